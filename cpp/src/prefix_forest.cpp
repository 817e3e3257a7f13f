// The prefix forest (prefix_forest.hpp): the trie's parent / depth arrays, trees as
// the roots of the rows' paths, and the cost of row subsets by a marked walk up.
#include "seqpack/prefix_forest.hpp"

#include <string>

#include "trie.hpp"

namespace seqpack {
namespace {

constexpr const char* kFn = "build_prefix_forest";

}  // namespace

PrefixForest build_prefix_forest(std::span<const int64_t> tokens, Lengths cu, std::span<const int64_t> group_ids,
                                 int64_t min_shared_tokens) {
  detail::check_trie_arguments(kFn, tokens, cu, group_ids, min_shared_tokens);
  detail::Trie trie = detail::build_trie(tokens, cu, group_ids, min_shared_tokens);
  const size_t rows = cu.size() - 1;
  PrefixForest forest;
  forest.parent = std::move(trie.up);
  forest.depth = std::move(trie.depth);
  forest.row_leaf.assign(rows, -1);
  forest.tree_of_row.assign(rows, -1);
  // A root's tree id, given when its first row is met (-1: none yet).
  std::vector<int64_t> tree_of_root(forest.parent.size(), -1);
  for (size_t r = 0; r < rows; ++r) {
    if (cu[r + 1] == cu[r]) {
      forest.tree_of_row[r] = forest.num_trees++;
      continue;
    }
    forest.row_leaf[r] = trie.node_of[static_cast<size_t>(cu[r + 1] - 1)];
    // The row's first token is its root: no walk up needed.
    int64_t& tree = tree_of_root[static_cast<size_t>(trie.node_of[static_cast<size_t>(cu[r])])];
    if (tree < 0) tree = forest.num_trees++;
    forest.tree_of_row[r] = tree;
  }
  return forest;
}

void check_forest(const char* fn, const ForestView& f) {
  const auto m = static_cast<int64_t>(f.parent.size());
  if (f.depth.size() != f.parent.size())
    throw_invalid(fn, "forest: parent and depth must have one entry per node (" + std::to_string(m) + "), got " +
                          std::to_string(f.depth.size()) + " depths");
  for (int64_t i = 0; i < m; ++i) {
    const int64_t p = f.parent[static_cast<size_t>(i)], d = f.depth[static_cast<size_t>(i)];
    if (p < -1 || p >= i)
      throw_invalid(fn, "forest: parent[" + std::to_string(i) + "] = " + std::to_string(p) +
                            " must be -1 or an earlier node");
    if (d != (p < 0 ? 0 : f.depth[static_cast<size_t>(p)] + 1))
      throw_invalid(fn, "forest: depth[" + std::to_string(i) + "] = " + std::to_string(d) +
                            " must be 0 at a root and its parent's depth + 1 elsewhere");
  }
  for (size_t r = 0; r < f.row_leaf.size(); ++r)
    if (f.row_leaf[r] < -1 || f.row_leaf[r] >= m)
      throw_invalid(fn, "forest: row_leaf[" + std::to_string(r) + "] = " + std::to_string(f.row_leaf[r]) +
                            " must be -1 or a node in [0, " + std::to_string(m) + ")");
}

void forest_subset_costs(const ForestView& f, std::span<const int64_t> rows, Lengths offsets,
                         std::span<SubsetCost> out) {
  constexpr const char* fn = "forest_subset_costs";
  check_forest(fn, f);  // O(M + R), as much as costing the whole batch once: the walks below then stay in bounds
  if (offsets.empty()) throw_invalid(fn, "offsets: must hold at least one offset (got none)");
  if (out.size() != offsets.size() - 1)
    throw_invalid(fn, "out: must hold one entry per subset (" + std::to_string(offsets.size() - 1) + ")");
  if (offsets[0] != 0 || offsets.back() != static_cast<int64_t>(rows.size()))
    throw_invalid(fn, "offsets: must start at 0 and end at the number of row ids (" + std::to_string(rows.size()) +
                          ")");
  for (size_t k = 1; k < offsets.size(); ++k)
    if (offsets[k] < offsets[k - 1]) throw_invalid(fn, "offsets: must never decrease");
  const auto n_rows = static_cast<int64_t>(f.row_leaf.size());
  for (size_t i = 0; i < rows.size(); ++i)
    if (rows[i] < 0 || rows[i] >= n_rows)
      throw_invalid(fn, "rows: row id " + std::to_string(rows[i]) + " at position " + std::to_string(i) +
                            " is outside [0, " + std::to_string(n_rows) + ")");
  // mark[node] == k + 1: the node is already counted for subset k. Walking up from a
  // row's leaf stops at the first marked node: its ancestors are marked too.
  std::vector<int64_t> mark(f.parent.size(), 0);
  for (size_t k = 0; k + 1 < offsets.size(); ++k) {
    SubsetCost cost;
    const auto stamp = static_cast<int64_t>(k) + 1;
    for (int64_t i = offsets[k]; i < offsets[k + 1]; ++i) {
      for (int64_t node = f.row_leaf[static_cast<size_t>(rows[static_cast<size_t>(i)])];
           node >= 0 && mark[static_cast<size_t>(node)] != stamp; node = f.parent[static_cast<size_t>(node)]) {
        mark[static_cast<size_t>(node)] = stamp;
        ++cost.tokens;
        cost.pairs += f.depth[static_cast<size_t>(node)] + 1;
      }
    }
    out[k] = cost;
  }
}

}  // namespace seqpack
