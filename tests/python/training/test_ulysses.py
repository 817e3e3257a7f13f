"""Ulysses sequence parallelism (issue 18): ``seqpack.attention`` on a Ulysses cut
(``seqpack.shard_layout(batch, world, rank, scheme="ulysses")``), the implementation
``seqpack.training.attention_ulysses.ulysses_attention`` (non-causal and windowed
rows, the agreement) and ``PackedBatch.ulysses_slice`` / ``ulysses_gather``.

On 2 and 4 gloo ranks (one _gloo.RankPool per world size for the module, started
together): every rank's rows of the output and of the q/k/v gradients equal the
single-process varlen attention over the whole stream (causal and not, GQA with
KV heads replicated to the group size, a sliding window, a v head dim of its own,
tail padding that must not leak); one rank's bad input makes every rank raise
(never a hang: each case is bounded by the pool's timeout); and the tiny model
trained a few SGD steps with DP 2 x Ulysses 2 gives the single-process padded
run's losses, gradients and weights.
"""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _gloo import started_pools, values_of

import seqpack
from seqpack import varlen_attention
from seqpack.training.attention_ulysses import _repeat_kv, ulysses_attention

CASE_TIMEOUT_S = 30
WORLDS = (2, 4)
OTHERS = "another rank's input failed"


def _batch(lengths, pad_multiple=1):
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    return seqpack.pack_sequences({"input_ids": ids}, seq_lens=lengths, pad_multiple=pad_multiple)


# ------------------------------------------------------------------ one process
def test_slice_pads_the_stream_and_the_slices_rebuild_it():
    batch = _batch([5, 1, 12, 3])  # T = 21
    x = torch.randn(21, 3, requires_grad=True)
    for world in (1, 2, 4, 5, 21, 25):
        n = math.ceil(21 / world)
        parts = [batch.ulysses_slice(x, r, world, fill=-1.0) for r in range(world)]
        assert all(p.shape == (n, 3) for p in parts)
        whole = torch.cat(parts)
        assert torch.equal(whole[:21], x) and bool((whole[21:] == -1).all())
    batch.ulysses_slice(x, 1, 4).sum().backward()  # differentiable: rows 6..11 get 1
    assert x.grad[:, 0].tolist() == [0.0] * 6 + [1.0] * 6 + [0.0] * 9


def test_slice_names_and_position_ids():
    ids = torch.arange(1, 13).view(3, 4)
    batch = seqpack.pack_sequences({"input_ids": ids}, seq_lens=[4, 1, 2], pad_multiple=2)  # T = 4 + 2 + 2 = 8
    assert batch.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 0, 1]
    got = [batch.ulysses_slice("position_ids", r, 3).tolist() for r in range(3)]
    assert got == [[0, 1, 2], [3, 0, 1], [0, 1, 0]]  # the one padding row counts from 0 (verl)
    assert batch.ulysses_slice("input_ids", 1, 3).tolist() == [4, 5, 0]
    assert batch.ulysses_slice("input_ids", 2, 3, fill=-7).tolist() == [9, 10, -7]


def test_slice_of_mrope_position_ids_cuts_the_token_dim():
    # M-RoPE ids pack to [3, T]: slices cut T (the last dim) for every component.
    ids = torch.arange(1, 7).view(2, 3)
    mrope = torch.stack([torch.arange(3).expand(2, 3) + 10 * c for c in range(3)])  # [3, B, S]
    batch = seqpack.pack_sequences({"input_ids": ids, "position_ids": mrope}, seq_lens=[3, 2])  # T = 5
    got = [batch.ulysses_slice("position_ids", r, 2) for r in range(2)]
    assert [g.shape for g in got] == [(3, 3), (3, 3)]
    assert got[0].tolist() == [[0, 1, 2], [10, 11, 12], [20, 21, 22]]
    assert got[1].tolist() == [[0, 1, 0], [10, 11, 0], [20, 21, 0]]  # the padding token counts from 0
    assert batch.ulysses_slice(batch["position_ids"], 1, 2, fill=-1)[:, -1].tolist() == [-1, -1, -1]


