#include "seqpack/common.hpp"

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>

#ifdef __linux__
#include <sys/mman.h>
#endif

namespace seqpack {

IndexGroups IndexGroups::from_nested(const std::vector<std::vector<int64_t>>& nested) {
  IndexGroups out;
  for (const auto& g : nested) out.push_group(g);
  return out;
}

std::vector<std::vector<int64_t>> IndexGroups::to_nested() const {
  std::vector<std::vector<int64_t>> out(size());
  for (size_t g = 0; g < size(); ++g) {
    auto items = group(g);
    out[g].assign(items.begin(), items.end());
  }
  return out;
}

std::vector<int64_t> group_sums(const IndexGroups& groups, Lengths values, const char* function, const char* what) {
  std::vector<int64_t> sums(groups.size(), 0);
  for (size_t g = 0; g < groups.size(); ++g)
    for (int64_t i : groups.group(g)) sums[g] = checked_add(function, what, sums[g], values[static_cast<size_t>(i)]);
  return sums;
}

bool advise_huge_pages(void* data, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const auto begin = reinterpret_cast<uintptr_t>(data);
  const uintptr_t lo = (begin + kHuge - 1) & ~(kHuge - 1), hi = (begin + bytes) & ~(kHuge - 1);
  if (data == nullptr || hi <= lo) return false;
  return madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE) == 0;
#else
  (void)data;
  (void)bytes;
  return false;
#endif
}

void throw_invalid(const char* function, const std::string& message) {
  throw std::invalid_argument(std::string("[seqpack.") + function + "] " + message);
}

void check_positive(const char* function, const char* name, int64_t value) {
  if (value <= 0)
    throw_invalid(function, std::string(name) + " must be positive, got " + std::to_string(value));
}

void check_non_negative_lengths(const char* function, const char* name, Lengths lengths) {
  for (size_t i = 0; i < lengths.size(); ++i)
    if (lengths[i] < 0)
      throw_invalid(function, std::string(name) + "[" + std::to_string(i) + "] = " +
                                  std::to_string(lengths[i]) + " is negative; lengths must be >= 0");
}

void check_positive_lengths(const char* function, const char* name, Lengths lengths) {
  for (size_t i = 0; i < lengths.size(); ++i)
    if (lengths[i] <= 0)
      throw_invalid(function, std::string(name) + "[" + std::to_string(i) + "] = " +
                                  std::to_string(lengths[i]) + "; lengths must be positive");
}

void check_lengths_fit(const char* function, const char* name, Lengths lengths, int64_t capacity,
                       const char* capacity_name) {
  for (size_t i = 0; i < lengths.size(); ++i)
    if (lengths[i] > capacity)
      throw_invalid(function, std::string(name) + "[" + std::to_string(i) + "] = " +
                                  std::to_string(lengths[i]) + " exceeds " + capacity_name + " = " +
                                  std::to_string(capacity));
}

int64_t checked_add(const char* function, const char* what, int64_t a, int64_t b) {
  int64_t out;
  if (__builtin_add_overflow(a, b, &out)) throw_invalid(function, std::string(what) + " overflows int64");
  return out;
}

int64_t checked_sum(const char* function, const char* name, Lengths values) {
  int64_t total = 0;
  for (int64_t v : values)
    if (__builtin_add_overflow(total, v, &total))
      throw_invalid(function, std::string("sum of ") + name + " overflows int64");
  return total;
}

int64_t round_up(const char* function, int64_t a, int64_t multiple) {
  int64_t out;
  if (__builtin_mul_overflow(ceil_div(a, multiple), multiple, &out))
    throw_invalid(function, std::to_string(a) + " rounded up to a multiple of " + std::to_string(multiple) +
                                " overflows int64");
  return out;
}

int64_t checked_mul(const char* function, const char* what, int64_t a, int64_t b) {
  int64_t out;
  if (__builtin_mul_overflow(a, b, &out))
    throw_invalid(function,
                  std::string(what) + " = " + std::to_string(a) + " * " + std::to_string(b) + " overflows int64");
  return out;
}

namespace {

template <typename T>
void copy_items(const IntBuffer& b, std::vector<int64_t>& out, const char* function, const char* name) {
  const auto* base = static_cast<const unsigned char*>(b.data);
  for (size_t i = 0; i < out.size(); ++i) {
    unsigned char bytes[sizeof(T)];
    std::memcpy(bytes, base + static_cast<int64_t>(i) * b.stride_bytes, sizeof(T));
    if (b.swap_bytes) std::reverse(bytes, bytes + sizeof(T));
    T v;
    std::memcpy(&v, bytes, sizeof(T));
    if constexpr (std::is_unsigned_v<T> && sizeof(T) == 8) {
      if (v > static_cast<T>(std::numeric_limits<int64_t>::max()))
        throw_invalid(function, std::string(name) + "[" + std::to_string(i) + "] = " + std::to_string(v) +
                                    " does not fit in int64");
    }
    out[i] = static_cast<int64_t>(v);
  }
}

}  // namespace

std::vector<int64_t> int64_from_buffer(const IntBuffer& b, const char* function, const char* name) {
  if (b.size < 0) throw_invalid(function, std::string(name) + ": negative size " + std::to_string(b.size));
  std::vector<int64_t> out(static_cast<size_t>(b.size));
  if (b.size == 0) return out;
  if (b.is_signed && b.itemsize == 8 && b.stride_bytes == 8 && !b.swap_bytes) {
    std::memcpy(out.data(), b.data, out.size() * sizeof(int64_t));  // the common case: one memcpy
    return out;
  }
  switch (b.itemsize * (b.is_signed ? 1 : -1)) {
    case 1: copy_items<int8_t>(b, out, function, name); break;
    case 2: copy_items<int16_t>(b, out, function, name); break;
    case 4: copy_items<int32_t>(b, out, function, name); break;
    case 8: copy_items<int64_t>(b, out, function, name); break;
    case -1: copy_items<uint8_t>(b, out, function, name); break;
    case -2: copy_items<uint16_t>(b, out, function, name); break;
    case -4: copy_items<uint32_t>(b, out, function, name); break;
    case -8: copy_items<uint64_t>(b, out, function, name); break;
    default:
      throw_invalid(function, std::string(name) + ": unsupported integer width of " + std::to_string(b.itemsize) +
                                  " bytes (1, 2, 4 or 8)");
  }
  return out;
}

uint64_t Rng::next() {
  uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t Rng::below(uint64_t bound) {
  // Rejection sampling on the top of the range: unbiased and portable.
  const uint64_t limit = std::numeric_limits<uint64_t>::max() -
                         std::numeric_limits<uint64_t>::max() % bound;
  uint64_t x;
  do x = next(); while (x >= limit);
  return x % bound;
}

void check_each_index_once(const char* fn, const char* name, const IndexGroups& groups, int64_t n) {
  std::vector<char> seen(static_cast<size_t>(n), 0);
  for (int64_t i : groups.indices) {
    if (i < 0 || i >= n)
      throw_invalid(fn, std::string(name) + ": index " + std::to_string(i) + " is out of range for " +
                            std::to_string(n) + " sequence lengths");
    if (seen[static_cast<size_t>(i)]++)
      throw_invalid(fn, std::string(name) + ": index " + std::to_string(i) + " appears twice");
  }
  if (groups.indices.size() != static_cast<size_t>(n))
    throw_invalid(fn, std::string(name) + " must hold every index once: " +
                          std::to_string(n - static_cast<int64_t>(groups.indices.size())) + " are missing");
}

}  // namespace seqpack
