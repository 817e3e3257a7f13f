"""Host plans of a prefix tree: what its consumers derive from the layout once and
the tree then carries (:meth:`~seqpack.PrefixTreeBatch.host_plan`), pickled with it.

- :func:`attention_plan` (:class:`TreeAttentionPlan`): the *attention segments* and
  the key rows of each. An attention segment is a maximal chain of physical tokens
  in which every token but the last has exactly one child: segments break at
  branch points only (a row ending inside a chain changes the log-prob targets, not
  the attention). Its queries see its ancestors' rows (the prefix, fully) and its own
  rows (causally)::

      rows (one per turn)      5 6 | 5 6 7 8 | 5 6 7 8 9 | 5 6 7 8 4      (a chain, then a branch)
      physical                 0:5 1:6 2:7 3:8 ┬ 4:9
                                               └ 5:4
      attention segments       [0 1 2 3] [4] [5]        parents -1 0 0
      key rows (paths)         0 1 2 3 | 0 1 2 3 4 | 0 1 2 3 5

  The keys gathered are the sum of the segments' path lengths, at most the tree's
  physical tokens times ``2 * leaves - 1`` and below twice the tokens of the rows
  that end at leaves; a chain of rows (each a prefix of the next) is one segment,
  its keys exactly its tokens. Rows that share nothing are root segments only:
  :attr:`TreeAttentionPlan.plain`, and attention runs plain packing's kernels.
- :func:`tree_targets` (:class:`TreeTargets`): each physical token's next-token
  targets and the map back to the logical tokens (the log-prob kernels' plan).

    >>> from seqpack import pack_prefix_tree
    >>> tree = pack_prefix_tree([[5, 6], [5, 6, 7, 8], [5, 6, 7, 8, 9], [5, 6, 7, 8, 4]])
    >>> plan = attention_plan(tree)
    >>> plan.segment_offsets.tolist(), plan.segment_parent.tolist(), plan.k_index.tolist()
    ([0, 4, 5, 6], [-1, 0, 0], [0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2, 3, 5])

Torch-free: every plan is NumPy.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import numpy as np

from .._equality import values_equal
from .._lengths import as_positive_int, type_name
from .prefix_tree import PrefixTreeBatch
from .layout_kinds import as_tree

__all__ = ["TreeAttentionPlan", "TreeCpPlan", "TreeTargets", "attention_plan", "attention_segments",
           "cp_attention_plan", "prepare_tree", "scored_targets", "tree_cp_plan", "tree_targets"]


_tree = as_tree


def _index_array(a: Any, name: str, size: Optional[int], low: int, high: Optional[int]) -> int:
    """Checks a pickled plan's int64 array: 1-D, ``size`` entries (any when None),
    values in ``[low, high)`` (no upper bound when None); returns its size."""
    if not isinstance(a, np.ndarray) or a.dtype != np.int64 or a.ndim != 1:
        raise ValueError(f"a tree plan's {name} must be a 1-D int64 array, got {type_name(a)}")
    if size is not None and a.shape[0] != size:
        raise ValueError(f"a tree plan's {name} must hold {size} entries for this tree, got {a.shape[0]}")
    if a.shape[0] and (int(a.min()) < low or (high is not None and int(a.max()) >= high)):
        raise ValueError(f"a tree plan's {name} must hold values in [{low}, {high}) for this tree")
    return int(a.shape[0])


# ---- attention ---------------------------------------------------------------------
def attention_segments(tree: PrefixTreeBatch) -> Tuple[np.ndarray, np.ndarray]:
    """``(offsets [S + 1], parent [S])`` int64: the tree's attention segments (see
    the module docstring), in physical order; a pad token is a root segment of its
    own. Vectorised, linear in the tokens."""
    _tree(tree)
    t, real = tree.num_tokens, tree.num_tokens - tree.num_pad_tokens
    parent = tree.parent
    children = np.bincount(parent[parent >= 0], minlength=t) if t else np.zeros(0, dtype=np.int64)
    starts = np.ones(t, dtype=bool)
    inner = np.flatnonzero(parent[:real] >= 0)
    # A token continues its parent's segment when it is the parent's only child (in
    # depth-first order that child comes right after its parent).
    starts[inner] = children[parent[inner]] != 1
    first = np.flatnonzero(starts)
    segment_of = np.cumsum(starts) - 1
    up = parent[first]
    seg_parent = np.where(up >= 0, segment_of[np.maximum(up, 0)], -1).astype(np.int64)
    return np.append(first, t).astype(np.int64), seg_parent


# A tree whose rows' causal pairs are fewer than this many times its own visible
# pairs shares too little for the tree kernels to pay: its attention runs as plain
# packing over the logical rows (expanded). Measured on the CPU, fwd+bwd against the
# rows alone (RESULTS.md, "Partial sharing"): the tree kernels ran at 0.73-0.81x at a
# pairs ratio of 1.00-1.003, 1.01x at 1.031 and 1.03-1.07x at 1.11; expanded runs at
# 0.94-0.97x whatever the ratio (the gathers to and from the rows).
EXPAND_BELOW = 1.02


class TreeAttentionPlan:
    """The host plan of tree attention (:func:`seqpack.attention` on a prefix tree;
    int64 NumPy arrays, ints).

    Attributes:
        segment_offsets / segment_parent: the attention segments.
        plain: every segment is a root (nothing shared): the tree is packed rows
            with offsets ``segment_offsets``, and attention is plain packing's.
        expand: the rows share so little (their causal pairs below
            :data:`EXPAND_BELOW` times the tree's) that attention is cheaper as plain
            packing over the logical rows: q, k and v gathered to the rows
            (``row_index``, the tree's ``logical_index``; ``row_offsets`` /
            ``max_row`` the rows' offsets and longest), each physical token's output
            read at its first occurrence (``first_row``).
        k_index: ``[K]`` the key rows of every segment's path, segment after
            segment; ``cu_k`` ``[S + 1]`` their offsets (``cu_q`` is
            ``segment_offsets``), ``max_q`` / ``max_k`` the longest of each.
        groups: ``(count, P, Lq)`` per group of same-shape segments (prefix length,
            own length) for the SDPA path; ``group_q`` / ``group_k`` their query
            and key rows, group after group; ``inverse`` puts the groups' outputs
            back in physical order.
        own_groups / own_rows / own_inverse: the cascade (prefix-once) path's
            causal part: ``(count, L)`` per group of segments of own length ``L``,
            their rows group after group (every token once), and the permutation
            back to physical order.
        prefix_groups / prefix_q / prefix_k: its shared-prefix part, one entry per
            segment with children: ``(Nq, P)``, the rows of all its children's
            segments (queries) and its own path (keys, read once for all of them).
    """

    _STATE = ("segment_offsets", "segment_parent", "plain", "k_index", "cu_k", "max_q", "max_k", "groups", "group_q",
              "group_k", "inverse", "own_groups", "own_rows", "own_inverse", "prefix_groups", "prefix_q", "prefix_k",
              "expand", "row_offsets", "max_row", "row_index", "first_row")
    __slots__ = _STATE + ("_devices",)

    def __init__(self, tree: PrefixTreeBatch) -> None:
        self._devices: Dict[Any, Any] = {}
        offsets, parents = attention_segments(tree)
        self.segment_offsets, self.segment_parent = offsets, parents
        s = parents.shape[0]
        self.plain = bool((parents < 0).all())
        own = np.diff(offsets)
        # A segment's path: its last token's depth + 1 (a pad token: 1).
        lengths = tree.position_ids[offsets[1:] - 1] + 1 if s else np.zeros(0, dtype=np.int64)
        cu_k = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        k_index = np.empty(int(cu_k[-1]), dtype=np.int64)
        for seg in range(s):  # a parent segment precedes its children in depth-first order
            p, at, prefix = int(parents[seg]), int(cu_k[seg]), int(lengths[seg] - own[seg])
            if p >= 0:
                k_index[at:at + prefix] = k_index[cu_k[p]:cu_k[p + 1]]
            k_index[at + prefix:cu_k[seg + 1]] = np.arange(offsets[seg], offsets[seg + 1])
        self.k_index, self.cu_k = k_index, cu_k
        self.max_q = int(own.max()) if s else 0
        self.max_k = int(lengths.max()) if s else 0
        self.groups: List[Tuple[int, int, int]] = []
        self.group_q = self.group_k = self.inverse = np.zeros(0, dtype=np.int64)
        self.own_groups: List[Tuple[int, int]] = []
        self.prefix_groups: List[Tuple[int, int]] = []
        self.own_rows = self.own_inverse = self.prefix_q = self.prefix_k = np.zeros(0, dtype=np.int64)
        self.expand = not self.plain and _expands(tree)
        self.row_offsets = self.row_index = self.first_row = np.zeros(0, dtype=np.int64)
        self.max_row = 0
        if self.expand:
            real = tree.num_tokens - tree.num_pad_tokens
            self.row_offsets, self.row_index = np.array(tree.cu_seqlens), np.array(tree.logical_index)
            self.first_row = np.array(tree.first_logical[:real])
            self.max_row = int(tree.seq_lens.max(initial=0))
        elif not self.plain:
            self._group(own, lengths)
            self._cascade(own)

    def _cascade(self, own: np.ndarray) -> None:
        offsets, parents = self.segment_offsets, self.segment_parent
        rows_of = [np.arange(offsets[s], offsets[s + 1], dtype=np.int64) for s in range(parents.shape[0])]
        by_length: Dict[int, List[int]] = defaultdict(list)
        for seg, rows in enumerate(own.tolist()):
            by_length[rows].append(seg)
        self.own_groups = [(len(members), rows) for rows, members in by_length.items()]
        self.own_rows = np.concatenate([rows_of[m] for members in by_length.values() for m in members])
        self.own_inverse = np.empty_like(self.own_rows)
        self.own_inverse[self.own_rows] = np.arange(self.own_rows.shape[0], dtype=np.int64)
        children: Dict[int, List[int]] = defaultdict(list)
        for seg, parent in enumerate(parents.tolist()):
            if parent >= 0:
                children[parent].append(seg)
        q_parts, k_parts = [], []
        for parent, kids in children.items():
            q_parts.extend(rows_of[c] for c in kids)
            k_parts.append(self.k_index[self.cu_k[parent]:self.cu_k[parent + 1]])
            self.prefix_groups.append((int(sum(own[c] for c in kids)), int(k_parts[-1].shape[0])))
        self.prefix_q = np.concatenate(q_parts).astype(np.int64) if q_parts else self.prefix_q
        self.prefix_k = np.concatenate(k_parts).astype(np.int64) if k_parts else self.prefix_k

    def _group(self, own: np.ndarray, lengths: np.ndarray) -> None:
        by_shape: Dict[Tuple[int, int], List[int]] = defaultdict(list)
        for seg, (rows, keys) in enumerate(zip(own.tolist(), lengths.tolist())):
            by_shape[(keys - rows, rows)].append(seg)
        q_parts, k_parts = [], []
        for (prefix, rows), members in by_shape.items():
            self.groups.append((len(members), prefix, rows))
            q_parts.extend(np.arange(self.segment_offsets[m], self.segment_offsets[m + 1]) for m in members)
            k_parts.extend(self.k_index[self.cu_k[m]:self.cu_k[m + 1]] for m in members)
        self.group_q = np.concatenate(q_parts).astype(np.int64)
        self.group_k = np.concatenate(k_parts).astype(np.int64)
        self.inverse = np.empty_like(self.group_q)
        self.inverse[self.group_q] = np.arange(self.group_q.shape[0], dtype=np.int64)

    @property
    def cu_q(self) -> np.ndarray:
        return self.segment_offsets

    @property
    def num_keys(self) -> int:
        """Key rows gathered for the whole tree (the sum of the paths)."""
        return int(self.cu_k[-1])

    def on_device(self, device: Any, *names: str) -> Tuple[Any, ...]:
        """The index arrays ``names`` as tensors on ``device``: one pinned,
        non-blocking host-to-device copy the first time, kept by the plan for every
        later layer and step (device copies are not pickled). Imports torch."""
        import torch

        from ._device import host_to_device

        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        key = (device, names)
        hit = self._devices.get(key)
        if hit is None:
            hit = self._devices.setdefault(key, tuple(host_to_device([getattr(self, n) for n in names], device)))
        return hit

    def __getstate__(self):
        return {name: getattr(self, name) for name in self._STATE}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        for name in self._STATE:
            setattr(self, name, state[name])
        self._devices = {}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TreeAttentionPlan):
            return NotImplemented
        return all(values_equal(getattr(self, n), getattr(other, n)) for n in self._STATE)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (f"TreeAttentionPlan(num_segments={self.segment_parent.shape[0]}, num_keys={self.num_keys}, "
                f"plain={self.plain}, expand={self.expand})")

    def check_layout(self, tree: PrefixTreeBatch) -> None:
        """Raises ValueError unless this plan is ``tree``'s (a pickled plan): its
        segments are recomputed (linear) and its key rows bounded."""
        offsets, parents = attention_segments(tree)
        if not (np.array_equal(offsets, self.segment_offsets) and np.array_equal(parents, self.segment_parent)):
            raise ValueError("a pickled tree attention plan does not match its tree's attention segments")
        t, s = tree.num_tokens, parents.shape[0]
        k = _index_array(self.k_index, "k_index", None, 0, t)
        _index_array(self.cu_k, "cu_k", s + 1, 0, k + 1)
        if (self.cu_k.shape[0] and (self.cu_k[0] != 0 or self.cu_k[-1] != k)) or (np.diff(self.cu_k) < 1).any():
            raise ValueError("a pickled tree attention plan's cu_k must start at 0, increase and end at its keys")
        if self.plain != bool((parents < 0).all()):
            raise ValueError("a pickled tree attention plan's plain flag does not match its tree")
        if self.expand != (not self.plain and _expands(tree)):
            raise ValueError("a pickled tree attention plan's expand flag does not match its tree")
        if self.expand and not (np.array_equal(self.row_offsets, tree.cu_seqlens)
                                and np.array_equal(self.row_index, tree.logical_index)
                                and np.array_equal(self.first_row, tree.first_logical[:t - tree.num_pad_tokens])
                                and self.max_row == int(tree.seq_lens.max(initial=0))):
            raise ValueError("a pickled tree attention plan's rows do not match its tree")
        flat = self.plain or self.expand  # no groups: plain packing's kernels
        q = _index_array(self.group_q, "group_q", None, 0, t)
        _index_array(self.inverse, "inverse", q, 0, max(q, 1))
        g = _index_array(self.group_k, "group_k", None, 0, t)
        if (sum(c * lq for c, _, lq in self.groups) != q or sum(c * (p + lq) for c, p, lq in self.groups) != g
                or (not flat and q != t)):
            raise ValueError("a pickled tree attention plan's groups do not add up to its rows")
        own = _index_array(self.own_rows, "own_rows", 0 if flat else t, 0, t)
        _index_array(self.own_inverse, "own_inverse", own, 0, max(own, 1))
        pq = _index_array(self.prefix_q, "prefix_q", None, 0, t)
        pk = _index_array(self.prefix_k, "prefix_k", None, 0, t)
        if (sum(c * n for c, n in self.own_groups) != own or sum(n for n, _ in self.prefix_groups) != pq
                or sum(p for _, p in self.prefix_groups) != pk):
            raise ValueError("a pickled tree attention plan's cascade groups do not add up to its rows")


def _expands(tree: PrefixTreeBatch) -> bool:
    """Whether ``tree`` shares too little for the tree kernels (:data:`EXPAND_BELOW`)."""
    m = tree.metrics()
    return m.plain_attention_pairs < EXPAND_BELOW * m.tree_attention_pairs


def attention_plan(tree: PrefixTreeBatch) -> TreeAttentionPlan:
    """``tree``'s :class:`TreeAttentionPlan`, built once and kept by the tree."""
    return _tree(tree).host_plan("attention", TreeAttentionPlan)


# ---- context parallelism -------------------------------------------------------------
def tree_cp_plan(tree: PrefixTreeBatch, bounds: np.ndarray, rank: int) -> Dict[str, Any]:
    """The varlen plan of rank ``rank``'s rows ``[bounds[rank], bounds[rank + 1])``:
    one query segment per tree segment they meet, its keys (rows of the full
    layout) the segment's root path cut after its last local row."""
    start, end = int(bounds[rank]), int(bounds[rank + 1])
    whole = attention_plan(tree)  # the attention segments and their paths
    offsets = whole.cu_q
    first = int(np.searchsorted(offsets, start, side="right")) - 1
    last = int(np.searchsorted(offsets, end, side="left"))
    seg = np.arange(max(first, 0), last if end > start else max(first, 0), dtype=np.int64)
    q_start, q_end = np.maximum(offsets[seg], start), np.minimum(offsets[seg + 1], end)
    k_start = whole.cu_k[seg]
    k_lens = whole.cu_k[seg + 1] - k_start - (offsets[seg + 1] - q_end)  # the path up to the last local row
    k_index = np.repeat(k_start - np.concatenate([[0], np.cumsum(k_lens)[:-1]]), k_lens) + np.arange(
        int(k_lens.sum()), dtype=np.int64)
    q_lens = q_end - q_start
    return dict(cu_q=np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64),
                cu_k=np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int64),
                k_index=whole.k_index[k_index] if k_index.shape[0] else np.zeros(0, dtype=np.int64),
                max_q=int(q_lens.max(initial=0)), max_k=int(k_lens.max(initial=0)))


