// Fused token log-probabilities (cpp/src/logprob.cpp) against a naive fp64 computation.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "seqpack/common.hpp"
#include "seqpack/logprob.hpp"
#include "seqpack/logprob_math.hpp"
#include "test_helpers.hpp"

namespace {

using namespace seqpack;
using seqpack_test::ThrowsInvalid;
namespace lp = seqpack::lpmath;

struct Naive {
  double lse, logprob, entropy;
};

Naive naive_row(const float* x, int64_t vocab, int64_t target, double temperature) {
  double m = -INFINITY;
  for (int64_t i = 0; i < vocab; ++i) m = std::max(m, x[i] / temperature);
  double s = 0.0;
  for (int64_t i = 0; i < vocab; ++i) s += std::exp(x[i] / temperature - m);
  const double lse = m + std::log(s);
  double h = 0.0;
  for (int64_t i = 0; i < vocab; ++i) {
    const double lp = x[i] / temperature - lse;
    h -= std::exp(lp) * lp;
  }
  return {lse, target >= 0 ? x[target] / temperature - lse : 0.0, h};
}

std::vector<float> random_logits(int64_t rows, int64_t vocab, float scale, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> x(static_cast<size_t>(rows * vocab));
  for (float& v : x) v = d(rng);
  return x;
}

TEST(Logprob, StatsMatchAnFp64ReferenceAcrossBlocksAndThreads) {
  const int64_t rows = 37, vocab = 1537;  // several 512-column blocks, a ragged tail
  const std::vector<float> x = random_logits(rows, vocab, 4.0f, 1);
  std::vector<int64_t> targets(rows);
  for (int64_t r = 0; r < rows; ++r) targets[r] = r % 5 == 0 ? -1 : (r * 97) % vocab;
  std::vector<float> m(rows), s(rows), t(rows), z(rows);
  for (int threads : {1, 3}) {
    row_stats({x.data(), rows, vocab, vocab, LogitsDtype::Float32}, targets.data(), 0, 0.8f,
              {m.data(), s.data(), t.data(), z.data()}, threads);
    for (int64_t r = 0; r < rows; ++r) {
      const Naive ref = naive_row(x.data() + r * vocab, vocab, targets[r], 0.8);
      const double lse = m[r] + std::log(static_cast<double>(s[r]));
      EXPECT_NEAR(lse, ref.lse, 1e-6 * std::abs(ref.lse)) << r;
      EXPECT_NEAR(std::log(static_cast<double>(s[r])) - t[r] / s[r], ref.entropy, 1e-5 * std::max(1.0, ref.entropy))
          << r;
      if (targets[r] >= 0) EXPECT_NEAR(z[r] - lse, ref.logprob, 1e-5) << r;
      else EXPECT_EQ(z[r], 0.0f);
    }
  }
}

TEST(Logprob, VocabularySlicesCombineExactly) {
  // Two halves of the vocabulary (tensor parallelism) give the full row's numbers.
  const int64_t rows = 4, vocab = 1000, half = 500;
  const std::vector<float> x = random_logits(rows, vocab, 3.0f, 2);
  const std::vector<int64_t> targets = {3, 700, -1, 499};
  std::vector<float> m[2], s[2], t[2], z[2];
  for (int k = 0; k < 2; ++k) {
    m[k].resize(rows), s[k].resize(rows), t[k].resize(rows), z[k].resize(rows);
    row_stats({x.data() + k * half, rows, half, vocab, LogitsDtype::Float32}, targets.data(), k * half, 1.0f,
              {m[k].data(), s[k].data(), t[k].data(), z[k].data()});
  }
  for (int64_t r = 0; r < rows; ++r) {
    const Naive ref = naive_row(x.data() + r * vocab, vocab, targets[r], 1.0);
    const double big = std::max(m[0][r], m[1][r]);
    double se = 0.0, te = 0.0;
    for (int k = 0; k < 2; ++k) {
      const double sc = std::exp(m[k][r] - big);
      se += sc * s[k][r];
      te += sc * (t[k][r] + (m[k][r] - big) * s[k][r]);
    }
    EXPECT_NEAR(big + std::log(se), ref.lse, 1e-6 * std::abs(ref.lse));
    EXPECT_NEAR(std::log(se) - te / se, ref.entropy, 1e-5 * std::max(1.0, ref.entropy));
    if (targets[r] >= 0) EXPECT_NEAR(z[0][r] + z[1][r] - (big + std::log(se)), ref.logprob, 1e-5);
  }
}

TEST(Logprob, GradientIsSoftmaxMinusOneHot) {
  const int64_t rows = 3, vocab = 700;
  const std::vector<float> x = random_logits(rows, vocab, 2.0f, 3);
  const std::vector<int64_t> targets = {5, -1, 699};
  std::vector<float> lse(rows), zero(rows, 0.0f), ent(rows), g_lp = {0.5f, 2.0f, -1.0f}, g_ent = {0.25f, 0.0f, 1.5f};
  for (int64_t r = 0; r < rows; ++r) {
    const Naive ref = naive_row(x.data() + r * vocab, vocab, targets[r], 1.3);
    lse[r] = static_cast<float>(ref.lse);  // as max 0 + log_sumexp lse
    ent[r] = static_cast<float>(ref.entropy);
  }
  g_ent[1] = 0.0f;
  std::vector<float> grad(rows * vocab, 7.0f);
  row_grad({x.data(), rows, vocab, vocab, LogitsDtype::Float32}, targets.data(), 0, 1.3f,
           {zero.data(), lse.data(), ent.data(), g_lp.data(), g_ent.data()}, grad.data(), vocab);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < vocab; ++i) {
      const double logp = x[r * vocab + i] / 1.3 - lse[r];
      const double p = std::exp(logp);
      const double lp_part = targets[r] >= 0 ? g_lp[r] * ((i == targets[r]) - p) : 0.0;
      const double want = (lp_part - g_ent[r] * p * (logp + ent[r])) / 1.3;
      ASSERT_NEAR(grad[r * vocab + i], want, 1e-6 + 1e-5 * std::abs(want)) << r << " " << i;
    }
  }
}

