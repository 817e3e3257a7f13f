#include <gtest/gtest.h>

#include <cmath>

#include "seqpack/dynamic_batching.hpp"
#include "seqpack/metrics.hpp"
#include "seqpack/packing.hpp"
#include "seqpack/partition.hpp"
#include "test_helpers.hpp"

namespace {

using namespace seqpack;
using seqpack_test::ThrowsInvalid;
using Vec = std::vector<int64_t>;

IndexGroups groups(const seqpack_test::Nested& nested) { return IndexGroups::from_nested(nested); }

// Sample standard deviation (n - 1), as Python's statistics.stdev.
double sample_stdev(const std::vector<double>& x) {
  double mean = 0.0;
  for (double v : x) mean += v;
  mean /= static_cast<double>(x.size());
  double ss = 0.0;
  for (double v : x) ss += (v - mean) * (v - mean);
  return std::sqrt(ss / static_cast<double>(x.size() - 1));
}

TEST(Metrics, PackingStatsByHand) {
  const PackingStats s = packing_stats(Vec{30, 30, 30, 30, 30}, groups({{4, 3, 2}, {1, 0}}), 100);
  EXPECT_EQ(s.num_sequences, 5);
  EXPECT_EQ(s.num_bins, 2);
  EXPECT_EQ(s.total_sequence_length, 150);
  EXPECT_EQ(s.total_bin_capacity, 200);
  EXPECT_EQ(s.total_waste, 50);
  EXPECT_DOUBLE_EQ(s.average_utilization, 0.75);
  EXPECT_DOUBLE_EQ(s.waste_ratio, 0.25);
  EXPECT_EQ(s.theoretical_min_bins, 2);
  EXPECT_DOUBLE_EQ(s.bin_efficiency, 1.0);
  EXPECT_EQ(s.max_bin_load, 90);
  EXPECT_NEAR(s.bin_balance, 1.0 - sample_stdev({0.9, 0.6}) / 0.75, 1e-12);
  EXPECT_NEAR(s.bin_balance, 1.0 - std::sqrt(0.045) / 0.75, 1e-12);  // 0.717157...
}

TEST(Metrics, PackingStatsThreeUnevenBins) {
  // Loads 100, 50, 10 of capacity 100: utilizations 1.0, 0.5, 0.1.
  const Vec lengths = {60, 40, 50, 10};
  const PackingStats s = packing_stats(lengths, groups({{0, 1}, {2}, {3}}), 100);
  EXPECT_EQ(s.total_sequence_length, 160);
  EXPECT_EQ(s.total_waste, 140);
  EXPECT_DOUBLE_EQ(s.average_utilization, 160.0 / 300.0);
  EXPECT_DOUBLE_EQ(s.waste_ratio, 140.0 / 300.0);
  EXPECT_EQ(s.theoretical_min_bins, 2);
  EXPECT_DOUBLE_EQ(s.bin_efficiency, 2.0 / 3.0);
  EXPECT_EQ(s.max_bin_load, 100);
  EXPECT_NEAR(s.bin_balance, 1.0 - sample_stdev({1.0, 0.5, 0.1}) / (160.0 / 300.0), 1e-12);
}

TEST(Metrics, PackingStatsEdgeCases) {
  const PackingStats one = packing_stats(Vec{10, 20}, groups({{0, 1}}), 50);
  EXPECT_DOUBLE_EQ(one.bin_balance, 1.0);  // stdev undefined for one bin
  EXPECT_DOUBLE_EQ(one.average_utilization, 0.6);
  EXPECT_EQ(one.theoretical_min_bins, 1);
  const PackingStats none = packing_stats(Vec{}, IndexGroups{}, 50);
  EXPECT_EQ(none.num_bins, 0);
  EXPECT_EQ(none.total_bin_capacity, 0);
  EXPECT_DOUBLE_EQ(none.average_utilization, 0.0);
  // Empty bins are allowed and count as capacity.
  const PackingStats with_empty = packing_stats(Vec{50}, groups({{0}, {}}), 100);
  EXPECT_EQ(with_empty.total_waste, 150);
  EXPECT_DOUBLE_EQ(with_empty.average_utilization, 0.25);
}

TEST(Metrics, PackingStatsAgreesWithAPackedResult) {
  const Vec lengths = seqpack_test::uniform_lengths(9, 1000, 1, 4096);
  const IndexGroups bins = first_fit_decreasing(lengths, 4096);
  const PackingStats s = packing_stats(lengths, bins, 4096);
  EXPECT_EQ(s.num_bins, static_cast<int64_t>(bins.size()));
  EXPECT_EQ(s.total_sequence_length, seqpack_test::sum_of(lengths));
  EXPECT_EQ(s.total_waste + s.total_sequence_length, s.total_bin_capacity);
  EXPECT_EQ(s.max_bin_load, seqpack_test::max_of(group_sums(bins, lengths)));
  EXPECT_LE(s.max_bin_load, 4096);
  EXPECT_GT(s.bin_efficiency, 0.9);
  EXPECT_LE(s.bin_efficiency, 1.0);
  EXPECT_NEAR(s.average_utilization + s.waste_ratio, 1.0, 1e-12);
}

TEST(Metrics, PackingStatsInvalidArguments) {
  const Vec lengths = {1, 2, 3};
  EXPECT_TRUE(ThrowsInvalid([&] { packing_stats(lengths, groups({{0, 3}}), 10); }, {"bins", "3"}));
  EXPECT_TRUE(ThrowsInvalid([&] { packing_stats(lengths, groups({{-1}}), 10); }, {"bins", "-1"}));
  EXPECT_TRUE(ThrowsInvalid([&] { packing_stats(lengths, groups({{0}}), 0); }, {"bin_capacity"}));
}

TEST(Metrics, DpBalanceStatsByHand) {
  // Contiguous split of 2 rows: sums 3, 7, 11; balanced sums 7, 7, 7.
  const BalanceStats s = dp_balance_stats(Vec{1, 2, 3, 4, 5, 6}, groups({{0, 5}, {1, 4}, {2, 3}}));
  EXPECT_EQ(s.min, 3);
  EXPECT_EQ(s.max, 11);
  EXPECT_EQ(s.minmax_diff, 8);
  EXPECT_EQ(s.balanced_min, 7);
  EXPECT_EQ(s.balanced_max, 7);
  EXPECT_DOUBLE_EQ(s.mean, 7.0);
}

TEST(Metrics, DpBalanceStatsWithARemainder) {
  // n = 5, k = 2: verl walks offsets 0, 2, 4, so a third, short part (5) counts.
  const BalanceStats s = dp_balance_stats(Vec{1, 2, 3, 4, 5}, groups({{0, 1, 4}, {2, 3}}));
  EXPECT_EQ(s.min, 3);
  EXPECT_EQ(s.max, 7);
  EXPECT_EQ(s.minmax_diff, 4);
  EXPECT_EQ(s.balanced_min, 7);
  EXPECT_EQ(s.balanced_max, 8);
  EXPECT_DOUBLE_EQ(s.mean, 7.5);
}

TEST(Metrics, DpBalanceStatsOfKarmarkarKarp) {
  const Vec lengths = seqpack_test::lognormal_lengths(5, 512, 1000, 1.0, 1, 16384);
  const IndexGroups parts = karmarkar_karp(lengths, 8, true, true);
  const BalanceStats s = dp_balance_stats(lengths, parts);
  EXPECT_LE(s.balanced_max - s.balanced_min, s.max - s.min);
  EXPECT_LE(s.balanced_min, s.balanced_max);
  EXPECT_DOUBLE_EQ(s.mean, static_cast<double>(seqpack_test::sum_of(lengths)) / 8.0);
  EXPECT_LE(static_cast<double>(s.balanced_min), s.mean);
  EXPECT_GE(static_cast<double>(s.balanced_max), s.mean);
}

TEST(Metrics, DpBalanceStatsInvalidArguments) {
  EXPECT_TRUE(ThrowsInvalid([] { dp_balance_stats(Vec{1, 2}, IndexGroups{}); }, {"partitions"}));
  EXPECT_TRUE(ThrowsInvalid([] { dp_balance_stats(Vec{1}, groups({{0}, {}})); }, {"partitions"}));
  EXPECT_TRUE(ThrowsInvalid([] { dp_balance_stats(Vec{1, 2}, groups({{0}, {2}})); }, {"partitions", "2"}));
}

TEST(Metrics, DynamicBatchingStats) {
  // ROLL example: 8 sequences padded to width 8 -> 64 tokens; the plan computes 52.
  DynamicBatchingOptions o;
  o.shards = 2;
  o.max_tokens_per_microbatch = 10;
  o.sequence_length_round = 2;
  const Vec lengths = {7, 6, 8, 5, 1, 3, 8, 6};
  const DynamicBatchingPlan plan = plan_dynamic_batching(lengths, o, DynamicBatchingRule::Roll);
  const DynamicBatchingStats s = dynamic_batching_stats(plan, 8, 8);
  EXPECT_EQ(s.valid_tokens, 44);
  EXPECT_EQ(s.actual_tokens_origin, 64);
  EXPECT_EQ(s.actual_tokens, 52);
  EXPECT_EQ(s.removed_padding_tokens, 12);
  EXPECT_DOUBLE_EQ(s.removed_padding_ratio, 12.0 / 64.0);

  const DynamicBatchingStats empty = dynamic_batching_stats(DynamicBatchingPlan{}, 0, 128);
  EXPECT_EQ(empty.actual_tokens_origin, 0);
  EXPECT_DOUBLE_EQ(empty.removed_padding_ratio, 0.0);
  EXPECT_TRUE(ThrowsInvalid([&] { dynamic_batching_stats(plan, int64_t{1} << 40, int64_t{1} << 40); }, {"overflow"}));
}

// Issue 26: the overflow errors name the quantity that overflowed.
TEST(Metrics, OverflowErrorsNameTheQuantity) {
  EXPECT_TRUE(ThrowsInvalid([] { packing_stats(Vec{INT64_MAX, 1}, groups({{0}, {1}}), INT64_MAX); },
                            {"[seqpack.packing_stats]", "sum of sequence_lengths overflows int64"}));
  EXPECT_TRUE(ThrowsInvalid([] { packing_stats(Vec{5, 1}, groups({{0}, {1}}), INT64_MAX); },
                            {"num_bins * bin_capacity"}));
  EXPECT_TRUE(ThrowsInvalid([] { dp_balance_stats(Vec{INT64_MAX, 1}, groups({{0}, {1}})); },
                            {"[seqpack.dp_balance_stats]", "sum of seqlen_list overflows int64"}));
  EXPECT_TRUE(ThrowsInvalid([] { dynamic_batching_stats(DynamicBatchingPlan{}, INT64_MAX, 2); },
                            {"num_sequences * width"}));
}

}  // namespace
