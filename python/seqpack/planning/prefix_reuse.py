"""Planning a step whose prefix trees run in passes under a cap, each shared prefix
computed once (issue 52): which physical tokens go in which pass, and which ranks
hold which trees.

One rule cuts a tree (:func:`split_tree`, on its parent / subtree arrays), and the
tensors layer's :func:`seqpack.split_prefix_tree` and this planner both use it, so
the passes a rank builds are the ones planned::

    provider passes   the tokens whose subtree exceeds the cap (the shared
                      prefixes), depth-first, in chunks of the cap
    branch passes     the largest subtrees that fit, first fit in depth-first order

:func:`plan_prefix_reuse` plans a step from a :class:`~seqpack.PrefixForest`: whole
trees to ranks (heaviest first to the least loaded rank, by the cost model's work:
each tree's tokens once, its visible attention pairs, its fewest passes), each
rank's passes by that rule on the trie of its rows (rebuilt from the forest's
depth-first order and shared prefixes, no token needed), and the micro-batch count
equal on every rank (a rank with fewer passes runs empty micro-batches).

    >>> import seqpack
    >>> rows = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8], [9, 9, 9, 9, 5, 6], [9, 9, 9, 9, 7, 8]]
    >>> plan = plan_prefix_reuse(seqpack.PrefixForest.from_rows(rows), max_tokens=4, dp_size=2)
    >>> plan.rank_rows, plan.pass_tokens, plan.num_micro_batches
    ([[0, 1], [2, 3]], [[4, 4], [4, 4]], 2)

Importing this module does not import torch.
"""

from __future__ import annotations

from typing import Any, List, Tuple

import numpy as np

from .. import _core
from .._lengths import as_positive_int, type_name

__all__ = ["PrefixReusePlan", "pass_pairs", "pass_providers", "plan_prefix_reuse", "run_order", "split_tree"]


def split_tree(parent: np.ndarray, subtree_end: np.ndarray, cap: int) -> List[Tuple[str, np.ndarray]]:
    """``(role, own tokens)`` of each pass of the tree whose depth-first arrays are
    ``parent`` / ``subtree_end`` (``[T]`` int64), under ``cap`` own tokens a pass:
    ``"provider"`` passes first (the tokens whose subtree holds more than ``cap``,
    depth-first, in chunks of ``cap``), then ``"branch"`` passes (the largest
    subtrees that fit, first fit in depth-first order: siblings together, so a pass
    reads few prefixes and a prefix's readers come one after the other).

    >>> [(role, own.tolist()) for role, own in split_tree(np.array([-1, 0, 1, 1]), np.array([4, 4, 3, 4]), 2)]
    [('provider', [0, 1]), ('branch', [2, 3])]
    """
    t = parent.shape[0]
    size = subtree_end - np.arange(t, dtype=np.int64)
    skeleton = size > cap
    roots = np.flatnonzero(~skeleton & ((parent < 0) | skeleton[np.maximum(parent, 0)]))
    chain = np.flatnonzero(skeleton)
    groups: List[Tuple[str, np.ndarray]] = [("provider", chain[s:s + cap]) for s in range(0, chain.shape[0], cap)]
    for members in _first_fit(size[roots], cap):
        parts = [np.arange(roots[m], subtree_end[roots[m]], dtype=np.int64) for m in members]
        groups.append(("branch", np.concatenate(parts)))
    return groups


def _first_fit(sizes: np.ndarray, cap: int) -> List[List[int]]:
    """First fit in the given order: each item into the first bin with room."""
    bins: List[List[int]] = []
    room = np.zeros(0, dtype=np.int64)
    for item, n in enumerate(sizes.tolist()):
        fits = np.flatnonzero(room >= n)
        if fits.shape[0]:
            bins[int(fits[0])].append(item)
            room[fits[0]] -= n
        else:
            bins.append([item])
            room = np.append(room, cap - n)
    return bins


def pass_pairs(parent: np.ndarray, position: np.ndarray, groups: List[Tuple[str, np.ndarray]]
               ) -> Tuple[np.ndarray, np.ndarray]:
    """``(visible pairs, context pairs)`` ``[passes]`` of :func:`split_tree`'s passes:
    each own token attends to its depth + 1 keys; the context pairs are those whose
    key is an earlier pass's token (the K/V the pass reads). Vectorised: each token's
    topmost ancestor in its own pass by pointer jumping."""
    t = parent.shape[0]
    owner = _owner(groups, t)  # tokens of no listed pass: -1
    up = np.where((parent >= 0) & (owner[np.maximum(parent, 0)] == owner), parent, np.arange(t, dtype=np.int64))
    while True:  # up[x]: an ancestor of x in x's pass; jump until it is the topmost one
        nxt = up[up]
        if np.array_equal(nxt, up):
            break
        up = nxt
    listed = owner >= 0
    visible = np.bincount(owner[listed], weights=(position + 1)[listed], minlength=len(groups)).astype(np.int64)
    context = np.bincount(owner[listed], weights=position[up][listed], minlength=len(groups)).astype(np.int64)
    return visible, context


