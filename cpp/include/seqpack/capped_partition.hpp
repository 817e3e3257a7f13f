#pragma once
// Partitions of sequences into k groups under a token cap, balanced on their work:
// what plan_micro_batches (microbatch.hpp) runs on one rank, built from plan_step's
// placement and balancing steps.
#include <cstdint>
#include <optional>
#include <span>

#include "seqpack/common.hpp"

namespace seqpack {

// Each sequence, heaviest work first, to the lightest of k groups that still has
// room for it under the cap, then moves and swaps between the heaviest and the
// lightest group (bounded work). Nothing when a sequence finds no room. Indices
// sorted inside each group. O(n log n + n log k).
std::optional<IndexGroups> capped_greedy_partition(Lengths lengths, std::span<const double> work, int64_t k,
                                                   int64_t cap);
// The moves and swaps alone, on groups that already respect the cap.
IndexGroups rebalance_under_cap(const IndexGroups& groups, Lengths lengths, std::span<const double> work, int64_t cap);

}  // namespace seqpack
