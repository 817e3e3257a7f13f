#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "seqpack/cuda_logprob.hpp"
#include "seqpack/logprob_math.hpp"

namespace seqpack::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 132 * 32;  // rows loop inside the kernel beyond this

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("[seqpack.cuda] ") + what + ": " + cudaGetErrorString(err));
}

using lpmath::BF16;
using lpmath::F16;
using Acc = lpmath::Lse<float>;

__device__ __forceinline__ Acc shfl_down(const Acc& a, int off) {
  return {__shfl_down_sync(0xffffffffu, a.m, off), __shfl_down_sync(0xffffffffu, a.s, off),
          __shfl_down_sync(0xffffffffu, a.t, off)};
}

// Every lane's accumulator merged into thread 0's (lpmath::lse_merge: empty lanes,
// -inf and NaN follow logprob_math.hpp's rules).
__device__ Acc block_reduce(Acc a) {
  __shared__ Acc warp_acc[kThreads / 32];
  for (int off = 16; off > 0; off >>= 1) a = lpmath::lse_merge(a, shfl_down(a, off));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_acc[warp] = a;
  __syncthreads();
  if (warp == 0) {
    a = lane < kThreads / 32 ? warp_acc[lane] : lpmath::lse_empty<float>();
    for (int off = 16; off > 0; off >>= 1) a = lpmath::lse_merge(a, shfl_down(a, off));
  }
  return a;  // valid in thread 0
}

template <typename T, int V>
using Pack = lpmath::Pack<T, V>;

template <typename T, int V>
__global__ void stats_kernel(const T* __restrict__ logits, int64_t rows, int64_t vocab, int64_t stride,
                             const int64_t* __restrict__ targets, int64_t vocab_start, float tau, float* max_out,
                             float* sumexp_out, float* zexp_out, float* target_out) {
  const bool entropy = zexp_out != nullptr;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* x = logits + r * stride;
    Acc a = lpmath::lane_stats<V>(x, vocab, tau, threadIdx.x, blockDim.x, entropy);
    a = block_reduce(a);
    if (threadIdx.x == 0) {
      max_out[r] = a.m;
      sumexp_out[r] = a.s;
      if (entropy) zexp_out[r] = a.t;
      const int64_t t = lpmath::local_target(targets[r], vocab_start, vocab);
      target_out[r] = t >= 0 ? lpmath::to_float(x[t]) / tau : 0.0f;
    }
    __syncthreads();  // warp_acc is reused by the next row
  }
}

template <typename T, int V>
__global__ void grad_kernel(const T* __restrict__ logits, int64_t rows, int64_t vocab, int64_t stride,
                            const int64_t* __restrict__ targets, int64_t vocab_start, float tau, RowGradInputs in,
                            T* __restrict__ grad, int64_t grad_stride) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* x = logits + r * stride;
    T* g = grad + r * grad_stride;
    const bool has = targets[r] >= 0;
    const float g_lp = has ? in.grad_logprob[r] : 0.0f;
    const float g_ent = in.grad_entropy ? in.grad_entropy[r] : 0.0f;
    const int64_t local = lpmath::local_target(targets[r], vocab_start, vocab);
    const int64_t e_lo = in.extra_offsets ? in.extra_offsets[r] : 0;
    const int64_t e_hi = in.extra_offsets ? in.extra_offsets[r + 1] : 0;
    const lpmath::ExtraSums extra = lpmath::extra_sums(in.extra_ids, in.extra_grad, e_lo, e_hi);
    const lpmath::GradRowParams prm = lpmath::grad_row_params(
        in.max[r], in.log_sumexp[r], in.entropy ? in.entropy[r] : 0.0f, g_lp, g_ent, tau, local, extra.sum, extra.any);
    const int64_t packs = vocab / V;
    const auto* xv = reinterpret_cast<const Pack<T, V>*>(x);
    auto* gv = reinterpret_cast<Pack<T, V>*>(g);
    for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
      const Pack<T, V> p = xv[i];
      Pack<T, V> out;
