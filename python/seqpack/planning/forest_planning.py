"""Planning over a prefix forest: the planners of :mod:`~seqpack.planning.balance`
and :mod:`~seqpack.planning.step` run on the forest's *items* (whole trees, or the
parts of trees larger than the cap; :meth:`PrefixForest.items
<seqpack.PrefixForest.items>`) instead of rows, so that a GRPO group's prompt is
forwarded once per micro-batch it lands in, not once per row, and the cap bounds
what memory sees: a micro-batch's physical tokens.

An item of ``t`` physical tokens and ``p`` visible attention pairs weighs
``per_token·t + per_token_squared·(2p − t)`` in the cost model: a plain row of ``s``
tokens has ``p = s(s + 1)/2`` pairs, so ``2p − t = s²`` and the model is unchanged
for it. Reached through ``plan_micro_batches(..., forest=)`` and ``plan_step(...,
forest=)``.
"""

from __future__ import annotations

from typing import Any, List, Tuple

import numpy as np

from .. import _core
from .._lengths import INT64_MAX, type_name
from ._token_rows import int_array
from .prefix_forest import PrefixForest

__all__ = ["plan_forest_micro_batches", "plan_forest_step"]


def _checked_forest(forest: Any, lengths: Any) -> PrefixForest:
    if not isinstance(forest, PrefixForest):
        raise TypeError(f"forest must be a seqpack.PrefixForest, got {type_name(forest)}")
    rows = int_array(lengths, "lengths", 1)
    if rows.shape != forest.lengths.shape or (rows != forest.lengths).any():
        raise ValueError(f"lengths must be the forest's row lengths (forest.lengths: {forest.num_rows} rows, "
                         f"{forest.num_logical_tokens} tokens); got {rows.shape[0]} lengths summing to "
                         f"{int(rows.sum())}")
    return forest


def _item_workloads(tokens: np.ndarray, pairs: np.ndarray, attention_coeff: int) -> np.ndarray:
    """Physical tokens, or ``attention_coeff * tokens + (2 * pairs - tokens)``: the
    ``attention_coeff * s + s**2`` of a plain row of s tokens (its pairs are
    s (s + 1) / 2), with a tree's visible pairs in place of the row's."""
    if attention_coeff <= 0:
        return tokens.astype(np.int64)
    worst = attention_coeff * int(tokens.max(initial=0)) + 2 * int(pairs.max(initial=0))
    if worst > INT64_MAX:
        raise ValueError(f"a micro-batch workload (attention_coeff * tokens + 2 * pairs - tokens) overflows int64 "
                         f"(attention_coeff = {attention_coeff})")
    return attention_coeff * tokens + 2 * pairs - tokens


