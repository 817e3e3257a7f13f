// The whole-step planner behind one call (step_planner.hpp).
#include "seqpack/step_planner.hpp"

#include <algorithm>
#include <string>

#include "seqpack/forest_cp.hpp"
#include "seqpack/forest_planning.hpp"

namespace seqpack {
namespace {

constexpr const char* kFn = "plan_step";

PlannedStep of_cp(CpStepPlan&& cp) {
  PlannedStep out;
  out.plan = std::move(cp.plan);
  out.degree = std::move(cp.degree);
  out.first_rank = std::move(cp.first_rank);
  out.kv_tokens = cp.kv_tokens;
  out.least_kv_tokens = cp.least_kv_tokens;
  return out;
}

// The planner the request names, before its shapes, at `max_tokens`.
PlannedStep plan_unshaped(const StepRequest& q, int64_t max_tokens) {
  CpStepOptions o = q.options;
  o.step.max_tokens = max_tokens;
  if (q.forest) {
    if (o.cp_size > 1) {
      PlannedStep out = of_cp(plan_forest_cp_step(*q.forest, o));
      out.planned_on.assign(out.plan.mini_batches.size(), "trees");
      return out;
    }
    ForestStepPlan f = plan_forest_step(*q.forest, o.step, q.whole_trees);
    PlannedStep out;
    out.plan = std::move(f.plan);
    out.planned_on = std::move(f.planned_on);
    return out;
  }
  if (o.cp_size > 1) return of_cp(plan_cp_step(q.lengths, o));
  PlannedStep out;
  out.plan = plan_step(q.lengths, o.step);
  return out;
}

PlannedStep shaped(const StepRequest& q, int64_t max_tokens) {
  PlannedStep out = plan_unshaped(q, max_tokens);
  const int64_t group = q.options.cp_size;
  shape_step(out.plan, q.options.step.dp_size * group, group, q.options.step.cost, q.options.step.sync, q.shapes);
  return out;
}

}  // namespace

PlannedStep plan_training_step(const StepRequest& q) {
  if (q.forest) {
    const auto rows = q.forest->row_length;
    if (rows.size() != q.lengths.size() || !std::equal(rows.begin(), rows.end(), q.lengths.begin()))
      throw_invalid(kFn, "lengths: must be the forest's row lengths (forest.lengths)");
  }
  const int64_t cap = q.options.step.max_tokens;
  PlannedStep best = shaped(q, cap);
  const auto& buckets = q.shapes.buckets;
  if (buckets.empty() || q.forest || q.options.cp_size > 1 || q.lengths.empty()) return best;
  // Micro-batches that fill a smaller bucket may pad less: plan under each bucket that
  // holds the longest sequence, keep the fastest padded step, with the full cap's bound.
  const int64_t longest = *std::max_element(q.lengths.begin(), q.lengths.end());
  const StepPlan full = best.plan;
  for (const int64_t b : buckets) {
    if (b < longest || b >= cap) continue;
    PlannedStep other = shaped(q, b);
    if (other.plan.predicted_time < best.plan.predicted_time) best = std::move(other);
  }
  for (size_t m = 0; m < best.plan.mini_batches.size(); ++m)
    best.plan.mini_batches[m].lower_bound = full.mini_batches[m].lower_bound;
  best.plan.lower_bound = full.lower_bound;
  return best;
}

}  // namespace seqpack
