"""Step shapes: the order in which a rank runs its micro-batches, and the static
sizes they are padded to. Neither changes which sequences go together. Both are
planned and costed by the core inside :func:`~seqpack.plan_step`'s one call
(``cpp/include/seqpack/step_shapes.hpp``); this module checks their options.

*Largest first* (``micro_batch_order="largest_first"``). The caching allocator keeps
the blocks of the largest micro-batch it has seen; when a smaller one runs first and
a larger one later, it reserves again and fragments (NeMo-RL PR #3476 ran the
largest first and cut reserved memory from 158.5 to 71.2 GiB). Every rank's
micro-batches of each mini-batch are sorted by tokens, largest first (ties: the
costlier first, then the planned order). The ranks stay in lock-step: their k-th
micro-batches run together, and every rank's k-th is its k-th largest::

    planned         k=0    k=1    k=2          largest first   k=0    k=1    k=2
    rank 0          3000   8000   5000         rank 0          8000   5000   3000
    rank 1          7000   2000   6000         rank 1          7000   6000   2000
    Σ_k max_r       7000 + 8000 + 6000         Σ_k max_r       8000 + 6000 + 3000

Under ``sync="step"`` the step's time does not change; under ``sync="micro_batch"``
sorting every rank the same way is the arrangement with the least time whenever the
costlier of two micro-batches is never the one with fewer tokens (a cost model
without the attention term). With the attention term a shorter micro-batch of one
long sequence can cost more than a fuller one of short ones; the order is still by
tokens (the allocator's measure) and the predicted time can then rise (by 2% in the
example below; benchmarks/bench_stream.py reports it). With context parallelism the
ranks of one CP group move together, sorted by the group's largest cell.

    >>> from seqpack import CostModel, plan_step
    >>> cost = CostModel(per_token=1, per_token_squared=0.002)
    >>> plan = plan_step([700, 800, 100, 800, 500, 500], dp_size=2, max_tokens=1000, cost=cost)
    >>> lf = plan_step([700, 800, 100, 800, 500, 500], dp_size=2, max_tokens=1000, cost=cost,
    ...                micro_batch_order="largest_first")
    >>> plan.tokens, lf.tokens                 # rank 0 ran 800 tokens, then 1000
    ([[[800, 1000], [800, 800]]], [[[1000, 800], [800, 800]]])
    >>> plan.predicted_time, lf.predicted_time  # [800] costs more than [500, 500]
    (4080.0, 4160.0)

*Static shapes* (``static_shapes=True | n | sizes``). CUDA graphs and a flat
allocator want a few fixed micro-batch sizes. Every micro-batch (dummies included)
is padded up to the smallest bucket that holds it; the padding is one extra segment
of its own, priced like a sequence of that length (``per_token·p +
per_token_squared·p²``), and reported (:attr:`StepPlan.padding_tokens
<seqpack.StepPlan.padding_tokens>`). On plain rows the step is also planned under
each smaller bucket that holds the longest sequence and the fastest padded step kept.

    >>> plan = plan_step([700, 300, 500, 200], dp_size=1, max_tokens=1000, static_shapes=[500, 1000])
    >>> plan.tokens, plan.padded_tokens, plan.padding_tokens
    ([[[900, 800]]], [[[1000, 1000]]], 300)

Importing this module does not import torch.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import numpy as np

from .._lengths import as_lengths, as_positive_int

MICRO_BATCH_ORDERS = ("planned", "largest_first")


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


def check_order(micro_batch_order: Optional[str]) -> str:
    """``micro_batch_order`` checked: ``"planned"`` or ``"largest_first"``."""
    if micro_batch_order not in MICRO_BATCH_ORDERS:
        raise ValueError(f"micro_batch_order must be one of {MICRO_BATCH_ORDERS}, got {micro_batch_order!r}")
    return micro_batch_order