def test_slice_errors():
    batch = _batch([3, 2])
    x = torch.zeros(5)
    with pytest.raises(ValueError, match="rank must be in"):
        batch.ulysses_slice(x, 2, 2)
    with pytest.raises(ValueError, match="world"):
        batch.ulysses_slice(x, 0, 0)
    with pytest.raises(ValueError, match="x must hold the 5 rows of the packed stream in its first or last"):
        batch.ulysses_slice(torch.zeros(4), 0, 2)
    with pytest.raises(ValueError, match="names no tensor"):
        batch.ulysses_slice("labels", 0, 2)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        batch.ulysses_slice(np.zeros(5), 0, 2)
    cp = seqpack.pack_sequences(torch.zeros(2, 4), seq_lens=[4, 4], pad_multiple=4, cp_size=2)
    with pytest.raises(ValueError, match="zigzag"):
        cp.ulysses_slice(cp["input"], 0, 2)


def test_kv_replication_keeps_the_gqa_pairing():
    # verl's repeat_kv: q head j still sees KV head j // (Hq / Hk) after replication.
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(9, 8, 4, generator=g), torch.randn(9, 2, 4, generator=g), torch.randn(9, 2, 4, generator=g)
    cu = [0, 4, 9]
    ref = varlen_attention(q, k, v, cu, cu, 5, 5)
    for rep in (1, 2, 4):
        assert _repeat_kv(k, rep).shape == (9, 2 * rep, 4)
        torch.testing.assert_close(varlen_attention(q, _repeat_kv(k, rep), _repeat_kv(v, rep), cu, cu, 5, 5), ref)


# ------------------------------------------------------------------ gloo ranks
# (lengths, pad_multiple, q heads, kv heads, v head dim, causal, window_size)
CONFIGS = [
    ([5, 1, 12, 3], 1, 4, 2, 8, True, (-1, -1)),  # T = 21: tail padding on both world sizes
    ([5, 1, 12, 3], 1, 4, 2, 8, False, (-1, -1)),
    ([7, 2, 9], 2, 4, 1, 8, True, (-1, -1)),  # 1 KV head: replicated to the group size
    ([7, 2, 9], 2, 8, 4, 8, False, (2, 1)),  # 4 KV heads, a sliding window
    ([6, 11, 1, 1], 1, 8, 8, 6, True, (-1, -1)),  # v's head dim differs: q/k and v exchanged apart
    ([30], 1, 4, 4, 8, True, (-1, -1)),  # one sequence across every rank
]


def _full(lengths, pad_multiple, hq, hk, dv, seed):
    batch = _batch(lengths, pad_multiple)
    g = torch.Generator().manual_seed(seed)
    total = batch.num_tokens
    qkv = [torch.randn(total, h, d, generator=g, dtype=torch.float64) for h, d in ((hq, 8), (hk, 8), (hk, dv))]
    weight = torch.randn(total, hq, dv, generator=g, dtype=torch.float64)
    return batch, qkv, weight


def case_attention(rank, world):
    """Values and q/k/v gradients of every config against the full varlen attention
    (this rank's rows); the tail padding of q/k/v is NaN and must not leak."""
    for i, (lengths, multiple, hq, hk, dv, causal, window) in enumerate(CONFIGS):
        batch, full, weight = _full(lengths, multiple, hq, hk, dv, seed=i)
        leaves = [t.clone().requires_grad_() for t in full]
        longest = batch.max_seqlen_padded
        ref = varlen_attention(*leaves, batch.cu_seqlens_padded, batch.cu_seqlens_padded, longest, longest,
                               causal=causal, window_size=window)
        (ref * weight).sum().backward()
        local = [batch.ulysses_slice(t, rank, world, fill=float("nan")).detach().requires_grad_() for t in full]
        if causal and window == (-1, -1):  # the one operation on the batch's Ulysses cut
            cut = seqpack.shard_layout(batch, world, rank, scheme="ulysses")
            out = seqpack.attention(*local, cut, group=dist.group.WORLD)
        else:  # non-causal or windowed rows: the implementation
            out = ulysses_attention(*local, batch, dist.group.WORLD, causal=causal, window_size=window)
        assert out.shape == (math.ceil(batch.num_tokens / world), hq, dv)
        torch.testing.assert_close(out, batch.ulysses_slice(ref.detach(), rank, world), rtol=1e-10, atol=1e-12,
                                   msg=lambda m: f"config {i}: {m}")
        (out * batch.ulysses_slice(weight, rank, world)).sum().backward()
        for name, mine, leaf in zip("qkv", local, leaves):
            torch.testing.assert_close(mine.grad, batch.ulysses_slice(leaf.grad, rank, world), rtol=1e-10,
                                       atol=1e-12, msg=lambda m: f"config {i}, d{name}: {m}")
    # A PackedLayout in place of the batch, agree=False: the same rows.
    batch, full, _ = _full(*CONFIGS[0][:5], seed=0)
    local = [batch.ulysses_slice(t, rank, world) for t in full]
    torch.testing.assert_close(ulysses_attention(*local, batch.layout, agree=False),
                               ulysses_attention(*local, batch), rtol=0, atol=0)
    return True


