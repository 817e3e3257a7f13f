"""The options of a step's plan as one object: what :func:`~seqpack.plan_step`,
:class:`~seqpack.StreamPlanner` and the configs (``cfg.step_options()``) share.

A step is planned from its batch (the lengths, and with shared prefixes the
:class:`~seqpack.PrefixForest` of its rows), the ranks and the cap, and from
options that stay the same step after step: the cost model, how ranks
synchronise, mini-batches, context parallelism, the micro-batches' order and
shapes. :class:`StepOptions` holds those, checked once when it is made::

    StepOptions(cost=..., cp_size=4, hybrid_cp=True)      checked here, once
          |                         |                         |
    plan_step(lengths, dp, cap,   StreamPlanner(dp, cap,    cfg.plan_step_kwargs(dp)
              options=opts)         step_tokens=...,        -> {dp_size, max_tokens,
                                    options=opts)               options: StepOptions}

    >>> from seqpack import CostModel, plan_step
    >>> options = StepOptions(cost=CostModel(per_micro_batch=100.0), mini_batches=2)
    >>> options
    StepOptions(cost=CostModel(per_micro_batch=100, per_token=1, per_token_squared=0), mini_batches=2)
    >>> plan = plan_step([3000, 500, 500, 2500], dp_size=2, max_tokens=4000, options=options)
    >>> plan == plan_step([3000, 500, 500, 2500], 2, 4000, cost=CostModel(per_micro_batch=100.0), mini_batches=2)
    True

Importing this module does not import torch.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple, Union

import numpy as np

from .._lengths import as_flag, as_positive_int, shown, type_name
from .cost import CostModel
from .step_shapes import check_order, static_shapes_spec

__all__ = ["StepOptions"]

SYNC_MODES = ("micro_batch", "step")


@dataclass(frozen=True, repr=False)
class StepOptions:
    """How every step is planned, apart from its batch, ranks and cap. Frozen,
    compared by value, pickles; every field is checked when the object is made
    (Python and NumPy scalars, 0-d arrays and 0-d tensors accepted as numbers; a
    bad value is a ``TypeError`` / ``ValueError`` naming the field).

    Attributes:
        cost: what a micro-batch costs (a :class:`~seqpack.CostModel`; ``None``
            gives :meth:`CostModel.default <seqpack.CostModel.default>`, an 8B model
            on an H200-class GPU in seconds, a fixed cost per micro-batch included).
        sync: ``"micro_batch"`` (FSDP / ZeRO-3, minimises ``Σ_k max_r``) or
            ``"step"`` (DDP / Megatron, minimises ``max_r Σ_k``).
        mini_batches: optimizer steps in one global batch; the batch is split into
            contiguous near-equal parts (as ``numpy.array_split``) planned in turn.
        min_micro_batches: at least this many micro-batches per rank and mini-batch.
        multiple_of: the count per rank is a multiple of this (pipeline parallelism).
        seed: breaks ties among equal lengths (``None``: by index; up to 2**64 - 1).
            The plan is a function of the inputs and the seed only, so every rank
            computes it alone and all agree.
        shared_prefix: plan the rows as prefix trees (rows that share a prompt
            forward it once per micro-batch; the cap bounds physical tokens).
            :func:`~seqpack.plan_step` then takes the batch's
            :class:`~seqpack.PrefixForest` as ``forest=``; a
            :class:`~seqpack.StreamPlanner` builds each step's forest from
            ``add(tokens=)``.
        prefix_reuse: with ``shared_prefix``, a tree larger than the cap runs as
            passes (:mod:`~seqpack.planning.prefix_reuse`): its shared prefix
            computed once in the step, its branches reading that prefix's K/V, and a
            row longer than the cap planned instead of refused. Each mini-batch
            keeps the passes where the cost model predicts them faster than the
            plan on trees (``StepPlan.prefix_reuse``).
        whole_trees: with ``shared_prefix``, keep every tree that fits in one
            micro-batch, and every tree on one rank (losses that couple a tree's
            rows: DPO and other preference pairs).
        cp_size: context-parallel ranks per data-parallel rank (a power of two):
            the plan then runs over ``dp_size * cp_size`` ranks (``rank = dp_rank *
            cp_size + cp_rank``), the cap bounds each rank's tokens of a
            micro-batch, and every sequence is sharded (zigzag, padded to a
            multiple of 2·degree) over an aligned block of ``cp_degree[i]`` ranks of
            one CP group, listed in the cell of each of them at the same
            micro-batch. ``cost.per_kv_token`` / ``cost.per_collective`` price the
            K/V each rank gathers. Without ``hybrid_cp`` every degree is
            ``cp_size``. With ``shared_prefix`` every tree of a mini-batch is one
            item, cut into ranges balanced by attention work
            (in the core: ``cpp/include/seqpack/forest_cp.hpp``).
        hybrid_cp: each sequence at the smallest degree whose shard fits the cap
            (the least K/V traffic), the fixed-CP placement kept instead when it
            is predicted faster: never slower than fixed CP on the same cost model.
            Megatron-LM's ``--dynamic-context-parallel`` (``--hybrid-context-parallel``
            when PR #2282 merged it).
        min_cp_degree: with ``hybrid_cp`` and ``cp_size > 1``, no sequence below
            this degree (a power of two up to ``cp_size``; Megatron-LM's
            ``--min-dynamic-context-parallel-size``).
        micro_batch_order: ``"planned"`` or ``"largest_first"``: every rank's
            micro-batches of a mini-batch sorted by tokens, largest first, the
            ranks still in lock-step (:mod:`~seqpack.planning.step_shapes`:
            a flat allocator peak; never slower under ``sync="step"``, and under
            ``"micro_batch"`` whenever cost follows tokens).
        static_shapes: pad every micro-batch up to a bucket size, for CUDA graphs
            and a stable allocator: ``True`` (eight buckets, stored as ``8``), a
            bucket count, or the sizes (stored sorted and unique; the largest must
            hold ``max_tokens``, checked when a step is planned). ``None``: off.
            ``padded_tokens`` then holds each cell's size, costs and
            ``predicted_time`` include the padding; on plain rows the step is also
            planned under each smaller bucket that holds the longest sequence and
            the fastest padded plan kept.

    >>> StepOptions(cp_size=4, hybrid_cp=True, static_shapes=[4096, 1024])
    StepOptions(cp_size=4, hybrid_cp=True, static_shapes=(1024, 4096))
    >>> StepOptions(cp_size=3)
    Traceback (most recent call last):
    ...
    ValueError: cp_size must be a power of two, got 3
    """

    cost: Optional[CostModel] = None
    sync: str = "micro_batch"
    mini_batches: int = 1
    min_micro_batches: int = 1
    multiple_of: int = 1
    seed: Optional[int] = None
    shared_prefix: bool = False
    prefix_reuse: bool = False
    whole_trees: bool = False
    cp_size: int = 1
    hybrid_cp: bool = False
    min_cp_degree: int = 1
    micro_batch_order: str = "planned"
    static_shapes: Optional[Union[int, Tuple[int, ...]]] = None

    def __post_init__(self) -> None:
        for name, check in _CHECKS.items():
            object.__setattr__(self, name, check(getattr(self, name), name))
        if self.whole_trees and not self.shared_prefix:
            raise ValueError("whole_trees=True needs shared_prefix=True (it keeps prefix trees whole; plan_step "
                             "takes their PrefixForest as forest=)")
        if self.prefix_reuse:
            self._check_prefix_reuse()
        if self.min_cp_degree > 1:
            if not (self.hybrid_cp and self.cp_size > 1):
                raise ValueError("min_cp_degree applies to hybrid CP: give it with cp_size > 1 and hybrid_cp=True")
            if not _power_of_two(self.min_cp_degree) or self.min_cp_degree > self.cp_size:
                raise ValueError(f"min_cp_degree must be a power of two in [1, cp_size={self.cp_size}], "
                                 f"got {self.min_cp_degree}")

    def _check_prefix_reuse(self) -> None:
        """Prefix reuse runs a tree's passes on one rank in one fixed order."""
        if not self.shared_prefix:
            raise ValueError("prefix_reuse=True needs shared_prefix=True (it runs prefix trees larger than the cap "
                             "in passes; plan_step takes their PrefixForest as forest=)")
        clashes = {"whole_trees": self.whole_trees and "a tree's rows meet in no one micro-batch when it runs in "
                                                      "passes (sequence-level losses are refused on passes)",
                   "cp_size": self.cp_size > 1 and "passes are not sharded over context-parallel ranks",
                   "static_shapes": self.static_shapes is not None and "passes are not padded to buckets",
                   "micro_batch_order": self.micro_batch_order != "planned" and "a tree's passes run in their "
                                                                               "planned order (providers first)"}
        for name, why in clashes.items():
            if why:
                raise ValueError(f"prefix_reuse=True and {name}={getattr(self, name)!r} cannot be combined: {why}")

    def __repr__(self) -> str:
        given = [f"{name}={getattr(self, name)!r}" for name in _CHECKS
                 if not _same(getattr(self, name), DEFAULTS[name])]
        return f"StepOptions({', '.join(given)})"


