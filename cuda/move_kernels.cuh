#pragma once
// Kernels of the THD pack/unpack launchers (move.cu). One thread block per task;
// what each thread does is seqpack/move_task.hpp's (shared with the host replay
// of the GoogleTest suite). Tasks are capped in size by the host, which balances
// long and short sequences across blocks.
#include <cstdint>

#include "seqpack/move_task.hpp"

namespace seqpack::cuda::detail {

template <typename V>
__global__ void move_kernel(MoveBuffers buffers, const ByteTask* __restrict__ tasks, int64_t num_tasks) {
  for (int64_t t = blockIdx.x; t < num_tasks; t += gridDim.x)
    run_byte_task<V>(tasks[t], buffers, threadIdx.x, blockDim.x);
}

__global__ void positions_kernel(const PositionRun* __restrict__ runs, int64_t num_runs, int64_t* __restrict__ out,
                                 int64_t out_rows) {
  for (int64_t r = blockIdx.x; r < num_runs; r += gridDim.x)
    run_position_run(runs[r], out, out_rows, threadIdx.x, blockDim.x);
}

}  // namespace seqpack::cuda::detail
