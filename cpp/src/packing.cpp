#include "seqpack/packing.hpp"

#include <algorithm>
#include <cctype>
#include <limits>
#include <numeric>
#include <queue>
#include <set>
#include <utility>

namespace seqpack {
namespace {

constexpr const char* kAlgorithmNames[] = {
    "concatenative",          "first_fit_decreasing", "first_fit_shuffle",
    "modified_first_fit_decreasing", "best_fit_decreasing", "greedy_sequential",
};

// Records (bin, item) placements in processing order and turns them into CSR with
// the items of each bin in the order they were placed.
class BinBuilder {
 public:
  explicit BinBuilder(size_t n) { bin_of_.reserve(n); item_of_.reserve(n); }
  void place(int64_t bin, int64_t item) {
    bin_of_.push_back(bin);
    item_of_.push_back(item);
    num_bins_ = std::max(num_bins_, bin + 1);
  }
  // `order[b]` gives the output position of bin b (identity when empty).
  IndexGroups finish(const std::vector<int64_t>& order = {}) const {
    IndexGroups out;
    std::vector<int64_t> counts(static_cast<size_t>(num_bins_), 0);
    for (int64_t b : bin_of_) ++counts[static_cast<size_t>(b)];
    std::vector<int64_t> slot_of_bin(static_cast<size_t>(num_bins_));
    std::iota(slot_of_bin.begin(), slot_of_bin.end(), 0);
    if (!order.empty()) slot_of_bin = order;
    std::vector<int64_t> bin_at_slot(static_cast<size_t>(num_bins_));
    for (int64_t b = 0; b < num_bins_; ++b) bin_at_slot[static_cast<size_t>(slot_of_bin[b])] = b;
    out.offsets.assign(static_cast<size_t>(num_bins_) + 1, 0);
    for (int64_t s = 0; s < num_bins_; ++s)
      out.offsets[s + 1] = out.offsets[s] + counts[static_cast<size_t>(bin_at_slot[s])];
    out.indices.resize(item_of_.size());
    std::vector<int64_t> cursor(static_cast<size_t>(num_bins_));
    for (int64_t b = 0; b < num_bins_; ++b) cursor[b] = out.offsets[slot_of_bin[b]];
    for (size_t k = 0; k < item_of_.size(); ++k) out.indices[cursor[bin_of_[k]]++] = item_of_[k];
    return out;
  }

 private:
  std::vector<int64_t> bin_of_, item_of_;
  int64_t num_bins_ = 0;
};

// Max segment tree over n bins' remaining capacities; unopened bins hold the full
// capacity, so "leftmost bin with room >= x" is first fit including opening a new bin.
class GapTree {
 public:
  GapTree(size_t n, int64_t capacity) {
    size_ = 1;
    while (size_ < std::max<size_t>(n, 1)) size_ <<= 1;
    tree_.assign(2 * size_, -1);
    for (size_t i = 0; i < n; ++i) tree_[size_ + i] = capacity;
    for (size_t i = size_ - 1; i >= 1; --i) tree_[i] = std::max(tree_[2 * i], tree_[2 * i + 1]);
  }
  int64_t leftmost_at_least(int64_t x) const {
    if (tree_[1] < x) return -1;
    size_t i = 1;
    while (i < size_) i = tree_[2 * i] >= x ? 2 * i : 2 * i + 1;
    return static_cast<int64_t>(i - size_);
  }
  int64_t get(int64_t pos) const { return tree_[size_ + pos]; }
  void set(int64_t pos, int64_t value) {
    size_t i = size_ + static_cast<size_t>(pos);
    tree_[i] = value;
    for (i >>= 1; i >= 1; i >>= 1) tree_[i] = std::max(tree_[2 * i], tree_[2 * i + 1]);
  }

 private:
  size_t size_;
  std::vector<int64_t> tree_;
};

void check_common(const char* fn, Lengths lengths, int64_t capacity) {
  check_positive(fn, "bin_capacity", capacity);
  check_non_negative_lengths(fn, "sequence_lengths", lengths);
  check_lengths_fit(fn, "sequence_lengths", lengths, capacity, "bin_capacity");
}

// Item indices sorted by (length, index) descending, as Python's
// `sorted([(l, i) ...], reverse=True)` orders them.
std::vector<int64_t> decreasing_order(Lengths lengths) {
  std::vector<int64_t> order(lengths.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return lengths[a] != lengths[b] ? lengths[a] > lengths[b] : a > b;
  });
  return order;
}

IndexGroups first_fit_in_order(Lengths lengths, int64_t capacity, const std::vector<int64_t>& order) {
  GapTree tree(lengths.size(), capacity);
  BinBuilder builder(lengths.size());
  for (int64_t item : order) {
    const int64_t len = lengths[item];
    const int64_t bin = tree.leftmost_at_least(len);
    tree.set(bin, tree.get(bin) - len);
    builder.place(bin, item);
  }
  return builder.finish();
}

}  // namespace

