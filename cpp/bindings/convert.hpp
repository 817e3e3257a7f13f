#pragma once
// Conversions at the Python boundary: the only place that knows both pybind11
// and the core's types.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "seqpack/common.hpp"

namespace seqpack::bindings {

namespace py = pybind11;

// A read-only int64 view of a 1-D integer array. An int64 C-contiguous array is
// used in place; other integer dtypes and strides are converted once, in C++.
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

}  // namespace seqpack::bindings
