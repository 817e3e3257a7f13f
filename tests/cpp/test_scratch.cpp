// The per-thread scratch cache behind the packers' temporaries (cpp/src/scratch.hpp).
#include <gtest/gtest.h>

#include <cstdint>
#include <numeric>
#include <thread>

#include "scratch.hpp"

namespace {

using seqpack::detail::Buffer;
using seqpack::detail::ScratchCache;

TEST(Scratch, LargeBlocksAreReusedOnTheSameThread) {
  const void* first = nullptr;
  {
    Buffer<int64_t> a(100000);
    std::iota(a.begin(), a.end(), 0);
    EXPECT_EQ(a[99999], 99999);
    first = a.data();
  }
  Buffer<int64_t> b(90000);  // same power-of-two class (1 MiB)
  EXPECT_EQ(static_cast<const void*>(b.data()), first);
  Buffer<int64_t> c(90000);  // the cached block is in use: a new one
  EXPECT_NE(static_cast<const void*>(c.data()), first);
}

TEST(Scratch, OtherThreadsHaveTheirOwnCache) {
  const void* mine = nullptr;
  {
    Buffer<int64_t> a(200000);
    mine = a.data();
  }
  const void* theirs = nullptr;
  std::thread([&] {
    Buffer<int64_t> b(200000);
    theirs = b.data();
  }).join();
  EXPECT_NE(theirs, mine);
  Buffer<int64_t> again(200000);
  EXPECT_EQ(static_cast<const void*>(again.data()), mine);
}

TEST(Scratch, SmallAndHugeBlocksAreNotHeld) {
  ScratchCache cache;
  void* small = cache.allocate(ScratchCache::kMinBytes - 1);
  cache.deallocate(small, ScratchCache::kMinBytes - 1);
  void* huge = cache.allocate(ScratchCache::kMaxHeldBytes * 2);
  cache.deallocate(huge, ScratchCache::kMaxHeldBytes * 2);
  void* huge_again = cache.allocate(ScratchCache::kMaxHeldBytes * 2);
  cache.deallocate(huge_again, ScratchCache::kMaxHeldBytes * 2);
  // Growing vectors (push_back through many classes) keep working.
  Buffer<int64_t> grown;
  for (int64_t i = 0; i < 3000000; ++i) grown.push_back(i);
  EXPECT_EQ(std::accumulate(grown.begin(), grown.end(), int64_t{0}), int64_t{3000000} * 2999999 / 2);
}

}  // namespace
