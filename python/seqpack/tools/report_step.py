"""One training step planned three ways on the same batch: seqpack's
:func:`~seqpack.plan_step` against NeMo-RL's and verl's pipelines
(:mod:`seqpack.testing.pipelines`), each step's time predicted by one cost model.

    >>> from seqpack.tools.report import synthetic_rl_lengths
    >>> table = step_table(synthetic_rl_lengths(256, seed=0), capacity=8192, dp_size=4)
    >>> [row[0] for row in table.rows]
    ['seqpack plan_step', 'NeMo-RL (MFFD bins, round-robin)', 'verl (balance_batch + dynamic bsz)']
"""

from __future__ import annotations

import time
from typing import Optional

import numpy as np

from ..planning.cost import CostModel
from ..planning.step import plan_step
from ..testing.pipelines import nemo_rl_pipeline, simulate, verl_pipeline
from ._table import Ms, Table, time_header


def step_table(lengths: np.ndarray, capacity: int, dp_size: int, cost: Optional[CostModel] = None) -> Table:
    """plan_step vs NeMo-RL's and verl's step plans of the same sequences (the first
    ``len - len % dp_size``): micro-batches per rank, cells over the cap, and the
    step time each predicts under ``cost`` (default :meth:`CostModel.default()
    <seqpack.CostModel.default>`, seconds: an 8B model on an H200-class GPU, a fixed
    cost per micro-batch included) with ranks in step after every micro-batch (FSDP)."""
    cost = CostModel.default() if cost is None else cost
    usable = np.asarray(lengths, dtype=np.int64)[: len(lengths) - len(lengths) % dp_size]
    t0 = time.perf_counter()
    plan = plan_step(usable, dp_size, capacity, cost=cost)
    ms = (time.perf_counter() - t0) * 1e3
    rows = [["seqpack plan_step", plan.num_micro_batches[0], 0, plan.predicted_time, 1.0, Ms(ms)]]
    for name, pipeline in (("NeMo-RL (MFFD bins, round-robin)", lambda: nemo_rl_pipeline(usable, dp_size, capacity)),
                           ("verl (balance_batch + dynamic bsz)", lambda: verl_pipeline(usable, dp_size, capacity,
                                                                                        cost=cost))):
        t0 = time.perf_counter()
        assignment = pipeline()
        ms = (time.perf_counter() - t0) * 1e3
        sim = simulate(assignment, usable, cost, max_tokens=capacity)
        rows.append([name, sim["num_micro_batches"][0], sim["cap_violations"], sim["time"],
                     sim["time"] / plan.predicted_time, Ms(ms)])
    return Table("One training step: plan_step vs the frameworks' pipelines (same batch, same cost model)",
                 ["pipeline", "micro-batches/rank", "over cap", time_header("predicted step", cost), "vs plan_step",
                  "plan ms"], rows,
                 note=f"Predicted step = sum over micro-batches of the slowest rank's cost, cost = "
                      f"{cost.per_micro_batch:g} + {cost.per_token:g} n + {cost.per_token_squared:g} n^2 per "
                      "micro-batch, the n terms summed over its sequences of n tokens; the frameworks' plans are seqpack.testing.pipelines' models of "
                      f"their released code; plan_step's lower bound: {plan.lower_bound:,.3f}.")
