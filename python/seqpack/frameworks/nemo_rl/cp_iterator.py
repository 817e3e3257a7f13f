"""A CP rank's micro-batches of a global batch of a :func:`seqpack.plan_step` plan
with ``cp_size > 1`` (fixed or hybrid CP): the rank's whole rows and its parts of
the sharded ones, each a :class:`~seqpack.HybridCpBatch` with its rows as ``.data``::

    data.shard_by_batch_size(D, step_plan=plan)[dp_rank]       rows of ranks dp_rank*C .. +C-1
        .get_batch(m)                                           global batch m
        .make_packed_microbatch_iterator(cp_rank=c)             HybridCpBatch, .data its rows

The CP size and the forest (the parts are prefix trees when the plan was made on
one) are the plan's.

Importing this module does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional, Sequence

from .errors import check
from .rows import gather, lengths, tensor_keys
from .shard import ShardRecord

if TYPE_CHECKING:  # pragma: no cover
    from ...tensors.hybrid_cp import HybridCpBatch

__all__ = ["cp_micro_batches"]


def cp_micro_batches(shard: ShardRecord, keys: Optional[Sequence[str]], *, cp_rank: int, input_lengths_key: str,
                     pad_values: Optional[Mapping[str, Any]], group: Any, wrap: Callable[[dict], Any]
                     ) -> Iterator["HybridCpBatch"]:
    """This CP rank's micro-batches of ``shard`` (a global batch from ``get_batch``,
    or a shard of a plan of one mini-batch), each with its rows as ``.data``
    (``wrap`` of them, in ``micro_batch.rows`` order: what the loss wrapper takes)."""
    from ...tensors.hybrid_cp import hybrid_cp_micro_batches

    info = shard.step_shard
    plan, cp_size = info.plan, info.plan.cp_size
    check(info.mini_batch is not None or len(plan.assignment) == 1,
          "a shard of a CP step plan of several global batches: take one with get_batch(batch_idx) first")
    check(type(cp_rank) is int and 0 <= cp_rank < cp_size,
          f"cp_rank must be an int in [0, {cp_size}) (the step plan's cp_size), got {cp_rank!r}")
    lens = lengths(shard.data, input_lengths_key)
    keys = tensor_keys(shard.data) if keys is None else list(keys)
    check(len(keys) > 0, "no [B, S, ...] tensor to pack (give keys=)")
    where = {i: p for p, i in enumerate(info.row_ids)}
    batches = hybrid_cp_micro_batches({k: shard.data[k] for k in keys}, lens, plan,
                                      mini_batch=info.mini_batch if info.mini_batch is not None else 0,
                                      group=group, forest=plan.forest, row_index=where, pad_values=pad_values,
                                      rank=info.dp_rank * cp_size + cp_rank)

    def gen():
        for mb in batches:
            mb.data = wrap(gather(shard.data, [where[i] for i in mb.rows]))
            yield mb

    return gen()
