// The prefix-tree builder: two hash tries keyed by (parent key, token), then one
// depth-first walk that lays the nodes out (prefix_tree.hpp states the contract).
#include "seqpack/prefix_tree.hpp"

#include <string>
#include <unordered_map>

namespace seqpack {
namespace {

constexpr const char* kFn = "build_prefix_tree";
constexpr int64_t kMaxTokens = int64_t{1} << 40;  // a padded tree past this is a mistake, not a batch

// Open-addressing map (parent key, token) -> node id with linear probing. The
// capacity is fixed up front (a power of two, at least twice the most entries), so
// a probe always ends at an empty slot and nothing is ever rehashed.
class EdgeTable {
 public:
  explicit EdgeTable(int64_t max_entries) {
    size_t capacity = 16;
    while (capacity < static_cast<size_t>(max_entries) * 2) capacity *= 2;
    slots_.assign(capacity, Slot{});
    mask_ = capacity - 1;
  }

  // The node stored for (parent, token); when absent, stores `fresh` and returns it.
  int64_t find_or_insert(int64_t parent, int64_t token, int64_t fresh) {
    size_t i = hash(parent, token) & mask_;
    for (;; i = (i + 1) & mask_) {
      Slot& s = slots_[i];
      if (s.node < 0) {
        s = Slot{parent, token, fresh};
        return fresh;
      }
      if (s.parent == parent && s.token == token) return s.node;
    }
  }

