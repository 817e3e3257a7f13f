"""Column log-probs of a vocabulary split over a tensor-parallel group (issue 30,
item 1): :func:`~seqpack.training.logprobs_columns.column_logprobs` and
:func:`~seqpack.training.logprobs_columns.linear_column_logprobs` when each rank
holds a slice ``[start, start + V_local)`` of the logits or of the LM head.

A column's log-prob is its logit minus its row's log-sum-exp over the whole
vocabulary; both come from vocabulary-parallel pieces that each have their own
backward::

    z   = the columns' logits: each rank's owned ones, summed over the group    one all-reduce
    lp0 = the vocabulary-parallel log-prob of one anchor column per row         the row statistics' two
    lse = z[anchor] - lp0,   log p(column) = z[column] - lse                    all-reduces

The anchor is the row's first column (id 0 where it is negative): any id works,
its log-prob carries the row's log-sum-exp and entropy. With the LM head, a column's
logit is one dot product ``hidden[row] . weight[column]`` on its owner, a chunk of
columns at a time; the hidden states' gradient of those products is all-reduced
over the group (each rank's columns reach every row), as the log-prob's is.

Importing this module does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from .._lengths import as_positive_int
from .logprobs import TokenLogprobs

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["vocab_parallel_column_logprobs", "vocab_parallel_linear_column_logprobs"]


def _start(group: Any, width: int, vocab_start: Any) -> int:
    import torch.distributed as dist

    if vocab_start is None:
        return dist.get_rank(group) * width
    return as_positive_int(vocab_start, "vocab_start", allow_zero=True)


def _compose(z: "torch.Tensor", lp0: "torch.Tensor", ent: "torch.Tensor", columns: "torch.Tensor",
             entropy: bool) -> TokenLogprobs:
    """``z`` ``[T, 1 + k]`` (anchor first, / temperature) and the anchor's log-prob ->
    the columns' log-probs (0 where a column is negative)."""
    import torch

    log_sumexp = z[:, 0] - lp0.to(z.dtype)
    lp = torch.where(columns >= 0, z[:, 1:] - log_sumexp[:, None], 0.0)
    return TokenLogprobs(lp, ent if entropy else None)


def vocab_parallel_column_logprobs(logits: "torch.Tensor", columns: "torch.Tensor", group: Any,
                                   vocab_start: Any, temperature: float, entropy: bool,
                                   num_threads: int) -> TokenLogprobs:
    """:func:`~seqpack.training.logprobs_columns.column_logprobs` of a vocabulary
    slice of the logits ``[T, V_local]`` (``columns`` int64 ``[T, k]``, global ids;
    every rank calls it with the same shapes). A column outside the global vocabulary
    has no owner and a logit of 0 (NeMo-RL's gather)."""
    import torch

    from . import _logprob_ops as ops
    from .vocab_parallel import vocab_parallel_gather_columns

    start = _start(group, int(logits.shape[1]), vocab_start)
    anchor = columns[:, :1].clamp(min=0)
    z = vocab_parallel_gather_columns(logits, torch.cat([anchor, columns.clamp(min=0)], 1), group,
                                      vocab_start_index=start, agree=False) / temperature
    lp0, ent, _, _ = ops.VocabParallelTokenLogprobs.apply(logits, anchor[:, 0].contiguous(), start, temperature,
                                                          entropy, num_threads, group)
    return _compose(z, lp0, ent, columns, entropy)


_HEAD_COLUMNS = None


def _head_columns():
    """``z[e] = hidden[row[e]] . weight[col[e]] (+ bias[col[e]])`` for this rank's owned
    columns (0 elsewhere), a chunk of columns at a time; backward: index-adds into
    the hidden states, the head rows and the bias, a chunk at a time."""
    global _HEAD_COLUMNS
    if _HEAD_COLUMNS is None:
        import torch

        from ._multi_target_ops import acc_of, extra_chunks, row_column_dots

        class HeadColumns(torch.autograd.Function):
            @staticmethod
            def forward(ctx, hidden, weight, bias, rows, cols, owned):
                ctx.save_for_backward(hidden, weight, rows, cols, owned)
                ctx.has_bias = bias is not None
                return torch.where(owned, row_column_dots(hidden, weight, bias, rows, cols), 0.0)

            @staticmethod
            def backward(ctx, grad):
                hidden, weight, rows, cols, owned = ctx.saved_tensors
                acc = acc_of(hidden.dtype)
                g = torch.where(owned, grad, 0.0).to(acc)
                g_h = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if ctx.needs_input_grad[0] else None
                g_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if ctx.needs_input_grad[1] else None
                for lo, hi in extra_chunks(rows.shape[0], int(hidden.shape[1])):
                    part = g[lo:hi, None]
                    if g_h is not None:
                        g_h.index_add_(0, rows[lo:hi], part * weight[cols[lo:hi]].to(acc))
                    if g_w is not None:
                        g_w.index_add_(0, cols[lo:hi], part * hidden[rows[lo:hi]].to(acc))
                g_b = None
                if ctx.has_bias and ctx.needs_input_grad[2]:
                    g_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device).index_add_(0, cols, g)
                    g_b = g_b.to(weight.dtype)  # the head's dtype, as the bias
                return (None if g_h is None else g_h.to(hidden.dtype), None if g_w is None else g_w.to(weight.dtype),
                        g_b, None, None, None)

        _HEAD_COLUMNS = HeadColumns
    return _HEAD_COLUMNS


