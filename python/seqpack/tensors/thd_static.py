"""Static-shape THD packing for CUDA graphs and ``torch.compile``: every shape fixed
by capacities (``max_tokens``, ``max_seqs``), every piece of metadata a tensor on the
data's device, so one captured graph serves every batch::

    max_tokens = 12, max_seqs = 4, seq_lens = [3, 5]
    rows               a a a b b b b b p p p p       the last sequence absorbs the tail
    cu_seqlens         [0, 3, 8, 8, 8]               entries past B repeat the last value
    cu_seqlens_padded  [0, 3, 12, 12, 12]

The planned (host-shaped) pack is :mod:`seqpack.tensors.thd`; both read the padded
batch by :mod:`seqpack.tensors.padded_batch`'s rules and return named packed tensors
(:mod:`seqpack.tensors.packed_tensors`).

Importing this module does not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Collection, Dict, Mapping, Optional, Union

import numpy as np

from .._lengths import as_lengths, as_positive_int
from .packed_tensors import NamedPackedTensors
from .padded_batch import (POSITION_KEYS, as_named, batch_dims, check_batch_shape, leading_names, pad_fills, rows_first,
                           token_dim)

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["StaticPackedBatch", "pack_sequences_static"]


@dataclass(eq=False)
class StaticPackedBatch(NamedPackedTensors):
    """The result of :func:`pack_sequences_static`: every shape fixed by the
    capacities, every piece of metadata a tensor on the data's device.

    Attributes:
        tensors: name -> ``[max_tokens, ...]`` packed rows (``max_tokens / cp_size``
            zigzag rows of rank ``cp_rank`` with CP); ``[..., max_tokens]`` for a
            ``[..., B, S]`` position tensor (``position_keys``).
        cu_seqlens: ``[max_seqs + 1]`` int32 real cumulative lengths; entries past
            the batch repeat the last value (zero-length sequences).
        cu_seqlens_padded: ``[max_seqs + 1]`` int32 offsets of the padded sequences;
            the batch's last sequence absorbs the rows up to the capacity (as
            Megatron-Core's ``pad_packed_to``), so entries from ``B`` on equal
            ``max_tokens`` and no row belongs to no sequence (with ``B = 0``: all
            zeros, every row padding).
        max_seqlen / max_seqlen_padded: host ints, upper bounds that hold for any
            lengths (``S`` and ``max_tokens``), as varlen kernels need them on the host.
        seq_lens: ``[B]`` int64 real lengths; position_ids: ``[max_tokens / cp_size]``
            int64, each row's position in its padded sequence.
        cp_size / cp_rank: the context-parallel split the rows belong to.
    """

    position_ids: "torch.Tensor"
    cp_size: int
    cp_rank: int
    _destination: "torch.Tensor" = field(repr=False)  # each row's b * S + s, or B * S for padding

    @property
    def num_tokens(self) -> int:
        return int(self.position_ids.shape[0])

    def flash_attn_kwargs(self) -> Dict[str, Any]:
        """Keyword arguments of ``flash_attn_varlen_func`` over the packed rows."""
        if self.cp_size > 1:
            raise ValueError("flash_attn_kwargs describe a full THD batch; with cp_size > 1 use "
                             "packed_seq_params() with Transformer Engine's context parallelism")
        return dict(cu_seqlens_q=self.cu_seqlens_padded, cu_seqlens_k=self.cu_seqlens_padded,
                    max_seqlen_q=self.max_seqlen_padded, max_seqlen_k=self.max_seqlen_padded)

    def unpack(self, x: "torch.Tensor", fill: Union[int, float, bool] = 0, *, dim: Optional[int] = None
               ) -> "torch.Tensor":
        """This batch's rows ``[num_tokens, ...]`` back to ``[B, S, ...]``; positions
        without a row (padding, other CP ranks' chunks) get ``fill``. PyTorch ops
        (one scatter), differentiable. ``[..., num_tokens]`` (packed M-RoPE ids) back
        to ``[..., B, S]``; ``dim`` as in :meth:`PackedBatch.unpack`."""
        import torch

        from ._device import check_tensor
        from ._ops import check_fill

        check_tensor(x, "x")
        if token_dim(x, self.num_tokens, dim) != 0:  # [..., T]: the scatter of its [T, ...] view
            return self.unpack(x.movedim(-1, 0), fill, dim=0).movedim((0, 1), (-2, -1))
        batch, width = self.seq_lens.shape[0], self.max_seqlen
        if x.dim() < 1 or x.shape[0] != self.num_tokens:
            raise ValueError(f"x must have {self.num_tokens} rows (this batch's packed rows), got shape "
                             f"{tuple(x.shape)}")
        fill = check_fill(fill, x.dtype, "fill")
        out = torch.full((batch * width + 1, *x.shape[1:]), fill, dtype=x.dtype, device=x.device)
        return out.index_put((self._destination,), x)[:-1].view(batch, width, *x.shape[1:])


def pack_sequences_static(
    tensors: Union["torch.Tensor", Mapping[str, "torch.Tensor"]],
    seq_lens: Any,
    *,
    max_tokens: int,
    max_seqs: Optional[int] = None,
    pad_multiple: int = 1,
    pad_values: Optional[Mapping[str, Union[int, float, bool]]] = None,
    pad_value: Union[int, float, bool] = 0,
    cp_size: int = 1,
    cp_rank: int = 0,
    position_keys: Collection[str] = POSITION_KEYS,
) -> StaticPackedBatch:
    """Pack right-padded ``[B, S, ...]`` tensors into ``[max_tokens, ...]`` THD rows
    with shapes fixed by the capacities and no host synchronisation: PyTorch ops
    only (a search and a gather per tensor), so the step can be captured in a CUDA
    graph and traced by ``torch.compile(fullgraph=True)`` — the static counterpart
    of :func:`pack_sequences` (whose plan is built on the host).

    ::

        seq_lens = [3, 1, 2], pad_multiple = 2, max_tokens = 10, max_seqs = 4
        rows               a a a p b p c c p p      (p: padding; the last sequence
        cu_seqlens         [0, 3, 4, 6, 6]           absorbs the rows up to 10)
        cu_seqlens_padded  [0, 4, 6, 10, 10]

    Args:
        tensors: one tensor (named ``"input"``) or a dict of tensors sharing ``[B, S]``.
        seq_lens: ``[B]`` real lengths (a tensor on the data's device for graphs,
            or host ints, which are validated).
        max_tokens: rows of the result; the padded lengths must fit. Host lengths
            are checked (ValueError); device lengths with ``torch._assert_async``
            (a RuntimeError on the CPU, a device-side assert on CUDA).
        max_seqs: entries of the offsets minus one (default ``B``; >= ``B``).
        pad_multiple / pad_values / pad_value: as in :func:`pack_sequences`.
        cp_size / cp_rank: context parallelism: the result holds rank
            ``cp_rank``'s ``max_tokens / cp_size`` zigzag rows (chunks ``r`` and
            ``2 * cp_size - 1 - r`` of every padded sequence, the capacity padding
            included); ``pad_multiple`` and ``max_tokens`` must be multiples of
            ``2 * cp_size``.
        position_keys: as in :func:`pack_sequences`: such a tensor of three or more
            dimensions is ``[..., B, S]`` and packs to ``[..., max_tokens / cp_size]``.

    >>> import torch, seqpack
    >>> ids = torch.tensor([[5, 6, 7], [8, 0, 0], [9, 4, 0]])
    >>> p = seqpack.pack_sequences_static(ids, torch.tensor([3, 1, 2]), max_tokens=10, max_seqs=4, pad_multiple=2)
    >>> p["input"].tolist(), p.cu_seqlens_padded.tolist()
    ([5, 6, 7, 0, 8, 0, 9, 4, 0, 0], [0, 4, 6, 10, 10])
    >>> torch.equal(p.unpack(p["input"]), ids)
    True
    """
    import torch

    from ._device import check_tensor
    from .cp import cp_row_positions

    named = as_named(tensors)
    leading = leading_names(named, position_keys)
    first = next(iter(named.values()))
    if first.dim() < 2:
        raise ValueError(f"tensors must be [B, S, ...], got shape {tuple(first.shape)}")
    (batch, width), device = batch_dims(named, leading), first.device
    for name, t in named.items():
        check_batch_shape(name, t, leading, batch, width)
        if t.device != device:
            raise ValueError(f"tensors[{name!r}] is {tuple(t.shape)} on {t.device}; every tensor must be "
                             f"[B, S, ...] = [{batch}, {width}, ...] on {device}")
    capacity = as_positive_int(max_tokens, "max_tokens")
    seqs = batch if max_seqs is None else as_positive_int(max_seqs, "max_seqs", allow_zero=True)
    if seqs < batch:
        raise ValueError(f"max_seqs = {seqs} is below the batch size {batch}")
    multiple = as_positive_int(pad_multiple, "pad_multiple")
    cp = as_positive_int(cp_size, "cp_size")
    cp_rank = as_positive_int(cp_rank, "cp_rank", allow_zero=True)
    if cp_rank >= cp:
        raise ValueError(f"cp_rank must be in [0, cp_size = {cp}), got {cp_rank}")
    if cp > 1 and (multiple % (2 * cp) or capacity % (2 * cp)):
        raise ValueError(f"with cp_size = {cp}, pad_multiple ({multiple}) and max_tokens ({capacity}) must be "
                         f"multiples of 2 * cp_size = {2 * cp}")
    fills = pad_fills(named, pad_values, pad_value)
    if isinstance(seq_lens, torch.Tensor):
        check_tensor(seq_lens, "seq_lens")
    if isinstance(seq_lens, torch.Tensor) and (seq_lens.device != torch.device("cpu") or
                                                torch.compiler.is_compiling()):
        if tuple(seq_lens.shape) != (batch,) or seq_lens.dtype.is_floating_point:
            raise ValueError(f"seq_lens must be an integer tensor [B] = [{batch}], got {seq_lens.dtype} "
                             f"{tuple(seq_lens.shape)}")
        from ._device import to_device

        lens = to_device(seq_lens, device).to(torch.int64)
    else:  # host lengths: checked here, then one pinned copy
        host = as_lengths(seq_lens, "seq_lens").astype(np.int64)
        if host.shape != (batch,):
            raise ValueError(f"seq_lens has {host.shape[0]} entries for a batch of {batch}")
        if ((host < 0) | (host > width)).any():
            raise ValueError(f"seq_lens must be in [0, S = {width}]")
        need = int((-(-host // multiple) * multiple).sum())
        if need > capacity:
            raise ValueError(f"the padded sequences need {need} rows; max_tokens is {capacity}")
        from ._device import host_to_device

        (lens,) = host_to_device([host], device)
    lens = lens.clamp(0, width)
    padded = (lens + multiple - 1) // multiple * multiple
    zero = torch.zeros(1, dtype=torch.int64, device=device)
    ends = torch.cumsum(padded, 0)
    total = ends[-1:] if batch else zero
    torch._assert_async((total <= capacity).all(), "pack_sequences_static: the padded sequences exceed max_tokens")
    starts = torch.cat([zero, ends[:-1]]) if batch else zero[:0]
    tail = torch.full((seqs - batch + (1 if batch else 0),), capacity, dtype=torch.int64, device=device)
    cu_padded = torch.cat([starts, tail]) if batch else torch.zeros(seqs + 1, dtype=torch.int64, device=device)
    real_ends = torch.cumsum(lens, 0)
    cu = torch.cat([zero, real_ends, real_ends[-1:].expand(seqs - batch)]) if batch else \
        torch.zeros(seqs + 1, dtype=torch.int64, device=device)
    rows = capacity // cp
    if batch:
        seq, pos = cp_row_positions(cu_padded[: batch + 1], rows, cp, cp_rank)
        keep = pos < lens[seq]
    else:
        pos = torch.arange(rows, device=device)
        seq, keep = torch.zeros_like(pos), torch.zeros_like(pos, dtype=torch.bool)
    source = (seq * width + pos.clamp(max=max(width - 1, 0))).clamp(max=max(batch * width - 1, 0))
    packed = {}
    for name, t in named.items():
        if name in leading:  # [..., B, S]: gathered as its [B, S, ...] view, the result [..., rows]
            t = rows_first(t)
        trailing = t.shape[2:]
        fill = torch.full((), fills[name], dtype=t.dtype, device=device)
        if batch * width == 0:
            packed[name] = fill.expand(rows, *trailing).clone()
        else:
            gathered = t.reshape(batch * width, *trailing).index_select(0, source)
            packed[name] = torch.where(keep.view(-1, *([1] * len(trailing))), gathered, fill)
        if name in leading:
            packed[name] = packed[name].movedim(0, -1)
    return StaticPackedBatch(
        tensors=packed, cu_seqlens=cu.to(torch.int32), cu_seqlens_padded=cu_padded.to(torch.int32),
        max_seqlen=width, max_seqlen_padded=capacity, seq_lens=lens, position_ids=pos, cp_size=cp,
        cp_rank=cp_rank, _destination=torch.where(keep, source, batch * width))
