#pragma once
// Planning the rows of a prefix forest into micro-batches under a hard cap on each
// micro-batch's *physical* tokens (what pack_prefix_tree of its rows lays out), and
// a whole training step over data-parallel ranks: one call each, items, splitting,
// placement, cost and bounds all here.
//
// A tree that fits the cap need not stay whole: splitting it fills capacity that
// would otherwise stay empty, at the price of its prefix once more per part. This is
// bin packing with fragmentable items, a fragment costing its repeated prefix:
//
//   cap 16; trees A B C D, each a 1-token prompt and 5 responses of 2 tokens (11)
//   whole trees:  [A] [B] [C] [D]                      4 micro-batches, 44 tokens
//   split:        [A + B(2 responses)]  16 tokens      3 micro-batches, 46 tokens:
//                 [B(3) + C(4)]         16 tokens      B and C carry their prompt
//                 [C(1) + D]            14 tokens      twice; ceil(44 / 16) = 3
//
// plan_forest_micro_batches keeps the best of several packings, by fewest
// micro-batches, then fewest physical tokens, then the lightest heaviest micro-batch:
//  * whole trees (the trees that fit stay whole, larger ones split duplicating the
//    fewest tokens), first-fit-decreasing and Karmarkar-Karp / LPT balancing;
//  * trees by decreasing size, each placed whole where it fits best, else cut at the
//    row boundary that leaves the least behind into the emptiest micro-batch;
//  * first fit over rows in depth-first order, trees by decreasing size, each row
//    counting only the tokens it adds to a micro-batch;
//  * first fit over rows in the given order (AReaL's trie packing: first_fit_trie).
// Each is brought to an admissible count (min_num, multiple_of: the heaviest
// micro-batch of several rows cut where its rows share the fewest tokens) and its
// parts (one tree's rows in one micro-batch) rebalanced on the workload when that
// keeps the count. With `whole_trees` only the first runs: losses that couple a
// tree's rows inside a micro-batch (preference pairs) keep them together.
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "seqpack/common.hpp"
#include "seqpack/dynamic_batching.hpp"
#include "seqpack/prefix_forest.hpp"
#include "seqpack/step.hpp"

namespace seqpack {

struct ForestPlanOptions {
  int64_t max_tokens = 0;       // hard cap on each micro-batch's physical tokens
  int64_t min_num = 1;          // at least this many micro-batches
  int64_t multiple_of = 1;      // the count is a multiple of this
  // Balance physical tokens (<= 0), or attention_coeff * tokens + 2 * pairs - tokens
  // (attention_coeff * s + s^2 for a plain row of s tokens).
  int64_t attention_coeff = 0;
  bool small_at_ends = false;   // order: lightest at both ends, else heaviest first
  bool whole_trees = false;     // a tree that fits stays in one micro-batch
};

struct ForestMicroBatchPlan {
  IndexGroups groups;             // row ids, ascending within each micro-batch
  std::vector<int64_t> tokens;    // physical tokens of each micro-batch (<= max_tokens)
  std::vector<int64_t> pairs;     // visible attention pairs of each micro-batch
  std::vector<int64_t> workloads;
  int64_t lower_bound = 0;        // max(min_num, ceil(physical_tokens / max_tokens))
  int64_t physical_tokens = 0;    // the rows as one prefix tree: no plan holds fewer
  const char* method = "";        // the packing kept
};

// All rows of the forest, or the subset `rows` (distinct ids). Throws when a row is
// longer than max_tokens or no admissible count can be filled with the rows.
ForestMicroBatchPlan plan_forest_micro_batches(const ForestView& forest, const ForestPlanOptions& options);
ForestMicroBatchPlan plan_forest_micro_batches(const ForestView& forest, const ForestPlanOptions& options,
                                               std::span<const int64_t> rows);

// AReaL's trie packing (areal/models/tree_attn/tree.py, _greedy_build_tries): rows
// in the given order, each joining the first micro-batch where the tokens it adds
// (its length minus its longest common prefix with a row already there) fit; a new
// micro-batch otherwise. Micro-batches in creation order, row ids ascending inside.
// O(R log R) plus the micro-batches holding each row's tree.
IndexGroups first_fit_trie(const ForestView& forest, int64_t max_tokens, std::span<const int64_t> rows);

struct ForestStepPlan {
  StepPlan plan;                        // cells of row ids; tokens / costs from physical tokens and pairs
  std::vector<std::string> planned_on;  // the packing each mini-batch kept
};

// plan_step over a forest's rows (options.squares / mini_batch_sizes unused): each
// mini-batch planned by the step planner on several item sets: whole trees (a tree
// over the cap in its fewest-duplication runs), and the micro-batches of the packings
// above as they come out of them (split_trees, first_fit_rows, first_fit_trie: before
// any count adjustment), and the rows themselves; plus trees dealt to ranks by their
// work, then packed per rank with their trees whole. Every cell costed from its own
// physical tokens and pairs, the fastest predicted step kept. With `whole_trees` only
// whole trees (dropped when a tree over the cap lands on two ranks) and trees dealt
// to ranks are candidates.
ForestStepPlan plan_forest_step(const ForestView& forest, const StepOptions& options, bool whole_trees);

// Dynamic batching over a forest (dynamic_batching.hpp's plan shape: every shard the
// same number of rows per chunk, one list of [start, end) row ranges shared by all
// shards), the cap on each shard's micro-batch *physical* tokens rounded up to
// sequence_length_round. Per chunk: trees, heaviest first, each whole to the
// least-loaded shard (physical tokens) with room for its rows, else cut in depth-first
// order over the shards with the most room; each shard's trees heaviest first, rows
// depth-first; then the fewest ranges (greedy: each as long as every shard's rows
// there fit), split to a multiple of pp_size as ROLL splits. `length` of a range: its
// longest row over the shards, rounded up (the padded width of its rows);
// padded_tokens: the shards' micro-batches' rounded physical tokens, summed.
// options.max_seqlen is unused.
DynamicBatchingPlan plan_forest_dynamic_batching(const ForestView& forest, const DynamicBatchingOptions& options);

}  // namespace seqpack