const char* algorithm_name(PackingAlgorithm algorithm) {
  return kAlgorithmNames[static_cast<int>(algorithm)];
}

std::vector<PackingAlgorithm> all_algorithms() {
  return {PackingAlgorithm::Concatenative,          PackingAlgorithm::FirstFitDecreasing,
          PackingAlgorithm::FirstFitShuffle,        PackingAlgorithm::ModifiedFirstFitDecreasing,
          PackingAlgorithm::BestFitDecreasing,      PackingAlgorithm::GreedySequential};
}

PackingAlgorithm parse_algorithm(std::string_view name) {
  std::string lower(name);
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (PackingAlgorithm a : all_algorithms())
    if (lower == algorithm_name(a)) return a;
  std::string valid;
  for (PackingAlgorithm a : all_algorithms()) valid += std::string(valid.empty() ? "" : ", ") + algorithm_name(a);
  throw_invalid("get_packer", "algorithm: unknown packing algorithm '" + std::string(name) +
                                  "'; valid algorithms: " + valid);
}

IndexGroups concatenative(Lengths lengths, int64_t bin_capacity, int64_t max_sequences_per_bin) {
  check_common("concatenative", lengths, bin_capacity);
  if (max_sequences_per_bin == 0 || max_sequences_per_bin < -1)
    throw_invalid("concatenative", "max_sequences_per_bin must be -1 (no limit) or positive, got " +
                                       std::to_string(max_sequences_per_bin));
  IndexGroups out;
  out.indices.resize(lengths.size());
  std::iota(out.indices.begin(), out.indices.end(), 0);
  int64_t load = 0, count = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    const bool full = load + lengths[i] > bin_capacity ||
                      (max_sequences_per_bin != -1 && count >= max_sequences_per_bin);
    if (full && count > 0) {
      out.offsets.push_back(static_cast<int64_t>(i));
      load = 0;
      count = 0;
    }
    load += lengths[i];
    ++count;
  }
  if (count > 0) out.offsets.push_back(static_cast<int64_t>(lengths.size()));
  return out;
}

IndexGroups greedy_sequential(Lengths lengths, int64_t bin_capacity, int64_t max_sequences_per_bin) {
  return concatenative(lengths, bin_capacity, max_sequences_per_bin);
}

IndexGroups first_fit_decreasing(Lengths lengths, int64_t bin_capacity) {
  check_common("first_fit_decreasing", lengths, bin_capacity);
  return first_fit_in_order(lengths, bin_capacity, decreasing_order(lengths));
}

IndexGroups first_fit_shuffle(Lengths lengths, int64_t bin_capacity, uint64_t seed) {
  check_common("first_fit_shuffle", lengths, bin_capacity);
  std::vector<int64_t> order(lengths.size());
  std::iota(order.begin(), order.end(), 0);
  Rng rng(seed);
  for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[rng.below(i)]);
  return first_fit_in_order(lengths, bin_capacity, order);
}

IndexGroups best_fit_decreasing(Lengths lengths, int64_t bin_capacity) {
  check_common("best_fit_decreasing", lengths, bin_capacity);
  // Open bins keyed by (remaining capacity, bin index): lower_bound gives the
  // tightest fit and, among equal gaps, the lowest bin index.
  std::set<std::pair<int64_t, int64_t>> open;
  BinBuilder builder(lengths.size());
  int64_t num_bins = 0;
  for (int64_t item : decreasing_order(lengths)) {
    const int64_t len = lengths[item];
    auto it = open.lower_bound({len, std::numeric_limits<int64_t>::min()});
    int64_t bin, remaining;
    if (it == open.end()) {
      bin = num_bins++;
      remaining = bin_capacity - len;
    } else {
      bin = it->second;
      remaining = it->first - len;
      open.erase(it);
    }
    open.emplace_hint(open.end(), remaining, bin);
    builder.place(bin, item);
  }
  return builder.finish();
}

