"""A rank's micro-batch under hybrid context parallelism: the sequences it runs whole
and, for each aligned block of ranks it shares a sharded sequence with, its part of
them - built from a :func:`seqpack.plan_step` plan with ``cp_size`` (and
``hybrid_cp=True``).

One micro-batch step of a CP group of 4 ranks, and what rank 1 holds::

    cp_rank        0        1        2        3
    A  d = 4    [ A/4      A/4      A/4      A/4 ]      block (4, 0)
    B  d = 2    [ B/2      B/2 ]                        block (2, 0)
    C, D d = 1                       C        D
    E    d = 1             E

    rank 1:   part 0  whole    E         (plain THD or a prefix tree, no collective)
              part 1  (2, 0)   B's zigzag chunks 1 and 2 of 4
              part 2  (4, 0)   A's zigzag chunks 1 and 6 of 8
    rows      [ E | B/2 | A/4 ]   one tensor; attention and log-probs per part

Its layout, ``mb.layout``, is a :class:`~seqpack.tensors.parts_layout.PartsLayout`: a
:class:`~seqpack.TokenLayout` whose cut is composite (each part its own), what
:func:`seqpack.attention`, :func:`seqpack.token_logprobs` and
:class:`~seqpack.SequencePackingLossWrapper` take (or the micro-batch holding it).

A part holds the sequences of one kind and block: the whole ones (packed as
:func:`~seqpack.pack_sequences` packs them, or with ``forest=`` one prefix tree of
their trees), or the sharded ones of one block (zigzag, each padded to a multiple of
``2 d``, :func:`~seqpack.pack_sequences` with ``cp_size=d``; with ``forest=`` each
sharded tree is a part of its own, cut in ranges as :func:`~seqpack.shard_layout`
cuts a tree). Parts
come whole first, then by ``(degree, first cp_rank, first row)``: the same order on
every rank, so collectives over the blocks' groups never wait on one another.

:func:`pack_hybrid_cp` builds one micro-batch, with no communication;
:func:`hybrid_cp_micro_batches` builds all of a rank's micro-batches of a mini-batch
after one agreement over the ranks (the plan, the rows) and creates the blocks'
process groups (:func:`~seqpack.hybrid_cp_groups`).

    >>> import torch, seqpack
    >>> plan = seqpack.plan_step([12, 3, 2], 1, 9, cp_size=2, hybrid_cp=True)
    >>> plan.assignment      # one mini-batch; rank 0: [0, 1], rank 1: [0, 2]
    [[[[0, 1]], [[0, 2]]]]
    >>> ids = torch.arange(36).view(3, 12)
    >>> mb = pack_hybrid_cp({"input_ids": ids}, [12, 3, 2], plan, rank=1, micro_batch=0)
    >>> [(p.degree, p.rows) for p in mb.parts], mb.num_tokens    # 2 whole + 12 / 2 sharded
    ([(1, (2,)), (2, (0,))], 8)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .._lengths import as_lengths, as_positive_int, type_name
from .cp_cut import CpCut
from .parts_layout import HybridCpPart, PartsLayout

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["HybridCpBatch", "hybrid_cp_micro_batches", "pack_hybrid_cp"]


@dataclass(eq=False)
class HybridCpBatch:
    """A rank's micro-batch under hybrid CP: its :class:`HybridCpPart` s, their rows
    concatenated in ``tensors`` (name -> ``[rows, ...]``; a tree part gives
    ``input_ids`` only) and ``position_ids``. ``cp_size`` and ``cp_rank`` are the CP
    group's and this rank's in it, ``dp_size`` / ``dp_rank`` its CP group's; a rank
    with an empty cell (a dummy) holds no part and no row."""

    parts: Tuple[HybridCpPart, ...]
    tensors: Dict[str, "torch.Tensor"]
    position_ids: "torch.Tensor"
    dp_size: int
    dp_rank: int
    cp_size: int
    cp_rank: int
    mini_batch: int = 0
    micro_batch: int = 0
    _rows: Tuple[int, ...] = field(default=(), repr=False)
    # The micro-batch's rows of the data it was built from, in ``rows`` order, when an
    # iterator attaches them (BatchedDataDict's: what the loss wrapper takes).
    data: Any = field(default=None, repr=False)
    # The global ranks of the DP x CP group the blocks' groups were made in (empty:
    # WORLD): where attention and the loss find them (tensors/hybrid_cp_groups.py).
    group_ranks: Tuple[int, ...] = field(default=(), repr=False)

    @property
    def layout(self) -> PartsLayout:
        """Its :class:`~seqpack.tensors.parts_layout.PartsLayout` (a
        :class:`~seqpack.TokenLayout` whose cut is composite: each part its own),
        kept while its parts and group stay."""
        held = self.__dict__.get("_layout")
        if held is None or held.parts is not self.parts or held.group_ranks != self.group_ranks:
            held = PartsLayout(self.parts, self.dp_size, self.dp_rank, self.cp_size, self.cp_rank, self.group_ranks,
                               local_rows=int(self.position_ids.shape[-1]))
            self.__dict__["_layout"] = held
        return held

    @property
    def cut(self) -> CpCut:
        """A composite cut: each part carries its own (``part.cut_layout``)."""
        return self.layout.cut

    def block_group(self, part: HybridCpPart) -> Any:
        """The process group of ``part``'s block (``None`` for a whole part)."""
        return self.layout.block_group(part)

    def next_token_targets(self, key: str = "input_ids", group: Any = None) -> None:
        """None: each part carries its own targets (a packed part its full ids, a tree
        its tokens), what :func:`seqpack.token_logprobs` reads."""
        return None

    def __getitem__(self, key: str) -> "torch.Tensor":
        return self.tensors[key]

    def keys(self):
        return self.tensors.keys()

    @property
    def rows(self) -> Tuple[int, ...]:
        """The plan's sequence ids of every part, in the order of the parts."""
        return self._rows

    @property
    def num_tokens(self) -> int:
        """This rank's rows of the micro-batch (every part's)."""
        return int(self.position_ids.shape[-1])

    def packed_seq_params(self) -> List[Any]:
        """Megatron's ``PackedSeqParams`` of each packed part, in order."""
        return [p.packed_seq_params() for p in self.parts]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, HybridCpBatch):
            return NotImplemented
        from .._equality import values_equal

        def key(b: "HybridCpBatch") -> tuple:
            return (b.dp_size, b.dp_rank, b.cp_size, b.cp_rank, b.mini_batch, b.micro_batch, b._rows, b.parts,
                    b.tensors, b.position_ids, b.data)

        return values_equal(key(self), key(other))

    __hash__ = None  # type: ignore[assignment]


