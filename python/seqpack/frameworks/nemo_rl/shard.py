"""A shard as plain data: its rows and what it carries of the plan that cut it.

``shard_by_batch_size`` returns one :class:`ShardRecord` per rank (wrapped as a
``SlicedDataDict``, whose attributes are the record's fields); ``get_batch`` takes
one global batch of it (:func:`global_batch`), and the iterators read the record
alone: its token cap, its static shapes, its trees and their sharing rule, and for
a :func:`seqpack.plan_step` plan the plan itself (its CP size and forest)::

    shard                      ShardRecord(data, micro_batch_indices, micro_batch_lengths,
                                           elem_counts_per_gb, micro_batch_token_cap, ...,
                                           step_shard=StepShard(plan, dp_rank, row_ids))
    global_batch(shard, 1)     the rows of global batch 1, its metadata, StepShard(..., mini_batch=1)

    >>> from seqpack.frameworks.nemo_rl.shard import ShardRecord, global_batch
    >>> shard = ShardRecord({"x": [1, 2, 3]}, micro_batch_indices=[[[0, 1]], [[0, 2]]],
    ...                     micro_batch_lengths=[[4], [9]], elem_counts_per_gb=[1, 2], micro_batch_token_cap=10)
    >>> batch = global_batch(shard, 1)
    >>> batch.data, batch.micro_batch_lengths, batch.micro_batch_token_cap
    ({'x': [2, 3]}, [[9]], 10)

Importing this module does not import torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

from .._batch import rows
from ..._equality import fields_equal
from ..._lengths import as_int
from .errors import check, positive
from .rows import slice_rows

if TYPE_CHECKING:  # pragma: no cover
    from ...planning.step import StepPlan
    from ...tensors.prefix_tree import PrefixTreeBatch
    from ...tensors.prefix_passes import PrefixPasses

__all__ = ["META", "ShardRecord", "StepShard", "global_batch", "one_plan"]


@dataclass(frozen=True)
class StepShard:
    """What a shard of a :func:`seqpack.plan_step` plan keeps of it: the plan (its CP
    size, forest, cap and static shapes decide how the shard iterates), the DP rank,
    the plan's sequence id of each of the shard's rows, and (after ``get_batch``)
    which global batch (mini-batch) it is."""

    plan: "StepPlan"
    dp_rank: int
    row_ids: Tuple[int, ...]
    mini_batch: Optional[int] = None

    def batch(self, batch_idx: int, start: int, end: int) -> "StepShard":
        """Global batch ``batch_idx``, the shard's rows ``[start, end)``.

        >>> StepShard(None, 0, (4, 7, 9)).batch(1, 1, 3)
        StepShard(plan=None, dp_rank=0, row_ids=(7, 9), mini_batch=1)
        """
        return StepShard(self.plan, self.dp_rank, self.row_ids[start:end],
                         batch_idx if self.mini_batch is None else self.mini_batch)


@dataclass(eq=False)
class ShardRecord:
    """A shard's rows (``data``) and the plan metadata it carries.

    Attributes:
        micro_batch_indices / micro_batch_lengths / elem_counts_per_gb: NeMo-RL's,
            per global batch (``None`` for a plain shard).
        micro_batch_token_cap: the token cap the micro-batches were planned under
            (sequence packing and step plans); nothing an iterator yields passes it.
        micro_batch_static_lengths: a step plan's static shapes, each micro-batch's
            padded size, per global batch.
        micro_batch_trees: each micro-batch's prefix tree (built with its host plans
            when the shard was; ``None`` for a dummy), per global batch, when the
            micro-batches were planned as trees.
        micro_batch_tree_options: the options those trees were built with (the
            sharing rule: ``input_key``, ``input_lengths_key``, ``group_key``,
            ``min_shared_tokens``, ``pad_to_multiple_of``).
        micro_batch_passes: per global batch, the :class:`~seqpack.PrefixPasses` of
            the shard's tree where the plan runs that batch in passes (prefix reuse:
            its micro-batches are those passes in their run order, then dummies),
            else ``None``.
        step_shard: the :class:`StepShard` of a shard of a step plan.
    """

    data: Dict[str, Any]
    micro_batch_indices: Optional[List[List[List[int]]]] = None
    micro_batch_lengths: Optional[List[List[int]]] = None
    elem_counts_per_gb: Optional[List[int]] = None
    micro_batch_token_cap: Optional[int] = None
    micro_batch_static_lengths: Optional[List[List[int]]] = None
    micro_batch_trees: Optional[List[List[Optional["PrefixTreeBatch"]]]] = None
    micro_batch_tree_options: Optional[Dict[str, Any]] = None
    step_shard: Optional[StepShard] = None
    micro_batch_passes: Optional[List[Optional["PrefixPasses"]]] = None

    __eq__ = fields_equal  # tensors compared element by element
    __hash__ = None  # mutable

    @property
    def cp_plan(self) -> bool:
        """A shard of a step plan with ``cp_size > 1``: each CP rank runs its own part
        of every micro-batch."""
        return self.step_shard is not None and self.step_shard.plan.cp_size > 1


# The metadata a BatchedDataDict carries as attributes: every field but the data.
META: Tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ShardRecord) if f.name != "data")


def _one(values: Optional[Sequence[Any]], index: int) -> Optional[List[Any]]:
    return None if values is None else [values[index]]


def global_batch(shard: ShardRecord, batch_idx: Any, batch_size: Optional[int] = None) -> ShardRecord:
    """Global batch ``batch_idx`` of ``shard``, with its metadata. A sequence-packed or
    step-plan shard knows its per-batch row counts; others need ``batch_size``."""
    try:
        batch_idx = as_int(batch_idx, "batch_idx")  # NumPy and 0-d tensor integers too
    except TypeError:
        pass  # refused below, by name

    def check_index(count: int) -> None:
        check(type(batch_idx) is int and 0 <= batch_idx < count,
              f"batch_idx must be an int in [0, {count}), got {batch_idx!r}")

    counts = shard.elem_counts_per_gb
    if counts is not None:
        check(shard.micro_batch_indices is not None or shard.cp_plan,
              "micro_batch_indices must be provided if sequence_packing is True")
        check_index(len(counts))
        start = sum(counts[:batch_idx])
        end = start + counts[batch_idx]
        return ShardRecord(
            slice_rows(shard.data, start, end), _one(shard.micro_batch_indices, batch_idx),
            _one(shard.micro_batch_lengths, batch_idx), [counts[batch_idx]], shard.micro_batch_token_cap,
            _one(shard.micro_batch_static_lengths, batch_idx), _one(shard.micro_batch_trees, batch_idx),
            shard.micro_batch_tree_options,
            None if shard.step_shard is None else shard.step_shard.batch(batch_idx, start, end),
            _one(shard.micro_batch_passes, batch_idx))
    check(batch_size is not None, "batch_size is required unless the data is a sequence-packed shard")
    batch_size = positive(batch_size, "batch_size")
    size = rows(next(iter(shard.data.values()))) if shard.data else 0
    check_index(-(-size // batch_size))
    out = ShardRecord(slice_rows(shard.data, batch_size * batch_idx, batch_size * (batch_idx + 1)))
    if shard.micro_batch_indices is not None:
        out.micro_batch_indices = [shard.micro_batch_indices[batch_idx]]
        out.micro_batch_lengths = [shard.micro_batch_lengths[batch_idx]]
        out.micro_batch_token_cap = shard.micro_batch_token_cap
    return out


def one_plan(shard: ShardRecord) -> Tuple[List[List[int]], List[int]]:
    """The micro-batches (row ranges) and their planned lengths of a shard of exactly
    one global batch."""
    check(shard.micro_batch_indices is not None and len(shard.micro_batch_indices) == 1
          and shard.micro_batch_lengths is not None,
          "micro-batch metadata for exactly one global batch is required (use get_batch on a shard)")
    return shard.micro_batch_indices[0], shard.micro_batch_lengths[0]
