#pragma once
// The whole-step planner behind one call: what Python's plan_step runs, whatever its
// options. One request picks the planner (plain rows: step.hpp; context parallelism:
// cp_step.hpp; prefix trees: forest_planning.hpp; both: forest_cp.hpp) and then the
// step shapes (step_shapes.hpp), all costed here:
//
//   rows    ──┐                                  ┌─ largest first (CP groups together)
//   + CP      ├─ place and cost every cell ──────┤
//   + forest  │                                  └─ padded to static shape buckets
//   + both  ──┘
//
// With static shapes on plain rows without CP, the step is also planned under each
// smaller bucket that holds the longest sequence (micro-batches that fill a smaller
// bucket can pad less) and the fastest padded step kept; its lower bound stays the
// full cap's, which holds for every plan of the inputs.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "seqpack/common.hpp"
#include "seqpack/cp_step.hpp"
#include "seqpack/prefix_forest.hpp"
#include "seqpack/step.hpp"
#include "seqpack/step_shapes.hpp"

namespace seqpack {

struct StepRequest {
  Lengths lengths;                   // per sequence; with a forest, its rows' lengths (checked equal)
  std::optional<ForestView> forest;  // plan prefix trees (shared prefixes once)
  CpStepOptions options;             // options.cp_size == 1: data parallel only
  bool whole_trees = false;          // with a forest: every tree in one micro-batch where it fits
  StepShapes shapes;
};

struct PlannedStep {
  StepPlan plan;
  // cp_size > 1: per sequence its degree and the first rank of its block; the K/V the
  // ranks gather and the least any degrees allow. Empty / 0 otherwise.
  std::vector<int64_t> degree, first_rank;
  int64_t kv_tokens = 0, least_kv_tokens = 0;
  // With a forest: the item set each mini-batch kept ("trees" with CP).
  std::vector<std::string> planned_on;
};

PlannedStep plan_training_step(const StepRequest& request);

}  // namespace seqpack