#pragma unroll
      for (int k = 0; k < V; ++k) out.v[k] = lpmath::grad_element(prm, p.v[k], i * V + k);
      gv[i] = out;
    }
    for (int64_t col = packs * V + threadIdx.x; col < vocab; col += blockDim.x) g[col] = lpmath::grad_element(prm, x[col], col);
    if (in.extra_offsets) {  // the same for every thread of the block: the barriers are uniform
      __syncthreads();  // the row is written: rewrite the extra targets' columns
      for (int64_t e = e_lo + threadIdx.x; e < e_hi; e += blockDim.x) {
        const int64_t col = lpmath::local_target(in.extra_ids[e], vocab_start, vocab);
        if (col < 0) continue;
        g[col] = lpmath::from_float<T>(lpmath::extra_column_value(prm, lpmath::to_float(x[col]) / tau, col,
                                                                  in.extra_ids, in.extra_grad, e_lo, e_hi,
                                                                  vocab_start, vocab));
      }
      __syncthreads();
    }
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <typename T>
void stats_typed(const LogitsView& v, const int64_t* targets, int64_t vocab_start, float tau, const RowStats& o,
                 cudaStream_t s) {
  constexpr int V = 16 / sizeof(T);
  const auto blocks = static_cast<unsigned>(std::min(v.rows, kMaxBlocks));
  const auto* x = static_cast<const T*>(v.data);
  if (aligned16(x) && v.row_stride % V == 0)
    stats_kernel<T, V><<<blocks, kThreads, 0, s>>>(x, v.rows, v.vocab, v.row_stride, targets, vocab_start, tau,
                                                   o.max, o.sumexp, o.zexp, o.target_z);
  else
    stats_kernel<T, 1><<<blocks, kThreads, 0, s>>>(x, v.rows, v.vocab, v.row_stride, targets, vocab_start, tau,
                                                   o.max, o.sumexp, o.zexp, o.target_z);
}

template <typename T>
void grad_typed(const LogitsView& v, const int64_t* targets, int64_t vocab_start, float tau, const RowGradInputs& in,
                void* grad, int64_t grad_stride, cudaStream_t s) {
  constexpr int V = 16 / sizeof(T);
  const auto blocks = static_cast<unsigned>(std::min(v.rows, kMaxBlocks));
  const auto* x = static_cast<const T*>(v.data);
  auto* g = static_cast<T*>(grad);
  if (aligned16(x) && aligned16(g) && v.row_stride % V == 0 && grad_stride % V == 0)
    grad_kernel<T, V><<<blocks, kThreads, 0, s>>>(x, v.rows, v.vocab, v.row_stride, targets, vocab_start, tau, in, g,
                                                  grad_stride);
  else
    grad_kernel<T, 1><<<blocks, kThreads, 0, s>>>(x, v.rows, v.vocab, v.row_stride, targets, vocab_start, tau, in, g,
                                                  grad_stride);
}

}  // namespace

void launch_logprob_row_stats(const LogitsView& v, const int64_t* targets, int64_t vocab_start, float temperature,
                              const RowStats& out, void* stream) {
  check_row_stats_args("cuda_logprob_row_stats", v, targets, temperature, out);
  if (v.rows == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  switch (v.dtype) {
    case LogitsDtype::Float32: stats_typed<float>(v, targets, vocab_start, temperature, out, s); break;
    case LogitsDtype::BFloat16: stats_typed<BF16>(v, targets, vocab_start, temperature, out, s); break;
    case LogitsDtype::Float16: stats_typed<F16>(v, targets, vocab_start, temperature, out, s); break;
  }
  check(cudaGetLastError(), "logprob stats kernel launch");
}

void launch_logprob_row_grad(const LogitsView& v, const int64_t* targets, int64_t vocab_start, float temperature,
                             const RowGradInputs& in, void* grad, int64_t grad_row_stride, void* stream) {
  check_row_grad_args("cuda_logprob_row_grad", v, targets, temperature, in, grad, grad_row_stride);
  if (v.rows == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  switch (v.dtype) {
    case LogitsDtype::Float32: grad_typed<float>(v, targets, vocab_start, temperature, in, grad, grad_row_stride, s); break;
    case LogitsDtype::BFloat16:
      grad_typed<BF16>(v, targets, vocab_start, temperature, in, grad, grad_row_stride, s);
      break;
    case LogitsDtype::Float16: grad_typed<F16>(v, targets, vocab_start, temperature, in, grad, grad_row_stride, s); break;
  }
  check(cudaGetLastError(), "logprob grad kernel launch");
}

}  // namespace seqpack::cuda
