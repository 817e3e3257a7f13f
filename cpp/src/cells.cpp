// The cells of plan_step (cells.hpp) and the capped partitions plan_micro_batches
// borrows from it (capped_partition.hpp).
#include "cells.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <queue>
#include <utility>

#include "seqpack/capped_partition.hpp"

namespace seqpack {
namespace detail {
namespace {

// Step floors: the heaviest sequences that cannot share a micro-batch (more than
// half the cap) at positions 0, R, 2R, ... of the heaviest-first order.
std::vector<double> step_floors(const std::vector<Item>& items, int64_t R, int64_t cap, int64_t* big_count) {
  std::vector<double> floors;
  int64_t big = 0;
  for (const Item& it : items) {
    if (it.s <= cap / 2) continue;
    if (big % R == 0) floors.push_back(it.w);
    ++big;
  }
  if (big_count) *big_count = big;
  return floors;
}

// The level L with  Σ_k max(floor_k, L) = W / R  over K steps (floors beyond their
// count are 0).
double water_level(const std::vector<double>& floors, double per_rank, int64_t K) {
  const auto P = static_cast<int64_t>(floors.size());
  std::vector<double> prefix(floors.size() + 1, 0.0);
  for (size_t k = 0; k < floors.size(); ++k) prefix[k + 1] = prefix[k] + floors[k];
  if (prefix.back() >= per_rank) return 0.0;
  // j = the number of steps whose floor stays at or above the level.
  for (int64_t j = std::min(P, K - 1); j >= 0; --j) {
    const auto u = static_cast<size_t>(j);
    const double level = (per_rank - prefix[u]) / static_cast<double>(K - j);
    if ((j == 0 || floors[u - 1] >= level) && (j == P || level >= floors[u])) return level;
  }
  return per_rank / static_cast<double>(K);
}

}  // namespace

bool lighter(const Item& a, const Item& b) {
  if (a.w != b.w) return a.w < b.w;
  if (a.s != b.s) return a.s < b.s;
  return a.index < b.index;
}

// Gives each empty cell in `scope` the lightest sequence of a cell in `scope`
// holding two or more, so a dummy remains only where every cell holds at most one.
void fill_dummies(Cells& cells, const std::vector<size_t>& scope) {
  std::vector<size_t> empty;
  std::vector<std::pair<Item, size_t>> spare;  // (sequence, its cell)
  for (size_t c : scope) {
    if (cells.items[c].empty()) empty.push_back(c);
    if (cells.items[c].size() >= 2)
      for (const Item& it : cells.items[c]) spare.push_back({it, c});
  }
  if (empty.empty() || spare.empty()) return;
  std::sort(spare.begin(), spare.end(), [](const auto& a, const auto& b) { return lighter(a.first, b.first); });
  size_t next = 0;
  for (size_t e : empty) {
    while (next < spare.size() && cells.items[spare[next].second].size() < 2) ++next;
    if (next == spare.size()) return;
    const auto [it, from] = spare[next++];
    auto& src = cells.items[from];
    const int64_t index = it.index;  // a structured binding cannot be captured before C++20 in clang < 16
    const auto pos = static_cast<size_t>(
        std::find_if(src.begin(), src.end(), [index](const Item& x) { return x.index == index; }) - src.begin());
    cells.add(e, cells.remove(from, pos));
  }
}

// Places the heaviest-first sequences into K·R cells: the sequences above half
// the cap one per cell, R per step; every other sequence into the cell furthest
// below its step's target (its floor, or the common water level) that still has
// room for it. Returns nothing when a sequence finds no room.
std::optional<Cells> place_for_micro_batch_sync(const std::vector<Item>& items, int64_t R, int64_t K, int64_t cap) {
  const auto C = static_cast<size_t>(R * K);
  int64_t big = 0;
  const std::vector<double> floors = step_floors(items, R, cap, &big);
  if (big > static_cast<int64_t>(C)) return std::nullopt;
  double total = 0.0;
  for (const Item& it : items) total += it.w;
  const double level = water_level(floors, total / static_cast<double>(R), K);
  std::vector<double> target(C, level);
  for (size_t k = 0; k < floors.size(); ++k)
    for (int64_t r = 0; r < R; ++r)
      target[k * static_cast<size_t>(R) + static_cast<size_t>(r)] = std::max(floors[k], level);
  Cells cells(C);
  size_t next_big = 0;
  for (const Item& it : items) {
    if (it.s > cap / 2) cells.add(next_big++, it);
  }
  // open: cells by (slack to the target, then the lightest, then the lowest index);
  // parked (no room for the current sequence): by room.
  using Open = std::tuple<double, double, int64_t>;  // (slack, -load, -cell)
  std::priority_queue<Open> open;
  std::priority_queue<std::pair<int64_t, int64_t>> parked;  // (room, -cell)
  auto reopen = [&](size_t c) {
    open.push({target[c] - cells.load[c], -cells.load[c], -static_cast<int64_t>(c)});
  };
  for (size_t c = 0; c < C; ++c) reopen(c);
  for (const Item& it : items) {
    if (it.s > cap / 2) continue;
    while (!parked.empty() && parked.top().first >= it.s) {
      const auto c = static_cast<size_t>(-parked.top().second);
      parked.pop();
      reopen(c);
    }
    size_t c = 0;
    for (;;) {
      if (open.empty()) return std::nullopt;
      c = static_cast<size_t>(-std::get<2>(open.top()));
      open.pop();
      if (cap - cells.tokens[c] >= it.s) break;
      parked.push({cap - cells.tokens[c], -static_cast<int64_t>(c)});
    }
    cells.add(c, it);
    reopen(c);
  }
  return cells;
}

// Cells heaviest first, R to a step (which minimises Σ_k max for given cells);
// inside a step the heaviest cell goes to the rank with the least work so far.
// Returns the cells' positions rank-major: layout[r·K + k] = cell.
std::vector<size_t> group_into_steps(const Cells& cells, int64_t R, int64_t K) {
  std::vector<size_t> order(cells.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return cells.load[a] > cells.load[b]; });
  std::vector<size_t> layout(cells.size());
  std::vector<double> rank_load(static_cast<size_t>(R), 0.0);
  std::vector<size_t> ranks(static_cast<size_t>(R));
  for (int64_t k = 0; k < K; ++k) {
    std::iota(ranks.begin(), ranks.end(), 0);
    std::stable_sort(ranks.begin(), ranks.end(), [&](size_t a, size_t b) { return rank_load[a] < rank_load[b]; });
    for (int64_t j = 0; j < R; ++j) {
      const size_t cell = order[static_cast<size_t>(k * R + j)];
      const size_t r = ranks[static_cast<size_t>(j)];
      layout[r * static_cast<size_t>(K) + static_cast<size_t>(k)] = cell;
      rank_load[r] += cells.load[cell];
    }
  }
  return layout;
}

// ---- Step sync: ranks balanced on their total work, K cells each.

// Each sequence (heaviest first) goes to the least-loaded rank with room for it,
// into that rank's cell with the most room. Cells come rank-major.
std::optional<Cells> place_for_step_sync(const std::vector<Item>& items, int64_t R, int64_t K, int64_t cap) {
  Cells cells(static_cast<size_t>(R * K));
  using Room = std::pair<int64_t, int64_t>;  // (room, -cell)
  std::vector<std::priority_queue<Room>> rooms(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r)
    for (int64_t k = 0; k < K; ++k) rooms[static_cast<size_t>(r)].push({cap, -(r * K + k)});
  std::vector<double> load(static_cast<size_t>(R), 0.0);
  using Open = std::pair<double, int64_t>;  // (load, rank): least first
  std::priority_queue<Open, std::vector<Open>, std::greater<>> open;
  std::priority_queue<std::pair<int64_t, int64_t>> parked;  // (largest room, -rank)
  for (int64_t r = 0; r < R; ++r) open.push({0.0, r});
  for (const Item& it : items) {
    while (!parked.empty() && parked.top().first >= it.s) {
      const int64_t r = -parked.top().second;
      parked.pop();
      open.push({load[static_cast<size_t>(r)], r});
    }
    int64_t r = 0;
    for (;;) {
      if (open.empty()) return std::nullopt;
      r = open.top().second;
      open.pop();
      if (rooms[static_cast<size_t>(r)].top().first >= it.s) break;
      parked.push({rooms[static_cast<size_t>(r)].top().first, -r});
    }
    auto [room, neg_cell] = rooms[static_cast<size_t>(r)].top();
    rooms[static_cast<size_t>(r)].pop();
    cells.add(static_cast<size_t>(-neg_cell), it);
    rooms[static_cast<size_t>(r)].push({room - it.s, neg_cell});
    load[static_cast<size_t>(r)] += it.w;
    open.push({load[static_cast<size_t>(r)], r});
  }
  return cells;
}

// Step sync polish: moves and swaps between the most and the least loaded rank
// that lower the larger of the two, keeping every cell within the cap; stops when
// none helps or after a bounded amount of work.
void balance_ranks(Cells& cells, int64_t R, int64_t K, int64_t cap) {
  std::vector<double> load(static_cast<size_t>(R), 0.0);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t k = 0; k < K; ++k) load[static_cast<size_t>(r)] += cells.load[static_cast<size_t>(r * K + k)];
  int64_t budget = int64_t{1} << 24;  // pair checks
  for (int64_t iter = 0; iter < 8 * R + 64 && budget > 0; ++iter) {
    budget -= R;
    const auto h = static_cast<size_t>(std::max_element(load.begin(), load.end()) - load.begin());
    const auto l = static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    const double gap = load[h] - load[l];
    if (!(gap > 0)) break;
    double best = load[h];
    size_t best_ca = 0, best_a = 0, best_cb = 0, best_b = SIZE_MAX;  // best_b == SIZE_MAX: a move
    bool found = false;
    // The cell of rank l with the most room takes moves.
    size_t roomiest = l * static_cast<size_t>(K);
    for (int64_t k = 1; k < K; ++k) {
      const size_t c = l * static_cast<size_t>(K) + static_cast<size_t>(k);
      if (cells.tokens[c] < cells.tokens[roomiest]) roomiest = c;
    }
    // Rank l's sequences by work: a swap wants w_b near w_a - gap / 2.
    std::vector<std::pair<double, std::pair<size_t, size_t>>> lows;  // (w, (cell, position))
    for (int64_t kb = 0; kb < K; ++kb) {
      const size_t cb = l * static_cast<size_t>(K) + static_cast<size_t>(kb);
      for (size_t b = 0; b < cells.items[cb].size(); ++b) lows.push_back({cells.items[cb][b].w, {cb, b}});
    }
    std::sort(lows.begin(), lows.end());
    budget -= static_cast<int64_t>(lows.size());
    constexpr ptrdiff_t kWindow = 8;  // candidates tried on each side of the ideal partner
    for (int64_t ka = 0; ka < K; ++ka) {
      const size_t ca = h * static_cast<size_t>(K) + static_cast<size_t>(ka);
      for (size_t a = 0; a < cells.items[ca].size(); ++a) {
        const Item& ia = cells.items[ca][a];
        if (ia.w < gap && cells.tokens[roomiest] + ia.s <= cap) {
          const double m = std::max(load[h] - ia.w, load[l] + ia.w);
          if (m < best) best = m, best_ca = ca, best_a = a, best_cb = roomiest, best_b = SIZE_MAX, found = true;
        }
        const auto ideal = std::make_pair(ia.w - gap / 2, std::make_pair(size_t{0}, size_t{0}));
        const auto mid = std::lower_bound(lows.begin(), lows.end(), ideal) - lows.begin();
        const ptrdiff_t lo = std::max<ptrdiff_t>(0, mid - kWindow);
        const ptrdiff_t hi = std::min<ptrdiff_t>(static_cast<ptrdiff_t>(lows.size()), mid + kWindow);
        budget -= hi - lo;
        for (ptrdiff_t j = lo; j < hi; ++j) {
          const auto [cb, b] = lows[static_cast<size_t>(j)].second;
          const Item& ib = cells.items[cb][b];
          const double d = ia.w - ib.w;
          if (!(d > 0) || d >= gap) continue;
          if (cells.tokens[ca] - ia.s + ib.s > cap || cells.tokens[cb] - ib.s + ia.s > cap) continue;
          const double m = std::max(load[h] - d, load[l] + d);
          if (m < best) best = m, best_ca = ca, best_a = a, best_cb = cb, best_b = b, found = true;
        }
      }
    }
    if (!found) break;
    const Item a = cells.remove(best_ca, best_a);
    load[h] -= a.w;
    load[l] += a.w;
    if (best_b != SIZE_MAX) {
      const Item b = cells.remove(best_cb, best_b);
      cells.add(best_ca, b);
      load[h] += b.w;
      load[l] -= b.w;
    }
    cells.add(best_cb, a);
  }
}

