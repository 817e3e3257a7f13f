#pragma once
// The units a tree-aware planner places: whole trees of a prefix forest, or, for a
// tree whose physical tokens exceed the cap, parts of it, each carrying its prefix.
//
// A tree's rows are taken in depth-first order of their last tokens (rows ending
// inside other rows, and duplicates, included). In that order a row adds exactly
// len - lcp(previous row, row) new physical tokens, so a contiguous part [j, i) of
// the order holds  lcp_j + S(i) - S(j)  tokens (S: prefix sums of the new tokens,
// lcp_j: what row j shares with row j - 1), and cutting the order before row j
// duplicates lcp_j tokens:
//
//   rows (DFS order)   new  lcp     cap 8: one item [a b c d] (8 tokens)
//   a = 1 2 3 4         4    0      cap 6: [a b] (5) and [c d] (2 + 1 + 2 = 5),
//   b = 1 2 3 5         1    3             "1 2" in both: 2 tokens duplicated
//   c = 1 2 6           1    2      cap 4: [a] [b] [c] [d]: cuts before b, c, d
//   d = 1 2 7 8         2    2             duplicate 3 + 2 + 2 = 7 tokens
//
// Among contiguous splits whose parts fit the cap, forest_items picks one that
// duplicates the fewest tokens (a DP over cut points with a sliding-window minimum:
// O(rows) per tree after the order), then the fewest parts, then the longest last
// parts.
#include <cstdint>
#include <span>
#include <vector>

#include "seqpack/common.hpp"
#include "seqpack/prefix_forest.hpp"

namespace seqpack {

struct ForestItems {
  IndexGroups rows;             // the rows of each item (CSR), in depth-first order
  std::vector<int64_t> tokens;  // physical tokens of each item (<= the cap)
  std::vector<int64_t> pairs;   // visible attention pairs of each item
  std::vector<int64_t> work;    // the work items each item holds (prefix_forest.hpp), each once
  std::vector<int64_t> tree;    // the tree each item is (part of)
  int64_t duplicated_tokens = 0;  // sum of the items' tokens - the forest's physical tokens
};

// Items of the forest under `max_tokens` (> 0): one per tree that fits, the fewest
// duplicated tokens for each tree that does not. Throws when a single row is longer
// than max_tokens. Items are ordered by tree, then part. O(R log R), without the trie.
//
// `min_items`: when there are fewer items than this (a planner asked for more
// micro-batches than there are trees), the largest item of several rows (then the
// earliest) is halved in depth-first order, each half carrying its prefix, until
// there are enough or every item is one row: O(R log R) with a heap.
ForestItems forest_items(const ForestView& forest, int64_t max_tokens, int64_t min_items = 0);
// The same for a subset of the rows (distinct ids in [0, R); a mini-batch of the
// step): the items hold only these rows, and a tree is what of it they reach.
// `duplicated_tokens` is then relative to the subset's own physical tokens.
ForestItems forest_items(const ForestView& forest, int64_t max_tokens, std::span<const int64_t> rows,
                         int64_t min_items = 0);

}  // namespace seqpack
