#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include "seqpack/move.hpp"
#include "seqpack/move_task.hpp"
#include "test_helpers.hpp"

namespace {

using namespace seqpack;
using seqpack_test::ThrowsInvalid;

TEST(Move, RowsOfAnyWidthWithAPatternFill) {
  // 3-byte rows (an odd element size): copy rows 1..2 to 0..1, fill rows 2..4.
  MovePlan plan;
  plan.src_rows = 3;
  plan.dst_rows = 5;
  plan.copies = {{1, 0, 2}};
  plan.fills = {{2, 3}};
  const std::vector<char> src = {'a', 'b', 'c', 'd', 'e', 'f', 'g', 'h', 'i'};
  std::vector<char> dst(15, '?');
  const char fill[3] = {'x', 'y', 'z'};
  execute_move_plan(plan, src.data(), 3, dst.data(), 5, 3, fill);
  EXPECT_EQ(std::string(dst.begin(), dst.end()), "defghixyzxyzxyz");
  execute_move_plan(plan, src.data(), 3, dst.data(), 5, 3, nullptr);
  EXPECT_EQ(std::memcmp(dst.data() + 6, std::vector<char>(9, 0).data(), 9), 0);
}

TEST(Move, ThreadsSplitRunsExactly) {
  // 64 MiB of rows over several runs and threads: same bytes as one thread.
  const int64_t rows = 1 << 20;
  const size_t row_bytes = 64;
  std::vector<uint8_t> src(static_cast<size_t>(rows) * row_bytes);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 2654435761u >> 24);
  MovePlan plan;
  plan.src_rows = rows;
  plan.dst_rows = rows + 1000;
  plan.copies = {{rows / 2, 0, rows / 2}, {0, rows / 2 + 1000, rows / 2}};
  plan.fills = {{rows / 2, 1000}};
  const std::vector<uint8_t> fill(row_bytes, 7);
  std::vector<uint8_t> one(static_cast<size_t>(plan.dst_rows) * row_bytes), many(one.size());
  execute_move_plan(plan, src.data(), rows, one.data(), plan.dst_rows, row_bytes, fill.data(), 1);
  execute_move_plan(plan, src.data(), rows, many.data(), plan.dst_rows, row_bytes, fill.data(), 5);
  EXPECT_EQ(one, many);
  EXPECT_EQ(std::memcmp(one.data(), src.data() + src.size() / 2, src.size() / 2), 0);
  EXPECT_EQ(one[static_cast<size_t>(rows / 2) * row_bytes], 7);
}

TEST(Move, PlansAreCheckedAgainstTheBuffers) {
  MovePlan plan;
  plan.src_rows = 4;
  plan.dst_rows = 4;
  plan.copies = {{0, 0, 4}};
  std::vector<int32_t> a(4), b(4);
  EXPECT_TRUE(ThrowsInvalid([&] { execute_move_plan(plan, a.data(), 3, b.data(), 4, 4); }, {"source", "3"}));
  EXPECT_TRUE(ThrowsInvalid([&] { execute_move_plan(plan, a.data(), 4, b.data(), 5, 4); }, {"destination", "5"}));
  plan.copies = {{2, 0, 4}};
  EXPECT_TRUE(ThrowsInvalid([&] { execute_move_plan(plan, a.data(), 4, b.data(), 4, 4); }, {"corrupt"}));
  std::vector<int64_t> pos(3);
  EXPECT_TRUE(ThrowsInvalid([&] { write_position_ids(plan, pos.data(), 3); }, {"output"}));
}