// Several targets per row (a prefix tree's branch point): primary targets plus CSR
// extras; repeated ids, ids < 0, a row with extras but no primary target, a row whose
// gradients are all 0, and a vocabulary slice (vocab_start) that holds only some ids.
TEST(Logprob, ExtraTargetsAddTheirOneHotsAndWeighTheSoftmax) {
  const int64_t rows = 5, vocab = 700, start = 100;  // the slice holds global ids [100, 800)
  const std::vector<float> x = random_logits(rows, vocab, 2.0f, 5);
  const std::vector<int64_t> targets = {105, -1, 799, 103, 150};
  const std::vector<int64_t> offsets = {0, 3, 4, 4, 6, 8};
  const std::vector<int64_t> ids = {107, 105, -1, 102, 110, 110, 3, 160};  // 3: another slice's id
  const std::vector<float> eg = {0.75f, -0.5f, 9.0f, 1.25f, 0.0f, 0.0f, 2.0f, -1.5f};
  const std::vector<float> g_lp = {0.5f, 2.0f, -1.0f, 0.0f, 1.0f}, g_ent = {0.25f, 0.0f, 1.5f, 0.0f, 0.5f};
  const double tau = 1.3;
  std::vector<float> lse(rows), zero(rows, 0.0f), ent(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const Naive ref = naive_row(x.data() + r * vocab, vocab, -1, tau);
    lse[r] = static_cast<float>(ref.lse);
    ent[r] = static_cast<float>(ref.entropy);
  }
  RowGradInputs in{zero.data(), lse.data(), ent.data(), g_lp.data(), g_ent.data()};
  in.extra_offsets = offsets.data();
  in.extra_ids = ids.data();
  in.extra_grad = eg.data();
  std::vector<float> grad(rows * vocab, 7.0f);
  const LogitsView view{x.data(), rows, vocab, vocab, LogitsDtype::Float32};
  row_grad(view, targets.data(), start, static_cast<float>(tau), in, grad.data(), vocab);
  for (int64_t r = 0; r < rows; ++r) {
    // The naive gradient: every target k (the primary, each extra) adds g_k (onehot - p).
    std::vector<std::pair<int64_t, double>> all;
    if (targets[r] >= 0) all.emplace_back(targets[r], g_lp[r]);
    for (int64_t e = offsets[r]; e < offsets[r + 1]; ++e)
      if (ids[e] >= 0) all.emplace_back(ids[e], eg[e]);
    const lp::GradRowParams prm = lp::grad_row_params(
        0.0f, lse[r], ent[r], targets[r] >= 0 ? g_lp[r] : 0.0f, g_ent[r], static_cast<float>(tau),
        lp::local_target(targets[r], start, vocab), lp::extra_sums(ids.data(), eg.data(), offsets[r], offsets[r + 1]).sum,
        lp::extra_sums(ids.data(), eg.data(), offsets[r], offsets[r + 1]).any);
    for (int64_t i = 0; i < vocab; ++i) {
      const double logp = x[r * vocab + i] / tau - lse[r], p = std::exp(logp);
      double want = -g_ent[r] * p * (logp + ent[r]);
      for (auto [id, g] : all) want += g * ((id - start == i) - p);
      want /= tau;
      if (r == 3) want = 0.0;  // every gradient of the row is 0: exact zeros
      const float got = grad[r * vocab + i];
      ASSERT_NEAR(got, want, 1e-6 + 1e-5 * std::abs(want)) << r << " " << i;
      // The CUDA kernel's arithmetic (grad_element, then extra_column_value at the
      // extra targets' columns), replayed here, gives the same values.
      float gpu = lp::to_float(lp::grad_element(prm, x[r * vocab + i], i));
      for (int64_t e = offsets[r]; e < offsets[r + 1]; ++e)
        if (lp::local_target(ids[e], start, vocab) == i)
          gpu = lp::extra_column_value(prm, x[r * vocab + i] / static_cast<float>(tau), i, ids.data(), eg.data(),
                                       offsets[r], offsets[r + 1], start, vocab);
      ASSERT_NEAR(gpu, got, 1e-6 + 1e-5 * std::abs(want)) << r << " " << i;
    }
  }
  RowGradInputs partial{zero.data(), lse.data(), ent.data(), g_lp.data(), g_ent.data()};
  partial.extra_ids = ids.data();  // without offsets and gradients
  EXPECT_TRUE(ThrowsInvalid([&] { row_grad(view, targets.data(), start, 1.0f, partial, grad.data(), vocab); },
                            {"extra_offsets", "together"}));
}

