// Items of a prefix forest under a token cap (forest_items.hpp): rows in
// depth-first order, each row's new tokens by a marked walk up, then per tree
// either one item or the contiguous split that duplicates the fewest tokens.
#include "seqpack/forest_items.hpp"

#include <algorithm>
#include <deque>
#include <numeric>
#include <string>
#include <tuple>
#include <utility>

namespace seqpack {
namespace {

constexpr const char* kFn = "forest_items";

// Pre-order index of every node, children visited in order of creation (node id).
std::vector<int64_t> preorder(std::span<const int64_t> parent) {
  const size_t m = parent.size();
  std::vector<int64_t> first_child(m, -1), next_sibling(m, -1), last_child(m, -1), pre(m, 0);
  int64_t first_root = -1, last_root = -1;
  for (size_t i = 0; i < m; ++i) {
    const int64_t p = parent[i], node = static_cast<int64_t>(i);
    int64_t& last = p < 0 ? last_root : last_child[static_cast<size_t>(p)];
    (last < 0 ? (p < 0 ? first_root : first_child[static_cast<size_t>(p)]) : next_sibling[static_cast<size_t>(last)]) =
        node;
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

// The parts of one tree's rows (in depth-first order, with their new tokens and the
// lcp with the previous row): [begin, end) ranges of positions.
std::vector<std::pair<int64_t, int64_t>> split(const std::vector<int64_t>& fresh, const std::vector<int64_t>& lcp,
                                               int64_t cap) {
  const auto n = static_cast<int64_t>(fresh.size());
  std::vector<int64_t> prefix(static_cast<size_t>(n) + 1, 0);  // S(i): new tokens of positions [0, i)
  for (size_t i = 0; i < fresh.size(); ++i) prefix[i + 1] = prefix[i] + fresh[i];
  // best[i]: (duplicated tokens, parts) of the best split of positions [0, i); from[i]: where its last part starts.
  using Score = std::pair<int64_t, int64_t>;
  std::vector<Score> best(static_cast<size_t>(n) + 1, {0, 0});
  std::vector<int64_t> from(static_cast<size_t>(n) + 1, 0);
  // A part [j, i) holds lcp_j + S(i) - S(j) tokens, never more as j grows (lcp_{j+1} <= len_j = lcp_j + new_j),
  // so the starts that fit form a window [lo, i) that only moves right. The deque holds the window's starts by
  // increasing score (the start's own score plus the tokens a cut there duplicates), earliest first on ties.
  auto start_score = [&](int64_t j) {
    const Score& b = best[static_cast<size_t>(j)];
    return Score{b.first + (j > 0 ? lcp[static_cast<size_t>(j)] : 0), b.second + 1};
  };
  std::deque<int64_t> window;
  int64_t lo = 0;
  for (int64_t i = 1; i <= n; ++i) {
    const int64_t j_new = i - 1;
    while (!window.empty() && start_score(window.back()) > start_score(j_new)) window.pop_back();
    window.push_back(j_new);
    auto tokens = [&](int64_t j) {
      const auto u = static_cast<size_t>(j);
      return (j > 0 ? lcp[u] : 0) + prefix[static_cast<size_t>(i)] - prefix[u];
    };
    while (tokens(lo) > cap) ++lo;  // lo <= i - 1: a single row fits (checked by the caller)
    while (window.front() < lo) window.pop_front();
    best[static_cast<size_t>(i)] = start_score(window.front());
    from[static_cast<size_t>(i)] = window.front();
  }
  std::vector<std::pair<int64_t, int64_t>> parts;
  for (int64_t i = n; i > 0; i = from[static_cast<size_t>(i)]) parts.emplace_back(from[static_cast<size_t>(i)], i);
  std::reverse(parts.begin(), parts.end());
  return parts;
}

}  // namespace

ForestItems forest_items(const ForestView& f, std::span<const int64_t> tree_of_row, int64_t num_trees,
                         int64_t max_tokens) {
  check_forest(kFn, f);
  check_positive(kFn, "max_tokens", max_tokens);
  const size_t rows = f.row_leaf.size();
  if (tree_of_row.size() != rows)
    throw_invalid(kFn, "tree_of_row: must hold one tree id per row (" + std::to_string(rows) + ")");
  if (num_trees < 0) throw_invalid(kFn, "num_trees: must be >= 0");
  for (size_t r = 0; r < rows; ++r)
    if (tree_of_row[r] < 0 || tree_of_row[r] >= num_trees)
      throw_invalid(kFn, "tree_of_row[" + std::to_string(r) + "] = " + std::to_string(tree_of_row[r]) +
                             " is outside [0, num_trees = " + std::to_string(num_trees) + ")");
  for (size_t r = 0; r < rows; ++r) {
    const int64_t leaf = f.row_leaf[r], length = leaf < 0 ? 0 : f.depth[static_cast<size_t>(leaf)] + 1;
    if (length > max_tokens)
      throw_invalid(kFn, "row " + std::to_string(r) + " has " + std::to_string(length) +
                             " tokens, more than max_tokens = " + std::to_string(max_tokens) +
                             " (no micro-batch can hold it)");
  }

  // Rows by tree, then depth-first position of their last token (empty rows first), then id.
  const std::vector<int64_t> pre = preorder(f.parent);
  std::vector<int64_t> order(rows);
  std::iota(order.begin(), order.end(), int64_t{0});
  auto key = [&](int64_t r) {
    const int64_t leaf = f.row_leaf[static_cast<size_t>(r)];
    return std::tuple{tree_of_row[static_cast<size_t>(r)], leaf < 0 ? -1 : pre[static_cast<size_t>(leaf)], r};
  };
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return key(a) < key(b); });

