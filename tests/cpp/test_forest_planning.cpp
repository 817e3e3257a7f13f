// Planning a prefix forest (forest_planning.hpp): the header's worked example, AReaL's
// first-fit tries, and on random GRPO-like forests: every row once, every
// micro-batch's physical tokens within the cap, never worse than the whole-trees plan
// or AReaL's tries (micro-batches, then tokens), whole trees kept whole; the step
// and dynamic-batching planners' counts and caps.
#include <algorithm>
#include <random>
#include <numeric>
#include <tuple>
#include <vector>

#include "seqpack/forest_planning.hpp"
#include "test_helpers.hpp"

namespace {

using namespace seqpack;
using seqpack_test::ThrowsInvalid;
using Vec = std::vector<int64_t>;
using Rows = std::vector<Vec>;

// Four trees of a 1-token prompt and five 2-token responses (11 tokens each).
PrefixForest four_trees() {
  Rows rows;
  for (int64_t t = 0; t < 4; ++t)
    for (int64_t k = 0; k < 5; ++k) rows.push_back({100 + t, 10 * t + k, 10 * t + k});
  const auto b = seqpack_test::flatten_rows(rows);
  return build_prefix_forest(b.tokens, b.cu, {});
}

int64_t sum(const Vec& v) { return std::accumulate(v.begin(), v.end(), int64_t{0}); }

Vec tokens_of(const PrefixForest& f, const IndexGroups& groups) {
  std::vector<SubsetCost> costs(groups.size());
  forest_subset_costs(view_of(f), groups.indices, groups.offsets, costs);
  Vec out;
  for (const auto& c : costs) out.push_back(c.tokens);
  return out;
}

TEST(ForestPlanning, TheHeaderExample) {
  const PrefixForest f = four_trees();
  ForestPlanOptions o;
  o.max_tokens = 16;
  o.whole_trees = true;
  const ForestMicroBatchPlan whole = plan_forest_micro_batches(view_of(f), o);
  EXPECT_EQ(whole.groups.size(), 4u);
  EXPECT_EQ(sum(whole.tokens), 44);
  o.whole_trees = false;
  const ForestMicroBatchPlan split = plan_forest_micro_batches(view_of(f), o);
  EXPECT_EQ(split.groups.size(), 3u);
  EXPECT_EQ(split.lower_bound, 3);
  EXPECT_EQ(split.physical_tokens, 44);
  EXPECT_EQ(sum(split.tokens), 46);  // two prompts repeated: the fewest any 3 micro-batches can hold
  EXPECT_EQ(split.tokens, tokens_of(f, split.groups));
  for (int64_t t : split.tokens) EXPECT_LE(t, 16);
}

TEST(ForestPlanning, FirstFitTrieIsAReaLsRule) {
  const auto b = seqpack_test::flatten_rows({{1, 2, 3}, {1, 2, 4}, {5, 6}, {1, 2, 7}});
  const PrefixForest f = build_prefix_forest(b.tokens, b.cu, {});
  const Vec all{0, 1, 2, 3};
  EXPECT_EQ(first_fit_trie(view_of(f), 5, all).to_nested(), (Rows{{0, 1, 3}, {2}}));
  EXPECT_EQ(first_fit_trie(view_of(f), 5, Vec{2, 0, 1}).to_nested(), (Rows{{0, 2}, {1}}));
  EXPECT_TRUE(ThrowsInvalid([&] { first_fit_trie(view_of(f), 2, all); }, {"row 0 has 3 tokens"}));
  EXPECT_TRUE(ThrowsInvalid([&] { first_fit_trie(view_of(f), 5, Vec{0, 0}); }, {"repeated"}));
}

// GRPO-like forests: `prompts` groups of random responses over a large vocabulary.
PrefixForest random_forest(std::mt19937_64& rng, int64_t prompts) {
  Rows rows;
  Vec groups;
  for (int64_t p = 0; p < prompts; ++p) {
    Vec prompt(static_cast<size_t>(1 + rng() % 12));
    for (auto& t : prompt) t = static_cast<int64_t>(rng() % 1000);
    const auto responses = 1 + rng() % 6;
    for (uint64_t r = 0; r < responses; ++r) {
      Vec row = prompt;
      for (uint64_t k = 0, n = 1 + rng() % 10; k < n; ++k) row.push_back(static_cast<int64_t>(rng() % 1000));
      rows.push_back(row);
      groups.push_back(p);
    }
  }
  const auto b = seqpack_test::flatten_rows(rows, groups);
  return build_prefix_forest(b.tokens, b.cu, b.groups);
}

TEST(ForestPlanning, NeverWorseThanWholeTreesOrFirstFitTries) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const PrefixForest f = random_forest(rng, 1 + static_cast<int64_t>(rng() % 12));
    const int64_t longest = *std::max_element(f.row_length.begin(), f.row_length.end());
    ForestPlanOptions o;
    o.max_tokens = longest + static_cast<int64_t>(rng() % 40);
    const ForestMicroBatchPlan plan = plan_forest_micro_batches(view_of(f), o);
    Vec placed;
    for (int64_t r : plan.groups.indices) placed.push_back(r);
    std::sort(placed.begin(), placed.end());
    Vec all(f.row_length.size());
    std::iota(all.begin(), all.end(), int64_t{0});
    ASSERT_EQ(placed, all);
    ASSERT_EQ(plan.tokens, tokens_of(f, plan.groups));
    for (int64_t t : plan.tokens) ASSERT_LE(t, o.max_tokens);
    ASSERT_LE(plan.lower_bound, static_cast<int64_t>(plan.groups.size()));
    ASSERT_LE(plan.physical_tokens, sum(plan.tokens));
    const auto key = [](size_t count, int64_t tokens) { return std::tuple(count, tokens); };
    const IndexGroups tries = first_fit_trie(view_of(f), o.max_tokens, all);
    ASSERT_LE(key(plan.groups.size(), sum(plan.tokens)), key(tries.size(), sum(tokens_of(f, tries))));
    o.whole_trees = true;
    const ForestMicroBatchPlan whole = plan_forest_micro_batches(view_of(f), o);
    ASSERT_LE(key(plan.groups.size(), sum(plan.tokens)), key(whole.groups.size(), sum(whole.tokens)));
  }
}