uint16_t bits_bf16(float f) { return static_cast<uint16_t>(std::bit_cast<uint32_t>(f) >> 16); }

TEST(Logprob, HalfPrecisionInputsAndOutputs) {
  // bf16 values taken exactly from floats with zero low bits; fp16 values exact too.
  const int64_t vocab = 600;
  std::vector<float> x(vocab);
  std::vector<uint16_t> bf(vocab), hf(vocab);
  for (int64_t i = 0; i < vocab; ++i) {
    x[i] = static_cast<float>((i * 37) % 101 - 50) / 8.0f;  // multiples of 1/8: exact in both
    bf[i] = bits_bf16(x[i]);
    const uint32_t u = std::bit_cast<uint32_t>(x[i]);
    hf[i] = x[i] == 0.0f ? 0 : static_cast<uint16_t>(((u >> 16) & 0x8000u) |
                                                      ((((u >> 23) & 0xffu) - 112u) << 10) | ((u >> 13) & 0x3ffu));
  }
  const int64_t target = 17;
  const Naive ref = naive_row(x.data(), vocab, target, 1.0);
  for (auto [data, dtype] : {std::pair<const void*, LogitsDtype>{bf.data(), LogitsDtype::BFloat16},
                             std::pair<const void*, LogitsDtype>{hf.data(), LogitsDtype::Float16}}) {
    float m, s, t, z;
    row_stats({data, 1, vocab, vocab, dtype}, &target, 0, 1.0f, {&m, &s, &t, &z});
    EXPECT_NEAR(m + std::log(s), ref.lse, 1e-6 * std::abs(ref.lse));
    EXPECT_NEAR(z - (m + std::log(s)), ref.logprob, 1e-5);
    std::vector<uint16_t> grad(vocab);
    const float lse = static_cast<float>(ref.lse), zero = 0.0f, g = 1.0f;
    row_grad({data, 1, vocab, vocab, dtype}, &target, 0, 1.0f, {&zero, &lse, nullptr, &g, nullptr}, grad.data(),
             vocab);
    for (int64_t i = 0; i < vocab; ++i) {
      const double want = (i == target) - std::exp(x[i] - ref.lse);
      const float got = dtype == LogitsDtype::BFloat16
                            ? std::bit_cast<float>(static_cast<uint32_t>(grad[i]) << 16)
                            : static_cast<float>(std::ldexp((grad[i] & 0x3ff) | ((grad[i] & 0x7c00) ? 0x400 : 0),
                                                            std::max(1, (grad[i] >> 10) & 0x1f) - 25)) *
                                  ((grad[i] & 0x8000) ? -1.0f : 1.0f);
      const double tol = dtype == LogitsDtype::BFloat16 ? 4e-3 : 5e-4;  // half an ulp of the output format
      ASSERT_NEAR(got, want, tol * std::abs(want) + 1e-7) << i;
    }
  }
}

