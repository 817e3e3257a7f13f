#pragma once
// Tensors at the Python boundary. A tensor crosses as a DLPack capsule (any object
// with __dlpack__, e.g. a torch.Tensor, or the capsule of torch.utils.dlpack.to_dlpack),
// so the binding sees its shape, strides, dtype, device and byte offset and checks
// them, output sizes included, before any kernel runs. The extension never links
// libtorch: DLPack is a plain C ABI.
//
//   TensorArg logits(obj, "logprob_row_stats", "logits");
//   logits.dims(2).inner_contiguous().dtype_in({kF32, kBF16, kF16});
//   TensorArg out(obj2, fn, "max");
//   out.shape({logits.size(0)}).dtype_is(kF32).contiguous().same_device(logits);
#include <pybind11/pybind11.h>

#include <cstdint>
#include <initializer_list>
#include <string>

#include <dlpack/dlpack.h>  // a C ABI header; CMakeLists.txt says where it comes from

namespace seqpack::bindings {

namespace py = pybind11;

// The element types the kernels take, as DLPack codes.
enum class Dtype { F32, F64, BF16, F16, I64, I32, U8 };
const char* dtype_name(Dtype d);

class TensorArg {
 public:
  // `fn` and `name` make every error message: "[fn] name must ...".
  TensorArg(py::handle obj, const char* fn, const char* name);

  // Properties (sizes and strides in elements, as DLPack and torch count them).
  int ndim() const { return t_->ndim; }
  int64_t size(int d) const { return t_->shape[d]; }
  int64_t stride(int d) const;
  int64_t numel() const;
  int64_t element_size() const { return (t_->dtype.bits * t_->dtype.lanes + 7) / 8; }
  bool on_cuda() const { return t_->device.device_type == kDLCUDA; }
  int device_id() const { return t_->device.device_id; }
  std::string dtype_str() const;
  bool is(Dtype d) const;
  void* data() const { return static_cast<char*>(t_->data) + t_->byte_offset; }
  template <typename T>
  T* ptr() const {
    return static_cast<T*>(data());
  }

  // Checks; each throws ValueError/TypeError naming the argument and the rule.
  const TensorArg& dims(int n) const;
  const TensorArg& shape(std::initializer_list<int64_t> expected) const;  // -1: any size there
  const TensorArg& dtype_is(Dtype d) const;
  const TensorArg& dtype_in(std::initializer_list<Dtype> allowed) const;
  const TensorArg& same_dtype(const TensorArg& other) const;
  const TensorArg& contiguous() const;        // dense, row-major
  const TensorArg& inner_contiguous() const;  // 2-D: unit column stride, row stride >= columns
  const TensorArg& on_cpu() const;
  const TensorArg& writable() const;  // not exported read-only (DLPack 1.0's flag)
  const TensorArg& same_device(const TensorArg& other) const;

  // Dense row-major bytes after the first `lead` dimensions (one "row").
  int64_t row_bytes(int lead) const;
  int64_t rows(int lead) const;  // product of the first `lead` sizes

  const char* name() const { return name_; }

 private:
  [[noreturn]] void fail_value(const std::string& rule) const;
  [[noreturn]] void fail_type(const std::string& rule) const;
  std::string where() const;

  py::object capsule_;  // owns the DLManagedTensor for the duration of the call
  DLTensor* t_ = nullptr;
  bool read_only_ = false;
  const char* fn_;
  const char* name_;
};

// The byte geometry of a row move between two tensors: the first `src_lead` /
// `dst_lead` dimensions are rows, the rest one row; both dense, of one dtype and
// device, with the same bytes per row (checked here).
struct MoveGeometry {
  int64_t src_rows, dst_rows, row_bytes;
};
MoveGeometry move_geometry(const TensorArg& src, int src_lead, const TensorArg& dst, int dst_lead);

}  // namespace seqpack::bindings
