"""The operations a model's step calls on any layout: :func:`attention` and
:func:`token_logprobs` (one call each for rows, prefix trees, every CP cut and
hybrid-CP micro-batches), and :func:`varlen_attention`, flash-attn's raw form.

Which implementation runs is decided by :mod:`seqpack.training.dispatch` from the
layout's kind and cut::

    layout = seqpack.pack_prefix_tree(rows)                 # or PackedLayout, a PackedBatch,
    layout = seqpack.shard_layout(layout, cp_size, rank)     # ... cut for this CP rank
    out = seqpack.attention(q, k, v, layout, group=cp_group)             # q, k, v [T_local, H, D]
    lp = seqpack.token_logprobs(logits, layout).logprobs                  # trees: [N] logical

    >>> import torch, seqpack
    >>> tree = seqpack.pack_prefix_tree([[5, 6, 7], [5, 6, 8]])
    >>> q = torch.randn(tree.num_tokens, 2, 8, dtype=torch.float64)
    >>> seqpack.attention(q, q, q, tree).shape
    torch.Size([4, 2, 8])
    >>> seqpack.token_logprobs(torch.randn(4, 10), tree).logprobs.shape
    torch.Size([6])
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence

from ..tensors.layout_kinds import is_layout
from .dispatch import ATTENTION, TOKEN_LOGPROBS, lookup

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .logprobs import TokenLogprobs

__all__ = ["attention", "token_logprobs", "varlen_attention"]


def attention(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", layout: Any, *, group: Any = None,
              backend: str = "auto", softmax_scale: Optional[float] = None,
              kv_heads_per_chunk: Optional[int] = None, agree: bool = True) -> "torch.Tensor":
    """Causal attention of the physical tokens of ``layout``, each over the tokens of
    its rows up to itself (a prefix tree: its ancestors and itself).

    ::

        rows  | a a a | b b |      each row alone, causal
        tree  5 6 7 / 5 6 8 9      shared 5 6 computed once; 8 sees 5 6, never 7
        cut   rank r's tokens of either (zigzag chunks, tree ranges, Ulysses slices)

    Args:
        q, k, v: ``[T, Hq, D]``, ``[T, Hk, D]``, ``[T, Hk, Dv]`` at the layout's
            physical tokens on this rank (``Hq`` a multiple of ``Hk``: GQA); under a
            cut, this rank's rows (``layout.num_local_tokens``; zigzag:
            ``T / cp_size``).
        layout: a :class:`~seqpack.TokenLayout` (:class:`~seqpack.PackedLayout`,
            :class:`~seqpack.PrefixTreeBatch`, a cut of one from
            :func:`seqpack.shard_layout`), a :class:`~seqpack.PackedBatch`, or a
            hybrid-CP micro-batch.
        group: the CP / Ulysses process group of a cut layout (``None``: WORLD for a
            cut layout; a whole layout takes none).
        backend: ``"auto"``, one of :func:`seqpack.varlen_attention`'s backends, or
            a tree backend (``"varlen"``, ``"sdpa"``, ``"flex"``, ``"reference"``).
        softmax_scale: default ``1 / sqrt(D)``.
        kv_heads_per_chunk: under CP, gather K/V that many heads at a time.
        agree: under a cut, compare every rank's inputs in one all-reduce before
            the first collective (a rank that fails makes all raise).

    Returns:
        ``[rows, Hq, Dv]`` in q's dtype (the autocast dtype under autocast),
        differentiable with respect to q, k and v.
    """
    options = dict(softmax_scale=softmax_scale, backend=backend, kv_heads_per_chunk=kv_heads_per_chunk,
                   agree=agree)
    return lookup(ATTENTION, layout, "attention", group)(q, k, v, layout, group, options)


def token_logprobs(logits: "torch.Tensor", layout: Any, input_ids: Any = None, *, weight: Any = None,
                   bias: Any = None, temperature: Any = 1.0, return_entropy: bool = False,
                   vocab_parallel_group: Any = None, vocab_start: Any = 0, chunk_tokens: Optional[int] = None,
                   scored: Any = None, num_threads: int = 0, agree: bool = True) -> "TokenLogprobs":
    """Log-probability (and entropy) of each token's next token, fused and
    differentiable, for any layout; with ``weight`` the LM head is fused in
    (``logits`` are then the final hidden states ``[T, H]``; the ``[T, V]`` logits
    are never held).

    Where the values land::

        rows   [T_local] at this rank's physical rows (the THD layout: unpack with
               the PackedBatch); a row's last token and pad rows read 0
        tree   [N] at the logical tokens (rows concatenated): a shared token has one
               target per child; under a ranges cut only this rank's predictions
               (0 elsewhere), so the ranks' results sum to the whole
        parts  each part's, back to back in part order

    Args:
        logits: ``[T, V]`` (``[T, V / TP]`` with ``vocab_parallel_group``), or with
            ``weight`` the hidden states ``[T, H]``.
        layout: as :func:`attention` takes it.
        input_ids: rows: the full packed ids ``[T]`` (also under CP); a tree and a
            hybrid micro-batch carry their own (give none). An id < 0 means "no
            target" (log-prob 0, no gradient).
        weight / bias: the LM head ``[V, H]`` / ``[V]``.
        temperature: logits are divided by it first.
        return_entropy: also return each token's entropy.
        vocab_parallel_group / vocab_start: a tensor-parallel vocabulary (rows).
        chunk_tokens: with ``weight``, rows per chunk of the fused head.
        scored: a tree's logical tokens whose next token is wanted (``[N]`` bool).
        num_threads: CPU threads (0: seqpack's default).
        agree: with a vocabulary-parallel group, one agreement before the
            collectives.

    Returns:
        :class:`~seqpack.training.logprobs.TokenLogprobs` ``(logprobs, entropy)``.
    """
    options = dict(temperature=temperature, return_entropy=return_entropy, vocab_parallel_group=vocab_parallel_group,
                   vocab_start=vocab_start, chunk_tokens=chunk_tokens, scored=scored, num_threads=num_threads,
                   agree=agree, head=None if weight is None else (weight, bias))
    if weight is None and bias is not None:
        raise ValueError("bias is the LM head's: give it with weight")
    return lookup(TOKEN_LOGPROBS, layout, "token_logprobs", vocab_parallel_group)(logits, layout, input_ids, options)


def varlen_attention(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", cu_seqlens_q: Any,
                     cu_seqlens_k: Any = None, max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
                     causal: bool = True, softmax_scale: Optional[float] = None,
                     window_size: Optional[Sequence[int]] = (-1, -1), backend: str = "auto") -> "torch.Tensor":
    """flash-attn's ``flash_attn_varlen_func`` form: packed queries over packed keys,
    sequence by sequence (see :func:`seqpack.training.attention_varlen.varlen_attention`
    for every argument and backend). A layout as ``cu_seqlens_q`` (and nothing
    else) runs :func:`attention` on it.

    ::

        q rows:  | a0 a1 a2 | b0 b1 |      cu_seqlens_q = [0, 3, 5]

    >>> import torch
    >>> x = torch.randn(5, 1, 4)
    >>> varlen_attention(x, x, x, [0, 3, 5], [0, 3, 5], 3, 3).shape
    torch.Size([5, 1, 4])
    """
    from .attention_varlen import varlen_attention as raw

    held = getattr(cu_seqlens_q, "layout", cu_seqlens_q)  # a PackedBatch's layout
    if not is_layout(held):
        return raw(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                   window_size, backend)
    if cu_seqlens_k is not None or max_seqlen_q is not None or max_seqlen_k is not None:
        raise ValueError("a layout as cu_seqlens_q carries the keys' offsets and the longest sequence: give no "
                         "cu_seqlens_k, max_seqlen_q or max_seqlen_k with it")
    if causal is not True or tuple(window_size if window_size is not None else (-1, -1)) != (-1, -1):
        raise ValueError(f"a layout's attention is causal over each row: give causal=True and no window, got "
                         f"causal={causal!r}, window_size={window_size!r}")
    return attention(q, k, v, held, softmax_scale=softmax_scale, backend=backend)
