#pragma once
// Token log-probabilities straight from logits, one pass per direction, no
// [rows, vocab] intermediate.
//
// Forward (row_stats): for each row r of logits (or of a vocabulary slice of
// them, for tensor-parallel vocabularies), with z = x / temperature:
//   max[r] = max z,  sumexp[r] = sum exp(z - max),  zexp[r] = sum exp(z - max) * (z - max),
//   target_z[r] = z[target[r] - vocab_start] when that target falls in this slice.
// Slices combine exactly (log-sum-exp of the pieces, zexp shifted to the common
// maximum M: sum_k e^(m_k - M) (zexp_k + (m_k - M) sumexp_k)), then
//   logprob = target_z - lse,  entropy = log(sumexp) - zexp / sumexp  (both at M).
//
// Backward (row_grad): d/dx of  g_lp * logprob + g_ent * entropy  for one row:
//   (g_lp * (onehot(target) - p) - g_ent * p * (log p + H)) / temperature,
// recomputing p = exp((z - max) - log_sumexp) from the saved row statistics (the
// softmax is never stored).
// Rows whose target is negative and whose entropy gradient is 0 get zeros (unless
// extra targets of the row have a gradient).
//
// The element arithmetic (accumulator, merge, gradient, -inf / NaN rules, fp16 /
// bf16 conversions) is seqpack/logprob_math.hpp's, shared with the CUDA kernels.
// Accumulation is fp32 within blocks of the row and fp64 across blocks, for
// fp32, bf16 and fp16 logits alike; rows are spread over threads.
// A target id is global; a negative one means "no target" (log-prob 0, no gradient
// from it); callers check ids against the full vocabulary.
#include <cstddef>
#include <cstdint>

namespace seqpack {

enum class LogitsDtype { Float32, BFloat16, Float16 };

struct LogitsView {
  const void* data = nullptr;  // row r starts at data + r * row_stride elements
  int64_t rows = 0;
  int64_t vocab = 0;           // columns in this slice
  int64_t row_stride = 0;      // in elements
  LogitsDtype dtype = LogitsDtype::Float32;
};

struct RowStats {
  float* max = nullptr;       // [rows]
  float* sumexp = nullptr;    // [rows]
  float* zexp = nullptr;      // [rows], may be null (no entropy); relative to max
  float* target_z = nullptr;  // [rows], 0 where the target is not in the slice
};

// targets[r]: a vocabulary index (global), or < 0 for rows without a target.
// vocab_start: the global index of this slice's first column.
void row_stats(const LogitsView& logits, const int64_t* targets, int64_t vocab_start, float temperature,
               const RowStats& out, int num_threads = 0);

struct RowGradInputs {
  // The global log-sum-exp of z as max + log_sumexp (kept apart: at large logits
  // their sum would lose the low bits that z - max keeps).
  const float* max = nullptr;          // [rows]
  const float* log_sumexp = nullptr;   // [rows], log(sum exp(z - max))
  const float* entropy = nullptr;   // [rows], may be null when grad_entropy is null
  const float* grad_logprob = nullptr;  // [rows]
  const float* grad_entropy = nullptr;  // [rows] or null
  // Extra targets (several columns read from one log-sum-exp; all three null for
  // none): row r's are extra_ids[extra_offsets[r] .. extra_offsets[r + 1]) (global
  // ids, < 0 skipped, repeats allowed), each with its upstream gradient extra_grad[e];
  // they add sum_e g_e (onehot(col_e) - p) / tau to the row (logprob_math.hpp).
  const int64_t* extra_offsets = nullptr;  // [rows + 1], absolute positions into the two below
  const int64_t* extra_ids = nullptr;
  const float* extra_grad = nullptr;
};

// Writes d loss / d logits for the slice into grad (same dtype as the logits,
// grad_row_stride elements between rows).
void row_grad(const LogitsView& logits, const int64_t* targets, int64_t vocab_start, float temperature,
              const RowGradInputs& in, void* grad, int64_t grad_row_stride, int num_threads = 0);

// The argument checks of row_stats / row_grad, shared with the CUDA launchers
// (throw std::invalid_argument "[fn] ..."): shapes, strides, null buffers, a
// positive finite temperature, an entropy gradient only with the entropy.
void check_row_stats_args(const char* fn, const LogitsView& logits, const int64_t* targets, float temperature,
                          const RowStats& out);
void check_row_grad_args(const char* fn, const LogitsView& logits, const int64_t* targets, float temperature,
                         const RowGradInputs& in, const void* grad, int64_t grad_row_stride);

// The CPU build the kernels run ("avx512", "avx2" or "baseline"): the best the
// processor supports, capped by the environment variable SEQPACK_CPU_ISA.
const char* logprob_cpu_isa();

}  // namespace seqpack
