"""The data split of Ulysses sequence parallelism (DeepSpeed-Ulysses, verl): every
rank of an SP group of ``world`` ranks holds one contiguous slice of the packed THD
stream. The stream's ``T`` rows are padded at the end to a multiple of ``world``
(``n = ceil(T / world)`` rows a rank) and rank ``r`` holds rows
``[r * n, (r + 1) * n)``::

    T = 10, world = 4, n = 3:   | a a a | b b b | b c c | c p p |     p: tail padding
                                  rank 0  rank 1  rank 2  rank 3

The tail rows belong to no sequence: Ulysses attention (:func:`seqpack.attention` on
a ``scheme="ulysses"`` cut, :func:`seqpack.shard_layout`) gives them 0, their
position ids count ``0, 1, ...`` (verl's ``ulysses_pad_and_slice_inputs``: a
sequence of their own for code that finds sequences from position resets).
Imported with the tensor API (torch); :class:`seqpack.PackedBatch` exposes it as
``ulysses_slice`` / ``ulysses_gather``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Union

import torch

from .._lengths import as_positive_int
from ._device import check_tensor


def local_rows(total: int, world: int) -> int:
    """Rows of each rank: ``ceil(total / world)``.

    >>> local_rows(10, 4), local_rows(8, 4), local_rows(0, 2)
    (3, 2, 0)
    """
    return -(-int(total) // int(world))


def check_rank(rank: Any, world: Any) -> tuple:
    """``(rank, world)`` as ints with ``0 <= rank < world`` (named errors)."""
    world = as_positive_int(world, "world")
    rank = as_positive_int(rank, "rank", allow_zero=True)
    if rank >= world:
        raise ValueError(f"rank must be in [0, world = {world}), got {rank}")
    return rank, world


def token_dim(x: torch.Tensor, total: int) -> int:
    """The dimension of ``x`` that holds the ``total`` tokens: the first (``[T, ...]``),
    else the last (``[..., T]``, M-RoPE position ids ``[3, T]``)."""
    check_tensor(x, "x")
    if x.dim() >= 1 and x.shape[0] == total:
        return 0
    if x.dim() >= 2 and x.shape[-1] == total:
        return x.dim() - 1
    raise ValueError(f"x must hold the {total} rows of the packed stream in its first or last dimension, "
                     f"got shape {tuple(x.shape)}")


def slice_rows(x: torch.Tensor, total: int, rank: Any, world: Any, fill: Union[int, float, bool] = 0) -> torch.Tensor:
    """Rank ``rank``'s ``ceil(total / world)`` tokens of ``x [total, ...]`` (or
    ``[..., total]``); tokens past ``total`` get ``fill``. A view of ``x`` when the
    rank has no padding token, else a new tensor; differentiable either way."""
    from ._ops import check_fill

    rank, world = check_rank(rank, world)
    dim = token_dim(x, total)
    n = local_rows(total, world)
    start, stop = min(rank * n, total), min((rank + 1) * n, total)
    part = x.narrow(dim, start, stop - start)
    missing = n - (stop - start)
    if missing == 0:
        return part
    shape = list(x.shape)
    shape[dim] = missing
    pad = torch.full(shape, check_fill(fill, x.dtype, "fill"), dtype=x.dtype, device=x.device)
    return torch.cat([part, pad], dim=dim)


def slice_positions(position_ids: torch.Tensor, rank: Any, world: Any) -> torch.Tensor:
    """Rank ``rank``'s tokens of ``position_ids [T]`` (or ``[..., T]``, M-RoPE); the
    tail padding counts ``0, 1, ...`` in every component (verl's convention)."""
    rank, world = check_rank(rank, world)
    total = int(position_ids.shape[-1])
    n = local_rows(total, world)
    tail = torch.arange(n * world - total, dtype=position_ids.dtype, device=position_ids.device)
    full = torch.cat([position_ids, tail.expand(*position_ids.shape[:-1], -1)], dim=-1)
    return full[..., rank * n:(rank + 1) * n]


def _checks(local: torch.Tensor, total: int, size: int) -> int:
    check_tensor(local, "local")
    n = local_rows(total, size)
    if local.dim() < 1 or local.shape[0] != n:
        raise ValueError(f"local must hold this rank's {n} rows (ceil({total} / group size {size})), got shape "
                         f"{tuple(local.shape)}")
    return n


def gather_rows(local: torch.Tensor, total: int, group: Any = None, agree: bool = True,
                precheck: Optional[Callable[[], None]] = None) -> torch.Tensor:
    """Every rank's slice all-gathered over ``group`` (rank order) without the tail
    padding: the stream ``[total, ...]``. Backward: a reduce-scatter (the gradient
    summed over the group, each rank keeping its rows), as
    :func:`seqpack.tensors.cp.gather_cp`. With ``agree``, the row count and the
    rows' shape, dtype and whether they require grad (with grad mode on: the
    backward's reduce-scatter) are checked on every rank inside one all-reduce
    first, so a rank with other inputs makes every rank raise instead of hanging.
    ``precheck()``, when given, is the caller's own check of this rank, run inside
    the same agreement."""
    import torch.distributed as dist

    from .._dist import checked_on_every_rank, tensor_facts

    size, me = dist.get_world_size(group), dist.get_rank(group)
    if size < 1 or me < 0:
        raise ValueError(f"this process is not in the group (size {size}, rank {me}); it cannot take part in "
                         "ulysses_gather's all-gather over it")

    def facts(_):
        shared = tensor_facts(local)
        return {"the packed stream's rows": int(total), "local's shape": shared["shape"],
                "local's dtype": shared["dtype"],
                "whether local requires grad (with grad mode on)": shared["requires_grad"]}

    def own_checks():
        if precheck is not None:
            precheck()
        return _checks(local, total, size)

    checked_on_every_rank(own_checks, group, "ulysses_gather", agree and size > 1, fingerprint=facts)
    return _gather_function().apply(local, int(total), group)


@functools.lru_cache(maxsize=1)
def _gather_function():
    import torch.distributed as dist

    class GatherUlysses(torch.autograd.Function):
        @staticmethod
        def forward(ctx, local, total, group):
            size = dist.get_world_size(group)
            ctx.group, ctx.size, ctx.rows = group, size, local.shape[0]
            if size == 1:
                return local[:total].clone()
            pieces = [torch.empty_like(local) for _ in range(size)]
            dist.all_gather(pieces, local.contiguous(), group=group)
            return torch.cat(pieces)[:total]

        @staticmethod
        def backward(ctx, grad):
            n, size = ctx.rows, ctx.size
            missing = n * size - grad.shape[0]
            if missing:
                grad = torch.cat([grad, grad.new_zeros(missing, *grad.shape[1:])])
            if size == 1:
                return grad, None, None
            out = grad.new_empty((n, *grad.shape[1:]))
            dist.reduce_scatter_tensor(out, grad.contiguous(), group=ctx.group)
            return out, None, None

    return GatherUlysses
