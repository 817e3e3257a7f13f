#include "convert.hpp"

#include <optional>
#include <string>

namespace seqpack::bindings {

namespace {

// An integer item (int, NumPy integer, anything with __index__) as int64; nullopt
// for a non-integer; ValueError naming `name` + `where` when it does not fit.
std::optional<int64_t> index_value(PyObject* item, const char* name, const std::string& where) {
  if (!PyLong_Check(item) && !PyIndex_Check(item)) return std::nullopt;
  auto as_int = py::reinterpret_steal<py::object>(PyNumber_Index(item));
  if (!as_int) throw py::error_already_set();
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(as_int.ptr(), &overflow);
  if (overflow != 0)
    throw py::value_error(std::string(name) + where + " = " + std::string(py::str(as_int)) +
                          " does not fit in int64");
  return v;
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
    for (Py_ssize_t i = 0; i < n && all_integers; ++i) {
      if (PyLong_CheckExact(items[i])) {  // the common case, without a Python call or a string
        int overflow = 0;
        const long long v = PyLong_AsLongLongAndOverflow(items[i], &overflow);
        if (overflow == 0) {
          owned_[static_cast<size_t>(i)] = v;
          continue;
        }
      }
      const auto v = index_value(items[i], name, "[" + std::to_string(i) + "]");
      if (v) owned_[static_cast<size_t>(i)] = *v;
      all_integers = v.has_value();
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
  // A snapshot, taken with the GIL held: the core reads it with the GIL released, so
  // another thread writing the array can give garbage or an error, never a value
  // that changed after it was checked. Non-native byte order is swapped, not misread.
  IntBuffer buffer;
  buffer.data = array_.data();
  buffer.size = array_.shape(0);
  buffer.stride_bytes = array_.strides(0);
  buffer.itemsize = static_cast<int>(array_.itemsize());
  buffer.is_signed = kind == 'i';
  buffer.swap_bytes = !array_.dtype().attr("isnative").cast<bool>();
  owned_ = int64_from_buffer(buffer, "lengths", name);
  view_ = Lengths(owned_);
}

namespace {

// Python ints for the indices 0 .. kCachedInts - 1, made once and shared by every
// list to_list builds (as CPython shares its small ints): an index list then costs
// a reference count per item instead of an allocation. Never freed.
constexpr int64_t kCachedInts = int64_t{1} << 17;

PyObject* index_object(int64_t v) {
  static std::vector<PyObject*> cache;
  if (v < 0 || v >= kCachedInts) return PyLong_FromLongLong(v);
  if (static_cast<size_t>(v) >= cache.size()) {
    const size_t old = cache.size(), want = std::min<size_t>(kCachedInts, std::max<size_t>(2 * old, v + 1));
    cache.resize(want, nullptr);
    for (size_t i = old; i < want; ++i) {
      cache[i] = PyLong_FromLongLong(static_cast<long long>(i));
      if (!cache[i]) {
        cache.resize(i);
        return nullptr;
      }
    }
  }
  PyObject* o = cache[static_cast<size_t>(v)];
  Py_INCREF(o);
  return o;
}

}  // namespace

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
      PyObject* value = index_object(items[j]);
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
    for (py::handle i : g) {
      const auto v = index_value(i.ptr(), name, "[" + std::to_string(out.size()) + "]");
      if (!v)
        throw py::type_error(std::string(name) + "[" + std::to_string(out.size()) + "] must hold integer indices, got " +
                             std::string(py::str(py::type::handle_of(i).attr("__name__"))));
      out.indices.push_back(*v);
    }
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
