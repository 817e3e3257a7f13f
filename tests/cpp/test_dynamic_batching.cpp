#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "seqpack/dynamic_batching.hpp"
#include "test_helpers.hpp"

namespace {

using namespace seqpack;
using seqpack_test::ThrowsInvalid;
using Vec = std::vector<int64_t>;
using Ranges = std::vector<MicroBatchRange>;
using Rule = DynamicBatchingRule;

const Vec kNemo = {2, 8, 4, 16, 28, 32, 2, 32};
const Vec kRoll = {7, 6, 8, 5, 1, 3, 8, 6};

DynamicBatchingOptions options(int64_t shards, int64_t batch_size, int64_t max_tokens, int64_t round,
                               int64_t max_seqlen = 0, int64_t pp_size = 1) {
  DynamicBatchingOptions o;
  o.shards = shards;
  o.batch_size = batch_size;
  o.max_tokens_per_microbatch = max_tokens;
  o.sequence_length_round = round;
  o.max_seqlen = max_seqlen;
  o.pp_size = pp_size;
  return o;
}

const char* name(Rule r) { return r == Rule::NemoRL ? "NemoRL" : r == Rule::Roll ? "Roll" : "Optimal"; }

int64_t count(const DynamicBatchingPlan& p) {
  int64_t c = 0;
  for (const auto& chunk : p.chunks) c += static_cast<int64_t>(chunk.size());
  return c;
}

// Checks the sort/stride order, the ranges and the token totals of a plan.
::testing::AssertionResult IsValidPlan(const DynamicBatchingPlan& p, const Vec& v, const DynamicBatchingOptions& o,
                                       Rule rule) {
  using ::testing::AssertionFailure;
  const auto n = static_cast<int64_t>(v.size());
  const int64_t chunk = o.batch_size == 0 ? n : o.batch_size;
  const int64_t per = chunk / o.shards;
  if (p.shard_chunk_size != per) return AssertionFailure() << "shard_chunk_size " << p.shard_chunk_size;
  if (static_cast<int64_t>(p.chunks.size()) != (chunk == 0 ? 0 : n / chunk))
    return AssertionFailure() << p.chunks.size() << " chunks";
  if (static_cast<int64_t>(p.sorted_indices.size()) != n) return AssertionFailure() << "sorted_indices size";
  int64_t padded_tokens = 0;
  for (size_t c = 0; c < p.chunks.size(); ++c) {
    const int64_t base = static_cast<int64_t>(c) * chunk;
    // Sorted position q sits in shard q % shards at row q / shards; positions
    // list the chunk's indices by (length, index) ascending.
    Vec by_position(static_cast<size_t>(chunk)), row_max(static_cast<size_t>(per), 0);
    for (int64_t q = 0; q < chunk; ++q) {
      const int64_t i = p.sorted_indices[base + (q % o.shards) * per + q / o.shards];
      by_position[q] = i;
      row_max[q / o.shards] = std::max(row_max[q / o.shards], v[i]);
    }
    Vec expected(static_cast<size_t>(chunk));
    for (int64_t q = 0; q < chunk; ++q) expected[q] = base + q;
    std::stable_sort(expected.begin(), expected.end(), [&](int64_t a, int64_t b) { return v[a] < v[b]; });
    if (by_position != expected) return AssertionFailure() << "chunk " << c << " is not sorted and strided";
    int64_t next = 0;
    for (const MicroBatchRange& r : p.chunks[c]) {
      if (r.start != next || r.end <= r.start) return AssertionFailure() << "ranges not contiguous in chunk " << c;
      next = r.end;
      int64_t need = 0;
      for (int64_t j = r.start; j < r.end; ++j) {
        int64_t len = round_up("test", row_max[j], o.sequence_length_round);
        if (rule == Rule::NemoRL && o.max_seqlen > 0) len = std::min(len, o.max_seqlen);
        need = std::max(need, len);
      }
      if (r.length < need || (rule == Rule::Optimal && r.length != need))
        return AssertionFailure() << "range [" << r.start << "," << r.end << ") length " << r.length << " vs " << need;
      if ((r.end - r.start) * r.length > o.max_tokens_per_microbatch)
        return AssertionFailure() << "range [" << r.start << "," << r.end << ") over the cap";
      padded_tokens += (r.end - r.start) * r.length * o.shards;
    }
    if (next != per) return AssertionFailure() << "ranges of chunk " << c << " end at " << next;
    const bool multiple = rule == Rule::Optimal || (rule == Rule::Roll && o.pp_size > 1);
    if (multiple && static_cast<int64_t>(p.chunks[c].size()) % o.pp_size != 0)
      return AssertionFailure() << p.chunks[c].size() << " ranges, not a multiple of pp_size";
  }
  if (p.padded_tokens != padded_tokens) return AssertionFailure() << "padded_tokens " << p.padded_tokens;
  if (p.valid_tokens != seqpack_test::sum_of(v)) return AssertionFailure() << "valid_tokens " << p.valid_tokens;
  return ::testing::AssertionSuccess();
}

TEST(DynamicBatching, NemoRlExample) {
  const auto o = options(2, 0, 32, 4, 128);
  const DynamicBatchingPlan p = plan_dynamic_batching(kNemo, o, Rule::NemoRL);
  EXPECT_EQ(p.sorted_indices, (Vec{0, 2, 3, 5, 6, 1, 4, 7}));
  ASSERT_EQ(p.chunks.size(), 1u);
  EXPECT_EQ(p.chunks[0], (Ranges{{0, 2, 8}, {2, 3, 28}, {3, 4, 32}}));
  EXPECT_EQ(p.shard_chunk_size, 4);
  EXPECT_EQ(p.padded_tokens, (2 * 8 + 28 + 32) * 2);
  EXPECT_EQ(p.valid_tokens, 124);
  EXPECT_TRUE(IsValidPlan(p, kNemo, o, Rule::NemoRL));
}

TEST(DynamicBatching, NemoRlClampsToMaxSeqlen) {
  // Row lengths 3 and 5 round up to 4 and 8; the 8 is clamped to max_seqlen 5.
  const auto o = options(1, 0, 10, 4, 5);
  const DynamicBatchingPlan p = plan_dynamic_batching(Vec{5, 3}, o, Rule::NemoRL);
  EXPECT_EQ(p.sorted_indices, (Vec{1, 0}));
  EXPECT_EQ(p.chunks[0], (Ranges{{0, 2, 5}}));
  EXPECT_TRUE(ThrowsInvalid([&] { plan_dynamic_batching(Vec{6, 3}, o, Rule::NemoRL); }, {"lengths", "max_seqlen"}));
}

TEST(DynamicBatching, RollExample) {
  const DynamicBatchingPlan p10 = plan_dynamic_batching(kRoll, options(2, 0, 10, 2), Rule::Roll);
  EXPECT_EQ(p10.sorted_indices, (Vec{4, 3, 7, 2, 5, 1, 0, 6}));
  ASSERT_EQ(p10.chunks.size(), 1u);
  EXPECT_EQ(p10.chunks[0], (Ranges{{0, 1, 4}, {1, 2, 6}, {2, 3, 8}, {3, 4, 8}}));
  EXPECT_EQ(p10.padded_tokens, 52);
  EXPECT_EQ(p10.valid_tokens, 44);

  const DynamicBatchingPlan p12 = plan_dynamic_batching(kRoll, options(2, 0, 12, 2), Rule::Roll);
  EXPECT_EQ(p12.chunks[0], (Ranges{{0, 2, 6}, {2, 3, 8}, {3, 4, 8}}));
  EXPECT_EQ(p12.padded_tokens, 56);

  const auto vpp = options(2, 0, 12, 2, 0, 2);
  const DynamicBatchingPlan pp = plan_dynamic_batching(kRoll, vpp, Rule::Roll);
  EXPECT_EQ(pp.chunks[0], (Ranges{{0, 1, 6}, {1, 2, 6}, {2, 3, 8}, {3, 4, 8}}));
  EXPECT_TRUE(IsValidPlan(pp, kRoll, vpp, Rule::Roll));
}

TEST(DynamicBatching, RollSplitsTheLargestRangesForPipelineParallelism) {
  // Greedy: [0,4) at 1 (4 tokens) and [4,8) at 2 (8 tokens).
  const Vec v = {1, 1, 1, 1, 2, 2, 2, 2};
  EXPECT_EQ(plan_dynamic_batching(v, options(1, 0, 8, 1), Rule::Roll).chunks[0], (Ranges{{0, 4, 1}, {4, 8, 2}}));
  // ROLL's current rule halves the range with the most rows, ties to the earlier.
  const auto pp3 = options(1, 0, 8, 1, 0, 3);
  const DynamicBatchingPlan p3 = plan_dynamic_batching(v, pp3, Rule::Roll);
  EXPECT_EQ(p3.chunks[0], (Ranges{{0, 2, 1}, {2, 4, 1}, {4, 8, 2}}));
  EXPECT_TRUE(IsValidPlan(p3, v, pp3, Rule::Roll));
  EXPECT_EQ(plan_dynamic_batching(v, options(1, 0, 8, 1, 0, 4), Rule::Roll).chunks[0],
            (Ranges{{0, 2, 1}, {2, 4, 1}, {4, 6, 2}, {6, 8, 2}}));
}

TEST(DynamicBatching, RollSplitRepeatsOnTheSameRange) {
  // ROLL's test: one range [0, 8) and pp 4 -> four ranges of two rows.
  std::vector<MicroBatchRange> ranges{{0, 8, 8}};
  split_ranges_to_multiple(ranges, 4);
  EXPECT_EQ(ranges, (Ranges{{0, 2, 8}, {2, 4, 8}, {4, 6, 8}, {6, 8, 8}}));
  std::vector<MicroBatchRange> singles{{0, 1, 8}, {1, 2, 8}};
  EXPECT_THROW(split_ranges_to_multiple(singles, 4), std::invalid_argument);
  std::vector<MicroBatchRange> gap{{0, 1, 8}, {2, 3, 8}};
  EXPECT_THROW(split_ranges_to_multiple(gap, 4), std::invalid_argument);
}

TEST(DynamicBatching, ZeroLengthRows) {
  // Rows pad to 0, 0, 8, 8. Roll's running maximum starts at the rounding unit,
  // NeMo-RL's at 0.
  const Vec v = {0, 5, 0, 5};
  const auto o = options(1, 0, 16, 4);
  EXPECT_EQ(plan_dynamic_batching(v, o, Rule::Roll).chunks[0], (Ranges{{0, 2, 4}, {2, 4, 8}}));
  EXPECT_EQ(plan_dynamic_batching(v, o, Rule::NemoRL).chunks[0], (Ranges{{0, 2, 0}, {2, 4, 8}}));
  const DynamicBatchingPlan opt = plan_dynamic_batching(v, o, Rule::Optimal);
  EXPECT_EQ(opt.padded_tokens, 16);
  EXPECT_TRUE(IsValidPlan(opt, v, o, Rule::Optimal));
}

TEST(DynamicBatching, OptimalOnTheRollExample) {
  // Cap 12: [0,2) at 6 costs 12 tokens per shard, [0,1) at 4 plus [1,2) at 6 only 10.
  const DynamicBatchingPlan p = plan_dynamic_batching(kRoll, options(2, 0, 12, 2), Rule::Optimal);
  EXPECT_EQ(p.chunks[0], (Ranges{{0, 1, 4}, {1, 2, 6}, {2, 3, 8}, {3, 4, 8}}));
  EXPECT_EQ(p.padded_tokens, 52);
  // Cap 16: [2,4) at 8 costs the same as two ranges; the fewest ranges win.
  const DynamicBatchingPlan q = plan_dynamic_batching(kRoll, options(2, 0, 16, 2), Rule::Optimal);
  EXPECT_EQ(q.chunks[0], (Ranges{{0, 1, 4}, {1, 2, 6}, {2, 4, 8}}));
  // pp_size 2 forces an even count.
  const DynamicBatchingPlan r = plan_dynamic_batching(kRoll, options(2, 0, 16, 2, 0, 2), Rule::Optimal);
  EXPECT_EQ(r.chunks[0].size() % 2, 0u);
  EXPECT_EQ(r.padded_tokens, 52);
}

TEST(DynamicBatching, OptimalIsNeverWorseOnRandomInputs) {
  int strictly_better = 0;
  for (uint64_t seed = 1; seed <= 12; ++seed) {
    const int64_t shards = int64_t{1} << (seed % 3);  // 1, 2, 4
    const int64_t round = seed % 2 ? 1 : 64;
    const int64_t cap = int64_t{8192} << (seed % 4);
    const Vec v = seqpack_test::lognormal_lengths(seed, 256, 1000, 1.0, 1, 8192);
    for (int64_t pp : {1, 2, 4}) {
      SCOPED_TRACE("seed " + std::to_string(seed) + " pp " + std::to_string(pp));
      const auto o = options(shards, 0, cap, round, 0, pp);
      DynamicBatchingPlan plans[3];
      for (Rule rule : {Rule::NemoRL, Rule::Roll, Rule::Optimal}) {
        SCOPED_TRACE(name(rule));
        plans[static_cast<int>(rule)] = plan_dynamic_batching(v, o, rule);
        EXPECT_TRUE(IsValidPlan(plans[static_cast<int>(rule)], v, o, rule));
      }
      const auto& opt = plans[static_cast<int>(Rule::Optimal)];
      EXPECT_LE(opt.padded_tokens, plans[static_cast<int>(Rule::Roll)].padded_tokens);
      if (pp == 1) EXPECT_LE(opt.padded_tokens, plans[static_cast<int>(Rule::NemoRL)].padded_tokens);
      strictly_better += opt.padded_tokens < plans[static_cast<int>(Rule::Roll)].padded_tokens;
      // The pp constraint can only cost tokens.
      if (pp > 1) EXPECT_GE(opt.padded_tokens, plan_dynamic_batching(v, options(shards, 0, cap, round), Rule::Optimal).padded_tokens);
    }
  }
  EXPECT_GT(strictly_better, 0) << "the random inputs never separate Optimal from the greedy rule";
}

TEST(DynamicBatching, MultipleChunks) {
  const Vec v = seqpack_test::uniform_lengths(5, 64, 1, 500);
  for (Rule rule : {Rule::NemoRL, Rule::Roll, Rule::Optimal}) {
    SCOPED_TRACE(name(rule));
    const auto o = options(4, 32, 2048, 16, 0, rule == Rule::NemoRL ? 1 : 2);
    const DynamicBatchingPlan p = plan_dynamic_batching(v, o, rule);
    ASSERT_EQ(p.chunks.size(), 2u);
    EXPECT_EQ(p.shard_chunk_size, 8);
    EXPECT_TRUE(IsValidPlan(p, v, o, rule));
    // Each chunk only reorders its own sequences.
    for (size_t q = 0; q < 64; ++q) EXPECT_EQ(p.sorted_indices[q] / 32, static_cast<int64_t>(q / 32));
  }
}

TEST(DynamicBatching, EmptyInput) {
  const DynamicBatchingPlan p = plan_dynamic_batching(Vec{}, options(2, 0, 16, 1), Rule::Optimal);
  EXPECT_TRUE(p.chunks.empty());
  EXPECT_TRUE(p.sorted_indices.empty());
  EXPECT_EQ(p.padded_tokens, 0);
}

TEST(DynamicBatching, InvalidArguments) {
  for (Rule rule : {Rule::NemoRL, Rule::Roll, Rule::Optimal}) {
    SCOPED_TRACE(name(rule));
    auto plan = [&](const Vec& v, const DynamicBatchingOptions& o) { plan_dynamic_batching(v, o, rule); };
    EXPECT_TRUE(ThrowsInvalid([&] { plan(kRoll, options(2, 3, 16, 1)); }, {"batch_size"}));
    EXPECT_TRUE(ThrowsInvalid([&] { plan(kRoll, options(3, 4, 16, 1)); }, {"batch_size", "shards"}));
    EXPECT_TRUE(ThrowsInvalid([&] { plan(kRoll, options(3, 0, 16, 1)); }, {"shards"}));
    // 8 rounds up to 16 > 12.
    EXPECT_TRUE(ThrowsInvalid([&] { plan(kRoll, options(2, 0, 12, 16)); }, {"max_tokens_per_microbatch", "16"}));
    EXPECT_TRUE(ThrowsInvalid([&] { plan(kRoll, options(0, 0, 16, 1)); }, {"shards"}));
    EXPECT_TRUE(ThrowsInvalid([&] { plan(kRoll, options(2, 0, 0, 1)); }, {"max_tokens_per_microbatch"}));
    EXPECT_TRUE(ThrowsInvalid([&] { plan(kRoll, options(2, 0, 16, 0)); }, {"sequence_length_round"}));
    EXPECT_TRUE(ThrowsInvalid([&] { plan(kRoll, options(2, 0, 16, 1, 0, 0)); }, {"pp_size"}));
    EXPECT_TRUE(ThrowsInvalid([&] { plan(kRoll, options(2, -2, 16, 1)); }, {"batch_size"}));
    EXPECT_TRUE(ThrowsInvalid([&] { plan(kRoll, options(2, 0, 16, 1, -1)); }, {"max_seqlen"}));
    EXPECT_TRUE(ThrowsInvalid([&] { plan(Vec{1, -1}, options(1, 0, 16, 1)); }, {"lengths"}));
  }
  // pp_size larger than the rows of a shard cannot be met.
  EXPECT_TRUE(ThrowsInvalid([] { plan_dynamic_batching(kRoll, options(2, 0, 64, 1, 0, 8), Rule::Optimal); },
                            {"pp_size"}));
  EXPECT_TRUE(ThrowsInvalid([] { plan_dynamic_batching(kRoll, options(2, 0, 64, 1, 0, 8), Rule::Roll); },
                            {"pp_size"}));
}

// Found by fuzz_dynamic_batching: a huge batch_size with no sequences allocated
// batch_size rows, pp_size above the rows allocated rows x pp_size cells, and
// rounding a length near INT64_MAX up to sequence_length_round wrapped around.
TEST(DynamicBatching, FuzzRegressions) {
  DynamicBatchingOptions o;
  o.shards = 2;
  o.max_tokens_per_microbatch = 100;
  o.batch_size = INT64_MAX - 1;
  EXPECT_TRUE(plan_dynamic_batching(Vec{}, o, Rule::NemoRL).chunks.empty());
  o.batch_size = 0;
  o.pp_size = INT64_MAX - 2;
  EXPECT_TRUE(ThrowsInvalid([&] { plan_dynamic_batching(Vec{1, 2, 3, 4}, o, Rule::Optimal); }, {"pp_size"}));
  EXPECT_TRUE(ThrowsInvalid([&] { plan_dynamic_batching(Vec{1, 2, 3, 4}, o, Rule::Roll); }, {"pp_size"}));
  o.pp_size = 1;
  o.max_tokens_per_microbatch = INT64_MAX;
  o.sequence_length_round = 8;
  EXPECT_TRUE(ThrowsInvalid([&] { plan_dynamic_batching(Vec{INT64_MAX - 1, 1}, o, Rule::NemoRL); }, {"overflows int64"}));
}

}  // namespace
