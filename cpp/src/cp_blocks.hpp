#pragma once
// The aligned blocks of a CP step placement (cp_step.cpp), indexed for its greedy
// searches, so that placing an item costs a few tree descents per micro-batch step
// instead of a scan of every rank.
//
//   R = 8 ranks, degree 2^j = 2: blocks b = 0..3, block b = ranks [2b, 2b + 2)
//   ranks      0 1 | 2 3 | 4 5 | 6 7
//   blocks      b0    b1    b2    b3        leaves of a segment tree per step
//   node  (b0 b1)  (b2 b3)                  each node: the least tokens, the most
//   root  (b0 b1 b2 b3)                     tokens and the least load of its blocks
//
// A block holds the most tokens and the most load of its ranks. Values only grow
// while items are placed, so a block's maximum follows its ranks in O(1) and a node's
// aggregates are exact. A search keeps the block with the least (key, index) among
// those whose tokens fit: a subtree none of whose blocks fits is skipped, and so is
// one whose bound (a key of its least values: keys grow with their values) cannot
// beat the best found; children are visited in order of their bounds. The same
// structure over the ranks' totals (load = a rank's work over all steps) serves the
// bounds of a per-step search that ranks blocks by their totals first.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <set>
#include <utility>
#include <vector>

namespace seqpack::detail {

using BlockKey = std::pair<double, double>;

// The blocks of every degree in use of one micro-batch step.
class StepBlocks {
 public:
  StepBlocks() = default;
  // `ranks` a multiple of 2^j for every level j in `levels`.
  StepBlocks(int64_t ranks, const std::vector<int64_t>& levels) {
    int64_t top = 0;
    for (int64_t j : levels) top = std::max(top, j);
    trees_.resize(static_cast<size_t>(top) + 1);
    for (int64_t j : levels) {
      Tree& t = trees_[static_cast<size_t>(j)];
      t.blocks = ranks >> j;
      t.leaves = 1;
      while (t.leaves < t.blocks) t.leaves *= 2;
      const auto nodes = static_cast<size_t>(2 * t.leaves);
      t.min_tokens.assign(nodes, kNone);
      t.max_tokens.assign(nodes, 0);
      t.min_load.assign(nodes, std::numeric_limits<double>::infinity());
      for (int64_t b = 0; b < t.blocks; ++b) {
        t.min_tokens[static_cast<size_t>(t.leaves + b)] = 0;
        t.min_load[static_cast<size_t>(t.leaves + b)] = 0.0;
      }
      for (int64_t p = t.leaves - 1; p >= 1; --p) t.pull(p);
    }
  }

  // Rank r now holds `tokens` and `load` (neither less than before).
  void raise(int64_t r, int64_t tokens, double load) {
    for (size_t j = 0; j < trees_.size(); ++j) {
      Tree& t = trees_[j];
      if (t.blocks == 0) continue;
      auto p = static_cast<size_t>(t.leaves + (r >> j));
      if (t.max_tokens[p] >= tokens && t.min_load[p] >= load) continue;
      t.min_tokens[p] = t.max_tokens[p] = std::max(t.max_tokens[p], tokens);
      t.min_load[p] = std::max(t.min_load[p], load);
      for (p /= 2; p >= 1; p /= 2) t.pull(static_cast<int64_t>(p));
    }
  }

  // Node p of level j's tree (1 the root, 2p and 2p + 1 its children; the leaf of
  // block b is leaves(j) + b): the least and most tokens and the least load of its
  // blocks (a leaf: its block's most tokens and most load).
  int64_t min_tokens(int64_t j, int64_t p) const { return tree(j).min_tokens[static_cast<size_t>(p)]; }
  int64_t max_tokens(int64_t j, int64_t p) const { return tree(j).max_tokens[static_cast<size_t>(p)]; }
  double min_load(int64_t j, int64_t p) const { return tree(j).min_load[static_cast<size_t>(p)]; }
  int64_t leaves(int64_t j) const { return tree(j).leaves; }

  // The block of level j with the least (key(p), index) among those holding at most
  // `limit` tokens, or -1; p is the block's leaf. bound(p) of a node is at most the
  // key of each of its blocks. With an incumbent (``below`` >= 0: the best block of
  // an earlier search, and its key), only a block lower in (key, index) is returned,
  // and a subtree that cannot beat it is not entered: -1 when none does.
  template <class Key, class Bound>
  int64_t best(int64_t j, int64_t limit, const Key& key, const Bound& bound, int64_t below = -1,
               BlockKey below_key = {}) const {
    const Tree& t = tree(j);
    Search<Key, Bound> s{t, limit, key, bound, below, below_key};
    s.enter(1, 0, t.leaves, bound(1));
    return s.improved ? s.best : -1;
  }

