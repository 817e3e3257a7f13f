"""Attention over a prefix tree (issue 28, step 3): every physical token of a
:class:`~seqpack.tensors.prefix_tree.PrefixTreeBatch` attends to its ancestors and
itself, so each row gets exactly the causal attention it would get alone, while a
shared prefix is computed once.

The tree of :func:`~seqpack.pack_prefix_tree`'s example (rows ``5 6 7``,
``5 6 8 9``, ``5 6`` and, in another group, ``5``) and its visibility: key ``j`` is
visible to query ``i`` exactly when ``j <= i < subtree_end[j]``::

    physical  0  1  2  3  4  5            visibility (x = may attend)
    ids       5  6  7  8  9  5                  k: 0 1 2 3 4 5
    parent   -1  0  1  1  3 -1              q: 0   x
    segments [0 1][2][3  4][5]                 1   x x
                                               2   x x x            <- row 5 6 7
        0 ── 1 ──┬── 2                         3   x x . x
                 └── 3 ── 4                    4   x x . x x        <- row 5 6 8 9
        5                                      5             x      <- row 5

Per attention segment (a maximal chain that breaks at branch points only:
:func:`~seqpack.tensors.tree_plans.attention_segments`; rows ending inside a chain
do not cut it, so a chain of rows, each a prefix of the next, costs what its
longest row costs alone) the queries of the segment see every row of its ancestor segments (the *prefix*) and
their own segment causally: segment ``[3, 5)`` attends to keys ``0 1 | 3 4`` with
the mask ``[[1 1 1 0], [1 1 1 1]]``. Pad tokens are single-token root segments
that see only themselves.

Any :class:`~seqpack.tensors.token_layout.TokenLayout` is accepted: a layout whose
rows share no token (a :class:`~seqpack.PackedLayout`, or a tree with nothing
shared) runs plain packing's kernels, :func:`~seqpack.varlen_attention` on its
:meth:`~seqpack.tensors.token_layout.TokenLayout.rows`, with no tree plan; a tree
whose attention segments are all roots (chains) runs it on the segments. The plan of a tree is built once and
kept by the tree (:meth:`~seqpack.PrefixTreeBatch.host_plan`; build it where the
batch is built with :func:`~seqpack.prepare_tree`).

Backends (:func:`tree_attention_backends` says which run here); none but the
reference ever builds a dense ``[T, T]`` mask:

- ``"varlen"``: each segment is one sequence of :func:`~seqpack.varlen_attention`
  with its own rows as queries and its ancestors' rows then its own as keys
  (``cu_seqlens_q`` = the segments, ``cu_seqlens_k`` = each segment's path from
  the root), causal with the diagonal aligned bottom-right as flash-attention
  aligns it: the prefix is fully visible, the segment causal. One kernel launch
  for the whole tree: flash-attn's (or PyTorch's ``varlen_attn``) on CUDA
  fp16 / bf16, varlen_attention's reference elsewhere. The queries stay in place
  (segments are contiguous in DFS order); keys and values are gathered once per
  segment that reads them, so their memory is the sum of the segments' path
  lengths: at most the physical tokens times ``2 * leaves - 1``, and under twice
  the tokens of the rows that end at leaves (the bound of
  :mod:`~seqpack.tensors.tree_plans`), never the square of the depth.
- ``"sdpa"`` (any device, CPU included; gradients). On the CPU (head sizes of q
  and v equal) it uses the cascade of :mod:`~seqpack.training.attention_tree_cascade`:
  all children of a segment form one query block against its path, so each shared
  prefix's keys are read once. Each segment is also causal over itself, and the
  two parts are merged by log-sum-exp, with no mask. Elsewhere, segments are
  grouped by shape (prefix length, own length) and keys gathered by an index of
  their ancestor segments' rows, with one ``scaled_dot_product_attention`` call
  per group: a root segment uses SDPA's own causal kernel, others a small
  ``[Lq, P + Lq]`` mask. Scores cost what the visible pairs cost, not ``T^2``.
- ``"flex"``: FlexAttention with a block mask from the ancestor rule,
  ``(kv <= q) & (q < subtree_end[kv])`` (forward on any device, backward on GPU
  only, as :func:`~seqpack.varlen_attention`'s flex; eager mode materialises the
  scores, compile it for speed).
- ``"reference"``: dense masked softmax in float64 from the ancestor rule (tests and
  small inputs only: refused above :data:`MAX_REFERENCE_SCORES`).

``backend="auto"`` picks varlen on CUDA fp16 / bf16 when flash-attn or PyTorch's
``varlen_attn`` is there (one launch, FlashAttention's kernels), else sdpa; eager
FlexAttention materialises the scores (about Hq·T² elements), so it is only chosen
by name (compile it for speed and memory). On CUDA the varlen path reads a shared
prefix's keys once per child segment. The cascade there needs a kernel that
returns the log-sum-exp (flash-attn's), which is not wired in yet.

    >>> import torch, seqpack
    >>> tree = seqpack.pack_prefix_tree([[1, 2, 3], [1, 2, 4]])     # physical: 1 2 3 4
    >>> q, k, v = torch.randn(3, 4, 2, 8, dtype=torch.float64).unbind(0)
    >>> out = seqpack.attention(q, k, v, tree)
    >>> row = tree.logical_index[3:].tolist()                         # row 1 = physical 0 1 3
    >>> alone = torch.nn.functional.scaled_dot_product_attention(
    ...     *(t[row].transpose(0, 1) for t in (q, k, v)), is_causal=True).transpose(0, 1)
    >>> torch.allclose(out[row], alone)
    True

Importing this module does not import torch.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Dict, Optional

from ..tensors.layout_kinds import as_layout
from ..tensors.tree_plans import attention_plan
from . import attention_inputs as inputs
from .attention_tree_cascade import cascade_available, tree_cascade_attention
from .attention_varlen import BACKENDS, MAX_SCORE_ELEMENTS, varlen_attention
from .varlen_backends import why_unavailable

if TYPE_CHECKING:
    import torch

    from ..tensors.prefix_tree import PrefixTreeBatch

__all__ = ["TREE_BACKENDS", "MAX_REFERENCE_SCORES", "tree_attention", "tree_attention_backends"]

TREE_BACKENDS = ("varlen", "sdpa", "flex", "reference")
# The varlen_attention backend that runs rows sharing nothing for each tree backend.
_ROWS_BACKEND = {"reference": "reference", "flex": "flex"}
# The reference builds [Hq, T, T] float64 scores: refused past this many (256 MiB).
MAX_REFERENCE_SCORES = 1 << 25


def _torch():
    import torch

    return torch


@functools.lru_cache(maxsize=None)
def _why_tree_unavailable(name: str) -> Optional[str]:
    """None when ``name`` can run here, else why not."""
    if name in ("sdpa", "varlen"):  # varlen: varlen_attention falls back to its SDPA reference
        torch = _torch()
        if not hasattr(torch.nn.functional, "scaled_dot_product_attention"):
            return "torch.nn.functional.scaled_dot_product_attention is missing (PyTorch < 2.0)"
        return None
    return why_unavailable(name)  # flex, reference: the same rules as varlen_attention's


def _cuda_varlen_kernel(q) -> bool:
    """Whether varlen_attention runs a CUDA kernel (flash-attn, varlen_attn) on q."""
    torch = _torch()
    return (q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16)
            and any(why_unavailable(name) is None for name in ("flash_attn", "torch_varlen")))


def tree_attention_backends() -> Dict[str, str]:
    """Every backend of :func:`tree_attention` and whether it can run here
    (``"available"`` or the reason it cannot).

    >>> from seqpack.training.attention_tree import tree_attention_backends
    >>> tree_attention_backends()["sdpa"]
    'available'
    """
    return {name: (_why_tree_unavailable(name) or "available") for name in TREE_BACKENDS}


def tree_attention(
    q: "torch.Tensor",
    k: "torch.Tensor",
    v: "torch.Tensor",
    tree: "PrefixTreeBatch",
    *,
    softmax_scale: Any = None,
    backend: str = "auto",
) -> "torch.Tensor":
    """Attention of the physical tokens of ``tree`` over their ancestors and
    themselves (the ancestor-or-self rule, every row's causal mask at once).

    Args:
        q: ``[T, Hq, D]`` at the physical tokens (``T = tree.num_tokens``, pad
            tokens included).
        k: ``[T, Hk, D]``, v: ``[T, Hk, Dv]`` (``Hq`` a multiple of ``Hk``: GQA).
        tree: the layout the tokens were laid out by (a
            :class:`~seqpack.tensors.token_layout.TokenLayout`): a
            :class:`~seqpack.PrefixTreeBatch`, or rows that share nothing (a
            :class:`~seqpack.PackedLayout`, a ``PackedBatch``, ``cu_seqlens``
            offsets), which run :func:`~seqpack.varlen_attention` as they are.
        softmax_scale: default ``1 / sqrt(D)``; any real number (NumPy and 0-d
            tensor scalars included).
        backend: ``"auto"`` or one of :data:`TREE_BACKENDS`.

    Returns:
        ``[T, Hq, Dv]`` in q's dtype, differentiable w.r.t. q, k and v. Row ``i``
        equals what the token gets in every row through it run alone with causal
        attention; a pad token gets its own ``v``.

    Under ``torch.autocast`` (for q's device type) q, k and v are cast to the
    autocast dtype first, as SDPA's are; outside autocast they must share dtype.
    """
    layout, q, k, v, scale, name = _prepared(q, k, v, tree, softmax_scale, backend)
    if layout.num_tokens == 0:  # [0, Hq, Dv], still attached to v's graph
        return v[:0].repeat_interleave(q.shape[1] // k.shape[1], 1)
    if name == "reference":
        return _reference(q, k, v, layout, scale)
    if name == "flex":
        return _flex(q, k, v, layout, scale)
    if name == "varlen":
        return _varlen(q, k, v, layout, scale)
    return _sdpa(q, k, v, layout, scale)


def flat_tree_attention(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", tree: "PrefixTreeBatch", *,
                        softmax_scale: Any = None, backend: str = "auto") -> "torch.Tensor":
    """:func:`tree_attention` of a tree whose rows share nothing: plain packing's
    kernels (one :func:`varlen_attention` call on its rows), no tree plan."""
    layout, q, k, v, scale, name = _prepared(q, k, v, tree, softmax_scale, backend)
    if layout.num_tokens == 0:
        return v[:0].repeat_interleave(q.shape[1] // k.shape[1], 1)
    rows = layout.rows()
    cu, longest = rows.cu_seqlens_padded, rows.max_seqlen_padded
    return varlen_attention(q, k, v, cu, cu, longest, longest, causal=True, softmax_scale=scale,
                            backend=_ROWS_BACKEND.get(name, "auto"))


def _prepared(q, k, v, tree: Any, softmax_scale: Any, backend: Any) -> tuple:
    """The checks every tree attention runs: (layout, q, k, v after autocast, scale,
    backend name)."""
    layout = as_layout(tree, "tree")
    if layout.cp_size != 1:
        raise ValueError(f"tree is laid out for cp_size = {layout.cp_size} (this rank's zigzag rows): cut it with "
                         "seqpack.shard_layout and run seqpack.attention with the CP group")
    q, k, v = inputs.follow_autocast(q, k, v)
    inputs.check_qkv(q, k, v, None, True)
    t = layout.num_tokens
    if q.shape[0] != t or k.shape[0] != t:
        raise ValueError(f"q, k and v must have one row per physical token of tree (tree.num_tokens = {t}), got "
                         f"q {tuple(q.shape)} and k/v {tuple(k.shape)}")
    return layout, q, k, v, inputs.softmax_scale(softmax_scale, q), pick_tree_backend(backend, q, k, v)


def rows_backend(backend: Any) -> str:
    """The :func:`~seqpack.varlen_attention` backend that runs rows sharing nothing
    for ``backend``: a varlen backend as it is, a tree backend as its rows' form
    (``"reference"`` and ``"flex"`` themselves, the others ``"auto"``)."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string, got {type(backend).__name__}")
    if backend == "auto" or backend in BACKENDS:
        return backend
    if backend in TREE_BACKENDS:
        return _ROWS_BACKEND.get(backend, "auto")
    raise ValueError(f"backend must be 'auto', one of varlen_attention's {BACKENDS} or one of tree attention's "
                     f"{TREE_BACKENDS}, got {backend!r}")


def pick_tree_backend(backend: Any, q, k, v) -> str:
    """The backend :func:`tree_attention` runs for ``backend`` on these inputs (or why it cannot)."""
    torch = _torch()
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string ('auto' or one of {TREE_BACKENDS}), got {type(backend).__name__}")
    if backend == "auto":  # never eager flex: it materialises Hq x T x T scores
        return "varlen" if _cuda_varlen_kernel(q) else "sdpa"
    if backend not in TREE_BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {TREE_BACKENDS}, got {backend!r}")
    why = _why_tree_unavailable(backend)
    if why is not None:
        raise ValueError(f"tree attention backend {backend!r} is not available: {why}")
    if (backend == "flex" and q.device.type == "cpu" and torch.is_grad_enabled()
            and any(x.requires_grad for x in (q, k, v))):
        raise ValueError("tree attention backend 'flex' has no backward on the CPU (PyTorch's FlexAttention); use "
                         "'sdpa' for training on the CPU")
    return backend


# ---- reference: dense, float64 -----------------------------------------------------
def _reference(q, k, v, tree, scale):
    torch = _torch()
    t, hq, hk = q.shape[0], q.shape[1], k.shape[1]
    if hq * t * t > MAX_REFERENCE_SCORES:
        raise ValueError(f"tree attention backend 'reference' builds dense [Hq, T, T] float64 scores; Hq * T * T = "
                         f"{hq} * {t} * {t} is above MAX_REFERENCE_SCORES = {MAX_REFERENCE_SCORES} (use 'sdpa')")
    from ..tensors._device import host_to_device

    (end,) = host_to_device([tree.subtree_end], q.device)
    i = torch.arange(t, device=q.device)
    visible = (i[None, :] <= i[:, None]) & (i[:, None] < end[None, :])  # [query, key]
    with torch.autocast(q.device.type, enabled=False):
        q64, k64, v64 = (x.double() for x in (q, k, v))
        if hq != hk:
            k64, v64 = k64.repeat_interleave(hq // hk, 1), v64.repeat_interleave(hq // hk, 1)
        scores = torch.einsum("ihd,jhd->hij", q64, k64) * scale
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)  # every row sees itself
        out = torch.einsum("hij,jhd->ihd", probs, v64)
    return out.to(q.dtype)


# ---- flex: a block mask from the ancestor rule --------------------------------------
def _flex(q, k, v, tree, scale):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from ..tensors._device import host_to_device

    t = q.shape[0]
    (end,) = host_to_device([tree.subtree_end], q.device)

    def ancestor_or_self(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < end[kv_idx])

    block_mask = create_block_mask(ancestor_or_self, None, None, t, t, device=q.device)
    out = flex_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                         block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


# ---- sdpa: segments over their ancestor segments -------------------------------------
def _plain(q, k, v, plan, scale):
    """Rows that share nothing: the tree is packed rows, and attention is plain
    packing's (:func:`~seqpack.varlen_attention` on the segments), no tree plan."""
    cu, longest = plan.segment_offsets, plan.max_q
    return varlen_attention(q, k, v, cu, cu, longest, longest, causal=True, softmax_scale=scale)


def _expanded(q, k, v, tree, plan, scale):
    """A tree that shares too little for its kernels to pay (``plan.expand``): plain
    packing's attention over the logical rows, each physical token's output read at
    its first occurrence; a pad token sees only itself (its own ``v``)."""
    torch = _torch()
    rows, first = plan.on_device(q.device, "row_index", "first_row")
    ql, kl, vl = (x.index_select(0, rows) for x in (q, k, v))
    cu, longest = plan.row_offsets, plan.max_row
    out = varlen_attention(ql, kl, vl, cu, cu, longest, longest, causal=True, softmax_scale=scale).index_select(0, first)
    pads = tree.num_pad_tokens
    if pads:
        out = torch.cat([out, v[v.shape[0] - pads:].repeat_interleave(q.shape[1] // k.shape[1], 1).to(out.dtype)])
    return out


def _sdpa(q, k, v, tree, scale, budget: int = MAX_SCORE_ELEMENTS):
    """One SDPA call per group of same-shape attention segments (split so that a
    call's ``count x Hq x Lq x (P + Lq)`` scores stay within ``budget``). The gathers
    are one ``index_select`` per tensor (one backward node each, not one per segment)."""
    torch = _torch()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    plan = attention_plan(tree)
    if plan.plain:
        return _plain(q, k, v, plan, scale)
    if plan.expand:
        return _expanded(q, k, v, tree, plan, scale)
    if cascade_available(q, v):  # the CPU: each shared prefix read once, no masks
        return tree_cascade_attention(q, k, v, plan, scale)
    hq, hk, dv = q.shape[1], k.shape[1], v.shape[2]
    q_index, k_index, inverse = plan.on_device(q.device, "group_q", "group_k", "inverse")
    q_parts = torch.split(q.index_select(0, q_index), [c * lq for c, _, lq in plan.groups])
    k_sizes = [c * (p + lq) for c, p, lq in plan.groups]
    k_parts = torch.split(k.index_select(0, k_index), k_sizes)
    v_parts = torch.split(v.index_select(0, k_index), k_sizes)
    outs = []
    for (count, prefix, rows), qg, kg, vg in zip(plan.groups, q_parts, k_parts, v_parts):
        keys = prefix + rows
        # [count, H, L, D]: each segment a batch entry.
        qg = qg.view(count, rows, hq, -1).transpose(1, 2)
        kg = kg.view(count, keys, hk, -1).transpose(1, 2)
        vg = vg.view(count, keys, hk, -1).transpose(1, 2)
        mask, causal = None, False
        if prefix == 0:
            causal = rows > 1  # SDPA's causal (top-left) is the segment's own when Lq == Lk
        elif rows > 1:  # the prefix fully visible, the segment causal: the diagonal at column P
            col = torch.arange(keys, device=q.device)
            mask = col[None, :] <= torch.arange(rows, device=q.device)[:, None] + prefix
        step = max(1, budget // max(1, hq * rows * keys))
        pieces = [sdpa(qg[b:b + step], kg[b:b + step], vg[b:b + step], attn_mask=mask, is_causal=causal, scale=scale,
                       enable_gqa=hq != hk) for b in range(0, count, step)]
        out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        outs.append(out.transpose(1, 2).reshape(count * rows, hq, dv))
    return torch.cat(outs).index_select(0, inverse)


# ---- varlen: every segment a sequence over its path ----------------------------------
def _varlen(q, k, v, tree, scale):
    """One :func:`~seqpack.varlen_attention` call: queries in place, keys and values
    gathered along each attention segment's path (one ``index_select`` each)."""
    plan = attention_plan(tree)
    if plan.plain:
        return _plain(q, k, v, plan, scale)
    if plan.expand:
        return _expanded(q, k, v, tree, plan, scale)
    (k_index,) = plan.on_device(q.device, "k_index")
    return varlen_attention(q, k.index_select(0, k_index), v.index_select(0, k_index), plan.cu_q, plan.cu_k,
                            plan.max_q, plan.max_k, causal=True, softmax_scale=scale)