def _cost(value: Any, name: str) -> CostModel:
    if value is None:
        return CostModel.default()
    if not isinstance(value, CostModel):
        raise TypeError(f"{name} must be a seqpack.CostModel, got {type_name(value)}")
    return value


def _sync(value: Any, name: str) -> str:
    if not isinstance(value, str) or value not in SYNC_MODES:
        raise ValueError(f"{name} must be 'micro_batch' (FSDP / ZeRO-3) or 'step' (DDP / Megatron), got {shown(value)}")
    return value


def _seed(value: Any, name: str) -> Optional[int]:
    return None if value is None else as_positive_int(value, name, allow_zero=True, maximum=2**64 - 1)  # a uint64


def _power_of_two(n: int) -> bool:
    return n & (n - 1) == 0


def _cp_size(value: Any, name: str) -> int:
    size = as_positive_int(value, name)
    if not _power_of_two(size):
        raise ValueError(f"{name} must be a power of two, got {size}")
    return size


def _positive(value: Any, name: str) -> int:
    return as_positive_int(value, name)


_CHECKS: Dict[str, Callable[[Any, str], Any]] = {
    "cost": _cost, "sync": _sync, "mini_batches": _positive, "min_micro_batches": _positive,
    "multiple_of": _positive, "seed": _seed, "shared_prefix": as_flag, "prefix_reuse": as_flag,
    "whole_trees": as_flag, "cp_size": _cp_size,
    "hybrid_cp": as_flag, "min_cp_degree": _positive, "micro_batch_order": lambda v, _: check_order(v),
    "static_shapes": lambda v, _: static_shapes_spec(v),
}
DEFAULTS: Dict[str, Any] = {f.name: _CHECKS[f.name](f.default, f.name) for f in dataclasses.fields(StepOptions)}


