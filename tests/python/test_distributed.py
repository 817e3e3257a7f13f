"""Real torch.distributed (gloo, CPU processes): all_gather, the micro-batch count
agreement of the ROLL/verl planners (and their synchronised errors), batch_balance,
the CP/vocab-parallel losses, cp_attention (and its synchronised errors). The
spawn harness is in _gloo.py; test_distributed_properties.py draws failing ranks
at random."""

import os
import sys

import pytest
import torch
import torch.distributed as dist
from _gloo import run_world

from seqpack import BatchedDataDict, roll
from seqpack.verl import rearrange_micro_batches

TIMEOUT_S = 120


def mask_of(lengths, width):
    return (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()


def check_all_gather(rank, world):
    data = BatchedDataDict(x=torch.arange(rank + 1) + 10 * rank, h=torch.ones(rank + 1, 3) * rank,
                           names=[f"{rank}.{i}" for i in range(rank + 1)])
    out = data.all_gather(dist.group.WORLD)
    assert out["x"].tolist() == [v for r in range(world) for v in range(10 * r, 10 * r + r + 1)]
    assert out["h"][:, 0].tolist() == [float(r) for r in range(world) for _ in range(r + 1)]
    assert out["names"] == [f"{r}.{i}" for r in range(world) for i in range(r + 1)]


def check_count_agreement(rank, world):
    # Longer rows on higher ranks: the last rank needs the most micro-batches.
    lengths = [40 + 20 * rank + (i % 3) for i in range(8)]
    batch = {"attention_mask": mask_of(lengths, 128), "row": torch.arange(len(lengths))}
    mbs, idx = rearrange_micro_batches(batch, max_token_len=160)
    counts = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    dist.all_gather(counts, torch.tensor([len(mbs)]))
    assert len({int(c) for c in counts}) == 1, counts
    assert all(int(mb["attention_mask"].sum()) <= 160 for mb in mbs)
    assert sorted(i for p in idx for i in p) == list(range(len(lengths)))
    packed = list(roll.make_micro_batch_iter_for_sequence_packing(batch, max_packed_sequence_length=192, vp_size=2,
                                                                  dp_group=dist.group.WORLD))
    dist.all_gather(counts, torch.tensor([len(packed)]))
    assert len({int(c) for c in counts}) == 1 and len(packed) % 2 == 0
    own = roll.make_micro_batch_iter_for_sequence_packing(batch, max_packed_sequence_length=192, dp_group=None)
    assert len(list(own)) >= 1  # default group initialised: still agreed


def check_synchronised_error(rank, world):
    # Rank 0 has one row, the others need several micro-batches: every rank raises.
    lengths = [10] if rank == 0 else [100, 100, 100]
    batch = {"attention_mask": mask_of(lengths, 100)}
    with pytest.raises(ValueError, match="same micro-batch count across DP ranks"):
        rearrange_micro_batches(batch, max_token_len=100)
    dist.barrier()  # nobody is stuck in a collective


def check_batch_balance(rank, world):
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(1, 400, (8 * world,), generator=g).tolist()
    batch = {"attention_mask": mask_of(lengths, 400), "row": torch.arange(len(lengths))}
    metrics = roll.batch_balance(batch, dp_size=world, minibatch_size=len(lengths))
    mine = batch["attention_mask"][rank * 8:(rank + 1) * 8].sum()
    lo, hi = mine.clone(), mine.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    assert (int(lo), int(hi)) == (metrics["global_seqlen/balanced_min"], metrics["global_seqlen/balanced_max"])


def _loss_helpers(*names):
    """Helpers of training/test_loss.py, importable in a spawned rank whatever
    pytest put on the parent's path."""
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "training")
    if here not in sys.path:
        sys.path.insert(0, here)
    import test_loss

    return tuple(getattr(test_loss, n) for n in names)


