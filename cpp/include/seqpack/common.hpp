#pragma once
// Shared types of the planning core. Nothing here (or anywhere under cpp/include)
// includes Python or CUDA headers.
//
// Errors: every public function validates its arguments and throws
// std::invalid_argument("[seqpack.<function>] <argument>: <rule broken>"), which
// the bindings surface as ValueError.
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace seqpack {

using Lengths = std::span<const int64_t>;

// A list of groups of input indices stored as CSR: group g holds
// indices[offsets[g] .. offsets[g+1]). Used for bins, partitions and micro-batches.
struct IndexGroups {
  std::vector<int64_t> offsets{0};
  std::vector<int64_t> indices;

  size_t size() const { return offsets.size() - 1; }
  int64_t group_size(size_t g) const { return offsets[g + 1] - offsets[g]; }
  std::span<const int64_t> group(size_t g) const {
    return {indices.data() + offsets[g], static_cast<size_t>(group_size(g))};
  }
  void push_group(std::span<const int64_t> items) {
    indices.insert(indices.end(), items.begin(), items.end());
    offsets.push_back(static_cast<int64_t>(indices.size()));
  }
  static IndexGroups from_nested(const std::vector<std::vector<int64_t>>& nested);
  std::vector<std::vector<int64_t>> to_nested() const;
  bool operator==(const IndexGroups&) const = default;
};

// Sum of values[i] over each group (indices in range). Checked: a sum past int64
// throws "[seqpack.<function>] <what> overflows int64", e.g. what = "sum of
// workloads in a micro-batch".
std::vector<int64_t> group_sums(const IndexGroups& groups, Lengths values, const char* function = "group_sums",
                                const char* what = "a group's sum");

[[noreturn]] void throw_invalid(const char* function, const std::string& message);

// Validation helpers; each throws with the argument name and the rule broken.
void check_positive(const char* function, const char* name, int64_t value);
void check_non_negative_lengths(const char* function, const char* name, Lengths lengths);
void check_positive_lengths(const char* function, const char* name, Lengths lengths);
void check_lengths_fit(const char* function, const char* name, Lengths lengths,
                       int64_t capacity, const char* capacity_name);

// Every index in [0, n) appears in `groups` exactly once (a partition of the items).
void check_each_index_once(const char* function, const char* name, const IndexGroups& groups, int64_t n);

// a + b and a * b with an overflow check: a result past int64 throws
// "[seqpack.<function>] <what> overflows int64", where `what` names the quantity in
// the caller's terms ("sum of lengths", "num_sequences * width").
int64_t checked_add(const char* function, const char* what, int64_t a, int64_t b);
int64_t checked_mul(const char* function, const char* what, int64_t a, int64_t b);
// The sum of every value, checked as checked_add (what: "sum of <name>").
int64_t checked_sum(const char* function, const char* name, Lengths values);

// An integer array as raw memory, as a buffer protocol / NumPy array describes it:
// `size` items of `itemsize` bytes (1, 2, 4 or 8), `stride_bytes` apart (may be
// negative), signed or not, in the host's byte order unless `swap_bytes`.
struct IntBuffer {
  const void* data = nullptr;
  int64_t size = 0;
  int64_t stride_bytes = 0;
  int itemsize = 8;
  bool is_signed = true;
  bool swap_bytes = false;
};

// Copies `buffer` into int64 values. Throws (naming `name` and the item) for an
// unsupported width, a negative size, or an unsigned 64-bit value above INT64_MAX.
std::vector<int64_t> int64_from_buffer(const IntBuffer& buffer, const char* function, const char* name);

// Asks the kernel to back the 2 MiB-aligned interior of a fresh (not yet touched)
// buffer with transparent huge pages: one page fault per 2 MiB instead of 512 when
// a kernel first writes it. Linux only (MADV_HUGEPAGE); elsewhere, or when the
// kernel refuses, returns false and changes nothing. Contents are unaffected.
bool advise_huge_pages(void* data, size_t bytes);

// a >= 0, b > 0; exact for every such pair (a + b - 1 would overflow near INT64_MAX).
inline int64_t ceil_div(int64_t a, int64_t b) { return a / b + (a % b != 0 ? 1 : 0); }
// a >= 0, multiple > 0; throws (naming `function`) when the result overflows int64.
int64_t round_up(const char* function, int64_t a, int64_t multiple);

// A portable, seeded PRNG (SplitMix64) with an unbiased bounded draw, so a seed
// gives the same stream on every platform and standard library.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next();
  uint64_t below(uint64_t bound);  // uniform in [0, bound), bound > 0
 private:
  uint64_t state_;
};

}  // namespace seqpack
