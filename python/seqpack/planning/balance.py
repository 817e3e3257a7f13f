"""Balanced partitioning: data-parallel ranks and micro-batches.

* :func:`karmarkar_karp` / :func:`get_seqlen_balanced_partitions` - verl's (and
  ROLL's) functions, same partitions, in C++.
* :func:`greedy_lpt_partition`, :func:`sorted_stride_partition` - simpler rules.
* :func:`plan_micro_batches` - micro-batches under a *hard* token cap.

Example:
    >>> get_seqlen_balanced_partitions([5, 3, 8, 1, 9, 2], k_partitions=2, equal_size=False)
    [[1, 4, 5], [0, 2, 3]]
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from .. import _core
from .._lengths import as_flag, as_lengths, as_positive_int, core_lengths
from .cost import WORKLOAD_ATTENTION_COEFF  # noqa: F401 (verl's and ROLL's constant, imported from here)
from .metrics import dp_balance_metrics


def _k(k_partitions: Any) -> int:
    return as_positive_int(k_partitions, "k_partitions")


def _coeff(attention_coeff: Any) -> int:
    """``attention_coeff``: None or 0 balance tokens; a positive int the quadratic workload."""
    return 0 if attention_coeff is None else as_positive_int(attention_coeff, "attention_coeff", allow_zero=True)


def karmarkar_karp(seqlen_list: Any, k_partitions: int, equal_size: bool) -> List[List[int]]:
    """Karmarkar-Karp (largest differencing) k-way partition.

    Returns exactly what verl's ``karmarkar_karp`` returns: ``k_partitions`` lists
    of indices, ordered by decreasing sum, items in merge order. With
    ``equal_size`` every partition has ``n / k`` items.

    Raises:
        ValueError: ``k_partitions < 1``, fewer items than partitions, negative
            values, or ``equal_size`` with ``n % k != 0``.
    """
    return _core.karmarkar_karp(core_lengths(seqlen_list, "seqlen_list"), _k(k_partitions), bool(equal_size))


def get_seqlen_balanced_partitions(seqlen_list: Any, k_partitions: int, equal_size: bool) -> List[List[int]]:
    """verl's ``get_seqlen_balanced_partitions``: KK partitions, indices sorted.

    Example:
        >>> get_seqlen_balanced_partitions([1, 1, 9, 9], 2, equal_size=True)
        [[0, 3], [1, 2]]
    """
    return _core.karmarkar_karp(core_lengths(seqlen_list, "seqlen_list"), _k(k_partitions), bool(equal_size), True)


def greedy_lpt_partition(seqlen_list: Any, k_partitions: int, equal_size: bool = False) -> List[List[int]]:
    """Longest-processing-time greedy: largest first, each to the lightest group.

    Indices are sorted within groups. (verl's ``greedy_partition`` takes items in
    input order instead; LPT sorts them first, which balances far better.)
    """
    return _core.greedy_lpt_partition(core_lengths(seqlen_list, "seqlen_list"), _k(k_partitions), bool(equal_size))


def sorted_stride_partition(seqlen_list: Any, k_partitions: int) -> List[List[int]]:
    """Sort ascending and deal round-robin (NeMo-RL's dynamic-batching sharding).

    Example:
        >>> sorted_stride_partition([2, 8, 4, 16], 2)
        [[0, 1], [2, 3]]
    """
    return _core.sorted_stride_partition(core_lengths(seqlen_list, "seqlen_list"), _k(k_partitions))


def log_seqlen_unbalance(seqlen_list: Sequence[int], partitions: List[List[int]], prefix: str) -> Dict[str, float]:
    """verl's name for :func:`seqpack.metrics.dp_balance_metrics`."""
    return dp_balance_metrics(seqlen_list, partitions, prefix)




def sequence_workloads(lengths: Any, attention_coeff: Optional[int] = None) -> np.ndarray:
    """Per-sequence workload: ``s`` (tokens) or ``attention_coeff * s + s**2``.

    The quadratic model counts linear layers (proportional to ``s``, with
    ``attention_coeff`` the ratio of their per-token cost to attention's
    per-token-pair cost, a few times the hidden size) plus causal attention.
    """
    return _core.sequence_workloads(as_lengths(lengths, "lengths"), _coeff(attention_coeff))


@dataclass
class MicroBatchPlan:
    """Micro-batches of one mini-batch under a hard token cap.

    Attributes:
        micro_batches: indices per micro-batch (sorted within each).
        tokens: token sum per micro-batch; every entry <= ``max_tokens``.
        workloads: balanced workload per micro-batch (tokens unless
            ``attention_coeff`` was given).
        max_tokens: the cap.
        lower_bound: ``max(min_num, ceil(total / max_tokens))``, before rounding
            up to ``multiple_of``.
        method: the partitioner whose plan was accepted (``karmarkar_karp``,
            ``greedy_lpt``, ``capped_greedy`` or ``first_fit_decreasing``).
        sharing_kept: planned with a :class:`~seqpack.PrefixForest`: the batch's
            physical tokens over the sum of the micro-batches' (1.0 when no tree is
            cut); ``tokens`` are then each micro-batch's physical tokens and
            ``workloads`` count attention by visible pairs. None otherwise.
        physical_lower_bound: planned with a forest, the batch's physical tokens
            (its rows as one prefix tree): no plan holds fewer. ``lower_bound`` is
            then ``max(min_num, ceil(physical_lower_bound / max_tokens))``. None
            otherwise.
        prefix_reuse: planned in passes (``prefix_reuse=True`` and ``method`` is
            ``"prefix_reuse"``), the :class:`~seqpack.planning.PrefixReusePlan` of
            its one rank (roles, the K/V pairs each pass reads, the row order that
            builds the passes); ``micro_batches`` then list each pass's rows (a row
            in every pass that holds some of its tokens). None otherwise.
    """

    micro_batches: List[List[int]]
    tokens: List[int]
    workloads: List[int]
    max_tokens: int
    lower_bound: int
    method: str
    order: str = field(default="heaviest_first")
    sharing_kept: Optional[float] = None
    physical_lower_bound: Optional[int] = None
    prefix_reuse: Optional[Any] = field(default=None, repr=False)

    @property
    def num_micro_batches(self) -> int:
        return len(self.micro_batches)

    @property
    def imbalance(self) -> float:
        """max / mean workload - 1 (0 is perfect balance)."""
        if not self.workloads:
            return 0.0
        mean = sum(self.workloads) / len(self.workloads)
        return max(self.workloads) / mean - 1.0 if mean > 0 else 0.0

    def __len__(self) -> int:
        return len(self.micro_batches)

    def __iter__(self):
        return iter(self.micro_batches)

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{i}</td><td>{len(mb)}</td><td>{t}</td><td>{t / self.max_tokens:.1%}</td><td>{w}</td></tr>"
            for i, (mb, t, w) in enumerate(zip(self.micro_batches, self.tokens, self.workloads))
        )
        head = html.escape(
            f"MicroBatchPlan: {len(self)} micro-batches (lower bound {self.lower_bound}), cap {self.max_tokens}, "
            f"method {self.method}, imbalance {self.imbalance:.2%}"
        )
        return (
            f"<b>{head}</b><table><tr><th>#</th><th>sequences</th><th>tokens</th><th>fill</th>"
            f"<th>workload</th></tr>{rows}</table>"
        )


