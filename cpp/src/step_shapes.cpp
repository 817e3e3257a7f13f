// Step shapes (step_shapes.hpp): each CP group's micro-batches reordered largest
// first, then every cell padded to its bucket, and the times recomputed.
#include "seqpack/step_shapes.hpp"

#include <algorithm>
#include <limits>
#include <numeric>
#include <string>

#include "seqpack/common.hpp"

namespace seqpack {
namespace {

constexpr const char* kFn = "plan_step";

// Permutes the K cells of each rank of [first, first + group) by `order`.
template <typename T>
void permute(std::vector<T>& values, int64_t first, int64_t group, int64_t K, const std::vector<int64_t>& order) {
  if (values.empty()) return;
  std::vector<T> row(static_cast<size_t>(K));
  for (int64_t r = first; r < first + group; ++r) {
    const auto base = static_cast<size_t>(r * K);
    for (int64_t k = 0; k < K; ++k) row[static_cast<size_t>(k)] = std::move(values[base + static_cast<size_t>(order[static_cast<size_t>(k)])]);
    std::move(row.begin(), row.end(), values.begin() + static_cast<std::ptrdiff_t>(base));
  }
}

void largest_first(MiniBatchStep& mb, int64_t num_ranks, int64_t group) {
  const int64_t K = mb.num_micro_batches;
  std::vector<int64_t> key_tokens(static_cast<size_t>(K)), order(static_cast<size_t>(K));
  std::vector<double> key_cost(static_cast<size_t>(K));
  for (int64_t first = 0; first < num_ranks; first += group) {
    for (int64_t k = 0; k < K; ++k) {
      int64_t tokens = 0;
      double cost = -std::numeric_limits<double>::infinity();
      for (int64_t r = first; r < first + group; ++r) {
        const auto c = static_cast<size_t>(r * K + k);
        tokens = std::max(tokens, mb.tokens[c]);
        cost = std::max(cost, mb.costs[c]);
      }
      key_tokens[static_cast<size_t>(k)] = tokens;
      key_cost[static_cast<size_t>(k)] = cost;
    }
    std::iota(order.begin(), order.end(), int64_t{0});
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      const auto ua = static_cast<size_t>(a), ub = static_cast<size_t>(b);
      if (key_tokens[ua] != key_tokens[ub]) return key_tokens[ua] > key_tokens[ub];
      return key_cost[ua] > key_cost[ub];
    });
    std::vector<std::vector<int64_t>> cells = mb.cells.to_nested();
    permute(cells, first, group, K, order);
    permute(mb.costs, first, group, K, order);
    permute(mb.tokens, first, group, K, order);
    permute(mb.padded, first, group, K, order);
    mb.cells = IndexGroups::from_nested(cells);
  }
}

void pad_to_buckets(MiniBatchStep& mb, const std::vector<int64_t>& buckets, const StepCost& cost) {
  mb.padded.resize(mb.tokens.size());
  for (size_t c = 0; c < mb.tokens.size(); ++c) {
    const int64_t tokens = mb.tokens[c];
    const auto it = std::lower_bound(buckets.begin(), buckets.end(), tokens);
    if (it == buckets.end())
      throw_invalid(kFn, "static_shapes: a micro-batch of " + std::to_string(tokens) +
                             " tokens is larger than the largest bucket (" + std::to_string(buckets.back()) + ")");
    mb.padded[c] = *it;
    mb.costs[c] += cost.work(*it - tokens);
  }
}

}  // namespace

void shape_step(StepPlan& plan, int64_t num_ranks, int64_t group, const StepCost& cost, StepSync sync,
                const StepShapes& shapes) {
  if (shapes.empty()) return;
  check_positive(kFn, "cp_size", group);
  for (size_t i = 1; i < shapes.buckets.size(); ++i)
    if (shapes.buckets[i] <= shapes.buckets[i - 1]) throw_invalid(kFn, "static_shapes: bucket sizes must ascend");
  plan.predicted_time = 0.0;
  for (MiniBatchStep& mb : plan.mini_batches) {
    if (shapes.order == MicroBatchOrder::LargestFirst) largest_first(mb, num_ranks, group);
    if (!shapes.buckets.empty()) pad_to_buckets(mb, shapes.buckets, cost);
    mb.predicted_time = step_time(mb.costs, num_ranks, mb.num_micro_batches, sync);
    plan.predicted_time += mb.predicted_time;
  }
}

}  // namespace seqpack
