#include "seqpack/step.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <numeric>
#include <queue>
#include <string>
#include <tuple>
#include <utility>

#include "cells.hpp"
#include "seqpack/microbatch.hpp"
#include "seqpack/packing.hpp"
#include "seqpack/partition.hpp"
#include "thread_pool.hpp"

namespace seqpack {
namespace {

using detail::balance_ranks;
using detail::Cells;
using detail::fill_dummies;
using detail::group_into_steps;
using detail::Item;
using detail::order_within_ranks;
using detail::place_for_micro_batch_sync;
using detail::place_for_step_sync;

constexpr const char* kFn = "plan_step";
// Cells planned per mini-batch at most (dp_size · K): far above any real step,
// low enough that a typo in min_micro_batches cannot exhaust memory.
constexpr int64_t kMaxCells = int64_t{1} << 24;
// Relative margin under which two predicted times count as equal.
constexpr double kTie = 1e-12;

// c1·s + c2·s² of sequence i (global index), with o.squares standing in for s².
double work_of(const StepOptions& o, Lengths lengths, size_t i) {
  if (o.squares.empty()) return o.cost.work(lengths[i]);
  return o.cost.per_token * static_cast<double>(lengths[i]) + o.cost.per_token_squared * static_cast<double>(o.squares[i]);
}

// The s² stand-ins of sequences [begin, end), or none (plain lengths).
Lengths squares_of(const StepOptions& o, int64_t begin, int64_t end) {
  return o.squares.empty() ? Lengths{} : o.squares.subspan(static_cast<size_t>(begin), static_cast<size_t>(end - begin));
}

// A mini-batch's sequences heaviest first: (work, length) descending, then the
// seeded tie key (or the index) ascending.
std::vector<Item> sorted_items(Lengths lengths, int64_t begin, int64_t end, const StepOptions& o) {
  const auto n = static_cast<size_t>(end - begin);
  std::vector<Item> items(n);
  std::vector<uint64_t> tie(n);
  std::iota(tie.begin(), tie.end(), 0);
  if (o.seed) {
    Rng rng(*o.seed + 0x9E3779B97F4A7C15ULL * static_cast<uint64_t>(begin));
    for (auto& t : tie) t = rng.next();
  }
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  for (size_t j = 0; j < n; ++j) {
    const int64_t s = lengths[static_cast<size_t>(begin) + j];
    items[j] = Item{begin + static_cast<int64_t>(j), s, work_of(o, lengths, static_cast<size_t>(begin) + j)};
  }
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    if (items[a].w != items[b].w) return items[a].w > items[b].w;
    if (items[a].s != items[b].s) return items[a].s > items[b].s;
    if (tie[a] != tie[b]) return tie[a] < tie[b];
    return a < b;
  });
  std::vector<Item> out(n);
  for (size_t j = 0; j < n; ++j) out[j] = items[order[j]];
  return out;
}

