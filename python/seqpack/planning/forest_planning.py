"""Planning over a prefix forest: ``plan_micro_batches(..., forest=)`` and
``plan_step(..., forest=)`` are each one call into the C++ core
(``cpp/include/seqpack/forest_planning.hpp``), which builds the items, splits trees,
places them, costs every micro-batch from its own physical tokens and visible
attention pairs and computes the bounds. This module checks the arguments and
wraps the result.

The cap bounds what memory sees: a micro-batch's *physical* tokens (its rows laid
out as one prefix tree). A tree that fits may still be split when that fills a
micro-batch that would otherwise stay part empty: each part carries its prefix
again, so the planner keeps the packing with the fewest micro-batches, then the
fewest physical tokens (``whole_trees=True`` keeps every tree that fits in one
micro-batch, and with ranks every tree on one rank: losses that couple a tree's
rows, as preference pairs do)::

    cap 16; trees A B C D, each a 1-token prompt and 5 responses of 2 tokens (11)
    whole trees:  [A] [B] [C] [D]                         4 micro-batches, 44 tokens
    split:        [A + B(2)] [B(3) + C(4)] [C(1) + D]     3 micro-batches, 46 tokens

An item of ``t`` physical tokens and ``p`` visible attention pairs weighs
``per_token·t + per_token_squared·(2p − t)`` in the cost model: a plain row of ``s``
tokens has ``p = s(s + 1)/2`` pairs, so ``2p − t = s²`` and the model is unchanged
for it.
"""

from __future__ import annotations

from typing import Any, Dict, List

import numpy as np

from .. import _core
from .._lengths import as_positive_int, type_name
from ._token_rows import int_array
from .prefix_forest import PrefixForest

__all__ = ["checked_forest", "first_fit_trie", "plan_forest_micro_batches"]


def checked_forest(forest: Any, lengths: Any) -> PrefixForest:
    """``forest`` when it is a :class:`~seqpack.PrefixForest` of rows of these lengths."""
    if not isinstance(forest, PrefixForest):
        raise TypeError(f"forest must be a seqpack.PrefixForest, got {type_name(forest)}")
    rows = int_array(lengths, "lengths", 1)
    if rows.shape != forest.lengths.shape or (rows != forest.lengths).any():
        raise ValueError(f"lengths must be the forest's row lengths (forest.lengths: {forest.num_rows} rows, "
                         f"{forest.num_logical_tokens} tokens); got {rows.shape[0]} lengths summing to "
                         f"{int(rows.sum())}")
    return forest


def plan_forest_micro_batches(forest: Any, lengths: Any, max_tokens: int, min_num: int, multiple_of: int,
                              attention_coeff: int, order: str, whole_trees: bool) -> Dict[str, Any]:
    """:func:`~seqpack.plan_micro_batches` with ``forest=``: the fields of its
    :class:`~seqpack.MicroBatchPlan`."""
    forest = checked_forest(forest, lengths)
    raw = _core.plan_forest_micro_batches(*forest._core_args(), max_tokens, min_num, multiple_of, attention_coeff,
                                          order == "small_at_ends", bool(whole_trees), items=forest._core_items())
    total = sum(raw["tokens"])
    return dict(micro_batches=raw["groups"], tokens=raw["tokens"], workloads=raw["workloads"],
                max_tokens=max_tokens, lower_bound=raw["lower_bound"], method=raw["method"], order=order,
                sharing_kept=1.0 if total == 0 else raw["physical_tokens"] / total,
                physical_lower_bound=raw["physical_tokens"])


def first_fit_trie(forest: Any, max_tokens: Any, row_indices: Any = None) -> List[List[int]]:
    """AReaL's trie packing (``areal/models/tree_attn/tree.py``): rows in order (all
    of them, or ``row_indices`` in the order given), each joining the first
    micro-batch where the tokens it adds (its length minus its longest common
    prefix with a row already there, under the forest's sharing rule) fit
    ``max_tokens``; a new micro-batch otherwise. Row ids ascending inside each
    micro-batch, micro-batches in the order they were opened. A baseline: it never
    splits a row's tree on purpose, nor balances.

    >>> forest = PrefixForest.from_rows([[1, 2, 3], [1, 2, 4], [5, 6], [1, 2, 7]])
    >>> first_fit_trie(forest, 5)      # [5 6] finds no room beside "1 2 3 4 7"
    [[0, 1, 3], [2]]
    """
    if not isinstance(forest, PrefixForest):
        raise TypeError(f"forest must be a seqpack.PrefixForest, got {type_name(forest)}")
    cap = as_positive_int(max_tokens, "max_tokens")
    rows = np.arange(forest.num_rows, dtype=np.int64) if row_indices is None else forest._row_ids(row_indices,
                                                                                                   "row_indices")
    return _core.first_fit_trie(*forest._core_args(), cap, rows, items=forest._core_items())
