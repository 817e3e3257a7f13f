// seqpack._core: thin bindings over the C++ core. Arguments are converted while
// holding the GIL; every core call then runs with the GIL released. The core
// throws std::invalid_argument, which pybind11 raises as ValueError.
#include <pybind11/pybind11.h>

#include <optional>

#include "seqpack/common.hpp"
#include "tensor.hpp"

#ifdef SEQPACK_WITH_CUDA
#include "seqpack/cuda_device.hpp"
#include "seqpack/cuda_move.hpp"
#endif

namespace py = pybind11;

namespace seqpack::bindings {
void init_packing(py::module_& m);
void init_partition(py::module_& m);
void init_step(py::module_& m);
void init_dynamic_batching(py::module_& m);
void init_metrics(py::module_& m);
void init_thd(py::module_& m);
void init_logprob(py::module_& m);
void init_prefix_tree(py::module_& m);
void init_prefix_forest(py::module_& m);
void init_pylists(py::module_& m);
}  // namespace seqpack::bindings

PYBIND11_MODULE(_core, m) {
  m.doc() = "seqpack C++ core (planning, THD plans); use the seqpack package, not this module.";
  seqpack::bindings::init_packing(m);
  seqpack::bindings::init_partition(m);
  seqpack::bindings::init_step(m);
  seqpack::bindings::init_dynamic_batching(m);
  seqpack::bindings::init_metrics(m);
  seqpack::bindings::init_thd(m);
  seqpack::bindings::init_logprob(m);
  seqpack::bindings::init_prefix_tree(m);
  seqpack::bindings::init_prefix_forest(m);
  seqpack::bindings::init_pylists(m);
  m.def(
      "advise_huge_pages",
      [](py::handle obj) {
        seqpack::bindings::TensorArg t(obj, "advise_huge_pages", "tensor");
        t.on_cpu().contiguous();
        return seqpack::advise_huge_pages(t.data(), static_cast<size_t>(t.numel() * t.element_size()));
      },
      py::arg("tensor"),
      "madvise(MADV_HUGEPAGE) on the 2 MiB-aligned interior of a fresh CPU tensor; False where unsupported.");
#ifdef SEQPACK_WITH_CUDA
  m.attr("built_with_cuda") = true;
  m.attr("cuda_architectures") = SEQPACK_CUDA_ARCHITECTURES;  // CMake's list, e.g. "80-real,86-real,89-real,90"
  m.def("cuda_device_count", &seqpack::cuda::device_count);
  m.def("cuda_runtime_version", &seqpack::cuda::runtime_version);
  m.def("cuda_device_name", &seqpack::cuda::device_name, py::arg("index") = 0);
  // Device tensors (DLPack) and the caller's cudaStream_t; sizes come from the tensors.
  m.def(
      "cuda_move",
      [](py::handle src_obj, int src_lead, py::handle dst_obj, int dst_lead, py::handle tasks_obj,
         py::handle fill_obj, uintptr_t stream) {
        using seqpack::bindings::Dtype;
        using seqpack::bindings::TensorArg;
        constexpr const char* fn = "cuda_move";
        TensorArg src(src_obj, fn, "src"), dst(dst_obj, fn, "dst"), tasks(tasks_obj, fn, "tasks");
        dst.writable();
        if (!src.on_cuda()) throw py::value_error("[cuda_move] src must be on a CUDA device");
        const int64_t row_bytes = seqpack::bindings::move_geometry(src, src_lead, dst, dst_lead).row_bytes;
        tasks.shape({-1, 3}).dtype_is(Dtype::I64).contiguous().same_device(src);
        const char* fill_row = nullptr;
        std::optional<TensorArg> fill;
        if (!fill_obj.is_none()) {
          fill.emplace(fill_obj, fn, "fill");
          fill->shape({row_bytes}).dtype_is(Dtype::U8).contiguous().same_device(src);
          fill_row = fill->ptr<const char>();
        }
        const seqpack::MoveBuffers buffers{src.ptr<const char>(), src.numel() * src.element_size(), dst.ptr<char>(),
                                           dst.numel() * dst.element_size(), fill_row, row_bytes};
        seqpack::cuda::launch_move(buffers, tasks.ptr<const seqpack::ByteTask>(), tasks.size(0),
                                   reinterpret_cast<void*>(stream));
      },
      py::arg("src"), py::arg("src_lead"), py::arg("dst"), py::arg("dst_lead"), py::arg("tasks"), py::arg("fill"),
      py::arg("stream"));
  m.def(
      "cuda_positions",
      [](py::handle runs_obj, py::handle out_obj, uintptr_t stream) {
        using seqpack::bindings::Dtype;
        using seqpack::bindings::TensorArg;
        TensorArg runs(runs_obj, "cuda_positions", "runs"), out(out_obj, "cuda_positions", "out");
        if (!out.on_cuda()) throw py::value_error("[cuda_positions] out must be on a CUDA device");
        out.dims(1).dtype_is(Dtype::I64).contiguous();
        runs.shape({-1, 3}).dtype_is(Dtype::I64).contiguous().same_device(out);
        seqpack::cuda::launch_positions(runs.ptr<const seqpack::PositionRun>(), runs.size(0), out.ptr<int64_t>(),
                                        out.size(0), reinterpret_cast<void*>(stream));
      },
      py::arg("runs"), py::arg("out"), py::arg("stream"));
#else
  m.attr("built_with_cuda") = false;
  m.attr("cuda_architectures") = "";
  m.def("cuda_device_count", []() { return 0; });
  m.def("cuda_runtime_version", []() { return 0; });
  m.def("cuda_device_name", [](int) { return std::string(); }, py::arg("index") = 0);
#endif
}
