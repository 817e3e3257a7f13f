"""A :class:`~seqpack.BatchedDataDict` sharded by a hybrid-CP plan
(``plan_step(..., cp_size=C, hybrid_cp=True)``) and its micro-batches.

A DP shard holds the rows of all ``C`` CP ranks of its replica (a rank runs some of
them whole and shares the sharded ones with its block), in plan order per global
batch; each CP rank then builds its own hybrid micro-batches from the plan::

    data.shard_by_batch_size(D, step_plan=plan)[dp_rank]      rows of ranks dp_rank*C .. +C-1
        .get_batch(m)                                          global batch m
        .make_packed_microbatch_iterator(cp_size=C, cp_rank=c) HybridCpBatch, .data its rows

Importing this module does not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, List, Mapping, Optional, Sequence, Tuple

from ._bdd_values import _check, _lengths

if TYPE_CHECKING:  # pragma: no cover
    from ..planning.step import StepPlan
    from ..tensors.hybrid_cp import HybridCpBatch
    from .batched_data_dict import BatchedDataDict

__all__ = ["HybridCpShard"]


@dataclass(frozen=True)
class HybridCpShard:
    """What a DP shard of a hybrid-CP plan carries: the plan, its DP rank, the
    plan's sequence id of each of its rows, and (after ``get_batch``) which global
    batch it is."""

    plan: "StepPlan"
    dp_rank: int
    row_ids: Tuple[int, ...]
    mini_batch: Optional[int] = None


def shard_rows(plan: "StepPlan", dp_rank: int) -> List[List[int]]:
    """Per mini-batch, the sequence ids of every CP rank of replica ``dp_rank``
    (ascending)."""
    C = plan.cp_size
    return [sorted({i for r in range(dp_rank * C, (dp_rank + 1) * C) for cell in mb[r] for i in cell})
            for mb in plan.assignment]


def hybrid_shards(data: "BatchedDataDict", shards: int, plan: "StepPlan", shard_cls: type):
    """The DP shards of ``data`` under a hybrid-CP ``plan`` and the rows each holds."""
    out, order = [], []
    for s in range(shards):
        per_batch = shard_rows(plan, s)
        rows = [i for b in per_batch for i in b]
        shard = data._gather(rows, shard_cls, sorted(data.data))
        shard.elem_counts_per_gb = [len(b) for b in per_batch]
        shard.micro_batch_token_cap = int(plan.max_tokens)
        shard.hybrid_cp = HybridCpShard(plan, s, tuple(rows))
        out.append(shard)
        order.extend(rows)
    return out, order


def batch_of(shard: "BatchedDataDict", batch_idx: int, shard_cls: type) -> "BatchedDataDict":
    """Global batch ``batch_idx`` of a hybrid-CP shard."""
    info: HybridCpShard = shard.hybrid_cp
    counts = shard.elem_counts_per_gb
    _check(0 <= batch_idx < len(counts), f"batch_idx must be an int in [0, {len(counts)}), got {batch_idx!r}")
    start = sum(counts[:batch_idx])
    out = shard.slice(start, start + counts[batch_idx])
    out.elem_counts_per_gb = [counts[batch_idx]]
    out.micro_batch_token_cap = shard.micro_batch_token_cap
    out.hybrid_cp = HybridCpShard(info.plan, info.dp_rank, info.row_ids[start:start + counts[batch_idx]], batch_idx)
    return out


def hybrid_iterator(data: "BatchedDataDict", keys: Optional[Sequence[str]], *, cp_size: int, cp_rank: int,
                    input_lengths_key: str, pad_values: Optional[Mapping[str, Any]], group: Any, forest: Any,
                    shard_cls: type) -> Iterator["HybridCpBatch"]:
    """This CP rank's hybrid micro-batches of one global batch (``data`` from
    ``get_batch``, or a shard of a plan of one mini-batch), each with its rows as
    ``.data`` (a ``shard_cls``, in ``micro_batch.rows`` order: what the loss wrapper
    takes)."""
    from ..tensors.hybrid_cp import hybrid_cp_micro_batches

    info: HybridCpShard = data.hybrid_cp
    plan = info.plan
    mini_batch = info.mini_batch if info.mini_batch is not None else 0
    _check(info.mini_batch is not None or len(plan.assignment) == 1,
           "a hybrid-CP shard of several global batches: take one with get_batch(batch_idx) first")
    _check(cp_size == plan.cp_size, f"cp_size={cp_size}, but the step plan was made with cp_size={plan.cp_size}")
    _check(0 <= cp_rank < cp_size, f"cp_rank must be in [0, {cp_size}), got {cp_rank}")
    lens = _lengths(data.data, input_lengths_key)
    if keys is None:
        keys = [k for k, v in data.data.items() if hasattr(v, "dim") and v.dim() >= 2]
    _check(len(keys) > 0, "no [B, S, ...] tensor to pack (give keys=)")
    where = {i: p for p, i in enumerate(info.row_ids)}
    rank = info.dp_rank * cp_size + cp_rank
    batches = hybrid_cp_micro_batches({k: data.data[k] for k in keys}, lens, plan, mini_batch=mini_batch,
                                      group=group, forest=forest, row_index=where, pad_values=pad_values, rank=rank)

    def gen():
        for mb in batches:
            mb.data = data._gather([where[i] for i in mb.rows], shard_cls)
            yield mb

    return gen()