// What a pickled plan must pass before it is adopted: every run inside the rows,
// position runs included, and a total of moved rows within int64.
TEST(Move, CheckMovePlanRefusesCorruptRunsAndOverflowingWork) {
  MovePlan plan;
  plan.src_rows = 4;
  plan.dst_rows = 4;
  plan.copies = {{0, 0, 2}};
  plan.fills = {{2, 2}};
  plan.positions = {{0, 4, 0}};
  EXPECT_NO_THROW(check_move_plan(plan, "t"));
  plan.positions = {{1, 4, 0}};
  EXPECT_TRUE(ThrowsInvalid([&] { check_move_plan(plan, "t"); }, {"[seqpack.t]", "position run", "corrupt"}));
  // Issue 26: positions first + i wrapped around int64 (undefined behaviour).
  plan.positions = {{0, 4, INT64_MAX - 1}};
  EXPECT_TRUE(ThrowsInvalid([&] { check_move_plan(plan, "t"); }, {"positions (first + count) overflow int64"}));
  plan.positions = {{0, 4, -1}};
  EXPECT_TRUE(ThrowsInvalid([&] { check_move_plan(plan, "t"); }, {"positions (first + count) overflow int64"}));
  plan.positions = {{0, 4, INT64_MAX - 4}};
  EXPECT_NO_THROW(check_move_plan(plan, "t"));
  plan.positions.clear();
  plan.dst_rows = -1;
  EXPECT_TRUE(ThrowsInvalid([&] { check_move_plan(plan, "t"); }, {">= 0"}));
  const int64_t big = INT64_MAX / 2 + 1;  // two runs of this many rows add up past int64
  plan.src_rows = plan.dst_rows = INT64_MAX;
  plan.copies = {{0, 0, big}, {0, 0, big}};
  plan.fills.clear();
  EXPECT_TRUE(ThrowsInvalid([&] { check_move_plan(plan, "t"); }, {"[seqpack.t]", "overflow"}));
}

}  // namespace

