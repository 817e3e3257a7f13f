#pragma once
// The prefix forest of a batch: the token trie of all its rows (prefix_tree.hpp's
// sharing rule: groups, min_shared_tokens) kept as parent and depth arrays instead
// of being laid out, for the planners. What a subset of rows costs is what its own
// prefix-tree layout would hold:
//
//   rows            trie (node: token)           subset          tokens  pairs
//   r0 = 5 6 7      0:5 ─ 1:6 ─┬─ 2:7            {r0, r1, r2}    5       1+2+3+3+4 = 13
//   r1 = 5 6 8 9               └─ 3:8 ─ 4:9      {r1}            4       1+2+3+4 = 10
//   r2 = 5 6                                     {r0, r2}        3       6
//   r3 = 7 (group 1)  5:7                        {r2, r3}        3       1+2+1 = 4
//
//   tokens(S) = |the union of S's root-to-row paths| (its physical tokens),
//   pairs(S)  = the sum of depth + 1 over those nodes (each token attends to its
//               ancestors and itself: the visible pairs of tree attention).
//
// Trees: rows whose paths share a node (they share at least their first token) are
// in one tree; an empty row is a tree of its own. Tree ids follow each tree's first
// row. Node ids grow along every path (a parent is created before its children).
#include <cstdint>
#include <span>
#include <vector>

#include "seqpack/common.hpp"

namespace seqpack {

struct PrefixForest {
  std::vector<int64_t> parent;       // [M] parent node, -1 at a root
  std::vector<int64_t> depth;        // [M] 0 at a root
  std::vector<int64_t> row_leaf;     // [R] the node of the row's last token, -1 for an empty row
  std::vector<int64_t> tree_of_row;  // [R] dense tree id
  int64_t num_trees = 0;
  bool operator==(const PrefixForest&) const = default;
};

// The forest of rows given as flat `tokens` and offsets `cu_seqlens` (as
// build_prefix_tree takes them). Linear in the tokens (expected).
PrefixForest build_prefix_forest(std::span<const int64_t> tokens, Lengths cu_seqlens,
                                 std::span<const int64_t> group_ids, int64_t min_shared_tokens = 1);

// A forest held elsewhere (arrays that came back from Python, a pickle).
struct ForestView {
  std::span<const int64_t> parent, depth, row_leaf;
};

// Checks that a view is a forest: parent[i] in [-1, i), depth 0 at roots and
// depth[parent] + 1 elsewhere, row_leaf in [-1, M). O(M + R).
void check_forest(const char* fn, const ForestView& forest);

struct SubsetCost {
  int64_t tokens = 0, pairs = 0;
  bool operator==(const SubsetCost&) const = default;
};

// The cost of each subset k of rows: rows[offsets[k] .. offsets[k + 1]) (row ids in
// [0, R); repeats count once). O(the subset's distinct nodes) each, after one
// check_forest. `out` has one entry per subset.
void forest_subset_costs(const ForestView& forest, std::span<const int64_t> rows, Lengths offsets,
                         std::span<SubsetCost> out);

}  // namespace seqpack
