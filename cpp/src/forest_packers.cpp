// Packings of a forest subset under a cap on physical tokens (forest_packers.hpp).
#include "forest_packers.hpp"

#include <algorithm>
#include <iterator>
#include <numeric>
#include <queue>
#include <set>
#include <tuple>
#include <utility>

#include "bin_structures.hpp"
#include "seqpack/packing.hpp"

namespace seqpack::detail {

ForestBins first_fit_rows(const ForestSubset& s, std::span<const int64_t> order, int64_t cap) {
  ForestBins bins;
  std::vector<std::set<int64_t>> members;  // each micro-batch's positions, sorted
  std::vector<int64_t> room;
  // The micro-batches holding rows of each tree: only there can a row add fewer
  // tokens than its length (rows of different trees share nothing).
  std::vector<std::vector<int64_t>> tree_bins(static_cast<size_t>(s.num_forest_trees()));
  GapTree<int64_t> gaps(64, cap);  // first fit by length; unopened micro-batches have the whole cap
  for (int64_t p : order) {
    const auto pos = static_cast<size_t>(p);
    const int64_t len = s.length(pos), tree = s.tree(pos);
    // The tokens p adds to micro-batch b: its length minus its lcp with its neighbours
    // there in depth-first order (the longest common prefix with any member).
    auto adds = [&](int64_t b) {
      const std::set<int64_t>& m = members[static_cast<size_t>(b)];
      const auto next = m.lower_bound(p);
      int64_t shared = 0;
      if (next != m.end()) shared = s.lcp(pos, static_cast<size_t>(*next));
      if (next != m.begin()) shared = std::max(shared, s.lcp(static_cast<size_t>(*std::prev(next)), pos));
      return len - shared;
    };
    int64_t best = gaps.leftmost_at_least(len), add = len;  // == bins.size(): a new one
    std::vector<int64_t>& mine = tree_bins[static_cast<size_t>(tree)];
    for (int64_t b : mine) {
      if (b > best) continue;
      const int64_t a = adds(b);
      if (a <= room[static_cast<size_t>(b)]) best = b, add = a;
    }
    if (best == static_cast<int64_t>(bins.size())) {
      bins.emplace_back();
      members.emplace_back();
      room.push_back(cap);
    }
    const auto b = static_cast<size_t>(best);
    if (std::find(mine.begin(), mine.end(), best) == mine.end()) mine.push_back(best);
    members[b].insert(p);
    bins[b].push_back(p);
    room[b] -= add;
    gaps.set(best, room[b]);
  }
  return bins;
}

std::vector<size_t> trees_by_size(const ForestSubset& s) {
  const auto& starts = s.tree_starts();
  std::vector<size_t> trees(s.num_trees());
  std::iota(trees.begin(), trees.end(), size_t{0});
  auto tokens = [&](size_t t) {
    return s.run_tokens(static_cast<size_t>(starts[t]), static_cast<size_t>(starts[t + 1]));
  };
  std::stable_sort(trees.begin(), trees.end(), [&](size_t a, size_t b) { return tokens(a) > tokens(b); });
  return trees;
}

std::vector<int64_t> largest_trees_first(const ForestSubset& s) {
  const auto& starts = s.tree_starts();
  std::vector<int64_t> order;
  order.reserve(s.size());
  for (size_t t : trees_by_size(s))
    for (int64_t p = starts[t]; p < starts[t + 1]; ++p) order.push_back(p);
  return order;
}

ForestBins fill_with_splits(const ForestSubset& s, int64_t cap) {
  ForestBins bins;
  std::vector<int64_t> room;
  std::set<std::pair<int64_t, int64_t>> by_room;  // (room, micro-batch)
  auto place = [&](size_t b, size_t begin, size_t end) {
    for (size_t p = begin; p < end; ++p) bins[b].push_back(static_cast<int64_t>(p));
    by_room.erase({room[b], static_cast<int64_t>(b)});
    room[b] -= s.run_tokens(begin, end);
    by_room.emplace(room[b], static_cast<int64_t>(b));
  };
  const auto& starts = s.tree_starts();
  for (size_t t : trees_by_size(s)) {
    const auto lo = static_cast<size_t>(starts[t]), hi = static_cast<size_t>(starts[t + 1]);
    for (size_t cur = lo; cur < hi;) {
      const int64_t whole = s.run_tokens(cur, hi);
      if (auto it = by_room.lower_bound({whole, -1}); it != by_room.end()) {  // the tightest micro-batch it fits
        place(static_cast<size_t>(it->second), cur, hi);
        break;
      }
      size_t b;
      if (!by_room.empty() && by_room.rbegin()->first >= s.length(cur)) {
        b = static_cast<size_t>(by_room.rbegin()->second);
      } else {
        b = bins.size();
        bins.emplace_back();
        room.push_back(cap);
        by_room.emplace(cap, static_cast<int64_t>(b));
        if (whole <= cap) {
          place(b, cur, hi);
          break;
        }
      }
      // Cut before j: [cur, j) here, [j, hi) left with lcp_j + new tokens of [j, hi).
      // The cut that leaves the least (the most new tokens placed net of the prefix
      // repeated), the later one on ties. j = cur + 1 always fits: the first row does.
      size_t cut = cur + 1;
      int64_t left = s.run_tokens(cut, hi);
      for (size_t j = cur + 2; j < hi && s.run_tokens(cur, j) <= room[b]; ++j) {
        const int64_t rest = s.run_tokens(j, hi);
        if (rest <= left) cut = j, left = rest;
      }
      place(b, cur, cut);
      cur = cut;
    }
  }
  return bins;
}

ForestBins whole_tree_bins(const ForestSubset& s, int64_t cap) {
  const std::vector<std::pair<int64_t, int64_t>> runs = tree_runs(s, cap);
  std::vector<int64_t> tokens(runs.size());
  for (size_t k = 0; k < runs.size(); ++k)
    tokens[k] = s.run_tokens(static_cast<size_t>(runs[k].first), static_cast<size_t>(runs[k].second));
  const IndexGroups groups = first_fit_decreasing(tokens, cap);
  ForestBins bins(groups.size());
  for (size_t g = 0; g < groups.size(); ++g)
    for (int64_t k : groups.group(g))
      for (int64_t p = runs[static_cast<size_t>(k)].first; p < runs[static_cast<size_t>(k)].second; ++p)
        bins[g].push_back(p);
  return bins;
}

void split_to_count(const ForestSubset& s, ForestBins& bins, size_t count, int64_t whole_cap) {
  for (auto& b : bins) std::sort(b.begin(), b.end());
  // With whole_cap, a cut inside a tree that fits it is not allowed.
  auto tree_fits = [&](int64_t p) {
    const auto& starts = s.tree_starts();
    const auto t = static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), p) - starts.begin() - 1);
    return s.run_tokens(static_cast<size_t>(starts[t]), static_cast<size_t>(starts[t + 1])) <= whole_cap;
  };
  auto allowed = [&](int64_t a, int64_t b) {
    return whole_cap <= 0 || s.tree(static_cast<size_t>(a)) != s.tree(static_cast<size_t>(b)) || !tree_fits(a);
  };
  // Each micro-batch of >= 2 rows by its best cut: (-shared tokens, tokens, -index), the
  // cheapest cut first (between trees: free), then the heaviest micro-batch.
  std::priority_queue<std::tuple<int64_t, int64_t, int64_t>> cheapest;
  std::vector<size_t> cut_at(bins.size());
  std::vector<int64_t> shared, left, right;
  auto push = [&](size_t b) {
    const std::vector<int64_t>& rows = bins[b];
    const size_t m = rows.size();
    if (cut_at.size() < bins.size()) cut_at.resize(bins.size());
    if (m < 2) return;
    // shared[i]: lcp of rows i - 1 and i; left[i] / right[i]: tokens of rows [0, i) / [i, m).
    shared.assign(m, 0);
    left.assign(m + 1, 0);
    right.assign(m + 1, 0);
    for (size_t i = 1; i < m; ++i) shared[i] = s.lcp(static_cast<size_t>(rows[i - 1]), static_cast<size_t>(rows[i]));
    for (size_t i = 0; i < m; ++i) left[i + 1] = left[i] + s.length(static_cast<size_t>(rows[i])) - shared[i];
    for (size_t i = m; i-- > 0;)
      right[i] = right[i + 1] + s.length(static_cast<size_t>(rows[i])) - (i + 1 < m ? shared[i + 1] : 0);
    size_t cut = 0;  // the fewest shared tokens, then the most even halves, among the cuts allowed
    for (size_t i = 1; i < m; ++i)
      if (allowed(rows[i - 1], rows[i]) &&
          (cut == 0 || shared[i] < shared[cut] ||
           (shared[i] == shared[cut] && std::max(left[i], right[i]) < std::max(left[cut], right[cut]))))
        cut = i;
    if (cut == 0) return;
    cut_at[b] = cut;
    cheapest.emplace(-shared[cut], left[m], -static_cast<int64_t>(b));
  };
  for (size_t b = 0; b < bins.size(); ++b) push(b);
  while (bins.size() < count && !cheapest.empty()) {
    const auto b = static_cast<size_t>(-std::get<2>(cheapest.top()));
    cheapest.pop();
    const size_t cut = cut_at[b];
    std::vector<int64_t> tail(bins[b].begin() + static_cast<std::ptrdiff_t>(cut), bins[b].end());
    bins[b].resize(cut);
    bins.push_back(std::move(tail));
    push(b);
    push(bins.size() - 1);
  }
}

}  // namespace seqpack::detail
