"""Padded ``[B, S, ...]`` batches to the packed THD layout and back.

::

    attention_mask [B=3, S=6]     THD (pad_multiple=4; p = alignment padding)
    1 1 1 0 0 0                   a a a p b b b b b p p p c p p p
    1 1 1 1 1 0                   cu_seqlens        = [0, 3, 8, 9]
    0 0 1 0 0 0   (any mask)      cu_seqlens_padded = [0, 4, 12, 16]
                                  position_ids      = 0 1 2 3 0 1 2 3 4 5 6 7 0 1 2 3

With ``cp_size > 1`` every padded sequence is cut into ``2 * cp_size`` chunks and
rank ``r`` gets chunks ``r`` and ``2 * cp_size - 1 - r`` of each sequence (the
zigzag layout of Megatron-Core / Transformer Engine), built directly from the
padded batch. The plan (a :class:`~seqpack.PackedLayout` and the runs that fill it)
is computed once on the host from the mask or the lengths; the tensors reach C++ as
DLPack, checked there against the plan, and the copies run in C++ (CPU:
multi-threaded, GIL released; CUDA: one kernel launch per tensor on the current
stream). What a padded batch must be is :mod:`seqpack.tensors.padded_batch`'s; the
result, a :class:`PackedBatch`, is named packed tensors
(:mod:`seqpack.tensors.packed_tensors`) with the plan that unpacks them.

Position tensors with leading dimensions (M-RoPE's ``[3, B, S]`` temporal / height /
width ids of Qwen2-VL-style models, or any ``[..., B, S]``) pack per sequence like
every other tensor: one named in ``position_keys`` (default ``"position_ids"``) with
three or more dimensions is read as ``[..., B, S]`` and packs to ``[..., T]``; the
rows, the zigzag split and the padding of the sequence dimension are the same for
every leading index, and ``unpack`` restores ``[..., B, S]``. See ``docs/vlm.md``.

    >>> import torch, seqpack
    >>> ids = torch.tensor([[5, 6, 0, 0], [7, 8, 9, 0]])
    >>> packed = seqpack.pack_sequences({"input_ids": ids}, seq_lens=[2, 3], pad_multiple=2)
    >>> packed["input_ids"].tolist(), packed.cu_seqlens.tolist(), packed.cu_seqlens_padded.tolist()
    ([5, 6, 7, 8, 9, 0], [0, 2, 5], [0, 2, 6])
    >>> packed.unpack(packed["input_ids"]).tolist()
    [[5, 6, 0, 0], [7, 8, 9, 0]]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Collection, Dict, FrozenSet, List, Mapping, Optional, Union

import numpy as np

from .. import _core
from .._lengths import as_lengths, as_positive_int
from .layout import PackedLayout, PackedSeqParams, alignment, host_offsets
from .layout_kinds import as_packed_layout
from .packed_tensors import NamedPackedTensors
from .padded_batch import POSITION_KEYS, check_device, host_mask, named_tensors, pad_fills, rows_first, token_dim

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["PackedBatch", "PackedSeqParams", "alignment", "pack_sequences", "pack_to_layout",
           "unpack_sequences"]  # PackedSeqParams, alignment: from .layout; static shapes: .thd_static


def _plan_runs(plan) -> tuple:
    """The plan's pack and unpack runs as CPU int64 tensors (the torch ops' inputs)."""
    import torch

    return tuple(torch.from_numpy(np.asarray(a)) for a in
                 (plan.pack_copies, plan.pack_fills, plan.unpack_copies, plan.unpack_fills))


def _position_ids(plan, device) -> "torch.Tensor":
    """The plan's position ids on ``device`` (seqpack's kernel on CUDA, one pinned copy without it)."""
    import torch

    out = torch.empty(plan.local_rows, dtype=torch.int64, device=device)
    from ._device import cuda_kernels, dlpack, host_to_device

    if out.device.type == "cpu":
        plan.position_ids_into(dlpack(out))
        return out
    if not cuda_kernels(out.device):  # positions on the host, one pinned copy
        host = np.empty(plan.local_rows, dtype=np.int64)
        plan.position_ids_into(host)
        return host_to_device([host], out.device)[0]
    (run_tensor,) = host_to_device([plan.position_runs], out.device)
    with torch.cuda.device(out.device):
        _core.cuda_positions(dlpack(run_tensor), dlpack(out), torch.cuda.current_stream(out.device).cuda_stream)
    return out


@dataclass(eq=False)
class PackedBatch(NamedPackedTensors):
    """The result of :func:`pack_sequences`.

    Attributes:
        tensors: name -> packed THD tensor ``[T, ...]`` (``T = cu_seqlens_padded[-1]``,
            or ``T / cp_size`` rows of rank ``cp_rank``'s local part with CP); a
            ``[..., B, S]`` position tensor (``position_keys``) packs to ``[..., T]``,
            a view of a contiguous ``[T, ...]`` tensor.
        cu_seqlens: ``[B + 1]`` int32, cumulative real lengths.
        cu_seqlens_padded: ``[B + 1]`` int32, cumulative padded lengths (offsets in
            the full THD; a CP rank's local offsets are these ``// cp_size``).
        max_seqlen / max_seqlen_padded: host ints.
        seq_lens: ``[B]`` int64 real lengths; padded_lens: ``[B]`` after padding.
        position_ids: ``[T]`` int64 (or the local rows), restarting at 0 per
            sequence and counting through its padding; built on first access.
        cp_size / cp_rank: the context-parallel split this batch was built for.
        layout: the :class:`PackedLayout` (host offsets) the tensors follow.
    """

    padded_lens: "torch.Tensor"
    cp_size: int
    cp_rank: int
    layout: PackedLayout
    _plan: Any = field(repr=False)
    _num_threads: int = field(default=0, repr=False)
    _device: Any = field(default=None, repr=False)
    _position_ids: Any = field(default=None, repr=False)
    _run_tensors: Optional[tuple] = field(default=None, repr=False)

    def _shape_key(self) -> tuple:
        return self.batch_size, self.width

    def _runs(self) -> tuple:
        """The plan's runs as tensors: what the torch operators (autograd,
        ``torch.compile``) and the CUDA launcher take. Built on first need."""
        if self._run_tensors is None:
            self._run_tensors = _plan_runs(self._plan)
        return self._run_tensors

    @property
    def position_ids(self) -> "torch.Tensor":
        if self._position_ids is None:
            self._position_ids = _position_ids(self._plan, self._device)
        return self._position_ids

    @property
    def batch_size(self) -> int:
        return int(self._plan.batch)

    @property
    def width(self) -> int:
        """S of the padded batch this was packed from."""
        return int(self._plan.width)

    @property
    def num_tokens(self) -> int:
        """Rows of the packed tensors (this rank's with CP)."""
        return int(self._plan.local_rows)

    def flash_attn_kwargs(self) -> Dict[str, Any]:
        """Keyword arguments of ``flash_attn_varlen_func`` over the packed rows.

        Offsets are the padded ones (memory offsets of the THD tensors): each
        sequence's alignment padding sits at its tail, so with causal attention no
        real token attends to it."""
        if self.cp_size > 1:
            raise ValueError("flash_attn_kwargs describe a full THD batch; with cp_size > 1 use "
                             "packed_seq_params() with Transformer Engine's context parallelism")
        return dict(cu_seqlens_q=self.cu_seqlens_padded, cu_seqlens_k=self.cu_seqlens_padded,
                    max_seqlen_q=self.max_seqlen_padded, max_seqlen_k=self.max_seqlen_padded)

    def hf_kwargs(self, mrope_position_ids: Optional["torch.Tensor"] = None) -> Dict[str, Any]:
        """The fields of HF transformers' ``DataCollatorWithFlattening``
        (``position_ids [1, T]``, ``cu_seq_lens_q/k``, ``max_length_q/k``).

        ``mrope_position_ids``: this batch's packed M-RoPE ids ``[3, T]`` (such as
        ``self["position_ids"]`` packed from ``[3, B, S]``). ``position_ids`` is then
        ``[4, 1, T]``: row 0 this batch's text positions (restarting at 0 per
        sequence, counting through its padding), rows 1-3 the M-RoPE ids - the layout
        transformers' Qwen2-VL / Qwen2.5-VL text models take as a packed batch (they
        find the sequences from row 0; ``[3, 1, T]`` ids are never read as packed). A
        ``[4, T]`` tensor is taken as holding its text row already. See ``docs/vlm.md``.

        >>> import torch, seqpack
        >>> pos = torch.arange(3).view(1, 1, 3).expand(3, 2, 3)         # [3, B, S]
        >>> b = seqpack.pack_sequences({"position_ids": pos}, seq_lens=[3, 2])
        >>> b.hf_kwargs(b["position_ids"])["position_ids"][:, 0].tolist()
        [[0, 1, 2, 0, 1], [0, 1, 2, 0, 1], [0, 1, 2, 0, 1], [0, 1, 2, 0, 1]]
        """
        if self.cp_size > 1:
            raise ValueError("hf_kwargs describe a full THD batch; got cp_size > 1")
        position_ids = self.position_ids.unsqueeze(0)
        if mrope_position_ids is not None:
            import torch

            from ._device import check_tensor

            check_tensor(mrope_position_ids, "mrope_position_ids")
            rows = tuple(mrope_position_ids.shape)
            if len(rows) != 2 or rows[0] not in (3, 4) or rows[1] != self.num_tokens:
                raise ValueError(f"mrope_position_ids must be this batch's packed M-RoPE ids [3, T] (or [4, T] with "
                                 f"the text row) with T = {self.num_tokens}, got shape {rows}")
            mrope = mrope_position_ids.to(device=position_ids.device, dtype=position_ids.dtype)
            position_ids = (mrope if rows[0] == 4 else torch.cat([position_ids, mrope])).unsqueeze(1)
        return dict(position_ids=position_ids, cu_seq_lens_q=self.cu_seqlens_padded,
                    cu_seq_lens_k=self.cu_seqlens_padded, max_length_q=self.max_seqlen_padded,
                    max_length_k=self.max_seqlen_padded)

    def unpack(self, x: "torch.Tensor", fill: Union[int, float, bool] = 0, *, dim: Optional[int] = None
               ) -> "torch.Tensor":
        """THD ``[T, ...]`` (this batch's layout, or this rank's local rows with CP)
        back to padded ``[B, S, ...]``; rows without a token of ``x`` (padding, other
        ranks' chunks) get ``fill``. Differentiable (its backward packs the gradient).

        ``[..., T]`` tensors (packed M-RoPE ids ``[3, T]``) come back as ``[..., B, S]``:
        ``dim`` is the token dimension, 0 or -1; by default 0 when ``x`` has ``T``
        rows, else -1 when its last dimension has ``T`` entries (give ``dim=-1`` where
        both could hold, e.g. ``[3, T]`` with ``T = 3``).
        """
        check_device(x, "x")
        if token_dim(x, self.num_tokens, dim) != 0:  # [..., T]: the row move on a [T, ...] view
            return self.unpack(x.movedim(-1, 0), fill, dim=0).movedim((0, 1), (-2, -1))
        if x.dim() < 1 or x.shape[0] != self.num_tokens:
            raise ValueError(f"x must have {self.num_tokens} rows (the packed length), got shape {tuple(x.shape)}")
        from . import _ops

        return _ops.unpack_rows(x, self._plan, self._runs, _ops.check_fill(fill, x.dtype, "fill"), self._num_threads)

    def next_token_targets(self, key: str = "input_ids", group: Any = None) -> "torch.Tensor":
        """The full packed ids ``[T]`` that :func:`seqpack.token_logprobs` reads as
        next-token targets: the batch's ``tensors[key]``, all-gathered over the CP
        ``group`` when the batch holds one rank's zigzag rows.

        >>> import torch, seqpack
        >>> b = seqpack.pack_sequences({"input_ids": torch.tensor([[1, 2, 3]])}, seq_lens=[3])
        >>> b.next_token_targets().tolist()
        [1, 2, 3]
        """
        if key not in self.tensors:
            raise ValueError(f"key names no tensor of this batch: {key!r} (it holds {sorted(self.tensors)})")
        if self.cp_size == 1:
            return self.tensors[key]
        from .cp import gather_cp

        return gather_cp(self.tensors[key], self.cu_seqlens_padded, group)

    def ulysses_slice(self, x: Union["torch.Tensor", str], rank: int, world: int,
                      fill: Union[int, float, bool] = 0) -> "torch.Tensor":
        """Rank ``rank``'s contiguous rows of the packed stream for Ulysses sequence
        parallelism over ``world`` ranks (:func:`seqpack.attention` on
        ``seqpack.shard_layout(batch, world, rank, scheme="ulysses")``): the
        ``T`` rows padded at the end to a multiple of ``world``, rows
        ``[rank * n, (rank + 1) * n)`` with ``n = ceil(T / world)``; padding rows
        get ``fill``. ``x`` is a ``[T, ...]`` tensor of this layout or the name of one
        of the batch's tensors; ``"position_ids"`` gives the positions, the padding
        counting ``0, 1, ...`` as verl's ``ulysses_pad_and_slice_inputs``.
        Differentiable; see ``docs/ulysses.md``.

        >>> import torch, seqpack
        >>> b = seqpack.pack_sequences({"input_ids": torch.tensor([[1, 2, 3], [4, 5, 0]])}, seq_lens=[3, 2])
        >>> [b.ulysses_slice("input_ids", r, 2).tolist() for r in range(2)]
        [[1, 2, 3], [4, 5, 0]]
        >>> [b.ulysses_slice("position_ids", r, 4).tolist() for r in range(4)]
        [[0, 1], [2, 0], [1, 0], [1, 2]]
        """
        from . import _ulysses

        if self.cp_size > 1:
            raise ValueError(f"ulysses_slice cuts the full packed stream; this batch holds cp_rank {self.cp_rank}'s "
                             f"zigzag rows of cp_size {self.cp_size}")
        if isinstance(x, str):
            if x == "position_ids":  # M-RoPE ids [..., T] when the batch packed them, else the 1-D ones
                ids = self.tensors.get("position_ids")
                return _ulysses.slice_positions(ids if ids is not None and ids.dim() >= 2 else self.position_ids,
                                                rank, world)
            if x not in self.tensors:
                raise ValueError(f"x names no tensor of this batch: {x!r} (it holds {sorted(self.tensors)} and "
                                 "'position_ids')")
            x = self.tensors[x]
        return _ulysses.slice_rows(x, self.num_tokens, rank, world, fill)

    def ulysses_gather(self, local: "torch.Tensor", group: Any = None, *, agree: bool = True) -> "torch.Tensor":
        """Every rank's :meth:`ulysses_slice` of one tensor, all-gathered over the SP
        ``group`` (``torch.distributed``; default WORLD) and without the tail
        padding: ``[T, ...]``. Backward: one reduce-scatter (the gradient summed over
        the group, this rank's rows kept) - when every rank computes the same loss
        on the gathered tensor, divide it by the group size. ``agree``: the rows,
        shape and dtype are checked on every rank inside one all-reduce before the
        gather, so a wrong shape on one rank (or a batch with context parallelism)
        makes every rank raise."""
        from . import _ulysses

        def full_stream() -> None:
            if self.cp_size > 1:
                raise ValueError(f"ulysses_gather rebuilds the full packed stream; this batch holds cp_rank "
                                 f"{self.cp_rank}'s zigzag rows of cp_size {self.cp_size}")

        return _ulysses.gather_rows(local, self.num_tokens, group, agree, precheck=full_stream)


def _pack_named(result: "PackedBatch", named: Dict[str, "torch.Tensor"], pad_values, pad_value,
                num_threads: int, leading: FrozenSet[str] = frozenset()) -> "PackedBatch":
    from . import _ops

    fills = pad_fills(named, pad_values, pad_value)
    for name, t in named.items():
        fill = fills[name]
        if name in leading:  # [..., B, S]: one row move of its [B, S, ...] view, the result [..., T]
            result.tensors[name] = _ops.pack_rows(rows_first(t), result._plan, result._runs, fill,
                                                  num_threads).movedim(0, -1)
        else:
            result.tensors[name] = _ops.pack_rows(t, result._plan, result._runs, fill, num_threads)
    return result


def pack_sequences(
    tensors: Union["torch.Tensor", Mapping[str, "torch.Tensor"]],
    attention_mask: Optional["torch.Tensor"] = None,
    seq_lens: Any = None,
    *,
    pad_multiple: int = 1,
    pad_values: Optional[Mapping[str, Union[int, float, bool]]] = None,
    pad_value: Union[int, float, bool] = 0,
    pad_packed_to: Optional[int] = None,
    pad_packed_multiple: Optional[int] = None,
    cp_size: int = 1,
    cp_rank: int = 0,
    num_threads: int = 0,
    position_keys: Collection[str] = POSITION_KEYS,
) -> PackedBatch:
    """Pack padded tensors ``[B, S, ...]`` into THD (or rank ``cp_rank``'s zigzag part).

    Args:
        tensors: one tensor (returned under the name ``"input"``) or a dict of
            tensors sharing ``[B, S]`` (ids, labels, masks, hidden states; any dtype).
        attention_mask: ``[B, S]`` bool/int, non-zero on real tokens; right-, left- or
            arbitrarily padded (tokens are taken in column order, like flash-attn's
            ``unpad_input``). Give this or ``seq_lens``.
        seq_lens: ``[B]`` real lengths of right-padded rows.
        pad_multiple: every sequence is padded at its tail to a multiple of this;
            see :func:`alignment` (required multiple of ``2 * cp_size`` with CP).
        pad_values: per-name pad value (e.g. ``{"labels": -100}``); others use
            ``pad_value``.
        pad_packed_to / pad_packed_multiple: pad the whole pack to exactly / to a
            multiple of this many tokens; the extra joins the last sequence's padding,
            as Megatron-Core does.
        cp_size / cp_rank: context parallelism; the result holds rank ``cp_rank``'s
            local THD and its position ids, built without a full packed copy.
        num_threads: CPU threads for the copies (0: automatic).
        position_keys: names of position tensors that may carry leading dimensions:
            one of these with three or more dimensions is ``[..., B, S]`` (M-RoPE's
            ``[3, B, S]``) and packs to ``[..., T]`` (``[3, T]``), every leading index
            split and padded like a ``[B, S]`` tensor (``pad_values`` / ``pad_value``;
            with CP the same zigzag rows). Others, and 2-D ones, are ``[B, S, ...]``.

    >>> import torch, seqpack
    >>> pos = torch.tensor([[0, 1, 1, 2], [0, 1, 0, 0]]).expand(3, 2, 4)   # [3, B, S] M-RoPE ids
    >>> b = seqpack.pack_sequences({"position_ids": pos}, seq_lens=[4, 2])
    >>> b["position_ids"].shape, b.unpack(b["position_ids"]).shape
    (torch.Size([3, 6]), torch.Size([3, 2, 4]))
    """
    named, batch, width, leading = named_tensors(tensors, position_keys)
    num_threads = as_positive_int(num_threads, "num_threads", allow_zero=True)
    if (attention_mask is None) == (seq_lens is None):
        raise ValueError("give exactly one of attention_mask and seq_lens")
    mask = None
    lens = None
    if attention_mask is not None:
        mask = host_mask(attention_mask, batch, width)
    else:
        lens = as_lengths(seq_lens, "seq_lens")
        if lens.shape[0] != batch:
            raise ValueError(f"seq_lens has {lens.shape[0]} entries for a batch of {batch}")
    plan = _core.thd_plan(
        lens, mask, batch, width,
        as_positive_int(pad_multiple, "pad_multiple"),
        0 if pad_packed_to is None else as_positive_int(pad_packed_to, "pad_packed_to"),
        1 if pad_packed_multiple is None else as_positive_int(pad_packed_multiple, "pad_packed_multiple"),
        as_positive_int(cp_size, "cp_size"),
        as_positive_int(cp_rank, "cp_rank", allow_zero=True),
    )
    layout = PackedLayout._from_core(plan.layout, pad_multiple, int(plan.cp_rank))
    device = next(iter(named.values())).device
    return _pack_named(batch_from_plan(plan, layout, device, num_threads), named, pad_values, pad_value, num_threads,
                       leading)


def pack_to_layout(
    tensors: Union["torch.Tensor", Mapping[str, "torch.Tensor"]],
    layout: PackedLayout,
    *,
    pad_values: Optional[Mapping[str, Union[int, float, bool]]] = None,
    pad_value: Union[int, float, bool] = 0,
    num_threads: int = 0,
    position_keys: Collection[str] = POSITION_KEYS,
) -> PackedBatch:
    """Pack right-padded ``[B, S, ...]`` tensors into a given :class:`PackedLayout`
    (sequence ``b``'s ``layout.seq_lens[b]`` real tokens to its offset; rank
    ``layout.cp_rank``'s rows with CP): for offsets that come from elsewhere (a
    trainer's ``cu_seqlens``, a dataset) rather than from a pad multiple.
    ``position_keys``: as in :func:`pack_sequences` (``[..., B, S]`` position ids).

    >>> import torch, seqpack
    >>> layout = seqpack.PackedLayout.from_offsets([0, 2, 5], [0, 3, 8])
    >>> seqpack.pack_to_layout(torch.tensor([[5, 6, 0], [7, 8, 9]]), layout)["input"].tolist()
    [5, 6, 0, 7, 8, 9, 0, 0]
    """
    named, batch, width, leading = named_tensors(tensors, position_keys)
    num_threads = as_positive_int(num_threads, "num_threads", allow_zero=True)
    as_packed_layout(layout)
    if batch != layout.num_sequences:
        raise ValueError(f"the tensors hold {batch} rows; the layout has {layout.num_sequences} sequences")
    plan = _core.thd_plan_for_layout(layout._core_layout, width, layout.cp_rank)
    device = next(iter(named.values())).device
    return _pack_named(batch_from_plan(plan, layout, device, num_threads), named, pad_values, pad_value, num_threads,
                       leading)


def batch_from_plan(plan, layout: PackedLayout, device, num_threads: int = 0) -> "PackedBatch":
    """A :class:`PackedBatch` (no tensors yet) of ``plan`` and its ``layout``, the
    offsets on ``device``."""
    from ._device import host_to_device

    # The metadata arrays in one pinned non-blocking copy on CUDA (views of one
    # buffer; separate tensors on the CPU): the batch's four, and the layout's own
    # copy of the offsets for its cache, since the caller may edit the batch's.
    cu_seqlens, cu_seqlens_padded, seq_lens_t, padded_lens, *cached = host_to_device(
        [layout.cu_seqlens, layout.cu_seqlens_padded, plan.seq_lens, plan.padded_lens]
        + ([layout.cu_seqlens, layout.cu_seqlens_padded] if device not in layout._device_offsets else []), device)
    if cached:
        layout._seed_offsets(device, *cached)
    return PackedBatch(
        tensors={},
        cu_seqlens=cu_seqlens,
        cu_seqlens_padded=cu_seqlens_padded,
        max_seqlen=int(plan.max_seqlen),
        max_seqlen_padded=int(plan.max_seqlen_padded),
        seq_lens=seq_lens_t,
        padded_lens=padded_lens,
        cp_size=layout.cp_size,
        cp_rank=layout.cp_rank,
        layout=layout,
        _plan=plan,
        _num_threads=num_threads,
        _device=device,
    )


def unpack_sequences(x: "torch.Tensor", cu_seqlens_padded: Any, cp_size: int = 1) -> List["torch.Tensor"]:
    """Per-sequence views (no copies) of a THD tensor, like ROLL's ``_unpack_sequences``.

    With ``cp_size > 1``, ``x`` holds one rank's local rows (e.g. logits
    ``[T / cp_size, V]``) and sequence ``i`` is rows
    ``cu_seqlens_padded[i] // cp_size`` to ``cu_seqlens_padded[i + 1] // cp_size``: its
    two zigzag chunks, padding included.

    >>> import torch, seqpack
    >>> [v.tolist() for v in seqpack.unpack_sequences(torch.arange(6), [0, 2, 6])]
    [[0, 1], [2, 3, 4, 5]]
    """
    from ._device import check_tensor

    check_tensor(x, "x")
    offsets = host_offsets(cu_seqlens_padded, "cu_seqlens_padded")
    layout = PackedLayout.from_offsets(offsets, offsets, cp_size=cp_size)
    if x.dim() < 1 or x.shape[0] != layout.local_tokens:
        raise ValueError(f"x has {x.shape[0] if x.dim() else 0} rows; cu_seqlens_padded[-1] / cp_size = "
                         f"{layout.local_tokens}")
    local = layout.local_offsets().tolist()
    return [x[a:b] for a, b in zip(local[:-1], local[1:])]