def case_gather(rank, world):
    """ulysses_gather rebuilds the stream; its backward sums the gradient over the
    group (every rank computed the same loss here: world x the slice)."""
    batch = _batch([5, 1, 12, 3])
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(21, 3, generator=g), torch.randn(21, 3, generator=g)
    local = batch.ulysses_slice(x, rank, world).requires_grad_()
    whole = batch.ulysses_gather(local)
    assert torch.equal(whole, x)
    (whole * w).sum().backward()
    torch.testing.assert_close(local.grad, world * batch.ulysses_slice(w, rank, world))
    try:  # one rank's slice has a row too many: every rank raises, none waits in the gather
        batch.ulysses_gather(torch.cat([local, local[:1]]) if rank == world - 1 else local)
    except ValueError as exc:
        assert ("local must hold this rank's" if rank == world - 1 else OTHERS) in str(exc), str(exc)
    else:
        raise AssertionError("every rank must raise")
    return True


def case_failing_rank(rank, world):
    """One rank's input breaks a rule: it raises its own error and every other rank
    a ValueError, instead of waiting in the all-to-all; inputs that pass their own
    checks but differ from the other ranks' in what the exchange shares make every
    rank raise the fingerprint's error. Then the ranks are still in step."""
    batch, (q, k, v), _ = _full([5, 1, 12, 3], 1, 4, 2, 8, seed=3)
    q, k, v = (batch.ulysses_slice(t, rank, world) for t in (q, k, v))
    n = q.shape[0]
    other = _batch([6, 12, 3])  # same T = 21, other offsets
    g = torch.Generator().manual_seed(5)
    heads3, heads12 = (torch.randn(n, h, 8, generator=g, dtype=torch.float64) for h in (3, 12))
    last = world - 1
    cases = [  # (failing rank, its q, k, v, its batch, its error; None: the fingerprint's)
        (last, (torch.cat([q, q[:1]]), k, v), batch, "must hold this rank's"),
        (0, (q, k[:-1], v[:-1]), batch, "must hold this rank's"),
        (last, (q, k[..., :4], v[..., :4]), batch, "same head dim"),
        (0, (heads3, k[:, :1], v[:, :1]), batch, "q has 3 heads, not a multiple of the group size"),
        (last, (heads12, heads3, heads3), batch, "k and v have 3 heads"),
        (last, (q, k, v), SimpleNamespace(cu_seqlens_padded=batch.cu_seqlens_padded, cp_size=2),
         "was built for cp_size=2"),
        (0, (q, k, v), SimpleNamespace(), "must have cu_seqlens_padded"),
        (0, (q, k, v.float()), batch, "share dtype"),
        (last, (q, k, v), batch, "backend"),  # an unknown backend on one rank
        (0, (q, k[:, :1], v[:, :1]), batch, None),  # 1 KV head divides the group: passes, other fingerprint
        (last, (q, k, v), other, None),  # other offsets, same rows
    ]
    for bad, inputs, its_batch, error in cases:
        args = inputs + (its_batch,) if rank == bad else (q, k, v, batch)
        backend = "nope" if rank == bad and error == "backend" else "auto"
        try:
            ulysses_attention(*args, dist.group.WORLD, backend=backend)
        except (ValueError, TypeError) as exc:
            expected = "disagree on" if error is None else error if rank == bad else OTHERS
            assert expected in str(exc), (bad, error, str(exc))
        else:
            raise AssertionError(f"every rank must raise (rank {bad}: {error})")
    ulysses_attention(q, k, v, batch, dist.group.WORLD)  # still in step
    return True


