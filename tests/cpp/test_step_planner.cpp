// The whole-step planner behind one call (step_planner.hpp): each route gives what
// its planner gives, the shapes applied after it, static shapes on rows never slower
// than padding the full cap's plan, with the full cap's bound.
#include <random>
#include <vector>

#include "seqpack/forest_cp.hpp"
#include "seqpack/forest_planning.hpp"
#include "seqpack/step_planner.hpp"
#include "test_helpers.hpp"

namespace {

using namespace seqpack;
using seqpack_test::ThrowsInvalid;
using Vec = std::vector<int64_t>;

StepRequest request(const Vec& lengths, int64_t dp, int64_t cap) {
  StepRequest q;
  q.lengths = lengths;
  q.options.step.dp_size = dp;
  q.options.step.max_tokens = cap;
  q.options.step.cost = {3.0, 1.0, 0.001};
  return q;
}

TEST(StepPlanner, EachRouteIsItsPlanner) {
  const Vec lengths{400, 30, 250, 90, 12, 310, 70, 6, 180, 220, 9, 390};
  StepRequest q = request(lengths, 2, 512);
  const PlannedStep rows = plan_training_step(q);
  EXPECT_EQ(rows.plan.mini_batches[0].cells, plan_step(lengths, q.options.step).mini_batches[0].cells);
  EXPECT_TRUE(rows.degree.empty() && rows.planned_on.empty());
  q.options.cp_size = 2;
  q.options.hybrid = true;
  const PlannedStep cp = plan_training_step(q);
  const CpStepPlan direct = plan_cp_step(lengths, q.options);
  EXPECT_EQ(cp.degree, direct.degree);
  EXPECT_EQ(cp.plan.predicted_time, direct.plan.predicted_time);
  EXPECT_EQ(cp.kv_tokens, direct.kv_tokens);
  // Trees: a forest of GRPO groups, with and without CP.
  std::vector<Vec> rows_of;
  for (int64_t g = 0; g < 4; ++g)
    for (int64_t r = 0; r < 3; ++r) rows_of.push_back({100 + g, 100 + g, 10 * g + r, 10 * g + r + 1});
  const auto b = seqpack_test::flatten_rows(rows_of);
  const PrefixForest f = build_prefix_forest(b.tokens, b.cu, {});
  StepRequest t = request(f.row_length, 2, 8);
  t.forest = view_of(f);
  const PlannedStep trees = plan_training_step(t);
  EXPECT_EQ(trees.plan.predicted_time, plan_forest_step(view_of(f), t.options.step, false).plan.predicted_time);
  EXPECT_EQ(trees.planned_on.size(), 1u);
  t.options.cp_size = 2;
  const PlannedStep tree_cp = plan_training_step(t);
  EXPECT_EQ(tree_cp.degree, plan_forest_cp_step(view_of(f), t.options).degree);
  EXPECT_EQ(tree_cp.planned_on, (std::vector<std::string>{"trees"}));
  t.lengths = lengths;
  EXPECT_TRUE(ThrowsInvalid([&] { plan_training_step(t); }, {"the forest's row lengths"}));
}

TEST(StepPlanner, StaticShapesKeepTheFastestPaddedStep) {
  std::mt19937_64 rng(2);
  for (int trial = 0; trial < 100; ++trial) {
    Vec lengths(1 + rng() % 50);
    for (auto& s : lengths) s = 1 + static_cast<int64_t>(rng() % 200);
    StepRequest q = request(lengths, 1 + static_cast<int64_t>(rng() % 3), 400);
    q.shapes.buckets = {50, 100, 200, 300, 400};
    q.shapes.order = rng() % 2 ? MicroBatchOrder::LargestFirst : MicroBatchOrder::Planned;
    const PlannedStep best = plan_training_step(q);
    StepPlan full = plan_step(lengths, q.options.step);
    shape_step(full, q.options.step.dp_size, 1, q.options.step.cost, q.options.step.sync, q.shapes);
    EXPECT_LE(best.plan.predicted_time, full.predicted_time);
    EXPECT_EQ(best.plan.lower_bound, full.lower_bound);
    EXPECT_FALSE(best.plan.mini_batches[0].padded.empty());
  }
}

}  // namespace
