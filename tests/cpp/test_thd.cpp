#include <algorithm>
#include <random>
#include <numeric>
#include <vector>

#include "seqpack/move.hpp"
#include "seqpack/thd.hpp"
#include "test_helpers.hpp"

namespace {

using namespace seqpack;
using seqpack_test::ThrowsInvalid;
using Vec = std::vector<int64_t>;
using Vec32 = std::vector<int32_t>;

constexpr int64_t P = -1;  // the pad value in these tests

// A [B, width] source whose real tokens hold their sequence index, padding P.
Vec right_padded_ids(const Vec& lens, int64_t width) {
  Vec src(lens.size() * static_cast<size_t>(width), P);
  for (size_t b = 0; b < lens.size(); ++b)
    for (int64_t s = 0; s < lens[b]; ++s) src[b * static_cast<size_t>(width) + static_cast<size_t>(s)] = static_cast<int64_t>(b);
  return src;
}

Vec run(const MovePlan& plan, const Vec& src) {
  Vec dst(static_cast<size_t>(plan.dst_rows), 12345);
  const int64_t fill = P;
  execute_move_plan(plan, src.data(), static_cast<int64_t>(src.size()), dst.data(), plan.dst_rows, sizeof(int64_t),
                    &fill);
  return dst;
}

TEST(Thd, LayoutAlignsEverySequence) {
  ThdOptions o;
  o.pad_multiple = 4;
  const ThdLayout l = make_thd_layout(Vec{3, 5, 1, 0}, o);
  EXPECT_EQ(l.padded_lens, (Vec{4, 8, 4, 0}));
  EXPECT_EQ(l.cu_seqlens, (Vec32{0, 3, 8, 9, 9}));
  EXPECT_EQ(l.cu_seqlens_padded, (Vec32{0, 4, 12, 16, 16}));
  EXPECT_EQ(l.max_seqlen, 5);
  EXPECT_EQ(l.max_seqlen_padded, 8);
  EXPECT_EQ(l.total_padded(), 16);
}

TEST(Thd, BinPaddingIsAbsorbedByTheLastSequence) {
  ThdOptions o;
  o.pad_multiple = 2;
  o.pad_packed_to = 16;
  ThdLayout l = make_thd_layout(Vec{3, 4}, o);
  EXPECT_EQ(l.padded_lens, (Vec{4, 12}));
  EXPECT_EQ(l.cu_seqlens_padded, (Vec32{0, 4, 16}));
  EXPECT_EQ(l.cu_seqlens, (Vec32{0, 3, 7}));
  EXPECT_EQ(l.max_seqlen_padded, 12);
  o.pad_packed_to = 0;
  o.pad_packed_multiple = 10;
  l = make_thd_layout(Vec{3, 4}, o);
  EXPECT_EQ(l.cu_seqlens_padded, (Vec32{0, 4, 10}));
}

// SPEC section 7: CP=2, TP=1, lengths [2, 4, 6, 1] right padded to width 8.
TEST(Thd, SpecContextParallelExample) {
  const Vec lens = {2, 4, 6, 1};
  ThdOptions o;
  o.cp_size = 2;
  o.pad_multiple = 4;  // 2 * CP * TP
  const ThdLayout l = make_thd_layout(lens, o);
  EXPECT_EQ(l.padded_lens, (Vec{4, 4, 8, 4}));
  EXPECT_EQ(l.cu_seqlens_padded, (Vec32{0, 4, 8, 16, 20}));
  const SourceSpans src = spans_from_lengths(lens, 8);
  const Vec ids = right_padded_ids(lens, 8);
  EXPECT_EQ(run(make_pack_plan(l, src, 0), ids), (Vec{0, P, 1, 1, 2, 2, P, P, 3, P}));
  EXPECT_EQ(run(make_pack_plan(l, src, 1), ids), (Vec{0, P, 1, 1, 2, 2, 2, 2, P, P}));
}

TEST(Thd, PositionIdsCountThroughPadding) {
  const Vec lens = {2, 4, 6, 1};
  ThdOptions o;
  o.cp_size = 2;
  o.pad_multiple = 4;
  const ThdLayout l = make_thd_layout(lens, o);
  const SourceSpans src = spans_from_lengths(lens, 8);
  Vec pos(10);
  write_position_ids(make_pack_plan(l, src, 0), pos.data(), 10);
  EXPECT_EQ(pos, (Vec{0, 3, 0, 3, 0, 1, 6, 7, 0, 3}));
  o.cp_size = 1;
  const ThdLayout full = make_thd_layout(lens, o);
  Vec all(20);
  write_position_ids(make_pack_plan(full, src, 0), all.data(), 20);
  EXPECT_EQ(all, (Vec{0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3}));
}

TEST(Thd, AnyMaskPacksTokensInColumnOrder) {
  // Row 0 right padded, row 1 left padded, row 2 with holes.
  const std::vector<uint8_t> mask = {1, 1, 0, 0,  //
                                     0, 0, 1, 1,  //
                                     1, 0, 1, 1};
  const SourceSpans spans = spans_from_mask(mask.data(), 3, 4);
  EXPECT_EQ(span_lengths(spans), (Vec{2, 2, 3}));
  EXPECT_EQ(spans.spans, (std::vector<Span>{{0, 2}, {6, 2}, {8, 1}, {10, 2}}));
  Vec src(12);
  std::iota(src.begin(), src.end(), 100);
  ThdOptions o;
  o.pad_multiple = 2;
  const ThdLayout l = make_thd_layout(span_lengths(spans), o);
  const MovePlan pack = make_pack_plan(l, spans);
  EXPECT_EQ(run(pack, src), (Vec{100, 101, 106, 107, 108, 110, 111, P}));
  // Unpack puts every real token back and fills the rest.
  const Vec back = run(make_unpack_plan(pack, 12), run(pack, src));
  EXPECT_EQ(back, (Vec{100, 101, P, P, P, P, 106, 107, 108, P, 110, 111}));
}

TEST(Thd, ContiguousRowsMergeIntoOneCopy) {
  // Full rows, no padding: the whole batch is one memcpy.
  const ThdLayout l = make_thd_layout(Vec{4, 4, 4}, ThdOptions{});
  const MovePlan plan = make_pack_plan(l, spans_from_lengths(Vec{4, 4, 4}, 4));
  ASSERT_EQ(plan.copies.size(), 1u);
  EXPECT_EQ(plan.copies[0], (CopyRun{0, 0, 12}));
  EXPECT_TRUE(plan.fills.empty());
}

TEST(Thd, RandomRoundTripsAndRanksCoverThePackedStream) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t batch = static_cast<int64_t>(rng() % 6), width = 1 + static_cast<int64_t>(rng() % 12);
    const int64_t cp = int64_t{1} << (rng() % 3);
    std::vector<uint8_t> mask(static_cast<size_t>(batch * width));
    for (auto& m : mask) m = static_cast<uint8_t>(rng() % 3 != 0);
    const SourceSpans spans = spans_from_mask(mask.data(), batch, width);
    ThdOptions o;
    o.cp_size = cp;
    o.pad_multiple = 2 * cp * (1 + static_cast<int64_t>(rng() % 2));
    o.pad_packed_multiple = batch > 0 && rng() % 2 ? 2 * cp * 4 : 1;
    const ThdLayout l = make_thd_layout(span_lengths(spans), o);
    Vec src(mask.size());
    std::iota(src.begin(), src.end(), 1000);
    // The full packed stream (cp = 1 layout with the same padded lengths).
    ThdOptions full_o = o;
    full_o.cp_size = 1;
    const ThdLayout full = make_thd_layout(span_lengths(spans), full_o);
    ASSERT_EQ(full.cu_seqlens_padded, l.cu_seqlens_padded);
    const Vec packed = run(make_pack_plan(full, spans), src);
    Vec expected_back(src.size(), P);
    for (size_t i = 0; i < mask.size(); ++i)
      if (mask[i]) expected_back[i] = src[i];
    EXPECT_EQ(run(make_unpack_plan(make_pack_plan(full, spans), static_cast<int64_t>(src.size())), packed),
              expected_back);
    // Each rank's local THD is its zigzag chunks of the full stream.
    Vec tokens_seen;
    for (int64_t r = 0; r < cp; ++r) {
      const Vec local = run(make_pack_plan(l, spans, r), src);
      ASSERT_EQ(static_cast<int64_t>(local.size()), l.total_padded() / cp);
      size_t k = 0;
      for (int64_t b = 0; b < l.batch_size(); ++b) {
        const int64_t chunk = l.padded_lens[b] / (2 * cp);
        for (int64_t c : {r, 2 * cp - 1 - r})
          for (int64_t j = 0; j < chunk; ++j) EXPECT_EQ(local[k++], packed[l.cu_seqlens_padded[b] + c * chunk + j]);
      }
      for (int64_t v : local)
        if (v != P) tokens_seen.push_back(v);
    }
    std::sort(tokens_seen.begin(), tokens_seen.end());
    Vec real;
    for (size_t i = 0; i < mask.size(); ++i)
      if (mask[i]) real.push_back(src[i]);
    EXPECT_EQ(tokens_seen, real);  // every real token on exactly one rank
  }
}

