#pragma once
// Internal data structures of the packers (not part of the public headers).
#include <algorithm>
#include <bit>
#include <cstdint>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "scratch.hpp"
#include "seqpack/common.hpp"

namespace seqpack::detail {

// Values at or below this use O(n + value) counting structures; above it the
// packers fall back to comparison-based ones with the same results.
inline constexpr int64_t kDenseValueLimit = int64_t{1} << 22;

// Indices ordered by length, then index, each ascending or descending. Stable
// counting sort when lengths are small (the common case: lengths <= capacity).
inline Buffer<int64_t> order_by_length(Lengths lengths, bool length_desc, bool index_desc) {
  const size_t n = lengths.size();
  Buffer<int64_t> order(n);
  const int64_t max_len = n ? *std::max_element(lengths.begin(), lengths.end()) : 0;
  if (max_len <= kDenseValueLimit && static_cast<size_t>(max_len) <= 16 * n + 1024) {
    Buffer<int64_t> start(static_cast<size_t>(max_len) + 2, 0);
    for (int64_t l : lengths) ++start[static_cast<size_t>(l) + 1];
    if (length_desc) {  // bucket offsets from the longest length down
      int64_t acc = 0;
      for (int64_t v = max_len; v >= 0; --v) {
        const int64_t c = start[static_cast<size_t>(v) + 1];
        start[static_cast<size_t>(v) + 1] = acc;
        acc += c;
      }
    } else {
      for (size_t v = 1; v < start.size(); ++v) start[v] += start[v - 1];
    }
    // start[l + 1] (descending) / start[l] (ascending): the next slot of length l.
    // Indices are dealt in the order wanted inside a length: last to first for
    // index_desc.
    const size_t shift = length_desc ? 1 : 0;
    if (index_desc) {
      for (size_t i = n; i-- > 0;) order[start[static_cast<size_t>(lengths[i]) + shift]++] = static_cast<int64_t>(i);
    } else {
      for (size_t i = 0; i < n; ++i) order[start[static_cast<size_t>(lengths[i]) + shift]++] = static_cast<int64_t>(i);
    }
    return order;
  }
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    if (lengths[a] != lengths[b]) return length_desc ? lengths[a] > lengths[b] : lengths[a] < lengths[b];
    return index_desc ? a > b : a < b;
  });
  return order;
}

// Max tree over bins' remaining capacities, 8 children per node (a node's
// children are adjacent, so a descent is ~log8(bins) dependent loads instead of
// log2). `Value` is int32_t when the capacity allows (half the cache footprint). Every leaf is a bin; unopened bins hold the full capacity, so
// "leftmost bin with room >= x" is first fit, opening a new bin included. Starts
// with room for `expected_bins` leaves and grows 8x when every leaf is in use.
template <typename Value>
class GapTree {
 public:
  static constexpr size_t kFanout = 8;

  GapTree(size_t expected_bins, int64_t capacity) : capacity_(capacity) {
    size_t leaves = kFanout;
    while (leaves < expected_bins) leaves *= kFanout;
    build(leaves);
  }
  int64_t leftmost_at_least(int64_t x) {
    size_t node = first_at_least(0, x);
    if (node == kFanout) {  // every leaf in use; x <= capacity, so the new leaves have room
      grow();
      node = first_at_least(0, x);
    }
    for (size_t level = 1; level < level_begin_.size(); ++level)
      node = node * kFanout + first_at_least(level_begin_[level] + node * kFanout, x);
    return static_cast<int64_t>(node);
  }
  int64_t get(int64_t pos) const { return values_[level_begin_.back() + static_cast<size_t>(pos)]; }
  // Lowers (never raises) the room of bin `pos` to `value`.
  void set(int64_t pos, int64_t value) {
    auto node = static_cast<size_t>(pos);
    Value& leaf = values_[level_begin_.back() + node];
    const Value old = leaf;
    leaf = static_cast<Value>(value);
    if (level_begin_.size() > 1 && values_[level_begin_[level_begin_.size() - 2] + node / kFanout] > old)
      return;  // a sibling holds the parent's maximum
    for (size_t level = level_begin_.size() - 1; level > 0; --level) {
      const size_t first = level_begin_[level] + node / kFanout * kFanout;
      Value m = values_[first];
      for (size_t c = 1; c < kFanout; ++c) m = std::max(m, values_[first + c]);
      node /= kFanout;
      Value& parent = values_[level_begin_[level - 1] + node];
      if (parent == m) break;  // ancestors unchanged
      parent = m;
    }
  }

