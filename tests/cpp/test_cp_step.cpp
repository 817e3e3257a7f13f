// Planning a step with context parallelism (cp_step.hpp): the zigzag share of a
// sequence, a long tail where hybrid CP shards only the long sequence, and on random
// lengths: placement on aligned blocks at one step, the cap per rank, equal counts,
// hybrid never predicted slower than fixed; items (trees) with their own shares.
#include <algorithm>
#include <random>
#include <vector>

#include "seqpack/cp_step.hpp"
#include "test_helpers.hpp"

namespace {

using namespace seqpack;
using seqpack_test::ThrowsInvalid;
using Vec = std::vector<int64_t>;

CpStepOptions options(int64_t dp, int64_t cp, int64_t cap, bool hybrid) {
  CpStepOptions o;
  o.step.dp_size = dp;
  o.step.max_tokens = cap;
  o.step.cost = {1e-3, 1e-4, 2e-9};
  o.cp_size = cp;
  o.hybrid = hybrid;
  o.cp = {1e-6, 2e-3};
  return o;
}

TEST(CpStep, LocalTokensCarryTheZigzagPad) {
  EXPECT_EQ(cp_local_tokens(100, 1), 100);
  EXPECT_EQ(cp_local_tokens(100, 2), 50);  // 100 = 4 chunks of 25
  EXPECT_EQ(cp_local_tokens(101, 2), 52);  // padded to 104
  EXPECT_EQ(cp_local_tokens(1, 8), 2);
}

TEST(CpStep, HybridShardsOnlyTheLongTail) {
  Vec lengths{65536};
  lengths.insert(lengths.end(), 40, 2000);
  const CpStepPlan fixed = plan_cp_step(lengths, options(1, 8, 16384, false));
  const CpStepPlan hybrid = plan_cp_step(lengths, options(1, 8, 16384, true));
  EXPECT_TRUE(std::all_of(fixed.degree.begin(), fixed.degree.end(), [](int64_t d) { return d == 8; }));
  EXPECT_TRUE(std::all_of(hybrid.degree.begin() + 1, hybrid.degree.end(), [](int64_t d) { return d == 1; }));
  EXPECT_LT(hybrid.kv_tokens, fixed.kv_tokens);
  EXPECT_LE(hybrid.plan.predicted_time, fixed.plan.predicted_time);
  EXPECT_TRUE(ThrowsInvalid([&] { plan_cp_step(Vec{200000}, options(1, 8, 16384, true)); },
                            {"even sharded over cp_size=8"}));
  EXPECT_TRUE(ThrowsInvalid([&] { plan_cp_step(lengths, options(1, 6, 16384, true)); }, {"power of two"}));
}

TEST(CpStep, PlacementCapAndCounts) {
  std::mt19937_64 rng(3);
  for (int trial = 0; trial < 100; ++trial) {
    const int64_t cp = int64_t{1} << (1 + rng() % 3), dp = 1 + static_cast<int64_t>(rng() % 2);
    Vec lengths(1 + rng() % 20);
    for (auto& s : lengths) s = static_cast<int64_t>(rng() % 400);
    int64_t cap = 2;
    for (int64_t s : lengths) cap = std::max(cap, cp_local_tokens(s, cp));
    cap += static_cast<int64_t>(rng() % 100);
    double times[2];
    for (const bool hybrid : {false, true}) {
      const CpStepPlan p = plan_cp_step(lengths, options(dp, cp, cap, hybrid));
      const MiniBatchStep& mb = p.plan.mini_batches.front();
      const int64_t K = mb.num_micro_batches, R = dp * cp;
      ASSERT_EQ(static_cast<int64_t>(mb.cells.size()), R * K);
      std::vector<Vec> where(lengths.size());  // (rank, step) cells of each sequence
      for (int64_t c = 0; c < R * K; ++c) {
        int64_t tokens = 0;
        for (int64_t i : mb.cells.group(static_cast<size_t>(c))) {
          tokens += cp_local_tokens(lengths[static_cast<size_t>(i)], p.degree[static_cast<size_t>(i)]);
          where[static_cast<size_t>(i)].push_back(c);
        }
        ASSERT_EQ(tokens, mb.tokens[static_cast<size_t>(c)]);
        ASSERT_LE(tokens, cap);
      }
      for (size_t i = 0; i < lengths.size(); ++i) {
        const int64_t d = p.degree[i], first = p.first_rank[i];
        ASSERT_EQ(static_cast<int64_t>(where[i].size()), d);
        ASSERT_EQ(first % d, 0);
        ASSERT_LE(first % cp + d, cp);
        const int64_t k = where[i].front() % K;
        for (int64_t j = 0; j < d; ++j) ASSERT_EQ(where[i][static_cast<size_t>(j)], (first + j) * K + k);
      }
      ASSERT_LE(mb.lower_bound, mb.predicted_time);
      times[hybrid] = p.plan.predicted_time;
    }
    ASSERT_LE(times[1], times[0] * (1 + 1e-9));
  }
}

}  // namespace