 private:
  static constexpr int64_t kNone = std::numeric_limits<int64_t>::max();  // a leaf past the last block

  struct Tree {
    int64_t blocks = 0, leaves = 0;
    std::vector<int64_t> min_tokens, max_tokens;
    std::vector<double> min_load;
    void pull(int64_t p) {
      const auto a = static_cast<size_t>(2 * p), b = a + 1, q = static_cast<size_t>(p);
      min_tokens[q] = std::min(min_tokens[a], min_tokens[b]);
      max_tokens[q] = std::max(max_tokens[a], max_tokens[b]);
      min_load[q] = std::min(min_load[a], min_load[b]);
    }
  };

  template <class Key, class Bound>
  struct Search {
    const Tree& t;
    int64_t limit;
    const Key& key;
    const Bound& bound;
    int64_t best = -1;
    BlockKey best_key{};
    bool improved = false;
    // Node p covers blocks [first, first + span): skipped when none of them fits, or
    // when its bound cannot beat the best (an equal bound only with lower indices);
    // children in order of their bounds.
    void visit(int64_t p, int64_t first, int64_t span) {
      if (t.min_tokens[static_cast<size_t>(p)] > limit) return;
      if (span == 1) {
        const BlockKey k = key(p);
        if (best < 0 || k < best_key || (k == best_key && first < best)) best = first, best_key = k, improved = true;
        return;
      }
      const int64_t half = span / 2;
      const BlockKey bl = bound(2 * p), br = bound(2 * p + 1);
      if (br < bl) {
        enter(2 * p + 1, first + half, half, br);
        enter(2 * p, first, half, bl);
      } else {
        enter(2 * p, first, half, bl);
        enter(2 * p + 1, first + half, half, br);
      }
    }
    void enter(int64_t p, int64_t first, int64_t span, const BlockKey& b) {
      if (best >= 0 && (best_key < b || (b == best_key && first > best))) return;
      visit(p, first, span);
    }
  };

  const Tree& tree(int64_t j) const { return trees_[static_cast<size_t>(j)]; }

  std::vector<Tree> trees_;  // by level j; blocks == 0 where the level is not in use
};

// Best fit over every (block, step) of a placement at once: per level in use, the
// blocks of all steps ordered by their busiest rank's tokens (most first), then load,
// block and step, so that the block leaving the least room for an item is the first
// entry at or under its limit (one ordered-set lookup, whatever the steps).
class BestFit {
 public:
  struct Entry {
    int64_t tokens = 0;
    double load = 0.0;
    int64_t block = 0, step = 0;
    bool operator<(const Entry& o) const {
      if (tokens != o.tokens) return tokens > o.tokens;
      if (load != o.load) return load < o.load;
      if (block != o.block) return block < o.block;
      return step < o.step;
    }
  };

  BestFit(int64_t ranks, int64_t steps, const std::vector<int64_t>& levels) {
    int64_t top = 0;
    for (int64_t j : levels) top = std::max(top, j);
    sets_.resize(static_cast<size_t>(top) + 1);
    for (int64_t j : levels)
      for (int64_t b = 0; b < (ranks >> j); ++b)
        for (int64_t k = 0; k < steps; ++k) sets_[static_cast<size_t>(j)].insert({0, 0.0, b, k});
  }

  // (block, step) of level j with the most tokens at or under `limit`, then the least
  // load, block and step; (-1, -1) when none fits.
  std::pair<int64_t, int64_t> find(int64_t j, int64_t limit) const {
    const auto& set = sets_[static_cast<size_t>(j)];
    const auto it = set.lower_bound({limit, -std::numeric_limits<double>::infinity(), -1, -1});
    return it == set.end() ? std::pair<int64_t, int64_t>{-1, -1} : std::pair{it->block, it->step};
  }

  // Block b of level j at step k went from (tokens, load) to its new values.
  void move(int64_t j, const Entry& from, int64_t tokens, double load) {
    auto& set = sets_[static_cast<size_t>(j)];
    set.erase(from);
    set.insert({tokens, load, from.block, from.step});
  }

  bool uses(int64_t j) const { return j < static_cast<int64_t>(sets_.size()) && !sets_[static_cast<size_t>(j)].empty(); }

 private:
  std::vector<std::set<Entry>> sets_;  // by level; empty where the level is not in use
};

}  // namespace seqpack::detail
