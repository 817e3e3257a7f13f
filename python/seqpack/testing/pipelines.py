"""How today's RL frameworks plan one training step, re-implemented in plain Python.

Each ``*_pipeline`` function takes the sequence lengths of one global batch and
returns an *assignment*: ``assignment[m][r][k]`` is the list of global sequence
indices in mini-batch ``m`` (one optimizer step), data-parallel rank ``r``,
micro-batch ``k``; an empty list is a dummy micro-batch (a rank that runs the
collectives with no data). :func:`~seqpack.testing.step_simulator.simulate` (here
too) turns an assignment into a simulated step time under a
:class:`~seqpack.planning.cost.CostModel`, so a benchmark can compare the
frameworks' plans with seqpack's on the same lengths.

Conventions shared by every pipeline:

* Mini-batches are the contiguous chunks ``numpy.array_split(numpy.arange(n),
  mini_batches)``, each planned on its own (global indices kept). In verl and ROLL
  this is the ``keep_minibatch=True`` path of the DP balancer; by default those two
  balance the whole batch across ranks first and let each rank cut its share into
  mini-batches, which this module does not model.
* The rows of a micro-batch are listed in the order the framework feeds them.
* A sequence longer than ``max_tokens`` is rejected (``ValueError``): every
  framework here asserts (or drops, TRL) such a sequence; none trains it.
* Where a framework asserts a precondition (e.g. a mini-batch size divisible by the
  DP size), the pipeline raises ``ValueError`` with the framework's reason.
* Per-sequence workloads (KK balancing in verl, ROLL, slime) come from the cost
  model: ``per_token·s + per_token_squared·s²`` scaled to integers; the default
  :meth:`CostModel.verl` gives exactly verl's/ROLL's ``calculate_workload``
  (``24576·s + s²``).

Only the planning is simulated; padding tokens a framework adds to each sequence
(ROLL's multiple of 16, NeMo-RL's TP/CP multiple) steer its decisions here but are
not charged by :func:`simulate`, which costs the real lengths.

This module is a test/benchmark oracle (torch-free), not part of the API.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import numpy as np

from .._lengths import as_lengths, as_positive_int
from ..planning.balance import get_seqlen_balanced_partitions, plan_micro_batches
from ..planning.cost import CostModel
from ..planning.packing import get_packer
from .distributions import DISTRIBUTIONS, reasoning_tail, rl_long_tail, sft, trl_6092
from .step_simulator import Assignment, Cells, simulate

__all__ = [
    "DISTRIBUTIONS", "PIPELINES", "nemo_rl_pipeline", "reasoning_tail", "rl_long_tail", "roll_pipeline",
    "seqpack_two_step_pipeline", "sft", "simulate", "slime_pipeline", "trl_6092", "trl_async_grpo_pipeline",
    "verl_pipeline",
]

_VERL_COST = CostModel.verl()


# --------------------------------------------------------------------------- shared helpers


def _ceildiv(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(x: int, multiple: int) -> int:
    return _ceildiv(x, multiple) * multiple


def _check(lengths: Any, dp_size: Any, max_tokens: Any, mini_batches: Any):
    arr = as_lengths(lengths, "lengths").astype(np.int64, copy=False)
    dp = as_positive_int(dp_size, "dp_size")
    cap = as_positive_int(max_tokens, "max_tokens")
    mbs = as_positive_int(mini_batches, "mini_batches")
    if arr.size and int(arr.min()) < 1:
        raise ValueError(f"lengths must be positive, got {int(arr.min())}")
    if arr.size and int(arr.max()) > cap:
        raise ValueError(f"a sequence has {int(arr.max())} tokens, more than max_tokens={cap}")
    return arr, dp, cap, mbs


def _plan(lengths: Any, dp_size: Any, max_tokens: Any, mini_batches: Any,
          plan_chunk: Callable[[List[int], int, int], List[Cells]]) -> Assignment:
    """Split into mini-batches, plan each with ``plan_chunk(chunk_lengths, dp, cap)``
    (which returns chunk-local indices per rank), map back to global indices."""
    arr, dp, cap, mbs = _check(lengths, dp_size, max_tokens, mini_batches)
    out: Assignment = []
    for chunk in np.array_split(np.arange(arr.size, dtype=np.int64), mbs):
        if chunk.size == 0:  # more mini-batches than sequences: nothing to run
            out.append([[] for _ in range(dp)])
            continue
        start = int(chunk[0])
        ranks = plan_chunk([int(x) for x in arr[chunk]], dp, cap)
        assert len(ranks) == dp
        out.append([[[start + i for i in cell] for cell in rank] for rank in ranks])
    return out


def _workloads(lengths: List[int], cost: CostModel) -> List[int]:
    """``per_token·s + per_token_squared·s²`` per sequence as integers, scaled so the
    smaller positive coefficient is 1 (exact for integer ratios, e.g. verl's
    ``24576·s + s²``; rounded otherwise)."""
    a, b = float(cost.per_token), float(cost.per_token_squared)
    if a == 0.0 and b == 0.0:  # only a per-micro-batch cost: nothing per sequence; use tokens (a guess)
        return list(lengths)
    unit = min(c for c in (a, b) if c > 0.0)
    ra, rb = a / unit, b / unit
    if ra.is_integer() and rb.is_integer():
        ia, ib = int(ra), int(rb)
        return [ia * s + ib * s * s for s in lengths]
    return [int(round(ra * s + rb * s * s)) for s in lengths]


def _check_divisible(n: int, dp: int, who: str) -> None:
    if n % dp:
        raise ValueError(f"{who}: a mini-batch of {n} sequences is not a multiple of dp_size={dp}")


def _balance_batch_keep_minibatch(workloads: List[int], dp: int) -> List[List[int]]:
    """verl ``RayPPOTrainer._balance_batch`` / ROLL ``batch_balance`` on one mini-batch:
    equal-size KK over the ranks on the workloads, then each rank's rows sorted by
    ``(workload, index)`` and laid out light, ..., heavy, ..., light
    (``p[::2] + p[1::2][::-1]``). Returns each rank's rows in its local order."""
    ranks = []
    for part in get_seqlen_balanced_partitions(workloads, dp, equal_size=True):
        order = sorted(part, key=lambda i: (workloads[i], i))
        ranks.append(order[::2] + order[1::2][::-1])
    return ranks


