"""Plan a whole training step: sequences over data-parallel ranks *and* micro-batches
at once, for the fastest step under a :class:`~seqpack.planning.cost.CostModel`.

Frameworks plan in two blind steps (balance over ranks, then cut each rank's share
into micro-batches). What the step costs depends on how the ranks synchronise:

* ``sync="micro_batch"`` (FSDP / ZeRO-3: every micro-batch all-gathers the
  parameters, ranks move in lock-step): ``Σ_k max_r cost(r, k)``.
* ``sync="step"`` (DDP, Megatron: gradients reduced once per step):
  ``max_r Σ_k cost(r, k)``.

:func:`plan_step` minimises the one you name, in C++, and guarantees: every index
once; no micro-batch above ``max_tokens``; in each mini-batch the same number of
micro-batches on every rank (so no collective is needed to agree on it); dummies
(empty micro-batches, still run for the collectives) only where needed; the same
plan on every rank for the same lengths and seed. Its options (cost model, sync,
mini-batches, context parallelism, order, shapes) are one
:class:`~seqpack.StepOptions` (``options=``, shared with
:class:`~seqpack.StreamPlanner` and the configs) or the same fields as keywords.

    >>> from seqpack.planning.step import plan_step
    >>> plan = plan_step([3000, 500, 500, 2500, 1000, 400], dp_size=2, max_tokens=4000)
    >>> plan.assignment            # [mini-batch][rank][micro-batch] -> sequence indices
    [[[[2, 3, 4]], [[0, 1, 5]]]]
    >>> plan.num_micro_batches, round(plan.predicted_time, 4), round(plan.lower_bound, 4)  # seconds
    ([1], 0.5858, 0.5815)
"""

from __future__ import annotations

import dataclasses

import html
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .. import _core
from .._readonly import ReadOnlyArrays
from .._lengths import INT64_MAX, as_int64, as_lengths, as_positive_int
from .cost import CostModel
from .prefix_forest import PrefixForest
from .step_options import StepOptions, with_keywords
from .step_shapes import shape_buckets

__all__ = ["StepPlan", "plan_step"]


