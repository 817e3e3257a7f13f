#pragma once
// The packings of a forest subset's positions (forest_subset.hpp) into micro-batches
// under a cap on physical tokens, which plan_forest_micro_batches compares
// (forest_planning.hpp), and the moves that bring one to an admissible count.
#include <cstdint>
#include <span>
#include <vector>

#include "forest_subset.hpp"

namespace seqpack::detail {

// Micro-batches of positions (any order inside one).
using ForestBins = std::vector<std::vector<int64_t>>;

// Rows in `order` (positions), each joining the first micro-batch where the tokens it
// adds (length minus its longest common prefix with a member) fit (AReaL's rule).
ForestBins first_fit_rows(const ForestSubset& s, std::span<const int64_t> order, int64_t cap);

// Tree indices (into tree_starts) by decreasing physical tokens, then index.
std::vector<size_t> trees_by_size(const ForestSubset& s);

// Positions tree by tree, trees by decreasing physical tokens (then position), in
// depth-first order inside each: the order first_fit_rows takes for "first fit over
// depth-first rows".
std::vector<int64_t> largest_trees_first(const ForestSubset& s);

// Trees by decreasing size, each placed whole in the micro-batch it fits most
// tightly; one that fits none is cut, at the row boundary that leaves the least
// behind, into the micro-batch with the most room (a new one when none holds its
// first row), and the rest placed the same way.
ForestBins fill_with_splits(const ForestSubset& s, int64_t cap);

// Trees that fit whole, larger ones in their fewest-duplication runs (tree_runs),
// first-fit-decreasing on their tokens.
ForestBins whole_tree_bins(const ForestSubset& s, int64_t cap);

// Sorts each micro-batch, then cuts micro-batches of several rows until there are
// `count`: each where its consecutive rows share the fewest tokens (then most
// evenly), the cheapest such cut first (between two trees: free), then the
// heaviest micro-batch. With `whole_cap` > 0 a tree of at most `whole_cap` tokens is
// never cut (only between trees, or inside a larger tree). Stops early when no cut is
// left.
void split_to_count(const ForestSubset& s, ForestBins& bins, size_t count, int64_t whole_cap = 0);

}  // namespace seqpack::detail