// ---- The two-step plan from seqpack's parts, a candidate so plan_step never loses
// to it: Karmarkar-Karp over the ranks on tokens (equal-size when the mini-batch
// divides), then plan_micro_batches on each rank balancing attention_coeff·s + s²
// (attention_coeff = per_token / per_token_squared, or tokens), every rank at the
// largest rank's count (rounded to multiple_of, at least min_micro_batches).
// Returns the cells rank-major and the count.
std::pair<Cells, int64_t> two_step_cells(Lengths lengths, int64_t begin, int64_t end, const StepOptions& o) {
  const int64_t R = o.dp_size, n = end - begin;
  const Lengths local = lengths.subspan(static_cast<size_t>(begin), static_cast<size_t>(n));
  IndexGroups parts;
  if (n >= R) {
    parts = karmarkar_karp(local, R, n % R == 0, true);
  } else {
    for (int64_t i = 0; i < R; ++i) parts.push_group(i < n ? std::vector<int64_t>{i} : std::vector<int64_t>{});
  }
  MicroBatchOptions mo;
  mo.max_tokens = o.max_tokens;
  if (o.cost.per_token_squared > 0) {
    // plan_micro_batches balances integer workloads coeff·s + s², whose sum over a
    // rank is at most (coeff + cap)·Σs: used only where that fits in int64 (with a
    // margin), else tokens (this is one candidate; the cost decides between them).
    const double coeff = std::max(1.0, std::round(o.cost.per_token / o.cost.per_token_squared));
    double tokens = 0.0;
    for (int64_t s : local) tokens += static_cast<double>(s);
    if ((coeff + static_cast<double>(o.max_tokens)) * tokens < 0x1p62) mo.attention_coeff = static_cast<int64_t>(coeff);
  }
  // With s² stand-ins, each rank's workloads coeff·s + square are given (<= (coeff + cap)·s: the same guard).
  const Lengths local_squares = squares_of(o, begin, end);
  const bool given_work = !local_squares.empty() && mo.attention_coeff > 0;
  std::vector<std::vector<int64_t>> rank_lengths(static_cast<size_t>(R)), rank_work(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i : parts.group(static_cast<size_t>(r))) {
      rank_lengths[static_cast<size_t>(r)].push_back(local[static_cast<size_t>(i)]);
      if (given_work)
        rank_work[static_cast<size_t>(r)].push_back(mo.attention_coeff * local[static_cast<size_t>(i)] +
                                                    local_squares[static_cast<size_t>(i)]);
    }
  auto rank_options = [&](size_t r, MicroBatchOptions base) {
    base.workloads = rank_work[r];
    return base;
  };
  // Each rank's plan is independent: spread them over the pool's threads.
  std::vector<MicroBatchPlan> plans(static_cast<size_t>(R));
  const size_t threads = std::min(static_cast<size_t>(R), detail::available_threads());
  auto each_rank = [&](const std::function<void(size_t)>& fn) {
    detail::parallel_for(threads, [&](size_t t) {
      for (size_t r = t; r < static_cast<size_t>(R); r += threads) fn(r);
    });
  };
  each_rank([&](size_t r) {
    if (!rank_lengths[r].empty()) plans[r] = plan_micro_batches(rank_lengths[r], rank_options(r, mo));
  });
  int64_t count = o.min_micro_batches;
  for (const MicroBatchPlan& plan : plans) count = std::max(count, static_cast<int64_t>(plan.groups.size()));
  count = round_up(kFn, count, o.multiple_of);
  each_rank([&](size_t r) {
    const auto have = static_cast<int64_t>(plans[r].groups.size());
    if (rank_lengths[r].empty() || have >= count) return;
    MicroBatchOptions more = mo;
    more.min_num = std::min(count, static_cast<int64_t>(rank_lengths[r].size()));
    plans[r] = plan_micro_batches(rank_lengths[r], rank_options(r, more));
  });
  Cells cells(static_cast<size_t>(R * count));
  for (int64_t r = 0; r < R; ++r) {
    const MicroBatchPlan& plan = plans[static_cast<size_t>(r)];
    const auto part = parts.group(static_cast<size_t>(r));
    for (size_t k = 0; k < plan.groups.size(); ++k)
      for (int64_t j : plan.groups.group(k)) {
        const int64_t i = begin + part[static_cast<size_t>(j)];
        const int64_t s = lengths[static_cast<size_t>(i)];
        cells.add(static_cast<size_t>(r * count) + k, Item{i, s, work_of(o, lengths, static_cast<size_t>(i))});
      }
  }
  return {std::move(cells), count};
}

// ---- The fallback that always exists: first-fit-decreasing bins under the cap.

Cells ffd_cells(const std::vector<Item>& items, Lengths lengths, int64_t begin, int64_t end, int64_t R, int64_t K,
                int64_t cap, StepSync sync) {
  const Lengths local = lengths.subspan(static_cast<size_t>(begin), static_cast<size_t>(end - begin));
  const IndexGroups bins = first_fit_decreasing(local, cap);
  std::vector<Item> by_index(items.size());
  for (const Item& it : items) by_index[static_cast<size_t>(it.index - begin)] = it;
  Cells cells(static_cast<size_t>(R * K));
  if (sync == StepSync::MicroBatch) {
    for (size_t b = 0; b < bins.size(); ++b)
      for (int64_t i : bins.group(b)) cells.add(b, by_index[static_cast<size_t>(i)]);
    return cells;
  }
  // Step sync: bins heaviest first to the least-loaded rank that has a free cell.
  std::vector<double> bin_load(bins.size(), 0.0);
  for (size_t b = 0; b < bins.size(); ++b)
    for (int64_t i : bins.group(b)) bin_load[b] += by_index[static_cast<size_t>(i)].w;
  std::vector<size_t> order(bins.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return bin_load[a] > bin_load[b]; });
  std::vector<double> load(static_cast<size_t>(R), 0.0);
  std::vector<int64_t> used(static_cast<size_t>(R), 0);
  for (size_t b : order) {
    size_t best = SIZE_MAX;
    for (size_t r = 0; r < static_cast<size_t>(R); ++r)
      if (used[r] < K && (best == SIZE_MAX || load[r] < load[best])) best = r;
    const size_t cell = best * static_cast<size_t>(K) + static_cast<size_t>(used[best]++);
    for (int64_t i : bins.group(b)) cells.add(cell, by_index[static_cast<size_t>(i)]);
    load[best] += bin_load[b];
  }
  return cells;
}