@dataclass(frozen=True)
class StepPlan(ReadOnlyArrays):
    """The plan of one training step (one or more mini-batches / optimizer steps).

    Attributes:
        assignment: ``assignment[m][r][k]`` - the sequence indices (sorted) of
            mini-batch ``m``, rank ``r``, micro-batch ``k``; ``[]`` is a dummy.
        costs: the cost model's prediction for each micro-batch, same shape
            (a dummy costs ``per_micro_batch``).
        tokens: token sum of each micro-batch, same shape, each ``<= max_tokens``.
        num_micro_batches: micro-batches per rank in each mini-batch.
        mini_batch_ranges: ``(begin, end)`` of each mini-batch in the global batch.
        predicted_time: the step's time under the cost model and ``sync``, summed
            over mini-batches.
        lower_bound: a proven lower bound on ``predicted_time`` for any plan of the
            same inputs (docs/planning.md, "How far from optimal").
        lengths: the planned sequence lengths, one per sequence of the global batch
            (what :meth:`valid_tokens` checks counts against).
        planned_on / sharing_kept: with a :class:`~seqpack.PrefixForest`, the
            items the kept plan placed: ``"trees"`` (whole trees and the parts of
            larger ones), ``"split_trees"`` / ``"first_fit_rows"`` /
            ``"first_fit_trie"`` (the micro-batches of those packings),
            ``"rows"`` (the plain plan), ``"ranks_of_trees"`` (trees dealt to
            ranks, then micro-batches per rank); comma-separated per
            mini-batch when they differ. And the batch's physical tokens over the
            sum of the micro-batches' (1.0 when no tree is cut). None without a
            forest.
        prefix_reuse / context_pairs: with ``StepOptions.prefix_reuse``, each
            mini-batch's :class:`~seqpack.planning.PrefixReusePlan` where it runs
            in passes (``None`` where its cells are trees), and each cell's
            attention pairs whose K/V an earlier pass computed (what the cost
            model prices as part of the cell's visible pairs). In a mini-batch in
            passes, ``assignment`` lists the rows with a token in each pass (a
            row may be in several), ``tokens`` each pass's own tokens.
        forest / whole_trees: the :class:`~seqpack.PrefixForest` the plan was made
            on (row ``i`` is sequence ``i``; None without one) and whether every
            tree was kept whole (``StepOptions.whole_trees``): what a shard of this
            plan needs to lay its micro-batches out as the planned trees.
    """

    assignment: List[List[List[List[int]]]]
    costs: List[List[List[float]]]
    tokens: List[List[List[int]]]
    num_micro_batches: List[int]
    mini_batch_ranges: List[Tuple[int, int]]
    predicted_time: float
    lower_bound: float
    dp_size: int
    max_tokens: int
    sync: str
    cost: CostModel
    # Read-only int64; not compared (the cells and token sums already say what the plan is).
    lengths: Optional[np.ndarray] = field(default=None, repr=False, compare=False)
    # Planned with a PrefixForest: "trees" (its items) or "rows" (the plain plan won),
    # and the batch's physical tokens over the micro-batches' sum. None otherwise.
    planned_on: Optional[str] = None
    sharing_kept: Optional[float] = None
    # Context parallelism: ranks are dp_rank * cp_size + cp_rank; per sequence its
    # degree and the first rank of its block (read-only int64); the K/V tokens the
    # ranks gather, and the least any degrees allow. None / 1 without CP.
    cp_size: int = 1
    cp_degree: Optional[np.ndarray] = field(default=None, repr=False, compare=False)
    cp_first_rank: Optional[np.ndarray] = field(default=None, repr=False, compare=False)
    kv_tokens: Optional[int] = None
    least_kv_tokens: Optional[int] = None
    # Step shapes (planning/step_shapes.py, planned in the core): the order of each rank's micro-batches,
    # and with static_shapes the bucket sizes and each cell's padded size (costs and
    # predicted_time then include the padding).
    micro_batch_order: str = "planned"
    shape_buckets: Optional[Tuple[int, ...]] = None
    padded_tokens: Optional[List[List[List[int]]]] = None
    # Planned on prefix trees: the PrefixForest (its row i is sequence i; not compared:
    # the cells already say what was planned) and whether its trees were kept whole.
    forest: Optional[PrefixForest] = field(default=None, repr=False, compare=False)
    whole_trees: bool = False
    # Prefix reuse (planning/step_prefix_reuse.py): per mini-batch its passes' plan, or
    # None where the cells are trees; and each cell's attention pairs whose K/V an
    # earlier pass computed (0 outside passes). None without prefix_reuse.
    prefix_reuse: Optional[Tuple[Any, ...]] = field(default=None, repr=False, compare=False)
    context_pairs: Optional[List[List[List[int]]]] = field(default=None, repr=False, compare=False)

    @property
    def num_ranks(self) -> int:
        """``dp_size * cp_size``: the ranks ``assignment`` runs over."""
        return self.dp_size * self.cp_size

    @property
    def gap(self) -> float:
        """``predicted_time / lower_bound`` (1.0: provably optimal)."""
        return self.predicted_time / self.lower_bound if self.lower_bound > 0 else 1.0

    @property
    def num_sequences(self) -> int:
        return self.mini_batch_ranges[-1][1] if self.mini_batch_ranges else 0

    @property
    def padding_tokens(self) -> int:
        """Tokens of static-shape padding over all cells (0 without ``static_shapes``)."""
        if self.padded_tokens is None:
            return 0
        return sum(p - t for pm, tm in zip(self.padded_tokens, self.tokens) for pr, tr in zip(pm, tm)
                   for p, t in zip(pr, tr))

    @property
    def num_dummies(self) -> int:
        return sum(not cell for mb in self.assignment for rank in mb for cell in rank)

    def rank(self, r: int) -> List[List[List[int]]]:
        """Rank ``r``'s micro-batches: ``[m][k]`` lists of sequence indices."""
        r = as_int64(r, "r")
        if not 0 <= r < self.num_ranks:
            raise ValueError(f"r must be a rank in [0, {self.num_ranks}), got {r!r}")
        return [mb[r] for mb in self.assignment]

    def rank_rows(self, r: int, mini_batch: Optional[int] = None) -> List[int]:
        """Rank ``r``'s sequence indices in the order it runs them: micro-batch by
        micro-batch, mini-batch by mini-batch (or only ``mini_batch``'s). A shard
        built from these rows holds each micro-batch contiguously; of a mini-batch in
        prefix-reuse passes, the rows in the order that lays out the rank's trees
        (every pass reads them all).

        >>> plan_step([5, 3, 4, 2], dp_size=2, max_tokens=8).rank_rows(0)
        [0, 3]
        """
        self.rank(r)
        minis = range(len(self.assignment)) if mini_batch is None else [self._mini_batch(mini_batch)]
        return [i for m in minis for i in self._rows_of(m, r)]

    def _rows_of(self, m: int, r: int) -> List[int]:
        """Rank ``r``'s rows of mini-batch ``m``: its cells' rows, or in passes the
        rows in the order that builds the planned passes."""
        passes = None if self.prefix_reuse is None else self.prefix_reuse[m]
        if passes is not None:
            return list(passes.rank_rows[r])
        return [i for cell in self.assignment[m][r] for i in cell]

    def local_micro_batches(self, r: int, mini_batch: int = 0) -> List[List[int]]:
        """Rank ``r``'s micro-batches of ``mini_batch`` as positions into
        ``rank_rows(r, mini_batch)`` (what a rank holding only its own rows
        indexes); ``[]`` is a dummy. In passes, each pass's rows (a row in every
        pass that holds some of its tokens).

        >>> plan_step([5, 3, 4, 2], dp_size=2, max_tokens=8).local_micro_batches(1)
        [[0, 1]]
        """
        self.rank(r)
        m = self._mini_batch(mini_batch)
        if self.prefix_reuse is not None and self.prefix_reuse[m] is not None:  # a row in every pass it is in
            where = {row: i for i, row in enumerate(self._rows_of(m, r))}
            return [[where[row] for row in cell] for cell in self.assignment[m][r]]
        out, start = [], 0
        for cell in self.assignment[m][r]:
            out.append(list(range(start, start + len(cell))))
            start += len(cell)
        return out

    def _mini_batch(self, m: Any) -> int:
        m = as_int64(m, "mini_batch")
        if not 0 <= m < len(self.assignment):
            raise ValueError(f"mini_batch must be in [0, {len(self.assignment)}), got {m!r}")
        return m

    def valid_tokens(self, mask_lengths: Any) -> List[int]:
        """The global number of loss tokens of each mini-batch: the normaliser of a
        token-mean loss, known at plan time from per-sequence counts, so no
        all-reduce is needed and context parallelism cannot over-count it.

        Args:
            mask_lengths: loss tokens per sequence (e.g. the response lengths, or
                ``loss_mask.sum(-1)``), one per sequence of the global batch, each
                between 0 and that sequence's planned length.

        Raises:
            ValueError: a count is negative or above its sequence's length (the
                message names the index and both values), or the counts do not
                match the plan's sequences.

        >>> plan_step([5, 3, 4, 2], dp_size=2, max_tokens=8, mini_batches=2).valid_tokens([4, 2, 3, 1])
        [6, 4]
        """
        counts = as_lengths(mask_lengths, "mask_lengths")
        if len(counts) != self.num_sequences:
            raise ValueError(f"mask_lengths has {len(counts)} entries, the plan {self.num_sequences} sequences")
        if len(counts) == 0:
            return [0 for _ in self.mini_batch_ranges]
        if counts.min() < 0:
            i = int(np.argmin(counts))
            raise ValueError(f"mask_lengths must be >= 0, got mask_lengths[{i}] = {int(counts[i])}")
        if counts.dtype == np.uint64 and counts.max() > INT64_MAX:  # compared exactly, as Python ints
            counts = counts.astype(object)
        if self.lengths is not None:
            lengths = self.lengths
            over = np.flatnonzero(counts > lengths)
            if over.size:
                i = int(over[0])
                raise ValueError(f"mask_lengths[{i}] = {int(counts[i])} exceeds the length of sequence {i} "
                                 f"({int(lengths[i])}): a sequence has at most as many loss tokens as tokens")
            # Each count <= its length, whose sum plan_step checked against int64.
            return [int(counts[b:e].astype(np.int64).sum()) for b, e in self.mini_batch_ranges]
        # A plan built without its lengths: exact Python sums, no wrap-around.
        return [sum(int(c) for c in counts[b:e].tolist()) for b, e in self.mini_batch_ranges]

    @property
    def metrics(self) -> Dict[str, float]:
        """Scalars for logging: predicted time, bound, gap, micro-batch counts,
        dummies, the fullest micro-batch and the spread of ranks' total cost."""
        rank_totals = np.zeros(self.num_ranks)
        for mb in self.costs:
            for r, rank in enumerate(mb):
                rank_totals[r] += sum(rank)
        fill = [t for mb in self.tokens for rank in mb for t in rank]
        out = {
            "predicted_time": self.predicted_time,
            "lower_bound": self.lower_bound,
            "gap": self.gap,
            "micro_batches_per_rank": float(sum(self.num_micro_batches)),
            "dummies": float(self.num_dummies),
            "max_fill": max(fill) / self.max_tokens if fill else 0.0,
            "mean_fill": float(np.mean(fill)) / self.max_tokens if fill else 0.0,
            "rank_cost_max_over_mean": float(rank_totals.max() / rank_totals.mean()) if rank_totals.mean() > 0 else 1.0,
        }
        if self.padded_tokens is not None:  # static shapes: the padding over the real tokens
            out["padding"] = self.padding_tokens / sum(fill) if sum(fill) else 0.0
        return out

    def _repr_html_(self) -> str:
        m = self.metrics
        head = html.escape(
            f"StepPlan: {self.num_sequences} sequences, dp_size {self.dp_size}, sync {self.sync}, "
            f"{len(self.assignment)} mini-batch(es) x {self.num_micro_batches} micro-batches, cap {self.max_tokens}; "
            f"predicted {self.predicted_time:.6g} (lower bound {self.lower_bound:.6g}, gap {self.gap:.4f}), "
            f"{self.num_dummies} dummies"
        )
        rows = []
        for mi, mb in enumerate(self.assignment):
            for r, rank in enumerate(mb):
                cells = " | ".join(
                    f"{len(cell)} seq / {self.tokens[mi][r][k]} tok" if cell else "dummy" for k, cell in enumerate(rank)
                )
                rows.append(f"<tr><td>{mi}</td><td>{r}</td><td>{sum(self.costs[mi][r]):.6g}</td>"
                            f"<td>{html.escape(cells)}</td></tr>")
        return (f"<b>{head}</b><br>max fill {m['max_fill']:.1%}, mean fill {m['mean_fill']:.1%}"
                "<table><tr><th>mini-batch</th><th>rank</th><th>cost</th><th>micro-batches</th></tr>"
                + "".join(rows) + "</table>")