class TreeCpPlan:
    """One CP rank's host plan of a tree: the cut (``bounds``) and the rank's varlen
    plan (:func:`tree_cp_plan`), kept by the tree under ``("cp", cp_size, rank)``."""

    __slots__ = ("bounds", "plan")

    def __init__(self, bounds: np.ndarray, plan: Dict[str, Any]) -> None:
        self.bounds, self.plan = bounds, plan

    def __getstate__(self):
        return {"bounds": self.bounds, "plan": self.plan}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.bounds, self.plan = state["bounds"], state["plan"]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TreeCpPlan):
            return NotImplemented
        return values_equal(self.bounds, other.bounds) and values_equal(self.plan, other.plan)

    __hash__ = None  # type: ignore[assignment]

    def check_layout(self, tree: PrefixTreeBatch) -> None:
        """Raises ValueError unless this plan is one of ``tree``'s (a pickled plan):
        the cut recomputed, the key rows bounded."""
        from .prefix_tree_cp import tree_cp_bounds

        _tree(tree)
        bounds, plan = self.bounds, self.plan
        if not isinstance(bounds, np.ndarray) or not np.array_equal(bounds, tree_cp_bounds(tree, bounds.shape[0] - 1)):
            raise ValueError("a pickled tree CP plan's cut does not match its tree")
        k = plan.get("k_index") if isinstance(plan, dict) else None
        if not isinstance(k, np.ndarray) or k.dtype != np.int64 or (k.size and (k.min() < 0 or
                                                                                k.max() >= tree.num_tokens)):
            raise ValueError("a pickled tree CP plan's key rows must be int64 rows of its tree")


