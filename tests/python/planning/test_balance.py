"""seqpack.balance: k-way partitioning (verl's Karmarkar-Karp, LPT, stride) and
micro-batch planning under a hard token cap."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import seqpack
from seqpack import reference as ref

from conftest import assert_index_partition, group_sums, lengths_strategy, round_up, spread

PARTITIONERS = {
    "karmarkar_karp": lambda v, k, eq: seqpack.karmarkar_karp(v, k, eq),
    "get_seqlen_balanced_partitions": lambda v, k, eq: seqpack.get_seqlen_balanced_partitions(v, k, eq),
    "greedy_lpt_partition": lambda v, k, eq: seqpack.greedy_lpt_partition(v, k, eq),
    "sorted_stride_partition": lambda v, k, eq: seqpack.sorted_stride_partition(v, k),
}


@st.composite
def partition_case(draw, equal_size: bool, max_size: int = 40, max_value: int = 10_000):
    """(values, k) with 1 <= k <= n; with equal_size, n % k == 0."""
    if equal_size:
        k = draw(st.integers(1, 8))
        per = draw(st.integers(1, max(1, max_size // k)))
        values = draw(lengths_strategy(max_value, min_value=0, min_size=k * per, max_size=k * per))
    else:
        values = draw(lengths_strategy(max_value, min_value=0, min_size=1, max_size=max_size))
        k = draw(st.integers(1, len(values)))
    return values, k


# ---------------------------------------------------------------- verl equality


@pytest.mark.parametrize("equal_size", [False, True])
@settings(max_examples=200)
@given(data=st.data())
def test_karmarkar_karp_matches_verl(equal_size, data):
    values, k = data.draw(partition_case(equal_size))
    got = seqpack.karmarkar_karp(values, k, equal_size)
    expected = ref.karmarkar_karp(values, k, equal_size)
    assert got == expected
    assert spread(got, values) == spread(expected, values)


@pytest.mark.parametrize("equal_size", [False, True])
@given(data=st.data())
def test_get_seqlen_balanced_partitions_matches_verl(equal_size, data):
    values, k = data.draw(partition_case(equal_size))
    got = seqpack.get_seqlen_balanced_partitions(np.asarray(values, dtype=np.int64), k, equal_size)
    assert got == ref.get_seqlen_balanced_partitions(values, k, equal_size)
    assert all(g == sorted(g) for g in got)


def test_lpt_zero_values_leave_no_group_empty():
    # Regression: ties between equal sums went to the lowest index, so zero-valued
    # items could pile into one group and leave another empty.
    assert seqpack.greedy_lpt_partition([0, 0], 2) == [[0], [1]]
    assert seqpack.greedy_lpt_partition([5, 0, 0], 3) == [[0], [1], [2]]
    assert seqpack.greedy_lpt_partition([5, 3, 8, 1, 9, 2], 2) == [[1, 4, 5], [0, 2, 3]]


def test_balanced_partitions_examples():
    assert seqpack.get_seqlen_balanced_partitions([5, 3, 8, 1, 9, 2], 2, equal_size=True) == [[1, 4, 5], [0, 2, 3]]
    assert seqpack.get_seqlen_balanced_partitions([1, 1, 9, 9], 2, equal_size=True) == [[0, 3], [1, 2]]
    assert seqpack.sorted_stride_partition([2, 8, 4, 16], 2) == [[0, 1], [2, 3]]


# ---------------------------------------------------------------- oracles for the simple rules


def lpt_oracle(values, k, equal_size):
    """Items by (value desc, index asc), each to the lightest group (ties: an empty
    group, then the lowest index); with equal_size a full group (n / k items)
    receives no more."""
    cap = len(values) // k if equal_size else len(values)
    groups, sums = [[] for _ in range(k)], [0] * k
    for i in sorted(range(len(values)), key=lambda i: (-values[i], i)):
        g = min((g for g in range(k) if len(groups[g]) < cap), key=lambda g: (sums[g], len(groups[g]) > 0, g))
        groups[g].append(i)
        sums[g] += values[i]
    return [sorted(g) for g in groups]


def stride_oracle(values, k):
    order = sorted(range(len(values)), key=lambda i: (values[i], i))
    return [order[g::k] for g in range(k)]


@pytest.mark.parametrize("equal_size", [False, True])
@given(data=st.data())
def test_greedy_lpt_matches_oracle(equal_size, data):
    values, k = data.draw(partition_case(equal_size))
    assert seqpack.greedy_lpt_partition(values, k, equal_size) == lpt_oracle(values, k, equal_size)


@given(data=st.data())
def test_sorted_stride_matches_oracle(data):
    values, k = data.draw(partition_case(False))
    assert seqpack.sorted_stride_partition(values, k) == stride_oracle(values, k)


# ---------------------------------------------------------------- invariants and errors


@pytest.mark.parametrize("name", list(PARTITIONERS))
@pytest.mark.parametrize("equal_size", [False, True])
@given(data=st.data())
def test_partition_invariants(name, equal_size, data):
    values, k = data.draw(partition_case(equal_size))
    groups = PARTITIONERS[name](values, k, equal_size)
    assert len(groups) == k
    assert_index_partition(groups, len(values))
    n = len(values)
    sizes = sorted(len(g) for g in groups)
    if equal_size and name != "sorted_stride_partition":
        assert sizes == [n // k] * k
    if name == "sorted_stride_partition":  # round-robin dealing: sizes differ by at most one
        assert sizes[-1] - sizes[0] <= 1


@pytest.mark.parametrize("name", list(PARTITIONERS))
def test_partition_errors(name):
    fn = PARTITIONERS[name]
    with pytest.raises(ValueError, match="k_partitions"):
        fn([1, 2, 3], 0, False)
    with pytest.raises(ValueError, match="k_partitions"):
        fn([1, 2], 3, False)
    with pytest.raises(ValueError, match="k_partitions"):
        fn([], 1, False)
    with pytest.raises(ValueError, match="negative"):
        fn([1, -2, 3, 4], 2, False)
    with pytest.raises(TypeError):
        fn([1.5, 2.0], 1, False)
    if name != "sorted_stride_partition":
        with pytest.raises(ValueError, match="multiple of k_partitions"):
            fn([1, 2, 3], 2, True)


# ---------------------------------------------------------------- DP balance metrics


def test_dp_balance_metrics_hand_example():
    expected = {"p/min": 2, "p/max": 18, "p/minmax_diff": 16, "p/balanced_min": 10, "p/balanced_max": 10, "p/mean": 10.0}
    assert seqpack.dp_balance_metrics([1, 1, 9, 9], [[0, 3], [1, 2]], prefix="p") == expected
    assert seqpack.log_seqlen_unbalance([1, 1, 9, 9], [[0, 3], [1, 2]], "p") == expected
    assert set(seqpack.dp_balance_metrics([1, 1, 9, 9], [[0, 3], [1, 2]])) == {
        f"global_seqlen/{k}" for k in ("min", "max", "minmax_diff", "balanced_min", "balanced_max", "mean")
    }


def test_dp_balance_metrics_uneven_split_like_verl():
    # verl steps through the list in chunks of n // k, so 7 items in 3 parts are
    # cut into [1, 2], [3, 4], [5, 6], [7]: sums 3, 7, 11, 7.
    stats = seqpack.log_seqlen_unbalance([1, 2, 3, 4, 5, 6, 7], [[0, 6], [1, 5], [2, 3, 4]], "x")
    assert stats == {
        "x/min": 3,
        "x/max": 11,
        "x/minmax_diff": 8,
        "x/balanced_min": 8,
        "x/balanced_max": 12,
        "x/mean": pytest.approx(28 / 3),
    }


# ---------------------------------------------------------------- plan_micro_batches

ROLL_EXAMPLE = [512, 1024, 256, 2048, 128, 768, 1536, 384, 896, 640]


def test_plan_micro_batches_roll_example():
    plan = seqpack.plan_micro_batches(ROLL_EXAMPLE, 4096)
    assert plan.num_micro_batches == len(plan) == 2
    assert plan.tokens == [4096, 4096]
    assert group_sums(plan.micro_batches, ROLL_EXAMPLE) == [4096, 4096]
    assert_index_partition(plan.micro_batches, len(ROLL_EXAMPLE))
    assert plan.lower_bound == 2 and plan.imbalance == 0.0
    assert list(plan) == plan.micro_batches


def ffd_bin_count(lengths, cap):
    return len(seqpack.get_packer("first_fit_decreasing", cap).pack(lengths))


@st.composite
def micro_batch_case(draw):
    cap = draw(st.sampled_from([64, 100, 1000, 4096]))
    lengths = draw(lengths_strategy(cap, min_value=0, min_size=1, max_size=50))
    return (
        lengths,
        cap,
        draw(st.integers(1, 6)),  # min_num
        draw(st.integers(1, 4)),  # multiple_of
        draw(st.sampled_from([None, 0, 1, 64, 4096])),  # attention_coeff
        draw(st.sampled_from(["heaviest_first", "small_at_ends"])),
    )


@settings(max_examples=200)
@given(case=micro_batch_case())
def test_plan_micro_batches_properties(case):
    lengths, cap, min_num, multiple_of, coeff, order = case
    n, total = len(lengths), sum(lengths)
    lower = max(min_num, math.ceil(total / cap))
    first = round_up(lower, multiple_of)
    kwargs = dict(min_num=min_num, multiple_of=multiple_of, attention_coeff=coeff, order=order)
    if first > n:
        with pytest.raises(ValueError, match="micro-batches"):
            seqpack.plan_micro_batches(lengths, cap, **kwargs)
        return
    try:
        plan = seqpack.plan_micro_batches(lengths, cap, **kwargs)
    except ValueError:
        # Only when even first-fit-decreasing's bins cannot be brought to an
        # admissible count (a multiple of multiple_of, at most n).
        assert ffd_bin_count(lengths, cap) > n - n % multiple_of
        return
    k = plan.num_micro_batches
    assert plan.lower_bound == lower
    assert k >= lower and k % multiple_of == 0 and k <= n
    assert_index_partition(plan.micro_batches, n)
    assert all(g == sorted(g) for g in plan.micro_batches)
    # The hard cap, from the reported tokens and recomputed from the indices.
    assert plan.tokens == group_sums(plan.micro_batches, lengths)
    assert max(plan.tokens) <= cap
    c = coeff or 0
    workloads = [c * s + s * s for s in lengths] if c > 0 else lengths
    assert plan.workloads == group_sums(plan.micro_batches, workloads)
    if order == "heaviest_first":
        assert plan.workloads == sorted(plan.workloads, reverse=True)
    elif k >= 2:
        assert sorted([plan.workloads[0], plan.workloads[-1]]) == sorted(plan.workloads)[:2]
    # The smallest admissible count: every smaller one breaks the cap under both
    # balancing partitioners.
    if plan.method != "first_fit_decreasing":
        for smaller in range(first, k, multiple_of):
            for part in (seqpack.karmarkar_karp(workloads, smaller, False), seqpack.greedy_lpt_partition(workloads, smaller)):
                assert max(group_sums(part, lengths)) > cap


def test_small_at_ends_order():
    lengths = [100, 90, 80, 70, 60, 50, 40, 30, 20, 10]
    plan = seqpack.plan_micro_batches(lengths, 100, min_num=6, order="small_at_ends")
    w = plan.workloads
    assert sorted([w[0], w[-1]]) == sorted(w)[:2]
    heavy = seqpack.plan_micro_batches(lengths, 100, min_num=6)
    assert sorted(heavy.workloads) == sorted(w) and heavy.workloads == sorted(w, reverse=True)


def test_attention_workloads():
    lengths = [100, 10, 50, 40]
    assert seqpack.sequence_workloads(lengths).tolist() == lengths
    assert seqpack.sequence_workloads(lengths, 8).tolist() == [8 * s + s * s for s in lengths]
    plan = seqpack.plan_micro_batches(lengths, 100, attention_coeff=8)
    assert plan.workloads == [sum(8 * lengths[i] + lengths[i] ** 2 for i in g) for g in plan.micro_batches]


def test_plan_micro_batches_errors():
    with pytest.raises(ValueError, match="max_tokens"):
        seqpack.plan_micro_batches([10, 200, 30], 100)
    with pytest.raises(ValueError, match="only 2 sequences"):
        seqpack.plan_micro_batches([10, 20], 100, min_num=3)
    with pytest.raises(ValueError, match="only 3 sequences"):
        seqpack.plan_micro_batches([10, 20, 30], 100, multiple_of=4)
    with pytest.raises(ValueError, match="order"):
        seqpack.plan_micro_batches([10, 20], 100, order="lightest_first")
    with pytest.raises(ValueError):
        seqpack.plan_micro_batches([10, 20], 0)
    with pytest.raises(ValueError, match="negative"):
        seqpack.plan_micro_batches([10, -20], 100)
    assert seqpack.plan_micro_batches([], 100).micro_batches == []


def test_naive_soft_cap_exceeds_but_planner_never_does():
    """verl / ROLL pick k = ceil(total / cap) and balance with Karmarkar-Karp; the cap
    is then only a target. plan_micro_batches treats it as a hard limit."""
    cap, naive_exceeded = 4096, 0
    for seed in range(200):
        rng = np.random.default_rng(seed)
        n = int(rng.integers(8, 64))
        lengths = np.minimum(rng.lognormal(6.5, 1.0, n).astype(np.int64) + 1, cap)
        k = min(n, max(1, math.ceil(int(lengths.sum()) / cap)))
        naive = seqpack.karmarkar_karp(lengths, k, False)
        naive_exceeded += max(group_sums(naive, lengths)) > cap
        plan = seqpack.plan_micro_batches(lengths, cap)
        assert max(group_sums(plan.micro_batches, lengths)) <= cap
        assert plan.num_micro_batches >= k
    assert naive_exceeded > 0
