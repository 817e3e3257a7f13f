"""Queries against keys and values gathered over a context-parallel group: the
kernel step both CP layouts share (zigzag chunks of rows, :mod:`attention_cp`;
contiguous ranges of a tree, :mod:`attention_tree_cp`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict

from .attention_varlen import varlen_attention

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["attend_gathered"]


def attend_gathered(q, k, v, gather, plan: Dict[str, Any], *, causal: bool, scale: float, backend: str,
                    kv_heads_per_chunk: int) -> "torch.Tensor":
    """This rank's queries against keys and values gathered over its group:
    ``gather(t)`` gives every rank's rows of ``t`` in the full layout, ``plan``'s
    ``k_index`` picks each query segment's keys from them (``cu_q``, ``cu_k``,
    ``max_q``, ``max_k``: the :func:`varlen_attention` offsets), and
    ``kv_heads_per_chunk`` KV heads go at a time (re-gathered in the backward:
    activation checkpointing) when fewer than all."""
    from ..tensors._device import host_to_device

    import torch
    (k_index,) = host_to_device([plan["k_index"]], k.device)
    hk, group_size = k.shape[1], q.shape[1] // k.shape[1]

    def attend(qc, kc, vc):
        keys, values = gather(kc).index_select(0, k_index), gather(vc).index_select(0, k_index)
        if qc.shape[0] == 0:  # no query here (a tree's CP rank can hold none): no kernel runs, and the
            # gathers stay in the graph through an exact 0, so this rank's backward joins their reduce-scatters
            zero = (qc[:0].sum() + keys[:0].sum() + values[:0].sum()).to(vc.dtype)
            return vc.new_zeros((0, qc.shape[1], vc.shape[2])) + zero
        return varlen_attention(qc, keys, values, plan["cu_q"], plan["cu_k"], plan["max_q"], plan["max_k"],
                                causal=causal, softmax_scale=scale, backend=backend)

    if kv_heads_per_chunk >= hk:
        return attend(q, k, v)
    from torch.utils.checkpoint import checkpoint

    outs = []
    for h in range(0, hk, kv_heads_per_chunk):
        e = min(hk, h + kv_heads_per_chunk)
        outs.append(checkpoint(attend, q[:, h * group_size: e * group_size], k[:, h:e], v[:, h:e],
                               use_reentrant=False))
    return torch.cat(outs, dim=1)
