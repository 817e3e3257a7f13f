"""plan_step: the guarantees as properties, the bound against brute force, the
framework pipelines it must not lose to, and errors."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import seqpack
from seqpack.planning.cost import CostModel
from seqpack.planning.step import StepPlan, plan_step
from seqpack.testing.pipelines import DISTRIBUTIONS, seqpack_two_step_pipeline, simulate

costs = st.sampled_from([CostModel.tokens(), CostModel.verl(), CostModel(50.0, 1.0, 0.0), CostModel(3.0, 0.5, 0.01),
                         CostModel(1.0, 0.0, 0.0), CostModel(0.0, 0.0, 1.0)])


def recomputed_time(plan: StepPlan) -> float:
    total = 0.0
    for mb in plan.costs:
        if plan.sync == "micro_batch":
            total += sum(max(rank[k] for rank in mb) for k in range(len(mb[0])))
        else:
            total += max(sum(rank) for rank in mb)
    return total


def check_guarantees(plan: StepPlan, lengths, dp_size, cap, cost, mini_batches, min_mb, multiple_of):
    n = len(lengths)
    assert len(plan.assignment) == mini_batches
    assert plan.mini_batch_ranges == [(int(a[0]), int(a[-1]) + 1) for a in np.array_split(np.arange(n), mini_batches)]
    seen = []
    for m, (mb, (begin, end)) in enumerate(zip(plan.assignment, plan.mini_batch_ranges)):
        k = plan.num_micro_batches[m]
        assert len(mb) == dp_size and all(len(rank) == k for rank in mb)  # equal counts: no agreement needed
        assert k >= min_mb and k % multiple_of == 0
        for r, rank in enumerate(mb):
            for j, cell in enumerate(rank):
                assert cell == sorted(cell) and all(begin <= i < end for i in cell)
                tokens = sum(lengths[i] for i in cell)
                assert tokens <= cap and plan.tokens[m][r][j] == tokens
                assert plan.costs[m][r][j] == pytest.approx(cost(cell and [lengths[i] for i in cell]), rel=1e-9)
                seen.extend(cell)
        # dummies only where needed
        if plan.sync == "micro_batch":
            if any(not cell for rank in mb for cell in rank):
                assert end - begin < dp_size * k
        else:
            for rank in mb:
                if any(not cell for cell in rank):
                    assert all(len(cell) <= 1 for cell in rank)
    assert sorted(seen) == list(range(n))  # every index exactly once
    assert plan.predicted_time == pytest.approx(recomputed_time(plan), rel=1e-9)
    assert plan.lower_bound <= plan.predicted_time * (1 + 1e-9)


@settings(max_examples=300, deadline=None)
@given(st.data(), st.integers(1, 5), st.integers(1, 400), costs, st.sampled_from(["micro_batch", "step"]),
       st.integers(1, 3), st.integers(1, 3), st.integers(1, 3), st.none() | st.integers(0, 2**64 - 1))
def test_guarantees(data, dp_size, cap, cost, sync, mini_batches, min_mb, multiple_of, seed):
    lengths = data.draw(st.lists(st.integers(0, cap), min_size=mini_batches, max_size=60))
    plan = plan_step(lengths, dp_size, cap, cost=cost, sync=sync, mini_batches=mini_batches,
                     min_micro_batches=min_mb, multiple_of=multiple_of, seed=seed)
    check_guarantees(plan, lengths, dp_size, cap, cost, mini_batches, min_mb, multiple_of)
    again = plan_step(np.asarray(lengths), dp_size, cap, cost=cost, sync=sync, mini_batches=mini_batches,
                      min_micro_batches=min_mb, multiple_of=multiple_of, seed=seed)
    assert again == plan  # deterministic for a seed, whatever container the lengths come in


def brute_force(lengths, dp_size, cap, cost, sync):
    """The optimum over every assignment of sequences to (rank, micro-batch) cells,
    for every count from the token bound up to one sequence per cell."""
    n = len(lengths)
    k_min = max(1, math.ceil(math.ceil(sum(lengths) / cap) / dp_size))
    best = math.inf
    for k in range(k_min, max(k_min, math.ceil(n / dp_size)) + 1):
        cells = dp_size * k
        for labels in itertools.product(range(cells), repeat=n):
            groups = [[] for _ in range(cells)]
            for i, c in enumerate(labels):
                groups[c].append(lengths[i])
            if any(sum(g) > cap for g in groups):
                continue
            c = [cost(g) for g in groups]
            if sync == "micro_batch":
                t = sum(max(c[r * k + j] for r in range(dp_size)) for j in range(k))
            else:
                t = max(sum(c[r * k:(r + 1) * k]) for r in range(dp_size))
            best = min(best, t)
    return best


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=6), st.integers(1, 2), st.integers(12, 20),
       st.sampled_from([CostModel.tokens(), CostModel(0.0, 1.0, 0.5), CostModel(4.0, 1.0, 0.1)]),
       st.sampled_from(["micro_batch", "step"]))
def test_bound_and_heuristic_against_the_exact_optimum(lengths, dp_size, cap, cost, sync):
    assume(len(lengths) <= 4 or dp_size == 1)
    plan = plan_step(lengths, dp_size, cap, cost=cost, sync=sync)
    optimum = brute_force(lengths, dp_size, cap, cost, sync)
    assert plan.lower_bound <= optimum * (1 + 1e-9)  # the bound is a bound
    assert optimum <= plan.predicted_time * (1 + 1e-9)
    assert plan.predicted_time <= 1.5 * optimum


def test_bound_counts_the_sequences_that_cannot_share_a_step():
    # Two sequences above half the cap on two ranks: one step holds both, the rest
    # of the work fills the other ranks; the bound sees the floor, not just W / R.
    lengths, cost = [900, 800, 100, 100, 100, 100], CostModel(0, 0, 1)
    plan = plan_step(lengths, dp_size=2, max_tokens=1000, cost=cost)
    assert sum(s * s for s in lengths) / 2 < 900**2 <= plan.lower_bound
    assert plan.predicted_time == brute_force(lengths, 2, 1000, cost, "micro_batch") == 900**2 + 100**2


def test_docstring_example_and_top_level_names():
    plan = seqpack.plan_step([3000, 500, 500, 2500, 1000, 400], dp_size=2, max_tokens=4000)
    assert isinstance(plan, seqpack.StepPlan)
    assert plan.rank(1) == [plan.assignment[0][1]]
    assert plan.metrics["gap"] == plan.gap >= 1
    assert "StepPlan" in plan._repr_html_()


def test_valid_tokens_is_the_global_normaliser_per_mini_batch():
    lengths = [10, 20, 30, 40, 50]
    plan = plan_step(lengths, 2, 100, mini_batches=2)
    assert plan.mini_batch_ranges == [(0, 3), (3, 5)]
    assert plan.valid_tokens([1, 2, 3, 4, 5]) == [6, 9]
    with pytest.raises(ValueError, match="mask_lengths has 2 entries"):
        plan.valid_tokens([1, 2])
    with pytest.raises(ValueError, match="mask_lengths must be >= 0"):
        plan.valid_tokens([1, 2, -3, 4, 5])


@pytest.mark.parametrize("sync", ["micro_batch", "step"])
@pytest.mark.parametrize("dist_name", ["rl_long_tail", "trl_6092", "reasoning_tail", "sft"])
def test_never_worse_than_the_two_step_pipeline_from_seqpacks_parts(dist_name, sync):
    cost = CostModel.verl()
    for dp_size, cap in [(4, 8192), (8, 16384)]:
        lengths = DISTRIBUTIONS[dist_name](64 * dp_size, seed=1, max_len=cap)
        plan = plan_step(lengths, dp_size, cap, cost=cost, sync=sync, mini_batches=2)
        two_step = simulate(seqpack_two_step_pipeline(lengths, dp_size, cap, mini_batches=2, cost=cost), lengths,
                            cost, sync=sync, max_tokens=cap)
        assert plan.predicted_time <= two_step["time"] * (1 + 1e-9)
        assert plan.gap <= 1.03


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(lengths=[5, 11], max_tokens=10), ValueError, r"lengths\[1\].*max_tokens"),
    (dict(lengths=[5, -1]), ValueError, "lengths"),
    (dict(dp_size=0), ValueError, "dp_size"),
    (dict(max_tokens=0), ValueError, "max_tokens"),
    (dict(mini_batches=3), ValueError, "mini_batches=3"),
    (dict(min_micro_batches=0), ValueError, "min_micro_batches"),
    (dict(min_micro_batches=2**40), ValueError, "min_micro_batches"),
    (dict(multiple_of=0), ValueError, "multiple_of"),
    (dict(sync="fsdp"), ValueError, "sync must be"),
    (dict(cost="tokens"), TypeError, "CostModel"),
    (dict(seed=-1), ValueError, "seed"),
    (dict(lengths=[2**62, 2**62], max_tokens=2**62), ValueError, "overflow"),
])
def test_errors_name_the_argument(kwargs, error, match):
    args = dict(lengths=[5, 3], dp_size=2, max_tokens=10)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        plan_step(args.pop("lengths"), args.pop("dp_size"), args.pop("max_tokens"), **args)


def test_valid_tokens_refuses_counts_above_their_lengths_and_never_wraps():
    # Issue 26: counts were not checked against the lengths and summed in int64, so
    # [2^63 - 1, 2^63 - 1] gave [-2] and uint64 counts above 2^63 wrapped too.
    plan = plan_step([1, 4, 4], 2, 8)
    assert plan.lengths.tolist() == [1, 4, 4] and plan.valid_tokens([1, 4, 0]) == [5]
    with pytest.raises(ValueError, match=r"mask_lengths\[0\] = 9223372036854775807 exceeds the length of sequence 0 "
                                         r"\(1\)"):
        plan.valid_tokens([2**63 - 1, 2**63 - 1, 0])
    with pytest.raises(ValueError, match=r"mask_lengths\[2\] = 5 exceeds the length of sequence 2 \(4\)"):
        plan.valid_tokens(np.array([1, 4, 5], dtype=np.uint8))
    with pytest.raises(ValueError, match=r"mask_lengths\[1\] = 18446744073709551615 exceeds"):
        plan.valid_tokens(np.array([0, 2**64 - 1, 0], dtype=np.uint64))
    with pytest.raises(ValueError, match=r"mask_lengths must be >= 0, got mask_lengths\[1\] = -3"):
        plan.valid_tokens([1, -3, 0])
    # A plan built by hand, without its lengths: exact sums, past int64 too.
    bare = dataclasses.replace(plan, lengths=None)
    assert bare.valid_tokens([2**63 - 1, 2**63 - 1, 3]) == [2**64 + 1]


@pytest.mark.parametrize("cost, cap, match", [
    (CostModel(0.0, 1e300, 0.0), 2**40, r"per_token = 1e\+300 x Σs is inf"),
    (CostModel(0.0, 0.0, 1e290), 2**40, r"per_token_squared = 1e\+290 x Σs² is inf"),
    (CostModel(1.7e308, 1e306, 0.0), 100, r"its terms are finite but their sum is not"),
])
def test_a_cost_overflowing_float64_names_the_coefficient(cost, cap, match):
    # Issue 26: finite coefficients whose products overflow gave predicted_time = inf
    # and gap = inf / inf = nan.
    with pytest.raises(ValueError, match=r"^the cost of a micro-batch of max_tokens = \d+ tokens overflows float64: "
                                         + match):
        plan_step([100] * 4, 2, cap, cost=cost)


def test_a_step_time_overflowing_float64_names_the_coefficient():
    # Each micro-batch costs 1e307, the step's 100 of them do not fit a float64.
    for sync in ("micro_batch", "step"):
        with pytest.raises(ValueError, match=r"predicted step time overflows float64: cost.per_token = 1e\+305"):
            plan_step([100] * 100, 1, 100, cost=CostModel(0.0, 1e305, 0.0), sync=sync)
    plan = plan_step([100] * 100, 1, 100, cost=CostModel(0.0, 1e300, 0.0))
    assert math.isfinite(plan.predicted_time) and plan.gap == plan.gap


def test_large_lengths_with_an_attention_cost_still_plan():
    # The two-step candidate balanced int64 workloads c1/c2·s + s², which overflowed
    # for valid inputs ("[seqpack.sequence_workloads] product overflows int64").
    for lengths, cost in [([2**32] * 4, CostModel(0.0, 1.0, 1.0)), ([10**4] * 4, CostModel(0.0, 1.0, 1e-15))]:
        plan = plan_step(lengths, 2, 2 * lengths[0], cost=cost)
        assert sorted(i for mb in plan.assignment for rank in mb for cell in rank for i in cell) == [0, 1, 2, 3]
        assert plan.lower_bound <= plan.predicted_time < math.inf