struct Candidate {
  double time = 0.0;
  int64_t K = 0;
  Cells cells{0};
  std::vector<size_t> layout;  // rank-major position r·K + k -> cell
};

// Dummies filled, cells laid out rank-major, the time under the sync mode.
Candidate finish(Cells cells, int64_t R, int64_t K, const StepOptions& o) {
  Candidate c{0.0, K, std::move(cells), {}};
  if (o.sync == StepSync::MicroBatch) {
    std::vector<size_t> all(c.cells.size());
    std::iota(all.begin(), all.end(), 0);
    fill_dummies(c.cells, all);
    c.layout = group_into_steps(c.cells, R, K);
  } else {
    c.layout = order_within_ranks(c.cells, R, K);
  }
  std::vector<double> costs;
  costs.reserve(c.layout.size());
  for (size_t cell : c.layout) costs.push_back(o.cost.per_micro_batch + c.cells.load[cell]);
  c.time = step_time(costs, R, K, o.sync);
  return c;
}

int64_t min_micro_batches(Lengths lengths, const StepOptions& o) {
  const int64_t total = checked_sum(kFn, "lengths", lengths);
  int64_t big = 0;
  for (int64_t s : lengths) big += s > o.max_tokens / 2 ? 1 : 0;
  const int64_t cells = std::max(ceil_div(total, o.max_tokens), big);
  return round_up(kFn, std::max(o.min_micro_batches, ceil_div(cells, o.dp_size)), o.multiple_of);
}

// Fractional knapsack: the most Σs² (or Σ squares, the stand-ins) that `budget`
// tokens of these sequences can hold: densest first (s² / s = s: longest first),
// the last one in part.
double max_square_sum(Lengths lengths, Lengths squares, double budget) {
  std::vector<std::pair<double, double>> by_density;  // (square per token, tokens)
  by_density.reserve(lengths.size());
  for (size_t i = 0; i < lengths.size(); ++i) {
    const auto x = static_cast<double>(lengths[i]);
    if (x > 0) by_density.emplace_back(squares.empty() ? x : static_cast<double>(squares[i]) / x, x);
  }
  std::sort(by_density.begin(), by_density.end(), std::greater<>());
  double sq = 0.0;
  for (const auto& [density, x] : by_density) {
    if (budget <= 0) break;
    const double take = std::min(x, budget);
    sq += take * density;
    budget -= take;
  }
  return sq;
}

