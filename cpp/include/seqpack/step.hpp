#pragma once
// Planning a whole training step: sequences over data-parallel ranks and
// micro-batches at once, for the fastest step under a cost model.
//
// A micro-batch of lengths s costs  c0 + c1·Σs + c2·Σs²  (per micro-batch
// overhead, linear work, attention quadratic per sequence). Ranks in lock-step
// micro-batch by micro-batch (FSDP / ZeRO-3: each micro-batch all-gathers the
// parameters) take  Σ_k max_r cost(r, k)  per mini-batch (StepSync::MicroBatch);
// ranks synchronised once per step (DDP, Megatron) take  max_r Σ_k cost(r, k)
// (StepSync::Step). An empty (dummy) micro-batch still runs, so it costs c0.
//
// Guarantees of plan_step: every index exactly once; no micro-batch above
// max_tokens; in each mini-batch every rank has the same number of micro-batches
// K (a multiple of multiple_of, at least min_micro_batches); dummies only where
// needed (MicroBatch: only when the mini-batch has fewer sequences than the
// K·dp_size micro-batches; Step: a rank has a dummy only when each of its
// micro-batches holds at most one sequence); the result depends only on the
// inputs and the seed.
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "seqpack/common.hpp"

namespace seqpack {

enum class StepSync { MicroBatch, Step };

struct StepCost {
  double per_micro_batch = 0.0;    // c0
  double per_token = 1.0;          // c1
  double per_token_squared = 0.0;  // c2
  // c1·s + c2·s², the part of a micro-batch's cost one sequence brings.
  double work(int64_t s) const {
    const auto x = static_cast<double>(s);
    return per_token * x + per_token_squared * x * x;
  }
};

struct StepOptions {
  int64_t dp_size = 1;
  int64_t max_tokens = 0;
  StepCost cost;
  StepSync sync = StepSync::MicroBatch;
  int64_t mini_batches = 1;       // equal contiguous split, as numpy.array_split
  int64_t min_micro_batches = 1;  // per rank and mini-batch
  int64_t multiple_of = 1;        // the count per rank is a multiple of this
  std::optional<uint64_t> seed;   // breaks ties among equal lengths; none: by index
  // Per sequence, what stands in for s² in the attention term (empty: s² itself): a
  // prefix-tree item of `s` physical tokens puts 2·pairs − s there (its visible
  // attention pairs; exactly s² for a plain row, at most s²) plus the work items it
  // holds (a VLM's images, prefix_forest.hpp), which can pass s². One per length, >= 0.
  Lengths squares = {};
  // Sequences per mini-batch, in order (each >= 1, summing to the number of
  // sequences, mini_batches entries), instead of the near-equal split; empty: split.
  Lengths mini_batch_sizes = {};
};

struct MiniBatchStep {
  int64_t begin = 0, end = 0;      // the mini-batch's slice of the global batch
  int64_t num_micro_batches = 0;   // K, the same on every rank
  IndexGroups cells;               // dp_size·K groups, rank-major: cell r·K + k
  std::vector<double> costs;       // cost of each cell, same order
  std::vector<int64_t> tokens;     // token sum of each cell
  std::vector<int64_t> padded;     // static shapes (step_shapes.hpp): each cell's padded size; else empty
  double predicted_time = 0.0;
  double lower_bound = 0.0;
};

struct StepPlan {
  std::vector<MiniBatchStep> mini_batches;
  double predicted_time = 0.0;  // summed over mini-batches
  double lower_bound = 0.0;
};

StepPlan plan_step(Lengths lengths, const StepOptions& options);

// The number of sequences (or items) in each mini-batch, in order:
// options.mini_batch_sizes (checked: mini_batches sizes >= 1 summing to n), else the
// near-equal split of numpy.array_split. Throws when n < mini_batches; messages name
// the units as `name` ("lengths") and `units` ("sequences").
std::vector<int64_t> mini_batch_counts(int64_t n, const StepOptions& options, const std::string& name,
                                       const char* units);

// Throws what plan_step throws for these options (counts, the cost model).
void check_step_options(const StepOptions& options);

// The time of cells laid out rank-major (r·K + k) under a sync mode.
double step_time(const std::vector<double>& cell_costs, int64_t dp_size, int64_t num_micro_batches, StepSync sync);

// A proven lower bound on the time of any valid plan of one mini-batch (see
// docs/planning.md): K_min·c0 plus, for MicroBatch, the least Σ_k M_k allowed by
// the step maxima's floors (the heaviest sequences that cannot share a
// micro-batch) and the work each step can hold under the token cap; for Step,
// max(W / dp_size, the heaviest sequence).
double step_lower_bound(Lengths lengths, const StepOptions& options);

}  // namespace seqpack
