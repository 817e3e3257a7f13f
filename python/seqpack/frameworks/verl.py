"""verl's dynamic micro-batching (``verl.utils.seqlen_balancing``), with a strict cap.

:func:`rearrange_micro_batches` takes verl's arguments and returns verl's
``(micro_batches, micro_bsz_idx)``; unlike verl's KK split into
``ceil(total / max_token_len)`` parts (whose parts can exceed the cap), every
micro-batch here holds at most ``max_token_len`` real tokens: the count grows
until Karmarkar-Karp (or LPT) balances the workload within the cap, and when
ranks are given it is the same on every rank, agreed with collectives that every
rank runs (no rank waits alone).

    >>> import torch
    >>> mask = torch.ones(8, 7, dtype=torch.long)              # 8 rows of 7 tokens, cap 8
    >>> mbs, idx = rearrange_micro_batches({"attention_mask": mask}, max_token_len=8)
    >>> len(mbs), max(int(mb["attention_mask"].sum()) for mb in mbs)
    (8, 7)
    >>> get_reverse_idx([2, 0, 1])
    [1, 2, 0]
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Tuple

from ._batch import batch_size, dummy_row, mask_lengths, select_all, step_plan_parts
from .._dist import active, agree_on_count, checked_on_every_rank
from .._lengths import as_positive_int
from ..planning.balance import WORKLOAD_ATTENTION_COEFF, get_seqlen_balanced_partitions, plan_micro_batches

if TYPE_CHECKING:  # pragma: no cover
    from ..planning.step import StepPlan

__all__ = ["ceildiv", "get_reverse_idx", "get_seqlen_balanced_partitions", "rearrange_micro_batches",
           "roundup_divisible"]


def ceildiv(a: int, b: int) -> int:
    return -(a // -b)


def roundup_divisible(a: int, b: int) -> int:
    return ((a + b - 1) // b) * b


def get_reverse_idx(idx_map: List[int]) -> List[int]:
    """The inverse permutation: ``out[idx_map[i]] = i``."""
    out = list(idx_map)
    for i, j in enumerate(idx_map):
        out[j] = i
    return out


def rearrange_micro_batches(
    batch: Mapping[str, Any],
    max_token_len: int,
    dp_group=None,
    num_batches_divided_by: Optional[int] = None,
    same_micro_num_in_dp: bool = True,
    min_num_micro_batch: Optional[int] = None,
    use_dynamic_bsz_balance: bool = True,
    *,
    step_plan: Optional["StepPlan"] = None,
    dp_rank: Optional[int] = None,
    mini_batch: int = 0,
) -> Tuple[List[Any], List[List[int]]]:
    """Split a batch into micro-batches of at most ``max_token_len`` real tokens.

    Args:
        batch: mapping (dict, TensorDict) of row-aligned tensors with ``attention_mask``.
        max_token_len: strict cap on real tokens per micro-batch.
        dp_group: the data-parallel group whose ranks must run the same number of
            micro-batches (the default group when ``torch.distributed`` is initialised).
        num_batches_divided_by: the count is a multiple of this (Megatron VPP).
        same_micro_num_in_dp: agree on the count across ``dp_group``.
        min_num_micro_batch: lower bound on the count (e.g. pipeline stages).
        use_dynamic_bsz_balance: order micro-batches light, heavy, ..., heavy, light
            by the workload ``24576·s + s²``; otherwise heaviest first.
        step_plan, dp_rank, mini_batch: take rank ``dp_rank``'s micro-batches of
            ``mini_batch`` from a :func:`seqpack.plan_step` plan of the global batch
            (``batch`` holds ``step_plan.rank_rows(dp_rank, mini_batch)``). The plan
            gives every rank the same count, so no collective runs; an empty
            micro-batch becomes a one-row dummy (one token, zero loss masks) with no
            entry in ``micro_bsz_idx``.

    Returns:
        ``(micro_batches, micro_bsz_idx)``: the sub-batches (rows ascending) and
        their row indices; ``get_reverse_idx(sum(micro_bsz_idx, []))`` restores order.

    Raises:
        ValueError: a sequence longer than ``max_token_len``; a count no rank can
            reach with its rows (raised on every rank).
    """
    cap = as_positive_int(max_token_len, "max_token_len")
    if step_plan is not None:
        parts = step_plan_parts(step_plan, dp_rank, mini_batch, batch_size(batch), cap, "max_token_len")
        return [_select(batch, p) if p else _dummy(batch) for p in parts], parts
    agree = same_micro_num_in_dp and (dp_group is not None or active())
    order = "small_at_ends" if use_dynamic_bsz_balance else "heaviest_first"
    box = {}

    def plan_with(count: int):
        return plan_micro_batches(box["lengths"], cap, min_num=count, multiple_of=box["multiple"],
                                  attention_coeff=WORKLOAD_ATTENTION_COEFF, order=order)

    def local():  # every check that can differ between ranks, inside the agreement
        box["lengths"] = lengths = mask_lengths(batch)
        batch_size(batch)  # every value must have the mask's rows (extra rows were silently dropped)
        if lengths.size and lengths.max() > cap:
            raise ValueError(f"a sequence has {int(lengths.max())} tokens, more than max_token_len={cap}")
        box["multiple"] = (as_positive_int(num_batches_divided_by, "num_batches_divided_by")
                           if num_batches_divided_by else 1)
        min_num = as_positive_int(min_num_micro_batch, "min_num_micro_batch") if min_num_micro_batch else 1
        return plan_with(min_num)

    plan = checked_on_every_rank(local, dp_group, "rearrange_micro_batches", agree)
    if agree:
        plan = agree_on_count(plan.num_micro_batches, plan_with, lambda p: p.num_micro_batches, dp_group,
                              "rearrange_micro_batches")
    micro_batches = [_select(batch, part) for part in plan.micro_batches]
    return micro_batches, [list(p) for p in plan.micro_batches]


def _dummy(batch: Mapping[str, Any]) -> Any:
    row = dummy_row(batch)
    if not isinstance(batch, dict) and hasattr(batch, "batch_size"):  # a TensorDict keeps its type
        return type(batch)(row, batch_size=[1])
    return row


def _select(batch: Mapping[str, Any], rows: List[int]) -> Any:
    if not isinstance(batch, dict) and hasattr(batch, "batch_size"):  # a TensorDict keeps its type
        import torch

        return batch[torch.tensor(rows, dtype=torch.long)]
    out: Dict[str, Any] = select_all(batch, rows)
    return out
