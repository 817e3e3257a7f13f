"""The torch operators behind :func:`seqpack.token_logprobs` on rows
(:func:`~seqpack.training.logprobs.packed_token_logprobs`).

``seqpack::logprob_stats`` (per-row max, sum of exponentials, target logit,
entropy sum) and ``seqpack::logprob_grad`` (the gradient written straight into a
logits-shaped tensor) run seqpack's kernels (C++ on the CPU, CUDA on the GPU, both
on the arithmetic of ``seqpack/logprob_math.hpp``); ``seqpack::token_logprobs``
composes them into log-probs (and entropies) with an autograd formula. All three
are ``torch.library.custom_op``s with fake implementations, so ``torch.compile``
traces through them and CUDA graphs capture them (no host synchronisation).

float64 logits (for ``gradcheck``) and devices without a seqpack kernel take the
same formulas in PyTorch ops. Imported on first use; ``import seqpack`` does not
import torch.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .. import _core
from ..tensors._device import cuda_kernels, dlpack

_KERNEL_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_HUGE_PAGES_FROM = 64 << 20  # bytes
# Devices or dtypes without a seqpack kernel: the same arithmetic in torch, a block
# of rows at a time, so the [rows, vocab] temporaries stay bounded.
_ROW_BLOCK = 1024


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the row statistics and log-probs: fp64 for fp64 logits, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _kernel(logits: torch.Tensor) -> Optional[str]:
    """"cpu" / "cuda" when a seqpack kernel runs these logits, else None."""
    if logits.dtype not in _KERNEL_DTYPES:
        return None
    if logits.device.type == "cpu":
        return "cpu"
    return "cuda" if cuda_kernels(logits.device) else None


def _launch(kernel: str, name: str, logits: torch.Tensor, args: tuple, num_threads: int, **kwargs) -> None:
    """``_core.<name>`` on the CPU (with a thread count) or on the logits' CUDA device
    and current stream. Tensors cross as DLPack capsules; the binding checks them."""
    args = tuple(dlpack(a) if isinstance(a, torch.Tensor) else a for a in args)
    kwargs = {k: dlpack(a) if isinstance(a, torch.Tensor) else a for k, a in kwargs.items()}
    if kernel == "cpu":
        getattr(_core, name)(*args, num_threads=num_threads, **kwargs)
    else:
        with torch.cuda.device(logits.device):
            getattr(_core, name)(*args, stream=torch.cuda.current_stream(logits.device).cuda_stream, **kwargs)


def _checked(logits: torch.Tensor, targets: torch.Tensor, *rows_vectors: torch.Tensor) -> torch.Tensor:
    """The operators' inputs as the kernels read them (the binding checks them again): targets int64
    ``[rows]`` on the logits' device, every per-row vector ``[rows]`` there too;
    returns logits with unit column stride and a row stride >= V (a copy otherwise)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, V], got shape {tuple(logits.shape)}")
    rows = logits.shape[0]
    if targets.dtype != torch.int64 or tuple(targets.shape) != (rows,) or targets.device != logits.device:
        raise ValueError(f"targets must be int64 [{rows}] on {logits.device}, got {targets.dtype} "
                         f"{tuple(targets.shape)} on {targets.device}")
    for v in rows_vectors:
        if tuple(v.shape) != (rows,) or v.device != logits.device:
            raise ValueError(f"per-row statistics must be [{rows}] on {logits.device}, got {tuple(v.shape)} on "
                             f"{v.device}")
    if logits.stride(1) != 1 or logits.stride(0) < logits.shape[1]:
        logits = logits.contiguous()
    return logits


# ---- seqpack::logprob_stats -------------------------------------------------------
@torch.library.custom_op("seqpack::logprob_stats", mutates_args=())
def logprob_stats(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, temperature: float,
                  entropy: bool, num_threads: int) -> torch.Tensor:
    """``[4, rows]``: max z, sum exp(z - max), the target's z (0 where this slice
    does not hold it), sum exp(z - max)(z - max) (0 without ``entropy``); z = x / temperature."""
    logits = _checked(logits, targets)
    targets = targets.contiguous()
    rows, vocab = logits.shape
    out = torch.zeros((4, rows), dtype=acc_dtype(logits.dtype), device=logits.device)
    kernel = _kernel(logits)
    if kernel is None:
        return _stats_torch(logits, targets, vocab_start, temperature, entropy, out)
    args = (logits, targets, vocab_start, temperature, out[0], out[1], out[3] if entropy else None, out[2])
    _launch(kernel, "logprob_row_stats", logits, args, num_threads)
    return out


