// Step shapes (step_shapes.hpp): the header's largest-first and padding examples, the
// CP group moving together, and on random plans: the same cells per rank, every rank
// sorted by tokens, each cell padded to its smallest bucket and the times recomputed.
#include <algorithm>
#include <random>
#include <vector>

#include "seqpack/step_shapes.hpp"
#include "test_helpers.hpp"

namespace {

using namespace seqpack;
using seqpack_test::ThrowsInvalid;
using Vec = std::vector<int64_t>;

StepOptions options(int64_t dp, int64_t cap, StepCost cost) {
  StepOptions o;
  o.dp_size = dp;
  o.max_tokens = cap;
  o.cost = cost;
  return o;
}

TEST(StepShapes, LargestFirstLiteral) {
  const StepCost cost{0.0, 1.0, 0.002};
  StepPlan plan = plan_step(Vec{700, 800, 100, 800, 500, 500}, options(2, 1000, cost));
  EXPECT_EQ(plan.mini_batches[0].tokens, (Vec{800, 1000, 800, 800}));
  EXPECT_DOUBLE_EQ(plan.predicted_time, 4080.0);
  shape_step(plan, 2, 1, cost, StepSync::MicroBatch, {MicroBatchOrder::LargestFirst, {}});
  EXPECT_EQ(plan.mini_batches[0].tokens, (Vec{1000, 800, 800, 800}));  // [800] costs more than [500, 500]
  EXPECT_DOUBLE_EQ(plan.predicted_time, 4160.0);
  EXPECT_DOUBLE_EQ(plan.mini_batches[0].predicted_time, 4160.0);
  EXPECT_TRUE(plan.mini_batches[0].padded.empty());
}

TEST(StepShapes, PaddingLiteral) {
  const StepCost cost{0.0, 1.0, 0.0};
  StepPlan plan = plan_step(Vec{700, 300, 500, 200}, options(1, 1000, cost));
  const double bound = plan.lower_bound;
  shape_step(plan, 1, 1, cost, StepSync::MicroBatch, {MicroBatchOrder::Planned, {500, 1000}});
  EXPECT_EQ(plan.mini_batches[0].tokens, (Vec{900, 800}));
  EXPECT_EQ(plan.mini_batches[0].padded, (Vec{1000, 1000}));
  EXPECT_DOUBLE_EQ(plan.predicted_time, 2000.0);
  EXPECT_DOUBLE_EQ(plan.lower_bound, bound);
  StepPlan dummy = plan_step(Vec{5, 5}, options(3, 8, cost));
  shape_step(dummy, 3, 1, cost, StepSync::MicroBatch, {MicroBatchOrder::Planned, {4, 8}});
  Vec padded = dummy.mini_batches[0].padded;
  std::sort(padded.begin(), padded.end());
  EXPECT_EQ(padded, (Vec{4, 8, 8}));  // a dummy pads to the smallest bucket
  EXPECT_TRUE(ThrowsInvalid([&] { shape_step(plan, 1, 1, cost, StepSync::MicroBatch, {MicroBatchOrder::Planned, {512}}); },
                            {"larger than the largest bucket (512)"}));
}

TEST(StepShapes, ACpGroupMovesTogether) {
  // Two CP groups of two ranks, three micro-batches each: each group sorted by its
  // ranks' largest cell, both ranks of a group permuted alike.
  StepPlan plan;
  MiniBatchStep mb;
  mb.num_micro_batches = 3;
  mb.cells = IndexGroups::from_nested({{0}, {1}, {2}, {0}, {3}, {2}, {4}, {5}, {6}, {7}, {8}, {9}});
  mb.tokens = {10, 50, 30, 60, 5, 30, 1, 2, 3, 1, 3, 3};
  mb.costs.assign(12, 1.0);
  plan.mini_batches.push_back(mb);
  shape_step(plan, 4, 2, StepCost{}, StepSync::MicroBatch, {MicroBatchOrder::LargestFirst, {}});
  const MiniBatchStep& got = plan.mini_batches[0];
  EXPECT_EQ(got.cells.to_nested(),
            (std::vector<Vec>{{0}, {1}, {2}, {0}, {3}, {2}, {5}, {6}, {4}, {8}, {9}, {7}}));
  // group 0 keeps its order (60, 50, 30 at its top); group 1's keys are 1, 3, 3: k = 1 and 2 tie, planned order
  EXPECT_EQ(got.tokens, (Vec{10, 50, 30, 60, 5, 30, 2, 3, 1, 3, 3, 1}));
}

TEST(StepShapes, RandomPlansKeepTheirCells) {
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t dp = 1 + static_cast<int64_t>(rng() % 4), cap = 300;
    Vec lengths(1 + rng() % 40);
    for (auto& s : lengths) s = 1 + static_cast<int64_t>(rng() % cap);
    const StepCost cost{static_cast<double>(rng() % 50), 1.0, (rng() % 2) * 0.01};
    const StepSync sync = rng() % 2 ? StepSync::Step : StepSync::MicroBatch;
    StepOptions o = options(dp, cap, cost);
    o.sync = sync;
    const StepPlan plan = plan_step(lengths, o);
    StepPlan shaped = plan;
    const Vec buckets{37, 150, 300};
    shape_step(shaped, dp, 1, cost, sync, {MicroBatchOrder::LargestFirst, buckets});
    const MiniBatchStep &a = plan.mini_batches[0], &b = shaped.mini_batches[0];
    const int64_t K = a.num_micro_batches;
    for (int64_t r = 0; r < dp; ++r) {
      std::vector<std::pair<Vec, int64_t>> before, after;
      for (int64_t k = 0; k < K; ++k) {
        const auto c = static_cast<size_t>(r * K + k);
        before.emplace_back(Vec(a.cells.group(c).begin(), a.cells.group(c).end()), a.tokens[c]);
        after.emplace_back(Vec(b.cells.group(c).begin(), b.cells.group(c).end()), b.tokens[c]);
        if (k > 0) EXPECT_GE(b.tokens[c - 1], b.tokens[c]);
        const int64_t size = b.padded[c];
        EXPECT_GE(size, b.tokens[c]);
        EXPECT_TRUE(std::find(buckets.begin(), buckets.end(), size) != buckets.end());
        for (int64_t smaller : buckets) if (smaller < size) EXPECT_LT(smaller, b.tokens[c]);
      }
      std::sort(before.begin(), before.end());
      std::sort(after.begin(), after.end());
      EXPECT_EQ(before, after);
    }
    EXPECT_DOUBLE_EQ(shaped.predicted_time, step_time(b.costs, dp, K, sync));
    EXPECT_EQ(shaped.lower_bound, plan.lower_bound);
  }
}

}  // namespace
