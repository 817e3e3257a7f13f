"""Per-token log-probabilities on packed (THD) logits, fused: one pass over the
logits forward, one backward, no ``[T, V]`` intermediate.

::

    packed tokens   a0 a1 a2 p | b0 b1 p p        (p = padding)
    logprob[t]      lp(a1|a0) lp(a2|a1) 0 0 | lp(b1|b0) 0 0 0

Targets roll within each sequence (``input_ids[t + 1]``), never across a
boundary; each sequence's last real token and every padding row get 0 (and no
gradient). With context parallelism the logits are a rank's zigzag-local rows
and ``input_ids`` the full packed ids (their next tokens may sit on another
rank). With a vocabulary-parallel (TP) head, pass the group and each rank's
slice start: the per-row max and sums are combined with three all-reduces.

    >>> import torch, seqpack
    >>> logits = torch.zeros(6, 4)                        # uniform over 4 tokens
    >>> ids = torch.tensor([1, 2, 3, 0, 1, 0])
    >>> seqpack.packed_token_logprobs(logits, ids, cu_seqlens=[0, 3, 5], cu_seqlens_padded=[0, 4, 6]).tolist()
    [-1.3862943649291992, -1.3862943649291992, 0.0, 0.0, -1.3862943649291992, 0.0]
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Tuple, Union

import numpy as np

from . import _core
from .cp import check_cu_seqlens
from ._lengths import as_lengths, as_positive_int

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["next_token_sources", "packed_token_logprobs"]

_DTYPES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}


def _host_offsets(cu: Any, name: str) -> np.ndarray:
    check_cu_seqlens(cu, name)
    offsets = as_lengths(cu, name).astype(np.int64)
    if offsets.size == 0 or offsets[0] != 0 or (np.diff(offsets) < 0).any():
        raise ValueError(f"{name} must start at 0 and be non-decreasing")
    return offsets


def next_token_sources(cu_seqlens: Any, cu_seqlens_padded: Any = None, cp_size: int = 1,
                       cp_rank: int = 0) -> np.ndarray:
    """For every (local) packed row, the packed position of the token it predicts,
    or -1 (padding, a sequence's last real token). Host only: from the offsets.

    >>> next_token_sources([0, 3, 5], [0, 4, 6]).tolist()
    [1, 2, -1, -1, 5, -1]
    """
    cu = _host_offsets(cu_seqlens, "cu_seqlens")
    padded = cu if cu_seqlens_padded is None else _host_offsets(cu_seqlens_padded, "cu_seqlens_padded")
    if padded.shape != cu.shape:
        raise ValueError(f"cu_seqlens has {cu.size} entries, cu_seqlens_padded {padded.size}")
    lengths, spans = np.diff(cu), np.diff(padded)
    if (lengths > spans).any():
        raise ValueError("every padded length must be >= the real length (cu_seqlens vs cu_seqlens_padded)")
    cp = as_positive_int(cp_size, "cp_size")
    if cp > 1:
        positions = np.asarray(_core.cp_partition_indices(padded, cp, int(cp_rank)), dtype=np.int64)
    else:
        positions = np.arange(int(padded[-1]), dtype=np.int64)
    seq = np.searchsorted(padded, positions, side="right") - 1
    real_end = padded[seq] + lengths[seq]
    return np.where(positions + 1 < real_end, positions + 1, -1)


def _torch():
    import torch

    return torch


_HUGE_PAGES_FROM = 64 << 20  # bytes


class _FusedTokenLogprob:
    """Builds the autograd Function lazily (``import seqpack`` must not import torch)."""

    fn = None

    @classmethod
    def get(cls):
        if cls.fn is None:
            cls.fn = _make_function()
        return cls.fn


def _make_function():
    torch = _torch()

    def stats(logits, targets, vocab_start, temperature, entropy, num_threads):
        rows, vocab = logits.shape
        out = torch.empty((4 if entropy else 3, rows), dtype=torch.float32, device=logits.device)
        args = (logits.data_ptr(), rows, vocab, logits.stride(0), _DTYPES[str(logits.dtype)], targets.data_ptr(),
                vocab_start, temperature, out[0].data_ptr(), out[1].data_ptr(), out[3].data_ptr() if entropy else 0,
                out[2].data_ptr())
        if logits.device.type == "cpu":
            _core.logprob_row_stats(*args, num_threads)
        elif _cuda_kernels(logits):
            with torch.cuda.device(logits.device):
                _core.cuda_logprob_row_stats(*args, torch.cuda.current_stream(logits.device).cuda_stream)
        else:
            _stats_torch(logits, targets, vocab_start, temperature, entropy, out)
        return out

    class TokenLogprob(torch.autograd.Function):
        @staticmethod
        def forward(ctx, logits, targets, vocab_start, temperature, entropy, group, num_threads):
            s = stats(logits, targets, vocab_start, temperature, entropy, num_threads)
            m, se, tz = s[0], s[1], s[2]
            if group is not None:
                import torch.distributed as dist

                big = m.clone()
                dist.all_reduce(big, op=dist.ReduceOp.MAX, group=group)
                scale = torch.exp(m - big)
                sums = torch.stack([se * scale, tz] + ([scale * (s[3] + (m - big) * se)] if entropy else []))
                dist.all_reduce(sums, group=group)
                m, se, tz = big, sums[0], sums[1]
                ze = sums[2] if entropy else None
            else:
                ze = s[3] if entropy else None
            log_se = torch.log(se)
            has = targets >= 0
            zero = torch.zeros_like(m)
            logprob = torch.where(has, (tz - m) - log_se, zero)  # not tz - (m + log_se): keeps low bits
            ent = torch.where(has, log_se - ze / se, zero) if entropy else None
            ctx.save_for_backward(logits, targets, m.contiguous(), log_se.contiguous(), *([ent] if entropy else []))
            ctx.vocab_start, ctx.temperature, ctx.entropy, ctx.num_threads = vocab_start, temperature, entropy, \
                num_threads
            return (logprob, ent) if entropy else logprob

        @staticmethod
        def backward(ctx, grad_logprob, grad_entropy=None):
            logits, targets, m, log_se, *rest = ctx.saved_tensors
            ent = rest[0] if rest else None
            has = targets >= 0
            g_lp = torch.where(has, grad_logprob.float(), torch.zeros_like(m)).contiguous()
            g_ent = None
            if ent is not None and grad_entropy is not None:
                g_ent = torch.where(has, grad_entropy.float(), torch.zeros_like(m)).contiguous()
            grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
            if grad.device.type == "cpu" and grad.nbytes >= _HUGE_PAGES_FROM:
                # A fresh gradient as large as the logits: first-touch page faults
                # would cost as much as the kernel itself (4 KiB pages).
                _core.advise_huge_pages(grad.data_ptr(), grad.nbytes)
            rows, vocab = logits.shape
            args = (logits.data_ptr(), rows, vocab, logits.stride(0), _DTYPES[str(logits.dtype)], targets.data_ptr(),
                    ctx.vocab_start, ctx.temperature, m.data_ptr(), log_se.data_ptr(),
                    ent.data_ptr() if g_ent is not None else 0, g_lp.data_ptr(),
                    g_ent.data_ptr() if g_ent is not None else 0, grad.data_ptr(), grad.stride(0))
            if logits.device.type == "cpu":
                _core.logprob_row_grad(*args, ctx.num_threads)
            elif _cuda_kernels(logits):
                with torch.cuda.device(logits.device):
                    _core.cuda_logprob_row_grad(*args, torch.cuda.current_stream(logits.device).cuda_stream)
            else:
                _grad_torch(logits, targets, ctx.vocab_start, ctx.temperature, m, log_se, ent, g_lp, g_ent, grad)
            return grad, None, None, None, None, None, None

    return TokenLogprob


def _cuda_kernels(t) -> bool:
    return t.device.type == "cuda" and bool(getattr(_core, "built_with_cuda", False))


# Devices without a seqpack kernel: the same arithmetic in torch, a block of rows
# at a time, so the [rows, vocab] temporaries stay bounded.
_ROW_BLOCK = 1024


def _stats_torch(logits, targets, vocab_start, temperature, entropy, out):
    torch = _torch()
    vocab = logits.shape[1]
    for lo in range(0, logits.shape[0], _ROW_BLOCK):
        z = logits[lo: lo + _ROW_BLOCK].float() / temperature
        t = targets[lo: lo + _ROW_BLOCK]
        m = z.max(dim=1).values
        d = z - m[:, None]
        e = torch.exp(d)
        out[0, lo: lo + len(z)] = m
        out[1, lo: lo + len(z)] = e.sum(1)
        local = t - vocab_start
        owned = (local >= 0) & (local < vocab)
        out[2, lo: lo + len(z)] = torch.where(owned, z.gather(1, local.clamp(0, vocab - 1)[:, None])[:, 0],
                                              torch.zeros_like(m))
        if entropy:
            out[3, lo: lo + len(z)] = (e * d).sum(1)
    return out


def _grad_torch(logits, targets, vocab_start, temperature, m, log_se, ent, g_lp, g_ent, grad):
    torch = _torch()
    vocab = logits.shape[1]
    for lo in range(0, logits.shape[0], _ROW_BLOCK):
        hi = lo + _ROW_BLOCK
        logp = (logits[lo:hi].float() / temperature - m[lo:hi, None]) - log_se[lo:hi, None]
        p = torch.exp(logp)
        g = -g_lp[lo:hi, None] * p
        if g_ent is not None:
            g = g - g_ent[lo:hi, None] * p * (logp + ent[lo:hi, None])
        local = targets[lo:hi] - vocab_start
        owned = (local >= 0) & (local < vocab)
        g.scatter_add_(1, local.clamp(0, vocab - 1)[:, None], torch.where(owned, g_lp[lo:hi], 0.0)[:, None])
        grad[lo:hi] = (g / temperature).to(grad.dtype)
    return grad


def packed_token_logprobs(
    logits: "torch.Tensor",
    input_ids: "torch.Tensor",
    cu_seqlens: Any,
    cu_seqlens_padded: Any = None,
    *,
    cp_size: int = 1,
    cp_rank: int = 0,
    return_entropy: bool = False,
    temperature: float = 1.0,
    vocab_parallel_group=None,
    vocab_start: int = 0,
    num_threads: int = 0,
) -> Union["torch.Tensor", Tuple["torch.Tensor", "torch.Tensor"]]:
    """Log-probability of each packed token's next token, fused and differentiable.

    Args:
        logits: ``[T, V]`` (fp32, bf16 or fp16) for the packed rows; with CP this
            rank's ``T / cp_size`` zigzag-local rows; with a vocabulary-parallel
            head the local vocabulary slice ``[T, V / TP]``.
        input_ids: the full packed ids ``[T]`` (also under CP).
        cu_seqlens: real cumulative lengths ``[B + 1]`` (host or device; read once).
        cu_seqlens_padded: padded cumulative lengths (the THD offsets); default
            ``cu_seqlens``.
        cp_size / cp_rank: context parallelism of ``logits``.
        return_entropy: also return the per-token entropy (0 where no target).
        temperature: logits are divided by it first.
        vocab_parallel_group / vocab_start: tensor-parallel vocabulary: the group
            over which the slices are combined and this rank's first vocabulary id.
        num_threads: CPU threads (0: all the process may use).

    Returns:
        ``[rows]`` fp32 log-probabilities (and entropies), 0 at padding and at each
        sequence's last real token. The backward writes ``d/d logits`` directly
        (softmax minus one-hot, scaled), in the logits' dtype.
    """
    torch = _torch()
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"logits must be a [T, V] tensor, got {getattr(logits, 'shape', type(logits))}")
    if str(logits.dtype) not in _DTYPES:
        raise TypeError(f"logits must be float32, bfloat16 or float16, got {logits.dtype}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 1:
        raise ValueError("input_ids must be the 1-D packed token ids [T]")
    if not (temperature > 0):
        raise ValueError(f"temperature must be positive, got {temperature}")
    cp = as_positive_int(cp_size, "cp_size")
    sources = next_token_sources(cu_seqlens, cu_seqlens_padded, cp, cp_rank)
    total = int((_host_offsets(cu_seqlens_padded, "cu_seqlens_padded") if cu_seqlens_padded is not None
                 else _host_offsets(cu_seqlens, "cu_seqlens"))[-1])
    if logits.shape[0] != sources.shape[0]:
        raise ValueError(f"logits has {logits.shape[0]} rows; the packed layout has {sources.shape[0]} "
                         f"(cu_seqlens_padded[-1] = {total}{f', cp_size = {cp}' if cp > 1 else ''})")
    if input_ids.shape[0] != total:
        raise ValueError(f"input_ids must hold the full packed ids [{total}], got {input_ids.shape[0]}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    src = torch.from_numpy(sources).to(input_ids.device)
    targets = torch.where(src >= 0, input_ids[src.clamp(min=0)].long(), src).to(logits.device).contiguous()
    fn = _FusedTokenLogprob.get()
    return fn.apply(logits, targets, int(vocab_start), float(temperature), bool(return_entropy),
                    vocab_parallel_group, int(num_threads))
