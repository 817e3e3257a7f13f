#include <numeric>
#include <vector>

#include "seqpack/cp.hpp"
#include "test_helpers.hpp"

namespace {

using namespace seqpack;
using seqpack_test::ThrowsInvalid;
using Vec = std::vector<int64_t>;

// SPEC section 7 / Transformer Engine's thd_get_partitioned_indices.
TEST(ContextParallel, TransformerEngineIndices) {
  const Vec cu = {0, 8, 16};
  EXPECT_EQ(cp_partition_indices(cu, 2, 0), (Vec{0, 1, 6, 7, 8, 9, 14, 15}));
  EXPECT_EQ(cp_partition_indices(cu, 2, 1), (Vec{2, 3, 4, 5, 10, 11, 12, 13}));
  EXPECT_EQ(cp_partition_indices(cu, 1, 0), (Vec{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}));
}

TEST(ContextParallel, RanksPartitionEveryPosition) {
  const Vec cu = {0, 8, 8, 24, 32};
  for (int64_t cp : {1, 2, 4}) {
    Vec all;
    for (int64_t r = 0; r < cp; ++r) {
      const Vec part = cp_partition_indices(cu, cp, r);
      EXPECT_EQ(static_cast<int64_t>(part.size()), cu.back() / cp);
      all.insert(all.end(), part.begin(), part.end());
    }
    // Restoring: gathered[order[g]] is global position g.
    const Vec order = cp_restore_order(cu, cp);
    for (int64_t g = 0; g < cu.back(); ++g) EXPECT_EQ(all[static_cast<size_t>(order[g])], g);
  }
}

TEST(ContextParallel, InvalidArguments) {
  EXPECT_TRUE(ThrowsInvalid([] { cp_partition_indices(Vec{0, 6}, 2, 0); }, {"2 * cp_size", "6"}));
  EXPECT_TRUE(ThrowsInvalid([] { cp_partition_indices(Vec{1, 8}, 2, 0); }, {"start at 0"}));
  EXPECT_TRUE(ThrowsInvalid([] { cp_partition_indices(Vec{0, 8, 4}, 1, 0); }, {"non-decreasing"}));
  EXPECT_TRUE(ThrowsInvalid([] { cp_partition_indices(Vec{0, 8}, 2, 2); }, {"cp_rank"}));
  EXPECT_TRUE(ThrowsInvalid([] { cp_restore_order(Vec{0, 8}, 0); }, {"cp_size"}));
}

// Found by fuzz_cp: a huge cp_size over empty sequences looped once per rank, and
// offsets far apart overflowed when subtracted.
TEST(ContextParallel, FuzzRegressions) {
  EXPECT_TRUE(cp_restore_order(Vec{0, 0, 0}, int64_t{1} << 40).empty());
  EXPECT_TRUE(ThrowsInvalid([] { cp_restore_order(Vec{0, 8, INT64_MIN + 2}, 2); }, {"non-decreasing"}));
  EXPECT_TRUE(ThrowsInvalid([] { cp_partition_indices(Vec{0, int64_t{1} << 40}, 1, 0); }, {"int32"}));
}

}  // namespace
