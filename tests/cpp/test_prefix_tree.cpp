#include <algorithm>
#include <random>
#include <string_view>
#include <vector>

#include "seqpack/prefix_tree.hpp"
#include "test_helpers.hpp"

namespace {

using namespace seqpack;
using seqpack_test::ThrowsInvalid;
using Vec = std::vector<int64_t>;
using Rows = std::vector<Vec>;

using Flat = seqpack_test::FlatRows;
constexpr auto flatten = [](const Rows& rows) { return seqpack_test::flatten_rows(rows); };

PrefixTree build(const Rows& rows, const Vec& groups = {}, int64_t min_shared = 1, int64_t pad_to = 1) {
  const Flat f = flatten(rows);
  return build_prefix_tree(f.tokens, f.cu, groups, {min_shared, pad_to, -7});
}

int64_t lcp(const Vec& a, const Vec& b) {
  size_t k = 0;
  while (k < a.size() && k < b.size() && a[k] == b[k]) ++k;
  return static_cast<int64_t>(k);
}

TEST(PrefixTree, TheHeaderExample) {
  const PrefixTree t = build({{5, 6, 7}, {5, 6, 8, 9}, {5, 6}, {5}}, {0, 0, 0, 1});
  EXPECT_EQ(t.input_ids, (Vec{5, 6, 7, 8, 9, 5}));
  EXPECT_EQ(t.parent, (Vec{-1, 0, 1, 1, 3, -1}));
  EXPECT_EQ(t.subtree_end, (Vec{5, 5, 3, 5, 5, 6}));
  EXPECT_EQ(t.position_ids, (Vec{0, 1, 2, 2, 3, 0}));
  EXPECT_EQ(t.logical_index, (Vec{0, 1, 2, 0, 1, 3, 4, 0, 1, 5}));
  EXPECT_EQ(t.cu_seqlens, (Vec{0, 3, 7, 9, 10}));
  EXPECT_EQ(t.segment_offsets, (Vec{0, 2, 3, 5, 6}));
  EXPECT_EQ(t.segment_parent, (Vec{-1, 0, 0, -1}));
  EXPECT_EQ(t.first_logical, (Vec{0, 1, 2, 5, 6, 9}));
  EXPECT_EQ(t.num_pad_tokens, 0);
}

TEST(PrefixTree, MinSharedTokensSharesOnlyLongCommonPrefixes) {
  const PrefixTree t = build({{1, 2, 3, 4}, {1, 2, 3, 5}, {1, 2, 7}, {1, 2}, {1, 2}}, {}, 3);
  // "1 2 3" once, then 4 and 5; "1 2 7", and each "1 2" alone.
  EXPECT_EQ(t.num_tokens(), 5 + 3 + 2 + 2);
  EXPECT_EQ(t.input_ids, (Vec{1, 2, 3, 4, 5, 1, 2, 7, 1, 2, 1, 2}));
  EXPECT_EQ(t.logical_index, (Vec{0, 1, 2, 3, 0, 1, 2, 4, 5, 6, 7, 8, 9, 10, 11}));
}

TEST(PrefixTree, ZeroAndOneMinSharedAgree) {
  const Rows rows{{1, 2}, {1, 3}, {}, {4}, {1, 2}};
  EXPECT_EQ(build(rows, {}, 0), build(rows, {}, 1));
}

TEST(PrefixTree, EmptyRowsDuplicatesAndRowsInsideRows) {
  const PrefixTree t = build({{}, {3, 4, 5}, {3, 4, 5}, {}, {3, 4}, {3}});
  EXPECT_EQ(t.input_ids, (Vec{3, 4, 5}));
  EXPECT_EQ(t.cu_seqlens, (Vec{0, 0, 3, 6, 6, 8, 9}));
  EXPECT_EQ(t.logical_index, (Vec{0, 1, 2, 0, 1, 2, 0, 1, 0}));
  // Rows end at 3 and at 4: every node starts a segment.
  EXPECT_EQ(t.segment_offsets, (Vec{0, 1, 2, 3}));
  EXPECT_EQ(t.segment_parent, (Vec{-1, 0, 1}));
}

TEST(PrefixTree, NoRowsAndOnlyEmptyRows) {
  const PrefixTree none = build({});
  EXPECT_EQ(none.num_tokens(), 0);
  EXPECT_EQ(none.segment_offsets, (Vec{0}));
  const PrefixTree empty = build({{}, {}}, {}, 1, 4);
  EXPECT_EQ(empty.num_tokens(), 0);
  EXPECT_EQ(empty.cu_seqlens, (Vec{0, 0, 0}));
}

TEST(PrefixTree, GroupsNeverShare) {
  const PrefixTree t = build({{1, 2}, {1, 2}, {1, 2}}, {7, -3, 7});
  EXPECT_EQ(t.input_ids, (Vec{1, 2, 1, 2}));
  EXPECT_EQ(t.logical_index, (Vec{0, 1, 2, 3, 0, 1}));
}

TEST(PrefixTree, PadTokensAreTheirOwnRoots) {
  const PrefixTree t = build({{1, 2, 3}, {1, 4}}, {}, 1, 8);
  EXPECT_EQ(t.num_tokens(), 8);
  EXPECT_EQ(t.num_pad_tokens, 4);
  EXPECT_EQ(t.input_ids, (Vec{1, 2, 3, 4, -7, -7, -7, -7}));
  EXPECT_EQ(t.parent, (Vec{-1, 0, 1, 0, -1, -1, -1, -1}));
  EXPECT_EQ(t.subtree_end, (Vec{4, 3, 3, 4, 5, 6, 7, 8}));
  EXPECT_EQ(t.first_logical, (Vec{0, 1, 2, 4, -1, -1, -1, -1}));
  EXPECT_EQ(t.segment_offsets, (Vec{0, 1, 3, 4, 5, 6, 7, 8}));
  EXPECT_EQ(t.segment_parent, (Vec{-1, 0, 0, -1, -1, -1, -1}));
}

TEST(PrefixTree, BadArgumentsThrowNamingThem) {
  const Vec tokens{1, 2, 3};
  EXPECT_TRUE(ThrowsInvalid([&] { build_prefix_tree(tokens, Vec{}, {}); }, {"cu_seqlens", "at least one"}));
  EXPECT_TRUE(ThrowsInvalid([&] { build_prefix_tree(tokens, Vec{1, 3}, {}); }, {"cu_seqlens", "start at 0"}));
  EXPECT_TRUE(ThrowsInvalid([&] { build_prefix_tree(tokens, Vec{0, 2, 1, 3}, {}); }, {"cu_seqlens", "decrease"}));
  EXPECT_TRUE(ThrowsInvalid([&] { build_prefix_tree(tokens, Vec{0, 2}, {}); }, {"cu_seqlens", "end at"}));
  EXPECT_TRUE(ThrowsInvalid([&] { build_prefix_tree(tokens, Vec{0, 3}, Vec{1, 2}); }, {"group_ids", "one id"}));
  EXPECT_TRUE(ThrowsInvalid([&] { build_prefix_tree(tokens, Vec{0, 3}, {}, {-1, 1, 0}); }, {"min_shared_tokens"}));
  EXPECT_TRUE(ThrowsInvalid([&] { build_prefix_tree(tokens, Vec{0, 3}, {}, {1, 0, 0}); }, {"pad_to_multiple_of"}));
  EXPECT_TRUE(ThrowsInvalid([&] { build_prefix_tree(tokens, Vec{0, 3}, {}, {1, INT64_MAX, 0}); },
                            {"pad_to_multiple_of", "at most 2^24"}));
}

// Random forests against the definition: logical tokens (r, p) and (s, p) are one
// physical token iff same group, p < lcp(r, s) and lcp(r, s) >= max(m, 1).
TEST(PrefixTree, RandomForestsMatchTheDefinition) {
  std::mt19937_64 rng(123);
  for (int trial = 0; trial < 300; ++trial) {
    const int n_rows = static_cast<int>(rng() % 9);
    const int64_t vocab = 1 + static_cast<int64_t>(rng() % 3), m = static_cast<int64_t>(rng() % 4);
    Rows rows;
    Vec groups;
    for (int r = 0; r < n_rows; ++r) {
      Vec row = (r > 0 && rng() % 2) ? rows[rng() % rows.size()] : Vec{};
      row.resize(std::min<size_t>(row.size(), rng() % 7));
      const size_t extra = rng() % 5;
      for (size_t k = 0; k < extra; ++k) row.push_back(static_cast<int64_t>(rng() % vocab));
      rows.push_back(row);
      groups.push_back(static_cast<int64_t>(rng() % 2));
    }
    const bool grouped = rng() % 2;
    const int64_t pad_to = 1 + static_cast<int64_t>(rng() % 3);
    const PrefixTree t = build(rows, grouped ? groups : Vec{}, m, pad_to);
    const Flat f = flatten(rows);
    for (int r = 0; r < n_rows; ++r)
      for (int s = 0; s < n_rows; ++s) {
        const int64_t l = lcp(rows[r], rows[s]);
        const bool same_group = !grouped || groups[r] == groups[s];
        for (int64_t p = 0; p < static_cast<int64_t>(std::min(rows[r].size(), rows[s].size())); ++p) {
          const bool shared = r == s || (same_group && p < l && l >= std::max<int64_t>(m, 1));
          ASSERT_EQ(t.logical_index[f.cu[r] + p] == t.logical_index[f.cu[s] + p], shared) << trial;
        }
      }
    const int64_t T = t.num_tokens(), real = T - t.num_pad_tokens;
    for (size_t i = 0; i < f.tokens.size(); ++i) ASSERT_EQ(t.input_ids[t.logical_index[i]], f.tokens[i]);
    for (int r = 0; r < n_rows; ++r)
      for (int64_t p = 0; p < static_cast<int64_t>(rows[r].size()); ++p) {
        const int64_t i = t.logical_index[f.cu[r] + p];
        ASSERT_EQ(t.position_ids[i], p);
        ASSERT_EQ(t.parent[i], p == 0 ? -1 : t.logical_index[f.cu[r] + p - 1]);
      }
    // Ancestor rule, from parent chains.
    for (int64_t i = 0; i < T; ++i) {
      std::vector<bool> ancestor(static_cast<size_t>(T), false);
      for (int64_t a = i; a >= 0; a = t.parent[a]) ancestor[a] = true;
      for (int64_t j = 0; j < T; ++j) ASSERT_EQ(j <= i && i < t.subtree_end[j], ancestor[j]);
    }
    // Segments: contiguous, every non-first member is the single child of the one before.
    ASSERT_EQ(t.segment_offsets.front(), 0);
    ASSERT_EQ(t.segment_offsets.back(), T);
    for (size_t s = 0; s + 1 < t.segment_offsets.size(); ++s) {
      const int64_t a = t.segment_offsets[s], b = t.segment_offsets[s + 1];
      ASSERT_LT(a, b);
      for (int64_t i = a + 1; i < b; ++i) ASSERT_EQ(t.parent[i], i - 1);
      const int64_t p = t.parent[a];
      const auto& off = t.segment_offsets;
      const int64_t segment_of_p = std::upper_bound(off.begin(), off.end(), p) - off.begin() - 1;
      ASSERT_EQ(t.segment_parent[s], p < 0 ? -1 : segment_of_p);
    }
    for (int64_t i = real; i < T; ++i) ASSERT_EQ(t.input_ids[i], -7);
    ASSERT_EQ(T % pad_to, 0);
    ASSERT_LT(t.num_pad_tokens, pad_to);
  }
}

}  // namespace

