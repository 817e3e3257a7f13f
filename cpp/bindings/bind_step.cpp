// The whole-step planner (step_planner.hpp) as one call, and the forest CP items and
// the work cut it counts with (forest_cp.hpp).
#include <optional>
#include <string>

#include "convert.hpp"
#include "forest_args.hpp"
#include "seqpack/forest_cp.hpp"
#include "seqpack/step_planner.hpp"

namespace seqpack::bindings {

namespace {

StepSync sync_of(const std::string& sync) {
  if (sync == "micro_batch") return StepSync::MicroBatch;
  if (sync == "step") return StepSync::Step;
  throw py::value_error("sync must be 'micro_batch' or 'step', got '" + sync + "'");
}

MicroBatchOrder order_of(const std::string& order) {
  if (order == "planned") return MicroBatchOrder::Planned;
  if (order == "largest_first") return MicroBatchOrder::LargestFirst;
  throw py::value_error("micro_batch_order must be 'planned' or 'largest_first', got '" + order + "'");
}

std::optional<ForestArgs> forest_of(py::handle forest) {
  if (forest.is_none()) return std::nullopt;
  const auto t = forest.cast<py::tuple>();
  if (t.size() != 5 && t.size() != 6)
    throw py::value_error("forest: (row_length, row_order, adjacent_lcp, tree_of_row, num_trees[, items])");
  return std::optional<ForestArgs>(std::in_place, t);
}

// {"mini_batches": [{begin, end, num_micro_batches, cells, costs, tokens, padded (static
// shapes), predicted_time, lower_bound}, ...], "predicted_time", "lower_bound"}, with
// CP: "degree", "first_rank", "kv_tokens", "least_kv_tokens"; with a forest: "planned_on".
py::dict step_dict(PlannedStep&& step, bool cp, bool forest) {
  py::list minis;
  for (MiniBatchStep& mb : step.plan.mini_batches) {
    py::dict d;
    d["begin"] = mb.begin;
    d["end"] = mb.end;
    d["num_micro_batches"] = mb.num_micro_batches;
    d["cells"] = to_list(mb.cells);
    d["costs"] = mb.costs;
    d["tokens"] = mb.tokens;
    if (!mb.padded.empty()) d["padded"] = mb.padded;
    d["predicted_time"] = mb.predicted_time;
    d["lower_bound"] = mb.lower_bound;
    minis.append(d);
  }
  py::dict out;
  out["mini_batches"] = minis;
  out["predicted_time"] = step.plan.predicted_time;
  out["lower_bound"] = step.plan.lower_bound;
  if (cp) {
    out["degree"] = to_array(std::move(step.degree));
    out["first_rank"] = to_array(std::move(step.first_rank));
    out["kv_tokens"] = step.kv_tokens;
    out["least_kv_tokens"] = step.least_kv_tokens;
  }
  if (forest) out["planned_on"] = step.planned_on;
  return out;
}

}  // namespace

void init_step(py::module_& m) {
  m.def(
      "plan_step",
      [](py::handle lengths, int64_t dp_size, int64_t max_tokens, double per_micro_batch, double per_token,
         double per_token_squared, const std::string& sync, int64_t mini_batches, int64_t min_micro_batches,
         int64_t multiple_of, std::optional<uint64_t> seed, py::handle squares, py::handle mini_batch_sizes,
         py::handle forest, bool whole_trees, double per_kv_token, double per_collective, int64_t cp_size,
         bool hybrid, int64_t min_degree, const std::string& micro_batch_order, py::handle buckets) {
        LengthsArg arg(lengths, "lengths");
        std::optional<LengthsArg> sq, sizes, shapes;
        if (!squares.is_none()) sq.emplace(squares, "squares");
        if (!mini_batch_sizes.is_none()) sizes.emplace(mini_batch_sizes, "mini_batch_sizes");
        if (!buckets.is_none()) shapes.emplace(buckets, "static_shapes");
        const std::optional<ForestArgs> f = forest_of(forest);
        StepRequest q;
        q.lengths = arg.view();
        if (f) q.forest = f->view();
        StepOptions& o = q.options.step;
        o.dp_size = dp_size;
        o.max_tokens = max_tokens;
        o.cost = StepCost{per_micro_batch, per_token, per_token_squared};
        o.sync = sync_of(sync);
        o.mini_batches = mini_batches;
        o.min_micro_batches = min_micro_batches;
        o.multiple_of = multiple_of;
        o.seed = seed;
        if (sq) o.squares = sq->view();
        if (sizes) o.mini_batch_sizes = sizes->view();
        q.options.cp_size = cp_size;
        q.options.hybrid = hybrid;
        q.options.min_degree = min_degree;
        q.options.cp = CpCost{per_kv_token, per_collective};
        q.whole_trees = whole_trees;
        q.shapes.order = order_of(micro_batch_order);
        if (shapes) q.shapes.buckets.assign(shapes->view().begin(), shapes->view().end());
        PlannedStep step;
        {
          py::gil_scoped_release release;
          step = plan_training_step(q);
        }
        return step_dict(std::move(step), cp_size > 1, f.has_value());
      },
      py::arg("lengths"), py::arg("dp_size"), py::arg("max_tokens"), py::arg("per_micro_batch"), py::arg("per_token"),
      py::arg("per_token_squared"), py::arg("sync") = "micro_batch", py::arg("mini_batches") = 1,
      py::arg("min_micro_batches") = 1, py::arg("multiple_of") = 1, py::arg("seed") = py::none(),
      py::arg("squares") = py::none(), py::arg("mini_batch_sizes") = py::none(), py::arg("forest") = py::none(),
      py::arg("whole_trees") = false, py::arg("per_kv_token") = 0.0, py::arg("per_collective") = 0.0,
      py::arg("cp_size") = 1, py::arg("hybrid") = false, py::arg("min_degree") = 1,
      py::arg("micro_batch_order") = "planned", py::arg("buckets") = py::none(),
      "The whole training step in one call (step_planner.hpp): rows, CP, prefix trees (forest = "
      "(row_length, row_order, adjacent_lcp, tree_of_row, num_trees)) or both, then the step shapes.");
  m.def(
      "cp_work_bounds",
      [](py::handle work, int64_t cp_size) {
        return map_lengths(work, "work", [&](Lengths w) { return cp_work_bounds(w, cp_size); });
      },
      py::arg("work"), py::arg("cp_size"),
      "The cut of tokens of these works (keys seen) into cp_size contiguous ranges balanced by work: "
      "cp_size + 1 offsets.");
  m.def(
      "forest_cp_items",
      [](py::handle length, py::handle order, py::handle lcp, py::handle tree, int64_t num_trees,
         py::handle mini_batch_rows, int64_t cp_size) {
        const ForestArgs f(length, order, lcp, tree, num_trees);
        LengthsArg rows(mini_batch_rows, "mini_batch_rows");
        ForestCpItems items;
        {
          py::gil_scoped_release release;
          items = forest_cp_items(f.view(), rows.view(), cp_size);
        }
        py::dict out;
        out["rows"] = to_list(items.rows);
        out["tokens"] = to_array(std::move(items.items.tokens));
        out["squares"] = to_array(std::move(items.items.squares));
        const py::ssize_t levels = items.items.levels;
        out["local"] = to_array(std::move(items.items.local)).reshape({static_cast<py::ssize_t>(-1), levels});
        out["mini_batch_sizes"] = to_array(std::move(items.mini_batch_sizes));
        return out;
      },
      py::arg("row_length"), py::arg("row_order"), py::arg("adjacent_lcp"), py::arg("tree_of_row"),
      py::arg("num_trees"), py::arg("mini_batch_rows"), py::arg("cp_size"),
      "The items plan_step places with a forest and cp_size: per tree of each mini-batch its rows, physical "
      "tokens, attention work (2 pairs - tokens) and a rank's tokens at each degree 1, 2, .. cp_size.");
}

}  // namespace seqpack::bindings
