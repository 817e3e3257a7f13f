// The prefix forest (prefix_forest.hpp): the header's example, subset costs against
// the prefix-tree layout of the same rows, trees, and the checks of a foreign forest.
#include <algorithm>
#include <random>
#include <vector>

#include "seqpack/prefix_forest.hpp"
#include "seqpack/prefix_tree.hpp"
#include "test_helpers.hpp"

namespace {

using namespace seqpack;
using seqpack_test::ThrowsInvalid;
using Vec = std::vector<int64_t>;
using Rows = std::vector<Vec>;

using Flat = seqpack_test::FlatRows;
using seqpack_test::flatten_rows;

std::vector<SubsetCost> costs(const PrefixForest& f, const std::vector<Vec>& subsets) {
  Vec rows, offsets{0};
  for (const Vec& s : subsets) {
    rows.insert(rows.end(), s.begin(), s.end());
    offsets.push_back(static_cast<int64_t>(rows.size()));
  }
  std::vector<SubsetCost> out(subsets.size());
  forest_subset_costs(view_of(f), rows, offsets, out);
  return out;
}

TEST(PrefixForest, TheHeaderExample) {
  const Flat in = flatten_rows({{5, 6, 7}, {5, 6, 8, 9}, {5, 6}, {7}}, {0, 0, 0, 1});
  const PrefixForest f = build_prefix_forest(in.tokens, in.cu, in.groups);
  EXPECT_EQ(f.row_length, (Vec{3, 4, 2, 1}));
  EXPECT_EQ(f.row_order, (Vec{2, 0, 1, 3}));
  EXPECT_EQ(f.adjacent_lcp, (Vec{0, 2, 2, 0}));
  EXPECT_EQ(f.tree_of_row, (Vec{0, 0, 0, 1}));
  EXPECT_EQ(f.num_trees, 2);
  EXPECT_EQ(f.num_nodes, 6);
  const std::vector<SubsetCost> c = costs(f, {{0, 1, 2}, {1}, {0, 2}, {2, 3}, {}, {1, 1, 1}});
  EXPECT_EQ(c, (std::vector<SubsetCost>{{5, 13}, {4, 10}, {3, 6}, {3, 4}, {0, 0}, {4, 10}}));
}

TEST(PrefixForest, EmptyRowsAreTreesOfTheirOwn) {
  const Flat in = flatten_rows({{}, {1, 2}, {}, {1}});
  const PrefixForest f = build_prefix_forest(in.tokens, in.cu, {});
  EXPECT_EQ(f.tree_of_row, (Vec{0, 1, 2, 1}));
  EXPECT_EQ(f.row_order, (Vec{0, 3, 1, 2}));
  EXPECT_EQ(costs(f, {{0, 2}, {0, 1, 3}}), (std::vector<SubsetCost>{{0, 0}, {2, 3}}));
}

// Random rows over a tiny vocabulary, groups and sharing thresholds: a subset costs
// what build_prefix_tree of just those rows lays out (tokens, and the sum of their
// position + 1), and two rows are in one tree exactly when their first tokens are one
// physical token of the whole batch's tree.
TEST(PrefixForest, SubsetsCostTheirOwnTreeLayout) {
  std::mt19937 rng(7);
  for (int round = 0; round < 300; ++round) {
    const int rows = std::uniform_int_distribution<int>(0, 9)(rng);
    Rows data;
    Vec groups;
    for (int r = 0; r < rows; ++r) {
      Vec row;
      const int len = std::uniform_int_distribution<int>(0, 6)(rng);
      for (int k = 0; k < len; ++k) row.push_back(std::uniform_int_distribution<int>(0, 2)(rng));
      data.push_back(row);
      groups.push_back(std::uniform_int_distribution<int>(0, 1)(rng));
    }
    if (round % 2) groups.clear();
    const int64_t min_shared = std::uniform_int_distribution<int>(0, 3)(rng);
    const Flat in = flatten_rows(data, groups);
    const PrefixForest f = build_prefix_forest(in.tokens, in.cu, in.groups, min_shared);
    const PrefixTree whole = build_prefix_tree(in.tokens, in.cu, in.groups, {min_shared, 1, 0});
    ASSERT_EQ(f.num_nodes, whole.num_tokens());
    std::vector<Vec> subsets;
    for (int k = 0; k < 6; ++k) {
      Vec s;
      for (int r = 0; r < rows; ++r)
        if (std::uniform_int_distribution<int>(0, 2)(rng) == 0) s.push_back(r);
      subsets.push_back(s);
    }
    const std::vector<SubsetCost> got = costs(f, subsets);
    for (size_t k = 0; k < subsets.size(); ++k) {
      Rows part;
      Vec part_groups;
      for (int64_t r : subsets[k]) {
        part.push_back(data[static_cast<size_t>(r)]);
        if (!groups.empty()) part_groups.push_back(groups[static_cast<size_t>(r)]);
      }
      const Flat p = flatten_rows(part, part_groups);
      const PrefixTree t = build_prefix_tree(p.tokens, p.cu, p.groups, {min_shared, 1, 0});
      int64_t pairs = 0;
      for (int64_t pos : t.position_ids) pairs += pos + 1;
      EXPECT_EQ(got[k], (SubsetCost{t.num_tokens(), pairs})) << round << " " << k;
    }
    for (int r = 0; r < rows; ++r)
      for (int s = 0; s < rows; ++s) {
        const bool both = !data[r].empty() && !data[s].empty();
        const bool shared = both && whole.logical_index[static_cast<size_t>(in.cu[r])] ==
                                        whole.logical_index[static_cast<size_t>(in.cu[s])];
        EXPECT_EQ(f.tree_of_row[r] == f.tree_of_row[s], r == s || shared) << round << " " << r << " " << s;
      }
  }
}

TEST(PrefixForest, ForeignForestsAndBadSubsetsThrow) {
  const Flat in = flatten_rows({{1, 2, 3}, {1, 4}, {5}});
  const PrefixForest f = build_prefix_forest(in.tokens, in.cu, {});
  std::vector<SubsetCost> one(1);
  auto with = [&](auto change) {
    PrefixForest g = f;
    change(g);
    return g;
  };
  const PrefixForest not_permutation = with([](PrefixForest& g) { g.row_order[1] = g.row_order[0]; });
  const PrefixForest lcp_too_long = with([](PrefixForest& g) { g.adjacent_lcp[1] = 3; });
  const PrefixForest lcp_across_trees = with([](PrefixForest& g) { g.adjacent_lcp[2] = 1; });
  const PrefixForest bad_tree = with([](PrefixForest& g) { g.tree_of_row[0] = 7; });
  EXPECT_TRUE(ThrowsInvalid([&] { check_forest("t", view_of(not_permutation)); }, {"permutation"}));
  EXPECT_TRUE(ThrowsInvalid([&] { check_forest("t", view_of(lcp_too_long)); }, {"adjacent_lcp[1] = 3"}));
  EXPECT_TRUE(ThrowsInvalid([&] { check_forest("t", view_of(lcp_across_trees)); }, {"adjacent_lcp[2] = 1"}));
  EXPECT_TRUE(ThrowsInvalid([&] { check_forest("t", view_of(bad_tree)); }, {"tree_of_row[0] = 7"}));
  const PrefixForest interleaved = with([](PrefixForest& g) {
    g.row_order = {0, 2, 1};
    g.adjacent_lcp = {0, 0, 0};
  });
  EXPECT_TRUE(ThrowsInvalid([&] { check_forest("t", view_of(interleaved)); }, {"contiguous"}));
  EXPECT_TRUE(ThrowsInvalid([&] { forest_subset_costs(view_of(f), Vec{0, 3}, Vec{0, 2}, one); }, {"row id 3"}));
  EXPECT_TRUE(ThrowsInvalid([&] { forest_subset_costs(view_of(f), Vec{0}, Vec{0, 2}, one); }, {"offsets"}));
  EXPECT_TRUE(ThrowsInvalid([&] { forest_subset_costs(view_of(lcp_too_long), Vec{0}, Vec{0, 1}, one); },
                            {"adjacent_lcp"}));
  EXPECT_TRUE(ThrowsInvalid([&] { build_prefix_forest(in.tokens, Vec{0, 3}, {}); }, {"cu_seqlens"}));
}

// The header's work-item example: a and b share "s I I I q" (their image), c only "s".
TEST(PrefixForest, WorkItemsCountOncePerSetThatHoldsTheirTokens) {
  const Flat in = flatten_rows({{1, 9, 9, 9, 2, 3}, {1, 9, 9, 9, 2, 4}, {1, 8, 8, 8, 2, 5}});
  const PrefixForest f = build_prefix_forest(in.tokens, in.cu, {});
  const Vec offsets{0, 1, 2, 3}, ends{4, 4, 4}, work{9, 9, 7};
  ForestView v = view_of(f);
  v.item_offsets = offsets;
  v.item_end = ends;
  v.item_work = work;
  Vec rows, cuts{0};
  for (const Vec& s : std::vector<Vec>{{0, 1}, {0, 2}, {2}, {0, 1, 2}, {}}) {
    rows.insert(rows.end(), s.begin(), s.end());
    cuts.push_back(static_cast<int64_t>(rows.size()));
  }
  std::vector<SubsetCost> out(5);
  forest_subset_costs(v, rows, cuts, out);
  EXPECT_EQ(out[0].work, 9);
  EXPECT_EQ(out[1].work, 16);
  EXPECT_EQ(out[2].work, 7);
  EXPECT_EQ(out[3].work, 16);
  EXPECT_EQ(out[4].work, 0);
  EXPECT_EQ(v.item_work_upto(0, 3), 0);  // the image ends at token 4
  EXPECT_EQ(v.item_work_upto(0, 4), 9);
  auto items = [&](const Vec& o, const Vec& e, const Vec& w) {
    ForestView b = view_of(f);
    b.item_offsets = o;
    b.item_end = e;
    b.item_work = w;
    return b;
  };
  const Vec o3{0, 1, 2, 3}, o2{0, 1, 2}, e2{4, 4}, w2{1, 1}, ones{1, 1, 1}, fours{4, 4, 4};
  const Vec e_zero{4, 0, 4}, e_past{4, 7, 4}, o_twice{0, 2, 2, 3}, e_back{4, 3, 4}, w_neg{1, -1, 1}, o_down{0, 2, 1, 3};
  EXPECT_TRUE(ThrowsInvalid([&] { check_forest("t", items(o2, e2, w2)); }, {"item_offsets", "one offset per row"}));
  EXPECT_TRUE(ThrowsInvalid([&] { check_forest("t", items(o3, e_zero, ones)); }, {"item_end[1] = 0"}));
  EXPECT_TRUE(ThrowsInvalid([&] { check_forest("t", items(o3, e_past, ones)); }, {"item_end[1] = 7", "[1, 6]"}));
  EXPECT_TRUE(ThrowsInvalid([&] { check_forest("t", items(o_twice, e_back, ones)); },
                            {"item_end[1] = 3", "previous item"}));
  EXPECT_TRUE(ThrowsInvalid([&] { check_forest("t", items(o3, fours, w_neg)); }, {"item_work[1]", ">= 0"}));
  EXPECT_TRUE(ThrowsInvalid([&] { check_forest("t", items(o_down, fours, ones)); }, {"never decrease"}));
  EXPECT_TRUE(ThrowsInvalid([&] { check_forest("t", items(o3, e2, w2)); }, {"item_end and item_work"}));
}

}  // namespace
