"""Columns of vocabulary-parallel logits (issue 30, item 2): NeMo-RL's
``gather_logits_at_global_indices`` under tensor parallelism, as
``seqpack.loss.vocab_parallel_gather_columns``.

Each TP rank holds the logits of its slice of the vocabulary ``[start, start +
V_local)``; the wanted columns are global token ids. Every rank gathers the columns
it owns (0 elsewhere), and one all-reduce sums them, so every rank ends with every
column::

    V = 8, TP = 2        rank 0 holds columns 0..3, rank 1 columns 4..7
    columns [5, 1]       rank 0: [0, z1]    rank 1: [z5, 0]    all-reduce: [z5, z1]

The backward is NeMo-RL's: each rank's gradient reaches only the columns it owns,
unscaled (every rank computes the same loss on the gathered columns, and each
column's gradient lives on its one owner). A softmax over the gathered columns is
the full-vocabulary softmax restricted to them and renormalised. With a CP group
(NeMo-RL's ``cp_group``) each rank gathers the columns of its zigzag rows and one
all-gather gives every rank the whole rows.

    >>> import torch
    >>> from seqpack.loss import vocab_parallel_gather_columns
    >>> logits = torch.arange(8.0).view(1, 8)
    >>> vocab_parallel_gather_columns(logits, torch.tensor([[5, 1]])).tolist()   # no TP group: a gather
    [[5.0, 1.0]]
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional

import numpy as np

from .._lengths import as_int, as_positive_int

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["vocab_parallel_gather_columns"]

_SUM = None


def sum_over_ranks():
    """All-reduce (sum) forward, the gradient passed through unchanged backward."""
    global _SUM
    if _SUM is None:
        import torch
        import torch.distributed as dist

        class SumOverRanks(torch.autograd.Function):
            @staticmethod
            def forward(ctx, local, group):
                out = local.clone()
                dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
                return out

            @staticmethod
            def backward(ctx, grad):
                return grad, None

        _SUM = SumOverRanks
    return _SUM


def _tp_world(tp_group: Any) -> int:
    """The size of a given TP group, read from ``torch.distributed`` as NeMo-RL reads
    it (so a group its tests emulate by patching ``get_world_size``, ``get_rank`` and
    ``all_reduce`` is used as given); never ignored: where ``torch.distributed``
    cannot say, a ``ValueError``."""
    import torch.distributed as dist

    try:
        return int(dist.get_world_size(tp_group))
    except (RuntimeError, ValueError, AssertionError, AttributeError, TypeError) as e:
        raise ValueError(f"tp_group was given but torch.distributed cannot size it ({e}); initialise the process "
                         "group, or pass tp_group=None for the whole vocabulary on one rank") from e


def vocab_parallel_gather_columns(logits: "torch.Tensor", columns: "torch.Tensor", tp_group: Any = None,
                                  cp_group: Any = None, *, vocab_start_index: Optional[int] = None,
                                  vocab_end_index: Optional[int] = None, chunk_size: Optional[int] = None,
                                  agree: bool = True) -> "torch.Tensor":
    """The logits at global token ids ``columns`` of vocabulary-parallel ``logits``,
    gathered across ``tp_group`` (NeMo-RL's semantics and argument order; fp32 or fp64,
    differentiable).

    Args:
        logits: ``[..., V_local]`` this rank's vocabulary slice (the whole vocabulary
            without a TP group); with a CP group ``[B, S_cp, V_local]``, this rank's
            zigzag rows of every row (each row padded to ``S_cp * cp``).
        columns: ``[..., k]`` integer global token ids, the same leading shape; with
            a CP group ``[B, S, k]`` for the whole rows (``S <= S_cp * cp``); or one
            set ``[k]`` for every position (NeMo-RL's column gather).
        tp_group: the tensor-parallel group (``None``, or one of size 1: a plain
            gather). A group is used as given, sized and ranked by
            ``torch.distributed`` (its functions patched, as NeMo-RL's tests do,
            included); one it cannot size is refused, never taken for one rank.
        cp_group: the context-parallel group: the columns of this rank's rows are
            gathered here and all-gathered over the group (sequence order, cut to
            ``S``); its backward is :func:`seqpack.cp.gather_cp`'s.
        vocab_start_index / vocab_end_index: this rank's slice (default
            ``rank * V_local`` and ``start + V_local``, NeMo-RL's layout).
        chunk_size: NeMo-RL's memory bound for its upcast copy of the logits; seqpack
            gathers before upcasting (no copy), so it is only checked (> 0).
        agree: before the first collective every rank checks its arguments, then one
            all-reduce over both groups makes every rank raise together when one
            failed or when the ranks' shapes differ (``False`` skips it).

    Returns:
        ``[..., k]`` fp32 (fp64 for fp64 logits): column ``j`` of row ``r`` is the
        full-vocabulary logit ``columns[r, j]``; a column no rank owns (outside the
        vocabulary) is 0.
    """
    import torch
    import torch.distributed as dist

    from .._dist import active, checked_on_every_rank, groups_of, tensor_facts
    from ..tensors._device import check_tensor
    from ._logprob_ops import ColumnGather

    parallel = tp_group is not None and _tp_world(tp_group) > 1
    cp = dist.get_world_size(cp_group) if cp_group is not None and active(cp_group) else 1
    if isinstance(columns, torch.Tensor) and columns.dim() == 1 and logits.dim() >= 1:  # one set for every position
        columns = columns.expand(*logits.shape[:-1], columns.shape[0])

    def local() -> Dict[str, Any]:
        check_tensor(logits, "logits")
        check_tensor(columns, "columns")
        if not logits.dtype.is_floating_point:
            raise TypeError(f"logits must be floating point, got {logits.dtype}")
        if columns.dtype.is_floating_point or columns.dtype == torch.bool:
            raise TypeError(f"columns must hold integer token ids, got {columns.dtype}")
        if chunk_size is not None:
            as_positive_int(chunk_size, "chunk_size")
        if cp > 1:
            if logits.dim() != 3 or columns.dim() != 3 or columns.shape[0] != logits.shape[0]:
                raise ValueError(f"with a CP group logits must be [B, S_cp, V_local] and columns [B, S, k], got "
                                 f"{tuple(logits.shape)} and {tuple(columns.shape)}")
            if columns.shape[1] > logits.shape[1] * cp or (logits.shape[1] * cp) % (2 * cp):
                raise ValueError(f"columns cover {columns.shape[1]} positions; this rank's {logits.shape[1]} rows "
                                 f"x cp {cp} must cover them, in 2 x cp zigzag chunks")
        elif logits.dim() < 1 or columns.dim() != logits.dim() or columns.shape[:-1] != logits.shape[:-1]:
            raise ValueError(f"columns must be [..., k] with logits' leading shape {tuple(logits.shape[:-1])}, got "
                             f"{tuple(columns.shape)}")
        width = int(logits.shape[-1])
        rank = dist.get_rank(tp_group) if parallel else 0
        start = rank * width if vocab_start_index is None else as_int(vocab_start_index, "vocab_start_index")
        end = start + width if vocab_end_index is None else as_int(vocab_end_index, "vocab_end_index")
        if end - start != width:
            raise ValueError(f"vocab_end_index - vocab_start_index must be logits' vocabulary slice ({width}), got "
                             f"[{start}, {end})")
        return {"start": start, "end": end}

    facts = (lambda _: {"the shapes of logits and columns (but the vocabulary slice)":
                        [tuple(logits.shape[:-1]), tuple(columns.shape)],
                        "whether logits require grad": tensor_facts(logits)["requires_grad"]})
    groups = groups_of(tp_group, cp_group)  # real process groups only: an emulated one has no agreement to join
    slice_ = checked_on_every_rank(local, groups, "vocab_parallel_gather_columns", agree and bool(groups),
                                   fingerprint=facts)
    start, end = slice_["start"], slice_["end"]
    ids = columns.to(device=logits.device, dtype=torch.int64)
    if cp > 1:  # this rank's zigzag rows of every (padded) row's columns
        from ..tensors.cp import cp_local_rows, gather_cp

        batch, local_rows, k = logits.shape[0], logits.shape[1], ids.shape[-1]
        padded, full = local_rows * cp, ids.shape[1]
        cu = np.arange(batch + 1, dtype=np.int64) * padded
        ids = torch.nn.functional.pad(ids, (0, 0, 0, padded - full)).reshape(batch * padded, k)
        ids = cp_local_rows(ids, cu, cp, dist.get_rank(cp_group)).view(batch, local_rows, k)
    owned = (ids >= start) & (ids < end)
    index = (ids - start).clamp(0, max(int(logits.shape[-1]) - 1, 0))
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    if logits.shape[-1] == 0:  # an empty slice owns no column
        values = logits.new_zeros(ids.shape, dtype=dtype)
    else:
        values = torch.where(owned, ColumnGather.apply(logits, index).to(dtype), 0.0)
    if parallel:
        values = sum_over_ranks().apply(values, tp_group)
    if cp > 1:
        values = gather_cp(values.reshape(batch * local_rows, k), cu, cp_group, agree=False)
        values = values.view(batch, padded, k)[:, :full]
    return values
