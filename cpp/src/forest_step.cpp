// A training step over a prefix forest (forest_planning.hpp): per mini-batch, the
// step planner (step.hpp) on several sets of items (whole trees, the micro-batches of
// the best packing, AReaL's tries, the rows), every cell then costed from its own
// physical tokens and visible pairs, the fastest kept.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <queue>
#include <string>
#include <utility>

#include "forest_planning_internal.hpp"
#include "seqpack/forest_planning.hpp"

namespace seqpack {
namespace {

using detail::ForestBins;
using detail::ForestSubset;

constexpr const char* kFn = "plan_step";

// The cost model on a cell's physical tokens, pairs (2 pairs - tokens: the s² of a
// plain row) and work items (a VLM's images, in pair units).
double cell_cost(const StepCost& c, const SubsetCost& t) {
  return c.per_micro_batch + c.per_token * static_cast<double>(t.tokens) +
         c.per_token_squared * (static_cast<double>(2 * t.pairs - t.tokens) + static_cast<double>(t.work));
}

// Cells of positions (rank-major, K per rank) as a mini-batch's step, costed exactly.
MiniBatchStep costed(const ForestSubset& s, const ForestBins& cells, int64_t K, const StepOptions& o) {
  MiniBatchStep mb;
  mb.num_micro_batches = K;
  std::vector<int64_t> ids;
  for (const auto& cell : cells) {
    std::vector<int64_t> sorted(cell);
    std::sort(sorted.begin(), sorted.end());
    const SubsetCost c = s.cost(sorted);
    ids.clear();
    for (int64_t p : sorted) ids.push_back(s.row(static_cast<size_t>(p)));
    std::sort(ids.begin(), ids.end());
    mb.cells.push_group(ids);
    mb.tokens.push_back(c.tokens);
    mb.costs.push_back(cell_cost(o.cost, c));
  }
  mb.predicted_time = step_time(mb.costs, o.dp_size, K, o.sync);
  return mb;
}

// The step planner on items (each a set of positions): their physical tokens and
// their pairs as the s² stand-in; cells mapped back to positions.
// `begin`: the mini-batch's first row, which seeds the planner's tie-breaks as
// plan_step seeds that mini-batch's.
std::pair<ForestBins, int64_t> plan_items(const ForestSubset& s, const ForestBins& items, const StepOptions& o,
                                          int64_t begin) {
  std::vector<int64_t> tokens(items.size()), squares(items.size());
  for (size_t k = 0; k < items.size(); ++k) {
    std::vector<int64_t> sorted(items[k]);
    std::sort(sorted.begin(), sorted.end());
    const SubsetCost c = s.cost(sorted);
    tokens[k] = c.tokens;
    squares[k] = 2 * c.pairs - c.tokens + c.work;
  }
  StepOptions one = o;
  one.mini_batches = 1;
  one.mini_batch_sizes = {};
  one.squares = squares;
  if (o.seed) one.seed = *o.seed + 0x9E3779B97F4A7C15ULL * static_cast<uint64_t>(begin);
  const StepPlan plan = plan_step(tokens, one);
  const MiniBatchStep& mb = plan.mini_batches.front();
  ForestBins cells(mb.cells.size());
  for (size_t c = 0; c < mb.cells.size(); ++c)
    for (int64_t k : mb.cells.group(c))
      cells[c].insert(cells[c].end(), items[static_cast<size_t>(k)].begin(), items[static_cast<size_t>(k)].end());
  return {std::move(cells), mb.num_micro_batches};
}

// Whether every tree's positions sit on one rank.
bool trees_on_one_rank(const ForestSubset& s, const ForestBins& cells, int64_t K) {
  std::vector<int64_t> rank_of(s.num_trees(), -1);
  const auto& starts = s.tree_starts();
  for (size_t c = 0; c < cells.size(); ++c)
    for (int64_t p : cells[c]) {
      const auto t = static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), p) - starts.begin() - 1);
      const auto r = static_cast<int64_t>(c) / K;
      if (rank_of[t] >= 0 && rank_of[t] != r) return false;
      rank_of[t] = r;
    }
  return true;
}

// Trees to ranks by their work (heaviest first, each to the least loaded rank), each
// rank's rows then planned into micro-batches with its trees whole; ranks with fewer
// micro-batches than the most get empty ones. The plan that keeps every tree on one
// rank whatever its size (a tree over the cap is cut into micro-batches of its rank).
std::pair<ForestBins, int64_t> ranks_of_trees(const ForestSubset& s, const StepOptions& o) {
  const auto& starts = s.tree_starts();
  const size_t trees = s.num_trees();
  std::vector<double> work(trees);
  for (size_t t = 0; t < trees; ++t) {
    const auto a = static_cast<size_t>(starts[t]), b = static_cast<size_t>(starts[t + 1]);
    work[t] = cell_cost(o.cost, s.run_cost(a, b)) - o.cost.per_micro_batch;
  }
  std::vector<size_t> order(trees);
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return work[a] > work[b]; });
  using Load = std::pair<double, int64_t>;
  std::priority_queue<Load, std::vector<Load>, std::greater<>> lightest;
  for (int64_t r = 0; r < o.dp_size; ++r) lightest.emplace(0.0, r);
  std::vector<std::vector<int64_t>> rank_rows(static_cast<size_t>(o.dp_size));
  for (size_t t : order) {
    auto [load, r] = lightest.top();
    lightest.pop();
    for (int64_t p = starts[t]; p < starts[t + 1]; ++p) rank_rows[static_cast<size_t>(r)].push_back(p);
    lightest.emplace(load + work[t], r);
  }
  ForestPlanOptions fo;
  fo.max_tokens = o.max_tokens;
  fo.whole_trees = true;
  std::vector<ForestBins> per_rank(static_cast<size_t>(o.dp_size));
  int64_t K = o.min_micro_batches;
  for (size_t r = 0; r < per_rank.size(); ++r) {
    if (rank_rows[r].empty()) continue;
    // The rank's own subset: positions there map back through their rows.
    std::vector<int64_t> rows;
    for (int64_t p : rank_rows[r]) rows.push_back(s.row(static_cast<size_t>(p)));
    const ForestSubset local(s, rows, o.max_tokens, kFn);
    std::vector<int64_t> position_of(local.size());
    for (size_t q = 0; q < local.size(); ++q)
      position_of[q] = s.position_of(local.row(q));
    for (auto& bin : detail::best_packing(local, fo).bins) {
      for (auto& q : bin) q = position_of[static_cast<size_t>(q)];
      per_rank[r].push_back(std::move(bin));
    }
    K = std::max(K, static_cast<int64_t>(per_rank[r].size()));
  }
  K = round_up(kFn, K, o.multiple_of);
  ForestBins cells;
  for (auto& bins : per_rank) {
    std::sort(bins.begin(), bins.end(), [&](const auto& a, const auto& b) {
      return s.cost(a).tokens > s.cost(b).tokens;  // heaviest first on every rank: step maxima line up
    });
    bins.resize(static_cast<size_t>(K));
    for (auto& bin : bins) cells.push_back(std::move(bin));
  }
  return {std::move(cells), K};
}

