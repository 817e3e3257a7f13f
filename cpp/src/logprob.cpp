#include "seqpack/logprob.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <string>

#include "seqpack/common.hpp"
#include "thread_pool.hpp"

// Hot loops are compiled for AVX2+FMA as well as the baseline and picked at run
// time (GCC/Clang function multiversioning on x86-64 Linux).
#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
#define SEQPACK_MULTIVERSION __attribute__((target_clones("arch=haswell", "default")))
#else
#define SEQPACK_MULTIVERSION
#endif

namespace seqpack {
namespace {

constexpr int64_t kBlock = 512;           // columns per fp32 partial sum
constexpr int64_t kRowsPerTask = 8;       // at least this many rows per thread task
constexpr float kExpMin = -87.0f;         // exp() below this is ~1e-38: flushed to it

// exp(x) for x <= 88 to ~2 ulp: x = n ln2 + r, a degree-6 polynomial on r, times
// 2^n from the exponent bits. Branch-free, so loops over it vectorise.
inline float fast_exp(float x) {
  x = std::clamp(x, kExpMin, 88.0f);
  const float shifted = x * 1.44269504088896341f + 12582912.0f;  // round(x / ln2) in the low mantissa
  const float n = shifted - 12582912.0f;
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // x - n ln2, two-part ln2
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const auto scale = std::bit_cast<float>(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23);
  return p * scale;
}

inline float bf16_to_float(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

inline uint16_t float_to_bf16(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t body = static_cast<uint32_t>(h & 0x7fffu) << 13;
  float f = std::bit_cast<float>(body) * 0x1p112f;  // rebias normals and subnormals alike
  if (body >= 0x0f800000u) f = std::bit_cast<float>(body | 0x7f800000u);  // inf / NaN
  return std::bit_cast<float>(std::bit_cast<uint32_t>(f) | sign);
}

inline uint16_t float_to_half(float f) {
  uint32_t x = std::bit_cast<uint32_t>(f);
  const auto sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return sign | (x > 0x7f800000u ? 0x7e00u : 0x7c00u);  // NaN / inf
  if (x >= 0x477ff000u) return sign | 0x7c00u;  // rounds past the largest half: inf
  if (x < 0x38800000u) {  // below 2^-14: subnormal half; the float add rounds to nearest even
    const float t = std::bit_cast<float>(x) + 0.5f;
    return sign | static_cast<uint16_t>(std::bit_cast<uint32_t>(t) - 0x3f000000u);
  }
  x += 0xc8000fffu + ((x >> 13) & 1u);  // rebias 127 -> 15 and round to nearest even
  return sign | static_cast<uint16_t>(x >> 13);
}

template <typename T>
struct Io;
template <>
struct Io<float> {
  static float load(const float* p, int64_t i) { return p[i]; }
  static void store(float* p, int64_t i, float v) { p[i] = v; }
};
struct BF16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};
template <>
struct Io<BF16> {
  static float load(const BF16* p, int64_t i) { return bf16_to_float(p[i].bits); }
  static void store(BF16* p, int64_t i, float v) { p[i].bits = float_to_bf16(v); }
};
template <>
struct Io<F16> {
  static float load(const F16* p, int64_t i) { return half_to_float(p[i].bits); }
  static void store(F16* p, int64_t i, float v) { p[i].bits = float_to_half(v); }
};

struct StatsOut {
  float max, sumexp, zexp, target_z;
};

// One row: online log-sum-exp over blocks (fp32 within a block, fp64 across). The
// entropy sum is taken relative to the maximum (every term <= 0), so that
// H = log(sumexp) - zexp / sumexp has no cancellation.
template <typename T>
inline StatsOut stats_row(const T* __restrict x, int64_t vocab, float inv_t, int64_t local_target, bool entropy) {
  alignas(64) float z[kBlock];
  float m = -std::numeric_limits<float>::infinity();
  double s = 0.0, t = 0.0;
  for (int64_t b = 0; b < vocab; b += kBlock) {
    const int64_t n = std::min(kBlock, vocab - b);
    float bm = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n; ++i) {
      z[i] = Io<T>::load(x, b + i) * inv_t;
      bm = std::max(bm, z[i]);
    }
    if (bm > m) {
      if (s > 0.0) {  // re-express the sums relative to the new maximum
        const double shift = static_cast<double>(m) - static_cast<double>(bm);
        const double scale = std::exp(shift);
        t = scale * (t + shift * s);
        s *= scale;
      }
      m = bm;
    }
    float bs = 0.0f, bt = 0.0f;
    if (entropy) {
      for (int64_t i = 0; i < n; ++i) {
        const float d = z[i] - m;
        const float e = fast_exp(d);
        bs += e;
        bt += e * d;
      }
    } else {
      for (int64_t i = 0; i < n; ++i) bs += fast_exp(z[i] - m);
    }
    s += bs;
    t += bt;
  }
  const float tz = local_target >= 0 ? Io<T>::load(x, local_target) * inv_t : 0.0f;
  return {m, static_cast<float>(s), static_cast<float>(t), tz};
}

template <typename T>
inline void grad_row(const T* __restrict x, T* __restrict g, int64_t vocab, float inv_t, int64_t local_target,
                     float m, float log_s, float g_lp, float g_ent, float h) {
  // d/dz: g_lp * (onehot - p) - g_ent * p * (log p + H); then / temperature.
  const float a = -g_lp * inv_t, c = -g_ent * inv_t;
  for (int64_t i = 0; i < vocab; ++i) {
    const float logp = (Io<T>::load(x, i) * inv_t - m) - log_s;
    const float p = fast_exp(logp);
    Io<T>::store(g, i, p * (a + c * (logp + h)));
  }
  if (local_target >= 0) Io<T>::store(g, local_target, Io<T>::load(g, local_target) + g_lp * inv_t);
}

int64_t local_index(const int64_t* targets, int64_t r, int64_t vocab_start, int64_t vocab) {
  const int64_t t = targets[r];
  return (t >= vocab_start && t < vocab_start + vocab) ? t - vocab_start : -1;
}

template <typename T>
SEQPACK_MULTIVERSION void stats_rows(const LogitsView& v, const int64_t* targets, int64_t vocab_start, float inv_t,
                                     const RowStats& out, int64_t lo, int64_t hi) {
  const auto* base = static_cast<const T*>(v.data);
  for (int64_t r = lo; r < hi; ++r) {
    const StatsOut s = stats_row<T>(base + r * v.row_stride, v.vocab, inv_t,
                                    local_index(targets, r, vocab_start, v.vocab), out.zexp != nullptr);
    out.max[r] = s.max;
    out.sumexp[r] = s.sumexp;
    if (out.zexp) out.zexp[r] = s.zexp;
    out.target_z[r] = s.target_z;
  }
}

template <typename T>
SEQPACK_MULTIVERSION void grad_rows(const LogitsView& v, const int64_t* targets, int64_t vocab_start, float inv_t,
                                    const RowGradInputs& in, void* grad, int64_t grad_stride, int64_t lo, int64_t hi) {
  const auto* base = static_cast<const T*>(v.data);
  auto* gbase = static_cast<T*>(grad);
  for (int64_t r = lo; r < hi; ++r) {
    T* g = gbase + r * grad_stride;
    const int64_t t = local_index(targets, r, vocab_start, v.vocab);
    const float g_lp = targets[r] >= 0 ? in.grad_logprob[r] : 0.0f;
    const float g_ent = in.grad_entropy ? in.grad_entropy[r] : 0.0f;
    if (g_lp == 0.0f && g_ent == 0.0f) {
      for (int64_t i = 0; i < v.vocab; ++i) Io<T>::store(g, i, 0.0f);
      continue;
    }
    grad_row<T>(base + r * v.row_stride, g, v.vocab, inv_t, t, in.max[r], in.log_sumexp[r], g_lp, g_ent,
                in.entropy ? in.entropy[r] : 0.0f);
  }
}

void check_view(const char* fn, const LogitsView& v, const int64_t* targets, float temperature) {
  if (v.rows < 0 || v.vocab <= 0) throw_invalid(fn, "logits must be [rows, vocab] with vocab > 0");
  if (v.row_stride < v.vocab) throw_invalid(fn, "row_stride must be >= vocab");
  if (v.rows > 0 && (v.data == nullptr || targets == nullptr)) throw_invalid(fn, "null buffer");
  if (!(temperature > 0.0f) || !std::isfinite(temperature))
    throw_invalid(fn, "temperature must be a positive finite number");
}

template <typename F>
void over_rows(int64_t rows, int num_threads, F&& body) {
  if (num_threads < 0) throw_invalid("logprob", "num_threads must be >= 0");
  const size_t threads = num_threads > 0 ? static_cast<size_t>(num_threads) : detail::available_threads();
  const auto tasks = static_cast<size_t>(std::max<int64_t>(
      1, std::min<int64_t>(static_cast<int64_t>(threads) * 4, rows / kRowsPerTask)));
  detail::parallel_for(tasks, [&](size_t k) {
    const auto T = static_cast<int64_t>(tasks), i = static_cast<int64_t>(k);
    body(rows / T * i + rows % T * i / T, rows / T * (i + 1) + rows % T * (i + 1) / T);
  });
}

}  // namespace

