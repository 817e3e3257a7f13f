// Micro-batches of a prefix forest under a cap on physical tokens: the packings of
// forest_packers.hpp, each brought to an admissible count and rebalanced, the best
// kept (forest_planning.hpp).
#include "seqpack/forest_planning.hpp"

#include <algorithm>
#include <limits>
#include <numeric>
#include <optional>
#include <string>
#include <tuple>

#include "forest_packers.hpp"
#include "forest_planning_internal.hpp"
#include "seqpack/microbatch.hpp"
#include "seqpack/packing.hpp"

namespace seqpack {
namespace detail {
namespace {

constexpr const char* kFn = "plan_micro_batches";

// Tokens, or attention_coeff * tokens + 2 * pairs - tokens plus the work items held
// (a VLM's images, each once: prefix_forest.hpp).
int64_t workload(const ForestPlanOptions& o, const SubsetCost& c) {
  if (o.attention_coeff <= 0) return c.tokens;
  const char* what = "a micro-batch workload (attention_coeff * tokens + 2 * pairs - tokens + work items)";
  return checked_add(kFn, what,
                     checked_add(kFn, what, checked_mul(kFn, "attention_coeff * tokens", o.attention_coeff, c.tokens),
                                 checked_mul(kFn, "2 * pairs", 2, c.pairs) - c.tokens),
                     c.work);
}

// Rebalances the parts of `bins` (one tree's positions in one micro-batch) on the
// workload with plan_micro_batches, kept when it needs no more micro-batches. Parts
// of a tree that meet again cost less together, never more, so the cap still holds.
void rebalance(const ForestSubset& s, ForestBins& bins, const ForestPlanOptions& o) {
  ForestBins parts;
  for (const auto& bin : bins)
    for (size_t i = 0; i < bin.size();) {
      size_t j = i + 1;
      while (j < bin.size() && s.tree(static_cast<size_t>(bin[j])) == s.tree(static_cast<size_t>(bin[i]))) ++j;
      parts.emplace_back(bin.begin() + static_cast<std::ptrdiff_t>(i), bin.begin() + static_cast<std::ptrdiff_t>(j));
      i = j;
    }
  if (parts.size() <= 1) return;
  std::vector<int64_t> tokens(parts.size()), work(parts.size());
  for (size_t k = 0; k < parts.size(); ++k) {
    const SubsetCost c = s.cost(parts[k]);
    tokens[k] = c.tokens;
    work[k] = workload(o, c);
  }
  // The planner's counts run from the lower bound to first-fit-decreasing's; it
  // cannot fail when that range holds a count with as many parts.
  const auto n = static_cast<int64_t>(parts.size());
  const int64_t total = std::accumulate(tokens.begin(), tokens.end(), int64_t{0});
  const int64_t first = round_up(kFn, std::max(o.min_num, ceil_div(total, o.max_tokens)), o.multiple_of);
  const auto ffd = static_cast<int64_t>(first_fit_decreasing(tokens, o.max_tokens).size());
  const int64_t last = std::min(round_up(kFn, std::max(ffd, first), o.multiple_of), n - n % o.multiple_of);
  if (first > n || last < first || last < ffd) return;
  MicroBatchOptions mo;
  mo.max_tokens = o.max_tokens;
  mo.min_num = o.min_num;
  mo.multiple_of = o.multiple_of;
  mo.workloads = work;
  const MicroBatchPlan plan = plan_micro_batches(tokens, mo);
  if (plan.groups.size() > bins.size()) return;
  ForestBins merged(plan.groups.size());
  for (size_t g = 0; g < plan.groups.size(); ++g) {
    for (int64_t k : plan.groups.group(g))
      merged[g].insert(merged[g].end(), parts[static_cast<size_t>(k)].begin(), parts[static_cast<size_t>(k)].end());
    std::sort(merged[g].begin(), merged[g].end());
  }
  bins = std::move(merged);
}

// The packing brought to an admissible count (cuts), rebalanced and costed; none
// when the count would need more micro-batches than rows.
std::optional<Packing> admissible(const ForestSubset& s, ForestBins bins, const ForestPlanOptions& o,
                                  const char* method) {
  const size_t count = static_cast<size_t>(round_up(kFn, std::max<int64_t>(o.min_num, static_cast<int64_t>(bins.size())),
                                                    o.multiple_of));
  if (count > s.size()) return std::nullopt;
  split_to_count(s, bins, count, o.whole_trees ? o.max_tokens : 0);  // sorts each micro-batch
  if (bins.size() < count) return std::nullopt;  // whole trees: not enough of them
  rebalance(s, bins, o);
  Packing p;
  p.method = method;
  for (const auto& bin : bins) {
    const SubsetCost c = s.cost(bin);
    p.costs.push_back(c);
    p.tokens += c.tokens;
    p.max_work = std::max(p.max_work, workload(o, c));
  }
  p.bins = std::move(bins);
  return p;
}

bool better(const Packing& a, const Packing& b) {
  return std::tuple(a.bins.size(), a.tokens, a.max_work) < std::tuple(b.bins.size(), b.tokens, b.max_work);
}

}  // namespace

std::vector<std::pair<ForestBins, const char*>> packings(const ForestSubset& s, int64_t cap, bool whole_trees,
                                                         std::span<const int64_t> input_order) {
  std::vector<std::pair<ForestBins, const char*>> out;
  out.emplace_back(whole_tree_bins(s, cap), "whole_trees");
  if (whole_trees) return out;
  out.emplace_back(fill_with_splits(s, cap), "split_trees");
  out.emplace_back(first_fit_rows(s, largest_trees_first(s), cap), "first_fit_rows");
  out.emplace_back(first_fit_rows(s, input_order, cap), "first_fit_trie");
  return out;
}

std::vector<int64_t> positions_in_row_order(const ForestSubset& s) {
  std::vector<int64_t> order(s.size());
  std::iota(order.begin(), order.end(), int64_t{0});
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return s.row(static_cast<size_t>(a)) < s.row(static_cast<size_t>(b));
  });
  return order;
}

