#pragma once
// The step planner's options from Python's arguments and its plan back as dicts,
// shared by plan_step and plan_forest_step.
#include <optional>
#include <string>

#include "convert.hpp"
#include "seqpack/step.hpp"

namespace seqpack::bindings {

inline StepOptions step_options(int64_t dp_size, int64_t max_tokens, double per_micro_batch, double per_token,
                                double per_token_squared, const std::string& sync, int64_t mini_batches,
                                int64_t min_micro_batches, int64_t multiple_of, std::optional<uint64_t> seed) {
  StepOptions o;
  o.dp_size = dp_size;
  o.max_tokens = max_tokens;
  o.cost = StepCost{per_micro_batch, per_token, per_token_squared};
  if (sync == "micro_batch") o.sync = StepSync::MicroBatch;
  else if (sync == "step") o.sync = StepSync::Step;
  else throw py::value_error("sync must be 'micro_batch' or 'step', got '" + sync + "'");
  o.mini_batches = mini_batches;
  o.min_micro_batches = min_micro_batches;
  o.multiple_of = multiple_of;
  o.seed = seed;
  return o;
}

// {"mini_batches": [{begin, end, num_micro_batches, cells, costs, tokens,
// predicted_time, lower_bound}, ...], "predicted_time", "lower_bound"}.
inline py::dict step_plan_dict(const StepPlan& plan) {
  py::list minis;
  for (const MiniBatchStep& mb : plan.mini_batches) {
    py::dict d;
    d["begin"] = mb.begin;
    d["end"] = mb.end;
    d["num_micro_batches"] = mb.num_micro_batches;
    d["cells"] = to_list(mb.cells);
    d["costs"] = mb.costs;
    d["tokens"] = mb.tokens;
    d["predicted_time"] = mb.predicted_time;
    d["lower_bound"] = mb.lower_bound;
    minis.append(d);
  }
  py::dict out;
  out["mini_batches"] = minis;
  out["predicted_time"] = plan.predicted_time;
  out["lower_bound"] = plan.lower_bound;
  return out;
}

}  // namespace seqpack::bindings