def check_loss_context_parallel(rank, world):
    # Every rank holds its zigzag rows of the packed logits; the loss (same on every
    # rank) / cp backwards into exactly the unpacked gradient of those rows.
    from seqpack.tensors.cp import cp_partition_indices
    from seqpack.loss import ClippedPGLoss, SequencePackingLossWrapper
    PG_CFG, make_batch, unpacked_loss = _loss_helpers("PG_CFG", "make_batch", "unpacked_loss")

    lengths = [7, 1, 12, 5]
    data, unpacked, packed, cu, cu_p, gvt, gvs = make_batch(lengths, 12, 48, seed=5, multiple=2 * world)
    loss_fn = ClippedPGLoss({**PG_CFG, "entropy_coef": 0.01})
    base = unpacked.clone().requires_grad_()
    base_loss, base_metrics = unpacked_loss(loss_fn, base, data, gvs, gvt)
    base_loss.backward()
    full_grad = torch.zeros_like(packed)
    for i, n in enumerate(lengths):
        full_grad[cu_p[i]: cu_p[i] + n] = base.grad[i, :n]
    rows = torch.from_numpy(cp_partition_indices(cu_p, world, rank))
    for fused in (False, True):
        local = packed[rows].clone().requires_grad_()
        wrapper = SequencePackingLossWrapper(loss_fn, None, cu, cu_p, context_parallel_group=dist.group.WORLD,
                                             fused=fused)
        loss, metrics = wrapper(local[None], data, gvs, gvt)
        torch.testing.assert_close(loss, base_loss, rtol=1e-6, atol=1e-7)
        (loss / world).backward()
        torch.testing.assert_close(local.grad, full_grad[rows], rtol=1e-5, atol=1e-7)
        assert metrics["loss"] == pytest.approx(base_metrics["loss"], rel=1e-5)


def check_loss_vocab_parallel(rank, world):
    from seqpack.loss import NLLLoss, SequencePackingLossWrapper
    make_batch, unpacked_loss = _loss_helpers("make_batch", "unpacked_loss")

    lengths = [6, 3, 9]
    vocab = 48
    data, unpacked, packed, cu, cu_p, gvt, gvs = make_batch(lengths, 9, vocab, seed=6)
    base = unpacked.clone().requires_grad_()
    base_loss, _ = unpacked_loss(NLLLoss(), base, data, gvs, gvt)
    base_loss.backward()
    width = vocab // world
    cols = slice(rank * width, (rank + 1) * width)
    for fused in (False, True):
        local = packed[:, cols].clone().requires_grad_()
        wrapper = SequencePackingLossWrapper(NLLLoss(), None, cu, cu_p, vocab_parallel_rank=rank,
                                             vocab_parallel_group=dist.group.WORLD, fused=fused)
        loss, _ = wrapper(local, data, gvs, gvt)
        torch.testing.assert_close(loss, base_loss, rtol=1e-6, atol=1e-7)
        loss.backward()
        for i, n in enumerate(lengths):
            torch.testing.assert_close(local.grad[cu_p[i]: cu_p[i] + n], base.grad[i, :n, cols], rtol=1e-5,
                                       atol=1e-7)


