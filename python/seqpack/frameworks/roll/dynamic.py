"""ROLL's dynamic batching (:mod:`seqpack.roll`): sort, stride across DP, one shared
greedy plan, the VPP split; its metrics and metadata.

Importing this module does not import torch.
"""

from __future__ import annotations

import copy

from ... import _core
import warnings
from numbers import Integral
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from .._batch import batch_size, host_mask, is_data_proto, is_tensor, mask_lengths, proto_select, proto_slice, select_all
from ..._lengths import as_positive_int
from ...planning.dynamic_batching import plan_dynamic_batching
from ...planning.metrics import dynamic_batching_metrics
from .common import RollBatch, batch_columns, int_like, roll_meta, roll_errors


@roll_errors
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
    forest: Any = None,
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
    ``forest``: a :class:`~seqpack.PrefixForest` of the batch's rows (e.g.
    ``PrefixForest.from_padded(input_ids, attention_mask, group_ids=...)``) for
    micro-batches laid out as prefix trees: trees go to ranks whole where they fit
    the ranks' rows, and the shared ranges keep every rank's micro-batch *physical*
    tokens (rounded up to ``sequence_length_round``) within the cap
    (:func:`~seqpack.plan_dynamic_batching` with ``forest=``); the counts stay equal.
    Lay each micro-batch out as a tree (:class:`~seqpack.PrefixTreeBatch`, ROLL's
    ``shared_prefix`` path): run padded, ``rows x micro_batch_lengths`` tokens would
    pass the cap. ``rule`` is not used with a forest (a warning says so).

    Returns ``(batch, metrics)``: a DataProto of the input's class (its own
    ``select_idxs``) or a :class:`RollBatch`, whose ``meta_info`` (a copy of the
    input's) holds ``micro_batch_indices``/``micro_batch_lengths`` (and their
    ``global_`` copies) and ``num_micro_batchs``; the input is not modified.
    """
    dp_size = as_positive_int(dp_size, "dp_size")
    pp = _pp_size(pipeline_model_parallel_size)
    if rule not in ("roll", "optimal"):
        raise ValueError(f"rule must be 'roll' or 'optimal', got {rule!r}")
    cols = batch_columns(origin_batch)
    lengths = mask_lengths(cols, "origin_batch")
    n = batch_size(cols, "origin_batch")
    _check_right_padded(host_mask(cols, "origin_batch"), lengths)
    if n % dp_size:
        raise ValueError(f"the batch has {n} rows, not a multiple of dp_size={dp_size}")
    if (lengths == 0).any():
        warnings.warn(f"The attention_mask is all zero in the {log_prefix} stage. Please verify the rollout stage.")
    split_pp = pp if (pp > 1 and virtual_pipeline_model_parallel_size) or rule == "optimal" else 1
    per_rank = n // dp_size
    if forest is not None:
        if rule != "roll":
            warnings.warn(f"dynamic_batching_shard: rule={rule!r} is not used with forest= (the forest plan has the "
                          "fewest micro-batches, then the fewest physical tokens)", stacklevel=3)
        if keep_dp_partition:
            raise ValueError("keep_dp_partition and forest cannot be combined: with a forest the plan deals the "
                             "trees to the ranks itself")
        plan = plan_dynamic_batching(lengths, dp_size, max_tokens_per_microbatch, sequence_length_round,
                                     pp_size=split_pp, forest=forest)
        order = plan.sorted_indices
        padded_tokens = plan.padded_tokens
    elif keep_dp_partition:
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
    meta = copy.deepcopy(roll_meta(origin_batch))
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


@roll_errors
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
    meta = roll_meta(data)
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
        mini_batch_size = int_like(mini_batch_size)
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


@roll_errors
def make_micro_batch_iter_for_dynamic_batching(mini_batch: Any) -> Iterator[Any]:
    """The micro-batches of a mini-batch, each cut to its padded length (columns of
    tensors as wide as ``input_ids``, or one less, and ``position_ids``; right-padded
    data). A DataProto's micro-batches are its own ``slice``s with their ``batch``
    tensors cut (non-tensor values whole), as ROLL does."""
    meta = roll_meta(mini_batch)
    proto = is_data_proto(mini_batch)
    ids = batch_columns(mini_batch)["input_ids"]
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
