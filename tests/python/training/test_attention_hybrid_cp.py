"""Hybrid context parallelism executed (issue 41): every rank runs its hybrid-CP
micro-batches of a ``plan_step(..., cp_size=C, hybrid_cp=True)`` plan - the rows it
runs whole, and its part of every sequence sharded over an aligned block of ranks
(``cp_attention`` / ``tree_cp_attention`` over that block's group).

On 4 gloo ranks (C = 4, D = 1; and C = 2, D = 2): a one-layer model's loss and
weight gradients summed over the ranks equal the one-process padded step on the
same rows, in fp64, with plain rows and with prefix trees (plans whose degrees mix
1, 2 and 4); a rank handed another plan, or a bad input, makes every rank raise
(never a hang). The one-process layout properties are in
tests/python/tensors/test_hybrid_cp.py.
"""

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _gloo import started_pools, values_of

import seqpack
from seqpack import CostModel

CASE_TIMEOUT_S = 90
COST = CostModel(per_micro_batch=20.0, per_token=1.0, per_token_squared=0.02, per_kv_token=0.5, per_collective=5.0)


def long_tail_rows(seed=0, count=10):
    rng = np.random.default_rng(seed)
    lengths = [61, 37] + rng.integers(2, 14, count - 2).tolist()
    return [rng.integers(1, 97, n).tolist() for n in lengths]


def grpo_rows(seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for prompt_len, answers in ((40, 3), (6, 2), (3, 3), (9, 1)):
        prompt = rng.integers(1, 97, prompt_len).tolist()
        rows += [prompt + rng.integers(1, 97, int(rng.integers(1, 12))).tolist() for _ in range(answers)]
    return rows


def padded(rows):
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
    lengths = torch.tensor([len(r) for r in rows])
    return ids, lengths


def make_plan(rows, dp, cp, cap, trees, seed=0):
    if trees:
        forest = seqpack.PrefixForest.from_rows(rows)
        plan = seqpack.plan_step(forest.lengths, dp, cap, cost=COST, forest=forest, cp_size=cp, hybrid_cp=True,
                                 seed=seed)
        return plan, forest
    return seqpack.plan_step([len(r) for r in rows], dp, cap, cost=COST, cp_size=cp, hybrid_cp=True,
                             seed=seed), None


# ------------------------------------------------------------------ gloo ranks
def step_matches_one_process(rank, world, dp, cp, cap, trees):
    from seqpack.testing.tiny_model import TinyCausalLM, TinyConfig, packed_loss

    torch.manual_seed(0)
    model = TinyCausalLM(TinyConfig(vocab_size=97, hidden_size=16, num_layers=1, num_heads=4,
                                    num_kv_heads=2)).double()
    rows = grpo_rows() if trees else long_tail_rows()
    ids, lengths = padded(rows)
    tokens = float((lengths - 1).sum())
    mask = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
    logits = model.forward_padded(ids, mask)  # the one-process step, fp64 throughout
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    ref_loss = -(logp * mask[:, 1:]).sum() / tokens
    ref_loss.backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    plan, forest = make_plan(rows, dp, cp, cap, trees)
    degrees = set(plan.cp_degree.tolist())
    assert len(degrees) >= 2 and 1 in degrees, degrees  # a real mix: whole rows and sharded ones
    total = torch.zeros((), dtype=torch.float64)
    for mb in seqpack.hybrid_cp_micro_batches({"input_ids": ids}, lengths, plan, forest=forest):
        loss = packed_loss(model, mb, tokens)
        loss.backward()
        total += loss.detach()
    dist.all_reduce(total)
    torch.testing.assert_close(total, ref_loss.detach(), rtol=1e-10, atol=1e-12)
    for n, p in model.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad)
        torch.testing.assert_close(grad, reference[n], rtol=1e-9, atol=1e-12, msg=n)
    return sorted(degrees)


def nemo_rl_step_matches_one_process(rank, world, dp, cp, cap, trees, fused):
    # NeMo-RL's flow: DP shards of a BatchedDataDict by the step plan, one global batch
    # at a time, each CP rank's hybrid micro-batches and the loss wrapper on them.
    from seqpack.testing.tiny_model import TinyCausalLM, TinyConfig
    from seqpack.training.loss import NLLLoss

    torch.manual_seed(0)
    model = TinyCausalLM(TinyConfig(vocab_size=97, hidden_size=16, num_layers=1, num_heads=4,
                                    num_kv_heads=2)).double()
    rows = grpo_rows() if trees else long_tail_rows()
    ids, lengths = padded(rows)
    mask = (torch.arange(ids.shape[1])[None] < lengths[:, None]).double()
    tokens = float((lengths - 1).sum())
    logits = model.forward_padded(ids, mask.long())
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    (-(logp * mask[:, 1:]).sum() / tokens).backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    n = len(rows)
    forest = seqpack.PrefixForest.from_rows(rows) if trees else None
    plan = seqpack.plan_step(lengths, dp, cap, cost=COST, mini_batches=2, cp_size=cp, hybrid_cp=True, forest=forest)
    data = seqpack.BatchedDataDict(input_ids=ids, input_lengths=lengths, token_mask=mask,
                                   sample_mask=torch.ones(n, dtype=torch.float64))
    shards, _ = data.shard_by_batch_size(dp, step_plan=plan)
    shard = shards[rank // cp]
    count = 0
    for gb in range(2):
        batch = shard.get_batch(gb)
        for mb in batch.make_packed_microbatch_iterator(["input_ids"], cp_size=cp, cp_rank=rank % cp, forest=forest):
            wrapper = seqpack.SequencePackingLossWrapper(NLLLoss(), cu_seqlens_q=mb, fused=fused)
            loss, metrics = wrapper(model.forward_packed(mb), mb.data, torch.tensor(float(n)), torch.tensor(tokens))
            loss.backward()
            count += 1
    assert count == sum(plan.num_micro_batches)
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad)
        torch.testing.assert_close(grad, reference[name], rtol=1e-9, atol=1e-12, msg=name)
    return count


