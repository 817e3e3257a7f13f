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
//
// Work items (optional): work attached to a run of a row's tokens that a set of rows
// pays once when it holds those tokens once - a VLM's image, whose vision tower runs
// once per micro-batch whose tree holds its placeholder tokens. Row r's items are
// [item_offsets[r], item_offsets[r + 1]) (item_offsets: R + 1 entries, or empty for
// none), item k ending at token item_end[k] of its row (ascending within a row) and
// weighing item_work[k] (in the planner's pair units: what per_token_squared
// multiplies). A row adds the items that end past what it shares with the rows
// before it, as it adds tokens:
//
//   rows (depth-first)   tokens        items (end: work)   lcp   adds
//   a = s I I I q x      6             4: 9                0     9
//   b = s I I I q y      6             4: 9                5     0   (its image is a's)
//   c = s J J J q z      6             4: 7                1     7   (another image)
struct ForestView {
  std::span<const int64_t> row_length, row_order, adjacent_lcp, tree_of_row;
  int64_t num_trees = 0;
  std::span<const int64_t> item_offsets = {}, item_end = {}, item_work = {};

  // The work of row r's items that end within its first k tokens.
  int64_t item_work_upto(int64_t row, int64_t k) const {
    if (item_offsets.empty()) return 0;
    int64_t work = 0;
    for (int64_t i = item_offsets[static_cast<size_t>(row)]; i < item_offsets[static_cast<size_t>(row) + 1]; ++i) {
      if (item_end[static_cast<size_t>(i)] > k) break;
      work += item_work[static_cast<size_t>(i)];
    }
    return work;
  }
};

inline ForestView view_of(const PrefixForest& f) {
  return {f.row_length, f.row_order, f.adjacent_lcp, f.tree_of_row, f.num_trees};
}

// Checks that a view is consistent: lengths >= 0, row_order a permutation of the
// rows, each tree contiguous in it, adjacent_lcp in [0, both rows' lengths] and 0 at
// the start of each tree, tree ids in [0, num_trees); work items as described above
// (ends in [1, the row's length], ascending within a row; work >= 0; the forest's
// total work below 2^61). O(R + items).
void check_forest(const char* fn, const ForestView& forest);

struct SubsetCost {
  int64_t tokens = 0, pairs = 0;
  int64_t work = 0;  // the work items the subset holds, each once
  bool operator==(const SubsetCost&) const = default;
};

// The cost of each subset k of rows: rows[offsets[k] .. offsets[k + 1]) (row ids in
// [0, R); repeats count once). One check_forest and sparse table per call, then
// O(|S| log |S|) per subset. `out` has one entry per subset.
void forest_subset_costs(const ForestView& forest, std::span<const int64_t> rows, Lengths offsets,
                         std::span<SubsetCost> out);

}  // namespace seqpack
