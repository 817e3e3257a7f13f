"""Real torch.distributed (gloo, CPU processes): all_gather, the micro-batch count
agreement of the ROLL/verl planners (and their synchronised errors), batch_balance."""

import datetime
import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from seqpack import BatchedDataDict, roll
from seqpack.verl import rearrange_micro_batches

TIMEOUT_S = 120


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def check_loss_context_parallel(rank, world):
    # Every rank holds its zigzag rows of the packed logits; the loss (same on every
    # rank) / cp backwards into exactly the unpacked gradient of those rows.
    from seqpack import cp_partition_indices
    from seqpack.loss import ClippedPGLoss, SequencePackingLossWrapper
    from test_loss import PG_CFG, make_batch, unpacked_loss

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
    from test_loss import make_batch, unpacked_loss

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


CHECKS = {"all_gather": check_all_gather, "count_agreement": check_count_agreement,
          "synchronised_error": check_synchronised_error, "batch_balance": check_batch_balance,
          "loss_context_parallel": check_loss_context_parallel, "loss_vocab_parallel": check_loss_vocab_parallel}


def worker(rank, world, port, names, errors):
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        for name in names:
            CHECKS[name](rank, world)
    except BaseException:  # report to the parent, which fails the test
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(world, names):
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, names, errors)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(TIMEOUT_S)
        alive = [p for p in procs if p.is_alive()]
        assert not alive, f"{len(alive)} ranks still running after {TIMEOUT_S} s"
        failures = []
        while not errors.empty():
            failures.append(errors.get())
        assert not failures, "\n".join(failures)
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_ranks(world):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    run_world(world, list(CHECKS))


def test_gloo_four_context_parallel_ranks():
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    run_world(4, ["loss_context_parallel"])
