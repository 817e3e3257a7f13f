// Python rows read straight into buffers: a list of token lists (Python lists or
// tuples of Python ints, as users hand datasets over) as CSR offsets and int64
// values, one pass to size and one to copy, no intermediate objects. Reading Python
// objects needs the GIL, so this binding holds it; it is Python-facing by nature and
// has no core counterpart.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>

namespace py = pybind11;

namespace seqpack::bindings {
namespace {

// The items of a list or tuple (borrowed; null for an empty list), false for anything else.
bool items_of(PyObject* row, PyObject*** items, Py_ssize_t* size) {
  if (PyList_Check(row)) {
    *size = PyList_GET_SIZE(row);
    *items = reinterpret_cast<PyListObject*>(row)->ob_item;
    return true;
  }
  if (PyTuple_Check(row)) {
    *size = PyTuple_GET_SIZE(row);
    *items = reinterpret_cast<PyTupleObject*>(row)->ob_item;
    return true;
  }
  return false;
}

// (offsets [n + 1], values [total], first_bad): first_bad is the first row that is
// not a list / tuple of ints within int64 (-1: none); the arrays are then partial.
py::tuple int_lists(const py::list& rows) {
  const Py_ssize_t n = PyList_GET_SIZE(rows.ptr());
  py::array_t<int64_t> offsets(n + 1);
  int64_t* off = offsets.mutable_data();
  off[0] = 0;
  int64_t first_bad = -1;
  for (Py_ssize_t i = 0; i < n; ++i) {
    Py_ssize_t size = 0;
    PyObject** items = nullptr;
    if (!items_of(PyList_GET_ITEM(rows.ptr(), i), &items, &size)) {
      first_bad = i;
      for (Py_ssize_t j = i; j < n; ++j) off[j + 1] = off[i];
      break;
    }
    off[i + 1] = off[i] + static_cast<int64_t>(size);
  }
  py::array_t<int64_t> values(first_bad < 0 ? off[n] : 0);
  if (first_bad >= 0) return py::make_tuple(offsets, values, first_bad);
  int64_t* out = values.mutable_data();
  for (Py_ssize_t i = 0; i < n && first_bad < 0; ++i) {
    Py_ssize_t size = 0;
    PyObject** items = nullptr;
    if (!items_of(PyList_GET_ITEM(rows.ptr(), i), &items, &size) || off[i] + size != off[i + 1]) {
      first_bad = i;  // changed since it was sized (no Python code runs here, but never write past it)
      break;
    }
    int64_t* dst = out + off[i];
    for (Py_ssize_t k = 0; k < size; ++k) {
      PyObject* x = items[k];
      if (!PyLong_Check(x)) {  // (bool is a subclass of int: 0 / 1, as NumPy reads it)
        first_bad = i;
        break;
      }
      int overflow = 0;
      const long long v = PyLong_AsLongLongAndOverflow(x, &overflow);
      if (overflow != 0 || (v == -1 && PyErr_Occurred() != nullptr)) {
        PyErr_Clear();
        first_bad = i;
        break;
      }
      dst[k] = static_cast<int64_t>(v);
    }
  }
  return py::make_tuple(offsets, values, first_bad);
}

}  // namespace

void init_pylists(py::module_& m) {
  m.def("int_lists", &int_lists, py::arg("rows"),
        "(offsets [n + 1], values int64, first_bad) of a list of lists / tuples of Python ints: first_bad is the "
        "first row that is not one (or holds an int outside int64), -1 when every row is; the arrays are then "
        "partial.");
}

}  // namespace seqpack::bindings
