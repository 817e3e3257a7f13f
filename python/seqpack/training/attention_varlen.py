"""Attention over packed (THD) sequences: one call for the whole batch, sequences
never see each other.

Layout (flash-attention's varlen convention)::

    q, k, v rows [T, H, D]:   | a a a | b b | c c c c |      cu_seqlens = [0, 3, 5, 9]

    causal mask, per sequence (x = may attend):
              k: a a a b b c c c c
        q: a     x
           a     x x
           a     x x x
           b           x
           b           x x
           c               x
           c               x x
           c               x x x
           c               x x x x

With different query and key lengths (``cu_seqlens_q`` != ``cu_seqlens_k``) the
causal diagonal is aligned to the bottom right, as in flash-attention >= 2.1:
query ``i`` of a sequence with ``Lq`` queries and ``Lk`` keys sees keys
``j <= i + Lk - Lq``. ``window_size=(left, right)`` further limits key ``j`` to
``[i + Lk - Lq - left, i + Lk - Lq + right]`` (-1: unbounded). A query row that
sees no key gets 0 (flash-attention's convention); rows after ``cu_seqlens_q[-1]``
get 0 too.

Backends (``seqpack.attention_backends()`` says which are usable here):

- ``"flash_attn"``: ``flash_attn_varlen_func`` (CUDA, fp16/bf16, flash-attn installed);
- ``"torch_varlen"``: ``torch.nn.attention.varlen.varlen_attn`` (CUDA; its signature
  is read at run time: ``is_causal=`` in early releases, ``window_size=`` later);
- ``"flex"``: FlexAttention with a document mask (forward on any device, backward
  on GPU only - PyTorch's CPU FlexAttention has none; eager mode materialises the
  scores, compile it for speed);
- ``"reference"``: exact PyTorch on any device, CPU included: ``scaled_dot_product_attention``
  on tiles of whole sequences (or row chunks of a long one) with a block-diagonal
  mask, so the score memory stays under ``max_score_elements``.

``backend="auto"`` picks flash_attn, then torch_varlen for CUDA fp16/bf16 inputs,
else the reference.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .._lengths import as_positive_int
from ..tensors.layout import check_offsets
from . import attention_inputs as inputs
from .varlen_backends import BACKENDS, attention_backends  # noqa: F401  (varlen_attention's, re-exported)
from .varlen_backends import flash_attn_varlen_func, pick_backend, torch_varlen_attn, torch_varlen_params

if TYPE_CHECKING:
    import torch

MAX_SCORE_ELEMENTS = 1 << 25  # reference backend: scores per tile (heads x queries x keys), 128 MiB in fp32


def _torch():
    import torch

    return torch


def _host_cu(cu: Any, name: str) -> Optional[np.ndarray]:
    """cu_seqlens on the host as int64 (validated), or None for a device tensor (not
    read: that would synchronise; the kernels clamp and check bounds themselves)."""
    out = check_offsets(cu, name)
    return out if isinstance(out, np.ndarray) else None


def _device_cu(cu: Any, device) -> "torch.Tensor":
    torch = _torch()
    if isinstance(cu, torch.Tensor):
        return cu.to(device=device, dtype=torch.int32)
    return torch.as_tensor(np.asarray(cu), dtype=torch.int32, device=device)


def varlen_attention(
    q: "torch.Tensor",
    k: "torch.Tensor",
    v: "torch.Tensor",
    cu_seqlens_q: Any,
    cu_seqlens_k: Any = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    causal: bool = True,
    softmax_scale: Optional[float] = None,
    window_size: Optional[Sequence[int]] = (-1, -1),
    backend: str = "auto",
) -> "torch.Tensor":
    """Attention of packed queries over packed keys, sequence by sequence.

    ::

        q rows:  | a0 a1 a2 | b0 b1 |      cu_seqlens_q = [0, 3, 5]
        k rows:  | a0 a1 a2 | b0 b1 |      cu_seqlens_k = [0, 3, 5]
        causal:  a_i sees a_0..a_i, b_j sees b_0..b_j; a never sees b (nor b a)

    Args:
        q: ``[Tq, Hq, D]``; k, v: ``[Tk, Hk, D]`` (``Hq`` a multiple of ``Hk``: GQA).
        cu_seqlens_q / cu_seqlens_k: ``[B + 1]`` offsets of each sequence's rows,
            any form of :func:`seqpack.tensors.layout.check_offsets` (host or device;
            device offsets are not read back). Or a layout of rows that share
            nothing as ``cu_seqlens_q`` alone (a :class:`~seqpack.PackedLayout`,
            ``PackedBatch``, or a :class:`~seqpack.PrefixTreeBatch` with nothing
            shared; causal, no window), run on its padded offsets; a tree that
            shares is refused (:func:`seqpack.attention` takes every layout).
        max_seqlen_q / max_seqlen_k: the longest query / key sequence (not given
            with a layout).
        causal: bottom-right aligned causal mask per sequence.
        softmax_scale: default ``1 / sqrt(D)``.
        window_size: ``(left, right)`` sliding window, -1 = unbounded; ``None`` is
            ``(-1, -1)``.
        backend: ``"auto"`` or one of :data:`BACKENDS`.

    Returns:
        ``[Tq, Hq, D]``, differentiable w.r.t. q, k and v.

    >>> import torch, seqpack
    >>> q = k = v = torch.randn(5, 2, 8)
    >>> out = seqpack.varlen_attention(q, k, v, [0, 3, 5], [0, 3, 5], 3, 3)
    >>> torch.allclose(out[3], v[3])  # first token of the 2nd sequence sees only itself
    True

    Under ``torch.autocast`` (for q's device type) q, k and v are cast to the
    autocast dtype first, as SDPA's are (transformers hands an attention function
    float32 q/k, after rotary embeddings, and a bfloat16 v): the attention runs in,
    and returns, that dtype. Outside autocast they must share their dtype.
    """
    if cu_seqlens_k is None or max_seqlen_q is None or max_seqlen_k is None:
        raise TypeError("varlen_attention needs cu_seqlens_k, max_seqlen_q and max_seqlen_k with offsets as "
                        "cu_seqlens_q (or a layout as cu_seqlens_q alone)")
    q, k, v = inputs.follow_autocast(q, k, v)
    left, right = inputs.check_qkv(q, k, v, window_size, causal)
    scale = inputs.softmax_scale(softmax_scale, q)
    max_seqlen_q = as_positive_int(max_seqlen_q, "max_seqlen_q", allow_zero=True)
    max_seqlen_k = as_positive_int(max_seqlen_k, "max_seqlen_k", allow_zero=True)
    host_q, host_k = _host_cu(cu_seqlens_q, "cu_seqlens_q"), _host_cu(cu_seqlens_k, "cu_seqlens_k")
    if host_q is not None and host_k is not None:
        if host_q.size != host_k.size:
            raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same sequences, got "
                             f"{host_q.size - 1} and {host_k.size - 1}")
        if host_q[-1] > q.shape[0] or host_k[-1] > k.shape[0]:
            raise ValueError(f"cu_seqlens_q[-1] = {host_q[-1]} / cu_seqlens_k[-1] = {host_k[-1]} exceed the rows of "
                             f"q ({q.shape[0]}) / k ({k.shape[0]})")
        if host_q.size > 1 and (np.diff(host_q).max() > max_seqlen_q or np.diff(host_k).max() > max_seqlen_k):
            raise ValueError(f"max_seqlen_q / max_seqlen_k ({max_seqlen_q} / {max_seqlen_k}) are below the longest "
                             f"sequence ({np.diff(host_q).max()} / {np.diff(host_k).max()})")
    name = pick_backend(backend, q, (left, right), causal)
    if name == "flash_attn":
        out = flash_attn_varlen_func()(q, k, v, _device_cu(cu_seqlens_q, q.device), _device_cu(cu_seqlens_k, q.device),
                                 int(max_seqlen_q), int(max_seqlen_k), dropout_p=0.0, softmax_scale=scale,
                                 causal=bool(causal), window_size=(left, right))
        return out[0] if isinstance(out, tuple) else out
    if name == "torch_varlen":
        return _torch_varlen(q, k, v, _device_cu(cu_seqlens_q, q.device), _device_cu(cu_seqlens_k, q.device),
                             int(max_seqlen_q), int(max_seqlen_k), causal, scale, (left, right))
    if host_q is None:
        host_q = cu_seqlens_q.cpu().numpy().astype(np.int64)
    if host_k is None:
        host_k = cu_seqlens_k.cpu().numpy().astype(np.int64)
    if name == "flex":
        return _flex(q, k, v, host_q, host_k, causal, scale, (left, right))
    return _reference(q, k, v, host_q, host_k, causal, scale, (left, right))


def _torch_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window):
    fn = torch_varlen_attn()
    params = torch_varlen_params()
    kwargs: Dict[str, Any] = {"scale": scale} if "scale" in params else {}
    if "window_size" in params:  # later releases: causal is the window (-1, 0)
        kwargs["window_size"] = (window[0], 0 if causal else window[1])
    elif window != (-1, 0 if causal else -1):
        raise ValueError("this PyTorch's varlen_attn has no window_size; use another backend")
    else:
        kwargs["is_causal"] = bool(causal)
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return fn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)


def _row_ids(cu: np.ndarray, rows: int) -> Tuple[np.ndarray, np.ndarray]:
    """Sequence id (-1 outside every sequence) and position of each row."""
    seq = np.full(rows, -1, dtype=np.int64)
    pos = np.zeros(rows, dtype=np.int64)
    lens = np.diff(cu)
    inside = np.repeat(np.arange(len(lens)), lens)
    seq[cu[0]: cu[-1]] = inside
    pos[cu[0]: cu[-1]] = np.arange(cu[-1] - cu[0]) - np.repeat(cu[:-1] - cu[0], lens)
    return seq, pos


def _allowed(seq_q, pos_q, seq_k, pos_k, shift_of_seq, causal, window):
    """[rows_q, rows_k] bool mask (torch) of the pairs that may attend."""
    shift = pos_q + shift_of_seq[seq_q.clamp(min=0)]  # the diagonal key position of each query
    ok = (seq_q[:, None] == seq_k[None, :]) & (seq_q[:, None] >= 0)
    if causal:
        ok &= pos_k[None, :] <= shift[:, None]
    elif window[1] >= 0:
        ok &= pos_k[None, :] <= shift[:, None] + window[1]
    if window[0] >= 0:
        ok &= pos_k[None, :] >= shift[:, None] - window[0]
    return ok


SMALL_TILE_ROWS = 64  # reference backend: consecutive short sequences share one masked tile up to this many rows


def _groups(cu_q: np.ndarray, cu_k: np.ndarray, heads: int, budget: int, plain: bool) -> List[Tuple[int, int]]:
    """Runs ``[b, e)`` of consecutive sequences, each computed as one tile.

    Without a window (``plain``) every sequence with as many queries as keys gets
    SDPA's own causal kernel, alone (no mask, memory linear in its length); only
    short ones are grouped, up to :data:`SMALL_TILE_ROWS` rows, to save calls.
    Otherwise sequences are grouped while heads x queries x keys stays within
    ``budget`` (a longer one is later cut into row chunks)."""
    groups: List[Tuple[int, int]] = []
    b, n = 0, len(cu_q) - 1
    while b < n:
        e = b + 1
        if plain:
            while e < n and cu_q[e + 1] - cu_q[b] <= SMALL_TILE_ROWS and cu_k[e + 1] - cu_k[b] <= SMALL_TILE_ROWS:
                e += 1
        else:
            while e < n and heads * (cu_q[e + 1] - cu_q[b]) * (cu_k[e + 1] - cu_k[b]) <= budget:
                e += 1
        groups.append((b, e))
        b = e
    return groups


def _reference(q, k, v, cu_q, cu_k, causal, scale, window, budget: int = MAX_SCORE_ELEMENTS):
    torch = _torch()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    hq, hk, dv = q.shape[1], k.shape[1], v.shape[2]
    plain = window == (-1, 0 if causal else -1)
    seq_q, pos_q = (torch.from_numpy(a) for a in _row_ids(cu_q, q.shape[0]))
    seq_k, pos_k = (torch.from_numpy(a) for a in _row_ids(cu_k, k.shape[0]))
    shift_of_seq = torch.from_numpy(np.diff(cu_k) - np.diff(cu_q)) if len(cu_q) > 1 else torch.zeros(1, dtype=torch.long)
    groups = _groups(cu_q, cu_k, hq, budget, plain)
    # One split per tensor (a single backward node), not a slice per tile: each
    # slice's backward would write a zero gradient the size of the whole tensor.
    q_sizes = [int(cu_q[0])] + [int(cu_q[e] - cu_q[b]) for b, e in groups] + [q.shape[0] - int(cu_q[-1])]
    k_sizes = [int(cu_k[0])] + [int(cu_k[e] - cu_k[b]) for b, e in groups] + [k.shape[0] - int(cu_k[-1])]
    q_parts, k_parts, v_parts = torch.split(q, q_sizes), torch.split(k, k_sizes), torch.split(v, k_sizes)
    pieces = [q.new_zeros(q_sizes[0], hq, dv)] if q_sizes[0] else []
    for g, (b, e) in enumerate(groups):
        qg, kg, vg = q_parts[g + 1], k_parts[g + 1], v_parts[g + 1]
        q0, k0 = int(cu_q[b]), int(cu_k[b])
        if qg.shape[0] == 0:
            continue
        if plain and e == b + 1 and qg.shape[0] == kg.shape[0]:  # one sequence: SDPA's causal kernel, no mask
            qq, kk, vv = (t.transpose(0, 1)[None] for t in (qg, kg, vg))
            if hq != hk:
                kk, vv = kk.repeat_interleave(hq // hk, 1), vv.repeat_interleave(hq // hk, 1)
            pieces.append(sdpa(qq, kk, vv, is_causal=causal, scale=scale)[0].transpose(0, 1))
            continue
        rows = qg.shape[0]
        if e == b + 1 and hq * rows * kg.shape[0] > budget:  # a long sequence: chunks of its query rows
            step = max(1, budget // max(1, hq * kg.shape[0]))
            bounds = list(range(0, rows, step)) + [rows]
        else:
            bounds = [0, rows]
        chunks = torch.split(qg, list(np.diff(bounds))) if len(bounds) > 2 else (qg,)
        lq, lk = rows, kg.shape[0]
        for (lo, hi), qc in zip(zip(bounds[:-1], bounds[1:]), chunks):
            k_hi = min(lk, max(0, hi + lk - lq)) if (causal and e == b + 1) else lk
            kc, vc = (kg, vg) if k_hi == lk else (kg[:k_hi], vg[:k_hi])
            ok = _allowed(seq_q[q0 + lo:q0 + hi], pos_q[q0 + lo:q0 + hi], seq_k[k0:k0 + k_hi], pos_k[k0:k0 + k_hi],
                          shift_of_seq, causal, window)
            empty = ~ok.any(dim=1)  # rows that see no key: 0, not the NaN of an all-masked softmax
            ok = (ok | empty[:, None]).to(q.device)
            out = sdpa(qc.transpose(0, 1)[None], kc.transpose(0, 1)[None], vc.transpose(0, 1)[None], attn_mask=ok,
                       scale=scale, enable_gqa=hq != hk)[0].transpose(0, 1)
            if bool(empty.any()):
                out = out.masked_fill(empty.to(q.device)[:, None, None], 0.0)
            pieces.append(out)
    if q_sizes[-1]:
        pieces.append(q.new_zeros(q_sizes[-1], hq, dv))
    return torch.cat(pieces) if pieces else q.new_zeros(q.shape[0], hq, dv)


def _flex(q, k, v, cu_q, cu_k, causal, scale, window):
    torch = _torch()
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from ..tensors._device import host_to_device

    dev = q.device
    shifts = np.diff(cu_k) - np.diff(cu_q) if len(cu_q) > 1 else np.zeros(1, dtype=np.int64)
    # The row maps in one pinned non-blocking copy (no stream sync).
    seq_q, pos_q, seq_k, pos_k, shift_of_seq = host_to_device(
        [*_row_ids(cu_q, q.shape[0]), *_row_ids(cu_k, k.shape[0]), shifts], dev)
    seq_k = torch.where(seq_k < 0, -2, seq_k)  # rows outside: never equal to a query's -1
    left, right = window

    def document_mask(b, h, qi, ki):
        sq = seq_q[qi]
        shift = pos_q[qi] + shift_of_seq[sq.clamp(min=0)]
        ok = sq == seq_k[ki]
        if causal:
            ok = ok & (pos_k[ki] <= shift)
        elif right >= 0:
            ok = ok & (pos_k[ki] <= shift + right)
        if left >= 0:
            ok = ok & (pos_k[ki] >= shift - left)
        return ok

    block_mask = create_block_mask(document_mask, None, None, q.shape[0], k.shape[0], device=dev)
    out = flex_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                         block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)

