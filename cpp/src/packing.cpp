#include "seqpack/packing.hpp"

#include "bin_structures.hpp"

#include <algorithm>
#include <cctype>
#include <limits>
#include <numeric>
#include <set>
#include <tuple>
#include <utility>

namespace seqpack {
namespace {

using detail::Buffer;

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
  IndexGroups finish(const Buffer<int64_t>& order = {}) const {
    IndexGroups out;
    Buffer<int64_t> counts(static_cast<size_t>(num_bins_), 0);
    for (int64_t b : bin_of_) ++counts[static_cast<size_t>(b)];
    Buffer<int64_t> slot_of_bin(static_cast<size_t>(num_bins_));
    std::iota(slot_of_bin.begin(), slot_of_bin.end(), 0);
    if (!order.empty()) slot_of_bin = order;
    Buffer<int64_t> bin_at_slot(static_cast<size_t>(num_bins_));
    for (int64_t b = 0; b < num_bins_; ++b) bin_at_slot[static_cast<size_t>(slot_of_bin[b])] = b;
    out.offsets.assign(static_cast<size_t>(num_bins_) + 1, 0);
    for (int64_t s = 0; s < num_bins_; ++s)
      out.offsets[s + 1] = out.offsets[s] + counts[static_cast<size_t>(bin_at_slot[s])];
    out.indices.resize(item_of_.size());
    Buffer<int64_t> cursor(static_cast<size_t>(num_bins_));
    for (int64_t b = 0; b < num_bins_; ++b) cursor[b] = out.offsets[slot_of_bin[b]];
    for (size_t k = 0; k < item_of_.size(); ++k) out.indices[cursor[bin_of_[k]]++] = item_of_[k];
    return out;
  }

 private:
  Buffer<int64_t> bin_of_, item_of_;
  int64_t num_bins_ = 0;
};

void check_common(const char* fn, Lengths lengths, int64_t capacity) {
  check_positive(fn, "bin_capacity", capacity);
  check_non_negative_lengths(fn, "sequence_lengths", lengths);
  check_lengths_fit(fn, "sequence_lengths", lengths, capacity, "bin_capacity");
}

// Item indices sorted by (length, index) descending, as Python's
// `sorted([(l, i) ...], reverse=True)` orders them.
Buffer<int64_t> decreasing_order(Lengths lengths) { return detail::order_by_length(lengths, true, true); }

template <typename Value>
IndexGroups first_fit_with(Lengths lengths, int64_t capacity, const Buffer<int64_t>& order, int64_t bound) {
  // Expect about the L1 bound of bins; the tree grows if first fit needs more.
  detail::GapTree<Value> tree(static_cast<size_t>(std::min<int64_t>(bound + bound / 8 + 16,
                                                                    static_cast<int64_t>(lengths.size()) + 1)),
                              capacity);
  BinBuilder builder(lengths.size());
  for (int64_t item : order) {
    const int64_t len = lengths[item];
    const int64_t bin = tree.leftmost_at_least(len);
    tree.set(bin, tree.get(bin) - len);
    builder.place(bin, item);
  }
  return builder.finish();
}

// First fit of items in non-increasing length order with a small capacity: the
// bins with room for the current length ("open") in an occupancy bitset, so the
// leftmost is one next-set-bit query; the others wait in a bucket per room. As the
// length only falls, a bucket joins the open set once the length reaches its room,
// and a bin leaves it when its room drops below the length: O(n + capacity) moves
// and O(log64 bins) per item. The same bins as the max-tree's first fit.
IndexGroups first_fit_decreasing_dense(Lengths lengths, int64_t capacity, const Buffer<int64_t>& order) {
  const size_t n = lengths.size();
  detail::NextSetBit open(static_cast<int64_t>(n) + 1);
  Buffer<int64_t> room(n + 1), head(static_cast<size_t>(capacity) + 1, -1), next_in_bucket(n + 1);
  BinBuilder builder(n);
  int64_t bins = 0, level = capacity + 1;  // every bin with room >= level is open
  for (int64_t item : order) {
    const int64_t len = lengths[item];
    for (; level > len; --level) {  // rooms in [len, level) open now
      for (int64_t b = head[static_cast<size_t>(level - 1)]; b >= 0; b = next_in_bucket[static_cast<size_t>(b)])
        open.insert(b);
      head[static_cast<size_t>(level - 1)] = -1;
    }
    int64_t bin = open.next(0);
    if (bin < 0) {
      bin = bins++;
      room[static_cast<size_t>(bin)] = capacity;
      open.insert(bin);
    }
    const int64_t left = room[static_cast<size_t>(bin)] -= len;
    if (left < len) {  // closed until the length falls to its room
      open.erase(bin);
      next_in_bucket[static_cast<size_t>(bin)] = head[static_cast<size_t>(left)];
      head[static_cast<size_t>(left)] = bin;
    }
    builder.place(bin, item);
  }
  return builder.finish();
}

IndexGroups first_fit_in_order(const char* fn, Lengths lengths, int64_t capacity, const Buffer<int64_t>& order) {
  const int64_t bound = ceil_div(checked_sum(fn, "sequence_lengths", lengths), capacity);
  if (capacity <= std::numeric_limits<int32_t>::max())
    return first_fit_with<int32_t>(lengths, capacity, order, bound);
  return first_fit_with<int64_t>(lengths, capacity, order, bound);
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
    const bool full = lengths[i] > bin_capacity - load ||  // load <= bin_capacity: no overflow
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
  if (bin_capacity <= detail::kDenseValueLimit && static_cast<size_t>(bin_capacity) <= 16 * lengths.size() + 1024) {
    checked_sum("first_fit_decreasing", "sequence_lengths", lengths);
    return first_fit_decreasing_dense(lengths, bin_capacity, decreasing_order(lengths));
  }
  return first_fit_in_order("first_fit_decreasing", lengths, bin_capacity, decreasing_order(lengths));
}

IndexGroups first_fit_shuffle(Lengths lengths, int64_t bin_capacity, uint64_t seed) {
  check_common("first_fit_shuffle", lengths, bin_capacity);
  Buffer<int64_t> order(lengths.size());
  std::iota(order.begin(), order.end(), 0);
  Rng rng(seed);
  for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[rng.below(i)]);
  return first_fit_in_order("first_fit_shuffle", lengths, bin_capacity, order);
}