def check_linear_vocab_parallel(rank, world):
    """token_logprobs with the LM head (weight=) and its vocabulary split over the
    ranks: log-probs, entropies and every gradient equal the single-rank computation."""
    import seqpack

    g = torch.Generator().manual_seed(3)
    cu, width, hidden = [0, 7, 11, 21], 12, 6
    vocab = width * world
    h = torch.randn(21, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) / hidden**0.5
    b = torch.randn(vocab, generator=g)
    ids = torch.randint(0, vocab, (21,), generator=g)
    leaves = [t.clone().requires_grad_() for t in (h, w, b)]
    full = seqpack.token_logprobs(leaves[0], cu, ids, weight=leaves[1], bias=leaves[2], return_entropy=True)
    (full.logprobs.sum() + 0.5 * full.entropy.sum()).backward()
    cols = slice(rank * width, (rank + 1) * width)
    mine = [h.clone().requires_grad_(), w[cols].clone().requires_grad_(), b[cols].clone().requires_grad_()]
    out = seqpack.token_logprobs(mine[0], cu, ids, weight=mine[1], bias=mine[2], return_entropy=True, chunk_tokens=5,
                                 vocab_parallel_group=dist.group.WORLD, vocab_start=rank * width)
    torch.testing.assert_close(out.logprobs, full.logprobs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.entropy, full.entropy, rtol=1e-5, atol=1e-6)
    (out.logprobs.sum() + 0.5 * out.entropy.sum()).backward()
    torch.testing.assert_close(mine[0].grad, leaves[0].grad, rtol=1e-5, atol=1e-6)  # all-reduced over the group
    torch.testing.assert_close(mine[1].grad, leaves[1].grad[cols], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mine[2].grad, leaves[2].grad[cols], rtol=1e-5, atol=1e-6)


