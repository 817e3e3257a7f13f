"""packed_token_logprobs on CUDA tensors: the device kernels against the CPU kernels,
and against PyTorch (``log_softmax`` + ``gather`` in fp64, autograd gradients).

Marked ``gpu``: skipped where PyTorch sees no CUDA device, failed where it sees one
but seqpack's CUDA kernels cannot run (conftest.py). Every shape is small except
``test_more_than_2_31_logit_elements`` (4.3 GB of bf16 logits, skipped without the
free GPU memory)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import seqpack
from seqpack.logprobs import packed_token_logprobs
from seqpack.tensors.cp import cp_partition_indices

pytestmark = pytest.mark.gpu

TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (1.6e-2, 1e-4), torch.float16: (2e-3, 1e-5)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [7, 4096, 32000 + 3])  # odd sizes take the unvectorised path
@pytest.mark.parametrize("cp", [1, 2])
def test_cuda_matches_cpu(dtype, vocab, cp):
    g = torch.Generator().manual_seed(vocab + cp)
    lengths = [1, 37, 9, 128]
    multiple = 2 * cp
    padded = [max(multiple, -(-n // multiple) * multiple) for n in lengths]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    cu_p = np.concatenate([[0], np.cumsum(padded)]).astype(np.int32)
    total = int(cu_p[-1])
    ids = torch.randint(0, vocab, (total,), generator=g)
    full = (torch.randn(total, vocab, generator=g) * 3).to(dtype)
    rows = torch.from_numpy(cp_partition_indices(cu_p, cp, cp - 1)) if cp > 1 else torch.arange(total)
    local = full[rows]
    w = torch.randn(local.shape[0], generator=g)
    results = []
    for device in ("cpu", "cuda"):
        x = local.detach().to(device).requires_grad_()  # a fresh leaf on each device
        lp, ent = packed_token_logprobs(x, ids.to(device), cu, cu_p, cp_size=cp, cp_rank=cp - 1,
                                        return_entropy=True, temperature=0.8)
        ((lp * w.to(device)).sum() + ent.sum()).backward()
        results.append((lp.detach().cpu(), ent.detach().cpu(), x.grad.float().cpu()))
    (lp_c, ent_c, g_c), (lp_g, ent_g, g_g) = results
    torch.testing.assert_close(lp_g, lp_c, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent_g, ent_c, rtol=1e-5, atol=1e-5)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(g_g, g_c, rtol=rtol, atol=atol)


def test_wrapper_on_cuda_equals_cpu():
    from seqpack.loss import ClippedPGLoss, SequencePackingLossWrapper

    g = torch.Generator().manual_seed(0)
    lengths, vocab, width = [5, 9, 2], 1000, 9
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    logits = torch.randn(int(cu[-1]), vocab, generator=g)
    data = {"input_ids": torch.randint(0, vocab, (3, width), generator=g), "token_mask": torch.ones(3, width),
            "sample_mask": torch.ones(3), "advantages": torch.randn(3, width, generator=g),
            "prev_logprobs": -torch.rand(3, width, generator=g),
            "generation_logprobs": -torch.rand(3, width, generator=g),
            "reference_policy_logprobs": -torch.rand(3, width, generator=g)}
    loss_fn = ClippedPGLoss({})
    out = []
    for device in ("cpu", "cuda"):
        d = {k: v.to(device) for k, v in data.items()}
        x = logits.detach().to(device).requires_grad_()  # .to("cpu") is logits itself
        loss, _ = SequencePackingLossWrapper(loss_fn, None, cu, fused=True)(x, d, 3, 15)
        loss.backward()
        out.append((loss.item(), x.grad.cpu()))
    assert out[0][0] == pytest.approx(out[1][0], rel=1e-5)
    torch.testing.assert_close(out[1][1], out[0][1], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_linear_token_logprobs_on_cuda_equals_pytorch(dtype):
    # The LM head fused in, on the GPU: against F.linear + log_softmax + gather in
    # fp64 (values, and the gradients of hidden and head), tiles of both kinds.
    import torch.nn.functional as F
    from seqpack.logprobs import linear_token_logprobs, next_token_sources

    g = torch.Generator().manual_seed(3)
    lengths = [300, 17, 700]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total, hidden, vocab = int(cu[-1]), 64, 5000
    h = torch.randn(total, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) / 8
    ids = torch.randint(0, vocab, (total,), generator=g)
    sources = next_token_sources(cu)
    rows = torch.from_numpy(np.nonzero(sources >= 0)[0])
    targets = ids[torch.from_numpy(sources[sources >= 0])]
    hd, wd = h.double().requires_grad_(), w.double().requires_grad_()
    ref = torch.zeros(total, dtype=torch.float64).index_put(
        (rows,), torch.log_softmax(F.linear(hd, wd), -1)[rows, targets])
    ref.sum().backward()
    for chunk in (64, 2000):  # vocabulary slices (T < V), then row chunks
        hc, wc = h.to("cuda", dtype).requires_grad_(), w.to("cuda", dtype).requires_grad_()
        out = linear_token_logprobs(hc, wc, ids.cuda(), cu, chunk_tokens=chunk).logprobs
        out.sum().backward()
        tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
        torch.testing.assert_close(out.double().cpu(), ref.detach(), **tol)
        torch.testing.assert_close(hc.grad.double().cpu(), hd.grad, **tol)
        torch.testing.assert_close(wc.grad.double().cpu(), wd.grad, **tol)


# ---- against PyTorch ------------------------------------------------------------------
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]
GRID_ROWS = 132 * 32  # kMaxBlocks of cuda/logprob.cu: rows past it loop inside the kernel
# Against the fp64 reference on the same (rounded) logits: log-probs and entropies
# are fp32 whatever the logits; gradients are stored in the logits' dtype.
LP_TOL = dict(rtol=1e-5, atol=1e-5)
GRAD_TOL = {torch.float32: dict(rtol=1e-4, atol=4e-6), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5),
            torch.float16: dict(rtol=2e-3, atol=1e-6)}


def layout(lengths, multiple):
    padded = [-(-n // multiple) * multiple for n in lengths]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    cu_p = np.concatenate([[0], np.cumsum(padded)]).astype(np.int32)
    return cu, cu_p


def next_token_rows(ids, lengths, cu_p):
    """Each packed row's next-token id, -1 at padding and at a sequence's last token
    (NumPy, independent of seqpack's own target computation)."""
    ids = np.asarray(ids)
    out = np.full(ids.shape[0], -1, dtype=np.int64)
    for i, n in enumerate(lengths):
        s = int(cu_p[i])
        if n > 1:
            out[s: s + n - 1] = ids[s + 1: s + n]
    return torch.from_numpy(out)


def torch_reference(x, targets, temperature=1.0, vocab_start=0):
    """``log_softmax(x / temperature)`` at each row's target and the entropy
    ``-sum p log p``, in fp64 PyTorch ops (differentiable in ``x``); 0 where the
    target is < 0. A -inf logit becomes -1e4 (exp is exactly 0 in fp64 and
    0 * -1e4 = 0, where PyTorch's 0 * -inf makes the entropy and every gradient of
    the row NaN): tests/python/test_logprobs.py's ``masked_reference``."""
    z = x.double()
    z = z.masked_fill(z == -torch.inf, -1e4) / temperature
    lsm = torch.log_softmax(z, -1)
    targets = targets.to(x.device)
    has = targets >= 0
    local = (targets - vocab_start).clamp(0, x.shape[1] - 1)
    lp = torch.where(has, lsm.gather(1, local[:, None])[:, 0], 0.0)
    p = lsm.exp()
    ent = torch.where(has, -torch.where(p > 0, p * lsm, 0.0).sum(-1), 0.0)
    return lp, ent


def weights(rows, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, generator=g, dtype=torch.float64).cuda(), \
        torch.randn(rows, generator=g, dtype=torch.float64).cuda()


def loss_of(lp, ent, w, v, keep=None):
    """sum(w lp) + sum(v ent) over the rows in ``keep`` (all by default); rows left
    out contribute nothing, not even a NaN."""
    terms = lp.double() * w + (ent.double() * v if ent is not None else 0.0)
    return (terms if keep is None else torch.where(keep, terms, 0.0)).sum()


def assert_grads_close(got, ref, dtype):
    torch.testing.assert_close(got.double(), ref, **GRAD_TOL[dtype])


@pytest.mark.parametrize("entropy", [False, True], ids=["lp", "entropy"])
@pytest.mark.parametrize("vocab", [1, 5, 1027, 4096])  # 1027: not a multiple of 8 (bf16/fp16) nor of 4 (fp32)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_logprobs_match_torch(dtype, vocab, entropy):
    # Public API, host offsets: packed rows with padding and a length-1 sequence.
    g = torch.Generator().manual_seed(vocab)
    lengths = [1, 37, 9, 128, 0, 66]
    cu, cu_p = layout(lengths, 8)
    total = int(cu_p[-1])
    ids = torch.randint(0, vocab, (total,), generator=g)
    logits = (torch.randn(total, vocab, generator=g) * 2).to(dtype).cuda()
    temperature = 0.7 if entropy else 1.0
    x = logits.clone().requires_grad_()
    out = packed_token_logprobs(x, ids.cuda(), cu, cu_p, return_entropy=entropy, temperature=temperature)
    assert out.logprobs.dtype == torch.float32 and out.logprobs.is_cuda
    assert (out.entropy is not None) == entropy
    w, v = weights(total)
    loss_of(out.logprobs, out.entropy, w, v).backward()
    ref_x = logits.double().requires_grad_()
    ref_lp, ref_ent = torch_reference(ref_x, next_token_rows(ids, lengths, cu_p), temperature)
    loss_of(ref_lp, ref_ent if entropy else None, w, v).backward()
    torch.testing.assert_close(out.logprobs.double(), ref_lp.detach(), **LP_TOL)
    if entropy:
        torch.testing.assert_close(out.entropy.double(), ref_ent.detach(), **LP_TOL)
    assert x.grad.dtype == dtype
    assert_grads_close(x.grad, ref_x.grad, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_more_rows_than_one_grid(dtype):
    # > 2 grids of rows (the kernels loop over rows beyond 132 * 32 blocks); the last
    # rows are the ones a wrong grid-stride loop would skip.
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 61, size=330).tolist()
    cu, cu_p = layout(lengths, 8)
    total, vocab = int(cu_p[-1]), 203
    assert total > 2 * GRID_ROWS
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (total,), generator=g)
    logits = (torch.randn(total, vocab, generator=g) * 2).to(dtype).cuda()
    x = logits.clone().requires_grad_()
    lp, ent = packed_token_logprobs(x, ids.cuda(), cu, cu_p, return_entropy=True, temperature=0.9)
    w, v = weights(total)
    loss_of(lp, ent, w, v).backward()
    ref_x = logits.double().requires_grad_()
    ref_lp, ref_ent = torch_reference(ref_x, next_token_rows(ids, lengths, cu_p), 0.9)
    loss_of(ref_lp, ref_ent, w, v).backward()
    torch.testing.assert_close(lp.double(), ref_lp.detach(), **LP_TOL)
    torch.testing.assert_close(ent.double(), ref_ent.detach(), **LP_TOL)
    assert_grads_close(x.grad, ref_x.grad, dtype)
    tail = slice(2 * GRID_ROWS, None)  # rows of the third pass of the grid
    assert (x.grad[tail].float().abs().sum(1) > 0).sum() > 0
    torch.testing.assert_close(lp[tail].double(), ref_lp[tail].detach(), **LP_TOL)


