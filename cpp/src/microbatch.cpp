#include "seqpack/microbatch.hpp"

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <optional>
#include <string>

#include "seqpack/packing.hpp"
#include "seqpack/partition.hpp"
#include "seqpack/capped_partition.hpp"

namespace seqpack {

std::vector<int64_t> sequence_workloads(Lengths lengths, int64_t attention_coeff) {
  const char* fn = "sequence_workloads";
  check_non_negative_lengths(fn, "lengths", lengths);
  std::vector<int64_t> w(lengths.size());
  for (size_t i = 0; i < lengths.size(); ++i) {
    const int64_t s = lengths[i];
    w[i] = attention_coeff > 0 ? checked_add(fn, "a workload (attention_coeff * s + s * s)",
                                             checked_mul(fn, "attention_coeff * s", attention_coeff, s),
                                             checked_mul(fn, "s * s", s, s))
                               : s;
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

// Sums cannot overflow: plan_micro_batches checked the totals of both.
Candidate evaluate(IndexGroups groups, Lengths lengths, Lengths workloads, const char* method) {
  constexpr const char* fn = "plan_micro_batches";
  Candidate c;
  c.tokens = group_sums(groups, lengths, fn, "a micro-batch's tokens");
  c.workloads = group_sums(groups, workloads, fn, "a micro-batch's workload");
  c.max_tokens = c.tokens.empty() ? 0 : *std::max_element(c.tokens.begin(), c.tokens.end());
  c.max_workload = c.workloads.empty() ? 0 : *std::max_element(c.workloads.begin(), c.workloads.end());
  c.groups = std::move(groups);
  c.method = method;
  return c;
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
  const int64_t total = checked_sum(fn, "lengths", lengths);
  if (!o.workloads.empty() && o.workloads.size() != lengths.size())
    throw_invalid(fn, "workloads: must hold one entry per length (" + std::to_string(lengths.size()) + "), got " +
                          std::to_string(o.workloads.size()));
  if (!o.workloads.empty()) check_non_negative_lengths(fn, "workloads", o.workloads);
  const std::vector<int64_t> work_vec =
      o.workloads.empty() ? sequence_workloads(lengths, o.attention_coeff) : std::vector<int64_t>{};
  const Lengths work = o.workloads.empty() ? Lengths(work_vec) : o.workloads;
  // Every group's workload then fits too (and the partitioners' own checks, which
  // would name themselves, cannot fail).
  const int64_t total_work = checked_sum(fn, "workloads (attention_coeff * s + s * s)", work);
  plan.lower_bound = std::max(o.min_num, ceil_div(total, o.max_tokens));
  const int64_t first = round_up(fn, plan.lower_bound, o.multiple_of);
  if (first > n)
    throw_invalid(fn, "need at least " + std::to_string(first) + " micro-batches (min_num=" +
                          std::to_string(o.min_num) + ", multiple_of=" + std::to_string(o.multiple_of) +
                          ", ceil(total/max_tokens)=" + std::to_string(ceil_div(total, o.max_tokens)) +
                          ") but there are only " + std::to_string(n) + " sequences");
  if (first == 1 && total <= o.max_tokens) {  // one micro-batch holds them all
    std::vector<int64_t> all(lengths.size());
    std::iota(all.begin(), all.end(), 0);
    plan.groups.push_group(all);
    plan.tokens.push_back(total);
    plan.workloads.push_back(total_work);
    plan.method = "karmarkar_karp";  // what KK returns for k = 1
    return plan;
  }
  // First-fit-decreasing on tokens always respects the cap: any k between its bin
  // count and n is feasible by splitting bins (adjust_bin_count), which bounds
  // the search.
  const IndexGroups ffd = first_fit_decreasing(lengths, o.max_tokens);
  const int64_t feasible = round_up(fn, std::max<int64_t>(static_cast<int64_t>(ffd.size()), first), o.multiple_of);
  const int64_t last = std::min(feasible, n - n % o.multiple_of);
  if (last < first)
    throw_invalid(fn, "no micro-batch count that is a multiple of multiple_of=" + std::to_string(o.multiple_of) +
                          " and at most the " + std::to_string(n) +
                          " sequences keeps every micro-batch <= max_tokens=" + std::to_string(o.max_tokens));
  // A count k is tried with Karmarkar-Karp and LPT on the workload (verl's and
  // ROLL's planners; up to kExactLimit sequences), keeping the better one that
  // fits the cap, else with the cap-aware greedy. A few O(n log n) tries find the
  // count (below), instead of one try per count.
  constexpr int64_t kExactLimit = 65536;
  std::vector<double> work_d(work.begin(), work.end());
  auto attempt = [&](int64_t k) -> std::optional<Candidate> {
    std::optional<Candidate> found;
    if (n <= kExactLimit) {
      for (int method = 0; method < 2; ++method) {
        Candidate c = method == 0 ? evaluate(karmarkar_karp(work, k, false, true), lengths, work, "karmarkar_karp")
                                  : evaluate(greedy_lpt_partition(work, k, false), lengths, work, "greedy_lpt");
        if (c.max_tokens > o.max_tokens) continue;
        if (!found || c.max_workload < found->max_workload) found = std::move(c);
      }
    }
    if (!found) {
      if (auto groups = capped_greedy_partition(lengths, work_d, k, o.max_tokens))
        found = evaluate(std::move(*groups), lengths, work, "capped_greedy");
    }
    return found;
  };
  // Sequences above half the cap cannot share a micro-batch: no count below
  // theirs can work.
  int64_t big = 0;
  for (int64_t s : lengths) big += s > o.max_tokens / 2 ? 1 : 0;  // 2s > cap, without overflow
  const int64_t start = round_up(fn, std::max(first, big), o.multiple_of);
  // The smallest count tried first (usually it works); else the largest, and if
  // that works, bisection between them for the smallest that does.
  std::optional<Candidate> best;
  if (start <= last) best = attempt(start);
  if (!best && start < last) {
    if ((best = attempt(last))) {
      int64_t failed = start, works = last;
      while (works - failed > o.multiple_of) {
        const int64_t mid = failed + (works - failed) / o.multiple_of / 2 * o.multiple_of;
        if (auto c = attempt(mid)) {
          best = std::move(c);
          works = mid;
        } else {
          failed = mid;
        }
      }
    }
  }
  if (!best && last >= static_cast<int64_t>(ffd.size())) {
    // First-fit-decreasing's bins fit by construction: split to `last`, then
    // rebalanced on the workload without crossing the cap.
    best = evaluate(rebalance_under_cap(adjust_bin_count(ffd, last, 1), lengths, work_d, o.max_tokens), lengths, work,
                    "first_fit_decreasing");
  }
  if (!best)
    throw_invalid(fn, "no plan with every micro-batch <= max_tokens=" + std::to_string(o.max_tokens) +
                          " and a count that is a multiple of " + std::to_string(o.multiple_of) +
                          " up to " + std::to_string(n) + " sequences");
  // Order: heaviest first, or lightest at both ends.
  const size_t k = best->groups.size();
  std::vector<int64_t> order(k);
  if (o.small_at_ends) {
    order = small_at_ends_order(best->workloads);
  } else {
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return best->workloads[a] > best->workloads[b]; });
  }
  for (int64_t g : order) {
    plan.groups.push_group(best->groups.group(static_cast<size_t>(g)));
    plan.tokens.push_back(best->tokens[g]);
    plan.workloads.push_back(best->workloads[g]);
  }
  plan.method = best->method;
  return plan;
}

}  // namespace seqpack
