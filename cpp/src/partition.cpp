#include "seqpack/partition.hpp"

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <queue>
#include <tuple>

namespace seqpack {
namespace {

void check_partition_args(const char* fn, Lengths values, int64_t k, bool equal_size) {
  if (k < 1) throw_invalid(fn, "k_partitions must be >= 1, got " + std::to_string(k));
  check_non_negative_lengths(fn, "seqlen_list", values);
  const auto n = static_cast<int64_t>(values.size());
  if (n < k)
    throw_invalid(fn, "number of items (" + std::to_string(n) + ") < k_partitions (" + std::to_string(k) +
                          "); every partition must be non-empty");
  if (equal_size && n % k != 0)
    throw_invalid(fn, "equal_size=True needs the number of items (" + std::to_string(n) +
                          ") to be a multiple of k_partitions (" + std::to_string(k) + ")");
  checked_sum(fn, "seqlen_list", values);  // every partial sum fits too
  if (n > static_cast<int64_t>(UINT32_MAX))
    throw_invalid(fn, "seqlen_list: at most 2^32 - 1 items, got " + std::to_string(n));
}

// One set of a KK state. Its items form an intrusive singly linked list that
// starts at `head` (the set's identity: merging appends another set's list, so
// the head, the first item, stays); the list's links and tails live in the
// solver, so a set is 16 bytes and states reorder them cheaply.
struct KKSet {
  int64_t sum = 0;
  uint32_t count = 0;
  uint32_t head = 0;
};

// verl's Set.__lt__ compares (sum, len(items), items); items of different sets are
// distinct indices, so for equal sums and counts the first items decide.
bool set_less(const KKSet& a, const KKSet& b) {
  if (a.sum != b.sum) return a.sum < b.sum;
  if (a.count != b.count) return a.count < b.count;
  return a.head < b.head;  // both non-empty here: empty sets are never stored
}

bool set_greater(const KKSet& a, const KKSet& b) { return set_less(b, a); }

// A state's non-empty sets in decreasing order; k - sets.size() empty sets follow.
struct KKState {
  std::vector<KKSet> sets;
  // Cached for the heap: the spread (largest sum minus the smallest, which is an
  // empty set's 0 while fewer than k are non-empty).
  int64_t spread = 0;
};

class KarmarkarKarp {
  static constexpr uint32_t kEnd = UINT32_MAX;

 public:
  KarmarkarKarp(Lengths values, int64_t k) : values_(values), k_(k), next_(values.size(), kEnd), tail_(values.size()) {
    std::iota(tail_.begin(), tail_.end(), 0u);
  }

  IndexGroups run(bool equal_size, bool sort_groups) {
    const size_t n = values_.size();
    std::vector<uint32_t> order(n);
    std::iota(order.begin(), order.end(), 0u);
    std::sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
      return values_[a] != values_[b] ? values_[a] < values_[b] : a < b;
    });
    const size_t step = equal_size ? static_cast<size_t>(k_) : 1;
    states_.reserve(n / step);
    heap_.reserve(n / step);
    for (size_t off = 0; off < n; off += step) {
      KKState s;
      for (size_t j = 0; j < step; ++j) {
        const uint32_t i = order[off + j];
        s.sets.push_back(KKSet{values_[i], 1, i});
      }
      std::sort(s.sets.begin(), s.sets.end(), set_greater);
      refresh(s);
      states_.push_back(std::move(s));
      heap_.push_back(entry(states_.size() - 1));
    }
    // Pop the two states with the largest spreads, merge the second into the
    // first, push it back. heapq gives the same sequence of pops: no two states
    // compare equal (their largest sets have distinct first items), so any correct
    // priority queue does. This one is 4-ary with the keys inline, and its
    // "pop b, push a" is one replace of the root.
    heapify();
    while (heap_.size() > 1) {
      const uint32_t a = pop();
      const uint32_t b = heap_[0].state;
      merge(states_[a], states_[b]);
      heap_[0] = entry(a);
      sift(0);
    }
    const KKState& final_state = states_[heap_[0].state];
    IndexGroups out;
    std::vector<int64_t> group;
    for (const KKSet& set : final_state.sets) {
      group.clear();
      for (uint32_t i = set.head; i != kEnd; i = next_[i]) group.push_back(i);
      if (sort_groups) std::sort(group.begin(), group.end());
      out.push_group(group);
    }
    for (size_t g = final_state.sets.size(); g < static_cast<size_t>(k_); ++g) out.push_group({});
    return out;
  }

 private:
  void refresh(KKState& s) const {
    const int64_t smallest = static_cast<int64_t>(s.sets.size()) == k_ ? s.sets.back().sum : 0;
    s.spread = s.sets.front().sum - smallest;
  }

