#include "seqpack/cp.hpp"

#include <cstdint>
#include <limits>
#include <string>

namespace seqpack {
namespace {

// Validates cu_seqlens_padded for a CP split and returns the number of sequences.
size_t check_cu(const char* fn, std::span<const int64_t> cu, int64_t cp_size) {
  check_positive(fn, "cp_size", cp_size);
  if (cp_size > INT64_MAX / 2)
    throw_invalid(fn, "cp_size: 2 * cp_size chunks must fit in int64, got cp_size = " + std::to_string(cp_size));
  if (cu.empty() || cu[0] != 0) throw_invalid(fn, "cu_seqlens_padded must start at 0");
  if (cu.back() > std::numeric_limits<int32_t>::max())
    throw_invalid(fn, "cu_seqlens_padded ends at " + std::to_string(cu.back()) +
                          "; THD offsets must fit in int32 (as flash-attention's and Transformer Engine's)");
  for (size_t i = 1; i < cu.size(); ++i) {
    if (cu[i] < cu[i - 1])  // compared before subtracting: a difference could overflow
      throw_invalid(fn, "cu_seqlens_padded must be non-decreasing (index " + std::to_string(i) + ")");
    const int64_t len = cu[i] - cu[i - 1];
    if (len % (2 * cp_size) != 0)
      throw_invalid(fn, "sequence " + std::to_string(i - 1) + " has padded length " + std::to_string(len) +
                            ", not a multiple of 2 * cp_size = " + std::to_string(2 * cp_size));
  }
  return cu.size() - 1;
}

}  // namespace

std::vector<int64_t> cp_partition_indices(std::span<const int64_t> cu, int64_t cp_size, int64_t cp_rank) {
  constexpr const char* fn = "cp_partition_indices";
  const size_t n = check_cu(fn, cu, cp_size);
  if (cp_rank < 0 || cp_rank >= cp_size)
    throw_invalid(fn, "cp_rank must be in [0, cp_size=" + std::to_string(cp_size) + "), got " +
                          std::to_string(cp_rank));
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(cu.back() / cp_size));
  for (size_t i = 0; i < n; ++i) {
    const int64_t chunk = (cu[i + 1] - cu[i]) / (2 * cp_size);
    for (int64_t c : {cp_rank, 2 * cp_size - 1 - cp_rank})
      for (int64_t k = 0; k < chunk; ++k) out.push_back(cu[i] + c * chunk + k);
  }
  return out;
}

std::vector<int64_t> cp_restore_order(std::span<const int64_t> cu, int64_t cp_size) {
  constexpr const char* fn = "cp_restore_order";
  check_cu(fn, cu, cp_size);
  std::vector<int64_t> order(static_cast<size_t>(cu.back()));
  if (order.empty()) return order;  // also bounds the loop: cp_size <= total / 2 otherwise
  int64_t gathered = 0;
  for (int64_t r = 0; r < cp_size; ++r)
    for (int64_t global : cp_partition_indices(cu, cp_size, r)) order[static_cast<size_t>(global)] = gathered++;
  return order;
}

}  // namespace seqpack