namespace {

seqpack::MoveBuffers buffers(const std::vector<uint8_t>& src, std::vector<uint8_t>& dst, const uint8_t* fill,
                             size_t row_bytes) {
  return {reinterpret_cast<const char*>(src.data()), static_cast<int64_t>(src.size()),
          reinterpret_cast<char*>(dst.data()), static_cast<int64_t>(dst.size()),
          reinterpret_cast<const char*>(fill), static_cast<int64_t>(row_bytes)};
}

// The device kernel's task table, run on the CPU, reproduces the CPU executor.
TEST(Move, ByteTasksReproduceThePlan) {
  using namespace seqpack;
  std::vector<uint8_t> mask = {1, 1, 1, 0, 0, 1, 0, 1, 1, 1, 1, 1, 0, 0, 0, 1};
  const SourceSpans spans = spans_from_mask(mask.data(), 4, 4);
  ThdOptions o;
  o.cp_size = 2;
  o.pad_multiple = 4;
  o.pad_packed_to = 24;
  const ThdLayout layout = make_thd_layout(span_lengths(spans), o);
  for (int64_t rank = 0; rank < 2; ++rank) {
    const MovePlan pack = make_pack_plan(layout, spans, rank);
    const MovePlan unpack = make_unpack_plan(pack, 16);
    for (size_t row_bytes : {size_t{1}, size_t{6}, size_t{16}}) {
      for (size_t max_task : {size_t{1}, size_t{20}, size_t{1} << 20}) {
        std::vector<uint8_t> src(16 * row_bytes);
        std::iota(src.begin(), src.end(), 1);
        std::vector<uint8_t> fill(row_bytes);
        std::iota(fill.begin(), fill.end(), 200);
        for (const MovePlan* plan : {&pack, &unpack}) {
          const auto in_rows = static_cast<size_t>(plan->src_rows), out_rows = static_cast<size_t>(plan->dst_rows);
          std::vector<uint8_t> in(in_rows * row_bytes);
          for (size_t i = 0; i < in.size(); ++i) in[i] = src[i % src.size()];
          std::vector<uint8_t> expected(out_rows * row_bytes, 0), got(out_rows * row_bytes, 0);
          execute_move_plan(*plan, in.data(), plan->src_rows, expected.data(), plan->dst_rows, row_bytes,
                            fill.data(), 1);
          const auto tasks = make_byte_tasks(*plan, row_bytes, max_task);
          for (const ByteTask& t : tasks) EXPECT_LE(static_cast<size_t>(t.bytes), std::max(max_task, row_bytes));
          for (int width : {1, 4, 8, 16}) {  // the kernel's access widths, a block of 3 lanes
            if (row_bytes % static_cast<size_t>(width) != 0) continue;
            std::fill(got.begin(), got.end(), 0);
            execute_byte_tasks(tasks, buffers(in, got, fill.data(), row_bytes), width, 3);
            EXPECT_EQ(got, expected) << "rank " << rank << ", row_bytes " << row_bytes << ", max_task " << max_task
                                     << ", width " << width;
          }
          // No fill row: zero bytes on both sides (the GPU used to dereference null).
          std::vector<uint8_t> zero_fill(out_rows * row_bytes, 7), zero_got(out_rows * row_bytes, 7);
          execute_move_plan(*plan, in.data(), plan->src_rows, zero_fill.data(), plan->dst_rows, row_bytes, nullptr, 1);
          execute_byte_tasks(tasks, buffers(in, zero_got, nullptr, row_bytes), row_bytes % 4 ? 1 : 4, 2);
          EXPECT_EQ(zero_got, zero_fill);
        }
      }
    }
  }
}

// A task or position run that would leave its buffers (a corrupt table in device
// memory) is skipped, not run out of bounds: the kernels cannot read the table back.
TEST(Move, TasksAndRunsOutsideTheBuffersAreSkipped) {
  using namespace seqpack;
  std::vector<uint8_t> src(8, 1), dst(8, 0);
  const std::vector<ByteTask> tasks = {{0, 0, 4},        // fine
                                       {4, 6, 4},        // dst overflow
                                       {6, 0, 4},        // src overflow
                                       {-1, -2, 2},      // negative dst
                                       {0, 4, -4},       // negative size
                                       {0, INT64_MAX, 8}};  // offset + size wraps around
  execute_byte_tasks(tasks, buffers(src, dst, nullptr, 1), 1, 2);
  EXPECT_EQ(dst, (std::vector<uint8_t>{1, 1, 1, 1, 0, 0, 0, 0}));
  std::vector<int64_t> out(4, -7);
  for (const PositionRun& run : {PositionRun{0, 2, 5}, PositionRun{3, 2, 0}, PositionRun{-1, 1, 0},
                                 PositionRun{INT64_MAX, 2, 0}})
    for (int64_t lane = 0; lane < 2; ++lane) run_position_run(run, out.data(), 4, lane, 2);
  EXPECT_EQ(out, (std::vector<int64_t>{5, 6, -7, -7}));
}

// Found by fuzz_byte_tasks: bounds checks that added a run's start and count
// overflowed, and byte offsets (rows x row_bytes) could wrap around.
TEST(Move, FuzzRegressions) {
  MovePlan plan;
  plan.src_rows = plan.dst_rows = 4;
  plan.copies = {{INT64_MAX, 0, 2}};
  std::vector<char> src(4), dst(4);
  EXPECT_TRUE(ThrowsInvalid([&] { execute_move_plan(plan, src.data(), 4, dst.data(), 4, 1); }, {"copy run"}));
  EXPECT_TRUE(ThrowsInvalid([&] { make_byte_tasks(plan, 1, 64); }, {"copy run"}));
  plan.copies.clear();
  plan.fills = {{2, INT64_MAX}};
  EXPECT_TRUE(ThrowsInvalid([&] { make_byte_tasks(plan, 1, 64); }, {"fill run"}));
  MovePlan huge;
  huge.src_rows = huge.dst_rows = int64_t{1} << 62;
  EXPECT_TRUE(ThrowsInvalid([&] { make_byte_tasks(huge, 8, 64); }, {"row_bytes", "int64"}));
}

}  // namespace
