#pragma once
// Device launchers for the fused token log-probabilities (see seqpack/logprob.hpp
// for the arithmetic): one thread block per row, fp32 accumulation, vectorised
// loads when rows are 16-byte aligned, the caller's stream, no synchronisation.
// All pointers are device pointers.
#include <cstdint>

#include "seqpack/logprob.hpp"

namespace seqpack::cuda {

void launch_logprob_row_stats(const LogitsView& logits, const int64_t* targets, int64_t vocab_start,
                              float temperature, const RowStats& out, void* stream);

void launch_logprob_row_grad(const LogitsView& logits, const int64_t* targets, int64_t vocab_start,
                             float temperature, const RowGradInputs& in, void* grad, int64_t grad_row_stride,
                             void* stream);

}  // namespace seqpack::cuda