// Within each rank: dummies filled from the rank's own cells (its total is
// unchanged), micro-batches heaviest first.
std::vector<size_t> order_within_ranks(Cells& cells, int64_t R, int64_t K) {
  std::vector<size_t> layout(cells.size());
  for (int64_t r = 0; r < R; ++r) {
    std::vector<size_t> scope(static_cast<size_t>(K));
    std::iota(scope.begin(), scope.end(), static_cast<size_t>(r * K));
    fill_dummies(cells, scope);
    std::stable_sort(scope.begin(), scope.end(), [&](size_t a, size_t b) { return cells.load[a] > cells.load[b]; });
    std::copy(scope.begin(), scope.end(), layout.begin() + r * K);
  }
  return layout;
}

}  // namespace detail

namespace {

using detail::Cells;
using detail::Item;

std::vector<Item> items_by_work(Lengths lengths, std::span<const double> work) {
  std::vector<Item> items(lengths.size());
  for (size_t i = 0; i < lengths.size(); ++i) items[i] = Item{static_cast<int64_t>(i), lengths[i], work[i]};
  std::sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    if (a.w != b.w) return a.w > b.w;
    if (a.s != b.s) return a.s > b.s;
    return a.index < b.index;
  });
  return items;
}

IndexGroups to_groups(const Cells& cells) {
  IndexGroups out;
  std::vector<int64_t> idx;
  for (const auto& cell : cells.items) {
    idx.clear();
    for (const Item& it : cell) idx.push_back(it.index);
    std::sort(idx.begin(), idx.end());
    out.push_group(idx);
  }
  return out;
}

}  // namespace

std::optional<IndexGroups> capped_greedy_partition(Lengths lengths, std::span<const double> work, int64_t k,
                                                   int64_t cap) {
  std::optional<Cells> cells = detail::place_for_step_sync(items_by_work(lengths, work), k, 1, cap);
  if (!cells) return std::nullopt;
  detail::balance_ranks(*cells, k, 1, cap);
  return to_groups(*cells);
}

IndexGroups rebalance_under_cap(const IndexGroups& groups, Lengths lengths, std::span<const double> work, int64_t cap) {
  Cells cells(groups.size());
  for (size_t g = 0; g < groups.size(); ++g)
    for (int64_t i : groups.group(g))
      cells.add(g, Item{i, lengths[static_cast<size_t>(i)], work[static_cast<size_t>(i)]});
  detail::balance_ranks(cells, static_cast<int64_t>(groups.size()), 1, cap);
  return to_groups(cells);
}

}  // namespace seqpack
