#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <utility>
#include <vector>

#include "seqpack/step.hpp"
#include "test_helpers.hpp"

namespace seqpack {
namespace {

StepOptions options(int64_t dp, int64_t cap, StepSync sync) {
  StepOptions o;
  o.dp_size = dp;
  o.max_tokens = cap;
  o.sync = sync;
  return o;
}

TEST(PlanStep, EveryIndexOnceUnderTheCapWithEqualCounts) {
  std::vector<int64_t> lengths;
  for (int64_t i = 0; i < 500; ++i) lengths.push_back(1 + (i * 7919) % 4000);
  for (StepSync sync : {StepSync::MicroBatch, StepSync::Step}) {
    StepOptions o = options(8, 4096, sync);
    o.cost = StepCost{10.0, 1.0, 1e-3};
    o.mini_batches = 2;
    o.multiple_of = 2;
    const StepPlan plan = plan_step(lengths, o);
    std::vector<int64_t> seen;
    double time = 0.0;
    for (const MiniBatchStep& mb : plan.mini_batches) {
      EXPECT_EQ(mb.num_micro_batches % 2, 0);
      ASSERT_EQ(mb.cells.size(), static_cast<size_t>(8 * mb.num_micro_batches));
      for (size_t c = 0; c < mb.cells.size(); ++c) {
        int64_t tokens = 0;
        for (int64_t i : mb.cells.group(c)) {
          seen.push_back(i);
          tokens += lengths[i];
          EXPECT_TRUE(i >= mb.begin && i < mb.end);
        }
        EXPECT_LE(tokens, 4096);
        EXPECT_EQ(tokens, mb.tokens[c]);
      }
      EXPECT_DOUBLE_EQ(step_time(mb.costs, 8, mb.num_micro_batches, sync), mb.predicted_time);
      EXPECT_LE(mb.lower_bound, mb.predicted_time);
      time += mb.predicted_time;
    }
    std::sort(seen.begin(), seen.end());
    std::vector<int64_t> all(lengths.size());
    std::iota(all.begin(), all.end(), 0);
    EXPECT_EQ(seen, all);
    EXPECT_DOUBLE_EQ(plan.predicted_time, time);
    EXPECT_LE(plan.predicted_time, 1.03 * plan.lower_bound);
  }
}

// Prefix-tree items give their own s² stand-ins (2·pairs − tokens) and mini-batch
// sizes: squares equal to s² plan exactly as without them; smaller squares lower
// the costs and the bound; explicit sizes set the mini-batch ranges.
TEST(PlanStep, SquareStandInsAndMiniBatchSizes) {
  std::vector<int64_t> lengths, squares, halves;
  for (int64_t i = 0; i < 300; ++i) {
    lengths.push_back(1 + (i * 7919) % 2000);
    squares.push_back(lengths.back() * lengths.back());
    halves.push_back(squares.back() / 2);
  }
  for (StepSync sync : {StepSync::MicroBatch, StepSync::Step}) {
    StepOptions o = options(4, 4096, sync);
    o.cost = StepCost{10.0, 1.0, 1e-3};
    o.mini_batches = 2;
    const StepPlan plain = plan_step(lengths, o);
    StepOptions same = o;
    same.squares = squares;
    const StepPlan with_squares = plan_step(lengths, same);
    EXPECT_NEAR(with_squares.predicted_time, plain.predicted_time, 1e-12 * plain.predicted_time);
    EXPECT_NEAR(with_squares.lower_bound, plain.lower_bound, 1e-12 * plain.lower_bound);
    for (size_t m = 0; m < plain.mini_batches.size(); ++m)
      EXPECT_EQ(with_squares.mini_batches[m].cells, plain.mini_batches[m].cells);
    StepOptions lighter = o;
    lighter.squares = halves;
    const StepPlan light = plan_step(lengths, lighter);
    EXPECT_LT(light.predicted_time, plain.predicted_time);
    EXPECT_LE(light.lower_bound, light.predicted_time);
    for (const MiniBatchStep& mb : light.mini_batches)
      for (size_t c = 0; c < mb.cells.size(); ++c) {
        double cost = o.cost.per_micro_batch;
        for (int64_t i : mb.cells.group(c))
          cost += o.cost.per_token * static_cast<double>(lengths[i]) +
                  o.cost.per_token_squared * static_cast<double>(halves[i]);
        EXPECT_NEAR(mb.costs[c], cost, 1e-9 * cost);
      }
    StepOptions sized = o;
    const std::vector<int64_t> sizes{100, 200};
    sized.mini_batch_sizes = sizes;
    const StepPlan split = plan_step(lengths, sized);
    EXPECT_EQ(split.mini_batches[0].end, 100);
    EXPECT_EQ(split.mini_batches[1].begin, 100);
    EXPECT_EQ(split.mini_batches[1].end, 300);
  }
  StepOptions o = options(2, 4096, StepSync::MicroBatch);
  std::vector<int64_t> bad = squares;
  bad[3] = -1;
  o.squares = bad;
  EXPECT_TRUE(seqpack_test::ThrowsInvalid([&] { plan_step(lengths, o); }, {"squares[3]", ">= 0"}));
  o.squares = std::span<const int64_t>(squares).first(5);
  EXPECT_TRUE(seqpack_test::ThrowsInvalid([&] { plan_step(lengths, o); }, {"squares", "one entry per length"}));
  o.squares = {};
  o.mini_batches = 2;
  const std::vector<int64_t> wrong{100, 100};
  o.mini_batch_sizes = wrong;
  EXPECT_TRUE(seqpack_test::ThrowsInvalid([&] { plan_step(lengths, o); }, {"mini_batch_sizes", "sum to"}));
  const std::vector<int64_t> three{100, 100, 100};
  o.mini_batch_sizes = three;
  EXPECT_TRUE(seqpack_test::ThrowsInvalid([&] { plan_step(lengths, o); }, {"mini_batch_sizes", "mini_batches = 2"}));
}

TEST(PlanStep, StepTimeFollowsTheSyncMode) {
  // Two ranks, two micro-batches, rank-major: rank 0 = {4, 1}, rank 1 = {2, 3}.
  const std::vector<double> costs{4, 1, 2, 3};
  EXPECT_DOUBLE_EQ(step_time(costs, 2, 2, StepSync::MicroBatch), 4 + 3);
  EXPECT_DOUBLE_EQ(step_time(costs, 2, 2, StepSync::Step), 5);
}

TEST(PlanStep, BadArgumentsThrowNamingThem) {
  const std::vector<int64_t> lengths{5, 3};
  EXPECT_THROW(plan_step(lengths, options(0, 10, StepSync::Step)), std::invalid_argument);
  EXPECT_THROW(plan_step(lengths, options(2, 4, StepSync::Step)), std::invalid_argument);
  StepOptions o = options(2, 10, StepSync::MicroBatch);
  o.cost = StepCost{0, 0, 0};
  EXPECT_THROW(plan_step(lengths, o), std::invalid_argument);
  o = options(2, 10, StepSync::MicroBatch);
  o.mini_batches = 3;
  EXPECT_THROW(plan_step(lengths, o), std::invalid_argument);
}

// Found by fuzz_step: the count rounded up to multiple_of wrapped around.
TEST(PlanStep, FuzzRegressions) {
  StepOptions o = options(2, 10, StepSync::MicroBatch);
  o.min_micro_batches = INT64_MAX / 2 + 1;
  o.multiple_of = 2;
  EXPECT_THROW(plan_step(std::vector<int64_t>{5, 3}, o), std::invalid_argument);
}

// Issue 26: the two-step candidate balanced integer workloads c1/c2·s + s², which
// overflowed for valid inputs ("[seqpack.sequence_workloads] product overflows").
TEST(PlanStep, LargeLengthsAndCoefficientRatiosStillPlan) {
  const int64_t big = int64_t{1} << 32;  // s² = 2^64
  const std::vector<std::pair<std::vector<int64_t>, StepCost>> cases = {
      {{big, big, big, big}, StepCost{0.0, 1.0, 1.0}},
      {{10000, 10000, 10000, 10000}, StepCost{0.0, 1.0, 1e-15}},  // c1 / c2 = 1e15
      {{10000, 10000, 10000, 10000}, StepCost{0.0, 1.0, 1e-300}},
  };
  for (const auto& [lengths, cost] : cases)
    for (StepSync sync : {StepSync::MicroBatch, StepSync::Step}) {
      StepOptions o = options(2, 2 * lengths[0], sync);
      o.cost = cost;
      const StepPlan plan = plan_step(lengths, o);
      ASSERT_EQ(plan.mini_batches.size(), 1u);
      EXPECT_TRUE(seqpack_test::IsPartition(plan.mini_batches[0].cells, lengths.size(), true));
      EXPECT_TRUE(std::isfinite(plan.predicted_time));
      EXPECT_LE(plan.lower_bound, plan.predicted_time);
    }
}

// Issue 26: finite coefficients whose products overflow gave predicted_time = inf
// (and a gap of inf / inf = nan); now an error naming the coefficient.
TEST(PlanStep, CostOverflowNamesTheCoefficient) {
  const std::vector<int64_t> lengths(100, 100);
  StepOptions o = options(1, int64_t{1} << 40, StepSync::MicroBatch);
  o.cost = StepCost{0.0, 1e300, 0.0};
  EXPECT_TRUE(seqpack_test::ThrowsInvalid([&] { plan_step(lengths, o); },
                                          {"cost.per_token * max_tokens", "overflows float64"}));
  o.cost = StepCost{0.0, 0.0, 1e290};
  EXPECT_TRUE(seqpack_test::ThrowsInvalid([&] { plan_step(lengths, o); },
                                          {"cost.per_token_squared * max_tokens^2", "overflows float64"}));
  o.cost = StepCost{1.7e308, 1e295, 0.0};  // each term finite, their sum not
  EXPECT_TRUE(seqpack_test::ThrowsInvalid([&] { plan_step(lengths, o); }, {"the cost of a micro-batch", "overflows"}));
  // Each micro-batch's cost is finite, the step's (100 micro-batches) is not.
  o = options(1, 100, StepSync::MicroBatch);
  o.cost = StepCost{0.0, 1e305, 0.0};
  EXPECT_TRUE(seqpack_test::ThrowsInvalid([&] { plan_step(lengths, o); },
                                          {"predicted step time overflows float64", "cost.per_token = 1e+305"}));
  o.sync = StepSync::Step;
  EXPECT_TRUE(seqpack_test::ThrowsInvalid([&] { plan_step(lengths, o); }, {"cost.per_token = 1e+305"}));
}

}  // namespace
}  // namespace seqpack