TEST(ForestPlanning, StepPlansHaveEqualCountsAndKeepTheCap) {
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 60; ++trial) {
    const PrefixForest f = random_forest(rng, 2 + static_cast<int64_t>(rng() % 10));
    StepOptions o;
    o.dp_size = 1 + static_cast<int64_t>(rng() % 3);
    o.max_tokens = *std::max_element(f.row_length.begin(), f.row_length.end()) + static_cast<int64_t>(rng() % 30);
    o.cost = {10.0, 1.0, 0.01};
    const bool whole = trial % 2 == 1;
    const ForestStepPlan p = plan_forest_step(view_of(f), o, whole);
    const MiniBatchStep& mb = p.plan.mini_batches.front();
    ASSERT_EQ(static_cast<int64_t>(mb.cells.size()), o.dp_size * mb.num_micro_batches);
    ASSERT_EQ(mb.tokens, tokens_of(f, mb.cells));
    for (int64_t t : mb.tokens) ASSERT_LE(t, o.max_tokens);
    ASSERT_LE(mb.lower_bound, mb.predicted_time);
    ASSERT_EQ(mb.cells.indices.size(), f.row_length.size());
  }
}

TEST(ForestPlanning, DynamicBatchingSharesRangesAndKeepsTheCap) {
  const PrefixForest f = four_trees();  // 20 rows
  DynamicBatchingOptions o;
  o.shards = 2;
  o.max_tokens_per_microbatch = 16;
  o.sequence_length_round = 1;
  const DynamicBatchingPlan plan = plan_forest_dynamic_batching(view_of(f), o);
  EXPECT_EQ(plan.shard_chunk_size, 10);
  ASSERT_EQ(plan.chunks.size(), 1u);
  // Each shard holds two whole trees (10 rows); a range of 5 rows holds one tree.
  EXPECT_EQ(plan.chunks[0], (std::vector<MicroBatchRange>{{0, 5, 3}, {5, 10, 3}}));
  EXPECT_EQ(plan.padded_tokens, 44);
  o.pp_size = 4;
  EXPECT_EQ(plan_forest_dynamic_batching(view_of(f), o).chunks[0].size(), 4u);
  o.max_tokens_per_microbatch = 2;
  EXPECT_TRUE(ThrowsInvalid([&] { plan_forest_dynamic_batching(view_of(f), o); }, {"row 0 has 3 tokens"}));
}

}  // namespace
