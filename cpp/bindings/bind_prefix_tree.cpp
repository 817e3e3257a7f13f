// Prefix-tree packing: the trie is built with the GIL released; its arrays come back
// as NumPy arrays without a copy.
#include <iterator>
#include <optional>
#include <vector>

#include "convert.hpp"
#include "seqpack/prefix_tree.hpp"

namespace seqpack::bindings {

void init_prefix_tree(py::module_& m) {
  m.def(
      "build_prefix_tree",
      [](py::handle tokens_obj, py::handle cu_obj, py::handle groups_obj, int64_t min_shared_tokens,
         int64_t pad_to_multiple_of, int64_t pad_token) {
        LengthsArg tokens(tokens_obj, "tokens"), cu(cu_obj, "cu_seqlens");
        std::optional<LengthsArg> groups;
        if (!groups_obj.is_none()) groups.emplace(groups_obj, "group_ids");
        PrefixTree tree;
        {
          py::gil_scoped_release release;
          const PrefixTreeOptions options{min_shared_tokens, pad_to_multiple_of, pad_token};
          tree = build_prefix_tree(tokens.view(), cu.view(), groups ? groups->view() : Lengths{}, options);
        }
        py::dict d;
        d["input_ids"] = to_array(std::move(tree.input_ids));
        d["position_ids"] = to_array(std::move(tree.position_ids));
        d["parent"] = to_array(std::move(tree.parent));
        d["subtree_end"] = to_array(std::move(tree.subtree_end));
        d["first_logical"] = to_array(std::move(tree.first_logical));
        d["logical_index"] = to_array(std::move(tree.logical_index));
        d["cu_seqlens"] = to_array(std::move(tree.cu_seqlens));
        d["segment_offsets"] = to_array(std::move(tree.segment_offsets));
        d["segment_parent"] = to_array(std::move(tree.segment_parent));
        d["num_pad_tokens"] = tree.num_pad_tokens;
        return d;
      },
      py::arg("tokens"), py::arg("cu_seqlens"), py::arg("group_ids"), py::arg("min_shared_tokens"),
      py::arg("pad_to_multiple_of"), py::arg("pad_token"),
      "The token trie of rows (flat tokens + cu_seqlens) in DFS order, as a dict of int64 arrays.");
  m.def(
      "check_prefix_tree",
      [](const py::dict& arrays, int64_t num_pad_tokens) {
        static constexpr const char* kNames[] = {"input_ids",     "position_ids", "parent",
                                                 "subtree_end",   "first_logical", "logical_index",
                                                 "cu_seqlens",    "segment_offsets", "segment_parent"};
        std::vector<LengthsArg> held;
        held.reserve(std::size(kNames));
        for (const char* name : kNames) held.emplace_back(py::object(arrays[name]), name);
        PrefixTreeView view{held[0].view(), held[1].view(), held[2].view(), held[3].view(), held[4].view(),
                            held[5].view(), held[6].view(), held[7].view(), held[8].view(), num_pad_tokens};
        py::gil_scoped_release release;
        check_prefix_tree("PrefixTreeBatch", view);
      },
      py::arg("arrays"), py::arg("num_pad_tokens"),
      "Raises ValueError unless the dict of int64 arrays is a prefix-tree layout build_prefix_tree could produce.");
}

}  // namespace seqpack::bindings