def _kk_micro_batches(ranks: List[List[int]], work: List[int], count: int, small_at_ends: bool) -> List[Cells]:
    """KK of each rank's rows into ``count`` micro-batches (``equal_size=False``), as
    verl's ``rearrange_micro_batches`` and ROLL's ``LoadBalancePacker`` do; with
    ``small_at_ends`` sorted by ``(workload, first row)`` descending and interleaved
    ``mbs[::2][::-1] + mbs[1::2]`` (lightest micro-batches first and last)."""
    out: List[Cells] = []
    for rows in ranks:
        workloads = [work[i] for i in rows]
        mbs = get_seqlen_balanced_partitions(workloads, count, equal_size=False)
        if small_at_ends:
            mbs.sort(key=lambda p: (sum(workloads[j] for j in p), p[0] if p else 0), reverse=True)
            mbs = mbs[::2][::-1] + mbs[1::2]
        out.append([[rows[j] for j in mb] for mb in mbs])
    return out


# --------------------------------------------------------------------------- NeMo-RL


def nemo_rl_pipeline(lengths: Any, dp_size: int, max_tokens: int, *, mini_batches: int = 1,
                     algorithm: str = "modified_first_fit_decreasing", pad_multiple: int = 1) -> Assignment:
    """NeMo-RL with sequence packing.

    Follows ``NVIDIA-NeMo/RL`` ``nemo_rl/distributed/batched_data_dict.py``,
    ``BatchedDataDict.shard_by_batch_size(shards, batch_size, sequence_packing_args=...)``:
    per ``batch_size`` chunk (one mini-batch), the lengths padded to
    ``sequence_length_pad_multiple`` are packed by ``get_packer(algorithm,
    bin_capacity=max_tokens_per_microbatch, min_bin_count=shards,
    bin_count_multiple=shards)`` (``nemo_rl/data/packing/algorithms.py``; NeMo-RL's
    configs use ``modified_first_fit_decreasing``), and bin ``b`` goes to shard
    ``b % shards``; each shard runs its bins in bin order, one per micro-batch.
    The bin count is a multiple of the DP size, so every rank runs the same number
    of micro-batches, none empty, none over the cap.

    ``shard_by_batch_size`` asserts ``batch_size % shards == 0``: a mini-batch not a
    multiple of ``dp_size`` raises ``ValueError``.

    Example (MFFD makes 3 bins, the count rule splits one to 4, dealt 0, 2 | 1, 3):
        >>> nemo_rl_pipeline([6, 5, 4, 3, 2, 1], dp_size=2, max_tokens=8)
        [[[[0, 4], [2]], [[1, 3], [5]]]]
    """
    packer = get_packer(algorithm, max_tokens, min_bin_count=dp_size, bin_count_multiple=dp_size)
    pad = as_positive_int(pad_multiple, "pad_multiple")

    def plan(chunk: List[int], dp: int, cap: int) -> List[Cells]:
        _check_divisible(len(chunk), dp, "NeMo-RL shard_by_batch_size")
        bins = packer.pack([_round_up(s, pad) for s in chunk])
        ranks: List[Cells] = [[] for _ in range(dp)]
        for b, bin_ in enumerate(bins):
            ranks[b % dp].append(list(bin_))
        return ranks

    return _plan(lengths, dp_size, max_tokens, mini_batches, plan)


