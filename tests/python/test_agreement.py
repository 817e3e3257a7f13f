"""Issue 26, item 2: every multi-rank entry point agrees on its inputs before its first
collective. One rank's input is flipped - its shape, its dtype, whether it requires
grad, the autocast state it runs under, or the offsets - and every rank must raise
in the forward (the flipped rank its own error or the shared one, the others a
``ValueError`` saying another rank failed or naming what the ranks disagree on);
none may wait in a collective, forward or backward. Without a flip every rank
returns.

Where a flip changes nothing a collective exchanges, the entry point must accept it
on every rank (a refusal there would break correct programs), and the test checks
that every rank returns:

- ``requires_grad`` for ``BatchedDataDict.all_gather``: an all-gather is not
  differentiable (what it returns never requires grad), and for verl / ROLL, which
  read the attention mask's lengths on the host (detached) and exchange only counts.
- autocast for the pure data movement (``gather_cp``, ``ulysses_gather``,
  ``BatchedDataDict.all_gather``, verl, ROLL): none runs an op autocast casts.
- dtype for verl / ROLL: any mask dtype gives the same lengths; only ints travel.
  Their "shape" flip is a mask that is not ``[B, S]`` (the ranks legitimately hold
  different row counts and widths, so only an invalid shape must stop them).

Every case runs forward and, where its output requires grad, backward: on the code
before this change a rank whose input required grad alone waited in the backward's
collective (the Ulysses all-to-all, the CP reduce-scatter, the vocabulary-parallel
hidden-state all-reduce) for the gloo timeout. Here a case that does not finish in
CASE_TIMEOUT_S fails as a hang (the harness tears the ranks down), so a regression
fails fast instead of stalling CI. Two gloo ranks, kept for the whole module.
"""

from __future__ import annotations

import contextlib
import itertools
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _gloo import RankPool

WORLD = 2
CASE_TIMEOUT_S = 45  # first-use imports and backward passes on 2 busy cores fit well inside
CASE_IDS = itertools.count(1)
OTHERS = ("another rank's input failed", "disagree on")

# What each flip must name when the ranks pass their own checks but disagree.
NAMES = {"shape": "shape", "dtype": "dtype", "requires_grad": "require grad|requires grad",
         "autocast": "autocast", "offsets": "cu_seqlens_padded|layout|input_ids"}


# ---------------------------------------------------------------- the inputs


def _grad(t, flip, bad):
    """``t`` requiring grad, except on the flipped rank of a requires_grad flip."""
    t = t.detach().clone()
    return t if bad and flip == "requires_grad" else t.requires_grad_()


def _autocast(flip, bad):
    if bad and flip == "autocast":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _zigzag(flip, bad):
    """Padded offsets of two sequences for CP over WORLD ranks (multiples of 2 * WORLD);
    the flipped rank's split differently, with the same total (its own checks pass)."""
    return np.array([0, 4, 12] if bad and flip == "offsets" else [0, 8, 12], dtype=np.int64)


def _cp_attention(rank, flip, bad):
    from seqpack.training.attention import cp_attention
    from seqpack.cp import cp_local_rows

    cu_p = _zigzag(flip, bad)
    g = torch.Generator().manual_seed(1)
    q, k, v = (cp_local_rows(torch.randn(12, 2, 4, generator=g), cu_p, WORLD, rank) for _ in range(3))
    if bad and flip == "shape":  # the head dim: the rows still match the offsets
        q, k, v = q[..., :2], k[..., :2], v[..., :2]
    if bad and flip == "dtype":
        q, k, v = q.double(), k.double(), v.double()
    q, k, v = (_grad(t, flip, bad) for t in (q, k, v))
    with _autocast(flip, bad):
        return cp_attention(q, k, v, SimpleNamespace(cu_seqlens_padded=cu_p, cp_size=WORLD, cp_rank=rank),
                            dist.group.WORLD)


