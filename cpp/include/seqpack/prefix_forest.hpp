#pragma once
// The prefix forest of a batch: what the planners need of the token trie of all
// its rows (prefix_tree.hpp's sharing rule: groups, min_shared_tokens), kept per
// row (O(rows), whatever the tokens): the rows in depth-first order of the trie and
// the longest common prefix of each row with the one before it in that order.
//
//   rows            trie (node: token)         depth-first order   length   lcp with previous
//   r0 = 5 6 7      5 ─ 6 ─┬─ 7                r2 = 5 6            2        0
//   r1 = 5 6 8 9           └─ 8 ─ 9            r0 = 5 6 7          3        2
//   r2 = 5 6                                   r1 = 5 6 8 9        4        2
//   r3 = 7 (group 1)  7                        r3 = 7              1        0  (another tree)
//
// In that order (as for sorted strings) a row adds length - lcp(previous row, row)
// nodes to the union of the paths before it, and the lcp of two rows is the least
// adjacent lcp between them. So a subset S of rows, taken in that order, costs
//
//   tokens(S) = sum of lengths - sum of lcp(consecutive rows of S)      (its physical tokens)
//   pairs(S)  = sum of P(length) - sum of P(lcp(consecutive rows of S)),  P(x) = x (x + 1) / 2
//
// (pairs: each node attends to its ancestors and itself, depth + 1 keys; a row's
// new nodes have depths lcp .. length - 1): exactly what pack_prefix_tree of those
// rows lays out and tree attention computes. With a sparse table over the adjacent
// lcps a subset costs O(|S| log |S|), without the trie.
//
// Trees: rows whose paths share a node (at least their first token) are one tree,
// contiguous in the order; an empty row is a tree of its own. Tree ids follow each
// tree's first row in the input.
#include <cstdint>
#include <span>
#include <vector>

#include "seqpack/common.hpp"

namespace seqpack {

struct PrefixForest {
  std::vector<int64_t> row_length;    // [R] tokens of each row
  std::vector<int64_t> row_order;     // [R] row ids in depth-first order (by tree, then trie position, then id)
  std::vector<int64_t> adjacent_lcp;  // [R] lcp of row_order[i] with row_order[i - 1] (0 at i = 0 and across trees)
  std::vector<int64_t> tree_of_row;   // [R] dense tree id
  int64_t num_trees = 0;
  int64_t num_nodes = 0;              // the trie's nodes: the batch's physical tokens
  bool operator==(const PrefixForest&) const = default;
};

// The forest of rows given as flat `tokens` and offsets `cu_seqlens` (as
// build_prefix_tree takes them). Linear in the tokens (expected) plus a sort of the
// rows; the trie itself is not kept.
PrefixForest build_prefix_forest(std::span<const int64_t> tokens, Lengths cu_seqlens,
                                 std::span<const int64_t> group_ids, int64_t min_shared_tokens = 1);

// A forest held elsewhere (arrays that came back from Python, a pickle).
struct ForestView {
  std::span<const int64_t> row_length, row_order, adjacent_lcp, tree_of_row;
  int64_t num_trees = 0;
};

inline ForestView view_of(const PrefixForest& f) {
  return {f.row_length, f.row_order, f.adjacent_lcp, f.tree_of_row, f.num_trees};
}

// Checks that a view is consistent: lengths >= 0, row_order a permutation of the
// rows, each tree contiguous in it, adjacent_lcp in [0, both rows' lengths] and 0 at
// the start of each tree, tree ids in [0, num_trees). O(R).
void check_forest(const char* fn, const ForestView& forest);

struct SubsetCost {
  int64_t tokens = 0, pairs = 0;
  bool operator==(const SubsetCost&) const = default;
};

// The cost of each subset k of rows: rows[offsets[k] .. offsets[k + 1]) (row ids in
// [0, R); repeats count once). One check_forest and sparse table per call, then
// O(|S| log |S|) per subset. `out` has one entry per subset.
void forest_subset_costs(const ForestView& forest, std::span<const int64_t> rows, Lengths offsets,
                         std::span<SubsetCost> out);

}  // namespace seqpack
