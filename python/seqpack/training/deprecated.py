"""The per-kind training functions of seqpack 0.1, kept for one release behind
:func:`seqpack.attention`, :func:`seqpack.token_logprobs` and
:class:`seqpack.SequencePackingLossWrapper` (``seqpack.<old name>`` warns with a
``DeprecationWarning`` naming the new call: ``seqpack._DEPRECATED``; the table is
docs/migration.md). Each takes its old arguments and runs the one operation.

    >>> import warnings, seqpack
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     _ = seqpack.tree_attention
    >>> "seqpack.attention(q, k, v, tree)" in str(caught[0].message)
    True
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional

from ..tensors.layout_kinds import as_layout, is_layout
from .ops import attention

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .logprobs import TokenLogprobs

__all__ = ["HybridCpLossWrapper", "cp_attention", "hybrid_cp_attention", "hybrid_cp_token_logprobs",
           "tree_attention", "ulysses_attention"]


def _group_cut(group: Any) -> tuple:
    import torch.distributed as dist

    return dist.get_world_size(group), dist.get_rank(group)


def tree_attention(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", tree: Any, *,
                   softmax_scale: Any = None, backend: str = "auto") -> "torch.Tensor":
    """``seqpack.attention(q, k, v, tree, softmax_scale=, backend=)``."""
    return attention(q, k, v, as_layout(tree, "tree"), softmax_scale=softmax_scale, backend=backend)


def cp_attention(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", packed_batch: Any, group: Any = None, *,
                 causal: bool = True, softmax_scale: Optional[float] = None, kv_heads_per_chunk: Optional[int] = None,
                 backend: str = "auto", agree: bool = True) -> "torch.Tensor":
    """``seqpack.attention(q, k, v, layout, group=group)`` for a layout cut for this
    rank (zigzag rows; a whole tree is cut in ranges first). Non-causal rows (and
    objects that only carry ``cu_seqlens_padded`` / ``cp_size`` / ``cp_rank``) run
    zigzag CP attention as before."""
    from .attention_cp import cp_attention as zigzag

    held = getattr(packed_batch, "layout", packed_batch)
    if causal is not True or not is_layout(held):
        return zigzag(q, k, v, packed_batch, group, causal=causal, softmax_scale=softmax_scale,
                      kv_heads_per_chunk=kv_heads_per_chunk, backend=backend, agree=agree)
    layout = as_layout(held)
    if layout.cut.is_whole and _group_cut(group)[0] > 1:  # a whole tree: cut in ranges (its checks agreed)
        from .attention_tree_cp import tree_cp_attention

        return tree_cp_attention(q, k, v, layout, group, softmax_scale=softmax_scale,
                                 kv_heads_per_chunk=kv_heads_per_chunk, backend=backend, agree=agree)
    return attention(q, k, v, layout, group=group, softmax_scale=softmax_scale,
                     kv_heads_per_chunk=kv_heads_per_chunk, backend=backend, agree=agree)


def ulysses_attention(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", packed_batch: Any, group: Any = None, *,
                      causal: bool = True, softmax_scale: Optional[float] = None,
                      window_size: Any = (-1, -1), backend: str = "auto", agree: bool = True) -> "torch.Tensor":
    """``seqpack.attention(q, k, v, seqpack.shard_layout(layout, size, rank,
    scheme="ulysses"), group=group)``; a non-causal or windowed attention of rows
    (and a batch laid out for zigzag CP, which it refuses) runs Ulysses on the rows
    as before."""
    from ..tensors.sharded_layout import shard_layout
    from .attention_ulysses import ulysses_attention as rows_ulysses

    held = getattr(packed_batch, "layout", packed_batch)
    plain = causal is True and tuple(window_size if window_size is not None else (-1, -1)) == (-1, -1)
    if not plain or not is_layout(held) or not as_layout(held).cut.is_whole:
        return rows_ulysses(q, k, v, packed_batch, group, causal=causal, softmax_scale=softmax_scale,
                            window_size=window_size, backend=backend, agree=agree)
    size, rank = _group_cut(group)
    layout = as_layout(held)
    return attention(q, k, v, shard_layout(layout, size, rank, scheme="ulysses") if size > 1 else layout,
                     group=group if size > 1 else None, softmax_scale=softmax_scale, backend=backend, agree=agree)


def hybrid_cp_attention(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", batch: Any, *, groups: Any = None,
                        softmax_scale: Optional[float] = None, kv_heads_per_chunk: Optional[int] = None,
                        backend: str = "auto", agree: bool = True) -> "torch.Tensor":
    """``seqpack.attention(q, k, v, micro_batch)``."""
    if groups is not None:
        raise ValueError("groups= is gone: a hybrid-CP micro-batch finds each block's group itself "
                         "(batch.block_group(part), made by seqpack.hybrid_cp_micro_batches)")
    return attention(q, k, v, batch, softmax_scale=softmax_scale, kv_heads_per_chunk=kv_heads_per_chunk,
                     backend=backend, agree=agree)


def hybrid_cp_token_logprobs(logits: "torch.Tensor", batch: Any, *, temperature: float = 1.0,
                             return_entropy: bool = False) -> List["TokenLogprobs"]:
    """Each part's log-probs as a list (``seqpack.token_logprobs(logits,
    micro_batch)`` gives them back to back)."""
    from .dispatch import parts_token_logprobs

    options = dict(temperature=temperature, return_entropy=return_entropy, vocab_parallel_group=None, vocab_start=0,
                   chunk_tokens=None, scored=None, num_threads=0, agree=True, head=None)
    return parts_token_logprobs(logits, batch, options)


def HybridCpLossWrapper(loss_fn: Any, batch: Any, **options: Any) -> Any:  # noqa: N802 - the old class's name
    """``seqpack.SequencePackingLossWrapper(loss_fn, cu_seqlens_q=micro_batch, ...)``."""
    from .loss import SequencePackingLossWrapper

    return SequencePackingLossWrapper(loss_fn, cu_seqlens_q=batch, **options)
