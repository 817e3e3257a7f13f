#include "tensor.hpp"

#include <limits>
#include <string>

namespace seqpack::bindings {
namespace {

struct DtypeInfo {
  Dtype dtype;
  uint8_t code;
  uint8_t bits;
  const char* name;
};

constexpr DtypeInfo kDtypes[] = {
    {Dtype::F32, kDLFloat, 32, "float32"}, {Dtype::F64, kDLFloat, 64, "float64"},
    {Dtype::BF16, kDLBfloat, 16, "bfloat16"}, {Dtype::F16, kDLFloat, 16, "float16"},
    {Dtype::I64, kDLInt, 64, "int64"},     {Dtype::I32, kDLInt, 32, "int32"},
    {Dtype::U8, kDLUInt, 8, "uint8"},
};

const DtypeInfo& info(Dtype d) {
  for (const DtypeInfo& i : kDtypes)
    if (i.dtype == d) return i;
  throw std::logic_error("unknown dtype");
}

}  // namespace

const char* dtype_name(Dtype d) { return info(d).name; }

TensorArg::TensorArg(py::handle obj, const char* fn, const char* name) : fn_(fn), name_(name) {
  if (obj.is_none()) fail_type("must be a tensor, got None");
  if (PyCapsule_CheckExact(obj.ptr())) {
    capsule_ = py::reinterpret_borrow<py::object>(obj);
  } else if (py::hasattr(obj, "__dlpack__")) {
    try {
      // A CUDA tensor is exported with stream=-1: no synchronisation, the kernels
      // run on the caller's stream. Host arrays (NumPy) take no stream.
      const bool cuda = py::hasattr(obj, "__dlpack_device__") &&
                        obj.attr("__dlpack_device__")().cast<py::tuple>()[0].cast<int>() == kDLCUDA;
      capsule_ = cuda ? obj.attr("__dlpack__")(py::arg("stream") = -1) : obj.attr("__dlpack__")();
    } catch (py::error_already_set& e) {
      // A read-only array (NumPy's view of an Arrow buffer) has no legacy capsule;
      // DLPack 1.0 exports it with a read-only flag (checked by writable()).
      if (!e.matches(PyExc_BufferError)) fail_type(std::string("cannot be exported through DLPack: ") + e.what());
      try {
        capsule_ = obj.attr("__dlpack__")(py::arg("max_version") = py::make_tuple(1, 0));
      } catch (py::error_already_set& e2) {
        fail_type(std::string("cannot be exported through DLPack: ") + e2.what());
      }
    }
  } else {
    fail_type(std::string("must be a tensor (an object with __dlpack__), got ") +
              py::str(py::type::of(obj).attr("__name__")).cast<std::string>());
  }
  // A capsule is borrowed, not consumed: its destructor frees the tensor when the
  // capsule object goes away, after this call.
  if (PyCapsule_IsValid(capsule_.ptr(), "dltensor_versioned")) {
    auto* managed = static_cast<DLManagedTensorVersioned*>(PyCapsule_GetPointer(capsule_.ptr(), "dltensor_versioned"));
    if (managed->version.major != DLPACK_MAJOR_VERSION)
      fail_type("is a DLPack " + std::to_string(managed->version.major) + ".x tensor; this build reads DLPack " +
                std::to_string(DLPACK_MAJOR_VERSION) + ".x");
    read_only_ = (managed->flags & DLPACK_FLAG_BITMASK_READ_ONLY) != 0;
    t_ = &managed->dl_tensor;
  } else {
    auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule_.ptr(), "dltensor"));
    if (managed == nullptr) {
      PyErr_Clear();
      fail_type("must be an unconsumed DLPack capsule (\"dltensor\" or \"dltensor_versioned\")");
    }
    t_ = &managed->dl_tensor;
  }
  if (t_->ndim < 0 || (t_->ndim > 0 && t_->shape == nullptr)) fail_value("has a malformed DLPack shape");
  if (t_->device.device_type != kDLCPU && t_->device.device_type != kDLCUDA &&
      t_->device.device_type != kDLCUDAHost)
    fail_value("must be on the CPU or a CUDA device, got DLPack device type " +
               std::to_string(static_cast<int>(t_->device.device_type)));
  if (t_->dtype.lanes != 1) fail_type("must have scalar elements (DLPack lanes == 1)");
  for (int d = 0; d < t_->ndim; ++d)
    if (t_->shape[d] < 0) fail_value("has a negative size");
}

int64_t TensorArg::stride(int d) const {
  if (t_->strides != nullptr) return t_->strides[d];
  int64_t s = 1;  // null strides: compact row-major
  for (int i = t_->ndim - 1; i > d; --i) s *= t_->shape[i];
  return s;
}

int64_t TensorArg::numel() const {
  int64_t n = 1;
  for (int d = 0; d < t_->ndim; ++d) n *= t_->shape[d];
  return n;
}

std::string TensorArg::dtype_str() const {
  for (const DtypeInfo& i : kDtypes)
    if (i.code == t_->dtype.code && i.bits == t_->dtype.bits) return i.name;
  return "DLPack(code=" + std::to_string(t_->dtype.code) + ", bits=" + std::to_string(t_->dtype.bits) + ")";
}