def check_cp_attention(rank, world):
    # Zigzag-local q/k/v on every rank; cp_attention's rows and gradients equal the
    # full varlen attention's rows of this rank (CP=world), GQA, all heads at once
    # and one KV head at a time (re-gathered in the backward).
    from types import SimpleNamespace

    import numpy as np

    from seqpack import varlen_attention
    from seqpack.training.attention import cp_attention
    from seqpack.cp import cp_local_rows

    lengths = [1, 13, 2 * world, 5, 31]
    multiple = 2 * world
    padded = [-(-n // multiple) * multiple for n in lengths]
    cu_p = np.concatenate([[0], np.cumsum(padded)]).astype(np.int32)
    total = int(cu_p[-1])
    g = torch.Generator().manual_seed(11)
    full = [torch.randn(total, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2)]
    w = torch.randn(total, 4, 8, generator=g, dtype=torch.float64)
    batch = SimpleNamespace(cu_seqlens_padded=cu_p, cp_size=world, cp_rank=rank)
    local_w = cp_local_rows(w, cu_p, world, rank)
    for causal, heads in ((True, None), (True, 1), (False, None)):
        leaves = [t.clone().requires_grad_() for t in full]
        ref = varlen_attention(*leaves, cu_p, cu_p, max(padded), max(padded), causal=causal)
        (ref * w).sum().backward()
        local = [cp_local_rows(t, cu_p, world, rank).clone().requires_grad_() for t in full]
        out = cp_attention(*local, batch, dist.group.WORLD, causal=causal, kv_heads_per_chunk=heads)
        torch.testing.assert_close(out, cp_local_rows(ref.detach(), cu_p, world, rank), rtol=1e-10, atol=1e-12)
        (out * local_w).sum().backward()
        for mine, leaf in zip(local, leaves):
            torch.testing.assert_close(mine.grad, cp_local_rows(leaf.grad, cu_p, world, rank), rtol=1e-10,
                                       atol=1e-12)
    with pytest.raises(ValueError, match="packed_batch was built for cp_size"):
        cp_attention(*local, SimpleNamespace(cu_seqlens_padded=cu_p, cp_size=world + 1, cp_rank=rank))


def check_train_dp_cp(rank, world):
    # DP=2 x CP=2: NeMo-RL-style packed shards and micro-batches per DP rank, each
    # micro-batch zigzag-split over the CP pair (cp_attention + fused loss); the
    # all-reduced gradients equal one process's padded training step.
    import seqpack
    from seqpack.testing.tiny_model import TinyCausalLM, TinyConfig, packed_loss, padded_loss

    assert world == 4
    dp, cp = rank // 2, rank % 2
    cp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dist.new_group([0, 2]), dist.new_group([1, 3])  # DP groups: created by every rank, in the same order
    cfg = TinyConfig(vocab_size=101, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)
    torch.manual_seed(0)
    model = TinyCausalLM(cfg)
    g = torch.Generator().manual_seed(5)
    lengths = torch.tensor([3, 60, 1, 9, 22, 5, 41, 2, 14, 7, 33, 4, 18, 2, 11, 6])
    width = int(lengths.max())
    mask = (torch.arange(width)[None] < lengths[:, None]).long()
    ids = torch.randint(0, cfg.vocab_size, (len(lengths), width), generator=g) * mask
    tokens = float((lengths - 1).sum())
    padded_loss(model, ids, mask, tokens).backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    data = seqpack.BatchedDataDict(input_ids=ids, input_lengths=lengths)
    shards, _ = data.shard_by_batch_size(2, sequence_packing_args=dict(
        max_tokens_per_microbatch=72, input_key="input_ids", input_lengths_key="input_lengths",
        algorithm="modified_first_fit_decreasing", sequence_length_pad_multiple=4))
    count = 0
    for mb in shards[dp].make_packed_microbatch_iterator(["input_ids"], cp_size=2, cp_rank=cp):
        packed_loss(model, mb, tokens, cp_groups[dp]).backward()
        count += 1
    counts = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    dist.all_gather(counts, torch.tensor([count]))
    assert len({int(c) for c in counts}) == 1 and count >= 2, counts
    for n, p in model.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad)
        scale = reference[n].abs().max()
        assert float((grad - reference[n]).abs().max() / scale) <= 1e-5, n


def check_step_plan(rank, world):
    """Every rank plans the step alone from the same global lengths; the plans agree
    without any communication, every rank runs the same number of lock-step
    collectives (one per micro-batch, dummies included), and the plan's
    valid_tokens is the all-reduced count of loss tokens."""
    from seqpack import CostModel, plan_step
    from seqpack.testing.pipelines import rl_long_tail

    lengths = rl_long_tail(16 * world + 3, seed=11, max_len=2048).tolist()
    plan = plan_step(lengths, world, 4096, cost=CostModel.verl(), mini_batches=2, min_micro_batches=2, seed=5)
    plans = [None] * world
    dist.all_gather_object(plans, plan.assignment)  # only to check that they agree
    assert all(p == plans[0] for p in plans)
    for m in range(2):
        mine = torch.zeros(1, dtype=torch.long)
        for cell in plan.assignment[m][rank]:
            tokens = torch.tensor([sum(lengths[i] for i in cell)], dtype=torch.long)
            mine += tokens
            dist.all_reduce(tokens)  # the FSDP lock-step: one collective per micro-batch on every rank
        dist.all_reduce(mine)
        assert mine.item() == plan.valid_tokens(lengths)[m]


def check_a_failing_rank_stops_every_rank(rank, world):
    """One rank's input breaks a rule (a sequence over the cap, no attention_mask):
    it raises its own error and every other rank raises too, instead of waiting in
    the count agreement's all-reduce (bounded by the test's timeout)."""
    from seqpack import roll
    from seqpack.verl import rearrange_micro_batches

    mask = torch.ones(4, 6, dtype=torch.long)
    if rank == world - 1:
        mask = torch.cat([mask, torch.ones(4, 4, dtype=torch.long)], 1)  # 10 tokens: over the cap of 8
    calls = [lambda b: rearrange_micro_batches(b, max_token_len=8),
             lambda b: list(roll.make_micro_batch_iter_for_sequence_packing(
                 roll.RollBatch(b, meta_info={}), max_packed_sequence_length=8, pad_multiple=1))]
    for call in calls:
        try:
            call({"attention_mask": mask, "input_ids": torch.zeros_like(mask)})
        except ValueError as exc:
            expected = "more than max_token_len" if rank == world - 1 else "another rank's input failed"
            assert expected in str(exc) or "exceeds max_packed_sequence_length" in str(exc), str(exc)
        else:
            raise AssertionError("every rank must raise")
    batch = {"input_ids": torch.zeros(4, 6, dtype=torch.long)}
    if rank != 0:
        batch["attention_mask"] = torch.ones(4, 6, dtype=torch.long)
    try:  # rank 0 has no attention_mask
        rearrange_micro_batches(batch, max_token_len=8)
    except ValueError as exc:
        assert ("attention_mask" in str(exc)) if rank == 0 else ("another rank's input failed" in str(exc))
    else:
        raise AssertionError("every rank must raise")
    dist.barrier()  # and they are still in step


def check_cp_attention_failing_rank(rank, world):
    """One rank's q or k has the wrong rows or head dim, or it claims another
    rank's cp_rank: that rank raises its own error and every other rank a
    ValueError, instead of waiting in the K/V all-gather. K/V with fewer heads on
    one rank pass that rank's own checks but not the fingerprint: every rank raises
    the same error. The failing rank stays alive (it goes on to the next case), so
    only the agreement can stop the others (the test's timeout bounds a hang); then
    the normal path still matches the full attention."""
    from types import SimpleNamespace

    import numpy as np

    from seqpack import varlen_attention
    from seqpack.training.attention import cp_attention
    from seqpack.cp import cp_local_rows

    multiple = 2 * world
    padded = [multiple, 3 * multiple, 2 * multiple]
    cu_p = np.concatenate([[0], np.cumsum(padded)]).astype(np.int32)
    g = torch.Generator().manual_seed(3)
    full = [torch.randn(int(cu_p[-1]), h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2)]
    batch = SimpleNamespace(cu_seqlens_padded=cu_p, cp_size=world, cp_rank=rank)
    q, k, v = (cp_local_rows(t, cu_p, world, rank) for t in full)
    last = world - 1
    cases = [  # (failing rank, its q, k, v, its batch, its error)
        (last, (torch.cat([q, q[:1]]), k, v), batch, "must hold this rank's"),
        (0, (q, k[:-1], v[:-1]), batch, "must hold this rank's"),
        (last, (q, k[..., :4], v), batch, "same head dim"),
        (last, (q, k, v), SimpleNamespace(cu_seqlens_padded=cu_p, cp_size=world, cp_rank=0), "was built for"),
        (0, (q, k[:, :1], v[:, :1]), batch, None),  # passes its own checks (GQA 4:1), not the fingerprint
    ]
    for bad, inputs, its_batch, error in cases:
        args = inputs + (its_batch,) if rank == bad else (q, k, v, batch)
        try:
            cp_attention(*args, dist.group.WORLD)
        except ValueError as exc:
            expected = ("disagree on the shapes of q, k and v" if error is None
                        else error if rank == bad else "another rank's input failed")
            assert expected in str(exc), (bad, error, str(exc))
        else:
            raise AssertionError(f"every rank must raise (rank {bad}: {error})")
    ref = cp_local_rows(varlen_attention(*full, cu_p, cu_p, max(padded), max(padded)), cu_p, world, rank)
    for agree in (True, False):  # still in step, still right; agree=False: no all-reduce
        out = cp_attention(q, k, v, batch, dist.group.WORLD, agree=agree)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)


