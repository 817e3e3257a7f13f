"""ROLL's balancing and micro-batching, on ROLL's ``DataProto`` or on mappings.

A batch is ROLL's ``DataProto`` (``.batch`` tensors, ``.non_tensor_batch`` NumPy
object arrays, ``.meta_info``; duck-typed, ROLL is never imported), whose results
are built by its own ``select_idxs``/``slice`` and so keep its class, or a mapping
of tensors (and NumPy arrays or lists) sharing dimension 0, whose results are
:class:`RollBatch` dicts. Either needs an ``attention_mask [B, S]``; results carry
the ``meta_info`` keys ROLL writes. Invalid input raises ``ValueError``; in
dynamic batching, where ROLL asserts, a :class:`RollError` (also an ``AssertionError``).

* :func:`batch_balance` - Karmarkar-Karp over DP ranks with equal sizes, rows
  reordered in place so rank ``r`` takes the ``r``-th contiguous block.
* :func:`dynamic_batching_shard` + :func:`make_mini_batch_iter_for_dynamic_batching`
  + :func:`make_micro_batch_iter_for_dynamic_batching` - ROLL's dynamic batching
  (sort, stride across DP, one shared greedy plan, VPP split), its metrics and
  metadata. ``keep_dp_partition=True`` keeps a :func:`batch_balance` assignment
  instead of re-sorting the whole batch (ROLL re-sorts it away).
* :func:`make_micro_batch_iter_for_sequence_packing` (``load_balance``) - packed
  micro-batches under a **hard** cap (ROLL's may exceed
  ``max_packed_sequence_length``), at least ``min_num_micro_batches``, a multiple
  of the VPP size, the count agreed across the DP group when ``torch.distributed``
  is initialised; and :func:`restore_results_order`. ROLL's
  :class:`LoadBalancePacker`, :class:`SequencePackingPacker`,
  :class:`SequencePackingConfig`, :func:`get_sequence_packing_packer` and
  :func:`calculate_workload` are thin adapters over them with ROLL's signatures.

Example (ROLL's load-balance example: two micro-batches of exactly 4096 tokens):
    >>> import torch
    >>> lens = [512, 1024, 256, 2048, 128, 768, 1536, 384, 896, 640]
    >>> mask = (torch.arange(2048)[None, :] < torch.tensor(lens)[:, None]).long()
    >>> mbs = list(make_micro_batch_iter_for_sequence_packing({"attention_mask": mask},
    ...                                                       max_packed_sequence_length=4096))
    >>> [int(mb["attention_mask"].sum()) for mb in mbs]
    [4096, 4096]
"""

from __future__ import annotations

import copy
import functools
import math
import types
import warnings
from dataclasses import dataclass
from numbers import Integral
from typing import (TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Mapping, MutableMapping, Optional, Sequence,
                    Tuple)

import numpy as np

from .. import _core
from ._batch import (batch_size, dummy_row, host_mask, is_data_proto, is_tensor, mask_lengths, padded_forest,
                     proto_columns, proto_select, proto_slice, select_all, step_plan_parts)
from .._dist import active, agree_on_count, checked_on_every_rank
from .._equality import ValueEquality, values_equal
from .._lengths import as_int, as_positive_int
from ..tensors.layout import alignment, round_up
from ..planning.balance import WORKLOAD_ATTENTION_COEFF, MicroBatchPlan, get_seqlen_balanced_partitions, plan_micro_batches, sequence_workloads
from ..planning.dynamic_batching import plan_dynamic_batching
from ..planning.metrics import dp_balance_metrics, dynamic_batching_metrics

if TYPE_CHECKING:  # pragma: no cover
    from ..planning.step import StepPlan

__all__ = [
    "LoadBalancePacker",
    "ROLL_ATTENTION_COEFF",
    "RollBatch",
    "RollError",
    "SequencePackingConfig",
    "SequencePackingPacker",
    "batch_balance",
    "calculate_workload",
    "dynamic_batching_shard",
    "get_sequence_packing_packer",
    "make_micro_batch_iter_for_dynamic_batching",
    "make_micro_batch_iter_for_sequence_packing",
    "make_mini_batch_iter_for_dynamic_batching",
    "restore_results_order",
]

ROLL_ATTENTION_COEFF = WORKLOAD_ATTENTION_COEFF  # ROLL's name for it


