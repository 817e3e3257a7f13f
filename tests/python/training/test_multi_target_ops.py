"""seqpack::multi_token_logprobs and seqpack::linear_multi_token_logprobs: a primary
target and CSR extra targets per row from one log-sum-exp. Values and gradients equal
log_softmax + gather summed over every target (repeats, ids < 0, rows with extras but
no primary target, rows without any), on the C++ kernels (fp32 / bf16 / fp16) and the
PyTorch fallback (fp64); opcheck; the fused head holds one chunk of logits at a time."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack.training import _logprob_ops as ops
from seqpack.training import _multi_target_ops  # noqa: F401  (registers the operators)

VOCAB = 11


@st.composite
def targets(draw, max_rows=6):
    """(primary [rows], offsets [rows + 1], extra ids [E]) with ids in [-1, VOCAB)."""
    ids = st.integers(-1, VOCAB - 1)
    rows = draw(st.integers(0, max_rows))
    primary = draw(st.lists(ids, min_size=rows, max_size=rows))
    extras = [draw(st.lists(ids, max_size=4)) for _ in range(rows)]
    offsets = [0]
    for e in extras:
        offsets.append(offsets[-1] + len(e))
    flat = [i for e in extras for i in e]
    return (torch.tensor(primary, dtype=torch.int64), torch.tensor(offsets, dtype=torch.int64),
            torch.tensor(flat, dtype=torch.int64))


def reference(logits, primary, offsets, ids, temperature):
    """(primary log-probs, extra log-probs, entropy) by log_softmax in fp64."""
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    rows = torch.repeat_interleave(torch.arange(len(primary)), offsets.diff())
    lp = torch.where(primary >= 0, logp.gather(1, primary.clamp(min=0)[:, None])[:, 0], 0.0)
    lp_extra = torch.where(ids >= 0, logp[rows, ids.clamp(min=0)], 0.0)
    ent = torch.where(primary >= 0, -(logp.exp() * logp).sum(-1), 0.0)
    return lp, lp_extra, ent


def weighted(out, g):
    return sum((o.double() * w).sum() for o, w in zip(out, g))


@settings(max_examples=60, deadline=None)
@given(targets(), st.sampled_from([torch.float64, torch.float32, torch.bfloat16, torch.float16]),
       st.sampled_from([1.0, 0.6]), st.integers(0, 2**31))
def test_equals_log_softmax_gather_for_every_target(case, dtype, temperature, seed):
    primary, offsets, ids = case
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(len(primary), VOCAB, generator=gen, dtype=torch.float64) * 2).to(dtype)
    g = [torch.randn(n, generator=gen, dtype=torch.float64) for n in (len(primary), len(ids), len(primary))]
    leaf = logits.clone().requires_grad_(True)
    out = torch.ops.seqpack.multi_token_logprobs(leaf, primary, offsets, ids, temperature, True, 0)
    (grad,) = torch.autograd.grad(weighted(out[:3], g), leaf) if len(primary) else (torch.zeros_like(leaf),)
    ref_leaf = logits.double().requires_grad_(True)
    want = reference(ref_leaf, primary, offsets, ids, temperature)
    (want_grad,) = torch.autograd.grad(weighted(want, g), ref_leaf) if len(primary) else (torch.zeros_like(ref_leaf),)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-5, torch.float16: 1e-5}[dtype]
    for got, ref in zip(out[:3], want):
        assert got.dtype == ops.acc_dtype(dtype)
        torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol)
    grad_tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    assert grad.dtype == dtype
    torch.testing.assert_close(grad.double(), want_grad, rtol=grad_tol, atol=grad_tol)


def test_rows_without_any_gradient_are_exact_zeros():
    logits = torch.randn(3, VOCAB)
    logits[1, 4] = torch.nan  # garbage in a row that nothing reads
    primary, offsets, ids = torch.tensor([2, -1, -1]), torch.tensor([0, 1, 1, 3]), torch.tensor([5, 7, -1])
    leaf = logits.requires_grad_(True)
    out = torch.ops.seqpack.multi_token_logprobs(leaf, primary, offsets, ids, 1.0, False, 0)
    (grad,) = torch.autograd.grad(out[0].sum() + out[1].sum(), leaf)
    assert (grad[1] == 0).all() and torch.isfinite(grad).all()
    assert grad[2].abs().sum() > 0  # extras but no primary target: a gradient all the same


@pytest.mark.parametrize("entropy", [False, True])
def test_opcheck(entropy):
    primary, offsets, ids = torch.tensor([1, -1, 3, 0]), torch.tensor([0, 2, 3, 3, 4]), torch.tensor([4, 5, 2, 1])
    logits = torch.randn(4, 7, requires_grad=True)
    torch.library.opcheck(torch.ops.seqpack.multi_token_logprobs, (logits, primary, offsets, ids, 1.3, entropy, 0))
    h, w, b = (torch.randn(*s, requires_grad=True) for s in ((4, 5), (7, 5), (7,)))
    torch.library.opcheck(torch.ops.seqpack.linear_multi_token_logprobs,
                          (h, w, b, primary, offsets, ids, 1.3, entropy, 0, 2))


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_fused_head_equals_logits_and_holds_one_chunk(monkeypatch, chunk):
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(9, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(VOCAB, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(VOCAB, generator=gen, dtype=torch.float64, requires_grad=True)
    primary = torch.tensor([1, -1, 3, 0, 10, 2, 2, -1, 4])
    offsets = torch.tensor([0, 2, 3, 3, 6, 6, 6, 7, 7, 8])
    ids = torch.tensor([4, 5, 2, 1, 1, 9, 0, 7])
    g = [torch.randn(n, generator=gen, dtype=torch.float64) for n in (9, 8, 9)]
    shapes = []
    real = ops._tile_logits
    monkeypatch.setattr(ops, "_tile_logits", lambda *a: (lambda z: shapes.append(tuple(z.shape)) or z)(real(*a)))
    out = torch.ops.seqpack.linear_multi_token_logprobs(h, w, b, primary, offsets, ids, 0.8, True, 0, chunk)
    got = torch.autograd.grad(weighted(out[:3], g), (h, w, b))
    assert max(s[0] * s[1] for s in shapes) <= min(chunk, 9) * VOCAB  # never all the logits at once (chunk < T)
    monkeypatch.setattr(ops, "_tile_logits", real)
    full = torch.ops.seqpack.multi_token_logprobs(F.linear(h, w, b), primary, offsets, ids, 0.8, True, 0)
    want = torch.autograd.grad(weighted(full[:3], g), (h, w, b))
    for a, c in zip(out[:3], full[:3]):
        torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-12)
    for a, c in zip(got, want):
        torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-10)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [11, 4096 + 3])  # an odd size takes the unvectorised path
def test_cuda_kernels_equal_the_cpu_kernels(dtype, vocab):
    """The CUDA grad kernel's extra-target pass (a second sweep after a barrier)
    against the CPU kernels and fp64 PyTorch; many extras in one row (a 300-way fan)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    gen = torch.Generator().manual_seed(vocab)
    rows = 40
    primary = torch.randint(-1, vocab, (rows,), generator=gen)
    counts = torch.randint(0, 4, (rows,), generator=gen)
    counts[7] = 300
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    ids = torch.randint(-1, vocab, (int(offsets[-1]),), generator=gen)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
    g = [torch.randn(n, generator=gen) for n in (rows, len(ids), rows)]
    results = []
    for device in ("cpu", "cuda"):
        leaf = logits.to(device).requires_grad_(True)
        args = [t.to(device) for t in (primary, offsets, ids)]
        out = torch.ops.seqpack.multi_token_logprobs(leaf, *args, 0.9, True, 0)
        (grad,) = torch.autograd.grad(weighted(out[:3], [w.to(device).double() for w in g]), leaf)
        results.append([t.cpu().double() for t in (*out[:3], grad)])
    ref_leaf = logits.double().requires_grad_(True)
    want = reference(ref_leaf, primary, offsets, ids, 0.9)
    (want_grad,) = torch.autograd.grad(weighted(want, [w.double() for w in g]), ref_leaf)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    for got_cuda, got_cpu in zip(*results):
        torch.testing.assert_close(got_cuda, got_cpu, rtol=tol, atol=tol)
    for got, ref in zip(results[1], [*want, want_grad]):
        torch.testing.assert_close(got, ref, rtol=max(tol, 1e-5), atol=max(tol, 1e-5))
