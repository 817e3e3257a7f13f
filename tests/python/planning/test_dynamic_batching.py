"""seqpack.dynamic_batching: NeMo-RL / ROLL greedy plans and the optimal plan."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import seqpack
from seqpack import plan_dynamic_batching
from seqpack import reference as ref

from conftest import round_up

ROLL_DOC = [7, 6, 8, 5, 1, 3, 8, 6]


def test_spec_example_nemo_rl():
    plan = plan_dynamic_batching(
        (2, 8, 4, 16, 28, 32, 2, 32), shards=2, max_tokens_per_microbatch=32, sequence_length_round=4, max_seqlen=128
    )
    assert plan.sorted_indices == [0, 2, 3, 5, 6, 1, 4, 7]
    assert plan.micro_batch_indices == [[[0, 2], [2, 3], [3, 4]]]
    assert plan.micro_batch_lengths == [[8, 28, 32]]
    assert plan.shard_chunk_size == 4 and plan.num_micro_batches == 3
    assert plan.padded_tokens == 2 * (2 * 8 + 28 + 32) and plan.valid_tokens == 124


# ROLL's documentation walks through [7, 6, 8, 5, 1, 3, 8, 6] on 2 DP ranks with
# sequence_length_round 2 and quotes 56 actual tokens. With a cap of 10 every
# micro-batch holds one row (2 rows would need 2 * 6 = 12 > 10 tokens) and the plan
# computes 52 tokens; the doc's 56 needs a cap of 12, where rows 0-1 (padded to 6)
# share a micro-batch.
def test_roll_doc_example_cap_10():
    plan = plan_dynamic_batching(ROLL_DOC, 2, 10, 2, rule="roll")
    assert plan.sorted_indices == [4, 3, 7, 2, 5, 1, 0, 6]
    assert plan.micro_batch_indices == [[[0, 1], [1, 2], [2, 3], [3, 4]]]
    assert plan.micro_batch_lengths == [[4, 6, 8, 8]]
    assert plan.padded_tokens == 52 == 2 * (4 + 6 + 8 + 8)


def test_roll_doc_example_cap_12():
    plan = plan_dynamic_batching(ROLL_DOC, 2, 12, 2, rule="roll")
    assert plan.micro_batch_indices == [[[0, 2], [2, 3], [3, 4]]]
    assert plan.micro_batch_lengths == [[6, 8, 8]]
    assert plan.padded_tokens == 56  # the ROLL doc's number
    assert plan.valid_tokens == sum(ROLL_DOC) == 44


def test_roll_doc_example_cap_12_with_vpp_split():
    plan = plan_dynamic_batching(ROLL_DOC, 2, 12, 2, rule="roll", pp_size=2)
    assert plan.micro_batch_lengths == [[6, 6, 8, 8]]
    assert plan.micro_batch_indices == [[[0, 1], [1, 2], [2, 3], [3, 4]]]
    assert plan.padded_tokens == 56


def test_roll_rejects_cap_below_round():
    # ROLL seeds each micro-batch's running maximum with sequence_length_round.
    with pytest.raises(ValueError, match="sequence_length_round"):
        plan_dynamic_batching([0, 0], 1, 4, 8, rule="roll")
    assert plan_dynamic_batching([0, 0], 1, 4, 8, rule="nemo_rl").padded_tokens == 0


def test_roll_doc_example_metrics():
    plan = plan_dynamic_batching(ROLL_DOC, 2, 10, 2, rule="roll")
    metrics = plan.metrics(width=10)
    assert metrics == {
        "dynamic_batching/valid_tokens": 44,
        "dynamic_batching/actual_tokens_origin": 80,
        "dynamic_batching/actual_tokens": 52,
        "dynamic_batching/removed_padding_tokens": 28,
        "dynamic_batching/removed_padding_ratio": pytest.approx(0.35),
    }


# ---------------------------------------------------------------- hypothesis


@st.composite
def db_case(draw, max_rows_per_shard: int = 12, rows_multiple: int = 1):
    """(lengths, shards, batch_size or None, cap, round); rows per shard per chunk
    are a multiple of rows_multiple."""
    shards = draw(st.integers(1, 4))
    per_shard = rows_multiple * draw(st.integers(1, max_rows_per_shard))
    chunks = draw(st.integers(1, 3))
    chunk = shards * per_shard
    batch_size = draw(st.sampled_from([chunk, None])) if chunks == 1 else chunk
    round_to = draw(st.sampled_from([1, 2, 4, 8, 16]))
    max_len = draw(st.sampled_from([8, 64, 256]))
    lo = draw(st.integers(0, max_len))
    lengths = draw(st.lists(st.integers(lo if draw(st.booleans()) else 0, max_len), min_size=chunks * chunk, max_size=chunks * chunk))
    cap = draw(st.integers(max(round_up(max(lengths), round_to), round_to), 8 * max_len))
    return lengths, shards, batch_size, cap, round_to


def plan_rows(plan, lengths, round_to, chunk_index):
    """Per-position maximum over shards of one chunk, rounded up."""
    per_chunk = plan.shard_chunk_size * plan.shards
    base = chunk_index * per_chunk
    rows = []
    for j in range(plan.shard_chunk_size):
        m = max(lengths[plan.sorted_indices[base + s * plan.shard_chunk_size + j]] for s in range(plan.shards))
        rows.append(round_up(m, round_to))
    return rows


def check_plan(plan, lengths, round_to, cap, exact_lengths):
    n = len(lengths)
    assert sorted(plan.sorted_indices) == list(range(n))
    assert plan.valid_tokens == sum(lengths)
    total = 0
    for c, (ranges, lens) in enumerate(zip(plan.micro_batch_indices, plan.micro_batch_lengths)):
        rows = plan_rows(plan, lengths, round_to, c)
        assert len(ranges) == len(lens) >= 1
        assert ranges[0][0] == 0 and ranges[-1][1] == plan.shard_chunk_size
        for (s, e), (s2, _) in zip(ranges, ranges[1:]):
            assert e == s2
        for (s, e), length in zip(ranges, lens):
            assert e > s
            assert (e - s) * length <= cap
            assert length >= max(rows[s:e])
            if exact_lengths:
                assert length == max(rows[s:e])
            total += (e - s) * length * plan.shards
    assert plan.padded_tokens == total
    # The shards' rows partition all indices.
    assert sorted(i for s in range(plan.shards) for i in plan.shard_indices(s)) == list(range(n))


@settings(max_examples=200)
@given(case=db_case(), clamp=st.booleans())
def test_nemo_rl_matches_reference(case, clamp):
    lengths, shards, batch_size, cap, round_to = case
    max_seqlen = (max(lengths) or 1) if clamp else None
    plan = plan_dynamic_batching(
        np.asarray(lengths), shards, cap, round_to, rule="nemo_rl", batch_size=batch_size, max_seqlen=max_seqlen
    )
    expected = ref.dynamic_batching(lengths, shards, cap, round_to, batch_size=batch_size, max_seqlen=max_seqlen)
    assert (plan.sorted_indices, plan.micro_batch_indices, plan.micro_batch_lengths) == expected
    if not clamp:
        check_plan(plan, lengths, round_to, cap, exact_lengths=True)


@settings(max_examples=200)
@given(case=db_case())
def test_roll_matches_reference(case):
    lengths, shards, batch_size, cap, round_to = case
    plan = plan_dynamic_batching(lengths, shards, cap, round_to, rule="roll", batch_size=batch_size)
    expected = ref.dynamic_batching(lengths, shards, cap, round_to, batch_size=batch_size, initial_max=round_to)
    assert (plan.sorted_indices, plan.micro_batch_indices, plan.micro_batch_lengths) == expected
    check_plan(plan, lengths, round_to, cap, exact_lengths=False)


@settings(max_examples=200)
@given(case=db_case())
def test_optimal_beats_greedy_rules(case):
    lengths, shards, batch_size, cap, round_to = case
    args = (lengths, shards, cap, round_to)
    optimal = plan_dynamic_batching(*args, rule="optimal", batch_size=batch_size)
    nemo = plan_dynamic_batching(*args, rule="nemo_rl", batch_size=batch_size)
    roll = plan_dynamic_batching(*args, rule="roll", batch_size=batch_size)
    assert optimal.padded_tokens <= nemo.padded_tokens
    assert optimal.padded_tokens <= roll.padded_tokens
    assert optimal.sorted_indices == nemo.sorted_indices == roll.sorted_indices
    check_plan(optimal, lengths, round_to, cap, exact_lengths=True)


@settings(max_examples=150)
@given(data=st.data(), pp_size=st.integers(2, 4))
def test_optimal_with_pp_size(data, pp_size):
    # Rows per shard a multiple of pp_size, so single-row micro-batches always work.
    lengths, shards, batch_size, cap, round_to = data.draw(db_case(max_rows_per_shard=4, rows_multiple=pp_size))
    plan = plan_dynamic_batching(lengths, shards, cap, round_to, rule="optimal", batch_size=batch_size, pp_size=pp_size)
    for ranges in plan.micro_batch_indices:
        assert len(ranges) % pp_size == 0
    check_plan(plan, lengths, round_to, cap, exact_lengths=True)
    unconstrained = plan_dynamic_batching(lengths, shards, cap, round_to, rule="optimal", batch_size=batch_size)
    assert plan.padded_tokens >= unconstrained.padded_tokens
    try:
        roll = plan_dynamic_batching(lengths, shards, cap, round_to, rule="roll", batch_size=batch_size, pp_size=pp_size)
    except ValueError:
        return
    for ranges in roll.micro_batch_indices:
        assert len(ranges) % pp_size == 0
    check_plan(roll, lengths, round_to, cap, exact_lengths=False)
    assert plan.padded_tokens <= roll.padded_tokens


@given(case=db_case(), rule=st.sampled_from(["nemo_rl", "roll", "optimal"]), width_extra=st.integers(0, 64))
def test_metrics(case, rule, width_extra):
    lengths, shards, batch_size, cap, round_to = case
    plan = plan_dynamic_batching(lengths, shards, cap, round_to, rule=rule, batch_size=batch_size)
    width = max(round_up(max(lengths), round_to), 1) + width_extra
    n = len(lengths)
    metrics = plan.metrics(width)
    assert metrics == seqpack.dynamic_batching_metrics(plan.valid_tokens, plan.padded_tokens, n, width)
    assert metrics["dynamic_batching/valid_tokens"] == sum(lengths)
    assert metrics["dynamic_batching/actual_tokens"] == plan.padded_tokens
    assert metrics["dynamic_batching/actual_tokens_origin"] == n * width
    assert metrics["dynamic_batching/removed_padding_tokens"] == n * width - plan.padded_tokens
    assert metrics["dynamic_batching/removed_padding_ratio"] == pytest.approx(1 - plan.padded_tokens / (n * width))
    prefixed = plan.metrics(width, log_prefix="train")
    assert prefixed == {k.replace("dynamic_batching/", "dynamic_batching/train/"): v for k, v in metrics.items()}


def test_shard_indices():
    plan = plan_dynamic_batching([2, 8, 4, 16, 28, 32, 2, 32], 2, 32, 4, batch_size=4)
    assert sorted(plan.shard_indices(0) + plan.shard_indices(1)) == list(range(8))
    # Chunk by chunk: each chunk's rows are dealt to the shards in sorted order.
    # chunk 0 sorted: 0, 2, 1, 3; chunk 1 sorted: 6, 4, 5, 7 (stable on the 32s).
    assert plan.shard_indices(0) == [0, 1, 6, 5]
    assert plan.shard_indices(1) == [2, 3, 4, 7]
    with pytest.raises(ValueError, match="shard"):
        plan.shard_indices(2)


# ---------------------------------------------------------------- errors


def test_errors():
    with pytest.raises(ValueError, match="rule"):
        plan_dynamic_batching(ROLL_DOC, 2, 12, 2, rule="verl")
    with pytest.raises(ValueError, match="batch_size"):
        plan_dynamic_batching(ROLL_DOC, 2, 12, 2, batch_size=3)  # 8 % 3 != 0
    with pytest.raises(ValueError, match="shards"):
        plan_dynamic_batching(ROLL_DOC, 3, 12, 2)  # 8 % 3 != 0
    with pytest.raises(ValueError, match="shards"):
        plan_dynamic_batching(ROLL_DOC, 4, 12, 2, batch_size=2)
    for rule in ("nemo_rl", "roll", "optimal"):
        with pytest.raises(ValueError, match="max_tokens_per_microbatch"):
            plan_dynamic_batching(ROLL_DOC, 2, 7, 2, rule=rule)  # 8 padded to 8 > 7
    with pytest.raises(ValueError, match="pp_size"):
        plan_dynamic_batching(ROLL_DOC, 2, 12, 2, rule="roll", pp_size=8)  # 4 rows per shard
    with pytest.raises(ValueError, match="pp_size"):
        plan_dynamic_batching(ROLL_DOC, 2, 12, 2, rule="optimal", pp_size=8)
    with pytest.raises(ValueError):
        plan_dynamic_batching(ROLL_DOC, 0, 12, 2)
    with pytest.raises(ValueError, match="negative"):
        plan_dynamic_batching([1, -1], 1, 12, 2)
    with pytest.raises(TypeError):
        plan_dynamic_batching([1.0, 2.0], 1, 12, 2)
