#pragma once
// Shared parts of the libFuzzer targets: a reader that turns the fuzzer's bytes
// into arguments (mostly small, valid values, sometimes the edges of int64), and
// invariant checks that abort, so the fuzzer records the input as a crash.
//
// Every target calls the core like a user would and accepts exactly two outcomes:
// std::invalid_argument (the core's documented error), or a result whose
// invariants hold. Anything else (another exception, a sanitizer report, a broken
// invariant, a timeout) is a finding.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <vector>

#include "seqpack/common.hpp"

namespace seqpack_fuzz {

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
constexpr int64_t kMin = std::numeric_limits<int64_t>::min();

class Input {
 public:
  Input(const uint8_t* data, size_t size) : data_(data), size_(size) {}

  // `n` bytes as a little-endian unsigned integer; zeros once the input runs out.
  uint64_t bits(int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; ++i) v |= static_cast<uint64_t>(byte()) << (8 * i);
    return v;
  }
  bool flag() { return byte() & 1; }
  // Uniform-ish in [lo, hi] (lo <= hi, a small span).
  int64_t in_range(int64_t lo, int64_t hi) {
    const auto span = static_cast<uint64_t>(hi - lo) + 1;
    return traced(lo + static_cast<int64_t>(bits(span > 255 ? 4 : 1) % span));
  }
  // Mostly in [0, scale]; one time in four an edge: 0, -1, a negative, near a
  // power of two that sums or doubles past int64, or the int64 extremes.
  int64_t edgy(int64_t scale) {
    const uint8_t sel = byte();
    if (sel < 192) return in_range(0, std::max<int64_t>(scale, 0));
    switch (sel % 8) {
      case 0: return traced(0);
      case 1: return traced(-1 - in_range(0, 3));
      case 2: return traced(kMax - in_range(0, 3));
      case 3: return traced(kMin + in_range(0, 3));
      case 4: return traced((int64_t{1} << 62) + in_range(-2, 2));
      case 5: return traced((int64_t{1} << 31) + in_range(-2, 2));
      case 6: return traced(kMax / 2 + in_range(-2, 2));
      default: return traced(static_cast<int64_t>(bits(8)));
    }
  }
  std::vector<int64_t> lengths(size_t max_n, int64_t scale) {
    std::vector<int64_t> out(static_cast<size_t>(in_range(0, static_cast<int64_t>(max_n))));
    for (auto& v : out) v = edgy(scale);
    return out;
  }
  bool exhausted() const { return pos_ >= size_; }

 private:
  // SEQPACK_FUZZ_TRACE=1 prints every value drawn, to read a crash input back:
  //   SEQPACK_FUZZ_TRACE=1 ./fuzz_packing crash-<hash>
  int64_t traced(int64_t v) const {
    static const bool on = std::getenv("SEQPACK_FUZZ_TRACE") != nullptr;
    if (on) std::fprintf(stderr, "  drawn %lld\n", static_cast<long long>(v));
    return v;
  }
  uint8_t byte() { return pos_ < size_ ? data_[pos_++] : 0; }
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

[[noreturn]] inline void fail(const char* what, const char* file, int line) {
  std::fprintf(stderr, "seqpack fuzz invariant broken at %s:%d: %s\n", file, line, what);
  std::abort();
}
#define FUZZ_REQUIRE(cond) \
  do {                     \
    if (!(cond)) ::seqpack_fuzz::fail(#cond, __FILE__, __LINE__); \
  } while (0)

// Well-formed CSR holding every index of [0, n) exactly once.
inline void require_partition(const seqpack::IndexGroups& g, size_t n) {
  FUZZ_REQUIRE(!g.offsets.empty() && g.offsets.front() == 0);
  FUZZ_REQUIRE(g.offsets.back() == static_cast<int64_t>(g.indices.size()));
  for (size_t b = 0; b < g.size(); ++b) FUZZ_REQUIRE(g.group_size(b) >= 0);
  FUZZ_REQUIRE(g.indices.size() == n);
  std::vector<char> seen(n, 0);
  for (int64_t i : g.indices) {
    FUZZ_REQUIRE(i >= 0 && i < static_cast<int64_t>(n));
    FUZZ_REQUIRE(!seen[static_cast<size_t>(i)]++);
  }
}

// Sum of lengths[i] over a group, exact (no int64 wrap-around in the check itself).
inline __int128 group_sum(std::span<const int64_t> group, std::span<const int64_t> lengths) {
  __int128 s = 0;
  for (int64_t i : group) s += lengths[static_cast<size_t>(i)];
  return s;
}

inline void require_under_cap(const seqpack::IndexGroups& g, std::span<const int64_t> lengths, int64_t cap) {
  for (size_t b = 0; b < g.size(); ++b) FUZZ_REQUIRE(group_sum(g.group(b), lengths) <= cap);
}

// Runs `body`; the core's documented error ends the input quietly, anything else
// escapes to libFuzzer as a crash.
template <class F>
int run(F&& body) {
  try {
    body();
  } catch (const std::invalid_argument&) {
  }
  return 0;
}

}  // namespace seqpack_fuzz
