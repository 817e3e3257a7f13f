#include "seqpack/move.hpp"
#include "seqpack/move_task.hpp"

#include "thread_pool.hpp"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

namespace seqpack {
namespace {

// Each thread gets at least this many bytes: waking a pooled worker costs a few
// microseconds, about what copying this much takes.
constexpr size_t kBytesPerThread = size_t{256} << 10;

void fill_rows(char* dst, int64_t rows, size_t row_bytes, const char* fill_row, bool zero) {
  const size_t bytes = static_cast<size_t>(rows) * row_bytes;
  if (bytes == 0) return;
  if (zero) {
    std::memset(dst, 0, bytes);
    return;
  }
  std::memcpy(dst, fill_row, row_bytes);
  for (size_t done = row_bytes; done < bytes;) {  // double the filled prefix
    const size_t step = std::min(done, bytes - done);
    std::memcpy(dst + done, dst, step);
    done += step;
  }
}

// Rows [begin, begin + count) lie in [0, rows), written so that nothing overflows
// (a corrupt plan may hold any int64).
bool rows_in_bounds(int64_t begin, int64_t count, int64_t rows) {
  return begin >= 0 && count >= 0 && begin <= rows && count <= rows - begin;
}
bool copy_in_bounds(const CopyRun& r, const MovePlan& plan) {
  return rows_in_bounds(r.src, r.count, plan.src_rows) && rows_in_bounds(r.dst, r.count, plan.dst_rows);
}

}  // namespace

void check_move_plan(const MovePlan& plan, const char* fn) {
  if (plan.src_rows < 0 || plan.dst_rows < 0)
    throw_invalid(fn, "the plan's row counts must be >= 0 (corrupt plan)");
  int64_t work = 0;  // rows moved in all: the executor splits this sum over threads
  for (const CopyRun& r : plan.copies) {
    if (!copy_in_bounds(r, plan)) throw_invalid(fn, "a copy run leaves the buffers (corrupt plan)");
    work = checked_add(fn, "the rows the plan moves", work, r.count);
  }
  for (const FillRun& r : plan.fills) {
    if (!rows_in_bounds(r.dst, r.count, plan.dst_rows))
      throw_invalid(fn, "a fill run leaves the destination (corrupt plan)");
    work = checked_add(fn, "the rows the plan moves", work, r.count);
  }
  for (const PositionRun& r : plan.positions) {
    if (!run_in_bounds(r, plan.dst_rows)) throw_invalid(fn, "a position run leaves the destination (corrupt plan)");
    if (r.first < 0 || r.first > INT64_MAX - r.count)  // positions first .. first + count - 1
      throw_invalid(fn, "a position run's positions (first + count) overflow int64 or are negative (corrupt plan)");
  }
}

void execute_move_plan(const MovePlan& plan, const void* src, int64_t src_rows, void* dst, int64_t dst_rows,
                       size_t row_bytes, const void* fill_row, int num_threads) {
  constexpr const char* fn = "execute_move_plan";
  if (src_rows < plan.src_rows)
    throw_invalid(fn, "the source has " + std::to_string(src_rows) + " rows, the plan reads " +
                          std::to_string(plan.src_rows));
  if (dst_rows != plan.dst_rows)
    throw_invalid(fn, "the destination has " + std::to_string(dst_rows) + " rows, the plan writes " +
                          std::to_string(plan.dst_rows));
  if (num_threads < 0) throw_invalid(fn, "num_threads must be >= 0");
  check_move_plan(plan, fn);
  if (row_bytes == 0) return;
  if ((src == nullptr && !plan.copies.empty()) || (dst == nullptr && plan.dst_rows > 0))
    throw_invalid(fn, "null buffer");

  bool zero = fill_row == nullptr;
  if (!zero) {
    const auto* f = static_cast<const char*>(fill_row);
    zero = std::all_of(f, f + row_bytes, [](char c) { return c == 0; });
  }
  const auto* s = static_cast<const char*>(src);
  auto* d = static_cast<char*>(dst);
  const auto* fill = static_cast<const char*>(fill_row);

  // Work = the copies' rows then the fills' rows; thread t takes rows
  // [t * total / T, (t + 1) * total / T) of that sequence, splitting runs.
  const size_t num_copies = plan.copies.size();
  std::vector<int64_t> start(num_copies + plan.fills.size() + 1, 0);
  for (size_t i = 0; i < num_copies; ++i) start[i + 1] = start[i] + plan.copies[i].count;
  for (size_t i = 0; i < plan.fills.size(); ++i)
    start[num_copies + i + 1] = start[num_copies + i] + plan.fills[i].count;
  const int64_t total = start.back();
  auto run_range = [&](int64_t lo, int64_t hi) {
    if (lo >= hi) return;
    size_t i = static_cast<size_t>(std::upper_bound(start.begin(), start.end(), lo) - start.begin()) - 1;
    for (; i + 1 < start.size() && start[i] < hi; ++i) {
      const int64_t a = std::max(lo, start[i]) - start[i], b = std::min(hi, start[i + 1]) - start[i];
      if (a >= b) continue;
      if (i < num_copies) {
        const CopyRun& r = plan.copies[i];
        std::memcpy(d + static_cast<size_t>(r.dst + a) * row_bytes, s + static_cast<size_t>(r.src + a) * row_bytes,
                    static_cast<size_t>(b - a) * row_bytes);
      } else {
        const FillRun& r = plan.fills[i - num_copies];
        fill_rows(d + static_cast<size_t>(r.dst + a) * row_bytes, b - a, row_bytes, fill, zero);
      }
    }
  };
  const size_t bytes = static_cast<size_t>(total) * row_bytes;
  size_t threads = num_threads > 0 ? static_cast<size_t>(num_threads) : detail::available_threads();
  threads = std::max<size_t>(1, std::min({threads, bytes / kBytesPerThread, static_cast<size_t>(total)}));
  const auto T = static_cast<int64_t>(threads);
  auto bound = [&](size_t t) {  // floor(total * t / T) without overflow
    const auto k = static_cast<int64_t>(t);
    return total / T * k + total % T * k / T;
  };
  detail::parallel_for(threads, [&](size_t t) { run_range(bound(t), bound(t + 1)); });
}

std::vector<ByteTask> make_byte_tasks(const MovePlan& plan, size_t row_bytes, size_t max_task_bytes) {
  constexpr const char* fn = "make_byte_tasks";
  if (row_bytes == 0) return {};
  int64_t bytes = 0;  // byte offsets of both buffers must fit in int64
  if (plan.src_rows < 0 || plan.dst_rows < 0 || row_bytes > static_cast<size_t>(INT64_MAX) ||
      __builtin_mul_overflow(std::max(plan.src_rows, plan.dst_rows), static_cast<int64_t>(row_bytes), &bytes))
    throw_invalid(fn, "the plan's rows (" + std::to_string(plan.src_rows) + " read, " + std::to_string(plan.dst_rows) +
                          " written) times row_bytes (" + std::to_string(row_bytes) + ") must fit in int64 bytes");
  const auto rows_per_task = static_cast<int64_t>(std::max<size_t>(1, max_task_bytes / row_bytes));
  const auto rb = static_cast<int64_t>(row_bytes);
  std::vector<ByteTask> tasks;
  auto split = [&](int64_t src_row, int64_t dst_row, int64_t count) {
    for (int64_t k = 0; k < count; k += rows_per_task) {
      const int64_t n = std::min(rows_per_task, count - k);
      tasks.push_back({src_row < 0 ? -1 : (src_row + k) * rb, (dst_row + k) * rb, n * rb});
    }
  };
  check_move_plan(plan, fn);
  for (const CopyRun& r : plan.copies) split(r.src, r.dst, r.count);
  for (const FillRun& r : plan.fills) split(-1, r.dst, r.count);
  return tasks;
}

namespace {
struct alignas(16) Word16 {
  uint32_t w[4];
};

template <typename V>
void replay_block(const std::vector<ByteTask>& tasks, const MoveBuffers& buffers, int64_t lanes) {
  for (const ByteTask& t : tasks)
    for (int64_t lane = 0; lane < lanes; ++lane) run_byte_task<V>(t, buffers, lane, lanes);
}
}  // namespace

void execute_byte_tasks(const std::vector<ByteTask>& tasks, const MoveBuffers& buffers, int width, int64_t lanes) {
  constexpr const char* fn = "execute_byte_tasks";
  if (lanes <= 0) throw_invalid(fn, "lanes must be positive");
  if (width != 1 && width != 4 && width != 8 && width != 16) throw_invalid(fn, "width must be 1, 4, 8 or 16");
  if (buffers.row_bytes % width != 0) throw_invalid(fn, "row_bytes must be a multiple of width");
  switch (width) {
    case 16: replay_block<Word16>(tasks, buffers, lanes); break;
    case 8: replay_block<uint64_t>(tasks, buffers, lanes); break;
    case 4: replay_block<uint32_t>(tasks, buffers, lanes); break;
    default: replay_block<uint8_t>(tasks, buffers, lanes); break;
  }
}

void write_position_ids(const MovePlan& plan, int64_t* out, int64_t out_rows) {
  constexpr const char* fn = "write_position_ids";
  if (out_rows != plan.dst_rows)
    throw_invalid(fn, "the output has " + std::to_string(out_rows) + " rows, the plan writes " +
                          std::to_string(plan.dst_rows));
  for (const PositionRun& r : plan.positions) {
    if (!run_in_bounds(r, out_rows)) throw_invalid(fn, "a position run leaves the output");
    run_position_run(r, out, out_rows, 0, 1);
  }
}

}  // namespace seqpack