def engine_rows(rank, groups):
    """verl's engine TensorDict (nested ``input_ids``, padded prompt / response masks)
    of ``groups`` GRPO groups: a 20-token prompt, 4 responses of 3-7 tokens."""
    import tensordict

    g = torch.Generator().manual_seed(rank)
    prompts, responses = [], []
    for _ in range(groups):
        prompt = torch.randint(3, 90, (20,), generator=g)
        for _ in range(4):
            prompts.append(prompt)
            responses.append(torch.randint(3, 90, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g))
    rows_ = [torch.cat([p, r]) for p, r in zip(prompts, responses)]
    width = max(len(r) for r in responses)
    rm = torch.stack([(torch.arange(width) < len(r)).long() for r in responses])
    return tensordict.TensorDict({
        "prompts": torch.stack(prompts), "attention_mask": torch.cat([torch.ones(len(rows_), 20).long(), rm], 1),
        "response_mask": rm, "loss_mask": rm,
        "input_ids": torch.nested.as_nested_tensor(rows_, layout=torch.jagged),
        "position_ids": torch.nested.as_nested_tensor([torch.arange(len(r)) for r in rows_], layout=torch.jagged),
    }, batch_size=[len(rows_)])


def check_prefix_reuse_count_agreement(rank, world):
    # More groups on higher ranks, trees of ~40 tokens under a cap of 24: passes, counts agreed.
    td = engine_rows(rank, 1 + rank)
    mbs, parts = rearrange_micro_batches(td, max_token_len=24, shared_prefix=True, prefix_reuse=True,
                                         dp_group=dist.group.WORLD)
    counts = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    dist.all_gather(counts, torch.tensor([len(mbs)]))
    assert len({int(c) for c in counts}) == 1, counts
    passes = [mb for mb in mbs if "seqpack_pass" in mb.keys()]
    assert passes and sorted(set(i for p in parts for i in p)) == list(range(len(td)))
    assert torch.equal(sum(mb["response_mask"] for mb in passes), td["response_mask"][torch.tensor(parts[0])])
    # a rank whose batch cannot run passes (padded rows) makes every rank raise, none waits
    bad = {"attention_mask": td["attention_mask"], "input_ids": torch.zeros(len(td), 30, dtype=torch.long)}
    with pytest.raises(ValueError, match="verl's engine TensorDicts" if rank == 0 else "another rank"):
        rearrange_micro_batches(bad if rank == 0 else td, max_token_len=24, shared_prefix=True, prefix_reuse=True,
                                dp_group=dist.group.WORLD)
    # ROLL's packer: the same, its count read from the first micro-batch (the passes run lazily)
    ids = td["input_ids"].to_padded_tensor(0)
    mini = {"input_ids": ids, "attention_mask": (ids != 0).long(), "prompt_id": torch.arange(len(td)) // 4}
    first = next(roll.make_micro_batch_iter_for_sequence_packing(
        mini, max_packed_sequence_length=24, shared_prefix=True, prefix_reuse=True, group_key="prompt_id",
        dp_group=dist.group.WORLD, is_train=True))
    dist.all_gather(counts, torch.tensor([first.meta_info["num_micro_batchs"]]))
    assert len({int(c) for c in counts}) == 1 and "prefix_pass" in first.meta_info, counts
    with pytest.raises(ValueError, match="needs the batch's 'input_ids'" if rank == 0 else "another rank"):
        roll.make_micro_batch_iter_for_sequence_packing(
            {"attention_mask": mini["attention_mask"]} if rank == 0 else mini, max_packed_sequence_length=24,
            shared_prefix=True, prefix_reuse=True, dp_group=dist.group.WORLD, is_train=True)
    dist.barrier()


CHECKS = {"all_gather": check_all_gather, "count_agreement": check_count_agreement,
          "synchronised_error": check_synchronised_error, "batch_balance": check_batch_balance,
          "loss_context_parallel": check_loss_context_parallel, "loss_vocab_parallel": check_loss_vocab_parallel,
          "cp_attention": check_cp_attention, "train_dp_cp": check_train_dp_cp, "step_plan": check_step_plan,
          "linear_vocab_parallel": check_linear_vocab_parallel,
          "failing_rank_stops_every_rank": check_a_failing_rank_stops_every_rank,
          "cp_attention_failing_rank": check_cp_attention_failing_rank,
          "prefix_reuse_count_agreement": check_prefix_reuse_count_agreement}


def run_checks(rank, world, names):
    for name in names:
        CHECKS[name](rank, world)


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_ranks(world):  # every check but train_dp_cp (4 ranks), on 2 and 3 ranks
    run_world(world, run_checks, ([name for name in CHECKS if name != "train_dp_cp"],), TIMEOUT_S)


def test_gloo_four_context_parallel_ranks():
    run_world(4, run_checks, (["loss_context_parallel", "cp_attention", "train_dp_cp"],), TIMEOUT_S)
