#include "seqpack/partition.hpp"

#include <algorithm>
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
  int64_t total = 0;
  for (int64_t v : values) total = checked_add(fn, total, v);
}

// One set of a KK state: an intrusive singly linked list of item indices.
struct KKSet {
  int64_t sum = 0;
  int64_t count = 0;
  int64_t head = -1;
  int64_t tail = -1;
};

// verl's Set.__lt__ compares (sum, len(items), items); items of different sets are
// distinct indices, so for equal sums and counts the first items decide.
bool set_less(const KKSet& a, const KKSet& b) {
  if (a.sum != b.sum) return a.sum < b.sum;
  if (a.count != b.count) return a.count < b.count;
  return a.head < b.head;  // both non-empty here: empty sets are never stored
}

struct KKState {
  std::vector<KKSet> sets;  // non-empty sets, decreasing; k - sets.size() empty sets follow
};

class KarmarkarKarp {
 public:
  KarmarkarKarp(Lengths values, int64_t k) : values_(values), k_(k), next_(values.size(), -1) {}

  IndexGroups run(bool equal_size, bool sort_groups) {
    const size_t n = values_.size();
    std::vector<int64_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      return values_[a] != values_[b] ? values_[a] < values_[b] : a < b;
    });
    const size_t step = equal_size ? static_cast<size_t>(k_) : 1;
    states_.reserve(n / step);
    for (size_t off = 0; off < n; off += step) {
      KKState s;
      for (size_t j = 0; j < step; ++j) s.sets.push_back(singleton(order[off + j]));
      std::sort(s.sets.begin(), s.sets.end(), [](const KKSet& a, const KKSet& b) { return set_less(b, a); });
      states_.push_back(std::move(s));
      heap_push(static_cast<int64_t>(states_.size() - 1));
    }
    while (heap_.size() > 1) {
      const int64_t a = heap_pop();
      const int64_t b = heap_pop();
      merge(states_[a], states_[b]);
      heap_push(a);
    }
    const KKState& final_state = states_[heap_[0]];
    IndexGroups out;
    std::vector<int64_t> group;
    for (const KKSet& set : final_state.sets) {
      group.clear();
      for (int64_t i = set.head; i != -1; i = next_[i]) group.push_back(i);
      if (sort_groups) std::sort(group.begin(), group.end());
      out.push_group(group);
    }
    for (size_t g = final_state.sets.size(); g < static_cast<size_t>(k_); ++g) out.push_group({});
    return out;
  }

 private:
  KKSet singleton(int64_t item) { return KKSet{values_[item], 1, item, item}; }

  int64_t spread(const KKState& s) const {
    const int64_t smallest = static_cast<int64_t>(s.sets.size()) == k_ ? s.sets.back().sum : 0;
    return s.sets.front().sum - smallest;
  }

  // verl's State.__lt__: the larger spread is "smaller" (popped first); on equal
  // spreads, the state whose largest set is larger.
  bool state_less(int64_t a, int64_t b) const {
    const int64_t sa = spread(states_[a]), sb = spread(states_[b]);
    if (sa != sb) return sa > sb;
    return set_less(states_[b].sets.front(), states_[a].sets.front());
  }

  static KKSet concat(const KKSet& x, const KKSet& y, std::vector<int64_t>& next) {
    if (x.count == 0) return y;
    if (y.count == 0) return x;
    next[x.tail] = y.head;
    return KKSet{x.sum + y.sum, x.count + y.count, x.head, y.tail};
  }

  // self.sets[i].merge(other.sets[k-1-i]) for every i, then a descending sort.
  void merge(KKState& a, KKState& b) {
    const int64_t na = static_cast<int64_t>(a.sets.size()), nb = static_cast<int64_t>(b.sets.size());
    std::vector<KKSet> merged;
    merged.reserve(static_cast<size_t>(std::min(k_, na + nb)));
    const KKSet empty;
    for (int64_t i = 0; i < k_; ++i) {
      const int64_t j = k_ - 1 - i;
      const bool in_a = i < na, in_b = j < nb;
      if (!in_a && !in_b) {
        i = k_ - 1 - nb;  // skip the run of (empty, empty) pairs
        continue;
      }
      merged.push_back(concat(in_a ? a.sets[i] : empty, in_b ? b.sets[j] : empty, next_));
    }
    std::sort(merged.begin(), merged.end(), [](const KKSet& x, const KKSet& y) { return set_less(y, x); });
    a.sets = std::move(merged);
    b.sets.clear();
    b.sets.shrink_to_fit();
  }

  // heapq.heappush / heappop, transcribed so ties resolve exactly as in CPython.
  void sift_down(size_t start, size_t pos) {
    const int64_t item = heap_[pos];
    while (pos > start) {
      const size_t parent = (pos - 1) >> 1;
      if (state_less(item, heap_[parent])) {
        heap_[pos] = heap_[parent];
        pos = parent;
        continue;
      }
      break;
    }
    heap_[pos] = item;
  }
  void sift_up(size_t pos) {
    const size_t end = heap_.size(), start = pos;
    const int64_t item = heap_[pos];
    size_t child = 2 * pos + 1;
    while (child < end) {
      const size_t right = child + 1;
      if (right < end && !state_less(heap_[child], heap_[right])) child = right;
      heap_[pos] = heap_[child];
      pos = child;
      child = 2 * pos + 1;
    }
    heap_[pos] = item;
    sift_down(start, pos);
  }
  void heap_push(int64_t s) {
    heap_.push_back(s);
    sift_down(0, heap_.size() - 1);
  }
  int64_t heap_pop() {
    const int64_t last = heap_.back();
    heap_.pop_back();
    if (heap_.empty()) return last;
    const int64_t top = heap_[0];
    heap_[0] = last;
    sift_up(0);
    return top;
  }

  Lengths values_;
  int64_t k_;
  std::vector<int64_t> next_;
  std::vector<KKState> states_;
  std::vector<int64_t> heap_;
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
