"""Context-parallel index maps for the zigzag THD layout.

A sequence of padded length ``L`` is cut into ``2 * cp_size`` chunks; rank ``r``
keeps chunks ``r`` and ``2 * cp_size - 1 - r``::

    cu_seqlens_padded = [0, 8, 16], cp_size = 2
    global  0 1 | 2 3 | 4 5 | 6 7 || 8 9 | 10 11 | 12 13 | 14 15
    rank 0  0 1               6 7    8 9                   14 15
    rank 1        2 3   4 5                10 11   12 13

    >>> from seqpack.tensors.cp import cp_partition_indices
    >>> cp_partition_indices([0, 8, 16], cp_size=2, cp_rank=0).tolist()
    [0, 1, 6, 7, 8, 9, 14, 15]

These are Transformer Engine's index maps; the cut of a layout for one rank,
:func:`seqpack.shard_layout`, applies them (``local_rows(full)``, ``gather(local,
group)``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _core
from .._lengths import as_positive_int, check_not_meta
from .layout import host_offsets

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["cp_local_rows", "cp_partition_indices", "cp_restore_order", "cp_row_positions", "gather_cp"]


def cp_partition_indices(cu_seqlens_padded: Any, cp_size: int, cp_rank: int) -> np.ndarray:
    """Global THD positions held by ``cp_rank``, in its local order (int64); the same
    indices as Transformer Engine's ``thd_get_partitioned_indices``. Every padded
    length must be a multiple of ``2 * cp_size``."""
    return _core.cp_partition_indices(host_offsets(cu_seqlens_padded, "cu_seqlens_padded"),
                                      as_positive_int(cp_size, "cp_size"),
                                      as_positive_int(cp_rank, "cp_rank", allow_zero=True))


def cp_restore_order(cu_seqlens_padded: Any, cp_size: int) -> np.ndarray:
    """Index map that restores sequence order after an all-gather of every rank's
    local THD (rank-major): ``gathered[order]`` is the full THD.

    >>> import numpy as np
    >>> from seqpack.tensors.cp import cp_partition_indices, cp_restore_order
    >>> cu = [0, 8, 16]
    >>> gathered = np.concatenate([cp_partition_indices(cu, 2, r) for r in range(2)])
    >>> gathered[cp_restore_order(cu, 2)].tolist() == list(range(16))
    True
    """
    return _core.cp_restore_order(host_offsets(cu_seqlens_padded, "cu_seqlens_padded"),
                                  as_positive_int(cp_size, "cp_size"))


def cp_row_positions(cu_seqlens_padded: "torch.Tensor", rows: int, cp_size: int = 1, cp_rank: int = 0):
    """For each of a rank's ``rows`` local THD rows: ``(seq, pos)``, its sequence
    and its position inside that padded sequence (the zigzag map of
    :func:`cp_partition_indices`, from an int64 tensor of offsets on the rows'
    device, in PyTorch ops: no host read). Rows past the last sequence belong to
    the last one, with ``pos`` past its span; empty sequences own no row.

    >>> import torch
    >>> seq, pos = cp_row_positions(torch.tensor([0, 8, 12]), 6, cp_size=2, cp_rank=1)
    >>> seq.tolist(), pos.tolist()
    ([0, 0, 0, 0, 1, 1], [2, 3, 4, 5, 1, 2])
    """
    import torch

    check_not_meta(cu_seqlens_padded, "cu_seqlens_padded")
    count = cu_seqlens_padded.shape[0] - 1
    j = torch.arange(rows, device=cu_seqlens_padded.device)
    # The last sequence starting at or before the row (an empty sequence shares its
    # start with the next one, which wins).
    seq = (torch.searchsorted(cu_seqlens_padded[:-1] // cp_size, j, right=True) - 1).clamp(0, max(count - 1, 0))
    start = cu_seqlens_padded[seq]
    pos = j - start // cp_size
    if cp_size > 1:  # chunks cp_rank and 2 * cp_size - 1 - cp_rank of 2 * cp_size
        chunk = (cu_seqlens_padded[seq + 1] - start) // (2 * cp_size)
        pos = torch.where(pos < chunk, cp_rank * chunk + pos, (2 * cp_size - 1 - cp_rank) * chunk + (pos - chunk))
    return seq, pos


def cp_local_rows(full: "torch.Tensor", cu_seqlens_padded: Any, cp_size: int, cp_rank: int) -> "torch.Tensor":
    """Rank ``cp_rank``'s zigzag rows of a full THD tensor ``[T, ...]`` (one gather)."""
    if cp_size == 1:
        return full
    from ._device import host_to_device

    (index,) = host_to_device([cp_partition_indices(cu_seqlens_padded, cp_size, cp_rank)], full.device)
    return full.index_select(0, index)


_GATHER = None


