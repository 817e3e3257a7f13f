#pragma once
// A set of rows of a prefix forest as the tree planners see it: the rows in
// depth-first order of the trie ("positions" 0 .. n - 1), each with its lcp with the
// previous position (0 where a tree starts) and prefix sums of the new tokens and
// pairs each row adds, so a run of consecutive positions of one tree costs O(1):
//
//   positions   row          len  lcp  new     run [1, 3) = b c:  lcp_1 + new_1 + new_2
//   0           a = 1 2 3 4   4    0    4                        = 3 + 1 + 1 = 5 tokens
//   1           b = 1 2 3 5   4    3    1      (b whole, then c's "6" after the shared "1 2")
//   2           c = 1 2 6     3    2    1
//
// and any set of positions costs  sum(len) - sum(lcp of consecutive members)  tokens
// (forest_lcp.hpp: the lcp of two positions is the least adjacent lcp between them).
#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "forest_lcp.hpp"
#include "seqpack/prefix_forest.hpp"

namespace seqpack::detail {

class ForestSubset {
 public:
  // `rows`: distinct ids in [0, R), each at most `max_tokens` long (checked, errors
  // name `fn`). `forest` is checked here and must outlive the subset.
  ForestSubset(const ForestView& forest, std::span<const int64_t> rows, int64_t max_tokens, const char* fn)
      : forest_(forest), index_(std::make_shared<const ForestLcp>((check_forest(fn, forest), forest))) {
    check_positive(fn, "max_tokens", max_tokens);
    build(rows, max_tokens, fn);
  }
  // Another subset of the same forest (`rows` checked as above), sharing its lcp
  // index: O(|rows| log |rows|), nothing proportional to the whole forest.
  ForestSubset(const ForestSubset& of, std::span<const int64_t> rows, int64_t max_tokens, const char* fn)
      : forest_(of.forest_), index_(of.index_) {
    check_positive(fn, "max_tokens", max_tokens);
    build(rows, max_tokens, fn);
  }

  size_t size() const { return row_.size(); }
  const ForestView& view() const { return forest_; }
  // The position of a row of the subset.
  int64_t position_of(int64_t row) const {
    return std::lower_bound(ranks_.begin(), ranks_.end(), index_->rank(row)) - ranks_.begin();
  }
  int64_t row(size_t p) const { return row_[p]; }
  int64_t length(size_t p) const { return forest_.row_length[static_cast<size_t>(row_[p])]; }
  int64_t tree(size_t p) const { return forest_.tree_of_row[static_cast<size_t>(row_[p])]; }
  int64_t lcp_prev(size_t p) const { return lcp_[p]; }
  // lcp of positions a < b (0 when their trees differ).
  int64_t lcp(size_t a, size_t b) const { return index_->lcp(ranks_[a], ranks_[b]); }
  // Trees as position ranges: tree t holds [starts[t], starts[t + 1]).
  const std::vector<int64_t>& tree_starts() const { return tree_starts_; }
  size_t num_trees() const { return tree_starts_.size() - 1; }
  int64_t num_forest_trees() const { return forest_.num_trees; }
  // The whole subset as one prefix tree (each tree's nodes once).
  int64_t physical_tokens() const { return fresh_.back(); }

  // A run of consecutive positions [a, b) of one tree: its first row whole, then what
  // each later row adds.
  int64_t run_tokens(size_t a, size_t b) const { return fresh_[b] - fresh_[a] + lcp_[a]; }
  int64_t run_pairs(size_t a, size_t b) const { return pairs_[b] - pairs_[a] + ForestLcp::pairs(lcp_[a]); }
  // Its work items (prefix_forest.hpp): the first row's all, then what each later row adds.
  int64_t run_work(size_t a, size_t b) const {
    return work_[b] - work_[a] + forest_.item_work_upto(row_[a], lcp_[a]);
  }
  SubsetCost run_cost(size_t a, size_t b) const { return {run_tokens(a, b), run_pairs(a, b), run_work(a, b)}; }

