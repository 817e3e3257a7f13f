"""Planning with groups of rows that must stay in one micro-batch: DPO's chosen /
rejected pairs, a reward model's candidates (verl's ``force_group_size``).

A group is one item for the planner: its tokens the sum of its rows', its workload
the sum of its rows' workloads. The planner places items; each micro-batch then
lists its groups' rows in row order, so consecutive pairs stay interleaved::

    rows      0  1 | 2  3 | 4  5         group_ids  0 0 1 1 2 2
    lengths   5  3 | 9  7 | 2  2         items      8, 16, 4
    max_tokens = 16                      micro-batches [2, 3] (16), [0, 1, 4, 5] (12)

Importing this module does not import torch.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import numpy as np

from .. import _core
from .._lengths import as_lengths


def group_members(group_ids: Any, num_rows: int) -> List[np.ndarray]:
    """The rows of each group, groups in order of first appearance, rows ascending;
    ``group_ids`` one hashable label per row (ints, strings, a tensor or array)."""
    if hasattr(group_ids, "tolist"):
        group_ids = group_ids.tolist()
    labels = list(group_ids)
    if len(labels) != num_rows:
        raise ValueError(f"group_ids must hold one label per row ({num_rows}), got {len(labels)}")
    index: Dict[Any, int] = {}
    members: List[List[int]] = []
    for row, label in enumerate(labels):
        try:
            k = index.setdefault(label, len(index))
        except TypeError:
            raise TypeError(f"group_ids[{row}] = {label!r} is not hashable: group labels must be") from None
        if k == len(members):
            members.append([])
        members[k].append(row)
    return [np.asarray(m, dtype=np.int64) for m in members]


def consecutive_groups(num_rows: int, group_size: int, name: str = "force_group_size") -> List[np.ndarray]:
    """Groups of ``group_size`` consecutive rows (verl's ``force_group_size``); the
    rows must be a multiple of it."""
    if num_rows % group_size:
        raise ValueError(f"{num_rows} rows are not a multiple of {name}={group_size}: every group of {group_size} "
                         "consecutive rows stays in one micro-batch")
    return [np.arange(g, g + group_size, dtype=np.int64) for g in range(0, num_rows, group_size)]


def group_totals(members: List[np.ndarray], values: np.ndarray, cap: int, what: str) -> np.ndarray:
    """Each group's sum of ``values`` (int64); a group above ``cap`` raises, naming it."""
    totals = np.asarray([int(values[m].sum()) for m in members], dtype=np.int64)
    over = np.flatnonzero(totals > cap)
    if over.size:
        g = int(over[0])
        raise ValueError(f"group {g} (rows {members[g].tolist()}) holds {int(totals[g])} {what}, more than "
                         f"max_tokens={cap}: a group stays whole in one micro-batch")
    return totals


def expand(bins: List[List[int]], members: List[np.ndarray]) -> List[List[int]]:
    """Bins of groups -> bins of rows, in row order."""
    return [sorted(int(r) for g in b for r in members[g]) for b in bins]


def plan_group_micro_batches(group_ids: Any, lengths: Any, max_tokens: int, min_num: int, multiple_of: int,
                             attention_coeff: int, order: str, workloads: np.ndarray) -> Dict[str, Any]:
    """:func:`~seqpack.plan_micro_batches` with ``group_ids=``: the groups planned as
    items by the C++ planner, mapped back to rows. Returns the fields of the
    :class:`~seqpack.MicroBatchPlan`."""
    lens = as_lengths(lengths, "lengths").astype(np.int64)
    members = group_members(group_ids, len(lens))
    tokens = group_totals(members, lens, max_tokens, "tokens")
    item_work = np.asarray([int(workloads[m].sum()) for m in members], dtype=np.int64)
    try:
        raw = _core.plan_micro_batches(tokens, max_tokens, min_num, multiple_of, attention_coeff,
                                       order == "small_at_ends", workloads=item_work)
    except ValueError as exc:
        if "more micro-batches" in str(exc) or "sequences" in str(exc):
            raise ValueError(f"{exc} (with group_ids: {len(members)} groups, each whole in one micro-batch)") from None
        raise
    micro = expand(raw["groups"], members)
    return dict(micro_batches=micro, tokens=[int(lens[m].sum()) for m in micro],
                workloads=[int(workloads[m].sum()) for m in micro], max_tokens=max_tokens,
                lower_bound=raw["lower_bound"], method=raw["method"], order=order)


def pack_groups(packer: Any, lengths: np.ndarray, members: List[np.ndarray]) -> Tuple[List[List[int]], np.ndarray]:
    """A :class:`~seqpack.SequencePacker`'s bins of whole groups (their summed
    lengths), as bins of rows in row order."""
    totals = group_totals(members, lengths, int(packer.bin_capacity), "tokens (padded)")
    return expand(packer.pack(totals), members), totals
