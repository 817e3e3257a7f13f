"""``shard_by_batch_size(shards, step_plan=plan)``: the shards of a
:func:`seqpack.plan_step` plan, each keeping what the plan decided.

Shard ``s`` takes DP rank ``s``'s rows and micro-batches as planned, per mini-batch
(one global batch each), with the plan's token cap and static shapes, and the plan
itself (:class:`~.shard.StepShard`: its CP size and forest)::

    plan_step(..., forest=F)       each micro-batch's prefix tree, built here from the rows'
                                   ``input_ids`` (rows share only within F's trees) and
                                   checked against the plan's physical tokens
    plan_step(..., forest=F,       a mini-batch in passes: the rank's tree of that batch split under the
      prefix_reuse=True)           cap (micro_batch_passes), its micro-batches the passes in run order,
                                   each reading the batch's rows (micro_batch_indices [0, n])
    plan_step(..., cp_size=C)      the rows of all C CP ranks of the replica; each CP rank
                                   builds its own micro-batches (``make_packed_microbatch_iterator``)

An empty micro-batch of a rank (a dummy) is iterated as a one-row, one-token
micro-batch with zero loss masks.

    >>> import seqpack
    >>> from seqpack.frameworks.nemo_rl.step_shards import step_plan_shards
    >>> plan = seqpack.plan_step([5, 3, 4, 2], dp_size=2, max_tokens=8)
    >>> shards, order = step_plan_shards({"input_lengths": [5, 3, 4, 2]}, 2, None, plan)
    >>> [s.data["input_lengths"] for s in shards], [s.micro_batch_lengths for s in shards]
    ([[5, 2], [3, 4]], [[[7]], [[7]]])

Importing this module does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Mapping, Optional, Tuple

import numpy as np

from .errors import check
from .rows import gather, lengths, row_count
from .shard import ShardRecord, StepShard
from .trees import bin_trees

if TYPE_CHECKING:  # pragma: no cover
    from ...planning.step import StepPlan

__all__ = ["FOREST_RULE", "step_plan_shards"]

# The trees of a forest plan's shards: the rows' tokens, sharing only within the
# forest's trees (the forest's labels, kept with the plan).
FOREST_RULE = {"input_key": "input_ids", "input_lengths_key": "input_lengths", "group_key": None,
               "min_shared_tokens": 1, "pad_to_multiple_of": 1}


def step_plan_shards(data: Mapping[str, Any], shards: int, batch_size: Optional[int], plan: "StepPlan",
                     pad_multiple: int = 1) -> Tuple[List[ShardRecord], List[int]]:
    """The shards of ``data`` (the plan's rows, in its sequence order) under ``plan``
    and the rows each holds, concatenated (``sorted_indices``); a forest plan's trees
    padded to ``pad_multiple`` (its passes' model inputs too, when they run)."""
    from ...planning.step import StepPlan

    check(isinstance(plan, StepPlan), f"step_plan must be a seqpack.StepPlan, got {type(plan).__name__}")
    check(plan.dp_size == shards, f"step_plan was planned for dp_size={plan.dp_size}, not shards={shards}")
    total = row_count(data)
    check(plan.num_sequences == total, f"step_plan covers {plan.num_sequences} rows, the data has {total}")
    if batch_size is not None:
        expected = [(c, c + batch_size) for c in range(0, total, batch_size)]
        check(plan.mini_batch_ranges == expected,
              f"step_plan's mini-batches {plan.mini_batch_ranges} are not the global batches of "
              f"batch_size={batch_size}")
    if plan.cp_size > 1:
        return _cp_shards(data, shards, plan)
    keys = sorted(data)
    out, order = [], []
    for s in range(shards):
        rows = plan.rank_rows(s)
        shard = ShardRecord(gather(data, rows, keys), micro_batch_indices=[], micro_batch_lengths=[],
                            elem_counts_per_gb=[], micro_batch_token_cap=int(plan.max_tokens),
                            step_shard=StepShard(plan, s, tuple(rows)))
        for m, mini_batch in enumerate(plan.assignment):
            bounds, start = [], 0  # row ranges within the global batch, as sequence packing's
            if _in_passes(plan, m):  # every pass reads the rank's rows of the batch (its tree); [n, n]: a dummy
                start = len(plan.rank_rows(s, m))
                bounds = [[0 if cell else start, start] for cell in mini_batch[s]]
            for cell in ([] if _in_passes(plan, m) else mini_batch[s]):
                bounds.append([start, start + len(cell)])
                start += len(cell)
            shard.micro_batch_indices.append(bounds)
            shard.micro_batch_lengths.append(list(plan.tokens[m][s]))
            shard.elem_counts_per_gb.append(start)
        if plan.padded_tokens is not None:  # static_shapes: the packed iterator pads to these
            shard.micro_batch_static_lengths = [list(mb[s]) for mb in plan.padded_tokens]
        out.append(shard)
        order.extend(rows)
    if plan.forest is not None:
        _add_trees(data, plan, out, pad_multiple)
    return out, order


def _add_trees(data: Mapping[str, Any], plan: "StepPlan", shards: List[ShardRecord], pad_multiple: int) -> None:
    """Each micro-batch's prefix tree (its rows sharing only within the forest's
    trees, host plans built; padded to ``pad_multiple``, a batch in passes not: its
    passes are), checked against the plan: the rows must be those the forest was
    made of."""
    key, lengths_key = FOREST_RULE["input_key"], FOREST_RULE["input_lengths_key"]
    check(key in data and lengths_key in data,
          f"step_plan was made on a PrefixForest: its micro-batches are prefix trees of the rows' tokens, so the "
          f"data needs {key!r} ([batch, seq] token ids) and {lengths_key!r} (got keys {sorted(data)})")
    lens = lengths(data, lengths_key)
    differ = np.flatnonzero(lens != plan.forest.lengths)
    check(differ.size == 0, f"step_plan's forest has rows of other lengths than data[{lengths_key!r}] (row "
                            f"{int(differ[0]) if differ.size else 0}): shard the rows the plan was made on")
    # A batch in passes: one tree of the rank's rows of it (split below); else a tree per cell.
    cells = [cell for s in range(len(shards)) for m, mb in enumerate(plan.assignment)
             for cell in ([plan.rank_rows(s, m)] if _in_passes(plan, m) else mb[s])]
    # static_shapes: each tree padded to its cell's bucket (the plan priced the padding)
    pad_to = None if plan.padded_tokens is None else \
        [size for s in range(len(shards)) for mb in plan.padded_tokens for size in mb[s]]
    if pad_to is None and pad_multiple > 1:
        pad_to = [1 if _in_passes(plan, m) else pad_multiple for s in range(len(shards))
                  for m, mb in enumerate(plan.assignment) for _ in ([None] if _in_passes(plan, m) else mb[s])]
    built = iter(bin_trees(data, lens, cells, key, plan.forest.tree_ids.tolist(), pad_to))
    for s, shard in enumerate(shards):
        shard.micro_batch_trees = [_passes(plan, m, s, next(built), shard) if _in_passes(plan, m) else
                                   [next(built) for _ in mb[s]] for m, mb in enumerate(plan.assignment)]
        shard.micro_batch_tree_options = dict(FOREST_RULE, pad_to_multiple_of=pad_multiple)
        for m, trees in enumerate(shard.micro_batch_trees):
            for k, tree in enumerate([] if _in_passes(plan, m) else trees):  # passes: checked when split
                planned = plan.tokens[m][s][k]
                real = 0 if tree is None else tree.num_tokens - tree.num_pad_tokens
                check(tree is None or real == planned,
                      f"step_plan's micro-batch (mini-batch {m}, rank {s}, {k}) holds {planned} physical tokens, "
                      f"but its rows' {key!r} make a tree of {real}: the data's tokens "
                      "are not those the plan's forest was made of")


def _in_passes(plan: "StepPlan", m: int) -> bool:
    return plan.prefix_reuse is not None and plan.prefix_reuse[m] is not None


def _passes(plan: "StepPlan", m: int, s: int, tree: Any, shard: ShardRecord) -> List[Any]:
    """Rank ``s``'s passes of batch ``m`` (its tree split under the cap), checked
    against the plan, kept on the shard; its micro-batches' layouts in run order,
    ``None`` for the dummies after them."""
    from ...tensors.prefix_passes import split_prefix_tree

    planned = plan.prefix_reuse[m]
    if shard.micro_batch_passes is None:
        shard.micro_batch_passes = [None] * len(plan.assignment)
    if tree is None:  # a rank with no rows in this batch: dummies only
        return [None] * plan.num_micro_batches[m]
    passes = split_prefix_tree(tree, plan.max_tokens)
    why = passes.differs_from(planned.pass_order[s], planned.pass_tokens[s])
    check(why is None, f"step_plan's mini-batch {m}, rank {s}: its rows' {FOREST_RULE['input_key']!r}: {why}; the "
                       "data's tokens are not those the plan's forest was made of")
    shard.micro_batch_passes[m] = passes
    ran = [passes.passes[i] for _, i in passes.order]
    return ran + [None] * (plan.num_micro_batches[m] - len(ran))


def _cp_rows(plan: "StepPlan", dp_rank: int) -> List[List[int]]:
    """Per mini-batch, the sequence ids of every CP rank of replica ``dp_rank``
    (ascending)."""
    C = plan.cp_size
    return [sorted({i for r in range(dp_rank * C, (dp_rank + 1) * C) for cell in mb[r] for i in cell})
            for mb in plan.assignment]


def _cp_shards(data: Mapping[str, Any], shards: int, plan: "StepPlan") -> Tuple[List[ShardRecord], List[int]]:
    """The DP shards of a CP plan: each holds the rows of all its CP ranks, in plan
    order per global batch; each CP rank builds its own micro-batches from the plan."""
    out, order = [], []
    keys = sorted(data)
    for s in range(shards):
        per_batch = _cp_rows(plan, s)
        rows = [i for b in per_batch for i in b]
        out.append(ShardRecord(gather(data, rows, keys), elem_counts_per_gb=[len(b) for b in per_batch],
                               micro_batch_token_cap=int(plan.max_tokens), step_shard=StepShard(plan, s, tuple(rows))))
        order.extend(rows)
    return out, order
