// The persistent worker pool behind the CPU copies (cpp/src/thread_pool.hpp).
#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <set>
#include <stdexcept>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include "thread_pool.hpp"

namespace {

using seqpack::detail::available_threads;
using seqpack::detail::parallel_for;

TEST(ThreadPool, EveryIndexRunsExactlyOnce) {
  for (size_t n : {0, 1, 2, 3, 7, 64}) {
    std::vector<std::atomic<int>> hits(n);
    parallel_for(n, [&](size_t i) { hits[i].fetch_add(1); });
    for (size_t i = 0; i < n; ++i) EXPECT_EQ(hits[i].load(), 1) << "n=" << n << " i=" << i;
  }
}

TEST(ThreadPool, RunsOnSeveralThreads) {
  // Every index waits until all four have started: only possible if they run concurrently.
  std::atomic<int> started{0};
  std::mutex m;
  std::set<std::thread::id> ids;
  parallel_for(4, [&](size_t) {
    started.fetch_add(1);
    while (started.load() < 4) std::this_thread::yield();
    std::lock_guard<std::mutex> lock(m);
    ids.insert(std::this_thread::get_id());
  });
  EXPECT_EQ(ids.size(), 4u);
}

TEST(ThreadPool, RethrowsTheFirstErrorAfterEveryIndexRan) {
  std::atomic<int> ran{0};
  EXPECT_THROW(parallel_for(8,
                            [&](size_t i) {
                              ran.fetch_add(1);
                              if (i % 3 == 1) throw std::runtime_error("boom");
                            }),
               std::runtime_error);
  EXPECT_EQ(ran.load(), 8);
  int after = 0;  // the pool still works
  parallel_for(1, [&](size_t) { ++after; });
  EXPECT_EQ(after, 1);
}

TEST(ThreadPool, NestedCallsRunInline) {
  std::atomic<int> inner{0};
  parallel_for(3, [&](size_t) { parallel_for(5, [&](size_t) { inner.fetch_add(1); }); });
  EXPECT_EQ(inner.load(), 15);
}

TEST(ThreadPool, ConcurrentCallersEachGetTheirJobDone) {
  std::vector<std::thread> callers;
  std::atomic<int> total{0};
  for (int c = 0; c < 4; ++c)
    callers.emplace_back([&] {
      for (int round = 0; round < 50; ++round) parallel_for(3, [&](size_t) { total.fetch_add(1); });
    });
  for (auto& t : callers) t.join();
  EXPECT_EQ(total.load(), 4 * 50 * 3);
}

TEST(ThreadPool, WorksInAForkedChild) {
  parallel_for(2, [](size_t) {});  // the parent's workers exist
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    std::atomic<int> hits{0};
    parallel_for(3, [&](size_t) { hits.fetch_add(1); });
    _exit(hits.load() == 3 ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST(ThreadPool, AvailableThreadsIsPositive) { EXPECT_GE(available_threads(), 1u); }

}  // namespace
