"""linear_token_logprobs: the LM head and the log-probs fused in chunks. Values and
gradients (hidden, weight, bias) equal F.linear + log_softmax + gather (+ entropy)
for random packed batches, every chunk size, CP rows, masked columns, temperature;
bf16 within twice PyTorch's own error; the custom op passes opcheck."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import seqpack
from seqpack.tensors.cp import cp_partition_indices
from seqpack.training import _logprob_ops as ops
from seqpack.training.logprobs import linear_token_logprobs, next_token_sources

from test_logprobs import layout, masked_reference, reference  # noqa: E402 (rootdir-relative test helpers)


def head(rows, hidden, vocab, seed, dtype=torch.float32, bias=True):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=g, dtype=torch.float64).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g, dtype=torch.float64) / hidden**0.5).to(dtype)
    b = torch.randn(vocab, generator=g, dtype=torch.float64).to(dtype) if bias else None
    return h, w, b


def grads(fn, leaves, g_lp, g_ent):
    lp, ent = fn(*leaves)
    return (lp, ent), torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), leaves)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=5), st.integers(1, 4), st.integers(2, 40),
       st.floats(0.5, 2.0), st.data())
def test_equals_linear_log_softmax_gather(lengths, multiple, vocab, temperature, data):
    cu, cu_p = layout(lengths, multiple)
    total = int(cu_p[-1])
    chunk = data.draw(st.integers(1, total))
    h, w, b = (t.requires_grad_() for t in head(total, 8, vocab, seed=len(lengths) * 7 + vocab))
    ids = torch.randint(0, vocab, (total,), generator=torch.Generator().manual_seed(vocab))
    g = torch.Generator().manual_seed(1)
    g_lp, g_ent = torch.randn(total, generator=g), torch.randn(total, generator=g)

    def ours(h, w, b):
        out = linear_token_logprobs(h, w, ids, cu, cu_p, bias=b, return_entropy=True, temperature=temperature,
                                    chunk_tokens=chunk)
        return out.logprobs, out.entropy

    def theirs(h, w, b):
        lp, ent = reference(F.linear(h.double(), w.double(), b.double()), ids, lengths, cu_p, temperature)
        return lp, ent

    (lp, ent), g_ours = grads(ours, (h, w, b), g_lp, g_ent)
    (lp_ref, ent_ref), g_ref = grads(theirs, (h, w, b), g_lp.double(), g_ent.double())
    torch.testing.assert_close(lp.double(), lp_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), ent_ref, rtol=1e-5, atol=1e-5)
    for mine, ref in zip(g_ours, g_ref):
        assert mine.dtype == torch.float32
        torch.testing.assert_close(mine.double(), ref.double(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 3, 16, 64, None])
def test_every_chunk_size_gives_the_same_result(chunk):
    lengths = [20, 5, 31]
    cu, cu_p = layout(lengths, 2)
    h, w, b = (t.requires_grad_() for t in head(int(cu_p[-1]), 12, 50, seed=3))
    ids = torch.randint(0, 50, (int(cu_p[-1]),), generator=torch.Generator().manual_seed(2))
    out = linear_token_logprobs(h, w, ids, cu, cu_p, bias=b, return_entropy=True, chunk_tokens=chunk)
    full = seqpack.token_logprobs(F.linear(h, w, b), seqpack.PackedLayout.from_offsets(cu, cu_p), ids,
                                  return_entropy=True)
    torch.testing.assert_close(out.logprobs, full.logprobs, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.entropy, full.entropy, rtol=1e-6, atol=1e-6)
    ga = torch.autograd.grad(out.logprobs.sum() + out.entropy.sum(), (h, w, b))
    gb = torch.autograd.grad(full.logprobs.sum() + full.entropy.sum(), (h, w, b))
    for a, c in zip(ga, gb):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cp", [2, 3])
def test_cp_ranks_hold_their_rows(cp):
    lengths = [9, 14, 4]
    cu, cu_p = layout(lengths, 2 * cp)
    total = int(cu_p[-1])
    h, w, b = head(total, 8, 30, seed=5)
    ids = torch.randint(0, 30, (total,), generator=torch.Generator().manual_seed(4))
    full = linear_token_logprobs(h, w, ids, cu, cu_p, bias=b, return_entropy=True)
    for rank in range(cp):
        rows = torch.from_numpy(cp_partition_indices(cu_p, cp, rank))
        local = linear_token_logprobs(h[rows], w, ids, cu, cu_p, bias=b, cp_size=cp, cp_rank=rank,
                                      return_entropy=True, chunk_tokens=5)
        torch.testing.assert_close(local.logprobs, full.logprobs[rows])
        torch.testing.assert_close(local.entropy, full.entropy[rows])


def test_masked_columns_and_temperature():
    lengths = [12, 7]
    cu, cu_p = layout(lengths, 1)
    total, vocab = int(cu_p[-1]), 24
    h, w, b = head(total, 6, vocab, seed=8)
    b = b.masked_fill(torch.arange(vocab) % 5 == 0, -float("inf")).requires_grad_()
    h.requires_grad_(), w.requires_grad_()
    ids = torch.randint(0, vocab, (total,), generator=torch.Generator().manual_seed(9))
    ids[ids % 5 == 0] += 1  # targets are never masked
    out = linear_token_logprobs(h, w, ids, cu, cu_p, bias=b, return_entropy=True, temperature=1.7, chunk_tokens=4)
    lp_ref, ent_ref = masked_reference(F.linear(h, w, b).detach(), ids, lengths, cu_p, temperature=1.7)
    assert torch.isfinite(out.entropy).all()
    torch.testing.assert_close(out.logprobs.double(), lp_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.entropy.double(), ent_ref, rtol=1e-5, atol=1e-5)
    gh, gw, gb = torch.autograd.grad(out.logprobs.sum() + out.entropy.sum(), (h, w, b))
    assert torch.isfinite(gh).all() and torch.isfinite(gw).all()
    assert (gb[torch.arange(vocab) % 5 == 0] == 0).all()  # a masked column gets no gradient


def test_bf16_within_twice_pytorchs_own_error():
    lengths = [60, 9, 80]
    cu, cu_p = layout(lengths, 1)
    total, vocab = int(cu_p[-1]), 2000
    h, w, b = head(total, 64, vocab, seed=11, bias=False)
    h, w = h * 2, w * 2
    ids = torch.randint(0, vocab, (total,), generator=torch.Generator().manual_seed(12))
    hb, wb = h.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
    hd, wd = hb.detach().double().requires_grad_(), wb.detach().double().requires_grad_()
    exact, _ = reference(F.linear(hd, wd), ids, lengths, cu_p)
    exact.sum().backward()
    ours = linear_token_logprobs(hb, wb, ids, cu, cu_p, chunk_tokens=32).logprobs
    ours.sum().backward()
    # PyTorch's own bf16 path: F.linear in bf16, log_softmax in bf16, gather.
    h2, w2 = hb.detach().clone().requires_grad_(), wb.detach().clone().requires_grad_()
    lsm = torch.log_softmax(F.linear(h2, w2), -1)
    sources = next_token_sources(cu, cu_p)
    rows = torch.from_numpy(np.nonzero(sources >= 0)[0])
    theirs = lsm[rows, ids[torch.from_numpy(sources[sources >= 0])]]
    theirs.float().sum().backward()
    exact_rows = exact.detach()[rows]
    assert (ours.detach()[rows].double() - exact_rows).abs().max() <= 2 * (theirs.double() - exact_rows).abs().max()
    assert hb.grad.dtype == wb.grad.dtype == torch.bfloat16
    for mine, pt, ref in ((hb.grad, h2.grad, hd.grad), (wb.grad, w2.grad, wd.grad)):
        assert (mine.double() - ref).abs().max() <= 2 * (pt.double() - ref).abs().max()


def test_custom_op_passes_opcheck_and_never_holds_all_logits(monkeypatch):
    h, w, b = head(10, 4, 7, seed=1)
    targets = torch.tensor([1, 2, -1, 3, 0, 6, 5, -1, 2, 4])
    for entropy in (False, True):
        torch.library.opcheck(torch.ops.seqpack.linear_token_logprobs,
                              (h.requires_grad_(), w.requires_grad_(), b.requires_grad_(), targets, 0, 1.3, entropy,
                               0, 3))
    shapes = []
    real = ops._tile_logits
    monkeypatch.setattr(ops, "_tile_logits", lambda *a: (lambda z: shapes.append(tuple(z.shape)) or z)(real(*a)))
    out = linear_token_logprobs(h, w, torch.randint(0, 7, (10,)), [0, 10], chunk_tokens=4)
    out.logprobs.sum().backward()
    assert shapes and max(s[0] for s in shapes) == 4  # forward and backward: a chunk of logits at a time


def test_fewer_rows_than_vocabulary_tiles_the_vocabulary(monkeypatch):
    # T < V: each tile is every row by a slice of the head (the head's gradient is
    # written once per slice); the results equal the unchunked computation.
    lengths = [7, 9]
    cu, cu_p = layout(lengths, 1)
    h, w, b = (t.requires_grad_() for t in head(16, 8, 100, seed=6))
    ids = torch.randint(0, 100, (16,), generator=torch.Generator().manual_seed(7))
    shapes = []
    real = ops._tile_logits
    monkeypatch.setattr(ops, "_tile_logits", lambda *a: (lambda z: shapes.append(tuple(z.shape)) or z)(real(*a)))
    out = linear_token_logprobs(h, w, ids, cu, cu_p, bias=b, return_entropy=True, chunk_tokens=3)
    grads = torch.autograd.grad(out.logprobs.sum() + out.entropy.sum(), (h, w, b))
    assert set(shapes) == {(16, 18), (16, 10)} and len(shapes) == 12  # 3 x 100 logits: 18 columns, twice
    monkeypatch.setattr(ops, "_tile_logits", real)
    full = seqpack.token_logprobs(F.linear(h, w, b), seqpack.PackedLayout.from_offsets(cu, cu_p), ids,
                                  return_entropy=True)
    torch.testing.assert_close(out.logprobs, full.logprobs)
    torch.testing.assert_close(out.entropy, full.entropy)
    for a, c in zip(grads, torch.autograd.grad(full.logprobs.sum() + full.entropy.sum(), (h, w, b))):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


def test_errors_name_the_argument():
    h, w, b = head(6, 4, 5, seed=2)
    ids = torch.zeros(6, dtype=torch.long)
    with pytest.raises(ValueError, match=r"weight must be the \[V, H = 4\]"):
        linear_token_logprobs(h, w[:, :3], ids, [0, 6])
    with pytest.raises(TypeError, match="weight must be torch.float32"):
        linear_token_logprobs(h, w.double(), ids, [0, 6])
    with pytest.raises(ValueError, match=r"bias must be \[V = 5\]"):
        linear_token_logprobs(h, w, ids, [0, 6], bias=b[:4])
    with pytest.raises(ValueError, match="chunk_tokens"):
        linear_token_logprobs(h, w, ids, [0, 6], chunk_tokens=0)
    with pytest.raises(ValueError, match="hidden has|logits has 6 rows|6 rows"):
        linear_token_logprobs(h, w, ids, [0, 8])
    with pytest.raises(ValueError, match="ids must be < 5"):
        linear_token_logprobs(h, w, torch.full((6,), 5), [0, 6])


def test_no_rows_has_a_backward():
    """T = 0 (an empty micro-batch): empty results, zero gradients for the head (the
    backward once indexed the first of no tiles)."""
    h, w, b = (t.requires_grad_() for t in head(0, 4, 7, seed=2))
    out = linear_token_logprobs(h, w, torch.zeros(0, dtype=torch.int64), [0], bias=b, return_entropy=True)
    assert out.logprobs.shape == out.entropy.shape == (0,)
    g_h, g_w, g_b = torch.autograd.grad(out.logprobs.sum() + out.entropy.sum(), (h, w, b))
    assert g_h.shape == (0, 4) and not g_w.any() and not g_b.any()