# --------------------------------------------------------------------------- verl


def verl_pipeline(lengths: Any, dp_size: int, max_tokens: int, *, mini_batches: int = 1,
                  cost: CostModel = _VERL_COST, use_dynamic_bsz_balance: bool = True,
                  num_batches_divided_by: Optional[int] = None, soft_cap: bool = False) -> Assignment:
    """verl with ``balance_batch`` and ``use_dynamic_bsz`` (remove-padding path), as released (0.9.1).

    1. ``volcengine/verl`` ``verl/trainer/ppo/ray_trainer.py``,
       ``RayPPOTrainer._balance_batch(..., keep_minibatch=True)``: per mini-batch,
       ``get_seqlen_balanced_partitions(workloads, dp_size, equal_size=True)`` on
       ``calculate_workload`` (``24576·s + s²``; current verl balances workloads,
       releases before it balanced token counts), then each rank's rows sorted by
       ``(workload, index)`` and reordered ``p[::2] + p[1::2][::-1]``.
    2. ``verl/utils/seqlen_balancing.py``, ``rearrange_micro_batches(batch,
       max_token_len, same_micro_num_in_dp=True, use_dynamic_bsz_balance=...)`` on
       each rank (via ``prepare_dynamic_batch``): the count starts at
       ``min(rows, ceildiv(tokens, max_token_len))``, all-reduced with ``MAX`` over
       the ranks and rounded up to ``num_batches_divided_by`` (Megatron VPP); then
       ``get_seqlen_balanced_partitions(calculate_workload(...), count,
       equal_size=False)`` on every rank, and while some rank has a part of more than
       ``max_token_len`` tokens (``MIN`` over the ranks of "all fit") the count grows
       by ``num_batches_divided_by`` (else 1) and the rows are partitioned again; a
       count above a rank's rows raises (``ValueError`` here, as verl). With
       ``use_dynamic_bsz_balance`` the micro-batches are sorted by ``(workload, first
       row)`` descending and interleaved ``mbs[::2][::-1] + mbs[1::2]``.

    So no micro-batch holds more than ``max_tokens`` tokens. ``soft_cap=True`` is
    verl before verl PR #7553 (and ROLL's ``load_balance`` to this day): the first
    count only, so KK, which balances workload, can put a micro-batch over the cap.
    ``cost`` stands in for ``calculate_workload`` in both steps. Equal-size KK asserts
    ``rows % dp_size == 0``: such a mini-batch raises ``ValueError``.

    One detail differs on purpose: in verl (and ROLL's copy) the light-heavy-light
    sort after ``keep_minibatch`` runs over a rank's whole share, across mini-batch
    boundaries, before each rank cuts it into ``ppo_mini_batch_size`` slices; here it
    runs within each mini-batch, so every mini-batch keeps its own sequences, as
    ``keep_minibatch`` intends. Within a mini-batch the rows end up in verl's order.

    Example (3 sequences of 7 tokens, cap 11: 2 parts would put 14 tokens in one, so 3;
    verl before #7553 kept the 2):
        >>> verl_pipeline([7, 7, 7], dp_size=1, max_tokens=11)
        [[[[0], [1], [2]]]]
        >>> verl_pipeline([7, 7, 7], dp_size=1, max_tokens=11, soft_cap=True)
        [[[[0, 2], [1]]]]
    """
    step = 1 if num_batches_divided_by is None else as_positive_int(num_batches_divided_by, "num_batches_divided_by")

    def plan(chunk: List[int], dp: int, cap: int) -> List[Cells]:
        _check_divisible(len(chunk), dp, "verl _balance_batch (equal-size KK)")
        work = _workloads(chunk, cost)
        ranks = _balance_batch_keep_minibatch(work, dp)
        count = max(min(len(rows), _ceildiv(sum(chunk[i] for i in rows), cap)) for rows in ranks)
        count = _round_up(count, step)
        fewest = min(len(rows) for rows in ranks)
        while True:
            if count > fewest:  # verl 0.9.1 raises; before #7553 its KK asserted k <= rows
                raise ValueError(f"verl rearrange_micro_batches: {count} micro-batches (max_token_len={cap}, "
                                 f"num_batches_divided_by={step}) but a rank has only {fewest} rows")
            cells = _kk_micro_batches(ranks, work, count, use_dynamic_bsz_balance)
            if soft_cap or all(sum(chunk[i] for i in cell) <= cap for rank in cells for cell in rank):
                return cells
            count += step

    return _plan(lengths, dp_size, max_tokens, mini_batches, plan)