def _owner(groups: List[Tuple[str, np.ndarray]], tokens: int) -> np.ndarray:
    """Each token's pass (``-1``: in none)."""
    owner = np.full(tokens, -1, dtype=np.int64)
    for i, (_, own) in enumerate(groups):
        owner[own] = i
    return owner


def pass_providers(parent: np.ndarray, groups: List[Tuple[str, np.ndarray]]) -> List[Tuple[int, ...]]:
    """The earlier passes each of :func:`split_tree`'s passes reads (those holding an
    ancestor of one of its tokens), ascending.

    >>> pass_providers(np.array([-1, 0, 1, 1]), [("provider", np.array([0, 1])), ("branch", np.array([2, 3]))])
    [(), (0,)]
    """
    owner = _owner(groups, parent.shape[0])
    has_parent = parent >= 0
    out: List[Tuple[int, ...]] = []
    for i, (_, own) in enumerate(groups):  # a provider precedes its readers: theirs are known
        above = parent[own[has_parent[own]]]
        direct = {int(q) for q in np.unique(owner[above]) if q != i}
        out.append(tuple(sorted(direct.union(*(out[q] for q in direct)))))
    return out


def run_order(roles: List[str], providers: List[Tuple[int, ...]]) -> List[Tuple[str, int]]:
    """What a step's loop runs: the branch passes in order, each provider's close
    right after the last pass that reads it (a branch, or a later provider's close;
    the deepest first), so a prefix's K/V and graph are held only while its readers run.

    >>> run_order(["provider", "branch", "branch"], [(), (0,), (0,)])
    [('branch', 1), ('branch', 2), ('close', 0)]
    """
    readers: List[set] = [set() for _ in roles]
    for i, read in enumerate(providers):
        for q in read:
            readers[q].add(i)
    done: set = set()
    order: List[Tuple[str, int]] = []
    open_providers = [i for i in reversed(range(len(roles))) if roles[i] == "provider"]

    def close_ready() -> None:
        progress = True
        while progress:
            progress = False
            for q in list(open_providers):  # the deepest first: a chunk's close before the chunks it read
                if readers[q] <= done:
                    order.append(("close", q))
                    done.add(q)
                    open_providers.remove(q)
                    progress = True

    for i, role in enumerate(roles):
        if role == "branch":
            order.append(("branch", i))
            done.add(i)
            close_ready()
    close_ready()
    return order


