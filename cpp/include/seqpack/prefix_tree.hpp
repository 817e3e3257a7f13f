#pragma once
// Prefix-tree packing: rows that share a prefix are laid out once, as a token trie
// whose nodes are the physical tokens, in depth-first order.
//
//   rows (logical)      trie                  DFS order (physical index: token)
//   r0 = 5 6 7          5 ─ 6 ─┬─ 7           0:5  1:6  2:7  3:8  4:9  5:5'
//   r1 = 5 6 8 9               └─ 8 ─ 9       parent      = [-1, 0, 1, 1, 3, -1]
//   r2 = 5 6                                  subtree_end = [ 5, 5, 3, 5, 5,  6]
//   r3 = 5  (group 1)   5'                    position    = [ 0, 1, 2, 2, 3,  0]
//
// Key j is visible to query i exactly when j <= i < subtree_end[j] (j is an
// ancestor of i or i itself), which is each row's causal mask, mapped through
// logical_index. Children follow the order in which the rows first reach them.
//
// Sharing. Two rows r and s share tokens only when they are in the same group and
// their longest common prefix, lcp(r, s), is at least max(min_shared_tokens, 1);
// they then share exactly their first lcp(r, s) tokens. The relation is transitive
// (lcp(r, t) >= min(lcp(r, s), lcp(s, t))), so the physical tokens are well defined
// and do not depend on the order of the rows. With min_shared_tokens = 3,
// "1 2 3 4" and "1 2 3 5" share "1 2 3"; "1 2 7" shares nothing with either (its
// common prefix with them is 2 tokens); a row shorter than min_shared_tokens is
// never shared, not even with an exact duplicate.
//
// Segments: maximal chains in which every node but the last has exactly one child
// and no row ends at it. A node starts a segment when it is a root, its parent has
// several children, or a row ends at its parent. Each row's tokens are thus a
// root-to-leaf path of whole segments; in DFS order a segment is a contiguous range.
#include <cstdint>
#include <span>
#include <vector>

#include "seqpack/common.hpp"

namespace seqpack {

struct PrefixTreeOptions {
  int64_t min_shared_tokens = 1;   // >= 0; 0 means 1
  int64_t pad_to_multiple_of = 1;  // > 0: T is rounded up with pad tokens, each its own root
  int64_t pad_token = 0;           // input id of a pad token (position 0, parent -1)
};

struct PrefixTree {
  // Physical tokens [T] in DFS order (pad tokens last).
  std::vector<int64_t> input_ids, position_ids, parent, subtree_end;
  // For each physical token, the logical index of its first occurrence (-1 for a pad).
  std::vector<int64_t> first_logical;
  // [N]: physical index of each logical token of the concatenated rows.
  std::vector<int64_t> logical_index;
  std::vector<int64_t> cu_seqlens;  // [R + 1], the rows' logical offsets
  // Segments: [S + 1] offsets into the physical order, [S] parent segment (-1: root).
  std::vector<int64_t> segment_offsets{0}, segment_parent;
  int64_t num_pad_tokens = 0;

  int64_t num_tokens() const { return static_cast<int64_t>(input_ids.size()); }
  int64_t num_logical_tokens() const { return static_cast<int64_t>(logical_index.size()); }
  bool operator==(const PrefixTree&) const = default;
};

// Builds the trie of rows given as flat `tokens` and offsets `cu_seqlens` ([R + 1],
// starting at 0, non-decreasing, ending at tokens.size()). `group_ids`: empty (one
// group) or one id per row; rows of different groups never share a token. Linear in
// the number of tokens (expected; an open-addressing hash keyed by (parent, token)).
PrefixTree build_prefix_tree(std::span<const int64_t> tokens, Lengths cu_seqlens, std::span<const int64_t> group_ids,
                             const PrefixTreeOptions& options = {});

// The arrays of a PrefixTree, borrowed (a tree rebuilt from a pickle, or given by hand).
struct PrefixTreeView {
  Lengths input_ids, position_ids, parent, subtree_end, first_logical, logical_index, cu_seqlens, segment_offsets,
      segment_parent;
  int64_t num_pad_tokens = 0;
};

// Throws std::invalid_argument ("[seqpack.<fn>] <array>: <rule>") unless `tree` is a
// layout build_prefix_tree could have produced: one entry per physical token where
// due, at most kMaxPrefixTreeTokens tokens, pad tokens last (each its own root at
// position 0), parents before their children in depth-first order with
// subtree_end closing each subtree, position = depth, every row a root-to-node path
// (logical_index), first_logical the first occurrence of each physical token,
// every real token on some row, and the segments of the rule above. Linear time.
void check_prefix_tree(const char* fn, const PrefixTreeView& tree);

// The most physical tokens a tree may have, padding included: offsets of the tree
// reach kernels as int32 (flash-attention's cu_seqlens), as every packed layout's do.
inline constexpr int64_t kMaxPrefixTreeTokens = (int64_t{1} << 31) - 1;
// The largest pad_to_multiple_of: a multiple is a static micro-batch shape, and a
// pad of tens of millions of tokens is a mistake (2^24 pads hold 640 MiB of arrays).
inline constexpr int64_t kMaxPrefixTreePadMultiple = int64_t{1} << 24;

}  // namespace seqpack
