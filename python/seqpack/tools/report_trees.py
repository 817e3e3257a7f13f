"""A GRPO batch packed plainly and as prefix trees, planned by
:func:`~seqpack.plan_step` both ways (CLI and notebooks): the tokens and attention
pairs each layout computes, the micro-batches under one cap, the step time one
cost model predicts, and how much of the sharing survives a cap (sharing kept =
the batch's physical tokens / the sum over micro-batches).

    plain   every row alone:          P R0 | P R1 | ... | P R7      (the prompt P 8 times)
    trees   each group as its trie:   P R0 R1 ... R7                 (P once)

Example:
    >>> rep = tree_report(*grpo_rows(prompts=16, group=4, seed=0), capacity=8192, dp_size=2)
    >>> rep.tables[0].title
    'A GRPO batch as prefix trees: plan_step plain vs with a PrefixForest'
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..planning.cost import CostModel
from ..planning.prefix_forest import PrefixForest
from ..planning.step import plan_step
from ._table import Pct, Table, Tables, time_header

CAP_MULTIPLES = (1, 2, 4, 8, 16)  # caps of the sharing curve, in mean trees


def grpo_rows(prompts: int = 64, group: int = 8, seed: int = 0, max_len: int = 8192,
              vocab: int = 32000) -> Tuple[List[np.ndarray], List[int]]:
    """Synthetic GRPO rollouts: ``prompts`` prompts (256-2048 tokens, at most half of
    ``max_len``) with ``group`` responses each (lognormal, median ~600 tokens, each
    row clipped to ``max_len``); random token ids. Returns the rows and each row's
    prompt (its group)."""
    if max_len < 2:
        raise ValueError(f"max_len must be at least 2 (a prompt token and a response token), got {max_len}")
    rng = np.random.default_rng(seed)
    rows, groups = [], []
    for p in range(prompts):
        prompt = rng.integers(0, vocab, min(int(rng.integers(256, 2049)), max_len // 2))
        for _ in range(group):
            n = int(np.clip(np.rint(rng.lognormal(math.log(600), 1.0)), 1, max_len - prompt.shape[0]))
            rows.append(np.concatenate([prompt, rng.integers(0, vocab, n)]))
            groups.append(p)
    return rows, groups


@dataclass(eq=False)
class TreeReport(Tables):
    """Tables of one :func:`tree_report` run, and the sharing curve behind its figure."""

    caps: List[int] = field(default_factory=list)
    sharing_kept: List[float] = field(default_factory=list)
    micro_batches: Dict[str, List[int]] = field(default_factory=dict)

    def plot(self, path: Optional[str] = None):
        """Sharing kept and micro-batches per rank against the cap (needs matplotlib)."""
        from .plot import plot_sharing

        return plot_sharing(self, path)


def tree_report(rows: Sequence[np.ndarray], groups: Sequence[int], capacity: int = 8192, dp_size: int = 8,
                cost: Optional[CostModel] = None) -> TreeReport:
    """Plan ``rows`` (their ``groups``: one prompt each) with :func:`plan_step` plainly
    and with a :class:`~seqpack.PrefixForest`, under ``capacity`` tokens per
    micro-batch on ``dp_size`` ranks; the step time under ``cost`` (default
    :meth:`CostModel.default() <seqpack.CostModel.default>`, seconds; a tree's
    attention is priced by its visible pairs)."""
    cost = CostModel.default() if cost is None else cost
    forest = PrefixForest.from_rows(rows, group_ids=list(groups))
    lengths = forest.lengths
    plain = plan_step(lengths, dp_size, capacity, cost=cost)
    trees = plan_step(lengths, dp_size, capacity, cost=cost, forest=forest)
    everything = range(forest.num_rows)
    logical, physical = forest.num_logical_tokens, forest.num_physical_tokens
    plain_pairs = int(sum(int(n) * (int(n) + 1) // 2 for n in lengths))
    tree_pairs = forest.visible_pairs(everything)
    rep = TreeReport()
    rows_out = [
        ["tokens computed", logical, physical, logical / physical],
        ["attention pairs", plain_pairs, tree_pairs, plain_pairs / tree_pairs],
        ["micro-batches per rank", plain.num_micro_batches[0], trees.num_micro_batches[0],
         plain.num_micro_batches[0] / trees.num_micro_batches[0]],
        [time_header("predicted step", cost), plain.predicted_time, trees.predicted_time,
         plain.predicted_time / trees.predicted_time],
    ]
    rep.tables.append(Table(
        "A GRPO batch as prefix trees: plan_step plain vs with a PrefixForest", ["", "plain", "trees", "plain / trees"],
        rows_out,
        note=f"{forest.num_rows:,} rows, {forest.num_trees:,} prompts, {dp_size} DP ranks, cap {capacity:,} tokens per "
             f"micro-batch (physical tokens for trees), planned on {trees.planned_on}, sharing kept "
             f"{trees.sharing_kept:.3f}. Cost {cost.per_micro_batch:g} + {cost.per_token:g} n + "
             f"{cost.per_token_squared:g} n^2 per micro-batch, the n terms summed over its sequences of n tokens (n^2: twice "
             "the visible pairs minus the tokens for a tree), ranks in step after each micro-batch."))

    mean_tree = physical / max(forest.num_trees, 1)
    rep.micro_batches = {"plain": [], "trees": []}
    curve = []
    longest = int(lengths.max(initial=1))
    for k in CAP_MULTIPLES:
        cap = max(int(round(k * mean_tree)), longest)
        p = plan_step(lengths, dp_size, cap, cost=cost)
        t = plan_step(lengths, dp_size, cap, cost=cost, forest=forest)
        rep.caps.append(cap)
        rep.sharing_kept.append(float(t.sharing_kept))
        rep.micro_batches["plain"].append(p.num_micro_batches[0])
        rep.micro_batches["trees"].append(t.num_micro_batches[0])
        curve.append([f"{k}x ({cap:,})", Pct(t.sharing_kept), p.num_micro_batches[0], t.num_micro_batches[0],
                      p.predicted_time / t.predicted_time])
    rep.tables.append(Table(
        "Sharing kept vs the cap (caps in mean trees)",
        ["cap", "sharing kept", "plain mbs/rank", "tree mbs/rank", "predicted plain / trees"], curve,
        note=f"Mean tree: {mean_tree:,.0f} physical tokens; a cap below a tree splits it, each part carrying its "
             "prefix (the split repeating the fewest tokens). Caps never go below the longest row."))
    return rep
