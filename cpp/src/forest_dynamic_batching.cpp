// Dynamic batching over a prefix forest (forest_planning.hpp): rows to shards by
// trees, then one list of row ranges shared by every shard under a cap on physical
// tokens.
#include <algorithm>
#include <limits>
#include <numeric>
#include <string>
#include <utility>

#include "forest_packers.hpp"
#include "seqpack/forest_planning.hpp"

namespace seqpack {
namespace {

constexpr const char* kFn = "plan_dynamic_batching";

// One shard's rows of a chunk: positions in the order it runs them, and for each
// whether it continues the previous row's tree (so shares its lcp with it).
struct ShardRows {
  std::vector<int64_t> positions;
  std::vector<char> continues;
  int64_t load = 0;  // physical tokens
};

// Trees to shards with `per_shard` rows each (see the header).
std::vector<ShardRows> deal(const detail::ForestSubset& s, int64_t shards, int64_t per_shard) {
  const auto& starts = s.tree_starts();
  std::vector<std::vector<std::pair<int64_t, int64_t>>> parts(static_cast<size_t>(shards));  // runs per shard
  std::vector<int64_t> free(static_cast<size_t>(shards), per_shard), load(static_cast<size_t>(shards), 0);
  for (size_t t : detail::trees_by_size(s)) {
    int64_t begin = starts[t];
    const int64_t end = starts[t + 1];
    int64_t whole = -1;  // the least-loaded shard with room for the whole tree
    for (int64_t k = 0; k < shards; ++k)
      if (free[static_cast<size_t>(k)] >= end - begin &&
          (whole < 0 || load[static_cast<size_t>(k)] < load[static_cast<size_t>(whole)]))
        whole = k;
    while (begin < end) {
      int64_t k = whole;
      if (k < 0) {  // the shard with the most room (then the least load) takes the next rows
        k = 0;
        for (int64_t j = 1; j < shards; ++j)
          if (free[static_cast<size_t>(j)] > free[static_cast<size_t>(k)] ||
              (free[static_cast<size_t>(j)] == free[static_cast<size_t>(k)] &&
               load[static_cast<size_t>(j)] < load[static_cast<size_t>(k)]))
            k = j;
      }
      const auto ks = static_cast<size_t>(k);
      const int64_t take = std::min(free[ks], end - begin);
      parts[ks].emplace_back(begin, begin + take);
      load[ks] += s.run_tokens(static_cast<size_t>(begin), static_cast<size_t>(begin + take));
      free[ks] -= take;
      begin += take;
    }
  }
  std::vector<ShardRows> out(static_cast<size_t>(shards));
  for (size_t k = 0; k < out.size(); ++k) {
    auto& runs = parts[k];
    std::stable_sort(runs.begin(), runs.end(), [&](const auto& a, const auto& b) {
      return s.run_tokens(static_cast<size_t>(a.first), static_cast<size_t>(a.second)) >
             s.run_tokens(static_cast<size_t>(b.first), static_cast<size_t>(b.second));
    });
    for (const auto& [a, b] : runs)
      for (int64_t p = a; p < b; ++p) {
        out[k].positions.push_back(p);
        out[k].continues.push_back(p > a);
      }
    out[k].load = load[k];
  }
  return out;
}


// The tokens row j of a shard adds to a micro-batch (`first`: it opens one).
int64_t added(const detail::ForestSubset& s, const ShardRows& sh, int64_t j, bool first) {
  const auto p = static_cast<size_t>(sh.positions[static_cast<size_t>(j)]);
  const bool shares = !first && sh.continues[static_cast<size_t>(j)];
  return s.length(p) - (shares ? s.lcp(static_cast<size_t>(sh.positions[static_cast<size_t>(j) - 1]), p) : 0);
}

// Ranges [start, end) of the shards' rows, shared by all, each within the cap on every
// shard: the fewest (greedy: each as long as it fits), then, among as many, the
// fewest rounded physical tokens (dynamic programming over ranges no longer than the
// greedy's longest, so cuts fall between trees where they can). The programme is
// skipped when it would take more than kSteps row extensions (the greedy ranges
// stand): rows x the longest range x shards.
std::vector<MicroBatchRange> shared_ranges(const detail::ForestSubset& s, const std::vector<ShardRows>& shards,
                                           int64_t n, int64_t cap, int64_t round) {
  constexpr int64_t kSteps = int64_t{1} << 26;
  std::vector<int64_t> tokens(shards.size());
  // Extends a range from `a` while it fits, calling visit(end, summed rounded tokens).
  auto extend = [&](int64_t a, int64_t widest, auto&& visit) {
    std::fill(tokens.begin(), tokens.end(), 0);
    for (int64_t b = a; b < n && b - a < widest; ++b) {
      int64_t total = 0;
      for (size_t k = 0; k < shards.size(); ++k) {
        const int64_t t = tokens[k] + added(s, shards[k], b, b == a);
        if (b > a && round_up(kFn, t, round) > cap) return;
        tokens[k] = t;
        total += round_up(kFn, t, round);
      }
      visit(b + 1, total);
    }
  };
  std::vector<int64_t> cuts{0};
  int64_t widest = 0;
  while (cuts.back() < n) {
    int64_t end = cuts.back() + 1;
    extend(cuts.back(), n, [&](int64_t b, int64_t) { end = b; });
    widest = std::max(widest, end - cuts.back());
    cuts.push_back(end);
  }
  if (widest <= kSteps / std::max<int64_t>(1, n * static_cast<int64_t>(shards.size()))) {
    // best[j]: (ranges, tokens) of the best cover of rows [0, j); from[j]: its last start.
    constexpr int64_t kNone = std::numeric_limits<int64_t>::max();
    std::vector<std::pair<int64_t, int64_t>> best(static_cast<size_t>(n) + 1, {kNone, kNone});
    std::vector<int64_t> from(static_cast<size_t>(n) + 1, -1);
    best[0] = {0, 0};
    for (int64_t a = 0; a < n; ++a) {
      if (best[static_cast<size_t>(a)].first == kNone) continue;
      const int64_t count = best[static_cast<size_t>(a)].first, used = best[static_cast<size_t>(a)].second;
      extend(a, widest, [&](int64_t b, int64_t total) {
        const std::pair<int64_t, int64_t> cand{count + 1, used + total};
        if (cand < best[static_cast<size_t>(b)]) best[static_cast<size_t>(b)] = cand, from[static_cast<size_t>(b)] = a;
      });
    }
    cuts.clear();
    for (int64_t j = n; j > 0; j = from[static_cast<size_t>(j)]) cuts.push_back(j);
    cuts.push_back(0);
    std::reverse(cuts.begin(), cuts.end());
  }
  std::vector<MicroBatchRange> ranges;
  for (size_t i = 0; i + 1 < cuts.size(); ++i) {
    MicroBatchRange r{cuts[i], cuts[i + 1], 0};
    for (const ShardRows& sh : shards)
      for (int64_t j = r.start; j < r.end; ++j)
        r.length = std::max(r.length, round_up(kFn, s.length(static_cast<size_t>(sh.positions[static_cast<size_t>(j)])),
                                               round));
    ranges.push_back(r);
  }
  return ranges;
}

}  // namespace

DynamicBatchingPlan plan_forest_dynamic_batching(const ForestView& f, const DynamicBatchingOptions& o) {
  check_forest(kFn, f);
  const auto n = static_cast<int64_t>(f.row_length.size());
  const int64_t chunk = dynamic_batching_chunk(o, n);
  const int64_t cap = o.max_tokens_per_microbatch, round = o.sequence_length_round;
  for (int64_t r = 0; r < n; ++r)
    if (round_up(kFn, f.row_length[static_cast<size_t>(r)], round) > cap)
      throw_invalid(kFn, "row " + std::to_string(r) + " has " + std::to_string(f.row_length[static_cast<size_t>(r)]) +
                             " tokens, above max_tokens_per_microbatch=" + std::to_string(cap) +
                             " once rounded up to sequence_length_round=" + std::to_string(round));
  DynamicBatchingPlan plan;
  const int64_t num_chunks = chunk == 0 ? 0 : n / chunk;
  const int64_t per_shard = chunk / o.shards;
  plan.shard_chunk_size = per_shard;
  const detail::ForestSubset none(f, {}, cap, kFn);  // the forest's lcp index, shared by the chunks
  for (int64_t c = 0; c < num_chunks; ++c) {
    std::vector<int64_t> rows(static_cast<size_t>(chunk));
    std::iota(rows.begin(), rows.end(), c * chunk);
    const detail::ForestSubset s(none, rows, cap, kFn);
    const std::vector<ShardRows> shards = deal(s, o.shards, per_shard);
    for (const ShardRows& sh : shards)
      for (int64_t p : sh.positions) plan.sorted_indices.push_back(s.row(static_cast<size_t>(p)));
    std::vector<MicroBatchRange> ranges = shared_ranges(s, shards, per_shard, cap, round);
    if (o.pp_size > 1 && !ranges.empty()) {
      if (round_up(kFn, static_cast<int64_t>(ranges.size()), o.pp_size) > per_shard)
        throw_invalid(kFn, "cannot split " + std::to_string(ranges.size()) +
                               " micro-batches into a multiple of pp_size=" + std::to_string(o.pp_size) +
                               " with only " + std::to_string(per_shard) + " sequences per shard");
      split_ranges_to_multiple(ranges, o.pp_size);
    }
    for (const MicroBatchRange& r : ranges)
      for (const ShardRows& sh : shards) {
        std::vector<int64_t> members(sh.positions.begin() + r.start, sh.positions.begin() + r.end);
        std::sort(members.begin(), members.end());
        plan.padded_tokens = checked_add(kFn, "the planned tokens", plan.padded_tokens,
                                         round_up(kFn, s.cost(members).tokens, round));
      }
    plan.chunks.push_back(std::move(ranges));
  }
  plan.valid_tokens = checked_sum(kFn, "lengths (valid_tokens)", f.row_length);
  return plan;
}

}  // namespace seqpack
