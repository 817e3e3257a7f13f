#pragma once
// CPU execution of MovePlans over raw row-major buffers (any dtype: rows are bytes).
#include <cstddef>
#include <cstdint>
#include <vector>

#include "seqpack/thd.hpp"

namespace seqpack {

// Throws std::invalid_argument("[fn] ...") unless every run of `plan` lies inside
// its src_rows / dst_rows and the rows it moves add up within int64: what a plan
// from elsewhere (a pickle, a caller's run arrays) must satisfy before it runs.
void check_move_plan(const MovePlan& plan, const char* fn);

// Runs `plan` from `src` (plan.src_rows rows of row_bytes) into `dst`
// (plan.dst_rows rows): copies, then fills with `fill_row` (row_bytes bytes; null
// means zero bytes). src_rows / dst_rows are the buffers' real sizes, checked
// against the plan. Large moves are split over up to `num_threads` threads
// (0: one per hardware thread, fewer for small moves).
void execute_move_plan(const MovePlan& plan, const void* src, int64_t src_rows, void* dst, int64_t dst_rows,
                       size_t row_bytes, const void* fill_row = nullptr, int num_threads = 0);

// A plan flattened into byte tasks of at most `max_task_bytes` (rounded to whole
// rows), for a device kernel that gives each task to one thread block: copy
// `bytes` from src + src_offset to dst + dst_offset, or, when src_offset < 0, fill
// them with the fill row repeated (tasks start on row boundaries).
struct ByteTask {
  int64_t src_offset = 0;
  int64_t dst_offset = 0;
  int64_t bytes = 0;
};
std::vector<ByteTask> make_byte_tasks(const MovePlan& plan, size_t row_bytes, size_t max_task_bytes);

// Runs byte tasks on the CPU as a CUDA block of `lanes` threads moving `width`
// bytes (1, 4, 8 or 16) at a time would: the device kernel's code
// (seqpack/move_task.hpp), for tests. A null fill_row fills zero bytes.
struct MoveBuffers;  // seqpack/move_task.hpp
void execute_byte_tasks(const std::vector<ByteTask>& tasks, const MoveBuffers& buffers, int width = 1,
                        int64_t lanes = 1);

// Writes the position ids of a pack plan into `out` (plan.dst_rows values).
void write_position_ids(const MovePlan& plan, int64_t* out, int64_t out_rows);

}  // namespace seqpack