IndexGroups best_fit_decreasing(Lengths lengths, int64_t bin_capacity) {
  check_common("best_fit_decreasing", lengths, bin_capacity);
  const Buffer<int64_t> order = decreasing_order(lengths);
  BinBuilder builder(lengths.size());
  int64_t num_bins = 0;
  if (bin_capacity <= detail::kDenseValueLimit) {
    // Bins bucketed by remaining capacity (a stack per value, so ties go to the
    // bin that reached that gap most recently) and a hierarchical bitset of the
    // non-empty buckets: the tightest fit is the next set value >= length.
    detail::NextSetBit gaps(bin_capacity + 1);
    Buffer<int64_t> head(static_cast<size_t>(bin_capacity) + 1, -1), below(lengths.size(), -1);
    for (int64_t item : order) {
      const int64_t len = lengths[item];
      const int64_t gap = gaps.next(len);
      int64_t bin, remaining;
      if (gap < 0) {
        bin = num_bins++;
        remaining = bin_capacity - len;
      } else {
        bin = head[gap];
        head[gap] = below[bin];
        if (head[gap] < 0) gaps.erase(gap);
        remaining = gap - len;
      }
      if (head[remaining] < 0) gaps.insert(remaining);
      below[bin] = head[remaining];
      head[remaining] = bin;
      builder.place(bin, item);
    }
    return builder.finish();
  }
  // Large capacities: the same rule on an ordered set keyed by
  // (remaining, -last update), so ties also go to the most recently updated bin.
  std::set<std::tuple<int64_t, int64_t, int64_t>> open;
  int64_t stamp = 0;
  for (int64_t item : order) {
    const int64_t len = lengths[item];
    auto it = open.lower_bound({len, std::numeric_limits<int64_t>::min(), 0});
    int64_t bin, remaining;
    if (it == open.end()) {
      bin = num_bins++;
      remaining = bin_capacity - len;
    } else {
      bin = std::get<2>(*it);
      remaining = std::get<0>(*it) - len;
      open.erase(it);
    }
    open.emplace(remaining, -(++stamp), bin);
    builder.place(bin, item);
  }
  return builder.finish();
}

