"""The packed (THD) layout: one owner for offsets, alignment and context parallelism.

Every packed tensor in seqpack (``[T, ...]``, sequences back to back, each padded
at its tail) is described by a :class:`PackedLayout`::

    seq_lens           3        5            1          pad_multiple = 4
    THD rows           a a a p  b b b b b p p p  c p p p
    cu_seqlens         [0, 3, 8, 9]        real offsets (flash-attn's cu_seqlens)
    cu_seqlens_padded  [0, 4, 12, 16]      memory offsets (Megatron's *_padded)

With context parallelism (``cp_size > 1``) each padded sequence is cut into
``2 * cp_size`` chunks and rank ``r`` holds chunks ``r`` and ``2 * cp_size - 1 - r``
(the zigzag of Megatron-Core / Transformer Engine): ``T / cp_size`` local rows, a
sequence's local rows starting at ``cu_seqlens_padded[i] // cp_size``.

This module also holds the two rules every packer shares: :func:`alignment` (the
per-sequence pad multiple a parallel layout needs) and :func:`round_up`; and the one
validation of offsets, :func:`check_offsets`, that every function taking
``cu_seqlens`` applies.

    >>> from seqpack.tensors.layout import PackedLayout
    >>> layout = PackedLayout.from_lengths([3, 5, 1], pad_multiple=4)
    >>> layout.cu_seqlens.tolist(), layout.cu_seqlens_padded.tolist(), layout.num_tokens
    ([0, 3, 8, 9], [0, 4, 12, 16], 16)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple, Union

import numpy as np

from .. import _core
from .._equality import fields_equal
from .._lengths import as_positive_int, check_not_meta, core_lengths, round_up
from .token_layout import TokenLayout

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["PackedLayout", "PackedSeqParams", "alignment", "check_offsets", "host_offsets", "megatron_packed_seq_params", "reads_on_host", "round_up"]

_INT32_MAX = 2**31 - 1
_RULES = ("megatron", "roll")


def alignment(cp_size: int = 1, tp_size: int = 1, sequence_parallel: bool = False, *, rule: str = "megatron") -> int:
    """The multiple every sequence is padded to in a packed layout.

    ``rule="megatron"`` (default) is what Megatron-Core needs: ``2 * cp_size`` with
    context parallelism (each sequence splits into 2·CP zigzag chunks), times
    ``tp_size`` when sequence parallelism shards tokens over tensor-parallel ranks;
    NeMo-RL's ``make_sequence_length_divisible_by`` must be a multiple of it.

    ``rule="roll"`` is the formula in ROLL's Megatron strategy code (and NeMo-RL's
    before ``make_sequence_length_divisible_by`` existed): ``2 * cp_size * tp_size``
    with CP, else ``tp_size``, whether or not sequence parallelism is on.

    >>> alignment(cp_size=2, tp_size=4, sequence_parallel=True), alignment(cp_size=2, tp_size=4)
    (16, 4)
    >>> alignment(tp_size=8, sequence_parallel=True), alignment(tp_size=8, rule="roll")
    (8, 8)
    """
    cp = as_positive_int(cp_size, "cp_size")
    tp = as_positive_int(tp_size, "tp_size")
    if rule == "megatron":
        return (2 * cp if cp > 1 else 1) * (tp if sequence_parallel else 1)
    if rule == "roll":
        return 2 * cp * tp if cp > 1 else tp
    raise ValueError(f"rule must be one of {', '.join(_RULES)}; got {rule!r}")


def _torch():
    import torch

    return torch


def reads_on_host(cu: Any) -> bool:
    """True for offsets the host can read without a device synchronisation or a
    graph break: lists, NumPy arrays, CPU tensors outside ``torch.compile``."""
    if not hasattr(cu, "device") or not hasattr(cu, "dim"):
        return True
    return cu.device.type == "cpu" and not _torch().compiler.is_compiling()


def check_offsets(cu: Any, name: str = "cu_seqlens") -> Union[np.ndarray, "torch.Tensor"]:
    """The one rule for every ``cu_seqlens``-like argument in seqpack.

    Accepted forms: a list/tuple of ints, a 1-D integer NumPy array, or a 1-D int32
    or int64 torch tensor (CPU or CUDA). Host offsets (everything but a device tensor,
    or any tensor inside ``torch.compile``) are read and must hold at least one
    entry, start at 0, never decrease and fit in int32; they come back as an int64
    NumPy array. A device tensor is not read (that would synchronise): its dtype and
    shape are checked and it comes back as int32 on its device (the kernels and
    index maps clamp, so bad device offsets give wrong values, never an
    out-of-bounds access).

    >>> check_offsets([0, 3, 8]).tolist()
    [0, 3, 8]
    >>> check_offsets([0, 3, 2], "cu_seqlens_padded")
    Traceback (most recent call last):
    ...
    ValueError: cu_seqlens_padded must start at 0 and never decrease; got [0, 3, 2]
    """
    if hasattr(cu, "dim") and hasattr(cu, "device"):  # a torch tensor
        torch = _torch()
        check_not_meta(cu, name)
        if cu.dim() != 1 or cu.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be a 1-D int32 or int64 tensor [B + 1], got {cu.dtype} {tuple(cu.shape)}")
        if not reads_on_host(cu):
            if cu.shape[0] < 1:
                raise ValueError(f"{name} must hold at least one offset")
            return cu.to(torch.int32)
        arr = cu.detach().numpy()
    else:
        arr = np.asarray(cu)
        if arr.dtype == object or arr.dtype.kind not in "iu" and arr.size:
            raise TypeError(f"{name} must hold integers, got {arr.dtype}")
        if arr.ndim != 1:
            raise ValueError(f"{name} must be 1-D [B + 1], got shape {arr.shape}")
    arr = arr.astype(np.int64)
    if arr.size < 1:
        raise ValueError(f"{name} must hold at least one offset")
    if arr[0] != 0 or (np.diff(arr) < 0).any():
        shown = arr.tolist() if arr.size <= 8 else arr[:8].tolist() + ["..."]
        raise ValueError(f"{name} must start at 0 and never decrease; got {shown}")
    if arr[-1] > _INT32_MAX:
        raise ValueError(f"{name} ends at {int(arr[-1])}; offsets must fit in int32")
    return arr


@dataclass(eq=False)
class PackedSeqParams:
    """Megatron-Core's ``PackedSeqParams`` fields, when megatron-core is absent.
    Equal when every field is (offsets compared element by element)."""

    qkv_format: str
    cu_seqlens_q: "torch.Tensor"
    cu_seqlens_kv: "torch.Tensor"
    cu_seqlens_q_padded: "torch.Tensor"
    cu_seqlens_kv_padded: "torch.Tensor"
    max_seqlen_q: int
    max_seqlen_kv: int

    __eq__ = fields_equal
    __hash__ = None  # mutable


def megatron_packed_seq_params(cu_seqlens: Any, cu_seqlens_padded: Any, max_seqlen_padded: int):
    """Megatron-Core's ``PackedSeqParams`` for a THD batch: ``qkv_format="thd"``, real
    ``cu_seqlens_q/kv``, padded ``cu_seqlens_q/kv_padded`` and padded max lengths
    (memory offsets, so each sequence's tail padding stays inside it). A real
    ``megatron.core.packed_seq_params.PackedSeqParams`` when megatron-core is
    importable, else :class:`seqpack.PackedSeqParams` with the same fields."""
    fields = dict(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                  cu_seqlens_q_padded=cu_seqlens_padded, cu_seqlens_kv_padded=cu_seqlens_padded,
                  max_seqlen_q=max_seqlen_padded, max_seqlen_kv=max_seqlen_padded)
    try:
        from megatron.core.packed_seq_params import PackedSeqParams as MegatronParams
    except ImportError:
        MegatronParams = PackedSeqParams
    return MegatronParams(**fields)


def host_offsets(cu: Any, name: str = "cu_seqlens", *, copy_device: bool = False) -> np.ndarray:
    """:func:`check_offsets` for functions that must read the values on the host
    (index maps, plans). A device tensor is refused rather than read with a hidden
    synchronisation, unless ``copy_device`` (the caller documents the copy)."""
    if copy_device and hasattr(cu, "device") and hasattr(cu, "cpu") and cu.device.type != "cpu":
        cu = cu.detach().cpu()
    out = check_offsets(cu, name)
    if not isinstance(out, np.ndarray):
        raise ValueError(f"{name} must be on the host here (a list, NumPy array or CPU tensor); got a tensor on "
                         f"{cu.device}: reading it would synchronise the device")
    return out


def _host_form(cu: Any, name: str) -> Any:
    """``cu`` in a form the C++ core reads and checks itself (a 1-D integer NumPy
    array or a list of ints), else through :func:`host_offsets` (forms, dtypes, devices)."""
    if isinstance(cu, np.ndarray) and cu.ndim == 1 and cu.dtype.kind == "i":
        return cu
    if isinstance(cu, list) and all(type(v) is int for v in cu):
        return cu
    return host_offsets(cu, name)


@dataclass(frozen=True, eq=False)
class PackedLayout(TokenLayout):
    """Where each sequence's tokens sit in a packed THD tensor, and for which
    context-parallel split: the :class:`~seqpack.tensors.token_layout.TokenLayout`
    of rows that share nothing (physical row ``cu_seqlens_padded[i] + j`` is token
    ``j`` of row ``i``; the rows' tails are pad rows). Immutable; built by :meth:`from_lengths` or
    :meth:`from_offsets` (both validate), held by every :class:`seqpack.PackedBatch`
    (:func:`seqpack.pack_sequences`, :func:`seqpack.collate_packs`, and through them
    ``BatchedDataDict``'s micro-batches and the HF ``PackingCollator``). Taken in
    place of offsets by :func:`seqpack.attention`, :func:`seqpack.token_logprobs`
    and :class:`seqpack.SequencePackingLossWrapper` (with ``cp_size > 1``: its zigzag
    cut; :func:`seqpack.shard_layout` cuts a whole one).

    Attributes:
        cu_seqlens: ``[B + 1]`` int32 NumPy (read-only): cumulative real lengths.
        cu_seqlens_padded: ``[B + 1]`` int32 NumPy (read-only): cumulative padded
            lengths, the memory offsets of the full THD tensor.
        pad_multiple: the per-sequence multiple the layout was padded to (1 if
            built from offsets).
        cp_size / cp_rank: the context-parallel split; local rows are
            ``num_tokens // cp_size``.
    """

    cu_seqlens: np.ndarray
    cu_seqlens_padded: np.ndarray
    pad_multiple: int = 1
    cp_size: int = 1
    cp_rank: int = 0
    _device_offsets: Dict[Any, Tuple[Any, Any]] = field(default_factory=dict, repr=False, compare=False)
    _core_layout: Any = field(default=None, repr=False, compare=False)  # the C++ ThdLayout
    _plans: Dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)  # host plans (TokenLayout)

    def __post_init__(self) -> None:
        cp = as_positive_int(self.cp_size, "cp_size")
        if as_positive_int(self.cp_rank, "cp_rank", allow_zero=True) >= cp:
            raise ValueError(f"cp_rank must be an int in [0, cp_size={cp}), got {self.cp_rank!r}")
        object.__setattr__(self, "pad_multiple", as_positive_int(self.pad_multiple, "pad_multiple"))
        cu, padded = _host_form(self.cu_seqlens, "cu_seqlens"), _host_form(self.cu_seqlens_padded, "cu_seqlens_padded")
        # The values' rules (start at 0, never decrease, int32, padded spans hold the
        # real ones, CP chunks) live in the C++ core; it returns the int32 offsets.
        self._adopt(_core.thd_layout_from_offsets(cu, padded, cp), cp, int(self.cp_rank))

    def _adopt(self, core: Any, cp_size: int, cp_rank: int) -> None:
        cu, padded = core.cu_seqlens, core.cu_seqlens_padded  # fresh int32 arrays, the layout's own
        cu.flags.writeable = False
        padded.flags.writeable = False
        for name, value in (("_core_layout", core), ("cu_seqlens", cu), ("cu_seqlens_padded", padded),
                            ("cp_size", cp_size), ("cp_rank", cp_rank)):
            object.__setattr__(self, name, value)

    @classmethod
    def _from_core(cls, core: Any, pad_multiple: int, cp_rank: int, plans: Any = None) -> "PackedLayout":
        """A layout the C++ core has just built and checked (a plan's, or the core
        layout of a pickle, which checks its offsets as it loads): no second pass."""
        if not isinstance(core, _core.ThdLayout):
            raise TypeError(f"core must be a seqpack._core.ThdLayout, got {type(core).__name__}")
        self = object.__new__(cls)
        object.__setattr__(self, "pad_multiple", as_positive_int(pad_multiple, "pad_multiple"))
        object.__setattr__(self, "_device_offsets", {})
        object.__setattr__(self, "_plans", {})
        cp_rank = as_positive_int(cp_rank, "cp_rank", allow_zero=True)
        if cp_rank >= core.cp_size:
            raise ValueError(f"cp_rank must be an int in [0, cp_size={core.cp_size}), got {cp_rank}")
        self._adopt(core, int(core.cp_size), cp_rank)
        self._adopt_plans(plans)
        return self

    # ---- value semantics: equality, hashing, pickling ----------------------------
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PackedLayout):
            return NotImplemented
        return (self.pad_multiple, self.cp_size, self.cp_rank) == (other.pad_multiple, other.cp_size, other.cp_rank) \
            and np.array_equal(self.cu_seqlens, other.cu_seqlens) \
            and np.array_equal(self.cu_seqlens_padded, other.cu_seqlens_padded)

    def __hash__(self) -> int:
        return hash((self.cu_seqlens.tobytes(), self.cu_seqlens_padded.tobytes(), self.pad_multiple, self.cp_size,
                     self.cp_rank))

    def _defining_arrays(self) -> Tuple[Any, ...]:
        """Its offsets, padded offsets, pad multiple and CP split."""
        return (self.cu_seqlens, self.cu_seqlens_padded, self.pad_multiple, self.cp_size, self.cp_rank)

    def __reduce__(self):
        # The C++ layout pickles as its offsets (checked again on load), with the
        # host plans that can be checked against it; the device-offset cache is
        # not state and starts empty in the copy.
        return PackedLayout._from_core, (self._core_layout, self.pad_multiple, self.cp_rank, self._pickled_plans())

    # ---- constructors ------------------------------------------------------------
    @classmethod
    def from_lengths(cls, seq_lens: Any, *, pad_multiple: int = 1, pad_packed_to: Optional[int] = None,
                     pad_packed_multiple: Optional[int] = None, cp_size: int = 1, cp_rank: int = 0) -> "PackedLayout":
        """Pad each of ``seq_lens`` to ``pad_multiple`` (the C++ core's rule, the one
        :func:`seqpack.pack_sequences` uses); the whole pack optionally to exactly /
        a multiple of ``pad_packed_to`` / ``pad_packed_multiple`` tokens, the extra
        joining the last sequence as Megatron-Core does.

        >>> PackedLayout.from_lengths([3, 5], pad_multiple=4, cp_size=2).cu_seqlens_padded.tolist()
        [0, 4, 12]
        """
        layout = _core.thd_layout(
            core_lengths(seq_lens, "seq_lens"), as_positive_int(pad_multiple, "pad_multiple"),
            0 if pad_packed_to is None else as_positive_int(pad_packed_to, "pad_packed_to"),
            1 if pad_packed_multiple is None else as_positive_int(pad_packed_multiple, "pad_packed_multiple"),
            as_positive_int(cp_size, "cp_size"))
        return cls(layout.cu_seqlens, layout.cu_seqlens_padded, pad_multiple, cp_size, cp_rank)

    @classmethod
    def from_offsets(cls, cu_seqlens: Any, cu_seqlens_padded: Any = None, *, cp_size: int = 1,
                     cp_rank: int = 0) -> "PackedLayout":
        """A layout from existing offsets (host forms of :func:`check_offsets`);
        ``cu_seqlens_padded`` defaults to ``cu_seqlens`` (no padding)."""
        return cls(cu_seqlens, cu_seqlens if cu_seqlens_padded is None else cu_seqlens_padded, 1, cp_size, cp_rank)

    # ---- derived sizes ----------------------------------------------------------
    @property
    def num_sequences(self) -> int:
        return int(self.cu_seqlens.size - 1)

    @property
    def seq_lens(self) -> np.ndarray:
        """``[B]`` int64 real lengths."""
        return np.diff(self.cu_seqlens.astype(np.int64))

    @property
    def padded_lens(self) -> np.ndarray:
        """``[B]`` int64 padded lengths."""
        return np.diff(self.cu_seqlens_padded.astype(np.int64))

    @property
    def max_seqlen(self) -> int:
        return int(self.seq_lens.max()) if self.num_sequences else 0

    @property
    def max_seqlen_padded(self) -> int:
        return int(self.padded_lens.max()) if self.num_sequences else 0

    @property
    def num_tokens(self) -> int:
        """Rows of the full THD tensor (``cu_seqlens_padded[-1]``)."""
        return int(self.cu_seqlens_padded[-1])

    @property
    def local_tokens(self) -> int:
        """Rows this context-parallel rank holds (``num_tokens // cp_size``)."""
        return self.num_tokens // self.cp_size

    @property
    def real_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    # ---- the TokenLayout interface ----------------------------------------------------
    num_rows = property(lambda self: self.num_sequences, doc="Rows (sequences) R.")
    num_logical_tokens = property(lambda self: self.real_tokens, doc="Real tokens N (cu_seqlens[-1]).")

    @property
    def logical_index(self) -> np.ndarray:
        """``[N]`` int64: the THD row of each real token, sequences in order."""
        return self.host_plan("logical_index", _logical_index)

    @property
    def position_ids(self) -> np.ndarray:
        """``[T]`` int64 over the full THD tensor: positions restart at 0 at each
        sequence and run on through its tail padding (what :func:`seqpack.pack_sequences`
        gives)."""
        return self.host_plan("position_ids", _position_ids)

    def rows(self) -> "PackedLayout":
        """Itself: rows that share nothing are plain packing."""
        return self

    def select(self, *, rows: Any, tree: Any) -> Any:
        return rows

    def _plan_store(self) -> Dict[Any, Any]:
        return self._plans

    def local_offsets(self) -> np.ndarray:
        """``[B + 1]`` int64: where each sequence's local rows start on this CP rank."""
        return self.cu_seqlens_padded.astype(np.int64) // self.cp_size

    def for_rank(self, cp_rank: int) -> "PackedLayout":
        """The same layout as seen by another context-parallel rank."""
        return PackedLayout(self.cu_seqlens, self.cu_seqlens_padded, self.pad_multiple, self.cp_size, cp_rank)

    # ---- tensors ------------------------------------------------------------------
    def offsets_on(self, device: Any = "cpu") -> Tuple["torch.Tensor", "torch.Tensor"]:
        """``(cu_seqlens, cu_seqlens_padded)`` as new int32 tensors on ``device``,
        yours to keep or edit: the layout never shares storage with a tensor it
        hands out. The host-to-device copy happens once (one pinned non-blocking
        copy, cached); later calls copy on the device, without a host sync.

        >>> layout = PackedLayout.from_lengths([3, 5], pad_multiple=4)
        >>> cu, _ = layout.offsets_on("cpu"); cu += 1
        >>> layout.offsets_on("cpu")[0].tolist()
        [0, 3, 8]
        """
        return tuple(t.clone() for t in self._offsets_on(device))

    def _offsets_on(self, device: Any) -> Tuple["torch.Tensor", "torch.Tensor"]:
        """The cached offsets on ``device``, for seqpack's own kernels, which only
        read them; never handed to a caller (see :meth:`offsets_on`)."""
        torch = _torch()
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        cached = self._device_offsets.get(device)
        if cached is None:
            from ._device import host_to_device

            cached = tuple(host_to_device([self.cu_seqlens, self.cu_seqlens_padded], device))
            self._device_offsets[device] = cached
        return cached

    def _seed_offsets(self, device: Any, cu_seqlens: "torch.Tensor", cu_seqlens_padded: "torch.Tensor") -> None:
        """Cache offsets a caller has just copied to ``device`` in its own transfer
        (a batch's metadata copy): tensors nobody else holds, never handed out."""
        self._device_offsets.setdefault(device, (cu_seqlens, cu_seqlens_padded))

    def packed_seq_params(self, device: Any = "cpu"):
        """Megatron-Core ``PackedSeqParams`` of this layout with offsets on ``device``
        (see :func:`megatron_packed_seq_params`; new tensors, as :meth:`offsets_on`)."""
        cu, padded = self.offsets_on(device)
        return megatron_packed_seq_params(cu, padded, self.max_seqlen_padded)

    def __repr__(self) -> str:
        cp = f", cp_size={self.cp_size}, cp_rank={self.cp_rank}" if self.cp_size > 1 else ""
        return (f"PackedLayout(num_sequences={self.num_sequences}, real_tokens={self.real_tokens}, "
                f"num_tokens={self.num_tokens}, pad_multiple={self.pad_multiple}{cp})")


def _logical_index(layout: PackedLayout) -> np.ndarray:
    lens = layout.seq_lens
    shift = layout.cu_seqlens_padded[:-1].astype(np.int64) - layout.cu_seqlens[:-1].astype(np.int64)
    index = np.repeat(shift, lens) + np.arange(layout.real_tokens, dtype=np.int64)
    index.flags.writeable = False
    return index


def _position_ids(layout: PackedLayout) -> np.ndarray:
    starts = layout.cu_seqlens_padded[:-1].astype(np.int64)
    pos = np.arange(layout.num_tokens, dtype=np.int64) - np.repeat(starts, layout.padded_lens)
    pos.flags.writeable = False
    return pos
