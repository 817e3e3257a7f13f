#pragma once
// What one worker of a thread block does for one byte task or position run
// (seqpack/move.hpp): the CUDA kernels call these with lane = threadIdx.x and
// lanes = blockDim.x; execute_byte_tasks replays a whole block on the host.
#include <cstdint>

#include "seqpack/hd.hpp"
#include "seqpack/move.hpp"

namespace seqpack {

// The buffers a byte task reads and writes, with their sizes: a task that would
// leave them (a corrupt task array in device memory the host cannot check without
// a synchronisation) is skipped, never run out of bounds.
struct MoveBuffers {
  const char* src = nullptr;
  int64_t src_bytes = 0;
  char* dst = nullptr;
  int64_t dst_bytes = 0;
  const char* fill_row = nullptr;  // row_bytes bytes repeated by fills; null: zero bytes
  int64_t row_bytes = 0;
};

SEQPACK_HD bool task_in_bounds(const ByteTask& t, const MoveBuffers& b) {
  if (t.bytes < 0 || t.dst_offset < 0 || t.bytes > b.dst_bytes || t.dst_offset > b.dst_bytes - t.bytes) return false;
  return t.src_offset < 0 || (t.bytes <= b.src_bytes && t.src_offset <= b.src_bytes - t.bytes);
}

// Copies (src_offset >= 0) or fills the task's bytes as `lanes` workers moving V
// at a time; worker `lane` takes elements lane, lane + lanes, ... (consecutive
// lanes touch consecutive words: coalesced on the GPU). A fill repeats the row
// `fill_row` (row_bytes bytes), or writes zero bytes when it is null. Offsets,
// sizes and row_bytes are multiples of sizeof(V) (the launcher picks V so).
template <typename V>
SEQPACK_HD void run_byte_task(const ByteTask& task, const MoveBuffers& b, int64_t lane, int64_t lanes) {
  if (!task_in_bounds(task, b)) return;
  const int64_t n = task.bytes / static_cast<int64_t>(sizeof(V));
  V* d = reinterpret_cast<V*>(b.dst + task.dst_offset);
  if (task.src_offset >= 0) {
    const V* s = reinterpret_cast<const V*>(b.src + task.src_offset);
    for (int64_t i = lane; i < n; i += lanes) d[i] = s[i];
  } else if (b.fill_row != nullptr) {
    const V* f = reinterpret_cast<const V*>(b.fill_row);
    const int64_t per_row = b.row_bytes / static_cast<int64_t>(sizeof(V));
    for (int64_t i = lane; i < n; i += lanes) d[i] = f[i % per_row];
  } else {
    for (int64_t i = lane; i < n; i += lanes) d[i] = V{};
  }
}

// Positions first, first + 1, ... into out[dst, dst + count); a run that leaves
// `out` (out_rows values) is skipped.
SEQPACK_HD bool run_in_bounds(const PositionRun& run, int64_t out_rows) {
  return run.dst >= 0 && run.count >= 0 && run.count <= out_rows && run.dst <= out_rows - run.count;
}

SEQPACK_HD void run_position_run(const PositionRun& run, int64_t* out, int64_t out_rows, int64_t lane,
                                        int64_t lanes) {
  if (!run_in_bounds(run, out_rows)) return;
  for (int64_t i = lane; i < run.count; i += lanes) out[run.dst + i] = run.first + i;
}

}  // namespace seqpack
