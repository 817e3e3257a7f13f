"""Mixture-of-experts router statistics counted per row on a prefix tree (issue 53).

A tree holds a shared prompt token once; the rows hold it once each, and training
optimises the rows' statistics. transformers' load-balancing loss
(``load_balancing_loss_func`` of Mixtral, Qwen2-MoE, Qwen3-MoE and the families that
copy it) weights each token by the ``attention_mask`` it is given, so
:func:`~seqpack.frameworks.hf_tree.tree_kwargs` hands the tree's row weights as that
mask (how many rows hold each physical token, 0 at pad tokens) and the model's
``aux_loss`` is the rows'. :func:`router_counts` gives the per-expert token counts that
aux-loss-free balancing (a per-expert bias moved by the load) and capacity read::

    rows  P P P a a          tree  P P P a a       row weights  3 3 3 1 1
          P P P b                        b                                  1
          P P P c c                      c c                                1 1
    a router's counts over the rows = over the tree's tokens, each times its weight

Importing this module does not import torch.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["balancing_loss", "router_counts", "tree_aux_loss"]


def router_counts(router_logits: Any, top_k: Any, weights: Any = None) -> Any:
    """``[layers, experts]`` float64: how many tokens each layer routes to each expert
    (its ``top_k`` highest logits), each token counted by ``weights``: a
    :class:`~seqpack.PrefixTreeBatch` (its :meth:`~seqpack.PrefixTreeBatch.row_weights`:
    the rows' counts), a padded batch's ``attention_mask`` ``[B, S]`` (its real
    tokens), a ``[tokens]`` tensor, or None (every token once).

    Args:
        router_logits: the model's ``router_logits`` (``output_router_logits=True``):
            one ``[tokens, experts]`` tensor per layer (a tuple or list), or one
            ``[layers, tokens, experts]`` tensor.
        top_k: experts per token (``config.num_experts_per_tok``).
        weights: see above.

    >>> import torch, seqpack
    >>> tree = seqpack.pack_prefix_tree([[1, 2, 3], [1, 2, 4]])
    >>> logits = torch.tensor([[[2.0, 0.0], [2.0, 0.0], [0.0, 2.0], [2.0, 0.0]]])  # 1 layer, 4 tokens
    >>> router_counts(logits, 1, tree).tolist()   # the rows: 1 2 3 and 1 2 4
    [[5.0, 1.0]]
    """
    import torch

    from .._lengths import as_positive_int
    from ..tensors.layout_kinds import is_layout

    layers: Sequence[Any] = list(router_logits) if isinstance(router_logits, (tuple, list)) else (
        list(router_logits) if hasattr(router_logits, "dim") and router_logits.dim() == 3 else [])
    if not layers or any(not hasattr(x, "dim") or x.dim() != 2 for x in layers):
        raise ValueError("router_logits must be one [tokens, experts] tensor per layer (the model's router_logits) "
                         "or a [layers, tokens, experts] tensor")
    k = as_positive_int(top_k, "top_k")
    tokens, experts = (int(n) for n in layers[0].shape)
    if k > experts:
        raise ValueError(f"top_k = {k} is more than the {experts} experts")
    device = layers[0].device
    if weights is None:
        w = torch.ones(tokens, dtype=torch.float64, device=device)
    elif is_layout(weights):
        w = torch.tensor(weights.row_weights(), dtype=torch.float64, device=device)
    else:
        w = torch.as_tensor(weights).reshape(-1).to(device=device, dtype=torch.float64)
    if w.shape[0] != tokens:
        raise ValueError(f"weights give {w.shape[0]} tokens, the router_logits have {tokens}")
    out = torch.zeros(len(layers), experts, dtype=torch.float64, device=device)
    for i, logits in enumerate(layers):
        if tuple(logits.shape) != (tokens, experts):
            raise ValueError(f"router_logits[{i}] is {tuple(logits.shape)}, layer 0's is {(tokens, experts)}")
        chosen = torch.topk(logits.detach(), k, dim=-1).indices.reshape(-1)
        out[i].scatter_add_(0, chosen, w.repeat_interleave(k))
    return out


def balancing_loss(model: Any) -> Any:
    """The load-balancing loss function of ``model``'s family (transformers'
    ``load_balancing_loss_func`` in its modeling module, which weights tokens by the
    mask it is given), or None where the family has none."""
    import inspect
    import sys

    for cls in type(model).__mro__:  # FSDP2 swaps the class for one made in torch's module: its base is the family
        fn = getattr(sys.modules.get(cls.__module__), "load_balancing_loss_func", None)
        if callable(fn):
            names = list(inspect.signature(fn).parameters)[:4]
            if names == ["gate_logits", "num_experts", "top_k", "attention_mask"] and hasattr(
                    model, "num_experts_per_tok"):
                return fn
            return None  # another signature (Doge's num_keys): not the one counted here
    return None


def tree_aux_loss(model: Any, router_logits: Any, layout: Any) -> Any:
    """``model``'s load-balancing ``aux_loss`` over a tree's tokens counted per row (its
    :meth:`~seqpack.PrefixTreeBatch.row_weights`): the rows' value, from the
    ``router_logits`` of one forward on the tree (what the model computes itself when
    called with :func:`~seqpack.frameworks.hf_tree.tree_kwargs`)."""
    fn = balancing_loss(model)
    if fn is None:
        raise ValueError(f"{type(model).__name__} has no transformers load-balancing loss (load_balancing_loss_func) "
                         "seqpack can count per row")
    if not hasattr(layout, "row_weights"):
        raise ValueError("the load-balancing loss is a product of means over the whole batch: it is counted per row "
                         f"on a whole tree, not on {type(layout).__name__} (a pass of a tree split under a cap)")
    from ..tensors._device import host_to_device

    device = router_logits[0].device
    weights = layout.host_plan(("row_weights", str(device)), lambda t: host_to_device(
        [t.row_weights()[None]], device)[0])  # no host sync (the forward is queued)
    experts = getattr(model, "num_experts", None) or getattr(model.config, "num_local_experts", None)
    return fn(tuple(router_logits), experts, model.num_experts_per_tok, weights)
