#pragma once
// Device launchers for THD pack/unpack. They take raw device pointers and plain
// structs from the core's plans (seqpack/move.hpp), launch on the caller's stream
// and return without synchronising. Nothing here knows about Python or torch.
#include <cstdint>

#include "seqpack/move.hpp"
#include "seqpack/move_task.hpp"

namespace seqpack::cuda {

// Runs `num_tasks` byte tasks (an array in device memory, see make_byte_tasks):
// copies from buffers.src to buffers.dst, fills from buffers.fill_row (row_bytes
// bytes in device memory, repeated; null: zero bytes, as on the CPU). A task that
// leaves src_bytes / dst_bytes is skipped. Uses 16-, 8- or 4-byte accesses when the
// pointers and row_bytes allow, bytes otherwise. `stream` is a cudaStream_t (null:
// the legacy default stream). Throws std::runtime_error naming the CUDA error on failure.
void launch_move(const MoveBuffers& buffers, const ByteTask* tasks, int64_t num_tasks, void* stream);

// Position ids for the runs (dst, count, first) in device memory into out[0, out_rows)
// (int64); a run that leaves it is skipped.
void launch_positions(const PositionRun* runs, int64_t num_runs, int64_t* out, int64_t out_rows, void* stream);

}  // namespace seqpack::cuda
