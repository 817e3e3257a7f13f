#include <cstring>
#include <numeric>
#include <vector>

#include "seqpack/move.hpp"
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

}  // namespace
