"""The layout of a hybrid-CP micro-batch: a composite of parts, each a layout with its
own cut, that is itself a :class:`~seqpack.TokenLayout`.

A rank's hybrid micro-batch (:class:`~seqpack.HybridCpBatch`) holds the sequences it
runs whole and, for each block of ranks it shares sharded sequences with, its share
of them. Its layout puts the parts' whole streams back to back; the rank holds each
part's cut (``part.cut_layout``), its rows in part order::

    parts            whole E      (2, 0): B zigzag     (4, 0): A zigzag
    physical stream  [ E E E | B B B B B B B B | A A A ... A ]     num_tokens
    this rank        [ E E E | B/2             | A/4       ]      num_local_tokens
    cut              composite: each part's own (whole, zigzag over 2, over 4)

What every layout states (rows, logical tokens, positions, ``cu_seqlens``) is the
parts' in order; what runs is decided per part by the dispatch table
(:mod:`seqpack.training.dispatch`, kind ``"parts"``): :func:`seqpack.attention`,
:func:`seqpack.token_logprobs` and :class:`~seqpack.SequencePackingLossWrapper` take
the layout or the micro-batch holding it.

Importing this module does not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Dict, Optional, Tuple

import numpy as np

from .cp_cut import CpCut
from .token_layout import TokenLayout

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["HybridCpPart", "PartsLayout"]


@dataclass(eq=False)
class HybridCpPart:
    """One part of a rank's hybrid micro-batch.

    Attributes:
        degree: the ranks its sequences are sharded over (1: run whole here).
        first: the first cp_rank of its block (its group:
            ``hybrid_cp_groups(...).block(dp_rank, degree, first)``).
        cp_rank: this rank's index in the block (``0`` for a whole part).
        rows: the plan's sequence ids, in the order laid out.
        layout: a :class:`~seqpack.PackedBatch` (zigzag with ``cp_size=degree`` when
            sharded) or a :class:`~seqpack.PrefixTreeBatch` (the whole tree; a
            sharded rank holds one range of it: :attr:`cut_layout`, the tree's
            ranges cut by :func:`~seqpack.shard_layout`).
        input_ids: a packed part's full packed ids ``[T]`` (before the zigzag cut;
            the next-token targets), ``None`` for a tree (its own ids).
        start / end: this part's rows of the micro-batch's tensors.
    """

    degree: int
    first: int
    cp_rank: int
    rows: Tuple[int, ...]
    layout: Any
    input_ids: Optional["torch.Tensor"]
    start: int
    end: int

    @property
    def cut_layout(self) -> Any:
        """The part's layout carrying this rank's cut (:class:`~seqpack.TokenLayout`):
        whole, zigzag rows (``cp_size = degree``) or a tree's range of the block: what
        :func:`seqpack.attention` and :func:`seqpack.token_logprobs` take for it."""
        from .layout_kinds import as_layout
        from .sharded_layout import shard_layout

        layout = as_layout(self.layout)
        return layout if self.degree == 1 or not layout.cut.is_whole else shard_layout(layout, self.degree,
                                                                                          self.cp_rank)

    def packed_seq_params(self) -> Any:
        """Megatron's ``PackedSeqParams`` of a packed part (its THD offsets before the
        zigzag cut, as Transformer Engine's CP takes them); a tree sharing tokens has
        none (``TypeError``)."""
        return self.layout.packed_seq_params()

    def _key(self) -> tuple:
        return (self.degree, self.first, self.cp_rank, self.rows, self.start, self.end, self.layout, self.input_ids)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, HybridCpPart):
            return NotImplemented
        from .._equality import values_equal

        return values_equal(self._key(), other._key())

    __hash__ = None  # type: ignore[assignment]


@dataclass(eq=False)
class PartsLayout(TokenLayout):
    """The composite layout of one rank's hybrid-CP micro-batch (module docstring).

    Attributes:
        parts: the :class:`HybridCpPart` s, in the order every rank runs them.
        dp_size / dp_rank: the CP groups and this rank's; ``cp_size`` / ``cp_rank``
            the CP group's size and this rank's index in it.
        group_ranks: the global ranks of the DP x CP group the blocks' process
            groups are made in (empty: WORLD).
    """

    parts: Tuple[HybridCpPart, ...]
    dp_size: int
    dp_rank: int
    cp_size: int
    cp_rank: int
    group_ranks: Tuple[int, ...] = ()
    # This rank's rows: the parts' and, when the plan gave the micro-batch a static
    # shape, the pad rows after them that no part reads (None: the parts' rows).
    local_rows: Optional[int] = None
    _plans: Dict[Any, Any] = field(default_factory=dict, repr=False)
    # Its layout kind, the dispatch table's key with its cut (layout_kinds.layout_kind).
    composite_kind: ClassVar[str] = "parts"

    @property
    def cut(self) -> CpCut:
        """A composite cut: each part carries its own (``part.cut_layout``)."""
        return CpCut("composite", self.cp_size, self.cp_rank)

    def _layouts(self) -> Tuple[TokenLayout, ...]:
        from .layout_kinds import as_layout

        return tuple(as_layout(p.layout) for p in self.parts)

    def _concat(self, name: str, shift: Optional[str] = None) -> np.ndarray:
        """The parts' per-token arrays ``name`` back to back (each shifted by the
        ``shift`` count of the parts before it)."""
        out, base = [], 0
        for layout in self._layouts():
            out.append(np.asarray(getattr(layout, name), dtype=np.int64) + base)
            if shift is not None:
                base += int(getattr(layout, shift))
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    @property
    def cu_seqlens(self) -> np.ndarray:
        """``[R + 1]``: the rows' logical offsets, parts in order."""
        lens = [layout.seq_lens for layout in self._layouts()]
        return np.concatenate([[0], np.cumsum(np.concatenate(lens) if lens else [])]).astype(np.int64)

    num_tokens = property(lambda self: sum(layout.num_tokens for layout in self._layouts()),
                          doc="Physical tokens of the parts' whole streams.")
    num_logical_tokens = property(lambda self: sum(layout.num_logical_tokens for layout in self._layouts()),
                                  doc="Tokens of the rows, N.")
    num_rows = property(lambda self: sum(len(p.rows) for p in self.parts), doc="Rows R: every part's.")
    num_local_tokens = property(
        lambda self: self.local_rows if self.local_rows is not None else self.parts[-1].end if self.parts else 0,
        doc="This rank's rows of the micro-batch: each part's cut in order, then the static shape's pad rows.")
    num_local_pad_rows = property(lambda self: self.num_local_tokens - (self.parts[-1].end if self.parts else 0),
                                  doc="The pad rows after the parts (a static shape's), read by no part.")

    @property
    def logical_index(self) -> np.ndarray:
        """``[N]``: each logical token's physical token in the parts' stream."""
        return self.host_plan("logical_index", lambda s: s._concat("logical_index", "num_tokens"))

    @property
    def position_ids(self) -> np.ndarray:
        """``[T]``: each physical token's position in its rows, parts in order."""
        return self.host_plan("position_ids", lambda s: s._concat("position_ids"))

    def rows(self) -> None:
        """None: the parts run with their own cuts, never as one set of rows."""
        return None

    def require_rows(self, op: str) -> Any:
        raise TypeError(f"a hybrid-CP micro-batch is a composite of parts with their own cuts: {op} takes rows that "
                        "share nothing; run it with seqpack.attention / seqpack.token_logprobs, or each "
                        "part.cut_layout")

    def select(self, *, rows: Any, tree: Any) -> Any:
        raise TypeError("a hybrid-CP micro-batch is a composite of parts (layout kind 'parts'), neither rows nor a "
                        "tree: seqpack.training.dispatch runs each part")

    def _plan_store(self) -> Dict[Any, Any]:
        return self._plans

    def block_group(self, part: HybridCpPart) -> Any:
        """The process group of ``part``'s block (``None`` for a whole part)."""
        if part.degree == 1:
            return None
        from .hybrid_cp_groups import cached_hybrid_cp_groups

        return cached_hybrid_cp_groups(self.dp_size, self.cp_size, self.group_ranks).block(
            self.dp_rank, part.degree, part.first)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PartsLayout):
            return NotImplemented
        from .._equality import values_equal

        def key(x: "PartsLayout") -> tuple:
            return (x.parts, x.dp_size, x.dp_rank, x.cp_size, x.cp_rank, x.group_ranks, x.num_local_tokens)

        return values_equal(key(self), key(other))

    __hash__ = None  # type: ignore[assignment]

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state["_plans"] = {}  # host plans are rebuilt where the layout lands
        return state
