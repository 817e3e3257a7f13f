// The prefix forest (prefix_forest.hpp): the trie built and walked once for the rows'
// depth-first order and adjacent lcps, then dropped; subset costs from those alone.
#include "seqpack/prefix_forest.hpp"

#include <algorithm>
#include <numeric>
#include <string>
#include <tuple>

#include "forest_lcp.hpp"
#include "trie.hpp"

namespace seqpack {
namespace {

constexpr const char* kFn = "build_prefix_forest";

// Pre-order index of every node, children visited in order of creation (node id).
std::vector<int64_t> preorder(const std::vector<int64_t>& parent) {
  const size_t m = parent.size();
  std::vector<int64_t> first_child(m, -1), next_sibling(m, -1), last_child(m, -1), pre(m, 0);
  int64_t first_root = -1, last_root = -1;
  for (size_t i = 0; i < m; ++i) {
    const int64_t p = parent[i], node = static_cast<int64_t>(i);
    int64_t& last = p < 0 ? last_root : last_child[static_cast<size_t>(p)];
    int64_t& first = p < 0 ? first_root : first_child[static_cast<size_t>(p)];
    (last < 0 ? first : next_sibling[static_cast<size_t>(last)]) = node;
    last = node;
  }
  int64_t t = 0;
  for (int64_t node = first_root; node >= 0;) {
    pre[static_cast<size_t>(node)] = t++;
    if (first_child[static_cast<size_t>(node)] >= 0) {
      node = first_child[static_cast<size_t>(node)];
      continue;
    }
    while (node >= 0 && next_sibling[static_cast<size_t>(node)] < 0) node = parent[static_cast<size_t>(node)];
    if (node >= 0) node = next_sibling[static_cast<size_t>(node)];
  }
  return pre;
}

// The work items of a view (prefix_forest.hpp), checked.
void check_items(const char* fn, const ForestView& f) {
  const size_t n = f.row_length.size();
  if (f.item_offsets.empty()) {
    if (!f.item_end.empty() || !f.item_work.empty())
      throw_invalid(fn, "forest: work items need item_offsets (one per row + 1)");
    return;
  }
  if (f.item_offsets.size() != n + 1 || f.item_offsets[0] != 0)
    throw_invalid(fn, "forest: item_offsets must hold one offset per row + 1 (" + std::to_string(n + 1) +
                          "), starting at 0");
  const int64_t items = f.item_offsets[n];
  if (items < 0 || f.item_end.size() != static_cast<size_t>(items) || f.item_work.size() != f.item_end.size())
    throw_invalid(fn, "forest: item_end and item_work must hold item_offsets[-1] = " + std::to_string(items) +
                          " entries");
  for (size_t r = 0; r < n; ++r)
    if (f.item_offsets[r + 1] < f.item_offsets[r]) throw_invalid(fn, "forest: item_offsets must never decrease");
  int64_t total = 0;
  for (size_t r = 0; r < n; ++r) {
    const int64_t begin = f.item_offsets[r], end = f.item_offsets[r + 1];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t at = f.item_end[static_cast<size_t>(i)], work = f.item_work[static_cast<size_t>(i)];
      if (at < 1 || at > f.row_length[r] || (i > begin && at < f.item_end[static_cast<size_t>(i) - 1]))
        throw_invalid(fn, "forest: item_end[" + std::to_string(i) + "] = " + std::to_string(at) + " of row " +
                              std::to_string(r) + " must be in [1, " + std::to_string(f.row_length[r]) +
                              "] and not before the row's previous item");
      if (work < 0 || work > (int64_t{1} << 61) - total)
        throw_invalid(fn, "forest: item_work[" + std::to_string(i) + "] must be >= 0, the total below 2^61");
      total += work;
    }
  }
}

}  // namespace

