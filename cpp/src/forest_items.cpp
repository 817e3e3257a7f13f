// Items of a prefix forest under a token cap (forest_items.hpp): the rows of each
// tree in depth-first order with their adjacent lcps (forest_lcp.hpp), then per tree
// either one item or the contiguous split that duplicates the fewest tokens.
#include "seqpack/forest_items.hpp"

#include <algorithm>
#include <deque>
#include <numeric>
#include <string>
#include <utility>

#include "forest_lcp.hpp"

namespace seqpack {
namespace {

constexpr const char* kFn = "forest_items";

// The parts of one tree's rows (in depth-first order, with their new tokens and the
// lcp with the previous row): [begin, end) ranges of positions.
std::vector<std::pair<int64_t, int64_t>> split(const std::vector<int64_t>& fresh, const std::vector<int64_t>& lcp,
                                               int64_t cap) {
  const auto n = static_cast<int64_t>(fresh.size());
  std::vector<int64_t> prefix(fresh.size() + 1, 0);  // S(i): new tokens of positions [0, i)
  for (size_t i = 0; i < fresh.size(); ++i) prefix[i + 1] = prefix[i] + fresh[i];
  // best[i]: (duplicated tokens, parts) of the best split of positions [0, i); from[i]: where its last part starts.
  using Score = std::pair<int64_t, int64_t>;
  std::vector<Score> best(fresh.size() + 1, {0, 0});
  std::vector<int64_t> from(fresh.size() + 1, 0);
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

ForestItems forest_items(const ForestView& f, int64_t max_tokens) {
  std::vector<int64_t> all(f.row_length.size());
  std::iota(all.begin(), all.end(), int64_t{0});
  return forest_items(f, max_tokens, all);
}

ForestItems forest_items(const ForestView& f, int64_t max_tokens, std::span<const int64_t> subset) {
  check_forest(kFn, f);
  check_positive(kFn, "max_tokens", max_tokens);
  const size_t n_rows = f.row_length.size();
  std::vector<char> chosen(n_rows, 0);
  for (int64_t r : subset) {
    if (r < 0 || r >= static_cast<int64_t>(n_rows))
      throw_invalid(kFn, "rows: row id " + std::to_string(r) + " is outside [0, " + std::to_string(n_rows) + ")");
    if (chosen[static_cast<size_t>(r)]) throw_invalid(kFn, "rows: row id " + std::to_string(r) + " is repeated");
    chosen[static_cast<size_t>(r)] = 1;
    if (f.row_length[static_cast<size_t>(r)] > max_tokens)
      throw_invalid(kFn, "row " + std::to_string(r) + " has " + std::to_string(f.row_length[static_cast<size_t>(r)]) +
                             " tokens, more than max_tokens = " + std::to_string(max_tokens) +
                             " (no micro-batch can hold it)");
  }
  // The subset in depth-first order, each row's lcp with the previous one of the subset.
  const detail::ForestLcp index(f);
  std::vector<int64_t> ranks;
  ranks.reserve(subset.size());
  for (int64_t r : subset) ranks.push_back(index.rank(r));
  std::sort(ranks.begin(), ranks.end());
  const size_t rows = ranks.size();
  std::vector<int64_t> order(rows), fresh(rows), lcp(rows);
  for (size_t i = 0; i < rows; ++i) {
    order[i] = f.row_order[static_cast<size_t>(ranks[i])];
    lcp[i] = i == 0 ? 0 : index.lcp(ranks[i - 1], ranks[i]);  // 0 across trees
    fresh[i] = index.length(order[i]) - lcp[i];
  }

  ForestItems items;
  int64_t total = 0, physical = 0;
  for (size_t begin = 0; begin < rows;) {
    const int64_t tree = f.tree_of_row[static_cast<size_t>(order[begin])];
    size_t end = begin;
    while (end < rows && f.tree_of_row[static_cast<size_t>(order[end])] == tree) ++end;
    const auto lo = static_cast<int64_t>(begin), hi = static_cast<int64_t>(end);
    const std::vector<int64_t> tree_fresh(fresh.begin() + lo, fresh.begin() + hi);
    std::vector<int64_t> tree_lcp(lcp.begin() + lo, lcp.begin() + hi);
    tree_lcp[0] = 0;
    for (const auto& [a, b] : split(tree_fresh, tree_lcp, max_tokens)) {
      const auto first = begin + static_cast<size_t>(a);
      items.rows.push_group(std::span<const int64_t>(order).subspan(first, static_cast<size_t>(b - a)));
      items.tree.push_back(tree);
      // The part's own cost: its first row whole, then each row's new tokens and pairs.
      int64_t tokens = 0, pairs = 0;
      for (size_t i = first; i < begin + static_cast<size_t>(b); ++i) {
        const int64_t len = index.length(order[i]), shared = i == first ? 0 : lcp[i];
        tokens += len - shared;
        pairs += detail::ForestLcp::pairs(len) - detail::ForestLcp::pairs(shared);
      }
      items.tokens.push_back(tokens);
      items.pairs.push_back(pairs);
      total += tokens;
    }
    for (size_t i = begin; i < end; ++i) physical += fresh[i];
    begin = end;
  }
  items.duplicated_tokens = total - physical;
  return items;
}

}  // namespace seqpack
