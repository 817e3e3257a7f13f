"""A layout cut across context-parallel ranks: :func:`shard_layout` and its helpers.

Every :class:`~seqpack.TokenLayout` carries its cut (:attr:`~seqpack.TokenLayout.cut`,
a :class:`~seqpack.tensors.cp_cut.CpCut`). Rows packed for ``cp_size > 1`` are
already cut in zigzag chunks; :func:`shard_layout` cuts any layout for one rank of
a CP group and returns a :class:`ShardedLayout`, which knows this rank's rows of a
full tensor (:meth:`ShardedLayout.local_rows`) and gathers every rank's back
(:meth:`ShardedLayout.gather`)::

    rows  a a a a | b b b b        zigzag, C = 2, rank 0:  a0 a3 b0 b3
    tree  0 1 2 3 4 5 6 7 8 9      ranges, C = 2, rank 0:  0 .. 5   (tree_cp_bounds)
    any   0 1 2 3 4 5 6 7 8 9      ulysses, C = 2, rank 1: 5 .. 9   (heads exchanged)

    >>> import seqpack
    >>> tree = seqpack.pack_prefix_tree([[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 8, 9, 10]])
    >>> part = seqpack.shard_layout(tree, 2, 1)
    >>> part.cut, part.bounds.tolist(), part.num_local_tokens
    (CpCut('ranges', size=2, rank=1), [0, 6, 10], 4)

The attention and log-prob implementations each cut runs are chosen in
:mod:`seqpack.training.dispatch`. Importing this module does not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, Optional

import numpy as np

from .._lengths import as_positive_int
from .cp_cut import CpCut
from .layout import PackedLayout
from .layout_kinds import as_layout, layout_kind
from .token_layout import TokenLayout

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["SCHEMES", "ShardedLayout", "shard_layout"]

SCHEMES = ("auto", "zigzag", "ranges", "ulysses")


@dataclass(frozen=True, eq=True)
class ShardedLayout(TokenLayout):
    """One rank's view of ``base`` cut by ``cut`` (see :func:`shard_layout`). A
    :class:`~seqpack.TokenLayout`: its counts, positions and logical order are the
    whole layout's (every rank knows the whole batch); its rows on this rank are
    :attr:`num_local_tokens`."""

    base: TokenLayout
    _cut: CpCut
    _bounds: Optional[np.ndarray] = field(default=None, repr=False, compare=False)

    # ---- what the cut changes --------------------------------------------------------
    @property
    def cut(self) -> CpCut:
        return self._cut

    @property
    def whole(self) -> TokenLayout:
        """The layout the implementations take (for zigzag: the rows laid out for
        this rank, a :class:`~seqpack.PackedLayout` with ``cp_size > 1``)."""
        return self.base

    cp_size = property(lambda self: self._cut.size, doc="The CP group's size.")
    cp_rank = property(lambda self: self._cut.rank, doc="This rank's index in it.")

    @property
    def bounds(self) -> np.ndarray:
        """``[size + 1]`` int64: rank ``r`` holds physical rows ``[bounds[r],
        bounds[r + 1])`` (``ranges`` and ``ulysses`` cuts; zigzag rows are not
        contiguous: ``None``)."""
        return self._bounds

    @property
    def num_local_tokens(self) -> int:
        """Rows of this rank."""
        if self._cut.kind == "zigzag":
            return self.base.local_tokens
        return int(self._bounds[self._cut.rank + 1] - self._bounds[self._cut.rank])

    # ---- the whole layout's facts ------------------------------------------------------
    num_tokens = property(lambda self: self.base.num_tokens)
    num_logical_tokens = property(lambda self: self.base.num_logical_tokens)
    num_rows = property(lambda self: self.base.num_rows)
    logical_index = property(lambda self: self.base.logical_index)
    position_ids = property(lambda self: self.base.position_ids)
    cu_seqlens = property(lambda self: self.base.cu_seqlens)

    def rows(self) -> Any:
        """The plain packing of these tokens when nothing is shared and the cut is a
        rows cut (zigzag); else ``None``."""
        return self.base.rows() if self._cut.kind == "zigzag" else None

    def select(self, *, rows: Any, tree: Any) -> Any:
        return self.base.select(rows=rows, tree=tree)

    def _plan_store(self) -> Dict[Any, Any]:
        return self.base._plan_store()

    def _identity(self) -> str:
        return self.base._identity()  # the plans are the base's, and so is their digest

    # ---- the cut's helpers -------------------------------------------------------------
    def local_rows(self, full: Any) -> Any:
        """This rank's rows of a full ``[T, ...]`` tensor (or array) of the whole
        layout: zigzag chunks (one gather), a contiguous range (a view), or a
        Ulysses slice (padded at the stream's tail with 0)."""
        shape = tuple(getattr(full, "shape", ()))
        if not shape or shape[0] != self.num_tokens:
            raise ValueError(f"full must have one row per physical token of the layout ({self.num_tokens}), got "
                             f"shape {shape}")
        kind, size, rank = self._cut.kind, self._cut.size, self._cut.rank
        if kind == "zigzag":
            from .cp import cp_local_rows

            return cp_local_rows(full, self.base.cu_seqlens_padded, size, rank)
        start, end = int(self._bounds[rank]), int(self._bounds[rank + 1])
        if kind == "ulysses" and end > self.num_tokens:
            from ._ulysses import slice_rows

            return slice_rows(full, self.num_tokens, rank, size)
        return full[start:end]

    def gather(self, local: "torch.Tensor", group: Any = None, *, agree: bool = True) -> "torch.Tensor":
        """Every rank's :meth:`local_rows` all-gathered over ``group`` into the full
        ``[T, ...]`` (one collective; its backward a reduce-scatter). ``agree``
        first compares every rank's rows, shapes and dtypes in one all-reduce."""
        import torch.distributed as dist

        size = dist.get_world_size(group)
        if size != self._cut.size or dist.get_rank(group) != self._cut.rank:
            raise ValueError(f"group has size {size} and this process is rank {dist.get_rank(group)} in it; the "
                             f"layout is cut for {self._cut}")
        kind = self._cut.kind
        if kind == "zigzag":
            from .cp import gather_cp

            return gather_cp(local, self.base.cu_seqlens_padded, group, agree=agree)
        if kind == "ranges":
            from .prefix_tree_cp import gather_tree_cp

            return gather_tree_cp(local, self.base, group, agree=agree)
        from ._ulysses import gather_rows

        return gather_rows(local, self.num_tokens, group, agree=agree)

    def __reduce__(self):
        return _rebuild, (self.base, self._cut.kind, self._cut.size, self._cut.rank)


def _rebuild(base: Any, kind: str, size: int, rank: int) -> "ShardedLayout":
    return shard_layout(base, size, rank, scheme=kind)


def shard_layout(layout: Any, cp_size: Any, cp_rank: Any, *, scheme: str = "auto") -> TokenLayout:
    """``layout`` cut for rank ``cp_rank`` of a context-parallel group of
    ``cp_size`` ranks: the layout every op takes on that rank
    (:func:`seqpack.attention`, :func:`seqpack.token_logprobs`, the loss wrapper).

    Args:
        layout: a :class:`~seqpack.TokenLayout` (or a :class:`~seqpack.PackedBatch`)
            of the whole batch, not cut yet.
        cp_size / cp_rank: the group's size and this rank (Python, NumPy or 0-d
            tensor integers). ``cp_size == 1`` returns ``layout`` itself.
        scheme: ``"zigzag"`` (rows: each padded row's chunks ``r`` and ``2C-1-r``;
            its padded lengths must be multiples of ``2 * cp_size``, see
            :func:`seqpack.alignment`), ``"ranges"`` (a prefix tree's depth-first
            order in ``cp_size`` contiguous ranges of even attention work),
            ``"ulysses"`` (contiguous slices of the stream, heads exchanged in
            attention), or ``"auto"``: zigzag for rows, ranges for a tree.

    Returns:
        a :class:`ShardedLayout` (``.cut``, ``.local_rows(full)``, ``.gather(local,
        group)``).
    """
    from ._ulysses import local_rows as ulysses_rows

    base = as_layout(layout, "layout")
    if not isinstance(scheme, str) or scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    size = as_positive_int(cp_size, "cp_size")
    rank = as_positive_int(cp_rank, "cp_rank", allow_zero=True)
    if rank >= size:
        raise ValueError(f"cp_rank must be in [0, cp_size={size}), got {rank}")
    if not base.cut.is_whole:
        raise ValueError(f"layout is already cut ({base.cut}): give the whole layout")
    if size == 1:
        return base
    kind = layout_kind(base)
    if scheme == "auto":
        scheme = "zigzag" if kind == "rows" else "ranges"
    if scheme == "zigzag":
        if kind != "rows":
            raise ValueError("scheme='zigzag' cuts rows back to back (a PackedLayout); a prefix tree is cut in "
                             "'ranges' (or 'ulysses')")
        cut_rows = PackedLayout(base.cu_seqlens, base.cu_seqlens_padded, base.pad_multiple, size, rank)
        return ShardedLayout(cut_rows, CpCut("zigzag", size, rank))
    if scheme == "ranges":
        if kind == "rows":
            raise ValueError("scheme='ranges' cuts a prefix tree; rows back to back are cut in 'zigzag' chunks "
                             "(or 'ulysses')")
        from .prefix_tree_cp import tree_cp_bounds

        bounds = np.asarray(tree_cp_bounds(base, size), dtype=np.int64)
    else:
        n = ulysses_rows(base.num_tokens, size)
        bounds = np.arange(size + 1, dtype=np.int64) * n
    bounds.flags.writeable = False
    return ShardedLayout(base, CpCut(scheme, size, rank), bounds)
