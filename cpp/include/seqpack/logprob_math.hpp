#pragma once
// The arithmetic of the fused token log-probabilities, written once for the CPU
// kernels (scalars and SIMD lanes, cpp/src/logprob.cpp) and the CUDA kernels
// (cuda/logprob.cu, where nvcc compiles it as __host__ __device__). The CPU test
// suite therefore runs the same float arithmetic the GPU runs.
//
// Per row, with z = x / temperature, an accumulator holds
//   m = max z,   s = sum exp(z - m),   t = sum exp(z - m) (z - m)
// (t <= 0 relative to the maximum, so the entropy log(s) - t / s has no
// cancellation). Rules every function below keeps:
//   * a masked logit (z = -inf) contributes exactly 0 to s and t, whatever m is
//     (exp(-inf) (-inf) is taken as its limit 0, never 0 * -inf = NaN);
//   * an empty accumulator is {-inf, 0, 0}; merging with it is the identity;
//   * a NaN logit makes s NaN (exp(NaN) = NaN; m too where a NaN-propagating max
//     saw it), so the log-prob, entropy and gradient of its row are NaN (as
//     log_softmax gives); an all-masked row (every z = -inf) gives s = 0 and NaN
//     results, as log_softmax does.
// Functions are templates over the value type V so that the CPU kernels can run
// them on GCC/Clang vector types (comparisons give lane masks, ?: selects lanes)
// as well as on float and double; `Exp` is the exponential the caller uses (a
// SIMD polynomial on the CPU, expf on the GPU) and must give exp(-inf) = 0 and
// exp(NaN) = NaN.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "seqpack/hd.hpp"

namespace seqpack::lpmath {

// -inf without std::numeric_limits (a constexpr host function nvcc would not
// call from device code without --expt-relaxed-constexpr).
template <typename F>
SEQPACK_HD F neg_inf() {
  return static_cast<F>(-HUGE_VAL);
}

// exp for scalars: the accurate library function on either side (the GPU's
// __expf would be 2 + 1.2|x| ulp off for the large |x| of a long tail).
struct ScalarExp {
  SEQPACK_HD float operator()(float x) const {
#if defined(__CUDA_ARCH__)
    return expf(x);
#else
    return std::exp(x);
#endif
  }
  SEQPACK_HD double operator()(double x) const {
#if defined(__CUDA_ARCH__)
    return ::exp(x);
#else
    return std::exp(x);
#endif
  }
};

// max that propagates NaN from either side (std::max and fmaxf drop it).
template <typename V>
SEQPACK_HD V nan_max(V a, V b) {
  return (a > b || a != a) ? a : b;
}

// Re-expresses (s, t), sums taken relative to `from`, relative to `to` >= from:
//   s' = e s,  t' = e t + e d s  with d = from - to, e = exp(d).
// from == to (including both -inf: an empty accumulator) leaves them as they are;
// from = -inf (nothing but masked logits so far) gives e = 0 and zero sums.
template <typename V, typename Exp = ScalarExp>
SEQPACK_HD void lse_rebase(V& s, V& t, V from, V to, Exp exp = {}) {
  const V zero{}, one = zero + 1;
  const auto same = from == to;
  const V d = from - to;
  const V e = same ? one : exp(d);
  const V ed = (same || e == zero) ? zero : e * d;
  t = e * t + ed * s;
  s = e * s;
}

// Masked logits and vanishing terms use ordered comparisons and a finite stand-in
// for -inf rather than == (GCC 12 scalarises vector equality and x != x in the
// AVX-512 build, several times slower); a NaN passes every clamp unchanged.
constexpr float kVanishing = -1.0e4f;  // exp of it is exactly 0 in fp32 and fp64

// Adds exp(z - m) and exp(z - m)(z - m) to (s, t) for one value (or one lane
// each) relative to a maximum m >= z that is not -inf (callers skip stretches of
// masked logits, whose maximum is -inf: they add nothing). A masked z (-inf) then
// has d = -inf and adds exactly 0 to both sums: exp(-inf) = 0, and the entropy
// term takes d clamped to a finite value, never 0 * -inf. NaN stays NaN.
template <typename V, typename Exp = ScalarExp>
SEQPACK_HD void lse_accumulate(V& s, V& t, V z, V m, bool entropy, Exp exp = {}) {
  const V d = z - m;
  const V e = exp(d);
  s += e;
  if (entropy) t += e * (d < kVanishing ? V{} + kVanishing : d);
}

// The accumulator of one row (or of a part of one, a thread's lane, a vocabulary
// slice). F is float in the kernels; double where the CPU keeps a row's sums.
template <typename F>
struct Lse {
  F m, s, t;
};

template <typename F>
SEQPACK_HD Lse<F> lse_empty() {
  return {neg_inf<F>(), F(0), F(0)};
}

// Raises the accumulator's maximum to include `new_max` (the max of values about
// to be accumulated), rescaling its sums once.
template <typename F, typename Exp = ScalarExp>
SEQPACK_HD void lse_raise(Lse<F>& a, F new_max, Exp exp = {}) {
  const F m = nan_max(a.m, new_max);
  if (!(m == a.m)) {  // also when m is NaN
    lse_rebase(a.s, a.t, a.m, m, exp);
    a.m = m;
  }
}

// One value, online (raise the maximum if needed, then accumulate).
template <typename F, typename Exp = ScalarExp>
SEQPACK_HD void lse_add(Lse<F>& a, F z, bool entropy, Exp exp = {}) {
  lse_raise(a, z, exp);
  if (a.m > neg_inf<F>() || a.m != a.m) lse_accumulate(a.s, a.t, z, a.m, entropy, exp);  // else z is -inf too
}

// Exact merge of two accumulators (lanes, warps, blocks of a row).
template <typename F, typename Exp = ScalarExp>
SEQPACK_HD Lse<F> lse_merge(Lse<F> a, Lse<F> b, Exp exp = {}) {
  const F m = nan_max(a.m, b.m);
  lse_rebase(a.s, a.t, a.m, m, exp);
  lse_rebase(b.s, b.t, b.m, m, exp);
  return {m, a.s + b.s, a.t + b.t};
}

// The gradient of g_lp * logprob + g_ent * entropy with respect to one logit,
// without the one-hot term of the target column (the caller adds g_lp / tau there):
//   p (a + c (log p + H)),  log p = (z - m) - log_s,  a = -g_lp / tau, c = -g_ent / tau.
// A masked logit (log p = -inf) gets exactly 0, as log_softmax's backward gives,
// not 0 * -inf: log p is clamped to a finite value whose exp is 0.
template <typename V, typename Exp = ScalarExp>
SEQPACK_HD V grad_value(V z, V m, V log_s, V a, V c, V h, Exp exp = {}) {
  const V vanishing = V{} + kVanishing;
  const V raw = (z - m) - log_s;
  const V logp = raw < kVanishing ? vanishing : raw;  // NaN stays NaN
  return exp(logp) * (a + c * (logp + h));
}

// ---- storage formats ------------------------------------------------------
template <typename To, typename From>
SEQPACK_HD To bit_copy(From f) {
  static_assert(sizeof(To) == sizeof(From), "same size");
  To t;
  std::memcpy(&t, &f, sizeof t);
  return t;
}

SEQPACK_HD float bf16_to_float(uint16_t h) { return bit_copy<float>(static_cast<uint32_t>(h) << 16); }

SEQPACK_HD uint16_t float_to_bf16(float f) {
  const uint32_t u = bit_copy<uint32_t>(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;  // round to nearest even
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);  // NaN stays NaN
}

SEQPACK_HD float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t body = static_cast<uint32_t>(h & 0x7fffu) << 13;
  float f = bit_copy<float>(body) * 0x1p112f;  // rebias normals and subnormals alike
  if (body >= 0x0f800000u) f = bit_copy<float>(body | 0x7f800000u);  // inf / NaN
  return bit_copy<float>(bit_copy<uint32_t>(f) | sign);
}