def _check_plan(plan: Any, rank: Any, mini_batch: Any) -> Tuple[int, int]:
    from ..planning.step import StepPlan

    if not isinstance(plan, StepPlan):
        raise TypeError(f"plan must be a seqpack.StepPlan, got {type_name(plan)}")
    if plan.cp_degree is None:
        raise ValueError("plan has no CP degrees: plan it with plan_step(..., cp_size=C, hybrid_cp=True)")
    m = as_positive_int(mini_batch, "mini_batch", allow_zero=True)
    if m >= len(plan.assignment):
        raise ValueError(f"mini_batch must be below the plan's {len(plan.assignment)} mini-batches, got {m}")
    r = as_positive_int(rank, "rank", allow_zero=True)
    if r >= plan.num_ranks:
        raise ValueError(f"rank must be below dp_size x cp_size = {plan.num_ranks}, got {r}")
    return r, m


def _part_keys(plan: Any, cell: Sequence[int], forest: Any) -> List[Tuple[Tuple[int, int, int], List[int]]]:
    """The cell's sequences grouped into parts, in the order every rank runs them:
    whole first, then by (degree, first cp_rank, first row); a tree part's rows in
    the forest's depth-first order."""
    groups: Dict[Tuple[int, int, int], List[int]] = {}
    C = plan.cp_size
    for i in cell:
        d = int(plan.cp_degree[i])
        tree = int(forest.tree_ids[i]) if forest is not None and d > 1 else -1
        key = (1, 0, -1) if d == 1 else (d, int(plan.cp_first_rank[i]) % C, tree)
        groups.setdefault(key, []).append(int(i))
    parts = []
    for key in sorted(groups, key=lambda k: (k[0], k[1], min(groups[k]))):
        rows = sorted(groups[key])
        if forest is not None:  # tree by tree, each tree's rows depth-first (the planner's layout)
            trees = sorted({int(forest.tree_ids[i]) for i in rows})
            rows = [int(i) for t in trees for i in forest.depth_first([i for i in rows
                                                                        if int(forest.tree_ids[i]) == t])]
        parts.append((key, rows))
    return parts


