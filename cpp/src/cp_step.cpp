// Planning a step with fixed or hybrid context parallelism (cp_step.hpp): degrees
// per sequence, then a greedy placement of aligned blocks over the D * C ranks and K
// micro-batch steps, K grown from its bound until everything fits the cap.
#include "seqpack/cp_step.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>
#include <string>

#include "cp_blocks.hpp"

namespace seqpack {
namespace {

constexpr const char* kFn = "plan_step";

struct Item {
  int64_t id = 0, s = 0, d = 1, tokens = 0;
  double work = 0.0;  // on each rank of its block, per_micro_batch excluded
};

// Item i's work on each rank of its block at degree d.
double item_work(const CpStepOptions& o, const CpItems& items, int64_t i, int64_t d) {
  const StepCost& c = o.step.cost;
  const auto sd = static_cast<double>(items.tokens[static_cast<size_t>(i)]), dd = static_cast<double>(d);
  double w = c.per_token * static_cast<double>(items.local_at(i, d)) +
             c.per_token_squared * static_cast<double>(items.squares[static_cast<size_t>(i)]) / dd;
  if (d > 1) w += o.cp.per_kv_token * sd * (dd - 1.0) / dd + o.cp.per_collective;
  return w;
}

// The smallest power-of-two degree d <= C whose shard of item i fits the cap; 0 if none.
int64_t smallest_degree(const CpItems& items, int64_t i, int64_t C, int64_t cap, int64_t min_degree) {
  for (int64_t d = min_degree; d <= C; d *= 2)
    if (items.local_at(i, d) <= cap) return d;
  return 0;
}

int64_t log2_of(int64_t d) {
  int64_t j = 0;
  while ((int64_t{1} << j) < d) ++j;
  return j;
}

struct Placement {
  int64_t K = 0;
  std::vector<std::vector<int64_t>> cells;  // [R * K] sequence ids
  std::vector<double> load;                 // [R * K], per_micro_batch excluded
  std::vector<int64_t> tokens;              // [R * K]
  std::vector<int64_t> first_rank;          // per item (in the order given)
};

// The levels j (degree 2^j) of the items' degrees.
std::vector<int64_t> levels_in_use(const std::vector<Item>& items) {
  std::vector<int64_t> levels;
  for (const Item& it : items) levels.push_back(log2_of(it.d));
  std::sort(levels.begin(), levels.end());
  levels.erase(std::unique(levels.begin(), levels.end()), levels.end());
  return levels;
}

// Items heaviest first (work x degree), each to the aligned block and step that
// raise the step's maximum the least (sync MicroBatch) or keep its ranks' totals the
// lowest (Step), within the cap; or, `tight`, items with the most tokens first, each
// where it leaves the least room (best fit: packs a count that balancing misses).
// Ties go to the lowest block, then the earliest step. None when some item finds no
// room. Each step's blocks are searched through their index (cp_blocks.hpp): a few
// tree descents per step instead of a scan of the ranks.
std::optional<Placement> place(const std::vector<Item>& items, const CpStepOptions& o, int64_t K, bool tight) {
  const int64_t C = o.cp_size, R = o.step.dp_size * C, cap = o.step.max_tokens;
  Placement p;
  p.K = K;
  p.cells.assign(static_cast<size_t>(R * K), {});
  p.load.assign(static_cast<size_t>(R * K), 0.0);
  p.tokens.assign(static_cast<size_t>(R * K), 0);
  p.first_rank.assign(items.size(), -1);
  std::vector<double> step_max(static_cast<size_t>(K), 0.0), total(static_cast<size_t>(R), 0.0);
  const std::vector<int64_t> used = levels_in_use(items);
  std::vector<detail::StepBlocks> steps(static_cast<size_t>(K), detail::StepBlocks(R, used));
  const bool by_total = !tight && o.step.sync == StepSync::Step;
  detail::StepBlocks totals = by_total ? detail::StepBlocks(R, used) : detail::StepBlocks();  // load = a rank's total
  std::vector<size_t> order(items.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    if (tight) return items[a].tokens * items[a].d > items[b].tokens * items[b].d;
    return items[a].work * static_cast<double>(items[a].d) > items[b].work * static_cast<double>(items[b].d);
  });
  // Best fit looks at every step at once (one ordered set per level).
  std::optional<detail::BestFit> fit;
  if (tight) fit.emplace(R, K, used);
  for (size_t i : order) {
    const Item& it = items[i];
    const int64_t j = log2_of(it.d), limit = cap - it.tokens;
    const double w = it.work;
    detail::BlockKey best_key;
    int64_t best_rank = -1, best_k = -1;
    if (tight) {
      const auto [b, k] = limit < 0 ? std::pair<int64_t, int64_t>{-1, -1} : fit->find(j, limit);
      best_rank = b < 0 ? -1 : b << j, best_k = k;
    }
    for (int64_t k = 0; k < K && !tight; ++k) {
      const detail::StepBlocks& s = steps[static_cast<size_t>(k)];
      const double top = step_max[static_cast<size_t>(k)];
      // (a, b) of a block whose busiest rank holds load L: MicroBatch, how much the
      // step's maximum grows, then the new peak (L + w); Step, the busiest rank's new
      // total, then the peak. A node's bound: the same of its least values. The best so
      // far (an earlier step's) is the incumbent: a step that cannot beat it is left
      // after its root's bound.
      auto key = [&](int64_t q) {
        const double peak = s.min_load(j, q) + w;
        return by_total ? detail::BlockKey{totals.min_load(j, q) + w, peak}
                        : detail::BlockKey{std::max(0.0, peak - top), peak};
      };
      const int64_t b = s.best(j, limit, key, key, best_rank < 0 ? -1 : best_rank >> j, best_key);
      if (b < 0) continue;
      best_key = key(s.leaves(j) + b), best_rank = b << j, best_k = k;  // lower in (key, block) than the incumbent
    }
    if (best_rank < 0) return std::nullopt;
    p.first_rank[i] = best_rank;
    detail::StepBlocks& s = steps[static_cast<size_t>(best_k)];
    std::vector<std::pair<int64_t, detail::BestFit::Entry>> touched;  // (level, its old entry) of each block changed
    if (tight)
      for (int64_t jj : used)
        for (int64_t b = best_rank >> jj; b <= (best_rank + it.d - 1) >> jj; ++b) {
          const int64_t q = s.leaves(jj) + b;
          touched.push_back({jj, {s.max_tokens(jj, q), s.min_load(jj, q), b, best_k}});
        }
    for (int64_t r = best_rank; r < best_rank + it.d; ++r) {
      const auto c = static_cast<size_t>(r * K + best_k);
      p.cells[c].push_back(it.id);
      p.tokens[c] += it.tokens;
      p.load[c] += it.work;
      total[static_cast<size_t>(r)] += it.work;
      step_max[static_cast<size_t>(best_k)] = std::max(step_max[static_cast<size_t>(best_k)], p.load[c]);
      s.raise(r, p.tokens[c], p.load[c]);
      if (by_total) totals.raise(r, 0, total[static_cast<size_t>(r)]);
    }
    for (const auto& [jj, from] : touched) {
      const int64_t q = s.leaves(jj) + from.block;
      fit->move(jj, from, s.max_tokens(jj, q), s.min_load(jj, q));
    }
  }
  return p;
}

double time_of(const Placement& p, const CpStepOptions& o) {
  std::vector<double> costs(p.load.size());
  for (size_t c = 0; c < costs.size(); ++c) costs[c] = o.step.cost.per_micro_batch + p.load[c];
  return step_time(costs, o.step.dp_size * o.cp_size, p.K, o.step.sync);
}

// Levels (FSDP sync: a step costs its busiest rank): items tallest first (a rank's work
// of it), each into the first micro-batch step where an aligned block of its ranks has
// room under the step's height (set by its first, tallest item) and under the cap, the
// least loaded such block; a new step otherwise. The steps of first-fit decreasing
// height, as in strip packing: tall shares share a step, short ones fill the gaps under
// it. Empty steps are added up to min_micro_batches and the multiple.
Placement place_levels(const std::vector<Item>& items, const CpStepOptions& o) {
  const int64_t C = o.cp_size, R = o.step.dp_size * C, cap = o.step.max_tokens;
  std::vector<size_t> order(items.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return items[a].work > items[b].work; });
  struct Level {
    double height = 0.0;
    std::vector<double> load;
    std::vector<int64_t> tokens;
    std::vector<std::vector<int64_t>> cells;
    detail::StepBlocks blocks;
  };
  const std::vector<int64_t> used = levels_in_use(items);
  std::vector<Level> levels;
  std::vector<int64_t> first_rank(items.size(), -1);
  for (size_t i : order) {
    const Item& it = items[i];
    const int64_t j = log2_of(it.d), limit = cap - it.tokens;
    int64_t at_level = -1, at_rank = -1;
    for (size_t l = 0; l < levels.size() && at_level < 0; ++l) {
      // The least loaded block with room for the tokens; if it goes over the step's
      // height, every block with room does.
      const detail::StepBlocks& s = levels[l].blocks;
      if (s.min_tokens(j, 1) > limit || s.min_load(j, 1) + it.work > levels[l].height * (1 + 1e-12)) continue;
      auto key = [&](int64_t q) { return detail::BlockKey{s.min_load(j, q), 0.0}; };
      const int64_t b = s.best(j, limit, key, key);
      if (b >= 0 && s.min_load(j, s.leaves(j) + b) + it.work <= levels[l].height * (1 + 1e-12))
        at_level = static_cast<int64_t>(l), at_rank = b << j;
    }
    if (at_level < 0) {
      Level lv;
      lv.height = it.work;
      lv.load.assign(static_cast<size_t>(R), 0.0);
      lv.tokens.assign(static_cast<size_t>(R), 0);
      lv.cells.assign(static_cast<size_t>(R), {});
      lv.blocks = detail::StepBlocks(R, used);
      levels.push_back(std::move(lv));
      at_level = static_cast<int64_t>(levels.size()) - 1;
      at_rank = 0;
    }
    Level& lv = levels[static_cast<size_t>(at_level)];
    for (int64_t r = at_rank; r < at_rank + it.d; ++r) {
      const auto c = static_cast<size_t>(r);
      lv.load[c] += it.work;
      lv.tokens[c] += it.tokens;
      lv.cells[c].push_back(it.id);
      lv.blocks.raise(r, lv.tokens[c], lv.load[c]);
    }
    first_rank[i] = at_rank;
  }
  Placement p;
  p.K = round_up(kFn, std::max<int64_t>({static_cast<int64_t>(levels.size()), o.step.min_micro_batches, 1}),
                 o.step.multiple_of);
  p.cells.assign(static_cast<size_t>(R * p.K), {});
  p.load.assign(static_cast<size_t>(R * p.K), 0.0);
  p.tokens.assign(static_cast<size_t>(R * p.K), 0);
  for (size_t l = 0; l < levels.size(); ++l)
    for (int64_t r = 0; r < R; ++r) {
      const auto c = static_cast<size_t>(r * p.K + static_cast<int64_t>(l));
      p.cells[c] = std::move(levels[l].cells[static_cast<size_t>(r)]);
      p.load[c] = levels[l].load[static_cast<size_t>(r)];
      p.tokens[c] = levels[l].tokens[static_cast<size_t>(r)];
    }
  p.first_rank = std::move(first_rank);
  return p;
}