namespace {

// One batch of best_fit_decreasing_fifo: items[begin, end) placed into bins
// numbered from `first_bin`; returns the next free bin number.
int64_t bfd_fifo_batch(Lengths lengths, int64_t begin, int64_t end, int64_t capacity, int64_t first_bin,
                       BinBuilder& builder) {
  Buffer<int64_t> order(static_cast<size_t>(end - begin));
  std::iota(order.begin(), order.end(), begin);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return lengths[a] > lengths[b]; });
  int64_t next_bin = first_bin;
  if (capacity <= detail::kDenseValueLimit) {
    // Open bins keyed by remaining space, first come first served per key: a
    // pushed stamp names the bin that got that space at that time.
    detail::BucketQueue open(capacity + 1);
    Buffer<int64_t> bin_of_stamp;
    bin_of_stamp.reserve(order.size());
    for (int64_t item : order) {
      const int64_t len = lengths[item];
      auto [space, stamp] = open.first_at_least(len);
      int64_t bin;
      if (space < 0) {
        bin = next_bin++;
        space = capacity;
      } else {
        bin = bin_of_stamp[static_cast<size_t>(stamp)];
        open.pop(space);
      }
      builder.place(bin, item);
      bin_of_stamp.push_back(bin);
      open.push(space - len, static_cast<int64_t>(bin_of_stamp.size()) - 1);
    }
    return next_bin;
  }
  // Large capacities: the same rule on an ordered set keyed by (remaining, stamp).
  std::set<std::tuple<int64_t, int64_t, int64_t>> open;
  int64_t stamp = 0;
  for (int64_t item : order) {
    const int64_t len = lengths[item];
    auto it = open.lower_bound({len, std::numeric_limits<int64_t>::min(), 0});
    int64_t bin, space;
    if (it == open.end()) {
      bin = next_bin++;
      space = capacity;
    } else {
      std::tie(space, std::ignore, bin) = *it;
      open.erase(it);
    }
    builder.place(bin, item);
    open.emplace(space - len, stamp++, bin);
  }
  return next_bin;
}

}  // namespace