def test_more_than_2_31_logit_elements():
    # 33,000 x 65,536 bf16 = 2.16e9 elements (4.3 GB): element offsets past 2^31
    # (rows from 32,768 on) must not wrap. Forward over every row against a chunked
    # fp32 PyTorch reference; gradients against fp64 autograd on three row blocks,
    # the last one reaching past 2^31 elements.
    rows, vocab = 33_000, 65_536
    assert rows * vocab > 2**31
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    need = 14 << 30  # logits + gradient (2 x 4.3 GB) + reference blocks
    if free < need:
        pytest.skip(f"needs {need / 2**30:.0f} GiB of free GPU memory for 4.3 GB logits and their gradient; "
                    f"{free / 2**30:.1f} GiB free")
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16, generator=gen)
    try:
        _check_huge_logits(x, gen)
    finally:
        del x
        torch.cuda.empty_cache()


def _check_huge_logits(x, gen):
    rows, vocab = x.shape
    targets = torch.randint(0, vocab, (rows,), device="cuda", generator=gen)
    targets[::7] = -1  # rows without a target
    targets[-1] = vocab - 1  # the very last element of the tensor is a target
    x[-1, -1] = 6.0
    x.requires_grad_()
    lp, ent, _, _ = torch.ops.seqpack.token_logprobs(x, targets, 0, 1.0, True, 0)
    w, v = weights(rows)
    loss_of(lp, ent, w, v).backward()
    grad = x.grad
    x.grad = None
    assert grad.dtype == torch.bfloat16 and grad.shape == x.shape
    xd = x.detach()
    has = targets >= 0
    for lo in range(0, rows, 2048):  # forward, every row, fp32 reference in blocks
        sl = slice(lo, lo + 2048)
        lsm = torch.log_softmax(xd[sl].float(), -1)
        ref_lp = torch.where(has[sl], lsm.gather(1, targets[sl].clamp(min=0)[:, None])[:, 0], 0.0)
        ref_ent = torch.where(has[sl], -(lsm.exp() * lsm).sum(-1), 0.0)
        torch.testing.assert_close(lp[sl].detach(), ref_lp, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(ent[sl].detach(), ref_ent, rtol=1e-5, atol=1e-4)
        del lsm, ref_lp, ref_ent
    first_past = 2**31 // vocab  # 32,768: rows from here on start past 2^31 elements
    for lo, hi in ((0, 256), (16_000, 16_256), (first_past - 64, rows)):
        ref_x = xd[lo:hi].double().requires_grad_()
        r_lp, r_ent = torch_reference(ref_x, targets[lo:hi])
        loss_of(r_lp, r_ent, w[lo:hi], v[lo:hi]).backward()
        torch.testing.assert_close(grad[lo:hi].double(), ref_x.grad, rtol=1.6e-2, atol=1e-6)


@pytest.mark.parametrize("vocab", [40, 1027])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_masked_all_masked_and_nan_rows_match_log_softmax(dtype, vocab):
    # -inf logits (a masked vocabulary tail on every other row), a row of -inf only,
    # NaN in the vectorised part, in the tail and at the target: NaN exactly where
    # torch.log_softmax gives NaN; elsewhere log-probs equal log_softmax's, entropy
    # and gradients the fp64 reference's, masked logits get a zero gradient.
    g = torch.Generator().manual_seed(vocab)
    rows, live = 24, vocab * 3 // 4
    logits = (torch.randn(rows, vocab, generator=g) * 2).to(dtype)
    targets = torch.randint(0, live, (rows,), generator=g)
    targets[[4, 13]] = -1  # no target
    logits[::2, live:] = -torch.inf
    logits[3] = -torch.inf  # all masked
    logits[5, 1] = torch.nan
    logits[7, vocab - 1] = torch.nan  # the unvectorised tail for vocab = 1027
    logits[9, targets[9]] = torch.nan
    logits = logits.cuda()
    targets = targets.cuda()
    lsm = torch.log_softmax(logits.double() / 0.9, -1)
    nan_rows = torch.isnan(lsm).all(-1)
    assert nan_rows.nonzero().flatten().tolist() == [3, 5, 7, 9]
    x = logits.clone().requires_grad_()
    lp, ent, _, _ = torch.ops.seqpack.token_logprobs(x, targets, 0, 0.9, True, 0)
    assert torch.equal(torch.isnan(lp), nan_rows) and torch.equal(torch.isnan(ent), nan_rows)
    ok = ~nan_rows
    has = targets >= 0
    expected = torch.where(has, lsm.gather(1, targets.clamp(min=0)[:, None])[:, 0], 0.0)
    torch.testing.assert_close(lp[ok].double(), expected[ok], **LP_TOL)
    w, v = weights(rows)
    loss_of(lp, ent, w, v, keep=ok).backward()
    assert torch.isfinite(x.grad[ok]).all()
    assert (x.grad[::2, live:][ok[::2]] == 0).all()
    ref_x = logits[ok].double().requires_grad_()
    ref_lp, ref_ent = torch_reference(ref_x, targets[ok], 0.9)
    loss_of(ref_lp, ref_ent, w[ok], v[ok]).backward()
    torch.testing.assert_close(ent[ok].double(), ref_ent.detach(), **LP_TOL)
    assert_grads_close(x.grad[ok], ref_x.grad, dtype)


@pytest.mark.parametrize("entropy", [False, True], ids=["lp", "entropy"])
@pytest.mark.parametrize("start,width", [(384, 300), (512, 488), (0, 1000)])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_vocab_start_slice_matches_torch(dtype, start, width, entropy):
    # The operator on one vocabulary slice [start, start + width) of a 1000-token
    # vocabulary with global target ids: log_softmax over the slice at the owned
    # targets, NaN where another slice holds the target, 0 without a target.
    g = torch.Generator().manual_seed(start + width)
    rows = 96
    full = (torch.randn(rows, 1000, generator=g) * 2).to(dtype)
    local = full[:, start: start + width].contiguous().cuda()
    targets = torch.randint(0, 1000, (rows,), generator=g)
    targets[:8] = torch.randint(start, start + width, (8,), generator=g)  # some owned ...
    targets[8:12] = -1  # ... and some without a target
    targets = targets.cuda()
    has = targets >= 0
    owned = has & (targets >= start) & (targets < start + width)
    x = local.clone().requires_grad_()
    lp, ent, _, _ = torch.ops.seqpack.token_logprobs(x, targets, start, 0.8, entropy, 0)
    assert torch.equal(torch.isnan(lp), has & ~owned)
    assert (lp[~has] == 0).all()
    w, v = weights(rows)
    loss_of(lp, ent if entropy else None, w, v, keep=owned | ~has).backward()
    ref_x = local.double().requires_grad_()
    ref_lp, ref_ent = torch_reference(ref_x, targets, 0.8, vocab_start=start)
    loss_of(ref_lp, ref_ent if entropy else None, w, v, keep=owned | ~has).backward()
    torch.testing.assert_close(lp[owned].double(), ref_lp[owned].detach(), **LP_TOL)
    if entropy:
        assert ent.shape == (rows,)
        torch.testing.assert_close(ent.double(), ref_ent.detach(), **LP_TOL)
    else:
        assert ent.numel() == 0
    assert_grads_close(x.grad, ref_x.grad, dtype)


@pytest.mark.parametrize("fn", ["packed", "linear"])
def test_device_ids_outside_a_shifted_vocabulary_give_nan_on_both_sides(fn):
    # Issue 26, item 4: CUDA ids are not read on the host (no sync), so an id outside
    # [vocab_start, vocab_start + V) is not refused: its row is NaN, below vocab_start
    # as above the end (the host-id path raises for both instead).
    g = torch.Generator().manual_seed(11)
    hidden, weight = torch.randn(6, 8, generator=g).cuda(), torch.randn(4, 8, generator=g).cuda()
    ids = torch.tensor([10, 11, 3, 13, 14, -100]).cuda()  # rows 0..4 predict ids[1..5]
    if fn == "packed":
        lp = packed_token_logprobs(hidden @ weight.T, ids, [0, 6], vocab_start=10).logprobs
    else:
        lp = seqpack.token_logprobs(hidden, [0, 6], ids, weight=weight, vocab_start=10).logprobs
    lp = lp.cpu()
    assert torch.isfinite(lp[[0, 2]]).all() and lp[4] == 0 and lp[5] == 0, lp
    assert torch.isnan(lp[[1, 3]]).all(), lp  # targets 3 (below vocab_start) and 14 (past its end)


@pytest.mark.parametrize("kind", ["column1", "row_stride", "odd_row_stride"])
@pytest.mark.parametrize("vocab", [1024, 1027])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_misaligned_and_strided_logits_match_torch(dtype, vocab, kind):
    # Views of a wider tensor: starting at column 1 (not 16-byte aligned), and
    # aligned rows with a row stride > vocab (a multiple of the vector width, so
    # the vectorised kernels step over the gap; or not). Gradients reach the base
    # tensor through the view, zero outside it.
    # row_stride: 1040 columns, a multiple of 8 (and 4) whatever the vocab.
    extra = {"column1": 9, "row_stride": 16 - vocab % 8, "odd_row_stride": 3}[kind]
    g = torch.Generator().manual_seed(vocab + extra)
    lengths = [20, 1, 33, 7]
    cu, cu_p = layout(lengths, 4)
    total = int(cu_p[-1])
    base_values = (torch.randn(total, vocab + extra, generator=g) * 2).to(dtype).cuda()
    ids = torch.randint(0, vocab, (total,), generator=g)
    col = 1 if kind == "column1" else 0
    base = base_values.clone().requires_grad_()
    view = base[:, col: col + vocab]
    assert view.stride() == (vocab + extra, 1)
    if kind == "column1":
        assert view.data_ptr() % 16 != 0
    lp, ent = packed_token_logprobs(view, ids.cuda(), cu, cu_p, return_entropy=True, temperature=1.3)
    w, v = weights(total)
    loss_of(lp, ent, w, v).backward()
    ref_x = base_values[:, col: col + vocab].double().requires_grad_()
    ref_lp, ref_ent = torch_reference(ref_x, next_token_rows(ids, lengths, cu_p), 1.3)
    loss_of(ref_lp, ref_ent, w, v).backward()
    torch.testing.assert_close(lp.double(), ref_lp.detach(), **LP_TOL)
    torch.testing.assert_close(ent.double(), ref_ent.detach(), **LP_TOL)
    assert_grads_close(base.grad[:, col: col + vocab], ref_x.grad, dtype)
    outside = torch.ones(vocab + extra, dtype=torch.bool, device="cuda")
    outside[col: col + vocab] = False
    assert (base.grad[:, outside] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_empty_batch(dtype):
    # 0 rows: host offsets [0], device int32 offsets, the operator itself; forward
    # and backward give empty results on the device, nothing is launched on 0 rows.
    x = torch.zeros(0, 33, dtype=dtype, device="cuda", requires_grad=True)
    ids = torch.zeros(0, dtype=torch.int64, device="cuda")
    for cu in ([0], torch.zeros(1, dtype=torch.int32, device="cuda")):
        out = packed_token_logprobs(x, ids, cu, return_entropy=True)
        assert out.logprobs.shape == (0,) and out.entropy.shape == (0,) and out.logprobs.is_cuda
        (out.logprobs.sum() + out.entropy.sum()).backward()
        assert x.grad.shape == (0, 33) and x.grad.is_cuda
    lp, ent, m, ls = torch.ops.seqpack.token_logprobs(x.detach(), ids, 0, 1.0, False, 0)
    assert lp.shape == (0,) and ent.numel() == 0 and m.shape == (0,)
    torch.cuda.synchronize()