# --------------------------------------------------------------------------- ROLL


def roll_pipeline(lengths: Any, dp_size: int, max_tokens: int, *, mini_batches: int = 1,
                  cost: CostModel = _VERL_COST, pad_multiple: int = 16,
                  min_num_micro_batches: int = 1) -> Assignment:
    """ROLL with ``use_sequence_packing`` and ``algorithm: load_balance`` (Megatron).

    1. ``alibaba/ROLL`` ``roll/utils/functionals.py``, ``batch_balance(batch, dp_size,
       minibatch_size, keep_minibatch=True)``: the same rule as verl's
       ``_balance_batch`` (equal-size KK on ``24576·s + s²`` of the real lengths,
       rows sorted by ``(workload, index)`` and laid out ``p[::2] + p[1::2][::-1]``).
    2. ``roll/utils/sequence_packing.py``, ``LoadBalancePacker.
       make_micro_batch_iter_for_sequence_packing`` on each rank's mini-batch:
       lengths padded to ``get_pad_factor`` = ``lcm(16, TP)`` (``lcm(16, 2·CP·TP)``
       with CP; ``pad_multiple=16`` is TP = CP = 1); count
       ``max(1, ceildiv(padded tokens, max_packed_sequence_length_train))``, at most
       the rows, at least ``min_num_micro_batches_train``, all-reduced with ``MAX``
       over the DP group; ``get_seqlen_balanced_partitions(workloads of the padded
       lengths, count, equal_size=False)``; micro-batches sorted by
       ``(workload, first row)`` descending and interleaved
       ``mbs[::2][::-1] + mbs[1::2]``.

    Like verl's before verl PR #7553 (``verl_pipeline(..., soft_cap=True)``), the cap
    is soft. ROLL shuffles mini-batches within a rank by default (``shuffle``); that
    only changes tie-breaking, and the rows are taken in ``batch_balance``'s order here.
    ROLL's padded dynamic batching (``roll/utils/dynamic_batching.py``,
    ``dynamic_batching_shard``: sort, stride over ranks, greedy padded micro-batches)
    is a different mode and not modelled.
    ``rows % dp_size != 0`` raises ``ValueError`` (equal-size KK asserts it).

    Example (padded to 16 tokens each, 3 micro-batches where verl plans 2):
        >>> roll_pipeline([7, 7, 7], dp_size=1, max_tokens=16)
        [[[[0], [1], [2]]]]
    """
    pad = as_positive_int(pad_multiple, "pad_multiple")
    min_num = as_positive_int(min_num_micro_batches, "min_num_micro_batches")

    def plan(chunk: List[int], dp: int, cap: int) -> List[Cells]:
        _check_divisible(len(chunk), dp, "ROLL batch_balance (equal-size KK)")
        ranks = _balance_batch_keep_minibatch(_workloads(chunk, cost), dp)
        padded = [_round_up(s, pad) for s in chunk]
        count = max(max(min(max(1, _ceildiv(sum(padded[i] for i in rows), cap)), len(rows)), min_num)
                    for rows in ranks)
        if count > min(len(rows) for rows in ranks):
            raise ValueError(f"ROLL LoadBalancePacker: {count} micro-batches for "
                             f"{min(len(rows) for rows in ranks)} rows on a rank")
        return _kk_micro_batches(ranks, _workloads(padded, cost), count, True)

    return _plan(lengths, dp_size, max_tokens, mini_batches, plan)