// step_lower_bound of validated lengths and options (the mini-batch's own
// `squares`, or none), K_min given.
double lower_bound_of(Lengths lengths, Lengths squares, const StepOptions& o, int64_t k_min) {
  const auto R = static_cast<double>(o.dp_size);
  double work = 0.0, heaviest = 0.0, tokens = 0.0;
  std::vector<Item> big;
  for (size_t i = 0; i < lengths.size(); ++i) {
    const double w = squares.empty() ? o.cost.work(lengths[i])
                                     : o.cost.per_token * static_cast<double>(lengths[i]) +
                                           o.cost.per_token_squared * static_cast<double>(squares[i]);
    work += w;
    tokens += static_cast<double>(lengths[i]);
    heaviest = std::max(heaviest, w);
    if (lengths[i] > o.max_tokens / 2) big.push_back({static_cast<int64_t>(i), lengths[i], w});
  }
  double variable = std::max(work / R, heaviest);
  if (o.sync == StepSync::MicroBatch && !big.empty()) {
    // Step maxima sorted descending satisfy M_(j) >= floor_j (R sequences above
    // half the cap per step at most). A step holds at most R·cap tokens, so at most
    // H1 = c1·R·cap linear work and H2 = H1 + c2·(the most Σs² of R·cap tokens)
    // in all, and at most R·M_k: raising Σ M_k by one absorbs at most R of either.
    std::sort(big.begin(), big.end(), [](const Item& a, const Item& b) { return a.w > b.w; });
    std::vector<double> floors;
    for (size_t j = 0; j < big.size(); j += static_cast<size_t>(o.dp_size)) floors.push_back(big[j].w);
    const double step_tokens = R * static_cast<double>(o.max_tokens);
    const double h1 = o.cost.per_token * step_tokens;
    const double h2 = h1 + o.cost.per_token_squared * max_square_sum(lengths, squares, step_tokens);
    double floor_sum = 0.0, held_linear = 0.0, held_all = 0.0;
    for (double f : floors) {
      floor_sum += f;
      held_linear += std::min(R * f, h1);
      held_all += std::min(R * f, h2);
    }
    const double excess =
        std::max({0.0, o.cost.per_token * tokens - held_linear, work - held_all});
    variable = std::max(variable, floor_sum + excess / R);
  }
  return static_cast<double>(k_min) * o.cost.per_micro_batch + variable;
}

MiniBatchStep plan_mini_batch(Lengths lengths, int64_t begin, int64_t end, const StepOptions& o, int64_t k_min) {
  const int64_t R = o.dp_size, cap = o.max_tokens, mult = o.multiple_of;
  const Lengths local = lengths.subspan(static_cast<size_t>(begin), static_cast<size_t>(end - begin));
  MiniBatchStep out;
  out.begin = begin;
  out.end = end;
  out.lower_bound = lower_bound_of(local, squares_of(o, begin, end), o, k_min);
  const double variable_bound = out.lower_bound - static_cast<double>(k_min) * o.cost.per_micro_batch;
  const std::vector<Item> items = sorted_items(lengths, begin, end, o);
  const auto n = static_cast<int64_t>(items.size());
  const int64_t k_cap = std::max(k_min, round_up(kFn, ceil_div(n, R), mult));

  std::optional<Candidate> best;
  auto consider = [&](Candidate c) {
    if (!best || c.time < best->time * (1 - kTie)) {
      best = std::move(c);
      return true;
    }
    return false;
  };
  int tried_since_best = 0, failed = 0;
  for (int64_t K = k_min; K <= k_cap; K += mult) {
    if (best && static_cast<double>(K) * o.cost.per_micro_batch + variable_bound >= best->time * (1 - kTie)) break;
    if (best && best->time <= out.lower_bound * (1 + 1e-9)) break;
    std::optional<Cells> cells = o.sync == StepSync::MicroBatch ? place_for_micro_batch_sync(items, R, K, cap)
                                                                 : place_for_step_sync(items, R, K, cap);
    if (!cells) {
      if (++failed >= 16) break;
      continue;
    }
    if (consider(finish(std::move(*cells), R, K, o))) {
      tried_since_best = 0;
    } else if (++tried_since_best >= 4) {
      break;
    }
  }
  {
    auto [cells, K] = two_step_cells(lengths, begin, end, o);
    consider(finish(std::move(cells), R, K, o));
  }
  // First-fit-decreasing bins always fit the cap: the plan of last resort, and a
  // candidate like any other.
  {
    const auto bins = static_cast<int64_t>(first_fit_decreasing(local, cap).size());
    const int64_t K = std::max(k_min, round_up(kFn, ceil_div(bins, R), mult));
    consider(finish(ffd_cells(items, lengths, begin, end, R, K, cap, o.sync), R, K, o));
  }
  if (o.sync == StepSync::Step) {
    // Polish the chosen plan only (it never raises the heaviest rank).
    balance_ranks(best->cells, R, best->K, cap);
    best = finish(std::move(best->cells), R, best->K, o);
  }
  out.num_micro_batches = best->K;
  out.predicted_time = best->time;
  for (size_t cell : best->layout) {
    std::vector<int64_t> idx;
    idx.reserve(best->cells.items[cell].size());
    for (const Item& it : best->cells.items[cell]) idx.push_back(it.index);
    std::sort(idx.begin(), idx.end());
    out.cells.push_group(idx);
    out.costs.push_back(o.cost.per_micro_batch + best->cells.load[cell]);
    out.tokens.push_back(best->cells.tokens[cell]);
  }
  return out;
}