// The fastest placement over a few counts from the first that fits (found growing
// K by a quarter from its bound: at K = n every item has a step of its own).
std::optional<Placement> best_placement(const std::vector<Item>& items, const CpStepOptions& o, int64_t k_min) {
  const auto n = static_cast<int64_t>(items.size());
  const int64_t step = o.step.multiple_of, last = round_up(kFn, std::max<int64_t>(k_min, n), step);
  std::optional<Placement> best;
  double best_time = 0.0;
  int64_t K = k_min;
  auto consider = [&](int64_t k) {
    for (const bool tight : {false, true}) {
      std::optional<Placement> p = place(items, o, k, tight);
      if (!p) continue;
      const double t = time_of(*p, o);
      if (!best || t < best_time * (1 - 1e-12)) best = std::move(p), best_time = t;
    }
  };
  // Grow K by a quarter, never past `last` (the count that surely fits) before trying it.
  auto next = [&](int64_t k) {
    return k >= last ? last + step : std::min(last, round_up(kFn, k + std::max<int64_t>(step, k / 4), step));
  };
  for (; K <= last && !best; K = next(K)) consider(K);
  for (int64_t extra = 0; best && extra < 2 && K <= last; ++extra, K += step) consider(K);
  if (o.step.sync == StepSync::MicroBatch) {  // every item fits a step of its own: levels always place
    Placement p = place_levels(items, o);
    const double t = time_of(p, o);
    if (!best || t < best_time * (1 - 1e-12)) best = std::move(p), best_time = t;
  }
  return best;
}

}  // namespace

