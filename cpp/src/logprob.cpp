#include "seqpack/logprob.hpp"

#if defined(__GNUC__)
#pragma GCC diagnostic ignored "-Wpsabi"  // 32/64-byte vectors in always-inlined helpers only
#endif

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>

#include "seqpack/common.hpp"
#include "seqpack/logprob_math.hpp"
#include "thread_pool.hpp"

// The row loops exist three times on x86-64: 16 lanes for AVX-512, 8 lanes for
// AVX2+FMA, 4 lanes for the baseline ISA; the CPU picks once at run time.
// Elsewhere: 4 lanes.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define SEQPACK_X86_DISPATCH 1
#define SEQPACK_AVX2 __attribute__((target("avx2,fma")))
#define SEQPACK_AVX512 __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma")))
#include <immintrin.h>
#endif

namespace seqpack {
namespace {

constexpr int64_t kBlock = 512;           // columns per fp32 partial sum
constexpr int64_t kRowsPerTask = 8;       // at least this many rows per thread task
constexpr float kExpMin = -87.0f;         // exp() below this is ~1e-38: flushed to it

// Several lanes at a time with GCC/Clang vector extensions (plain loops over the
// scalar code above do not vectorise: its clamps and the reductions would need
// reassociation, which -O3 alone does not allow).
typedef float f4 __attribute__((vector_size(16)));
typedef int32_t i4 __attribute__((vector_size(16)));
typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));
typedef float f16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));
template <typename V>
struct IntsOf;
template <>
struct IntsOf<f4> {
  using type = i4;
};
template <>
struct IntsOf<f8> {
  using type = i8;
};
template <>
struct IntsOf<f16> {
  using type = i16;
};
template <typename V>
constexpr int64_t kLanesOf = sizeof(V) / sizeof(float);

#ifdef SEQPACK_X86_DISPATCH
// A non-temporal 64-byte store (AVX-512 builds only; inlined into them). The vector
// goes by address: clang < 15 refuses a 64-byte vector argument in a function whose
// caller is not compiled for AVX-512 (an ABI change), even when it is inlined.
SEQPACK_AVX512 inline void stream16(float* p, const f16* v) {
  _mm512_stream_ps(p, _mm512_loadu_ps(reinterpret_cast<const float*>(v)));
}
#endif

