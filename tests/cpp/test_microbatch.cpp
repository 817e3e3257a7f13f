#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "seqpack/microbatch.hpp"
#include "seqpack/packing.hpp"
#include "test_helpers.hpp"

namespace {

using namespace seqpack;
using seqpack_test::IsPartition;
using seqpack_test::ThrowsInvalid;
using Vec = std::vector<int64_t>;

const Vec kRoll = {512, 1024, 256, 2048, 128, 768, 1536, 384, 896, 640};

MicroBatchOptions options(int64_t max_tokens, int64_t min_num = 1, int64_t multiple_of = 1, int64_t coeff = 0,
                          bool small_at_ends = false) {
  MicroBatchOptions o;
  o.max_tokens = max_tokens;
  o.min_num = min_num;
  o.multiple_of = multiple_of;
  o.attention_coeff = coeff;
  o.small_at_ends = small_at_ends;
  return o;
}

// Heaviest first, or rising to a peak and falling again with the two lightest
// at the ends.
::testing::AssertionResult IsOrdered(const Vec& w, bool small_at_ends) {
  if (!small_at_ends) {
    if (std::is_sorted(w.rbegin(), w.rend())) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "workloads not non-increasing";
  }
  if (w.size() < 2) return ::testing::AssertionSuccess();
  Vec sorted = w;
  std::sort(sorted.begin(), sorted.end());
  if (std::min(w.front(), w.back()) != sorted[0] || std::max(w.front(), w.back()) != sorted[1])
    return ::testing::AssertionFailure() << "the two lightest micro-batches are not at the ends";
  const auto peak = std::max_element(w.begin(), w.end());
  if (!std::is_sorted(w.begin(), peak + 1) || !std::is_sorted(w.rbegin(), std::make_reverse_iterator(peak)))
    return ::testing::AssertionFailure() << "workloads do not rise then fall";
  return ::testing::AssertionSuccess();
}

// Every property the plan promises.
::testing::AssertionResult IsValidPlan(const MicroBatchPlan& p, const Vec& lengths, const MicroBatchOptions& o) {
  auto part = IsPartition(p.groups, lengths.size());
  if (!part) return part;
  const size_t k = p.groups.size();
  if (p.tokens != group_sums(p.groups, lengths)) return ::testing::AssertionFailure() << "tokens mismatch";
  if (p.workloads != group_sums(p.groups, sequence_workloads(lengths, o.attention_coeff)))
    return ::testing::AssertionFailure() << "workloads mismatch";
  for (size_t g = 0; g < k; ++g) {
    auto items = p.groups.group(g);
    if (!std::is_sorted(items.begin(), items.end()))
      return ::testing::AssertionFailure() << "micro-batch " << g << " not sorted";
    if (p.tokens[g] > o.max_tokens) return ::testing::AssertionFailure() << "micro-batch " << g << " over the cap";
  }
  const int64_t total = seqpack_test::sum_of(lengths);
  const int64_t lower = std::max(o.min_num, ceil_div(total, o.max_tokens));
  if (p.lower_bound != lower) return ::testing::AssertionFailure() << "lower_bound " << p.lower_bound << " != " << lower;
  const auto count = static_cast<int64_t>(k);
  if (count < lower || count % o.multiple_of != 0)
    return ::testing::AssertionFailure() << count << " micro-batches violates the count rule";
  // First-fit-decreasing bins split up to the count bound the search.
  const auto ffd = static_cast<int64_t>(first_fit_decreasing(lengths, o.max_tokens).size());
  if (count > round_up("test", std::max(ffd, lower), o.multiple_of))
    return ::testing::AssertionFailure() << count << " micro-batches, more than the FFD bound";
  const char* m = p.method;
  if (std::strcmp(m, "karmarkar_karp") && std::strcmp(m, "greedy_lpt") && std::strcmp(m, "capped_greedy") &&
      std::strcmp(m, "first_fit_decreasing"))
    return ::testing::AssertionFailure() << "unknown method " << m;
  return IsOrdered(p.workloads, o.small_at_ends);
}

TEST(MicroBatch, RollExampleSplitsIntoTwoFullBatches) {
  const MicroBatchOptions o = options(4096);
  const MicroBatchPlan p = plan_micro_batches(kRoll, o);
  ASSERT_EQ(p.groups.size(), 2u);
  EXPECT_EQ(p.tokens, (Vec{4096, 4096}));
  EXPECT_EQ(p.lower_bound, 2);
  EXPECT_TRUE(IsValidPlan(p, kRoll, o));
}

TEST(MicroBatch, PropertiesOnRandomInputs) {
  int checked = 0;
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    const int64_t cap = int64_t{4096} << (seed % 3);
    const Vec lengths = seqpack_test::lognormal_lengths(seed, 40 + 80 * seed, 900, 1.0, 1, cap);
    for (int64_t min_num : {1, 3, 16})
      for (int64_t multiple_of : {1, 2, 4})
        for (int64_t coeff : {0, 4096})
          for (bool ends : {false, true}) {
            SCOPED_TRACE("seed " + std::to_string(seed) + " min_num " + std::to_string(min_num) + " multiple_of " +
                         std::to_string(multiple_of) + " coeff " + std::to_string(coeff) + " ends " +
                         std::to_string(ends));
            const MicroBatchOptions o = options(cap, min_num, multiple_of, coeff, ends);
            const MicroBatchPlan p = plan_micro_batches(lengths, o);
            EXPECT_TRUE(IsValidPlan(p, lengths, o));
            EXPECT_EQ(plan_micro_batches(lengths, o).groups, p.groups) << "not deterministic";
            ++checked;
          }
  }
  EXPECT_EQ(checked, 6 * 3 * 3 * 2 * 2);
}

