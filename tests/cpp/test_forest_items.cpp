// Items of a prefix forest under a cap (forest_items.hpp): the header's example, and
// on random forests: every row in exactly one item, every item within the cap and
// costed exactly, whole trees kept whole when they fit, and the fewest duplicated
// tokens among contiguous splits (against a brute force over every cut set).
#include <algorithm>
#include <random>
#include <vector>

#include "seqpack/forest_items.hpp"
#include "test_helpers.hpp"

namespace {

using namespace seqpack;
using seqpack_test::ThrowsInvalid;
using Vec = std::vector<int64_t>;
using Rows = std::vector<Vec>;

using Batch = seqpack_test::FlatRows;
using seqpack_test::flatten_rows;

ForestItems items_of(const PrefixForest& f, int64_t cap) { return forest_items(view_of(f), cap); }

TEST(ForestItems, TheHeaderExample) {
  const Batch b = flatten_rows({{1, 2, 3, 4}, {1, 2, 3, 5}, {1, 2, 6}, {1, 2, 7, 8}});
  const PrefixForest f = build_prefix_forest(b.tokens, b.cu, {});
  const ForestItems whole = items_of(f, 8);
  EXPECT_EQ(whole.rows.to_nested(), (Rows{{0, 1, 2, 3}}));
  EXPECT_EQ(whole.tokens, (Vec{8}));
  EXPECT_EQ(whole.duplicated_tokens, 0);
  const ForestItems six = items_of(f, 6);
  EXPECT_EQ(six.rows.to_nested(), (Rows{{0, 1}, {2, 3}}));
  EXPECT_EQ(six.tokens, (Vec{5, 5}));
  EXPECT_EQ(six.pairs, (Vec{1 + 2 + 3 + 4 + 4, 1 + 2 + 3 + 3 + 4}));
  EXPECT_EQ(six.duplicated_tokens, 2);
  const ForestItems four = items_of(f, 4);
  EXPECT_EQ(four.rows.to_nested(), (Rows{{0}, {1}, {2}, {3}}));
  EXPECT_EQ(four.duplicated_tokens, 7);
  EXPECT_TRUE(ThrowsInvalid([&] { items_of(f, 3); }, {"row 0 has 4 tokens", "max_tokens = 3"}));
}

// The fewest duplicated tokens of any contiguous split of `order` (row positions),
// by trying every set of cut points.
int64_t brute_force_duplicates(const PrefixForest& f, const Vec& order, int64_t cap) {
  const auto n = static_cast<int64_t>(order.size());
  int64_t best = -1;
  for (int64_t mask = 0; mask < (int64_t{1} << (n - 1)); ++mask) {
    Vec rows, offsets{0};
    for (int64_t i = 0; i < n; ++i) {
      if (i > 0 && (mask >> (i - 1) & 1)) offsets.push_back(static_cast<int64_t>(rows.size()));
      rows.push_back(order[static_cast<size_t>(i)]);
    }
    offsets.push_back(static_cast<int64_t>(rows.size()));
    std::vector<SubsetCost> c(offsets.size() - 1);
    forest_subset_costs(view_of(f), rows, offsets, c);
    int64_t sum = 0;
    bool fits = true;
    for (const SubsetCost& x : c) {
      sum += x.tokens;
      fits = fits && x.tokens <= cap;
    }
    if (fits && (best < 0 || sum < best)) best = sum;
  }
  std::vector<SubsetCost> whole(1);
  forest_subset_costs(view_of(f), order, Vec{0, n}, whole);
  return best - whole[0].tokens;
}

TEST(ForestItems, RandomForestsSplitExactlyAndOptimally) {
  std::mt19937 rng(11);
  int split_trees = 0;  // the cases that exercise the DP
  for (int round = 0; round < 1000; ++round) {
    Rows data;
    Vec groups;
    const int rows = std::uniform_int_distribution<int>(0, 9)(rng);
    for (int r = 0; r < rows; ++r) {
      Vec row = data.empty() || rng() % 2 ? Vec{} : data[rng() % data.size()];
      row.resize(std::uniform_int_distribution<size_t>(0, row.size())(rng));
      for (int k = std::uniform_int_distribution<int>(0, 4)(rng); k > 0; --k) row.push_back(rng() % 3);
      data.push_back(row);
      groups.push_back(rng() % 2);
    }
    const Batch b = flatten_rows(data, round % 3 ? groups : Vec{});
    const PrefixForest f = build_prefix_forest(b.tokens, b.cu, b.groups);
    int64_t longest = 0;
    for (const Vec& r : data) longest = std::max<int64_t>(longest, static_cast<int64_t>(r.size()));
    const int64_t cap = std::max<int64_t>(1, longest + std::uniform_int_distribution<int>(0, 6)(rng));
    const ForestItems it = items_of(f, cap);
    std::vector<int> seen(data.size(), 0);
    int64_t total = 0;
    for (size_t k = 0; k < it.rows.size(); ++k) {
      ASSERT_LE(it.tokens[k], cap);
      total += it.tokens[k];
      std::vector<SubsetCost> c(1);
      forest_subset_costs(view_of(f), it.rows.group(k), Vec{0, it.rows.group_size(k)}, c);
      EXPECT_EQ(c[0], (SubsetCost{it.tokens[k], it.pairs[k]}));
      for (int64_t r : it.rows.group(k)) {
        ++seen[static_cast<size_t>(r)];
        EXPECT_EQ(f.tree_of_row[static_cast<size_t>(r)], it.tree[k]);
      }
    }
    for (int s : seen) ASSERT_EQ(s, 1);
    EXPECT_EQ(it.duplicated_tokens, total - f.num_nodes);
    // Per tree: whole when it fits; otherwise no contiguous split of its order duplicates fewer tokens.
    for (int64_t t = 0; t < f.num_trees; ++t) {
      Vec order;
      int64_t dup = 0, parts = 0, tree_tokens = 0;
      for (size_t k = 0; k < it.rows.size(); ++k)
        if (it.tree[k] == t) {
          order.insert(order.end(), it.rows.group(k).begin(), it.rows.group(k).end());
          dup += it.tokens[k];
          ++parts;
        }
      std::vector<SubsetCost> whole(1);
      forest_subset_costs(view_of(f), order, Vec{0, static_cast<int64_t>(order.size())}, whole);
      tree_tokens = whole[0].tokens;
      dup -= tree_tokens;
      if (tree_tokens <= cap) EXPECT_EQ(parts, 1) << round;
      split_trees += parts > 1;
      if (order.size() <= 10) EXPECT_EQ(dup, brute_force_duplicates(f, order, cap)) << round << " tree " << t;
    }
  }
  EXPECT_GT(split_trees, 100);
}

TEST(ForestItems, SubsetsOfRows) {
  const Batch b = flatten_rows({{1, 2, 3, 4}, {1, 2, 3, 5}, {1, 2, 6}, {1, 2, 7, 8}, {9}});
  const PrefixForest f = build_prefix_forest(b.tokens, b.cu, {});
  const ForestItems it = forest_items(view_of(f), 6, Vec{3, 1, 4});
  EXPECT_EQ(it.rows.to_nested(), (Rows{{1, 3}, {4}}));  // 4 + 2 = 6 tokens: b and d share "1 2"
  EXPECT_EQ(it.tokens, (Vec{6, 1}));
  EXPECT_EQ(it.duplicated_tokens, 0);
  EXPECT_TRUE(ThrowsInvalid([&] { forest_items(view_of(f), 6, Vec{1, 1}); }, {"row id 1 is repeated"}));
  EXPECT_TRUE(ThrowsInvalid([&] { forest_items(view_of(f), 6, Vec{5}); }, {"row id 5"}));
}

TEST(ForestItems, BadArgumentsThrow) {
  const Batch b = flatten_rows({{1, 2}, {1, 3}});
  const PrefixForest f = build_prefix_forest(b.tokens, b.cu, {});
  EXPECT_TRUE(ThrowsInvalid([&] { forest_items(view_of(f), 0); }, {"max_tokens"}));
  PrefixForest g = f;
  g.tree_of_row = {0, 1};
  EXPECT_TRUE(ThrowsInvalid([&] { forest_items(view_of(g), 5); }, {"tree_of_row[1] = 1"}));
}

}  // namespace
