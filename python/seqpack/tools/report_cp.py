"""Fixed vs hybrid context parallelism on a long-context batch, planned by
:func:`~seqpack.plan_step` both ways (``seqpack demo --cp 8``): the degrees hybrid CP
gives the sequences, the K/V the ranks gather, the predicted step and its bound, the
micro-batches per rank.

    fixed    every sequence over all C ranks of its CP group (2C zigzag chunks)
    hybrid   each over an aligned block of the fewest ranks it needs:
             cp_rank   0    1    2    3    4    5    6    7
                     [ A/4  A/4  A/4  A/4 ][ B/2  B/2 ][ C ][ D ]

Example:
    >>> rep = cp_report(long_context_lengths(64, 4 * 8192, seed=0), capacity=8192, dp_size=1, cp_size=4)
    >>> rep.tables[0].title
    'Context parallelism: fixed vs hybrid CP (plan_step, cp_size=4)'
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np

from ..planning.cost import CostModel
from ..planning.step import plan_step
from ._table import Table, Tables, time_header


def h100_cost_model() -> CostModel:
    """The demo's (and ``benchmarks/bench_cp_step.py``'s) cost model: a Llama-3-8B shape
    at 400 TFLOP/s, 450 GB/s of NVLink per direction, 20 µs per collective, 2 ms per
    micro-batch, bf16 K/V (:meth:`CostModel.from_model`)."""
    return CostModel.from_model(4096, 32, 32, 8, 14336, 128256, flops_per_second=4e14,
                                interconnect_bytes_per_second=4.5e11, collective_latency=2e-5, per_micro_batch=2e-3)


def long_context_lengths(n: int, longest: int, seed: int = 0) -> np.ndarray:
    """``n`` long-tailed lengths (lognormal, median 2k tokens, σ = 1.3, at most
    ``longest``), the first at ``longest``."""
    rng = np.random.default_rng(seed)
    lengths = np.minimum(longest, rng.lognormal(np.log(2048), 1.3, n).astype(np.int64) + 1)
    if n:
        lengths[0] = longest
    return lengths


@dataclass(eq=False)
class CpReport(Tables):
    """Tables of one :func:`cp_report` run, and what :meth:`plot` draws: each plan's
    predicted work per rank (summed over its micro-batches) and K/V gathered."""

    rank_costs: Dict[str, List[float]] = field(default_factory=dict)
    kv_tokens: Dict[str, int] = field(default_factory=dict)
    least_kv_tokens: int = 0

    def plot(self, path: Optional[str] = None):
        """Fixed vs hybrid CP: work per rank and K/V gathered (needs matplotlib)."""
        from .plot import plot_cp

        return plot_cp(self, path)


def cp_report(lengths, capacity: int, dp_size: int, cp_size: int, cost: Optional[CostModel] = None) -> CpReport:
    """Plan ``lengths`` with fixed and hybrid CP (``capacity`` tokens per rank and
    micro-batch) under ``cost`` (default :meth:`CostModel.default()
    <seqpack.CostModel.default>`, seconds)."""
    cost = CostModel.default() if cost is None else cost
    lengths = np.asarray(lengths, dtype=np.int64)
    rows = []
    rank_costs: Dict[str, List[float]] = {}
    kv: Dict[str, int] = {}
    least = 0
    for name, hybrid in (("fixed", False), ("hybrid", True)):
        plan = plan_step(lengths, dp_size, capacity, cost=cost, cp_size=cp_size, hybrid_cp=hybrid)
        rank_costs[name] = [float(sum(sum(mb[r]) for mb in plan.costs)) for r in range(plan.num_ranks)]
        kv[name], least = int(plan.kv_tokens), int(plan.least_kv_tokens)
        counts = np.bincount(plan.cp_degree, minlength=cp_size + 1)
        degrees = " ".join(f"{d}:{int(counts[d])}" for d in range(1, cp_size + 1) if counts[d])
        rows.append([name, degrees, plan.kv_tokens, plan.least_kv_tokens, plan.num_micro_batches[0],
                     plan.predicted_time, plan.lower_bound])
    note = (f"{len(lengths):,} sequences, {int(lengths.sum()):,} tokens, the longest {int(lengths.max(initial=0)):,}; "
            f"DP {dp_size} x CP {cp_size} ranks, {capacity:,} tokens per rank and micro-batch. degrees: degree:count "
            "(a sequence of degree d runs on d ranks of one CP group). K/V: tokens of K/V the ranks gather (least: "
            f"every sequence at its smallest degree). Predicted step under {cost!r}.")
    table = Table(f"Context parallelism: fixed vs hybrid CP (plan_step, cp_size={cp_size})",
                  ["plan", "degrees", "K/V gathered", "least K/V", "micro-batches / rank",
                   time_header("predicted step", cost), time_header("lower bound", cost)], rows, note=note)
    return CpReport(tables=[table], rank_costs=rank_costs, kv_tokens=kv, least_kv_tokens=least)
