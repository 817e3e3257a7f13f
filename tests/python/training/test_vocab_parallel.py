"""``vocab_parallel_gather_columns`` (issue 30, item 2): NeMo-RL's column gather of
vocabulary-parallel logits. One process: a plain gather (out-of-vocabulary columns
0), and a softmax over the gathered columns is the full softmax restricted to them.
On 2 and 3 gloo ranks: every rank's result equals the gather of the full logits,
each rank's gradient is the full gradient's slice (NeMo-RL's backward), and a rank
with other shapes makes every rank raise."""

import pytest
import torch
import torch.distributed as dist
from _gloo import started_pools, values_of

from seqpack.loss import vocab_parallel_gather_columns

WORLDS = (2, 3)
CASE_TIMEOUT_S = 60


def full_gather(logits, columns):
    valid = (columns >= 0) & (columns < logits.shape[-1])
    return torch.where(valid, logits.gather(-1, columns.clamp(0, logits.shape[-1] - 1)), 0.0)


def test_one_process_is_a_gather_and_its_softmax_is_the_restricted_one():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 7, generator=g, dtype=torch.float64)
    columns = torch.tensor([[[0, 6, 3], [1, 1, 9], [2, -1, 5]],
                            [[4, 0, 6], [5, 5, 5], [7, 3, 2]]])  # 9, -1 and 7 are outside V = 7: 0
    out = vocab_parallel_gather_columns(logits, columns)
    assert out.dtype == torch.float64  # fp32 for lower precisions
    assert vocab_parallel_gather_columns(logits.to(torch.bfloat16), columns).dtype == torch.float32
    torch.testing.assert_close(out, full_gather(logits, columns), rtol=0, atol=0)
    ok = torch.tensor([[[0, 6, 3]]]).expand(2, 3, 3)
    sub = torch.log_softmax(vocab_parallel_gather_columns(logits, ok).double(), -1)
    probs = torch.softmax(logits, -1).gather(-1, ok)
    torch.testing.assert_close(sub, torch.log(probs / probs.sum(-1, keepdim=True)), rtol=1e-6, atol=1e-6)


def test_gradient_is_the_gathers_with_repeated_columns(monkeypatch):
    # The backward scatters into a fresh gradient of its own (huge pages on the CPU, from
    # any size here): gradcheck in fp64, repeated and out-of-vocabulary columns.
    from seqpack.training import _logprob_ops

    monkeypatch.setattr(_logprob_ops, "_HUGE_PAGES_FROM", 0)
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    columns = torch.tensor([[0, 0, 5], [2, 9, 2], [-1, 1, 1], [3, 4, 5]]).expand(3, 4, 3)
    assert torch.autograd.gradcheck(lambda x: vocab_parallel_gather_columns(x, columns), (logits,))
    (grad,) = torch.autograd.grad(vocab_parallel_gather_columns(logits, columns).sum(), logits)
    (want,) = torch.autograd.grad(full_gather(logits, columns).sum(), logits)
    torch.testing.assert_close(grad, want, rtol=0, atol=0)


@pytest.mark.parametrize("logits, columns, kwargs, error, match", [
    (torch.zeros(2, 5), torch.zeros(3, 2, dtype=torch.long), {}, ValueError, "leading shape"),
    (torch.zeros(2, 5), torch.zeros(2, 2), {}, TypeError, "integer token ids"),
    (torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 2, dtype=torch.long), {}, TypeError, "floating point"),
    (torch.zeros(2, 5), torch.zeros(2, 2, dtype=torch.long), {"vocab_start_index": 0, "vocab_end_index": 4},
     ValueError, r"vocabulary slice \(5\)"),
])
def test_bad_arguments_are_named(logits, columns, kwargs, error, match):
    with pytest.raises(error, match=match):
        vocab_parallel_gather_columns(logits, columns, **kwargs)


def case_tp(rank, world, seed):
    g = torch.Generator().manual_seed(seed)
    width = 5
    full = torch.randn(2, 4, width * world, generator=g, dtype=torch.float64)
    columns = torch.randint(-1, width * world + 2, (2, 4, 6), generator=g)  # some outside the vocabulary
    w = torch.randn(2, 4, 6, generator=g, dtype=torch.float64)
    ref_leaf = full.clone().requires_grad_()
    ref = full_gather(ref_leaf, columns)
    (ref * w).sum().backward()
    mine = full[..., rank * width:(rank + 1) * width].clone().requires_grad_()
    out = vocab_parallel_gather_columns(mine, columns, dist.group.WORLD)
    torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-6, atol=1e-6)
    (out.double() * w).sum().backward()  # the same loss on every rank
    torch.testing.assert_close(mine.grad, ref_leaf.grad[..., rank * width:(rank + 1) * width], rtol=1e-6,
                               atol=1e-6)
    shared = torch.randperm(width * world, generator=g)[:6]  # NeMo-RL's tp_sharded test: one [k] set
    out = vocab_parallel_gather_columns(full[..., rank * width:(rank + 1) * width], shared, dist.group.WORLD)
    torch.testing.assert_close(out, full[..., shared], rtol=0, atol=0)
    return True


def case_failing_rank(rank, world):
    logits = torch.zeros(2, 3)
    columns = torch.zeros(2, 4 if rank == 0 else 5, dtype=torch.long)
    try:
        vocab_parallel_gather_columns(logits, columns, dist.group.WORLD)
    except ValueError as exc:
        assert "disagree on the shapes of logits and columns" in str(exc), str(exc)
    else:
        raise AssertionError("every rank must raise")
    bad = torch.zeros(2, 3) if rank else torch.zeros(3, 3)
    try:
        vocab_parallel_gather_columns(bad, torch.zeros(2, 4, dtype=torch.long), dist.group.WORLD)
    except ValueError as exc:
        assert ("leading shape" if rank == 0 else "another rank's input failed") in str(exc), str(exc)
    else:
        raise AssertionError("every rank must raise")
    return True


