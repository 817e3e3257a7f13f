// The prefix forest: built with the GIL released, its per-row arrays back as NumPy
// arrays without a copy; subset costs and planner items of a forest held in Python
// (checked first, in the core).
#include <optional>

#include "convert.hpp"
#include "forest_args.hpp"
#include "seqpack/forest_items.hpp"
#include "seqpack/forest_planning.hpp"
#include "seqpack/prefix_forest.hpp"

namespace seqpack::bindings {
void init_prefix_forest(py::module_& m) {
  m.def(
      "build_prefix_forest",
      [](py::handle tokens_obj, py::handle cu_obj, py::handle groups_obj, int64_t min_shared_tokens) {
        LengthsArg tokens(tokens_obj, "tokens"), cu(cu_obj, "cu_seqlens");
        std::optional<LengthsArg> groups;
        if (!groups_obj.is_none()) groups.emplace(groups_obj, "group_ids");
        PrefixForest forest;
        {
          py::gil_scoped_release release;
          forest = build_prefix_forest(tokens.view(), cu.view(), groups ? groups->view() : Lengths{},
                                       min_shared_tokens);
        }
        py::dict d;
        d["row_length"] = to_array(std::move(forest.row_length));
        d["row_order"] = to_array(std::move(forest.row_order));
        d["adjacent_lcp"] = to_array(std::move(forest.adjacent_lcp));
        d["tree_of_row"] = to_array(std::move(forest.tree_of_row));
        d["num_trees"] = forest.num_trees;
        d["num_nodes"] = forest.num_nodes;
        return d;
      },
      py::arg("tokens"), py::arg("cu_seqlens"), py::arg("group_ids"), py::arg("min_shared_tokens"),
      "The prefix forest of rows (flat tokens + cu_seqlens): row_length, row_order (depth-first), adjacent_lcp, "
      "tree_of_row (int64 arrays), num_trees and num_nodes.");
  m.def(
      "check_prefix_forest",
      [](py::handle length, py::handle order, py::handle lcp, py::handle tree, int64_t num_trees, py::handle items) {
        const ForestArgs f(length, order, lcp, tree, num_trees, items);
        py::gil_scoped_release release;
        check_forest("PrefixForest", f.view());
      },
      py::arg("row_length"), py::arg("row_order"), py::arg("adjacent_lcp"), py::arg("tree_of_row"),
      py::arg("num_trees"), py::arg("items") = py::none(),
      "Raises ValueError unless the arrays are a consistent prefix forest.");
  m.def(
      "forest_subset_costs",
      [](py::handle length, py::handle order, py::handle lcp, py::handle tree, int64_t num_trees, py::handle rows_obj,
         py::handle offsets_obj, py::handle items) {
        const ForestArgs f(length, order, lcp, tree, num_trees, items);
        LengthsArg rows(rows_obj, "rows"), offsets(offsets_obj, "offsets");
        const size_t n = offsets.view().empty() ? 0 : offsets.view().size() - 1;
        std::vector<SubsetCost> costs(n);
        {
          py::gil_scoped_release release;
          forest_subset_costs(f.view(), rows.view(), offsets.view(), costs);
        }
        std::vector<int64_t> tokens(n), pairs(n), work(n);
        for (size_t k = 0; k < n; ++k) {
          tokens[k] = costs[k].tokens;
          pairs[k] = costs[k].pairs;
          work[k] = costs[k].work;
        }
        return py::make_tuple(to_array(std::move(tokens)), to_array(std::move(pairs)), to_array(std::move(work)));
      },
      py::arg("row_length"), py::arg("row_order"), py::arg("adjacent_lcp"), py::arg("tree_of_row"),
      py::arg("num_trees"), py::arg("rows"), py::arg("offsets"), py::arg("items") = py::none(),
      "(physical tokens, visible pairs, work items) of each subset rows[offsets[k]:offsets[k + 1]] of a forest.");
  m.def(
      "forest_items",
      [](py::handle length, py::handle order, py::handle lcp, py::handle tree, int64_t num_trees, int64_t max_tokens,
         py::handle rows_obj, int64_t min_items, py::handle items) {
        const ForestArgs f(length, order, lcp, tree, num_trees, items);
        std::optional<LengthsArg> rows;
        if (!rows_obj.is_none()) rows.emplace(rows_obj, "rows");
        ForestItems found;
        {
          py::gil_scoped_release release;
          found = rows ? forest_items(f.view(), max_tokens, rows->view(), min_items)
                       : forest_items(f.view(), max_tokens, min_items);
        }
        py::dict d;
        d["rows"] = to_list(found.rows);
        d["tokens"] = to_array(std::move(found.tokens));
        d["pairs"] = to_array(std::move(found.pairs));
        d["work"] = to_array(std::move(found.work));
        d["tree"] = to_array(std::move(found.tree));
        d["duplicated_tokens"] = found.duplicated_tokens;
        return d;
      },
      py::arg("row_length"), py::arg("row_order"), py::arg("adjacent_lcp"), py::arg("tree_of_row"),
      py::arg("num_trees"), py::arg("max_tokens"), py::arg("rows") = py::none(), py::arg("min_items") = 0,
      py::arg("items") = py::none(),
      "The planner's items of a forest (or of the subset `rows`) under max_tokens: whole trees, or the contiguous "
      "split of a larger tree that duplicates the fewest tokens (rows, tokens, pairs, tree, duplicated_tokens); "
      "halved until there are min_items.");
  m.def(
      "plan_forest_micro_batches",
      [](py::handle length, py::handle order, py::handle lcp, py::handle tree, int64_t num_trees, int64_t max_tokens,
         int64_t min_num, int64_t multiple_of, int64_t attention_coeff, bool small_at_ends, bool whole_trees,
         py::handle items) {
        const ForestArgs f(length, order, lcp, tree, num_trees, items);
        const ForestPlanOptions o{max_tokens, min_num, multiple_of, attention_coeff, small_at_ends, whole_trees};
        ForestMicroBatchPlan plan;
        {
          py::gil_scoped_release release;
          plan = plan_forest_micro_batches(f.view(), o);
        }
        py::dict d;
        d["groups"] = to_list(plan.groups);
        d["tokens"] = plan.tokens;
        d["pairs"] = plan.pairs;
        d["workloads"] = plan.workloads;
        d["lower_bound"] = plan.lower_bound;
        d["physical_tokens"] = plan.physical_tokens;
        d["method"] = std::string(plan.method);
        return d;
      },
      py::arg("row_length"), py::arg("row_order"), py::arg("adjacent_lcp"), py::arg("tree_of_row"),
      py::arg("num_trees"), py::arg("max_tokens"), py::arg("min_num"), py::arg("multiple_of"),
      py::arg("attention_coeff"), py::arg("small_at_ends"), py::arg("whole_trees"), py::arg("items") = py::none(),
      "Micro-batches of a forest's rows under a cap on physical tokens (forest_planning.hpp).");
  m.def(
      "first_fit_trie",
      [](py::handle length, py::handle order, py::handle lcp, py::handle tree, int64_t num_trees, int64_t max_tokens,
         py::handle rows_obj, py::handle items) {
        const ForestArgs f(length, order, lcp, tree, num_trees, items);
        LengthsArg rows(rows_obj, "rows");
        IndexGroups groups;
        {
          py::gil_scoped_release release;
          groups = first_fit_trie(f.view(), max_tokens, rows.view());
        }
        return to_list(groups);
      },
      py::arg("row_length"), py::arg("row_order"), py::arg("adjacent_lcp"), py::arg("tree_of_row"),
      py::arg("num_trees"), py::arg("max_tokens"), py::arg("rows"), py::arg("items") = py::none(),
      "AReaL's trie packing: rows in the given order, each to the first micro-batch where the tokens it adds fit.");
}

}  // namespace seqpack::bindings
