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
padded batch. The plan (offsets, runs) is computed once on the host from the mask
or the lengths; the copies run in C++ on raw buffers (CPU: multi-threaded, GIL
released; CUDA: one kernel launch per tensor on the current stream).

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
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Union

import numpy as np

from . import _core
from ._lengths import as_lengths, as_positive_int

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["PackedBatch", "PackedSeqParams", "alignment", "pack_sequences", "unpack_sequences"]


def alignment(cp_size: int = 1, tp_size: int = 1, sequence_parallel: bool = False) -> int:
    """The per-sequence padding multiple Megatron-Core needs: ``2 * cp_size`` with
    context parallelism (each sequence splits into 2·CP zigzag chunks), times
    ``tp_size`` when sequence parallelism shards tokens over tensor-parallel ranks.

    >>> alignment(cp_size=2, tp_size=4, sequence_parallel=True), alignment(cp_size=2, tp_size=4)
    (16, 4)
    >>> alignment(tp_size=8, sequence_parallel=True)
    8
    """
    cp = as_positive_int(cp_size, "cp_size")
    tp = as_positive_int(tp_size, "tp_size")
    return (2 * cp if cp > 1 else 1) * (tp if sequence_parallel else 1)


def _torch():
    import torch

    return torch


def _check_device(t: "torch.Tensor", name: str) -> None:
    if t.device.type == "cpu":
        return
    if t.device.type != "cuda":
        raise ValueError(f"{name} is on {t.device}; seqpack moves CPU and CUDA tensors")
    if not _core.built_with_cuda:
        raise ValueError(f"{name} is on {t.device} but this build of seqpack has no CUDA kernels (built without nvcc)")


def _plan_runs(plan) -> tuple:
    """The plan's pack and unpack runs as CPU int64 tensors (the torch ops' inputs)."""
    torch = _torch()
    return tuple(torch.from_numpy(np.asarray(a)) for a in
                 (plan.pack_copies, plan.pack_fills, plan.unpack_copies, plan.unpack_fills))


def _position_ids(plan, device) -> "torch.Tensor":
    torch = _torch()
    out = torch.empty(plan.local_rows, dtype=torch.int64, device=device)
    if out.device.type == "cpu":
        plan.position_ids_into(out.data_ptr(), plan.local_rows)
        return out
    runs = plan.position_runs
    with torch.cuda.device(out.device):
        run_tensor = torch.from_numpy(runs).to(out.device)
        _core.cuda_positions(run_tensor.data_ptr(), runs.shape[0], out.data_ptr(),
                             torch.cuda.current_stream(out.device).cuda_stream)
    return out


@dataclass
class PackedSeqParams:
    """Megatron-Core's ``PackedSeqParams`` fields, when megatron-core is absent."""

    qkv_format: str
    cu_seqlens_q: "torch.Tensor"
    cu_seqlens_kv: "torch.Tensor"
    cu_seqlens_q_padded: "torch.Tensor"
    cu_seqlens_kv_padded: "torch.Tensor"
    max_seqlen_q: int
    max_seqlen_kv: int