Packing best_packing(const ForestSubset& s, const ForestPlanOptions& o) {
  const auto n = static_cast<int64_t>(s.size());
  const int64_t bound = std::max(o.min_num, ceil_div(s.physical_tokens(), o.max_tokens));
  const int64_t first = round_up(kFn, bound, o.multiple_of);
  if (first > n)
    throw_invalid(kFn, "need at least " + std::to_string(first) + " micro-batches (min_num=" +
                           std::to_string(o.min_num) + ", multiple_of=" + std::to_string(o.multiple_of) +
                           ", ceil(physical tokens/max_tokens)=" +
                           std::to_string(ceil_div(s.physical_tokens(), o.max_tokens)) + ") but there are only " +
                           std::to_string(n) + " sequences");
  std::optional<Packing> best;
  size_t fewest = std::numeric_limits<size_t>::max();
  const std::vector<int64_t> input_order = positions_in_row_order(s);
  for (auto& [bins, method] : packings(s, o.max_tokens, o.whole_trees, input_order)) {
    fewest = std::min(fewest, bins.size());
    if (auto p = admissible(s, std::move(bins), o, method); p && (!best || better(*p, *best))) best = std::move(p);
  }
  const int64_t need = round_up(kFn, std::max<int64_t>(o.min_num, static_cast<int64_t>(fewest)), o.multiple_of);
  if (!best && o.whole_trees && need <= n)
    throw_invalid(kFn, "need at least " + std::to_string(need) + " micro-batches (min_num=" +
                           std::to_string(o.min_num) + ", multiple_of=" + std::to_string(o.multiple_of) +
                           ") but these " + std::to_string(n) + " rows form only " + std::to_string(s.num_trees()) +
                           " trees, and whole_trees keeps each tree that fits in one micro-batch");
  if (!best)
    throw_invalid(kFn, "need at least " + std::to_string(need) + " micro-batches (min_num=" +
                           std::to_string(o.min_num) + ", multiple_of=" + std::to_string(o.multiple_of) +
                           ", the fewest that hold these rows under max_tokens=" + std::to_string(o.max_tokens) +
                           ": " + std::to_string(fewest) + ") but there are only " + std::to_string(n) +
                           " sequences");
  return *std::move(best);
}

}  // namespace detail

ForestMicroBatchPlan plan_forest_micro_batches(const ForestView& f, const ForestPlanOptions& o) {
  std::vector<int64_t> all(f.row_length.size());
  std::iota(all.begin(), all.end(), int64_t{0});
  return plan_forest_micro_batches(f, o, all);
}

ForestMicroBatchPlan plan_forest_micro_batches(const ForestView& f, const ForestPlanOptions& o,
                                               std::span<const int64_t> rows) {
  const detail::ForestSubset s(f, rows, o.max_tokens, detail::kFn);
  check_positive(detail::kFn, "min_num", o.min_num);
  check_positive(detail::kFn, "multiple_of", o.multiple_of);
  ForestMicroBatchPlan plan;
  plan.physical_tokens = s.physical_tokens();
  if (s.size() == 0) return plan;  // as plan_micro_batches: no micro-batch, a bound of 0
  plan.lower_bound = std::max(o.min_num, ceil_div(s.physical_tokens(), o.max_tokens));
  detail::Packing best = detail::best_packing(s, o);
  std::vector<int64_t> work(best.bins.size());
  for (size_t b = 0; b < work.size(); ++b) work[b] = detail::workload(o, best.costs[b]);
  std::vector<int64_t> order(work.size());
  if (o.small_at_ends) {
    order = small_at_ends_order(work);
  } else {
    std::iota(order.begin(), order.end(), int64_t{0});
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return work[a] > work[b]; });
  }
  std::vector<int64_t> ids;
  for (int64_t b : order) {
    ids.clear();
    for (int64_t p : best.bins[static_cast<size_t>(b)]) ids.push_back(s.row(static_cast<size_t>(p)));
    std::sort(ids.begin(), ids.end());
    plan.groups.push_group(ids);
    plan.tokens.push_back(best.costs[static_cast<size_t>(b)].tokens);
    plan.pairs.push_back(best.costs[static_cast<size_t>(b)].pairs);
    plan.workloads.push_back(work[static_cast<size_t>(b)]);
  }
  plan.method = best.method;
  return plan;
}

IndexGroups first_fit_trie(const ForestView& f, int64_t max_tokens, std::span<const int64_t> rows) {
  const detail::ForestSubset s(f, rows, max_tokens, "first_fit_trie");
  std::vector<int64_t> position(f.row_length.size(), -1);
  for (size_t p = 0; p < s.size(); ++p) position[static_cast<size_t>(s.row(p))] = static_cast<int64_t>(p);
  std::vector<int64_t> order;
  order.reserve(rows.size());
  for (int64_t r : rows) order.push_back(position[static_cast<size_t>(r)]);
  IndexGroups out;
  std::vector<int64_t> ids;
  for (const auto& bin : detail::first_fit_rows(s, order, max_tokens)) {
    ids.clear();
    for (int64_t p : bin) ids.push_back(s.row(static_cast<size_t>(p)));
    std::sort(ids.begin(), ids.end());
    out.push_group(ids);
  }
  return out;
}

}  // namespace seqpack
