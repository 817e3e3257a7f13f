#include <optional>

#include "convert.hpp"
#include "step_args.hpp"
#include "seqpack/microbatch.hpp"
#include "seqpack/partition.hpp"
#include "seqpack/cp_step.hpp"
#include "seqpack/step.hpp"

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

CpStepOptions cp_options(int64_t dp_size, int64_t max_tokens, double per_micro_batch, double per_token,
                         double per_token_squared, double per_kv_token, double per_collective, const std::string& sync,
                         int64_t mini_batches, int64_t min_micro_batches, int64_t multiple_of,
                         std::optional<uint64_t> seed, int64_t cp_size, bool hybrid, int64_t min_degree,
                         Lengths mini_batch_sizes) {
  CpStepOptions o;
  o.step = step_options(dp_size, max_tokens, per_micro_batch, per_token, per_token_squared, sync, mini_batches,
                        min_micro_batches, multiple_of, seed);
  o.step.mini_batch_sizes = mini_batch_sizes;
  o.cp_size = cp_size;
  o.hybrid = hybrid;
  o.min_degree = min_degree;
  o.cp = CpCost{per_kv_token, per_collective};
  return o;
}

py::dict cp_plan_dict(CpStepPlan plan) {
  py::dict out = step_plan_dict(plan.plan);
  out["degree"] = to_array(std::move(plan.degree));
  out["first_rank"] = to_array(std::move(plan.first_rank));
  out["kv_tokens"] = plan.kv_tokens;
  out["least_kv_tokens"] = plan.least_kv_tokens;
  out["hybrid"] = plan.hybrid;
  return out;
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
  m.def(
      "plan_step",
      [](py::handle lengths, int64_t dp_size, int64_t max_tokens, double per_micro_batch, double per_token,
         double per_token_squared, const std::string& sync, int64_t mini_batches, int64_t min_micro_batches,
         int64_t multiple_of, std::optional<uint64_t> seed, py::handle squares, py::handle mini_batch_sizes) {
        LengthsArg arg(lengths, "lengths");
        std::optional<LengthsArg> sq, sizes;
        if (!squares.is_none()) sq.emplace(squares, "squares");
        if (!mini_batch_sizes.is_none()) sizes.emplace(mini_batch_sizes, "mini_batch_sizes");
        StepOptions o = step_options(dp_size, max_tokens, per_micro_batch, per_token, per_token_squared, sync,
                                     mini_batches, min_micro_batches, multiple_of, seed);
        if (sq) o.squares = sq->view();
        if (sizes) o.mini_batch_sizes = sizes->view();
        StepPlan plan;
        {
          py::gil_scoped_release release;
          plan = plan_step(arg.view(), o);
        }
        return step_plan_dict(plan);
      },
      py::arg("lengths"), py::arg("dp_size"), py::arg("max_tokens"), py::arg("per_micro_batch"), py::arg("per_token"),
      py::arg("per_token_squared"), py::arg("sync") = "micro_batch", py::arg("mini_batches") = 1,
      py::arg("min_micro_batches") = 1, py::arg("multiple_of") = 1, py::arg("seed") = py::none(),
      py::arg("squares") = py::none(), py::arg("mini_batch_sizes") = py::none());
  m.def(
      "plan_cp_step",
      [](py::handle lengths, int64_t dp_size, int64_t max_tokens, double per_micro_batch, double per_token,
         double per_token_squared, double per_kv_token, double per_collective, const std::string& sync,
         int64_t mini_batches, int64_t min_micro_batches, int64_t multiple_of, std::optional<uint64_t> seed,
         int64_t cp_size, bool hybrid, int64_t min_degree) {
        LengthsArg arg(lengths, "lengths");
        const CpStepOptions o = cp_options(dp_size, max_tokens, per_micro_batch, per_token, per_token_squared,
                                           per_kv_token, per_collective, sync, mini_batches, min_micro_batches,
                                           multiple_of, seed, cp_size, hybrid, min_degree, {});
        CpStepPlan plan;
        {
          py::gil_scoped_release release;
          plan = plan_cp_step(arg.view(), o);
        }
        return cp_plan_dict(std::move(plan));
      },
      py::arg("lengths"), py::arg("dp_size"), py::arg("max_tokens"), py::arg("per_micro_batch"), py::arg("per_token"),
      py::arg("per_token_squared"), py::arg("per_kv_token"), py::arg("per_collective"), py::arg("sync"),
      py::arg("mini_batches"), py::arg("min_micro_batches"), py::arg("multiple_of"), py::arg("seed"),
      py::arg("cp_size"), py::arg("hybrid"), py::arg("min_degree") = 1,
      "plan_step over dp_size x cp_size ranks with fixed or hybrid context parallelism (cp_step.hpp).");
  m.def(
      "plan_cp_items",
      [](py::handle tokens, py::handle squares, py::handle local, const std::string& name,
         py::handle mini_batch_sizes, int64_t dp_size, int64_t max_tokens, double per_micro_batch, double per_token,
         double per_token_squared, double per_kv_token, double per_collective, const std::string& sync,
         int64_t min_micro_batches, int64_t multiple_of, std::optional<uint64_t> seed, int64_t cp_size,
         bool hybrid, int64_t min_degree) {
        LengthsArg t(tokens, "tokens"), q(squares, "squares"), l(local, "local"), sizes(mini_batch_sizes,
                                                                                         "mini_batch_sizes");
        CpItems items;
        items.tokens.assign(t.view().begin(), t.view().end());
        items.squares.assign(q.view().begin(), q.view().end());
        items.local.assign(l.view().begin(), l.view().end());
        items.name = name;
        items.levels = 1;
        for (int64_t d = 1; d < cp_size && d > 0; d *= 2) ++items.levels;
        const auto count = static_cast<int64_t>(sizes.view().size());
        const CpStepOptions o = cp_options(dp_size, max_tokens, per_micro_batch, per_token, per_token_squared,
                                           per_kv_token, per_collective, sync, count, min_micro_batches, multiple_of,
                                           seed, cp_size, hybrid, min_degree, sizes.view());
        CpStepPlan plan;
        {
          py::gil_scoped_release release;
          plan = plan_cp_step(items, o);
        }
        return cp_plan_dict(std::move(plan));
      },
      py::arg("tokens"), py::arg("squares"), py::arg("local"), py::arg("name"), py::arg("mini_batch_sizes"),
      py::arg("dp_size"), py::arg("max_tokens"), py::arg("per_micro_batch"), py::arg("per_token"),
      py::arg("per_token_squared"), py::arg("per_kv_token"), py::arg("per_collective"), py::arg("sync"),
      py::arg("min_micro_batches"), py::arg("multiple_of"), py::arg("seed"), py::arg("cp_size"), py::arg("hybrid"),
      py::arg("min_degree") = 1,
      "plan_cp_step on items (prefix trees): tokens, work in s*s units and a rank's tokens at each degree "
      "(local, item-major, log2(cp_size) + 1 per item), mini-batches of mini_batch_sizes items in order.");
}

}  // namespace seqpack::bindings
