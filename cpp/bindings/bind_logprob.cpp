// Fused token log-probabilities: raw CPU pointers from torch (the Python layer
// checks shapes, dtypes, devices and contiguity); the core runs without the GIL.
#include <string>

#include "convert.hpp"
#include "seqpack/logprob.hpp"
#ifdef SEQPACK_WITH_CUDA
#include "seqpack/cuda_logprob.hpp"
#endif

namespace seqpack::bindings {
namespace {

LogitsView view(uintptr_t data, int64_t rows, int64_t vocab, int64_t row_stride, const std::string& dtype) {
  LogitsView v{reinterpret_cast<const void*>(data), rows, vocab, row_stride, LogitsDtype::Float32};
  if (dtype == "float32") v.dtype = LogitsDtype::Float32;
  else if (dtype == "bfloat16") v.dtype = LogitsDtype::BFloat16;
  else if (dtype == "float16") v.dtype = LogitsDtype::Float16;
  else throw py::value_error("logits dtype must be float32, bfloat16 or float16, got " + dtype);
  return v;
}

template <typename T>
T* ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

}  // namespace

void init_logprob(py::module_& m) {
  m.def("logprob_cpu_isa", &logprob_cpu_isa, "The CPU build of the log-prob kernels in use.");
  m.def(
      "logprob_row_stats",
      [](uintptr_t logits, int64_t rows, int64_t vocab, int64_t row_stride, const std::string& dtype,
         uintptr_t targets, int64_t vocab_start, float temperature, uintptr_t max, uintptr_t sumexp, uintptr_t zexp,
         uintptr_t target_z, int num_threads) {
        const LogitsView v = view(logits, rows, vocab, row_stride, dtype);
        const RowStats out{ptr<float>(max), ptr<float>(sumexp), ptr<float>(zexp), ptr<float>(target_z)};
        py::gil_scoped_release release;
        row_stats(v, ptr<const int64_t>(targets), vocab_start, temperature, out, num_threads);
      },
      py::arg("logits"), py::arg("rows"), py::arg("vocab"), py::arg("row_stride"), py::arg("dtype"),
      py::arg("targets"), py::arg("vocab_start"), py::arg("temperature"), py::arg("max"), py::arg("sumexp"),
      py::arg("zexp"), py::arg("target_z"), py::arg("num_threads") = 0,
      "Per-row max, sum exp(z - max), sum exp(z - max) z and the target's z of a (slice of) logits; "
      "zexp = 0 skips the entropy sum.");
  m.def(
      "logprob_row_grad",
      [](uintptr_t logits, int64_t rows, int64_t vocab, int64_t row_stride, const std::string& dtype,
         uintptr_t targets, int64_t vocab_start, float temperature, uintptr_t max, uintptr_t log_sumexp,
         uintptr_t entropy,
         uintptr_t grad_logprob, uintptr_t grad_entropy, uintptr_t grad, int64_t grad_row_stride, int num_threads) {
        const LogitsView v = view(logits, rows, vocab, row_stride, dtype);
        const RowGradInputs in{ptr<const float>(max), ptr<const float>(log_sumexp), ptr<const float>(entropy),
                               ptr<const float>(grad_logprob), ptr<const float>(grad_entropy)};
        py::gil_scoped_release release;
        row_grad(v, ptr<const int64_t>(targets), vocab_start, temperature, in, ptr<void>(grad), grad_row_stride,
                 num_threads);
      },
      py::arg("logits"), py::arg("rows"), py::arg("vocab"), py::arg("row_stride"), py::arg("dtype"),
      py::arg("targets"), py::arg("vocab_start"), py::arg("temperature"), py::arg("max"), py::arg("log_sumexp"),
      py::arg("entropy"),
      py::arg("grad_logprob"), py::arg("grad_entropy"), py::arg("grad"), py::arg("grad_row_stride"),
      py::arg("num_threads") = 0,
      "d(g_lp * logprob + g_ent * entropy)/d logits for a (slice of) logits, written in the logits' dtype.");
#ifdef SEQPACK_WITH_CUDA
  // The same on device pointers, launched on the caller's stream (cudaStream_t).
  m.def(
      "cuda_logprob_row_stats",
      [](uintptr_t logits, int64_t rows, int64_t vocab, int64_t row_stride, const std::string& dtype,
         uintptr_t targets, int64_t vocab_start, float temperature, uintptr_t max, uintptr_t sumexp, uintptr_t zexp,
         uintptr_t target_z, uintptr_t stream) {
        const LogitsView v = view(logits, rows, vocab, row_stride, dtype);
        const RowStats out{ptr<float>(max), ptr<float>(sumexp), ptr<float>(zexp), ptr<float>(target_z)};
        cuda::launch_logprob_row_stats(v, ptr<const int64_t>(targets), vocab_start, temperature, out,
                                       reinterpret_cast<void*>(stream));
      });
  m.def(
      "cuda_logprob_row_grad",
      [](uintptr_t logits, int64_t rows, int64_t vocab, int64_t row_stride, const std::string& dtype,
         uintptr_t targets, int64_t vocab_start, float temperature, uintptr_t max, uintptr_t log_sumexp,
         uintptr_t entropy, uintptr_t grad_logprob, uintptr_t grad_entropy, uintptr_t grad, int64_t grad_row_stride,
         uintptr_t stream) {
        const LogitsView v = view(logits, rows, vocab, row_stride, dtype);
        const RowGradInputs in{ptr<const float>(max), ptr<const float>(log_sumexp), ptr<const float>(entropy),
                               ptr<const float>(grad_logprob), ptr<const float>(grad_entropy)};
        cuda::launch_logprob_row_grad(v, ptr<const int64_t>(targets), vocab_start, temperature, in, ptr<void>(grad),
                                      grad_row_stride, reinterpret_cast<void*>(stream));
      });
#endif
}

}  // namespace seqpack::bindings
