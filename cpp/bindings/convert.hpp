#pragma once
// Conversions at the Python boundary: the only place that knows both pybind11
// and the core's types.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "seqpack/common.hpp"

namespace seqpack::bindings {

namespace py = pybind11;

// An int64 copy of a 1-D integer sequence, taken with the GIL held (the core reads it
// with the GIL released, so a racing writer cannot change a checked value): lists,
// tuples and arrays of any integer dtype, stride and byte order.
class LengthsArg {
 public:
  LengthsArg(py::handle obj, const char* name);
  Lengths view() const { return view_; }

 private:
  py::array array_;
  std::vector<int64_t> owned_;
  Lengths view_;
};

// list[list[int]] <-> CSR groups.
py::list to_list(const IndexGroups& groups);
IndexGroups groups_from(py::handle nested, const char* name);

// Moves a vector into a NumPy array without copying.
py::array_t<int64_t> to_array(std::vector<int64_t>&& values);

// Reads an integer array argument, runs `fn(view)` with the GIL released, and
// returns its vector<int64_t> result as a NumPy array.
template <typename Fn>
py::array_t<int64_t> map_lengths(py::handle obj, const char* name, Fn&& fn) {
  LengthsArg arg(obj, name);
  std::vector<int64_t> out;
  {
    py::gil_scoped_release release;
    out = fn(arg.view());
  }
  return to_array(std::move(out));
}

}  // namespace seqpack::bindings