  // Each row's new tokens in that order (a walk up to the first node an earlier row of its tree marked: in
  // depth-first order that is its deepest node shared with the previous row).
  std::vector<int64_t> mark(f.parent.size(), -1), fresh(rows), lcp(rows);
  for (size_t i = 0; i < rows; ++i) {
    const int64_t r = order[i], tree = tree_of_row[static_cast<size_t>(r)];
    int64_t added = 0, node = f.row_leaf[static_cast<size_t>(r)];
    for (; node >= 0 && mark[static_cast<size_t>(node)] != tree; node = f.parent[static_cast<size_t>(node)]) {
      mark[static_cast<size_t>(node)] = tree;
      ++added;
    }
    fresh[i] = added;
    lcp[i] = node < 0 ? 0 : f.depth[static_cast<size_t>(node)] + 1;
  }

  ForestItems items;
  for (size_t begin = 0; begin < rows;) {
    size_t end = begin;
    const int64_t tree = tree_of_row[static_cast<size_t>(order[begin])];
    while (end < rows && tree_of_row[static_cast<size_t>(order[end])] == tree) ++end;
    const auto lo = static_cast<int64_t>(begin), hi = static_cast<int64_t>(end);
    const std::vector<int64_t> tree_fresh(fresh.begin() + lo, fresh.begin() + hi);
    std::vector<int64_t> tree_lcp(lcp.begin() + lo, lcp.begin() + hi);
    tree_lcp[0] = 0;
    for (const auto& [a, b] : split(tree_fresh, tree_lcp, max_tokens)) {
      items.rows.push_group(std::span<const int64_t>(order).subspan(begin + static_cast<size_t>(a),
                                                                    static_cast<size_t>(b - a)));
      items.tree.push_back(tree);
    }
    begin = end;
  }
  // Exact tokens and pairs of each item (the forest's own subset costs).
  std::vector<SubsetCost> costs(items.rows.size());
  forest_subset_costs(f, items.rows.indices, items.rows.offsets, costs);
  int64_t total = 0;
  for (const SubsetCost& c : costs) {
    items.tokens.push_back(c.tokens);
    items.pairs.push_back(c.pairs);
    total += c.tokens;
  }
  items.duplicated_tokens = total - static_cast<int64_t>(f.parent.size());
  return items;
}

}  // namespace seqpack
