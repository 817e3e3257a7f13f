#include "convert.hpp"

#include <cstring>
#include <limits>
#include <string>

namespace seqpack::bindings {

namespace {

template <typename T>
void copy_as_int64(const py::array& a, std::vector<int64_t>& out, const char* name) {
  const auto n = static_cast<size_t>(a.shape(0));
  const auto stride = a.strides(0);
  const char* base = static_cast<const char*>(a.data());
  out.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const T v = *reinterpret_cast<const T*>(base + static_cast<py::ssize_t>(i) * stride);
    if constexpr (std::is_unsigned_v<T> && sizeof(T) == 8) {
      if (v > static_cast<T>(std::numeric_limits<int64_t>::max()))
        throw py::value_error(std::string(name) + "[" + std::to_string(i) + "] does not fit in int64");
    }
    out[i] = static_cast<int64_t>(v);
  }
}

}  // namespace

LengthsArg::LengthsArg(py::handle obj, const char* name) {
  if (PyList_Check(obj.ptr()) || PyTuple_Check(obj.ptr())) {
    // Lists of ints are read directly: faster than building a NumPy array first.
    PyObject* seq = obj.ptr();
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject** items = PySequence_Fast_ITEMS(seq);
    owned_.resize(static_cast<size_t>(n));
    bool all_integers = true;
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* item = items[i];
      int overflow = 0;
      long long v;
      if (PyLong_Check(item)) {
        v = PyLong_AsLongLongAndOverflow(item, &overflow);
      } else if (PyIndex_Check(item)) {
        v = py::cast<long long>(py::reinterpret_borrow<py::object>(item));
      } else {
        all_integers = false;
        break;
      }
      if (overflow != 0)
        throw py::value_error(std::string(name) + "[" + std::to_string(i) + "] does not fit in int64");
      owned_[static_cast<size_t>(i)] = v;
    }
    if (all_integers) {
      view_ = Lengths(owned_);
      return;
    }
    // Anything else (floats, nested lists) goes through NumPy for a precise error.
    owned_.clear();
  }
  array_ = py::array::ensure(obj);
  if (!array_) throw py::type_error(std::string(name) + " must be a 1-D sequence of integers");
  if (array_.ndim() != 1)
    throw py::value_error(std::string(name) + " must be 1-D, got " + std::to_string(array_.ndim()) + " dimensions");
  const char kind = array_.dtype().kind();
  if (array_.shape(0) == 0) return;  // [] arrives as float64; an empty list is fine
  if (kind != 'i' && kind != 'u')
    throw py::type_error(std::string(name) + " must hold integers, got dtype " +
                         std::string(py::str(array_.dtype())));
  if (!array_.dtype().attr("isnative").cast<bool>())  // big-endian data on a little-endian host, or the reverse
    array_ = py::array::ensure(array_.attr("astype")(array_.dtype().attr("newbyteorder")("=")));
  const auto size = array_.itemsize();
  const bool c_contig = array_.flags() & py::array::c_style;
  if (kind == 'i' && size == 8 && c_contig) {
    // A snapshot, taken with the GIL held: the core reads it with the GIL released,
    // so another thread writing the array can give garbage or an error, never a
    // value that changed after it was checked.
    const auto n = static_cast<size_t>(array_.shape(0));
    owned_.resize(n);
    std::memcpy(owned_.data(), array_.data(), n * sizeof(int64_t));
    view_ = Lengths(owned_);
    return;
  }
  switch (size * (kind == 'u' ? -1 : 1)) {
    case 1: copy_as_int64<int8_t>(array_, owned_, name); break;
    case 2: copy_as_int64<int16_t>(array_, owned_, name); break;
    case 4: copy_as_int64<int32_t>(array_, owned_, name); break;
    case 8: copy_as_int64<int64_t>(array_, owned_, name); break;
    case -1: copy_as_int64<uint8_t>(array_, owned_, name); break;
    case -2: copy_as_int64<uint16_t>(array_, owned_, name); break;
    case -4: copy_as_int64<uint32_t>(array_, owned_, name); break;
    case -8: copy_as_int64<uint64_t>(array_, owned_, name); break;
    default: throw py::type_error(std::string(name) + ": unsupported integer width");
  }
  view_ = Lengths(owned_);
}

py::list to_list(const IndexGroups& groups) {
  // Raw C API: building the nested list dominates pack() for large inputs. The
  // lists hold only ints (no cycles), so the cyclic GC is paused meanwhile rather
  // than run once per 700 new lists.
  struct GcPause {
    int was_enabled = PyGC_Disable();
    ~GcPause() {
      if (was_enabled) PyGC_Enable();
    }
  } pause;
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(groups.size()));
  if (!out) throw py::error_already_set();
  py::list result = py::reinterpret_steal<py::list>(out);
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto items = groups.group(g);
    PyObject* inner = PyList_New(static_cast<Py_ssize_t>(items.size()));
    if (!inner) throw py::error_already_set();
    PyList_SET_ITEM(out, static_cast<Py_ssize_t>(g), inner);
    for (size_t j = 0; j < items.size(); ++j) {
      PyObject* value = PyLong_FromLongLong(items[j]);
      if (!value) throw py::error_already_set();
      PyList_SET_ITEM(inner, static_cast<Py_ssize_t>(j), value);
    }
  }
  return result;
}

IndexGroups groups_from(py::handle nested, const char* name) {
  if (!py::isinstance<py::sequence>(nested) || py::isinstance<py::str>(nested))
    throw py::type_error(std::string(name) + " must be a list of lists of indices");
  IndexGroups out;
  for (py::handle g : nested) {
    if (!py::isinstance<py::sequence>(g) && !py::isinstance<py::array>(g))
      throw py::type_error(std::string(name) + " must be a list of lists of indices");
    for (py::handle i : g) out.indices.push_back(py::cast<int64_t>(i));
    out.offsets.push_back(static_cast<int64_t>(out.indices.size()));
  }
  return out;
}

py::array_t<int64_t> to_array(std::vector<int64_t>&& values) {
  auto* owner = new std::vector<int64_t>(std::move(values));
  py::capsule free_owner(owner, [](void* p) { delete static_cast<std::vector<int64_t>*>(p); });
  return py::array_t<int64_t>({static_cast<py::ssize_t>(owner->size())}, owner->data(), free_owner);
}

}  // namespace seqpack::bindings
