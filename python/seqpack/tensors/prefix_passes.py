"""A prefix tree run in passes of at most ``max_tokens`` physical tokens, each token
computed once whatever the cap (issue 52): :func:`split_prefix_tree`.

A micro-batch holds at most ``max_tokens`` tokens. A prefix tree larger than that
(a long prompt with many responses, an agentic history) is cut into *passes*, every
physical token in exactly one. The tokens whose subtree exceeds the cap (the shared
prefixes: the tree's *skeleton*) run first, in depth-first chunks of at most the cap,
as *provider* passes whose keys and values every later pass reads; the subtrees that
fit (the *units*) are packed into *branch* passes that read the K/V of the prefix
above them as extra keys. A token still sees exactly its root path::

    tree (cap 6)          P0 P1 P2 P3 P4 ─┬─ a0 a1 a2
                                          ├─ b0 b1 b2
                                          └─ c0 c1 c2
    pass 0  provider      P0 P1 P2 P3 P4              its K/V kept for passes 1, 2
    pass 1  branch        a0 a1 a2 b0 b1 b2           queries a, b; keys P + own
    pass 2  branch        c0 c1 c2                    queries c; keys P + own

    a step runs           forward 0 (when pass 1 first needs it),
                          forward + backward 1, forward + backward 2,
                          backward 0 ("close": fed the K/V gradients of 1 and 2)

A prefix longer than the cap is several provider passes, each reading the chunks
before it; a nested prefix (a history shared by many rows, a longer one by fewer)
is skeleton at every level whose subtree exceeds the cap. A pass's attention is
:func:`seqpack.attention` on its :class:`TreePass` layout (one more case of the one
table, :mod:`seqpack.training.dispatch`) and its log-probs
:func:`seqpack.token_logprobs`: the logical tokens its own tokens predict, 0
elsewhere, so the passes' results sum to the whole tree's. Running them in order
with their K/V is :func:`seqpack.prefix_reuse` (:mod:`seqpack.training.prefix_reuse`).

    >>> import seqpack
    >>> tree = seqpack.pack_prefix_tree([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 9, 10, 11],
    ...                                  [1, 2, 3, 4, 5, 12, 13, 14]])
    >>> passes = split_prefix_tree(tree, max_tokens=6)
    >>> [(p.role, p.own.tolist()) for p in passes.passes]
    [('provider', [0, 1, 2, 3, 4]), ('branch', [5, 6, 7, 8, 9, 10]), ('branch', [11, 12, 13])]
    >>> passes.order
    (('branch', 1), ('branch', 2), ('close', 0))

Importing this module does not import torch.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .._lengths import as_positive_int
from ..planning.prefix_reuse import pass_pairs, run_order, split_tree
from .layout_kinds import as_tree
from .prefix_tree import PrefixTreeBatch
from .token_layout import TokenLayout
from .tree_plans import attention_plan

__all__ = ["PrefixPasses", "TreePass", "split_prefix_tree"]

ROLES = ("provider", "branch")


class TreePass(TokenLayout):
    """One pass of a :class:`PrefixPasses`: the layout of its own physical tokens
    (``own``, ascending physical indices of ``tree``) and of the K/V it reads from
    earlier passes (``providers``). Its counts, positions and logical order are the
    whole tree's (as a CP cut's are); the model runs on its :attr:`num_local_tokens`
    rows: ``input_ids`` / ``local_position_ids``.

    Attention plan (host, int64): queries are the own tokens, one attention sequence
    per tree segment they fall in (``cu_q``); keys are gathered (``k_index``) from
    ``concat(each provider's own K in provider order, this pass's K)``, each
    sequence's root path then its own tokens (``cu_k``), causal aligned at the end.
    """

    __slots__ = ("tree", "cap", "index", "role", "own", "providers", "k_index", "cu_q", "cu_k", "max_q", "max_k",
                 "context_tokens", "cascade", "_plans", "runtime", "layer", "pad")

    def __init__(self, tree: PrefixTreeBatch, cap: int, index: int, role: str, own: np.ndarray,
                 providers: Tuple[int, ...], k_index: np.ndarray, cu_q: np.ndarray, cu_k: np.ndarray,
                 context_tokens: int, cascade: "PassCascade") -> None:
        self.tree, self.cap, self.index, self.role = tree, int(cap), int(index), role
        self.cascade = cascade
        self.providers = tuple(int(p) for p in providers)
        self.own, self.k_index, self.cu_q, self.cu_k = own, k_index, cu_q, cu_k
        for arr in (own, k_index, cu_q, cu_k):
            arr.flags.writeable = False
        lengths_q, lengths_k = np.diff(cu_q), np.diff(cu_k)
        self.max_q = int(lengths_q.max(initial=0))
        self.max_k = int(lengths_k.max(initial=0))
        self.context_tokens = int(context_tokens)
        self._plans: Dict[Any, Any] = {}
        self.runtime: Any = None  # the running step (seqpack.prefix_reuse) that holds the K/V it reads
        self.layer: Optional[int] = None  # the layer whose attention this view is (for_layer), None: by call order
        self.pad = 0  # pad rows after the own tokens (padded_to): the model's input is a multiple of the pad

    declared_kind = "tree_pass"

    # ---- the whole tree's facts ----------------------------------------------------------
    num_tokens = property(lambda self: self.tree.num_tokens)
    num_logical_tokens = property(lambda self: self.tree.num_logical_tokens)
    num_rows = property(lambda self: self.tree.num_rows)
    logical_index = property(lambda self: self.tree.logical_index)
    position_ids = property(lambda self: self.tree.position_ids)
    cu_seqlens = property(lambda self: self.tree.cu_seqlens)
    cp_size = property(lambda self: 1)
    cp_rank = property(lambda self: 0)

    # ---- this pass -------------------------------------------------------------------------
    @property
    def num_local_tokens(self) -> int:
        """The rows the model runs on: the pass's own tokens, then :attr:`pad` pad rows."""
        return int(self.own.shape[0]) + self.pad

    @property
    def input_ids(self) -> np.ndarray:
        """``[num_local_tokens]`` the own tokens' ids (0 on the pad rows)."""
        return self._padded(self.tree.input_ids[self.own])

    @property
    def local_position_ids(self) -> np.ndarray:
        """``[num_local_tokens]`` the own tokens' positions (depths; 0 on the pad rows)."""
        return self._padded(self.tree.position_ids[self.own])

    def _padded(self, values: np.ndarray) -> np.ndarray:
        if not self.pad:
            return values
        return np.concatenate([values, np.zeros(self.pad, dtype=values.dtype)])

    def padded_to(self, multiple: Any) -> "TreePass":
        """This pass with pad rows after its own tokens up to a multiple of ``multiple``
        tokens (tensor parallelism with sequence parallelism, FP8): the model runs on
        them, their attention output is 0 and they predict nothing, so the pass
        computes what it computes unpadded.

            own tokens  a0 a1 a2 b0 b1      padded_to(4)  a0 a1 a2 b0 b1 _ _ _
        """
        m = as_positive_int(multiple, "pad_to_multiple_of")
        n = int(self.own.shape[0])
        return self._view(pad=-(-n // m) * m - n)

    @property
    def num_context_pairs(self) -> int:
        """Attention pairs whose key is an earlier pass's token (the K/V it reads)."""
        return int(pass_pairs(self.tree.parent, self.tree.position_ids, [(self.role, self.own)])[1][0])

    def predicts(self) -> np.ndarray:
        """``[N]`` bool: the logical tokens whose next token this pass's own tokens
        predict (the log-probs it gives; the other passes give the rest)."""
        mine = np.zeros(self.tree.num_tokens, dtype=bool)
        mine[self.own] = True
        return mine[self.tree.logical_index]

    def predicted_tokens(self) -> np.ndarray:
        """:meth:`predicts` (the tokens the loss of this pass covers)."""
        return self.host_plan("predicts", TreePass.predicts)

    def local_rows(self, full: Any) -> Any:
        """This pass's rows of a full ``[T, ...]`` tensor (or array) of the tree."""
        shape = tuple(getattr(full, "shape", ()))
        if not shape or shape[0] != self.tree.num_tokens:
            raise ValueError(f"full must have one row per physical token of the tree ({self.tree.num_tokens}), got "
                             f"shape {shape}")
        if hasattr(full, "index_select"):
            import torch

            return full.index_select(0, torch.tensor(self.own, device=full.device))
        return np.asarray(full)[self.own]

    def rows(self) -> Any:
        return None

    def select(self, *, rows: Any, tree: Any) -> Any:
        return tree

    def _plan_store(self) -> Dict[Any, Any]:
        return self._plans

    def _defining_arrays(self) -> Tuple[Any, ...]:
        return (*self.tree._defining_arrays(), self.index, self.own, np.asarray(self.providers, dtype=np.int64))

    def __eq__(self, other: object) -> Any:
        if not isinstance(other, TreePass):
            return NotImplemented
        return (self.index == other.index and self.role == other.role and self.providers == other.providers
                and self.pad == other.pad and np.array_equal(self.own, other.own) and self.tree == other.tree)

    __hash__ = None  # type: ignore[assignment]

    def bound(self, runtime: Any) -> "TreePass":
        """This pass (the same arrays) bound to ``runtime``, the running step whose
        K/V its attention reads."""
        return self._view(runtime=runtime, layer=None)

    def for_layer(self, layer: Any) -> "TreePass":
        """This pass as layer ``layer``'s attention sees it (None: the step counts the
        layers in call order, which a layer recomputed during the backward breaks)."""
        if layer is None:
            return self
        return self._view(runtime=self.runtime, layer=as_positive_int(layer, "layer", allow_zero=True))

    def _view(self, **changes: Any) -> "TreePass":
        out = object.__new__(TreePass)
        for name in TreePass.__slots__:
            object.__setattr__(out, name, changes.get(name, getattr(self, name)))
        return out

    def __reduce__(self):
        # A pass is rebuilt from its schedule (the same tree and cap make the same
        # passes); the running step's K/V never travel.
        return _pass_of, (self.tree, self.cap, self.index, self.pad)

    def __repr__(self) -> str:
        pad = f", pad={self.pad}" if self.pad else ""
        return (f"TreePass(index={self.index}, role={self.role!r}, num_local_tokens={self.num_local_tokens}{pad}, "
                f"providers={list(self.providers)})")


class PassCascade:
    """A pass's attention as the cascade of
    :mod:`~seqpack.training.attention_tree_cascade` (the CPU path): each sequence's
    own part (its queries over themselves, causal: ``own_groups`` ``(count, L)``,
    queries ``own_rows`` in the pass, keys ``own_k`` in the key buffer,
    ``own_inverse`` back to the pass's order) and its prefix (the keys before it,
    fully visible), one prefix per group of sequences that share it, read once:
    ``prefix_groups`` ``(Nq, P)``, queries ``prefix_q``, keys ``prefix_k``."""

    __slots__ = ("own_groups", "own_rows", "own_k", "own_inverse", "prefix_groups", "prefix_q", "prefix_k")

    def __init__(self, cu_q: np.ndarray, cu_k: np.ndarray, k_index: np.ndarray, prefix_key: List[Any],
                 context: int) -> None:
        lengths = np.diff(cu_q)
        by_length: Dict[int, List[int]] = {}
        for seq, n in enumerate(lengths.tolist()):
            by_length.setdefault(n, []).append(seq)
        self.own_groups = [(len(seqs), n) for n, seqs in by_length.items()]
        rows = [np.arange(cu_q[j], cu_q[j + 1], dtype=np.int64) for j in range(lengths.shape[0])]
        self.own_rows = np.concatenate([rows[j] for seqs in by_length.values() for j in seqs]) if rows else \
            np.zeros(0, dtype=np.int64)
        self.own_k = self.own_rows + context  # a sequence's own part: the pass's own tokens
        self.own_inverse = np.empty_like(self.own_rows)
        self.own_inverse[self.own_rows] = np.arange(self.own_rows.shape[0], dtype=np.int64)
        shared: Dict[Any, List[int]] = {}
        for j, key in enumerate(prefix_key):
            if cu_k[j + 1] - cu_k[j] > lengths[j]:  # a sequence with keys before its own part
                shared.setdefault(key, []).append(j)
        self.prefix_groups: List[Tuple[int, int]] = []
        q_parts, k_parts = [], []
        for seqs in shared.values():
            first = seqs[0]
            keys = k_index[cu_k[first]:cu_k[first + 1] - lengths[first]]
            q_parts += [rows[j] for j in seqs]
            k_parts.append(keys)
            self.prefix_groups.append((int(sum(lengths[j] for j in seqs)), int(keys.shape[0])))
        empty = np.zeros(0, dtype=np.int64)
        self.prefix_q = np.concatenate(q_parts).astype(np.int64) if q_parts else empty
        self.prefix_k = np.concatenate(k_parts).astype(np.int64) if k_parts else empty
        for arr in (self.own_rows, self.own_k, self.own_inverse, self.prefix_q, self.prefix_k):
            arr.flags.writeable = False


def _pass_of(tree: PrefixTreeBatch, cap: int, index: int, pad: int = 0) -> TreePass:
    out = split_prefix_tree(tree, cap).passes[index]
    return out._view(pad=pad) if pad else out


class PrefixPasses:
    """The passes of one prefix tree under a cap (:func:`split_prefix_tree`).

    Attributes:
        tree: the :class:`~seqpack.PrefixTreeBatch`.
        max_tokens: the cap: no pass holds more own tokens.
        passes: the :class:`TreePass` layouts in forward order (providers first).
        order: what a step's loop runs, in order: ``("branch", i)`` (forward and
            backward of pass ``i``; the providers it reads are forwarded first, once)
            and ``("close", i)`` (provider ``i``'s backward, right after the last
            pass that reads it).
    """

    def __init__(self, tree: PrefixTreeBatch, max_tokens: int, passes: List[TreePass]) -> None:
        self.tree, self.max_tokens, self.passes = tree, int(max_tokens), tuple(passes)
        self.order = _loop_order(self.passes)

    @property
    def num_passes(self) -> int:
        return len(self.passes)

    @property
    def num_providers(self) -> int:
        return sum(p.role == "provider" for p in self.passes)

    def tokens(self) -> np.ndarray:
        """``[passes]`` own tokens of each pass (each <= ``max_tokens``)."""
        return np.array([p.own.shape[0] for p in self.passes], dtype=np.int64)

    def differs_from(self, order: Any, tokens: Any) -> Optional[str]:
        """How these passes differ from a plan's (its run ``order`` and each run pass's
        ``tokens``, :class:`~seqpack.planning.PrefixReusePlan` ``pass_order[r]`` /
        ``pass_tokens[r]``), or None: the check that a batch is the rows it was planned on."""
        at = [i for _, i in self.order]
        mine = self.tokens()[at].tolist()
        if list(self.order) == list(order) and mine == list(tokens):
            return None
        return (f"they split into passes {list(self.order)} of {mine} tokens, the plan's are {list(order)} of "
                f"{list(tokens)}")

    def context_pairs(self) -> np.ndarray:
        """``[passes]`` attention pairs each pass reads from earlier passes' K/V."""
        return np.array([p.num_context_pairs for p in self.passes], dtype=np.int64)

    def __eq__(self, other: object) -> Any:
        if not isinstance(other, PrefixPasses):
            return NotImplemented
        return self.max_tokens == other.max_tokens and self.passes == other.passes

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self):
        return split_prefix_tree, (self.tree, self.max_tokens)

    def __repr__(self) -> str:
        return (f"PrefixPasses(max_tokens={self.max_tokens}, passes={self.num_passes}, "
                f"providers={self.num_providers}, tokens={int(self.tokens().sum())})")


def _loop_order(passes: Tuple[TreePass, ...]) -> Tuple[Tuple[str, int], ...]:
    """What a step's loop runs (the planner's rule, :func:`~seqpack.planning.prefix_reuse.run_order`)."""
    return tuple(run_order([p.role for p in passes], [p.providers for p in passes]))


def split_prefix_tree(tree: Any, max_tokens: Any) -> PrefixPasses:
    """``tree`` cut into passes of at most ``max_tokens`` own physical tokens (see the
    module docstring), every physical token in exactly one pass.

    Provider passes: the tokens whose subtree holds more than ``max_tokens`` tokens,
    in depth-first chunks of ``max_tokens`` (a chunk reads the chunks before it).
    Branch passes: the largest subtrees that fit, packed first-fit in depth-first order
    (siblings together). A tree that fits is branch passes alone (none reads anything).

    Args:
        tree: a :class:`~seqpack.PrefixTreeBatch` (pad tokens are one-token subtrees).
        max_tokens: the cap, a positive int (NumPy and 0-d tensor ints too).
    """
    tree = as_tree(tree)
    cap = as_positive_int(max_tokens, "max_tokens")
    groups = split_tree(tree.parent, tree.subtree_end, cap)  # the planner's rule (planning/prefix_reuse.py)
    owner = np.full(tree.num_tokens, -1, dtype=np.int64)  # each token's pass
    for i, (_, own) in enumerate(groups):
        owner[own] = i
    plan = attention_plan(tree)
    offsets, seg_k, cu_k_tree = plan.segment_offsets, plan.k_index, plan.cu_k
    segment_of = np.repeat(np.arange(offsets.shape[0] - 1, dtype=np.int64), np.diff(offsets))
    passes = []
    for i, (role, own) in enumerate(groups):
        passes.append(_make_pass(tree, cap, i, role, own, owner, groups, segment_of, offsets, plan.segment_parent,
                                 seg_k, cu_k_tree))
    return PrefixPasses(tree, cap, passes)


def _make_pass(tree: PrefixTreeBatch, cap: int, i: int, role: str, own: np.ndarray, owner: np.ndarray,
               groups: List[Tuple[str, np.ndarray]], segment_of: np.ndarray, offsets: np.ndarray,
               segment_parent: np.ndarray, seg_k: np.ndarray, cu_k_tree: np.ndarray) -> TreePass:
    segs = segment_of[own]
    first = np.ones(own.shape[0], dtype=bool)
    first[1:] = segs[1:] != segs[:-1]
    starts = np.flatnonzero(first)
    cu_q = np.append(starts, own.shape[0]).astype(np.int64)
    keys: List[np.ndarray] = []
    prefix_key: List[Any] = []  # sequences whose keys before their own part are one prefix share it
    for at, end in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        seg = int(segs[at])
        whole = int(own[at]) == int(offsets[seg])  # the own part starts the segment: its prefix is the parent's path
        prefix_key.append(("path", int(segment_parent[seg])) if whole else ("inside", seg))
        last = int(own[end - 1])  # the own part of a segment ends here; later tokens are another pass's
        path = seg_k[cu_k_tree[seg]:cu_k_tree[seg + 1]]
        keys.append(path[:path.shape[0] - (int(offsets[seg + 1]) - 1 - last)])
    physical = np.concatenate(keys).astype(np.int64) if keys else np.zeros(0, dtype=np.int64)
    readers = owner[physical]
    if (readers > i).any():  # an ancestor in a later pass: the schedule's invariant broken
        raise AssertionError("a pass reads a later pass's keys")
    providers = tuple(int(p) for p in np.unique(readers[readers != i]))
    # Key buffer: each provider's own tokens in provider order, then this pass's.
    base: Dict[int, int] = {}
    at = 0
    for p in providers:
        base[p] = at
        at += groups[p][1].shape[0]
    context = at
    rank = np.empty(tree.num_tokens, dtype=np.int64)
    for p in providers + (i,):
        members = groups[p][1]
        rank[members] = np.arange(members.shape[0], dtype=np.int64) + (base[p] if p != i else context)
    k_index = rank[physical]
    lengths = [k.shape[0] for k in keys]
    cu_k = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return TreePass(tree, cap, i, role, own.astype(np.int64), providers, k_index, cu_q, cu_k, context,
                    PassCascade(cu_q, cu_k, k_index, prefix_key, context))
