"""verl's dynamic micro-batching (``verl.utils.seqlen_balancing``), with a strict cap.

:func:`rearrange_micro_batches` takes verl's arguments and returns verl's
``(micro_batches, micro_bsz_idx)``. By default (``strict=True``) every micro-batch
holds at most ``max_token_len`` real tokens: the count grows until Karmarkar-Karp
(or LPT) balances the workload within the cap, and when ranks are given it is the
same on every rank, agreed with collectives that every rank runs (no rank waits
alone). ``strict=False`` is the released verl's rule exactly (0.9.1, since
verl#7553: its count, grown in steps of ``num_batches_divided_by`` until its
Karmarkar-Karp parts fit the cap; its partitions, order and raises);
``strict="soft_cap"`` is the rule of verl before verl#7553 (``ceil(tokens / cap)``
parts, which can exceed the cap). docs/verl.md lists what differs on purpose.

:func:`prepare_dynamic_batch` / :func:`restore_dynamic_batch` are verl's
``DataProto``-level pair (a ``DataProto`` is duck-typed: ``.batch``,
``.non_tensor_batch``, ``.meta_info``; verl is never imported), and
:func:`get_group_balanced_partitions` balances ranks while keeping every uid's
group of responses (GRPO's) on one rank.

    >>> import torch
    >>> mask = torch.ones(8, 7, dtype=torch.long)              # 8 rows of 7 tokens, cap 8
    >>> mbs, idx = rearrange_micro_batches({"attention_mask": mask}, max_token_len=8)
    >>> len(mbs), max(int(mb["attention_mask"].sum()) for mb in mbs)
    (8, 7)
    >>> mbs, idx = rearrange_micro_batches({"attention_mask": mask}, max_token_len=8, strict="soft_cap")
    >>> len(mbs), max(int(mb["attention_mask"].sum()) for mb in mbs)   # verl < #7553: ceil(56 / 8) = 7
    (7, 14)
    >>> len(rearrange_micro_batches({"attention_mask": mask}, max_token_len=8, strict=False)[0])  # verl 0.9.1
    8
    >>> get_reverse_idx([2, 0, 1])
    [1, 2, 0]
    >>> get_group_balanced_partitions([100, 100, 300, 300, 50, 50, 250, 250], list("aabbccdd"), 2)
    [[2, 3, 4, 5], [0, 1, 6, 7]]
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import numpy as np

from .._batch import (batch_size, coupled_trees, dummy_row, is_data_proto, is_tensor, mask_lengths,
                     padded_forest, proto_columns, proto_select, step_plan_parts)
from ..._dist import active, agree_on_count, all_reduce_int, all_reduce_ints, checked_on_every_rank
from ..policy_forward import verl_tree_forward as tree_forward_micro_batch
from ..._lengths import as_lengths, as_positive_int
from ...planning.balance import (WORKLOAD_ATTENTION_COEFF, get_seqlen_balanced_partitions, plan_micro_batches,
                                sequence_workloads)
from .restore import get_reverse_idx, restore_dynamic_batch, select_rows

if TYPE_CHECKING:  # pragma: no cover
    from ...planning.step import StepPlan

__all__ = ["ceildiv", "get_group_balanced_partitions", "get_reverse_idx", "get_seqlen_balanced_partitions",
           "prepare_dynamic_batch", "rearrange_micro_batches", "restore_dynamic_batch", "roundup_divisible",
           "tree_forward_micro_batch"]


def ceildiv(a: int, b: int) -> int:
    return -(a // -b)


def roundup_divisible(a: int, b: int) -> int:
    return ((a + b - 1) // b) * b


def rearrange_micro_batches(
    batch: Any,
    max_token_len: int,
    dp_group=None,
    num_batches_divided_by: Optional[int] = None,
    same_micro_num_in_dp: bool = True,
    min_num_micro_batch: Optional[int] = None,
    use_dynamic_bsz_balance: bool = True,
    force_group_size: int = 1,
    *,
    strict: Union[bool, str] = True,
    step_plan: Optional["StepPlan"] = None,
    dp_rank: Optional[int] = None,
    mini_batch: int = 0,
    shared_prefix: bool = False,
    group_key: Optional[str] = "uid",
    prefix_reuse: bool = False,
) -> Tuple[List[Any], List[List[int]]]:
    """Split a batch into micro-batches of at most ``max_token_len`` real tokens.

    Args:
        batch: mapping (dict, TensorDict) of row-aligned tensors with ``attention_mask``,
            or verl 0.9.1's engine TensorDict (nested ``input_ids``: lengths from its
            offsets, as verl reads them, ``attention_mask`` optional; rows selected with
            their nested tensors and metadata); a DataProto gives DataProtos (as
            :func:`prepare_dynamic_batch`).
        max_token_len: strict cap on real tokens per micro-batch.
        dp_group: the data-parallel group whose ranks must run the same number of
            micro-batches (the default group when ``torch.distributed`` is initialised).
        num_batches_divided_by: the count is a multiple of this (Megatron VPP).
        same_micro_num_in_dp: agree on the count across ``dp_group``.
        min_num_micro_batch: lower bound on the count (e.g. pipeline stages).
        use_dynamic_bsz_balance: order micro-batches light, heavy, ..., heavy, light
            by the workload ``24576·s + s²``; otherwise heaviest first.
        force_group_size: every ``force_group_size`` consecutive rows stay in one
            micro-batch (verl's reward-model pairs); the rows must be a multiple of it.
        strict: ``True`` (default): the cap holds, the count grows as needed
            (seqpack's planner; agreed over ``dp_group``, or the default group).
            ``False``: the released verl's rule (0.9.1), exactly: count
            ``min(rows, ceil(tokens / max_token_len))`` (``rows``: groups of
            ``force_group_size``), raised to ``min_num_micro_batch``, the largest
            rank's when ``dp_group`` is given, ``same_micro_num_in_dp`` set and
            ``torch.distributed`` initialised, rounded up to
            ``num_batches_divided_by``, then grown by it until verl's Karmarkar-Karp
            parts of the workloads fit the cap on every rank (a ``ValueError``
            once it passes the rows of a rank); ordered as verl orders them.
            ``"soft_cap"``: the rule of verl before verl#7553, the same count
            without the growing, so a micro-batch can exceed the cap (and a
            ``force_group_size`` group may).
        step_plan, dp_rank, mini_batch: take rank ``dp_rank``'s micro-batches of
            ``mini_batch`` from a :func:`seqpack.plan_step` plan of the global batch
            (``batch`` holds ``step_plan.rank_rows(dp_rank, mini_batch)``). The plan
            gives every rank the same count, so no collective runs; an empty
            micro-batch becomes a one-row dummy (one token, zero loss masks) with an
            empty entry in ``micro_bsz_idx``.
        shared_prefix: plan prefix trees (verl's ``actor.use_prefix_grouper``;
            ``strict=True``): the rows' trie from ``input_ids`` and
            ``attention_mask`` (a :class:`~seqpack.PrefixForest`, rows sharing only
            within one value of the ``group_key`` column - verl's ``uid``, when the
            batch has it), the cap bounding each micro-batch's *physical* tokens,
            trees split where that fills micro-batches (per-token losses); with
            ``force_group_size > 1`` (rows coupled by the loss) every tree stays
            whole (``whole_trees``), each group of rows must be in one tree and
            every tree must fit the cap. Lay each micro-batch out with
            :func:`seqpack.pack_prefix_tree`. With ``step_plan`` the plan decides the
            micro-batches (plan it with ``forest=``).
        prefix_reuse: with ``shared_prefix``, a tree larger than the cap runs in
            passes (:mod:`seqpack.frameworks.verl.prefix_reuse`; verl's engine
            TensorDicts): its shared prefix forwarded and back-propagated once, a
            row longer than the cap planned instead of refused; kept when it needs
            fewer micro-batches (or as many and fewer tokens) than the trees. Each
            pass's micro-batch holds the rank's rows, ``micro_bsz_idx`` lists them
            for each pass, and :func:`restore_dynamic_batch` sums a row's passes.

    Returns:
        ``(micro_batches, micro_bsz_idx)``: the sub-batches (rows ascending) and
        their row indices; ``get_reverse_idx(sum(micro_bsz_idx, []))`` restores order.
        In passes (``prefix_reuse``) every pass lists the rank's rows in the order
        that lays out its trees: :func:`restore_dynamic_batch` sums a row's passes.

    Raises:
        ValueError: a sequence (or, but with ``"soft_cap"``, a
            ``force_group_size`` group) of more than ``max_token_len`` tokens; rows
            not a multiple of ``force_group_size``; a count no rank can reach with its rows; with
            ``strict=False`` an empty batch; a bad argument, ``strict`` included
            (raised on every rank of an agreeing ``dp_group``).
    """
    if is_data_proto(batch):
        return prepare_dynamic_batch(batch, max_token_len, dp_group, num_batches_divided_by, same_micro_num_in_dp,
                                     min_num_micro_batch, use_dynamic_bsz_balance, force_group_size=force_group_size,
                                     strict=strict, step_plan=step_plan, dp_rank=dp_rank, mini_batch=mini_batch,
                                     shared_prefix=shared_prefix, group_key=group_key, prefix_reuse=prefix_reuse)
    parts, passes = _plan_parts(_mapping_views(batch), max_token_len, dp_group, num_batches_divided_by,
                                same_micro_num_in_dp, min_num_micro_batch, use_dynamic_bsz_balance, force_group_size,
                                strict, step_plan, dp_rank, mini_batch, shared_prefix, group_key, prefix_reuse)
    if passes is not None and passes.rank_rows[0]:
        from .prefix_reuse import pass_micro_batches

        return pass_micro_batches(select_rows(batch, passes.rank_rows[0]), int(max_token_len), group_key, passes,
                                  lambda: _dummy(batch)), parts
    return [select_rows(batch, p) if p else _dummy(batch) for p in parts], parts


def prepare_dynamic_batch(
    data: Any,
    max_token_len: int,
    dp_group=None,
    num_batches_divided_by: Optional[int] = None,
    same_micro_num_in_dp: bool = True,
    min_num_micro_batch: Optional[int] = None,
    use_dynamic_bsz_balance: bool = True,
    *,
    force_group_size: int = 1,
    strict: Union[bool, str] = True,
    step_plan: Optional["StepPlan"] = None,
    dp_rank: Optional[int] = None,
    mini_batch: int = 0,
    shared_prefix: bool = False,
    group_key: Optional[str] = "uid",
    prefix_reuse: bool = False,
) -> Tuple[List[Any], List[List[int]]]:
    """verl's ``prepare_dynamic_batch``: a batch split into micro-batches under
    ``max_token_len`` (the rule of :func:`rearrange_micro_batches`, whose arguments
    these are) and the row indices of each.

    ``data`` is verl's ``DataProto`` (micro-batches are DataProtos built by its own
    ``select_idxs``, its ``non_tensor_batch`` rows included, each with a deep copy
    of ``meta_info``; the plan reads ``data.batch['attention_mask']``), a
    ``TensorDict`` (TensorDicts) or a mapping (dicts). Outputs computed per
    micro-batch and concatenated go back to ``data``'s order with
    :func:`restore_dynamic_batch`.
    """
    if not is_data_proto(data):
        return rearrange_micro_batches(data, max_token_len, dp_group, num_batches_divided_by, same_micro_num_in_dp,
                                       min_num_micro_batch, use_dynamic_bsz_balance, force_group_size, strict=strict,
                                       step_plan=step_plan, dp_rank=dp_rank, mini_batch=mini_batch,
                                       shared_prefix=shared_prefix, group_key=group_key, prefix_reuse=prefix_reuse)
    if prefix_reuse:
        raise ValueError("prefix_reuse runs passes on verl's engine TensorDicts (verl 0.9.1's training path), not on "
                         "a DataProto's micro-batches")
    parts, _ = _plan_parts(_proto_views(data), max_token_len, dp_group, num_batches_divided_by,
                           same_micro_num_in_dp, min_num_micro_batch, use_dynamic_bsz_balance, force_group_size, strict,
                           step_plan, dp_rank, mini_batch, shared_prefix, group_key)
    micro_batches = []
    for part in parts:
        mb = proto_select(data, part, "data") if part else _proto_dummy(data)
        mb.meta_info = copy.deepcopy(data.meta_info)  # select_idxs may share the input's dict
        micro_batches.append(mb)
    return micro_batches, parts


def get_group_balanced_partitions(seqlen_list: Any, uid_list: Any, k_partitions: int, *,
                                  equal_size: bool = True) -> List[List[int]]:
    """verl's ``get_group_balanced_partitions``: ``k_partitions`` (ranks) balanced on
    verl's workload ``24576·s + s²``, every sample of a uid in the same one (a
    prompt's GRPO group of responses).

    The groups are balanced with verl's Karmarkar-Karp (seqpack's C++), each group
    weighing the sum of its samples' workloads; ``equal_size`` (verl's rule) gives
    every partition the same number of groups. A uid's samples need not be
    contiguous (verl groups contiguous runs only; on contiguous uids, as verl's
    rollouts lay them out, the partitions are identical).

    Returns:
        ``k_partitions`` lists of sample indices, each sorted.

    Raises:
        ValueError: lengths differ; fewer uid groups than ``k_partitions``; with
            ``equal_size``, a group count that is not a multiple of ``k_partitions``.
    """
    lengths = as_lengths(seqlen_list, "seqlen_list")
    if is_tensor(uid_list) or isinstance(uid_list, np.ndarray):
        uid_list = uid_list.tolist()
    uids = list(uid_list)
    if len(uids) != len(lengths):
        raise ValueError(f"seqlen_list and uid_list must have the same length, got {len(lengths)} and {len(uids)}")
    k = as_positive_int(k_partitions, "k_partitions")
    first_seen: Dict[Any, int] = {}
    try:
        group_of = np.asarray([first_seen.setdefault(u, len(first_seen)) for u in uids], dtype=np.int64)
    except TypeError as exc:
        raise TypeError(f"uid_list items must be hashable: {exc}") from None
    groups = len(first_seen)
    if groups < k:
        raise ValueError(f"{groups} uid groups cannot fill k_partitions={k}: every partition needs a group "
                         "(reduce the ranks or raise the batch size)")
    if equal_size and groups % k:
        raise ValueError(f"equal_size=True gives every partition the same number of groups, but {groups} uid groups "
                         f"is not a multiple of k_partitions={k} (pass equal_size=False to balance workload only)")
    group_work = np.zeros(groups, dtype=np.int64)
    np.add.at(group_work, group_of, sequence_workloads(lengths, WORKLOAD_ATTENTION_COEFF))
    members = np.argsort(group_of, kind="stable")
    starts = np.concatenate([[0], np.cumsum(np.bincount(group_of, minlength=groups))])
    out = []
    for part in get_seqlen_balanced_partitions(group_work, k, equal_size=bool(equal_size)):
        samples = np.concatenate([members[starts[g]:starts[g + 1]] for g in part])
        out.append(np.sort(samples).tolist())
    return out


# ------------------------------------------------------------------ planning


def _mode_of(strict: Any) -> str:
    """``"strict"`` (seqpack's cap, ``True``), ``"verl"`` (the released verl's
    rule, ``False``) or ``"soft_cap"`` (verl's rule before verl#7553)."""
    if isinstance(strict, str):
        if strict == "soft_cap":
            return "soft_cap"
    elif isinstance(strict, (bool, np.bool_)) or (isinstance(strict, (int, np.integer)) and strict in (0, 1)):
        return "strict" if strict else "verl"
    raise ValueError(f"strict must be True (seqpack's strict cap), False (the released verl's rule) or 'soft_cap' "
                     f"(verl's rule before verl#7553), got {strict!r}")


def _plan_parts(views: Callable[[], Tuple[Mapping[str, Any], Mapping[str, Any]]], max_token_len: Any, dp_group,
                num_batches_divided_by, same_micro_num_in_dp, min_num_micro_batch, use_dynamic_bsz_balance,
                force_group_size, strict, step_plan, dp_rank, mini_batch, shared_prefix=False,
                group_key="uid", prefix_reuse=False) -> Tuple[List[List[int]], Any]:
    """Row indices of each micro-batch, and the rank's prefix-reuse plan where they
    are passes (each pass then lists the rank's rows in the order that lays out its
    trees), else None.
    ``views()`` gives ``(tensors, columns)``: the lengths come from
    ``tensors['attention_mask']``, and every value of ``columns`` must have its rows
    (called inside the agreement: it may raise)."""
    if step_plan is not None:
        return step_plan_parts(step_plan, dp_rank, mini_batch, batch_size(views()[1]),
                               as_positive_int(max_token_len, "max_token_len"), "max_token_len"), None
    try:
        mode, bad_mode = _mode_of(strict), None
    except ValueError as exc:  # raised inside the agreement, so that a dp_group's other ranks stop too
        mode, bad_mode = "invalid", exc
    if mode == "strict":
        agree = bool(same_micro_num_in_dp) and (dp_group is not None or active())
    else:  # verl: dist.is_initialized() and same_micro_num_in_dp and dp_group is not None
        agree = bool(same_micro_num_in_dp) and dp_group is not None and _initialized()
    box: Dict[str, Any] = {"passes": None}
    cap = 0  # max_token_len, checked inside the agreement (an invalid one on one rank stops every rank)
    reuse = bool(prefix_reuse)

    def strict_plan(count: int) -> List[List[int]]:
        forest = box.get("forest")
        plan = plan_micro_batches(box["units"] if forest is None else forest.lengths, cap, min_num=count,
                                  multiple_of=box["multiple"], attention_coeff=WORKLOAD_ATTENTION_COEFF,
                                  order="small_at_ends" if use_dynamic_bsz_balance else "heaviest_first",
                                  forest=forest, whole_trees=forest is not None and box["group"] > 1,
                                  prefix_reuse=forest is not None and reuse)
        box["passes"] = plan.prefix_reuse  # None on trees
        if box["passes"] is not None:  # every pass reads the rank's trees: its rows in the order that lays them out
            return [list(plan.prefix_reuse.rank_rows[0]) if p else [] for p in plan.micro_batches]
        return [list(p) for p in plan.micro_batches]

    def verl_plan(count: int) -> List[List[int]]:
        work = box["work"]
        if count > len(work):
            raise ValueError(f"{count} micro-batches need at least {count} rows (groups of force_group_size), "
                             f"got {len(work)}")
        parts = get_seqlen_balanced_partitions(work, count, equal_size=False) if count else []
        if use_dynamic_bsz_balance:  # verl: by (workload, first row) descending, then light ... heavy ... light
            parts.sort(key=lambda p: (int(work[p].sum()), p[0] if p else 0), reverse=True)
            parts = parts[::2][::-1] + parts[1::2]
        return parts

    def local():  # every check that can differ between ranks, inside the agreement
        nonlocal cap
        if bad_mode is not None:
            raise bad_mode
        cap = as_positive_int(max_token_len, "max_token_len")
        tensors, columns = views()
        lengths = mask_lengths(tensors)
        batch_size(columns)  # every value must have the mask's rows (extra rows were silently dropped)
        if reuse and not shared_prefix:
            raise ValueError("prefix_reuse=True runs prefix trees larger than the cap in passes: it needs "
                             "shared_prefix=True")
        if reuse:
            from .prefix_reuse import check_pass_inputs

            check_pass_inputs(tensors)
        if lengths.size and lengths.max() > cap and not reuse:  # in passes a row longer than the cap is planned
            raise ValueError(f"a sequence has {int(lengths.max())} tokens, more than max_token_len={cap}")
        group = as_positive_int(force_group_size, "force_group_size")
        if len(lengths) % group:
            raise ValueError(f"the batch has {len(lengths)} rows, not a multiple of force_group_size={group}")
        units = lengths.reshape(-1, group).sum(1) if group > 1 else lengths
        if shared_prefix:
            box["forest"] = _forest(tensors, columns, group_key, mode)
            if group > 1 and reuse:
                raise ValueError(f"prefix_reuse=True cuts a tree larger than the cap into passes, so rows a loss "
                                 f"couples (force_group_size={group}) cannot meet in one micro-batch")
            if group > 1:  # rows coupled by the loss: trees whole, each group in one
                coupled_trees(box["forest"], group, cap, "force_group_size", "max_token_len")
        elif mode != "soft_cap" and group > 1 and units.size and units.max() > cap:  # verl < #7553 let it exceed
            raise ValueError(f"{group} consecutive rows (force_group_size) hold {int(units.max())} tokens, more than "
                             f"max_token_len={cap}")
        if num_batches_divided_by is None or (mode != "verl" and not num_batches_divided_by):
            multiple = 1  # (verl: roundup_divisible(n, 0) fails, so 0 is refused there)
        else:
            multiple = as_positive_int(num_batches_divided_by, "num_batches_divided_by")
        box.update(units=units, multiple=multiple, group=group)
        if mode == "strict":
            min_num = as_positive_int(min_num_micro_batch, "min_num_micro_batch") if min_num_micro_batch else 1
            return strict_plan(min_num)
        if mode == "verl" and not len(units):  # verl: max() of no lengths (a ValueError), before any collective
            raise ValueError("the batch has no rows: verl's rearrange_micro_batches needs at least one "
                             "(max_token_len cannot be checked on an empty batch)")
        work = sequence_workloads(lengths, WORKLOAD_ATTENTION_COEFF)
        box["work"] = work.reshape(-1, group).sum(1) if group > 1 else work
        count = min(len(units), ceildiv(int(units.sum()), cap))
        if min_num_micro_batch is not None:
            box["min_num"] = as_positive_int(min_num_micro_batch, "min_num_micro_batch", allow_zero=True)
            count = max(box["min_num"], count)
        if mode == "verl":
            return count  # grown below, after the ranks agree on it
        count = max(count, 1) if len(units) else count  # verl fails on k = 0 (an all-padding batch)
        return verl_plan(roundup_divisible(count, multiple))

    def facts(_: Any) -> Dict[str, Any]:  # what changes the collectives that follow: the same on every rank
        return {"strict": mode, "num_batches_divided_by": box["multiple"], "shared_prefix": bool(shared_prefix),
                "prefix_reuse": reuse}

    result = checked_on_every_rank(local, dp_group, "rearrange_micro_batches", agree, fingerprint=facts)
    if mode == "verl":
        parts = _grow_until_within_cap(result, box, cap, verl_plan, dp_group if agree else None)
    elif agree:
        parts = agree_on_count(len(result), strict_plan if mode == "strict" else verl_plan, len, dp_group,
                               "rearrange_micro_batches")
    else:
        parts = result
    group = box["group"]
    if group > 1 and box.get("forest") is None:  # parts of groups; a forest's parts are rows
        parts = [[g * group + j for g in p for j in range(group)] for p in parts]
    return [[int(i) for i in p] for p in parts], box["passes"]


def _forest(tensors: Mapping[str, Any], columns: Mapping[str, Any], group_key: Optional[str], mode: str):
    """The :class:`~seqpack.PrefixForest` of a batch's rows for ``shared_prefix``."""
    if mode != "strict":
        raise ValueError("shared_prefix plans prefix trees with seqpack's planner: it needs strict=True")
    return padded_forest({**columns, **tensors}, group_key, missing_group_ok=True)[0]


def _grow_until_within_cap(count: int, box: Mapping[str, Any], cap: int, verl_plan: Callable[[int], List[List[int]]],
                           dp_group) -> List[List[int]]:
    """The released verl's count: the largest rank's (with ``dp_group``), rounded up
    to ``num_batches_divided_by``, then grown by it until every rank's Karmarkar-Karp
    parts hold at most ``cap`` tokens each. Every rank runs the same collectives
    (one MAX, then one MIN per count tried) and raises the same error."""
    units, step = box["units"], box["multiple"]
    fewest = len(units)
    if dp_group is not None:
        most, minus_fewest = all_reduce_ints([count, -fewest], "max", dp_group)
        count, fewest = most, -minus_fewest
    count = roundup_divisible(count, step) or step  # 0: an all-padding batch (verl's KK fails on k = 0)
    while True:
        if count > fewest:
            group = box["group"]
            raise ValueError(
                f"{count} micro-batches are needed (max_token_len={cap}, min_num_micro_batch="
                f"{box.get('min_num')}, num_batches_divided_by={step}), but "
                f"{'the smallest rank of dp_group' if dp_group is not None else 'the batch'} has only {fewest} "
                f"{f'groups of force_group_size={group} rows' if group > 1 else 'rows'} and every micro-batch needs "
                "one (verl raises too)")
        parts = verl_plan(count)
        fits = all(int(units[p].sum()) <= cap for p in parts)
        if dp_group is not None:
            fits = bool(all_reduce_int(int(fits), "min", dp_group))
        if fits:
            return parts
        count += step


def _initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


# ------------------------------------------------------------------ rows


def _mapping_views(batch: Any) -> Callable[[], Tuple[Any, Any]]:
    return lambda: (batch, batch)


def _proto_views(proto: Any) -> Callable[[], Tuple[Any, Any]]:
    """A DataProto's tensors (``attention_mask`` is one) and all its row-aligned values."""
    return lambda: (_tensors(proto), proto_columns(proto))


def _tensors(proto: Any) -> Dict[str, Any]:
    tensors = proto.batch
    return {} if tensors is None else {k: tensors[k] for k in list(tensors.keys())}


def _dummy(batch: Mapping[str, Any]) -> Any:
    row = dummy_row(batch)
    if not isinstance(batch, dict) and hasattr(batch, "batch_size"):  # a TensorDict keeps its type
        return type(batch)(row, batch_size=[1])
    return row


def _proto_dummy(proto: Any) -> Any:
    """Row 0 of a DataProto with its tensors replaced by :func:`dummy_row`'s."""
    out = proto_select(proto, [0], "data")
    for key, value in dummy_row(_tensors(proto), name="data.batch").items():
        out.batch[key] = value
    return out