def plan_forest_micro_batches(forest: Any, lengths: Any, max_tokens: int, min_num: int, multiple_of: int,
                              attention_coeff: int, order: str):
    """:func:`~seqpack.plan_micro_batches` with ``forest=``: the forest's items (whole
    trees, split ones) planned by the C++ planner with their own workloads, then
    mapped back to rows and costed exactly (a micro-batch's physical tokens).
    Returns the fields of the :class:`~seqpack.MicroBatchPlan`."""
    forest = _checked_forest(forest, lengths)
    items = forest.items(max_tokens)
    while True:
        # The count the planner starts from (min_num, the tokens over the cap, rounded to
        # multiple_of) needs as many items: halve the largest ones until there are.
        need = -(-max(min_num, -(-int(items.tokens.sum()) // max_tokens)) // multiple_of) * multiple_of
        if items.num_items < need and items.num_items < forest.num_rows:
            items = forest.items(max_tokens, min_items=need)
            continue
        try:
            raw = _core.plan_micro_batches(items.tokens, max_tokens, min_num, multiple_of, attention_coeff,
                                           order == "small_at_ends",
                                           workloads=_item_workloads(items.tokens, items.pairs, attention_coeff))
            break
        except ValueError:  # no count fits these items (first-fit's bins past the last multiple): one more item
            if items.num_items >= forest.num_rows:
                raise
            items = forest.items(max_tokens, min_items=items.num_items + 1)
    micro = [sorted(np.concatenate([items.rows[k] for k in group]).tolist()) for group in raw["groups"]]
    tokens, pairs = forest.subset_costs(micro)
    total = int(tokens.sum())
    return dict(micro_batches=micro, tokens=tokens.tolist(),
                workloads=_item_workloads(tokens, pairs, attention_coeff).tolist(), max_tokens=max_tokens,
                lower_bound=raw["lower_bound"], method=raw["method"], order=order,
                sharing_kept=1.0 if total == 0 else forest.num_physical_tokens / total)


def _squares(tokens: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    """The s² stand-ins of items: 2·pairs − tokens (<= tokens²)."""
    return 2 * pairs - tokens


def plan_forest_step(forest: Any, lengths: Any, dp_size: int, max_tokens: int, cost: Any, sync: str,
                     mini_batches: int, min_micro_batches: int, multiple_of: int, seed: Any):
    """:func:`~seqpack.plan_step` with ``forest=``. Each mini-batch (the rows split
    as without a forest) is planned on its own items by the C++ step planner (each
    item's s² stand-in given); cells are mapped back to rows and costed exactly:
    ``tokens`` are physical tokens and ``costs`` / ``predicted_time`` come from the
    micro-batches' own physical tokens and visible pairs. The plain plan of the same
    rows, costed the same way, is kept instead when it predicts a faster step.
    ``lower_bound``: for each mini-batch, its fewest micro-batches times
    ``per_micro_batch`` plus its trees' work (each tree's nodes costed once) over
    the ranks; any plan of these rows, split however, costs at least that.
    Returns the fields of the :class:`~seqpack.StepPlan`, each mini-batch's cells,
    costs and tokens flat (rank-major)."""
    forest = _checked_forest(forest, lengths)
    n = forest.num_rows
    if n < mini_batches:
        raise ValueError(f"[seqpack.plan_step] lengths: {n} sequences cannot fill mini_batches={mini_batches} "
                         "mini-batches (each needs at least one)")
    bounds = np.cumsum([0] + [n // mini_batches + (m < n % mini_batches) for m in range(mini_batches)])
    ranges = [(int(bounds[m]), int(bounds[m + 1])) for m in range(mini_batches)]
    items = [forest.items(max_tokens, row_indices=np.arange(b, e)) for b, e in ranges]
    item_rows = [r for it in items for r in it.rows]
    tokens = np.concatenate([it.tokens for it in items]).astype(np.int64)
    pairs = np.concatenate([it.pairs for it in items]).astype(np.int64)
    raw = _core.plan_step(tokens, dp_size, max_tokens, cost.per_micro_batch, cost.per_token, cost.per_token_squared,
                          sync=sync, mini_batches=mini_batches, min_micro_batches=min_micro_batches,
                          multiple_of=multiple_of, seed=seed, squares=_squares(tokens, pairs),
                          mini_batch_sizes=np.asarray([it.num_items for it in items], dtype=np.int64))
    tree_cells = [[sorted(int(r) for k in cell for r in item_rows[k]) for cell in mb["cells"]]
                  for mb in raw["mini_batches"]]
    plain = _core.plan_step(forest.lengths, dp_size, max_tokens, cost.per_micro_batch, cost.per_token,
                            cost.per_token_squared, sync=sync, mini_batches=mini_batches,
                            min_micro_batches=min_micro_batches, multiple_of=multiple_of, seed=seed)
    plain_cells = [[list(cell) for cell in mb["cells"]] for mb in plain["mini_batches"]]
    candidates = []
    for name, cells, mbs in (("trees", tree_cells, raw["mini_batches"]), ("rows", plain_cells, plain["mini_batches"])):
        exact = [_exact(forest, c, cost) for c in cells]
        ks = [mb["num_micro_batches"] for mb in mbs]
        time = sum(_step_time(costs, dp_size, k, sync) for (_, costs), k in zip(exact, ks))
        candidates.append((time, name, cells, exact, ks))
    time, name, cells, exact, ks = min(candidates, key=lambda c: c[0])  # the tree plan on ties
    used = sum(sum(t) for t, _ in exact)
    lower = sum(_mini_batch_bound(forest, b, e, dp_size, max_tokens, cost, min_micro_batches, multiple_of)
                for b, e in ranges)
    return dict(
        cells=cells, costs=[c for _, c in exact], tokens=[t for t, _ in exact], num_micro_batches=ks,
        mini_batch_ranges=ranges, predicted_time=time,
        lower_bound=min(lower, time),  # min: float rounding only (the bound is proven)
        planned_on=name, sharing_kept=1.0 if used == 0 else forest.num_physical_tokens / used,
    )


def _step_time(costs: List[float], dp_size: int, k: int, sync: str) -> float:
    """The step time of cells laid out rank-major (r·K + k), as the C++ planner's."""
    grid = np.asarray(costs, dtype=np.float64).reshape(dp_size, k)
    return float(grid.max(axis=0).sum() if sync == "micro_batch" else grid.sum(axis=1).max())


def _exact(forest: PrefixForest, cells: List[List[int]], cost: Any) -> Tuple[List[int], List[float]]:
    """Each cell's physical tokens and its cost from its own tokens and pairs (a
    dummy, no rows, costs per_micro_batch)."""
    tokens, pairs = forest.subset_costs(cells)
    squares = _squares(tokens, pairs).astype(np.float64)
    costs = cost.per_micro_batch + cost.per_token * tokens.astype(np.float64) + cost.per_token_squared * squares
    return tokens.tolist(), costs.tolist()


def _mini_batch_bound(forest: PrefixForest, begin: int, end: int, dp_size: int, max_tokens: int, cost: Any,
                      min_micro_batches: int, multiple_of: int) -> float:
    """Fewest micro-batches per rank · per_micro_batch + the trees' work / ranks, for
    rows [begin, end): every node of a tree is in at least one micro-batch, and
    splitting a tree only repeats nodes."""
    rows = np.arange(begin, end, dtype=np.int64)
    by_tree = rows[np.argsort(forest.tree_ids[rows], kind="stable")]  # each tree's rows together
    starts = np.flatnonzero(np.diff(forest.tree_ids[by_tree], prepend=-1))
    offsets = np.append(starts, by_tree.shape[0]).astype(np.int64)
    tokens, pairs = _core.forest_subset_costs(*forest._core_args(), by_tree, offsets)  # one C++ call, no lists
    work = cost.per_token * float(tokens.sum()) + cost.per_token_squared * float(_squares(tokens, pairs).sum())
    cells = max(1, -(-int(tokens.sum()) // max_tokens))
    k_min = max(min_micro_batches, -(-cells // dp_size))
    k_min = -(-k_min // multiple_of) * multiple_of
    return k_min * cost.per_micro_batch + work / dp_size