def cp_attention_plan(tree: PrefixTreeBatch, cp: int, rank: int) -> TreeCpPlan:
    """Rank ``rank``'s :class:`TreeCpPlan` of ``tree`` over ``cp`` ranks, built once
    and kept by the tree: every attention layer of a step reuses it."""
    from .prefix_tree_cp import tree_cp_bounds

    def build(t):
        bounds = tree_cp_bounds(t, cp)
        return TreeCpPlan(bounds, tree_cp_plan(t, bounds, rank))

    return tree.host_plan(("cp", cp, rank), build)


def prepare_tree(tree: PrefixTreeBatch, *, attention: bool = True, targets: bool = True,
                 cp_size: Any = None) -> PrefixTreeBatch:
    """Build now the host plans a training step reads (the attention plan, or the
    plain rows of a tree that shares nothing; the log-prob targets; each rank's CP
    attention plan for ``cp_size`` ranks), so that
    the step does none of that work: call it where the batch is built (a collate
    function, a DataLoader worker); the plans pickle with the tree. Returns the tree.

    >>> from seqpack import pack_prefix_tree
    >>> tree = prepare_tree(pack_prefix_tree([[1, 2, 3], [1, 2, 4]]))
    >>> sorted(map(str, tree.planned()))
    ['attention', 'targets']
    """
    _tree(tree)
    if attention and tree.shares_tokens:  # rows sharing nothing run plain packing: no attention plan
        attention_plan(tree)
    if targets:
        tree_targets(tree)
    if cp_size is not None and as_positive_int(cp_size, "cp_size") > 1:
        for rank in range(int(cp_size)):  # every rank's: the same tree goes to each
            cp_attention_plan(tree, int(cp_size), rank)
    return tree