# --------------------------------------------------------------------------- slime


def _first_fit(lengths: List[int], cap: int) -> List[List[int]]:
    """slime ``first_fit_pack``: items in input order, each into the first open bin
    with room (a linear scan), else a new bin."""
    bins: List[List[int]] = []
    loads: List[int] = []
    for i, s in enumerate(lengths):
        for b in range(len(bins)):
            if loads[b] + s <= cap:
                bins[b].append(i)
                loads[b] += s
                break
        else:
            bins.append([i])
            loads.append(s)
    return bins


def _expand_by_splitting(bins: List[List[int]], target: int, lengths: List[int]) -> None:
    """slime ``expand_bins_by_splitting``: while short of ``target`` bins, split the
    multi-item bin with the most tokens (ties: the highest bin index) in two by LPT
    (items longest first, each to the lighter half, the first half on ties); the
    first half stays in place, the second is appended."""
    while len(bins) < target:
        candidates = [(sum(lengths[i] for i in b), k) for k, b in enumerate(bins) if len(b) > 1]
        if not candidates:
            return
        _, k = max(candidates)
        halves: List[List[int]] = [[], []]
        sums = [0, 0]
        for i in sorted(bins[k], key=lambda i: -lengths[i]):
            h = 0 if sums[0] <= sums[1] else 1
            halves[h].append(i)
            sums[h] += lengths[i]
        bins[k] = halves[0]
        bins.append(halves[1])


def slime_pipeline(lengths: Any, dp_size: int, max_tokens: int, *, mini_batches: int = 1,
                   cost: CostModel = _VERL_COST, balance_data: bool = True) -> Assignment:
    """slime with ``--use-dynamic-batch-size`` (``max_tokens_per_gpu``) and ``--balance-data``.

    Follows ``THUDM/slime`` ``slime/utils/dp_schedule.py``, ``build_dp_schedule``
    ("pack first, distribute second"), per training step (mini-batch):

    1. ``first_fit_pack(step_lengths, max_tokens_per_gpu)``
       (``slime/utils/seqlen_balancing.py``): plain first fit in sample order (not
       decreasing).
    2. The bin count is raised to ``max(ceil(K / dp) · dp, dp)`` by
       ``expand_bins_by_splitting`` (split the fullest multi-sample bin in two by
       LPT, repeatedly); slime asserts it gets there, so does this (``ValueError``).
    3. With ``balance_data``, ``get_seqlen_balanced_partitions(bin workloads, dp,
       equal_size=True)`` deals the bins to ranks, ``K / dp`` each, in ascending bin
       order; without it, bin ``b`` goes to rank ``b % dp``.

    slime weighs bins by ``calculate_fwd_flops`` of its model config; ``cost``
    stands in for it (default ``24576·s + s²``). ``packing_safety_margin`` (1.0),
    CP (``max_tokens_per_gpu · cp_size``) and the ``--balance-by-flops`` variant
    (KK on FLOPs ignoring the cap) are not modelled. Every bin respects the cap and
    every rank runs the same number of micro-batches.

    Example (first fit makes 3 bins, ``[1, 3]`` is split to reach 4, KK deals them):
        >>> slime_pipeline([6, 5, 4, 3, 2, 1], dp_size=2, max_tokens=8)
        [[[[0, 4], [3]], [[1], [2, 5]]]]
    """

    def plan(chunk: List[int], dp: int, cap: int) -> List[Cells]:
        if len(chunk) < dp:
            raise ValueError(f"slime build_dp_schedule: {len(chunk)} samples < dp_size {dp}")
        bins = _first_fit(chunk, cap)
        target = max(_ceildiv(len(bins), dp) * dp, dp)
        _expand_by_splitting(bins, target, chunk)
        if len(bins) != target:
            raise ValueError(f"slime build_dp_schedule: could only produce {len(bins)} micro-batches after "
                             f"maximal splitting; need {target} (a multiple of dp_size={dp})")
        if balance_data:
            work = _workloads(chunk, cost)
            weights = [sum(work[i] for i in b) for b in bins]
            ranks = get_seqlen_balanced_partitions(weights, dp, equal_size=True)
        else:
            ranks = [list(range(r, target, dp)) for r in range(dp)]
        return [[list(bins[b]) for b in idx] for idx in ranks]

    return _plan(lengths, dp_size, max_tokens, mini_batches, plan)