IndexGroups modified_first_fit_decreasing(Lengths lengths, int64_t bin_capacity) {
  const char* fn = "modified_first_fit_decreasing";
  check_positive(fn, "bin_capacity", bin_capacity);
  check_positive_lengths(fn, "sequence_lengths", lengths);
  check_lengths_fit(fn, "sequence_lengths", lengths, bin_capacity, "bin_capacity");
  if (bin_capacity > std::numeric_limits<int64_t>::max() / 6)
    throw_invalid(fn, "bin_capacity is too large (must be <= INT64_MAX / 6)");
  const int64_t C = bin_capacity;
  const size_t n = lengths.size();
  // Classes of Johnson & Garey: large (C/2, C], medium (C/3, C/2], small (C/6, C/3],
  // tiny (0, C/6]; compared exactly in integers (2s > C is s > C/2).
  auto is_large = [&](int64_t s) { return 2 * s > C; };
  auto is_medium = [&](int64_t s) { return !is_large(s) && 3 * s > C; };
  auto is_small = [&](int64_t s) { return 3 * s <= C && 6 * s > C; };

  // Phase 1: one bin per large item, by (size desc, index asc) (a stable sort).
  std::vector<int64_t> large;
  // Pools keyed so that begin() is the item NeMo-RL's list would try first.
  std::set<std::pair<int64_t, int64_t>> medium;  // (-size, index): first = largest
  std::set<std::pair<int64_t, int64_t>> small;   // (size, index): first = smallest
  std::set<std::pair<int64_t, int64_t>> rest;    // phase 4 pool: (-size, index)
  for (size_t i = 0; i < n; ++i) {
    const int64_t s = lengths[i];
    const auto idx = static_cast<int64_t>(i);
    if (is_large(s)) large.push_back(idx);
    else if (is_medium(s)) medium.emplace(-s, idx);
    else if (is_small(s)) small.emplace(s, idx);
    else rest.emplace(-s, idx);  // tiny items wait for phase 4
  }
  std::stable_sort(large.begin(), large.end(), [&](int64_t a, int64_t b) { return lengths[a] > lengths[b]; });
  const size_t num_large = large.size();
  std::vector<int64_t> load(num_large);
  std::vector<char> has_medium(num_large, 0);
  BinBuilder builder(n);
  for (size_t b = 0; b < num_large; ++b) {
    load[b] = lengths[large[b]];
    builder.place(static_cast<int64_t>(b), large[b]);
  }
  // Phase 2 (forward): the largest medium item that fits, per large bin.
  for (size_t b = 0; b < num_large && !medium.empty(); ++b) {
    auto it = medium.lower_bound({-(C - load[b]), std::numeric_limits<int64_t>::min()});
    if (it == medium.end()) continue;
    load[b] += -it->first;
    has_medium[b] = 1;
    builder.place(static_cast<int64_t>(b), it->second);
    medium.erase(it);
  }
  // Phase 3 (backward): into bins without a medium item, the smallest small item
  // plus the largest small item that still fits (ties: the later index).
  for (size_t r = num_large; r-- > 0;) {
    if (has_medium[r] || small.size() < 2) continue;
    const int64_t room = C - load[r];
    auto first = small.begin();
    if (first->first + std::next(first)->first > room) continue;
    const auto a = *first;
    small.erase(first);
    auto second = std::prev(small.upper_bound({room - a.first, std::numeric_limits<int64_t>::max()}));
    const auto c = *second;
    small.erase(second);
    load[r] += a.first + c.first;
    builder.place(static_cast<int64_t>(r), a.second);
    builder.place(static_cast<int64_t>(r), c.second);
  }
  // Phase 4 (forward): fill each bin greedily with the largest remaining item that fits.
  for (const auto& m : medium) rest.insert(m);
  for (const auto& s : small) rest.emplace(-s.first, s.second);
  for (size_t b = 0; b < num_large && !rest.empty(); ++b) {
    while (!rest.empty()) {
      const int64_t room = C - load[b];
      if (room < -std::prev(rest.end())->first) break;
      auto it = rest.lower_bound({-room, std::numeric_limits<int64_t>::min()});
      load[b] += -it->first;
      builder.place(static_cast<int64_t>(b), it->second);
      rest.erase(it);
    }
  }
  // Phase 5: leftovers (largest first) go into the least-filled leftover bin when
  // they fit, else into a new bin; bins stay ordered by (load, insertion), which
  // is the order NeMo-RL's bisect-maintained list ends in. Slot 0 is its initial
  // empty bin.
  using Entry = std::pair<int64_t, int64_t>;  // (load, insertion stamp)
  std::priority_queue<Entry, std::vector<Entry>, std::greater<>> heap;
  std::vector<int64_t> bin_of_stamp{-1};
  std::vector<std::pair<Entry, int64_t>> final_state;
  heap.push({0, 0});
  int64_t stamp = 0;
  int64_t next_bin = static_cast<int64_t>(num_large);
  for (const auto& [neg_size, item] : rest) {
    const int64_t size = -neg_size;
    Entry top = heap.top();
    int64_t bin;
    int64_t new_load;
    if (size <= C - top.first) {
      heap.pop();
      bin = bin_of_stamp[top.second];
      if (bin < 0) bin = next_bin++;  // first use of the initial empty bin
      new_load = top.first + size;
    } else {
      bin = next_bin++;
      new_load = size;
    }
    builder.place(bin, item);
    heap.push({new_load, ++stamp});
    bin_of_stamp.push_back(bin);
  }
  // Output order: the large bins, then leftover bins by (load, stamp); an unused
  // initial empty bin is dropped.
  std::vector<int64_t> order(static_cast<size_t>(next_bin));
  for (size_t b = 0; b < num_large; ++b) order[b] = static_cast<int64_t>(b);
  int64_t slot = static_cast<int64_t>(num_large);
  while (!heap.empty()) {
    const int64_t bin = bin_of_stamp[heap.top().second];
    heap.pop();
    if (bin >= 0) order[static_cast<size_t>(bin)] = slot++;
  }
  return builder.finish(order);
}

