// Plans that did not come from the planner (a corrupt or hostile MovePlan, as the
// CUDA path would receive run arrays): make_byte_tasks and execute_move_plan refuse
// runs that leave the buffers, or stay inside them (AddressSanitizer watches), and
// byte tasks that leave the buffers are skipped by the device code.
#include "fuzz.hpp"
#include "seqpack/move.hpp"
#include "seqpack/move_task.hpp"

using namespace seqpack;
using namespace seqpack_fuzz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Input in(data, size);
  MovePlan plan;
  plan.src_rows = in.flag() ? in.in_range(0, 32) : in.edgy(32);
  plan.dst_rows = in.flag() ? in.in_range(0, 32) : in.edgy(32);
  const auto row_bytes = static_cast<size_t>(in.flag() ? in.in_range(0, 8) : in.edgy(8));
  const auto max_task_bytes = static_cast<size_t>(in.in_range(0, 64));
  for (auto n = in.in_range(0, 6); n > 0; --n) plan.copies.push_back({in.edgy(32), in.edgy(32), in.edgy(8)});
  for (auto n = in.in_range(0, 6); n > 0; --n) plan.fills.push_back({in.edgy(32), in.edgy(8)});
  // Raw tasks, as a corrupt device array could hold.
  std::vector<ByteTask> raw(static_cast<size_t>(in.in_range(0, 4)));
  for (auto& t : raw) t = {in.flag() ? -1 : in.edgy(256), in.edgy(256), in.edgy(64)};  // src_offset < 0: a fill
  const int64_t lanes = in.in_range(1, 4);

  std::vector<char> src(256, 'a'), dst(256, 'b'), fill(8, 'f');
  MoveBuffers buffers{src.data(), static_cast<int64_t>(src.size()), dst.data(), static_cast<int64_t>(dst.size()),
                      fill.data(), 1};
  execute_byte_tasks(raw, buffers, 1, lanes);  // out-of-bounds tasks are skipped, never run
  // A plan of a few huge runs makes (legitimately) billions of small tasks: skip those.
  __int128 expected_tasks = 0;
  const auto rows_per_task = static_cast<int64_t>(row_bytes == 0 ? 1 : std::max<size_t>(1, max_task_bytes / row_bytes));
  for (const auto& r : plan.copies) expected_tasks += static_cast<__int128>(std::max<int64_t>(r.count, 0) / rows_per_task) + 1;
  for (const auto& r : plan.fills) expected_tasks += static_cast<__int128>(std::max<int64_t>(r.count, 0) / rows_per_task) + 1;
  if (expected_tasks > (1 << 16)) return 0;
  return run([&] {
    const auto tasks = make_byte_tasks(plan, row_bytes, max_task_bytes);
    const auto rb = static_cast<int64_t>(row_bytes);
    for (const ByteTask& t : tasks) {
      FUZZ_REQUIRE(t.bytes > 0 && t.bytes % rb == 0 && t.dst_offset % rb == 0);
      FUZZ_REQUIRE(t.dst_offset >= 0 && t.dst_offset + static_cast<__int128>(t.bytes) <= static_cast<__int128>(plan.dst_rows) * rb);
      if (t.src_offset >= 0)
        FUZZ_REQUIRE(t.src_offset + static_cast<__int128>(t.bytes) <= static_cast<__int128>(plan.src_rows) * rb);
    }
    if (row_bytes > 0 && row_bytes <= 8 && plan.src_rows >= 0 && plan.dst_rows >= 0 && plan.src_rows <= 32 &&
        plan.dst_rows <= 32) {
      std::vector<char> s(static_cast<size_t>(plan.src_rows) * row_bytes, 's');
      std::vector<char> d(static_cast<size_t>(plan.dst_rows) * row_bytes, 'd');
      execute_move_plan(plan, s.data(), plan.src_rows, d.data(), plan.dst_rows, row_bytes, fill.data(), 1);
    }
  });
}
