"""Context-parallel index maps for the zigzag THD layout.

A sequence of padded length ``L`` is cut into ``2 * cp_size`` chunks; rank ``r``
keeps chunks ``r`` and ``2 * cp_size - 1 - r``::

    cu_seqlens_padded = [0, 8, 16], cp_size = 2
    global  0 1 | 2 3 | 4 5 | 6 7 || 8 9 | 10 11 | 12 13 | 14 15
    rank 0  0 1               6 7    8 9                   14 15
    rank 1        2 3   4 5                10 11   12 13

    >>> import seqpack
    >>> seqpack.cp_partition_indices([0, 8, 16], cp_size=2, cp_rank=0).tolist()
    [0, 1, 6, 7, 8, 9, 14, 15]
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

    >>> import numpy as np, seqpack
    >>> cu = [0, 8, 16]
    >>> gathered = np.concatenate([seqpack.cp_partition_indices(cu, 2, r) for r in range(2)])
    >>> gathered[seqpack.cp_restore_order(cu, 2)].tolist() == list(range(16))
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
    global _GATHER
    if _GATHER is None:
        _GATHER = _make_gather()
    if agree:
        import torch.distributed as dist

        from .._dist import checked_on_every_rank, tensor_facts

        size, me = dist.get_world_size(group), dist.get_rank(group)
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
    return _GATHER.apply(local, cu_seqlens_padded, group)


def _make_gather():
    import torch
    import torch.distributed as dist

    from ._device import host_to_device

    class GatherCP(torch.autograd.Function):
        @staticmethod
        def forward(ctx, local, cu_seqlens_padded, group):
            cp = dist.get_world_size(group)
            ctx.group, ctx.rank, ctx.cu = group, dist.get_rank(group), cu_seqlens_padded
            if cp == 1:
                return local.clone()
            pieces = [torch.empty_like(local) for _ in range(cp)]
            dist.all_gather(pieces, local.contiguous(), group=group)
            (order,) = host_to_device([cp_restore_order(cu_seqlens_padded, cp)], local.device)
            return torch.cat(pieces).index_select(0, order)

        @staticmethod
        def backward(ctx, grad):
            cp = dist.get_world_size(ctx.group)
            if cp == 1:
                return grad, None, None
            # Reduce-scatter: the rows back in rank-major order (rank r's rows are
            # r's zigzag positions), summed over the group, each rank keeping its own.
            rank_major = np.concatenate([cp_partition_indices(ctx.cu, cp, r) for r in range(cp)])
            (index,) = host_to_device([rank_major], grad.device)
            grad = grad.index_select(0, index).contiguous()
            out = grad.new_empty((grad.shape[0] // cp,) + tuple(grad.shape[1:]))
            dist.reduce_scatter_tensor(out, grad, group=ctx.group)
            return out, None, None

    return GatherCP
