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

// values[c] = old values[source[c]], in place.
template <typename T>
void gather(std::vector<T>& values, const std::vector<size_t>& source) {
  if (values.empty()) return;
  std::vector<T> out;
  out.reserve(values.size());
  for (const size_t c : source) out.push_back(values[c]);
  values = std::move(out);
}

void largest_first(MiniBatchStep& mb, int64_t num_ranks, int64_t group) {
  const auto K = static_cast<size_t>(mb.num_micro_batches);
  std::vector<int64_t> key_tokens(K);
  std::vector<double> key_cost(K);
  std::vector<size_t> order(K), source(mb.cells.size());  // source[c]: the planned cell that goes to c
  for (int64_t first = 0; first < num_ranks; first += group) {
    const auto lo = static_cast<size_t>(first), hi = static_cast<size_t>(first + group);
    for (size_t k = 0; k < K; ++k) {
      key_tokens[k] = 0;
      key_cost[k] = -std::numeric_limits<double>::infinity();
      for (size_t r = lo; r < hi; ++r) {
        key_tokens[k] = std::max(key_tokens[k], mb.tokens[r * K + k]);
        key_cost[k] = std::max(key_cost[k], mb.costs[r * K + k]);
      }
    }
    std::iota(order.begin(), order.end(), size_t{0});
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      if (key_tokens[a] != key_tokens[b]) return key_tokens[a] > key_tokens[b];
      return key_cost[a] > key_cost[b];
    });
    for (size_t r = lo; r < hi; ++r)
      for (size_t k = 0; k < K; ++k) source[r * K + k] = r * K + order[k];
  }
  IndexGroups cells;
  cells.indices.reserve(mb.cells.indices.size());
  cells.offsets.reserve(source.size() + 1);
  for (const size_t c : source) cells.push_group(mb.cells.group(c));
  mb.cells = std::move(cells);
  gather(mb.costs, source);
  gather(mb.tokens, source);
  gather(mb.padded, source);
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