def another_plan_raises_everywhere(rank, world, trees):
    rows = grpo_rows() if trees else long_tail_rows()
    ids, lengths = padded(rows)
    plan, forest = make_plan(rows, 1, 4, 30 if trees else 16, trees)
    if rank == 2:  # handed another plan (another cap)
        plan, forest = make_plan(rows, 1, 4, 44 if trees else 24, trees)
    try:
        seqpack.hybrid_cp_micro_batches({"input_ids": ids}, lengths, plan, forest=forest)
    except ValueError as exc:
        return str(exc)
    return "no error"


def other_lengths_or_trees_raise_everywhere(rank, world, what):
    # Issue 51, finding 8: a rank whose plan differs only in its lengths (or that
    # lays out rows where the others lay out trees) used to run the step.
    import dataclasses

    trees = what == "forest"
    rows = grpo_rows() if trees else long_tail_rows()
    ids, lengths = padded(rows)
    plan, forest = make_plan(rows, 1, 4, 30 if trees else 16, trees)
    if rank == 2 and what == "lengths":  # the same cells over other lengths (one row a token shorter)
        lengths = lengths.clone()
        lengths[-1] -= 1
        other = plan.lengths.copy()
        other[-1] -= 1
        other.flags.writeable = False
        plan = dataclasses.replace(plan, lengths=other)
    if rank == 2 and what == "forest":
        forest = None
    try:
        seqpack.hybrid_cp_micro_batches({"input_ids": ids}, lengths, plan, forest=forest)
    except ValueError as exc:
        return str(exc)
    return "no error"


def a_bad_rank_raises_everywhere(rank, world):
    rows = long_tail_rows()
    ids, lengths = padded(rows)
    plan, _ = make_plan(rows, 1, 4, 16, False)
    if rank == 1:
        lengths = lengths[:-1]  # its rows do not cover the plan
    try:
        seqpack.hybrid_cp_micro_batches({"input_ids": ids}, lengths, plan)
    except (ValueError, IndexError) as exc:
        return type(exc).__name__ + ": " + str(exc)
    return "no error"


@pytest.fixture(scope="module")
def pool():
    for pools in started_pools((4,)):
        yield pools[4]


@pytest.mark.parametrize("dp, cp, cap, trees", [(1, 4, 16, False), (2, 2, 32, False), (1, 4, 30, True),
                                                 (2, 2, 42, True)])
def test_hybrid_step_equals_one_process(pool, dp, cp, cap, trees):
    got = values_of(pool, step_matches_one_process, dp, cp, cap, trees, timeout_s=CASE_TIMEOUT_S)
    assert all(g == got[0] for g in got)


@pytest.mark.parametrize("dp, cp, cap, trees, fused", [(2, 2, 32, False, False), (1, 4, 16, False, True),
                                                        (1, 4, 30, True, False)])
def test_nemo_rl_loss_wrapper_on_hybrid_micro_batches(pool, dp, cp, cap, trees, fused):
    values_of(pool, nemo_rl_step_matches_one_process, dp, cp, cap, trees, fused, timeout_s=CASE_TIMEOUT_S)


@pytest.mark.parametrize("trees", [False, True])
def test_a_rank_with_another_plan_raises_on_every_rank(pool, trees):
    got = values_of(pool, another_plan_raises_everywhere, trees, timeout_s=CASE_TIMEOUT_S)
    assert all("disagree on" in g and "the plan's" in g for g in got), got


@pytest.mark.parametrize("what, named", [("lengths", "the plan's lengths"),
                                         ("forest", "the parts' prefix trees")])
def test_a_rank_with_other_lengths_or_no_trees_raises_on_every_rank(pool, what, named):
    got = values_of(pool, other_lengths_or_trees_raise_everywhere, what, timeout_s=CASE_TIMEOUT_S)
    assert all("disagree on" in g and named in g for g in got), got


def test_a_rank_whose_rows_fail_raises_on_every_rank(pool):
    got = values_of(pool, a_bad_rank_raises_everywhere, timeout_s=CASE_TIMEOUT_S)
    assert "another rank's input failed" in got[0] and "another rank's input failed" not in got[1], got