def plan_micro_batches(
    lengths: Any,
    max_tokens: int,
    min_num: int = 1,
    multiple_of: int = 1,
    attention_coeff: Optional[int] = None,
    order: str = "heaviest_first",
    *,
    forest: Any = None,
    group_ids: Any = None,
    whole_trees: bool = False,
    prefix_reuse: bool = False,
) -> MicroBatchPlan:
    """Split sequences into balanced micro-batches that never exceed ``max_tokens``.

    Finds the smallest count ``k >= max(min_num, ceil(total / max_tokens))``, a
    multiple of ``multiple_of`` (PP / VPP), for which a balanced plan keeps every
    micro-batch's token sum <= ``max_tokens``: Karmarkar-Karp or LPT on the
    workload (up to 65,536 sequences), else a cap-aware greedy (each sequence,
    heaviest first, to the lightest micro-batch with room for it), else
    first-fit-decreasing's bins (always within the cap); the last two are then
    rebalanced by moves and swaps that keep the cap. Counts are tried at the lower
    bound, then at FFD's count and bisected in between, so a million lengths plan
    in under a second. ROLL's ``load_balance`` and verl's
    ``rearrange_micro_batches`` before verl#7553 stop at ``ceil(total / cap)`` and
    may exceed the cap; this never does (verl 0.9 grows its count until its
    Karmarkar-Karp parts fit).

    Args:
        lengths: tokens per sequence.
        max_tokens: hard cap per micro-batch (e.g. ``max_packed_sequence_length_train``).
        min_num: minimum number of micro-batches.
        multiple_of: the count is a multiple of this (e.g. PP size with VPP).
        attention_coeff: balance ``attention_coeff * s + s**2`` instead of tokens.
        order: ``"heaviest_first"`` or ``"small_at_ends"`` (lightest micro-batches
            first and last, shrinking pipeline bubbles).
        forest: a :class:`~seqpack.PrefixForest` of the same rows (``lengths`` must be
            ``forest.lengths``): plan prefix trees instead of rows, in one C++ call
            (:mod:`~seqpack.planning.forest_planning`). The cap then bounds each
            micro-batch's *physical* tokens (what the tree layout holds). The plan
            has the fewest micro-batches, then the fewest physical tokens, of
            several packings: whole trees (a tree larger than the cap split where
            it duplicates the fewest tokens), trees split to fill micro-batches that
            would stay part empty (each part carries its prefix again), first fit
            over rows in depth-first order, and AReaL's first-fit tries
            (:func:`~seqpack.planning.forest_planning.first_fit_trie`); so never
            more micro-batches, nor more tokens at as many, than either the
            whole-trees plan or AReaL's. Balance counts physical tokens, or with
            ``attention_coeff`` ``attention_coeff * tokens`` plus twice the visible
            attention pairs minus the tokens (``s**2`` for a plain row).
        whole_trees: with ``forest``, keep every tree that fits the cap in one
            micro-batch (only a larger tree is split): for losses that couple a
            tree's rows inside a micro-batch (DPO and other preference pairs).
            Per-token losses (GRPO, SFT) do not need it.
        prefix_reuse: with ``forest``, also plan the trees in passes
            (:func:`~seqpack.planning.plan_prefix_reuse`: each shared prefix once,
            branches reading its K/V; a row longer than the cap planned, not
            refused) and keep the passes when they need fewer micro-batches, or as
            many and fewer tokens, than the plan on trees. Passes keep their run
            order (``order`` applies to the plan on trees).
        group_ids: one label per row; rows of one label stay in one micro-batch
            (DPO's chosen / rejected pairs, a reward model's candidates), listed in
            row order. Each group is one item (its summed tokens and workloads); a
            group over ``max_tokens`` raises.

    Raises:
        ValueError: a sequence longer than ``max_tokens``; more micro-batches
            required than there are sequences; bad arguments.

    Example:
        >>> plan = plan_micro_batches([512, 1024, 256, 2048, 128, 768, 1536, 384, 896, 640], 4096)
        >>> plan.tokens
        [4096, 4096]
    """
    if order not in ("heaviest_first", "small_at_ends"):
        raise ValueError(f"order must be 'heaviest_first' or 'small_at_ends', got {order!r}")
    max_tokens = as_positive_int(max_tokens, "max_tokens")
    if whole_trees and forest is None:
        raise ValueError("whole_trees=True needs forest= (it keeps a PrefixForest's trees whole)")
    if as_flag(prefix_reuse, "prefix_reuse"):
        if forest is None or whole_trees or group_ids is not None:
            raise ValueError("prefix_reuse=True needs forest= (it runs a PrefixForest's trees in passes), and "
                             "neither whole_trees=True nor group_ids (rows a loss couples meet in no one micro-batch "
                             "when their tree runs in passes)")
        from .prefix_forest import refuse_work_items_in_passes

        refuse_work_items_in_passes(forest)
        return _with_passes(forest, lengths, max_tokens, as_positive_int(min_num, "min_num"),
                            as_positive_int(multiple_of, "multiple_of"), _coeff(attention_coeff), order)
    if group_ids is not None:
        if forest is not None:
            raise ValueError("forest and group_ids cannot be combined (a forest's trees are its groups: build it "
                             "with PrefixForest(..., group_ids=))")
        from .group_planning import plan_group_micro_batches

        return MicroBatchPlan(**plan_group_micro_batches(
            group_ids, lengths, max_tokens, as_positive_int(min_num, "min_num"),
            as_positive_int(multiple_of, "multiple_of"), _coeff(attention_coeff), order,
            sequence_workloads(lengths, attention_coeff)))
    if forest is not None:
        from .forest_planning import plan_forest_micro_batches

        return MicroBatchPlan(**plan_forest_micro_batches(
            forest, lengths, max_tokens, as_positive_int(min_num, "min_num"),
            as_positive_int(multiple_of, "multiple_of"), _coeff(attention_coeff), order, whole_trees))
    raw = _core.plan_micro_batches(
        as_lengths(lengths, "lengths"),
        max_tokens,
        as_positive_int(min_num, "min_num"),
        as_positive_int(multiple_of, "multiple_of"),
        _coeff(attention_coeff),
        order == "small_at_ends",
    )
    return MicroBatchPlan(
        micro_batches=raw["groups"],
        tokens=raw["tokens"],
        workloads=raw["workloads"],
        max_tokens=max_tokens,
        lower_bound=raw["lower_bound"],
        method=raw["method"],
        order=order,
    )


