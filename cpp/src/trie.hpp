#pragma once
// The token trie behind the prefix-tree layout (prefix_tree.cpp) and the planners'
// forest (prefix_forest.cpp), with prefix_tree.hpp's sharing rule: nodes keyed by
// (parent, token) in an open-addressing table, created in the order the rows first
// reach them, so a node's parent (and every ancestor) has a smaller id.
#include <cstdint>
#include <span>
#include <vector>

#include "seqpack/common.hpp"

namespace seqpack::detail {

struct Trie {
  // Per node, in order of creation: its token, depth (0 at a root), parent node (-1
  // for a root) and the logical index of its first occurrence.
  std::vector<int64_t> token, depth, up, first;
  std::vector<int64_t> node_of;  // [N] the node of each logical token
  int64_t num_nodes() const { return static_cast<int64_t>(token.size()); }
};

// Checks tokens / cu_seqlens / group_ids / min_shared_tokens (errors name `fn`).
void check_trie_arguments(const char* fn, std::span<const int64_t> tokens, Lengths cu,
                          std::span<const int64_t> group_ids, int64_t min_shared_tokens);

// The trie of rows given as flat tokens and offsets; arguments already checked.
// Linear in the tokens (expected).
Trie build_trie(std::span<const int64_t> tokens, Lengths cu, std::span<const int64_t> group_ids,
                int64_t min_shared_tokens);

}  // namespace seqpack::detail
