// THD plans end to end, on real buffers: a layout from lengths (or from offsets),
// source spans from lengths or from an arbitrary mask, a pack plan per CP rank and
// its unpack plan. Checks: each real token lands at its sequence's offset (zigzag
// chunks with CP) with every other row the fill; position ids are positions in the
// sequence; unpacking restores every token the rank holds and fills the rest; the
// byte tasks of a device launch move the same bytes as the CPU executor.
#include "fuzz.hpp"
#include "seqpack/move.hpp"
#include "seqpack/move_task.hpp"
#include "seqpack/thd.hpp"

using namespace seqpack;
using namespace seqpack_fuzz;

namespace {

constexpr int64_t kMaxRows = 1 << 14;  // buffers stay small; larger plans are only planned

// Source row r holds bytes derived from r (never the fill byte 0xEE).
uint8_t source_byte(int64_t row, size_t j) { return static_cast<uint8_t>((row * 7 + static_cast<int64_t>(j)) % 200); }
constexpr uint8_t kFill = 0xEE;

void run_pack(const ThdLayout& layout, const SourceSpans& source, int64_t cp_rank, size_t row_bytes,
              size_t max_task_bytes, int64_t lanes) {
  const MovePlan pack = make_pack_plan(layout, source, cp_rank);
  FUZZ_REQUIRE(pack.src_rows == static_cast<__int128>(source.batch_size()) * source.width);
  const int64_t padded_rows = pack.src_rows;
  const MovePlan unpack = make_unpack_plan(pack, padded_rows);
  FUZZ_REQUIRE(pack.dst_rows == layout.local_rows() && unpack.dst_rows == padded_rows);
  if (padded_rows > kMaxRows || pack.dst_rows > kMaxRows) return;

  std::vector<uint8_t> src(static_cast<size_t>(padded_rows) * row_bytes), fill(row_bytes, kFill);
  for (int64_t r = 0; r < padded_rows; ++r)
    for (size_t j = 0; j < row_bytes; ++j) src[static_cast<size_t>(r) * row_bytes + j] = source_byte(r, j);
  std::vector<uint8_t> thd(static_cast<size_t>(pack.dst_rows) * row_bytes, 0x11);
  execute_move_plan(pack, src.data(), padded_rows, thd.data(), pack.dst_rows, row_bytes, fill.data(), 1);
  std::vector<int64_t> positions(static_cast<size_t>(pack.dst_rows), -1);
  write_position_ids(pack, positions.data(), pack.dst_rows);

  // Expected local THD: sequence b's positions [from, from + chunk) in zigzag order.
  const int64_t cp = layout.cp_size;
  for (int64_t b = 0; b < layout.batch_size(); ++b) {
    std::vector<int64_t> rows_of_b;  // source row of each real position of b
    for (int64_t k = source.offsets[b]; k < source.offsets[b + 1]; ++k)
      for (int64_t i = 0; i < source.spans[k].count; ++i) rows_of_b.push_back(source.spans[k].start + i);
    const int64_t L = layout.padded_lens[b], base = layout.cu_seqlens_padded[b] / cp;
    const int64_t chunk = cp == 1 ? L : L / (2 * cp);
    const int64_t starts[2] = {cp == 1 ? 0 : cp_rank * chunk, (2 * cp - 1 - cp_rank) * chunk};
    for (int part = 0; part < (cp == 1 ? 1 : 2); ++part)
      for (int64_t i = 0; i < chunk; ++i) {
        const int64_t pos = starts[part] + i, at = base + part * chunk + i;
        FUZZ_REQUIRE(positions[static_cast<size_t>(at)] == pos);
        for (size_t j = 0; j < row_bytes; ++j) {
          const uint8_t want = pos < layout.seq_lens[b] ? source_byte(rows_of_b[static_cast<size_t>(pos)], j) : kFill;
          FUZZ_REQUIRE(thd[static_cast<size_t>(at) * row_bytes + j] == want);
        }
      }
  }

  // The device path's byte tasks, replayed on the host, give the same THD.
  std::vector<uint8_t> thd_tasks(thd.size(), 0x22);
  const auto tasks = make_byte_tasks(pack, row_bytes, max_task_bytes);
  MoveBuffers buffers{reinterpret_cast<const char*>(src.data()), static_cast<int64_t>(src.size()),
                      reinterpret_cast<char*>(thd_tasks.data()), static_cast<int64_t>(thd_tasks.size()),
                      reinterpret_cast<const char*>(fill.data()), static_cast<int64_t>(row_bytes)};
  execute_byte_tasks(tasks, buffers, 1, lanes);
  FUZZ_REQUIRE(thd_tasks == thd);

  // Unpacking gives back every token this rank holds; every other row is the fill.
  std::vector<uint8_t> back(src.size(), 0x33);
  execute_move_plan(unpack, thd.data(), pack.dst_rows, back.data(), padded_rows, row_bytes, fill.data(), 1);
  std::vector<char> held(static_cast<size_t>(padded_rows), 0);
  for (const CopyRun& r : pack.copies)
    for (int64_t i = 0; i < r.count; ++i) held[static_cast<size_t>(r.src + i)] = 1;
  for (int64_t r = 0; r < padded_rows; ++r)
    for (size_t j = 0; j < row_bytes; ++j)
      FUZZ_REQUIRE(back[static_cast<size_t>(r) * row_bytes + j] == (held[static_cast<size_t>(r)] ? source_byte(r, j) : kFill));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Input in(data, size);
  const auto batch = in.in_range(0, 6);
  const int64_t width = in.flag() ? in.in_range(0, 24) : in.edgy(24);
  const bool from_mask = in.flag(), from_offsets = in.flag();
  ThdOptions o;
  o.cp_size = in.flag() ? in.in_range(1, 3) : in.edgy(3);
  // Mostly a valid multiple of 2 * cp_size; otherwise anything, for the core to refuse.
  const bool valid_multiple = in.flag() && o.cp_size >= 1 && o.cp_size <= 3;
  o.pad_multiple = valid_multiple ? 2 * o.cp_size * in.in_range(1, 3) : in.edgy(8);
  o.pad_packed_multiple = in.flag() ? in.edgy(16) : 1;
  o.pad_packed_to = in.flag() ? in.edgy(128) : 0;
  const auto row_bytes = static_cast<size_t>(in.in_range(1, 9));
  const auto max_task_bytes = static_cast<size_t>(in.in_range(0, 40));
  const int64_t lanes = in.in_range(1, 5);

  return run([&] {
    SourceSpans source;
    std::vector<int64_t> seq_lens(static_cast<size_t>(batch));
    if (from_mask && width >= 0 && width <= 64) {
      std::vector<uint8_t> mask(static_cast<size_t>(batch * width));
      for (auto& m : mask) m = in.flag() ? static_cast<uint8_t>(in.bits(1)) : 0;
      source = spans_from_mask(mask.data(), batch, width);
      seq_lens = span_lengths(source);
    } else {
      for (auto& s : seq_lens) s = in.flag() ? in.in_range(0, std::max<int64_t>(0, std::min<int64_t>(width, 64))) : in.edgy(32);
      source = spans_from_lengths(seq_lens, width);
    }
    ThdLayout layout = make_thd_layout(seq_lens, o);
    if (from_offsets) {  // the same layout rebuilt from its offsets
      const std::vector<int64_t> cu(layout.cu_seqlens.begin(), layout.cu_seqlens.end());
      const std::vector<int64_t> cu_padded(layout.cu_seqlens_padded.begin(), layout.cu_seqlens_padded.end());
      const ThdLayout again = thd_layout_from_offsets(cu, cu_padded, layout.cp_size);
      FUZZ_REQUIRE(again.seq_lens == layout.seq_lens && again.padded_lens == layout.padded_lens);
    }
    FUZZ_REQUIRE(layout.total_padded() % layout.cp_size == 0);
    for (int64_t b = 0; b < layout.batch_size(); ++b) {
      FUZZ_REQUIRE(layout.padded_lens[b] >= layout.seq_lens[b]);
      FUZZ_REQUIRE(layout.cu_seqlens_padded[b + 1] - layout.cu_seqlens_padded[b] == layout.padded_lens[b]);
    }
    // Every rank (a huge cp_size is valid for empty sequences: its first and last rank).
    const int64_t cp = layout.cp_size;
    for (int64_t r = 0; r < cp; r = (cp > 8 && r == 0) ? cp - 1 : r + 1)
      run_pack(layout, source, r, row_bytes, max_task_bytes, lanes);
  });
}
