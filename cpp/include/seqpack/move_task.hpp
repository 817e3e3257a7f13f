#pragma once
// What one worker of a thread block does for one byte task or position run
// (seqpack/move.hpp): the CUDA kernels call these with lane = threadIdx.x and
// lanes = blockDim.x; execute_byte_tasks replays a whole block on the host.
#include <cstdint>

#include "seqpack/hd.hpp"
#include "seqpack/move.hpp"

namespace seqpack {

// Copies (src_offset >= 0) or fills the task's bytes as `lanes` workers moving V
// at a time; worker `lane` takes elements lane, lane + lanes, ... (consecutive
// lanes touch consecutive words: coalesced on the GPU). A fill repeats the row
// `fill_row` (row_bytes bytes), or writes zero bytes when it is null. Offsets,
// sizes and row_bytes are multiples of sizeof(V) (the launcher picks V so).
template <typename V>
SEQPACK_HD void run_byte_task(const ByteTask& task, const char* src, char* dst, const char* fill_row,
                              int64_t row_bytes, int64_t lane, int64_t lanes) {
  const int64_t n = task.bytes / static_cast<int64_t>(sizeof(V));
  V* d = reinterpret_cast<V*>(dst + task.dst_offset);
  if (task.src_offset >= 0) {
    const V* s = reinterpret_cast<const V*>(src + task.src_offset);
    for (int64_t i = lane; i < n; i += lanes) d[i] = s[i];
  } else if (fill_row != nullptr) {
    const V* f = reinterpret_cast<const V*>(fill_row);
    const int64_t per_row = row_bytes / static_cast<int64_t>(sizeof(V));
    for (int64_t i = lane; i < n; i += lanes) d[i] = f[i % per_row];
  } else {
    for (int64_t i = lane; i < n; i += lanes) d[i] = V{};
  }
}

SEQPACK_HD void run_position_run(const PositionRun& run, int64_t* out, int64_t lane, int64_t lanes) {
  for (int64_t i = lane; i < run.count; i += lanes) out[run.dst + i] = run.first + i;
}

}  // namespace seqpack
