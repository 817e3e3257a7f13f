#include <array>
#include <cstring>
#include <vector>

#include "seqpack/common.hpp"
#include "test_helpers.hpp"

namespace {

using namespace seqpack;
using seqpack_test::ThrowsInvalid;
using Vec = std::vector<int64_t>;

IntBuffer buffer_of(const void* data, int64_t size, int64_t stride, int itemsize, bool is_signed, bool swap) {
  IntBuffer b;
  b.data = data;
  b.size = size;
  b.stride_bytes = stride;
  b.itemsize = itemsize;
  b.is_signed = is_signed;
  b.swap_bytes = swap;
  return b;
}

TEST(Int64FromBuffer, EveryWidthSignStrideAndByteOrder) {
  const std::array<int16_t, 4> i16{-2, 256, 3, 7};
  EXPECT_EQ(int64_from_buffer(buffer_of(i16.data(), 4, 2, 2, true, false), "t", "x"), (Vec{-2, 256, 3, 7}));
  // Every other item, read backwards from the last.
  EXPECT_EQ(int64_from_buffer(buffer_of(&i16[3], 2, -4, 2, true, false), "t", "x"), (Vec{7, 256}));
  // Big-endian 1, 256, 3 as int16: what sorted_stride_partition(np.array(..., '>i2')) passes.
  const std::array<uint8_t, 6> be{0, 1, 1, 0, 0, 3};
  EXPECT_EQ(int64_from_buffer(buffer_of(be.data(), 3, 2, 2, true, true), "t", "x"), (Vec{1, 256, 3}));
  const std::array<uint8_t, 2> u8{255, 0};
  EXPECT_EQ(int64_from_buffer(buffer_of(u8.data(), 2, 1, 1, false, false), "t", "x"), (Vec{255, 0}));
  const std::array<uint64_t, 1> big{~uint64_t{0}};
  EXPECT_TRUE(ThrowsInvalid([&] { int64_from_buffer(buffer_of(big.data(), 1, 8, 8, false, false), "t", "x"); },
                            {"x[0] = 18446744073709551615", "does not fit in int64"}));
  EXPECT_TRUE(ThrowsInvalid([&] { int64_from_buffer(buffer_of(big.data(), 1, 3, 3, true, false), "t", "x"); },
                            {"unsupported integer width"}));
  EXPECT_TRUE(int64_from_buffer(buffer_of(nullptr, 0, 8, 3, true, false), "t", "x").empty());
}

TEST(Common, RoundUpRefusesOverflow) {
  EXPECT_EQ(round_up("t", 0, 8), 0);
  EXPECT_EQ(round_up("t", 9, 8), 16);
  EXPECT_EQ(round_up("t", INT64_MAX, 1), INT64_MAX);
  EXPECT_TRUE(ThrowsInvalid([] { round_up("t", INT64_MAX - 1, 4); }, {"[seqpack.t]", "overflows int64"}));
}

// Issue 26: every sum that can overflow is checked, and the error names what
// overflowed (group sums used to wrap around silently).
TEST(Common, CheckedArithmeticNamesWhatOverflowed) {
  EXPECT_EQ(checked_add("t", "x + y", INT64_MAX - 1, 1), INT64_MAX);
  EXPECT_TRUE(
      ThrowsInvalid([] { checked_add("t", "sum of x", INT64_MAX, 1); }, {"[seqpack.t]", "sum of x overflows int64"}));
  EXPECT_TRUE(ThrowsInvalid([] { checked_mul("t", "rows * width", INT64_MAX, 2); },
                            {"rows * width = 9223372036854775807 * 2 overflows int64"}));
  EXPECT_EQ(checked_sum("t", "lengths", Vec{INT64_MAX - 1, 1, 0}), INT64_MAX);
  EXPECT_TRUE(
      ThrowsInvalid([] { checked_sum("t", "lengths", Vec{INT64_MAX, 1}); }, {"sum of lengths overflows int64"}));
  const IndexGroups g = IndexGroups::from_nested({{0}, {1, 2}});
  EXPECT_EQ(group_sums(g, Vec{INT64_MAX, INT64_MAX - 1, 1}, "t", "a bin's load"), (Vec{INT64_MAX, INT64_MAX}));
  EXPECT_TRUE(ThrowsInvalid([&] { group_sums(g, Vec{1, INT64_MAX, 1}, "t", "a bin's load"); },
                            {"[seqpack.t]", "a bin's load overflows int64"}));
}

}  // namespace
