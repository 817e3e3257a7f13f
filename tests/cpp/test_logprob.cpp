// Fused token log-probabilities (cpp/src/logprob.cpp) against a naive fp64 computation.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "seqpack/common.hpp"
#include "seqpack/logprob.hpp"
#include "test_helpers.hpp"

namespace {

using namespace seqpack;
using seqpack_test::ThrowsInvalid;

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

}  // namespace