// ---- check_prefix_tree: the contract of a tree given from outside ------------------
namespace {

PrefixTreeView view_of(const PrefixTree& t) {
  return {t.input_ids,    t.position_ids,  t.parent,          t.subtree_end,    t.first_logical,
          t.logical_index, t.cu_seqlens,    t.segment_offsets, t.segment_parent, t.num_pad_tokens};
}

}  // namespace

TEST(PrefixTreeCheck, EveryBuiltTreePasses) {
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 300; ++trial) {
    Rows rows;
    const int n = static_cast<int>(rng() % 8);
    for (int r = 0; r < n; ++r) {
      Vec row = rows.empty() || rng() % 2 ? Vec{} : rows[rng() % rows.size()];
      row.resize(rng() % (row.size() + 1));
      for (int k = static_cast<int>(rng() % 5); k > 0; --k) row.push_back(static_cast<int64_t>(rng() % 3));
      rows.push_back(row);
    }
    const PrefixTree t = build(rows, {}, static_cast<int64_t>(rng() % 3), 1 + static_cast<int64_t>(rng() % 4));
    EXPECT_NO_THROW(check_prefix_tree("test", view_of(t)));
  }
}

TEST(PrefixTreeCheck, TamperedArraysAreRefused) {
  const PrefixTree good = build({{5, 6, 7}, {5, 6, 8, 9}, {5, 6}, {5}}, {0, 0, 0, 1}, 1, 4);
  auto refused = [&](auto edit, std::initializer_list<std::string_view> words) {
    PrefixTree t = good;
    edit(t);
    return ThrowsInvalid([&] { check_prefix_tree("PrefixTreeBatch", view_of(t)); }, words);
  };
  EXPECT_TRUE(refused([](PrefixTree& t) { t.subtree_end[2] = 4; }, {"parent[3]", "depth-first"}));
  EXPECT_TRUE(refused([](PrefixTree& t) { t.subtree_end[0] = 6; }, {"subtree_end"}));
  EXPECT_TRUE(refused([](PrefixTree& t) { t.logical_index[3] = 4; }, {"logical_index[3]", "path from a root"}));
  EXPECT_TRUE(refused([](PrefixTree& t) { t.logical_index[0] = 99; }, {"logical_index[0]", "real token"}));
  EXPECT_TRUE(refused([](PrefixTree& t) { t.position_ids[4] = 7; }, {"position_ids[4]", "depth"}));
  EXPECT_TRUE(refused([](PrefixTree& t) { t.first_logical[1] = 4; }, {"first_logical[1]", "first logical"}));
  EXPECT_TRUE(refused([](PrefixTree& t) { t.segment_parent[1] = -1; }, {"segment_parent[1]"}));
  EXPECT_TRUE(refused([](PrefixTree& t) { t.segment_offsets[1] = 1; }, {"segment_offsets", "segment"}));
  EXPECT_TRUE(refused([](PrefixTree& t) { t.parent[7] = 0; }, {"pad token 7", "own root"}));
  EXPECT_TRUE(refused([](PrefixTree& t) { t.num_pad_tokens = 9; }, {"num_pad_tokens"}));
  EXPECT_TRUE(refused([](PrefixTree& t) { t.cu_seqlens.back() = 3; }, {"cu_seqlens", "end at"}));
  EXPECT_TRUE(refused([](PrefixTree& t) { t.parent.pop_back(); }, {"parent", "one entry per physical token"}));
}

TEST(PrefixTreeCheck, PaddingIsRefusedBeforeItIsAllocated) {
  const Flat f = flatten({{1, 2, 3}});
  EXPECT_TRUE(ThrowsInvalid([&] { build_prefix_tree(f.tokens, f.cu, {}, {1, int64_t{1} << 40, 0}); },
                            {"pad_to_multiple_of", "at most 2^24"}));
  EXPECT_TRUE(ThrowsInvalid([&] { build_prefix_tree(f.tokens, f.cu, {}, {1, (int64_t{1} << 24) + 1, 0}); },
                            {"pad_to_multiple_of"}));
}
