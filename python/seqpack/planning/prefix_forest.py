"""The prefix forest of a batch: what any subset of its rows costs as a prefix tree,
without laying out tensors (the planners' view of :func:`~seqpack.pack_prefix_tree`).

A GRPO batch is a forest of tries: every prompt's responses hang from it. A planner
that prices rows by their own lengths cuts a group across micro-batches and pays its
prompt once per piece, and a cap counted in logical tokens overestimates memory by
the sharing. :class:`PrefixForest` builds the trie of the whole batch once (C++,
the sharing rule of :func:`~seqpack.pack_prefix_tree`: ``group_ids``,
``min_shared_tokens``) and answers, for any subset of rows, the physical tokens and
attention pairs of that subset's own prefix tree::

    rows              trie (node: token)         subset          physical  visible pairs
    r0 = 5 6 7        0:5 ─ 1:6 ─┬─ 2:7          {r0, r1, r2}    5         1+2+3+3+4 = 13
    r1 = 5 6 8 9                 └─ 3:8 ─ 4:9    {r1}            4         1+2+3+4 = 10
    r2 = 5 6                                     {r0, r2}        3         1+2+3 = 6
    r3 = 7  (group 1) 5:7                        {r2, r3}        3         1+2+1 = 4

    trees: [r0, r1, r2] and [r3] (rows that share at least their first token)

    >>> forest = PrefixForest.from_rows([[5, 6, 7], [5, 6, 8, 9], [5, 6], [7]], group_ids=[0, 0, 0, 1])
    >>> forest.physical_tokens([0, 1, 2]), forest.visible_pairs([0, 1, 2])
    (5, 13)
    >>> [t.tolist() for t in forest.trees]
    [[0, 1, 2], [3]]
    >>> forest.subset_costs([[1], [0, 2], [2, 3]])
    (array([4, 3, 3]), array([10,  6,  4]))

A subset's physical tokens are exactly ``pack_prefix_tree`` of those rows (same
options, no padding) ``.num_tokens``, its visible pairs that tree's
``metrics().tree_attention_pairs``.

The trie itself is not kept: the forest holds, per row, its place in the trie's
depth-first order and its common prefix with the row before it there (as for sorted
strings, a row adds ``length - lcp`` nodes to the rows before it, and two rows'
common prefix is the least adjacent one between them)::

    depth-first order   r2 = 5 6    r0 = 5 6 7    r1 = 5 6 8 9    r3 = 7
    adjacent_lcp        0           2             2               0 (another tree)

so a subset costs ``sum(length) - sum(lcp of consecutive rows)`` tokens and
``sum(P(length)) - sum(P(lcp))`` pairs (``P(x) = x (x + 1) / 2``): O(|S| log |S|)
per subset with a sparse table, whatever the tokens; memory is O(rows).
"""

from __future__ import annotations

from typing import Any, Iterable, List, Sequence, Tuple

import numpy as np

from .. import _core
from .._equality import ValueEquality
from .._lengths import as_positive_int, type_name
from ._token_rows import group_array, int_array, packed_rows, padded_rows, rows_flat

__all__ = ["ForestItems", "PrefixForest"]

_ARRAYS = ("row_length", "row_order", "adjacent_lcp", "tree_of_row")