int64_t cp_local_tokens(int64_t s, int64_t d) { return d <= 1 ? s : round_up("cp_local_tokens", s, 2 * d) / d; }

CpItems CpItems::of_lengths(Lengths lengths, int64_t cp_size) {
  check_non_negative_lengths(kFn, "lengths", lengths);
  check_positive(kFn, "cp_size", cp_size);
  if (cp_size > kMaxCpRanks)
    throw_invalid(kFn, "cp_size=" + std::to_string(cp_size) + " is more than the " + std::to_string(kMaxCpRanks) +
                           " ranks a step can plan");
  CpItems items;
  items.levels = log2_of(cp_size) + 1;
  items.tokens.assign(lengths.begin(), lengths.end());
  items.squares.reserve(lengths.size());
  items.local.reserve(lengths.size() * static_cast<size_t>(items.levels));
  for (const int64_t s : lengths) {
    items.squares.push_back(checked_mul(kFn, "a length squared", s, s));
    for (int64_t j = 0; j < items.levels; ++j) items.local.push_back(cp_local_tokens(s, int64_t{1} << j));
  }
  return items;
}

int64_t CpItems::local_at(int64_t i, int64_t d) const {
  return local[static_cast<size_t>(i * levels + log2_of(d))];
}

CpStepPlan plan_cp_step(Lengths lengths, const CpStepOptions& o) {
  return plan_cp_step(CpItems::of_lengths(lengths, o.cp_size), o);
}

