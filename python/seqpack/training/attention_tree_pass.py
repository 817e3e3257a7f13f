"""Attention of one pass of a prefix tree run in passes (:mod:`seqpack.tensors.prefix_passes`):
the pass's own tokens as queries over their root paths, whose keys and values come
partly from earlier passes (the K/V the running step holds) and partly from the pass
itself::

    keys     [ provider 0's own K | provider 1's own K | this pass's K ]    (concatenated)
    gathered per sequence: each tree segment's root path, then its own tokens up to
             the pass's last one in it (k_index, cu_k)
    queries  the pass's own tokens, one sequence per segment they fall in (cu_q),
             causal aligned at the end: a token sees its path and itself

On the CPU the cascade of :mod:`~seqpack.training.attention_tree_cascade` runs it
(the keys before a sequence's own tokens, shared by its sibling sequences, read once
for all of them); elsewhere one :func:`~seqpack.varlen_attention` call. The gradient of the earlier passes' K/V
flows back into the tensors the step holds for them (and from there, when the
provider's pass closes, through its own forward).

Importing this module does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from .attention_tree_cascade import cascade_attention, cascade_available
from .attention_varlen import varlen_attention

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["tree_pass_attention"]


def tree_pass_attention(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", layout: Any,
                        softmax_scale: Optional[float] = None, backend: str = "auto") -> "torch.Tensor":
    """Attention of ``layout``'s own tokens (``q``, ``k``, ``v``: ``[num_local_tokens,
    H, D]``) over their root paths, the keys of earlier passes read from the step
    running ``layout`` (:func:`seqpack.prefix_reuse`). The pad rows of a padded pass
    (:meth:`~seqpack.TreePass.padded_to`) are neither keys nor queries: their output
    is 0."""
    import torch

    from ..tensors._device import host_to_device

    n = layout.num_local_tokens
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 3 or x.shape[0] != n:
            raise ValueError(f"{name} must be [num_local_tokens={n}, heads, head_dim] for pass {layout.index} of the "
                             f"tree, got shape {tuple(x.shape)}")
    runtime = layout.runtime
    if runtime is None:
        raise ValueError(f"pass {layout.index} of a tree split into passes is not part of a running step: iterate "
                         "seqpack.prefix_reuse(passes) and call mb.forward(model); its attention reads the K/V "
                         "of the passes before it, which the step holds")
    if backend not in ("auto", "sdpa", "reference", "varlen"):
        raise ValueError(f"backend must be 'auto', 'sdpa', 'varlen' or 'reference' for a tree pass, got {backend!r}")
    if layout.pad:  # the pad rows after the own tokens: no keys, output 0
        own = n - layout.pad
        out = tree_pass_attention(q[:own], k[:own], v[:own], layout._view(pad=0), softmax_scale, backend)
        return torch.cat([out, out.new_zeros((layout.pad,) + tuple(out.shape[1:]))])
    context_k, context_v = runtime.attention_context(layout, k, v)
    keys_k = torch.cat([context_k, k]) if context_k is not None else k
    keys_v = torch.cat([context_v, v]) if context_v is not None else v
    if backend in ("auto", "sdpa") and cascade_available(q, v):  # the CPU: each shared prefix's keys read once
        c = layout.cascade
        index = layout.host_plan(("cascade", str(q.device)), lambda l: tuple(host_to_device(
            [c.own_rows, c.prefix_q, c.prefix_k, c.own_inverse, c.own_k], q.device)))
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        return cascade_attention(q, keys_k, keys_v, c, index, float(scale))
    index = layout.host_plan(("k_index", str(q.device)), lambda l: host_to_device([l.k_index], q.device)[0])
    rows_backend = "reference" if backend == "reference" else "auto"
    return varlen_attention(q, keys_k.index_select(0, index), keys_v.index_select(0, index), layout.cu_q,
                            layout.cu_k, layout.max_q, layout.max_k, causal=True, softmax_scale=softmax_scale,
                            backend=rows_backend)
