#pragma once
// Per-thread reuse of large temporary buffers.
//
// A packer allocates about a dozen n-sized temporaries per call. glibc serves blocks
// this large with mmap, or trims them back to the kernel when they are freed, so a
// planner called once per training step would first-touch fresh pages every time:
// perf puts that at a third to a half of packing 32k sequences. `Buffer<T>` is a
// std::vector whose blocks of 64 KiB and more come from, and go back to, a cache
// owned by the calling thread (power-of-two size classes, at most 32 MiB held).
#include <array>
#include <bit>
#include <cstddef>
#include <new>
#include <vector>

namespace seqpack::detail {

class ScratchCache {
 public:
  static constexpr size_t kMinBytes = size_t{1} << 16;
  static constexpr size_t kMaxHeldBytes = size_t{32} << 20;

  static ScratchCache& local() {
    thread_local ScratchCache cache;
    return cache;
  }
  ScratchCache() = default;
  ScratchCache(const ScratchCache&) = delete;
  ScratchCache& operator=(const ScratchCache&) = delete;
  ~ScratchCache() {
    for (auto& blocks : free_)
      for (void* p : blocks) ::operator delete(p);
  }

  void* allocate(size_t bytes) {
    if (bytes < kMinBytes) return ::operator new(bytes);
    const unsigned c = size_class(bytes);
    auto& blocks = free_[c];
    if (blocks.empty()) return ::operator new(size_t{1} << c);
    void* p = blocks.back();
    blocks.pop_back();
    held_ -= size_t{1} << c;
    return p;
  }
  void deallocate(void* p, size_t bytes) noexcept {
    if (bytes >= kMinBytes) {
      const unsigned c = size_class(bytes);
      auto& blocks = free_[c];
      if (held_ + (size_t{1} << c) <= kMaxHeldBytes && blocks.size() < blocks.capacity()) {
        blocks.push_back(p);  // never reallocates: capacity reserved below
        held_ += size_t{1} << c;
        return;
      }
    }
    ::operator delete(p);
  }

 private:
  static unsigned size_class(size_t bytes) { return static_cast<unsigned>(std::bit_width(bytes - 1)); }

  // Room for as many blocks of each class as the cap allows (about 1k pointers in all).
  struct Lists : std::array<std::vector<void*>, 64> {
    Lists() {
      for (unsigned c = std::bit_width(kMinBytes - 1); c < size(); ++c) (*this)[c].reserve(kMaxHeldBytes >> c);
    }
  };
  Lists free_;
  size_t held_ = 0;
};

template <typename T>
struct ScratchAllocator {
  using value_type = T;
  ScratchAllocator() noexcept = default;
  template <typename U>
  ScratchAllocator(const ScratchAllocator<U>&) noexcept {}
  T* allocate(size_t n) { return static_cast<T*>(ScratchCache::local().allocate(n * sizeof(T))); }
  void deallocate(T* p, size_t n) noexcept { ScratchCache::local().deallocate(p, n * sizeof(T)); }
  friend bool operator==(const ScratchAllocator&, const ScratchAllocator&) noexcept { return true; }
};

template <typename T>
using Buffer = std::vector<T, ScratchAllocator<T>>;

}  // namespace seqpack::detail