# ---- log-prob targets ------------------------------------------------------------------
class TreeTargets(NamedTuple):
    """The host plan of :func:`tree_token_logprobs` (int64 NumPy arrays).

    Attributes:
        primary: ``[T]`` the primary target id of each physical token, -1 where it
            has none (a row's last token, a pad token, only negative targets).
        extra_source / extra_target: ``[E]`` the other (physical token, target id)
            pairs of the branch points, sorted by physical token, then id.
        extra_offsets: ``[T + 1]`` physical token ``p``'s extra pairs are
            ``extra_offsets[p]:extra_offsets[p + 1]`` (the kernels' form).
        logprob_index: ``[N]`` where each logical token reads its log-prob in
            ``concat(primary log-probs [T], extra log-probs [E], [0])``: ``p`` for its
            physical token's primary target, ``T + e`` for extra pair ``e``, ``T + E``
            (the 0) where it has no target.
        entropy_index: ``[N]`` where each logical token reads its entropy in
            ``concat(entropy [T], [0])``: its physical token, or ``T`` (the 0).
    """

    primary: np.ndarray
    extra_source: np.ndarray
    extra_target: np.ndarray
    extra_offsets: np.ndarray
    logprob_index: np.ndarray
    entropy_index: np.ndarray

    def __eq__(self, other: object) -> bool:  # arrays element by element, not a tuple's truth values
        if not isinstance(other, TreeTargets):
            return NotImplemented
        return all(values_equal(a, b) for a, b in zip(self, other))

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = None  # holds arrays

    def check_layout(self, tree: PrefixTreeBatch) -> None:
        """Raises ValueError unless this plan indexes within ``tree`` (a pickled plan)."""
        t, n = _tree(tree).num_tokens, tree.num_logical_tokens
        e = _index_array(self.extra_source, "extra_source", None, 0, t)
        _index_array(self.primary, "primary", t, -1, None)
        _index_array(self.extra_target, "extra_target", e, 0, None)
        _index_array(self.extra_offsets, "extra_offsets", t + 1, 0, e + 1)
        _index_array(self.logprob_index, "logprob_index", n, 0, t + e + 1)
        _index_array(self.entropy_index, "entropy_index", n, 0, t + 1)