@pytest.fixture(scope="module")
def pools():
    yield from started_pools(WORLDS)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case, args", [(case_tp, (0,)), (case_tp, (5,)), (case_failing_rank, ())],
                         ids=["tp-seed0", "tp-seed5", "failing-rank"])
def test_on_gloo_ranks(pools, world, case, args):
    assert values_of(pools[world], case, *args, timeout_s=CASE_TIMEOUT_S) == [True] * world  # a hang raises


def case_tp_cp(rank, world, seed):
    """NeMo-RL's cp_group: a 2 x (world / 2) grid would need 4 ranks; here CP alone
    over every rank (TP None) and CP with a TP group of one: each rank holds its
    zigzag rows of [B, S_cp, V]; the result is the whole rows' gather, the gradient
    (the same loss on every rank, / cp) the rank's rows of the full one."""
    from seqpack.cp import cp_local_rows

    g = torch.Generator().manual_seed(seed)
    batch, full_len, vocab, k = 2, 7, 6, 3
    padded = -(-full_len // (2 * world)) * 2 * world
    logits = torch.randn(batch, padded, vocab, generator=g, dtype=torch.float64)
    columns = torch.randint(0, vocab, (batch, full_len, k), generator=g)
    w = torch.randn(batch, full_len, k, generator=g, dtype=torch.float64)
    leaf = logits.clone().requires_grad_()
    ref = full_gather(leaf[:, :full_len], columns)
    (ref * w).sum().backward()
    cu = [i * padded for i in range(batch + 1)]
    mine = cp_local_rows(logits.reshape(batch * padded, vocab), cu, world, rank).view(batch, padded // world, vocab)
    mine = mine.clone().requires_grad_()
    out = vocab_parallel_gather_columns(mine, columns, None, dist.group.WORLD, chunk_size=4)
    torch.testing.assert_close(out, ref.detach(), rtol=0, atol=0)
    ((out * w).sum() / world).backward()
    expect = cp_local_rows(leaf.grad.reshape(batch * padded, vocab), cu, world, rank).view(mine.shape)
    torch.testing.assert_close(mine.grad, expect, rtol=1e-12, atol=1e-12)
    return True


@pytest.mark.parametrize("world", WORLDS)
def test_context_parallel_on_gloo_ranks(pools, world):
    assert values_of(pools[world], case_tp_cp, 4, timeout_s=CASE_TIMEOUT_S) == [True] * world


def test_nemo_rls_column_gather_tests():
    # NeMo-RL test_vocab_parallel_gather_columns_no_tp: bf16 logits, one [k] set of
    # columns for every position; fp32 and exactly the upcast gather.
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 10, generator=g).to(torch.bfloat16)
    idx = torch.tensor([1, 4, 7])
    out = vocab_parallel_gather_columns(logits, idx)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, logits[..., idx].float(), rtol=0, atol=0)
    # test_subset_softmax_matches_full_vocab_reference, T in {1, 2}: the subset
    # log-softmax of the gathered columns is the full one restricted and renormalised,
    # values and gradients.
    for temperature in (1.0, 2.0):
        base = torch.randn(2, 6, 64, generator=g)
        cols = torch.randperm(64, generator=g)[:8].sort().values
        x = base.clone().requires_grad_()
        full = torch.log_softmax(x / temperature, -1)[..., cols]
        ref = full - torch.logsumexp(full, -1, keepdim=True)
        y = base.clone().requires_grad_()
        new = torch.log_softmax(vocab_parallel_gather_columns(y, cols) / temperature, -1)
        torch.testing.assert_close(new, ref, rtol=1e-6, atol=1e-6)
        ref.sum().backward()
        new.sum().backward()
        torch.testing.assert_close(y.grad, x.grad, rtol=1e-6, atol=1e-6)


def test_an_emulated_tp_group_is_used_as_given(monkeypatch):
    """NeMo-RL's test_vocab_parallel_gather_columns_tp_sharded emulates 2 TP ranks with
    torch.distributed not initialised, patching get_rank, get_world_size and
    all_reduce: the group is used as given (issue 38: it was taken for one rank and
    gave wrong values). A group torch.distributed cannot size is refused."""
    import torch.distributed as dist

    g = torch.Generator().manual_seed(3)
    full = torch.randn(3, 8, dtype=torch.float64, generator=g)
    columns = torch.tensor([1, 6, 3, 7])
    shards = full.split(4, dim=-1)
    other = {0: 1, 1: 0}
    state = {"rank": 0}

    def all_reduce(t, op=None, group=None):  # the other rank's contribution, computed here
        me = state["rank"]
        state["rank"] = other[me]
        try:
            t += vocab_parallel_gather_columns_local(shards[other[me]], columns, other[me])
        finally:
            state["rank"] = me

    def vocab_parallel_gather_columns_local(shard, cols, rank):
        ids = cols.expand(shard.shape[0], -1)
        owned = (ids >= rank * 4) & (ids < rank * 4 + 4)
        return torch.where(owned, shard.gather(-1, (ids - rank * 4).clamp(0, 3)), 0.0)

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: state["rank"])
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    for rank in (0, 1):
        state["rank"] = rank
        out = vocab_parallel_gather_columns(shards[rank], columns, tp_group=object())
        torch.testing.assert_close(out, full[:, columns])
    monkeypatch.undo()
    if not dist.is_initialized():
        with pytest.raises(ValueError, match="tp_group was given but torch.distributed cannot size it"):
            vocab_parallel_gather_columns(shards[0], columns, tp_group=object())