def _with_passes(forest: Any, lengths: Any, max_tokens: int, min_num: int, multiple_of: int, coeff: int,
                 order: str) -> MicroBatchPlan:
    """The plan in passes, or the plan on trees where it needs fewer micro-batches
    (or as many and no more tokens)."""
    from .forest_planning import checked_forest, plan_forest_micro_batches
    from .prefix_reuse import plan_prefix_reuse
    from .step_prefix_reuse import pass_cells

    forest = checked_forest(forest, lengths)
    passes = plan_prefix_reuse(forest, max_tokens, min_micro_batches=min_num, multiple_of=multiple_of)
    k, n = passes.num_micro_batches, passes.pass_tokens[0]
    if forest.num_rows and int(forest.lengths.max()) <= max_tokens:  # trees can be planned, unless ...
        try:
            plain = MicroBatchPlan(**plan_forest_micro_batches(forest, lengths, max_tokens, min_num, multiple_of,
                                                               coeff, order, False))
        except ValueError as exc:  # ... they need more micro-batches than there are rows (passes may be empty)
            if "but there are only" not in str(exc):
                raise
            plain = None
        if plain is not None and (len(plain), sum(plain.tokens)) <= (k, sum(n)):
            return plain
    tokens = np.asarray(n, dtype=np.int64)
    pairs = np.asarray(passes.pass_pairs[0], dtype=np.int64)
    work = tokens if not coeff else coeff * tokens + 2 * pairs - tokens
    cells = pass_cells(passes.pass_rows, passes.pass_tokens, [[int(w) for w in work]], k, 0)
    return MicroBatchPlan(
        micro_batches=cells["assignment"][0], tokens=cells["tokens"][0], workloads=cells["costs"][0],
        max_tokens=max_tokens, lower_bound=max(min_num, passes.bound), method="prefix_reuse", order=order,
        sharing_kept=1.0, physical_lower_bound=forest.num_physical_tokens, prefix_reuse=passes)
