"""seqpack.testing.pipelines: the RL frameworks' step plans (NeMo-RL, verl, ROLL,
slime, TRL AsyncGRPO, seqpack's two-step plan), the step-time simulator and the
length distributions of the benchmark."""

from __future__ import annotations

import doctest
import hashlib
import json
import math
import subprocess
import sys
import threading
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import seqpack.testing.pipelines as pipelines
from seqpack.planning.balance import plan_micro_batches
from seqpack.planning.cost import CostModel
from seqpack.planning.packing import get_packer
from seqpack.testing.pipelines import (DISTRIBUTIONS, PIPELINES, nemo_rl_pipeline, roll_pipeline,
                                       seqpack_two_step_pipeline, simulate, slime_pipeline,
                                       trl_async_grpo_pipeline, verl_pipeline)

VERL = CostModel.verl()
# Pipelines that never put more than max_tokens tokens in a micro-batch (ROLL's count
# is only ceil(tokens / cap), so its cap is soft, as verl's was before verl#7553).
HARD_CAP = {"nemo_rl", "verl", "slime", "trl_async_grpo", "seqpack_two_step"}


def chunks(n, mini_batches):
    return [c.tolist() for c in np.array_split(np.arange(n), mini_batches)]


def tokens(cell, lengths):
    return sum(int(lengths[i]) for i in cell)


def check_structure(assignment, n, dp, mini_batches):
    """Every index exactly once, in the mini-batch of its chunk; dp ranks per mini-batch."""
    assert len(assignment) == mini_batches
    seen = []
    for mini_batch, chunk in zip(assignment, chunks(n, mini_batches)):
        assert len(mini_batch) == dp
        flat = [i for rank in mini_batch for cell in rank for i in cell]
        assert sorted(flat) == chunk
        seen += flat
    assert sorted(seen) == list(range(n))


def first_fit_bins(lengths, cap):
    """Independent oracle: the number of bins of plain first fit in input order."""
    loads = []
    for s in lengths:
        for b, load in enumerate(loads):
            if load + s <= cap:
                loads[b] += s
                break
        else:
            loads.append(s)
    return len(loads)


@st.composite
def divisible_case(draw, max_len=64):
    """(lengths, dp, max_tokens, mini_batches) with every mini-batch a multiple of dp."""
    dp = draw(st.integers(1, 4))
    mini_batches = draw(st.integers(1, 3))
    per_rank = draw(st.integers(1, 6))
    n = dp * mini_batches * per_rank
    top = draw(st.sampled_from([4, max_len]))  # few values (ties) or many
    lengths = draw(st.lists(st.integers(1, top), min_size=n, max_size=n))
    max_tokens = draw(st.integers(max(lengths), 3 * max(lengths)))
    return lengths, dp, max_tokens, mini_batches


# --------------------------------------------------------------------------- every pipeline


