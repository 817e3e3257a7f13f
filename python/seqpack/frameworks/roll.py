"""ROLL's balancing and micro-batching, on DataProto-like mappings.

A batch is a mapping of tensors (and NumPy arrays or lists) sharing dimension 0,
with an ``attention_mask [B, S]``; results are :class:`RollBatch` dicts whose
``meta_info`` holds what ROLL keeps in ``DataProto.meta_info``. No dependency on
ROLL.

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
  of the VPP size, the count agreed across the DP group; and
  :func:`restore_results_order`.

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
import warnings
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Mapping, MutableMapping, Optional, Sequence, Tuple

import numpy as np

from .. import _core
from ._batch import batch_size, dummy_row, host_mask, is_tensor, mask_lengths, select_all, step_plan_parts
from .._dist import active, agree_on_count, checked_on_every_rank
from .._lengths import as_positive_int
from ..tensors.layout import alignment, round_up
from ..planning.balance import WORKLOAD_ATTENTION_COEFF, MicroBatchPlan, get_seqlen_balanced_partitions, plan_micro_batches, sequence_workloads
from ..planning.dynamic_batching import plan_dynamic_batching
from ..planning.metrics import dp_balance_metrics, dynamic_batching_metrics

if TYPE_CHECKING:  # pragma: no cover
    from ..planning.step import StepPlan

__all__ = [
    "ROLL_ATTENTION_COEFF",
    "RollBatch",
    "batch_balance",
    "dynamic_batching_shard",
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

    @property
    def num_rows(self) -> int:
        """Rows (``len()`` of a DataProto; ``len()`` of this dict counts keys)."""
        return batch_size(self) if self else 0

    def slice(self, start: int, end: int) -> "RollBatch":
        return RollBatch({k: v[start:end] for k, v in self.items()}, meta_info=copy.deepcopy(self.meta_info))


def _meta(batch: Mapping[str, Any]) -> Dict[str, Any]:
    return getattr(batch, "meta_info", None) or {}


# ---------------------------------------------------------------- batch balance


def batch_balance(batch: MutableMapping[str, Any], dp_size: int, minibatch_size: int,
                  logging_prefix: str = "global_seqlen", keep_minibatch: bool = False) -> Dict[str, float]:
    """Balance the global batch over ``dp_size`` ranks, in place (ROLL's ``batch_balance``).

    Karmarkar-Karp with equal sizes on the workload ``24576·s + s²`` (``s`` = real
    tokens); each rank's rows ordered small…large…small, then rank 0's rows, rank
    1's... so that the usual contiguous dispatch hands rank ``r`` its part. With
    ``keep_minibatch`` each mini-batch of ``minibatch_size`` rows is balanced on its
    own. Returns ``{prefix}/min, max, minmax_diff`` (contiguous split),
    ``balanced_min/max`` and ``mean`` in tokens.
    """
    dp_size = as_positive_int(dp_size, "dp_size")
    lengths = mask_lengths(batch)
    n = batch_size(batch)
    if n % dp_size:
        raise ValueError(f"the batch has {n} rows, not a multiple of dp_size={dp_size}")
    work = sequence_workloads(lengths, ROLL_ATTENTION_COEFF)
    if keep_minibatch:
        if not isinstance(minibatch_size, int) or minibatch_size <= 0 or n % minibatch_size or minibatch_size % dp_size:
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
    for key, value in select_all(batch, ordered).items():
        batch[key] = value
    return dp_balance_metrics(lengths.tolist(), parts, logging_prefix)


# ---------------------------------------------------------------- dynamic batching


def dynamic_batching_shard(
    origin_batch: Mapping[str, Any],
    dp_size: int,
    max_tokens_per_microbatch: int,
    sequence_length_round: int,
    pipeline_model_parallel_size: Optional[int] = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    log_prefix: Optional[str] = None,
    *,
    keep_dp_partition: bool = False,
    rule: str = "roll",
) -> Tuple[RollBatch, Dict[str, float]]:
    """ROLL's ``dynamic_batching_shard``: rows sorted by length and dealt across DP
    ranks (rank ``r`` gets the ``r``-th contiguous block of the result), and one
    plan of micro-batches shared by every rank: ``[start, end)`` row ranges whose
    rows x padded length (max over ranks, rounded up to ``sequence_length_round``)
    stay within ``max_tokens_per_microbatch``. With pipeline parallelism and VPP the
    count is made a multiple of the PP size by halving ranges.

    ``keep_dp_partition=True``: the batch is already dispatched in contiguous
    per-rank blocks (e.g. by :func:`batch_balance`); rows are sorted within each
    block and the balance is kept. ``rule="optimal"``: the fewest padded tokens.

    Returns ``(batch, metrics)``; ``batch.meta_info`` holds
    ``micro_batch_indices``/``micro_batch_lengths`` (and their ``global_`` copies)
    and ``num_micro_batchs``.
    """
    dp_size = as_positive_int(dp_size, "dp_size")
    pp = _pp_size(pipeline_model_parallel_size)
    if rule not in ("roll", "optimal"):
        raise ValueError(f"rule must be 'roll' or 'optimal', got {rule!r}")
    lengths = mask_lengths(origin_batch, "origin_batch")
    n = batch_size(origin_batch, "origin_batch")
    _check_right_padded(host_mask(origin_batch, "origin_batch"), lengths)
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
    out = RollBatch(select_all(origin_batch, order), meta_info=copy.deepcopy(_meta(origin_batch)))
    out.meta_info.update(global_micro_batch_indices=ranges, global_micro_batch_lengths=widths_per_mb,
                         micro_batch_indices=ranges, micro_batch_lengths=widths_per_mb, num_micro_batchs=len(ranges))
    width = int(np.shape(origin_batch["attention_mask"])[1])
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


def _check_ranges(ranges: Sequence[Sequence[int]], rows: int) -> None:
    if rows == 0:
        if ranges:
            raise ValueError("an empty batch cannot have micro-batch ranges")
        return
    if not ranges:
        raise ValueError("global micro-batch ranges are missing for a non-empty batch")
    expected = 0
    for start, end in ranges:
        if start != expected:
            raise ValueError(f"global micro-batch ranges must be sorted and contiguous: expected start {expected}, "
                             f"got {start}")
        if not start < end <= rows:
            raise ValueError(f"global micro-batch range [{start}, {end}) is empty or beyond the {rows} rows")
        expected = end
    if expected != rows:
        raise ValueError(f"global micro-batch ranges must cover the complete local batch: they end at {expected}, "
                         f"the batch has {rows} rows")


def make_mini_batch_iter_for_dynamic_batching(
    data: Mapping[str, Any],
    epochs: int,
    ga_steps: int = 1,
    keep_mini_batch: bool = False,
    mini_batch_size: Optional[int] = None,
    pipeline_model_parallel_size: Optional[int] = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
) -> Iterator[RollBatch]:
    """Mini-batches (optimizer steps) of one rank's dynamically batched data.

    Groups ``ga_steps`` consecutive micro-batches per mini-batch, or with
    ``keep_mini_batch`` cuts the ranges at every ``mini_batch_size`` rows (and
    splits each group to a multiple of the PP size under VPP). Each yielded batch
    carries its own ``micro_batch_indices`` (relative), ``micro_batch_lengths``,
    ``mini_batch_size`` and ``num_micro_batchs``; ``data.meta_info`` is untouched.
    """
    meta = _meta(data)
    ranges = [list(r) for r in meta.get("global_micro_batch_indices", [])]
    lengths = list(meta.get("global_micro_batch_lengths", []))
    ga_steps = as_positive_int(ga_steps, "ga_steps")
    if len(ranges) != len(lengths):
        raise ValueError("global_micro_batch_indices and global_micro_batch_lengths differ in length")
    rows = batch_size(data, "data") if len(data) else 0
    _check_ranges(ranges, rows)
    pp = _pp_size(pipeline_model_parallel_size)
    groups: List[Tuple[List[List[int]], List[int]]] = []
    if keep_mini_batch:
        if not isinstance(mini_batch_size, int) or mini_batch_size <= 0 or rows % mini_batch_size:
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

    def gen():
        for _ in range(epochs):
            for idx, lens in groups:
                start, end = idx[0][0], idx[-1][1]
                mb = RollBatch({k: v[start:end] for k, v in data.items()}, meta_info=copy.deepcopy(meta))
                mb.meta_info.update(micro_batch_indices=[[s - start, e - start] for s, e in idx],
                                    micro_batch_lengths=list(lens), mini_batch_size=end - start,
                                    num_micro_batchs=len(idx))
                yield mb

    return gen()


def make_micro_batch_iter_for_dynamic_batching(mini_batch: Mapping[str, Any]) -> Iterator[RollBatch]:
    """The micro-batches of a mini-batch, each cut to its padded length (columns of
    tensors as wide as ``input_ids``, or one less, and ``position_ids``; right-padded data)."""
    meta = _meta(mini_batch)
    width = mini_batch["input_ids"].shape[-1]
    ndim = mini_batch["input_ids"].dim()

    def gen():
        for length, (start, end) in zip(meta["micro_batch_lengths"], meta["micro_batch_indices"]):
            mb = RollBatch(meta_info=copy.deepcopy(meta))
            for key, v in mini_batch.items():
                v = v[start:end]
                if is_tensor(v) and (v.dim() == ndim or key == "position_ids") and v.shape[-1] in (width, width - 1):
                    v = v.narrow(-1, 0, length if v.shape[-1] == width else length - 1)
                mb[key] = v
            yield mb

    return gen()


# ---------------------------------------------------------------- sequence packing


def make_micro_batch_iter_for_sequence_packing(
    mini_batch: Mapping[str, Any],
    *,
    max_packed_sequence_length: Optional[int] = None,
    algorithm: str = "load_balance",
    min_num_micro_batches: int = 1,
    pad_multiple: Optional[int] = None,
    tp_size: int = 1,
    cp_size: int = 1,
    vp_size: int = 1,
    dp_group=None,
    micro_batch_size: Optional[int] = None,
    step_plan: Optional["StepPlan"] = None,
    dp_rank: Optional[int] = None,
    mini_batch_index: int = 0,
) -> Iterator[RollBatch]:
    """Micro-batches of a mini-batch for sequence packing (ROLL ``algorithm``
    ``"none"``: consecutive chunks of ``micro_batch_size`` rows; ``"load_balance"``:
    balanced micro-batches under a hard cap).

    ``load_balance``: every sequence padded to ``pad_multiple`` (default ROLL's
    ``2·CP·TP`` with CP, ``TP`` without), at least ``min_num_micro_batches``, a
    multiple of ``vp_size``, the fewest such that Karmarkar-Karp (or LPT) balances
    the workload ``24576·s + s²`` with every micro-batch's padded tokens <=
    ``max_packed_sequence_length``; when ``dp_group`` is given (or a default group
    is initialised) every rank uses the largest rank's count. Micro-batches run
    light, heavy, ..., heavy, light (pipeline bubbles at the ends are small).

    ``step_plan`` (with ``dp_rank``, ``mini_batch_index``): rank ``dp_rank``'s
    micro-batches of that mini-batch from a :func:`seqpack.plan_step` plan
    (``mini_batch`` holds ``step_plan.rank_rows(dp_rank, mini_batch_index)``); the
    count is the same on every rank by construction, so no collective runs. An
    empty micro-batch is yielded as a one-row dummy (one token, zero loss masks)
    with ``is_padding_batch=True``: drop its outputs before
    :func:`restore_results_order`. Plan on the lengths as packed (each rounded up
    to the pad multiple) so that the cap holds after padding.

    Each micro-batch's ``meta_info``: ``micro_batch_idx``, ``num_micro_batchs``,
    ``partition_indices``, ``partition_indices_list``, ``mini_batch_size``,
    ``is_padding_batch`` and ``sequence_packing_metrics``.
    """
    meta = _meta(mini_batch)
    if algorithm == "none":
        n = batch_size(mini_batch, "mini_batch")
        if not isinstance(micro_batch_size, int) or micro_batch_size <= 0 or n % micro_batch_size:
            raise ValueError(f"algorithm 'none' needs a micro_batch_size > 0 dividing the {n} rows, "
                             f"got {micro_batch_size!r}")
        parts = [list(range(s, s + micro_batch_size)) for s in range(0, n, micro_batch_size)]
        return _yield_parts(mini_batch, meta, parts, n, {}, reorder=False)
    if step_plan is not None:
        n = batch_size(mini_batch, "mini_batch")
        cap = None if max_packed_sequence_length is None else as_positive_int(max_packed_sequence_length,
                                                                              "max_packed_sequence_length")
        parts = step_plan_parts(step_plan, dp_rank, mini_batch_index, n, cap, "max_packed_sequence_length")
        return _yield_parts(mini_batch, meta, parts, n, step_plan.metrics, reorder=True)
    agree = dp_group is not None or active()
    box: Dict[str, Any] = {}

    def plan_with(count: int) -> MicroBatchPlan:
        return plan_micro_batches(box["padded"], box["cap"], min_num=count, multiple_of=box["vp"],
                                  attention_coeff=ROLL_ATTENTION_COEFF, order="small_at_ends")

    def local() -> MicroBatchPlan:  # every check that can differ between ranks, inside the agreement
        box["n"] = n = batch_size(mini_batch, "mini_batch")
        if algorithm != "load_balance":
            raise ValueError(f"Illegal sequence packing algorithm {algorithm!r}, algorithm must be in "
                             "['none', 'load_balance']")
        if max_packed_sequence_length is None:
            raise ValueError("max_packed_sequence_length is required with algorithm 'load_balance'")
        box["cap"] = cap = as_positive_int(max_packed_sequence_length, "max_packed_sequence_length")
        tp, cp = as_positive_int(tp_size, "tp_size"), as_positive_int(cp_size, "cp_size")
        multiple = alignment(cp, tp, rule="roll") if pad_multiple is None else as_positive_int(pad_multiple,
                                                                                                "pad_multiple")
        box["padded"] = padded = round_up(mask_lengths(mini_batch, "mini_batch"), multiple)
        if n and padded.max() > cap:
            raise ValueError(f"a sequence padded to {int(padded.max())} tokens (pad multiple {multiple}) exceeds "
                             f"max_packed_sequence_length={cap}")
        box["vp"] = as_positive_int(vp_size, "vp_size")
        return plan_with(as_positive_int(min_num_micro_batches, "min_num_micro_batches"))

    plan = checked_on_every_rank(local, dp_group, "make_micro_batch_iter_for_sequence_packing", agree)
    if agree:
        plan = agree_on_count(plan.num_micro_batches, plan_with, lambda p: p.num_micro_batches, dp_group,
                              "make_micro_batch_iter_for_sequence_packing")
    n, cap, padded = box["n"], box["cap"], box["padded"]
    metrics = {
        "num_micro_batches": plan.num_micro_batches,
        "max_packed_tokens": max(plan.tokens) if plan.tokens else 0,
        "mean_packed_tokens": float(np.mean(plan.tokens)) if plan.tokens else 0.0,
        "fill": float(np.sum(plan.tokens)) / (cap * plan.num_micro_batches) if plan.tokens else 0.0,
        "workload_imbalance": plan.imbalance,
        "padding_tokens": int(padded.sum() - mask_lengths(mini_batch).sum()),
    }
    return _yield_parts(mini_batch, meta, plan.micro_batches, n, metrics, reorder=True)


def _yield_parts(batch, meta, parts, n, metrics, reorder: bool) -> Iterator[RollBatch]:
    def gen():
        for k, part in enumerate(parts):
            mb = RollBatch(select_all(batch, part) if part else dummy_row(batch, name="mini_batch"),
                           meta_info=copy.deepcopy(meta))
            mb.meta_info.update(micro_batch_idx=k, num_micro_batchs=len(parts), partition_indices=list(part),
                                partition_indices_list=[list(p) for p in parts] if reorder else [],
                                mini_batch_size=n, is_padding_batch=not part, sequence_packing_metrics=dict(metrics))
            yield mb

    return gen()


def restore_results_order(results: Mapping[str, Any], partition_indices_list: Sequence[Sequence[int]]) -> Dict[str, Any]:
    """Put per-row results of the packed micro-batches (concatenated in the order
    they were yielded) back in the mini-batch's row order. Scalars and non-tensor
    values pass through; an empty ``partition_indices_list`` (algorithm ``none``)
    changes nothing."""
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
