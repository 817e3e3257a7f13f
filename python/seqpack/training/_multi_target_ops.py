"""Several targets per row from one log-sum-exp: the torch operators behind
:func:`seqpack.token_logprobs` on a prefix tree (a branch point predicts each of
its children; :func:`~seqpack.training.logprobs_tree.tree_token_logprobs`) and its
LM-head-fused form.

Each row ``r`` has a *primary* target ``targets[r]`` (or -1) and *extra* targets
``extra_ids[extra_offsets[r]:extra_offsets[r + 1]]`` (global ids, < 0 for none)::

    row      0      1             2
    primary  6      7             -1
    extras   -      8  9          -
    offsets  [0,    0,            2,  2]        extra_ids = [8, 9]

The forward computes each row's statistics once (``seqpack::logprob_stats``, or a
chunk of the LM head at a time); a target's log-prob is then its logit minus the
row's log-sum-exp, whichever target it is. The backward writes one gradient per row
with seqpack's kernels (``seqpack::logprob_grad`` with the extra targets: one
softmax term weighted by the sum of the row's upstream gradients, one hit per
target column). No ``[rows, V]`` tensor exists beyond the logits themselves (and,
fused, none at all beyond one chunk).

Both operators are ``torch.library.custom_op``s with fake implementations (no host
reads: the extras' rows come from ``repeat_interleave`` with a known output size).
Imported on first use; ``import seqpack`` does not import torch.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import _logprob_ops as ops

__all__ = ["multi_token_logprobs", "linear_multi_token_logprobs"]


def _extra_rows(offsets: torch.Tensor, count: int) -> torch.Tensor:
    """The row of each extra target, from the CSR offsets (no host read)."""
    rows = torch.arange(offsets.shape[0] - 1, device=offsets.device)
    return torch.repeat_interleave(rows, offsets.diff(), output_size=count)


def _extra_logprobs(z: torch.Tensor, ids: torch.Tensor, e_row: torch.Tensor, m: torch.Tensor,
                    log_se: torch.Tensor) -> torch.Tensor:
    """log p of each extra target from its logit z (already / temperature, in the
    statistics' dtype) and its row's statistics; 0 where the id is < 0."""
    return torch.where(ids >= 0, (z - m[e_row]) - log_se[e_row], 0.0)


def _outputs_fake(rows: int, extras: int, entropy: bool, like: torch.Tensor):
    dtype = ops.acc_dtype(like.dtype)
    new = lambda n: like.new_empty(n, dtype=dtype)  # noqa: E731
    return new(rows), new(extras), new(rows if entropy else 0), new(rows), new(rows)


def _upstream(targets, ids, grad_logprob, grad_extra):
    """The primary and extra upstream gradients, zero where there is no target."""
    g_lp = torch.where(targets >= 0, grad_logprob, 0.0) if grad_logprob is not None else None
    g_ex = torch.where(ids >= 0, grad_extra, 0.0) if grad_extra is not None else torch.zeros(
        ids.shape, dtype=torch.float32, device=ids.device)
    return g_lp, g_ex


# ---- on logits ----------------------------------------------------------------------
@torch.library.custom_op("seqpack::multi_token_logprobs", mutates_args=())
def multi_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, extra_offsets: torch.Tensor,
                         extra_ids: torch.Tensor, temperature: float, return_entropy: bool, num_threads: int
                         ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(primary log-probs [rows], extra log-probs [E], entropy or empty, max, log_sumexp)
    of the whole-vocabulary ``logits``; the ids must be < V (callers check)."""
    stats = ops.logprob_stats(logits, targets, 0, temperature, return_entropy, num_threads)
    lp, ent, m, log_se = ops.finish(stats, targets, ops.owned_by(targets, 0, logits.shape[1]), return_entropy)
    e_row = _extra_rows(extra_offsets, extra_ids.shape[0])
    z = logits[e_row, extra_ids.clamp(min=0)].to(m.dtype) / temperature
    return lp, _extra_logprobs(z, extra_ids, e_row, m, log_se), ent, m, log_se


@multi_token_logprobs.register_fake
def _(logits, targets, extra_offsets, extra_ids, temperature, return_entropy, num_threads):
    return _outputs_fake(logits.shape[0], extra_ids.shape[0], return_entropy, logits)


def _setup(ctx, inputs, output):
    logits, targets, offsets, ids, temperature, return_entropy, num_threads = inputs
    _, _, ent, m, log_se = output
    ctx.save_for_backward(logits, targets, offsets, ids, m, log_se, ent)
    ctx.temperature, ctx.return_entropy, ctx.num_threads = temperature, return_entropy, num_threads


def _backward(ctx, grad_logprob, grad_extra, grad_entropy, grad_max, grad_log_sumexp):
    logits, targets, offsets, ids, m, log_se, ent = ctx.saved_tensors
    g_lp, g_ex = _upstream(targets, ids, grad_logprob, grad_extra)
    if g_lp is None:
        g_lp = torch.zeros_like(m)
    g_ent = torch.where(targets >= 0, grad_entropy, 0.0) if ctx.return_entropy and grad_entropy is not None else None
    grad = ops.logprob_grad(logits, targets, 0, ctx.temperature, m, log_se, ent if g_ent is not None else None, g_lp,
                            g_ent, ctx.num_threads, offsets, ids, g_ex)
    return grad, None, None, None, None, None, None


multi_token_logprobs.register_autograd(_backward, setup_context=_setup)


# ---- from hidden states and the LM head -----------------------------------------------
# Extra targets' logits are dot products of gathered rows ``[E, H]``: at most this many
# elements of them exist at once (a distillation's k columns per row make E = T * k).
_EXTRA_ELEMENTS = 1 << 22


def acc_of(dtype: torch.dtype) -> torch.dtype:
    """fp32 for bf16 / fp16, else the dtype itself: where dot products accumulate."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def extra_chunks(count: int, width: int):
    """``(lo, hi)`` ranges of extras whose gathered ``[hi - lo, width]`` rows stay
    under ``_EXTRA_ELEMENTS`` elements."""
    step = max(1, _EXTRA_ELEMENTS // max(width, 1))
    return [(lo, min(count, lo + step)) for lo in range(0, count, step)]


def row_column_dots(hidden, weight, bias, rows, cols):
    """``hidden[rows[e]] . weight[cols[e]] (+ bias[cols[e]])`` for every extra ``e``
    (``cols`` valid row indices of ``weight``), accumulated in :func:`acc_of`, a
    chunk of extras at a time (no data-dependent skips: traceable, no host reads)."""
    acc = acc_of(hidden.dtype)
    z = torch.empty(rows.shape[0], dtype=acc, device=hidden.device)
    for lo, hi in extra_chunks(rows.shape[0], int(hidden.shape[1])):
        h, w = hidden[rows[lo:hi]].to(acc), weight[cols[lo:hi]].to(acc)
        z[lo:hi] = torch.bmm(h.unsqueeze(1), w.unsqueeze(2)).view(hi - lo)
    return z if bias is None else z + bias[cols].to(acc)


def _extra_logits(hidden, weight, bias, ids, e_row, dtype):
    """z of each extra target as the LM head gives it (``hidden[row] . weight[id] +
    bias[id]``, rounded to the head's dtype as a logits tile would be), in ``dtype``."""
    return row_column_dots(hidden, weight, bias, e_row, ids.clamp(min=0)).to(hidden.dtype).to(dtype)


@torch.library.custom_op("seqpack::linear_multi_token_logprobs", mutates_args=())
def linear_multi_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                                targets: torch.Tensor, extra_offsets: torch.Tensor, extra_ids: torch.Tensor,
                                temperature: float, return_entropy: bool, num_threads: int, chunk: int
                                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`multi_token_logprobs` of ``hidden @ weight.T + bias``, never holding more
    than ``chunk`` rows of logits (the tiles of ``seqpack::linear_token_logprobs``)."""
    stats = ops.linear_stats(hidden, weight, bias, targets, 0, temperature, return_entropy, num_threads, chunk)
    lp, ent, m, log_se = ops.finish(stats, targets, ops.owned_by(targets, 0, weight.shape[0]), return_entropy)
    e_row = _extra_rows(extra_offsets, extra_ids.shape[0])
    z = _extra_logits(hidden, weight, bias, extra_ids, e_row, m.dtype) / temperature
    return lp, _extra_logprobs(z, extra_ids, e_row, m, log_se), ent, m, log_se


@linear_multi_token_logprobs.register_fake
def _(hidden, weight, bias, targets, extra_offsets, extra_ids, temperature, return_entropy, num_threads, chunk):
    return _outputs_fake(hidden.shape[0], extra_ids.shape[0], return_entropy, hidden)


def _setup_linear(ctx, inputs, output):
    hidden, weight, bias, targets, offsets, ids, temperature, return_entropy, num_threads, chunk = inputs
    _, _, ent, m, log_se = output
    # linear_grads reads the first seven; the extras' offsets and ids follow.
    ctx.save_for_backward(hidden, weight, bias, targets, m, log_se, ent, offsets, ids)
    ctx.vocab_start, ctx.temperature, ctx.return_entropy = 0, temperature, return_entropy
    ctx.num_threads, ctx.chunk = num_threads, chunk


def _linear_backward(ctx, grad_logprob, grad_extra, grad_entropy, grad_max, grad_log_sumexp):
    targets, offsets, ids = ctx.saved_tensors[3], ctx.saved_tensors[7], ctx.saved_tensors[8]
    _, g_ex = _upstream(targets, ids, grad_logprob, grad_extra)
    g_h, g_w, g_b = ops.linear_grads(ctx, grad_logprob, grad_entropy, tuple(ctx.needs_input_grad[:3]),
                                     (offsets, ids, g_ex))
    return g_h, g_w, g_b, None, None, None, None, None, None, None


linear_multi_token_logprobs.register_autograd(_linear_backward, setup_context=_setup_linear)
