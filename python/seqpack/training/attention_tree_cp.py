"""Context-parallel attention over a prefix tree (issue 29).

Each CP rank holds a contiguous range of the tree's physical tokens, cut by
:func:`~seqpack.tensors.prefix_tree_cp.tree_cp_bounds` so that the ranks' attention
work (visible pairs) is even. K and V are all-gathered over the CP group; each
local query attends to its ancestors and itself, as in
:func:`~seqpack.training.attention_tree.tree_attention`'s varlen backend: every tree segment the rank's
range meets is one sequence of :func:`~seqpack.varlen_attention`, its queries
the rank's rows of the segment and its keys the segment's path from the root up
to the last of those rows, causal with the diagonal aligned bottom-right::

    tree (segments)   [0 1 2 3] ── [4 5 6]          rank 0 holds 0 .. 5, rank 1 holds 6 .. 9
                               └── [7 8 9]
    rank 0   queries 0 1 2 3 -> keys 0 1 2 3;        queries 4 5 -> keys 0 1 2 3 4 5
    rank 1   queries 6 -> keys 0 1 2 3 4 5 6;        queries 7 8 9 -> keys 0 1 2 3 7 8 9

dK and dV are reduce-scattered back by the gather's backward.

A user runs it as :func:`seqpack.attention` on the tree's cut for this rank::

    >>> layout = seqpack.shard_layout(tree, cp_size, cp_rank)             # doctest: +SKIP
    >>> out = seqpack.attention(q, k, v, layout, group=cp_group)          # doctest: +SKIP

Ulysses over a tree is :func:`seqpack.attention` on a ``scheme="ulysses"`` cut of
the tree: each rank then attends over the whole tree for its heads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional

import numpy as np

from .._lengths import as_positive_int
from ..tensors.tree_plans import cp_attention_plan
from . import attention_inputs as inputs
from .attention_gathered import attend_gathered
from .varlen_backends import pick_backend

if TYPE_CHECKING:
    import torch

    from ..tensors.prefix_tree import PrefixTreeBatch

__all__ = ["tree_cp_attention"]


def _checks(q, k, v, tree, size: int, me: int, softmax_scale, kv_heads_per_chunk, backend: str) -> Dict[str, Any]:
    """Every check of :func:`tree_cp_attention` whose outcome can differ between
    ranks, run before its first collective and inside the agreement."""
    from ..tensors.prefix_tree_cp import _tree

    _tree(tree)
    inputs.check_qkv(q, k, v, (-1, 0), True)
    cp_plan = cp_attention_plan(tree, size, me)
    bounds, plan = cp_plan.bounds, cp_plan.plan
    start, end = int(bounds[me]), int(bounds[me + 1])
    if q.shape[0] != end - start or k.shape[0] != end - start:
        raise ValueError(f"q and k must hold this rank's {end - start} rows of the tree (rows [{start}, {end}) of "
                         f"tree_cp_bounds(tree, {size})), got {q.shape[0]} and {k.shape[0]}")
    hk = k.shape[1]
    step = hk if kv_heads_per_chunk is None else as_positive_int(kv_heads_per_chunk, "kv_heads_per_chunk")
    scale = inputs.softmax_scale(softmax_scale, q)
    pick_backend(backend, q, (-1, 0), True)  # an unknown / unusable backend: before the gathers
    return dict(bounds=bounds, plan=plan, step=min(step, hk), scale=scale,
                segments=(tree.segment_offsets, tree.segment_parent))


def _fingerprint(checked: Dict[str, Any], q, k, v) -> Dict[str, Any]:
    """What every rank must share: the tree's segments and CP cut (the gathers'
    sizes and each rank's keys), q's, k's and v's trailing shapes and dtypes, which
    of them take part in a backward, the autocast state and the heads per gather."""
    from .._dist import autocast_state, tensor_facts

    facts = tensor_facts(q, k, v)
    return {"the tree's segments (segment_offsets, segment_parent)": list(checked["segments"]),
            "the tree's CP cut (tree_cp_bounds)": checked["bounds"],
            "the head and feature shapes of q, k and v": [s[1:] for s in facts["shape"]],
            "the dtypes of q, k and v": facts["dtype"],
            "which of q, k and v require grad (with grad mode on)": facts["requires_grad"],
            "the autocast state": autocast_state(q.device.type), "kv_heads_per_chunk": checked["step"]}


def tree_cp_attention(
    q: "torch.Tensor",
    k: "torch.Tensor",
    v: "torch.Tensor",
    tree: "PrefixTreeBatch",
    group: Any = None,
    *,
    softmax_scale: Optional[float] = None,
    kv_heads_per_chunk: Optional[int] = None,
    backend: str = "auto",
    agree: bool = True,
) -> "torch.Tensor":
    """Context-parallel :func:`~seqpack.training.attention_tree.tree_attention` on
    this rank's rows of a prefix tree (what :func:`seqpack.attention` runs on a
    tree's ranges cut, :func:`seqpack.shard_layout`).

    Every CP rank holds rows ``[bounds[r], bounds[r + 1])`` of the tree's physical
    layout (the ``bounds`` and ``local_rows`` of ``seqpack.shard_layout(tree, cp_size, r)``)
    of q, k and v. K and V are all-gathered over ``group`` and each local query
    attends to its ancestors and itself through :func:`~seqpack.varlen_attention`
    (``backend``: one of its backends). The result equals
    ``tree_attention(q_full, k_full, v_full, tree)``'s rows of this rank, and the
    gradients its rows of the full gradients. ``kv_heads_per_chunk`` bounds memory
    as in :func:`~seqpack.training.attention_cp.cp_attention`.

    Before the first gather every rank runs its checks (the tree, q/k/v shapes and
    dtypes, this rank's row count, the arguments and backend), then one all-reduce
    over ``group`` tells every rank whether any failed and compares what must be
    the same everywhere (the tree's segments and CP cut, q/k/v head and feature
    shapes and dtypes, which require grad with grad mode on, the autocast state,
    the heads per gather); a rank that failed raises its own error and the others
    a ``ValueError``, so none is left waiting in a gather. ``agree=False`` skips
    that all-reduce (later layers of the same micro-batch).

    Args:
        q, k, v: this rank's rows ``[n_r, Hq, D]`` and ``[n_r, Hk, D]``.
        tree: the :class:`~seqpack.PrefixTreeBatch` every rank of ``group`` shares.
        group: the CP process group (``torch.distributed``; default WORLD).

    Returns:
        ``[n_r, Hq, Dv]``, this rank's rows of the attention output.
    """
    import torch.distributed as dist

    from .._dist import checked_on_every_rank
    from ..tensors.cp import gather_rank_rows
    from ..tensors.prefix_tree_cp import rank_major_order

    q, k, v = inputs.follow_autocast(q, k, v)
    size, me = dist.get_world_size(group), dist.get_rank(group)
    if size < 1 or me < 0:
        raise ValueError(f"this process is not in the CP group (size {size}, rank {me}); it cannot take part in "
                         "tree_cp_attention's collectives over it")
    checked = checked_on_every_rank(
        lambda: _checks(q, k, v, tree, size, me, softmax_scale, kv_heads_per_chunk, backend),
        group, "tree_cp_attention", agree and size > 1, fingerprint=lambda c: _fingerprint(c, q, k, v))
    bounds = checked["bounds"]
    counts, order = np.diff(bounds), rank_major_order(bounds)
    # Agreed above (the cut, k's and v's shapes, dtypes and requires_grad).
    return attend_gathered(q, k, v, lambda t: gather_rank_rows(t, counts, order, group), checked["plan"],
                           causal=True, scale=checked["scale"], backend=backend,
                           kv_heads_per_chunk=checked["step"])
