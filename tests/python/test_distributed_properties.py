"""Property (issue 16, hangs): the distributed helpers - ``verl.rearrange_micro_batches``
with a process group, ``roll.make_micro_batch_iter_for_sequence_packing``,
``cp_attention`` - with one rank's input made infeasible, the others fine, on 2 or 3
gloo ranks: every rank raises (the failing rank its own error, the others a
ValueError), none waits in a collective. Hypothesis picks the helper, the fault, the
failing rank, the world size and the lengths; without a fault every rank gets the
same answer (or, for a count the ranks cannot share, the same error).

The ranks are spawned once per world size for the whole module (a _gloo.RankPool
fed cases over queues): each example costs milliseconds, not a process start. Each
case is bounded by CASE_TIMEOUT_S: a hang fails the test and tears the pool down
(the next example starts a fresh one). Shrinking is off: shrinking a hang would
wait out the timeout again for every candidate, and the examples are small anyway.
"""

import itertools

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _gloo import RankPool
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

WORLDS = (2, 3)
CAP = 24  # max_token_len / max_packed_sequence_length
CASE_TIMEOUT_S = 20
FAULTS = {
    "verl": ("none", "over_cap", "min_num_above_rows", "no_attention_mask", "extra_rows", "bad_divisor"),
    "roll": ("none", "over_cap", "min_num_above_rows", "no_attention_mask", "bad_vp_size", "bad_algorithm"),
    "cp_attention": ("none", "q_rows", "k_rows", "kv_rows", "cp_rank", "offsets", "kv_heads_per_chunk",
                     "backend", "no_cp_size", "kv_heads", "head_dim", "dtype"),
}
# Faults that pass the failing rank's own checks and differ from the other ranks in
# what the collectives share: every rank raises the fingerprint's error.
SHARED_FAULTS = {"kv_heads", "head_dim", "dtype"}
OTHERS = ("another rank's input failed", "disagree on")
CASE_IDS = itertools.count(1)


