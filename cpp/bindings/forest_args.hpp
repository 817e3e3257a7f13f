#pragma once
// The arrays of a prefix forest that Python holds (PrefixForest._core_args(): its
// four per-row arrays, num_trees, and its work items or None), kept alive and viewed
// for one call.
#include <optional>

#include "convert.hpp"
#include "seqpack/prefix_forest.hpp"

namespace seqpack::bindings {

struct ForestArgs {
  LengthsArg length, order, lcp, tree;
  int64_t num_trees;
  std::optional<LengthsArg> item_offsets, item_end, item_work;
  ForestArgs(py::handle length_obj, py::handle order_obj, py::handle lcp_obj, py::handle tree_obj, int64_t trees,
             py::handle items = py::none())
      : length(length_obj, "row_length"), order(order_obj, "row_order"), lcp(lcp_obj, "adjacent_lcp"),
        tree(tree_obj, "tree_of_row"), num_trees(trees) {
    if (items.is_none()) return;
    const auto t = items.cast<py::tuple>();
    if (t.size() != 3) throw py::value_error("forest items: (item_offsets, item_end, item_work)");
    item_offsets.emplace(t[0], "item_offsets");
    item_end.emplace(t[1], "item_end");
    item_work.emplace(t[2], "item_work");
  }
  // A forest as one tuple: (row_length, row_order, adjacent_lcp, tree_of_row, num_trees, items).
  explicit ForestArgs(const py::tuple& t)
      : ForestArgs(t[0], t[1], t[2], t[3], t[4].cast<int64_t>(),
                   t.size() > 5 ? py::object(t[5]) : py::object(py::none())) {}
  ForestView view() const {
    ForestView v{length.view(), order.view(), lcp.view(), tree.view(), num_trees};
    if (item_offsets) {
      v.item_offsets = item_offsets->view();
      v.item_end = item_end->view();
      v.item_work = item_work->view();
    }
    return v;
  }
};

}  // namespace seqpack::bindings