IndexGroups adjust_bin_count(const IndexGroups& bins, int64_t min_bin_count, int64_t bin_count_multiple) {
  const char* fn = "adjust_bin_count";
  if (min_bin_count < 0)
    throw_invalid(fn, "min_bin_count must be nonnegative, got " + std::to_string(min_bin_count));
  if (bin_count_multiple < 1)
    throw_invalid(fn, "bin_count_multiple must be positive, got " + std::to_string(bin_count_multiple));
  const auto current = static_cast<int64_t>(bins.size());
  int64_t target = std::max(current, min_bin_count);
  target = round_up(target, bin_count_multiple);
  if (target == current) return bins;
  const auto total = static_cast<int64_t>(bins.indices.size());
  if (total < target)
    throw_invalid(fn, "Cannot create " + std::to_string(target) + " bins with only " + std::to_string(total) +
                          " sequences (min_bin_count=" + std::to_string(min_bin_count) +
                          ", bin_count_multiple=" + std::to_string(bin_count_multiple) +
                          "); each bin must contain at least one sequence");
  auto nested = bins.to_nested();
  std::vector<std::pair<int64_t, int64_t>> by_size;  // (size, index) descending
  for (int64_t b = 0; b < current; ++b) by_size.emplace_back(static_cast<int64_t>(nested[b].size()), b);
  std::sort(by_size.begin(), by_size.end(), std::greater<>());
  size_t source = 0;
  for (int64_t added = current; added < target; ++added) {
    while (nested[by_size[source].second].size() <= 1) ++source;  // total >= target keeps this in range
    auto& from = nested[by_size[source].second];
    const int64_t moved = from.back();
    from.pop_back();
    nested.push_back({moved});  // may reallocate: `from` is not used after this
  }
  return IndexGroups::from_nested(nested);
}

IndexGroups pack(PackingAlgorithm algorithm, Lengths lengths, const PackOptions& o) {
  // Validate the count constraints before the (possibly long) packing.
  if (o.min_bin_count < 0)
    throw_invalid("get_packer", "min_bin_count must be nonnegative, got " + std::to_string(o.min_bin_count));
  if (o.bin_count_multiple < 1)
    throw_invalid("get_packer", "bin_count_multiple must be positive, got " + std::to_string(o.bin_count_multiple));
  IndexGroups bins;
  switch (algorithm) {
    case PackingAlgorithm::Concatenative:
      bins = concatenative(lengths, o.bin_capacity, o.max_sequences_per_bin);
      break;
    case PackingAlgorithm::GreedySequential:
      bins = greedy_sequential(lengths, o.bin_capacity, o.max_sequences_per_bin);
      break;
    case PackingAlgorithm::FirstFitDecreasing:
      bins = first_fit_decreasing(lengths, o.bin_capacity);
      break;
    case PackingAlgorithm::FirstFitShuffle:
      bins = first_fit_shuffle(lengths, o.bin_capacity, o.seed);
      break;
    case PackingAlgorithm::BestFitDecreasing:
      bins = best_fit_decreasing(lengths, o.bin_capacity);
      break;
    case PackingAlgorithm::ModifiedFirstFitDecreasing:
      bins = modified_first_fit_decreasing(lengths, o.bin_capacity);
      break;
  }
  return adjust_bin_count(bins, o.min_bin_count, o.bin_count_multiple);
}

}  // namespace seqpack