TEST(Thd, InvalidArguments) {
  ThdOptions o;
  o.cp_size = 2;
  o.pad_multiple = 2;
  EXPECT_TRUE(ThrowsInvalid([&] { make_thd_layout(Vec{1}, o); }, {"pad_multiple", "2 * cp_size"}));
  o.pad_multiple = 4;
  o.pad_packed_to = 6;
  EXPECT_TRUE(ThrowsInvalid([&] { make_thd_layout(Vec{1}, o); }, {"bin padding", "adds 2", "2 * cp_size"}));
  ThdOptions plain;
  plain.pad_packed_to = 3;
  EXPECT_TRUE(ThrowsInvalid([&] { make_thd_layout(Vec{2, 2}, plain); }, {"pad_packed_to", "below"}));
  plain.pad_packed_to = 8;
  EXPECT_TRUE(ThrowsInvalid([&] { make_thd_layout(Vec{}, plain); }, {"absorb"}));
  EXPECT_TRUE(ThrowsInvalid([&] { make_thd_layout(Vec{-1}, ThdOptions{}); }, {"seq_lens"}));
  EXPECT_TRUE(ThrowsInvalid([&] { spans_from_lengths(Vec{5}, 4); }, {"seq_lens", "width"}));
  const ThdLayout l = make_thd_layout(Vec{2}, ThdOptions{});
  EXPECT_TRUE(ThrowsInvalid([&] { make_pack_plan(l, spans_from_lengths(Vec{3}, 4)); }, {"seq_lens"}));
  EXPECT_TRUE(ThrowsInvalid([&] { make_pack_plan(l, spans_from_lengths(Vec{2, 1}, 4)); }, {"sequences"}));
  EXPECT_TRUE(ThrowsInvalid([&] { make_pack_plan(l, spans_from_lengths(Vec{2}, 4), 1); }, {"cp_rank"}));
  ThdOptions big;
  big.pad_multiple = int64_t{1} << 30;
  EXPECT_TRUE(ThrowsInvalid([&] { make_thd_layout(Vec{1, 1, 1}, big); }, {"int32"}));
}