PrefixForest build_prefix_forest(std::span<const int64_t> tokens, Lengths cu, std::span<const int64_t> group_ids,
                                 int64_t min_shared_tokens) {
  detail::check_trie_arguments(kFn, tokens, cu, group_ids, min_shared_tokens);
  const detail::Trie trie = detail::build_trie(tokens, cu, group_ids, min_shared_tokens);
  const size_t rows = cu.size() - 1;
  PrefixForest forest;
  forest.num_nodes = trie.num_nodes();
  forest.row_length.resize(rows);
  forest.tree_of_row.assign(rows, -1);
  std::vector<int64_t> leaf(rows, -1), tree_of_root(static_cast<size_t>(trie.num_nodes()), -1);
  for (size_t r = 0; r < rows; ++r) {
    forest.row_length[r] = cu[r + 1] - cu[r];
    if (cu[r + 1] == cu[r]) {
      forest.tree_of_row[r] = forest.num_trees++;
      continue;
    }
    leaf[r] = trie.node_of[static_cast<size_t>(cu[r + 1] - 1)];
    int64_t& tree = tree_of_root[static_cast<size_t>(trie.node_of[static_cast<size_t>(cu[r])])];  // the row's root
    if (tree < 0) tree = forest.num_trees++;
    forest.tree_of_row[r] = tree;
  }
  // Rows by tree, then the depth-first position of their last token, then id.
  const std::vector<int64_t> pre = preorder(trie.up);
  forest.row_order.resize(rows);
  std::iota(forest.row_order.begin(), forest.row_order.end(), int64_t{0});
  auto key = [&](int64_t r) {
    const int64_t l = leaf[static_cast<size_t>(r)];
    return std::tuple{forest.tree_of_row[static_cast<size_t>(r)], l < 0 ? -1 : pre[static_cast<size_t>(l)], r};
  };
  std::sort(forest.row_order.begin(), forest.row_order.end(), [&](int64_t a, int64_t b) { return key(a) < key(b); });
  // Each row's lcp with the previous one: walking up from its last token to the
  // first node an earlier row of its tree marked (in depth-first order, the deepest
  // node it shares with the previous row).
  forest.adjacent_lcp.assign(rows, 0);
  std::vector<int64_t> mark(static_cast<size_t>(trie.num_nodes()), -1);
  for (size_t i = 0; i < rows; ++i) {
    const int64_t r = forest.row_order[i], tree = forest.tree_of_row[static_cast<size_t>(r)];
    int64_t node = leaf[static_cast<size_t>(r)];
    for (; node >= 0 && mark[static_cast<size_t>(node)] != tree; node = trie.up[static_cast<size_t>(node)])
      mark[static_cast<size_t>(node)] = tree;
    forest.adjacent_lcp[i] = node < 0 ? 0 : trie.depth[static_cast<size_t>(node)] + 1;
  }
  return forest;
}