TEST(Logprob, RowsWithoutGradientAreZeroAndExtremesStayFinite) {
  const int64_t vocab = 4;
  const std::vector<float> x = {1000.0f, -1000.0f, 0.0f, 999.0f};
  const int64_t target = 3;
  float m, s, t, z;
  row_stats({x.data(), 1, vocab, vocab, LogitsDtype::Float32}, &target, 0, 1.0f, {&m, &s, &t, &z});
  EXPECT_FLOAT_EQ(m, 1000.0f);
  EXPECT_NEAR((z - m) - std::log(s), -1.0 - std::log1p(std::exp(-1.0)), 1e-6);  // the wrapper's order
  const int64_t none = -1;
  const float lse = 0.0f, g = 1.0f;
  std::vector<float> grad(vocab, 3.0f);
  row_grad({x.data(), 1, vocab, vocab, LogitsDtype::Float32}, &none, 0, 1.0f, {&m, &lse, nullptr, &g, nullptr},
           grad.data(), vocab);
  EXPECT_EQ(grad, std::vector<float>(vocab, 0.0f));
}

TEST(Logprob, BadArgumentsThrow) {
  const float x = 0.0f;
  const int64_t t = 0;
  float out[4];
  const RowStats stats{out, out + 1, out + 2, out + 3};
  EXPECT_TRUE(ThrowsInvalid([&] { row_stats({&x, 1, 0, 1, LogitsDtype::Float32}, &t, 0, 1.0f, stats); }, {"vocab"}));
  EXPECT_TRUE(
      ThrowsInvalid([&] { row_stats({&x, 1, 1, 1, LogitsDtype::Float32}, &t, 0, 0.0f, stats); }, {"temperature"}));
  EXPECT_TRUE(
      ThrowsInvalid([&] { row_stats({&x, 1, 2, 1, LogitsDtype::Float32}, &t, 0, 1.0f, stats); }, {"row_stride"}));
  EXPECT_TRUE(ThrowsInvalid([&] { row_stats({nullptr, 1, 1, 1, LogitsDtype::Float32}, &t, 0, 1.0f, stats); },
                            {"null"}));
}

