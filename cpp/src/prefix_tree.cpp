// The prefix-tree layout: the token trie (trie.hpp), then one depth-first walk that
// lays the nodes out (prefix_tree.hpp states the contract).
#include "seqpack/prefix_tree.hpp"

#include <string>

#include "trie.hpp"

namespace seqpack {
namespace {

constexpr const char* kFn = "build_prefix_tree";

}  // namespace

PrefixTree build_prefix_tree(std::span<const int64_t> tokens, Lengths cu, std::span<const int64_t> group_ids,
                             const PrefixTreeOptions& options) {
  detail::check_trie_arguments(kFn, tokens, cu, group_ids, options.min_shared_tokens);
  check_positive(kFn, "pad_to_multiple_of", options.pad_to_multiple_of);
  if (options.pad_to_multiple_of > kMaxPrefixTreePadMultiple)
    throw_invalid(kFn, "pad_to_multiple_of: must be at most 2^24 (" + std::to_string(kMaxPrefixTreePadMultiple) +
                           ": a micro-batch shape, not a memory size), got " +
                           std::to_string(options.pad_to_multiple_of));
  const size_t rows = cu.size() - 1;
  const int64_t n_logical = cu.back();
  const detail::Trie trie = detail::build_trie(tokens, cu, group_ids, options.min_shared_tokens);
  const std::vector<int64_t>&token = trie.token, &depth = trie.depth, &up = trie.up, &first = trie.first,
                           &node_of = trie.node_of;
  const int64_t n_nodes = trie.num_nodes();

  // Children in order of creation (of first appearance in the rows), and the nodes
  // a row ends at.
  std::vector<int64_t> first_child(static_cast<size_t>(n_nodes), -1), last_child(static_cast<size_t>(n_nodes), -1),
      next_sibling(static_cast<size_t>(n_nodes), -1), children(static_cast<size_t>(n_nodes), 0);
  std::vector<uint8_t> row_ends(static_cast<size_t>(n_nodes), 0);
  int64_t first_root = -1, last_root = -1;
  for (int64_t node = 0; node < n_nodes; ++node) {
    const int64_t parent = up[static_cast<size_t>(node)];
    if (parent < 0) {
      (last_root < 0 ? first_root : next_sibling[static_cast<size_t>(last_root)]) = node;
      last_root = node;
    } else {
      const auto p = static_cast<size_t>(parent);
      (last_child[p] < 0 ? first_child[p] : next_sibling[static_cast<size_t>(last_child[p])]) = node;
      last_child[p] = node;
      ++children[p];
    }
  }
  for (size_t r = 0; r < rows; ++r)
    if (cu[r + 1] > cu[r]) row_ends[static_cast<size_t>(node_of[static_cast<size_t>(cu[r + 1] - 1)])] = 1;

  // Pre-order walk: a node's subtree ends where the walk leaves it.
  std::vector<int64_t> pre(static_cast<size_t>(n_nodes)), end(static_cast<size_t>(n_nodes)),
      order(static_cast<size_t>(n_nodes));
  int64_t t = 0;
  for (int64_t node = first_root; node >= 0;) {
    pre[static_cast<size_t>(node)] = t;
    order[static_cast<size_t>(t++)] = node;
    if (first_child[static_cast<size_t>(node)] >= 0) {
      node = first_child[static_cast<size_t>(node)];
      continue;
    }
    while (node >= 0) {
      end[static_cast<size_t>(node)] = t;
      if (next_sibling[static_cast<size_t>(node)] >= 0) {
        node = next_sibling[static_cast<size_t>(node)];
        break;
      }
      node = up[static_cast<size_t>(node)];
    }
  }

  PrefixTree tree;
  const int64_t total = round_up(kFn, n_nodes, options.pad_to_multiple_of);
  if (total > kMaxPrefixTreeTokens)  // before any per-token array is allocated
    throw_invalid(kFn, "pad_to_multiple_of: rounding " + std::to_string(n_nodes) + " tokens up to a multiple of " +
                           std::to_string(options.pad_to_multiple_of) + " gives " + std::to_string(total) +
                           ", more than a tree may hold (2^31 - 1 tokens: its offsets are int32)");
  tree.num_pad_tokens = total - n_nodes;
  const auto T = static_cast<size_t>(total);
  tree.input_ids.resize(T);
  tree.position_ids.resize(T);
  tree.parent.resize(T);
  tree.subtree_end.resize(T);
  tree.first_logical.resize(T);
  std::vector<int64_t> segment_of(T);
  for (size_t i = 0; i < T; ++i) {
    const auto ii = static_cast<int64_t>(i);
    bool starts = true;
    if (ii < n_nodes) {
      const auto node = static_cast<size_t>(order[i]);
      const int64_t p = up[node];
      tree.input_ids[i] = token[node];
      tree.position_ids[i] = depth[node];
      tree.parent[i] = p < 0 ? -1 : pre[static_cast<size_t>(p)];
      tree.subtree_end[i] = end[node];
      tree.first_logical[i] = first[node];
      starts = p < 0 || children[static_cast<size_t>(p)] != 1 || row_ends[static_cast<size_t>(p)] != 0;
    } else {
      tree.input_ids[i] = options.pad_token;
      tree.position_ids[i] = 0;
      tree.parent[i] = -1;
      tree.subtree_end[i] = ii + 1;
      tree.first_logical[i] = -1;
    }
    if (starts) {
      if (i > 0) tree.segment_offsets.push_back(ii);
      const int64_t p = tree.parent[i];
      tree.segment_parent.push_back(p < 0 ? -1 : segment_of[static_cast<size_t>(p)]);
    }
    segment_of[i] = static_cast<int64_t>(tree.segment_parent.size()) - 1;
  }
  if (T > 0) tree.segment_offsets.push_back(total);

  tree.logical_index.resize(static_cast<size_t>(n_logical));
  for (size_t i = 0; i < node_of.size(); ++i) tree.logical_index[i] = pre[static_cast<size_t>(node_of[i])];
  tree.cu_seqlens.assign(cu.begin(), cu.end());
  return tree;
}

}  // namespace seqpack
