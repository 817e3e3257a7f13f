// Items of a prefix forest under a token cap (forest_items.hpp): the rows of each
// tree in depth-first order with their adjacent lcps (forest_lcp.hpp), then per tree
// either one item or the contiguous split that duplicates the fewest tokens.
#include "seqpack/forest_items.hpp"

#include <algorithm>
#include <deque>
#include <queue>
#include <numeric>
#include <string>
#include <utility>

#include "forest_subset.hpp"

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

ForestItems forest_items(const ForestView& f, int64_t max_tokens, int64_t min_items) {
  std::vector<int64_t> all(f.row_length.size());
  std::iota(all.begin(), all.end(), int64_t{0});
  return forest_items(f, max_tokens, all, min_items);
}

std::vector<std::pair<int64_t, int64_t>> detail::tree_runs(const ForestSubset& s, int64_t max_tokens) {
  std::vector<std::pair<int64_t, int64_t>> runs;
  const auto& starts = s.tree_starts();
  for (size_t t = 0; t + 1 < starts.size(); ++t) {
    const auto lo = static_cast<size_t>(starts[t]), hi = static_cast<size_t>(starts[t + 1]);
    std::vector<int64_t> fresh(hi - lo), lcp(hi - lo);
    for (size_t p = lo; p < hi; ++p) {
      lcp[p - lo] = p == lo ? 0 : s.lcp_prev(p);
      fresh[p - lo] = s.length(p) - lcp[p - lo];
    }
    for (const auto& [a, b] : split(fresh, lcp, max_tokens))
      runs.emplace_back(static_cast<int64_t>(lo) + a, static_cast<int64_t>(lo) + b);
  }
  return runs;
}

ForestItems forest_items(const ForestView& f, int64_t max_tokens, std::span<const int64_t> subset, int64_t min_items) {
  if (min_items < 0) throw_invalid(kFn, "min_items: must be >= 0, got " + std::to_string(min_items));
  const detail::ForestSubset s(f, subset, max_tokens, kFn);
  // Each item is a run [begin, end) of positions of one tree.
  std::vector<std::pair<int64_t, int64_t>> runs = detail::tree_runs(s, max_tokens);
  // Too few items: halve the largest run of several rows (then the earliest) until
  // there are enough, each half carrying its prefix. A heap: O(R log R).
  if (static_cast<int64_t>(runs.size()) < min_items) {
    auto tokens = [&](const std::pair<int64_t, int64_t>& r) {
      return s.run_tokens(static_cast<size_t>(r.first), static_cast<size_t>(r.second));
    };
    // (tokens, -begin): the largest first, then the earliest.
    std::priority_queue<std::pair<int64_t, int64_t>> heap;
    std::vector<int64_t> end_of(s.size() + 1, -1);
    for (const auto& r : runs) {
      end_of[static_cast<size_t>(r.first)] = r.second;
      if (r.second - r.first > 1) heap.emplace(tokens(r), -r.first);
    }
    auto count = static_cast<int64_t>(runs.size());
    while (count < min_items && !heap.empty()) {
      const int64_t begin = -heap.top().second;
      heap.pop();
      const int64_t end = end_of[static_cast<size_t>(begin)], mid = begin + (end - begin) / 2;
      end_of[static_cast<size_t>(begin)] = mid;
      end_of[static_cast<size_t>(mid)] = end;
      for (const auto& r : {std::pair{begin, mid}, std::pair{mid, end}})
        if (r.second - r.first > 1) heap.emplace(tokens(r), -r.first);
      ++count;
    }
    runs.clear();
    for (int64_t b = 0; b < static_cast<int64_t>(s.size()); b = end_of[static_cast<size_t>(b)])
      runs.emplace_back(b, end_of[static_cast<size_t>(b)]);
  }
  ForestItems items;
  int64_t total = 0;
  std::vector<int64_t> rows;
  for (const auto& [a, b] : runs) {
    const auto lo = static_cast<size_t>(a), hi = static_cast<size_t>(b);
    rows.clear();
    for (size_t p = lo; p < hi; ++p) rows.push_back(s.row(p));
    items.rows.push_group(rows);
    items.tree.push_back(s.tree(lo));
    items.tokens.push_back(s.run_tokens(lo, hi));
    items.pairs.push_back(s.run_pairs(lo, hi));
    items.work.push_back(s.run_work(lo, hi));
    total += items.tokens.back();
  }
  items.duplicated_tokens = total - s.physical_tokens();
  return items;
}

}  // namespace seqpack
