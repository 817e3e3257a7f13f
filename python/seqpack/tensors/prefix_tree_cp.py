"""Context parallelism for a prefix tree: each CP rank holds one contiguous range
of the tree's physical tokens (its DFS layout), the ranges cut so that every rank
has about the same attention work - the visible (query, key) pairs, not the
tokens.

A token sees its ancestors and itself: ``position_ids + 1`` keys (a pad token, 1).
Deep tokens cost more than shallow ones, so an even cut by tokens leaves the rank
holding the responses (deep in the tree) with most of the work::

    rows          p p p p a a a   and   p p p p b b b      (a GRPO group of 2)
    physical      0  1  2  3  4  5  6  7  8  9
    position ids  0  1  2  3  4  5  6  4  5  6
    keys seen     1  2  3  4  5  6  7  5  6  7              work 46
    cp = 2, by tokens:  rank 0: 0 .. 4 (work 15)   rank 1: 5 .. 9 (work 31)
            by work:    rank 0: 0 .. 5 (work 21)   rank 1: 6 .. 9 (work 25)

A token goes to the rank whose equal share of the work holds the middle of its own.
:func:`tree_cp_bounds` gives the cut (``cp_size + 1`` offsets),
:func:`tree_cp_local_rows` a rank's rows of a full ``[T, ...]`` tensor and
:func:`gather_tree_cp` every rank's rows back as ``[T, ...]`` (an all-gather whose
backward is a reduce-scatter). A user cuts a tree with :func:`seqpack.shard_layout`
(its ``bounds``, ``local_rows`` and ``gather`` are these), and :func:`seqpack.attention`
on the cut runs each rank's queries against the gathered keys and values.

    >>> import seqpack
    >>> tree = seqpack.pack_prefix_tree([[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 8, 9, 10]])
    >>> seqpack.shard_layout(tree, 2, 0).bounds.tolist()   # tree_cp_bounds(tree, 2)
    [0, 6, 10]

Importing this module does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _core
from .._lengths import as_positive_int
from .layout_kinds import as_tree

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .prefix_tree import PrefixTreeBatch

__all__ = ["gather_tree_cp", "tree_cp_bounds", "tree_cp_local_rows", "tree_cp_work"]


_tree = as_tree


def tree_cp_work(tree: "PrefixTreeBatch") -> np.ndarray:
    """The keys each physical token's query sees (its ancestors and itself):
    ``position_ids + 1``, int64 ``[T]``; their sum is the tree's visible pairs."""
    return _tree(tree).position_ids.astype(np.int64) + 1


def tree_cp_bounds(tree: "PrefixTreeBatch", cp_size: Any) -> np.ndarray:
    """Offsets ``[cp_size + 1]`` (int64) of the ranks' contiguous ranges of physical
    tokens: rank ``r`` holds ``[bounds[r], bounds[r + 1])``. A token belongs to the
    rank whose equal share of the total work (:func:`tree_cp_work`) holds the middle
    of its own work, so no rank is more than one token's work from its share. A
    rank may hold no token: fewer tokens than ranks, or a token whose work spans a
    whole share (one row of 3 tokens over 3 ranks: ``[0, 2, 2, 3]``); the CP
    functions handle such a rank."""
    # The core's rule (forest_cp.hpp), the one the planner counts a rank's tokens with.
    return _core.cp_work_bounds(tree_cp_work(tree), as_positive_int(cp_size, "cp_size"))


def _rank_range(tree: "PrefixTreeBatch", cp_size: Any, cp_rank: Any):
    bounds = tree_cp_bounds(tree, cp_size)
    rank = as_positive_int(cp_rank, "cp_rank", allow_zero=True)
    if rank >= bounds.shape[0] - 1:
        raise ValueError(f"cp_rank must be below cp_size = {bounds.shape[0] - 1}, got {rank}")
    return bounds, int(bounds[rank]), int(bounds[rank + 1])


def tree_cp_local_rows(full: Any, tree: "PrefixTreeBatch", cp_size: Any, cp_rank: Any) -> Any:
    """Rank ``cp_rank``'s rows of a full ``[T, ...]`` tensor or array laid out by
    ``tree`` (a view: the rows are contiguous)."""
    _, start, end = _rank_range(tree, cp_size, cp_rank)
    shape = tuple(getattr(full, "shape", ()))
    if not shape or shape[0] != tree.num_tokens:
        raise ValueError(f"full must have one row per physical token of tree ({tree.num_tokens}), got shape "
                         f"{shape}")
    return full[start:end]


def gather_tree_cp(local: "torch.Tensor", tree: "PrefixTreeBatch", group: Any, *,
                   agree: bool = True) -> "torch.Tensor":
    """Every CP rank's rows of ``tree`` (rank ``r`` holds ``[bounds[r], bounds[r + 1])``
    of :func:`tree_cp_bounds`), all-gathered over ``group`` into ``[T, ...]``
    (one collective; ranks with fewer rows pad to the widest). Backward: one
    reduce-scatter, each rank keeping the gradient summed over the group for its
    own rows.

    ``agree`` (default): before the gather every rank checks ``tree`` and that
    ``local`` holds its own rows, then one all-reduce tells every rank whether any
    failed and compares the cut, ``local``'s trailing shape, dtype and whether it
    requires grad, so a rank with other inputs makes every rank raise instead of
    leaving the others waiting in the gather. ``False`` skips that collective when
    the caller has agreed on all of it already."""
    import torch.distributed as dist

    from .._dist import checked_on_every_rank, tensor_facts
    from .cp import gather_rank_rows

    size, me = dist.get_world_size(group), dist.get_rank(group)
    if size < 1 or me < 0:
        raise ValueError(f"this process is not in the CP group (size {size}, rank {me}); it cannot take part in "
                         "gather_tree_cp's all-gather over it")

    def local_checks() -> np.ndarray:
        from ._device import check_tensor

        check_tensor(local, "local")
        bounds, start, end = _rank_range(tree, size, me)
        if local.dim() < 1 or local.shape[0] != end - start:
            raise ValueError(f"local must hold this rank's {end - start} rows of the tree (rows [{start}, {end}) of "
                             f"tree_cp_bounds(tree, {size})), got shape {tuple(local.shape)}")
        return bounds

    def facts(bounds: np.ndarray):
        shared = tensor_facts(local)
        return {"the tree's CP cut (tree_cp_bounds)": bounds, "local's trailing shape": shared["shape"][0][1:],
                "local's dtype": shared["dtype"], "whether local requires grad (with grad mode on)":
                shared["requires_grad"]}

    bounds = checked_on_every_rank(local_checks, group, "gather_tree_cp", agree and size > 1, fingerprint=facts)
    return gather_rank_rows(local, np.diff(bounds), rank_major_order(bounds), group)


def rank_major_order(bounds: np.ndarray) -> np.ndarray:
    """For each physical token, its position in the all-gather's rank-major buffer
    (each rank's range padded to the widest)."""
    counts = np.diff(bounds)
    width = int(counts.max(initial=0))
    rank = np.repeat(np.arange(counts.shape[0], dtype=np.int64), counts)
    return rank * width + (np.arange(int(bounds[-1]), dtype=np.int64) - bounds[:-1][rank])
