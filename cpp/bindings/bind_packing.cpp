#include <optional>

#include "convert.hpp"
#include "seqpack/packing.hpp"

namespace seqpack::bindings {

void init_packing(py::module_& m) {
  m.def("algorithm_names", []() {
    std::vector<std::string> names;
    for (PackingAlgorithm a : all_algorithms()) names.emplace_back(algorithm_name(a));
    return names;
  });
  m.def("canonical_algorithm", [](const std::string& name) { return std::string(algorithm_name(parse_algorithm(name))); },
        py::arg("name"));
  m.def(
      "pack",
      [](const std::string& algorithm, py::handle lengths, int64_t bin_capacity, int64_t min_bin_count,
         int64_t bin_count_multiple, uint64_t seed, int64_t max_sequences_per_bin, bool as_arrays) -> py::object {
        const PackingAlgorithm alg = parse_algorithm(algorithm);
        LengthsArg arg(lengths, "sequence_lengths");
        PackOptions o{bin_capacity, min_bin_count, bin_count_multiple, seed, max_sequences_per_bin};
        IndexGroups bins;
        {
          py::gil_scoped_release release;
          bins = pack(alg, arg.view(), o);
        }
        if (as_arrays) return py::make_tuple(to_array(std::move(bins.offsets)), to_array(std::move(bins.indices)));
        return to_list(bins);
      },
      py::arg("algorithm"), py::arg("sequence_lengths"), py::arg("bin_capacity"), py::arg("min_bin_count") = 0,
      py::arg("bin_count_multiple") = 1, py::arg("seed") = 0, py::arg("max_sequences_per_bin") = -1,
      py::arg("as_arrays") = false,
      "Pack lengths into bins; list of index lists, or (offsets, indices) arrays when as_arrays.");
  m.def(
      "best_fit_decreasing_fifo",
      [](py::handle lengths, int64_t bin_capacity, py::handle batch_bounds) {
        LengthsArg arg(lengths, "sequence_lengths");
        LengthsArg bounds(batch_bounds, "batch_bounds");
        IndexGroups bins;
        {
          py::gil_scoped_release release;
          bins = best_fit_decreasing_fifo(arg.view(), bin_capacity, bounds.view());
        }
        return py::make_tuple(to_array(std::move(bins.offsets)), to_array(std::move(bins.indices)));
      },
      py::arg("sequence_lengths"), py::arg("bin_capacity"), py::arg("batch_bounds") = py::tuple(),
      "Best fit decreasing with TRL's tie-breaks, batch by batch; (offsets, indices) arrays.");
  m.def(
      "adjust_bin_count",
      [](py::handle bins, int64_t min_bin_count, int64_t bin_count_multiple) {
        IndexGroups groups = groups_from(bins, "bins");
        {
          py::gil_scoped_release release;
          groups = adjust_bin_count(groups, min_bin_count, bin_count_multiple);
        }
        return to_list(groups);
      },
      py::arg("bins"), py::arg("min_bin_count") = 0, py::arg("bin_count_multiple") = 1);
}

}  // namespace seqpack::bindings
