"""Ulysses sequence parallelism on packed sequences.

Each rank holds a contiguous slice of the whole packed stream. One all-to-all
trades rows for heads (every rank then holds every row of ``H / group size``
heads), varlen attention runs on whole sequences, and a second all-to-all trades
them back::

    rank 0: rows 0..n-1, heads 0..H-1     --all-to-all-->   rank 0: rows 0..T-1, heads 0..H/2-1
    rank 1: rows n..T-1, heads 0..H-1                       rank 1: rows 0..T-1, heads H/2..H-1

KV heads are replicated up to the group size when there are fewer (GQA). A prefix
tree (:class:`~seqpack.PrefixTreeBatch`) works the same way: the stream is its
physical layout, and every rank runs
:func:`~seqpack.training.attention_tree.tree_attention` over the whole tree for its
heads. See docs/ulysses.md.

Causal attention is :func:`seqpack.attention` on a Ulysses cut of the layout (this
module's :func:`tree_ulysses_attention` or :func:`ulysses_attention` runs it);
non-causal and windowed attention call :func:`ulysses_attention` itself::

    >>> layout = seqpack.shard_layout(packed_batch, world, rank, scheme="ulysses")  # doctest: +SKIP
    >>> out = seqpack.attention(q, k, v, layout, group=sp_group)                    # doctest: +SKIP
    >>> out = ulysses_attention(q, k, v, packed_batch, sp_group, window_size=(w, 0))  # doctest: +SKIP
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Dict, Optional, Sequence

import numpy as np

from ..tensors.layout import host_offsets
from ..tensors.layout_kinds import as_tree
from .attention_tree import tree_attention
from . import attention_inputs as inputs
from .attention_varlen import varlen_attention
from .varlen_backends import pick_backend

if TYPE_CHECKING:
    import torch

__all__ = ["tree_ulysses_attention", "ulysses_attention"]


def _repeat_kv(x, rep: int):
    """``[T, Hk, D]`` -> ``[T, Hk * rep, D]``, each KV head ``rep`` times in a row
    (verl's ``repeat_kv``, ``repeat_interleave`` on the heads): q head ``j`` keeps
    its KV head ``j // (Hq / Hk)``."""
    if rep == 1:
        return x
    t, h, d = x.shape
    return x[:, :, None].expand(t, h, rep, d).reshape(t, h * rep, d)


def _all_to_all(x, group, size: int, to_heads: bool):
    """One ``all_to_all_single`` over ``group``. ``to_heads``: this rank's rows of
    every head ``[n, H, D]`` -> every rank's rows of this rank's heads
    ``[size * n, H / size, D]`` (head block ``j`` goes to rank ``j``; the rows come
    back in rank order: the stream). Else the inverse."""
    import torch.distributed as dist

    import torch
    if to_heads:
        n, h, d = x.shape
        send = x.reshape(n, size, h // size, d).transpose(0, 1).contiguous()  # [size, n, H / size, D]
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)  # recv[i]: rank i's rows of this rank's heads
        return recv.reshape(size * n, h // size, d)
    rows, h, d = x.shape
    send = x.contiguous()  # [size, n, h, D]: block i (rank i's rows) goes to rank i
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[j]: this rank's rows of rank j's heads
    return recv.reshape(size, rows // size, h, d).transpose(0, 1).reshape(rows // size, size * h, d)


@functools.lru_cache(maxsize=1)
def _ulysses_exchange():
    """The all-to-all as an autograd function: its backward is the inverse
    all-to-all (the exchange is a permutation of rows and heads over the group)."""
    import torch

    class UlyssesAllToAll(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group, size, to_heads):
            ctx.group, ctx.size, ctx.to_heads = group, size, to_heads
            return _all_to_all(x, group, size, to_heads)

        @staticmethod
        def backward(ctx, grad):
            return _all_to_all(grad, ctx.group, ctx.size, not ctx.to_heads), None, None, None

    return UlyssesAllToAll


def _ulysses_checks(q, k, v, packed_batch, size: int, me: int, causal: bool, softmax_scale, window_size,
                    backend: str) -> Dict[str, Any]:
    """Every check of :func:`ulysses_attention` whose outcome can differ between
    ranks, run before its first collective and inside the agreement; returns what
    the call needs."""
    from ..tensors.layout_kinds import is_layout

    layout = getattr(packed_batch, "layout", packed_batch)  # a PackedBatch's layout
    if is_layout(layout):  # a tree with nothing shared: plain packing's rows
        layout = layout.require_rows("ulysses_attention (a tree whose rows share tokens: tree_ulysses_attention)")
    try:
        cu = layout.cu_seqlens_padded
    except AttributeError as exc:
        raise TypeError(f"packed_batch must have cu_seqlens_padded (a PackedBatch or a PackedLayout), or be a "
                        f"PrefixTreeBatch: {exc}") from None
    cp = getattr(layout, "cp_size", 1)
    if cp != 1:
        raise ValueError(f"packed_batch was built for cp_size={cp} (zigzag rows, cp_attention's layout); "
                         "ulysses_attention takes a batch of the whole packed stream (cp_size=1), each rank "
                         "holding a contiguous slice of it (PackedBatch.ulysses_slice)")
    cu_p = host_offsets(cu, "packed_batch.cu_seqlens_padded", copy_device=True)
    left, right = inputs.check_qkv(q, k, v, window_size, causal)
    total = int(cu_p[-1])
    n = _check_rows_and_heads(q, k, total, size)
    hk = k.shape[1]
    scale = inputs.softmax_scale(softmax_scale, q)
    pick_backend(backend, q, (left, right), causal)  # an unknown / unusable backend: before the all-to-all
    longest = int(np.diff(cu_p).max(initial=0))
    return dict(cu_p=cu_p, total=total, n=n, longest=longest, rep=max(1, size // hk), scale=scale, tree=None)


def _check_rows_and_heads(q, k, total: int, size: int) -> int:
    """This rank's row count ``n`` of a stream of ``total`` rows, after checking q's
    and k's rows and the head counts against the group size."""
    from ..tensors._ulysses import local_rows

    n = local_rows(total, size)
    if q.shape[0] != n or k.shape[0] != n:
        raise ValueError(f"q, k and v must hold this rank's {n} rows (the stream's {total} rows padded to a "
                         f"multiple of the group size {size}, / {size}), got {q.shape[0]} and {k.shape[0]}")
    hq, hk = q.shape[1], k.shape[1]
    if hq % size:
        raise ValueError(f"q has {hq} heads, not a multiple of the group size {size}: ulysses_attention gives every "
                         "rank H / group size of q's heads (the attention heads must be divisible by the SP size)")
    if hk % size and size % hk:
        raise ValueError(f"k and v have {hk} heads: they must be a multiple of the group size {size}, or divide it "
                         "(fewer KV heads than ranks are replicated to the group size, as verl does)")
    return n


def _tree_checks(q, k, v, tree, size: int, causal: bool, softmax_scale, window_size, backend: str) -> Dict[str, Any]:
    """:func:`_ulysses_checks` for a prefix tree: the stream is the tree's physical
    layout and every rank runs :func:`~seqpack.training.attention_tree.tree_attention` over it for its heads."""
    from .attention_tree import TREE_BACKENDS, pick_tree_backend

    if causal is not True or tuple(window_size if window_size is not None else (-1, -1)) != (-1, -1):
        raise ValueError("a prefix tree's attention is each token over its ancestors and itself: ulysses_attention "
                         f"takes causal=True and window_size=(-1, -1) with a tree, got causal={causal!r}, "
                         f"window_size={window_size!r}")
    if backend != "auto" and backend not in TREE_BACKENDS:
        raise ValueError(f"with a prefix tree, backend is tree_attention's: 'auto' or one of {TREE_BACKENDS}, got "
                         f"{backend!r}")
    inputs.check_qkv(q, k, v, None, True)
    n = _check_rows_and_heads(q, k, tree.num_tokens, size)
    scale = inputs.softmax_scale(softmax_scale, q)
    pick_tree_backend(backend, q, k, v)  # an unknown / unusable backend: before the all-to-all
    return dict(cu_p=None, total=tree.num_tokens, n=n, longest=0, rep=max(1, size // k.shape[1]), scale=scale,
                tree=tree, segments=[tree.segment_offsets, tree.segment_parent])


def _ulysses_fingerprint(checked: Dict[str, Any], q, k, v) -> Dict[str, Any]:
    """What every rank must share, as named facts: the offsets (the stream every
    rank attends over, and the rows of the all-to-alls), q's, k's and v's shapes
    and dtypes (the exchanged blocks), whether each takes part in a backward (its
    inverse all-to-alls) and the autocast state (the dtype of the attention output,
    exchanged back)."""
    from .._dist import autocast_state, tensor_facts

    facts = tensor_facts(q, k, v)
    stream = ({"the tree's segments (segment_offsets, segment_parent)": checked["segments"]}
              if checked["tree"] is not None else {"cu_seqlens_padded": checked["cu_p"].astype(np.int64)})
    return {**stream,
            "the shapes of q, k and v": facts["shape"], "the dtypes of q, k and v": facts["dtype"],
            "which of q, k and v require grad (with grad mode on)": facts["requires_grad"],
            "the autocast state": autocast_state(q.device.type)}


def ulysses_attention(
    q: "torch.Tensor",
    k: "torch.Tensor",
    v: "torch.Tensor",
    packed_batch: Any,
    group: Any = None,
    *,
    causal: bool = True,
    softmax_scale: Optional[float] = None,
    window_size: Optional[Sequence[int]] = (-1, -1),
    backend: str = "auto",
    agree: bool = True,
) -> "torch.Tensor":
    """Ulysses sequence-parallel attention (DeepSpeed-Ulysses, verl) on a packed batch.

    Every rank of ``group`` holds a contiguous slice of the packed THD stream: its
    ``T`` rows padded at the end to a multiple of the group size, rank ``r`` holding
    rows ``[r n, (r + 1) n)``, ``n = ceil(T / size)`` (``PackedBatch.ulysses_slice``).
    An all-to-all swaps the sequence split for a head split (every rank gets all
    the rows of ``H / size`` heads), every rank runs :func:`varlen_attention` over
    the whole stream for its heads with the stream's ``cu_seqlens_padded``, and a
    second all-to-all swaps back to this rank's rows of every head. q, k and v
    travel in one all-to-all when their head dims match. The backward runs the
    inverse all-to-alls. The tail padding rows belong to no sequence: their output
    and gradients are 0.

    GQA: KV heads that are fewer than the ranks are replicated to the group size
    first (verl's ``repeat_kv``: each KV head ``size / Hk`` times in a row), so q head
    ``j`` still attends with KV head ``j // (Hq / Hk)``; q's heads must be a multiple
    of the group size, and K/V's a multiple or a divisor of it.

    Before the first all-to-all every rank runs its checks (the offsets, q/k/v
    shapes, dtypes and this rank's row count, the head counts against the group
    size, the arguments and backend), then one all-reduce over ``group`` tells every
    rank whether any failed - the failing rank raises its own error, the others a
    ``ValueError`` saying another rank failed - and compares a fingerprint of what
    must be the same everywhere (the offsets, q/k/v shapes and dtypes, which of
    them require grad with grad mode on - the backward's inverse all-to-alls - and
    the autocast state, which sets the dtype of the attention output exchanged
    back); a mismatch makes every rank raise, naming what differs, so no rank's
    backward waits for a rank that runs none. ``agree=False`` skips that all-reduce
    (one small collective a call and, on NCCL, a host-device synchronisation), as
    in :func:`cp_attention`.

    Args:
        q, k, v: this rank's rows ``[n, Hq, D]`` and ``[n, Hk, D]`` (``Dv`` for v).
        packed_batch: the :class:`seqpack.PackedBatch` of the whole stream
            (``cp_size=1``) or a :class:`seqpack.PackedLayout`; its
            ``cu_seqlens_padded`` are used. Or a :class:`seqpack.PrefixTreeBatch`:
            the stream is its physical layout and every rank runs
            :func:`~seqpack.training.attention_tree.tree_attention` over it for its heads (``causal=True``,
            no window; ``backend`` is then tree_attention's).
        group: the SP process group (``torch.distributed``; default WORLD).
            NCCL and gloo (CPU) both run ``all_to_all_single``.
        causal, softmax_scale, window_size, backend: as :func:`varlen_attention`,
            which runs on every rank over the whole stream.

    Returns:
        ``[n, Hq, Dv]``, this rank's rows of the attention output.
    """
    from .._dist import checked_on_every_rank

    q, k, v = inputs.follow_autocast(q, k, v)  # the all-to-alls move the autocast dtype, as varlen_attention computes in it
    size, me = _sp_size_and_rank(group)
    checked = checked_on_every_rank(
        lambda: _ulysses_checks(q, k, v, packed_batch, size, me, causal, softmax_scale, window_size, backend),
        group, "ulysses_attention", agree and size > 1, fingerprint=lambda c: _ulysses_fingerprint(c, q, k, v))
    return _exchanged(q, k, v, group, size, checked, causal, window_size, backend)


def tree_ulysses_attention(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", tree: Any, group: Any = None, *,
                           softmax_scale: Optional[float] = None, backend: str = "auto",
                           agree: bool = True) -> "torch.Tensor":
    """:func:`ulysses_attention` of a prefix tree: the stream is the tree's physical
    layout and every rank runs :func:`~seqpack.training.attention_tree.tree_attention`
    over the whole tree for its heads (``backend`` is tree attention's)."""
    from .._dist import checked_on_every_rank

    q, k, v = inputs.follow_autocast(q, k, v)
    size, me = _sp_size_and_rank(group)
    checked = checked_on_every_rank(
        lambda: _tree_checks(q, k, v, as_tree(tree), size, True, softmax_scale, (-1, -1), backend),
        group, "ulysses_attention", agree and size > 1, fingerprint=lambda c: _ulysses_fingerprint(c, q, k, v))
    return _exchanged(q, k, v, group, size, checked, True, (-1, -1), backend)


def _sp_size_and_rank(group: Any) -> tuple:
    """The SP group's size and this process's rank in it (a process outside it
    cannot take part in the all-to-alls: refused at once)."""
    import torch.distributed as dist

    size, me = dist.get_world_size(group), dist.get_rank(group)
    if size < 1 or me < 0:
        raise ValueError(f"this process is not in the SP group (size {size}, rank {me}); it cannot take part in "
                         "ulysses_attention's all-to-alls over it")
    return size, me


def _exchanged(q, k, v, group, size: int, checked: Dict[str, Any], causal: bool, window_size, backend: str):
    """The two all-to-alls around the attention of the whole stream (rows or a
    tree) for this rank's heads, once every rank agreed on ``checked``."""
    import torch

    total, n, longest, rep = checked["total"], checked["n"], checked["longest"], checked["rep"]
    cu = checked["cu_p"]

    def attend(qs, ks, vs):  # the whole stream (tail padding cut off) for this rank's heads
        if checked["tree"] is not None:
            out = tree_attention(qs[:total], ks[:total], vs[:total], checked["tree"], softmax_scale=checked["scale"],
                                 backend=backend)
        else:
            out = varlen_attention(qs[:total], ks[:total], vs[:total], cu, cu, longest, longest, causal=causal,
                                   softmax_scale=checked["scale"], window_size=window_size, backend=backend)
        if out.shape[0] < qs.shape[0]:
            out = torch.cat([out, out.new_zeros(qs.shape[0] - out.shape[0], *out.shape[1:])])
        return out

    if size == 1:
        return attend(q, k, v)
    if total == 0:
        return q.new_zeros(0, q.shape[1], v.shape[2])
    k, v = _repeat_kv(k, rep), _repeat_kv(v, rep)
    exchange = _ulysses_exchange().apply
    hq, hk = q.shape[1] // size, k.shape[1] // size  # heads of each rank after the exchange
    if q.shape[2] == v.shape[2]:  # one all-to-all: every rank's block holds its q, k and v heads
        both = torch.cat([t.reshape(n, size, -1, t.shape[2]) for t in (q, k, v)], dim=2)
        qs, ks, vs = exchange(both.reshape(n, size * (hq + 2 * hk), q.shape[2]), group, size, True).split(
            [hq, hk, hk], dim=1)
    else:
        qk = torch.cat([t.reshape(n, size, -1, t.shape[2]) for t in (q, k)], dim=2)
        qs, ks = exchange(qk.reshape(n, size * (hq + hk), q.shape[2]), group, size, True).split([hq, hk], dim=1)
        vs = exchange(v, group, size, True)
    return exchange(attend(qs, ks, vs), group, size, False)
