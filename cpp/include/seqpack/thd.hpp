#pragma once
// The THD (packed) layout and the host-side plans that move tokens between a padded
// [B, S, ...] batch and it.
//
//   padded [B=3, S=6]          THD, pad_multiple 4 (p = alignment padding)
//   a a a . . .                a a a p b b b b b p p p c p p p
//   b b b b b .                cu_seqlens        = [0, 3, 8, 9]
//   . . c . . .  (any mask)    cu_seqlens_padded = [0, 4, 12, 16]
//
// A plan is a list of row runs: `copies` move `count` consecutive token rows from
// `src` to `dst`, `fills` write the pad value, `positions` write position ids.
// A "row" is one token's trailing elements ([...] of [B, S, ...]), so one plan
// serves every tensor of a batch whatever its dtype or hidden size. Plans are
// computed once on the host from lengths already there; executing one never needs
// to read data back (no host sync on a device).
#include <cstdint>
#include <vector>

#include "seqpack/common.hpp"

namespace seqpack {

struct ThdOptions {
  int64_t pad_multiple = 1;         // every sequence padded at its tail to a multiple of this
  int64_t pad_packed_to = 0;        // > 0: total padded length becomes exactly this
  int64_t pad_packed_multiple = 1;  // total padded length rounded up to a multiple of this
  int64_t cp_size = 1;              // > 1: padded lengths must split into 2 * cp_size chunks
};

// Lengths and offsets of a packed batch. The bin-level padding (pad_packed_to /
// pad_packed_multiple) is absorbed into the last sequence's padded length, as
// Megatron-Core does, so cu_seqlens_padded[-1] is the packed length.
struct ThdLayout {
  std::vector<int64_t> seq_lens;     // real tokens per sequence
  std::vector<int64_t> padded_lens;  // per sequence, after padding
  std::vector<int32_t> cu_seqlens;   // [B + 1], cumulative real lengths
  std::vector<int32_t> cu_seqlens_padded;  // [B + 1], cumulative padded lengths (memory offsets)
  int64_t max_seqlen = 0;
  int64_t max_seqlen_padded = 0;
  int64_t cp_size = 1;

  int64_t batch_size() const { return static_cast<int64_t>(seq_lens.size()); }
  int64_t total_padded() const { return cu_seqlens_padded.back(); }
  // Rows of one context-parallel rank's local THD (total_padded / cp_size).
  int64_t local_rows() const { return total_padded() / cp_size; }
};

ThdLayout make_thd_layout(Lengths seq_lens, const ThdOptions& options);

// A layout from existing offsets (a packed dataset, a caller's cu_seqlens): both
// [B + 1], starting at 0, non-decreasing, within int32; every padded span holds its
// real span and, with context parallelism, splits into 2 * cp_size chunks.
ThdLayout thd_layout_from_offsets(Lengths cu_seqlens, Lengths cu_seqlens_padded, int64_t cp_size);

// Where each sequence's real tokens are in the padded source, in order: sequence b
// is the concatenation of spans[offsets[b] .. offsets[b+1]), each `count` rows
// starting at row `start` of the flattened [B * S] source.
struct Span {
  int64_t start = 0;
  int64_t count = 0;
  bool operator==(const Span&) const = default;
};
struct SourceSpans {
  std::vector<int64_t> offsets{0};
  std::vector<Span> spans;
  int64_t width = 0;  // S: the source has batch_size() * width rows

  int64_t batch_size() const { return static_cast<int64_t>(offsets.size()) - 1; }
};

// Right-padded rows: sequence b is row b's first seq_lens[b] tokens.
SourceSpans spans_from_lengths(Lengths seq_lens, int64_t width);
// Any mask (right, left or holes): sequence b is row b's tokens whose mask byte is
// non-zero, in column order. `mask` is [batch, width], row-major, bytes (bool/uint8).
SourceSpans spans_from_mask(const uint8_t* mask, int64_t batch, int64_t width);
// Real tokens per sequence.
std::vector<int64_t> span_lengths(const SourceSpans& spans);

struct CopyRun {
  int64_t src = 0, dst = 0, count = 0;
  bool operator==(const CopyRun&) const = default;
};
struct FillRun {
  int64_t dst = 0, count = 0;
  bool operator==(const FillRun&) const = default;
};
struct PositionRun {  // dst rows [dst, dst + count) get positions first, first + 1, ...
  int64_t dst = 0, count = 0, first = 0;
  bool operator==(const PositionRun&) const = default;
};
struct MovePlan {
  std::vector<CopyRun> copies;
  std::vector<FillRun> fills;
  std::vector<PositionRun> positions;  // pack plans only
  int64_t src_rows = 0;                // rows the source must have
  int64_t dst_rows = 0;                // rows the destination has
};

// Padded -> THD, or with layout.cp_size > 1 rank cp_rank's zigzag-local THD
// directly: each sequence's padded span is cut into 2 * cp_size chunks and the rank
// keeps chunks cp_rank and 2 * cp_size - 1 - cp_rank, sequences in order, at local
// offset cu_seqlens_padded / cp_size. Position ids are positions in the sequence.
MovePlan make_pack_plan(const ThdLayout& layout, const SourceSpans& source, int64_t cp_rank = 0);

// The inverse of a pack plan: THD (full or local) -> padded [B * S] rows, every row
// the pack did not fill from the THD (padding, other ranks' chunks) gets the fill.
MovePlan make_unpack_plan(const MovePlan& pack_plan, int64_t padded_rows);

}  // namespace seqpack