# --------------------------------------------------------------------------- TRL AsyncGRPO


def _least_squared(candidates: List[int], squared: List[int]) -> int:
    # min() returns the first of equal keys: the lowest row, as TRL's ``min(..., key=...)``.
    return min(candidates, key=lambda j: squared[j])


def trl_async_grpo_pipeline(lengths: Any, dp_size: int, max_tokens: int, *, mini_batches: int = 1,
                            per_device_batch_size: Optional[int] = None) -> Assignment:
    """TRL ``AsyncGRPOTrainer`` after huggingface/trl PR #6092 ("packing-aware dynamic batching").

    ``huggingface/trl`` ``trl/experimental/async_grpo/async_grpo_trainer.py``: a planner
    on rank 0 turns the stream of rollout samples into micro-batches of
    ``num_processes`` rows (one per DP rank), each row packed padding-free:

    * ``TokenBudgetBatcher`` (``token_budget > 0``, the default here with
      ``token_budget = max_tokens``): samples in arrival order, each into the row
      with the smallest running Σ Lᵢ² among the rows it fits (``tokens + L <=
      token_budget``; the lowest row on ties); when it fits no row the micro-batch is
      emitted and a fresh one started. The number of samples per row and the number
      of micro-batches are dynamic; every emitted micro-batch has all rows non-empty.
    * ``FixedCountBatcher`` (``per_device_batch_size`` given): every
      ``per_device_batch_size · num_processes`` samples in arrival order form one
      micro-batch, split by ``_balance_by_squared_length`` (longest first, each to the
      row with the smallest Σ Lᵢ²).

    My reading for a finite mini-batch: HF Trainer accumulates
    ``gradient_accumulation_steps`` micro-batches per optimizer step on an endless
    stream, so here a mini-batch's samples are planned alone and the last, partial
    micro-batch is flushed as well (TRL keeps it for the next step); its rows may be
    empty (dummy micro-batches). Micro-batches run in emission order; counts are
    equal across ranks by construction. TRL drops samples over ``token_budget``;
    here they raise ``ValueError`` like every pipeline.

    Example:
        >>> trl_async_grpo_pipeline([6, 5, 4, 3, 2, 1], dp_size=2, max_tokens=8)
        [[[[0], [2]], [[1], [3, 4, 5]]]]
        >>> trl_async_grpo_pipeline([6, 5, 4, 3, 2, 1], dp_size=2, max_tokens=8, per_device_batch_size=2)
        [[[[0, 3], [4]], [[1, 2], [5]]]]
    """
    per_device = None if per_device_batch_size is None else as_positive_int(per_device_batch_size,
                                                                             "per_device_batch_size")

    def token_budget(chunk: List[int], dp: int, cap: int) -> List[List[List[int]]]:
        emitted: List[List[List[int]]] = []
        rows: List[List[int]] = [[] for _ in range(dp)]
        squared, tokens = [0] * dp, [0] * dp
        for i, n in enumerate(chunk):
            fits = [j for j in range(dp) if tokens[j] + n <= cap]
            if not fits:
                emitted.append(rows)
                rows = [[] for _ in range(dp)]
                squared, tokens = [0] * dp, [0] * dp
                fits = list(range(dp))
            j = _least_squared(fits, squared)
            rows[j].append(i)
            squared[j] += n * n
            tokens[j] += n
        if any(rows):
            emitted.append(rows)  # the partial last micro-batch (see the docstring)
        return emitted

    def fixed_count(chunk: List[int], dp: int, size: int) -> List[List[List[int]]]:
        emitted = []
        for start in range(0, len(chunk), size):
            group = list(range(start, min(start + size, len(chunk))))
            rows: List[List[int]] = [[] for _ in range(dp)]
            squared = [0] * dp
            for i in sorted(group, key=lambda i: chunk[i], reverse=True):  # stable: arrival order on ties
                j = _least_squared(list(range(dp)), squared)
                rows[j].append(i)
                squared[j] += chunk[i] * chunk[i]
            emitted.append(rows)
        return emitted

    def plan(chunk: List[int], dp: int, cap: int) -> List[Cells]:
        mbs = token_budget(chunk, dp, cap) if per_device is None else fixed_count(chunk, dp, per_device * dp)
        return [[mb[r] for mb in mbs] for r in range(dp)]

    return _plan(lengths, dp_size, max_tokens, mini_batches, plan)