void check_forest(const char* fn, const ForestView& f) {
  const size_t n = f.row_length.size();
  if (f.row_order.size() != n || f.adjacent_lcp.size() != n || f.tree_of_row.size() != n)
    throw_invalid(fn, "forest: row_length, row_order, adjacent_lcp and tree_of_row must hold one entry per row (" +
                          std::to_string(n) + ")");
  if (f.num_trees < 0) throw_invalid(fn, "forest: num_trees must be >= 0");
  if (static_cast<size_t>(f.num_trees) > n) throw_invalid(fn, "forest: num_trees must be at most the number of rows");
  std::vector<char> seen(n, 0), tree_done(static_cast<size_t>(f.num_trees), 0);
  int64_t total = 0, longest = 0;
  for (size_t i = 0; i < n; ++i) {
    const int64_t r = f.row_order[i];
    if (r < 0 || r >= static_cast<int64_t>(n) || seen[static_cast<size_t>(r)])
      throw_invalid(fn, "forest: row_order must be a permutation of the rows; row_order[" + std::to_string(i) +
                            "] = " + std::to_string(r));
    seen[static_cast<size_t>(r)] = 1;
    const int64_t len = f.row_length[static_cast<size_t>(r)], tree = f.tree_of_row[static_cast<size_t>(r)];
    if (len < 0 || len > (int64_t{1} << 40))
      throw_invalid(fn, "forest: row_length[" + std::to_string(r) + "] must be in [0, 2^40]");
    total += len;
    longest = std::max(longest, len);
    // Pair counts (at most the sum of length^2 / 2 + length) must fit in int64.
    if (total > 0 && longest > (int64_t{1} << 61) / total)
      throw_invalid(fn, "forest: the rows are too long for int64 pair counts (sum of lengths x longest >= 2^61)");
    if (tree < 0 || tree >= f.num_trees)
      throw_invalid(fn, "forest: tree_of_row[" + std::to_string(r) + "] = " + std::to_string(tree) +
                            " must be in [0, num_trees = " + std::to_string(f.num_trees) + ")");
    const bool starts = i == 0 || f.tree_of_row[static_cast<size_t>(f.row_order[i - 1])] != tree;
    if (starts) {
      if (tree_done[static_cast<size_t>(tree)])
        throw_invalid(fn, "forest: the rows of tree " + std::to_string(tree) + " must be contiguous in row_order");
      tree_done[static_cast<size_t>(tree)] = 1;
    }
    const int64_t lcp = f.adjacent_lcp[i];
    const int64_t bound = starts ? 0 : std::min(len, f.row_length[static_cast<size_t>(f.row_order[i - 1])]);
    if (lcp < 0 || lcp > bound)
      throw_invalid(fn, "forest: adjacent_lcp[" + std::to_string(i) + "] = " + std::to_string(lcp) +
                            " must be in [0, " + std::to_string(bound) + "]");
  }
  check_items(fn, f);
}

void forest_subset_costs(const ForestView& f, std::span<const int64_t> rows, Lengths offsets,
                         std::span<SubsetCost> out) {
  constexpr const char* fn = "forest_subset_costs";
  check_forest(fn, f);
  if (offsets.empty()) throw_invalid(fn, "offsets: must hold at least one offset (got none)");
  if (out.size() != offsets.size() - 1)
    throw_invalid(fn, "out: must hold one entry per subset (" + std::to_string(offsets.size() - 1) + ")");
  if (offsets[0] != 0 || offsets.back() != static_cast<int64_t>(rows.size()))
    throw_invalid(fn, "offsets: must start at 0 and end at the number of row ids (" + std::to_string(rows.size()) +
                          ")");
  for (size_t k = 1; k < offsets.size(); ++k)
    if (offsets[k] < offsets[k - 1]) throw_invalid(fn, "offsets: must never decrease");
  const auto n_rows = static_cast<int64_t>(f.row_length.size());
  for (size_t i = 0; i < rows.size(); ++i)
    if (rows[i] < 0 || rows[i] >= n_rows)
      throw_invalid(fn, "rows: row id " + std::to_string(rows[i]) + " at position " + std::to_string(i) +
                            " is outside [0, " + std::to_string(n_rows) + ")");
  const detail::ForestLcp lcp(f);
  std::vector<int64_t> ranks;
  for (size_t k = 0; k + 1 < offsets.size(); ++k) {
    ranks.clear();
    for (int64_t i = offsets[k]; i < offsets[k + 1]; ++i) ranks.push_back(lcp.rank(rows[static_cast<size_t>(i)]));
    std::sort(ranks.begin(), ranks.end());
    ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
    SubsetCost cost;
    for (size_t j = 0; j < ranks.size(); ++j) {
      const int64_t len = lcp.length(f.row_order[static_cast<size_t>(ranks[j])]);
      const int64_t shared = j == 0 ? 0 : lcp.lcp(ranks[j - 1], ranks[j]);
      const int64_t row = f.row_order[static_cast<size_t>(ranks[j])];
      cost.tokens += len - shared;
      cost.pairs += detail::ForestLcp::pairs(len) - detail::ForestLcp::pairs(shared);
      cost.work += f.item_work_upto(row, len) - f.item_work_upto(row, shared);
    }
    out[k] = cost;
  }
}

}  // namespace seqpack
