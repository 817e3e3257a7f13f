#pragma once
// Context-parallel (CP) index maps for the zigzag THD layout: a sequence of padded
// length L is cut into 2 * cp_size chunks of L / (2 * cp_size) tokens and rank r
// keeps chunks r and 2 * cp_size - 1 - r, sequences in order.
//
//   cu_seqlens_padded = [0, 8, 16], cp_size = 2 (chunks of 2)
//   global  0 1 | 2 3 | 4 5 | 6 7 || 8 9 | 10 11 | 12 13 | 14 15
//   rank 0  0 1               6 7    8 9                   14 15
//   rank 1        2 3   4 5                10 11   12 13
#include <cstdint>
#include <span>
#include <vector>

#include "seqpack/common.hpp"

namespace seqpack {

// Global THD positions held by cp_rank, in its local order; the same indices as
// Transformer Engine's thd_get_partitioned_indices. Each padded length
// (differences of cu_seqlens_padded) must be a multiple of 2 * cp_size.
std::vector<int64_t> cp_partition_indices(std::span<const int64_t> cu_seqlens_padded, int64_t cp_size,
                                          int64_t cp_rank);

// For every global THD position, its index in the rank-major concatenation of all
// ranks' local tensors (what an all-gather returns): gathered[order] is the full
// THD in sequence order.
std::vector<int64_t> cp_restore_order(std::span<const int64_t> cu_seqlens_padded, int64_t cp_size);

}  // namespace seqpack
