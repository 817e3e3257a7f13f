#include "seqpack/microbatch.hpp"

#include <algorithm>
#include <cstdint>
#include <numeric>

#include "seqpack/packing.hpp"
#include "seqpack/partition.hpp"

namespace seqpack {

std::vector<int64_t> sequence_workloads(Lengths lengths, int64_t attention_coeff) {
  const char* fn = "sequence_workloads";
  check_non_negative_lengths(fn, "lengths", lengths);
  std::vector<int64_t> w(lengths.size());
  for (size_t i = 0; i < lengths.size(); ++i) {
    const int64_t s = lengths[i];
    w[i] = attention_coeff > 0 ? checked_add(fn, checked_mul(fn, attention_coeff, s), checked_mul(fn, s, s)) : s;
  }
  return w;
}

std::vector<int64_t> small_at_ends_order(const std::vector<int64_t>& workloads) {
  const size_t k = workloads.size();
  std::vector<int64_t> asc(k);
  std::iota(asc.begin(), asc.end(), 0);
  std::stable_sort(asc.begin(), asc.end(), [&](int64_t a, int64_t b) { return workloads[a] < workloads[b]; });
  std::vector<int64_t> order(k);
  size_t front = 0, back = k;
  for (size_t r = 0; r < k; ++r) order[(r % 2 == 0) ? front++ : --back] = asc[r];
  return order;
}

namespace {

struct Candidate {
  IndexGroups groups;
  std::vector<int64_t> tokens, workloads;
  int64_t max_tokens = 0, max_workload = 0;
  const char* method = "";
};

Candidate evaluate(IndexGroups groups, Lengths lengths, Lengths workloads, const char* method) {
  Candidate c;
  c.tokens = group_sums(groups, lengths);
  c.workloads = group_sums(groups, workloads);
  c.max_tokens = c.tokens.empty() ? 0 : *std::max_element(c.tokens.begin(), c.tokens.end());
  c.max_workload = c.workloads.empty() ? 0 : *std::max_element(c.workloads.begin(), c.workloads.end());
  c.groups = std::move(groups);
  c.method = method;
  return c;
}

// Lowers the heaviest group's workload by moving one sequence to the lightest
// group, or swapping one pair between them, as long as both stay within the
// token cap; repeats until neither helps (each step strictly lowers the larger of
// the two, so it terminates; the step count is bounded as well).
IndexGroups rebalance_within_cap(const IndexGroups& groups, Lengths lengths, Lengths work, int64_t cap) {
  std::vector<std::vector<int64_t>> g = groups.to_nested();
  const size_t k = g.size();
  if (k < 2) return groups;
  std::vector<int64_t> tokens = group_sums(groups, lengths), load = group_sums(groups, work);
  const size_t max_steps = 8 * lengths.size() + 16;
  for (size_t step = 0; step < max_steps; ++step) {
    const auto h = static_cast<size_t>(std::max_element(load.begin(), load.end()) - load.begin());
    const auto l = static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    if (load[h] == load[l]) break;
    int64_t best_max = load[h];
    size_t best_i = SIZE_MAX, best_j = SIZE_MAX;  // j == SIZE_MAX: a move, not a swap
    for (size_t i = 0; i < g[h].size(); ++i) {
      const int64_t si = lengths[g[h][i]], wi = work[g[h][i]];
      if (tokens[l] + si <= cap) {
        const int64_t m = std::max(load[h] - wi, load[l] + wi);
        if (m < best_max) best_max = m, best_i = i, best_j = SIZE_MAX;
      }
      for (size_t j = 0; j < g[l].size(); ++j) {
        const int64_t sj = lengths[g[l][j]], wj = work[g[l][j]];
        if (wj >= wi || tokens[l] + si - sj > cap || tokens[h] - si + sj > cap) continue;
        const int64_t m = std::max(load[h] - wi + wj, load[l] + wi - wj);
        if (m < best_max) best_max = m, best_i = i, best_j = j;
      }
    }
    if (best_i == SIZE_MAX) break;
    const int64_t a = g[h][best_i];
    tokens[h] -= lengths[a], load[h] -= work[a], tokens[l] += lengths[a], load[l] += work[a];
    if (best_j == SIZE_MAX) {
      g[h].erase(g[h].begin() + static_cast<std::ptrdiff_t>(best_i));
      g[l].push_back(a);
    } else {
      const int64_t b = g[l][best_j];
      tokens[l] -= lengths[b], load[l] -= work[b], tokens[h] += lengths[b], load[h] += work[b];
      g[h][best_i] = b;
      g[l][best_j] = a;
    }
  }
  for (auto& group : g) std::sort(group.begin(), group.end());
  return IndexGroups::from_nested(g);
}

}  // namespace

MicroBatchPlan plan_micro_batches(Lengths lengths, const MicroBatchOptions& o) {
  const char* fn = "plan_micro_batches";
  check_positive(fn, "max_tokens", o.max_tokens);
  check_positive(fn, "min_num", o.min_num);
  check_positive(fn, "multiple_of", o.multiple_of);
  check_non_negative_lengths(fn, "lengths", lengths);
  check_lengths_fit(fn, "lengths", lengths, o.max_tokens, "max_tokens");
  MicroBatchPlan plan;
  const auto n = static_cast<int64_t>(lengths.size());
  if (n == 0) return plan;
  int64_t total = 0;
  for (int64_t s : lengths) total = checked_add(fn, total, s);
  const std::vector<int64_t> work_vec = sequence_workloads(lengths, o.attention_coeff);
  const Lengths work(work_vec);
  plan.lower_bound = std::max(o.min_num, ceil_div(total, o.max_tokens));
  const int64_t first = round_up(plan.lower_bound, o.multiple_of);
  if (first > n)
    throw_invalid(fn, "need at least " + std::to_string(first) + " micro-batches (min_num=" +
                          std::to_string(o.min_num) + ", multiple_of=" + std::to_string(o.multiple_of) +
                          ", ceil(total/max_tokens)=" + std::to_string(ceil_div(total, o.max_tokens)) +
                          ") but there are only " + std::to_string(n) + " sequences");
  // First-fit-decreasing on tokens always respects the cap: any k between its bin
  // count and n is feasible by splitting bins (adjust_bin_count), which bounds
  // the search.
  const IndexGroups ffd = first_fit_decreasing(lengths, o.max_tokens);
  const int64_t feasible = round_up(std::max<int64_t>(static_cast<int64_t>(ffd.size()), first), o.multiple_of);
  const int64_t last = std::min(feasible, n - n % o.multiple_of);
  if (last < first)
    throw_invalid(fn, "no micro-batch count that is a multiple of multiple_of=" + std::to_string(o.multiple_of) +
                          " and at most the " + std::to_string(n) +
                          " sequences keeps every micro-batch <= max_tokens=" + std::to_string(o.max_tokens));
  Candidate best;
  bool found = false;
  for (int64_t k = first; k <= last && !found; k += o.multiple_of) {
    for (int method = 0; method < 2; ++method) {
      Candidate c = method == 0 ? evaluate(karmarkar_karp(work, k, false, true), lengths, work, "karmarkar_karp")
                                : evaluate(greedy_lpt_partition(work, k, false), lengths, work, "greedy_lpt");
      if (c.max_tokens > o.max_tokens) continue;
      if (!found || c.max_workload < best.max_workload) best = std::move(c);
      found = true;
    }
    if (!found && k + o.multiple_of > last && k >= static_cast<int64_t>(ffd.size())) {
      // First-fit-decreasing packs tight but leaves the last bins light: rebalance
      // its bins on the workload without crossing the cap.
      best = evaluate(rebalance_within_cap(adjust_bin_count(ffd, k, 1), lengths, work, o.max_tokens), lengths, work,
                      "first_fit_decreasing");
      found = true;
    }
  }
  if (!found)
    throw_invalid(fn, "no plan with every micro-batch <= max_tokens=" + std::to_string(o.max_tokens) +
                          " and a count that is a multiple of " + std::to_string(o.multiple_of) +
                          " up to " + std::to_string(n) + " sequences");
  // Order: heaviest first, or lightest at both ends.
  const size_t k = best.groups.size();
  std::vector<int64_t> order(k);
  if (o.small_at_ends) {
    order = small_at_ends_order(best.workloads);
  } else {
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return best.workloads[a] > best.workloads[b]; });
  }
  for (int64_t g : order) {
    plan.groups.push_group(best.groups.group(static_cast<size_t>(g)));
    plan.tokens.push_back(best.tokens[g]);
    plan.workloads.push_back(best.workloads[g]);
  }
  plan.method = best.method;
  return plan;
}

}  // namespace seqpack