SEQPACK_HD uint16_t float_to_half(float f) {
  uint32_t x = bit_copy<uint32_t>(f);
  const auto sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return sign | (x > 0x7f800000u ? 0x7e00u : 0x7c00u);  // NaN / inf
  if (x >= 0x477ff000u) return sign | 0x7c00u;  // rounds past the largest half: inf
  if (x < 0x38800000u) {  // below 2^-14: subnormal half; the float add rounds to nearest even
    const float t = bit_copy<float>(x) + 0.5f;
    return sign | static_cast<uint16_t>(bit_copy<uint32_t>(t) - 0x3f000000u);
  }
  x += 0xc8000fffu + ((x >> 13) & 1u);  // rebias 127 -> 15 and round to nearest even
  return sign | static_cast<uint16_t>(x >> 13);
}

// The element types of the logits, as 16-bit words where they are halves.
struct BF16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};

SEQPACK_HD float to_float(float x) { return x; }
SEQPACK_HD float to_float(BF16 x) { return bf16_to_float(x.bits); }
SEQPACK_HD float to_float(F16 x) { return half_to_float(x.bits); }

template <typename T>
SEQPACK_HD T from_float(float x);
template <>
SEQPACK_HD float from_float<float>(float x) {
  return x;
}
template <>
SEQPACK_HD BF16 from_float<BF16>(float x) {
  return {float_to_bf16(x)};
}
template <>
SEQPACK_HD F16 from_float<F16>(float x) {
  return {float_to_half(x)};
}

// The column of a (global) target id inside the slice [vocab_start, vocab_start +
// vocab), or -1 when the row has no target (id < 0) or another slice holds it.
SEQPACK_HD int64_t local_target(int64_t target, int64_t vocab_start, int64_t vocab) {
  return (target >= 0 && target >= vocab_start && target - vocab_start < vocab) ? target - vocab_start : -1;
}

