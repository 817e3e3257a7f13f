"""Context parallelism over a prefix forest: ``plan_step(..., forest=, cp_size=C)``.

Each mini-batch's rows of one tree form one item, planned whole at a CP degree ``d``
(a power of two dividing ``C``) on an aligned block of ``d`` ranks, as a plain row is
(:mod:`seqpack.planning.step`, ``cpp/include/seqpack/cp_step.hpp``). A sharded tree
is cut as :func:`seqpack.shard_layout` cuts a tree: contiguous ranges of its physical
tokens in depth-first order, balanced by attention work, so a rank's tokens of it
are the longest of its ``d`` ranges, not ``T / d``::

    tree of 2 rows:  p p p p a a a  /  p p p p b b b     physical 0..9
    keys seen        1 2 3 4 5 6 7     .       5 6 7
    d = 2: ranges [0, 6) and [6, 10)  -> a rank holds up to 6 tokens (cap check)

Every item's tokens, attention work (``2 pairs - tokens``: ``s²`` for a row) and
longest range at each degree come from the forest alone (a row adds the tokens past
its common prefix with the row before it, depth-first), then one C++ call places
them. The plan lists every row of a tree in the cells of its block; ``cp_degree``
and ``cp_first_rank`` are per row (its tree's).

    >>> import seqpack
    >>> forest = seqpack.PrefixForest.from_rows([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [7, 8, 9]])
    >>> cost = seqpack.CostModel(per_token=1.0, per_kv_token=1.0)
    >>> plan = seqpack.plan_step(forest.lengths, 1, 4, forest=forest, cp_size=2, hybrid_cp=True, cost=cost)
    >>> plan.cp_degree.tolist(), plan.assignment   # the tree of 6 physical tokens is cut in two
    ([2, 2, 1], [[[[0, 1], [2]], [[0, 1], []]]])
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import numpy as np

from .. import _core
from .forest_planning import checked_forest
from .prefix_forest import PrefixForest

__all__ = ["bounds_of_work", "forest_cp_items", "forest_row_order", "plan_forest_cp_step"]


def forest_row_order(forest: PrefixForest, rows: Any) -> np.ndarray:
    """``rows`` (row ids) in the forest's depth-first order: packed in this order,
    :func:`~seqpack.pack_prefix_tree` lays out the physical tokens as the planner
    counted them (the order decides where :func:`seqpack.shard_layout` cuts the tree)."""
    rows = np.asarray(rows, dtype=np.int64)
    return rows[np.argsort(forest.row_position[rows], kind="stable")]


def bounds_of_work(work: np.ndarray, cp: int) -> np.ndarray:
    """The ``bounds`` of a tree's cut (:func:`seqpack.shard_layout`,
    :func:`~seqpack.tensors.prefix_tree_cp.tree_cp_bounds`) of tokens whose works
    are ``work`` (int64 ``[T]``, the keys each token's query sees): ``cp + 1`` offsets, a token on the
    rank whose equal share of the total holds the middle of its own work."""
    cum = np.cumsum(work)
    total = int(cum[-1]) if cum.shape[0] else 0
    # The token's middle, cum - work / 2, against r * total / cp, in integers: x2 and x cp.
    middle = cp * (2 * cum - work)
    cuts = np.searchsorted(middle, 2 * total * np.arange(1, cp, dtype=np.int64), side="right")
    return np.concatenate([[0], cuts, [work.shape[0]]]).astype(np.int64)


def _depths(forest: PrefixForest, rows: np.ndarray) -> np.ndarray:
    """Position ids of the prefix tree of ``rows`` (one tree's rows), in its
    depth-first layout: each row in depth-first order adds the depths from its common prefix with the previous one (the least
    adjacent lcp between them) to its length."""
    pos = np.sort(forest.row_position[rows])
    lengths = forest.lengths[forest.row_order[pos]]
    lcp = np.zeros(pos.shape[0], dtype=np.int64)
    if pos.shape[0] > 1:  # the least adjacent_lcp over (pos[i - 1], pos[i]]
        lcp[1:] = np.minimum.reduceat(forest.adjacent_lcp[: pos[-1] + 1], pos[:-1] + 1)
    counts = lengths - lcp
    starts = np.repeat(lcp - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
    return starts + np.arange(int(counts.sum()), dtype=np.int64)


def forest_cp_items(forest: PrefixForest, ranges: List[Tuple[int, int]], cp_size: int
                    ) -> Tuple[List[np.ndarray], np.ndarray, np.ndarray, np.ndarray, List[int]]:
    """The items of ``plan_step(forest=, cp_size=)``: per mini-batch row range, the
    rows of each tree there (ascending), and per item its physical tokens, its work
    in ``s²`` units (``2 pairs - tokens``) and its longest range of
    the ``bounds`` of :func:`seqpack.shard_layout` at each degree ``1, 2, 4 .. cp_size``
    (``[items, log2(cp_size) + 1]``); and the items per mini-batch."""
    degrees = [1 << j for j in range(int(cp_size).bit_length())]
    items: List[np.ndarray] = []
    tokens, squares, local, sizes = [], [], [], []
    for begin, end in ranges:
        rows = np.arange(begin, end, dtype=np.int64)
        trees = forest.tree_ids[begin:end]
        order = np.argsort(trees, kind="stable")
        cuts = np.flatnonzero(np.diff(trees[order])) + 1
        groups = np.split(rows[order], cuts)
        groups.sort(key=lambda g: int(g[0]))
        for g in groups:
            depth = _depths(forest, g)
            work = depth + 1
            items.append(g)
            tokens.append(depth.shape[0])
            squares.append(2 * int(work.sum()) - depth.shape[0])
            local.append([int(np.diff(bounds_of_work(work, d)).max(initial=0)) for d in degrees])
        sizes.append(len(groups))
    return (items, np.asarray(tokens, dtype=np.int64), np.asarray(squares, dtype=np.int64),
            np.asarray(local, dtype=np.int64).reshape(-1, len(degrees)), sizes)


def plan_forest_cp_step(forest: Any, lengths: Any, dp_size: int, max_tokens: int, cost: Any, sync: str,
                        mini_batches: int, min_micro_batches: int, multiple_of: int, seed: Any, cp_size: int,
                        hybrid: bool, ranges: List[Tuple[int, int]], min_degree: int = 1) -> Dict[str, Any]:
    """:func:`~seqpack.plan_step` with ``forest=`` and ``cp_size > 1`` over the
    mini-batch row ``ranges``: the core's plan of the trees, its cells, degrees and
    blocks given back per row."""
    forest = checked_forest(forest, lengths)
    items, tokens, squares, local, sizes = forest_cp_items(forest, ranges, cp_size)
    raw = _core.plan_cp_items(tokens, squares, local.reshape(-1), "trees", np.asarray(sizes, dtype=np.int64),
                              dp_size, max_tokens, cost.per_micro_batch, cost.per_token, cost.per_token_squared,
                              cost.per_kv_token, cost.per_collective, sync, min_micro_batches, multiple_of, seed,
                              cp_size, hybrid, min_degree)
    degree = np.empty(forest.num_rows, dtype=np.int64)
    first = np.empty(forest.num_rows, dtype=np.int64)
    for rows, d, f in zip(items, raw["degree"], raw["first_rank"]):
        degree[rows], first[rows] = d, f
    for (begin, end), mb in zip(ranges, raw["mini_batches"]):
        mb["cells"] = [sorted(int(r) for i in cell for r in items[i]) for cell in mb["cells"]]
        mb["begin"], mb["end"] = begin, end
    raw["degree"], raw["first_rank"] = degree, first
    return raw
