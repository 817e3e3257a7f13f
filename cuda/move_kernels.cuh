#pragma once
// Kernels of the THD pack/unpack launchers (move.cu). One thread block per task;
// threads stride over the task's vectors, so consecutive threads touch consecutive
// 16-byte words (coalesced). Tasks are capped in size by the host, which balances
// long and short sequences across blocks.
#include <cstdint>

#include "seqpack/move.hpp"

namespace seqpack::cuda::detail {

template <typename V>
__global__ void move_kernel(const char* __restrict__ src, char* __restrict__ dst, const ByteTask* __restrict__ tasks,
                            int64_t num_tasks, const char* __restrict__ fill_row, int64_t row_bytes) {
  const int64_t per_row = row_bytes / static_cast<int64_t>(sizeof(V));
  for (int64_t t = blockIdx.x; t < num_tasks; t += gridDim.x) {
    const ByteTask task = tasks[t];
    const int64_t n = task.bytes / static_cast<int64_t>(sizeof(V));
    V* d = reinterpret_cast<V*>(dst + task.dst_offset);
    if (task.src_offset >= 0) {
      const V* s = reinterpret_cast<const V*>(src + task.src_offset);
      for (int64_t i = threadIdx.x; i < n; i += blockDim.x) d[i] = s[i];
    } else if (fill_row != nullptr) {
      const V* f = reinterpret_cast<const V*>(fill_row);
      for (int64_t i = threadIdx.x; i < n; i += blockDim.x) d[i] = f[i % per_row];
    } else {  // no fill row: zero bytes, as the CPU executor does
      for (int64_t i = threadIdx.x; i < n; i += blockDim.x) d[i] = V{};
    }
  }
}

__global__ void positions_kernel(const PositionRun* __restrict__ runs, int64_t num_runs, int64_t* __restrict__ out) {
  for (int64_t r = blockIdx.x; r < num_runs; r += gridDim.x) {
    const PositionRun run = runs[r];
    for (int64_t i = threadIdx.x; i < run.count; i += blockDim.x) out[run.dst + i] = run.first + i;
  }
}

}  // namespace seqpack::cuda::detail
