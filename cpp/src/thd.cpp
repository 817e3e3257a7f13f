#include "seqpack/thd.hpp"

#include <algorithm>
#include <limits>
#include <string>

namespace seqpack {
namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

}  // namespace

ThdLayout make_thd_layout(Lengths seq_lens, const ThdOptions& o) {
  constexpr const char* fn = "make_thd_layout";
  check_positive(fn, "pad_multiple", o.pad_multiple);
  check_positive(fn, "pad_packed_multiple", o.pad_packed_multiple);
  check_positive(fn, "cp_size", o.cp_size);
  if (o.cp_size > INT64_MAX / 2)
    throw_invalid(fn, "cp_size: 2 * cp_size chunks must fit in int64, got cp_size = " + std::to_string(o.cp_size));
  if (o.pad_packed_to < 0) throw_invalid(fn, "pad_packed_to must be >= 0 (0: no bin padding)");
  check_non_negative_lengths(fn, "seq_lens", seq_lens);
  if (o.cp_size > 1) {
    // Every padded length must cut into 2 * cp_size equal chunks (zigzag layout).
    const int64_t chunks = 2 * o.cp_size;
    if (o.pad_multiple % chunks != 0)
      throw_invalid(fn, "pad_multiple (" + std::to_string(o.pad_multiple) + ") must be a multiple of 2 * cp_size (" +
                            std::to_string(chunks) + ") for context parallelism");
  }
  ThdLayout out;
  out.cp_size = o.cp_size;
  out.seq_lens.assign(seq_lens.begin(), seq_lens.end());
  out.padded_lens.reserve(seq_lens.size());
  out.cu_seqlens.reserve(seq_lens.size() + 1);
  out.cu_seqlens_padded.reserve(seq_lens.size() + 1);
  out.cu_seqlens.push_back(0);
  out.cu_seqlens_padded.push_back(0);
  int64_t real = 0, padded = 0;
  for (int64_t len : seq_lens) {
    const int64_t p = round_up(fn, len, o.pad_multiple);
    padded = checked_add(fn, "the packed length (sum of padded lengths)", padded, p);
    if (padded > kInt32Max)
      throw_invalid(fn, "the packed length " + std::to_string(padded) + " does not fit in int32 cu_seqlens");
    real += len;  // <= padded (each len <= its padded length), so within int32 now
    out.padded_lens.push_back(p);
    out.cu_seqlens.push_back(static_cast<int32_t>(real));
    out.cu_seqlens_padded.push_back(static_cast<int32_t>(padded));
    out.max_seqlen = std::max(out.max_seqlen, len);
  }
  int64_t target = round_up(fn, padded, o.pad_packed_multiple);
  if (o.pad_packed_to > 0) {
    if (o.pad_packed_to < target)
      throw_invalid(fn, "pad_packed_to (" + std::to_string(o.pad_packed_to) + ") is below the packed length " +
                            std::to_string(target));
    target = o.pad_packed_to;
  }
  if (target > padded) {
    if (o.cp_size > 1 && (target - padded) % (2 * o.cp_size) != 0)
      throw_invalid(fn, "bin padding (pad_packed_to / pad_packed_multiple) adds " + std::to_string(target - padded) +
                            " tokens to the last sequence, not a multiple of 2 * cp_size = " +
                            std::to_string(2 * o.cp_size) + " for context parallelism");
    if (seq_lens.empty())
      throw_invalid(fn, "bin padding to " + std::to_string(target) + " needs at least one sequence to absorb it");
    if (target > kInt32Max)
      throw_invalid(fn, "the packed length " + std::to_string(target) + " does not fit in int32 cu_seqlens");
    out.padded_lens.back() += target - padded;
    out.cu_seqlens_padded.back() = static_cast<int32_t>(target);
  }
  for (int64_t p : out.padded_lens) out.max_seqlen_padded = std::max(out.max_seqlen_padded, p);
  return out;
}

