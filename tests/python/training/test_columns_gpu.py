"""Issue 30's paths on CUDA tensors: ``column_logprobs`` and ``linear_column_logprobs``
(the multi-target kernels behind the teacher's top-k), ``DistillationLoss`` and
``DPOLoss`` through ``SequencePackingLossWrapper``, against the CPU kernels and an
fp64 PyTorch reference (``log_softmax`` + ``gather``, autograd gradients); the column
log-probs forward and backward with no host synchronisation.

Marked ``gpu``: skipped where PyTorch sees no CUDA device, failed where it sees one
but seqpack's CUDA kernels cannot run (conftest.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from seqpack import column_logprobs, linear_column_logprobs, pack_sequences
from seqpack.loss import DistillationLoss, DPOLoss, SequencePackingLossWrapper, vocab_parallel_gather_columns

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]
# Log-probs and entropies are fp32 whatever the logits; gradients are in the logits' dtype.
GRAD_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def random_columns(rows, k, vocab, gen):
    """[rows, k] ids in [0, V) with about one in eight -1 (no column) and a repeat."""
    cols = torch.randint(0, vocab, (rows, k), generator=gen)
    cols[torch.rand(rows, k, generator=gen) < 0.125] = -1
    if k > 1:
        cols[0, 1] = cols[0, 0]
    return cols


def reference(z, columns, temperature):
    """fp64 ``log_softmax(z / temperature)`` at each column (0 at -1) and each row's entropy."""
    lsm = torch.log_softmax(z.double() / temperature, -1)
    lp = torch.where(columns >= 0, lsm.gather(1, columns.clamp(min=0)), 0.0)
    return lp, -(lsm.exp() * lsm).sum(-1)


def weighted(lp, ent, w, v):
    return (lp.double() * w).sum() + (ent.double() * v).sum()


