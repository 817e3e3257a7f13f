#pragma once
// Quality metrics of plans, with the keys and formulas of the frameworks users
// compare against.
#include <cstdint>

#include "seqpack/common.hpp"
#include "seqpack/dynamic_batching.hpp"

namespace seqpack {

// NeMo-RL PackingMetrics.calculate_stats_only.
struct PackingStats {
  int64_t num_sequences = 0;
  int64_t num_bins = 0;
  int64_t total_sequence_length = 0;
  int64_t total_bin_capacity = 0;
  int64_t total_waste = 0;
  double average_utilization = 0.0;  // total length / total capacity
  double waste_ratio = 0.0;          // total waste / total capacity
  double bin_balance = 0.0;          // 1 - sample stdev(bin utilization) / average utilization
  int64_t theoretical_min_bins = 0;  // ceil(total length / capacity)
  double bin_efficiency = 0.0;       // theoretical_min_bins / num_bins
  int64_t max_bin_load = 0;          // beyond NeMo-RL: the fullest bin
};
// Validates that every bin index is in range; bins may be empty.
PackingStats packing_stats(Lengths lengths, const IndexGroups& bins, int64_t bin_capacity);

// verl / ROLL log_seqlen_unbalance: token sums of the contiguous split (n // k rows
// per part, as the batch would be split without balancing) and of the balanced
// partitions.
struct BalanceStats {
  int64_t min = 0, max = 0, minmax_diff = 0;
  int64_t balanced_min = 0, balanced_max = 0;
  double mean = 0.0;
};
BalanceStats dp_balance_stats(Lengths lengths, const IndexGroups& partitions);

// ROLL dynamic_batching_shard metrics. `actual_tokens` counts every row of every
// micro-batch at its padded length over all shards. (ROLL's own accumulation adds
// a range's tokens only when the next range opens, and then the over-cap total; we
// report the tokens that are actually computed.)
struct DynamicBatchingStats {
  int64_t valid_tokens = 0;
  int64_t actual_tokens_origin = 0;  // rows * padded width before dynamic batching
  int64_t actual_tokens = 0;
  int64_t removed_padding_tokens = 0;
  double removed_padding_ratio = 0.0;
};
DynamicBatchingStats dynamic_batching_stats(const DynamicBatchingPlan& plan, int64_t num_sequences, int64_t width);

}  // namespace seqpack