  // Tokens and pairs of a set of positions, sorted ascending and distinct.
  SubsetCost cost(std::span<const int64_t> sorted) const {
    SubsetCost c;
    for (size_t j = 0; j < sorted.size(); ++j) {
      const auto p = static_cast<size_t>(sorted[j]);
      const int64_t len = length(p), shared = j == 0 ? 0 : lcp(static_cast<size_t>(sorted[j - 1]), p);
      c.tokens += len - shared;
      c.pairs += ForestLcp::pairs(len) - ForestLcp::pairs(shared);
      c.work += forest_.item_work_upto(row_[p], len) - forest_.item_work_upto(row_[p], shared);
    }
    return c;
  }

 private:
  void build(std::span<const int64_t> rows, int64_t max_tokens, const char* fn) {
    const auto n_rows = static_cast<int64_t>(forest_.row_length.size());
    ranks_.reserve(rows.size());
    for (int64_t r : rows) {
      if (r < 0 || r >= n_rows)
        throw_invalid(fn, "rows: row id " + std::to_string(r) + " is outside [0, " + std::to_string(n_rows) + ")");
      const int64_t len = forest_.row_length[static_cast<size_t>(r)];
      if (len > max_tokens)
        throw_invalid(fn, "row " + std::to_string(r) + " has " + std::to_string(len) +
                              " tokens, more than max_tokens = " + std::to_string(max_tokens) +
                              " (no micro-batch can hold it)");
      ranks_.push_back(index_->rank(r));
    }
    std::sort(ranks_.begin(), ranks_.end());
    const size_t n = ranks_.size();
    for (size_t p = 1; p < n; ++p)
      if (ranks_[p] == ranks_[p - 1])
        throw_invalid(fn, "rows: row id " + std::to_string(forest_.row_order[static_cast<size_t>(ranks_[p])]) +
                              " is repeated");
    row_.resize(n);
    lcp_.resize(n);
    fresh_.assign(n + 1, 0);
    pairs_.assign(n + 1, 0);
    work_.assign(n + 1, 0);
    for (size_t p = 0; p < n; ++p) {
      row_[p] = forest_.row_order[static_cast<size_t>(ranks_[p])];
      lcp_[p] = p == 0 ? 0 : index_->lcp(ranks_[p - 1], ranks_[p]);  // 0 across trees
      if (p == 0 || tree(p) != tree(p - 1)) tree_starts_.push_back(static_cast<int64_t>(p));
      const int64_t len = length(p);
      fresh_[p + 1] = fresh_[p] + len - lcp_[p];
      pairs_[p + 1] = pairs_[p] + ForestLcp::pairs(len) - ForestLcp::pairs(lcp_[p]);
      work_[p + 1] = work_[p] + forest_.item_work_upto(row_[p], len) - forest_.item_work_upto(row_[p], lcp_[p]);
    }
    tree_starts_.push_back(static_cast<int64_t>(n));
  }

  const ForestView& forest_;
  std::shared_ptr<const ForestLcp> index_;
  std::vector<int64_t> ranks_;        // [n] depth-first ranks in the whole forest, ascending
  std::vector<int64_t> row_;          // [n] row ids
  std::vector<int64_t> lcp_;          // [n] lcp with the previous position (0 at a tree's start)
  std::vector<int64_t> fresh_;        // [n + 1] prefix sums of len - lcp
  std::vector<int64_t> pairs_;        // [n + 1] prefix sums of P(len) - P(lcp)
  std::vector<int64_t> work_;         // [n + 1] prefix sums of the work items each row adds
  std::vector<int64_t> tree_starts_;  // [trees + 1]
};

// Each tree of the subset as one run of positions [begin, end) when it fits
// `max_tokens`, else the contiguous runs that fit and duplicate the fewest tokens
// (forest_items.hpp), in position order.
std::vector<std::pair<int64_t, int64_t>> tree_runs(const ForestSubset& s, int64_t max_tokens);

}  // namespace seqpack::detail