ThdLayout thd_layout_from_offsets(Lengths cu, Lengths cu_padded, int64_t cp_size) {
  constexpr const char* fn = "thd_layout_from_offsets";
  check_positive(fn, "cp_size", cp_size);
  if (cu.empty()) throw_invalid(fn, "cu_seqlens must hold at least one offset");
  if (cu.size() != cu_padded.size())
    throw_invalid(fn, "cu_seqlens has " + std::to_string(cu.size()) + " entries, cu_seqlens_padded " +
                          std::to_string(cu_padded.size()));
  const auto check = [&](Lengths offsets, const char* name) {
    if (offsets[0] != 0) throw_invalid(fn, std::string(name) + " must start at 0, got " + std::to_string(offsets[0]));
    for (size_t i = 1; i < offsets.size(); ++i)
      if (offsets[i] < offsets[i - 1])
        throw_invalid(fn, std::string(name) + " must never decrease; entry " + std::to_string(i) + " is " +
                              std::to_string(offsets[i]) + " after " + std::to_string(offsets[i - 1]));
    if (offsets.back() > kInt32Max)
      throw_invalid(fn, std::string(name) + " ends at " + std::to_string(offsets.back()) + "; offsets must fit in int32");
  };
  check(cu, "cu_seqlens");
  check(cu_padded, "cu_seqlens_padded");
  ThdLayout out;
  out.cp_size = cp_size;
  const size_t n = cu.size() - 1;
  out.seq_lens.resize(n);
  out.padded_lens.resize(n);
  out.cu_seqlens.assign(cu.begin(), cu.end());
  out.cu_seqlens_padded.assign(cu_padded.begin(), cu_padded.end());
  for (size_t b = 0; b < n; ++b) {
    const int64_t len = cu[b + 1] - cu[b], padded = cu_padded[b + 1] - cu_padded[b];
    if (padded < len)
      throw_invalid(fn, "sequence " + std::to_string(b) + " has " + std::to_string(len) +
                            " real tokens but a padded length of " + std::to_string(padded));
    if (cp_size > 1 && padded % (2 * cp_size) != 0)
      throw_invalid(fn, "sequence " + std::to_string(b) + "'s padded length " + std::to_string(padded) +
                            " is not a multiple of 2 * cp_size = " + std::to_string(2 * cp_size) +
                            " (context parallelism)");
    out.seq_lens[b] = len;
    out.padded_lens[b] = padded;
    out.max_seqlen = std::max(out.max_seqlen, len);
    out.max_seqlen_padded = std::max(out.max_seqlen_padded, padded);
  }
  return out;
}

SourceSpans spans_from_lengths(Lengths seq_lens, int64_t width) {
  constexpr const char* fn = "spans_from_lengths";
  if (width < 0) throw_invalid(fn, "width must be >= 0");
  check_non_negative_lengths(fn, "seq_lens", seq_lens);
  check_lengths_fit(fn, "seq_lens", seq_lens, width, "the padded width");
  checked_mul(fn, "batch * width", static_cast<int64_t>(seq_lens.size()), width);  // the padded rows fit in int64
  SourceSpans out;
  out.width = width;
  out.spans.reserve(seq_lens.size());
  for (size_t b = 0; b < seq_lens.size(); ++b) {
    if (seq_lens[b] > 0) out.spans.push_back({static_cast<int64_t>(b) * width, seq_lens[b]});
    out.offsets.push_back(static_cast<int64_t>(out.spans.size()));
  }
  return out;
}

SourceSpans spans_from_mask(const uint8_t* mask, int64_t batch, int64_t width) {
  constexpr const char* fn = "spans_from_mask";
  if (batch < 0 || width < 0) throw_invalid(fn, "the mask shape must be non-negative");
  if (checked_mul(fn, "batch * width", batch, width) > 0 && mask == nullptr) throw_invalid(fn, "mask is null");
  SourceSpans out;
  out.width = width;
  out.offsets.reserve(static_cast<size_t>(batch) + 1);
  for (int64_t b = 0; b < batch; ++b) {
    const uint8_t* row = mask + b * width;
    int64_t s = 0;
    while (s < width) {
      while (s < width && row[s] == 0) ++s;
      const int64_t start = s;
      while (s < width && row[s] != 0) ++s;
      if (s > start) out.spans.push_back({b * width + start, s - start});
    }
    out.offsets.push_back(static_cast<int64_t>(out.spans.size()));
  }
  return out;
}

std::vector<int64_t> span_lengths(const SourceSpans& source) {
  std::vector<int64_t> out(static_cast<size_t>(source.batch_size()), 0);
  for (int64_t b = 0; b < source.batch_size(); ++b)
    for (int64_t k = source.offsets[b]; k < source.offsets[b + 1]; ++k) out[b] += source.spans[k].count;
  return out;
}