def pack_hybrid_cp(tensors: Mapping[str, "torch.Tensor"], seq_lens: Any, plan: Any, *, rank: Any,
                   micro_batch: Any, mini_batch: Any = 0, forest: Any = None, min_shared_tokens: Any = 1,
                   row_index: Any = None, pad_values: Optional[Mapping[str, Any]] = None) -> HybridCpBatch:
    """Rank ``rank``'s micro-batch ``micro_batch`` of mini-batch ``mini_batch`` of a
    hybrid-CP ``plan`` (no communication; see the module docstring).

    Args:
        tensors: ``[B, S, ...]`` padded tensors (right-padded rows: ``seq_lens``
            real tokens each), one row per sequence of the plan (or per entry of
            ``row_index``). With ``forest`` only ``input_ids`` is laid out (a
            prefix tree's rows are its token ids).
        seq_lens: ``[B]`` real lengths.
        plan: a :class:`~seqpack.StepPlan` with ``cp_size`` (``plan.cp_degree``).
        rank: ``dp_rank * cp_size + cp_rank``.
        forest: the :class:`~seqpack.PrefixForest` the plan was made on
            (``plan_step(..., forest=)``): the parts are prefix trees.
        min_shared_tokens: the forest's sharing rule, for the trees laid out.
        row_index: where each of the plan's sequence ids sits in ``tensors``
            (a mapping or an array; default: row ``i`` is sequence ``i``).
        pad_values: per-name pad value of the packed tensors (default 0).
    """
    import torch

    from .prefix_tree import pack_prefix_tree
    from .thd import pack_sequences

    r, m = _check_plan(plan, rank, mini_batch)
    k_count = plan.num_micro_batches[m]
    k = as_positive_int(micro_batch, "micro_batch", allow_zero=True)
    if k >= k_count:
        raise ValueError(f"micro_batch must be below mini-batch {m}'s {k_count} micro-batches, got {k}")
    if not isinstance(tensors, Mapping) or not tensors:
        raise TypeError(f"tensors must be a non-empty mapping of name -> [B, S, ...] tensor, got {type_name(tensors)}")
    lens = as_lengths(seq_lens, "seq_lens")
    if forest is not None and "input_ids" not in tensors:
        raise ValueError("with forest= the parts are prefix trees of tensors['input_ids']: give input_ids")
    C = plan.cp_size
    cell = plan.assignment[m][r][k]
    batch_rows = {int(t.shape[0]) if t.dim() >= 2 else -1 for t in tensors.values()}
    width = min(int(t.shape[1]) if t.dim() >= 2 else 0 for t in tensors.values())
    if batch_rows != {lens.shape[0]}:
        raise ValueError(f"tensors must be [B, S, ...] with B = len(seq_lens) = {lens.shape[0]}, got "
                         f"{ {n: tuple(t.shape) for n, t in tensors.items()} }")

    def where(i: int) -> int:
        at = int(i) if row_index is None else int(row_index[i])
        if not 0 <= at < lens.shape[0]:
            raise ValueError(f"sequence {i} of the plan is row {at}, outside the {lens.shape[0]} rows of tensors")
        if plan.lengths is not None and int(lens[at]) != int(plan.lengths[i]):
            raise ValueError(f"seq_lens[{at}] = {int(lens[at])}, but the plan was made with length "
                             f"{int(plan.lengths[i])} for sequence {i}: build the micro-batches from the rows planned")
        if int(lens[at]) > width:
            raise ValueError(f"seq_lens[{at}] = {int(lens[at])} exceeds the tensors' width S = {width}")
        return at

    names = ["input_ids"] if forest is not None else list(tensors)  # a tree lays out its ids alone

    def rows_of(ids: Sequence[int]) -> Tuple[Dict[str, Any], np.ndarray]:
        idx = [where(i) for i in ids]
        return {n: tensors[n][idx] for n in names}, lens[idx]

    parts: List[HybridCpPart] = []
    pieces: Dict[str, List[Any]] = {}
    positions: List[Any] = []
    start = 0
    device = next(iter(tensors.values())).device
    for (d, first, _), ids in _part_keys(plan, cell, forest):
        j = r % C - first if d > 1 else 0
        chosen, chosen_lens = rows_of(ids)
        if forest is not None:
            seqs = [chosen["input_ids"][q, : int(chosen_lens[q])] for q in range(len(ids))]
            groups = [int(forest.tree_ids[i]) for i in ids]
            tree = pack_prefix_tree(seqs, group_ids=groups, min_shared_tokens=min_shared_tokens)
            lo, hi = (0, tree.num_tokens) if d == 1 else _tree_range(tree, d, j)
            local_ids = torch.tensor(tree.input_ids[lo:hi], device=device)  # a copy: the arrays are read-only
            pieces.setdefault("input_ids", []).append(local_ids)
            positions.append(torch.tensor(tree.position_ids[lo:hi], device=device))
            layout, full = tree, None
        else:
            layout = pack_sequences(chosen, seq_lens=chosen_lens, pad_multiple=1 if d == 1 else 2 * d,
                                    pad_values=pad_values, cp_size=d, cp_rank=j)
            full = None  # the next-token targets: the part's ids before the zigzag cut
            if "input_ids" in tensors:
                full = layout["input_ids"] if d == 1 else pack_sequences(
                    {"input_ids": chosen["input_ids"]}, seq_lens=chosen_lens, pad_multiple=2 * d,
                    pad_values=pad_values)["input_ids"]
            for n in names:
                pieces.setdefault(n, []).append(layout[n])
            positions.append(layout.position_ids)
            lo, hi = 0, layout.num_tokens
        parts.append(HybridCpPart(d, first, j, tuple(ids), layout, full, start, start + hi - lo))
        start += hi - lo
    out = {}
    for n in names:
        got = pieces.get(n)
        if got:
            out[n] = torch.cat(got) if len(got) > 1 else got[0]
        else:  # an empty cell: no rows
            t = tensors[n]
            out[n] = t.new_empty((0,) + tuple(t.shape[2:]))
    pos = torch.cat(positions) if len(positions) > 1 else positions[0] if positions else \
        torch.zeros(0, dtype=torch.int64, device=device)
    if plan.padded_tokens is not None:  # static_shapes: pad rows after the parts, up to the cell's bucket
        extra = int(plan.padded_tokens[m][r][k]) - start
        if extra < 0:
            raise ValueError(f"the micro-batch holds {start} rows on rank {r}, more than its static shape "
                             f"{int(plan.padded_tokens[m][r][k])}: build it from the rows planned")
        fill = dict(pad_values or {})
        for n in names:
            pad = out[n].new_full((extra,) + tuple(out[n].shape[1:]), fill.get(n, 0))
            out[n] = torch.cat([out[n], pad])
        pos = torch.cat([pos, pos.new_zeros(extra)])
    return HybridCpBatch(tuple(parts), out, pos, plan.dp_size, r // C, C, r % C, m, k,
                         tuple(i for p in parts for i in p.rows))


