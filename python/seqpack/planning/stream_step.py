"""One planned step of a :class:`~seqpack.StreamPlanner`: a :func:`~seqpack.plan_step`
plan of the step's items, with the plan's cells given as item ids, and the
rollouts' payloads handed back with it.

A step's layout, for ``dp_size = 2`` and one mini-batch::

    item_ids     [ 12  13  14  15 | 20  21 ]      groups g3 (4 items), g5 (2), in the order taken
    position p     0   1   2   3    4   5        plan.assignment holds positions
    assignment   rank 0: [[12, 20], [15]]        step.assignment holds item ids
                 rank 1: [[13, 14], [21]]
    rank_items(0) -> [12, 20, 15]                rank 0's items in the order it runs them
    payloads     [ p12 p13 p14 p15 | p20 p21 ]   what add(payloads=) took, by position
    dropped      [ 7 8 9 ]  dropped_payloads [ p7 p8 p9 ]   stale (or too long) since the last step

Importing this module does not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Hashable, List, Optional

import numpy as np

from .._readonly import ReadOnlyArrays
from .step import StepPlan

__all__ = ["StreamStep"]


@dataclass(frozen=True)
class StreamStep(ReadOnlyArrays):
    """One planned step of a :class:`StreamPlanner`: a :class:`~seqpack.StepPlan` of
    its items, with the plan's cells given as item ids.

    Attributes:
        plan: the :func:`~seqpack.plan_step` plan over the step's positions
            ``0 .. num_items - 1`` (``item_ids[p]`` is position ``p``'s item); with
            ``shared_prefix`` it keeps the step's forest (``plan.forest``, whose
            row ``p`` is position ``p``'s rollout), so a shard of the step lays
            out the planned trees.
        item_ids: the step's items (read-only int64), group by group in the order
            they were taken, each group's items ascending.
        groups: the labels of the groups the step holds, in that order.
        dropped: the item ids dropped as stale since the previous step (read-only
            int64, ascending), and ``dropped_groups`` their groups' labels.
        version: the ``current_version`` the step was planned at.
        pending: items the planner still holds after this step.
        planning_seconds: wall time of :meth:`StreamPlanner.next_step` / ``flush``.
        payloads / dropped_payloads: what :meth:`StreamPlanner.add` took as each
            item's ``payloads`` (``None`` where none was given), by position of
            ``item_ids`` / ``dropped``: the planner hands each one back exactly
            once, with the step that holds or drops its item.
    """

    plan: StepPlan
    item_ids: np.ndarray = field(repr=False)
    groups: List[Hashable]
    dropped: np.ndarray = field(repr=False)
    dropped_groups: List[Hashable]
    version: int
    pending: int
    planning_seconds: float = field(default=0.0, compare=False)
    payloads: List[Any] = field(default_factory=list, repr=False, compare=False)
    dropped_payloads: List[Any] = field(default_factory=list, repr=False, compare=False)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StreamStep):
            return NotImplemented
        return (self.plan == other.plan and np.array_equal(self.item_ids, other.item_ids)
                and self.groups == other.groups and np.array_equal(self.dropped, other.dropped)
                and self.dropped_groups == other.dropped_groups and self.version == other.version
                and self.pending == other.pending)

    __hash__ = None  # type: ignore[assignment]

    def _ids(self, nested: Any) -> Any:
        if isinstance(nested, list):
            return [self._ids(x) for x in nested]
        return int(self.item_ids[nested])

    @property
    def assignment(self) -> List[List[List[List[int]]]]:
        """``assignment[m][r][k]``: the item ids of mini-batch ``m``, rank ``r``,
        micro-batch ``k`` (``[]``: a dummy)."""
        return self._ids(self.plan.assignment)

    costs = property(lambda self: self.plan.costs, doc="The plan's predicted cost of each cell.")
    tokens = property(lambda self: self.plan.tokens, doc="Each cell's tokens.")
    padded_tokens = property(lambda self: self.plan.padded_tokens, doc="Each cell's static shape, or None.")
    num_micro_batches = property(lambda self: self.plan.num_micro_batches, doc="Micro-batches per rank and mini-batch.")
    predicted_time = property(lambda self: self.plan.predicted_time, doc="The step's predicted time.")
    lower_bound = property(lambda self: self.plan.lower_bound, doc="A proven lower bound on any plan's time.")
    gap = property(lambda self: self.plan.gap, doc="``predicted_time / lower_bound``.")
    dp_size = property(lambda self: self.plan.dp_size)
    max_tokens = property(lambda self: self.plan.max_tokens)
    sync = property(lambda self: self.plan.sync)

    @property
    def num_items(self) -> int:
        return int(self.item_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        """The step's tokens (its items' lengths summed)."""
        return int(self.plan.lengths.sum()) if self.plan.lengths is not None else 0

    def rank_items(self, r: int, mini_batch: Optional[int] = None) -> List[int]:
        """Rank ``r``'s item ids in the order it runs them (see
        :meth:`StepPlan.rank_rows <seqpack.StepPlan.rank_rows>`)."""
        return [int(self.item_ids[p]) for p in self.plan.rank_rows(r, mini_batch)]

    @property
    def metrics(self) -> Dict[str, float]:
        """The plan's metrics plus the step's items, tokens, dropped items and the
        planner's pending items after it."""
        out = dict(self.plan.metrics)
        out.update(items=float(self.num_items), tokens=float(self.num_tokens), dropped=float(self.dropped.size),
                   pending=float(self.pending), planning_seconds=self.planning_seconds)
        return out