void row_stats(const LogitsView& logits, const int64_t* targets, int64_t vocab_start, float temperature,
               const RowStats& out, int num_threads) {
  check_view("row_stats", logits, targets, temperature);
  if (logits.rows > 0 && (!out.max || !out.sumexp || !out.target_z)) throw_invalid("row_stats", "null output");
  const float inv_t = 1.0f / temperature;
  over_rows(logits.rows, num_threads, [&](int64_t lo, int64_t hi) {
    switch (logits.dtype) {
      case LogitsDtype::Float32: stats_rows<float>(logits, targets, vocab_start, inv_t, out, lo, hi); break;
      case LogitsDtype::BFloat16: stats_rows<BF16>(logits, targets, vocab_start, inv_t, out, lo, hi); break;
      case LogitsDtype::Float16: stats_rows<F16>(logits, targets, vocab_start, inv_t, out, lo, hi); break;
    }
  });
}

void row_grad(const LogitsView& logits, const int64_t* targets, int64_t vocab_start, float temperature,
              const RowGradInputs& in, void* grad, int64_t grad_row_stride, int num_threads) {
  check_view("row_grad", logits, targets, temperature);
  if (grad_row_stride < logits.vocab) throw_invalid("row_grad", "grad_row_stride must be >= vocab");
  if (logits.rows > 0 && (!grad || !in.max || !in.log_sumexp || !in.grad_logprob))
    throw_invalid("row_grad", "null buffer");
  if (in.grad_entropy && !in.entropy) throw_invalid("row_grad", "grad_entropy needs the entropy");
  const float inv_t = 1.0f / temperature;
  over_rows(logits.rows, num_threads, [&](int64_t lo, int64_t hi) {
    switch (logits.dtype) {
      case LogitsDtype::Float32:
        grad_rows<float>(logits, targets, vocab_start, inv_t, in, grad, grad_row_stride, lo, hi);
        break;
      case LogitsDtype::BFloat16:
        grad_rows<BF16>(logits, targets, vocab_start, inv_t, in, grad, grad_row_stride, lo, hi);
        break;
      case LogitsDtype::Float16:
        grad_rows<F16>(logits, targets, vocab_start, inv_t, in, grad, grad_row_stride, lo, hi);
        break;
    }
  });
}

}  // namespace seqpack