class PrefixForest:
    """What the planners need of a batch's token trie (see the module docstring),
    kept per row: O(rows) memory whatever the tokens. Built by :meth:`from_rows`,
    :meth:`from_padded` or :meth:`from_packed`; holds read-only int64 NumPy arrays,
    compares by value, pickles and deep-copies through them (checked when rebuilt)."""

    __slots__ = ("_arrays", "_num_trees", "_num_nodes", "_trees", "_position", "_items")

    def __init__(self, *, row_length: Any, row_order: Any, adjacent_lcp: Any, tree_of_row: Any, num_trees: Any,
                 num_nodes: Any, work_items: Any = None) -> None:
        given = dict(row_length=row_length, row_order=row_order, adjacent_lcp=adjacent_lcp, tree_of_row=tree_of_row)
        arrays = {}
        for name in _ARRAYS:
            arr = np.array(int_array(given[name], name, 1), dtype=np.int64, copy=True)
            arr.flags.writeable = False
            arrays[name] = arr
        trees = as_positive_int(num_trees, "num_trees", allow_zero=True)
        items = _items_csr(work_items, arrays["row_length"].shape[0])
        _core.check_prefix_forest(*(arrays[k] for k in _ARRAYS), trees, items)
        nodes = as_positive_int(num_nodes, "num_nodes", allow_zero=True)
        self._arrays, self._num_trees, self._trees, self._position = arrays, trees, None, None
        self._items = items
        if nodes != int(self.subset_costs([np.arange(len(arrays["row_length"]))])[0][0]):
            raise ValueError(f"num_nodes = {nodes} is not the physical tokens of these rows")
        self._num_nodes = nodes

    # ---- constructors -------------------------------------------------------------
    @classmethod
    def from_rows(cls, rows: Any, *, group_ids: Any = None, min_shared_tokens: Any = 1, keys: Any = None,
                  work_items: Any = None) -> "PrefixForest":
        """The forest of ``rows`` (a list of 1-D token sequences: lists, NumPy arrays
        or tensors of integers), with :func:`~seqpack.pack_prefix_tree`'s sharing
        options (``keys``: rows of the same lengths the rows share by, as there; the
        forest keeps no token, so it reads only the keys). ``work_items``: see
        :attr:`work_items`."""
        if keys is None:
            return _build(*rows_flat(rows), group_ids, min_shared_tokens, work_items)
        flat_keys, key_cu = rows_flat(keys)
        _, cu = rows_flat(rows)
        if not np.array_equal(key_cu, cu):
            raise ValueError(f"keys must have the rows' lengths {np.diff(cu).tolist()}, got "
                             f"{np.diff(key_cu).tolist()}")
        return _build(flat_keys, cu, group_ids, min_shared_tokens, work_items)

    @classmethod
    def from_padded(cls, input_ids: Any, attention_mask: Any, *, group_ids: Any = None,
                    min_shared_tokens: Any = 1, keys: Any = None, work_items: Any = None) -> "PrefixForest":
        """The forest of padded rows (left or right padding, as
        :meth:`PrefixTreeBatch.from_padded <seqpack.PrefixTreeBatch.from_padded>`)."""
        return _build(*padded_rows(input_ids if keys is None else keys, attention_mask), group_ids,
                      min_shared_tokens, work_items)

    @classmethod
    def from_packed(cls, input_ids: Any, cu_seqlens: Any, *, group_ids: Any = None,
                    min_shared_tokens: Any = 1, keys: Any = None, work_items: Any = None) -> "PrefixForest":
        """The forest of rows packed back to back (``input_ids`` [N], ``cu_seqlens`` [R + 1])."""
        return _build(*packed_rows(input_ids if keys is None else keys, cu_seqlens), group_ids, min_shared_tokens,
                      work_items)

    # ---- the forest ---------------------------------------------------------------
    lengths = property(lambda self: self._arrays["row_length"], doc="Each row's logical length [R].")
    row_order = property(lambda self: self._arrays["row_order"],
                         doc="Row ids in depth-first order of the trie [R] (by tree, then trie position).")
    adjacent_lcp = property(lambda self: self._arrays["adjacent_lcp"],
                            doc="Common prefix of row_order[i] with row_order[i - 1] [R] (0 across trees).")
    tree_ids = property(lambda self: self._arrays["tree_of_row"],
                        doc="The tree of each row [R] (ids in order of each tree's first row).")

    @property
    def num_rows(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def num_trees(self) -> int:
        return self._num_trees

    @property
    def work_items(self) -> Any:
        """``(item_row, item_end, item_work)`` int64 arrays [I], or None: work attached
        to runs of the rows' tokens that a set of rows pays once when its tree holds
        those tokens once, like its tokens (a VLM's image: the vision tower's work,
        :func:`seqpack.frameworks.hf_vlm.vision_forest`). Item ``k`` belongs to row
        ``item_row[k]``, ends at its token ``item_end[k]`` and weighs
        ``item_work[k]`` in the cost model's pair units (what ``per_token_squared``
        multiplies: a plain row of ``s`` tokens weighs ``s**2``). A set of rows
        holds an item when one of its rows does; the rows that share the item's
        tokens share the item, so each of them must list it (as ``vision_forest``
        does: the forest counts the one of the first such row in depth-first order).
        Plans count it with an attention-aware cost
        (``attention_coeff``, a cost model with ``per_token_squared``); a token cap
        does not see it.

        >>> f = PrefixForest.from_rows([[7, 9, 9, 1], [7, 9, 9, 2], [7, 8, 8, 3]],
        ...                             work_items=([0, 1, 2], [3, 3, 3], [50, 50, 40]))
        >>> f.subset_work([[0, 1], [0, 2], [1]]).tolist()   # rows 0 and 1 share "7 9 9": one image
        [50, 90, 50]
        """
        if self._items is None:
            return None
        offsets, end, work = self._items
        return (np.repeat(np.arange(self.num_rows, dtype=np.int64), np.diff(offsets)), end, work)

    @property
    def num_physical_tokens(self) -> int:
        """The trie's nodes: the physical tokens of the whole batch as one tree."""
        return self._num_nodes

    @property
    def num_logical_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def trees(self) -> List[np.ndarray]:
        """The row ids of each tree (ascending), trees in order of their first row."""
        if self._trees is None:
            order = np.argsort(self.tree_ids, kind="stable")
            counts = np.bincount(self.tree_ids, minlength=self._num_trees)
            self._trees = [a for a in np.split(order.astype(np.int64), np.cumsum(counts)[:-1])] if self.num_rows else []
            for a in self._trees:
                a.flags.writeable = False
        return list(self._trees)

    @property
    def row_position(self) -> np.ndarray:
        """Each row's place in :attr:`row_order` [R] (its inverse; read-only, built once)."""
        if self._position is None:
            position = np.empty(self.num_rows, dtype=np.int64)
            position[self.row_order] = np.arange(self.num_rows, dtype=np.int64)
            position.flags.writeable = False
            self._position = position
        return self._position

    def depth_first(self, row_indices: Any) -> np.ndarray:
        """``row_indices`` (row ids) in the forest's depth-first order: packed in this
        order, :func:`~seqpack.pack_prefix_tree` lays out the physical tokens as the
        planners count them (the order also decides where :func:`seqpack.shard_layout`
        cuts a tree).

        >>> PrefixForest.from_rows([[5, 6, 7], [5, 6, 8, 9], [5, 6]]).depth_first([0, 1, 2]).tolist()
        [2, 0, 1]
        """
        rows = self._row_ids(row_indices, "row_indices")
        return rows[np.argsort(self.row_position[rows], kind="stable")]

    # ---- costs --------------------------------------------------------------------
    def subforest(self, row_indices: Any) -> "PrefixForest":
        """The forest of ``row_indices`` alone, its row ``i`` the ``i``-th of them in
        ascending order (one mini-batch of a step): the same trie restricted to them,
        no token needed.

        >>> f = PrefixForest.from_rows([[5, 6, 7], [9], [5, 6, 8]])
        >>> sub = f.subforest([0, 2])
        >>> sub.num_physical_tokens, sub.lengths.tolist(), sub.num_trees
        (4, [3, 3], 1)
        """
        rows = np.unique(self._row_ids(row_indices, "row_indices"))
        pos = self.row_position[rows]
        order = np.argsort(pos, kind="stable")  # the chosen rows' local ids in depth-first order
        at = pos[order]
        lcp = np.zeros(rows.shape[0], dtype=np.int64)
        for i in range(1, rows.shape[0]):  # two rows' common prefix: the least adjacent one between them
            lcp[i] = int(self.adjacent_lcp[at[i - 1] + 1:at[i] + 1].min())
        _, first, tree = np.unique(self.tree_ids[rows], return_index=True, return_inverse=True)
        renumber = np.empty(first.shape[0], dtype=np.int64)
        renumber[np.argsort(first, kind="stable")] = np.arange(first.shape[0], dtype=np.int64)
        items = None
        if self._items is not None:  # the chosen rows' items, renumbered
            item_row, item_end, item_work = self.work_items
            local = np.full(self.num_rows, -1, dtype=np.int64)
            local[rows] = np.arange(rows.shape[0], dtype=np.int64)
            keep = local[item_row] >= 0
            items = (local[item_row[keep]], item_end[keep], item_work[keep])
        return PrefixForest(row_length=self.lengths[rows], row_order=order, adjacent_lcp=lcp,
                            tree_of_row=renumber[tree.reshape(-1)], num_trees=first.shape[0],
                            num_nodes=self.physical_tokens(rows), work_items=items)

    def subset_costs(self, subsets: Iterable[Any]) -> Tuple[np.ndarray, np.ndarray]:
        """(physical tokens [K], visible pairs [K]) of each subset of rows (row ids;
        a repeated id counts once), in one C++ call with the GIL released."""
        parts = [self._row_ids(s, f"subsets[{k}]") for k, s in enumerate(_subset_list(subsets))]
        offsets = np.zeros(len(parts) + 1, dtype=np.int64)
        np.cumsum([p.shape[0] for p in parts], out=offsets[1:])
        rows = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        tokens, pairs, _ = _core.forest_subset_costs(*self._core_args(), rows, offsets)
        return tokens, pairs

    def subset_work(self, subsets: Iterable[Any]) -> np.ndarray:
        """The work items ([K] int64, :attr:`work_items`) each subset of rows holds,
        each once; zeros without work items."""
        parts = [self._row_ids(s, f"subsets[{k}]") for k, s in enumerate(_subset_list(subsets))]
        offsets = np.zeros(len(parts) + 1, dtype=np.int64)
        np.cumsum([p.shape[0] for p in parts], out=offsets[1:])
        rows = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return _core.forest_subset_costs(*self._core_args(), rows, offsets, items=self._items)[2]

    def physical_tokens(self, row_indices: Any) -> int:
        """Physical tokens of the prefix tree of these rows (their distinct prefixes)."""
        return int(self.subset_costs([row_indices])[0][0])

    def visible_pairs(self, row_indices: Any) -> int:
        """Attention pairs of the prefix tree of these rows: each token with its
        ancestors and itself."""
        return int(self.subset_costs([row_indices])[1][0])

    def items(self, max_tokens: Any, min_items: Any = 0, row_indices: Any = None) -> "ForestItems":
        """What a planner places under a cap of ``max_tokens`` physical tokens per
        micro-batch: each tree that fits as one item; a larger tree split into parts
        of consecutive rows (in depth-first order), each carrying its prefix, choosing
        the split that duplicates the fewest tokens (then the fewest parts).

        ::

            rows (depth-first)  new tokens     max_tokens = 6: [a b] (5) and [c d] (5),
            a = 1 2 3 4         4              "1 2" in both: 2 tokens duplicated
            b = 1 2 3 5         1
            c = 1 2 6           1
            d = 1 2 7 8         2

        >>> forest = PrefixForest.from_rows([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6], [1, 2, 7, 8]])
        >>> items = forest.items(6)
        >>> [r.tolist() for r in items.rows], items.tokens.tolist(), items.duplicated_tokens
        ([[0, 1], [2, 3]], [5, 5], 2)

        ``min_items``: when the trees give fewer items than this (a planner asked for
        more micro-batches than there are trees), the largest items of several rows
        are halved (in depth-first order, each half carrying its prefix) until there
        are enough or every item is one row. ``row_indices``: the items of just these
        rows (distinct ids; a mini-batch), the trees being what of them these rows
        reach. O(rows log rows), in C++.

        Raises ValueError when one row alone is longer than ``max_tokens``.
        """
        cap = as_positive_int(max_tokens, "max_tokens")
        wanted = as_positive_int(min_items, "min_items", allow_zero=True)
        subset = None if row_indices is None else self._row_ids(row_indices, "row_indices")
        d = _core.forest_items(*self._core_args(), cap, subset, wanted, items=self._items)
        physical = self.num_physical_tokens if subset is None else self.physical_tokens(subset)
        rows = [np.asarray(r, dtype=np.int64) for r in d["rows"]]
        tokens, pairs, tree = d["tokens"], d["pairs"], d["tree"]
        return ForestItems(rows=rows, tokens=tokens, pairs=pairs, tree=tree,
                           duplicated_tokens=int(tokens.sum()) - physical, physical_tokens=physical,
                           work=d["work"])

    def _core_args(self) -> tuple:
        return (*(self._arrays[k] for k in _ARRAYS), self._num_trees)

    def _core_items(self) -> Any:
        """The work items as the core takes them (CSR per row), or None."""
        return self._items

    def _core_forest(self) -> tuple:
        """The forest as one tuple (plan_step, dynamic batching)."""
        return (*self._core_args(), self._items)

    def _row_ids(self, value: Any, name: str) -> np.ndarray:
        ids = int_array(value, name, 1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_rows):
            bad = int(ids[(ids < 0) | (ids >= self.num_rows)][0])
            raise ValueError(f"{name} holds row id {bad}; the forest has {self.num_rows} rows (ids in "
                             f"[0, {self.num_rows}))")
        return ids

    # ---- value semantics -----------------------------------------------------------
    def __eq__(self, other: object) -> Any:
        if not isinstance(other, PrefixForest):
            return NotImplemented
        return (self._num_trees, self._num_nodes) == (other._num_trees, other._num_nodes) and all(
            np.array_equal(self._arrays[k], other._arrays[k]) for k in _ARRAYS) and _items_equal(
            self._items, other._items)

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self):
        return (_rebuild, ({k: np.array(v) for k, v in self._arrays.items()}, self._num_trees, self._num_nodes,
                           None if self._items is None else tuple(np.array(a) for a in self.work_items)))

    def __repr__(self) -> str:
        return (f"PrefixForest(num_rows={self.num_rows}, num_trees={self.num_trees}, "
                f"num_logical_tokens={self.num_logical_tokens}, num_physical_tokens={self.num_physical_tokens})")