def _same(a: Any, b: Any) -> bool:
    """Checked values equal, and of one type (``True`` is not ``1``)."""
    return type(a) is type(b) and a == b


def with_keywords(options: Any, keywords: Dict[str, Any], where: str) -> StepOptions:
    """``options`` (a :class:`StepOptions`, or ``None`` for the defaults) with the
    option ``keywords`` a caller was given one by one. A keyword at its default
    leaves the options' value; one that sets what ``options`` leaves at its default
    fills it in; one that differs from a value ``options`` sets is a ``ValueError``
    naming both (``where``: the caller, for the message).

    >>> with_keywords(StepOptions(cp_size=2), {"mini_batches": 2, "sync": "micro_batch"}, "plan_step")
    StepOptions(mini_batches=2, cp_size=2)
    >>> with_keywords(StepOptions(cp_size=2), {"cp_size": 4}, "plan_step")
    Traceback (most recent call last):
    ...
    ValueError: plan_step: cp_size=4 and options.cp_size=2 disagree; give cp_size once (in options=, or as a keyword)
    """
    if options is None:
        return StepOptions(**keywords)
    if not isinstance(options, StepOptions):
        raise TypeError(f"options must be a seqpack.StepOptions, got {type_name(options)}")
    changes = {}
    for name, value in keywords.items():
        if name not in _CHECKS:
            raise TypeError(f"{where}() got an unexpected keyword argument {name!r}")
        value = _CHECKS[name](value, name)
        current = getattr(options, name)
        if _same(value, DEFAULTS[name]) or _same(value, current):
            continue
        if not _same(current, DEFAULTS[name]):
            raise ValueError(f"{where}: {name}={value!r} and options.{name}={current!r} disagree; give {name} once "
                             "(in options=, or as a keyword)")
        changes[name] = value
    return dataclasses.replace(options, **changes) if changes else options


def stream_options(options: Any, shared_prefix: Any, deprecated: Dict[str, Any]) -> StepOptions:
    """:class:`~seqpack.StreamPlanner`'s options: ``options`` with ``shared_prefix``
    (either one turns it on) and the keywords it took before :class:`StepOptions`
    (``cost=``, ..., and ``forest=True`` for ``shared_prefix=True``), which keep
    working for one release with a ``DeprecationWarning`` naming the new call.
    Merged as :func:`with_keywords` merges."""
    old = dict(deprecated)
    unknown = sorted(k for k in old if k not in _CHECKS and k != "forest")
    if unknown:
        raise TypeError(f"StreamPlanner() got an unexpected keyword argument {unknown[0]!r}")
    if "forest" in old:
        forest = old.pop("forest")
        if not isinstance(forest, (bool, np.bool_)):
            raise TypeError(f"forest must be True or False (a stream builds each step's forest itself), got "
                            f"{type_name(forest)}; the switch is now StreamPlanner(shared_prefix=True)")
        warnings.warn(f"StreamPlanner(forest={bool(forest)}) is deprecated: use "
                      f"StreamPlanner(shared_prefix={bool(forest)})", DeprecationWarning, stacklevel=3)
        shared_prefix = as_flag(shared_prefix, "shared_prefix") or bool(forest)
    if old:
        given = ", ".join(f"{k}=..." for k in old)
        warnings.warn(f"StreamPlanner({given}) is deprecated: pass the plan's options as one object, "
                      f"StreamPlanner(..., options=seqpack.StepOptions({given}))", DeprecationWarning, stacklevel=3)
    return with_keywords(options, {**old, "shared_prefix": shared_prefix}, "StreamPlanner")