// Issue 26: a subnormal temperature passed the "positive finite" check, and its
// reciprocal (1e-40f -> inf) turned the gradient into inf / NaN.
TEST(Logprob, TemperatureMustBeANormalFloat) {
  const float x = 0.0f;
  const int64_t t = 0;
  float out[4];
  const RowStats stats{out, out + 1, out + 2, out + 3};
  const LogitsView v{&x, 1, 1, 1, LogitsDtype::Float32};
  for (float bad : {1e-40f, std::numeric_limits<float>::denorm_min(), -1.0f, std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN()})
    EXPECT_TRUE(
        ThrowsInvalid([&] { row_stats(v, &t, 0, bad, stats); }, {"temperature", "normal positive float32", "got"}));
  row_stats(v, &t, 0, std::numeric_limits<float>::min(), stats);
  row_stats(v, &t, 0, std::numeric_limits<float>::max(), stats);
}

TEST(Logprob, HugePageAdviceKeepsContents) {
  // The gradient buffer's advice: refused for null / sub-2 MiB ranges, never
  // changes what the buffer holds (Linux grants it when THP is "madvise" or on).
  EXPECT_FALSE(advise_huge_pages(nullptr, 8u << 20));
  std::vector<float> small(1024, 1.5f);
  EXPECT_FALSE(advise_huge_pages(small.data(), small.size() * sizeof(float)));
  std::vector<float> big(3u << 20, 0.25f);  // 12 MiB: holds at least one aligned 2 MiB page
  advise_huge_pages(big.data(), big.size() * sizeof(float));
  for (size_t i = 0; i < big.size(); i += 4097) ASSERT_EQ(big[i], 0.25f);
  EXPECT_STRNE(logprob_cpu_isa(), "");
}


// ---- the shared element math (seqpack/logprob_math.hpp), as the GPU runs it ----


// fp64 reference that skips masked (-inf) logits: they have probability 0 and
// contribute 0 (not 0 * -inf) to the entropy. NaN anywhere gives NaN.
Naive masked_naive(const std::vector<float>& x, int64_t target, double tau) {
  double m = -INFINITY;
  bool nan = false;
  for (float v : x) {
    nan |= std::isnan(v);
    m = std::max(m, v / tau);
  }
  if (nan) return {NAN, NAN, NAN};
  double s = 0.0;
  for (float v : x)
    if (v != -INFINITY) s += std::exp(v / tau - m);
  const double lse = m + std::log(s);
  double h = 0.0;
  for (float v : x)
    if (v != -INFINITY) h -= std::exp(v / tau - lse) * (v / tau - lse);
  return {lse, target >= 0 ? x[target] / tau - lse : 0.0, h};
}

// One CUDA block's statistics replayed on the host: every lane's lane_stats, then
// the kernel's merge order (shuffle-down tree in each warp of 32, then over warps).
lp::Lse<float> replay_block(const float* x, int64_t vocab, float tau, int width, bool entropy) {
  constexpr int kLanes = 256;
  std::vector<lp::Lse<float>> acc(kLanes);
  for (int lane = 0; lane < kLanes; ++lane)
    acc[lane] = width == 4 ? lp::lane_stats<4>(x, vocab, tau, lane, kLanes, entropy)
                           : lp::lane_stats<1>(x, vocab, tau, lane, kLanes, entropy);
  auto warp_reduce = [](lp::Lse<float>* w) {
    for (int off = 16; off > 0; off >>= 1)
      for (int lane = 0; lane + off < 32; ++lane) w[lane] = lp::lse_merge(w[lane], w[lane + off]);
  };
  std::vector<lp::Lse<float>> warps(32, lp::lse_empty<float>());
  for (int w = 0; w < kLanes / 32; ++w) {
    warp_reduce(acc.data() + 32 * w);
    warps[w] = acc[32 * w];
  }
  warp_reduce(warps.data());
  return warps[0];
}

