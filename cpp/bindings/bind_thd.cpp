// THD plans for seqpack.tensors: a plan is built once from host lengths or a host
// mask; tensors to move arrive as DLPack (tensor.hpp), checked here against the
// plan's sizes before any byte moves, so the extension never links libtorch.
#include <cstring>
#include <optional>

#include "convert.hpp"
#include "tensor.hpp"
#include "seqpack/cp.hpp"
#include "seqpack/move.hpp"
#include "seqpack/thd.hpp"

namespace seqpack::bindings {
namespace {

template <typename T>
py::array_t<T> array_of(const std::vector<T>& v) {
  py::array_t<T> out(static_cast<py::ssize_t>(v.size()));
  if (!v.empty()) std::memcpy(out.mutable_data(), v.data(), v.size() * sizeof(T));
  return out;
}

// The pack plan of one rank and its inverse, with the layout they share. The
// inverse is built on first use (with the GIL held): many batches never unpack.
struct ThdPlan {
  ThdLayout layout;
  MovePlan pack;
  int64_t batch = 0, width = 0, cp_rank = 0;
  std::optional<MovePlan> unpack_plan;

  const MovePlan& unpack() {
    if (!unpack_plan) unpack_plan = make_unpack_plan(pack, batch * width);
    return *unpack_plan;
  }
};

// Runs as NumPy arrays [n, 3] (src, dst, count) / [n, 2] (dst, count) / [n, 3]
// (dst, count, first): what a device launcher or a reference needs.
py::array_t<int64_t> copies_array(const std::vector<CopyRun>& runs) {
  py::array_t<int64_t> out({static_cast<py::ssize_t>(runs.size()), py::ssize_t{3}});
  auto m = out.mutable_unchecked<2>();
  for (size_t i = 0; i < runs.size(); ++i) {
    m(i, 0) = runs[i].src;
    m(i, 1) = runs[i].dst;
    m(i, 2) = runs[i].count;
  }
  return out;
}

py::array_t<int64_t> fills_array(const std::vector<FillRun>& runs) {
  py::array_t<int64_t> out({static_cast<py::ssize_t>(runs.size()), py::ssize_t{2}});
  auto m = out.mutable_unchecked<2>();
  for (size_t i = 0; i < runs.size(); ++i) {
    m(i, 0) = runs[i].dst;
    m(i, 1) = runs[i].count;
  }
  return out;
}

py::array_t<int64_t> tasks_array(const MovePlan& plan, size_t row_bytes, size_t max_task_bytes) {
  std::vector<ByteTask> tasks;
  {
    py::gil_scoped_release release;
    tasks = make_byte_tasks(plan, row_bytes, max_task_bytes);
  }
  py::array_t<int64_t> out({static_cast<py::ssize_t>(tasks.size()), py::ssize_t{3}});
  static_assert(sizeof(ByteTask) == 3 * sizeof(int64_t), "ByteTask is three int64s");
  if (!tasks.empty()) std::memcpy(out.mutable_data(), tasks.data(), tasks.size() * sizeof(ByteTask));
  return out;
}

std::string fill_row(const std::optional<py::bytes>& fill, int64_t row_bytes) {
  if (!fill) return {};
  std::string bytes = *fill;
  if (static_cast<int64_t>(bytes.size()) != row_bytes)
    throw py::value_error("fill must be one row (" + std::to_string(row_bytes) + " bytes), got " +
                          std::to_string(bytes.size()));
  return bytes;
}

// Runs `plan` between CPU tensors whose geometry move_geometry has checked.
void run_plan(const MovePlan& plan, const TensorArg& src, const TensorArg& dst, const MoveGeometry& g,
              const std::optional<py::bytes>& fill, int num_threads) {
  const std::string fill_bytes = fill_row(fill, g.row_bytes);
  py::gil_scoped_release release;
  execute_move_plan(plan, src.data(), g.src_rows, dst.data(), g.dst_rows, static_cast<size_t>(g.row_bytes),
                    fill ? fill_bytes.data() : nullptr, num_threads);
}

// ThdPlan.pack_into / unpack_into: padded [batch, width, ...] <-> packed [rows, ...].
template <typename Which>
auto move_by(Which which, bool packing) {
  return [which, packing](ThdPlan& p, py::handle src_obj, py::handle dst_obj, const std::optional<py::bytes>& fill,
                          int num_threads) {
    const char* fn = packing ? "ThdPlan.pack_into" : "ThdPlan.unpack_into";
    TensorArg src(src_obj, fn, "src"), dst(dst_obj, fn, "dst");
    dst.writable();
    const TensorArg& padded = packing ? src : dst;
    const TensorArg& packed = packing ? dst : src;
    if (padded.ndim() < 2 || padded.size(0) != p.batch || padded.size(1) != p.width)
      throw py::value_error(std::string("[") + fn + "] " + padded.name() + " must start with [batch, width] = [" +
                            std::to_string(p.batch) + ", " + std::to_string(p.width) + "]");
    if (packed.ndim() < 1 || packed.size(0) != p.pack.dst_rows)
      throw py::value_error(std::string("[") + fn + "] " + packed.name() + " must have " +
                            std::to_string(p.pack.dst_rows) + " rows (the plan's packed rows)");
    src.on_cpu();
    run_plan(which(p), src, dst, move_geometry(src, packing ? 2 : 1, dst, packing ? 1 : 2), fill, num_threads);
  };
}

// A MovePlan from run arrays ([n, 3] copies, [n, 2] fills), as the torch ops carry
// them; the executor validates every run against the buffer sizes.
MovePlan plan_from_runs(py::handle copies, py::handle fills, int64_t src_rows, int64_t dst_rows) {
  auto c = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(copies);
  auto f = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(fills);
  if (!c || c.ndim() != 2 || c.shape(1) != 3) throw py::value_error("copies must be an int64 array [n, 3]");
  if (!f || f.ndim() != 2 || f.shape(1) != 2) throw py::value_error("fills must be an int64 array [n, 2]");
  MovePlan plan;
  plan.src_rows = src_rows;
  plan.dst_rows = dst_rows;
  plan.copies.resize(static_cast<size_t>(c.shape(0)));
  plan.fills.resize(static_cast<size_t>(f.shape(0)));
  if (!plan.copies.empty()) std::memcpy(plan.copies.data(), c.data(), plan.copies.size() * sizeof(CopyRun));
  if (!plan.fills.empty()) std::memcpy(plan.fills.data(), f.data(), plan.fills.size() * sizeof(FillRun));
  return plan;
}

// ---- pickling: a layout is its offsets, a plan its layout and runs -------------
// A restored object is checked as a caller's offsets and runs are (a pickle may
// come from anywhere), never planned again: the runs are the plan.

py::tuple layout_state(const ThdLayout& l) {
  return py::make_tuple(array_of(l.cu_seqlens), array_of(l.cu_seqlens_padded), l.cp_size);
}

ThdLayout layout_from_state(const py::tuple& t) {
  if (t.size() != 3) throw py::value_error("ThdLayout pickle: expected (cu_seqlens, cu_seqlens_padded, cp_size)");
  LengthsArg cu(t[0], "cu_seqlens"), padded(t[1], "cu_seqlens_padded");
  const auto cp_size = t[2].cast<int64_t>();
  py::gil_scoped_release release;
  return thd_layout_from_offsets(cu.view(), padded.view(), cp_size);
}

template <typename Run>
std::vector<Run> runs_from(py::handle obj, const char* name) {
  constexpr py::ssize_t fields = sizeof(Run) / sizeof(int64_t);
  // No forcecast: integer arrays widen safely, a float array is refused, not truncated.
  auto a = py::array_t<int64_t, py::array::c_style>::ensure(obj);
  if (!a || a.ndim() != 2 || a.shape(1) != fields)
    throw py::value_error(std::string("ThdPlan pickle: ") + name + " must be an int64 array [n, " +
                          std::to_string(fields) + "]");
  std::vector<Run> runs(static_cast<size_t>(a.shape(0)));
  if (!runs.empty()) std::memcpy(runs.data(), a.data(), runs.size() * sizeof(Run));
  return runs;
}

py::array_t<int64_t> positions_array(const std::vector<PositionRun>& runs) {
  py::array_t<int64_t> out({static_cast<py::ssize_t>(runs.size()), py::ssize_t{3}});
  static_assert(sizeof(PositionRun) == 3 * sizeof(int64_t), "three int64s");
  if (!runs.empty()) std::memcpy(out.mutable_data(), runs.data(), runs.size() * sizeof(PositionRun));
  return out;
}

py::tuple plan_state(const ThdPlan& p) {
  return py::make_tuple(layout_state(p.layout), p.batch, p.width, p.cp_rank, copies_array(p.pack.copies),
                        fills_array(p.pack.fills), positions_array(p.pack.positions), p.pack.src_rows,
                        p.pack.dst_rows);
}

ThdPlan plan_from_state(const py::tuple& t) {
  constexpr const char* fn = "ThdPlan.__setstate__";
  if (t.size() != 9) throw py::value_error("ThdPlan pickle: expected 9 fields");
  ThdPlan p;
  p.layout = layout_from_state(t[0].cast<py::tuple>());
  p.batch = t[1].cast<int64_t>();
  p.width = t[2].cast<int64_t>();
  p.cp_rank = t[3].cast<int64_t>();
  p.pack.copies = runs_from<CopyRun>(t[4], "copies");
  p.pack.fills = runs_from<FillRun>(t[5], "fills");
  p.pack.positions = runs_from<PositionRun>(t[6], "positions");
  p.pack.src_rows = t[7].cast<int64_t>();
  p.pack.dst_rows = t[8].cast<int64_t>();
  if (p.batch != p.layout.batch_size() || p.width < 0 || p.cp_rank < 0 || p.cp_rank >= p.layout.cp_size ||
      p.pack.src_rows != checked_mul(fn, "batch * width", p.batch, p.width) || p.pack.dst_rows != p.layout.local_rows())
    throw_invalid(fn, "the plan's sizes do not match its layout (corrupt pickle)");
  check_move_plan(p.pack, fn);
  return p;
}

}  // namespace

void init_thd(py::module_& m) {
  static_assert(sizeof(CopyRun) == 3 * sizeof(int64_t) && sizeof(FillRun) == 2 * sizeof(int64_t));
  m.def(
      "move_rows",
      [](py::handle copies, py::handle fills, py::handle src_obj, int src_lead, py::handle dst_obj, int dst_lead,
         const std::optional<py::bytes>& fill, int num_threads) {
        TensorArg src(src_obj, "move_rows", "src"), dst(dst_obj, "move_rows", "dst");
        dst.writable();
        src.on_cpu();
        const MoveGeometry g = move_geometry(src, src_lead, dst, dst_lead);
        run_plan(plan_from_runs(copies, fills, g.src_rows, g.dst_rows), src, dst, g, fill, num_threads);
      },
      py::arg("copies"), py::arg("fills"), py::arg("src"), py::arg("src_lead"), py::arg("dst"), py::arg("dst_lead"),
      py::arg("fill") = py::none(), py::arg("num_threads") = 0,
      "Run copy/fill runs between CPU tensors (the CPU kernel of the seqpack torch ops); the first "
      "src_lead / dst_lead dimensions are rows.");
  m.def(
      "byte_tasks",
      [](py::handle copies, py::handle fills, int64_t src_rows, int64_t dst_rows, size_t row_bytes,
         size_t max_task_bytes) {
        return tasks_array(plan_from_runs(copies, fills, src_rows, dst_rows), row_bytes, max_task_bytes);
      },
      py::arg("copies"), py::arg("fills"), py::arg("src_rows"), py::arg("dst_rows"), py::arg("row_bytes"),
      py::arg("max_task_bytes"));
  py::class_<ThdLayout>(m, "ThdLayout", "Offsets and lengths of a packed batch (seqpack.PackedLayout's core).")
      .def_readonly("cp_size", &ThdLayout::cp_size)
      .def_readonly("max_seqlen", &ThdLayout::max_seqlen)
      .def_readonly("max_seqlen_padded", &ThdLayout::max_seqlen_padded)
      .def_property_readonly("seq_lens", [](const ThdLayout& l) { return array_of(l.seq_lens); })
      .def_property_readonly("padded_lens", [](const ThdLayout& l) { return array_of(l.padded_lens); })
      .def_property_readonly("cu_seqlens", [](const ThdLayout& l) { return array_of(l.cu_seqlens); })
      .def_property_readonly("cu_seqlens_padded", [](const ThdLayout& l) { return array_of(l.cu_seqlens_padded); })
      .def(py::pickle(&layout_state, &layout_from_state));
  m.def(
      "thd_layout",
      [](py::handle seq_lens, int64_t pad_multiple, int64_t pad_packed_to, int64_t pad_packed_multiple,
         int64_t cp_size) {
        LengthsArg lens(seq_lens, "seq_lens");
        py::gil_scoped_release release;
        return make_thd_layout(lens.view(), ThdOptions{pad_multiple, pad_packed_to, pad_packed_multiple, cp_size});
      },
      py::arg("seq_lens"), py::arg("pad_multiple") = 1, py::arg("pad_packed_to") = 0,
      py::arg("pad_packed_multiple") = 1, py::arg("cp_size") = 1);
  m.def(
      "thd_layout_from_offsets",
      [](py::handle cu_seqlens, py::handle cu_seqlens_padded, int64_t cp_size) {
        LengthsArg cu(cu_seqlens, "cu_seqlens"), padded(cu_seqlens_padded, "cu_seqlens_padded");
        py::gil_scoped_release release;
        return thd_layout_from_offsets(cu.view(), padded.view(), cp_size);
      },
      py::arg("cu_seqlens"), py::arg("cu_seqlens_padded"), py::arg("cp_size") = 1);
  py::class_<ThdPlan>(m, "ThdPlan", "Pack/unpack plan of one batch (and one CP rank).")
      .def_readonly("batch", &ThdPlan::batch)
      .def_readonly("width", &ThdPlan::width)
      .def_readonly("cp_rank", &ThdPlan::cp_rank)
      .def_readonly("layout", &ThdPlan::layout)
      .def_property_readonly("cp_size", [](const ThdPlan& p) { return p.layout.cp_size; })
      .def_property_readonly("seq_lens", [](const ThdPlan& p) { return array_of(p.layout.seq_lens); })
      .def_property_readonly("padded_lens", [](const ThdPlan& p) { return array_of(p.layout.padded_lens); })
      .def_property_readonly("cu_seqlens", [](const ThdPlan& p) { return array_of(p.layout.cu_seqlens); })
      .def_property_readonly("cu_seqlens_padded",
                             [](const ThdPlan& p) { return array_of(p.layout.cu_seqlens_padded); })
      .def_property_readonly("max_seqlen", [](const ThdPlan& p) { return p.layout.max_seqlen; })
      .def_property_readonly("max_seqlen_padded", [](const ThdPlan& p) { return p.layout.max_seqlen_padded; })
      .def_property_readonly("total_padded", [](const ThdPlan& p) { return p.layout.total_padded(); })
      .def_property_readonly("local_rows", [](const ThdPlan& p) { return p.pack.dst_rows; })
      .def_property_readonly("pack_copies", [](const ThdPlan& p) { return copies_array(p.pack.copies); })
      .def_property_readonly("pack_fills", [](const ThdPlan& p) { return fills_array(p.pack.fills); })
      .def_property_readonly("unpack_copies", [](ThdPlan& p) { return copies_array(p.unpack().copies); })
      .def_property_readonly("unpack_fills", [](ThdPlan& p) { return fills_array(p.unpack().fills); })
      .def_property_readonly("position_runs", [](const ThdPlan& p) { return positions_array(p.pack.positions); })
      .def(py::pickle(&plan_state, &plan_from_state))
      .def("pack_into", move_by([](ThdPlan& p) -> const MovePlan& { return p.pack; }, true), py::arg("src"),
           py::arg("dst"), py::arg("fill") = py::none(), py::arg("num_threads") = 0,
           "Pack CPU tensor src [batch, width, ...] into dst [rows, ...] by this plan.")
      .def("unpack_into", move_by([](ThdPlan& p) -> const MovePlan& { return p.unpack(); }, false), py::arg("src"),
           py::arg("dst"), py::arg("fill") = py::none(), py::arg("num_threads") = 0,
           "Unpack CPU tensor src [rows, ...] into dst [batch, width, ...] by this plan.")
      .def(
          "position_ids_into",
          [](const ThdPlan& p, py::handle out_obj) {
            TensorArg out(out_obj, "ThdPlan.position_ids_into", "out");
            out.on_cpu().shape({p.pack.dst_rows}).dtype_is(Dtype::I64).contiguous();
            py::gil_scoped_release release;
            write_position_ids(p.pack, out.ptr<int64_t>(), p.pack.dst_rows);
          },
          py::arg("out"), "Position ids of the packed rows into a CPU int64 tensor [rows].");

  m.def(
      "thd_plan",
      [](py::handle seq_lens, py::handle mask, int64_t batch, int64_t width, int64_t pad_multiple,
         int64_t pad_packed_to, int64_t pad_packed_multiple, int64_t cp_size, int64_t cp_rank) {
        ThdPlan plan;
        plan.batch = batch;
        plan.width = width;
        plan.cp_rank = cp_rank;
        ThdOptions o{pad_multiple, pad_packed_to, pad_packed_multiple, cp_size};
        std::optional<LengthsArg> lens;
        py::array_t<uint8_t, py::array::c_style> mask_bytes;
        if (!mask.is_none()) {
          mask_bytes = py::array_t<uint8_t, py::array::c_style>::ensure(mask);
          if (!mask_bytes || mask_bytes.ndim() != 2 || mask_bytes.shape(0) != batch || mask_bytes.shape(1) != width)
            throw py::value_error("attention_mask must be a [batch, width] uint8/bool array");
        } else {
          lens.emplace(seq_lens, "seq_lens");
          if (static_cast<int64_t>(lens->view().size()) != batch)
            throw py::value_error("seq_lens has " + std::to_string(lens->view().size()) + " entries for a batch of " +
                                  std::to_string(batch));
        }
        {
          py::gil_scoped_release release;
          const SourceSpans spans =
              lens ? spans_from_lengths(lens->view(), width) : spans_from_mask(mask_bytes.data(), batch, width);
          plan.layout = make_thd_layout(span_lengths(spans), o);
          plan.pack = make_pack_plan(plan.layout, spans, cp_rank);
        }
        return plan;
      },
      py::arg("seq_lens"), py::arg("mask"), py::arg("batch"), py::arg("width"), py::arg("pad_multiple") = 1,
      py::arg("pad_packed_to") = 0, py::arg("pad_packed_multiple") = 1, py::arg("cp_size") = 1,
      py::arg("cp_rank") = 0);

  m.def(
      "thd_plan_for_layout",
      [](const ThdLayout& layout, int64_t width, int64_t cp_rank) {
        ThdPlan plan;
        plan.batch = layout.batch_size();
        plan.width = width;
        plan.cp_rank = cp_rank;
        plan.layout = layout;
        py::gil_scoped_release release;
        plan.pack = make_pack_plan(plan.layout, spans_from_lengths(plan.layout.seq_lens, width), cp_rank);
        return plan;
      },
      py::arg("layout"), py::arg("width"), py::arg("cp_rank") = 0,
      "The pack/unpack plan of right-padded rows [B, width] into an existing layout.");
  m.def(
      "cp_partition_indices",
      [](py::handle cu_seqlens_padded, int64_t cp_size, int64_t cp_rank) {
        return map_lengths(cu_seqlens_padded, "cu_seqlens_padded",
                           [&](Lengths cu) { return cp_partition_indices(cu, cp_size, cp_rank); });
      },
      py::arg("cu_seqlens_padded"), py::arg("cp_size"), py::arg("cp_rank"));
  m.def(
      "cp_restore_order",
      [](py::handle cu_seqlens_padded, int64_t cp_size) {
        return map_lengths(cu_seqlens_padded, "cu_seqlens_padded",
                           [&](Lengths cu) { return cp_restore_order(cu, cp_size); });
      },
      py::arg("cu_seqlens_padded"), py::arg("cp_size"));
}

}  // namespace seqpack::bindings