class PrefixReusePlan:
    """A step planned for prefix reuse (:func:`plan_prefix_reuse`).

    Attributes:
        max_tokens: the cap on a pass's own tokens.
        rank_rows: each rank's rows (whole trees), in the forest's depth-first order:
            build the rank's tree from them in this order
            (``seqpack.pack_prefix_tree([rows[r] for r in plan.rank_rows[rank]])``)
            and :func:`seqpack.split_prefix_tree` gives the planned passes.
        pass_order: each rank's micro-batches in the order its step runs them
            (:attr:`PrefixPasses.order <seqpack.PrefixPasses.order>`): ``("branch",
            i)`` or ``("close", i)`` of pass ``i`` (providers numbered first). The
            lists below follow this order.
        pass_tokens: each rank's passes' own tokens.
        pass_roles: each rank's passes' roles, ``"provider"`` (its close) or
            ``"branch"``.
        pass_rows: each rank's passes' rows: those with a token in the pass (a row
            whose prefix a provider holds is in that provider and in its branch).
        num_micro_batches: the micro-batches every rank runs (its passes, then empty
            ones up to the busiest rank's count, ``min_micro_batches`` and a multiple
            of ``multiple_of``).
        pass_pairs: each pass's visible attention pairs (its tokens' depth + 1 each).
        context_pairs: of those, the pairs whose key an earlier pass computed (the
            K/V it reads).
        pass_costs: each pass's predicted time under the cost model,
            ``per_micro_batch + per_token * tokens + per_token_squared * (2 * pairs -
            tokens)`` (a row of ``s`` tokens costs ``s**2``, as for rows).
        physical_tokens: each rank's physical tokens (every token once).
        predicted: each rank's predicted step time: its passes' costs and its empty
            micro-batches (``per_micro_batch`` each).
        bound: the fewest micro-batches any plan could have,
            ``ceil(forest's physical tokens / (dp_size * max_tokens))``.
    """

    def __init__(self, max_tokens: int, rank_rows: List[List[int]], pass_order: List[List[Tuple[str, int]]],
                 pass_tokens: List[List[int]],
                 pass_roles: List[List[str]], pass_rows: List[List[List[int]]], pass_pairs: List[List[int]],
                 context_pairs: List[List[int]], pass_costs: List[List[float]], physical_tokens: List[int],
                 num_micro_batches: int, per_micro_batch: float, bound: int) -> None:
        self.max_tokens, self.rank_rows, self.pass_tokens = max_tokens, rank_rows, pass_tokens
        self.pass_order = pass_order
        self.pass_roles, self.pass_rows = pass_roles, pass_rows
        self.pass_pairs, self.context_pairs, self.pass_costs = pass_pairs, context_pairs, pass_costs
        self.physical_tokens, self.num_micro_batches, self.bound = physical_tokens, num_micro_batches, bound
        self.predicted = [sum(c) + per_micro_batch * (num_micro_batches - len(c)) for c in pass_costs]

    @property
    def dp_size(self) -> int:
        return len(self.rank_rows)

    def __eq__(self, other: object) -> Any:
        if not isinstance(other, PrefixReusePlan):
            return NotImplemented
        return vars(self) == vars(other)

    __hash__ = None  # type: ignore[assignment]

    @property
    def step_time(self) -> float:
        """The predicted step: the slowest rank's :attr:`predicted`."""
        return max(self.predicted, default=0.0)

    def __repr__(self) -> str:
        return (f"PrefixReusePlan(dp_size={self.dp_size}, max_tokens={self.max_tokens}, "
                f"num_micro_batches={self.num_micro_batches}, bound={self.bound}, "
                f"physical_tokens={sum(self.physical_tokens)})")


