#pragma once
// Cells: the groups of sequences plan_step places on ranks x micro-batches, and the
// placement and balancing steps that plan_step and plan_micro_batches share
// (capped_partition.hpp). Internal to the core.
#include <cstdint>
#include <optional>
#include <vector>

#include "seqpack/common.hpp"

namespace seqpack::detail {

// One sequence: its global index, length and work (the cost model's c1·s + c2·s²).
struct Item {
  int64_t index;  // global
  int64_t s;
  double w;
};

struct Cells {
  std::vector<std::vector<Item>> items;
  std::vector<double> load;  // Σ work
  std::vector<int64_t> tokens;

  explicit Cells(size_t c) : items(c), load(c, 0.0), tokens(c, 0) {}
  size_t size() const { return items.size(); }
  void add(size_t c, const Item& it) {
    items[c].push_back(it);
    load[c] += it.w;
    tokens[c] += it.s;
  }
  Item remove(size_t c, size_t pos) {
    const Item it = items[c][pos];
    items[c].erase(items[c].begin() + static_cast<std::ptrdiff_t>(pos));
    load[c] -= it.w;
    tokens[c] -= it.s;
    return it;
  }
};

// a before b in lightest-first order (work, length, index).
bool lighter(const Item& a, const Item& b);
// Gives each empty cell in `scope` the lightest sequence of a cell in `scope`
// holding two or more, so a dummy remains only where every cell holds at most one.
void fill_dummies(Cells& cells, const std::vector<size_t>& scope);
// MicroBatch sync: cells aimed at per-step levels (nothing when a sequence finds no
// room), then the layout that groups them into steps.
std::optional<Cells> place_for_micro_batch_sync(const std::vector<Item>& items, int64_t R, int64_t K, int64_t cap);
std::vector<size_t> group_into_steps(const Cells& cells, int64_t R, int64_t K);
// Step sync: each sequence (heaviest first) to the least-loaded rank with room, into
// that rank's cell with the most room; cells rank-major. Nothing when one finds none.
std::optional<Cells> place_for_step_sync(const std::vector<Item>& items, int64_t R, int64_t K, int64_t cap);
// Moves and swaps between the heaviest and the lightest rank under the cap (bounded work).
void balance_ranks(Cells& cells, int64_t R, int64_t K, int64_t cap);
// Within each rank: dummies filled from the rank's own cells, micro-batches heaviest first.
std::vector<size_t> order_within_ranks(Cells& cells, int64_t R, int64_t K);

}  // namespace seqpack::detail
