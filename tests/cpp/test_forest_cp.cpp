// Context parallelism over a prefix forest (forest_cp.hpp): the header's cut, the
// items of a small forest, its plan back on rows, and on random GRPO-like forests:
// every row once, a tree whole on one block at one micro-batch step.
#include <algorithm>
#include <random>
#include <set>
#include <vector>

#include "seqpack/forest_cp.hpp"
#include "test_helpers.hpp"

namespace {

using namespace seqpack;
using seqpack_test::ThrowsInvalid;
using Vec = std::vector<int64_t>;
using Rows = std::vector<Vec>;

PrefixForest forest_of(const Rows& rows, const Vec& groups = {}) {
  const auto b = seqpack_test::flatten_rows(rows, groups);
  return build_prefix_forest(b.tokens, b.cu, b.groups);
}

TEST(ForestCp, WorkBoundsOfTheHeader) {
  // p p p p a a a / p p p p b b b: keys seen 1..7 then 5 6 7.
  const Vec work{1, 2, 3, 4, 5, 6, 7, 5, 6, 7};
  EXPECT_EQ(cp_work_bounds(work, 2), (Vec{0, 6, 10}));
  EXPECT_EQ(cp_work_bounds(work, 1), (Vec{0, 10}));
  EXPECT_EQ(cp_work_bounds(Vec{1, 2, 3}, 3), (Vec{0, 2, 2, 3}));  // a rank may hold nothing
  EXPECT_EQ(cp_work_bounds(Vec{}, 4), (Vec{0, 0, 0, 0, 0}));
  EXPECT_TRUE(ThrowsInvalid([] { cp_work_bounds(Vec{int64_t{1} << 61, int64_t{1} << 61}, 4); }, {"overflows"}));
  EXPECT_TRUE(ThrowsInvalid([] { cp_work_bounds(Vec{1, -1}, 2); }, {"work[1] = -1"}));
}

TEST(ForestCp, ItemsAndPlanOfASmallForest) {
  const PrefixForest f = forest_of({{1, 2, 3, 4, 5}, {1, 2, 3, 4, 6}, {7, 8, 9}});
  const ForestCpItems items = forest_cp_items(view_of(f), Vec{3}, 2);
  EXPECT_EQ(items.rows.to_nested(), (Rows{{0, 1}, {2}}));
  EXPECT_EQ(items.items.tokens, (Vec{6, 3}));
  EXPECT_EQ(items.items.squares, (Vec{34, 9}));  // 2 pairs - tokens: 2 (1+2+3+4+5+5) - 6, 2 (1+2+3) - 3
  EXPECT_EQ(items.items.local, (Vec{6, 4, 3, 2}));
  EXPECT_EQ(items.mini_batch_sizes, (Vec{2}));
  CpStepOptions o;
  o.step.dp_size = 1;
  o.step.max_tokens = 4;
  o.step.cost = {0.0, 1.0, 0.0};
  o.cp_size = 2;
  o.hybrid = true;
  o.cp.per_kv_token = 1.0;
  const CpStepPlan plan = plan_forest_cp_step(view_of(f), o);
  EXPECT_EQ(plan.degree, (Vec{2, 2, 1}));
  EXPECT_EQ(plan.plan.mini_batches[0].cells.to_nested(), (Rows{{0, 1}, {2}, {0, 1}, {}}));
  EXPECT_EQ(plan.plan.mini_batches[0].end, 3);
  EXPECT_TRUE(ThrowsInvalid([&] { forest_cp_items(view_of(f), Vec{3}, 3); }, {"power of two"}));
  o.step.mini_batches = 4;
  EXPECT_TRUE(ThrowsInvalid([&] { plan_forest_cp_step(view_of(f), o); }, {"3 sequences cannot fill"}));
}

TEST(ForestCp, RandomForestsKeepTreesWholeOnABlock) {
  std::mt19937_64 rng(5);
  for (int trial = 0; trial < 100; ++trial) {
    Rows rows;
    Vec groups;
    for (int64_t p = 0, prompts = 1 + static_cast<int64_t>(rng() % 6); p < prompts; ++p) {
      Vec prompt(static_cast<size_t>(1 + rng() % 20));
      for (auto& t : prompt) t = static_cast<int64_t>(rng() % 1000);
      for (uint64_t r = 0, n = 1 + rng() % 5; r < n; ++r) {
        Vec row = prompt;
        for (uint64_t k = 0, m = 1 + rng() % 12; k < m; ++k) row.push_back(static_cast<int64_t>(rng() % 1000));
        rows.push_back(row);
        groups.push_back(p);
      }
    }
    const PrefixForest f = forest_of(rows, groups);
    CpStepOptions o;
    o.step.dp_size = 1 + static_cast<int64_t>(rng() % 2);
    o.step.max_tokens = 40 + static_cast<int64_t>(rng() % 40);
    o.step.mini_batches = 1 + static_cast<int64_t>(rng() % std::min<size_t>(2, rows.size()));
    o.cp_size = 4;
    o.hybrid = rng() % 2;
    o.cp.per_kv_token = 0.01;
    CpStepPlan plan;
    try {
      plan = plan_forest_cp_step(view_of(f), o);
    } catch (const std::invalid_argument&) {
      continue;  // a tree too large for the cap even over all 4 ranks
    }
    std::set<int64_t> seen;
    for (const MiniBatchStep& mb : plan.plan.mini_batches) {
      const int64_t K = mb.num_micro_batches;
      for (size_t c = 0; c < mb.cells.size(); ++c) {
        EXPECT_LE(mb.tokens[c], o.step.max_tokens);
        const auto r = static_cast<int64_t>(c) / K;
        for (int64_t row : mb.cells.group(c)) {
          const auto u = static_cast<size_t>(row);
          EXPECT_TRUE(plan.first_rank[u] <= r && r < plan.first_rank[u] + plan.degree[u]);
          EXPECT_EQ(plan.first_rank[u] % plan.degree[u], 0);
          if (r == plan.first_rank[u]) EXPECT_TRUE(seen.insert(row).second);
        }
      }
      // every row of a tree sits with the tree's other rows of the mini-batch
      for (int64_t row = mb.begin; row < mb.end; ++row)
        for (int64_t other = mb.begin; other < mb.end; ++other)
          if (f.tree_of_row[static_cast<size_t>(row)] == f.tree_of_row[static_cast<size_t>(other)]) {
            EXPECT_EQ(plan.degree[static_cast<size_t>(row)], plan.degree[static_cast<size_t>(other)]);
            EXPECT_EQ(plan.first_rank[static_cast<size_t>(row)], plan.first_rank[static_cast<size_t>(other)]);
          }
    }
    EXPECT_EQ(seen.size(), rows.size());
  }
}

}  // namespace
