"""The sequence-packing plan behind ROLL's ``make_micro_batch_iter_for_sequence_packing``
(:mod:`seqpack.roll`): bins under a hard cap (or ROLL's soft one), the count agreed
over the DP group, prefix trees with ``shared_prefix``, dummies for empty bins.

Importing this module does not import torch.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable, Dict, Iterator, List, Mapping, MutableMapping, Optional, Sequence

import numpy as np

from .._batch import (batch_size, dummy_row, is_data_proto, mask_lengths, padded_forest, proto_select, select_all,
                     step_plan_parts)
from ..._dist import agree_on_count, checked_on_every_rank
from ..._lengths import as_positive_int
from ...tensors.layout import alignment, round_up
from ...planning.balance import (WORKLOAD_ATTENTION_COEFF, MicroBatchPlan, get_seqlen_balanced_partitions,
                               plan_micro_batches)
from .common import RollBatch, ranks_agree, batch_columns, int_like, write_meta


def calculate_workload(seqlen: Any) -> Any:
    """ROLL's workload of a sequence (a FLOPs proxy): ``24576·s + s²``, for an int,
    a NumPy array or a tensor of lengths.

    >>> calculate_workload(1000)
    25576000
    """
    return WORKLOAD_ATTENTION_COEFF * seqlen + seqlen * seqlen


def pad_factor(cp_size: Any, tp_size: Any) -> int:
    """ROLL's ``get_pad_factor`` (its packer's and its Megatron strategy's):
    ``lcm(16, 2·CP·TP)`` with CP, ``lcm(16, TP)`` without."""
    return math.lcm(16, alignment(cp_size, tp_size, rule="roll"))


def phase_value(config: Any, is_train: bool, name: str, default: Any = None) -> Any:
    """``config.<name>_train`` / ``_forward`` (ROLL's fields), else ``config.<name>``."""
    value = getattr(config, f"{name}_{'train' if is_train else 'forward'}", None)
    if value is None:
        value = getattr(config, name, None)
    return default if value is None else value


def _roll_packing_metrics(lengths: np.ndarray, width: int, parts: Sequence[Sequence[int]], phase: str,
                          per_mb: Optional[Sequence[int]] = None) -> Dict[str, float]:
    """ROLL's ``sequence_packing_metrics`` (real tokens, ``{phase}/`` keys; ``per_mb``:
    the tokens each micro-batch computes, when not its rows' own, as in passes)."""
    n, k = int(lengths.size), len(parts)
    if per_mb is None:
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


def pack_sequences_of(mini_batch: Any, *, algorithm: Any, cap: Any, min_num: Any, pad_multiple: Any,
                      pad_rule: Callable[[int, int], int], tp_size: Any, cp_size: Any, vp_size: Any, pp_size: Any,
                      is_train: bool, dp_group: Any, micro_batch_size: Any, step_plan: Any, dp_rank: Any,
                      mini_batch_index: Any, strict: bool = True, shared_prefix: bool = False,
                      group_key: Optional[str] = None, prefix_reuse: bool = False,
                      prefix_reuse_memory: str = "activations") -> Iterator[Any]:
    phase = "train" if is_train else "forward"
    cols = batch_columns(mini_batch)
    meta = getattr(mini_batch, "meta_info", None)
    if not isinstance(meta, MutableMapping):
        meta = {}
    if shared_prefix and algorithm != "load_balance":
        raise ValueError(f"shared_prefix plans prefix trees with algorithm 'load_balance', got {algorithm!r}")
    if prefix_reuse:
        _check_prefix_reuse(shared_prefix, strict, step_plan, prefix_reuse_memory, is_train)
    if algorithm == "none":
        n = batch_size(cols, "mini_batch")
        if strict:
            micro_batch_size = int_like(micro_batch_size)
            if type(micro_batch_size) is not int or micro_batch_size <= 0 or n % micro_batch_size:
                raise ValueError(f"algorithm 'none' needs a micro_batch_size > 0 dividing the {n} rows, "
                                 f"got {micro_batch_size!r}")
            parts = [list(range(s, s + micro_batch_size)) for s in range(0, n, micro_batch_size)]
        else:  # ROLL: rows // micro_batch_size chunks, np.array_split's sizes
            micro_batch_size = int_like(micro_batch_size)
            if type(micro_batch_size) is not int or not 0 < micro_batch_size <= n:
                raise ValueError(f"algorithm 'none' needs a micro_batch_size in [1, {n}] (the rows), "
                                 f"got {micro_batch_size!r}")
            parts = [p.tolist() for p in np.array_split(np.arange(n), n // micro_batch_size)]
        metrics = _phase_metrics(cols, parts, phase)
        write_meta(mini_batch, partition_indices_list=[], num_micro_batchs=len(parts),
                    sequence_packing_metrics=dict(metrics))
        return _yield_parts(mini_batch, cols, meta, parts, n, metrics, reorder=False)
    if step_plan is not None:
        n = batch_size(cols, "mini_batch")
        cap = None if cap is None else as_positive_int(cap, "max_packed_sequence_length")
        parts = step_plan_parts(step_plan, dp_rank, mini_batch_index, n, cap, "max_packed_sequence_length")
        metrics = {**step_plan.metrics, **_phase_metrics(cols, parts, phase)}
        write_meta(mini_batch, partition_indices_list=[list(p) for p in parts],
                    sequence_packing_metrics=dict(metrics))
        trees = None
        if shared_prefix:  # the plan decides (plan it with forest=); each micro-batch still gets its tree
            groups = padded_forest(cols, group_key, missing_group_ok=False)[1]
            trees = _tree_maker(groups, _pad_of(pad_rule, pad_multiple, tp_size, cp_size))
        return _yield_parts(mini_batch, cols, meta, parts, n, metrics, reorder=True, trees=trees)
    agree = ranks_agree(dp_group)
    box: Dict[str, Any] = {}

    def plan_with(count: int) -> MicroBatchPlan:
        if not strict:
            return _roll_soft_plan(box["padded"], box["cap"], count)
        forest = box.get("forest")
        if prefix_reuse:  # passes where trees would need more micro-batches (or cannot hold a row)
            return plan_micro_batches(forest.lengths, box["cap"] // box["pad"] * box["pad"], min_num=count,
                                      multiple_of=box["multiple"],
                                      attention_coeff=WORKLOAD_ATTENTION_COEFF, order="small_at_ends",
                                      forest=forest, prefix_reuse=True)
        if forest is not None:  # trees padded as a whole: physical tokens under the cap rounded down
            usable = box["cap"] // box["pad"] * box["pad"]
            return plan_micro_batches(forest.lengths, usable, min_num=count, multiple_of=box["multiple"],
                                      attention_coeff=WORKLOAD_ATTENTION_COEFF, order="small_at_ends", forest=forest)
        return plan_micro_batches(box["padded"], box["cap"], min_num=count, multiple_of=box["multiple"],
                                  attention_coeff=WORKLOAD_ATTENTION_COEFF, order="small_at_ends")

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
        if prefix_reuse:  # a row longer than the cap is planned, in passes (padded as the trees)
            if as_positive_int(cp_size, "cp_size") > 1:
                raise ValueError(f"prefix_reuse runs each pass on one rank: no context parallelism, got "
                                 f"cp_size={cp_size}")
            if limit < multiple:
                raise ValueError(f"max_packed_sequence_length={limit} is below the pad multiple {multiple}")
            box["forest"], box["groups"] = padded_forest(cols, group_key, missing_group_ok=False)
        elif shared_prefix:
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
    trees = _tree_maker(box["groups"], box["pad"]) if shared_prefix else None
    if plan.prefix_reuse is not None:
        from .prefix_reuse import pass_micro_batches

        metrics.update(_roll_packing_metrics(lengths, int(np.shape(cols["attention_mask"])[1]), plan.micro_batches,
                                             phase, per_mb=plan.tokens), padding_tokens=0)
        write_meta(mini_batch, partition_indices_list=[], sequence_packing_metrics=dict(metrics))
        dummies = _part_maker(mini_batch, cols, meta, plan.micro_batches, n, metrics, False, trees)
        return pass_micro_batches(mini_batch, meta, plan, box["groups"], limit // box["pad"] * box["pad"],
                                  box["pad"], prefix_reuse_memory, lambda k: dummies(k, []))
    write_meta(mini_batch, partition_indices_list=[list(p) for p in plan.micro_batches],
                sequence_packing_metrics=dict(metrics))
    return _yield_parts(mini_batch, cols, meta, plan.micro_batches, n, metrics, reorder=True, trees=trees)


def _check_prefix_reuse(shared_prefix: bool, strict: bool, step_plan: Any, memory: Any, is_train: bool) -> None:
    from ...training.prefix_reuse import MEMORY_MODES

    if not is_train:
        raise ValueError("prefix_reuse runs the training phase's passes (each a micro-batch of every row, its share "
                         "of the loss masks); the forward phase concatenates per-row results: pass is_train=True")
    if not shared_prefix:
        raise ValueError("prefix_reuse runs a mini-batch's prefix trees in passes: it needs shared_prefix=True")
    if not strict:
        raise ValueError("prefix_reuse plans passes with seqpack's planner: it needs strict=True")
    if step_plan is not None:
        raise ValueError("prefix_reuse plans each mini-batch's passes on its rank's rows: pass it without step_plan "
                         "(a step plan decides its own micro-batches)")
    if memory not in MEMORY_MODES:
        raise ValueError(f"prefix_reuse_memory must be one of {MEMORY_MODES}, got {memory!r}")


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
        from ...tensors.prefix_tree import PrefixTreeBatch

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


def _part_maker(batch: Any, cols: Mapping[str, Any], meta: Dict[str, Any], parts: Sequence[Sequence[int]], n: int,
                metrics: Dict[str, Any], reorder: bool,
                trees: Optional[Callable[[Mapping[str, Any], Sequence[int]], Any]]) -> Callable[[int, Sequence[int]], Any]:
    """``make(k, part)``: micro-batch ``k`` of ``parts`` (rows ``part``; none: a dummy)."""
    proto = is_data_proto(batch)

    def make(k: int, part: Sequence[int]) -> Any:
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
            mb.meta_info["prefix_tree"] = trees(batch_columns(mb), part)
        return mb

    return make


def _yield_parts(batch: Any, cols: Mapping[str, Any], meta: Dict[str, Any], parts: Sequence[Sequence[int]], n: int,
                 metrics: Dict[str, Any], reorder: bool,
                 trees: Optional[Callable[[Mapping[str, Any], Sequence[int]], Any]] = None) -> Iterator[Any]:
    make = _part_maker(batch, cols, meta, parts, n, metrics, reorder, trees)
    return (make(k, part) for k, part in enumerate(parts))