template <typename V>
[[gnu::always_inline]] inline V splat(float v) {
  return V{} + v;
}
template <typename V>
[[gnu::always_inline]] inline V vload(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <typename V>
[[gnu::always_inline]] inline void vstore(float* p, V v) {
  std::memcpy(p, &v, sizeof v);
}
template <typename V>
[[gnu::always_inline]] inline V vmax(V a, V b) {
  return a > b ? a : b;
}

// exp(x) lane by lane for x <= 88, to ~2 ulp: x = n ln2 + r, a degree-6
// polynomial on r, times 2^n from the exponent bits. Below -87 it is exactly 0
// (so exp(-inf) = 0, as logprob_math.hpp requires); NaN stays NaN through the
// arithmetic: the clamps are written so that a NaN lane passes them unchanged
// (a self-comparison x != x is scalarised by GCC 12 in the AVX-512 build, several
// times slower).
template <typename V>
[[gnu::always_inline]] inline V vexp(V x) {
  using I = typename IntsOf<V>::type;
  // lo > x ? lo : x is maxps(lo, x) and hi < c ? hi : c is minps(hi, c): one
  // instruction each, and both return x / c where it is NaN.
  const V lo = splat<V>(kExpMin), hi = splat<V>(88.0f);
  V c = lo > x ? lo : x;
  c = hi < c ? hi : c;
  const V n = (c * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const V r = (c - n * 0.693359375f) + n * 2.12194440e-4f;
  V p = splat<V>(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const I bits = (__builtin_convertvector(n, I) + 127) << 23;
  const V y = p * std::bit_cast<V>(bits);
  return x < kExpMin ? V{} : y;
}

// The same for one value (row tails).
[[gnu::always_inline]] inline float fast_exp(float x) { return vexp(splat<f4>(x))[0]; }

// The exponential logprob_math.hpp's functions use here: the polynomial above on
// lanes and on single floats, the library's on doubles (row sums across blocks).
struct VecExp {
  template <typename V>
  [[gnu::always_inline]] V operator()(V x) const {
    return vexp(x);
  }
  [[gnu::always_inline]] float operator()(float x) const { return fast_exp(x); }
  [[gnu::always_inline]] double operator()(double x) const { return std::exp(x); }
};

template <typename V>
[[gnu::always_inline]] inline float hsum(V v) {
  float s = 0.0f;
  for (int k = 0; k < kLanesOf<V>; ++k) s += v[k];
  return s;
}
template <typename V>
[[gnu::always_inline]] inline float hmax(V v) {  // NaN in any lane gives NaN
  float m = v[0];
  for (int k = 1; k < kLanesOf<V>; ++k) m = lpmath::nan_max(m, v[k]);
  return m;
}

template <typename T>
struct Io;
template <>
struct Io<float> {
  [[gnu::always_inline]] static float load(const float* p, int64_t i) { return p[i]; }
  [[gnu::always_inline]] static void store(float* p, int64_t i, float v) { p[i] = v; }
};
using lpmath::BF16;
using lpmath::F16;
template <>
struct Io<BF16> {
  [[gnu::always_inline]] static float load(const BF16* p, int64_t i) { return lpmath::to_float(p[i]); }
  [[gnu::always_inline]] static void store(BF16* p, int64_t i, float v) { p[i] = lpmath::from_float<BF16>(v); }
};
template <>
struct Io<F16> {
  [[gnu::always_inline]] static float load(const F16* p, int64_t i) { return lpmath::to_float(p[i]); }
  [[gnu::always_inline]] static void store(F16* p, int64_t i, float v) { p[i] = lpmath::from_float<F16>(v); }
};

// Rows converted to fp32 (times 1/temperature) a block at a time, and fp32 results
// converted back: separate simple loops that the compiler vectorises.
template <typename T>
[[gnu::always_inline]] inline void load_block(const T* __restrict x, float* __restrict z, int64_t n, float tau) {
  for (int64_t i = 0; i < n; ++i) z[i] = Io<T>::load(x, i) / tau;  // divided, as x / temperature in PyTorch
}
template <typename T>
[[gnu::always_inline]] inline void store_block(T* __restrict g, const float* __restrict v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) Io<T>::store(g, i, v[i]);
}

struct StatsOut {
  float max, sumexp, zexp, target_z;
};

// One row, a block of columns at a time: the block's maximum raises the row's
// accumulator once (lpmath::lse_raise, in fp64 across blocks), then every lane
// accumulates exp(z - m) and its entropy term (lpmath::lse_accumulate, fp32 within
// the block). The rules for -inf and NaN logits are logprob_math.hpp's.
template <typename T, typename V>
[[gnu::always_inline]] inline StatsOut stats_row(const T* __restrict x, int64_t vocab, float tau,
                                                 int64_t local_target, bool entropy) {
  constexpr int64_t kLanes = kLanesOf<V>;
  alignas(64) float z[kBlock];
  lpmath::Lse<double> row = lpmath::lse_empty<double>();
  for (int64_t b = 0; b < vocab; b += kBlock) {
    const int64_t n = std::min(kBlock, vocab - b), full = n - n % kLanes;
    const float* zb = z;
    if constexpr (std::is_same_v<T, float>) {
      if (tau == 1.0f) zb = x + b;  // no conversion or scaling: read the row in place
      else load_block(x + b, z, n, tau);
    } else {
      load_block(x + b, z, n, tau);
    }
    // A plain lane max (a NaN-propagating one needs a self-comparison, scalarised by
    // GCC in the AVX-512 build): a NaN logit reaches the sums through exp(NaN) anyway.
    V vm = splat<V>(lpmath::neg_inf<float>());
    for (int64_t i = 0; i < full; i += kLanes) vm = vmax(vm, vload<V>(zb + i));
    float bm = hmax(vm);
    for (int64_t i = full; i < n; ++i) bm = lpmath::nan_max(bm, zb[i]);
    lpmath::lse_raise(row, static_cast<double>(bm), VecExp{});
    const float m = static_cast<float>(row.m);
    if (m == lpmath::neg_inf<float>()) continue;  // the row so far is all masked: nothing to add
    V vs{}, vt{};
    const V vmx = splat<V>(m);
    for (int64_t i = 0; i < full; i += kLanes) lpmath::lse_accumulate(vs, vt, vload<V>(zb + i), vmx, entropy, VecExp{});
    float bs = hsum(vs), bt = hsum(vt);
    for (int64_t i = full; i < n; ++i) lpmath::lse_accumulate(bs, bt, zb[i], m, entropy, VecExp{});
    row.s += bs;
    row.t += bt;
  }
  const float tz = local_target >= 0 ? Io<T>::load(x, local_target) / tau : 0.0f;
  return {static_cast<float>(row.m), static_cast<float>(row.s), static_cast<float>(row.t), tz};
}

template <typename T, typename V>
[[gnu::always_inline]] inline void grad_row(const T* __restrict x, T* __restrict g, int64_t vocab, float tau,
                                            int64_t local_target, float m, float log_s, float g_lp, float g_ent,
                                            float h, float extra_sum) {
  constexpr int64_t kLanes = kLanesOf<V>;
  // d/dz: g_lp * (onehot - p) - g_ent * p * (log p + H); then / temperature. Extra
  // targets weigh the p term too (extra_sum); grad_rows then rewrites their columns.
  alignas(64) float z[kBlock];
  const float inv_t = 1.0f / tau, a = -(g_lp + extra_sum) * inv_t, c = -g_ent * inv_t;
  const V va = splat<V>(a), vc = splat<V>(c), vh = splat<V>(h), vm = splat<V>(m), vls = splat<V>(log_s);
  if constexpr (std::is_same_v<T, float>) {
    // fp32: straight from the logits to the gradient, no staging block.
    const int64_t full = vocab - vocab % kLanes;
    const V vtau = splat<V>(tau);
    const bool stream = kLanes == 16 && reinterpret_cast<uintptr_t>(g) % 64 == 0;
    for (int64_t i = 0; i < full; i += kLanes) {
      const V zi = tau == 1.0f ? vload<V>(x + i) : vload<V>(x + i) / vtau;
      const V out = lpmath::grad_value(zi, vm, vls, va, vc, vh, VecExp{});
#ifdef SEQPACK_X86_DISPATCH
      if constexpr (kLanes == 16) {
        if (stream) {  // non-temporal: the gradient is not read again soon; no read-for-ownership
          stream16(g + i, &out);
          continue;
        }
      }
#endif
      vstore(g + i, out);
    }
    for (int64_t i = full; i < vocab; ++i) g[i] = lpmath::grad_value(x[i] / tau, m, log_s, a, c, h, VecExp{});
    if (local_target >= 0) g[local_target] += g_lp * inv_t;
    return;
  }
  for (int64_t b = 0; b < vocab; b += kBlock) {
    const int64_t n = std::min(kBlock, vocab - b), full = n - n % kLanes;
    load_block(x + b, z, n, tau);
    for (int64_t i = 0; i < full; i += kLanes)
      vstore(z + i, lpmath::grad_value(vload<V>(z + i), vm, vls, va, vc, vh, VecExp{}));
    for (int64_t i = full; i < n; ++i) z[i] = lpmath::grad_value(z[i], m, log_s, a, c, h, VecExp{});
    if (local_target >= b && local_target < b + n) z[local_target - b] += g_lp * inv_t;
    store_block(g + b, z, n);
  }
}

template <typename T, typename V>
[[gnu::always_inline]] inline void stats_rows(const LogitsView& v, const int64_t* targets, int64_t vocab_start,
                                              float tau, const RowStats& out, int64_t lo, int64_t hi) {
  const auto* base = static_cast<const T*>(v.data);
  for (int64_t r = lo; r < hi; ++r) {
    const StatsOut s = stats_row<T, V>(base + r * v.row_stride, v.vocab, tau,
                                       lpmath::local_target(targets[r], vocab_start, v.vocab), out.zexp != nullptr);
    out.max[r] = s.max;
    out.sumexp[r] = s.sumexp;
    if (out.zexp) out.zexp[r] = s.zexp;
    out.target_z[r] = s.target_z;
  }
}

template <typename T, typename V>
[[gnu::always_inline]] inline void grad_rows(const LogitsView& v, const int64_t* targets, int64_t vocab_start,
                                             float tau, const RowGradInputs& in, void* grad, int64_t grad_stride,
                                             int64_t lo, int64_t hi) {
  const auto* base = static_cast<const T*>(v.data);
  auto* gbase = static_cast<T*>(grad);
  for (int64_t r = lo; r < hi; ++r) {
    T* g = gbase + r * grad_stride;
    const int64_t t = lpmath::local_target(targets[r], vocab_start, v.vocab);
    const float g_lp = targets[r] >= 0 ? in.grad_logprob[r] : 0.0f;
    const float g_ent = in.grad_entropy ? in.grad_entropy[r] : 0.0f;
    const int64_t e_lo = in.extra_offsets ? in.extra_offsets[r] : 0;
    const int64_t e_hi = in.extra_offsets ? in.extra_offsets[r + 1] : 0;
    const lpmath::ExtraSums extra = lpmath::extra_sums(in.extra_ids, in.extra_grad, e_lo, e_hi);
    if (g_lp == 0.0f && g_ent == 0.0f && !extra.any) {
      for (int64_t i = 0; i < v.vocab; ++i) Io<T>::store(g, i, 0.0f);
      continue;
    }
    const T* x = base + r * v.row_stride;
    const float h = in.entropy ? in.entropy[r] : 0.0f;
    grad_row<T, V>(x, g, v.vocab, tau, t, in.max[r], in.log_sumexp[r], g_lp, g_ent, h, extra.sum);
    if (e_hi == e_lo) continue;
    const lpmath::GradRowParams prm =
        lpmath::grad_row_params(in.max[r], in.log_sumexp[r], h, g_lp, g_ent, tau, t, extra.sum, extra.any);
    for (int64_t e = e_lo; e < e_hi; ++e) {  // each extra target's column, with every hit in it
      const int64_t col = lpmath::local_target(in.extra_ids[e], vocab_start, v.vocab);
      if (col < 0) continue;
      Io<T>::store(g, col, lpmath::extra_column_value(prm, Io<T>::load(x, col) / tau, col, in.extra_ids, in.extra_grad,
                                                      e_lo, e_hi, vocab_start, v.vocab, VecExp{}));
    }
  }
}

// The builds of the row loops (4 lanes baseline; 8 lanes AVX2+FMA and 16 lanes
// AVX-512 on x86-64) and the choice between them, made once per process.
#ifdef SEQPACK_X86_DISPATCH
template <typename T>
SEQPACK_AVX2 void stats_rows_avx2(const LogitsView& v, const int64_t* t, int64_t vs, float tau, const RowStats& o,
                                  int64_t lo, int64_t hi) {
  stats_rows<T, f8>(v, t, vs, tau, o, lo, hi);
}
template <typename T>
SEQPACK_AVX2 void grad_rows_avx2(const LogitsView& v, const int64_t* t, int64_t vs, float tau,
                                 const RowGradInputs& in, void* g, int64_t gs, int64_t lo, int64_t hi) {
  grad_rows<T, f8>(v, t, vs, tau, in, g, gs, lo, hi);
}
template <typename T>
SEQPACK_AVX512 void stats_rows_avx512(const LogitsView& v, const int64_t* t, int64_t vs, float tau,
                                      const RowStats& o, int64_t lo, int64_t hi) {
  stats_rows<T, f16>(v, t, vs, tau, o, lo, hi);
}
template <typename T>
SEQPACK_AVX512 void grad_rows_avx512(const LogitsView& v, const int64_t* t, int64_t vs, float tau,
                                     const RowGradInputs& in, void* g, int64_t gs, int64_t lo, int64_t hi) {
  grad_rows<T, f16>(v, t, vs, tau, in, g, gs, lo, hi);
  _mm_sfence();  // the streamed gradient is visible before the task reports done
}
#endif

enum class Isa { Baseline, Avx2, Avx512 };

Isa detect_isa() {
  Isa best = Isa::Baseline;
#ifdef SEQPACK_X86_DISPATCH
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) best = Isa::Avx2;
  if (best == Isa::Avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
    best = Isa::Avx512;
#endif
  // SEQPACK_CPU_ISA=baseline|avx2 caps the choice (tests of every build, A/B runs).
  if (const char* cap = std::getenv("SEQPACK_CPU_ISA")) {
    const std::string c(cap);
    if (c == "baseline") best = Isa::Baseline;
    else if (c == "avx2" && best == Isa::Avx512) best = Isa::Avx2;
  }
  return best;
}

Isa cpu_isa() {
  static const Isa isa = detect_isa();
  return isa;
}

template <typename T>
void stats_rows_any(const LogitsView& v, const int64_t* t, int64_t vs, float tau, const RowStats& o, int64_t lo,
                    int64_t hi) {
#ifdef SEQPACK_X86_DISPATCH
  if (cpu_isa() == Isa::Avx512) return stats_rows_avx512<T>(v, t, vs, tau, o, lo, hi);
  if (cpu_isa() == Isa::Avx2) return stats_rows_avx2<T>(v, t, vs, tau, o, lo, hi);
#endif
  stats_rows<T, f4>(v, t, vs, tau, o, lo, hi);
}
template <typename T>
void grad_rows_any(const LogitsView& v, const int64_t* t, int64_t vs, float tau, const RowGradInputs& in, void* g,
                   int64_t gs, int64_t lo, int64_t hi) {
#ifdef SEQPACK_X86_DISPATCH
  if (cpu_isa() == Isa::Avx512) return grad_rows_avx512<T>(v, t, vs, tau, in, g, gs, lo, hi);
  if (cpu_isa() == Isa::Avx2) return grad_rows_avx2<T>(v, t, vs, tau, in, g, gs, lo, hi);
#endif
  grad_rows<T, f4>(v, t, vs, tau, in, g, gs, lo, hi);
}

template <typename F>
void over_rows(int64_t rows, int num_threads, F&& body) {
  if (num_threads < 0) throw_invalid("logprob", "num_threads must be >= 0");
  const size_t threads = num_threads > 0 ? static_cast<size_t>(num_threads) : detail::available_threads();
  // One task per thread (rows cost the same): the task count caps the concurrency.
  const auto tasks = static_cast<size_t>(
      std::max<int64_t>(1, std::min<int64_t>(static_cast<int64_t>(threads), rows / kRowsPerTask)));
  detail::parallel_for(tasks, [&](size_t k) {
    const auto T = static_cast<int64_t>(tasks), i = static_cast<int64_t>(k);
    body(rows / T * i + rows % T * i / T, rows / T * (i + 1) + rows % T * (i + 1) / T);
  });
}

}  // namespace

const char* logprob_cpu_isa() {
  switch (cpu_isa()) {
    case Isa::Avx512: return "avx512";
    case Isa::Avx2: return "avx2";
    default: return "baseline";
  }
}

namespace {
void check_view(const char* fn, const LogitsView& v, const int64_t* targets, float temperature) {
  if (v.rows < 0 || v.vocab <= 0) throw_invalid(fn, "logits must be [rows, vocab] with rows >= 0 and vocab > 0");
  if (v.row_stride < v.vocab) throw_invalid(fn, "row_stride must be >= vocab");
  if (v.rows > 0 && (v.rows - 1) > (std::numeric_limits<int64_t>::max() - v.vocab) / v.row_stride)
    throw_invalid(fn, "rows * row_stride overflows int64");
  if (v.rows > 0 && (v.data == nullptr || targets == nullptr)) throw_invalid(fn, "logits and targets must not be null");
  // A normal float32: x / temperature and 1 / temperature stay finite for finite x
  // of moderate size (a subnormal one has an infinite reciprocal).
  if (!(temperature >= std::numeric_limits<float>::min()) || !(temperature <= std::numeric_limits<float>::max())) {
    char shown[32];
    std::snprintf(shown, sizeof shown, "%.9g", static_cast<double>(temperature));
    throw_invalid(fn, std::string("temperature must be a normal positive float32 (1.1754944e-38 to "
                                  "3.4028235e+38), got ") + shown);
  }
}
}  // namespace

void check_row_stats_args(const char* fn, const LogitsView& logits, const int64_t* targets, float temperature,
                          const RowStats& out) {
  check_view(fn, logits, targets, temperature);
  if (logits.rows > 0 && (!out.max || !out.sumexp || !out.target_z))
    throw_invalid(fn, "max, sumexp and target_z outputs must not be null");
}

void check_row_grad_args(const char* fn, const LogitsView& logits, const int64_t* targets, float temperature,
                         const RowGradInputs& in, const void* grad, int64_t grad_row_stride) {
  check_view(fn, logits, targets, temperature);
  if (grad_row_stride < logits.vocab) throw_invalid(fn, "grad_row_stride must be >= vocab");
  if (logits.rows > 0 && (!grad || !in.max || !in.log_sumexp || !in.grad_logprob))
    throw_invalid(fn, "grad, max, log_sumexp and grad_logprob must not be null");
  if (in.grad_entropy && !in.entropy) throw_invalid(fn, "grad_entropy needs the entropy");
  const int extras = (in.extra_offsets != nullptr) + (in.extra_ids != nullptr) + (in.extra_grad != nullptr);
  if (extras != 0 && extras != 3)
    throw_invalid(fn, "extra_offsets, extra_ids and extra_grad must be given together (or none of them)");
}

void row_stats(const LogitsView& logits, const int64_t* targets, int64_t vocab_start, float temperature,
               const RowStats& out, int num_threads) {
  check_row_stats_args("row_stats", logits, targets, temperature, out);
  over_rows(logits.rows, num_threads, [&](int64_t lo, int64_t hi) {
    switch (logits.dtype) {
      case LogitsDtype::Float32: stats_rows_any<float>(logits, targets, vocab_start, temperature, out, lo, hi); break;
      case LogitsDtype::BFloat16: stats_rows_any<BF16>(logits, targets, vocab_start, temperature, out, lo, hi); break;
      case LogitsDtype::Float16: stats_rows_any<F16>(logits, targets, vocab_start, temperature, out, lo, hi); break;
    }
  });
}

void row_grad(const LogitsView& logits, const int64_t* targets, int64_t vocab_start, float temperature,
              const RowGradInputs& in, void* grad, int64_t grad_row_stride, int num_threads) {
  check_row_grad_args("row_grad", logits, targets, temperature, in, grad, grad_row_stride);
  over_rows(logits.rows, num_threads, [&](int64_t lo, int64_t hi) {
    switch (logits.dtype) {
      case LogitsDtype::Float32:
        grad_rows_any<float>(logits, targets, vocab_start, temperature, in, grad, grad_row_stride, lo, hi);
        break;
      case LogitsDtype::BFloat16:
        grad_rows_any<BF16>(logits, targets, vocab_start, temperature, in, grad, grad_row_stride, lo, hi);
        break;
      case LogitsDtype::Float16:
        grad_rows_any<F16>(logits, targets, vocab_start, temperature, in, grad, grad_row_stride, lo, hi);
        break;
    }
  });
}

}  // namespace seqpack