// Found by fuzz_thd: the padded batch's rows (batch x width) and a length rounded
// up to pad_multiple wrapped around.
TEST(Thd, FuzzRegressions) {
  EXPECT_TRUE(ThrowsInvalid([] { spans_from_lengths(Vec{1, 2, 3}, INT64_MAX / 2); }, {"overflows int64"}));
  EXPECT_TRUE(ThrowsInvalid([] { spans_from_mask(nullptr, 3, INT64_MAX / 2); }, {"overflows int64"}));
  ThdOptions o;
  o.pad_multiple = 4;
  EXPECT_TRUE(ThrowsInvalid([&] { make_thd_layout(Vec{INT64_MAX - 1}, o); }, {"overflows int64"}));
  // Issue 26: the errors name what overflowed.
  EXPECT_TRUE(ThrowsInvalid([] { spans_from_lengths(Vec{1, 2, 3}, INT64_MAX / 2); }, {"batch * width"}));
  EXPECT_TRUE(ThrowsInvalid([] { spans_from_mask(nullptr, 3, INT64_MAX / 2); }, {"batch * width"}));
  ThdOptions one;
  EXPECT_TRUE(
      ThrowsInvalid([&] { make_thd_layout(Vec{1, INT64_MAX}, one); }, {"the packed length", "overflows int64"}));
}

}  // namespace