def _mask(lengths):
    width = max(lengths)
    return (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()


def _batch(case, rank, bad):
    lengths = list(case["lengths"][rank])
    if bad and case["fault"] == "over_cap":
        lengths[case["seed"] % len(lengths)] = CAP + 1 + case["seed"] % 5
    mask = _mask(lengths)
    batch = {"attention_mask": mask, "input_ids": torch.zeros_like(mask)}
    if bad and case["fault"] == "no_attention_mask":
        del batch["attention_mask"]
    if bad and case["fault"] == "extra_rows":
        batch["input_ids"] = torch.zeros(len(lengths) + 1, mask.shape[1], dtype=torch.long)
    return batch, len(lengths)


def _verl(rank, world, case, bad):
    from seqpack.verl import rearrange_micro_batches

    batch, rows = _batch(case, rank, bad)
    kwargs = {}
    if bad and case["fault"] == "min_num_above_rows":
        kwargs["min_num_micro_batch"] = rows + 1
    if bad and case["fault"] == "bad_divisor":
        kwargs["num_batches_divided_by"] = -1
    micro_batches, _ = rearrange_micro_batches(batch, max_token_len=CAP, dp_group=dist.group.WORLD, **kwargs)
    return len(micro_batches)


def _roll(rank, world, case, bad):
    from seqpack import roll

    batch, rows = _batch(case, rank, bad)
    kwargs = dict(max_packed_sequence_length=CAP, pad_multiple=1, dp_group=dist.group.WORLD)
    if bad and case["fault"] == "min_num_above_rows":
        kwargs["min_num_micro_batches"] = rows + 1
    if bad and case["fault"] == "bad_vp_size":
        kwargs["vp_size"] = 0
    if bad and case["fault"] == "bad_algorithm":
        kwargs["algorithm"] = "first_fit"
    return len(list(roll.make_micro_batch_iter_for_sequence_packing(roll.RollBatch(batch, meta_info={}),
                                                                    **kwargs)))


def _cp_attention(rank, world, case, bad):
    from types import SimpleNamespace

    from seqpack import varlen_attention
    from seqpack.training.attention import cp_attention
    from seqpack.cp import cp_local_rows

    multiple = 2 * world
    padded = [-(-n // multiple) * multiple for n in case["seqs"]]
    cu_p = np.concatenate([[0], np.cumsum(padded)]).astype(np.int32)
    g = torch.Generator().manual_seed(case["seed"])
    full = [torch.randn(int(cu_p[-1]), 2, 4, generator=g, dtype=torch.float64) for _ in range(3)]
    q, k, v = (cp_local_rows(t, cu_p, world, rank) for t in full)
    batch = SimpleNamespace(cu_seqlens_padded=cu_p, cp_size=world, cp_rank=rank)
    kwargs = dict(kv_heads_per_chunk=case["heads_per_chunk"])
    fault = case["fault"] if bad else "none"
    if fault == "q_rows":
        q = torch.cat([q, q[:1]]) if case["seed"] % 2 else q[:-1]
    elif fault == "k_rows":  # k alone mis-shaped (no NaN, no error in its values)
        k = k[:-1]
    elif fault == "kv_rows":
        k, v = k[:-1], v[:-1]
    elif fault == "cp_rank":
        batch.cp_rank = (rank + 1) % world
    elif fault == "offsets":  # the last sequence's padded length no longer a multiple of 2 * cp
        batch.cu_seqlens_padded = np.concatenate([cu_p, [cu_p[-1] + 1]]).astype(np.int32)
    elif fault == "kv_heads_per_chunk":
        kwargs["kv_heads_per_chunk"] = 0
    elif fault == "backend":
        kwargs["backend"] = "flash"
    elif fault == "no_cp_size":
        batch = SimpleNamespace(cu_seqlens_padded=cu_p, cp_rank=rank)
    elif fault == "kv_heads":  # 2 query heads over 1 KV head: fine here (GQA), not for the gathers
        k, v = k[:, :1], v[:, :1]
    elif fault == "head_dim":
        q, k, v = q[..., :2], k[..., :2], v[..., :2]
    elif fault == "dtype":
        q, k, v = q.float(), k.float(), v.float()
    out = cp_attention(q, k, v, batch, dist.group.WORLD, **kwargs)
    ref = varlen_attention(*full, cu_p, cu_p, max(padded), max(padded))
    return float((out - cp_local_rows(ref, cu_p, world, rank)).abs().max())


HELPERS = {"verl": _verl, "roll": _roll, "cp_attention": _cp_attention}


def run_case(rank, world, case):
    """One example on one rank (in the pool); then every rank checks that all ran
    the same case, so a rank whose collectives paired with another case's fails."""
    try:
        value, error = HELPERS[case["helper"]](rank, world, case, rank == case["bad"]), None
    except Exception as exc:  # noqa: BLE001 - re-raised after the step check
        value, error = None, exc
    tags = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    dist.all_gather(tags, torch.tensor([case["id"]]))
    assert all(int(t) == case["id"] for t in tags), f"ranks out of step: cases {[int(t) for t in tags]}"
    if error is not None:
        raise error
    return value


class Pools:
    """One RankPool per world size, started together; a pool torn down by a hang is
    started again when next needed."""

    def __init__(self):
        self.pools = {w: RankPool(w) for w in WORLDS}
        for pool in self.pools.values():
            pool.wait_ready()

    def get(self, world):
        if self.pools[world].closed:
            self.pools[world] = RankPool(world).wait_ready()
        return self.pools[world]

    def close(self):
        for pool in self.pools.values():
            pool.close()


@pytest.fixture(scope="module")
def pools():
    started = Pools()
    try:
        yield started
    finally:
        started.close()


@st.composite
def cases(draw):
    helper = draw(st.sampled_from(sorted(HELPERS)))
    world = draw(st.sampled_from(WORLDS))
    case = dict(helper=helper, world=world, fault=draw(st.sampled_from(FAULTS[helper])),
                bad=draw(st.integers(0, world - 1)), seed=draw(st.integers(0, 2**16)))
    if helper == "cp_attention":
        case.update(seqs=draw(st.lists(st.integers(1, 13), min_size=1, max_size=4)),
                    heads_per_chunk=draw(st.sampled_from([None, 1])))
    else:
        case["lengths"] = draw(st.lists(st.lists(st.integers(1, CAP), min_size=1, max_size=6),
                                        min_size=world, max_size=world))
    return case


def _describe(outcomes):
    return "\n".join(f"rank {o.rank}: {o.raised or 'returned'} {o.message or o.value!r}\n{o.trace}"
                     for o in outcomes)


@settings(max_examples=50, deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate))
@given(case=cases())
def test_a_failing_rank_stops_every_rank(pools, case):
    case["id"] = next(CASE_IDS)
    outcomes = pools.get(case["world"]).run(run_case, case, timeout_s=CASE_TIMEOUT_S)  # a hang raises here
    details = _describe(outcomes)
    if case["fault"] == "none":
        if case["helper"] == "cp_attention":
            assert all(o.raised is None and o.value < 1e-9 for o in outcomes), details
        elif any(o.raised for o in outcomes):  # a count some rank cannot reach: every rank, the same error
            assert all(o.raised == "ValueError" and "same micro-batch count across DP ranks" in o.message
                       for o in outcomes), details
        else:
            assert len({o.value for o in outcomes}) == 1, details
        return
    assert all(o.raised in ("ValueError", "TypeError") for o in outcomes), details
    for o in outcomes:
        if case["fault"] in SHARED_FAULTS:
            assert o.raised == "ValueError" and "disagree on" in o.message, details
        elif o.rank == case["bad"]:
            assert not any(s in o.message for s in OTHERS), details  # its own error, naming the rule
        else:
            assert o.raised == "ValueError" and "another rank's input failed" in o.message, details