class RollBatch(dict):
    """A DataProto-like batch: tensors by name, plus ``meta_info``."""

    def __init__(self, *args, meta_info: Optional[Dict[str, Any]] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.meta_info: Dict[str, Any] = dict(meta_info or {})

    def __eq__(self, other: object) -> bool:
        """Same tensors (element by element) and the same ``meta_info``."""
        if not isinstance(other, RollBatch):
            return NotImplemented
        return values_equal(dict(self), dict(other)) and values_equal(self.meta_info, other.meta_info)

    def __ne__(self, other: object) -> bool:  # dict's own __ne__ would compare the tensors' truth values
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = None  # mutable

    @property
    def num_rows(self) -> int:
        """Rows (``len()`` of a DataProto; ``len()`` of this dict counts keys)."""
        return batch_size(self) if self else 0

    def slice(self, start: int, end: int) -> "RollBatch":
        return RollBatch({k: v[start:end] for k, v in self.items()}, meta_info=copy.deepcopy(self.meta_info))


class RollError(ValueError, AssertionError):
    """Invalid arguments or data of the dynamic-batching functions: a ``ValueError``,
    and also an ``AssertionError`` like ROLL's own checks there, so code (and ROLL's
    tests) catching either keeps working."""


def _int_like(value: Any) -> Any:
    """An integer given as a Python or NumPy integer or a 0-d integer array or tensor,
    as ``int``; anything else (a bool, a float, None) unchanged, for the caller's
    check to refuse by name."""
    try:
        return as_int(value, "value")
    except TypeError:
        return value


def _as_roll_error(exc: ValueError) -> RollError:
    return RollError(*exc.args).with_traceback(exc.__traceback__)


def _guarded(gen: Iterator[Any]) -> Iterator[Any]:
    try:
        yield from gen
    except ValueError as exc:
        if type(exc) is not ValueError:
            raise
        raise _as_roll_error(exc) from None


def _roll_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Plain ``ValueError``s of ``fn`` (and of the generator it returns) become
    :class:`RollError` with the same message; other errors pass unchanged."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            out = fn(*args, **kwargs)
        except ValueError as exc:
            if type(exc) is not ValueError:
                raise
            raise _as_roll_error(exc) from None
        return _guarded(out) if isinstance(out, types.GeneratorType) else out

    return wrapper


def _meta(batch: Any) -> Dict[str, Any]:
    return getattr(batch, "meta_info", None) or {}


def _columns(batch: Any) -> Mapping[str, Any]:
    """The batch's values by name: a DataProto's tensors and non-tensor arrays, or the mapping itself."""
    return proto_columns(batch) if is_data_proto(batch) else batch


def _write_meta(batch: Any, **values: Any) -> None:
    """Keys ROLL writes on its input's ``meta_info`` (a DataProto's, a RollBatch's)."""
    meta = getattr(batch, "meta_info", None)
    if isinstance(meta, MutableMapping):
        meta.update(values)


def _agrees(dp_group: Any) -> bool:
    """Whether the micro-batch count is agreed over a process group. ROLL agrees only
    when ``torch.distributed`` is initialised, so a stand-in ``dp_group`` (ROLL's
    tests pass a bare object) is ignored without one. Initialised, ``dp_group=None``
    is the default group (when it has more than one rank); anything else must be a
    ``ProcessGroup``."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    if dp_group is None:
        return active()
    if not isinstance(dp_group, dist.ProcessGroup):
        raise TypeError(f"dp_group must be a torch.distributed ProcessGroup (or None for the default group) once "
                        f"torch.distributed is initialised, got {type(dp_group).__name__}")
    return True


# ---------------------------------------------------------------- batch balance


def batch_balance(batch: Any, dp_size: int, minibatch_size: int,
                  logging_prefix: str = "global_seqlen", keep_minibatch: bool = False) -> Dict[str, float]:
    """Balance the global batch over ``dp_size`` ranks, in place (ROLL's ``batch_balance``).

    Karmarkar-Karp with equal sizes on the workload ``24576·s + s²`` (``s`` = real
    tokens); each rank's rows ordered small…large…small, then rank 0's rows, rank
    1's... so that the usual contiguous dispatch hands rank ``r`` its part. With
    ``keep_minibatch`` each mini-batch of ``minibatch_size`` rows is balanced on its
    own. A DataProto is reordered with its own ``reorder`` (as ROLL does), a mapping
    key by key. Returns ``{prefix}/min, max, minmax_diff`` (contiguous split),
    ``balanced_min/max`` and ``mean`` in tokens.
    """
    dp_size = as_positive_int(dp_size, "dp_size")
    cols = _columns(batch)
    lengths = mask_lengths(cols)
    n = batch_size(cols)
    if n % dp_size:
        raise ValueError(f"the batch has {n} rows, not a multiple of dp_size={dp_size}")
    work = sequence_workloads(lengths, ROLL_ATTENTION_COEFF)
    if keep_minibatch:
        minibatch_size = _int_like(minibatch_size)
        if type(minibatch_size) is not int or minibatch_size <= 0 or n % minibatch_size or minibatch_size % dp_size:
            raise ValueError(f"keep_minibatch needs a minibatch_size > 0 dividing the batch ({n} rows) and "
                             f"divisible by dp_size={dp_size}, got {minibatch_size!r}")
        parts: List[List[int]] = [[] for _ in range(dp_size)]
        for start in range(0, n, minibatch_size):
            local = get_seqlen_balanced_partitions(work[start:start + minibatch_size], dp_size, equal_size=True)
            for r in range(dp_size):
                parts[r].extend(start + i for i in local[r])
    else:
        parts = get_seqlen_balanced_partitions(work, dp_size, equal_size=True)
    ordered = []
    for part in parts:
        part = sorted(part, key=lambda i: (work[i], i))
        ordered.extend(part[0::2] + part[1::2][::-1])
    if is_data_proto(batch):
        _reorder_proto(batch, cols, ordered)
    else:
        for key, value in select_all(batch, ordered).items():
            batch[key] = value
    return dp_balance_metrics(lengths.tolist(), parts, logging_prefix)


def _reorder_proto(proto: Any, cols: Mapping[str, Any], order: List[int]) -> None:
    if callable(getattr(proto, "reorder", None)):
        import torch

        proto.reorder(torch.as_tensor(order, dtype=torch.long))
        return
    tensors = proto.batch
    tensor_keys = set(tensors.keys()) if tensors is not None else set()
    for key, value in select_all(cols, order).items():
        if key in tensor_keys:
            tensors[key] = value
        else:
            proto.non_tensor_batch[key] = value


# ---------------------------------------------------------------- dynamic batching


@_roll_errors
def dynamic_batching_shard(
    origin_batch: Any,
    dp_size: int,
    max_tokens_per_microbatch: int,
    sequence_length_round: int,
    pipeline_model_parallel_size: Optional[int] = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    log_prefix: Optional[str] = None,
    *,
    keep_dp_partition: bool = False,
    rule: str = "roll",
) -> Tuple[Any, Dict[str, float]]:
    """ROLL's ``dynamic_batching_shard``: rows sorted by length and dealt across DP
    ranks (rank ``r`` gets the ``r``-th contiguous block of the result), and one
    plan of micro-batches shared by every rank: ``[start, end)`` row ranges whose
    rows x padded length (max over ranks, rounded up to ``sequence_length_round``)
    stay within ``max_tokens_per_microbatch``. With pipeline parallelism and VPP the
    count is made a multiple of the PP size by halving ranges.

    ``keep_dp_partition=True``: the batch is already dispatched in contiguous
    per-rank blocks (e.g. by :func:`batch_balance`); rows are sorted within each
    block and the balance is kept. ``rule="optimal"``: the fewest padded tokens.

    Returns ``(batch, metrics)``: a DataProto of the input's class (its own
    ``select_idxs``) or a :class:`RollBatch`, whose ``meta_info`` (a copy of the
    input's) holds ``micro_batch_indices``/``micro_batch_lengths`` (and their
    ``global_`` copies) and ``num_micro_batchs``; the input is not modified.
    """
    dp_size = as_positive_int(dp_size, "dp_size")
    pp = _pp_size(pipeline_model_parallel_size)
    if rule not in ("roll", "optimal"):
        raise ValueError(f"rule must be 'roll' or 'optimal', got {rule!r}")
    cols = _columns(origin_batch)
    lengths = mask_lengths(cols, "origin_batch")
    n = batch_size(cols, "origin_batch")
    _check_right_padded(host_mask(cols, "origin_batch"), lengths)
    if n % dp_size:
        raise ValueError(f"the batch has {n} rows, not a multiple of dp_size={dp_size}")
    if (lengths == 0).any():
        warnings.warn(f"The attention_mask is all zero in the {log_prefix} stage. Please verify the rollout stage.")
    split_pp = pp if (pp > 1 and virtual_pipeline_model_parallel_size) or rule == "optimal" else 1
    per_rank = n // dp_size
    if keep_dp_partition:
        blocks = [np.argsort(lengths[r * per_rank:(r + 1) * per_rank], kind="stable") + r * per_rank
                  for r in range(dp_size)]
        order = np.concatenate(blocks).tolist() if blocks else []
        # Position j's width is the longest j-th row over ranks: plan over those widths.
        widths = np.max(np.stack([lengths[b] for b in blocks]), axis=0) if per_rank else np.zeros(0, np.int64)
        plan = plan_dynamic_batching(widths, 1, max_tokens_per_microbatch, sequence_length_round, rule=rule,
                                     pp_size=split_pp)
        padded_tokens = plan.padded_tokens * dp_size
    else:
        plan = plan_dynamic_batching(lengths, dp_size, max_tokens_per_microbatch, sequence_length_round, rule=rule,
                                     pp_size=split_pp)
        order = plan.sorted_indices
        padded_tokens = plan.padded_tokens
    ranges, widths_per_mb = (plan.micro_batch_indices[0], plan.micro_batch_lengths[0]) if per_rank else ([], [])
    meta = copy.deepcopy(_meta(origin_batch))
    meta.update(global_micro_batch_indices=ranges, global_micro_batch_lengths=widths_per_mb,
                micro_batch_indices=copy.deepcopy(ranges), micro_batch_lengths=list(widths_per_mb),
                num_micro_batchs=len(ranges))
    if is_data_proto(origin_batch):
        out = proto_select(origin_batch, order, "origin_batch")
        out.meta_info = meta
    else:
        out = RollBatch(select_all(cols, order), meta_info=meta)
    width = int(np.shape(cols["attention_mask"])[1])
    metrics = dynamic_batching_metrics(int(lengths.sum()), padded_tokens, n, width, log_prefix)
    return out, metrics


def _pp_size(pipeline_model_parallel_size: Any) -> int:
    """ROLL's PP size: ``None`` is 1; otherwise a positive int (0 is an error, not 1)."""
    if pipeline_model_parallel_size is None:
        return 1
    return as_positive_int(pipeline_model_parallel_size, "pipeline_model_parallel_size")


def _check_right_padded(mask: np.ndarray, lengths: np.ndarray) -> None:
    """Dynamic batching keeps each micro-batch's first ``length`` columns: a row whose
    real tokens do not start at column 0 would lose them (seqpack's THD packing takes
    any padding; this path needs right padding). ``lengths`` are the rows' non-zero
    counts, so a row is right-padded when it is full or its first zero is at column
    ``length``; a bool mask is read in place (no [B, S] temporaries)."""
    if mask.shape[1] == 0:
        return
    m = mask if mask.dtype == np.bool_ else mask != 0
    first_zero = np.argmin(m, axis=1)
    bad = np.nonzero((lengths < m.shape[1]) & (first_zero != lengths))[0]
    if bad.size:
        raise ValueError(f"origin_batch['attention_mask'] row {int(bad[0])} is not right-padded (its real tokens do "
                         "not start at column 0): dynamic batching cuts columns past each micro-batch's longest row, "
                         "so left-padded tokens would be dropped; right-pad the batch or use sequence packing")


def _check_ranges(ranges: Sequence[Sequence[int]], lengths: Sequence[Any], rows: int) -> None:
    if rows == 0:
        if ranges:
            raise ValueError("an empty batch cannot have micro-batch ranges")
        return
    if not ranges:
        raise ValueError("global micro-batch ranges are missing for a non-empty batch")
    expected = 0
    for i, ((start, end), length) in enumerate(zip(ranges, lengths)):
        if not all(isinstance(x, Integral) and not isinstance(x, bool) for x in (start, end)):
            raise ValueError(f"micro-batch range {i} must contain integer offsets, got [{start!r}, {end!r}]")
        if start != expected:
            raise ValueError(f"global micro-batch ranges must be sorted and contiguous: expected start {expected}, "
                             f"got {start}")
        if not start < end <= rows:
            raise ValueError(f"global micro-batch range [{start}, {end}) is empty or beyond the {rows} rows")
        if isinstance(length, bool) or not isinstance(length, Integral) or length <= 0:
            raise ValueError(f"micro-batch length must be a positive integer, got {length!r} (range {i})")
        expected = end
    if expected != rows:
        raise ValueError(f"global micro-batch ranges must cover the complete local batch: they end at {expected}, "
                         f"the batch has {rows} rows")


def _rows(data: Any, name: str) -> int:
    if is_data_proto(data):
        return len(data)
    return batch_size(data, name) if len(data) else 0


@_roll_errors
def make_mini_batch_iter_for_dynamic_batching(
    data: Any,
    epochs: int,
    ga_steps: int = 1,
    keep_mini_batch: bool = False,
    mini_batch_size: Optional[int] = None,
    pipeline_model_parallel_size: Optional[int] = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
) -> Iterator[Any]:
    """Mini-batches (optimizer steps) of one rank's dynamically batched data.

    Groups ``ga_steps`` consecutive micro-batches per mini-batch, or with
    ``keep_mini_batch`` cuts the ranges at every ``mini_batch_size`` rows (and
    splits each group to a multiple of the PP size under VPP). Each yielded batch
    (the DataProto's own ``slice``, or a :class:`RollBatch`) carries its own
    ``micro_batch_indices`` (relative), ``micro_batch_lengths``,
    ``mini_batch_size`` and ``num_micro_batchs``; ``data.meta_info`` is untouched.
    The layout is checked when called (ROLL: at the first ``next()``).
    """
    meta = _meta(data)
    ranges = [list(r) for r in meta.get("global_micro_batch_indices", [])]
    lengths = list(meta.get("global_micro_batch_lengths", []))
    ga_steps = as_positive_int(ga_steps, "ga_steps")
    if len(ranges) != len(lengths):
        raise ValueError("global_micro_batch_indices and global_micro_batch_lengths differ in length")
    rows = _rows(data, "data")
    _check_ranges(ranges, lengths, rows)
    pp = _pp_size(pipeline_model_parallel_size)
    groups: List[Tuple[List[List[int]], List[int]]] = []
    if keep_mini_batch:
        mini_batch_size = _int_like(mini_batch_size)
        if type(mini_batch_size) is not int or mini_batch_size <= 0 or rows % mini_batch_size:
            raise ValueError(f"keep_mini_batch needs a mini_batch_size > 0 dividing the {rows} rows, "
                             f"got {mini_batch_size!r}")
        for g in range(rows // mini_batch_size):
            lo, hi = g * mini_batch_size, (g + 1) * mini_batch_size
            pieces = [([max(s, lo), min(e, hi)], n) for (s, e), n in zip(ranges, lengths) if s < hi and e > lo]
            idx, lens = [p[0] for p in pieces], [p[1] for p in pieces]
            if pp > 1 and virtual_pipeline_model_parallel_size:
                try:
                    idx, lens = _core.split_ranges_to_multiple(idx, lens, pp)
                except ValueError as exc:
                    raise ValueError(f"logical mini-batch {g}: {exc}") from None
            groups.append((idx, lens))
    else:
        for i in range(0, len(ranges), ga_steps):
            groups.append((ranges[i:i + ga_steps], lengths[i:i + ga_steps]))
    epochs = as_positive_int(epochs, "epochs", allow_zero=True)
    proto = is_data_proto(data)

    def gen():
        for _ in range(epochs):
            for idx, lens in groups:
                start, end = idx[0][0], idx[-1][1]
                if proto:
                    mb = proto_slice(data, start, end, "data")
                    mb.meta_info = copy.deepcopy(meta)
                else:
                    mb = RollBatch({k: v[start:end] for k, v in data.items()}, meta_info=copy.deepcopy(meta))
                mb.meta_info.update(micro_batch_indices=[[s - start, e - start] for s, e in idx],
                                    micro_batch_lengths=list(lens), mini_batch_size=end - start,
                                    num_micro_batchs=len(idx))
                yield mb

    return gen()


def _narrow(key: str, v: Any, width: int, ndim: int, length: int) -> Any:
    """ROLL's column cut: tensors with ``input_ids``' rank (or ``position_ids``) as
    wide as ``input_ids`` keep ``length`` columns, one narrower ``length - 1``."""
    if is_tensor(v) and (v.dim() == ndim or key == "position_ids") and v.shape[-1] in (width, width - 1):
        return v.narrow(-1, 0, length if v.shape[-1] == width else length - 1)
    return v


@_roll_errors
def make_micro_batch_iter_for_dynamic_batching(mini_batch: Any) -> Iterator[Any]:
    """The micro-batches of a mini-batch, each cut to its padded length (columns of
    tensors as wide as ``input_ids``, or one less, and ``position_ids``; right-padded
    data). A DataProto's micro-batches are its own ``slice``s with their ``batch``
    tensors cut (non-tensor values whole), as ROLL does."""
    meta = _meta(mini_batch)
    proto = is_data_proto(mini_batch)
    ids = _columns(mini_batch)["input_ids"]
    width = ids.shape[-1]
    ndim = ids.dim()

    def gen():
        for length, (start, end) in zip(meta["micro_batch_lengths"], meta["micro_batch_indices"]):
            if proto:
                mb = proto_slice(mini_batch, start, end, "mini_batch")
                mb.meta_info = copy.deepcopy(meta)
                tensors = mb.batch
                for key in list(tensors.keys()):
                    v = tensors[key]
                    cut = _narrow(key, v, width, ndim, length)
                    if cut is not v:
                        tensors[key] = cut
            else:
                mb = RollBatch(meta_info=copy.deepcopy(meta))
                for key, v in mini_batch.items():
                    mb[key] = _narrow(key, v[start:end], width, ndim, length)
            yield mb

    return gen()


# ---------------------------------------------------------------- sequence packing


def calculate_workload(seqlen: Any) -> Any:
    """ROLL's workload of a sequence (a FLOPs proxy): ``24576·s + s²``, for an int,
    a NumPy array or a tensor of lengths.

    >>> calculate_workload(1000)
    25576000
    """
    return ROLL_ATTENTION_COEFF * seqlen + seqlen * seqlen


def _roll_pad_factor(cp_size: Any, tp_size: Any) -> int:
    """ROLL's ``get_pad_factor`` (its packer's and its Megatron strategy's):
    ``lcm(16, 2·CP·TP)`` with CP, ``lcm(16, TP)`` without."""
    return math.lcm(16, alignment(cp_size, tp_size, rule="roll"))


def _phase_value(config: Any, is_train: bool, name: str, default: Any = None) -> Any:
    """``config.<name>_train`` / ``_forward`` (ROLL's fields), else ``config.<name>``."""
    value = getattr(config, f"{name}_{'train' if is_train else 'forward'}", None)
    if value is None:
        value = getattr(config, name, None)
    return default if value is None else value


def _roll_packing_metrics(lengths: np.ndarray, width: int, parts: Sequence[Sequence[int]],
                          phase: str) -> Dict[str, float]:
    """ROLL's ``sequence_packing_metrics`` (real tokens, ``{phase}/`` keys)."""
    n, k = int(lengths.size), len(parts)
    per_mb = [int(lengths[list(p)].sum()) if len(p) else 0 for p in parts]
    top = max(per_mb) if per_mb else 1
    low = min(per_mb) if per_mb else 0
    return {
        f"{phase}/num_micro_batches": float(k),
        f"{phase}/effective_ratio": float(lengths.sum()) / (n * width) if n * width > 0 else 0.0,
        f"{phase}/seq_len_balance_ratio": low / top if top > 0 else 0.0,
        f"{phase}/avg_samples_per_pack": n / k if k > 0 else 0.0,
    }


def _phase_metrics(cols: Mapping[str, Any], parts: Sequence[Sequence[int]], phase: str) -> Dict[str, float]:
    if "attention_mask" not in cols:  # algorithm "none" runs without one
        return {}
    return _roll_packing_metrics(mask_lengths(cols, "mini_batch"), int(np.shape(cols["attention_mask"])[1]), parts,
                                 phase)


def make_micro_batch_iter_for_sequence_packing(
    mini_batch: Any,
    tp_size: int = 1,
    cp_size: int = 1,
    vp_size: Optional[int] = 1,
    is_train: bool = False,
    dp_group=None,
    micro_batch_size: Optional[int] = None,
    config: Any = None,
    pp_size: Optional[int] = None,
    *,
    max_packed_sequence_length: Optional[int] = None,
    algorithm: Optional[str] = None,
    min_num_micro_batches: Optional[int] = None,
    pad_multiple: Optional[int] = None,
    step_plan: Optional["StepPlan"] = None,
    dp_rank: Optional[int] = None,
    mini_batch_index: int = 0,
    strict: bool = True,
    shared_prefix: bool = False,
    group_key: Optional[str] = None,
) -> Iterator[Any]:
    """Micro-batches of a mini-batch for sequence packing (ROLL ``algorithm``
    ``"none"``: consecutive chunks of ``micro_batch_size`` rows; ``"load_balance"``:
    balanced micro-batches under a hard cap).

    ROLL's positional form ``(mini_batch, tp_size, cp_size, vp_size, is_train,
    dp_group, micro_batch_size, config, pp_size)`` with a :class:`SequencePackingConfig`
    (or ROLL's own) runs that config's packer (:func:`get_sequence_packing_packer`):
    its algorithm, the phase's cap and minimum (``is_train``), ROLL's pad factor
    ``lcm(16, 2·CP·TP)`` and, with ``vp_size > 1``, a count that is a multiple of
    ``pp_size``. Without ``config`` the keywords say it all: ``algorithm``
    (default ``"load_balance"``), ``max_packed_sequence_length``,
    ``min_num_micro_batches`` (default 1), every sequence padded to ``pad_multiple``
    (default ``2·CP·TP`` with CP, ``TP`` without) and a count that is a multiple of
    ``vp_size`` (of ``pp_size`` when it is given and ``vp_size > 1``). A keyword
    given with ``config`` overrides the config's value.

    ``load_balance``: at least ``min_num_micro_batches``, the fewest such that
    Karmarkar-Karp (or LPT) balances the workload ``24576·s + s²`` with every
    micro-batch's padded tokens <= the cap; when ``torch.distributed`` is
    initialised every rank of ``dp_group`` (``None``: the default group) uses the
    largest rank's count. Without an initialised process group no collective runs,
    whatever ``dp_group`` is (ROLL's tests pass a stand-in object). Micro-batches run
    light, heavy, ..., heavy, light (pipeline bubbles at the ends are small).

    ``strict=False`` restores ROLL's rules exactly: ``load_balance`` takes
    ``max(1, ceil(padded tokens / cap))`` micro-batches (at most the rows, at least
    the minimum, the largest rank's, rounded up to the multiple), Karmarkar-Karp on
    the workloads of the padded lengths, ordered as ROLL orders them, so a
    micro-batch can exceed the cap; ``none`` takes ``rows // micro_batch_size``
    chunks of ``np.array_split`` sizes instead of requiring the size to divide the
    rows. A sequence longer than the cap is refused either way.

    ``step_plan`` (with ``dp_rank``, ``mini_batch_index``): rank ``dp_rank``'s
    micro-batches of that mini-batch from a :func:`seqpack.plan_step` plan
    (``mini_batch`` holds ``step_plan.rank_rows(dp_rank, mini_batch_index)``); the
    count is the same on every rank by construction, so no collective runs. An
    empty micro-batch is yielded as a one-row dummy (one token, zero loss masks)
    with ``is_padding_batch=True``: drop its outputs before
    :func:`restore_results_order`. Plan on the lengths as packed (each rounded up
    to the pad multiple) so that the cap holds after padding.

    ``shared_prefix`` (seqpack's ``sequence_packing_args.shared_prefix``;
    ``load_balance``, ``strict``): plan prefix trees of the rows (the trie of
    ``input_ids`` under ``attention_mask``; rows share only within one value of the
    ``group_key`` column when given): each micro-batch's *physical* tokens, padded
    as a whole to the pad multiple, stay under the cap, and a tree that fits stays
    whole. Each micro-batch's ``meta_info["prefix_tree"]`` is its rows'
    :class:`~seqpack.PrefixTreeBatch` (padded to the pad multiple). With
    ``step_plan`` the plan decides the micro-batches (plan it with ``forest=``) and
    each still gets its tree.

    A DataProto's micro-batches are its own ``select_idxs`` (its class); a mapping's
    are :class:`RollBatch`. As ROLL, the mini-batch's own ``meta_info`` (a
    DataProto's or a RollBatch's) gets ``partition_indices_list`` and
    ``sequence_packing_metrics`` (and, for ``"none"``, ``num_micro_batchs``), written
    when this is called. Each micro-batch's ``meta_info`` is a copy of it plus
    ``micro_batch_idx``, ``num_micro_batchs``, ``partition_indices``,
    ``partition_indices_list``, ``mini_batch_size`` and ``is_padding_batch``.
    ``sequence_packing_metrics`` holds ROLL's ``{train|forward}/num_micro_batches``,
    ``/effective_ratio``, ``/seq_len_balance_ratio``, ``/avg_samples_per_pack`` and
    seqpack's own (``load_balance``: ``num_micro_batches``, ``max_packed_tokens``,
    ``mean_packed_tokens``, ``fill``, ``workload_imbalance``, ``padding_tokens``).
    """
    if config is not None:
        packer = get_sequence_packing_packer(config) if algorithm is None else _packer_for(algorithm, config)
        return packer.make_micro_batch_iter_for_sequence_packing(
            mini_batch, tp_size, cp_size, vp_size, is_train, dp_group, micro_batch_size,
            1 if pp_size is None else pp_size, max_packed_sequence_length=max_packed_sequence_length,
            min_num_micro_batches=min_num_micro_batches, pad_multiple=pad_multiple, step_plan=step_plan,
            dp_rank=dp_rank, mini_batch_index=mini_batch_index, strict=strict, shared_prefix=shared_prefix,
            group_key=group_key)
    return _sequence_packing(
        mini_batch, algorithm="load_balance" if algorithm is None else algorithm, cap=max_packed_sequence_length,
        min_num=1 if min_num_micro_batches is None else min_num_micro_batches, pad_multiple=pad_multiple,
        pad_rule=lambda cp, tp: alignment(cp, tp, rule="roll"), tp_size=tp_size, cp_size=cp_size, vp_size=vp_size,
        pp_size=pp_size, is_train=is_train, dp_group=dp_group, micro_batch_size=micro_batch_size,
        step_plan=step_plan, dp_rank=dp_rank, mini_batch_index=mini_batch_index, strict=strict,
        shared_prefix=shared_prefix, group_key=group_key)


def _sequence_packing(mini_batch: Any, *, algorithm: Any, cap: Any, min_num: Any, pad_multiple: Any,
                      pad_rule: Callable[[int, int], int], tp_size: Any, cp_size: Any, vp_size: Any, pp_size: Any,
                      is_train: bool, dp_group: Any, micro_batch_size: Any, step_plan: Any, dp_rank: Any,
                      mini_batch_index: Any, strict: bool = True, shared_prefix: bool = False,
                      group_key: Optional[str] = None) -> Iterator[Any]:
    phase = "train" if is_train else "forward"
    cols = _columns(mini_batch)
    meta = getattr(mini_batch, "meta_info", None)
    if not isinstance(meta, MutableMapping):
        meta = {}
    if shared_prefix and algorithm != "load_balance":
        raise ValueError(f"shared_prefix plans prefix trees with algorithm 'load_balance', got {algorithm!r}")
    if algorithm == "none":
        n = batch_size(cols, "mini_batch")
        if strict:
            micro_batch_size = _int_like(micro_batch_size)
            if type(micro_batch_size) is not int or micro_batch_size <= 0 or n % micro_batch_size:
                raise ValueError(f"algorithm 'none' needs a micro_batch_size > 0 dividing the {n} rows, "
                                 f"got {micro_batch_size!r}")
            parts = [list(range(s, s + micro_batch_size)) for s in range(0, n, micro_batch_size)]
        else:  # ROLL: rows // micro_batch_size chunks, np.array_split's sizes
            micro_batch_size = _int_like(micro_batch_size)
            if type(micro_batch_size) is not int or not 0 < micro_batch_size <= n:
                raise ValueError(f"algorithm 'none' needs a micro_batch_size in [1, {n}] (the rows), "
                                 f"got {micro_batch_size!r}")
            parts = [p.tolist() for p in np.array_split(np.arange(n), n // micro_batch_size)]
        metrics = _phase_metrics(cols, parts, phase)
        _write_meta(mini_batch, partition_indices_list=[], num_micro_batchs=len(parts),
                    sequence_packing_metrics=dict(metrics))
        return _yield_parts(mini_batch, cols, meta, parts, n, metrics, reorder=False)
    if step_plan is not None:
        n = batch_size(cols, "mini_batch")
        cap = None if cap is None else as_positive_int(cap, "max_packed_sequence_length")
        parts = step_plan_parts(step_plan, dp_rank, mini_batch_index, n, cap, "max_packed_sequence_length")
        metrics = {**step_plan.metrics, **_phase_metrics(cols, parts, phase)}
        _write_meta(mini_batch, partition_indices_list=[list(p) for p in parts],
                    sequence_packing_metrics=dict(metrics))
        trees = None
        if shared_prefix:  # the plan decides (plan it with forest=); each micro-batch still gets its tree
            groups = padded_forest(cols, group_key, missing_group_ok=False)[1]
            trees = _tree_maker(groups, _pad_of(pad_rule, pad_multiple, tp_size, cp_size))
        return _yield_parts(mini_batch, cols, meta, parts, n, metrics, reorder=True, trees=trees)
    agree = _agrees(dp_group)
    box: Dict[str, Any] = {}

    def plan_with(count: int) -> MicroBatchPlan:
        if not strict:
            return _roll_soft_plan(box["padded"], box["cap"], count)
        forest = box.get("forest")
        if forest is not None:  # trees padded as a whole: physical tokens under the cap rounded down
            usable = box["cap"] // box["pad"] * box["pad"]
            return plan_micro_batches(forest.lengths, usable, min_num=count, multiple_of=box["multiple"],
                                      attention_coeff=ROLL_ATTENTION_COEFF, order="small_at_ends", forest=forest)
        return plan_micro_batches(box["padded"], box["cap"], min_num=count, multiple_of=box["multiple"],
                                  attention_coeff=ROLL_ATTENTION_COEFF, order="small_at_ends")

    def local() -> MicroBatchPlan:  # every check that can differ between ranks, inside the agreement
        box["n"] = n = batch_size(cols, "mini_batch")
        if algorithm != "load_balance":
            raise ValueError(f"Illegal sequence packing algorithm {algorithm!r}, algorithm must be in "
                             "['none', 'load_balance']")
        if cap is None:
            raise ValueError("max_packed_sequence_length is required with algorithm 'load_balance'")
        box["cap"] = limit = as_positive_int(cap, "max_packed_sequence_length")
        multiple = _pad_of(pad_rule, pad_multiple, tp_size, cp_size)
        box["padded"] = padded = round_up(mask_lengths(cols, "mini_batch"), multiple)
        box["pad"] = multiple
        if shared_prefix:
            box["forest"], box["groups"] = _shared_prefix_forest(cols, group_key, strict, multiple, limit)
        elif n and padded.max() > limit:
            raise ValueError(f"a sequence padded to {int(padded.max())} tokens (pad multiple {multiple}) exceeds "
                             f"max_packed_sequence_length={limit}")
        vp = 1 if vp_size is None else as_positive_int(vp_size, "vp_size")
        if pp_size is None:
            box["multiple"] = vp
        else:
            pp = as_positive_int(pp_size, "pp_size")
            box["multiple"] = pp if vp > 1 else 1
        least = as_positive_int(min_num, "min_num_micro_batches")
        if not strict:  # ROLL's count; rounding before the agreement's max is the same as after
            count = max(min(max(1, -(-int(padded.sum()) // limit)), n), least)
            return plan_with(-(-count // box["multiple"]) * box["multiple"])
        return plan_with(least)

    plan = checked_on_every_rank(local, dp_group, "make_micro_batch_iter_for_sequence_packing", agree)
    if agree:
        plan = agree_on_count(plan.num_micro_batches, plan_with, lambda p: p.num_micro_batches, dp_group,
                              "make_micro_batch_iter_for_sequence_packing")
    n, limit, padded = box["n"], box["cap"], box["padded"]
    lengths = mask_lengths(cols)
    metrics = {
        **_roll_packing_metrics(lengths, int(np.shape(cols["attention_mask"])[1]), plan.micro_batches, phase),
        "num_micro_batches": plan.num_micro_batches,
        "max_packed_tokens": max(plan.tokens) if plan.tokens else 0,
        "mean_packed_tokens": float(np.mean(plan.tokens)) if plan.tokens else 0.0,
        "fill": float(np.sum(plan.tokens)) / (limit * plan.num_micro_batches) if plan.tokens else 0.0,
        "workload_imbalance": plan.imbalance,
        "padding_tokens": int(padded.sum() - lengths.sum()),
    }
    if shared_prefix:
        metrics["padding_tokens"] = int(sum(round_up(t, box["pad"]) - t for t in plan.tokens))
        metrics["sharing_kept"] = plan.sharing_kept
    _write_meta(mini_batch, partition_indices_list=[list(p) for p in plan.micro_batches],
                sequence_packing_metrics=dict(metrics))
    trees = _tree_maker(box["groups"], box["pad"]) if shared_prefix else None
    return _yield_parts(mini_batch, cols, meta, plan.micro_batches, n, metrics, reorder=True, trees=trees)


def _pad_of(pad_rule: Callable[[int, int], int], pad_multiple: Any, tp_size: Any, cp_size: Any) -> int:
    """Every sequence's (or tree's) pad multiple: ``pad_multiple``, else the rule's."""
    tp, cp = as_positive_int(tp_size, "tp_size"), as_positive_int(cp_size, "cp_size")
    if pad_multiple is not None:
        return as_positive_int(pad_multiple, "pad_multiple")
    return as_positive_int(pad_rule(cp, tp), "the pad factor")


def _shared_prefix_forest(cols: Mapping[str, Any], group_key: Optional[str], strict: bool, multiple: int,
                          cap: int):
    """``(forest, group ids or None)`` of a mini-batch's rows for ``shared_prefix``."""
    if not strict:
        raise ValueError("shared_prefix plans prefix trees with seqpack's planner: it needs strict=True")
    usable = cap // multiple * multiple  # a tree is padded as a whole to the pad multiple
    longest = int(mask_lengths(cols, "mini_batch").max(initial=0))
    if longest > usable:
        raise ValueError(f"a sequence of {longest} tokens exceeds max_packed_sequence_length={cap} (with trees "
                         f"padded to the pad multiple {multiple}: {usable} tokens)")
    return padded_forest(cols, group_key, missing_group_ok=False)


def _tree_maker(groups: Optional[List[int]], multiple: int) -> Callable[[Mapping[str, Any], Sequence[int]], Any]:
    """``tree(columns, part)``: the :class:`~seqpack.PrefixTreeBatch` of a yielded
    micro-batch (its own columns: a dummy's one row too), padded to ``multiple``;
    ``part`` (its rows in the mini-batch) picks their groups."""
    def tree(mb_cols: Mapping[str, Any], part: Sequence[int]):
        from ..tensors.prefix_tree import PrefixTreeBatch

        ids = None if groups is None or not part else [groups[i] for i in part]
        return PrefixTreeBatch.from_padded(mb_cols["input_ids"], mb_cols["attention_mask"], group_ids=ids,
                                           pad_to_multiple_of=multiple)
    return tree


def _roll_soft_plan(padded: np.ndarray, cap: int, count: int) -> MicroBatchPlan:
    """ROLL's ``LoadBalancePacker`` plan for ``count`` micro-batches: Karmarkar-Karp
    on ``24576·s + s²`` of the padded lengths, micro-batches sorted by (workload,
    first row) descending and laid out ``[::2][::-1] + [1::2]``; no cap check."""
    work = calculate_workload(padded.astype(np.int64))
    parts = get_seqlen_balanced_partitions(work, count, equal_size=False)
    keyed = sorted(((p, int(work[p].sum()), p[0] if p else 0) for p in parts), key=lambda x: (x[1], x[2]),
                   reverse=True)
    ordered = [list(x[0]) for x in keyed]
    ordered = ordered[::2][::-1] + ordered[1::2]
    return MicroBatchPlan(micro_batches=ordered, tokens=[int(padded[p].sum()) for p in ordered],
                          workloads=[int(work[p].sum()) for p in ordered], max_tokens=cap,
                          lower_bound=max(1, -(-int(padded.sum()) // cap)), method="karmarkar_karp",
                          order="small_at_ends")


def _proto_dummy(proto: Any, cols: Mapping[str, Any]) -> Any:
    """A one-row DataProto of the input's class: row 0 with the values of
    :func:`dummy_row` (one real token, zero loss masks)."""
    row = dummy_row(cols, name="mini_batch")
    out = proto_select(proto, [0], "mini_batch")
    tensors = out.batch
    tensor_keys = set(tensors.keys()) if tensors is not None else set()
    for key, value in row.items():
        if key in tensor_keys:
            tensors[key] = value
        else:
            out.non_tensor_batch[key] = value
    return out


def _yield_parts(batch: Any, cols: Mapping[str, Any], meta: Dict[str, Any], parts: Sequence[Sequence[int]], n: int,
                 metrics: Dict[str, Any], reorder: bool,
                 trees: Optional[Callable[[Mapping[str, Any], Sequence[int]], Any]] = None) -> Iterator[Any]:
    proto = is_data_proto(batch)

    def gen():
        for k, part in enumerate(parts):
            if proto:
                mb = proto_select(batch, part, "mini_batch") if part else _proto_dummy(batch, cols)
                mb.meta_info = copy.deepcopy(meta)
            else:
                mb = RollBatch(select_all(cols, part) if part else dummy_row(cols, name="mini_batch"),
                               meta_info=copy.deepcopy(meta))
            mb.meta_info.update(micro_batch_idx=k, num_micro_batchs=len(parts), partition_indices=list(part),
                                partition_indices_list=[list(p) for p in parts] if reorder else [],
                                mini_batch_size=n, is_padding_batch=not part, sequence_packing_metrics=dict(metrics))
            if trees is not None:
                mb.meta_info["prefix_tree"] = trees(_columns(mb), part)
            yield mb

    return gen()


def restore_results_order(results: Mapping[str, Any], partition_indices_list: Sequence[Sequence[int]],
                          config: Any = None) -> Dict[str, Any]:
    """Put per-row results of the packed micro-batches (concatenated in the order
    they were yielded) back in the mini-batch's row order. Scalars and non-tensor
    values pass through; an empty ``partition_indices_list`` (algorithm ``none``)
    changes nothing, nor does a ROLL ``config`` whose algorithm is ``"none"``
    (``results`` is returned as it is, as ROLL does)."""
    if config is not None and getattr(config, "algorithm", None) == "none":
        return results  # type: ignore[return-value]
    if not results:
        return {}
    if not partition_indices_list:
        return dict(results)
    flat = [i for part in partition_indices_list for i in part]
    if sorted(flat) != list(range(len(flat))):
        raise ValueError(f"partition_indices_list must hold each of the {len(flat)} rows 0..{len(flat) - 1} exactly "
                         "once (a permutation); it has duplicates or gaps")
    inverse = np.empty(len(flat), dtype=np.int64)
    inverse[np.asarray(flat, dtype=np.int64)] = np.arange(len(flat))
    out = {}
    for key, value in results.items():
        if is_tensor(value) and value.dim() > 0:
            if value.shape[0] != len(flat):
                raise ValueError(f"results[{key!r}] has {value.shape[0]} rows, the partitions {len(flat)}")
            import torch

            out[key] = value.index_select(0, torch.from_numpy(inverse).to(value.device))
        else:
            out[key] = value
    return out


# ---------------------------------------------------------------- ROLL's packer classes


@dataclass
class SequencePackingConfig:
    """ROLL's ``sequence_packing_args`` (``roll.configs.worker_config.SequencePackingConfig``):
    the same fields and defaults. ``max_packed_sequence_length`` (an older ROLL's
    single cap) is read for a phase whose own cap is ``None``."""

    algorithm: str = "none"
    max_packed_sequence_length_forward: Optional[int] = None
    max_packed_sequence_length_train: Optional[int] = None
    min_num_micro_batches_forward: int = 1
    min_num_micro_batches_train: int = 1
    max_packed_sequence_length: Optional[int] = None


class SequencePackingPacker(ValueEquality):
    """ROLL's packer for ``algorithm: none``: consecutive chunks of
    ``micro_batch_size`` rows (here their count must divide the rows), order kept.

    ``config`` is a :class:`SequencePackingConfig` or ROLL's own (read by attribute).
    """

    algorithm = "none"

    def __init__(self, config: Any = None):
        self.config = config if config is not None else SequencePackingConfig()

    def get_pad_factor(self, cp_size: int, tp_size: int) -> int:
        """ROLL's pad multiple: ``lcm(16, 2·CP·TP)`` with CP, ``lcm(16, TP)`` without."""
        return _roll_pad_factor(cp_size, tp_size)

    calculate_workload = staticmethod(calculate_workload)

    @staticmethod
    def ceildiv(a: int, b: int) -> int:
        return -(a // -b)

    def make_micro_batch_iter_for_sequence_packing(
        self, mini_batch: Any, tp_size: int = 1, cp_size: int = 1, vp_size: Optional[int] = 1,
        is_train: bool = False, dp_group=None, micro_batch_size: Optional[int] = None, pp_size: int = 1, *,
        max_packed_sequence_length: Optional[int] = None, min_num_micro_batches: Optional[int] = None,
        pad_multiple: Optional[int] = None, step_plan: Optional["StepPlan"] = None, dp_rank: Optional[int] = None,
        mini_batch_index: int = 0, strict: bool = True, shared_prefix: bool = False, group_key: Optional[str] = None,
    ) -> Iterator[Any]:
        """ROLL's signature; see :func:`make_micro_batch_iter_for_sequence_packing`
        (the keywords after ``pp_size`` are seqpack's and override the config)."""
        cap = (_phase_value(self.config, is_train, "max_packed_sequence_length")
               if max_packed_sequence_length is None else max_packed_sequence_length)
        min_num = (_phase_value(self.config, is_train, "min_num_micro_batches", 1)
                   if min_num_micro_batches is None else min_num_micro_batches)
        return _sequence_packing(
            mini_batch, algorithm=self.algorithm, cap=cap, min_num=min_num, pad_multiple=pad_multiple,
            pad_rule=self.get_pad_factor, tp_size=tp_size, cp_size=cp_size, vp_size=vp_size,
            pp_size=1 if pp_size is None else pp_size, is_train=is_train, dp_group=dp_group,
            micro_batch_size=micro_batch_size, step_plan=step_plan, dp_rank=dp_rank,
            mini_batch_index=mini_batch_index, strict=strict, shared_prefix=shared_prefix, group_key=group_key)

    @staticmethod
    def restore_results_order(results: Mapping[str, Any], partition_indices_list: Sequence[Sequence[int]]) -> Any:
        """Nothing to restore: the rows kept their order (``results`` as it is)."""
        return results


class LoadBalancePacker(SequencePackingPacker):
    """ROLL's packer for ``algorithm: load_balance``, over seqpack's planner
    (:func:`seqpack.plan_micro_batches`): the same signature, metadata and
    ``partition_indices_list`` written on the mini-batch, but a **hard** cap (ROLL
    splits into ``ceil(tokens / cap)`` parts, which can exceed it; ``strict=False``
    restores that). ``dp_group`` may be ``None``; without an initialised process
    group no collective runs."""

    algorithm = "load_balance"

    @staticmethod
    def roundup_divisible(a: int, b: int) -> int:
        return ((a + b - 1) // b) * b

    @staticmethod
    def calculate_workload_batch(seqlen_tensor: Any) -> Any:
        return calculate_workload(seqlen_tensor)

    @staticmethod
    def get_device_name() -> str:
        import torch

        return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"

    @staticmethod
    def restore_results_order(results: Mapping[str, Any], partition_indices_list: Sequence[Sequence[int]]) -> Any:
        """:func:`restore_results_order`."""
        return restore_results_order(results, partition_indices_list)


def _packer_for(algorithm: Any, config: Any) -> SequencePackingPacker:
    if algorithm == "load_balance":
        return LoadBalancePacker(config)
    if algorithm == "none":
        return SequencePackingPacker(config)
    raise ValueError(f"Illegal sequence packing algorithm {algorithm!r}, algorithm must be in "
                     "['none', 'load_balance']")


def get_sequence_packing_packer(config: Any = None) -> SequencePackingPacker:
    """ROLL's factory: the packer of ``config.algorithm`` (``None``: a default
    :class:`SequencePackingConfig`, algorithm ``"none"``)."""
    if config is None:
        config = SequencePackingConfig()
    return _packer_for(getattr(config, "algorithm", "none"), config)
