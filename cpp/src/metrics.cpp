#include "seqpack/metrics.hpp"

#include <algorithm>
#include <cmath>

namespace seqpack {

PackingStats packing_stats(Lengths lengths, const IndexGroups& bins, int64_t bin_capacity) {
  const char* fn = "packing_stats";
  check_positive(fn, "bin_capacity", bin_capacity);
  PackingStats s;
  if (bins.size() == 0) return s;
  const auto n = static_cast<int64_t>(lengths.size());
  check_non_negative_lengths(fn, "sequence_lengths", lengths);
  check_each_index_once(fn, "bins", bins, n);
  s.total_sequence_length = checked_sum(fn, "sequence_lengths", lengths);  // every bin's load fits too
  const std::vector<int64_t> loads = group_sums(bins, lengths, fn, "a bin's load");
  s.num_sequences = n;
  s.num_bins = static_cast<int64_t>(bins.size());
  s.total_bin_capacity = checked_mul(fn, "num_bins * bin_capacity", s.num_bins, bin_capacity);
  s.total_waste = s.total_bin_capacity - s.total_sequence_length;
  s.average_utilization = static_cast<double>(s.total_sequence_length) / static_cast<double>(s.total_bin_capacity);
  s.waste_ratio = static_cast<double>(s.total_waste) / static_cast<double>(s.total_bin_capacity);
  if (s.num_bins > 1) {
    double mean = 0.0;
    for (int64_t l : loads) mean += static_cast<double>(l) / static_cast<double>(bin_capacity);
    mean /= static_cast<double>(s.num_bins);
    double ss = 0.0;
    for (int64_t l : loads) {
      const double d = static_cast<double>(l) / static_cast<double>(bin_capacity) - mean;
      ss += d * d;
    }
    const double stdev = std::sqrt(ss / static_cast<double>(s.num_bins - 1));
    s.bin_balance = 1.0 - stdev / s.average_utilization;
  } else {
    s.bin_balance = 1.0;
  }
  s.theoretical_min_bins = ceil_div(s.total_sequence_length, bin_capacity);
  s.bin_efficiency = static_cast<double>(s.theoretical_min_bins) / static_cast<double>(s.num_bins);
  s.max_bin_load = *std::max_element(loads.begin(), loads.end());
  return s;
}

BalanceStats dp_balance_stats(Lengths lengths, const IndexGroups& partitions) {
  const char* fn = "dp_balance_stats";
  const auto n = static_cast<int64_t>(lengths.size());
  const auto k = static_cast<int64_t>(partitions.size());
  if (k < 1) throw_invalid(fn, "partitions must not be empty");
  if (n < k) throw_invalid(fn, "fewer sequences (" + std::to_string(n) + ") than partitions (" + std::to_string(k) + ")");
  check_non_negative_lengths(fn, "seqlen_list", lengths);
  check_each_index_once(fn, "partitions", partitions, n);
  checked_sum(fn, "seqlen_list", lengths);  // every partial sum below fits too
  BalanceStats s;
  const int64_t per = n / k;
  int64_t total = 0;
  bool first = true;
  for (int64_t off = 0; off < n; off += per) {
    int64_t sum = 0;
    for (int64_t i = off; i < std::min(off + per, n); ++i) sum += lengths[i];
    s.min = first ? sum : std::min(s.min, sum);
    s.max = first ? sum : std::max(s.max, sum);
    first = false;
    total += sum;
  }
  s.minmax_diff = s.max - s.min;
  const std::vector<int64_t> sums = group_sums(partitions, lengths, fn, "a partition's sum");
  s.balanced_min = *std::min_element(sums.begin(), sums.end());
  s.balanced_max = *std::max_element(sums.begin(), sums.end());
  s.mean = static_cast<double>(total) / static_cast<double>(k);
  return s;
}

DynamicBatchingStats dynamic_batching_stats(const DynamicBatchingPlan& plan, int64_t num_sequences, int64_t width) {
  DynamicBatchingStats s;
  s.valid_tokens = plan.valid_tokens;
  s.actual_tokens_origin = checked_mul("dynamic_batching_stats", "num_sequences * width", num_sequences, width);
  s.actual_tokens = plan.padded_tokens;
  s.removed_padding_tokens = s.actual_tokens_origin - s.actual_tokens;
  s.removed_padding_ratio = s.actual_tokens_origin > 0 ? static_cast<double>(s.removed_padding_tokens) /
                                                            static_cast<double>(s.actual_tokens_origin)
                                                      : 0.0;
  return s;
}

}  // namespace seqpack
