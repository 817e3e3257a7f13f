"""Named packed tensors: what every packed batch is, whichever pack made it.

A batch packed on the host's plan (:class:`~seqpack.PackedBatch`) and one packed
with static shapes (:class:`~seqpack.StaticPackedBatch`) both hold THD tensors by
name and the offsets that describe them::

    tensors            {"input_ids": [T], "labels": [T], "hidden": [T, H], ...}
    cu_seqlens         [B + 1] int32   real lengths, cumulative
    cu_seqlens_padded  [B + 1] int32   padded lengths, cumulative (memory offsets)
    max_seqlen, max_seqlen_padded      host ints
    seq_lens           [B] int64

This base gives them access by name, value equality (what a pickled or copied batch
compares as) and Megatron-Core's ``PackedSeqParams`` view.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Dict

from .._equality import values_equal
from .layout import megatron_packed_seq_params

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["NamedPackedTensors"]


@dataclass(eq=False)
class NamedPackedTensors:
    """The fields, access by name, equality and Megatron-Core view shared by
    :class:`~seqpack.PackedBatch` and :class:`~seqpack.StaticPackedBatch`."""

    tensors: Dict[str, "torch.Tensor"]
    cu_seqlens: "torch.Tensor"
    cu_seqlens_padded: "torch.Tensor"
    max_seqlen: int
    max_seqlen_padded: int
    seq_lens: "torch.Tensor"

    def __getitem__(self, name: str) -> "torch.Tensor":
        return self.tensors[name]

    def __eq__(self, other: object) -> bool:
        """Same type, layout and sizes, and every tensor equal (dtype, shape,
        device, values): what a pickled or deep-copied batch compares as. Caches
        (position ids, run tensors) are not compared; they follow from the rest."""
        if type(other) is not type(self):
            return NotImplemented
        names = [f.name for f in fields(self) if not f.name.startswith("_")]
        return self._shape_key() == other._shape_key() and all(
            values_equal(getattr(self, n), getattr(other, n)) for n in names)

    __hash__ = None  # mutable: holds tensors

    def _shape_key(self) -> tuple:
        """What besides the fields makes two batches equal (a subclass's sizes)."""
        return ()

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def packed_seq_params(self):
        """Megatron-Core ``PackedSeqParams`` (``qkv_format="thd"``; real
        ``cu_seqlens_q/kv``, padded ``cu_seqlens_q/kv_padded``, padded max lengths).
        A real ``megatron.core.packed_seq_params.PackedSeqParams`` when megatron-core
        is importable, else :class:`~seqpack.PackedSeqParams` with the same fields."""
        return megatron_packed_seq_params(self.cu_seqlens, self.cu_seqlens_padded, self.max_seqlen_padded)