  // A heap entry: a state and its ordering key. verl's State.__lt__: the larger
  // spread comes first; on equal spreads, the state whose largest set is larger.
  struct Entry {
    int64_t spread;
    KKSet top;
    uint32_t state;
  };
  static bool before(const Entry& x, const Entry& y) {
    if (x.spread != y.spread) return x.spread > y.spread;
    return set_less(y.top, x.top);
  }
  Entry entry(size_t state) const {
    return Entry{states_[state].spread, states_[state].sets.front(), static_cast<uint32_t>(state)};
  }
  void sift(size_t pos) {
    const Entry item = heap_[pos];
    const size_t n = heap_.size();
    for (;;) {
      const size_t first = 4 * pos + 1;
      if (first >= n) break;
      size_t best = first;
      for (size_t c = first + 1; c < std::min(first + 4, n); ++c)
        if (before(heap_[c], heap_[best])) best = c;
      if (!before(heap_[best], item)) break;
      heap_[pos] = heap_[best];
      pos = best;
    }
    heap_[pos] = item;
  }
  void heapify() {
    if (heap_.size() < 2) return;
    for (size_t pos = (heap_.size() - 2) / 4 + 1; pos-- > 0;) sift(pos);
  }
  uint32_t pop() {
    const uint32_t top = heap_[0].state;
    heap_[0] = heap_.back();
    heap_.pop_back();
    if (!heap_.empty()) sift(0);
    return top;
  }

  // verl's merge: self.sets[i].merge(other.sets[k-1-i]) for every i (a's items
  // first), then a descending sort. Only the pairs where both sets are non-empty
  // change - a's smallest o = na + nb - k with b's smallest - so the result is the
  // unchanged prefixes of a and b plus those o sums: the fewer sets are inserted
  // into the longer run, which costs O(fewer · log k) comparisons.
  void merge(KKState& a, KKState& b) {
    const auto na = static_cast<int64_t>(a.sets.size()), nb = static_cast<int64_t>(b.sets.size());
    const int64_t o = std::max<int64_t>(0, na + nb - k_);
    std::vector<KKSet>& changed = scratch_;
    changed.clear();
    for (int64_t t = 0; t < o; ++t) {
      const KKSet& x = a.sets[static_cast<size_t>(k_ - nb + t)];
      const KKSet& y = b.sets[static_cast<size_t>(nb - 1 - t)];
      next_[tail_[x.head]] = y.head;
      tail_[x.head] = tail_[y.head];
      changed.push_back(KKSet{x.sum + y.sum, x.count + y.count, x.head});
    }
    a.sets.resize(static_cast<size_t>(na - o));
    b.sets.resize(static_cast<size_t>(nb - o));
    const bool a_longer = a.sets.size() >= b.sets.size();
    std::vector<KKSet>& base = a_longer ? a.sets : b.sets;
    std::vector<KKSet>& other = a_longer ? b.sets : a.sets;
    other.insert(other.end(), changed.begin(), changed.end());
    std::sort(other.begin(), other.end(), set_greater);
    if (other.size() * 16 <= base.size()) {
      for (const KKSet& set : other) base.insert(std::upper_bound(base.begin(), base.end(), set, set_greater), set);
    } else {
      const size_t mid = base.size();
      base.insert(base.end(), other.begin(), other.end());
      std::inplace_merge(base.begin(), base.begin() + static_cast<std::ptrdiff_t>(mid), base.end(), set_greater);
    }
    if (!a_longer) a.sets.swap(base);
    b.sets.clear();
    b.sets.shrink_to_fit();
    refresh(a);
  }

  Lengths values_;
  int64_t k_;
  std::vector<uint32_t> next_;  // next item of the same set, kEnd after the last
  std::vector<uint32_t> tail_;  // last item of the set headed by an item
  std::vector<KKState> states_;
  std::vector<Entry> heap_;
  std::vector<KKSet> scratch_;
};

}  // namespace

IndexGroups karmarkar_karp(Lengths values, int64_t k, bool equal_size, bool sort_groups) {
  check_partition_args("karmarkar_karp", values, k, equal_size);
  return KarmarkarKarp(values, k).run(equal_size, sort_groups);
}

IndexGroups greedy_lpt_partition(Lengths values, int64_t k, bool equal_size) {
  check_partition_args("greedy_lpt_partition", values, k, equal_size);
  const size_t n = values.size();
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return values[a] != values[b] ? values[a] > values[b] : a < b;
  });
  const int64_t per_group = equal_size ? static_cast<int64_t>(n) / k : static_cast<int64_t>(n);
  // (sum, non-empty, group): among the lightest groups an empty one comes first,
  // so zero-valued items cannot leave a group empty (n >= k is checked above).
  using Entry = std::tuple<int64_t, int, int64_t>;
  std::priority_queue<Entry, std::vector<Entry>, std::greater<>> heap;
  for (int64_t g = 0; g < k; ++g) heap.push({0, 0, g});
  std::vector<std::vector<int64_t>> groups(static_cast<size_t>(k));
  for (int64_t item : order) {
    auto [sum, non_empty, g] = heap.top();
    heap.pop();
    groups[g].push_back(item);
    if (static_cast<int64_t>(groups[g].size()) < per_group) heap.push({sum + values[item], 1, g});
  }
  for (auto& g : groups) std::sort(g.begin(), g.end());
  return IndexGroups::from_nested(groups);
}

IndexGroups sorted_stride_partition(Lengths values, int64_t k) {
  check_partition_args("sorted_stride_partition", values, k, false);
  const size_t n = values.size();
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return values[a] < values[b]; });
  IndexGroups out;
  std::vector<int64_t> group;
  for (int64_t g = 0; g < k; ++g) {
    group.clear();
    for (size_t p = static_cast<size_t>(g); p < n; p += static_cast<size_t>(k)) group.push_back(order[p]);
    out.push_group(group);
  }
  return out;
}

}  // namespace seqpack