def gather_cp(local: "torch.Tensor", cu_seqlens_padded: Any, group, *, agree: bool = True) -> "torch.Tensor":
    """Every CP rank's zigzag-local rows ``[T / cp, ...]``, all-gathered over
    ``group`` (one collective per micro-batch) and put back in sequence order
    ``[T, ...]``. Backward: one reduce-scatter - the gradient summed over the CP
    group, this rank's rows kept - so when every rank computes the same loss on
    the gathered tensor, divide that loss by the CP size (NeMo-RL's convention);
    when each rank's loss covers only its own part (attention K/V), the sum is the
    gradient.

    ``agree`` (default): before the gather every rank checks ``local`` (a tensor of
    ``cu_seqlens_padded[-1] / cp`` rows) and the offsets (each padded length a
    multiple of ``2 cp``), then one all-reduce over ``group`` tells every rank
    whether any failed and compares the offsets, ``local``'s shape and dtype and
    whether it requires grad (with grad mode on: the backward's reduce-scatter),
    so a rank with other inputs makes every rank raise instead of leaving the others
    waiting in the gather or its backward. ``False`` skips that collective when the
    caller has agreed on all of it already."""
    import torch.distributed as dist

    global _GATHER
    if _GATHER is None:
        _GATHER = _make_gather()
    size = dist.get_world_size(group)
    if agree:
        from .._dist import checked_on_every_rank, tensor_facts

        me = dist.get_rank(group)
        if size < 1 or me < 0:
            raise ValueError(f"this process is not in the CP group (size {size}, rank {me}); it cannot take part "
                             "in gather_cp's all-gather over it")

        def local_checks() -> np.ndarray:
            from ._device import check_tensor

            check_tensor(local, "local")
            cu = host_offsets(cu_seqlens_padded, "cu_seqlens_padded")
            cp_restore_order(cu, size)  # each padded length a multiple of 2 * cp (named error)
            rows = int(cu[-1]) // size
            if local.dim() < 1 or local.shape[0] != rows:
                raise ValueError(f"local must hold this rank's {rows} rows (cu_seqlens_padded[-1] = {int(cu[-1])} "
                                 f"/ cp size {size}), got shape {tuple(local.shape)}")
            return cu

        def facts(cu: np.ndarray):
            shared = tensor_facts(local)
            return {"cu_seqlens_padded": cu.astype(np.int64), "local's shape": shared["shape"],
                    "local's dtype": shared["dtype"], "whether local requires grad (with grad mode on)":
                    shared["requires_grad"]}

        checked_on_every_rank(local_checks, group, "gather_cp", size > 1, fingerprint=facts)
    if size == 1:
        return _GATHER.apply(local, None, group)
    rows = int(host_offsets(cu_seqlens_padded, "cu_seqlens_padded")[-1]) // size
    return _GATHER.apply(local, _RankRows((rows,) * size, lambda: cp_restore_order(cu_seqlens_padded, size)), group)


class _RankRows:
    """How a gather lays out the ranks' rows: ``counts[r]`` rows come from rank ``r``
    (padded to the largest count for the all-gather), and ``order()`` gives, for
    each row of the gathered result, its position in the padded rank-major buffer
    (built when the gather runs)."""

    __slots__ = ("counts", "order")

    def __init__(self, counts, order) -> None:
        self.counts, self.order = tuple(int(c) for c in counts), order


def gather_rank_rows(local: "torch.Tensor", counts, order: np.ndarray, group) -> "torch.Tensor":
    """Every rank's rows (rank ``r`` holds ``counts[r]``, any of them 0) all-gathered
    over ``group`` and put in the order ``order`` (positions in the rank-major
    buffer, each rank's rows padded to ``max(counts)``), differentiable: the
    backward reduce-scatters the gradient, each rank keeping the sum for its own
    rows. No agreement here: the caller has compared ``counts`` and ``local``'s
    shape, dtype and requires_grad on every rank."""
    import torch.distributed as dist

    global _GATHER
    if _GATHER is None:
        _GATHER = _make_gather()
    if dist.get_world_size(group) == 1:
        return _GATHER.apply(local, None, group)
    return _GATHER.apply(local, _RankRows(counts, lambda: order), group)


def _make_gather():
    import torch
    import torch.distributed as dist

    from ._device import host_to_device

    class GatherRanks(torch.autograd.Function):
        """All-gather of every rank's rows (``_RankRows``) in a chosen order; the
        backward is one reduce-scatter."""

        @staticmethod
        def forward(ctx, local, rows, group):
            ctx.group = group
            if rows is None:  # a group of one
                return local.clone()
            width = max(rows.counts)
            padded = local.contiguous()
            if local.shape[0] < width:  # ranks with fewer rows pad up to the widest
                padded = torch.cat([padded, padded.new_zeros((width - local.shape[0],) + tuple(local.shape[1:]))])
            pieces = [torch.empty_like(padded) for _ in rows.counts]
            dist.all_gather(pieces, padded, group=group)
            (order,) = host_to_device([rows.order()], local.device)
            ctx.order, ctx.width, ctx.mine = order, width, local.shape[0]
            return torch.cat(pieces).index_select(0, order)

        @staticmethod
        def backward(ctx, grad):
            if not hasattr(ctx, "order"):
                return grad, None, None
            # Reduce-scatter: the rows back at their rank-major positions (padding
            # zero), summed over the group, each rank keeping its own.
            size = dist.get_world_size(ctx.group)
            full = grad.new_zeros((size * ctx.width,) + tuple(grad.shape[1:])).index_copy_(0, ctx.order, grad)
            out = grad.new_empty((ctx.width,) + tuple(grad.shape[1:]))
            dist.reduce_scatter_tensor(out, full, group=ctx.group)
            return out[:ctx.mine], None, None

    return GatherRanks
