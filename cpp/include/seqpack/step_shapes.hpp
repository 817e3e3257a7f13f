#pragma once
// Step shapes: the order in which a rank runs its micro-batches, and the static
// sizes they are padded to. Neither changes which sequences go together.
//
// Largest first. The caching allocator keeps the blocks of the largest micro-batch
// it has seen; when a smaller one runs first and a larger one later, it reserves
// again and fragments (NeMo-RL PR #3476 ran the largest first and cut reserved memory
// from 158.5 to 71.2 GiB). Each rank's micro-batches of each mini-batch are sorted by
// tokens, largest first (ties: the costlier first, then the planned order). The ranks
// stay in lock-step: their k-th micro-batches run together, and every rank's k-th is
// its k-th largest:
//
//   planned         k=0    k=1    k=2          largest first   k=0    k=1    k=2
//   rank 0          3000   8000   5000         rank 0          8000   5000   3000
//   rank 1          7000   2000   6000         rank 1          7000   6000   2000
//   Σ_k max_r       7000 + 8000 + 6000         Σ_k max_r       8000 + 6000 + 3000
//
// Under StepSync::Step (each rank's sum) the step's time does not change; under
// StepSync::MicroBatch (Σ_k max_r) sorting every rank the same way is the arrangement
// with the least time whenever the costlier of two micro-batches is never the one
// with fewer tokens (a cost model without the attention term): for any threshold t,
// the columns whose maximum exceeds t are then exactly as many as the one rank with
// the most cells above t needs. With the attention term a shorter micro-batch of one
// long sequence can cost more than a fuller one of short ones; the order is still by
// tokens (the allocator's measure) and the time can then rise. With context
// parallelism the ranks of one CP group move together (their blocks share
// micro-batch slots), sorted by the group's largest cell.
//
// Static shapes. CUDA graphs and a flat allocator want a few fixed micro-batch sizes.
// Every micro-batch (dummies included) is padded up to the smallest bucket that holds
// it; the padding is one extra segment of its own, priced like a sequence of that
// length (per_token·p + per_token_squared·p²), and each mini-batch's time is
// recomputed from the padded costs.
#include <cstdint>
#include <vector>

#include "seqpack/step.hpp"

namespace seqpack {

enum class MicroBatchOrder { Planned, LargestFirst };

struct StepShapes {
  MicroBatchOrder order = MicroBatchOrder::Planned;
  std::vector<int64_t> buckets;  // ascending and distinct, the largest holding a full micro-batch; empty: no padding
  bool empty() const { return order == MicroBatchOrder::Planned && buckets.empty(); }
};

// `plan` over `num_ranks` ranks in CP groups of `group` consecutive ranks, ordered and
// padded as `shapes` says (largest first, then the padding), each mini-batch's
// predicted time and the plan's recomputed under `sync`; the lower bounds stay.
// Throws when a micro-batch is larger than the largest bucket.
void shape_step(StepPlan& plan, int64_t num_ranks, int64_t group, const StepCost& cost, StepSync sync,
                const StepShapes& shapes);

}  // namespace seqpack
