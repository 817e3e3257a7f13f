#include "convert.hpp"
#include "seqpack/metrics.hpp"

namespace seqpack::bindings {

void init_metrics(py::module_& m) {
  m.def(
      "packing_stats",
      [](py::handle lengths, py::handle bins, int64_t capacity) {
        LengthsArg arg(lengths, "sequence_lengths");
        const IndexGroups groups = groups_from(bins, "bins");
        PackingStats s;
        {
          py::gil_scoped_release release;
          s = packing_stats(arg.view(), groups, capacity);
        }
        py::dict d;
        d["num_sequences"] = s.num_sequences;
        d["num_bins"] = s.num_bins;
        d["total_sequence_length"] = s.total_sequence_length;
        d["total_bin_capacity"] = s.total_bin_capacity;
        d["total_waste"] = s.total_waste;
        d["average_utilization"] = s.average_utilization;
        d["waste_ratio"] = s.waste_ratio;
        d["bin_balance"] = s.bin_balance;
        d["theoretical_min_bins"] = s.theoretical_min_bins;
        d["bin_efficiency"] = s.bin_efficiency;
        d["max_bin_load"] = s.max_bin_load;
        return d;
      },
      py::arg("sequence_lengths"), py::arg("bins"), py::arg("bin_capacity"));
  m.def(
      "dp_balance_stats",
      [](py::handle lengths, py::handle partitions) {
        LengthsArg arg(lengths, "seqlen_list");
        const IndexGroups groups = groups_from(partitions, "partitions");
        BalanceStats s;
        {
          py::gil_scoped_release release;
          s = dp_balance_stats(arg.view(), groups);
        }
        py::dict d;
        d["min"] = s.min;
        d["max"] = s.max;
        d["minmax_diff"] = s.minmax_diff;
        d["balanced_min"] = s.balanced_min;
        d["balanced_max"] = s.balanced_max;
        d["mean"] = s.mean;
        return d;
      },
      py::arg("seqlen_list"), py::arg("partitions"));
}

}  // namespace seqpack::bindings