@pytest.mark.parametrize("k", [1, 8, 64])
@pytest.mark.parametrize("vocab", [11, 4096 + 3, 32000])  # an odd size takes the unvectorised path
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_column_logprobs_on_cuda_equal_cpu_and_pytorch(dtype, vocab, k):
    gen = torch.Generator().manual_seed(vocab + k)
    rows = 131
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
    cols = random_columns(rows, k, vocab, gen)
    w, v = torch.randn(rows, k, generator=gen, dtype=torch.float64), torch.randn(rows, generator=gen,
                                                                                  dtype=torch.float64)
    got = []
    for device in ("cpu", DEVICE):
        leaf = logits.detach().to(device).requires_grad_()
        out = column_logprobs(leaf, cols.to(device), temperature=0.7, return_entropy=True)
        (grad,) = torch.autograd.grad(weighted(out.logprobs, out.entropy, w.to(device), v.to(device)), leaf)
        assert out.logprobs.dtype == torch.float32 and out.logprobs.device.type == torch.device(device).type
        got.append([t.detach().double().cpu() for t in (out.logprobs, out.entropy, grad)])
    ref_leaf = logits.double().requires_grad_()
    lp, ent = reference(ref_leaf, cols, 0.7)
    (ref_grad,) = torch.autograd.grad(weighted(lp, ent, w, v), ref_leaf)
    tol = GRAD_TOL[dtype]
    for cuda, cpu, want in zip(got[1], got[0], (lp, ent, ref_grad)):
        torch.testing.assert_close(cuda, cpu, rtol=tol, atol=tol)
        torch.testing.assert_close(cuda, want.detach(), rtol=max(tol, 1e-5), atol=max(tol, 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_linear_column_logprobs_on_cuda_equal_pytorch(dtype):
    # The LM head fused in: against F.linear + log_softmax + gather in fp64 (values,
    # entropy, and the gradients of hidden, head and bias); tiles of both kinds.
    gen = torch.Generator().manual_seed(5)
    rows, hidden, vocab, k = 517, 64, 5000, 16
    h = torch.randn(rows, hidden, generator=gen)
    wt = torch.randn(vocab, hidden, generator=gen) / 8
    b = torch.randn(vocab, generator=gen)
    cols = random_columns(rows, k, vocab, gen)
    w, v = torch.randn(rows, k, generator=gen, dtype=torch.float64), torch.randn(rows, generator=gen,
                                                                                  dtype=torch.float64)
    ref_leaves = [t.double().requires_grad_() for t in (h, wt, b)]
    lp, ent = reference(F.linear(*ref_leaves), cols, 0.9)
    ref = torch.autograd.grad(weighted(lp, ent, w, v), ref_leaves)
    # bf16: inputs and gradients rounded to 8 bits (|grad W| reaches 15, |grad h| 2.7)
    tol = dict(rtol=2e-4, atol=2e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=6e-2)
    for chunk in (64, 2000):  # vocabulary slices (T < V), then row chunks
        leaves = [t.detach().to(DEVICE, dtype).requires_grad_() for t in (h, wt, b)]
        out = linear_column_logprobs(leaves[0], leaves[1], cols.to(DEVICE), bias=leaves[2], temperature=0.9,
                                     return_entropy=True, chunk_tokens=chunk)
        grads = torch.autograd.grad(weighted(out.logprobs, out.entropy, w.to(DEVICE), v.to(DEVICE)), leaves)
        torch.testing.assert_close(out.logprobs.double().cpu(), lp.detach(), **tol)
        torch.testing.assert_close(out.entropy.double().cpu(), ent.detach(), **tol)
        for got, want in zip(grads, ref):
            torch.testing.assert_close(got.double().cpu(), want, **tol)


def test_column_logprobs_have_no_host_sync():
    # Device columns, device logits / head: forward and backward never wait on the host
    # (the columns' bound is checked by an asynchronous device assertion).
    gen = torch.Generator().manual_seed(0)
    rows, hidden, vocab, k = 96, 32, 1027, 8
    logits = torch.randn(rows, vocab, generator=gen).to(DEVICE).requires_grad_()
    h = torch.randn(rows, hidden, generator=gen).to(DEVICE).requires_grad_()
    wt = (torch.randn(vocab, hidden, generator=gen) / 8).to(DEVICE).requires_grad_()
    cols = random_columns(rows, k, vocab, gen).to(DEVICE)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = column_logprobs(logits, cols, temperature=0.8, return_entropy=True)
        (out.logprobs.sum() + out.entropy.sum()).backward()
        out = linear_column_logprobs(h, wt, cols, return_entropy=True, chunk_tokens=32)
        (out.logprobs.sum() + out.entropy.sum()).backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.isfinite(logits.grad).all() and torch.isfinite(h.grad).all() and torch.isfinite(wt.grad).all()


def test_a_column_past_the_vocabulary_fails_on_the_device():
    # The bound is a device assertion, which leaves the process's CUDA context unusable:
    # checked in a child process.
    code = ("import torch, seqpack\n"
            "cols = torch.tensor([[1], [2], [10], [3]], device='cuda')\n"
            "seqpack.column_logprobs(torch.zeros(4, 10, device='cuda'), cols)\n"
            "torch.cuda.synchronize()\n")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert child.returncode != 0
    assert "device-side assert" in child.stderr, child.stderr[-2000:]


def test_gather_columns_on_cuda_equal_cpu():
    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(2, 9, 300, generator=gen) * 2).to(torch.bfloat16)
    cols = torch.randint(0, 300, (7,), generator=gen)
    got = []
    for device in ("cpu", DEVICE):
        leaf = logits.detach().to(device).requires_grad_()
        out = vocab_parallel_gather_columns(leaf, cols.to(device), vocab_start_index=0, vocab_end_index=300)
        (grad,) = torch.autograd.grad(out.float().square().sum(), leaf)
        got.append((out.cpu(), grad.cpu()))
    assert got[1][0].dtype == torch.float32  # gathered in bf16, then upcast
    torch.testing.assert_close(got[1][0], got[0][0], rtol=0, atol=0)
    torch.testing.assert_close(got[1][1], got[0][1], rtol=0, atol=0)


# ---- the losses through the wrapper ------------------------------------------------------
def distillation_case(lengths, vocab, topk, seed):
    gen = torch.Generator().manual_seed(seed)
    batch, width = len(lengths), max(lengths)
    token_mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).float()
    data = {"input_ids": torch.randint(0, vocab, (batch, width), generator=gen) * token_mask.long(),
            "token_mask": token_mask, "sample_mask": torch.ones(batch),
            "teacher_topk_logits": torch.randn(batch, width, topk, generator=gen) * 3,
            "teacher_topk_indices": torch.randint(0, vocab, (batch, width, topk), generator=gen)}
    return data, torch.randn(batch, width, vocab, generator=gen) * 2


def on(device, data):
    return {key: value.to(device) for key, value in data.items()}