bool TensorArg::is(Dtype d) const { return t_->dtype.code == info(d).code && t_->dtype.bits == info(d).bits; }

// No iostreams here: on an H200 machine (Ubuntu 24.04's GCC, PyTorch 2.11) the
// extension segfaulted while formatting this message through std::ostringstream
// (cuda-gdb: frames labelled std::ostream::_M_insert<long>, inside _core), and
// std::to_string fixed it. The cause inside libstdc++ was not established.
std::string TensorArg::where() const {
  std::string out = " (got " + dtype_str() + " [";
  for (int d = 0; d < t_->ndim; ++d) out += (d ? ", " : "") + std::to_string(t_->shape[d]);
  return out + "] on " + (on_cuda() ? "cuda:" + std::to_string(device_id()) : std::string("cpu")) + ")";
}

void TensorArg::fail_value(const std::string& rule) const {
  throw py::value_error(std::string("[") + fn_ + "] " + name_ + " " + rule + (t_ ? where() : ""));
}

void TensorArg::fail_type(const std::string& rule) const {
  throw py::type_error(std::string("[") + fn_ + "] " + name_ + " " + rule + (t_ ? where() : ""));
}

const TensorArg& TensorArg::writable() const {
  if (read_only_) fail_value("is read-only and cannot be written");
  return *this;
}

const TensorArg& TensorArg::dims(int n) const {
  if (t_->ndim != n) fail_value("must have " + std::to_string(n) + " dimension" + (n == 1 ? "" : "s"));
  return *this;
}

const TensorArg& TensorArg::shape(std::initializer_list<int64_t> expected) const {
  dims(static_cast<int>(expected.size()));
  int d = 0;
  for (int64_t e : expected) {
    if (e >= 0 && t_->shape[d] != e) {
      std::string want = "[";
      int i = 0;
      for (int64_t x : expected) want += (i++ ? ", " : "") + (x >= 0 ? std::to_string(x) : std::string("*"));
      fail_value("must have shape " + want + "]");
    }
    ++d;
  }
  return *this;
}

const TensorArg& TensorArg::dtype_is(Dtype d) const {
  if (!is(d)) fail_type(std::string("must be ") + dtype_name(d));
  return *this;
}

const TensorArg& TensorArg::dtype_in(std::initializer_list<Dtype> allowed) const {
  std::string names;
  for (Dtype d : allowed) {
    if (is(d)) return *this;
    names += (names.empty() ? "" : ", ") + std::string(dtype_name(d));
  }
  fail_type("must be one of " + names);
}

const TensorArg& TensorArg::same_dtype(const TensorArg& other) const {
  if (t_->dtype.code != other.t_->dtype.code || t_->dtype.bits != other.t_->dtype.bits)
    fail_type(std::string("must have the dtype of ") + other.name_ + " (" + other.dtype_str() + ")");
  return *this;
}

const TensorArg& TensorArg::contiguous() const {
  if (numel() == 0) return *this;  // no element to address: any strides will do
  int64_t expected = 1;
  for (int d = t_->ndim - 1; d >= 0; --d) {
    if (t_->shape[d] != 1 && stride(d) != expected) fail_value("must be contiguous (dense, row-major)");
    expected *= t_->shape[d];
  }
  return *this;
}

const TensorArg& TensorArg::inner_contiguous() const {
  dims(2);
  if (numel() == 0) return *this;
  if ((t_->shape[1] > 1 && stride(1) != 1) || (t_->shape[0] > 1 && stride(0) < t_->shape[1]))
    fail_value("must have unit column stride and a row stride >= its columns");
  return *this;
}

const TensorArg& TensorArg::on_cpu() const {
  if (on_cuda()) fail_value("must be on the CPU");
  return *this;
}

const TensorArg& TensorArg::same_device(const TensorArg& other) const {
  if (on_cuda() != other.on_cuda() || (on_cuda() && device_id() != other.device_id()))
    fail_value(std::string("must be on the device of ") + other.name_);
  return *this;
}

int64_t TensorArg::rows(int lead) const {
  if (lead < 0 || t_->ndim < lead) fail_value("must have at least " + std::to_string(lead) + " dimensions");
  int64_t n = 1;
  for (int d = 0; d < lead; ++d) n *= t_->shape[d];
  return n;
}

int64_t TensorArg::row_bytes(int lead) const {
  if (lead < 0 || t_->ndim < lead) fail_value("must have at least " + std::to_string(lead) + " dimensions");
  int64_t n = element_size();
  for (int d = lead; d < t_->ndim; ++d) n *= t_->shape[d];
  return n;
}

MoveGeometry move_geometry(const TensorArg& src, int src_lead, const TensorArg& dst, int dst_lead) {
  src.contiguous();
  dst.contiguous().same_dtype(src).same_device(src);
  const int64_t row_bytes = src.row_bytes(src_lead);
  if (dst.row_bytes(dst_lead) != row_bytes)
    throw py::value_error(std::string("[") + src.name() + " -> " + dst.name() + "] rows differ: " +
                          std::to_string(row_bytes) + " bytes per source row, " +
                          std::to_string(dst.row_bytes(dst_lead)) + " per destination row");
  return {src.rows(src_lead), dst.rows(dst_lead), row_bytes};
}

}  // namespace seqpack::bindings
