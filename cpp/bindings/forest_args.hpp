#pragma once
// The arrays of a prefix forest that Python holds (PrefixForest._core_args()), kept
// alive and viewed for one call.
#include "convert.hpp"
#include "seqpack/prefix_forest.hpp"

namespace seqpack::bindings {

struct ForestArgs {
  LengthsArg length, order, lcp, tree;
  int64_t num_trees;
  ForestArgs(py::handle length_obj, py::handle order_obj, py::handle lcp_obj, py::handle tree_obj, int64_t trees)
      : length(length_obj, "row_length"), order(order_obj, "row_order"), lcp(lcp_obj, "adjacent_lcp"),
        tree(tree_obj, "tree_of_row"), num_trees(trees) {}
  ForestView view() const { return {length.view(), order.view(), lcp.view(), tree.view(), num_trees}; }
};

}  // namespace seqpack::bindings