IndexGroups best_fit_decreasing_fifo(Lengths lengths, int64_t bin_capacity, Lengths batch_bounds) {
  const char* fn = "best_fit_decreasing_fifo";
  check_positive(fn, "bin_capacity", bin_capacity);
  check_positive_lengths(fn, "sequence_lengths", lengths);
  check_lengths_fit(fn, "sequence_lengths", lengths, bin_capacity, "bin_capacity");
  const auto n = static_cast<int64_t>(lengths.size());
  const std::vector<int64_t> whole{0, n};
  if (batch_bounds.empty()) batch_bounds = whole;
  if (batch_bounds.front() != 0 || batch_bounds.back() != n)
    throw_invalid(fn, "batch_bounds must start at 0 and end at the number of sequences (" + std::to_string(n) + ")");
  for (size_t b = 1; b < batch_bounds.size(); ++b)
    if (batch_bounds[b] < batch_bounds[b - 1])
      throw_invalid(fn, "batch_bounds must never decrease (entry " + std::to_string(b) + ")");
  BinBuilder builder(lengths.size());
  int64_t bins = 0;
  for (size_t b = 1; b < batch_bounds.size(); ++b)
    bins = bfd_fifo_batch(lengths, batch_bounds[b - 1], batch_bounds[b], bin_capacity, bins, builder);
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
  enum Class : char { kLarge, kMedium, kSmall, kTiny };
  auto class_of = [&](int64_t s) { return 2 * s > C ? kLarge : 3 * s > C ? kMedium : 6 * s > C ? kSmall : kTiny; };
  Buffer<char> cls(n);
  for (size_t i = 0; i < n; ++i) cls[i] = class_of(lengths[i]);
  // NeMo-RL sorts its class lists stably: large and medium by size descending,
  // small by size ascending, ties in index order.
  const Buffer<int64_t> desc = detail::order_by_length(lengths, true, false);
  const Buffer<int64_t> asc = detail::order_by_length(lengths, false, false);
  auto filter = [&](const Buffer<int64_t>& order, auto keep) {
    Buffer<int64_t> out;
    out.reserve(static_cast<size_t>(std::count_if(order.begin(), order.end(), keep)));
    for (int64_t i : order)
      if (keep(i)) out.push_back(i);
    return out;
  };
  const Buffer<int64_t> large = filter(desc, [&](int64_t i) { return cls[i] == kLarge; });
  detail::LivePool medium(filter(desc, [&](int64_t i) { return cls[i] == kMedium; }));
  detail::LivePool small(filter(asc, [&](int64_t i) { return cls[i] == kSmall; }));
  Buffer<char> placed(n, 0);
  // First position in `pool` (sorted by size, descending or ascending) whose size
  // is <= bound (descending) or > bound (ascending).
  auto first_desc_at_most = [&](detail::LivePool& pool, int64_t bound) {
    size_t lo = 0, hi = pool.size();
    while (lo < hi) {
      const size_t mid = (lo + hi) / 2;
      if (lengths[pool.item(mid)] > bound) lo = mid + 1; else hi = mid;
    }
    return lo;
  };
  auto first_asc_above = [&](detail::LivePool& pool, int64_t bound) {
    size_t lo = 0, hi = pool.size();
    while (lo < hi) {
      const size_t mid = (lo + hi) / 2;
      if (lengths[pool.item(mid)] <= bound) lo = mid + 1; else hi = mid;
    }
    return lo;
  };

  // Phase 1: one bin per large item.
  const size_t num_large = large.size();
  Buffer<int64_t> load(num_large);
  Buffer<char> has_medium(num_large, 0);
  BinBuilder builder(n);
  auto put = [&](size_t bin, int64_t item) {
    builder.place(static_cast<int64_t>(bin), item);
    placed[item] = 1;
  };
  for (size_t b = 0; b < num_large; ++b) {
    load[b] = lengths[large[b]];
    put(b, large[b]);
  }
  // Phase 2 (forward): the first medium item (largest) that fits, per large bin.
  for (size_t b = 0; b < num_large && medium.live() > 0; ++b) {
    const size_t pos = medium.first_from(first_desc_at_most(medium, C - load[b]));
    if (pos == medium.size()) continue;
    const int64_t item = medium.item(pos);
    medium.remove(pos);
    load[b] += lengths[item];
    has_medium[b] = 1;
    put(b, item);
  }
  // Phase 3 (backward): into bins without a medium item, the smallest small item
  // plus the largest small item that still fits (ties: the later one).
  for (size_t r = num_large; r-- > 0;) {
    if (has_medium[r] || small.live() < 2) continue;
    const int64_t room = C - load[r];
    const size_t first = small.first_from(0);
    const size_t second = small.first_from(first + 1);
    const int64_t a = small.item(first);
    if (lengths[a] + lengths[small.item(second)] > room) continue;
    small.remove(first);
    const int64_t pos = small.last_upto(static_cast<int64_t>(first_asc_above(small, room - lengths[a])) - 1);
    const int64_t c = small.item(static_cast<size_t>(pos));
    small.remove(static_cast<size_t>(pos));
    load[r] += lengths[a] + lengths[c];
    put(r, a);
    put(r, c);
  }
  // Phase 4 (forward): every remaining item, largest first; each bin takes the
  // largest that fits until even the smallest does not.
  detail::LivePool rest(filter(desc, [&](int64_t i) { return !placed[i]; }));
  for (size_t b = 0; b < num_large && rest.live() > 0; ++b) {
    while (rest.live() > 0) {
      const int64_t room = C - load[b];
      const int64_t smallest = rest.item(static_cast<size_t>(rest.last_upto(static_cast<int64_t>(rest.size()) - 1)));
      if (room < lengths[smallest]) break;
      const size_t pos = rest.first_from(first_desc_at_most(rest, room));
      const int64_t item = rest.item(pos);
      rest.remove(pos);
      load[b] += lengths[item];
      put(b, item);
    }
  }
  // Phase 5: leftovers (largest first) go into the least-filled leftover bin when
  // they fit, else into a new bin; bins stay ordered by (load, insertion), which
  // is the order NeMo-RL's bisect-maintained list ends in. Stamp 0 is its initial
  // empty bin, which the first leftover always fills.
  Buffer<int64_t> bin_of_stamp{-1};
  int64_t next_bin = static_cast<int64_t>(num_large);
  Buffer<int64_t> order(num_large);
  std::iota(order.begin(), order.end(), 0);
  auto leftover_phase = [&](auto& queue) {
    queue.push(0, 0);
    for (size_t pos = rest.first_from(0); pos < rest.size(); pos = rest.first_from(pos + 1)) {
      const int64_t item = rest.item(pos);
      const int64_t size = lengths[item];
      const auto [least, least_stamp] = queue.top();
      const auto stamp = static_cast<int64_t>(bin_of_stamp.size());
      if (size <= C - least) {
        int64_t bin = bin_of_stamp[static_cast<size_t>(least_stamp)];
        if (bin < 0) bin = next_bin++;
        builder.place(bin, item);
        bin_of_stamp.push_back(bin);
        queue.pop();
        queue.push(least + size, stamp);
      } else {
        builder.place(next_bin, item);
        bin_of_stamp.push_back(next_bin++);
        queue.push(size, stamp);
      }
    }
    // Output order: the large bins, then leftover bins by (load, stamp); an unused
    // initial empty bin is dropped.
    order.resize(static_cast<size_t>(next_bin));
    int64_t slot = static_cast<int64_t>(num_large);
    while (!queue.empty()) {
      const int64_t bin = bin_of_stamp[static_cast<size_t>(queue.top().second)];
      queue.pop();
      if (bin >= 0) order[static_cast<size_t>(bin)] = slot++;
    }
  };
  if (C <= detail::kDenseValueLimit) {
    detail::BucketQueue queue(C + 1);
    leftover_phase(queue);
  } else {
    detail::MinHeapQueue queue;
    leftover_phase(queue);
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
  target = checked_mul(fn, "the bin count rounded up to bin_count_multiple", ceil_div(target, bin_count_multiple),
                       bin_count_multiple);
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