// A proven bound for one mini-batch: its fewest micro-batches per rank times the
// per-micro-batch cost, plus its trees' work (each node costed once; splitting a tree
// only repeats nodes) over the ranks.
double mini_batch_bound(const ForestSubset& s, const StepOptions& o) {
  const auto& starts = s.tree_starts();
  double work = 0.0;
  for (size_t t = 0; t + 1 < starts.size(); ++t) {
    const auto a = static_cast<size_t>(starts[t]), b = static_cast<size_t>(starts[t + 1]);
    work += cell_cost(o.cost, s.run_cost(a, b)) - o.cost.per_micro_batch;
  }
  const int64_t cells = std::max<int64_t>(1, ceil_div(s.physical_tokens(), o.max_tokens));
  const int64_t k_min = round_up(kFn, std::max(o.min_micro_batches, ceil_div(cells, o.dp_size)), o.multiple_of);
  return static_cast<double>(k_min) * o.cost.per_micro_batch + work / static_cast<double>(o.dp_size);
}

// Each row an item, in row order (so the step planner sees the plain plan's input).
ForestBins single_rows(const ForestSubset& s) {
  ForestBins items;
  for (int64_t p : detail::positions_in_row_order(s)) items.push_back({p});
  return items;
}

}  // namespace

ForestStepPlan plan_forest_step(const ForestView& f, const StepOptions& o, bool whole_trees) {
  check_forest(kFn, f);
  check_step_options(o);
  StepOptions split = o;
  split.mini_batch_sizes = {};  // unused here: the rows split evenly
  const std::vector<int64_t> counts =
      mini_batch_counts(static_cast<int64_t>(f.row_length.size()), split, "lengths", "sequences");
  ForestStepPlan out;
  const ForestSubset none(f, {}, o.max_tokens, kFn);  // the forest's lcp index, shared by the mini-batches
  int64_t begin = 0;
  for (int64_t m = 0; m < o.mini_batches; ++m) {
    const int64_t end = begin + counts[static_cast<size_t>(m)];
    std::vector<int64_t> rows(static_cast<size_t>(end - begin));
    std::iota(rows.begin(), rows.end(), begin);
    const ForestSubset s(none, rows, o.max_tokens, kFn);
    std::vector<std::pair<ForestBins, const char*>> items;
    for (auto& [bins, method] : detail::packings(s, o.max_tokens, whole_trees, detail::positions_in_row_order(s))) {
      if (std::string(method) == "whole_trees") {  // the items themselves, not their bins
        ForestBins runs;
        for (const auto& [a, b] : detail::tree_runs(s, o.max_tokens)) {
          runs.emplace_back(static_cast<size_t>(b - a));
          std::iota(runs.back().begin(), runs.back().end(), a);
        }
        items.emplace_back(std::move(runs), "trees");
      } else {
        items.emplace_back(std::move(bins), method);
      }
    }
    if (!whole_trees) items.emplace_back(single_rows(s), "rows");
    std::optional<MiniBatchStep> best;
    const char* name = "";
    auto consider = [&](const ForestBins& cells, int64_t K, const char* method) {
      MiniBatchStep mb = costed(s, cells, K, o);
      if (!best || mb.predicted_time < best->predicted_time * (1 - 1e-12)) {
        best = std::move(mb);
        name = method;
      }
    };
    for (const auto& [set, method] : items) {
      auto [cells, K] = plan_items(s, set, o, begin);
      if (whole_trees && !trees_on_one_rank(s, cells, K)) continue;  // a large tree's parts on two ranks
      consider(cells, K, method);
    }
    {  // a candidate either way, so the plan never loses to the whole_trees one
      auto [cells, K] = ranks_of_trees(s, o);
      consider(cells, K, "ranks_of_trees");
    }
    best->begin = begin;
    best->end = end;
    best->lower_bound = std::min(mini_batch_bound(s, o), best->predicted_time);  // min: float rounding only
    out.plan.predicted_time += best->predicted_time;
    out.plan.lower_bound += best->lower_bound;
    out.plan.mini_batches.push_back(std::move(*best));
    out.planned_on.emplace_back(name);
    begin = end;
  }
  return out;
}

}  // namespace seqpack