def _ulysses_attention(rank, flip, bad):
    from seqpack.training.attention import ulysses_attention
    from seqpack.tensors._ulysses import slice_rows

    cu_p = np.array([0, 2, 9] if bad and flip == "offsets" else [0, 5, 9], dtype=np.int64)
    g = torch.Generator().manual_seed(2)
    q, k, v = (slice_rows(torch.randn(9, 2, 4, generator=g), 9, rank, WORLD) for _ in range(3))
    if bad and flip == "shape":
        q, k, v = q[..., :2], k[..., :2], v[..., :2]
    if bad and flip == "dtype":
        q, k, v = q.double(), k.double(), v.double()
    q, k, v = (_grad(t, flip, bad) for t in (q, k, v))
    with _autocast(flip, bad):  # autocast: the attention output, exchanged back, in bf16 on one rank
        return ulysses_attention(q, k, v, SimpleNamespace(cu_seqlens_padded=cu_p), dist.group.WORLD)


def _gather_cp(rank, flip, bad):
    from seqpack.cp import gather_cp

    local = torch.randn(6, 3)
    if bad and flip == "shape":
        local = local[:, :2]
    if bad and flip == "dtype":
        local = local.double()
    with _autocast(flip, bad):
        return gather_cp(_grad(local, flip, bad), _zigzag(flip, bad), dist.group.WORLD)


def _ulysses_gather(rank, flip, bad):
    import seqpack

    ids = torch.arange(9)[None].expand(2, 9)
    batch = seqpack.pack_sequences({"input_ids": ids}, seq_lens=[5, 4])
    if bad and flip == "offsets":  # this rank's batch holds zigzag CP rows: no full stream to rebuild
        batch = seqpack.pack_sequences({"input_ids": ids}, seq_lens=[5, 4], cp_size=2, cp_rank=rank,
                                       pad_multiple=4)
    local = torch.randn(5, 3)  # ceil(9 / 2) rows
    if bad and flip == "shape":
        local = local[:, :2]
    if bad and flip == "dtype":
        local = local.double()
    with _autocast(flip, bad):
        return batch.ulysses_gather(_grad(local, flip, bad), dist.group.WORLD)


VOCAB = 8  # split in two slices of 4 over the vocabulary-parallel ranks


def _ids_and_offsets(flip, bad):
    """Ids, real and padded offsets of two sequences (2 and 4 tokens) in 9 rows; the
    flipped rank's padding split differently (still valid, same total)."""
    ids = torch.tensor([1, 6, 3, 7, 0, 5, 2, 4, 6])
    return ids, [0, 2, 6], ([0, 2, 9] if bad and flip == "offsets" else [0, 5, 9])