std::string number(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

void check_options(const StepOptions& o) {
  check_positive(kFn, "dp_size", o.dp_size);
  check_positive(kFn, "max_tokens", o.max_tokens);
  check_positive(kFn, "mini_batches", o.mini_batches);
  check_positive(kFn, "min_micro_batches", o.min_micro_batches);
  check_positive(kFn, "multiple_of", o.multiple_of);
  const std::pair<const char*, double> terms[] = {{"cost.per_micro_batch", o.cost.per_micro_batch},
                                                  {"cost.per_token", o.cost.per_token},
                                                  {"cost.per_token_squared", o.cost.per_token_squared}};
  for (const auto& [name, v] : terms)
    if (!std::isfinite(v) || v < 0)
      throw_invalid(kFn, std::string(name) + " must be finite and >= 0, got " + number(v));
  if (o.cost.per_micro_batch == 0 && o.cost.per_token == 0 && o.cost.per_token_squared == 0)
    throw_invalid(kFn, "cost needs at least one positive coefficient");
  // The largest micro-batch (max_tokens tokens, one sequence: max_tokens² attended
  // pairs) must have a finite cost, term by term and in all.
  const auto cap = static_cast<double>(o.max_tokens);
  const std::pair<const char*, double> largest[] = {{"cost.per_token * max_tokens", o.cost.per_token * cap},
                                                    {"cost.per_token_squared * max_tokens^2",
                                                     o.cost.per_token_squared * cap * cap}};
  for (const auto& [name, v] : largest)
    if (!std::isfinite(v))
      throw_invalid(kFn, std::string(name) + " overflows float64 (max_tokens = " + std::to_string(o.max_tokens) +
                             "): scale the cost model down, only its ratios matter");
  if (!std::isfinite(o.cost.per_micro_batch + largest[0].second + largest[1].second))
    throw_invalid(kFn, "the cost of a micro-batch of max_tokens = " + std::to_string(o.max_tokens) +
                           " tokens overflows float64: scale the cost model down, only its ratios matter");
}

// The lengths, and the s² stand-ins when given (one per length, >= 0).
void check_lengths(Lengths lengths, const StepOptions& o) {
  check_non_negative_lengths(kFn, "lengths", lengths);
  check_lengths_fit(kFn, "lengths", lengths, o.max_tokens, "max_tokens");
  if (o.squares.empty()) return;
  if (o.squares.size() != lengths.size())
    throw_invalid(kFn, "squares: must hold one entry per length (" + std::to_string(lengths.size()) + "), got " +
                           std::to_string(o.squares.size()));
  for (size_t i = 0; i < lengths.size(); ++i)
    if (o.squares[i] < 0)
      throw_invalid(kFn, "squares[" + std::to_string(i) + "] = " + std::to_string(o.squares[i]) + " must be >= 0");
}

// A plan whose total overflowed: names the term of the cost model that contributes
// the most to the step (per_micro_batch per micro-batch, per_token per token,
// per_token_squared per attended pair).
[[noreturn]] void throw_overflowed_time(Lengths lengths, const StepOptions& o, const StepPlan& plan) {
  double cells = 0.0, tokens = 0.0, pairs = 0.0;
  for (const MiniBatchStep& mb : plan.mini_batches) cells += static_cast<double>(mb.cells.size());
  for (size_t i = 0; i < lengths.size(); ++i) {
    tokens += static_cast<double>(lengths[i]);
    pairs += o.squares.empty() ? static_cast<double>(lengths[i]) * static_cast<double>(lengths[i])
                               : static_cast<double>(o.squares[i]);
  }
  struct Term {
    const char* name;
    double coeff, count;
  };
  const Term terms[] = {{"cost.per_micro_batch", o.cost.per_micro_batch, cells},
                        {"cost.per_token", o.cost.per_token, tokens},
                        {"cost.per_token_squared", o.cost.per_token_squared, pairs}};
  const Term* worst = &terms[0];
  for (const Term& t : terms)
    if (!(t.coeff * t.count <= worst->coeff * worst->count)) worst = &t;
  throw_invalid(kFn, std::string("the predicted step time overflows float64: ") + worst->name + " = " +
                         number(worst->coeff) + " is too large for these lengths; scale the cost model down, "
                         "only its ratios matter");
}

}  // namespace