class ForestItems(ValueEquality):
    """The items of :meth:`PrefixForest.items`: ``rows`` (the row ids of each item,
    depth-first), ``tokens`` / ``pairs`` (each item's physical tokens and visible
    attention pairs, int64 arrays), ``tree`` (the tree each item is, or is part
    of), ``duplicated_tokens`` (what the splits repeat); ``sharing_kept`` is the
    forest's physical tokens over the items' sum (1.0 when no tree was split)."""

    def __init__(self, *, rows: List[np.ndarray], tokens: np.ndarray, pairs: np.ndarray, tree: np.ndarray,
                 duplicated_tokens: int, physical_tokens: int, work: Any = None) -> None:
        self.rows, self.tokens, self.pairs, self.tree = rows, tokens, pairs, tree
        self.duplicated_tokens, self.physical_tokens = duplicated_tokens, physical_tokens
        self.work = np.zeros(len(rows), dtype=np.int64) if work is None else work

    @property
    def num_items(self) -> int:
        return len(self.rows)

    @property
    def sharing_kept(self) -> float:
        total = int(self.tokens.sum())
        return 1.0 if total == 0 else self.physical_tokens / total

    def __repr__(self) -> str:
        return (f"ForestItems(num_items={self.num_items}, tokens={int(self.tokens.sum())}, "
                f"duplicated_tokens={self.duplicated_tokens})")