// ---- what one GPU thread does, replayable on the host ---------------------
// W elements loaded at once (16 bytes on the GPU when the rows allow it).
template <typename T, int W>
struct alignas(sizeof(T) * W) Pack {
  T v[W];
};

// The statistics one of `lanes` threads of a row's block accumulates in the CUDA
// kernel: packs of W values at lane, lane + lanes, ... (each raising the maximum
// once), then the tail columns one at a time. The host tests replay a whole block
// lane by lane and merge the lanes in the kernel's tree order.
template <int W, typename T>
SEQPACK_HD Lse<float> lane_stats(const T* x, int64_t vocab, float tau, int64_t lane, int64_t lanes, bool entropy) {
  Lse<float> a = lse_empty<float>();
  const int64_t packs = vocab / W;
  const auto* xv = reinterpret_cast<const Pack<T, W>*>(x);
  for (int64_t i = lane; i < packs; i += lanes) {
    const Pack<T, W> p = xv[i];
    float z[W];
    float pm = neg_inf<float>();
    SEQPACK_UNROLL
    for (int k = 0; k < W; ++k) {
      z[k] = to_float(p.v[k]) / tau;
      pm = nan_max(pm, z[k]);
    }
    lse_raise(a, pm);
    if (!(a.m > neg_inf<float>() || a.m != a.m)) continue;  // every value so far masked: nothing to add
    SEQPACK_UNROLL
    for (int k = 0; k < W; ++k) lse_accumulate(a.s, a.t, z[k], a.m, entropy);
  }
  for (int64_t i = packs * W + lane; i < vocab; i += lanes) lse_add(a, to_float(x[i]) / tau, entropy);
  return a;
}

// One row's gradient parameters (from its statistics and upstream gradients) and
// the value written for one column, as the CUDA kernel computes them.
struct GradRowParams {
  float m, log_s, h, a, c, hit, tau;
  int64_t target;  // local column of the target, or -1
  bool zero;       // no upstream gradient: the row is all zeros
};

// extra_sum / extra_any: the sum of the row's extra targets' upstream gradients and
// whether any is nonzero (see "several targets in one row" below; 0 / false for none).
SEQPACK_HD GradRowParams grad_row_params(float m, float log_s, float h, float g_lp, float g_ent, float tau,
                                         int64_t local_target, float extra_sum = 0.0f, bool extra_any = false) {
  const float inv_t = 1.0f / tau;
  return {m, log_s, h, -(g_lp + extra_sum) * inv_t, -g_ent * inv_t, g_lp * inv_t, tau, local_target,
          g_lp == 0.0f && g_ent == 0.0f && !extra_any};
}

template <typename T>
SEQPACK_HD T grad_element(const GradRowParams& p, T x, int64_t col) {
  if (p.zero) return from_float<T>(0.0f);
  const float v = grad_value(to_float(x) / p.tau, p.m, p.log_s, p.a, p.c, p.h);
  return from_float<T>(col == p.target ? v + p.hit : v);
}

// ---- several targets in one row ---------------------------------------------
// A row may have extra targets besides its own (a prefix tree's branch point
// predicts each child; distillation reads k columns), all from the one
// log-sum-exp of the row. Extra target e of the row adds g_e * (onehot(col_e) - p)
// to its upstream gradient:
//   d/dz = (g_lp onehot(target) + sum_e g_e onehot(col_e) - (g_lp + sum_e g_e) p
//           - g_ent p (log p + H)) / tau.
// Row r's extras are ids[offsets[r] .. offsets[r + 1]) (global ids, < 0 skipped,
// repeats allowed) with gradients grad[...]. The kernels write every column with
// grad_row_params(..., extra_sum, extra_any) (the softmax term weighted by the
// whole sum, the primary target's hit) and then rewrite each extra target's column
// with extra_column_value, which adds every hit in that column: the rewrites of a
// repeated column all write the same value, in any order.
struct ExtraSums {
  float sum = 0.0f;
  bool any = false;  // some extra gradient is nonzero
};

SEQPACK_HD ExtraSums extra_sums(const int64_t* ids, const float* grad, int64_t lo, int64_t hi) {
  ExtraSums out;
  for (int64_t e = lo; e < hi; ++e) {
    if (ids[e] < 0) continue;
    out.sum += grad[e];
    out.any = out.any || grad[e] != 0.0f;
  }
  return out;
}

template <typename Exp = ScalarExp>
SEQPACK_HD float extra_column_value(const GradRowParams& p, float z, int64_t col, const int64_t* ids, const float* grad,
                                    int64_t lo, int64_t hi, int64_t vocab_start, int64_t vocab, Exp exp = {}) {
  if (p.zero) return 0.0f;
  float hits = 0.0f;
  for (int64_t e = lo; e < hi; ++e)
    if (local_target(ids[e], vocab_start, vocab) == col) hits += grad[e];
  const float v = grad_value(z, p.m, p.log_s, p.a, p.c, p.h, exp) + hits / p.tau;
  return col == p.target ? v + p.hit : v;
}

}  // namespace seqpack::lpmath