 private:
  // Index of the first of the 8 values at `first` that is >= x (8 if none).
  size_t first_at_least(size_t first, int64_t x) const {
    const auto v = static_cast<Value>(x);
#if defined(__SSE2__)
    if constexpr (std::is_same_v<Value, int32_t>) {
      // value >= x  <=>  value > x - 1 (x >= 0, so x - 1 does not wrap).
      const __m128i bar = _mm_set1_epi32(static_cast<int32_t>(x - 1));
      const auto* p = reinterpret_cast<const __m128i*>(values_.data() + first);
      const __m128i lo = _mm_cmpgt_epi32(_mm_loadu_si128(p), bar);
      const __m128i hi = _mm_cmpgt_epi32(_mm_loadu_si128(p + 1), bar);
      const auto bits = static_cast<unsigned>(_mm_movemask_epi8(_mm_packs_epi16(_mm_packs_epi32(lo, hi), lo)));
      return static_cast<size_t>(std::countr_zero((bits & 0xffu) | (1u << kFanout)));
    }
#endif
    unsigned mask = 1u << kFanout;
    for (size_t c = 0; c < kFanout; ++c) mask |= static_cast<unsigned>(values_[first + c] >= v) << c;
    return static_cast<size_t>(std::countr_zero(mask));
  }
  void build(size_t leaves) {
    level_begin_.clear();
    size_t total = 0;
    for (size_t width = kFanout; width <= leaves; width *= kFanout) {
      level_begin_.push_back(total);
      total += width;
    }
    values_.assign(total, static_cast<Value>(capacity_));
  }
  void grow() {
    const Buffer<Value> old_values = values_;
    const size_t old_leaves_begin = level_begin_.back();
    const size_t old_leaves = old_values.size() - old_leaves_begin;
    build(old_leaves * kFanout);
    std::copy(old_values.begin() + static_cast<std::ptrdiff_t>(old_leaves_begin), old_values.end(),
              values_.begin() + static_cast<std::ptrdiff_t>(level_begin_.back()));
    for (size_t level = level_begin_.size() - 1; level > 0; --level) {  // parents of the copied leaves
      const size_t width = (level + 1 < level_begin_.size() ? level_begin_[level + 1] : values_.size()) -
                           level_begin_[level];
      for (size_t node = 0; node < width / kFanout; ++node) {
        const auto children = values_.begin() + static_cast<std::ptrdiff_t>(level_begin_[level] + node * kFanout);
        values_[level_begin_[level - 1] + node] =
            *std::max_element(children, children + static_cast<std::ptrdiff_t>(kFanout));
      }
    }
  }

  int64_t capacity_;
  Buffer<size_t> level_begin_;  // offset of each level in values_, root level (8 nodes) first
  Buffer<Value> values_;
};

// Binary min-heap with replace_top (one sift-down instead of a pop and a push).
template <typename T>
class MinHeap {
 public:
  bool empty() const { return data_.empty(); }
  const T& top() const { return data_.front(); }
  void push(const T& v) {
    data_.push_back(v);
    size_t i = data_.size() - 1;
    while (i > 0) {
      const size_t parent = (i - 1) / 2;
      if (!(v < data_[parent])) break;
      data_[i] = data_[parent];
      i = parent;
    }
    data_[i] = v;
  }
  void replace_top(const T& v) {
    const size_t n = data_.size();
    size_t i = 0;
    for (;;) {
      size_t child = 2 * i + 1;
      if (child >= n) break;
      if (child + 1 < n && data_[child + 1] < data_[child]) ++child;
      if (!(data_[child] < v)) break;
      data_[i] = data_[child];
      i = child;
    }
    data_[i] = v;
  }
  void pop() {
    const T last = data_.back();
    data_.pop_back();
    if (!data_.empty()) replace_top(last);
  }

 private:
  Buffer<T> data_;
};

// The BucketQueue interface on a binary heap, for keys too large to bucket.
class MinHeapQueue {
 public:
  bool empty() const { return heap_.empty(); }
  std::pair<int64_t, int64_t> top() const { return heap_.top(); }
  void push(int64_t key, int64_t stamp) { heap_.push({key, stamp}); }
  void pop() { heap_.pop(); }

 private:
  MinHeap<std::pair<int64_t, int64_t>> heap_;
};

