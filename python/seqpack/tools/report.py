"""Plan a whole batch the ways the frameworks would, and compare (CLI and notebooks).

:func:`analyze` runs, on one batch of lengths: data-parallel balancing
(contiguous split vs Karmarkar-Karp vs LPT), bin packing per rank with every
algorithm, dynamic batching with each rule, the hard-cap micro-batch planner
against the soft-cap rule that ROLL uses (and verl before verl#7553), and the whole
step planned by :func:`~seqpack.plan_step` against NeMo-RL's and verl's pipelines
(:mod:`~seqpack.tools.report_step`). :class:`Report` prints the tables and draws the
figures; :mod:`~seqpack.tools.report_trees` does the same for a GRPO batch as prefix
trees.

Example:
    >>> rep = analyze(synthetic_rl_lengths(256, seed=0), capacity=8192, dp_size=4)
    >>> rep.tables[0].title
    'Data-parallel balance (tokens per rank)'
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from .._equality import fields_equal
from ._table import Ms, Pct, Table, _plain
from ..planning.balance import get_seqlen_balanced_partitions, greedy_lpt_partition, karmarkar_karp, plan_micro_batches
from ..planning.dynamic_batching import plan_dynamic_batching
from ..planning.packing import PackingAlgorithm, get_packer
from .report_step import step_table


def synthetic_rl_lengths(n: int = 4096, seed: int = 0, max_len: int = 8192) -> np.ndarray:
    """A long-tailed RL batch: prompt (64-1024 tokens) + lognormal response.

    Responses follow a lognormal with median ~600 tokens and sigma 1.0, clipped so
    the total stays <= ``max_len`` (the generation limit): most sequences are short,
    a few hit the limit, as in GRPO rollouts on reasoning tasks.
    """
    rng = np.random.default_rng(seed)
    prompt = rng.integers(64, 1025, size=n)
    response = np.rint(rng.lognormal(mean=math.log(600), sigma=1.0, size=n)).astype(np.int64)
    return np.clip(prompt + np.maximum(response, 1), 1, max_len).astype(np.int64)


def _timed(fn: Callable[[], Any]) -> tuple:
    t0 = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t0) * 1e3


@dataclass(eq=False)
class Report:
    """Tables (and the data behind the figures) of one :func:`analyze` run."""

    lengths: np.ndarray
    capacity: int
    dp_size: int
    tables: List[Table] = field(default_factory=list)
    rank_loads: Dict[str, List[int]] = field(default_factory=dict)
    bin_loads: Dict[str, List[int]] = field(default_factory=dict)
    computed_tokens: Dict[str, int] = field(default_factory=dict)

    __eq__ = fields_equal
    __hash__ = None  # mutable

    def to_dict(self) -> Dict[str, List[Dict[str, Any]]]:
        """The tables as plain data: ``{title: [{column: value}, ...]}``."""
        return {t.title: [dict(zip(t.columns, (_plain(v) for v in row))) for row in t.rows] for t in self.tables}

    def format(self) -> str:
        n, total = len(self.lengths), int(self.lengths.sum())
        head = (
            f"seqpack plan: {n:,} sequences, {total:,} tokens (mean {total / n:,.0f}, max {int(self.lengths.max()):,}), "
            f"{self.dp_size} DP ranks, {self.capacity:,}-token micro-batches"
        )
        return "\n\n".join([head] + [t.format() for t in self.tables])

    def _repr_html_(self) -> str:
        return "".join(t._repr_html_() for t in self.tables)

    def plot(self, path: Optional[str] = None):
        """Draw length histogram, per-rank load and per-bin fill (needs matplotlib)."""
        from .plot import plot_report

        return plot_report(self, path)


def analyze(
    lengths: Sequence[int],
    capacity: int = 8192,
    dp_size: int = 8,
    sequence_length_round: int = 64,
    algorithms: Optional[Sequence[str]] = None,
) -> Report:
    """Run every planner on ``lengths`` and collect comparison tables."""
    lengths = np.asarray(lengths, dtype=np.int64)
    n = len(lengths)
    if n == 0:
        raise ValueError("lengths must not be empty")
    if n < dp_size:
        raise ValueError(f"need at least dp_size={dp_size} sequences, got {n}")
    if int(lengths.max()) > capacity:
        raise ValueError(f"the longest sequence ({int(lengths.max())}) exceeds capacity={capacity}")
    rep = Report(lengths=lengths, capacity=capacity, dp_size=dp_size)
    total = int(lengths.sum())
    max_len = int(lengths.max())
    padded_total = n * max_len
    rep.computed_tokens["padded to the longest"] = padded_total

    # 1. Data-parallel balance: which sequences each rank trains on.
    usable = n - n % dp_size
    per = usable // dp_size
    shards = {"contiguous split": [list(range(r * per, (r + 1) * per)) for r in range(dp_size)]}
    shards["karmarkar_karp (equal size)"], t_kk = _timed(
        lambda: get_seqlen_balanced_partitions(lengths[:usable], dp_size, equal_size=True)
    )
    shards["greedy_lpt (equal size)"], t_lpt = _timed(lambda: greedy_lpt_partition(lengths[:usable], dp_size, True))
    times = {"contiguous split": 0.0, "karmarkar_karp (equal size)": t_kk, "greedy_lpt (equal size)": t_lpt}
    rows = []
    for name, parts in shards.items():
        loads = [int(lengths[p].sum()) for p in parts]
        rep.rank_loads[name] = loads
        mean = sum(loads) / len(loads)
        rows.append([name, min(loads), max(loads), max(loads) - min(loads), Pct(max(loads) / mean - 1), Ms(times[name])])
    rep.tables.append(
        Table(
            "Data-parallel balance (tokens per rank)",
            ["method", "min", "max", "max-min", "max/mean-1", "ms"],
            rows,
            note=f"{usable:,} sequences over {dp_size} ranks, {per} each.",
        )
    )

    # 2. Packing per rank (on the KK-balanced shards), every algorithm.
    rank_parts = shards["karmarkar_karp (equal size)"]
    names = list(algorithms) if algorithms else [a.value for a in PackingAlgorithm]
    rows = []
    for name in names:
        packer = get_packer(name, capacity, seed=0)
        bins_total, loads_all, elapsed = 0, [], 0.0
        bound = 0
        for part in rank_parts:
            rank_lengths = lengths[part]
            offsets_indices, ms = _timed(lambda: packer.pack_arrays(rank_lengths))
            offsets, indices = offsets_indices
            elapsed += ms
            loads = np.add.reduceat(rank_lengths[indices], offsets[:-1]) if len(indices) else np.zeros(0)
            loads_all.extend(int(x) for x in loads)
            bins_total += len(offsets) - 1
            bound += math.ceil(int(rank_lengths.sum()) / capacity)
        rep.bin_loads[name] = loads_all
        util = sum(loads_all) / (bins_total * capacity)
        rows.append([name, bins_total, bound, Pct(bins_total / bound - 1), Pct(util), Pct(1 - total / padded_total), Ms(elapsed)])
    rep.computed_tokens["sequence packing"] = total
    rep.tables.append(
        Table(
            "Sequence packing per rank (micro-batches = bins)",
            ["algorithm", "bins", "lower bound", "over bound", "utilization", "padding removed", "ms"],
            rows,
            note=(
                f"Lower bound: sum over ranks of ceil(tokens / {capacity}). Padding removed: vs padding all "
                f"{n:,} sequences to the longest ({max_len:,}): {padded_total:,} tokens."
            ),
        )
    )

    # 3. Dynamic batching (no packing): padded micro-batches under the same cap.
    rows = []
    for rule in ("nemo_rl", "roll", "optimal"):
        plan, ms = _timed(
            lambda: plan_dynamic_batching(
                lengths[:usable], dp_size, capacity, sequence_length_round, rule=rule, max_seqlen=None
            )
        )
        rep.computed_tokens[f"dynamic batching ({rule})"] = plan.padded_tokens + int(lengths[usable:].sum())
        rows.append(
            [rule, plan.num_micro_batches, plan.padded_tokens, Pct(plan.padded_tokens / plan.valid_tokens - 1),
             Pct(1 - plan.padded_tokens / (usable * max_len)), Ms(ms)]
        )
    rep.tables.append(
        Table(
            "Dynamic batching (padded micro-batches, shared plan across ranks)",
            ["rule", "micro-batches/rank", "padded tokens", "padding overhead", "padding removed", "ms"],
            rows,
            note=f"sequence_length_round={sequence_length_round}; overhead = padded / real tokens - 1.",
        )
    )

    # 4. Hard cap vs the soft cap of ROLL load_balance (verl rearrange_micro_batches before verl#7553).
    rows = []
    soft_viol = hard_viol = soft_count = hard_count = 0
    worst_soft = hard_max = 0
    t_hard = 0.0
    for part in rank_parts:
        rank_lengths = lengths[part]
        k = max(1, math.ceil(int(rank_lengths.sum()) / capacity))
        groups = karmarkar_karp(rank_lengths, min(k, len(part)), equal_size=False)
        sums = [int(rank_lengths[g].sum()) for g in groups]
        soft_count += len(groups)
        soft_viol += sum(s > capacity for s in sums)
        worst_soft = max(worst_soft, max(sums))
        plan, ms = _timed(lambda: plan_micro_batches(rank_lengths, capacity))
        t_hard += ms
        hard_count += plan.num_micro_batches
        hard_viol += sum(t > capacity for t in plan.tokens)
        hard_max = max(hard_max, max(plan.tokens))
    rows.append(["soft cap (ROLL): k = ceil(total/cap), KK", soft_count, soft_viol, worst_soft, "-"])
    rows.append(["seqpack plan_micro_batches (hard cap)", hard_count, hard_viol, hard_max, Ms(t_hard)])
    rep.tables.append(
        Table(
            "Load-balanced micro-batches under a token cap",
            ["method", "micro-batches", "over cap", "largest", "ms"],
            rows,
        )
    )

    # 5. The whole step: plan_step against NeMo-RL's and verl's pipelines.
    rep.tables.append(step_table(lengths, capacity, dp_size))
    return rep
