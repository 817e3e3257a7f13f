#include "seqpack/dynamic_batching.hpp"

#include <algorithm>
#include <limits>
#include <numeric>

namespace seqpack {
namespace {

constexpr const char* kFn = "plan_dynamic_batching";

// Greedy ranges exactly as NeMo-RL / ROLL build them.
std::vector<MicroBatchRange> greedy_ranges(const std::vector<int64_t>& padded, int64_t cap, int64_t initial_max) {
  std::vector<MicroBatchRange> ranges{{0, 0, 0}};
  int64_t running_max = initial_max;
  for (size_t j = 0; j < padded.size(); ++j) {
    const auto pos = static_cast<int64_t>(j);
    MicroBatchRange& cur = ranges.back();
    const int64_t rows = cur.end - cur.start + 1;
    running_max = std::max(running_max, padded[j]);
    if (running_max <= cap / rows) {  // rows * running_max <= cap, without overflow
      cur.end += 1;
      cur.length = running_max;
    } else {
      running_max = padded[j];
      ranges.push_back({pos, pos + 1, running_max});
    }
  }
  return ranges;
}

// Minimum padded tokens over contiguous ranges with rows * max <= cap, then the
// fewest ranges, with the count a multiple of `multiple`. O(n * w * multiple),
// w = the longest admissible range.
std::vector<MicroBatchRange> optimal_ranges(const std::vector<int64_t>& padded, int64_t cap, int64_t multiple) {
  const size_t n = padded.size();
  if (n == 0) return {};
  if (multiple > static_cast<int64_t>(n))  // a count of at least `multiple` ranges, each a row or more
    throw_invalid(kFn, "no plan has a micro-batch count that is a multiple of pp_size=" + std::to_string(multiple) +
                           " with only " + std::to_string(n) + " rows per shard");
  const auto m = static_cast<size_t>(multiple);
  constexpr int64_t kInf = std::numeric_limits<int64_t>::max();
  struct Cell {
    int64_t tokens = kInf, count = 0, prev = -1;
  };
  // cell[j * m + r]: best split of the first j rows into a count == r (mod m).
  std::vector<Cell> cell((n + 1) * m);
  cell[0] = {0, 0, -1};
  for (size_t j = 1; j <= n; ++j) {
    int64_t run_max = 0;
    for (size_t i = j; i-- > 0;) {
      run_max = std::max(run_max, padded[i]);
      const auto rows = static_cast<int64_t>(j - i);
      if (run_max > cap / rows) break;  // rows * run_max > cap, without overflow
      const int64_t cost = rows * run_max;
      for (size_t r = 0; r < m; ++r) {
        const Cell& from = cell[i * m + r];
        if (from.tokens == kInf) continue;
        Cell& to = cell[j * m + (r + 1) % m];
        int64_t t = 0;
        if (__builtin_add_overflow(from.tokens, cost, &t)) t = kInf;  // past any real plan
        const int64_t c = from.count + 1;
        if (t < to.tokens || (t == to.tokens && c < to.count)) to = {t, c, static_cast<int64_t>(i)};
      }
    }
  }
  if (cell[n * m].tokens == kInf)
    throw_invalid(kFn, "no plan has a micro-batch count that is a multiple of pp_size=" + std::to_string(multiple) +
                           " with only " + std::to_string(n) + " rows per shard");
  std::vector<MicroBatchRange> ranges;
  size_t j = n, r = 0;
  while (j > 0) {
    const Cell& c = cell[j * m + r];
    const auto i = static_cast<size_t>(c.prev);
    ranges.push_back({static_cast<int64_t>(i), static_cast<int64_t>(j),
                      *std::max_element(padded.begin() + static_cast<std::ptrdiff_t>(i),
                                        padded.begin() + static_cast<std::ptrdiff_t>(j))});
    j = i;
    r = (r + m - 1) % m;
  }
  std::reverse(ranges.begin(), ranges.end());
  return ranges;
}

}  // namespace

void split_ranges_to_multiple(std::vector<MicroBatchRange>& ranges, int64_t pp_size) {
  constexpr const char* fn = "split_ranges_to_multiple";
  check_positive(fn, "pp_size", pp_size);
  for (size_t i = 0; i < ranges.size(); ++i)
    if (ranges[i].end <= ranges[i].start || (i > 0 && ranges[i].start != ranges[i - 1].end))
      throw_invalid(fn, "ranges must be non-empty and contiguous");
  int64_t needed = round_up(fn, static_cast<int64_t>(ranges.size()), pp_size) - static_cast<int64_t>(ranges.size());
  for (; needed > 0; --needed) {
    size_t best = ranges.size();
    for (size_t i = 0; i < ranges.size(); ++i) {
      const int64_t rows = ranges[i].end - ranges[i].start;
      if (rows > 1 && (best == ranges.size() || rows > ranges[best].end - ranges[best].start)) best = i;
    }
    if (best == ranges.size())
      throw_invalid(fn, std::to_string(ranges.size()) + " micro-batches cannot be split into a multiple of pp_size=" +
                            std::to_string(pp_size) + ": there are not enough multi-sample ranges");
    const MicroBatchRange r = ranges[best];
    const int64_t mid = r.start + (r.end - r.start) / 2;
    ranges[best] = {r.start, mid, r.length};
    ranges.insert(ranges.begin() + static_cast<std::ptrdiff_t>(best) + 1, MicroBatchRange{mid, r.end, r.length});
  }
}

int64_t dynamic_batching_chunk(const DynamicBatchingOptions& o, int64_t n) {
  check_positive(kFn, "shards", o.shards);
  check_positive(kFn, "max_tokens_per_microbatch", o.max_tokens_per_microbatch);
  check_positive(kFn, "sequence_length_round", o.sequence_length_round);
  check_positive(kFn, "pp_size", o.pp_size);
  if (o.batch_size < 0) throw_invalid(kFn, "batch_size must be >= 0 (0: the whole batch)");
  if (o.max_seqlen < 0) throw_invalid(kFn, "max_seqlen must be >= 0 (0: no clamp)");
  const int64_t chunk = o.batch_size == 0 ? n : o.batch_size;
  if (chunk > 0 && n % chunk != 0)
    throw_invalid(kFn, "the number of sequences (" + std::to_string(n) + ") must be a multiple of batch_size (" +
                           std::to_string(chunk) + ")");
  if (chunk % o.shards != 0)
    throw_invalid(kFn, "batch_size (" + std::to_string(chunk) + ") must be a multiple of shards (" +
                           std::to_string(o.shards) + ")");
  return chunk;
}

DynamicBatchingPlan plan_dynamic_batching(Lengths lengths, const DynamicBatchingOptions& o, DynamicBatchingRule rule) {
  const auto n = static_cast<int64_t>(lengths.size());
  const int64_t chunk = dynamic_batching_chunk(o, n);
  check_non_negative_lengths(kFn, "lengths", lengths);
  if (rule == DynamicBatchingRule::NemoRL && o.max_seqlen > 0)
    check_lengths_fit(kFn, "lengths", lengths, o.max_seqlen, "max_seqlen");

  DynamicBatchingPlan plan;
  const int64_t num_chunks = chunk == 0 ? 0 : n / chunk;
  const int64_t per_shard = chunk / std::max<int64_t>(o.shards, 1);
  plan.shard_chunk_size = per_shard;
  // Sized only when there is a chunk (chunk <= n then): batch_size may be huge for n = 0.
  std::vector<int64_t> order(static_cast<size_t>(num_chunks > 0 ? chunk : 0));
  std::vector<int64_t> padded(static_cast<size_t>(num_chunks > 0 ? per_shard : 0));
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t base = c * chunk;
    std::iota(order.begin(), order.end(), base);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return lengths[a] < lengths[b]; });
    std::fill(padded.begin(), padded.end(), 0);
    // Sorted position p goes to shard p % shards as its row p / shards; the data
    // order is chunk by chunk, shard by shard within a chunk (as NeMo-RL's).
    for (int64_t s = 0; s < o.shards; ++s)
      for (int64_t p = s; p < chunk; p += o.shards) plan.sorted_indices.push_back(order[p]);
    for (int64_t p = 0; p < chunk; ++p)
      padded[p / o.shards] = std::max(padded[p / o.shards], lengths[order[p]]);
    for (int64_t j = 0; j < per_shard; ++j) {
      int64_t v = round_up(kFn, padded[j], o.sequence_length_round);
      if (rule == DynamicBatchingRule::NemoRL && o.max_seqlen > 0) v = std::min(v, o.max_seqlen);
      if (v > o.max_tokens_per_microbatch)
        throw_invalid(kFn, "a sequence padded to " + std::to_string(v) + " tokens (sequence_length_round=" +
                               std::to_string(o.sequence_length_round) + ") exceeds max_tokens_per_microbatch=" +
                               std::to_string(o.max_tokens_per_microbatch));
      padded[j] = v;
    }
    std::vector<MicroBatchRange> ranges;
    switch (rule) {
      case DynamicBatchingRule::NemoRL:
        ranges = greedy_ranges(padded, o.max_tokens_per_microbatch, 0);
        break;
      case DynamicBatchingRule::Roll:
        // ROLL starts every micro-batch's running maximum at sequence_length_round.
        if (o.max_tokens_per_microbatch < o.sequence_length_round)
          throw_invalid(kFn, "rule 'roll' needs max_tokens_per_microbatch (" +
                                 std::to_string(o.max_tokens_per_microbatch) + ") >= sequence_length_round (" +
                                 std::to_string(o.sequence_length_round) + ")");
        ranges = greedy_ranges(padded, o.max_tokens_per_microbatch, o.sequence_length_round);
        if (o.pp_size > 1) {
          if (o.pp_size > per_shard || round_up(kFn, static_cast<int64_t>(ranges.size()), o.pp_size) > per_shard)
            throw_invalid(kFn, "cannot split " + std::to_string(ranges.size()) +
                                   " micro-batches into a multiple of pp_size=" + std::to_string(o.pp_size) +
                                   " with only " + std::to_string(per_shard) + " sequences per shard");
          split_ranges_to_multiple(ranges, o.pp_size);
        }
        break;
      case DynamicBatchingRule::Optimal:
        ranges = optimal_ranges(padded, o.max_tokens_per_microbatch, o.pp_size);
        break;
    }
    for (const auto& r : ranges) {
      int64_t cell = 0;
      if (__builtin_mul_overflow(r.end - r.start, r.length, &cell) || __builtin_mul_overflow(cell, o.shards, &cell) ||
          __builtin_add_overflow(plan.padded_tokens, cell, &plan.padded_tokens))
        throw_invalid(kFn, "the padded token count (rows x padded length x shards) overflows int64");
    }
    plan.chunks.push_back(std::move(ranges));
  }
  plan.valid_tokens = checked_sum(kFn, "lengths (valid_tokens)", lengths);
  return plan;
}

}  // namespace seqpack