def _cells(minis: Sequence[Dict[str, Any]], ranks: int) -> Dict[str, Any]:
    """The StepPlan fields of the core's mini-batches (cells rank-major, ``ranks`` of them)."""
    return dict(
        assignment=[_nest(mb["cells"], ranks, mb["num_micro_batches"]) for mb in minis],
        costs=[_nest(mb["costs"], ranks, mb["num_micro_batches"]) for mb in minis],
        tokens=[_nest(mb["tokens"], ranks, mb["num_micro_batches"]) for mb in minis],
        num_micro_batches=[mb["num_micro_batches"] for mb in minis],
        mini_batch_ranges=[(mb["begin"], mb["end"]) for mb in minis],
    )


def _nest(values: Sequence[Any], dp_size: int, k: int) -> List[List[Any]]:
    return [list(values[r * k:(r + 1) * k]) for r in range(dp_size)]


def plan_step(
    lengths: Any,
    dp_size: int,
    max_tokens: int,
    *,
    options: Optional[StepOptions] = None,
    forest: Any = None,
    cost: Optional[CostModel] = None,
    sync: str = "micro_batch",
    mini_batches: int = 1,
    min_micro_batches: int = 1,
    multiple_of: int = 1,
    seed: Optional[int] = None,
    whole_trees: bool = False,
    cp_size: int = 1,
    hybrid_cp: bool = False,
    min_cp_degree: int = 1,
    micro_batch_order: str = "planned",
    static_shapes: Any = None,
    prefix_reuse: bool = False,
) -> StepPlan:
    """Assign every sequence of a global batch to (mini-batch, rank, micro-batch)
    for the fastest step under the options' cost model.

    Args:
        lengths: tokens per sequence of the global batch (list, NumPy or tensor).
        dp_size: data-parallel ranks.
        max_tokens: hard cap on each micro-batch's token sum (with ``cp_size > 1``,
            on each rank's tokens of a micro-batch).
        options: a :class:`~seqpack.StepOptions`: the cost model, sync, mini-batches,
            context parallelism, order and shapes (each documented there).
        forest: the :class:`~seqpack.PrefixForest` of the same rows (``lengths``
            must be ``forest.lengths``): plan prefix trees (``shared_prefix``),
            one C++ call (:mod:`~seqpack.planning.forest_planning`). The cap
            bounds each micro-batch's physical tokens. Each mini-batch is planned
            on whole trees (a larger tree split duplicating the fewest tokens), on
            trees dealt to ranks by their work, on the micro-batches of the
            packings of ``plan_micro_batches(..., forest=)`` (trees split where
            that fills capacity; AReaL's first-fit tries) and on the rows
            themselves; every cell's cost comes from its own physical tokens and
            visible attention pairs and the fastest predicted step is kept
            (``planned_on`` names it). ``lower_bound`` is then a simpler proven
            bound (the trees' work over the ranks plus the fewest micro-batches'
            overhead). The plan keeps the forest (:attr:`StepPlan.forest`).
        cost, sync, mini_batches, min_micro_batches, multiple_of, seed,
        whole_trees, cp_size, hybrid_cp, min_cp_degree, micro_batch_order,
        static_shapes, prefix_reuse: the :class:`~seqpack.StepOptions` fields one by one. With
            ``options``, a keyword left at its default takes the options' value, one
            the options leave at their default is filled in, and one that differs
            from a value the options set is a ``ValueError``.

    With ``static_shapes`` on plain rows the step is also planned under each
    smaller bucket that holds the longest sequence (micro-batches that fill a
    smaller bucket can pad less) and the fastest padded plan kept.

    With ``prefix_reuse`` each mini-batch also runs as passes where a tree exceeds
    the cap, each shared prefix computed once (:mod:`~seqpack.planning.step_prefix_reuse`),
    and a sequence above ``max_tokens`` is planned in passes.

    Raises:
        ValueError: a sequence above ``max_tokens`` (without ``prefix_reuse``), fewer sequences than
            ``mini_batches``, a bad option (named), ``shared_prefix`` without
            ``forest``; a cost that overflows float64 (a micro-batch of
            ``max_tokens`` tokens, or the whole step): the message names the
            coefficient, scale the model down.
        TypeError: ``cost`` is not a :class:`CostModel`, ``options`` not a
            :class:`~seqpack.StepOptions`.
    """
    opts = with_keywords(options, dict(
        cost=cost, sync=sync, mini_batches=mini_batches, min_micro_batches=min_micro_batches, multiple_of=multiple_of,
        seed=seed, shared_prefix=forest is not None, whole_trees=whole_trees, cp_size=cp_size, hybrid_cp=hybrid_cp,
        min_cp_degree=min_cp_degree, micro_batch_order=micro_batch_order, static_shapes=static_shapes,
        prefix_reuse=prefix_reuse), "plan_step")
    if opts.shared_prefix and forest is None:
        raise ValueError("shared_prefix=True plans prefix trees: plan_step needs forest=, the PrefixForest of the "
                         "lengths' rows (a StreamPlanner builds each step's forest itself)")
    dp_size = as_positive_int(dp_size, "dp_size")
    max_tokens = as_positive_int(max_tokens, "max_tokens")
    cost = opts.cost
    cost.check_finite(max_tokens)
    buckets = None if opts.static_shapes is None else shape_buckets(opts.static_shapes, max_tokens)
    if forest is not None:
        from .forest_planning import checked_forest

        forest = checked_forest(forest, lengths)
        lengths = forest.lengths
    else:
        lengths = as_lengths(lengths, "lengths")
    if opts.prefix_reuse:
        from .prefix_forest import refuse_work_items_in_passes

        refuse_work_items_in_passes(forest)
        return _with_passes(lengths, dp_size, max_tokens, opts, forest)
    # One core call: the planner the options name, its costs, the order and the shapes (step_planner.hpp).
    raw = _core.plan_step(
        lengths, dp_size, max_tokens, cost.per_micro_batch, cost.per_token, cost.per_token_squared,
        sync=opts.sync, mini_batches=opts.mini_batches, min_micro_batches=opts.min_micro_batches,
        multiple_of=opts.multiple_of, seed=opts.seed, forest=None if forest is None else forest._core_forest(),
        whole_trees=opts.whole_trees, per_kv_token=cost.per_kv_token, per_collective=cost.per_collective,
        cp_size=opts.cp_size, hybrid=opts.hybrid_cp, min_degree=opts.min_cp_degree,
        micro_batch_order=opts.micro_batch_order, buckets=buckets)
    ranks = dp_size * opts.cp_size
    minis = raw["mini_batches"]
    fields: Dict[str, Any] = {}
    if opts.cp_size > 1:
        fields.update(cp_size=opts.cp_size, cp_degree=_read_only(raw["degree"]),
                      cp_first_rank=_read_only(raw["first_rank"]), kv_tokens=raw["kv_tokens"],
                      least_kv_tokens=raw["least_kv_tokens"])
    if forest is not None:
        names = raw["planned_on"]
        used = sum(sum(mb["tokens"]) for mb in minis)
        fields.update(planned_on=names[0] if len(set(names)) == 1 else ",".join(names), forest=forest,
                      whole_trees=opts.whole_trees,
                      sharing_kept=None if opts.cp_size > 1 else
                      1.0 if used == 0 else forest.num_physical_tokens / used)
    if buckets is not None:
        fields.update(shape_buckets=buckets, padded_tokens=[_nest(mb["padded"], ranks, mb["num_micro_batches"])
                                                           for mb in minis])
    return StepPlan(
        **_cells(minis, ranks), predicted_time=raw["predicted_time"], lower_bound=raw["lower_bound"],
        dp_size=dp_size, max_tokens=max_tokens, sync=opts.sync, cost=cost,
        lengths=_read_only(np.asarray(lengths).astype(np.int64)), micro_batch_order=opts.micro_batch_order,
        **fields)


