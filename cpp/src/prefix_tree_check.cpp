// The contract of a prefix-tree layout, checked on arrays given from outside (a
// pickle, a hand-built tree): what build_prefix_tree guarantees, in linear time.
#include <string>
#include <vector>

#include "seqpack/prefix_tree.hpp"

namespace seqpack {
namespace {

std::string at(const char* name, size_t i) { return std::string(name) + "[" + std::to_string(i) + "]"; }

void check_size(const char* fn, const char* name, Lengths a, size_t n, const char* what) {
  if (a.size() != n)
    throw_invalid(fn, std::string(name) + ": must hold one entry per " + what + " (" + std::to_string(n) +
                          "), got " + std::to_string(a.size()));
}

// Offsets: start at 0, end at `total`, never decrease (strictly increase if `strict`).
void check_offsets(const char* fn, const char* name, Lengths a, int64_t total, bool strict) {
  if (a.empty() || a.front() != 0 || a.back() != total)
    throw_invalid(fn, std::string(name) + ": must start at 0 and end at " + std::to_string(total));
  for (size_t i = 1; i < a.size(); ++i)
    if (a[i] < a[i - 1] || (strict && a[i] == a[i - 1]))
      throw_invalid(fn, at(name, i) + ": offsets must " + (strict ? "increase" : "never decrease") + ", got " +
                            std::to_string(a[i - 1]) + " then " + std::to_string(a[i]));
}

}  // namespace

void check_prefix_tree(const char* fn, const PrefixTreeView& t) {
  const size_t T = t.input_ids.size();
  if (static_cast<int64_t>(T) > kMaxPrefixTreeTokens)
    throw_invalid(fn, "input_ids: a tree holds at most 2^31 - 1 physical tokens, got " + std::to_string(T));
  check_size(fn, "position_ids", t.position_ids, T, "physical token");
  check_size(fn, "parent", t.parent, T, "physical token");
  check_size(fn, "subtree_end", t.subtree_end, T, "physical token");
  check_size(fn, "first_logical", t.first_logical, T, "physical token");
  if (t.num_pad_tokens < 0 || t.num_pad_tokens > static_cast<int64_t>(T))
    throw_invalid(fn, "num_pad_tokens: must be in [0, " + std::to_string(T) + "], got " +
                          std::to_string(t.num_pad_tokens));
  const size_t real = T - static_cast<size_t>(t.num_pad_tokens);
  const size_t N = t.logical_index.size();
  check_offsets(fn, "cu_seqlens", t.cu_seqlens, static_cast<int64_t>(N), false);

  // Depth-first order: a stack of the open subtrees; at node i every subtree that
  // ends at i closes, and what stays on top must be i's parent.
  std::vector<int64_t> open;
  for (size_t i = 0; i < real; ++i) {
    const auto ii = static_cast<int64_t>(i);
    while (!open.empty() && t.subtree_end[static_cast<size_t>(open.back())] == ii) open.pop_back();
    const int64_t p = t.parent[i], end = t.subtree_end[i];
    if (p != (open.empty() ? -1 : open.back()))
      throw_invalid(fn, at("parent", i) + " = " + std::to_string(p) + " breaks the depth-first order (expected " +
                            std::to_string(open.empty() ? -1 : open.back()) + " from subtree_end)");
    if (end <= ii || end > (open.empty() ? static_cast<int64_t>(real) : t.subtree_end[static_cast<size_t>(p)]))
      throw_invalid(fn, at("subtree_end", i) + " = " + std::to_string(end) +
                            " must close the subtree after the token and inside its parent's");
    const int64_t depth = p < 0 ? 0 : t.position_ids[static_cast<size_t>(p)] + 1;
    if (t.position_ids[i] != depth)
      throw_invalid(fn, at("position_ids", i) + " = " + std::to_string(t.position_ids[i]) +
                            " must be the token's depth (" + std::to_string(depth) + ")");
    open.push_back(ii);
  }
  for (const int64_t node : open)
    if (t.subtree_end[static_cast<size_t>(node)] != static_cast<int64_t>(real))
      throw_invalid(fn, at("subtree_end", static_cast<size_t>(node)) + " must end with the real tokens (" +
                            std::to_string(real) + ")");
  for (size_t i = real; i < T; ++i)
    if (t.parent[i] != -1 || t.subtree_end[i] != static_cast<int64_t>(i) + 1 || t.position_ids[i] != 0 ||
        t.first_logical[i] != -1)
      throw_invalid(fn, "pad token " + std::to_string(i) +
                            ": must be its own root (parent -1, subtree_end i + 1, position 0, first_logical -1)");

  // Rows: each a path from a root, one token deeper at a time; first_logical the
  // first logical occurrence of each real token, and every real token on a row.
  std::vector<int64_t> first(real, -1);
  for (size_t r = 0; r + 1 < t.cu_seqlens.size(); ++r)
    for (int64_t j = t.cu_seqlens[r]; j < t.cu_seqlens[r + 1]; ++j) {
      const auto jj = static_cast<size_t>(j);
      const int64_t node = t.logical_index[jj];
      if (node < 0 || node >= static_cast<int64_t>(real))
        throw_invalid(fn, at("logical_index", jj) + " = " + std::to_string(node) + " must be a real token in [0, " +
                              std::to_string(real) + ")");
      const int64_t expected = j == t.cu_seqlens[r] ? -1 : t.logical_index[jj - 1];
      if (t.parent[static_cast<size_t>(node)] != expected)
        throw_invalid(fn, at("logical_index", jj) + " = " + std::to_string(node) + ": row " + std::to_string(r) +
                              " must be a path from a root (the token's parent is " +
                              std::to_string(t.parent[static_cast<size_t>(node)]) + ", the row's previous token " +
                              std::to_string(expected) + ")");
      if (first[static_cast<size_t>(node)] < 0) first[static_cast<size_t>(node)] = j;
    }
  for (size_t i = 0; i < real; ++i)
    if (t.first_logical[i] != first[i])
      throw_invalid(fn, at("first_logical", i) + " = " + std::to_string(t.first_logical[i]) +
                            " must be the token's first logical occurrence (" + std::to_string(first[i]) +
                            (first[i] < 0 ? ": no row reaches it)" : ")"));

  // Segments, by the rule of prefix_tree.hpp.
  std::vector<int64_t> children(real, 0);
  std::vector<uint8_t> row_ends(real, 0);
  for (size_t i = 0; i < real; ++i)
    if (t.parent[i] >= 0) ++children[static_cast<size_t>(t.parent[i])];
  for (size_t r = 0; r + 1 < t.cu_seqlens.size(); ++r)
    if (t.cu_seqlens[r + 1] > t.cu_seqlens[r])
      row_ends[static_cast<size_t>(t.logical_index[static_cast<size_t>(t.cu_seqlens[r + 1] - 1)])] = 1;
  check_offsets(fn, "segment_offsets", t.segment_offsets, static_cast<int64_t>(T), true);
  check_size(fn, "segment_parent", t.segment_parent, t.segment_offsets.size() - 1, "segment");
  size_t s = 0;
  std::vector<int64_t> segment_of(T);
  for (size_t i = 0; i < T; ++i) {
    const int64_t p = t.parent[i];
    const bool starts = i >= real || p < 0 || children[static_cast<size_t>(p)] != 1 || row_ends[static_cast<size_t>(p)];
    if (starts != (s < t.segment_parent.size() && t.segment_offsets[s] == static_cast<int64_t>(i)))
      throw_invalid(fn, "segment_offsets: token " + std::to_string(i) + (starts ? " starts" : " does not start") +
                            " a segment by the tree's rule");
    if (starts) {
      const int64_t expected = p < 0 ? -1 : segment_of[static_cast<size_t>(p)];
      if (t.segment_parent[s] != expected)
        throw_invalid(fn, at("segment_parent", s) + " = " + std::to_string(t.segment_parent[s]) + " must be " +
                              std::to_string(expected));
      ++s;
    }
    segment_of[i] = static_cast<int64_t>(s) - 1;
  }
}

}  // namespace seqpack