def _build(tokens: np.ndarray, cu: np.ndarray, group_ids: Any, min_shared_tokens: Any,
           work_items: Any = None) -> PrefixForest:
    min_shared = as_positive_int(min_shared_tokens, "min_shared_tokens", allow_zero=True)
    arrays = _core.build_prefix_forest(tokens, cu, group_array(group_ids, cu.shape[0] - 1), min_shared)
    return PrefixForest(**arrays, work_items=work_items)


def _items_csr(work_items: Any, rows: int) -> Any:
    """``(item_row, item_end, item_work)`` as the core's read-only CSR
    ``(item_offsets [R + 1], item_end, item_work)``, items sorted by row then end; None
    for none."""
    if work_items is None:
        return None
    if not isinstance(work_items, (tuple, list)) or len(work_items) != 3:
        raise TypeError(f"work_items must be (item_row, item_end, item_work), got {type_name(work_items)}")
    row, end, work = (int_array(a, name, 1) for a, name in zip(work_items, ("item_row", "item_end", "item_work")))
    if not row.shape == end.shape == work.shape:
        raise ValueError(f"work_items: item_row, item_end and item_work must have one length, got {row.shape[0]}, "
                         f"{end.shape[0]} and {work.shape[0]}")
    if row.size and (row.min() < 0 or row.max() >= rows):
        raise ValueError(f"work_items: item_row must hold row ids in [0, {rows}), got {int(row.min())}..."
                         f"{int(row.max())}")
    order = np.lexsort((end, row))
    offsets = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(row, minlength=rows), out=offsets[1:])
    out = (offsets, np.ascontiguousarray(end[order]), np.ascontiguousarray(work[order]))
    for a in out:
        a.flags.writeable = False
    return out


def refuse_work_items_in_passes(forest: Any) -> None:
    """Prefix reuse runs trees in passes, which carry no work items (a pass holds part
    of a prompt's image tokens and reads the rest's K/V: it has no image to encode)."""
    if forest is not None and forest.work_items is not None:
        raise ValueError("prefix_reuse=True: the forest has work items (a VLM's images), which passes of a tree "
                         "split under the cap do not carry: plan a VLM's batch without prefix reuse")


def _items_equal(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    return all(np.array_equal(x, y) for x, y in zip(a, b))


def _subset_list(subsets: Any) -> Sequence[Any]:
    if isinstance(subsets, (str, bytes, dict)) or not isinstance(subsets, Iterable):
        raise TypeError(f"subsets must be a list of row-id lists, got {type_name(subsets)}")
    return list(subsets)


def _rebuild(arrays: dict, num_trees: int, num_nodes: int, work_items: Any = None) -> PrefixForest:
    return PrefixForest(**arrays, num_trees=num_trees, num_nodes=num_nodes, work_items=work_items)