def _with_passes(lengths: np.ndarray, dp_size: int, max_tokens: int, opts: StepOptions,
                 forest: PrefixForest) -> StepPlan:
    """The step with each mini-batch in passes where they are predicted faster than
    the plan on trees (the only plan of a mini-batch with a row over the cap)."""
    from .step_prefix_reuse import with_prefix_reuse

    n = int(lengths.shape[0])
    if n < opts.mini_batches:
        raise ValueError(f"[seqpack.plan_step] lengths: {n} sequences cannot fill mini_batches={opts.mini_batches} "
                         "mini-batches (each needs at least one)")
    on_trees = dataclasses.replace(opts, prefix_reuse=False)
    if n == 0 or int(lengths.max()) <= max_tokens:  # every mini-batch fits: one core call plans them all on trees
        whole = plan_step(lengths, dp_size, max_tokens, options=on_trees, forest=forest)
        names = whole.planned_on.split(",") if "," in whole.planned_on else [whole.planned_on] * opts.mini_batches
        plains = [_mini(whole, m, names[m], 0) for m in range(opts.mini_batches)]
        return StepPlan(**with_prefix_reuse(plains, forest, dp_size, max_tokens, opts, whole.mini_batch_ranges,
                                            whole.lower_bound),
                        dp_size=dp_size, max_tokens=max_tokens, sync=opts.sync, cost=opts.cost,
                        lengths=_read_only(np.asarray(lengths).astype(np.int64)), forest=forest)
    sizes = [len(part) for part in np.array_split(np.arange(n), opts.mini_batches)]
    ends = np.cumsum(sizes).tolist()
    ranges = [(int(e - s), int(e)) for s, e in zip(sizes, ends)]
    plains: List[Optional[Dict[str, Any]]] = []
    for begin, end in ranges:  # on trees where the mini-batch's rows fit, shifted to the step's row ids
        if int(lengths[begin:end].max()) > max_tokens:
            plains.append(None)
            continue
        sub = forest.subforest(np.arange(begin, end))
        one = plan_step(sub.lengths, dp_size, max_tokens, options=dataclasses.replace(on_trees, mini_batches=1),
                        forest=sub)
        plains.append(_mini(one, 0, one.planned_on, begin))
    return StepPlan(**with_prefix_reuse(plains, forest, dp_size, max_tokens, opts, ranges, None),
                    dp_size=dp_size, max_tokens=max_tokens, sync=opts.sync, cost=opts.cost,
                    lengths=_read_only(np.asarray(lengths).astype(np.int64)), forest=forest)


def _mini(plan: StepPlan, m: int, planned_on: str, shift: int) -> Dict[str, Any]:
    """Mini-batch ``m`` of a plan on trees, its row ids shifted by ``shift``."""
    return dict(assignment=[[[i + shift for i in cell] for cell in rank] for rank in plan.assignment[m]],
                costs=plan.costs[m], tokens=plan.tokens[m], num_micro_batches=plan.num_micro_batches[m],
                planned_on=planned_on)


def _read_only(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a