@logprob_stats.register_fake
def _(logits, targets, vocab_start, temperature, entropy, num_threads):
    return logits.new_empty((4, logits.shape[0]), dtype=acc_dtype(logits.dtype))


def _stats_torch(logits, targets, vocab_start, temperature, entropy, out):
    vocab = logits.shape[1]
    for lo in range(0, logits.shape[0], _ROW_BLOCK):
        z = logits[lo: lo + _ROW_BLOCK].to(out.dtype) / temperature
        m = z.amax(dim=1)  # NaN propagates
        d = z - m[:, None]
        e = torch.where(z == -torch.inf, 0.0, torch.exp(d))  # masked logits add exactly 0
        out[0, lo: lo + len(z)] = m
        out[1, lo: lo + len(z)] = e.sum(1)
        local = targets[lo: lo + _ROW_BLOCK] - vocab_start
        owned = (local >= 0) & (local < vocab)
        out[2, lo: lo + len(z)] = torch.where(owned, z.gather(1, local.clamp(0, vocab - 1)[:, None])[:, 0], 0.0)
        if entropy:
            out[3, lo: lo + len(z)] = torch.where(e == 0, 0.0, e * d).sum(1)
    return out


# ---- seqpack::logprob_grad ---------------------------------------------------------
@torch.library.custom_op("seqpack::logprob_grad", mutates_args=())
def logprob_grad(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, temperature: float,
                 max: torch.Tensor, log_sumexp: torch.Tensor, entropy: Optional[torch.Tensor],
                 grad_logprob: torch.Tensor, grad_entropy: Optional[torch.Tensor], num_threads: int,
                 extra_offsets: Optional[torch.Tensor] = None, extra_ids: Optional[torch.Tensor] = None,
                 extra_grad: Optional[torch.Tensor] = None) -> torch.Tensor:
    """d(grad_logprob . logprob + grad_entropy . entropy) / d logits, in the logits' dtype.
    Rows whose upstream gradients are all 0 (padding, no target) get exact zeros,
    also where their logits are NaN: garbage in padding rows never reaches a weight.

    Extra targets (several columns of a row read from its one log-sum-exp, see
    ``logprob_math.hpp``): row ``r``'s are ``extra_ids[extra_offsets[r]:extra_offsets[r + 1]]``
    (global ids, < 0 skipped) with upstream gradients ``extra_grad``; all three or none."""
    return _grad_into(logits, targets, vocab_start, temperature, max, log_sumexp, entropy, grad_logprob, grad_entropy,
                      num_threads, extra_offsets, extra_ids, extra_grad,
                      logits_sized(logits.shape, logits.dtype, logits.device))