double step_time(const std::vector<double>& costs, int64_t R, int64_t K, StepSync sync) {
  double time = 0.0;
  if (sync == StepSync::MicroBatch) {
    for (int64_t k = 0; k < K; ++k) {
      double m = 0.0;
      for (int64_t r = 0; r < R; ++r) m = std::max(m, costs[static_cast<size_t>(r * K + k)]);
      time += m;
    }
  } else {
    for (int64_t r = 0; r < R; ++r) {
      double sum = 0.0;
      for (int64_t k = 0; k < K; ++k) sum += costs[static_cast<size_t>(r * K + k)];
      time = std::max(time, sum);
    }
  }
  return time;
}

void check_step_options(const StepOptions& o) { check_options(o); }

double step_lower_bound(Lengths lengths, const StepOptions& o) {
  check_options(o);
  check_lengths(lengths, o);
  return lower_bound_of(lengths, o.squares, o, min_micro_batches(lengths, o));
}

std::vector<int64_t> mini_batch_counts(int64_t n, const StepOptions& o, const std::string& name, const char* units) {
  check_positive(kFn, "mini_batches", o.mini_batches);
  if (n < o.mini_batches)
    throw_invalid(kFn, name + ": " + std::to_string(n) + " " + units + " cannot fill mini_batches=" +
                           std::to_string(o.mini_batches) + " mini-batches (each needs at least one)");
  if (!o.mini_batch_sizes.empty()) {
    if (static_cast<int64_t>(o.mini_batch_sizes.size()) != o.mini_batches)
      throw_invalid(kFn, "mini_batch_sizes: must hold mini_batches = " + std::to_string(o.mini_batches) +
                             " sizes, got " + std::to_string(o.mini_batch_sizes.size()));
    check_positive_lengths(kFn, "mini_batch_sizes", o.mini_batch_sizes);
    if (checked_sum(kFn, "mini_batch_sizes", o.mini_batch_sizes) != n)
      throw_invalid(kFn, "mini_batch_sizes: must sum to the number of " + std::string(units) + " (" +
                             std::to_string(n) + ")");
    return {o.mini_batch_sizes.begin(), o.mini_batch_sizes.end()};
  }
  std::vector<int64_t> counts(static_cast<size_t>(o.mini_batches));
  for (int64_t m = 0; m < o.mini_batches; ++m)
    counts[static_cast<size_t>(m)] = n / o.mini_batches + (m < n % o.mini_batches ? 1 : 0);
  return counts;
}

StepPlan plan_step(Lengths lengths, const StepOptions& o) {
  check_options(o);
  check_lengths(lengths, o);
  const std::vector<int64_t> counts = mini_batch_counts(static_cast<int64_t>(lengths.size()), o, "lengths",
                                                        "sequences");
  checked_sum(kFn, "lengths", lengths);
  StepPlan plan;
  int64_t begin = 0;
  for (int64_t m = 0; m < o.mini_batches; ++m) {
    const int64_t end = begin + counts[static_cast<size_t>(m)];
    const Lengths local = lengths.subspan(static_cast<size_t>(begin), static_cast<size_t>(end - begin));
    const int64_t k_min = min_micro_batches(local, o);
    if (k_min > kMaxCells / o.dp_size)
      throw_invalid(kFn, "min_micro_batches: " + std::to_string(k_min) + " micro-batches on each of dp_size=" +
                             std::to_string(o.dp_size) + " ranks exceed the " + std::to_string(kMaxCells) +
                             " micro-batches a mini-batch may plan");
    plan.mini_batches.push_back(plan_mini_batch(lengths, begin, end, o, k_min));
    plan.predicted_time += plan.mini_batches.back().predicted_time;
    plan.lower_bound += plan.mini_batches.back().lower_bound;
    begin = end;
  }
  if (!std::isfinite(plan.predicted_time) || !std::isfinite(plan.lower_bound)) throw_overflowed_time(lengths, o, plan);
  return plan;
}

}  // namespace seqpack