TEST(MicroBatch, TightCapNeedsMoreThanTheLowerBound) {
  // 6 + 6 > 10: every sequence needs its own micro-batch although ceil(24/10) = 3.
  const Vec lengths = {6, 6, 6, 6};
  const MicroBatchPlan p = plan_micro_batches(lengths, options(10));
  EXPECT_EQ(p.lower_bound, 3);
  EXPECT_EQ(p.groups.size(), 4u);
  EXPECT_TRUE(IsValidPlan(p, lengths, options(10)));
  // A few long sequences among short ones: balance alone would overflow the cap.
  const Vec skewed = {900, 900, 900, 100, 100, 100, 100, 100, 100, 100};
  const MicroBatchOptions o = options(1000);
  EXPECT_TRUE(IsValidPlan(plan_micro_batches(skewed, o), skewed, o));
}

TEST(MicroBatch, CappedGreedyWhenKarmarkarKarpAndLptOverflow) {
  // At 2 micro-batches of cap 10, KK and LPT on the workload 4*s + s^2 both
  // overflow; first-fit-decreasing's bins ({0,1,2,5} and {3,4}: workloads 98 and
  // 61) fit, and the cap-aware greedy does better: {1,3} and {0,2,4,5}, 89 and 70.
  const Vec lengths = {2, 2, 4, 7, 3, 1};
  const MicroBatchOptions o = options(10, 1, 1, 4);
  const MicroBatchPlan p = plan_micro_batches(lengths, o);
  EXPECT_STREQ(p.method, "capped_greedy");
  EXPECT_TRUE(IsValidPlan(p, lengths, o));
  ASSERT_EQ(p.groups.size(), 2u);
  EXPECT_EQ(p.groups.to_nested(), (seqpack_test::Nested{{1, 3}, {0, 2, 4, 5}}));
  EXPECT_EQ(p.workloads, (Vec{89, 70}));
}

TEST(MicroBatch, EmptyInputGivesAnEmptyPlan) {
  const MicroBatchPlan p = plan_micro_batches(Vec{}, options(100));
  EXPECT_EQ(p.groups.size(), 0u);
  EXPECT_TRUE(p.tokens.empty());
}