TEST(LogprobMath, EmptyAndMaskedAccumulatorsStayFinite) {
  // The GPU defects: {-inf, 0, 0} merged with itself, and a -inf first element,
  // gave -inf * 0 = NaN and -inf - (-inf) = NaN.
  const lp::Lse<float> e = lp::lse_empty<float>();
  const lp::Lse<float> ee = lp::lse_merge(e, e);
  EXPECT_EQ(ee.m, -INFINITY);
  EXPECT_EQ(ee.s, 0.0f);
  EXPECT_EQ(ee.t, 0.0f);
  lp::Lse<float> a = e;
  lp::lse_add(a, -INFINITY, true);
  EXPECT_EQ(a.s, 0.0f);
  EXPECT_EQ(a.t, 0.0f);
  lp::lse_add(a, 1.5f, true);
  lp::lse_add(a, -INFINITY, true);
  EXPECT_EQ(a.m, 1.5f);
  EXPECT_FLOAT_EQ(a.s, 1.0f);
  EXPECT_EQ(a.t, 0.0f);
  const lp::Lse<float> b = lp::lse_merge(e, a);
  EXPECT_EQ(b.m, a.m);
  EXPECT_EQ(b.s, a.s);
  EXPECT_EQ(b.t, a.t);
  lp::lse_add(a, NAN, true);  // NaN propagates through the sums and merges
  EXPECT_TRUE(std::isnan(a.s));
  EXPECT_TRUE(std::isnan(lp::lse_merge(e, a).s));
  EXPECT_TRUE(std::isnan(lp::lse_merge(a, b).s));
  // The gradient of a masked logit is 0, not 0 * -inf.
  EXPECT_EQ(lp::grad_value(-INFINITY, 1.0f, 0.5f, -1.0f, -0.3f, 2.0f), 0.0f);
  EXPECT_TRUE(std::isnan(lp::grad_value(NAN, 1.0f, 0.5f, -1.0f, -0.3f, 2.0f)));
}

TEST(LogprobMath, GpuBlockReplayMatchesReferenceWithMaskedAndNanLogits) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (int64_t vocab : {1, 7, 40, 255, 1000, 1029, 4099}) {
    for (int pattern = 0; pattern < 5; ++pattern) {
      std::vector<float> x(static_cast<size_t>(vocab));
      for (float& v : x) v = normal(rng);
      // 0: finite; 1: masked tail (a padded vocabulary); 2: every other logit
      // masked (each lane's first element -inf); 3: all masked; 4: one NaN.
      for (int64_t i = 0; i < vocab; ++i) {
        if (pattern == 1 && i >= vocab * 3 / 4 && i > 0) x[i] = -INFINITY;
        if (pattern == 2 && i % 2 == 0 && vocab > 1) x[i] = -INFINITY;
        if (pattern == 3) x[i] = -INFINITY;
      }
      if (pattern == 4) x[vocab / 2] = NAN;
      const int64_t target = vocab - 1;
      const Naive ref = masked_naive(x, target, 0.7);
      for (int width : {1, 4}) {
        const lp::Lse<float> a = replay_block(x.data(), vocab, 0.7f, width, true);
        const double lse = a.m + std::log(static_cast<double>(a.s));
        const double h = std::log(static_cast<double>(a.s)) - a.t / a.s;
        const std::string where = "vocab " + std::to_string(vocab) + " pattern " + std::to_string(pattern) +
                                  " width " + std::to_string(width);
        if (pattern >= 3) {  // all masked or NaN: NaN, as log_softmax gives
          EXPECT_TRUE(std::isnan(x[target] / 0.7 - lse) || std::isnan(h)) << where;
          if (pattern == 4) EXPECT_TRUE(std::isnan(lse)) << where;
          continue;
        }
        EXPECT_NEAR(lse, ref.lse, 2e-6 * std::max(1.0, std::abs(ref.lse))) << where;
        EXPECT_NEAR(h, ref.entropy, 2e-5 * std::max(1.0, ref.entropy)) << where;
        EXPECT_TRUE(std::isfinite(a.t)) << where;
      }
    }
  }
}