# --------------------------------------------------------------------------- seqpack


def _attention_coeff(cost: CostModel) -> Optional[int]:
    """``plan_micro_batches``' ``attention_coeff`` for a cost model: ``None`` (tokens)
    without a quadratic term, else ``per_token / per_token_squared`` rounded, at least
    1 (``0`` would mean tokens to ``plan_micro_batches``)."""
    if cost.per_token_squared == 0:
        return None
    return max(1, int(round(cost.per_token / cost.per_token_squared)))


def seqpack_two_step_pipeline(lengths: Any, dp_size: int, max_tokens: int, *, mini_batches: int = 1,
                              cost: CostModel = _VERL_COST) -> Assignment:
    """seqpack's two-step plan: balance the ranks, then micro-batches under a hard cap.

    Per mini-batch: :func:`~seqpack.planning.balance.get_seqlen_balanced_partitions`
    over the ranks on tokens (equal-size when the mini-batch is a multiple of
    ``dp_size``, else unequal; with fewer sequences than ranks, one each and the
    other ranks idle), then :func:`~seqpack.planning.balance.plan_micro_batches` per
    rank (``max_tokens`` a hard cap, balancing ``attention_coeff·s + s²`` with
    ``attention_coeff`` the cost model's ``per_token / per_token_squared``, or
    tokens). The ranks agree on the count: the largest rank's, passed back as
    ``min_num``; a rank with fewer sequences than that runs dummy micro-batches.

    Example (the cap holds: 3 micro-batches where verl before #7553 planned 2, 14 tokens in one):
        >>> seqpack_two_step_pipeline([7, 7, 7], dp_size=1, max_tokens=11)
        [[[[2], [1], [0]]]]
    """
    coeff = _attention_coeff(cost)

    def plan(chunk: List[int], dp: int, cap: int) -> List[Cells]:
        n = len(chunk)
        if n >= dp:
            parts = get_seqlen_balanced_partitions(chunk, dp, equal_size=n % dp == 0)
        else:
            parts = [[i] for i in range(n)] + [[] for _ in range(dp - n)]
        plans = [plan_micro_batches([chunk[i] for i in p], cap, attention_coeff=coeff) if p else None
                 for p in parts]
        count = max(len(p) for p in plans if p is not None)
        out: List[Cells] = []
        for part, p in zip(parts, plans):
            cells: Cells = []
            if p is not None:
                if len(p) < count:
                    p = plan_micro_batches([chunk[i] for i in part], cap, min_num=min(count, len(part)),
                                           attention_coeff=coeff)
                cells = [[part[j] for j in mb] for mb in p.micro_batches]
            out.append(cells + [[] for _ in range(count - len(cells))])
        return out

    return _plan(lengths, dp_size, max_tokens, mini_batches, plan)


PIPELINES: Dict[str, Callable[..., Assignment]] = {
    "nemo_rl": nemo_rl_pipeline,
    "verl": verl_pipeline,
    "roll": roll_pipeline,
    "slime": slime_pipeline,
    "trl_async_grpo": trl_async_grpo_pipeline,
    "seqpack_two_step": seqpack_two_step_pipeline,
}