def plan_prefix_reuse(forest: Any, max_tokens: Any, dp_size: Any = 1, cost: Any = None, *,
                      row_indices: Any = None, min_micro_batches: Any = 1, multiple_of: Any = 1) -> PrefixReusePlan:
    """Whole trees of ``forest`` to ``dp_size`` ranks and each rank's passes under
    ``max_tokens`` (see the module docstring). A tree or a row longer than the cap is
    planned (its prefix in chunks), never refused.

    Args:
        forest: the batch's :class:`~seqpack.PrefixForest`.
        max_tokens: the cap on a pass's own physical tokens.
        dp_size: data-parallel ranks.
        cost: the :class:`~seqpack.CostModel` of ``pass_costs`` (default
            :meth:`CostModel.default() <seqpack.CostModel.default>`).
        row_indices: plan these rows only (one mini-batch; default all): their trees
            are the forest's trees restricted to them.
        min_micro_batches, multiple_of: at least this many micro-batches per rank, a
            multiple of ``multiple_of`` (pipeline parallelism); the extra ones empty.
    """
    from .cost import CostModel
    from .prefix_forest import PrefixForest

    if not isinstance(forest, PrefixForest):
        raise TypeError(f"forest must be a seqpack.PrefixForest, got {type_name(forest)}")
    cap = as_positive_int(max_tokens, "max_tokens")
    ranks = as_positive_int(dp_size, "dp_size")
    least = as_positive_int(min_micro_batches, "min_micro_batches")
    multiple = as_positive_int(multiple_of, "multiple_of")
    if cost is None:
        cost = CostModel.default()
    elif not isinstance(cost, CostModel):
        raise TypeError(f"cost must be a seqpack.CostModel, got {type_name(cost)}")
    chosen = np.arange(forest.num_rows, dtype=np.int64) if row_indices is None else \
        np.unique(forest._row_ids(row_indices, "row_indices"))
    tree_ids = forest.tree_ids[chosen]
    trees = [chosen[tree_ids == t] for t in np.unique(tree_ids)]  # each tree's chosen rows
    tokens, pairs = (np.asarray(a, dtype=np.int64) for a in forest.subset_costs(trees)) if trees else \
        (np.zeros(0, dtype=np.int64),) * 2
    # each tree's work under the cost model (its tokens once, its visible pairs), and the
    # fixed cost of the passes it needs at least; heaviest first, to the least loaded rank
    weight = cost.per_token * tokens + cost.per_token_squared * (2 * pairs - tokens) + \
        cost.per_micro_batch * -(-tokens // cap)
    load, held = np.zeros(ranks, dtype=np.float64), np.zeros(ranks, dtype=np.int64)
    owned: List[List[int]] = [[] for _ in range(ranks)]
    for t in sorted(range(len(trees)), key=lambda t: (-float(weight[t]), t)):
        r = int(np.argmin(load))
        owned[r].append(t)
        load[r] += weight[t]
        held[r] += tokens[t]
    position = forest.row_position
    out: dict = {k: [] for k in ("rows", "order", "tokens", "roles", "members", "pairs", "context", "costs")}
    for r in range(ranks):
        rows = sorted((int(x) for t in owned[r] for x in trees[t]), key=lambda x: int(position[x]))
        parent, subtree_end, depth, logical = _shape(forest, rows)
        groups = split_tree(parent, subtree_end, cap)
        order = run_order([role for role, _ in groups], pass_providers(parent, groups))
        at = [i for _, i in order]  # the step's run order
        visible, reads = pass_pairs(parent, depth, groups)
        n = np.array([own.shape[0] for _, own in groups], dtype=np.int64)
        costs = cost.per_micro_batch + cost.per_token * n + cost.per_token_squared * (2 * visible - n)
        members = _pass_rows(groups, logical, rows)
        out["rows"].append(rows)
        out["order"].append(order)
        out["tokens"].append(n[at].tolist())
        out["roles"].append([groups[i][0] for i in at])
        out["members"].append([members[i] for i in at])
        out["pairs"].append(visible[at].tolist())
        out["context"].append(reads[at].tolist())
        out["costs"].append([float(c) for c in costs[at]])
    count = max(least, max((len(p) for p in out["tokens"]), default=0))
    count = -(-count // multiple) * multiple
    bound = -(-forest.physical_tokens(chosen) // (ranks * cap)) if chosen.shape[0] else 0
    return PrefixReusePlan(cap, out["rows"], out["order"], out["tokens"], out["roles"], out["members"], out["pairs"],
                           out["context"], out["costs"], [int(x) for x in held], count, cost.per_micro_batch,
                           int(bound))


def _pass_rows(groups: List[Tuple[str, np.ndarray]], logical: Tuple[np.ndarray, np.ndarray], rows: List[int]
               ) -> List[List[int]]:
    """The rows with a token in each pass (row ids, ascending)."""
    physical, row = logical
    owner = _owner(groups, physical.shape[0] and int(physical.max()) + 1)
    ids = np.asarray(rows, dtype=np.int64)
    pairs = np.unique(owner[physical] * max(len(rows), 1) + row)  # (pass, row) once each
    members: List[List[int]] = [[] for _ in groups]
    for p, r in zip((pairs // max(len(rows), 1)).tolist(), (pairs % max(len(rows), 1)).tolist()):
        members[p].append(int(ids[r]))
    return [sorted(m) for m in members]


def _shape(forest: Any, rows: List[int]) -> Tuple[np.ndarray, np.ndarray, np.ndarray, Tuple[np.ndarray, np.ndarray]]:
    """The trie of ``rows`` (whole trees, in depth-first order) from the forest's
    shared prefixes alone: each row is the row before it up to their common prefix
    (the least adjacent one between them), then fresh tokens (the same trie, children
    in the same order), built in C++. Returns its parent, subtree end and depth
    arrays and, per logical token, its physical token and its row (of ``rows``)."""
    if not rows:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty, (empty, empty)
    lengths, lcp, position = forest.lengths, forest.adjacent_lcp, forest.row_position
    out, fresh, previous, last_pos = [], 1, np.zeros(0, dtype=np.int64), -1
    for r in rows:
        n, pos = int(lengths[r]), int(position[r])
        shared = int(lcp[last_pos + 1:pos + 1].min()) if last_pos >= 0 else 0  # 0 across trees
        row = np.concatenate([previous[:shared], np.arange(fresh, fresh + n - shared, dtype=np.int64)])
        fresh += n - shared
        out.append(row)
        previous, last_pos = row, pos
    flat = np.concatenate(out)
    cu = np.concatenate([[0], np.cumsum([len(x) for x in out])]).astype(np.int64)
    arrays = _core.build_prefix_tree(flat, cu, None, 1, 1, 0)
    logical_row = np.repeat(np.arange(len(rows), dtype=np.int64), np.diff(cu))
    return arrays["parent"], arrays["subtree_end"], arrays["position_ids"], (arrays["logical_index"], logical_row)
