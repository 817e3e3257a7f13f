"""Attention and next-token log-probs of a rank's hybrid-CP micro-batch
(:class:`~seqpack.HybridCpBatch`): each part runs what its kind needs, over its
block's process group, and the results are concatenated in the parts' order::

    rows of rank 1      [ E (whole) | B/2 (block 2, 0) | A/4 (block 4, 0) ]
    attention           varlen / tree | cp_attention over ranks 0-1 | over ranks 0-3
    log-probs           this rank's positions of every part

Every rank runs its parts in the same order (whole, then by degree, first cp_rank
and first row), so the blocks' collectives - each part's own agreement, its K/V
gathers and, in the backward, their reduce-scatters - meet on every rank of a block
without waiting on another block's. The plan's agreement (same cells, degrees and
blocks everywhere) ran when the micro-batches were built
(:func:`~seqpack.hybrid_cp_micro_batches`).

    >>> out = hybrid_cp_attention(q, k, v, micro_batch)      # doctest: +SKIP
    >>> lps = hybrid_cp_token_logprobs(logits, micro_batch)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional

from .._lengths import type_name

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .logprobs import TokenLogprobs

__all__ = ["hybrid_cp_attention", "hybrid_cp_token_logprobs"]


def _checked(batch: Any, rows: int, what: str) -> Any:
    from ..tensors.hybrid_cp import HybridCpBatch

    if not isinstance(batch, HybridCpBatch):
        raise TypeError(f"{what} takes a seqpack.HybridCpBatch (hybrid_cp_micro_batches), got {type_name(batch)}")
    if rows != batch.num_tokens:
        raise ValueError(f"{what}: the tensors have {rows} rows, the micro-batch's parts {batch.num_tokens}")
    return batch


def hybrid_cp_attention(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", batch: Any, *,
                        groups: Any = None, softmax_scale: Optional[float] = None,
                        kv_heads_per_chunk: Optional[int] = None, backend: str = "auto",
                        agree: bool = True) -> "torch.Tensor":
    """Causal attention of this rank's rows ``[rows, H, D]`` of a hybrid-CP
    micro-batch: a whole part with :func:`~seqpack.varlen_attention` (packed) or
    :func:`~seqpack.tree_attention` (a prefix tree), a sharded part with
    :func:`~seqpack.cp_attention` (zigzag; a tree: :func:`~seqpack.tree_cp_attention`)
    over its block's group (``groups``: default the groups
    :func:`~seqpack.hybrid_cp_micro_batches` made, ``batch.block_group(part)``). ``agree`` is each sharded part's own agreement (its
    shapes, dtypes and offsets on every rank of its block)."""
    from .attention_cp import cp_attention
    from .attention_tree import tree_attention
    from .attention_varlen import varlen_attention

    batch = _checked(batch, int(q.shape[0]), "hybrid_cp_attention")
    outs = []
    for part in batch.parts:
        qs, ks, vs = q[part.start:part.end], k[part.start:part.end], v[part.start:part.end]
        if part.degree > 1:
            group = batch.block_group(part) if groups is None else groups.block(batch.dp_rank, part.degree,
                                                                                  part.first)
            outs.append(cp_attention(qs, ks, vs, part.layout, group, softmax_scale=softmax_scale,
                                     kv_heads_per_chunk=kv_heads_per_chunk, backend=backend, agree=agree))
        elif part.is_tree:
            outs.append(tree_attention(qs, ks, vs, part.layout, softmax_scale=softmax_scale, backend=backend))
        else:
            cu, longest = part.layout.cu_seqlens_padded, part.layout.max_seqlen_padded
            outs.append(varlen_attention(qs, ks, vs, cu, cu, longest, longest, softmax_scale=softmax_scale,
                                         backend=backend))
    if not outs:
        return q.new_empty((0, q.shape[1], v.shape[2]))
    import torch

    return torch.cat(outs) if len(outs) > 1 else outs[0]


def hybrid_cp_token_logprobs(logits: "torch.Tensor", batch: Any, *, temperature: float = 1.0,
                             return_entropy: bool = False) -> List["TokenLogprobs"]:
    """Each part's next-token log-probs (and entropies) from this rank's logits
    ``[rows, V]`` of a hybrid-CP micro-batch, no collective: a packed part's are its
    rows here (:func:`~seqpack.packed_token_logprobs` with the part's full ids; a
    sharded part: this rank's zigzag positions, in its local order), a tree part's
    its logical tokens (:func:`~seqpack.tree_token_logprobs`; sharded: 0 where
    another rank's rows predict). Summed over every rank and part, each token of the
    micro-batch counts once: a rank's loss is the sum of its parts', and the global
    token count normalises as without CP (no division by a CP size)."""
    from .logprobs import packed_token_logprobs
    from .logprobs_tree import tree_token_logprobs

    batch = _checked(batch, int(logits.shape[0]), "hybrid_cp_token_logprobs")
    out = []
    for part in batch.parts:
        rows = logits[part.start:part.end]
        if part.is_tree:
            out.append(tree_token_logprobs(rows, part.layout, temperature=temperature, return_entropy=return_entropy,
                                           cp_size=part.degree, cp_rank=part.cp_rank))
        else:
            if part.input_ids is None:
                raise ValueError("hybrid_cp_token_logprobs needs the micro-batch built with input_ids "
                                 "(the next-token targets)")
            out.append(packed_token_logprobs(rows, part.input_ids, part.layout.layout, temperature=temperature,
                                             return_entropy=return_entropy))
    return out
