#include <optional>

#include "convert.hpp"
#include "seqpack/microbatch.hpp"
#include "seqpack/partition.hpp"

namespace seqpack::bindings {

namespace {

template <typename F>
py::list run_partition(py::handle values, F&& f) {
  LengthsArg arg(values, "seqlen_list");
  IndexGroups groups;
  {
    py::gil_scoped_release release;
    groups = f(arg.view());
  }
  return to_list(groups);
}

}  // namespace

void init_partition(py::module_& m) {
  m.def(
      "karmarkar_karp",
      [](py::handle values, int64_t k, bool equal_size, bool sort_groups) {
        return run_partition(values, [&](Lengths v) { return karmarkar_karp(v, k, equal_size, sort_groups); });
      },
      py::arg("seqlen_list"), py::arg("k_partitions"), py::arg("equal_size"), py::arg("sort_groups") = false);
  m.def(
      "greedy_lpt_partition",
      [](py::handle values, int64_t k, bool equal_size) {
        return run_partition(values, [&](Lengths v) { return greedy_lpt_partition(v, k, equal_size); });
      },
      py::arg("seqlen_list"), py::arg("k_partitions"), py::arg("equal_size"));
  m.def(
      "sorted_stride_partition",
      [](py::handle values, int64_t k) {
        return run_partition(values, [&](Lengths v) { return sorted_stride_partition(v, k); });
      },
      py::arg("seqlen_list"), py::arg("k_partitions"));
  m.def(
      "sequence_workloads",
      [](py::handle lengths, int64_t coeff) {
        return map_lengths(lengths, "lengths", [&](Lengths v) { return sequence_workloads(v, coeff); });
      },
      py::arg("lengths"), py::arg("attention_coeff"));
  m.def(
      "plan_micro_batches",
      [](py::handle lengths, int64_t max_tokens, int64_t min_num, int64_t multiple_of, int64_t attention_coeff,
         bool small_at_ends, py::handle workloads) {
        LengthsArg arg(lengths, "lengths");
        std::optional<LengthsArg> work;
        if (!workloads.is_none()) work.emplace(workloads, "workloads");
        MicroBatchOptions o{max_tokens, min_num, multiple_of, attention_coeff, small_at_ends,
                            work ? work->view() : Lengths{}};
        MicroBatchPlan plan;
        {
          py::gil_scoped_release release;
          plan = plan_micro_batches(arg.view(), o);
        }
        py::dict out;
        out["groups"] = to_list(plan.groups);
        out["tokens"] = plan.tokens;
        out["workloads"] = plan.workloads;
        out["lower_bound"] = plan.lower_bound;
        out["method"] = std::string(plan.method);
        return out;
      },
      py::arg("lengths"), py::arg("max_tokens"), py::arg("min_num") = 1, py::arg("multiple_of") = 1,
      py::arg("attention_coeff") = 0, py::arg("small_at_ends") = false, py::arg("workloads") = py::none());
}

}  // namespace seqpack::bindings