def tree_targets(tree: PrefixTreeBatch) -> TreeTargets:
    """The targets of ``tree``'s physical tokens and the map back to its logical
    tokens (see :class:`TreeTargets`): NumPy, vectorised, linear in the tokens but for
    one sort of the (physical token, target) pairs. Torch-free.

    >>> from seqpack import pack_prefix_tree
    >>> plan = tree_targets(pack_prefix_tree([[5, 6, 7], [5, 6, 8, 9]]))
    >>> plan.primary.tolist(), plan.extra_source.tolist(), plan.extra_target.tolist()
    ([6, 7, -1, 9, -1], [1], [8])
    >>> plan.extra_offsets.tolist()
    [0, 0, 1, 1, 1, 1]
    >>> plan.logprob_index.tolist(), plan.entropy_index.tolist()
    ([0, 1, 6, 0, 5, 3, 6], [0, 1, 5, 0, 1, 3, 5])
    """
    return _tree(tree).host_plan("targets", _build_targets)


def scored_targets(tree: PrefixTreeBatch, scored: Any) -> Tuple[np.ndarray, TreeTargets]:
    """The plan of the logical tokens ``scored`` alone (``[N]`` bool: whose next token
    is wanted, as TRL's labels that are not -100), over only the physical tokens that
    predict one of them: ``rows`` ``[S]`` (their physical indices, ascending) and a
    :class:`TreeTargets` whose physical tokens are those ``S`` rows (the others never
    computed). Tokens not scored read the 0. Built per call (not kept by the tree).

    >>> from seqpack import pack_prefix_tree
    >>> tree = pack_prefix_tree([[5, 6, 7], [5, 6, 8, 9]])   # logical: 5 6 7 | 5 6 8 9
    >>> rows, plan = scored_targets(tree, [False, True, False, False, True, True, False])
    >>> rows.tolist(), plan.primary.tolist(), plan.extra_target.tolist(), plan.logprob_index.tolist()
    ([1, 3], [7, 9], [8], [3, 0, 3, 3, 2, 1, 3])
    """
    tree = _tree(tree)
    mask = np.asarray(scored)
    if mask.shape != (tree.num_logical_tokens,) or mask.dtype != np.bool_:
        raise ValueError(f"scored must be a [N] bool array, one per logical token (N = {tree.num_logical_tokens}), "
                         f"got {mask.dtype} {mask.shape}")
    return _build_targets(tree, mask)