def _tree_range(tree: Any, d: int, j: int) -> Tuple[int, int]:
    from .prefix_tree_cp import tree_cp_bounds

    bounds = tree_cp_bounds(tree, d)
    return int(bounds[j]), int(bounds[j + 1])


def _plan_facts(plan: Any, m: int, forest: Any) -> Dict[str, Any]:
    """What every rank's plan must share for the blocks' collectives to meet, and for
    the ranks' losses to add up to one step's: its cells, degrees, blocks, lengths,
    and whether its parts are prefix trees (of which forest)."""
    lo, hi = plan.mini_batch_ranges[m]
    lengths = None if plan.lengths is None else np.asarray(plan.lengths[lo:hi], dtype=np.int64)
    trees = None if forest is None else (forest.num_rows, forest.num_physical_tokens,
                                         np.asarray(forest.lengths, dtype=np.int64))
    return {"the plan's cells": [[list(c) for c in rank] for rank in plan.assignment[m]],
            "the plan's lengths": lengths,
            "the parts' prefix trees (forest=)": trees,
            "the plan's CP degrees": np.asarray(plan.cp_degree[lo:hi], dtype=np.int64),
            "the plan's CP blocks": np.asarray(plan.cp_first_rank[lo:hi], dtype=np.int64),
            "the plan's dp_size and cp_size": (plan.dp_size, plan.cp_size)}