 private:
  struct Slot {
    int64_t parent = 0, token = 0, node = -1;
  };
  static size_t hash(int64_t parent, int64_t token) {
    // SplitMix64's finaliser over both keys: good avalanche for sequential ids.
    uint64_t x = static_cast<uint64_t>(parent) * 0x9E3779B97F4A7C15ULL ^ static_cast<uint64_t>(token);
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ULL;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBULL;
    x ^= x >> 31;
    return static_cast<size_t>(x);
  }
  std::vector<Slot> slots_;
  size_t mask_ = 0;
};

void check_arguments(std::span<const int64_t> tokens, Lengths cu, std::span<const int64_t> group_ids,
                     const PrefixTreeOptions& options) {
  if (cu.empty()) throw_invalid(kFn, "cu_seqlens: must hold at least one offset (got none)");
  if (cu[0] != 0) throw_invalid(kFn, "cu_seqlens: must start at 0, got " + std::to_string(cu[0]));
  for (size_t r = 1; r < cu.size(); ++r)
    if (cu[r] < cu[r - 1])
      throw_invalid(kFn, "cu_seqlens: must never decrease, got cu_seqlens[" + std::to_string(r) +
                             "] = " + std::to_string(cu[r]) + " < " + std::to_string(cu[r - 1]));
  if (cu.back() != static_cast<int64_t>(tokens.size()))
    throw_invalid(kFn, "cu_seqlens: must end at the number of tokens (" + std::to_string(tokens.size()) +
                           "), got " + std::to_string(cu.back()));
  const size_t rows = cu.size() - 1;
  if (!group_ids.empty() && group_ids.size() != rows)
    throw_invalid(kFn, "group_ids: must hold one id per row (" + std::to_string(rows) + "), got " +
                           std::to_string(group_ids.size()));
  if (options.min_shared_tokens < 0)
    throw_invalid(kFn, "min_shared_tokens: must be >= 0, got " + std::to_string(options.min_shared_tokens));
  check_positive(kFn, "pad_to_multiple_of", options.pad_to_multiple_of);
}

// Dense group index per row (0 for every row without group ids).
std::vector<int64_t> dense_groups(std::span<const int64_t> group_ids, size_t rows) {
  std::vector<int64_t> dense(rows, 0);
  if (group_ids.empty()) return dense;
  std::unordered_map<int64_t, int64_t> index;
  index.reserve(rows);
  for (size_t r = 0; r < rows; ++r)
    dense[r] = index.emplace(group_ids[r], static_cast<int64_t>(index.size())).first->second;
  return dense;
}

// The key a row's first token hangs from. Rows with equal keys share their first
// token (and, through the trie, their whole common prefix); distinct keys never do.
// Trie nodes are >= 0, so these keys are negative.
std::vector<int64_t> root_keys(std::span<const int64_t> tokens, Lengths cu, const std::vector<int64_t>& group,
                               int64_t min_shared) {
  const size_t rows = cu.size() - 1;
  std::vector<int64_t> keys(rows);
  if (min_shared <= 1) {
    for (size_t r = 0; r < rows; ++r) keys[r] = -1 - group[r];
    return keys;
  }
  // A row of at least min_shared tokens hangs from its anchor: the node of its first
  // min_shared tokens in a trie of just those (per group). Rows with one anchor have
  // lcp >= min_shared; rows with different anchors, or shorter rows (each its own
  // key), share nothing.
  int64_t anchored_tokens = 0;
  for (size_t r = 0; r < rows; ++r)
    if (cu[r + 1] - cu[r] >= min_shared) anchored_tokens += min_shared;  // <= tokens.size()
  EdgeTable anchors(anchored_tokens);
  int64_t nodes = 0;
  std::vector<int64_t> anchor(rows, -1);
  for (size_t r = 0; r < rows; ++r) {
    if (cu[r + 1] - cu[r] < min_shared) continue;
    int64_t key = -1 - group[r];
    for (int64_t p = 0; p < min_shared; ++p) {
      key = anchors.find_or_insert(key, tokens[static_cast<size_t>(cu[r] + p)], nodes);
      if (key == nodes) ++nodes;
    }
    anchor[r] = key;
  }
  for (size_t r = 0; r < rows; ++r)
    keys[r] = anchor[r] >= 0 ? -1 - anchor[r] : -1 - nodes - static_cast<int64_t>(r);
  return keys;
}

}  // namespace

PrefixTree build_prefix_tree(std::span<const int64_t> tokens, Lengths cu, std::span<const int64_t> group_ids,
                             const PrefixTreeOptions& options) {
  check_arguments(tokens, cu, group_ids, options);
  const size_t rows = cu.size() - 1;
  const int64_t n_logical = cu.back();
  const std::vector<int64_t> keys =
      root_keys(tokens, cu, dense_groups(group_ids, rows), options.min_shared_tokens);

  // Nodes in order of creation, i.e. of first appearance in the rows.
  std::vector<int64_t> token, depth, up, first, first_child, last_child, next_sibling, children;
  std::vector<uint8_t> row_ends;
  std::vector<int64_t> node_of(static_cast<size_t>(n_logical));
  int64_t first_root = -1, last_root = -1;
  for (auto* v : {&token, &depth, &up, &first, &first_child, &last_child, &next_sibling, &children})
    v->reserve(static_cast<size_t>(n_logical));
  row_ends.reserve(static_cast<size_t>(n_logical));
  {
    EdgeTable edges(n_logical);
    for (size_t r = 0; r < rows; ++r) {
      int64_t key = keys[r], parent = -1;
      for (int64_t i = cu[r]; i < cu[r + 1]; ++i) {
        const int64_t fresh = static_cast<int64_t>(token.size());
        const int64_t node = edges.find_or_insert(key, tokens[static_cast<size_t>(i)], fresh);
        if (node == fresh) {
          token.push_back(tokens[static_cast<size_t>(i)]);
          depth.push_back(i - cu[r]);
          up.push_back(parent);
          first.push_back(i);
          first_child.push_back(-1);
          last_child.push_back(-1);
          next_sibling.push_back(-1);
          children.push_back(0);
          row_ends.push_back(0);
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
        node_of[static_cast<size_t>(i)] = node;
        key = parent = node;
      }
      if (parent >= 0) row_ends[static_cast<size_t>(parent)] = 1;
    }
  }

  // Pre-order walk: a node's subtree ends where the walk leaves it.
  const auto n_nodes = static_cast<int64_t>(token.size());
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
  if (total > kMaxTokens)
    throw_invalid(kFn, "pad_to_multiple_of: rounding " + std::to_string(n_nodes) + " tokens up to a multiple of " +
                           std::to_string(options.pad_to_multiple_of) + " gives more than 2^40 tokens");
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