@pytest.mark.parametrize("name", sorted(PIPELINES))
@settings(max_examples=30, deadline=None)
@given(case=divisible_case())
def test_every_index_once_equal_counts_and_the_count_rules(name, case):
    lengths, dp, cap, mbs = case
    assignment = PIPELINES[name](lengths, dp, cap, mini_batches=mbs)
    check_structure(assignment, len(lengths), dp, mbs)
    out = simulate(assignment, lengths, VERL, max_tokens=cap)
    # Every framework runs the same number of micro-batches on every rank.
    assert not out["unequal_counts"] and out["padded_cells"] == 0
    if name in HARD_CAP:
        assert out["cap_violations"] == 0 and out["max_cell_tokens"] <= cap
    soft_cap = verl_pipeline(lengths, dp, cap, mini_batches=mbs, soft_cap=True) if name == "verl" else None
    for m, (mini_batch, chunk) in enumerate(zip(assignment, chunks(len(lengths), mbs))):
        chunk_lengths = [lengths[i] for i in chunk]
        count = len(mini_batch[0])
        rank_tokens = [sum(tokens(cell, lengths) for cell in rank) for rank in mini_batch]
        rank_rows = [sum(len(cell) for cell in rank) for rank in mini_batch]
        cells = [cell for rank in mini_batch for cell in rank]
        if name in ("nemo_rl", "verl", "roll", "slime"):
            assert all(cells), "no dummy micro-batch"
        if name == "nemo_rl":  # MFFD bins, the count rounded up to a multiple of dp, dealt round-robin
            packer = get_packer("modified_first_fit_decreasing", cap, min_bin_count=dp, bin_count_multiple=dp)
            bins = packer.pack(chunk_lengths)
            assert count * dp == len(bins)
            assert [[chunk[0] + i for i in b] for b in bins[0::dp]] == mini_batch[0]
        elif name == "verl":  # equal rows per rank; count: from max over ranks of min(rows, ceil(tokens / cap)),
            assert set(rank_rows) == {len(chunk) // dp}  # grown only while KK's parts break the cap
            first = max(min(rows, math.ceil(t / cap)) for rows, t in zip(rank_rows, rank_tokens))
            soft = simulate([soft_cap[m]], lengths, VERL, max_tokens=cap)
            assert soft["num_micro_batches"] == [first]
            assert (count > first) == (soft["cap_violations"] > 0)
        elif name == "roll":  # the same on lengths padded to multiples of 16
            assert set(rank_rows) == {len(chunk) // dp}
            padded = [sum(-(-lengths[i] // 16) * 16 for cell in rank for i in cell) for rank in mini_batch]
            assert count == max(min(rows, math.ceil(t / cap)) for rows, t in zip(rank_rows, padded))
        elif name == "slime":  # first-fit bins, the count raised to a multiple of dp by splitting
            assert count * dp == max(math.ceil(first_fit_bins(chunk_lengths, cap) / dp) * dp, dp)
        elif name == "seqpack_two_step":  # the largest rank's own count, agreed by all
            own = [len(plan_micro_batches([lengths[i] for cell in rank for i in cell], cap)) for rank in mini_batch]
            assert count == max(own)
        elif name == "trl_async_grpo":  # every micro-batch but the flushed last one has all rows non-empty
            assert all(rank[k] for rank in mini_batch for k in range(count - 1))


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_mini_batches_are_planned_independently(name):
    lengths = pipelines.rl_long_tail(48, seed=3, max_len=4096).tolist()
    whole = PIPELINES[name](lengths, 4, 4096, mini_batches=3)
    for m, chunk in enumerate(chunks(len(lengths), 3)):
        alone = PIPELINES[name]([lengths[i] for i in chunk], 4, 4096)[0]
        assert whole[m] == [[[chunk[0] + i for i in cell] for cell in rank] for rank in alone]


@pytest.mark.parametrize("name", ["trl_async_grpo", "seqpack_two_step"])
@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 50), min_size=1, max_size=30), dp=st.integers(1, 5),
       mbs=st.integers(1, 3), extra=st.integers(0, 50))
def test_any_batch_size(name, lengths, dp, mbs, extra):
    """TRL and seqpack need no batch size divisible by dp (short ranks run dummy micro-batches)."""
    cap = max(lengths) + extra
    assignment = PIPELINES[name](lengths, dp, cap, mini_batches=mbs)
    check_structure(assignment, len(lengths), dp, mbs)
    out = simulate(assignment, lengths, VERL, max_tokens=cap)
    assert not out["unequal_counts"] and out["cap_violations"] == 0


def test_preconditions_raise():
    with pytest.raises(ValueError, match="max_tokens"):
        verl_pipeline([5, 9], 1, 8)
    for f in (nemo_rl_pipeline, verl_pipeline, roll_pipeline):
        with pytest.raises(ValueError, match="multiple of dp_size"):
            f([1, 2, 3], 2, 8)
    with pytest.raises(ValueError, match="dp_size"):
        slime_pipeline([1, 2, 3], 4, 8)
    with pytest.raises(ValueError, match="splitting"):  # 5 singleton bins cannot become 6
        slime_pipeline([8, 8, 8, 8, 8], 2, 8)
    with pytest.raises(ValueError, match="positive"):
        trl_async_grpo_pipeline([0, 3], 1, 8)


# --------------------------------------------------------------------------- verl, derived by hand


def test_verl_matches_a_hand_derivation():
    """verl, traced by hand through ray_trainer._balance_batch and
    seqlen_balancing.rearrange_micro_batches (workload w(s) = 24576·s + s²).

    lengths [6, 5, 4, 3, 2, 1], dp 2, max_token_len 6.
    _balance_batch: equal-size KK, pairs of ascending workloads
      {5,4} spread w2-w1 = 24579, {3,2} spread 24583, {1,0} spread 24587.
      Largest spread first: {1,0} merges {3,2}: sets {0,3} (221229) and {1,2} (221225).
      Then {5,4} (spread 24579 > 4) merges it: {4}+{1,2} = 270381, {5}+{0,3} = 245806.
      Rank 0 = [1, 2, 4], rank 1 = [0, 3, 5]; each sorted by workload and laid out
      p[::2] + p[1::2][::-1]: rank 0 [4, 1, 2] (lengths 2, 5, 4), rank 1 [5, 0, 3] (1, 6, 3).
    rearrange_micro_batches: counts ceil(11/6) = 2 and ceil(10/6) = 2, MAX = 2.
      Rank 0 KK on (w2, w5, w4): {w5} and {w4} merge to ({w5}, {w4}), spread 24585;
      then {w2} (spread 49156) merges it: {w2, w4} = 147476, {w5} = 122905:
      local [[0, 2], [1]] -> rows [[4, 2], [1]]; sorted by workload it stays, and
      mbs[::2][::-1] + mbs[1::2] keeps it.
      Rank 1 KK on (w1, w6, w3): ({w6}, {w3}) spread 73755 merges {w1}: {w6}, {w3, w1}:
      local [[1], [0, 2]] -> rows [[0], [5, 3]].
    """
    assert verl_pipeline([6, 5, 4, 3, 2, 1], 2, 6) == [[[[4, 2], [1]], [[0], [5, 3]]]]


def test_verl_soft_cap_by_hand():
    """verl before verl#7553 (soft_cap=True). [7, 7, 7], dp 1, max_token_len 11:
    _balance_batch's layout is [0, 2, 1] (equal workloads sorted by index,
    p[::2] + p[1::2][::-1]); the count is ceil(21 / 11) = 2; KK on three equal
    workloads pops the highest index first (the larger top set on ties): locals 2 and
    1 pair off, then local 0 joins local 1's set: [[0, 1], [2]], i.e. rows
    [[0, 2], [1]]: 14 tokens in the first micro-batch, over the cap of 11."""
    assignment = verl_pipeline([7, 7, 7], 1, 11, soft_cap=True)
    assert assignment == [[[[0, 2], [1]]]]
    out = simulate(assignment, [7, 7, 7], CostModel.tokens(), max_tokens=11)
    assert out["cap_violations"] == 1 and out["max_cell_tokens"] == 14
    # seqpack's plan keeps the cap with one more micro-batch.
    out = simulate(seqpack_two_step_pipeline([7, 7, 7], 1, 11), [7, 7, 7], CostModel.tokens(), max_tokens=11)
    assert out["cap_violations"] == 0 and out["num_micro_batches"] == [3]


def test_verl_released_grows_the_count_by_hand():
    """verl 0.9.1, the same case: the 2 parts above hold 14 > 11 tokens, so the count
    grows to 3 = the rows (one each, equal workloads). Sorted by (workload, first
    local row) descending: locals [2], [1], [0]; mbs[::2][::-1] + mbs[1::2] gives
    [0], [2], [1], i.e. rows [0], [1], [2] through the layout [0, 2, 1]. With
    num_batches_divided_by=2 the count starts at 2 and would grow to 4 > 3 rows: verl
    raises."""
    assignment = verl_pipeline([7, 7, 7], 1, 11)
    assert assignment == [[[[0], [1], [2]]]]
    out = simulate(assignment, [7, 7, 7], CostModel.tokens(), max_tokens=11)
    assert out["cap_violations"] == 0 and out["num_micro_batches"] == [3]
    with pytest.raises(ValueError, match="4 micro-batches .* only 3 rows"):
        verl_pipeline([7, 7, 7], 1, 11, num_batches_divided_by=2)
    # The soft cap raises only where the rounded first count passes the rows (verl's KK asserted k <= rows).
    assert verl_pipeline([7, 7, 7], 1, 11, num_batches_divided_by=2, soft_cap=True) == [[[[0, 2], [1]]]]
    with pytest.raises(ValueError, match="num_batches_divided_by"):
        verl_pipeline([7, 7, 7], 1, 11, num_batches_divided_by=0)


@settings(max_examples=30, deadline=None)
@given(case=divisible_case())
def test_verl_dynamic_bsz_balance_only_reorders(case):
    """Without use_dynamic_bsz_balance the micro-batches come heaviest first (KK's
    order); with it, the same micro-batches as mbs[::2][::-1] + mbs[1::2]."""
    lengths, dp, cap, mbs = case
    plain = verl_pipeline(lengths, dp, cap, mini_batches=mbs, use_dynamic_bsz_balance=False)
    balanced = verl_pipeline(lengths, dp, cap, mini_batches=mbs)
    w = lambda cell: sum(24576 * lengths[i] + lengths[i] ** 2 for i in cell)  # noqa: E731
    for plain_mb, balanced_mb in zip(plain, balanced):
        for p, b in zip(plain_mb, balanced_mb):
            assert [w(c) for c in p] == sorted((w(c) for c in p), reverse=True)
            assert sorted(map(sorted, p)) == sorted(map(sorted, b))
            # (ties are broken on the rank-local first row, so compare workloads)
            heavy_first = sorted((w(c) for c in p), reverse=True)
            assert [w(c) for c in b] == heavy_first[::2][::-1] + heavy_first[1::2]


# --------------------------------------------------------------------------- verl, against the released verl


# (distribution, n, seed, max_len, dp, max_tokens, mini_batches, use_dynamic_bsz_balance) -> sha256[:16] of
# json.dumps(verl_pipeline(...)) as it was before it modelled verl#7553 (commit e871f80); each but the
# trl_6092 case put a micro-batch over the cap.
SOFT_CAP_OUTPUTS = {
    ("rl_long_tail", 64, 3, 4096, 4, 4096, 2, True): "76f4bd05a5b35b5f",
    ("rl_long_tail", 64, 3, 4096, 4, 4096, 2, False): "9e2ddbc0435cbed4",
    ("sft", 96, 5, 4096, 8, 4096, 1, True): "38db98e04a4233d1",
    ("trl_6092", 48, 1, 5120, 2, 8192, 3, True): "e9c092811f32ab93",
    ("reasoning_tail", 64, 2, 16384, 4, 16384, 1, True): "716afd1fe328f1e0",
    ("rl_long_tail", 32, 7, 2048, 1, 2048, 1, True): "b9ffc9b3b13dc2be",
}


@pytest.mark.parametrize("case", sorted(SOFT_CAP_OUTPUTS))
def test_verl_soft_cap_keeps_its_previous_outputs_and_the_default_keeps_the_cap(case):
    dist_name, n, seed, max_len, dp, cap, mbs, balance = case
    lengths = DISTRIBUTIONS[dist_name](n, seed, max_len).tolist()
    soft = verl_pipeline(lengths, dp, cap, mini_batches=mbs, use_dynamic_bsz_balance=balance, soft_cap=True)
    assert hashlib.sha256(json.dumps(soft).encode()).hexdigest()[:16] == SOFT_CAP_OUTPUTS[case]
    released = verl_pipeline(lengths, dp, cap, mini_batches=mbs, use_dynamic_bsz_balance=balance)
    check_structure(released, n, dp, mbs)
    hard, old = (simulate(a, lengths, CostModel.tokens(), max_tokens=cap) for a in (released, soft))
    assert hard["cap_violations"] == 0 and hard["max_cell_tokens"] <= cap
    if old["cap_violations"]:  # more micro-batches where the first count broke the cap, else the same plan
        assert sum(hard["num_micro_batches"]) > sum(old["num_micro_batches"])
    else:
        assert released == soft


def released_verl():
    pytest.importorskip("tensordict", exc_type=ImportError)
    # ImportError too: verl is installed without its dependencies (a missing one skips, not fails).
    return pytest.importorskip("verl.utils.seqlen_balancing", exc_type=ImportError)


class ThreadGroup:
    """A ``dp_group`` for verl's collectives between threads, one per rank: what
    ``torch.distributed.all_reduce`` (MAX / MIN) does, with a barrier."""

    def __init__(self, size):
        self.barrier = threading.Barrier(size, timeout=60)
        self.slots = [None] * size

    def member(self, rank):
        return types.SimpleNamespace(group=self, rank=rank)


def thread_all_reduce(tensor, op, group):
    import torch
    import torch.distributed as dist

    shared = group.group
    shared.slots[group.rank] = tensor.clone()
    shared.barrier.wait()
    stacked = torch.stack(shared.slots)
    reduced = stacked.amax(0) if op == dist.ReduceOp.MAX else stacked.amin(0)
    shared.barrier.wait()  # every rank has read the slots before any writes the next
    tensor.copy_(reduced)


def verl_shares(verl, lengths, dp):
    """RayPPOTrainer._balance_batch(keep_minibatch=True) on one mini-batch, with
    verl's own calculate_workload and KK: each rank's rows in verl's order."""
    import torch

    work = verl.calculate_workload(torch.tensor(lengths, dtype=torch.long)).tolist()
    shares = []
    for part in verl.get_seqlen_balanced_partitions(work, k_partitions=dp, equal_size=True):
        part = sorted(part, key=lambda i: (work[i], i))
        shares.append(part[::2] + part[1::2][::-1])
    return shares


def verl_micro_batches(verl, lengths, dp, cap, divisor, balance):
    """Each rank's micro-batches (global rows) from the released rearrange_micro_batches
    on its share, the ranks agreeing through ``dp_group`` (threads), or ``"raises"``."""
    import torch
    import torch.distributed as dist
    from tensordict import TensorDict

    shares = verl_shares(verl, lengths, dp)
    width = max(lengths)

    def batch(rows):
        n = torch.tensor([lengths[i] for i in rows], dtype=torch.long)
        mask = (torch.arange(width)[None, :] < n[:, None]).long()
        return TensorDict({"input_ids": mask.clone(), "attention_mask": mask}, batch_size=[len(rows)])

    group = ThreadGroup(dp)
    out = [None] * dp

    def run(rank):
        try:
            _, idx = verl.rearrange_micro_batches(batch(shares[rank]), cap, group.member(rank) if dp > 1 else None,
                                                  divisor, True, None, balance)
            out[rank] = [[shares[rank][j] for j in part] for part in idx]
        except ValueError:
            out[rank] = "raises"

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(verl, "dist", types.SimpleNamespace(is_initialized=lambda: True, all_reduce=thread_all_reduce,
                                                       ReduceOp=dist.ReduceOp))
        mp.setattr(verl, "get_device_name", lambda: "cpu")
        threads = [threading.Thread(target=run, args=(r,)) for r in range(dp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert all(o is not None for o in out), "a rank of verl's rearrange_micro_batches did not finish"
    if "raises" in out:
        assert set(out) == {"raises"}, "verl raised on some ranks only"
        return "raises"
    return out


@st.composite
def tight_case(draw):
    """Like divisible_case, with caps close to the longest sequence and often lengths
    of one magnitude ([top // 2, top]): the first count often breaks the cap there,
    so verl grows it (or raises, with num_batches_divided_by)."""
    dp = draw(st.integers(1, 3))
    mini_batches = draw(st.integers(1, 2))
    n = dp * mini_batches * draw(st.integers(1, 8))
    top = draw(st.sampled_from([8, 64]))
    low = top // 2 if draw(st.booleans()) else 1
    lengths = draw(st.lists(st.integers(low, top), min_size=n, max_size=n))
    max_tokens = max(lengths) + draw(st.integers(0, max(lengths) // 2))
    return lengths, dp, max_tokens, mini_batches


@settings(max_examples=30, deadline=None)
@given(case=tight_case(), divisor=st.sampled_from([None, 1, 2, 3]), balance=st.booleans())
def test_verl_equals_the_released_rearrange_micro_batches(case, divisor, balance):
    """verl_pipeline's micro-batches are verl 0.9.1's: _balance_batch's rank shares
    (verl's KK), then verl's own rearrange_micro_batches on every rank (dp 1: called
    directly; dp > 1: the ranks' MAX / MIN all-reduces between threads)."""
    verl = released_verl()
    lengths, dp, cap, mbs = case
    try:
        ours = verl_pipeline(lengths, dp, cap, mini_batches=mbs, num_batches_divided_by=divisor,
                             use_dynamic_bsz_balance=balance)
    except ValueError as exc:
        assert "micro-batches" in str(exc)
        ours = "raises"
    theirs = []
    for chunk in chunks(len(lengths), mbs):
        got = verl_micro_batches(verl, [lengths[i] for i in chunk], dp, cap, divisor, balance)
        if got == "raises":
            theirs = "raises"
            break
        theirs.append([[[chunk[0] + i for i in cell] for cell in rank] for rank in got])
    assert ours == theirs


def test_verl_equals_the_released_rearrange_micro_batches_on_a_long_tail():
    """A benchmark-like mini-batch (dp 4, 64 rl_long_tail rows, cap 4096) where the
    first count puts a micro-batch over the cap: verl grows it; so does verl_pipeline."""
    verl = released_verl()
    lengths = pipelines.rl_long_tail(64, seed=3, max_len=4096).tolist()[:32]
    soft = simulate(verl_pipeline(lengths, 4, 4096, soft_cap=True), lengths, VERL, max_tokens=4096)
    assert soft["cap_violations"] > 0
    assert verl_pipeline(lengths, 4, 4096) == [verl_micro_batches(verl, lengths, 4, 4096, None, True)]


# --------------------------------------------------------------------------- the others, small cases


def test_small_cases_of_each_framework():
    six = [6, 5, 4, 3, 2, 1]
    # NeMo-RL: MFFD bins [6,2] [5,3] [4,1]; the count rule moves 1 out: [4] [1]; round-robin.
    assert nemo_rl_pipeline(six, 2, 8) == [[[[0, 4], [2]], [[1, 3], [5]]]]
    # slime: first fit [6,2] [5,3] [4,1]; [5,3] (8 tokens, the later of two full bins) splits;
    # KK on bin workloads deals bins {0, 3} and {1, 2}.
    assert slime_pipeline(six, 2, 8) == [[[[0, 4], [3]], [[1], [2, 5]]]]
    assert slime_pipeline(six, 2, 8, balance_data=False) == [[[[0, 4], [2, 5]], [[1], [3]]]]
    # TRL token budget: 6 -> row 0, 5 -> row 1, 4 fits no row: emit; 4 -> row 0, then 3, 2, 1
    # to the row with the smaller sum of squares (row 1 each time).
    assert trl_async_grpo_pipeline(six, 2, 8) == [[[[0], [2]], [[1], [3, 4, 5]]]]
    # ROLL pads to 16: three micro-batches of 16 padded tokens where verl plans two.
    assert roll_pipeline([7, 7, 7], 1, 16) == [[[[0], [1], [2]]]]
    assert verl_pipeline([7, 7, 7], 1, 16) == [[[[0, 2], [1]]]]


def test_seqpack_two_step_pads_short_ranks_with_dummy_micro_batches():
    # 5 sequences over 4 ranks: unequal KK; the rank with two (12 tokens) needs 2 micro-batches.
    lengths = [6, 6, 6, 6, 6]
    assignment = seqpack_two_step_pipeline(lengths, 4, 10)
    check_structure(assignment, 5, 4, 1)
    counts = [len(rank) for rank in assignment[0]]
    assert counts == [2, 2, 2, 2]
    assert sum(1 for rank in assignment[0] for cell in rank if not cell) == 3
    # Fewer sequences than ranks: idle ranks run only dummy micro-batches.
    assignment = seqpack_two_step_pipeline([3, 4], 3, 8)
    assert assignment == [[[[0]], [[1]], [[]]]]


def test_doctests():
    result = doctest.testmod(pipelines, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= 8 and result.failed == 0


# --------------------------------------------------------------------------- simulate


LENGTHS = [1, 2, 3, 4, 5, 1]
COST = CostModel(per_micro_batch=10, per_token=1, per_token_squared=1)  # 10 + Σs + Σs²


def test_simulate_by_hand_both_sync_modes():
    # Mini-batch 0: rank 0 [[0, 1], [2]] costs 10+3+5 = 18 and 10+3+9 = 22; rank 1 [[3], []]
    # costs 10+4+16 = 30 and 10 (a dummy micro-batch). Mini-batch 1: [[4]] 40, [[5]] 12.
    assignment = [[[[0, 1], [2]], [[3], []]], [[[4]], [[5]]]]
    out = simulate(assignment, LENGTHS, COST, sync="micro_batch", max_tokens=4)
    assert out["time"] == max(18, 30) + max(22, 10) + max(40, 12) == 92
    assert out["num_micro_batches"] == [2, 1]
    assert out["unequal_counts"] is False and out["padded_cells"] == 0 and out["cells"] == 6
    assert out["max_cell_tokens"] == 5 and out["cap_violations"] == 1  # [4] holds 5 > 4
    out = simulate(assignment, LENGTHS, COST, sync="step")
    assert out["time"] == max(18 + 22, 30 + 10) + max(40, 12) == 80
    assert out["cap_violations"] is None


def test_simulate_pads_unequal_counts_with_empty_cells():
    assignment = [[[[0, 1], [2]], [[3]]], [[[4]], [[5]]]]  # rank 1 of mini-batch 0 runs 1 micro-batch
    for sync, expected in (("micro_batch", 92), ("step", 80)):
        out = simulate(assignment, LENGTHS, COST, sync=sync)
        assert out["time"] == expected
        assert out["unequal_counts"] is True and out["padded_cells"] == 1 and out["cells"] == 6
        assert out["num_micro_batches"] == [2, 1]


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_simulate_agrees_with_the_cost_model(data):
    lengths = data.draw(st.lists(st.integers(1, 300), min_size=1, max_size=20))
    n, dp = len(lengths), data.draw(st.integers(1, 3))
    cells = data.draw(st.lists(st.integers(0, 4 * dp - 1), min_size=n, max_size=n))  # a cell per index
    grid = [[[i for i in range(n) if cells[i] == r * 4 + k] for k in range(4)] for r in range(dp)]
    cost = CostModel(per_micro_batch=data.draw(st.integers(0, 5)), per_token=2, per_token_squared=0.5)
    table = [[cost([lengths[i] for i in cell]) for cell in rank] for rank in grid]
    out = simulate([grid], lengths, cost, sync="micro_batch")
    assert out["time"] == pytest.approx(sum(max(table[r][k] for r in range(dp)) for k in range(4)))
    out = simulate([grid], lengths, cost, sync="step")
    assert out["time"] == pytest.approx(max(sum(row) for row in table))


def test_simulate_rejects_bad_input():
    with pytest.raises(ValueError, match="sync"):
        simulate([], [1], COST, sync="rank")
    with pytest.raises(ValueError, match="outside"):
        simulate([[[[0, 7]]]], [1, 2], COST)
    assert simulate([], [1], COST)["time"] == 0.0


# --------------------------------------------------------------------------- distributions


@pytest.mark.parametrize("name", sorted(DISTRIBUTIONS))
def test_distributions_are_seeded_int64_and_clipped(name):
    make = DISTRIBUTIONS[name]
    a = make(4000, 7)
    assert a.dtype == np.int64 and a.shape == (4000,)
    assert np.array_equal(a, make(4000, 7)) and not np.array_equal(a, make(4000, 8))
    small = make(4000, 7, 300)
    assert small.min() >= 1 and small.max() <= 300 and (small == 300).any()
    assert make(0, 1).shape == (0,)


def test_trl_6092_matches_the_pr_description():
    """PR #6092: completions log-normal (median 700, σ 0.9) with a 10% spike at 4096,
    prompts of median 256; realised lengths min 116 / mean 1597 / max 5120."""
    a = pipelines.trl_6092(20000, seed=0)
    assert a.max() == 5120 and 1400 < a.mean() < 1800
    spiked = (a >= 4096 + 32).mean()  # prompts are >= 32 tokens
    assert 0.10 <= spiked < 0.14  # the spike plus the few natural completions clipped at 4096


def test_module_does_not_import_torch():
    code = "import sys, seqpack.testing.pipelines; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