def hybrid_cp_micro_batches(tensors: Mapping[str, "torch.Tensor"], seq_lens: Any, plan: Any, *,
                            mini_batch: Any = 0, group: Any = None, forest: Any = None, min_shared_tokens: Any = 1,
                            row_index: Any = None, pad_values: Optional[Mapping[str, Any]] = None,
                            rank: Any = None, agree: bool = True) -> List[HybridCpBatch]:
    """This rank's micro-batches of mini-batch ``mini_batch`` of ``plan`` (each a
    :class:`HybridCpBatch`, the same count on every rank), its rank
    ``dp_rank * cp_size + cp_rank`` read from ``group`` (default WORLD, of
    ``dp_size * cp_size`` ranks). First, on every rank of ``group``: the blocks'
    process groups (:func:`~seqpack.hybrid_cp_groups`, created once), then one
    agreement - every rank's own checks (the plan, the rows, the lengths) and the
    plan's cells, degrees and blocks compared - so a rank handed another plan, or
    whose inputs fail, makes every rank raise before any collective over a block.
    ``rank``, when given (a trainer that knows its DP and CP ranks), must be this
    process's rank in ``group``. Other arguments as :func:`pack_hybrid_cp`."""
    import torch.distributed as dist

    from .._dist import checked_on_every_rank
    from .hybrid_cp_groups import hybrid_cp_groups

    size, me = dist.get_world_size(group), dist.get_rank(group)

    def local():
        if rank is not None and as_positive_int(rank, "rank", allow_zero=True) != me:
            raise ValueError(f"rank={rank} (dp_rank * cp_size + cp_rank) was given, but this process is rank {me} "
                             "of the group: the blocks' groups follow the group's rank order")
        r, m = _check_plan(plan, me, mini_batch)
        if plan.num_ranks != size:
            raise ValueError(f"plan runs over dp_size x cp_size = {plan.num_ranks} ranks; the group has {size}")
        return m, [pack_hybrid_cp(tensors, seq_lens, plan, rank=r, micro_batch=k, mini_batch=m, forest=forest,
                                  min_shared_tokens=min_shared_tokens, row_index=row_index, pad_values=pad_values)
                   for k in range(plan.num_micro_batches[m])]

    m_batches = checked_on_every_rank(local, group, "hybrid_cp_micro_batches", agree and size > 1,
                                      fingerprint=lambda got: _plan_facts(plan, got[0], forest))
    hybrid_cp_groups(plan.dp_size, plan.cp_size, group)  # every rank, in one order, before any block's collective
    ranks = () if group is None else tuple(int(r) for r in dist.get_process_group_ranks(group))
    for mb in m_batches[1]:
        mb.group_ranks = ranks
    return m_batches[1]