def logits_sized(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """A fresh (uninitialised) tensor for a gradient of logits. On the CPU a large one
    is advised huge pages: with 4 KiB pages its first-touch faults cost as much as the
    kernel that writes it."""
    grad = torch.empty(shape, dtype=dtype, device=device)
    if grad.device.type == "cpu" and grad.nbytes >= _HUGE_PAGES_FROM:
        _core.advise_huge_pages(grad)
    return grad


class ColumnGather(torch.autograd.Function):
    """``logits.gather(-1, index)`` whose backward scatters into a
    :func:`logits_sized` gradient (PyTorch's gather backward zero-fills a fresh
    ``[..., V]`` tensor with 4 KiB pages)."""

    @staticmethod
    def forward(ctx, logits, index):
        ctx.save_for_backward(index)
        ctx.like = (logits.shape, logits.dtype, logits.device)
        return logits.gather(-1, index)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        out = logits_sized(*ctx.like).zero_()
        return out.scatter_add_(-1, index, grad.to(out.dtype)), None


@logprob_grad.register_fake
def _(logits, targets, vocab_start, temperature, max, log_sumexp, entropy, grad_logprob, grad_entropy, num_threads,
      extra_offsets=None, extra_ids=None, extra_grad=None):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


@torch.library.custom_op("seqpack::logprob_grad_into", mutates_args=("grad",))
def logprob_grad_into(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, temperature: float,
                      max: torch.Tensor, log_sumexp: torch.Tensor, entropy: Optional[torch.Tensor],
                      grad_logprob: torch.Tensor, grad_entropy: Optional[torch.Tensor], num_threads: int,
                      extra_offsets: Optional[torch.Tensor], extra_ids: Optional[torch.Tensor],
                      extra_grad: Optional[torch.Tensor], grad: torch.Tensor) -> None:
    """:func:`logprob_grad` written into ``grad`` (contiguous, the logits' shape and
    dtype): a caller's workspace, reused tile after tile."""
    _grad_into(logits, targets, vocab_start, temperature, max, log_sumexp, entropy, grad_logprob, grad_entropy,
               num_threads, extra_offsets, extra_ids, extra_grad, grad)


@logprob_grad_into.register_fake
def _(logits, targets, vocab_start, temperature, max, log_sumexp, entropy, grad_logprob, grad_entropy, num_threads,
      extra_offsets, extra_ids, extra_grad, grad):
    return None


def _grad_into(logits, targets, vocab_start, temperature, max, log_sumexp, entropy, grad_logprob, grad_entropy,
               num_threads, extra_offsets, extra_ids, extra_grad, grad):
    if grad_entropy is not None and entropy is None:
        raise ValueError("grad_entropy needs the entropy")
    if tuple(grad.shape) != tuple(logits.shape) or grad.dtype != logits.dtype or not grad.is_contiguous():
        raise ValueError(f"grad must be a contiguous {logits.dtype} {tuple(logits.shape)} tensor")
    extras = _extras(logits, extra_offsets, extra_ids, extra_grad)
    acc = acc_dtype(logits.dtype)
    vectors = [t.to(acc).contiguous() for t in (max, log_sumexp, grad_logprob)]
    ent = entropy.to(acc).contiguous() if grad_entropy is not None else None
    g_ent = grad_entropy.to(acc).contiguous() if grad_entropy is not None else None
    logits = _checked(logits, targets, *vectors, *([ent, g_ent] if g_ent is not None else []))
    targets = targets.contiguous()
    m, log_se, g_lp = vectors
    kernel = _kernel(logits)
    if kernel is None:
        return _grad_torch(logits, targets, vocab_start, temperature, m, log_se, ent, g_lp, g_ent, grad, extras)
    args = (logits, targets, vocab_start, temperature, m, log_se, ent, g_lp, g_ent, grad)
    kwargs = {} if extras is None else dict(zip(("extra_offsets", "extra_ids", "extra_grad"), extras))
    _launch(kernel, "logprob_row_grad", logits, args, num_threads, **kwargs)
    return grad


def _extras(logits, offsets, ids, grad):
    """(offsets, ids, grad as fp32) checked as the kernels read them, or None."""
    given = sum(x is not None for x in (offsets, ids, grad))
    if given == 0:
        return None
    if given != 3:
        raise ValueError("extra_offsets, extra_ids and extra_grad must be given together")
    rows, device = logits.shape[0], logits.device
    if (offsets.dtype != torch.int64 or tuple(offsets.shape) != (rows + 1,) or ids.dtype != torch.int64
            or ids.dim() != 1 or tuple(grad.shape) != tuple(ids.shape)
            or any(x.device != device for x in (offsets, ids, grad))):
        raise ValueError(f"extra targets must be int64 offsets [{rows + 1}], int64 ids [E] and gradients [E] on "
                         f"{device}, got {offsets.dtype} {tuple(offsets.shape)}, {ids.dtype} {tuple(ids.shape)}, "
                         f"{tuple(grad.shape)}")
    if ids.shape[0] == 0:
        return None
    acc = acc_dtype(logits.dtype) if _kernel(logits) is None else torch.float32
    return offsets.contiguous(), ids.contiguous(), grad.to(acc).contiguous()


def _grad_torch(logits, targets, vocab_start, temperature, m, log_se, ent, g_lp, g_ent, grad, extras=None):
    vocab, rows = logits.shape[1], logits.shape[0]
    if extras is not None:  # each extra (row, column, gradient), < 0 ids dropped
        # The offsets are absolute positions into ids (a chunk of rows passes its own
        # slice of them, with every id): extras outside [offsets[0], offsets[-1]) are
        # other chunks'. searchsorted needs no host read.
        offsets, ids, eg = extras
        pos = torch.arange(ids.shape[0], device=ids.device)
        e_row = (torch.searchsorted(offsets, pos, right=True) - 1).clamp(0, max(rows - 1, 0))
        keep = (ids >= 0) & (pos >= offsets[0]) & (pos < offsets[-1])
        e_sum = torch.zeros_like(g_lp).index_add_(0, e_row, torch.where(keep, eg, 0.0))
        e_any = torch.zeros(rows, dtype=torch.bool, device=ids.device).index_put_(
            (e_row,), keep & (eg != 0), accumulate=True)
    for lo in range(0, rows, _ROW_BLOCK):
        hi = lo + _ROW_BLOCK
        logp = (logits[lo:hi].to(m.dtype) / temperature - m[lo:hi, None]) - log_se[lo:hi, None]
        p = torch.exp(logp)
        coef = -g_lp[lo:hi, None] if extras is None else -(g_lp[lo:hi] + e_sum[lo:hi])[:, None]
        if g_ent is not None:
            coef = coef - g_ent[lo:hi, None] * (logp + ent[lo:hi, None])
        g = torch.where(p == 0, 0.0, p * coef)  # a masked logit gets 0, not 0 * -inf
        local = targets[lo:hi] - vocab_start
        owned = (local >= 0) & (local < vocab)
        g.scatter_add_(1, local.clamp(0, vocab - 1)[:, None], torch.where(owned, g_lp[lo:hi], 0.0)[:, None])
        silent = g_lp[lo:hi] == 0
        if g_ent is not None:
            silent = silent & (g_ent[lo:hi] == 0)
        if extras is not None:
            col = ids - vocab_start
            mine = keep & (col >= 0) & (col < vocab) & (e_row >= lo) & (e_row < hi)
            g.index_put_((e_row[mine] - lo, col[mine]), eg[mine], accumulate=True)
            silent = silent & ~e_any[lo:hi]
        grad[lo:hi] = torch.where(silent[:, None], 0.0, g / temperature).to(grad.dtype)  # as the kernels
    return grad


# ---- seqpack::token_logprobs --------------------------------------------------------
def finish(stats: torch.Tensor, targets: torch.Tensor, owned: torch.Tensor, entropy: bool
           ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprobs, entropy or an empty tensor, max, log_sumexp) from combined statistics.
    Rows without a target get 0; rows whose target no vocabulary slice holds get NaN."""
    m, se, tz, ze = stats[0], stats[1], stats[2], stats[3]
    log_se = torch.log(se)
    has = targets >= 0
    logprob = (tz - m) - log_se  # not tz - (m + log_se): keeps the low bits
    logprob = torch.where(has, torch.where(owned, logprob, torch.nan), 0.0)
    ent = torch.where(has, log_se - ze / se, 0.0) if entropy else m.new_empty(0)
    return logprob, ent, m.contiguous(), log_se.contiguous()


def owned_by(targets: torch.Tensor, vocab_start: int, vocab: int) -> torch.Tensor:
    return (targets >= vocab_start) & (targets < vocab_start + vocab)


@torch.library.custom_op("seqpack::token_logprobs", mutates_args=())
def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, temperature: float,
                   return_entropy: bool, num_threads: int
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row log-prob of ``targets`` (and entropy) of the whole vocabulary ``logits``."""
    stats = logprob_stats(logits, targets, vocab_start, temperature, return_entropy, num_threads)
    return finish(stats, targets, owned_by(targets, vocab_start, logits.shape[1]), return_entropy)


@token_logprobs.register_fake
def _(logits, targets, vocab_start, temperature, return_entropy, num_threads):
    rows, dtype = logits.shape[0], acc_dtype(logits.dtype)
    new = lambda n: logits.new_empty(n, dtype=dtype)  # noqa: E731
    return new(rows), new(rows if return_entropy else 0), new(rows), new(rows)


def backward(ctx, grad_logprob, grad_entropy):
    """The logits' gradient from the saved statistics (shared by the vocabulary-parallel path)."""
    logits, targets, m, log_se, ent = ctx.saved_tensors
    has = targets >= 0
    g_lp = torch.where(has, grad_logprob, 0.0) if grad_logprob is not None else torch.zeros_like(m)
    g_ent = None
    if ctx.return_entropy and grad_entropy is not None:
        g_ent = torch.where(has, grad_entropy, 0.0)
    return logprob_grad(logits, targets, ctx.vocab_start, ctx.temperature, m, log_se,
                        ent if g_ent is not None else None, g_lp, g_ent, ctx.num_threads)


def _save(ctx, logits, targets, vocab_start, temperature, return_entropy, num_threads, m, log_se, ent):
    """What :func:`backward` reads (both autograd paths)."""
    ctx.save_for_backward(logits, targets, m, log_se, ent)
    ctx.vocab_start, ctx.temperature, ctx.return_entropy, ctx.num_threads = (vocab_start, temperature,
                                                                             return_entropy, num_threads)


def _setup(ctx, inputs, output):
    _, ent, m, log_se = output
    _save(ctx, *inputs, m, log_se, ent)


def _token_logprobs_backward(ctx, grad_logprob, grad_entropy, grad_max, grad_log_sumexp):
    return backward(ctx, grad_logprob, grad_entropy), None, None, None, None, None


token_logprobs.register_autograd(_token_logprobs_backward, setup_context=_setup)


def combine_slices(stats: torch.Tensor, targets: torch.Tensor, vocab_start: int, vocab: int, group
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The statistics of the whole vocabulary from each rank's slice: two all-reduces
    of ``[rows]`` vectors (the max, then the sums rebased to it, with the count of
    ranks that hold the target). Returns (stats, owned)."""
    import torch.distributed as dist

    m = stats[0].clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    s, t = rebase(stats, m)
    owned = owned_by(targets, vocab_start, vocab).to(m.dtype)
    sums = torch.stack([s, stats[2], t, owned])
    dist.all_reduce(sums, group=group)
    return torch.stack([m, sums[0], sums[1], sums[2]]), sums[3] > 0


def rebase(stats: torch.Tensor, m: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """A slice's (sum exp, sum exp * (z - max)) re-expressed at the maximum ``m`` >= its
    own (logprob_math.hpp's lse_rebase): a slice with only masked logits (max -inf)
    contributes 0, not -inf * 0."""
    same = stats[0] == m
    e = torch.where(same, 1.0, torch.exp(stats[0] - m))
    ed = torch.where(same | (e == 0), 0.0, e * (stats[0] - m))
    return stats[1] * e, e * stats[3] + ed * stats[1]


def merge_stats(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The statistics of two vocabulary slices of the same rows, as one (exact)."""
    m = torch.maximum(a[0], b[0])  # NaN propagates
    sa, ta = rebase(a, m)
    sb, tb = rebase(b, m)
    return torch.stack([m, sa + sb, a[2] + b[2], ta + tb])


class VocabParallelTokenLogprobs(torch.autograd.Function):
    """The same with the vocabulary split over a (tensor-parallel) group: each rank's
    statistics are combined with two all-reduces of ``[rows]`` vectors (max, then
    the rescaled sums); the backward needs no communication."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, temperature, return_entropy, num_threads, group):
        s = logprob_stats(logits, targets, vocab_start, temperature, return_entropy, num_threads)
        stats, owned = combine_slices(s, targets, vocab_start, logits.shape[1], group)
        logprob, ent, m, log_se = finish(stats, targets, owned, return_entropy)
        _save(ctx, logits, targets, vocab_start, temperature, return_entropy, num_threads, m, log_se, ent)
        ctx.mark_non_differentiable(m, log_se)
        return logprob, ent, m, log_se

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy, grad_max, grad_log_sumexp):
        return backward(ctx, grad_logprob, grad_entropy), None, None, None, None, None, None


# ---- seqpack::linear_token_logprobs: from hidden states and the LM head -------------
# Logits exist one tile at a time, at most ``chunk`` rows' worth (``chunk × V``); the
# backward recomputes each tile. A tile is ``chunk`` rows by the whole vocabulary;
# when that is under _MIN_TILE_ROWS rows (a large vocabulary) and there are fewer
# rows than vocabulary entries, it is every row by a slice of the vocabulary
# instead: the head's gradient [V, H] is then written once per slice rather than
# accumulated by a matmul with K = chunk over every chunk (measured on the CPU at
# V = 152k, T = 2k: 1.16-1.3x PyTorch's time instead of 1.3-1.45x; at V = 32k the
# row tiles are faster). Default chunk: about 2^24 logits (64 MiB in fp32).
# On CUDA the default is about 2^26 logits, and tiles are vocabulary slices whenever
# there are fewer rows than vocabulary entries (and more than a chunk): the head's
# fp32 gradient accumulator [V, H] of row tiles costs more memory and no less time
# (measured on an H200 at V = 152k, H = 4096, bf16, T = 8k / 16k: row tiles of
# 1024-4096 rows took 1.18-1.42x PyTorch's time holding 4.2-5.9 GB; this default's
# slices 1.17-1.19x holding 0.4-0.6 GB: benchmarks/results/gpu_issue30_h200_*.md).
_CHUNK_LOGITS = 1 << 24
_CHUNK_LOGITS_CUDA = 1 << 26
# torch.mm(a, b, out_dtype=torch.float32) for bf16 / fp16 operands (CUDA; PyTorch >= 2.8).
_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")
_MIN_TILE_ROWS = 256
_SLICE_ALIGN = 64  # columns: a vocabulary slice's width is a multiple (128 bytes of bf16)


def chunk_rows(chunk_tokens: int, rows: int, vocab: int, cuda: bool = False) -> int:
    """Rows per chunk: ``chunk_tokens`` when given (> 0), else ~2^24 logits (2^26 on CUDA)."""
    if chunk_tokens > 0:
        return chunk_tokens
    budget = _CHUNK_LOGITS_CUDA if cuda else _CHUNK_LOGITS
    return max(1, min(max(rows, 1), budget // max(vocab, 1)))


def tiles(rows: int, vocab: int, chunk: int, cuda: bool = False):
    """(row range, vocabulary range) of each tile, within ``chunk × vocab`` logits."""
    if rows <= chunk or rows >= vocab or (chunk >= _MIN_TILE_ROWS and not cuda):
        return [((lo, min(rows, lo + chunk)), (0, vocab)) for lo in range(0, rows, chunk)]
    width = max(1, chunk * vocab // rows)
    if width > _SLICE_ALIGN:  # slices of whole 128-byte lines: the kernels' vectorised rows
        width -= width % _SLICE_ALIGN
    return [((0, rows), (v0, min(vocab, v0 + width))) for v0 in range(0, vocab, width)]


def _linear(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.linear(hidden, weight, bias)


def _tile_logits(hidden, weight, bias, r, v, workspace=None):
    """The logits of tile ``(r, v)``; with ``workspace`` (a flat buffer of the largest
    tile) written into its front instead of a fresh tensor."""
    h, w, b = hidden[r[0]:r[1]], weight[v[0]:v[1]], None if bias is None else bias[v[0]:v[1]]
    if workspace is None:
        return _linear(h, w, b)
    out = workspace[: h.shape[0] * w.shape[0]].view(h.shape[0], w.shape[0])
    return torch.mm(h, w.t(), out=out) if b is None else torch.addmm(b, h, w.t(), out=out)


def tile_workspace(plan, like: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """One flat buffer for the largest tile of ``plan``, allocated once per call (the
    tiles reuse it, so the peak does not depend on when the allocator returns a
    freed tile to the system: issue 30, item 7)."""
    size = max(((r1 - r0) * (v1 - v0) for (r0, r1), (v0, v1) in plan), default=0)
    buffer = torch.empty(size, dtype=dtype or like.dtype, device=like.device)
    if isinstance(size, int) and buffer.device.type == "cpu" and size * buffer.element_size() >= _HUGE_PAGES_FROM:
        _core.advise_huge_pages(buffer)  # (not while tracing: symbolic sizes)
    return buffer


def linear_stats(hidden, weight, bias, targets, vocab_start, temperature, entropy, num_threads, chunk):
    """:func:`logprob_stats` of ``hidden @ weight.T + bias``, a tile at a time in one
    workspace (vocabulary slices of the same rows merged exactly)."""
    rows = hidden.shape[0]
    out = torch.zeros((4, rows), dtype=acc_dtype(hidden.dtype), device=hidden.device)
    merged = None
    plan = tiles(rows, weight.shape[0], chunk, hidden.is_cuda)
    workspace = tile_workspace(plan, hidden)
    for r, v in plan:
        s = logprob_stats(_tile_logits(hidden, weight, bias, r, v, workspace), targets[r[0]:r[1]],
                          vocab_start + v[0], temperature, entropy, num_threads)
        if v == (0, weight.shape[0]):
            out[:, r[0]:r[1]] = s
        else:
            merged = s if merged is None else merge_stats(merged, s)
    return out if merged is None else merged


def linear_grads(ctx, grad_logprob, grad_entropy, needs: Tuple[bool, bool, bool], extras=None):
    """(d hidden, d weight, d bias), a tile at a time: each tile's logits recomputed,
    their gradient from :func:`logprob_grad`, then two matmuls; what accumulates over
    tiles accumulates in fp32 for bf16 / fp16. ``extras``: ``(offsets, ids, gradients)``
    of extra targets (see :func:`logprob_grad`), or None."""
    hidden, weight, bias, targets, m, log_se, ent = ctx.saved_tensors[:7]
    has = targets >= 0
    g_lp = torch.where(has, grad_logprob, 0.0) if grad_logprob is not None else torch.zeros_like(m)
    g_ent = torch.where(has, grad_entropy, 0.0) if ctx.return_entropy and grad_entropy is not None else None
    want_h, want_w, want_b = needs
    want_b = want_b and bias is not None
    acc = torch.float32 if hidden.dtype in (torch.bfloat16, torch.float16) else hidden.dtype
    rows, vocab = hidden.shape[0], weight.shape[0]
    plan = tiles(rows, vocab, ctx.chunk, hidden.is_cuda)
    by_rows = not plan or plan[0][1] == (0, vocab)  # tiles of rows (or none): the head's gradient accumulates
    accumulate_w = by_rows and len(plan) != 1  # one tile writes the head's gradient directly
    g_hidden = (torch.zeros_like(hidden) if by_rows else torch.zeros(hidden.shape, dtype=acc,
                                                                      device=hidden.device)) if want_h else None
    g_weight = (torch.zeros(weight.shape, dtype=acc, device=weight.device) if accumulate_w
                else torch.empty_like(weight)) if want_w else None
    g_bias = torch.zeros(vocab, dtype=acc, device=weight.device) if want_b else None
    # Products that accumulate over tiles: on CUDA, tensor-core products of the bf16 /
    # fp16 operands with an fp32 result (torch.mm's out_dtype); elsewhere, fp32 products
    # of upcast operands (the upcast gradient tile in a workspace of its own).
    fast = acc != hidden.dtype and hidden.is_cuda and _MM_OUT_DTYPE
    # Two workspaces of the largest tile, allocated once (the forward's is freed by
    # now): the tile's logits and their gradient; the matmuls write into the outputs.
    logits_ws, grad_ws = tile_workspace(plan, hidden), tile_workspace(plan, hidden)
    acc_ws = tile_workspace(plan, hidden, acc) if acc != hidden.dtype and not fast else None
    for r, v in plan:  # no data-dependent skips: traceable, no host reads
        (lo, hi), (v0, v1) = r, v
        h = hidden[lo:hi]
        tile_extras = (None, None, None) if extras is None else (extras[0][lo:hi + 1], extras[1], extras[2])
        z = _tile_logits(hidden, weight, bias, r, v, logits_ws)
        n = z.shape[0] * z.shape[1]
        grad = grad_ws[:n].view(z.shape)
        logprob_grad_into(z, targets[lo:hi], ctx.vocab_start + v0, ctx.temperature, m[lo:hi], log_se[lo:hi],
                          ent[lo:hi] if g_ent is not None else None, g_lp[lo:hi],
                          g_ent[lo:hi] if g_ent is not None else None, ctx.num_threads, *tile_extras, grad)
        grad_acc = grad if acc_ws is None else acc_ws[:n].view(z.shape).copy_(grad)
        if g_hidden is not None:
            if by_rows:
                torch.mm(grad, weight, out=g_hidden[lo:hi])
            elif fast:
                g_hidden.add_(torch.mm(grad, weight[v0:v1], out_dtype=acc))
            else:
                g_hidden.addmm_(grad_acc, weight[v0:v1].to(acc))
        if g_weight is not None:
            if not accumulate_w:
                torch.mm(grad.t(), h, out=g_weight[v0:v1])
            elif fast:
                g_weight.add_(torch.mm(grad.t(), h, out_dtype=acc))
            else:
                g_weight.addmm_(grad_acc.t(), h.to(acc))
        if g_bias is not None:
            g_bias[v0:v1] += grad.sum(0, dtype=acc)
    return (None if g_hidden is None else g_hidden.to(hidden.dtype),
            None if g_weight is None else g_weight.to(weight.dtype),
            None if g_bias is None else g_bias.to(bias.dtype))


def _save_linear(ctx, hidden, weight, bias, targets, vocab_start, temperature, return_entropy, num_threads, chunk,
                 m, log_se, ent):
    ctx.save_for_backward(hidden, weight, bias, targets, m, log_se, ent)
    ctx.vocab_start, ctx.temperature, ctx.return_entropy = vocab_start, temperature, return_entropy
    ctx.num_threads, ctx.chunk = num_threads, chunk


@torch.library.custom_op("seqpack::linear_token_logprobs", mutates_args=())
def linear_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                          targets: torch.Tensor, vocab_start: int, temperature: float, return_entropy: bool,
                          num_threads: int, chunk: int
                          ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row log-prob of ``targets`` (and entropy) under ``hidden @ weight.T + bias``,
    never holding more than ``chunk`` rows of logits."""
    stats = linear_stats(hidden, weight, bias, targets, vocab_start, temperature, return_entropy, num_threads, chunk)
    return finish(stats, targets, owned_by(targets, vocab_start, weight.shape[0]), return_entropy)


@linear_token_logprobs.register_fake
def _(hidden, weight, bias, targets, vocab_start, temperature, return_entropy, num_threads, chunk):
    rows, dtype = hidden.shape[0], acc_dtype(hidden.dtype)
    new = lambda n: hidden.new_empty(n, dtype=dtype)  # noqa: E731
    return new(rows), new(rows if return_entropy else 0), new(rows), new(rows)


def _setup_linear(ctx, inputs, output):
    hidden, weight, bias, targets, vocab_start, temperature, return_entropy, num_threads, chunk = inputs
    _, ent, m, log_se = output
    _save_linear(ctx, hidden, weight, bias, targets, vocab_start, temperature, return_entropy, num_threads, chunk,
                 m, log_se, ent)


def _linear_backward(ctx, grad_logprob, grad_entropy, grad_max, grad_log_sumexp):
    g_h, g_w, g_b = linear_grads(ctx, grad_logprob, grad_entropy, tuple(ctx.needs_input_grad[:3]))
    return g_h, g_w, g_b, None, None, None, None, None, None


linear_token_logprobs.register_autograd(_linear_backward, setup_context=_setup_linear)


class VocabParallelLinearTokenLogprobs(torch.autograd.Function):
    """:func:`linear_token_logprobs` with the LM head's vocabulary split over a group:
    the statistics of all chunks are combined once (two all-reduces of ``[rows]``
    vectors); the backward all-reduces the hidden states' gradient (each rank's
    slice contributes to every row) unless ``reduce_hidden_grad`` is off."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, vocab_start, temperature, return_entropy, num_threads, chunk,
                group, reduce_hidden_grad):
        s = linear_stats(hidden, weight, bias, targets, vocab_start, temperature, return_entropy, num_threads, chunk)
        stats, owned = combine_slices(s, targets, vocab_start, weight.shape[0], group)
        logprob, ent, m, log_se = finish(stats, targets, owned, return_entropy)
        _save_linear(ctx, hidden, weight, bias, targets, vocab_start, temperature, return_entropy, num_threads, chunk,
                     m, log_se, ent)
        ctx.group, ctx.reduce_hidden_grad = group, reduce_hidden_grad
        ctx.mark_non_differentiable(m, log_se)
        return logprob, ent, m, log_se

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy, grad_max, grad_log_sumexp):
        import torch.distributed as dist

        g_h, g_w, g_b = linear_grads(ctx, grad_logprob, grad_entropy, tuple(ctx.needs_input_grad[:3]))
        if g_h is not None and ctx.reduce_hidden_grad:
            dist.all_reduce(g_h, group=ctx.group)
        return g_h, g_w, g_b, None, None, None, None, None, None, None, None
