#pragma once
// Micro-batch planning with a hard token cap.
//
// ROLL's `load_balance` and verl's `rearrange_micro_batches` choose
// k = ceil(total / cap) and balance with Karmarkar-Karp; the cap is only a target
// and is exceeded whenever KK cannot balance tightly enough. Here the cap is a
// hard constraint: plan_micro_batches returns the smallest admissible k for which
// it finds a balanced partition with every micro-batch's token sum <= max_tokens:
// Karmarkar-Karp or LPT (up to 65,536 sequences), else a cap-aware greedy (each
// sequence to the lightest micro-batch with room), else first-fit-decreasing's
// tight bins, each then rebalanced on the workload by moves and swaps that keep
// the cap. k is tried at its lower bound, then at first-fit-decreasing's count and
// bisected in between: a few O(n log n) tries (1M lengths in under a second).
#include <cstdint>
#include <vector>

#include "seqpack/common.hpp"

namespace seqpack {

struct MicroBatchOptions {
  int64_t max_tokens = 0;     // hard cap on each micro-batch's token sum
  int64_t min_num = 1;        // at least this many micro-batches
  int64_t multiple_of = 1;    // the count is a multiple of this (PP / VPP)
  // Workload balanced across micro-batches: tokens (attention_coeff <= 0), or
  // attention_coeff * s + s^2 per sequence of length s (linear layers plus
  // attention; attention_coeff ~ a multiple of the hidden size).
  int64_t attention_coeff = 0;
  // Order micro-batches with the lightest at both ends and the heaviest in the
  // middle (shrinks pipeline-parallel warm-up/cool-down bubbles). Otherwise
  // heaviest first.
  bool small_at_ends = false;
  // The workload of each item when the caller knows it better than its length does
  // (a prefix-tree part: its physical tokens, or attention_coeff * tokens plus its
  // attention pairs as an s^2 equivalent); one non-negative entry per length, or
  // empty to derive it from the lengths and attention_coeff.
  Lengths workloads = {};
};

struct MicroBatchPlan {
  IndexGroups groups;            // indices sorted inside each micro-batch
  std::vector<int64_t> tokens;   // token sum per micro-batch (each <= max_tokens)
  std::vector<int64_t> workloads;
  int64_t lower_bound = 0;       // max(min_num, ceil(total / cap)) before rounding
  const char* method = "";       // which partitioner produced the accepted plan
};

// Per-sequence workload: s, or coeff * s + s^2.
std::vector<int64_t> sequence_workloads(Lengths lengths, int64_t attention_coeff);

// Throws when a single sequence exceeds max_tokens, or when no count that is a
// multiple of multiple_of and at most the number of sequences admits a plan.
MicroBatchPlan plan_micro_batches(Lengths lengths, const MicroBatchOptions& options);

// Reorders groups so the lightest sit at both ends: ascending w0 <= w1 <= ...
// placed at positions 0, last, 1, last-1, ...
std::vector<int64_t> small_at_ends_order(const std::vector<int64_t>& workloads);

}  // namespace seqpack