TEST(MicroBatch, SequenceWorkloads) {
  EXPECT_EQ(sequence_workloads(Vec{1, 2, 3}, 10), (Vec{11, 24, 39}));
  EXPECT_EQ(sequence_workloads(Vec{1, 2, 3}, 0), (Vec{1, 2, 3}));
  EXPECT_EQ(sequence_workloads(Vec{1, 2, 3}, -5), (Vec{1, 2, 3}));
  EXPECT_EQ(sequence_workloads(Vec{4096}, 24576), (Vec{24576 * 4096 + 4096 * 4096}));
  EXPECT_TRUE(ThrowsInvalid([] { sequence_workloads(Vec{1, -1}, 10); }, {"lengths"}));
  EXPECT_TRUE(ThrowsInvalid([] { sequence_workloads(Vec{int64_t{1} << 40}, 1); }, {"overflows"}));
}

TEST(MicroBatch, AttentionCoeffBalancesQuadraticWorkloads) {
  const Vec lengths = seqpack_test::lognormal_lengths(77, 256, 2000, 1.2, 16, 16384);
  const MicroBatchOptions o = options(32768, 8, 1, 4096);
  const MicroBatchPlan p = plan_micro_batches(lengths, o);
  EXPECT_TRUE(IsValidPlan(p, lengths, o));
  const Vec w = sequence_workloads(lengths, 4096);
  EXPECT_EQ(p.workloads, group_sums(p.groups, w));
}

// Workloads given per item (prefix-tree parts) are the ones balanced: the same
// workloads given explicitly or derived from attention_coeff give the same plan, in
// every partitioner (the capped greedy and FFD rebalancing read them too).
TEST(MicroBatch, GivenWorkloadsAreTheOnesBalanced) {
  for (int64_t cap : {32768, 17000, 16400}) {
    const Vec lengths = seqpack_test::lognormal_lengths(78, 300, 2000, 1.2, 16, 16384);
    const MicroBatchOptions derived = options(cap, 4, 1, 4096);
    const Vec w = sequence_workloads(lengths, 4096);
    MicroBatchOptions given = options(cap, 4, 1, 0);
    given.workloads = w;
    const MicroBatchPlan a = plan_micro_batches(lengths, derived), b = plan_micro_batches(lengths, given);
    EXPECT_EQ(a.groups, b.groups) << cap;
    EXPECT_EQ(b.workloads, group_sums(b.groups, w)) << cap;
  }
  const Vec lengths = {2, 2, 4, 7, 3, 1};  // the capped greedy's case above, with given workloads
  MicroBatchOptions o = options(10, 1, 1, 0);
  const Vec w = sequence_workloads(lengths, 4);
  o.workloads = w;
  const MicroBatchPlan p = plan_micro_batches(lengths, o);
  EXPECT_STREQ(p.method, "capped_greedy");
  EXPECT_EQ(p.workloads, (Vec{89, 70}));
  const Vec short_w = {1, 2};
  o.workloads = short_w;
  EXPECT_TRUE(ThrowsInvalid([&] { plan_micro_batches(lengths, o); }, {"workloads", "one entry per length"}));
}

TEST(MicroBatch, SmallAtEndsOrder) {
  // Ascending: 1(1) 2(3) 3(4) 4(2) 5(0) placed at 0, last, 1, last-1, middle.
  EXPECT_EQ(small_at_ends_order(Vec{5, 1, 4, 2, 3}), (Vec{1, 4, 0, 2, 3}));
  EXPECT_EQ(small_at_ends_order(Vec{7}), (Vec{0}));
  EXPECT_TRUE(small_at_ends_order(Vec{}).empty());
  // Ties keep their input order.
  EXPECT_EQ(small_at_ends_order(Vec{2, 2, 2, 2}), (Vec{0, 2, 3, 1}));
  const MicroBatchPlan p = plan_micro_batches(kRoll, options(2048, 1, 1, 0, true));
  ASSERT_GE(p.groups.size(), 4u);
  EXPECT_TRUE(IsOrdered(p.workloads, true));
}

