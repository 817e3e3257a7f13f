// The token trie (trie.hpp): an open-addressing edge table, the sharing rule's root
// keys, and the one pass over the rows that creates the nodes.
#include "trie.hpp"

#include <string>
#include <unordered_map>

namespace seqpack::detail {
namespace {

// Open-addressing map (parent key, token) -> node id with linear probing, kept at
// most half full (doubled and rehashed past that), so a probe always ends at an
// empty slot. Sized for what it will hold, not for the tokens: the trie builder
// stores only the edges it cannot find by position (below).
class EdgeTable {
 public:
  explicit EdgeTable(int64_t expected_entries) {
    size_t capacity = 16;
    while (capacity < static_cast<size_t>(expected_entries) * 2) capacity *= 2;
    slots_.assign(capacity, Slot{});
    mask_ = capacity - 1;
  }

  // The node stored for (parent, token), or -1.
  int64_t find(int64_t parent, int64_t token) const {
    for (size_t i = hash(parent, token) & mask_;; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.node < 0) return -1;
      if (s.parent == parent && s.token == token) return s.node;
    }
  }

  // Stores (parent, token) -> node; the pair must be absent.
  void insert(int64_t parent, int64_t token, int64_t node) {
    if (2 * (size_ + 1) > slots_.size()) grow();
    place(Slot{parent, token, node});
    ++size_;
  }

  // The node stored for (parent, token); when absent, stores `fresh` and returns it.
  int64_t find_or_insert(int64_t parent, int64_t token, int64_t fresh) {
    const int64_t node = find(parent, token);
    if (node >= 0) return node;
    insert(parent, token, fresh);
    return fresh;
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
  void place(const Slot& slot) {
    size_t i = hash(slot.parent, slot.token) & mask_;
    while (slots_[i].node >= 0) i = (i + 1) & mask_;
    slots_[i] = slot;
  }
  void grow() {
    std::vector<Slot> old(slots_.size() * 2, Slot{});
    old.swap(slots_);
    mask_ = slots_.size() - 1;
    for (const Slot& slot : old)
      if (slot.node >= 0) place(slot);
  }

  std::vector<Slot> slots_;
  size_t mask_ = 0;
  size_t size_ = 0;
};

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

void check_trie_arguments(const char* fn, std::span<const int64_t> tokens, Lengths cu,
                          std::span<const int64_t> group_ids, int64_t min_shared_tokens) {
  if (cu.empty()) throw_invalid(fn, "cu_seqlens: must hold at least one offset (got none)");
  if (cu[0] != 0) throw_invalid(fn, "cu_seqlens: must start at 0, got " + std::to_string(cu[0]));
  for (size_t r = 1; r < cu.size(); ++r)
    if (cu[r] < cu[r - 1])
      throw_invalid(fn, "cu_seqlens: must never decrease, got cu_seqlens[" + std::to_string(r) +
                            "] = " + std::to_string(cu[r]) + " < " + std::to_string(cu[r - 1]));
  if (cu.back() != static_cast<int64_t>(tokens.size()))
    throw_invalid(fn, "cu_seqlens: must end at the number of tokens (" + std::to_string(tokens.size()) +
                          "), got " + std::to_string(cu.back()));
  const size_t rows = cu.size() - 1;
  if (!group_ids.empty() && group_ids.size() != rows)
    throw_invalid(fn, "group_ids: must hold one id per row (" + std::to_string(rows) + "), got " +
                          std::to_string(group_ids.size()));
  if (min_shared_tokens < 0)
    throw_invalid(fn, "min_shared_tokens: must be >= 0, got " + std::to_string(min_shared_tokens));
}

Trie build_trie(std::span<const int64_t> tokens, Lengths cu, std::span<const int64_t> group_ids,
                int64_t min_shared_tokens) {
  const size_t rows = cu.size() - 1;
  const int64_t n_logical = cu.back();
  const std::vector<int64_t> keys = root_keys(tokens, cu, dense_groups(group_ids, rows), min_shared_tokens);
  Trie trie;
  for (auto* v : {&trie.token, &trie.depth, &trie.up, &trie.first}) v->reserve(static_cast<size_t>(n_logical));
  trie.node_of.resize(static_cast<size_t>(n_logical));
  // A node created right after its parent (a row running on past the existing
  // nodes) has the parent's id + 1: that edge is found by position, sequentially, and
  // never stored; the table holds the roots and the branches only. A row walking a
  // shared prefix (a GRPO prompt, an agent's history) then reads consecutive nodes.
  EdgeTable edges(static_cast<int64_t>(rows) * 4);
  for (size_t r = 0; r < rows; ++r) {
    int64_t key = keys[r], parent = -1;
    for (int64_t i = cu[r]; i < cu[r + 1]; ++i) {
      const int64_t tok = tokens[static_cast<size_t>(i)];
      int64_t node = -1;
      if (parent >= 0 && parent + 1 < trie.num_nodes() && trie.up[static_cast<size_t>(parent) + 1] == parent &&
          trie.token[static_cast<size_t>(parent) + 1] == tok)
        node = parent + 1;
      else
        node = edges.find(key, tok);
      if (node < 0) {
        node = trie.num_nodes();
        if (parent < 0 || node != parent + 1) edges.insert(key, tok, node);
        trie.token.push_back(tok);
        trie.depth.push_back(i - cu[r]);
        trie.up.push_back(parent);
        trie.first.push_back(i);
      }
      trie.node_of[static_cast<size_t>(i)] = node;
      key = parent = node;
    }
  }
  return trie;
}

}  // namespace seqpack::detail
