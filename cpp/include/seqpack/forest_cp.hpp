#pragma once
// Context parallelism over a prefix forest: plan_step with a forest and cp_size = C.
//
// Each mini-batch's rows of one tree form one item, planned whole at a CP degree d (a
// power of two dividing C) on an aligned block of d ranks, as a plain row is
// (cp_step.hpp). A sharded tree is cut as seqpack.shard_layout cuts a tree: contiguous
// ranges of its physical tokens in depth-first order, balanced by attention work, so a
// rank's tokens of it are the longest of its d ranges, not T / d:
//
//   tree of 2 rows:  p p p p a a a  /  p p p p b b b     physical 0..9
//   keys seen        1 2 3 4 5 6 7     .       5 6 7
//   d = 2: ranges [0, 6) and [6, 10)  -> a rank holds up to 6 tokens (cap check)
//
// Every item's tokens, attention work (2 pairs - tokens: s² for a row) and longest
// range at each degree come from the forest alone (each row in depth-first order adds
// the depths from its common prefix with the row before it to its length), then the
// CP planner places them. The plan lists every row of a tree in the cells of its
// block; degree and first_rank are per row (its tree's).
#include <cstdint>
#include <span>
#include <vector>

#include "seqpack/common.hpp"
#include "seqpack/cp_step.hpp"
#include "seqpack/prefix_forest.hpp"

namespace seqpack {

// The cut of tokens whose works (the keys each token's query sees) are `work` into
// `cp` contiguous ranges: cp + 1 offsets, a token on the rank whose equal share of the
// total work holds the middle of its own work. O(T log cp).
std::vector<int64_t> cp_work_bounds(std::span<const int64_t> work, int64_t cp);

struct ForestCpItems {
  CpItems items;                          // one per tree of each mini-batch (name "trees")
  IndexGroups rows;                       // the rows of each item, ascending
  std::vector<int64_t> mini_batch_sizes;  // items per mini-batch, in order
};

// The items of the mini-batches holding `mini_batch_rows` consecutive rows each (in
// order, summing to the forest's rows): per mini-batch, its trees in the order of
// their first row there. `cp_size` a power of two. O(physical tokens · log cp_size).
ForestCpItems forest_cp_items(const ForestView& forest, Lengths mini_batch_rows, int64_t cp_size);

// plan_cp_step over the forest's rows, split into mini-batches as plan_step splits
// rows (options.step.mini_batch_sizes, else near-equal): cells, degree and first_rank
// per row; kv_tokens and least_kv_tokens over the trees' physical tokens.
CpStepPlan plan_forest_cp_step(const ForestView& forest, const CpStepOptions& options);

}  // namespace seqpack
