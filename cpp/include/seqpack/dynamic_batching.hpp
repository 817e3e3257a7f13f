#pragma once
// Dynamic batching plans: sequences are sorted by length and dealt across
// data-parallel shards; all shards then share one plan of contiguous micro-batch
// ranges, each padded to its longest (rounded) member, with rows * padded_length
// <= max_tokens. Three rules build the plan:
//
//  * NemoRL  - NeMo-RL v0.6 BatchedDataDict.shard_by_batch_size: per chunk of
//              batch_size sequences, sort ascending (stable), stride across shards,
//              greedy ranges over the per-position maximum over shards (rounded up
//              to sequence_length_round, clamped to max_seqlen).
//  * Roll    - ROLL dynamic_batching_shard: one chunk, no clamp, the running maximum
//              starts at sequence_length_round; with pp_size > 1 (VPP) ranges are
//              halved (split_ranges_to_multiple) until the count is a multiple of
//              pp_size.
//  * Optimal - the same sort/stride and the same constraint, but ranges chosen by
//              dynamic programming to minimise the padded tokens (then the count),
//              optionally with the count a multiple of pp_size. Never worse than
//              the greedy rules.
#include <cstdint>
#include <vector>

#include "seqpack/common.hpp"

namespace seqpack {

enum class DynamicBatchingRule { NemoRL, Roll, Optimal };

struct DynamicBatchingOptions {
  int64_t shards = 1;
  int64_t batch_size = 0;             // chunk size; 0 means the whole batch
  int64_t max_tokens_per_microbatch = 0;
  int64_t sequence_length_round = 1;
  int64_t max_seqlen = 0;             // width of the padded batch (clamp); 0: none
  int64_t pp_size = 1;                // count multiple (Roll: with VPP; Optimal: always)
};

struct MicroBatchRange {
  int64_t start = 0;   // row range [start, end) within a shard's chunk
  int64_t end = 0;
  int64_t length = 0;  // padded sequence length of the micro-batch
  bool operator==(const MicroBatchRange&) const = default;
};

struct DynamicBatchingPlan {
  // Data order after sharding (NeMo-RL's batch_sorted_indices): chunk by chunk,
  // and within a chunk shard 0's rows, then shard 1's, ...
  std::vector<int64_t> sorted_indices;
  // One plan per chunk, shared by every shard.
  std::vector<std::vector<MicroBatchRange>> chunks;
  int64_t shard_chunk_size = 0;  // rows per shard per chunk
  // Tokens computed by all shards together (rows * length summed, times shards).
  int64_t padded_tokens = 0;
  int64_t valid_tokens = 0;
};

// ROLL's VPP split (its current rule): while the count is not a multiple of
// pp_size, halve the range with the most rows (more than one; ties to the earlier
// range) at its middle, in place; both halves keep the padded length. Throws when
// no range has two rows left.
void split_ranges_to_multiple(std::vector<MicroBatchRange>& ranges, int64_t pp_size);

DynamicBatchingPlan plan_dynamic_batching(Lengths lengths, const DynamicBatchingOptions& options,
                                          DynamicBatchingRule rule);

// The rows per chunk (batch_size, or all n rows) after checking the options as
// plan_dynamic_batching does: counts positive, n a multiple of the chunk, the chunk
// a multiple of the shards.
int64_t dynamic_batching_chunk(const DynamicBatchingOptions& options, int64_t n);

}  // namespace seqpack
