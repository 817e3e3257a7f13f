#pragma once
// What the step planner over a forest (forest_step.cpp) shares with the micro-batch
// planner (forest_planning.cpp): the packings and how one is brought to an
// admissible count.
#include <cstdint>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "forest_packers.hpp"
#include "seqpack/forest_planning.hpp"

namespace seqpack::detail {

struct Packing {
  ForestBins bins;                // positions, sorted inside each micro-batch
  std::vector<SubsetCost> costs;  // of each micro-batch
  int64_t tokens = 0;             // their sum
  int64_t max_work = 0;           // the heaviest micro-batch's workload
  const char* method = "";
};

// The packings compared (whole trees first; only it with `whole_trees`), each with
// its name; `input_order`: the positions in the order AReaL would take the rows.
std::vector<std::pair<ForestBins, const char*>> packings(const ForestSubset& s, int64_t cap, bool whole_trees,
                                                         std::span<const int64_t> input_order);

// Positions ordered by row id (the rows' order in the batch).
std::vector<int64_t> positions_in_row_order(const ForestSubset& s);

// The best admissible packing (fewest micro-batches, then physical tokens, then the
// heaviest workload). Throws when no count the options admit can be filled.
Packing best_packing(const ForestSubset& s, const ForestPlanOptions& options);

}  // namespace seqpack::detail