MovePlan make_pack_plan(const ThdLayout& layout, const SourceSpans& source, int64_t cp_rank) {
  constexpr const char* fn = "make_pack_plan";
  const int64_t cp = layout.cp_size;
  if (cp_rank < 0 || cp_rank >= cp)
    throw_invalid(fn, "cp_rank must be in [0, cp_size=" + std::to_string(cp) + "), got " + std::to_string(cp_rank));
  if (source.batch_size() != layout.batch_size())
    throw_invalid(fn, "the source has " + std::to_string(source.batch_size()) + " sequences, the layout " +
                          std::to_string(layout.batch_size()));
  const std::vector<int64_t> real = span_lengths(source);
  for (int64_t b = 0; b < layout.batch_size(); ++b)
    if (real[b] != layout.seq_lens[b])
      throw_invalid(fn, "sequence " + std::to_string(b) + " has " + std::to_string(real[b]) +
                            " tokens in the source but seq_lens says " + std::to_string(layout.seq_lens[b]));
  MovePlan plan;
  plan.src_rows = checked_mul(fn, "batch * width", source.batch_size(), source.width);
  plan.dst_rows = layout.local_rows();
  plan.copies.reserve(source.spans.size() * static_cast<size_t>(cp > 1 ? 2 : 1));
  plan.fills.reserve(static_cast<size_t>(layout.batch_size()));
  plan.positions.reserve(static_cast<size_t>(layout.batch_size()) * static_cast<size_t>(cp > 1 ? 2 : 1));
  // One piece of a sequence: its positions [from, from + count) land at dst.
  auto emit = [&](int64_t b, int64_t from, int64_t count, int64_t dst) {
    if (count == 0) return;
    plan.positions.push_back({dst, count, from});
    const int64_t len = layout.seq_lens[b];
    const int64_t real_end = std::min(from + count, len);
    // Copy the real positions in [from, real_end) span by span.
    int64_t pos = 0;  // sequence position where the current span starts
    for (int64_t k = source.offsets[b]; k < source.offsets[b + 1] && pos < real_end; ++k) {
      const Span& sp = source.spans[k];
      const int64_t lo = std::max(from, pos), hi = std::min(real_end, pos + sp.count);
      if (lo < hi) {
        const int64_t d = dst + (lo - from);
        CopyRun run{sp.start + (lo - pos), d, hi - lo};
        if (!plan.copies.empty()) {  // merge with the previous run when both sides continue
          CopyRun& last = plan.copies.back();
          if (last.src + last.count == run.src && last.dst + last.count == run.dst) {
            last.count += run.count;
            pos += sp.count;
            continue;
          }
        }
        plan.copies.push_back(run);
      }
      pos += sp.count;
    }
    const int64_t pad_from = std::max(from, len);
    if (pad_from < from + count) plan.fills.push_back({dst + (pad_from - from), from + count - pad_from});
  };
  for (int64_t b = 0; b < layout.batch_size(); ++b) {
    const int64_t L = layout.padded_lens[b];
    const int64_t base = layout.cu_seqlens_padded[b] / cp;
    if (cp == 1) {
      emit(b, 0, L, base);
    } else {
      const int64_t chunk = L / (2 * cp);
      emit(b, cp_rank * chunk, chunk, base);
      emit(b, (2 * cp - 1 - cp_rank) * chunk, chunk, base + chunk);
    }
  }
  return plan;
}

MovePlan make_unpack_plan(const MovePlan& pack_plan, int64_t padded_rows) {
  constexpr const char* fn = "make_unpack_plan";
  if (padded_rows < pack_plan.src_rows)
    throw_invalid(fn, "padded_rows (" + std::to_string(padded_rows) + ") is below the rows the pack read (" +
                          std::to_string(pack_plan.src_rows) + ")");
  MovePlan plan;
  plan.src_rows = pack_plan.dst_rows;
  plan.dst_rows = padded_rows;
  plan.copies.reserve(pack_plan.copies.size());
  for (const CopyRun& r : pack_plan.copies) plan.copies.push_back({r.dst, r.src, r.count});
  std::vector<CopyRun> by_dst = plan.copies;
  std::sort(by_dst.begin(), by_dst.end(), [](const CopyRun& a, const CopyRun& b) { return a.dst < b.dst; });
  int64_t covered = 0;
  for (const CopyRun& r : by_dst) {
    if (r.dst > covered) plan.fills.push_back({covered, r.dst - covered});
    covered = r.dst + r.count;
  }
  if (padded_rows > covered) plan.fills.push_back({covered, padded_rows - covered});
  return plan;
}

}  // namespace seqpack
