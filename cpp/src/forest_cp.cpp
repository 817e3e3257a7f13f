// Context parallelism over a prefix forest (forest_cp.hpp): each mini-batch's trees as
// CP items, the CP planner on them, and its plan given back per row.
#include "seqpack/forest_cp.hpp"

#include <algorithm>
#include <limits>
#include <numeric>
#include <string>

#include "forest_subset.hpp"

namespace seqpack {
namespace {

constexpr const char* kFn = "plan_step";

}  // namespace

std::vector<int64_t> cp_work_bounds(std::span<const int64_t> work, int64_t cp) {
  constexpr const char* fn = "cp_work_bounds";
  check_positive(fn, "cp_size", cp);
  if (cp > kMaxCpRanks)
    throw_invalid(fn, "cp_size=" + std::to_string(cp) + " is more than the " + std::to_string(kMaxCpRanks) +
                          " ranks a cut can hold");
  // The token's middle, cum - work / 2, against r · total / cp, in integers: x2 and x cp.
  std::vector<int64_t> middle(work.size());
  int64_t cum = 0;
  for (size_t t = 0; t < work.size(); ++t) {
    if (work[t] < 0) throw_invalid(fn, "work: must be >= 0, got work[" + std::to_string(t) + "] = " +
                                           std::to_string(work[t]));
    cum = checked_add(fn, "the tokens' total work", cum, work[t]);
    middle[t] = checked_mul(fn, "the total work x 2 x cp_size", cp, checked_mul(fn, "the total work x 2", 2, cum) - work[t]);
  }
  const int64_t total2 = checked_mul(fn, "the total work x 2", 2, cum);
  std::vector<int64_t> bounds{0};
  for (int64_t r = 1; r < cp; ++r) {
    const int64_t share = checked_mul(fn, "the total work x 2 x cp_size", total2, r);
    bounds.push_back(std::upper_bound(middle.begin(), middle.end(), share) - middle.begin());
  }
  bounds.push_back(static_cast<int64_t>(work.size()));
  return bounds;
}

ForestCpItems forest_cp_items(const ForestView& f, Lengths mini_batch_rows, int64_t cp_size) {
  check_positive(kFn, "cp_size", cp_size);
  if ((cp_size & (cp_size - 1)) != 0) throw_invalid(kFn, "cp_size must be a power of two, got " + std::to_string(cp_size));
  if (cp_size > kMaxCpRanks)
    throw_invalid(kFn, "cp_size=" + std::to_string(cp_size) + " is more than the " + std::to_string(kMaxCpRanks) +
                           " ranks a step can plan");
  ForestCpItems out;
  out.items.name = "trees";
  out.items.levels = 1;
  for (int64_t d = 1; d < cp_size; d *= 2) ++out.items.levels;
  // A row sharded over the block may exceed the per-rank cap: the subsets take any length.
  constexpr int64_t kAnyLength = std::numeric_limits<int64_t>::max();
  const detail::ForestSubset none(f, {}, kAnyLength, kFn);  // the forest's lcp index, shared
  std::vector<int64_t> rows, work;
  int64_t begin = 0;
  for (const int64_t count : mini_batch_rows) {
    rows.resize(static_cast<size_t>(count));
    std::iota(rows.begin(), rows.end(), begin);
    begin += count;
    const detail::ForestSubset s(none, rows, kAnyLength, kFn);
    const auto& starts = s.tree_starts();
    // The subset's trees in the order of their first row in the mini-batch.
    std::vector<std::pair<int64_t, size_t>> trees;  // (first row, tree)
    for (size_t t = 0; t + 1 < starts.size(); ++t) {
      int64_t first = kAnyLength;
      for (auto p = static_cast<size_t>(starts[t]); p < static_cast<size_t>(starts[t + 1]); ++p)
        first = std::min(first, s.row(p));
      trees.emplace_back(first, t);
    }
    std::sort(trees.begin(), trees.end());
    for (const auto& [first, t] : trees) {
      const auto a = static_cast<size_t>(starts[t]), b = static_cast<size_t>(starts[t + 1]);
      // Depth-first, each row adds the depths lcp .. length - 1; a token sees depth + 1 keys.
      work.clear();
      std::vector<int64_t> members;
      for (size_t p = a; p < b; ++p) {
        for (int64_t depth = s.lcp_prev(p); depth < s.length(p); ++depth) work.push_back(depth + 1);
        members.push_back(s.row(p));
      }
      std::sort(members.begin(), members.end());
      out.rows.push_group(members);
      const int64_t tokens = s.run_tokens(a, b);
      out.items.tokens.push_back(tokens);
      // the s² stand-in: 2 pairs - tokens, plus the work items the tree holds (a VLM's images)
      out.items.squares.push_back(checked_add(kFn, "a tree's attention work",
                                              checked_mul(kFn, "a tree's attention work", 2, s.run_pairs(a, b)),
                                              s.run_work(a, b) - tokens));
      for (int64_t d = 1; d <= cp_size; d *= 2) {
        const std::vector<int64_t> bounds = cp_work_bounds(work, d);
        int64_t longest = 0;
        for (size_t r = 1; r < bounds.size(); ++r) longest = std::max(longest, bounds[r] - bounds[r - 1]);
        out.items.local.push_back(longest);
      }
    }
    out.mini_batch_sizes.push_back(static_cast<int64_t>(trees.size()));
  }
  return out;
}

CpStepPlan plan_forest_cp_step(const ForestView& f, const CpStepOptions& o) {
  check_forest(kFn, f);
  const auto n = static_cast<int64_t>(f.row_length.size());
  const std::vector<int64_t> row_counts = mini_batch_counts(n, o.step, "lengths", "sequences");
  const ForestCpItems items = forest_cp_items(f, row_counts, o.cp_size);
  CpStepOptions on_items = o;
  on_items.step.mini_batch_sizes = items.mini_batch_sizes;
  CpStepPlan plan = plan_cp_step(items.items, on_items);
  // Back to rows: a tree's degree and block for each of its rows, the cells' items as rows.
  std::vector<int64_t> degree(static_cast<size_t>(n)), first_rank(static_cast<size_t>(n));
  for (size_t i = 0; i < items.rows.size(); ++i)
    for (const int64_t r : items.rows.group(i)) {
      degree[static_cast<size_t>(r)] = plan.degree[i];
      first_rank[static_cast<size_t>(r)] = plan.first_rank[i];
    }
  plan.degree = std::move(degree);
  plan.first_rank = std::move(first_rank);
  int64_t begin = 0;
  std::vector<int64_t> cell_rows;
  for (size_t m = 0; m < plan.plan.mini_batches.size(); ++m) {
    MiniBatchStep& mb = plan.plan.mini_batches[m];
    IndexGroups cells;
    for (size_t c = 0; c < mb.cells.size(); ++c) {
      cell_rows.clear();
      for (const int64_t i : mb.cells.group(c)) {
        const auto g = items.rows.group(static_cast<size_t>(i));
        cell_rows.insert(cell_rows.end(), g.begin(), g.end());
      }
      std::sort(cell_rows.begin(), cell_rows.end());
      cells.push_group(cell_rows);
    }
    mb.cells = std::move(cells);
    mb.begin = begin;
    mb.end = begin += row_counts[m];
  }
  return plan;
}

}  // namespace seqpack