def _packed_logprobs(rank, flip, bad):
    import seqpack

    ids, cu, cu_p = _ids_and_offsets(flip, bad)
    logits = torch.randn(9, VOCAB // WORLD)
    if bad and flip == "shape":  # rows that do not match the layout: the rank's own check fails
        logits = logits[:-1]
    if bad and flip == "dtype":
        logits = logits.double()
    with _autocast(flip, bad):
        return seqpack.token_logprobs(_grad(logits, flip, bad), seqpack.PackedLayout.from_offsets(cu, cu_p), ids,
                                      vocab_parallel_group=dist.group.WORLD,
                                      vocab_start=rank * (VOCAB // WORLD)).logprobs


def _linear_logprobs(rank, flip, bad):
    import seqpack

    ids, cu, cu_p = _ids_and_offsets(flip, bad)
    hidden, weight = torch.randn(9, 3), torch.randn(VOCAB // WORLD, 3)
    if bad and flip == "shape":  # the hidden size (the backward's all-reduce), head to match
        hidden, weight = hidden[:, :2], weight[:, :2]
    if bad and flip == "dtype":
        hidden, weight = hidden.double(), weight.double()
    with _autocast(flip, bad):
        return seqpack.token_logprobs(_grad(hidden, flip, bad), seqpack.PackedLayout.from_offsets(cu, cu_p), ids,
                                      weight=weight, vocab_parallel_group=dist.group.WORLD,
                                      vocab_start=rank * (VOCAB // WORLD)).logprobs


def _loss_data(lengths, width):
    from seqpack import BatchedDataDict

    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.arange(1, n + 1) % (VOCAB // WORLD)  # in every vocabulary (also a narrower one)
        mask[i, :n] = 1
    return BatchedDataDict(input_ids=ids, token_mask=mask, sample_mask=torch.ones(len(lengths)))


def _loss_logits(rows, vocab, flip, bad):
    logits = torch.randn(rows, vocab - (1 if bad and flip == "shape" else 0))
    return _grad(logits.double() if bad and flip == "dtype" else logits, flip, bad)


def _loss_fused_cp(rank, flip, bad):
    """The fused wrapper over a CP group: log-probs, then the CP all-gather."""
    from seqpack.loss import NLLLoss, SequencePackingLossWrapper
    from seqpack.cp import cp_local_rows

    cu_p = _zigzag(flip, bad)  # sequences of 3 and 4 tokens
    wrapper = SequencePackingLossWrapper(NLLLoss(), None, [0, 3, 7], cu_p, context_parallel_group=dist.group.WORLD,
                                         fused=True)
    logits = _loss_logits(12, VOCAB, flip, bad)
    rows = cp_local_rows(torch.arange(12), cu_p, WORLD, rank)
    with _autocast(flip, bad):
        loss, _ = wrapper(logits[rows][None], _loss_data([3, 4], 4), 2, 5)
    return loss


def _loss_vocab_parallel(rank, flip, bad):
    """The per-sequence wrapper over a TP group: the log-probs' all-reduces."""
    from seqpack.loss import NLLLoss, SequencePackingLossWrapper

    _, cu, cu_p = _ids_and_offsets(flip, bad)
    wrapper = SequencePackingLossWrapper(NLLLoss(), None, cu, cu_p, vocab_parallel_rank=rank,
                                         vocab_parallel_group=dist.group.WORLD)
    with _autocast(flip, bad):
        loss, _ = wrapper(_loss_logits(9, VOCAB // WORLD, flip, bad), _loss_data([2, 4], 4), 2, 4)
    return loss


def _prepare_loss_input(rank, flip, bad):
    """The default prepare_fn alone, one sequence over a CP group."""
    from seqpack.cp import cp_local_rows
    from seqpack.loss import prepare_loss_input

    logits = _loss_logits(8, VOCAB, flip, bad)
    local = cp_local_rows(logits, [0, 8], WORLD, rank)
    data = _loss_data([5], 5 if bad and flip == "offsets" else 6)  # offsets: the sequence's width
    with _autocast(flip, bad):
        loss_input, _ = prepare_loss_input(local[None], data, context_parallel_group=dist.group.WORLD)
    return loss_input["next_token_logprobs"]


def _all_gather(rank, flip, bad):
    from seqpack import BatchedDataDict

    rows = 2 + rank  # the ranks' row counts differ: that is the point of the gather
    x = torch.randn(rows, 3)
    if bad and flip == "shape":
        x = x[:, :2]
    if bad and flip == "dtype":
        x = x.double()
    if bad and flip == "requires_grad":
        x.requires_grad_()
    batch = BatchedDataDict(x=x, input_ids=torch.arange(rows * 4).reshape(rows, 4), names=[f"r{rank}"] * rows)
    with _autocast(flip, bad):
        out = batch.all_gather(dist.group.WORLD)
    return [tuple(out["x"].shape), tuple(out["input_ids"].shape), out["names"]]


def _mask(flip, bad, rank):
    lengths = [3, 5, 2] if rank == 0 else [4, 1]  # the ranks hold different batches
    mask = (torch.arange(6)[None] < torch.tensor(lengths)[:, None]).long()
    if bad and flip == "shape":
        return mask.reshape(-1)  # not [B, S]
    if bad and flip == "dtype":
        return mask.bool()
    if bad and flip == "requires_grad":
        return mask.float().requires_grad_()
    return mask


def _verl(rank, flip, bad):
    from seqpack.verl import rearrange_micro_batches

    with _autocast(flip, bad):
        micro, _ = rearrange_micro_batches({"attention_mask": _mask(flip, bad, rank)}, max_token_len=6,
                                           dp_group=dist.group.WORLD)
    return len(micro)


def _roll(rank, flip, bad):
    from seqpack import roll

    batch = roll.RollBatch({"attention_mask": _mask(flip, bad, rank)}, meta_info={})
    with _autocast(flip, bad):
        parts = roll.make_micro_batch_iter_for_sequence_packing(batch, max_packed_sequence_length=6, pad_multiple=1,
                                                                dp_group=dist.group.WORLD)
        return len(list(parts))


ALL = ("none", "shape", "dtype", "requires_grad", "autocast")
# entry point -> (case, flips that must make every rank raise, flips every rank must accept)
ENTRY_POINTS = {
    "cp_attention": (_cp_attention, ALL[1:] + ("offsets",), ()),
    "ulysses_attention": (_ulysses_attention, ALL[1:] + ("offsets",), ()),
    "gather_cp": (_gather_cp, ("shape", "dtype", "requires_grad", "offsets"), ("autocast",)),
    "PackedBatch.ulysses_gather": (_ulysses_gather, ("shape", "dtype", "requires_grad", "offsets"), ("autocast",)),
    "packed_token_logprobs": (_packed_logprobs, ALL[1:] + ("offsets",), ()),
    "linear_token_logprobs": (_linear_logprobs, ALL[1:] + ("offsets",), ()),
    "SequencePackingLossWrapper(fused, CP)": (_loss_fused_cp, ALL[1:] + ("offsets",), ()),
    "SequencePackingLossWrapper(TP)": (_loss_vocab_parallel, ALL[1:] + ("offsets",), ()),
    "prepare_loss_input(CP)": (_prepare_loss_input, ALL[1:] + ("offsets",), ()),
    "BatchedDataDict.all_gather": (_all_gather, ("shape", "dtype"), ("requires_grad", "autocast")),
    "verl.rearrange_micro_batches": (_verl, ("shape",), ("dtype", "requires_grad", "autocast")),
    "roll.make_micro_batch_iter": (_roll, ("shape",), ("dtype", "requires_grad", "autocast")),
}
CASES = [(entry, flip, flip != "none" and flip in ENTRY_POINTS[entry][1])
         for entry in ENTRY_POINTS for flip in ("none",) + ENTRY_POINTS[entry][1] + ENTRY_POINTS[entry][2]]


def run_case(rank, world, entry, flip, bad_rank, case_id):
    """One case on one rank (in the pool): the forward, and a backward where the
    output requires grad; then every rank checks that all ran the same case, so a
    rank whose collectives paired with another case's fails."""
    torch.manual_seed(case_id)
    try:
        out = ENTRY_POINTS[entry][0](rank, flip, rank == bad_rank)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.float().sum().backward()
        value, error = ("returned" if isinstance(out, torch.Tensor) else out), None
    except Exception as exc:  # noqa: BLE001 - re-raised after the step check
        value, error = None, exc
    tags = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    dist.all_gather(tags, torch.tensor([case_id]))
    assert all(int(t) == case_id for t in tags), f"ranks out of step: cases {[int(t) for t in tags]}"
    if error is not None:
        raise error
    return value


@pytest.fixture(scope="module")
def pool():
    box = {"pool": RankPool(WORLD)}

    def get():
        if box["pool"].closed:  # torn down by a hang: a fresh one for the next case
            box["pool"] = RankPool(WORLD)
        return box["pool"]

    try:
        yield get
    finally:
        box["pool"].close()


def _describe(outcomes):
    return "\n".join(f"rank {o.rank}: {o.raised or 'returned'} {o.message or o.value!r}\n{o.trace}"
                     for o in outcomes)


@pytest.mark.parametrize("entry,flip,refused", CASES, ids=[f"{e}-{f}" for e, f, _ in CASES])
def test_one_rank_flipped_stops_every_rank(pool, entry, flip, refused):
    bad_rank = WORLD - 1 if flip in ("shape", "autocast") else 0  # both ranks take a turn as the odd one
    outcomes = pool().run(run_case, entry, flip, bad_rank, next(CASE_IDS), timeout_s=CASE_TIMEOUT_S)
    details = _describe(outcomes)
    if not refused:  # every rank returns, with the same answer where the answer is shared
        assert all(o.raised is None for o in outcomes), details
        if entry in ("BatchedDataDict.all_gather", "verl.rearrange_micro_batches", "roll.make_micro_batch_iter"):
            assert len({repr(o.value) for o in outcomes}) == 1, details
        return
    assert all(o.raised in ("ValueError", "TypeError") for o in outcomes), details
    shared = [o for o in outcomes if "disagree on" in o.message]
    if shared:  # the ranks passed their own checks: every rank names what differs
        assert len(shared) == WORLD and len({o.message for o in outcomes}) == 1, details
        assert re.search(NAMES[flip], outcomes[0].message.split("disagree on", 1)[1]), details
    else:  # the flipped rank's own check failed: its own error; the others say another rank failed
        for o in outcomes:
            if o.rank == bad_rank:
                assert not any(s in o.message for s in OTHERS), details
            else:
                assert o.raised == "ValueError" and "another rank's input failed" in o.message, details