namespace {

TEST(CpStep, ItemsCarryTheirOwnShareAndWork) {
  // Two items of 64 tokens whose ranks' shares are uneven (a tree cut by work): the
  // cap is checked on the given share, not on tokens / d; mini-batches by sizes.
  CpItems items;
  items.levels = 3;  // degrees 1, 2, 4
  items.tokens = {64, 64, 8};
  items.squares = {4096, 2000, 64};
  items.local = {64, 40, 22, 64, 36, 20, 8, 4, 2};
  items.name = "trees";
  CpStepOptions o = options(1, 4, 38, true);
  o.step.mini_batches = 2;
  const Vec sizes{2, 1};
  o.step.mini_batch_sizes = sizes;
  const CpStepPlan plan = plan_cp_step(items, o);
  ASSERT_EQ(plan.plan.mini_batches.size(), 2u);
  EXPECT_EQ(plan.plan.mini_batches[0].begin, 0);
  EXPECT_EQ(plan.plan.mini_batches[1].begin, 2);
  EXPECT_EQ(plan.degree[0], 4);  // 40 > 38 at degree 2
  EXPECT_GE(plan.degree[1], 2);  // 36 fits at degree 2 (spread further when faster)
  for (const int64_t t : plan.plan.mini_batches[0].tokens) EXPECT_LE(t, 38);
  EXPECT_EQ(plan.least_kv_tokens, 64 * 3 + 64 * 1);
  o.min_degree = 2;
  EXPECT_GE(plan_cp_step(items, o).degree[2], 2);
  o.min_degree = 3;
  EXPECT_TRUE(ThrowsInvalid([&] { plan_cp_step(items, o); }, {"min_cp_degree must be a power of two"}));
  o.min_degree = 1;
  items.local.pop_back();
  EXPECT_TRUE(ThrowsInvalid([&] { plan_cp_step(items, o); }, {"trees: per item, its squares and its local tokens"}));
}

TEST(CpStep, OneShardedSequenceAStepIsTriedUnderEitherSync) {
  // 14 sequences of 1000 tokens at a cap of 600 per rank over C = 2: each is a step of
  // its own (500 + 500 > 600). The count search must reach K = 14 under sync "step" too.
  for (const bool hybrid : {false, true})
    for (const StepSync sync : {StepSync::MicroBatch, StepSync::Step}) {
      CpStepOptions o = options(1, 2, 600, hybrid);
      o.step.sync = sync;
      const CpStepPlan plan = plan_cp_step(Vec(14, 1000), o);
      EXPECT_EQ(plan.plan.mini_batches[0].num_micro_batches, 14);
    }
  EXPECT_TRUE(ThrowsInvalid([] { plan_cp_step(Vec{5, 3}, options(1, int64_t{1} << 40, 8, false)); },
                            {"cp_size=1099511627776 is more than the 1048576 ranks"}));
}

}  // namespace
