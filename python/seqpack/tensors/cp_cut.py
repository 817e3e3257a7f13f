"""How a layout is cut across context-parallel ranks: one value every layout carries.

A :class:`~seqpack.TokenLayout` holds the physical tokens ``[T]`` of a batch; under
context parallelism each rank of a group of ``size`` holds some of them. The cut
says which, and so which attention / log-prob implementation runs
(:mod:`seqpack.training.dispatch`)::

    whole      every rank holds all T tokens                      (no CP)
    zigzag     rows back to back, each padded row cut in 2C chunks;
               rank r holds chunks r and 2C-1-r of every row      (Megatron, TE)
                   row a:  | a0 | a1 | a2 | a3 |   C = 2: rank 0 a0 a3, rank 1 a1 a2
    ranges     a prefix tree's depth-first order cut into C contiguous ranges,
               balanced by attention work (bounds [C + 1])
                   tree:   | 0 1 2 3 4 5 | 6 7 8 9 |   rank 0 [0, 6), rank 1 [6, 10)
    ulysses    the stream padded to a multiple of C, rank r holding rows
               [r n, (r + 1) n); attention swaps rows for heads (DeepSpeed-Ulysses)
    composite  a hybrid-CP micro-batch: parts, each a layout with its own cut

    >>> CpCut.whole().kind, CpCut("zigzag", 2, 1).local_share
    ('whole', 0.5)

This module is a leaf: it imports no layout (the layouts import it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._lengths import as_positive_int

__all__ = ["CUT_KINDS", "CpCut"]

CUT_KINDS = ("whole", "zigzag", "ranges", "ulysses", "composite")


@dataclass(frozen=True)
class CpCut:
    """A cut of a layout's physical tokens across the ``size`` ranks of a
    context-parallel group, as seen from rank ``rank`` (see the module docstring).

    Attributes:
        kind: one of ``"whole"``, ``"zigzag"``, ``"ranges"``, ``"ulysses"``,
            ``"composite"``.
        size: the group's size (1 for ``"whole"``).
        rank: this rank's index in the group.
    """

    kind: str = "whole"
    size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        if self.kind not in CUT_KINDS:
            raise ValueError(f"kind must be one of {CUT_KINDS}, got {self.kind!r}")
        size = as_positive_int(self.size, "size")
        rank = as_positive_int(self.rank, "rank", allow_zero=True)
        if rank >= size:
            raise ValueError(f"rank must be in [0, size={size}), got {rank}")
        if (self.kind == "whole") != (size == 1) and self.kind != "composite":
            raise ValueError(f"a {self.kind!r} cut needs size {'1' if self.kind == 'whole' else '> 1'}, got {size}")
        object.__setattr__(self, "size", size)
        object.__setattr__(self, "rank", rank)

    @classmethod
    def whole(cls) -> "CpCut":
        """No cut: every rank holds every token."""
        return _WHOLE

    @classmethod
    def of(cls, kind: str, size: Any, rank: Any) -> "CpCut":
        """``kind`` over ``size`` ranks, or :meth:`whole` when ``size`` is 1."""
        return _WHOLE if size == 1 else cls(kind, size, rank)

    @property
    def is_whole(self) -> bool:
        return self.kind == "whole"

    @property
    def local_share(self) -> float:
        """The share of the stream one rank holds when the cut is even (1 / size)."""
        return 1.0 / self.size

    def __repr__(self) -> str:
        return "CpCut.whole()" if self.is_whole else f"CpCut({self.kind!r}, size={self.size}, rank={self.rank})"


_WHOLE = CpCut()  # immutable: one object serves every whole layout
