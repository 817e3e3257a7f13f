#pragma once
// The lcp of any two rows of a prefix forest from its adjacent lcps: the rows'
// positions in depth-first order and a sparse table of range minima (shared by
// forest_subset_costs and forest_items).
#include <algorithm>
#include <cstdint>
#include <vector>

#include "seqpack/prefix_forest.hpp"

namespace seqpack::detail {

class ForestLcp {
 public:
  // `forest` checked (check_forest).
  explicit ForestLcp(const ForestView& forest) : forest_(forest), rank_(forest.row_order.size()) {
    const size_t n = forest.row_order.size();
    for (size_t i = 0; i < n; ++i) rank_[static_cast<size_t>(forest.row_order[i])] = static_cast<int64_t>(i);
    table_.emplace_back(forest.adjacent_lcp.begin(), forest.adjacent_lcp.end());
    for (size_t width = 1; 2 * width <= n; width *= 2) {
      const std::vector<int64_t>& prev = table_.back();
      std::vector<int64_t> next(n - 2 * width + 1);
      for (size_t i = 0; i < next.size(); ++i) next[i] = std::min(prev[i], prev[i + width]);
      table_.push_back(std::move(next));
    }
  }

  int64_t rank(int64_t row) const { return rank_[static_cast<size_t>(row)]; }
  int64_t length(int64_t row) const { return forest_.row_length[static_cast<size_t>(row)]; }

  // lcp of the rows at positions a < b of the depth-first order: the least adjacent
  // lcp of positions a + 1 .. b.
  int64_t lcp(int64_t a, int64_t b) const {
    const auto lo = static_cast<size_t>(a + 1), hi = static_cast<size_t>(b + 1);  // [lo, hi)
    size_t level = 0;
    while ((size_t{2} << level) <= hi - lo) ++level;
    return std::min(table_[level][lo], table_[level][hi - (size_t{1} << level)]);
  }

  static int64_t pairs(int64_t x) { return x * (x + 1) / 2; }

 private:
  const ForestView& forest_;
  std::vector<int64_t> rank_;
  std::vector<std::vector<int64_t>> table_;  // table_[k][i] = min of adjacent_lcp[i .. i + 2^k)
};

}  // namespace seqpack::detail