@dataclass
class PackedBatch:
    """The result of :func:`pack_sequences`.

    Attributes:
        tensors: name -> packed THD tensor ``[T, ...]`` (``T = cu_seqlens_padded[-1]``,
            or ``T / cp_size`` rows of rank ``cp_rank``'s local part with CP).
        cu_seqlens: ``[B + 1]`` int32, cumulative real lengths.
        cu_seqlens_padded: ``[B + 1]`` int32, cumulative padded lengths (offsets in
            the full THD; a CP rank's local offsets are these ``// cp_size``).
        max_seqlen / max_seqlen_padded: host ints.
        seq_lens: ``[B]`` int64 real lengths; padded_lens: ``[B]`` after padding.
        position_ids: ``[T]`` int64 (or the local rows), restarting at 0 per
            sequence and counting through its padding; built on first access.
        cp_size / cp_rank: the context-parallel split this batch was built for.
    """

    tensors: Dict[str, "torch.Tensor"]
    cu_seqlens: "torch.Tensor"
    cu_seqlens_padded: "torch.Tensor"
    max_seqlen: int
    max_seqlen_padded: int
    seq_lens: "torch.Tensor"
    padded_lens: "torch.Tensor"
    cp_size: int
    cp_rank: int
    _plan: Any = field(repr=False)
    _num_threads: int = field(default=0, repr=False)
    _device: Any = field(default=None, repr=False)
    _position_ids: Any = field(default=None, repr=False)
    _run_tensors: Optional[tuple] = field(default=None, repr=False)

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

    def __getitem__(self, name: str) -> "torch.Tensor":
        return self.tensors[name]

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

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

    def packed_seq_params(self):
        """Megatron-Core ``PackedSeqParams`` (``qkv_format="thd"``; real
        ``cu_seqlens_q/kv``, padded ``cu_seqlens_q/kv_padded``, padded max lengths).
        A real ``megatron.core.packed_seq_params.PackedSeqParams`` when megatron-core
        is importable, else :class:`PackedSeqParams` with the same fields."""
        fields = dict(
            qkv_format="thd",
            cu_seqlens_q=self.cu_seqlens,
            cu_seqlens_kv=self.cu_seqlens,
            cu_seqlens_q_padded=self.cu_seqlens_padded,
            cu_seqlens_kv_padded=self.cu_seqlens_padded,
            max_seqlen_q=self.max_seqlen_padded,
            max_seqlen_kv=self.max_seqlen_padded,
        )
        try:
            from megatron.core.packed_seq_params import PackedSeqParams as MegatronParams
        except ImportError:
            return PackedSeqParams(**fields)
        return MegatronParams(**fields)

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

    def hf_kwargs(self) -> Dict[str, Any]:
        """The fields of HF transformers' ``DataCollatorWithFlattening``
        (``position_ids [1, T]``, ``cu_seq_lens_q/k``, ``max_length_q/k``)."""
        if self.cp_size > 1:
            raise ValueError("hf_kwargs describe a full THD batch; got cp_size > 1")
        return dict(position_ids=self.position_ids.unsqueeze(0), cu_seq_lens_q=self.cu_seqlens_padded,
                    cu_seq_lens_k=self.cu_seqlens_padded, max_length_q=self.max_seqlen_padded,
                    max_length_k=self.max_seqlen_padded)

    def unpack(self, x: "torch.Tensor", fill: Union[int, float, bool] = 0) -> "torch.Tensor":
        """THD ``[T, ...]`` (this batch's layout, or this rank's local rows with CP)
        back to padded ``[B, S, ...]``; rows without a token of ``x`` (padding, other
        ranks' chunks) get ``fill``. Differentiable (its backward packs the gradient).
        """
        if x.dim() < 1 or x.shape[0] != self.num_tokens:
            raise ValueError(f"x must have {self.num_tokens} rows (the packed length), got shape {tuple(x.shape)}")
        _check_device(x, "x")
        from . import _ops

        return _ops.unpack_rows(x, self._plan, self._runs, float(fill), self._num_threads)


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
    """
    torch = _torch()
    named = {"input": tensors} if isinstance(tensors, torch.Tensor) else dict(tensors)
    if not named:
        raise ValueError("tensors must hold at least one tensor")
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors[{name!r}] must be a torch.Tensor, got {type(t).__name__}")
    first_name, first = next(iter(named.items()))
    if first.dim() < 2:
        raise ValueError(f"tensors[{first_name!r}] must be [B, S, ...], got shape {tuple(first.shape)}")
    batch, width = int(first.shape[0]), int(first.shape[1])
    for name, t in named.items():
        if t.dim() < 2 or tuple(t.shape[:2]) != (batch, width):
            raise ValueError(
                f"tensors[{name!r}] has shape {tuple(t.shape)}; every tensor must start with [B, S] = [{batch}, {width}]"
            )
        _check_device(t, f"tensors[{name!r}]")
        if t.device != first.device:
            raise ValueError(f"tensors[{name!r}] is on {t.device}, tensors[{first_name!r}] on {first.device}")
    if (attention_mask is None) == (seq_lens is None):
        raise ValueError("give exactly one of attention_mask and seq_lens")
    mask = None
    lens = None
    if attention_mask is not None:
        if tuple(attention_mask.shape) != (batch, width):
            raise ValueError(f"attention_mask must be [B, S] = [{batch}, {width}], got {tuple(attention_mask.shape)}")
        mask = (attention_mask != 0).to(torch.uint8).cpu().contiguous().numpy()
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
        int(cp_rank),
    )
    pad_values = dict(pad_values or {})
    unknown = set(pad_values) - set(named)
    if unknown:
        raise ValueError(f"pad_values names tensors that were not given: {sorted(unknown)}")
    from . import _ops

    device = first.device
    on_host = device.type == "cpu"

    def metadata(array):
        t = torch.from_numpy(array)
        return t if on_host else t.to(device)

    result = PackedBatch(
        tensors={},
        cu_seqlens=metadata(plan.cu_seqlens),
        cu_seqlens_padded=metadata(plan.cu_seqlens_padded),
        max_seqlen=int(plan.max_seqlen),
        max_seqlen_padded=int(plan.max_seqlen_padded),
        seq_lens=metadata(plan.seq_lens),
        padded_lens=metadata(plan.padded_lens),
        cp_size=int(plan.cp_size),
        cp_rank=int(plan.cp_rank),
        _plan=plan,
        _num_threads=num_threads,
        _device=device,
    )
    for name, t in named.items():
        fill = float(pad_values.get(name, pad_value))
        result.tensors[name] = _ops.pack_rows(t, plan, result._runs, fill, num_threads)
    return result


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
    cp = as_positive_int(cp_size, "cp_size")
    from .cp import check_cu_seqlens

    check_cu_seqlens(cu_seqlens_padded, "cu_seqlens_padded")
    cu = as_lengths(cu_seqlens_padded, "cu_seqlens_padded").astype(np.int64)
    if cu.size == 0 or cu[0] != 0:
        raise ValueError("cu_seqlens_padded must start at 0")
    steps = np.diff(cu)
    if (steps < 0).any():
        raise ValueError("cu_seqlens_padded must be non-decreasing")
    if cp > 1 and (steps % (2 * cp)).any():
        raise ValueError(f"every padded length must be a multiple of 2 * cp_size = {2 * cp}")
    if x.dim() < 1 or x.shape[0] * cp != int(cu[-1]):
        raise ValueError(
            f"x has {x.shape[0] if x.dim() else 0} rows; cu_seqlens_padded[-1] / cp_size = {int(cu[-1]) // cp}"
        )
    local = (cu // cp).tolist()
    return [x[a:b] for a, b in zip(local[:-1], local[1:])]
