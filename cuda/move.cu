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
void launch(const MoveBuffers& buffers, const ByteTask* tasks, int64_t num_tasks, cudaStream_t stream) {
  const auto blocks = static_cast<unsigned>(std::min(num_tasks, kMaxBlocks));
  detail::move_kernel<V><<<blocks, kThreads, 0, stream>>>(buffers, tasks, num_tasks);
}

}  // namespace

void launch_move(const MoveBuffers& b, const ByteTask* tasks, int64_t num_tasks, void* stream) {
  if (num_tasks < 0 || b.row_bytes < 0 || b.src_bytes < 0 || b.dst_bytes < 0)
    throw std::invalid_argument("[seqpack.cuda_move] num_tasks, row_bytes and buffer sizes must be >= 0");
  if (num_tasks == 0 || b.row_bytes == 0) return;
  // An empty source (every task a fill: unpacking zero tokens) may have no address.
  if ((b.src == nullptr && b.src_bytes > 0) || b.dst == nullptr || tasks == nullptr)
    throw std::invalid_argument("[seqpack.cuda_move] src (unless empty), dst and tasks must not be null");
  auto s = static_cast<cudaStream_t>(stream);
  // Task offsets are whole rows, so the widest access that divides row_bytes and
  // every base pointer is safe for all of them.
  auto fits = [&](int64_t w) {
    return b.row_bytes % w == 0 && aligned(b.src, w) && aligned(b.dst, w) &&
           (b.fill_row == nullptr || aligned(b.fill_row, w));
  };
  if (fits(16))
    launch<uint4>(b, tasks, num_tasks, s);
  else if (fits(8))
    launch<uint2>(b, tasks, num_tasks, s);
  else if (fits(4))
    launch<uint32_t>(b, tasks, num_tasks, s);
  else
    launch<uint8_t>(b, tasks, num_tasks, s);
  check(cudaGetLastError(), "move kernel launch");
}

void launch_positions(const PositionRun* runs, int64_t num_runs, int64_t* out, int64_t out_rows, void* stream) {
  if (num_runs < 0 || out_rows < 0)
    throw std::invalid_argument("[seqpack.cuda_positions] num_runs and out_rows must be >= 0");
  if (num_runs == 0) return;
  if (runs == nullptr || out == nullptr)
    throw std::invalid_argument("[seqpack.cuda_positions] runs and out must not be null");
  const auto blocks = static_cast<unsigned>(std::min(num_runs, kMaxBlocks));
  detail::positions_kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(runs, num_runs, out,
                                                                                         out_rows);
  check(cudaGetLastError(), "position ids kernel launch");
}

}  // namespace seqpack::cuda
