// The prefix forest: built with the GIL released, its arrays back as NumPy arrays
// without a copy; subset costs of a forest held in Python (checked first).
#include <optional>

#include "convert.hpp"
#include "seqpack/forest_items.hpp"
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
        d["parent"] = to_array(std::move(forest.parent));
        d["depth"] = to_array(std::move(forest.depth));
        d["row_leaf"] = to_array(std::move(forest.row_leaf));
        d["tree_of_row"] = to_array(std::move(forest.tree_of_row));
        d["num_trees"] = forest.num_trees;
        return d;
      },
      py::arg("tokens"), py::arg("cu_seqlens"), py::arg("group_ids"), py::arg("min_shared_tokens"),
      "The prefix forest of rows (flat tokens + cu_seqlens): parent, depth, row_leaf, tree_of_row (int64 arrays) "
      "and num_trees.");
  m.def(
      "check_prefix_forest",
      [](py::handle parent_obj, py::handle depth_obj, py::handle leaf_obj) {
        LengthsArg parent(parent_obj, "parent"), depth(depth_obj, "depth"), leaf(leaf_obj, "row_leaf");
        py::gil_scoped_release release;
        check_forest("PrefixForest", {parent.view(), depth.view(), leaf.view()});
      },
      py::arg("parent"), py::arg("depth"), py::arg("row_leaf"),
      "Raises ValueError unless the arrays are a forest (parents earlier, depths consistent, leaves in range).");
  m.def(
      "forest_subset_costs",
      [](py::handle parent_obj, py::handle depth_obj, py::handle leaf_obj, py::handle rows_obj,
         py::handle offsets_obj) {
        LengthsArg parent(parent_obj, "parent"), depth(depth_obj, "depth"), leaf(leaf_obj, "row_leaf"),
            rows(rows_obj, "rows"), offsets(offsets_obj, "offsets");
        const size_t n = offsets.view().empty() ? 0 : offsets.view().size() - 1;
        std::vector<SubsetCost> costs(n);
        {
          py::gil_scoped_release release;
          forest_subset_costs({parent.view(), depth.view(), leaf.view()}, rows.view(), offsets.view(), costs);
        }
        std::vector<int64_t> tokens(n), pairs(n);
        for (size_t k = 0; k < n; ++k) {
          tokens[k] = costs[k].tokens;
          pairs[k] = costs[k].pairs;
        }
        return py::make_tuple(to_array(std::move(tokens)), to_array(std::move(pairs)));
      },
      py::arg("parent"), py::arg("depth"), py::arg("row_leaf"), py::arg("rows"), py::arg("offsets"),
      "(physical tokens, visible pairs) of each subset rows[offsets[k]:offsets[k + 1]] of a checked forest.");
  m.def(
      "forest_items",
      [](py::handle parent_obj, py::handle depth_obj, py::handle leaf_obj, py::handle tree_obj, int64_t num_trees,
         int64_t max_tokens) {
        LengthsArg parent(parent_obj, "parent"), depth(depth_obj, "depth"), leaf(leaf_obj, "row_leaf"),
            tree(tree_obj, "tree_of_row");
        ForestItems items;
        {
          py::gil_scoped_release release;
          items = forest_items({parent.view(), depth.view(), leaf.view()}, tree.view(), num_trees, max_tokens);
        }
        py::dict d;
        d["rows"] = to_list(items.rows);
        d["tokens"] = to_array(std::move(items.tokens));
        d["pairs"] = to_array(std::move(items.pairs));
        d["tree"] = to_array(std::move(items.tree));
        d["duplicated_tokens"] = items.duplicated_tokens;
        return d;
      },
      py::arg("parent"), py::arg("depth"), py::arg("row_leaf"), py::arg("tree_of_row"), py::arg("num_trees"),
      py::arg("max_tokens"),
      "The planner's items of a forest under max_tokens: whole trees, or the contiguous split of a larger tree "
      "that duplicates the fewest tokens (rows, tokens, pairs, tree, duplicated_tokens).");
}

}  // namespace seqpack::bindings
