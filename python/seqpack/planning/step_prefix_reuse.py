"""A step's mini-batches in prefix-reuse passes where they pay
(``plan_step(..., forest=, prefix_reuse=True)``, issue 52).

Each mini-batch is planned twice: as today (whole trees and their parts, one core
call: :func:`~seqpack.plan_step`) and in passes (:func:`~seqpack.planning.plan_prefix_reuse`:
whole trees to ranks, each shared prefix computed once). The cost model prices both
the same way (a cell's physical tokens and visible attention pairs; a pass's pairs
include the K/V it reads from earlier passes), and the faster prediction is kept
per mini-batch, so turning reuse on never plans a slower step::

    mini-batch 0   trees fit the cap        plan on trees    planned_on "trees"
    mini-batch 1   a 12k-token group, 8k    passes           planned_on "prefix_reuse"
    mini-batch 2   a 9k-token row, 8k cap   passes (the only plan; the other
                                            mini-batches still planned on trees)

A mini-batch in passes lists in each cell the rows with a token in that pass (a row
whose prompt a provider pass holds appears there and in its branch pass); the
rank's rows, in the order that builds the planned passes, are
``plan.prefix_reuse[m].rank_rows[r]`` (also ``StepPlan.rank_rows``).

Importing this module does not import torch.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .prefix_reuse import PrefixReusePlan, plan_prefix_reuse

__all__ = ["pass_cells", "with_prefix_reuse"]


def with_prefix_reuse(plains: List[Optional[Dict[str, Any]]], forest: Any, dp_size: int, max_tokens: int,
                      opts: Any, ranges: List[Tuple[int, int]], trees_bound: Optional[float]) -> dict:
    """The fields of the step plan that keeps, per mini-batch ``ranges[m]``, the
    faster of ``plains[m]`` (its plan on trees: cells, costs, tokens, count and
    ``planned_on``; ``None`` when a row exceeds the cap) and the passes.
    ``trees_bound``: the trees' plan's lower bound, where one plan covers the step."""
    cost = opts.cost
    fields: dict = {k: [] for k in ("assignment", "costs", "tokens", "num_micro_batches")}
    reuse: List[Optional[PrefixReusePlan]] = []
    context: List[List[List[int]]] = []
    names, predicted, bound = [], 0.0, 0.0
    for (begin, end), plain in zip(ranges, plains):
        passes = plan_prefix_reuse(forest, max_tokens, dp_size, cost, row_indices=np.arange(begin, end),
                                   min_micro_batches=opts.min_micro_batches, multiple_of=opts.multiple_of)
        cells = pass_cells(passes.pass_rows, passes.pass_tokens, passes.pass_costs, passes.num_micro_batches,
                           cost.per_micro_batch)
        mine = _step_time(cells["costs"], opts.sync)
        bound += _work_bound(forest, np.arange(begin, end), passes, cost, opts.min_micro_batches)
        if plain is not None and _step_time(plain["costs"], opts.sync) <= mine:
            for k in fields:
                fields[k].append(plain[k])
            reuse.append(None)
            context.append([[0] * len(rank) for rank in plain["tokens"]])
            names.append(plain["planned_on"])
            predicted += _step_time(plain["costs"], opts.sync)
            continue
        for k in fields:
            fields[k].append(cells[k])
        reuse.append(passes)
        context.append([c + [0] * (passes.num_micro_batches - len(c)) for c in passes.context_pairs])
        names.append("prefix_reuse")
        predicted += mine
    used = sum(t for mb in fields["tokens"] for rank in mb for t in rank)
    fields.update(
        predicted_time=predicted, lower_bound=bound if trees_bound is None else min(bound, trees_bound),
        planned_on=names[0] if len(set(names)) == 1 else ",".join(names),
        sharing_kept=1.0 if used == 0 else forest.num_physical_tokens / used, prefix_reuse=tuple(reuse),
        context_pairs=context, mini_batch_ranges=list(ranges))
    return fields


def pass_cells(rows: List[List[List[int]]], tokens: List[List[int]], costs: List[List[float]], count: int,
               per_micro_batch: float) -> dict:
    """Cells of passes (each rank's, in run order) padded with empty ones to ``count``
    (a dummy: no rows, no tokens, ``per_micro_batch``)."""
    return dict(assignment=[r + [[] for _ in range(count - len(r))] for r in rows],
                costs=[c + [per_micro_batch] * (count - len(c)) for c in costs],
                tokens=[t + [0] * (count - len(t)) for t in tokens], num_micro_batches=count)


def _step_time(costs: List[List[float]], sync: str) -> float:
    """A mini-batch's time: ``Σ_k max_r`` (``"micro_batch"``) or ``max_r Σ_k`` (``"step"``)."""
    if not costs or not costs[0]:
        return 0.0
    c = np.asarray(costs, dtype=np.float64)
    return float(c.max(axis=0).sum() if sync == "micro_batch" else c.sum(axis=1).max())


def _work_bound(forest: Any, rows: np.ndarray, plan: PrefixReusePlan, cost: Any, least: int) -> float:
    """A proven lower bound on any plan of ``rows``, passes or cells: the forest's
    work (each physical token once, its visible pairs) spread evenly over the ranks,
    plus the fewest micro-batches' fixed cost (``Σ_k max_r >= max_r Σ_k >= mean_r Σ_k``)."""
    tokens, pairs = forest.physical_tokens(rows), forest.visible_pairs(rows)
    work = cost.per_token * tokens + cost.per_token_squared * (2 * pairs - tokens)
    return work / plan.dp_size + cost.per_micro_batch * max(least, plan.bound)
