#include "thread_pool.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#include <unistd.h>
#endif

namespace seqpack::detail {
namespace {

// More workers than this are never started, whatever a caller asks for.
constexpr size_t kMaxWorkers = 255;
// How long an idle worker polls for the next job before it sleeps.
constexpr std::chrono::microseconds kSpin{100};

thread_local bool t_in_job = false;

class ThreadPool {
 public:
  void run(size_t n, const std::function<void(size_t)>& fn) {
    std::lock_guard<std::mutex> one_job(submit_);
    grow(n - 1);
    {
      std::lock_guard<std::mutex> lock(m_);
      fn_ = &fn;
      n_ = n;
      next_ = 0;
      pending_ = n;
      error_ = nullptr;
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    std::unique_lock<std::mutex> lock(m_);
    work(lock);
    done_.wait(lock, [&] { return pending_ == 0; });
    fn_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void grow(size_t wanted) {
    wanted = std::min(wanted, kMaxWorkers);
    while (workers_.size() < wanted) workers_.emplace_back([this] { loop(); });
  }

  // Claims and runs indices of the current job until none is left; `lock` holds m_.
  void work(std::unique_lock<std::mutex>& lock) {
    while (next_ < n_) {
      const size_t i = next_++;
      const auto* fn = fn_;
      lock.unlock();
      std::exception_ptr error;
      t_in_job = true;
      try {
        (*fn)(i);
      } catch (...) {
        error = std::current_exception();
      }
      t_in_job = false;
      lock.lock();
      if (error && !error_) error_ = error;
      if (--pending_ == 0) done_.notify_all();
    }
  }

  void loop() {
    uint64_t seen = 0;
    for (;;) {
      // Spin briefly first (as OpenMP runtimes do): a job that follows soon
      // starts without the futex wake-up, which costs tens of microseconds on
      // virtual machines. Then sleep until the next job.
      const auto spin_until = std::chrono::steady_clock::now() + kSpin;
      while (generation_.load(std::memory_order_acquire) == seen && std::chrono::steady_clock::now() < spin_until) {
        for (int k = 0; k < 64; ++k) pause();
      }
      std::unique_lock<std::mutex> lock(m_);
      wake_.wait(lock, [&] { return generation_.load(std::memory_order_relaxed) != seen; });
      seen = generation_.load(std::memory_order_relaxed);
      work(lock);
    }
  }

  static void pause() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }

  std::mutex submit_;
  std::mutex m_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> workers_;
  const std::function<void(size_t)>* fn_ = nullptr;
  size_t n_ = 0, next_ = 0, pending_ = 0;
  std::atomic<uint64_t> generation_{0};
  std::exception_ptr error_;
};

ThreadPool& pool() {
  // Never destroyed: workers sleep until the process exits. After fork() the
  // child has none of the parent's workers, so it starts its own pool (the
  // parent's object is left behind untouched).
  static std::mutex guard;
  static ThreadPool* current = nullptr;
#if defined(__linux__)
  static pid_t owner = 0;
  std::lock_guard<std::mutex> lock(guard);
  if (current == nullptr || owner != getpid()) {
    current = new ThreadPool();
    owner = getpid();
  }
#else
  std::lock_guard<std::mutex> lock(guard);
  if (current == nullptr) current = new ThreadPool();
#endif
  return *current;
}

}  // namespace

void parallel_for(size_t n, const std::function<void(size_t)>& fn) {
  if (n == 0) return;
  if (n == 1 || t_in_job) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  pool().run(n, fn);
}

size_t available_threads() {
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int count = CPU_COUNT(&set);
    if (count > 0) return static_cast<size_t>(count);
  }
#endif
  return std::max<unsigned>(1, std::thread::hardware_concurrency());
}

}  // namespace seqpack::detail