TEST(MicroBatch, MinNumAndMultipleOf) {
  const MicroBatchPlan p = plan_micro_batches(kRoll, options(4096, 3, 4));
  EXPECT_EQ(p.groups.size(), 4u);
  EXPECT_EQ(p.lower_bound, 3);
  EXPECT_EQ(plan_micro_batches(kRoll, options(4096, 1, 5)).groups.size(), 5u);
  EXPECT_EQ(plan_micro_batches(kRoll, options(4096, 10)).groups.size(), 10u);
}

TEST(MicroBatch, InvalidArguments) {
  EXPECT_TRUE(ThrowsInvalid([] { plan_micro_batches(Vec{10, 200, 30}, options(100)); }, {"lengths", "max_tokens"}));
  // ceil(8192 / 4096) = 2 but min_num 11 > 10 sequences.
  EXPECT_TRUE(ThrowsInvalid([] { plan_micro_batches(kRoll, options(4096, 11)); }, {"min_num", "10 sequences"}));
  EXPECT_TRUE(ThrowsInvalid([] { plan_micro_batches(kRoll, options(4096, 1, 11)); }, {"multiple_of"}));
  // Three full sequences cannot make min_num = 4 micro-batches.
  EXPECT_TRUE(ThrowsInvalid([] { plan_micro_batches(Vec{100, 100, 100}, options(100, 4)); }, {"only 3 sequences"}));
  // Four sequences of 6 with cap 10 need 4 micro-batches, but multiple_of 3 allows
  // only 3 (over the cap) or 6 (more than the sequences).
  EXPECT_TRUE(ThrowsInvalid([] { plan_micro_batches(Vec{6, 6, 6, 6}, options(10, 1, 3)); }, {"max_tokens"}));
  EXPECT_TRUE(ThrowsInvalid([] { plan_micro_batches(kRoll, options(0)); }, {"max_tokens"}));
  EXPECT_TRUE(ThrowsInvalid([] { plan_micro_batches(kRoll, options(4096, 0)); }, {"min_num"}));
  EXPECT_TRUE(ThrowsInvalid([] { plan_micro_batches(kRoll, options(4096, 1, 0)); }, {"multiple_of"}));
  EXPECT_TRUE(ThrowsInvalid([] { plan_micro_batches(Vec{5, -5}, options(100)); }, {"lengths"}));
}

// Found by fuzz_micro_batches' sanitizers: the lower bound rounded up to
// multiple_of wrapped around (and passed the "more than n" check).
TEST(MicroBatch, FuzzRegressions) {
  MicroBatchOptions o;
  o.max_tokens = 10;
  o.min_num = INT64_MAX - 1;
  o.multiple_of = 4;
  EXPECT_TRUE(ThrowsInvalid([&] { plan_micro_batches(Vec{5, 3}, o); }, {"overflows int64"}));
}

// Issue 26: workloads s + s² whose sum passes int64 (each one fits). Up to 65,536
// sequences Karmarkar-Karp refused them under its own name; above, the cap-aware
// greedy summed them unchecked and balanced wrapped-around loads.
TEST(MicroBatch, WorkloadSumOverflowNamesPlanMicroBatches) {
  const int64_t s = 3'000'000'000;  // s² = 9e18 fits in int64, two of them do not
  for (size_t n : {size_t{4}, size_t{70'000}}) {
    const Vec lengths(n, s);
    EXPECT_TRUE(ThrowsInvalid([&] { plan_micro_batches(lengths, options(2 * s, 1, 1, 1)); },
                              {"[seqpack.plan_micro_batches]", "sum of workloads", "overflows int64"}));
  }
}

}  // namespace
