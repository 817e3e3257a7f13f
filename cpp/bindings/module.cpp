// seqpack._core: thin bindings over the C++ core. Arguments are converted while
// holding the GIL; every core call then runs with the GIL released. The core
// throws std::invalid_argument, which pybind11 raises as ValueError.
#include <pybind11/pybind11.h>

#include "seqpack/common.hpp"

#ifdef SEQPACK_WITH_CUDA
#include "seqpack/cuda_device.hpp"
#include "seqpack/cuda_move.hpp"
#endif

namespace py = pybind11;

namespace seqpack::bindings {
void init_packing(py::module_& m);
void init_partition(py::module_& m);
void init_dynamic_batching(py::module_& m);
void init_metrics(py::module_& m);
void init_thd(py::module_& m);
void init_logprob(py::module_& m);
}  // namespace seqpack::bindings

PYBIND11_MODULE(_core, m) {
  m.doc() = "seqpack C++ core (planning, THD plans); use the seqpack package, not this module.";
  seqpack::bindings::init_packing(m);
  seqpack::bindings::init_partition(m);
  seqpack::bindings::init_dynamic_batching(m);
  seqpack::bindings::init_metrics(m);
  seqpack::bindings::init_thd(m);
  seqpack::bindings::init_logprob(m);
  m.def(
      "advise_huge_pages",
      [](uintptr_t data, size_t bytes) { return seqpack::advise_huge_pages(reinterpret_cast<void*>(data), bytes); },
      py::arg("data"), py::arg("bytes"),
      "madvise(MADV_HUGEPAGE) on the 2 MiB-aligned interior of a fresh host buffer; False where unsupported.");
#ifdef SEQPACK_WITH_CUDA
  m.attr("built_with_cuda") = true;
  m.attr("cuda_architectures") = SEQPACK_CUDA_ARCHITECTURES;  // CMake's list, e.g. "80-real,86-real,89-real,90"
  m.def("cuda_device_count", &seqpack::cuda::device_count);
  m.def("cuda_runtime_version", &seqpack::cuda::runtime_version);
  m.def("cuda_device_name", &seqpack::cuda::device_name, py::arg("index") = 0);
  // Raw device pointers from torch (data_ptr) and the caller's cudaStream_t.
  m.def(
      "cuda_move",
      [](uintptr_t src, uintptr_t dst, uintptr_t tasks, int64_t num_tasks, uintptr_t fill_row, int64_t row_bytes,
         uintptr_t stream) {
        seqpack::cuda::launch_move(reinterpret_cast<const void*>(src), reinterpret_cast<void*>(dst),
                                   reinterpret_cast<const seqpack::ByteTask*>(tasks), num_tasks,
                                   reinterpret_cast<const void*>(fill_row), row_bytes, reinterpret_cast<void*>(stream));
      },
      py::arg("src"), py::arg("dst"), py::arg("tasks"), py::arg("num_tasks"), py::arg("fill_row"),
      py::arg("row_bytes"), py::arg("stream"));
  m.def(
      "cuda_positions",
      [](uintptr_t runs, int64_t num_runs, uintptr_t out, uintptr_t stream) {
        seqpack::cuda::launch_positions(reinterpret_cast<const seqpack::PositionRun*>(runs), num_runs,
                                        reinterpret_cast<int64_t*>(out), reinterpret_cast<void*>(stream));
      },
      py::arg("runs"), py::arg("num_runs"), py::arg("out"), py::arg("stream"));
#else
  m.attr("built_with_cuda") = false;
  m.attr("cuda_architectures") = "";
  m.def("cuda_device_count", []() { return 0; });
  m.def("cuda_runtime_version", []() { return 0; });
  m.def("cuda_device_name", [](int) { return std::string(); }, py::arg("index") = 0);
#endif
}
