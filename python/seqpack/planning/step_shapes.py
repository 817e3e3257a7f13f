"""Step shapes: the order in which a rank runs its micro-batches, and the static
sizes they are padded to. Neither changes which sequences go together.

*Largest first.* The caching allocator keeps the blocks of the largest micro-batch it
has seen; when a smaller one runs first and a larger one later, it reserves again
and fragments (NeMo-RL PR #3476 ran the largest first and cut reserved memory from
158.5 to 71.2 GiB). :func:`largest_first` sorts each rank's micro-batches by tokens,
largest first, every mini-batch on its own. The ranks stay in lock-step: their k-th
micro-batches run together, and every rank's k-th is its k-th largest::

    planned         k=0    k=1    k=2          largest first   k=0    k=1    k=2
    rank 0          3000   8000   5000         rank 0          8000   5000   3000
    rank 1          7000   2000   6000         rank 1          7000   6000   2000
    Σ_k max_r       7000 + 8000 + 6000         Σ_k max_r       8000 + 6000 + 3000

Under ``sync="step"`` (each rank's sum) the step's time does not change; under
``sync="micro_batch"`` (``Σ_k max_r``) sorting every rank the same way is the
arrangement with the least time whenever the costlier of two micro-batches is never
the one with fewer tokens (a cost model without the attention term, say): for any
threshold ``t``, the columns whose maximum exceeds ``t`` are then exactly as many as
the one rank with the most cells above ``t`` needs. With the attention term a
shorter micro-batch of one long sequence can cost more than a fuller one of short
ones; the order is still by tokens (the allocator's measure) and the recomputed time
can then rise (by 2% in the example below; benchmarks/bench_stream.py reports it). With context
parallelism the ranks of one CP group move together (their blocks share micro-batch
slots), sorted by the group's largest cell.

*Static shapes.* CUDA graphs and a flat allocator want a few fixed micro-batch
sizes. :func:`bucket_shapes` pads every micro-batch (dummies included) up to the
smallest bucket that holds it; the padding is one extra segment of its own, priced
by the cost model like a sequence of that length, and reported
(:attr:`StepPlan.padding_tokens <seqpack.StepPlan.padding_tokens>`).

Importing this module does not import torch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Sequence, Tuple, Union

import numpy as np

from .._lengths import as_lengths, as_positive_int

MICRO_BATCH_ORDERS = ("planned", "largest_first")


def step_time(costs: Sequence[Sequence[Sequence[float]]], sync: str) -> float:
    """The time of one mini-batch's cells ``costs[r][k]`` under ``sync``:
    ``Σ_k max_r`` (``"micro_batch"``) or ``max_r Σ_k`` (``"step"``)."""
    if not costs or not costs[0]:
        return 0.0
    table = np.asarray(costs, dtype=np.float64)
    return float(table.max(axis=0).sum() if sync == "micro_batch" else table.sum(axis=1).max())


def static_shapes_spec(spec: Any) -> Optional[Union[int, Tuple[int, ...]]]:
    """``static_shapes`` checked without a cap: ``None`` (off; also ``False``), a
    bucket count (``True`` is eight) or the bucket sizes (sorted, unique, each
    >= 1). Whether the largest size holds a full micro-batch is checked against
    ``max_tokens`` by :func:`shape_buckets`.

    >>> static_shapes_spec(True), static_shapes_spec(np.int64(4)), static_shapes_spec([4096, 1024, 4096])
    (8, 4, (1024, 4096))
    """
    if spec is None or spec is False or (isinstance(spec, np.bool_) and not spec):
        return None
    if spec is True or (isinstance(spec, np.bool_) and spec):
        return 8
    if isinstance(spec, (str, bytes)):
        raise TypeError(f"static_shapes must be True, a bucket count or a list of bucket sizes, got {spec!r}")
    if np.ndim(spec) == 0:
        return as_positive_int(spec, "static_shapes")
    sizes = as_lengths(spec, "static_shapes").tolist()
    if not sizes:
        raise ValueError("static_shapes must hold at least one bucket size")
    if min(sizes) <= 0:
        raise ValueError(f"static_shapes must hold sizes >= 1, got {min(sizes)}")
    return tuple(sorted({int(s) for s in sizes}))


def shape_buckets(spec: Any, max_tokens: int) -> Tuple[int, ...]:
    """The bucket sizes of ``static_shapes=spec``: ``True`` (eight: every eighth of
    ``max_tokens``), an int ``n`` (``n`` evenly spaced sizes up to ``max_tokens``) or
    the sizes themselves (the largest at least ``max_tokens``), sorted, unique.

    >>> shape_buckets(True, 8192)
    (1024, 2048, 3072, 4096, 5120, 6144, 7168, 8192)
    >>> shape_buckets(4, 8192)
    (2048, 4096, 6144, 8192)
    >>> shape_buckets([4096, 1024, 4096], 4096)
    (1024, 4096)
    """
    if spec is None or spec is False:
        raise TypeError(f"static_shapes must be True, a bucket count or a list of bucket sizes, got {spec!r}")
    spec = static_shapes_spec(spec)
    if isinstance(spec, int):
        if spec > max_tokens:
            raise ValueError(f"static_shapes = {spec} buckets is more than max_tokens = {max_tokens} sizes")
        return tuple(sorted({-(-max_tokens * (i + 1) // spec) for i in range(spec)}))
    if spec[-1] < max_tokens:
        raise ValueError(f"static_shapes: the largest bucket ({spec[-1]}) must hold a full micro-batch "
                         f"(max_tokens = {max_tokens})")
    return spec


def largest_first(plan: Any) -> Any:
    """``plan`` (a :class:`~seqpack.StepPlan`) with every rank's micro-batches of each
    mini-batch sorted by tokens, largest first (ties: the costlier first, then the
    planned order); ranks of one CP group move together. Its ``predicted_time`` is
    recomputed from the cells' costs under its ``sync``.

    >>> from seqpack import CostModel, plan_step
    >>> plan = plan_step([700, 800, 100, 800, 500, 500], dp_size=2, max_tokens=1000,
    ...                  cost=CostModel(per_token=1, per_token_squared=0.002))
    >>> plan.tokens, largest_first(plan).tokens        # rank 0 ran 800 tokens, then 1000
    ([[[800, 1000], [800, 800]]], [[[1000, 800], [800, 800]]])
    >>> plan.predicted_time, largest_first(plan).predicted_time   # [800] costs more than [500, 500]
    (4080.0, 4160.0)
    """
    group = plan.cp_size
    fields = {"assignment": [], "costs": [], "tokens": []}
    padded = [] if plan.padded_tokens is not None else None
    for m, cells in enumerate(plan.assignment):
        tokens, costs = np.asarray(plan.tokens[m]), np.asarray(plan.costs[m], dtype=np.float64)
        out = {name: [] for name in fields}
        out_padded: List[Any] = []
        for g in range(0, len(cells), group):
            ranks = range(g, g + group)
            key_tokens, key_cost = tokens[g:g + group].max(axis=0), costs[g:g + group].max(axis=0)
            order = np.lexsort((np.arange(len(key_tokens)), -key_cost, -key_tokens))
            for r in ranks:
                out["assignment"].append([cells[r][k] for k in order])
                out["costs"].append([plan.costs[m][r][k] for k in order])
                out["tokens"].append([plan.tokens[m][r][k] for k in order])
                if padded is not None:
                    out_padded.append([plan.padded_tokens[m][r][k] for k in order])
        for name in fields:
            fields[name].append(out[name])
        if padded is not None:
            padded.append(out_padded)
    time = sum(step_time(c, plan.sync) for c in fields["costs"])
    return dataclasses.replace(plan, **fields, padded_tokens=padded, predicted_time=time,
                               micro_batch_order="largest_first")


def bucket_shapes(plan: Any, buckets: Tuple[int, ...]) -> Any:
    """``plan`` with every micro-batch padded up to the smallest of ``buckets`` that
    holds it (a dummy to the smallest bucket): ``padded_tokens`` per cell, each
    cell's cost raised by its padding (one segment of ``p`` tokens: ``per_token·p +
    per_token_squared·p²``) and ``predicted_time`` recomputed.

    >>> from seqpack import plan_step
    >>> plan = bucket_shapes(plan_step([700, 300, 500, 200], dp_size=1, max_tokens=1000), (500, 1000))
    >>> plan.tokens, plan.padded_tokens, plan.padding_tokens
    ([[[900, 800]]], [[[1000, 1000]]], 300)
    """
    sizes = np.asarray(buckets, dtype=np.int64)
    cost = plan.cost
    padded, costs = [], []
    for m, mb in enumerate(plan.tokens):
        tok = np.asarray(mb, dtype=np.int64).reshape(len(mb), -1)
        if tok.size and tok.max() > sizes[-1]:
            raise ValueError(f"static_shapes: a micro-batch of {int(tok.max())} tokens is larger than the largest "
                             f"bucket ({int(sizes[-1])})")
        shape = sizes[np.searchsorted(sizes, tok, side="left")] if tok.size else tok
        pad = (shape - tok).astype(np.float64)
        extra = cost.per_token * pad + cost.per_token_squared * pad * pad
        padded.append(shape.tolist())
        costs.append((np.asarray(plan.costs[m], dtype=np.float64).reshape(tok.shape) + extra).tolist())
    time = sum(step_time(c, plan.sync) for c in costs)
    return dataclasses.replace(plan, padded_tokens=padded, costs=costs, predicted_time=time,
                               shape_buckets=tuple(int(s) for s in sizes))


def check_order(micro_batch_order: Optional[str]) -> str:
    """``micro_batch_order`` checked: ``"planned"`` or ``"largest_first"``."""
    if micro_batch_order not in MICRO_BATCH_ORDERS:
        raise ValueError(f"micro_batch_order must be one of {MICRO_BATCH_ORDERS}, got {micro_batch_order!r}")
    return micro_batch_order