@pytest.mark.parametrize("zero_outside_topk", [True, False])
@pytest.mark.parametrize("kl_type", ["forward", "reverse", "mixed"])
def test_distillation_wrapper_on_cuda_equals_cpu(kl_type, zero_outside_topk):
    data, logits = distillation_case([37, 5, 120, 64], 4096 + 3, 16, 11)
    packed = pack_sequences({"logits": logits}, attention_mask=data["token_mask"].bool(), pad_multiple=8)
    loss_fn = DistillationLoss({"kl_type": kl_type, "zero_outside_topk": zero_outside_topk})
    gvt = data["token_mask"][:, 1:].sum()
    got = []
    for device in ("cpu", DEVICE):
        rows = packed["logits"].detach().to(device).requires_grad_()
        wrapper = SequencePackingLossWrapper(loss_fn, cu_seqlens_q=packed.layout.cu_seqlens,
                                             cu_seqlens_q_padded=packed.layout.cu_seqlens_padded, fused=True,
                                             temperature=0.9)
        loss, metrics = wrapper(rows, on(device, data), 4, gvt.to(device))
        loss.backward()
        got.append((loss.detach().cpu(), rows.grad.cpu(), metrics))
    torch.testing.assert_close(got[1][0], got[0][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1][1], got[0][1], rtol=1e-4, atol=1e-7)
    assert got[1][2] == pytest.approx(got[0][2], rel=1e-4, abs=1e-6)


def test_distillation_with_the_lm_head_on_cuda_equals_logits():
    # Fused head (linear_column_logprobs) against the same loss on hidden @ W.T, fp32.
    data, _ = distillation_case([50, 7, 90], 3001, 8, 4)
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(3, 90, 48, generator=gen)
    packed = pack_sequences({"hidden": hidden}, attention_mask=data["token_mask"].bool())
    weight = torch.randn(3001, 48, generator=gen) / 6
    loss_fn = DistillationLoss({"kl_type": "mixed", "zero_outside_topk": True})
    wrapper = SequencePackingLossWrapper(loss_fn, cu_seqlens_q=packed.layout.cu_seqlens, fused=True)
    d, gvt = on(DEVICE, data), data["token_mask"][:, 1:].sum().to(DEVICE)
    fused_leaves = [t.detach().to(DEVICE).requires_grad_() for t in (packed["hidden"], weight)]
    fused, _ = wrapper(fused_leaves[0], d, 3, gvt, lm_head_weight=fused_leaves[1])
    ref_leaves = [t.detach().double().to(DEVICE).requires_grad_() for t in (packed["hidden"], weight)]
    ref, _ = wrapper(ref_leaves[0] @ ref_leaves[1].T, {**d, "teacher_topk_logits": d["teacher_topk_logits"].double(),
                                                        "token_mask": d["token_mask"].double(),
                                                        "sample_mask": d["sample_mask"].double()}, 3, gvt.double())
    torch.testing.assert_close(fused.double(), ref.detach(), rtol=1e-4, atol=1e-5)
    fused.backward()
    ref.backward()
    for a, b in zip(fused_leaves, ref_leaves):
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=1e-3, atol=1e-5)


def test_dpo_wrapper_on_cuda_equals_cpu():
    gen = torch.Generator().manual_seed(8)
    lengths, vocab = [40, 12, 7, 33, 64, 64], 2000
    batch, width = len(lengths), max(lengths)
    token_mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).float()
    token_mask[:, 0] = 0
    data = {"input_ids": torch.randint(0, vocab, (batch, width), generator=gen), "token_mask": token_mask,
            "sample_mask": torch.ones(batch),
            "reference_policy_logprobs": -torch.rand(batch, width, generator=gen) * 3}
    logits = torch.randn(batch, width, vocab, generator=gen)
    packed = pack_sequences({"logits": logits}, attention_mask=torch.arange(width)[None] < torch.tensor(
        lengths)[:, None], pad_multiple=8)
    loss_fn = DPOLoss({"reference_policy_kl_penalty": 0.1, "sft_loss_weight": 0.5})
    gvt = (token_mask[:, 1:]).sum()
    got = []
    for device in ("cpu", DEVICE):
        rows = packed["logits"].detach().to(device).requires_grad_()
        wrapper = SequencePackingLossWrapper(loss_fn, cu_seqlens_q=packed.layout.cu_seqlens,
                                             cu_seqlens_q_padded=packed.layout.cu_seqlens_padded, fused=True)
        loss, metrics = wrapper(rows, on(device, data), batch, gvt.to(device))
        loss.backward()
        got.append((loss.detach().cpu(), rows.grad.cpu(), metrics))
    torch.testing.assert_close(got[1][0], got[0][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1][1], got[0][1], rtol=1e-4, atol=1e-7)
    assert got[1][2] == pytest.approx(got[0][2], rel=1e-4, abs=1e-6)