def vocab_parallel_linear_column_logprobs(hidden: "torch.Tensor", weight: "torch.Tensor", columns: "torch.Tensor",
                                          group: Any, *, bias: Optional["torch.Tensor"] = None,
                                          vocab_start: Any = None, temperature: float = 1.0, entropy: bool = False,
                                          chunk: int = 0, num_threads: int = 0,
                                          subset: bool = False) -> TokenLogprobs:
    """:func:`~seqpack.training.logprobs_columns.linear_column_logprobs` with the LM
    head's vocabulary split over ``group``: ``hidden`` ``[T, H]`` (the same on every
    rank), ``weight`` ``[V_local, H]`` this rank's slice (``bias`` ``[V_local]``),
    ``columns`` int64 ``[T, k]`` global ids. The logits exist a tile at a time (the
    anchor's log-prob, :func:`~seqpack.training.logprobs.linear_token_logprobs`'s vocabulary-parallel
    op); the hidden states' gradient is summed over the group. ``subset``: the
    log-softmax over each row's k columns only (distillation without
    ``zero_outside_topk``): no log-sum-exp over the vocabulary is taken, only the k
    dot products per row (``group`` may then be None: the whole head on one rank)."""
    import torch

    from . import _logprob_ops as ops
    from .vocab_parallel import sum_over_ranks

    width = int(weight.shape[0])
    if group is None:
        if not subset:
            raise ValueError("without a vocabulary-parallel group use linear_column_logprobs (subset=False)")
        from ._columns import check_columns

        columns = check_columns(columns, hidden.shape[0], width, hidden.device)  # ids must be < V here
    start = 0 if group is None else _start(group, width, vocab_start)
    anchor = columns[:, :1].clamp(min=0)
    ids = columns if subset else torch.cat([anchor, columns], 1)
    rows = torch.arange(hidden.shape[0], device=hidden.device).repeat_interleave(ids.shape[1])
    flat = ids.reshape(-1)
    owned = (flat >= start) & (flat < start + width)
    local = (flat - start).clamp(0, max(width - 1, 0))
    if group is None:  # one rank holds the whole head (subset only: no vocabulary-parallel log-sum-exp)
        z = _head_columns().apply(hidden, weight, bias, rows, local, owned)
    else:
        z = _head_columns().apply(_copy_to_group().apply(hidden, group), weight, bias, rows, local, owned)
        z = sum_over_ranks().apply(z, group)
    z = z.view(ids.shape).to(hidden.dtype).to(z.dtype) / temperature
    if subset:
        from ._columns import subset_log_softmax

        return TokenLogprobs(subset_log_softmax(z, columns), None)
    chunk = ops.chunk_rows(as_positive_int(chunk, "chunk", allow_zero=True), hidden.shape[0], width,
                           hidden.is_cuda)
    lp0, ent, _, _ = ops.VocabParallelLinearTokenLogprobs.apply(hidden, weight, bias, anchor[:, 0].contiguous(), start,
                                                                temperature, entropy, num_threads, chunk, group, True)
    return _compose(z, lp0, ent, columns, entropy)


_COPY = None


def _copy_to_group():
    """Identity forward, the gradient all-reduced over the group backward (Megatron's
    ``copy_to_tensor_model_parallel_region``): each rank's columns add to every row."""
    global _COPY
    if _COPY is None:
        import torch
        import torch.distributed as dist

        class CopyToGroup(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, group):
                ctx.group = group
                return x.view_as(x)

            @staticmethod
            def backward(ctx, grad):
                grad = grad.contiguous().clone()
                dist.all_reduce(grad, group=ctx.group)
                return grad, None

        _COPY = CopyToGroup
    return _COPY
