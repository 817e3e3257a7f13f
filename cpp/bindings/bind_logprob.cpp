// Fused token log-probabilities. Tensors arrive as DLPack (tensor.hpp) and are
// checked here: shapes against the logits' rows and vocabulary, dtypes, strides and
// one device for all. CPU tensors run the core without the GIL; CUDA tensors launch
// on the caller's stream (seqpack built with nvcc).
#include <optional>
#include <string>

#include "convert.hpp"
#include "seqpack/logprob.hpp"
#include "tensor.hpp"
#ifdef SEQPACK_WITH_CUDA
#include "seqpack/cuda_logprob.hpp"
#endif

namespace seqpack::bindings {
namespace {

LogitsView logits_view(const TensorArg& logits) {
  logits.dims(2).dtype_in({Dtype::F32, Dtype::BF16, Dtype::F16}).inner_contiguous();
  const LogitsDtype dtype = logits.is(Dtype::F32)    ? LogitsDtype::Float32
                            : logits.is(Dtype::BF16) ? LogitsDtype::BFloat16
                                                     : LogitsDtype::Float16;
  return LogitsView{logits.data(), logits.size(0), logits.size(1), logits.size(0) > 1 ? logits.stride(0) : logits.size(1),
                    dtype};
}

// The int64 targets [rows] and the fp32 per-row vectors [rows] on the logits' device.
const int64_t* targets_of(const TensorArg& targets, const TensorArg& logits) {
  targets.shape({logits.size(0)}).dtype_is(Dtype::I64).contiguous().same_device(logits);
  return targets.ptr<const int64_t>();
}

// A per-row fp32 vector, or null for None (optional outputs and inputs).
struct RowVector {
  std::optional<TensorArg> arg;
  RowVector(py::handle obj, const char* fn, const char* name, const TensorArg& logits) {
    if (obj.is_none()) return;
    arg.emplace(obj, fn, name);
    arg->shape({logits.size(0)}).dtype_is(Dtype::F32).contiguous().same_device(logits);
  }
  template <typename T>
  T* get() const {
    return arg ? arg->ptr<T>() : nullptr;
  }
};

void require(bool present, const char* fn, const char* name) {
  if (!present) throw py::type_error(std::string("[") + fn + "] " + name + " must be a tensor, got None");
}

// The extra targets of logprob_row_grad (all three tensors or None): offsets int64
// [rows + 1], ids int64 [E], grad fp32 [E]. Offsets of CPU tensors are checked
// (non-decreasing within [0, E]); CUDA ones are not read on the host.
void set_extras(RowGradInputs& in, py::handle offsets_obj, py::handle ids_obj, py::handle grad_obj, const char* fn,
                const TensorArg& logits, std::optional<TensorArg> (&keep)[3]) {
  const int given = !offsets_obj.is_none() + !ids_obj.is_none() + !grad_obj.is_none();
  if (given == 0) return;
  if (given != 3)
    throw py::value_error(std::string("[") + fn + "] extra_offsets, extra_ids and extra_grad must be given together");
  auto& offsets = keep[0].emplace(offsets_obj, fn, "extra_offsets");
  auto& ids = keep[1].emplace(ids_obj, fn, "extra_ids");
  auto& grad = keep[2].emplace(grad_obj, fn, "extra_grad");
  offsets.shape({logits.size(0) + 1}).dtype_is(Dtype::I64).contiguous().same_device(logits);
  ids.dims(1).dtype_is(Dtype::I64).contiguous().same_device(logits);
  grad.shape({ids.size(0)}).dtype_is(Dtype::F32).contiguous().same_device(logits);
  if (!logits.on_cuda()) {
    const auto* o = offsets.ptr<const int64_t>();
    for (int64_t r = 0; r <= logits.size(0); ++r)
      if (o[r] < (r ? o[r - 1] : 0) || o[r] > ids.size(0))
        throw py::value_error(std::string("[") + fn + "] extra_offsets must be non-decreasing within [0, " +
                              std::to_string(ids.size(0)) + "], got " + std::to_string(o[r]) + " at " +
                              std::to_string(r));
  }
  if (ids.size(0) == 0) return;  // no extra target in any row
  in.extra_offsets = offsets.ptr<const int64_t>();
  in.extra_ids = ids.ptr<const int64_t>();
  in.extra_grad = grad.ptr<const float>();
}

#ifndef SEQPACK_WITH_CUDA
[[noreturn]] void no_cuda(const char* fn) {
  throw py::value_error(std::string("[") + fn + "] the tensors are on a CUDA device but seqpack was built without CUDA");
}
#endif

}  // namespace

void init_logprob(py::module_& m) {
  m.def("logprob_cpu_isa", &logprob_cpu_isa, "The CPU build of the log-prob kernels in use.");
  m.def(
      "logprob_row_stats",
      [](py::handle logits_obj, py::handle targets_obj, int64_t vocab_start, float temperature, py::handle max_obj,
         py::handle sumexp_obj, py::handle zexp_obj, py::handle target_z_obj, int num_threads, uintptr_t stream) {
        constexpr const char* fn = "logprob_row_stats";
        TensorArg logits(logits_obj, fn, "logits"), targets(targets_obj, fn, "targets");
        const LogitsView v = logits_view(logits);
        const int64_t* ids = targets_of(targets, logits);
        RowVector max(max_obj, fn, "max", logits), sumexp(sumexp_obj, fn, "sumexp", logits),
            zexp(zexp_obj, fn, "zexp", logits), target_z(target_z_obj, fn, "target_z", logits);
        require(max.arg && sumexp.arg && target_z.arg, fn, "max, sumexp and target_z");
        const RowStats out{max.get<float>(), sumexp.get<float>(), zexp.get<float>(), target_z.get<float>()};
        if (logits.on_cuda()) {
#ifdef SEQPACK_WITH_CUDA
          cuda::launch_logprob_row_stats(v, ids, vocab_start, temperature, out, reinterpret_cast<void*>(stream));
#else
          no_cuda(fn);
#endif
          return;
        }
        py::gil_scoped_release release;
        row_stats(v, ids, vocab_start, temperature, out, num_threads);
      },
      py::arg("logits"), py::arg("targets"), py::arg("vocab_start"), py::arg("temperature"), py::arg("max"),
      py::arg("sumexp"), py::arg("zexp"), py::arg("target_z"), py::arg("num_threads") = 0, py::arg("stream") = 0,
      "Per-row max, sum exp(z - max), sum exp(z - max) z and the target's z of a (slice of) logits "
      "[rows, V] (float32/bfloat16/float16); zexp=None skips the entropy sum. CUDA tensors launch on `stream`.");
  m.def(
      "logprob_row_grad",
      [](py::handle logits_obj, py::handle targets_obj, int64_t vocab_start, float temperature, py::handle max_obj,
         py::handle log_sumexp_obj, py::handle entropy_obj, py::handle grad_logprob_obj, py::handle grad_entropy_obj,
         py::handle grad_obj, int num_threads, uintptr_t stream, py::handle extra_offsets_obj, py::handle extra_ids_obj,
         py::handle extra_grad_obj) {
        constexpr const char* fn = "logprob_row_grad";
        TensorArg logits(logits_obj, fn, "logits"), targets(targets_obj, fn, "targets"), grad(grad_obj, fn, "grad");
        const LogitsView v = logits_view(logits);
        const int64_t* ids = targets_of(targets, logits);
        grad.shape({logits.size(0), logits.size(1)}).same_dtype(logits).inner_contiguous().same_device(logits);
        RowVector max(max_obj, fn, "max", logits), log_sumexp(log_sumexp_obj, fn, "log_sumexp", logits),
            entropy(entropy_obj, fn, "entropy", logits), grad_logprob(grad_logprob_obj, fn, "grad_logprob", logits),
            grad_entropy(grad_entropy_obj, fn, "grad_entropy", logits);
        require(max.arg && log_sumexp.arg && grad_logprob.arg, fn, "max, log_sumexp and grad_logprob");
        RowGradInputs in{max.get<const float>(), log_sumexp.get<const float>(), entropy.get<const float>(),
                         grad_logprob.get<const float>(), grad_entropy.get<const float>()};
        std::optional<TensorArg> extras[3];
        set_extras(in, extra_offsets_obj, extra_ids_obj, extra_grad_obj, fn, logits, extras);
        const int64_t grad_stride = logits.size(0) > 1 ? grad.stride(0) : logits.size(1);
        if (logits.on_cuda()) {
#ifdef SEQPACK_WITH_CUDA
          cuda::launch_logprob_row_grad(v, ids, vocab_start, temperature, in, grad.data(), grad_stride,
                                        reinterpret_cast<void*>(stream));
#else
          no_cuda(fn);
#endif
          return;
        }
        py::gil_scoped_release release;
        row_grad(v, ids, vocab_start, temperature, in, grad.data(), grad_stride, num_threads);
      },
      py::arg("logits"), py::arg("targets"), py::arg("vocab_start"), py::arg("temperature"), py::arg("max"),
      py::arg("log_sumexp"), py::arg("entropy"), py::arg("grad_logprob"), py::arg("grad_entropy"), py::arg("grad"),
      py::arg("num_threads") = 0, py::arg("stream") = 0, py::arg("extra_offsets") = py::none(),
      py::arg("extra_ids") = py::none(), py::arg("extra_grad") = py::none(),
      "d(g_lp * logprob + g_ent * entropy)/d logits for a (slice of) logits, written into grad [rows, V] in the "
      "logits' dtype. CUDA tensors launch on `stream`. Extra targets (several columns of a row from its one "
      "log-sum-exp): row r's are extra_ids[extra_offsets[r]:extra_offsets[r + 1]], with gradients extra_grad.");
}

}  // namespace seqpack::bindings