def _labels(batch):
    """Next-token targets on the whole stream (-100 where there is none)."""
    ids = batch["input_ids"]
    labels = torch.full_like(ids, -100)
    starts, lens = batch.cu_seqlens_padded[:-1].tolist(), batch.seq_lens.tolist()
    for s, n in zip(starts, lens):
        labels[s: s + n - 1] = ids[s + 1: s + n]
    return labels


def case_train_dp_ulysses(rank, world, steps):
    """DP 2 x Ulysses 2: each DP rank packs its half of the sequences into one
    stream, each SP rank runs its contiguous slice through the tiny model (embedding,
    MLPs and LM head on its rows, attention on its Ulysses cut in every block) and sums its
    rows' loss; the gradients all-reduced over the 4 ranks equal one process's
    padded step, for a few SGD steps."""
    from seqpack.testing.tiny_model import TinyCausalLM, TinyConfig

    assert world == 4
    dp, sp = rank // 2, rank % 2
    sp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group, in order
    cfg = TinyConfig(vocab_size=61, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=1)  # KV replicated
    torch.manual_seed(0)
    reference = TinyCausalLM(cfg).double()
    model = TinyCausalLM(cfg).double()
    model.load_state_dict(reference.state_dict())
    g = torch.Generator().manual_seed(7)
    lengths = torch.tensor([3, 17, 1, 9, 12, 5, 20, 2])
    width = int(lengths.max())
    mask = (torch.arange(width)[None] < lengths[:, None]).long()
    ids = torch.randint(1, cfg.vocab_size, (len(lengths), width), generator=g) * mask
    tokens = float((lengths - 1).sum())
    mine = torch.arange(dp, len(lengths), 2)  # this DP rank's sequences
    batch = seqpack.pack_sequences({"input_ids": ids[mine]}, seq_lens=lengths[mine].tolist())
    local_ids = batch.ulysses_slice("input_ids", sp, 2)
    positions = batch.ulysses_slice("position_ids", sp, 2)
    labels = batch.ulysses_slice(_labels(batch), sp, 2, fill=-100)

    cut = seqpack.shard_layout(batch, 2, sp, scheme="ulysses")

    def attend(q, k, v):
        return seqpack.attention(q, k, v, cut, group=sp_groups[dp])

    lr = 0.5
    for step in range(steps):
        for m in (model, reference):
            m.zero_grad()
        logits = reference.forward_padded(ids, mask)  # padded_loss's, in float64
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
        ref_loss = -(logp * mask[:, 1:]).sum() / tokens
        ref_loss.backward()
        ref_loss = float(ref_loss)
        x = model.embed(local_ids)
        for block in model.blocks:
            x = block(x, positions, attend)
        logits = model.lm_head(model.norm(x))
        loss = torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum") / tokens
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        assert abs(float(total) - ref_loss) <= 1e-10 * abs(ref_loss), (step, float(total), ref_loss)
        with torch.no_grad():
            for (name, p), r in zip(model.named_parameters(), reference.parameters()):
                grad = p.grad.clone()
                dist.all_reduce(grad)
                scale = float(r.grad.abs().max())
                assert float((grad - r.grad).abs().max()) <= 1e-9 * scale, (step, name)
                p -= lr * grad
                r -= lr * r.grad
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-9, atol=1e-12)
    return ref_loss


@pytest.fixture(scope="module")
def pools():
    yield from started_pools(WORLDS)


def _run(pool, fn, *args):
    return values_of(pool, fn, *args, timeout_s=CASE_TIMEOUT_S)  # a hang raises (and tears the pool down)


@pytest.mark.parametrize("world", WORLDS)
def test_equals_varlen_attention_over_the_stream(pools, world):
    assert _run(pools[world], case_attention) == [True] * world


@pytest.mark.parametrize("world", WORLDS)
def test_gather_rebuilds_the_stream(pools, world):
    assert _run(pools[world], case_gather) == [True] * world


@pytest.mark.parametrize("world", WORLDS)
def test_a_failing_rank_stops_every_rank(pools, world):
    assert _run(pools[world], case_failing_rank) == [True] * world


def test_tiny_model_dp_x_ulysses_trains_like_one_process(pools):
    losses = _run(pools[4], case_train_dp_ulysses, 3)
    assert len(set(losses)) == 1 and math.isfinite(losses[0])