def _build_targets(tree: PrefixTreeBatch, scored: Optional[np.ndarray] = None) -> Any:
    """:class:`TreeTargets` of every logical token (``scored`` None), or ``(rows,
    plan)`` of the scored ones over the physical tokens that predict them."""
    ids, logical, cu = tree.input_ids, tree.logical_index, tree.cu_seqlens
    t, n = ids.shape[0], logical.shape[0]
    # Logical token i predicts logical token i + 1 unless it ends its row.
    has_next = np.ones(n, dtype=bool)
    ends = cu[1:][cu[1:] > cu[:-1]] - 1  # the last token of each non-empty row
    has_next[ends] = False
    if scored is not None:
        has_next &= scored
    where = np.flatnonzero(has_next)
    src = logical[where]
    tgt = ids[logical[where + 1]]
    keep = tgt >= 0  # a negative id is "no target", as for packed rows
    where, src, tgt = where[keep], src[keep], tgt[keep]

    order = np.lexsort((tgt, src))  # by physical token, then target id
    s_src, s_tgt = src[order], tgt[order]
    new_pair = np.ones(s_src.shape[0], dtype=bool)
    new_pair[1:] = (s_src[1:] != s_src[:-1]) | (s_tgt[1:] != s_tgt[:-1])
    pair_of_sorted = np.cumsum(new_pair) - 1  # the pair of each sorted (logical) entry
    u_src, u_tgt = s_src[new_pair], s_tgt[new_pair]
    is_primary = np.ones(u_src.shape[0], dtype=bool)
    is_primary[1:] = u_src[1:] != u_src[:-1]  # the smallest target id of each physical token
    rows = None
    if scored is not None:  # the physical tokens with a pair, numbered 0..S-1
        rows = u_src[is_primary].astype(np.int64)
        t = rows.shape[0]
        u_src = np.cumsum(is_primary) - 1
        src = np.searchsorted(rows, src)

    primary = np.full(t, -1, dtype=np.int64)
    primary[u_src[is_primary]] = u_tgt[is_primary]
    extra = ~is_primary
    num_extra = int(extra.sum())
    pair_out = np.where(is_primary, u_src, t + np.cumsum(extra) - 1)  # each pair's slot in the concatenation

    logprob_index = np.full(n, t + num_extra, dtype=np.int64)
    logprob_index[where[order]] = pair_out[pair_of_sorted]
    entropy_index = np.full(n, t, dtype=np.int64)
    entropy_index[where] = src
    extra_source = u_src[extra].astype(np.int64)
    extra_offsets = np.searchsorted(extra_source, np.arange(t + 1, dtype=np.int64)).astype(np.int64)
    plan = TreeTargets(primary, extra_source, u_tgt[extra].astype(np.int64), extra_offsets, logprob_index,
                       entropy_index)
    return plan if rows is None else (rows, plan)
