"""The streaming batcher seqpack's :class:`~seqpack.StreamPlanner` is measured
against: torchtitan's RL batcher (``torchtitan/experiments/rl``, PR #3642), written
again from its description, for tests and benchmarks. Not part of the API.

Its rules: episodes whose policy version is too old are dropped; the trainer waits
until fresh episodes hold the step's token target; the taken episodes are packed in
arrival order, next-fit, into rows of ``seq_len`` tokens (a row is closed as soon as
the next episode does not fit); the rows are dealt to the data-parallel ranks in
turn (row ``j`` to rank ``j % D``, micro-batch ``j // D``); what is left over waits
for the next step. Here a row is one micro-batch, its padding to ``seq_len`` is not
charged (only the packing rule is compared), and the ranks' counts are evened out
with empty micro-batches as lock-step training needs.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import numpy as np

from ..planning.cost import CostModel


def step_time(costs: Sequence[Sequence[float]], sync: str) -> float:
    """The time of cells ``costs[r][k]`` under ``sync`` (the planner's rule, written
    again for the reference): ``Σ_k max_r`` or ``max_r Σ_k``."""
    if not costs or not costs[0]:
        return 0.0
    table = np.asarray(costs, dtype=np.float64)
    return float(table.max(axis=0).sum() if sync == "micro_batch" else table.sum(axis=1).max())


def next_fit_rows(lengths: Sequence[int], max_tokens: int) -> List[List[int]]:
    """Positions of ``lengths`` packed next-fit in order into rows of ``max_tokens``."""
    rows: List[List[int]] = []
    fill = max_tokens + 1
    for i, length in enumerate(lengths):
        if length > max_tokens:
            raise ValueError(f"lengths[{i}] = {length} exceeds max_tokens = {max_tokens}")
        if fill + length > max_tokens:
            rows.append([])
            fill = 0
        rows[-1].append(i)
        fill += length
    return rows


def next_fit_step(lengths: Sequence[int], dp_size: int, max_tokens: int, cost: CostModel,
                  sync: str = "micro_batch") -> Tuple[List[List[List[int]]], float]:
    """torchtitan's step over ``lengths`` (in arrival order): its cells
    ``[rank][micro-batch]`` of positions and their predicted time under ``cost``."""
    rows = next_fit_rows([int(x) for x in lengths], max_tokens)
    k = -(-len(rows) // dp_size)
    cells: List[List[List[int]]] = [[[] for _ in range(k)] for _ in range(dp_size)]
    for j, row in enumerate(rows):
        cells[j % dp_size][j // dp_size] = row
    lens = np.asarray(lengths, dtype=np.int64)
    costs = [[cost([int(lens[i]) for i in cell]) for cell in rank] for rank in cells]
    return cells, step_time(costs, sync)