// A set of integers in [0, universe) with next-at-least queries in
// O(log64 universe): a hierarchy of 64-bit occupancy words.
class NextSetBit {
 public:
  explicit NextSetBit(int64_t universe) {
    int64_t bits = std::max<int64_t>(universe, 1);
    do {
      const int64_t words = (bits + 63) / 64;
      levels_.emplace_back(static_cast<size_t>(words), 0);
      bits = words;
    } while (bits > 1);
  }
  void insert(int64_t v) {
    for (auto& level : levels_) {
      uint64_t& w = level[static_cast<size_t>(v >> 6)];
      const bool was_empty = w == 0;
      w |= uint64_t{1} << (v & 63);
      if (!was_empty) return;
      v >>= 6;
    }
  }
  void erase(int64_t v) {
    for (auto& level : levels_) {
      uint64_t& w = level[static_cast<size_t>(v >> 6)];
      w &= ~(uint64_t{1} << (v & 63));
      if (w != 0) return;
      v >>= 6;
    }
  }
  // Smallest member >= x, or -1.
  int64_t next(int64_t x) const {
    size_t lvl = 0;
    int64_t pos = x;
    for (;; ++lvl) {
      if (lvl == levels_.size()) return -1;
      const auto word = static_cast<size_t>(pos >> 6);
      if (word >= levels_[lvl].size()) return -1;
      const uint64_t w = levels_[lvl][word] & (~uint64_t{0} << (pos & 63));
      if (w) {
        pos = (pos & ~int64_t{63}) + std::countr_zero(w);
        break;
      }
      pos = (pos >> 6) + 1;
    }
    while (lvl-- > 0) pos = (pos << 6) + std::countr_zero(levels_[lvl][static_cast<size_t>(pos)]);
    return pos;
  }

 private:
  Buffer<Buffer<uint64_t>> levels_;
};

// Min-queue of (key, stamp) pairs for integer keys in [0, universe) where stamps
// are pushed in increasing order: one FIFO list per key (so equal keys pop in stamp
// order) and a NextSetBit over the non-empty keys. O(log64 universe) per operation.
class BucketQueue {
 public:
  explicit BucketQueue(int64_t universe)
      : occupied_(universe), head_(static_cast<size_t>(universe), -1), tail_(static_cast<size_t>(universe), -1) {}
  bool empty() const { return size_ == 0; }
  std::pair<int64_t, int64_t> top() const { return first_at_least(0); }
  // The oldest (key, stamp) among the smallest key >= x, or (-1, -1).
  std::pair<int64_t, int64_t> first_at_least(int64_t x) const {
    const int64_t key = occupied_.next(x);
    if (key < 0) return {-1, -1};
    return {key, head_[static_cast<size_t>(key)]};
  }
  void push(int64_t key, int64_t stamp) {
    if (static_cast<size_t>(stamp) >= next_.size()) next_.resize(static_cast<size_t>(stamp) + 1, -1);
    next_[static_cast<size_t>(stamp)] = -1;
    auto k = static_cast<size_t>(key);
    if (head_[k] < 0) {
      head_[k] = stamp;
      occupied_.insert(key);
    } else {
      next_[static_cast<size_t>(tail_[k])] = stamp;
    }
    tail_[k] = stamp;
    ++size_;
  }
  void pop() { pop(occupied_.next(0)); }
  // Removes the oldest entry of `key` (which must hold one).
  void pop(int64_t key) {
    const auto k = static_cast<size_t>(key);
    head_[k] = next_[static_cast<size_t>(head_[k])];
    if (head_[k] < 0) occupied_.erase(static_cast<int64_t>(k));
    --size_;
  }

 private:
  NextSetBit occupied_;
  Buffer<int64_t> head_, tail_, next_;
  size_t size_ = 0;
};

// Items sorted once by a key, then removed one by one; finds the first (last)
// live item at or after (before) a position with path-compressed skip links.
class LivePool {
 public:
  explicit LivePool(Buffer<int64_t> items) : items_(std::move(items)) {
    const size_t n = items_.size();
    next_.resize(n + 1);
    prev_.resize(n + 1);
    std::iota(next_.begin(), next_.end(), 0);  // next_[n] is the end sentinel
    std::iota(prev_.begin(), prev_.end(), 0);  // prev_ is shifted by one: prev_[0] is "none"
    live_ = n;
  }
  size_t size() const { return items_.size(); }
  size_t live() const { return live_; }
  int64_t item(size_t pos) const { return items_[pos]; }
  // First live position >= pos, or size().
  size_t first_from(size_t pos) { return find(next_, pos); }
  // Last live position <= pos (pos may be -1), or -1.
  int64_t last_upto(int64_t pos) { return static_cast<int64_t>(find(prev_, static_cast<size_t>(pos + 1))) - 1; }
  void remove(size_t pos) {
    next_[pos] = pos + 1;
    prev_[pos + 1] = pos;
    --live_;
  }

 private:
  static size_t find(Buffer<size_t>& link, size_t x) {
    size_t root = x;
    while (link[root] != root) root = link[root];
    while (link[x] != root) {
      const size_t up = link[x];
      link[x] = root;
      x = up;
    }
    return root;
  }
  Buffer<int64_t> items_;
  Buffer<size_t> next_, prev_;
  size_t live_;
};

}  // namespace seqpack::detail
