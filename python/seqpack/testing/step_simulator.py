"""One training step's assignment of sequences, and the step time it takes.

An *assignment* says where every sequence of a global batch trains::

    assignment[m][r][k] = [global sequence indices]
               |  |  +-- micro-batch k (one forward / backward); [] is a dummy one
               |  +----- data-parallel rank r
               +-------- mini-batch m (one optimizer step)

    rank 0   [0, 4] [2]        sync="micro_batch": the ranks wait after every
    rank 1   [1, 3] [5]        micro-batch: sum over k of max over r

The framework pipelines of :mod:`~seqpack.testing.pipelines` return one;
:func:`simulate` prices it under a :class:`~seqpack.planning.cost.CostModel`, so a
benchmark compares the frameworks' plans with seqpack's on the same lengths.

This module is a test/benchmark oracle (torch-free), not part of the API.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import numpy as np

from .._lengths import as_lengths, as_positive_int
from ..planning.cost import CostModel

__all__ = ["Assignment", "Cells", "simulate"]

Cells = List[List[int]]  # one rank's micro-batches in one mini-batch
Assignment = List[List[Cells]]  # [mini-batch][rank][micro-batch] -> sequence indices


def simulate(assignment: Assignment, lengths: Any, cost: CostModel, sync: str = "micro_batch",
             max_tokens: Optional[int] = None) -> Dict[str, Any]:
    """Simulated step time of an assignment under a cost model.

    A cell (one rank's micro-batch) costs ``cost(lengths of its sequences)``; an
    empty cell costs ``per_micro_batch``. ``sync="micro_batch"``: the ranks wait for
    each other after every micro-batch (FSDP/ZeRO-3 collectives, PP), the step takes
    ``Σ_m Σ_k max_r cost``; ``sync="step"``: only at the optimizer step (DDP-style
    gradient accumulation), ``Σ_m max_r Σ_k cost``. Ranks of a mini-batch with fewer
    micro-batches than the others are padded with empty cells (``unequal_counts``).

    Returns:
        dict with ``time``, ``unequal_counts`` (bool), ``num_micro_batches`` (per
        mini-batch, the largest rank's count), ``cap_violations`` (cells holding
        more than ``max_tokens`` tokens; ``None`` without ``max_tokens``),
        ``max_cell_tokens``, ``cells`` (cells simulated, padding included) and
        ``padded_cells``.

    Example:
        >>> cost = CostModel(per_micro_batch=1, per_token=1, per_token_squared=0)
        >>> out = simulate([[[[0], [1]], [[2]]]], [3, 4, 5], cost, max_tokens=4)
        >>> out["time"], out["unequal_counts"], out["cap_violations"]
        (11.0, True, 1)
    """
    if sync not in ("micro_batch", "step"):
        raise ValueError(f"sync must be 'micro_batch' or 'step', got {sync!r}")
    arr = as_lengths(lengths, "lengths").astype(np.int64, copy=False)
    cap = None if max_tokens is None else as_positive_int(max_tokens, "max_tokens")
    c0, c1, c2 = float(cost.per_micro_batch), float(cost.per_token), float(cost.per_token_squared)
    time = 0.0
    unequal = False
    counts_per_mb: List[int] = []
    cells = padded = violations = max_tok = 0
    for m, mini_batch in enumerate(assignment):
        counts = [len(rank) for rank in mini_batch]
        k = max(counts, default=0)
        counts_per_mb.append(k)
        if k == 0:
            continue
        unequal = unequal or min(counts) != k
        table = np.full((len(mini_batch), k), c0, dtype=np.float64)
        for r, rank in enumerate(mini_batch):
            for j, cell in enumerate(rank):
                if not len(cell):
                    continue
                idx = np.asarray(cell, dtype=np.int64)
                if int(idx.min()) < 0 or int(idx.max()) >= arr.size:
                    raise ValueError(f"assignment[{m}][{r}][{j}] holds an index outside the {arr.size} lengths")
                seq = arr[idx]
                tokens = int(seq.sum())
                table[r, j] = c0 + c1 * tokens + c2 * float(np.dot(seq, seq))
                max_tok = max(max_tok, tokens)
                if cap is not None and tokens > cap:
                    violations += 1
        cells += table.size
        padded += table.size - sum(counts)
        time += float(table.max(axis=0).sum()) if sync == "micro_batch" else float(table.sum(axis=1).max())
    return {
        "time": time,
        "unequal_counts": unequal,
        "num_micro_batches": counts_per_mb,
        "cap_violations": None if cap is None else violations,
        "max_cell_tokens": max_tok,
        "cells": cells,
        "padded_cells": padded,
    }