namespace {

void check_items(const CpItems& items, const CpStepOptions& o) {
  check_step_options(o.step);
  check_positive(kFn, "cp_size", o.cp_size);
  if ((o.cp_size & (o.cp_size - 1)) != 0)
    throw_invalid(kFn, "cp_size must be a power of two, got " + std::to_string(o.cp_size));
  if (o.cp_size > kMaxCpRanks / o.step.dp_size)
    throw_invalid(kFn, "cp_size=" + std::to_string(o.cp_size) + " x dp_size=" + std::to_string(o.step.dp_size) +
                           " ranks is more than the " + std::to_string(kMaxCpRanks) + " ranks a step can plan");
  if (o.min_degree < 1 || o.min_degree > o.cp_size || (o.min_degree & (o.min_degree - 1)) != 0)
    throw_invalid(kFn, "min_cp_degree must be a power of two in [1, cp_size=" + std::to_string(o.cp_size) +
                           "], got " + std::to_string(o.min_degree));
  for (const auto& [name, v] : {std::pair{"cost.per_kv_token", o.cp.per_kv_token},
                                std::pair{"cost.per_collective", o.cp.per_collective}})
    if (!std::isfinite(v) || v < 0) throw_invalid(kFn, std::string(name) + " must be finite and >= 0");
  const size_t n = items.tokens.size();
  if (items.levels != log2_of(o.cp_size) + 1 || items.squares.size() != n ||
      items.local.size() != n * static_cast<size_t>(items.levels))
    throw_invalid(kFn, items.name + ": per item, its squares and its local tokens at each of the " +
                           std::to_string(log2_of(o.cp_size) + 1) + " degrees up to cp_size=" +
                           std::to_string(o.cp_size) + " are needed");
  check_non_negative_lengths(kFn, items.name.c_str(), items.tokens);
  check_non_negative_lengths(kFn, (items.name + " squares").c_str(), items.squares);
  check_non_negative_lengths(kFn, (items.name + " local tokens").c_str(), items.local);
}

}  // namespace

