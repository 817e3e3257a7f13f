#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "move_kernels.cuh"
#include "seqpack/cuda_move.hpp"

namespace seqpack::cuda {
namespace {

constexpr int kThreads = 256;
// Enough blocks to fill an H100/H200 several times over; the kernels loop over tasks.
constexpr int64_t kMaxBlocks = 132 * 16;

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string("[seqpack.cuda] ") + what + ": " + cudaGetErrorString(err));
}

bool aligned(const void* p, int64_t bytes) { return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(bytes) == 0; }

template <typename V>
void launch(const void* src, void* dst, const ByteTask* tasks, int64_t num_tasks, const void* fill_row,
            int64_t row_bytes, cudaStream_t stream) {
  const auto blocks = static_cast<unsigned>(std::min(num_tasks, kMaxBlocks));
  detail::move_kernel<V><<<blocks, kThreads, 0, stream>>>(static_cast<const char*>(src), static_cast<char*>(dst),
                                                          tasks, num_tasks, static_cast<const char*>(fill_row),
                                                          row_bytes);
}

}  // namespace

void launch_move(const void* src, void* dst, const ByteTask* tasks, int64_t num_tasks, const void* fill_row,
                 int64_t row_bytes, void* stream) {
  if (num_tasks < 0 || row_bytes < 0)
    throw std::invalid_argument("[seqpack.cuda_move] num_tasks and row_bytes must be >= 0");
  if (num_tasks == 0 || row_bytes == 0) return;
  if (src == nullptr || dst == nullptr || tasks == nullptr)
    throw std::invalid_argument("[seqpack.cuda_move] src, dst and tasks must not be null");
  auto s = static_cast<cudaStream_t>(stream);
  // Task offsets are whole rows, so the widest access that divides row_bytes and
  // every base pointer is safe for all of them.
  auto fits = [&](int64_t w) {
    return row_bytes % w == 0 && aligned(src, w) && aligned(dst, w) && (fill_row == nullptr || aligned(fill_row, w));
  };
  if (fits(16))
    launch<uint4>(src, dst, tasks, num_tasks, fill_row, row_bytes, s);
  else if (fits(8))
    launch<uint2>(src, dst, tasks, num_tasks, fill_row, row_bytes, s);
  else if (fits(4))
    launch<uint32_t>(src, dst, tasks, num_tasks, fill_row, row_bytes, s);
  else
    launch<uint8_t>(src, dst, tasks, num_tasks, fill_row, row_bytes, s);
  check(cudaGetLastError(), "move kernel launch");
}

void launch_positions(const PositionRun* runs, int64_t num_runs, int64_t* out, void* stream) {
  if (num_runs < 0) throw std::invalid_argument("[seqpack.cuda_positions] num_runs must be >= 0");
  if (num_runs == 0) return;
  if (runs == nullptr || out == nullptr)
    throw std::invalid_argument("[seqpack.cuda_positions] runs and out must not be null");
  const auto blocks = static_cast<unsigned>(std::min(num_runs, kMaxBlocks));
  detail::positions_kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(runs, num_runs, out);
  check(cudaGetLastError(), "position ids kernel launch");
}

}  // namespace seqpack::cuda