TEST(Logprob, MaskedVocabularyGivesFiniteEntropyAndZeroGradient) {
  // The reproduction: logits [18, 40] with columns 30.. masked; before the
  // shared math the CPU gave 140 NaN gradient entries and a non-finite entropy.
  const int64_t rows = 18, vocab = 40;
  std::vector<float> x = random_logits(rows, vocab, 1.0f, 11);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 30; c < vocab; ++c) x[r * vocab + c] = -INFINITY;
  std::vector<int64_t> targets(rows);
  for (int64_t r = 0; r < rows; ++r) targets[r] = r % 6 == 5 ? -1 : (r * 7) % 30;
  std::vector<float> m(rows), s(rows), t(rows), z(rows), ls(rows), h(rows), glp(rows, 1.0f), gent(rows, 0.5f);
  row_stats({x.data(), rows, vocab, vocab, LogitsDtype::Float32}, targets.data(), 0, 1.0f,
            {m.data(), s.data(), t.data(), z.data()});
  for (int64_t r = 0; r < rows; ++r) {
    const std::vector<float> row(x.begin() + r * vocab, x.begin() + (r + 1) * vocab);
    const Naive ref = masked_naive(row, targets[r], 1.0);
    ls[r] = std::log(s[r]);
    h[r] = ls[r] - t[r] / s[r];
    ASSERT_TRUE(std::isfinite(h[r])) << r;
    EXPECT_NEAR(h[r], ref.entropy, 1e-5) << r;
    EXPECT_NEAR(m[r] + ls[r], ref.lse, 1e-5) << r;
  }
  std::vector<float> grad(static_cast<size_t>(rows * vocab), 7.0f);
  row_grad({x.data(), rows, vocab, vocab, LogitsDtype::Float32}, targets.data(), 0, 1.0f,
           {m.data(), ls.data(), h.data(), glp.data(), gent.data()}, grad.data(), vocab);
  for (int64_t r = 0; r < rows; ++r) {
    const lp::GradRowParams prm = lp::grad_row_params(m[r], ls[r], h[r], targets[r] >= 0 ? 1.0f : 0.0f, 0.5f, 1.0f,
                                                      lp::local_target(targets[r], 0, vocab));
    for (int64_t c = 0; c < vocab; ++c) {
      const float g = grad[r * vocab + c];
      ASSERT_TRUE(std::isfinite(g)) << r << "," << c;
      if (c >= 30) EXPECT_EQ(g, 0.0f) << r << "," << c;
      // The GPU's element function gives the CPU kernel's value.
      EXPECT_NEAR(lp::grad_element(prm, x[r * vocab + c], c), g, 1e-6f) << r << "," << c;
    }
  }
}

TEST(Logprob, NanLogitPropagatesInEveryBuild) {
  // A NaN in a column that is not the target must make the row's numbers NaN (the
  // CPU's clamped exp and max used to drop it and give a finite log-prob).
  const int64_t rows = 3, vocab = 1100;
  std::vector<float> x = random_logits(rows, vocab, 1.0f, 12);
  x[0 * vocab + 5] = NAN;     // in the first vector
  x[1 * vocab + 700] = NAN;   // in the second block
  x[2 * vocab + 1099] = NAN;  // in the scalar tail
  const std::vector<int64_t> targets = {1, 2, 3};
  std::vector<float> m(rows), s(rows), t(rows), z(rows);
  row_stats({x.data(), rows, vocab, vocab, LogitsDtype::Float32}, targets.data(), 0, 1.0f,
            {m.data(), s.data(), t.data(), z.data()});
  for (int64_t r = 0; r < rows; ++r) EXPECT_TRUE(std::isnan(z[r] - m[r] - std::log(s[r]))) << r;
}

}  // namespace