CpStepPlan plan_cp_step(const CpItems& items, const CpStepOptions& o) {
  check_items(items, o);
  const int64_t n = items.size();
  const std::vector<int64_t> counts = mini_batch_counts(n, o.step, items.name, "items");
  const int64_t C = o.cp_size, R = o.step.dp_size * C, cap = o.step.max_tokens;
  CpStepPlan plan;
  std::vector<int64_t> least(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s = items.tokens[static_cast<size_t>(i)];
    least[static_cast<size_t>(i)] = smallest_degree(items, i, C, cap, o.hybrid ? o.min_degree : 1);
    if (least[static_cast<size_t>(i)] == 0)
      throw_invalid(kFn, items.name + "[" + std::to_string(i) + "] = " + std::to_string(s) +
                             " tokens: even sharded over cp_size=" + std::to_string(C) + " ranks, a rank's part (" +
                             std::to_string(items.local_at(i, C)) + " tokens" +
                             (items.name == "lengths" ? " with the zigzag pad" : "") + ") exceeds max_tokens=" +
                             std::to_string(cap));
    plan.least_kv_tokens += s * (least[static_cast<size_t>(i)] - 1);
  }
  bool fixed_fits = true;
  for (int64_t i = 0; i < n; ++i) fixed_fits = fixed_fits && items.local_at(i, C) <= cap;
  if (!o.hybrid && !fixed_fits)
    throw_invalid(kFn, "fixed CP shards every sequence over cp_size=" + std::to_string(C) +
                           " ranks (a row padded to a multiple of 2 * cp_size = " + std::to_string(2 * C) +
                           "): some rank's part then exceeds max_tokens=" + std::to_string(cap) +
                           " (hybrid_cp=True shards short sequences less)");
  plan.degree.assign(static_cast<size_t>(n), C);
  plan.first_rank.assign(static_cast<size_t>(n), 0);
  bool any_hybrid = false;
  int64_t begin = 0;
  for (int64_t m = 0; m < o.step.mini_batches; ++m) {
    const int64_t end = begin + counts[static_cast<size_t>(m)];
    // The bound: the fewest steps the tokens need, and the work with every sequence at
    // its smallest degree spread over every rank.
    int64_t sum = 0;
    double work = 0.0;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t s = items.tokens[static_cast<size_t>(i)];
      sum = checked_add(kFn, "the tokens of a mini-batch", sum, s);
      const auto sd = static_cast<double>(s);
      work += o.step.cost.per_token * sd +
              o.step.cost.per_token_squared * static_cast<double>(items.squares[static_cast<size_t>(i)]) +
              o.cp.per_kv_token * sd * static_cast<double>(least[static_cast<size_t>(i)] - 1);
    }
    const int64_t k_min =
        round_up(kFn, std::max(o.step.min_micro_batches, ceil_div(sum, checked_mul(kFn, "ranks x max_tokens", R, cap))),
                 o.step.multiple_of);
    // Candidates: every sequence at C (fixed); with hybrid each at its smallest degree,
    // and each at the smallest degree whose shard is no heavier than a rank's mean load
    // per micro-batch (a long sequence spread wider so that it does not set the step).
    double mean_load = 0.0;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t d = least[static_cast<size_t>(i)];
      mean_load += item_work(o, items, i, d) * static_cast<double>(d);
    }
    mean_load /= static_cast<double>(R * k_min);
    struct Candidate {
      Placement placement;
      std::vector<Item> items;
      double time = 0.0, compute = 0.0;  // the step, and the same placement with the CP terms zeroed
      int64_t kv = 0;
      bool hybrid = false;
    };
    CpStepOptions bare = o;  // compute only: what a placement cannot hide behind communication
    bare.cp = CpCost{};
    // A placement's step under the model, and its compute: each cell's load summed
    // again from its items' work (a placement made for compute alone holds that).
    auto priced = [&](Candidate& c, Placement p) {
      std::vector<double> full(static_cast<size_t>(n), 0.0), compute_only(static_cast<size_t>(n), 0.0);
      for (const Item& it : c.items) {
        full[static_cast<size_t>(it.id)] = it.work;
        compute_only[static_cast<size_t>(it.id)] = item_work(bare, items, it.id, it.d);
      }
      Placement compute = p;
      for (size_t cell = 0; cell < p.cells.size(); ++cell) {
        p.load[cell] = compute.load[cell] = 0.0;
        for (int64_t id : p.cells[cell]) {
          p.load[cell] += full[static_cast<size_t>(id)];
          compute.load[cell] += compute_only[static_cast<size_t>(id)];
        }
      }
      c.time = time_of(p, o);
      c.compute = time_of(compute, o);
      c.placement = std::move(p);
    };
    std::vector<Candidate> candidates;
    // Rules: 0 fixed; 1 smallest degrees; 2 spread to the mean load; 3 + j: no shard
    // above cap / 2^(j+1) tokens (easier to pack, more traffic); 3 + levels + j: no
    // shard's work above the fixed plan's step / 2^(j+1) (only the sequences that would
    // hold a step up spread; the rest keep the least traffic).
    int64_t levels = 0;
    while ((int64_t{2} << levels) <= C) ++levels;
    double step_budget = mean_load * static_cast<double>(k_min);  // fixed CP's step when it places
    for (int64_t rule = 0; rule < 3 + 2 * levels + 1; ++rule) {
      if ((rule > 0 && !o.hybrid) || (rule == 0 && !fixed_fits)) continue;
      const int64_t share = rule - 3 - levels;  // >= 0: a work budget per shard
      const double budget = share >= 0 ? step_budget / static_cast<double>(int64_t{2} << share) : 0.0;
      Candidate c;
      for (int64_t i = begin; i < end; ++i) {
        const int64_t s = items.tokens[static_cast<size_t>(i)];
        int64_t d = rule == 0 ? C : least[static_cast<size_t>(i)];
        while (rule == 2 && d < C && item_work(o, items, i, d) > mean_load) d *= 2;
        while (rule >= 3 && share < 0 && d < C && items.local_at(i, d) > cap >> (rule - 2)) d *= 2;
        while (share >= 0 && d < C && item_work(o, items, i, d) > budget) d *= 2;
        c.items.push_back({i, s, d, items.local_at(i, d), item_work(o, items, i, d)});
        c.kv += s * (d - 1);
      }
      // Rules often agree on every degree: the same items place the same way.
      const bool seen = std::any_of(candidates.begin(), candidates.end(), [&](const Candidate& e) {
        return e.hybrid == (rule > 0) && std::equal(e.items.begin(), e.items.end(), c.items.begin(), c.items.end(),
                                                    [](const Item& x, const Item& y) { return x.d == y.d; });
      });
      if (seen) continue;
      std::optional<Placement> p = best_placement(c.items, o, k_min);
      if (!p) continue;
      c.hybrid = rule > 0;
      if (rule == 1 && (o.cp.per_kv_token > 0 || o.cp.per_collective > 0)) {
        // The least traffic placed again for compute alone: the K/V terms make a
        // sharded sequence's share look heavier than the compute it holds up, so the
        // placement above can leave ranks idle that a compute-balanced one fills.
        Candidate balanced = c;
        std::vector<Item> bare_items = c.items;
        for (Item& it : bare_items) it.work = item_work(bare, items, it.id, it.d);
        if (std::optional<Placement> q = best_placement(bare_items, bare, k_min)) {
          priced(balanced, std::move(*q));
          candidates.push_back(std::move(balanced));
        }
      }
      priced(c, std::move(*p));
      if (rule == 0) step_budget = c.time;
      candidates.push_back(std::move(c));
    }
    // The fastest; among the plans within kClose of it (and no slower than fixed CP),
    // the one gathering the least K/V: predictions that close are within the model's
    // error (measured gloo steps land within about 20% of a fitted model's prediction,
    // benchmarks/bench_hybrid_cp.py), the traffic is not.
    constexpr double kClose = 0.01;
    double fastest = 0.0, fixed_time = 0.0;
    bool have_fixed = false;
    for (const Candidate& c : candidates) {
      fastest = &c == &candidates.front() ? c.time : std::min(fastest, c.time);
      if (!c.hybrid) fixed_time = c.time, have_fixed = true;
    }
    const double limit = std::min(fastest * (1 + kClose), have_fixed ? fixed_time : fastest * (1 + kClose));
    const Candidate* chosen = nullptr;
    for (const Candidate& c : candidates)
      if (c.time <= limit && (!chosen || c.kv < chosen->kv || (c.kv == chosen->kv && c.time < chosen->time)))
        chosen = &c;
    // Of the same traffic within kClose of the chosen, the least compute: K/V moves
    // while attention runs (ring and all-gather CP overlap them), compute does not.
    const Candidate* first = chosen;
    for (const Candidate& c : candidates)
      if (first && c.kv == first->kv && c.time <= std::min(limit, first->time * (1 + kClose)) &&
          c.compute < chosen->compute)
        chosen = &c;
    std::optional<Placement> kept;
    std::vector<Item> kept_items;
    double kept_time = 0.0;
    bool kept_hybrid = false;
    if (chosen) kept = chosen->placement, kept_items = chosen->items, kept_time = chosen->time, kept_hybrid = chosen->hybrid;
    if (!kept)
      throw_invalid(kFn, "no placement of mini-batch " + std::to_string(m) + " keeps every rank's micro-batch within "
                         "max_tokens=" + std::to_string(cap));
    any_hybrid = any_hybrid || kept_hybrid;
    MiniBatchStep mb;
    mb.begin = begin;
    mb.end = end;
    mb.num_micro_batches = kept->K;
    for (size_t c = 0; c < kept->cells.size(); ++c) {
      std::vector<int64_t>& ids = kept->cells[c];
      std::sort(ids.begin(), ids.end());
      mb.cells.push_group(ids);
      mb.costs.push_back(o.step.cost.per_micro_batch + kept->load[c]);
      mb.tokens.push_back(kept->tokens[c]);
    }
    mb.predicted_time = kept_time;
    mb.lower_bound = std::min(kept_time, static_cast<double>(k_min) * o.step.cost.per_micro_batch +
                                             work / static_cast<double>(R));  // min: float rounding only
    for (size_t j = 0; j < kept_items.size(); ++j) {
      const Item& it = kept_items[j];
      plan.degree[static_cast<size_t>(it.id)] = it.d;
      plan.first_rank[static_cast<size_t>(it.id)] = kept->first_rank[j];
      plan.kv_tokens += it.s * (it.d - 1);
    }
    plan.plan.predicted_time += mb.predicted_time;
    plan.plan.lower_bound += mb.lower_bound;
    plan.plan.mini_batches.push_back(std::move(mb));
    begin = end;
  }
  plan.hybrid = any_hybrid;
  return plan;
}

}  // namespace seqpack
