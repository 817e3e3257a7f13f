"""HF transformers on prefix trees: one attention implementation for the whole
life of a model (also ``seqpack.integrations.hf``).

:func:`register_tree` registers ``"seqpack_tree"`` with transformers. A call that
passes a tree (``model(**tree_kwargs(tree))``, which hands ``prefix_tree=tree`` down
to every attention call) runs :func:`seqpack.attention`; any other call -
``model.generate`` with its KV cache, a padded batch, an evaluation - runs the
model's usual attention (``fallback``: SDPA unless told otherwise, or eager) with
the mask transformers builds for it. So a trainer needs no switching:

* no attention to switch back before generating;
* nothing to switch during gradient checkpointing's recompute, which calls every
  layer again with the same keyword arguments, the tree included;
* no mask built for a tree: transformers would read the tree's depth positions as
  packed sequences and build a ``[T, T]`` mask for SDPA. The mask function hands the
  attention a deferred mask, built on first use only by a call without a tree.

::

    model(**tree_kwargs(tree))         prefix_tree=tree   ->  tree attention, no mask built
    model(input_ids, attention_mask)   no tree            ->  fallback (sdpa) with its mask
    model.generate(...)                no tree, KV cache  ->  fallback (sdpa) with its mask

    >>> from seqpack.integrations import hf                        # doctest: +SKIP
    >>> model = AutoModelForCausalLM.from_config(cfg, attn_implementation=hf.register_tree())  # doctest: +SKIP
    >>> logits = model(**hf.tree_kwargs(tree)).logits[0]            # doctest: +SKIP
    >>> model.generate(prompt_ids, max_new_tokens=8)                # doctest: +SKIP

:func:`use_tree_attention` switches a loaded model to the implementation whose
fallback is the one it runs now (``"sdpa"`` -> ``"seqpack_tree"``, ``"eager"`` ->
``"seqpack_tree_eager"``) and :func:`restore_attention` switches it back.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Dict, Optional

from .._lengths import as_positive_int, as_real
from ..tensors.prefix_tree import HF_TREE_KWARG

__all__ = ["TREE_NAME", "TREE_KWARG", "pass_forward", "register_tree", "tree_attention_forward", "tree_kwargs",
           "tree_name", "use_tree_attention", "restore_attention"]

TREE_NAME = "seqpack_tree"
TREE_KWARG = HF_TREE_KWARG
_FALLBACK = "sdpa"


class _DeferredMask:
    """What the mask function of a tree implementation returns: the fallback's mask
    call, made on first use (by an attention call without a tree) and kept for the
    other layers of that forward. A call with a tree never builds it."""

    __slots__ = ("_build", "_kwargs", "_mask", "_built", "_tree_ok")

    def __init__(self, build: Callable[..., Any], kwargs: Dict[str, Any]) -> None:
        self._build, self._kwargs, self._mask, self._built = build, kwargs, None, False
        self._tree_ok: Optional[bool] = None

    def fits(self, layout: Any) -> bool:
        """Whether the padding mask is none, all ones, or the tree's row weights (zero
        exactly at its pad tokens); checked once per forward (every layer shares it)."""
        if self._tree_ok is None:
            padding = self.padding
            self._tree_ok = padding is None or bool(padding.all()) or _row_weights_of(padding, layout)
        return self._tree_ok

    @property
    def padding(self) -> Any:
        """The 2-D padding mask the model was called with (None: none)."""
        return self._kwargs.get("attention_mask")

    def resolve(self) -> Any:
        if not self._built:
            self._mask, self._built = self._build(**self._kwargs), True
        return self._mask

    # A model that reads the mask itself before its attention (indexing, .shape)
    # gets the built one.
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in _DeferredMask.__slots__:
            raise AttributeError(name)
        return getattr(self.resolve(), name)

    def __getitem__(self, index: Any) -> Any:
        return self.resolve()[index]


def tree_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                           sliding_window: Optional[int] = None, softcap=None, is_causal: Optional[bool] = None,
                           prefix_tree: Any = None, backend: str = "auto", **kwargs):
    """transformers' attention-function contract over a prefix tree: ``query``
    ``[1, Hq, T, D]``, ``key``/``value`` ``[1, Hk, T, D]`` at the tree's physical
    tokens (``T = prefix_tree.num_tokens``); returns ``([1, T, Hq, D], None)`` from
    :func:`seqpack.attention` - each token attends to its ancestors and itself.

    The tree arrives as the ``prefix_tree`` keyword argument, which transformers
    forwards from ``model(...)`` to every attention call (:func:`tree_kwargs` builds
    the whole call). No mask: a padding ``attention_mask`` is refused (an all-ones
    one means nothing and passes), a built mask too."""
    from ..tensors.layout_kinds import is_layout
    from ..training.ops import attention

    if not is_layout(prefix_tree):
        raise ValueError(f"seqpack tree attention needs the layout: call model(..., prefix_tree=tree) with a "
                         f"PrefixTreeBatch or PackedLayout (seqpack.integrations.hf.tree_kwargs(tree)); got "
                         f"prefix_tree = {type(prefix_tree).__name__}")
    if prefix_tree.cp_size != 1:
        raise ValueError(f"seqpack tree attention runs the whole stream; the layout is cut for cp_size = "
                         f"{prefix_tree.cp_size}")
    if as_real(dropout, "dropout", minimum=0, maximum=1) and module.training:
        raise ValueError("seqpack tree attention has no attention dropout; set the model's attention_dropout to 0")
    if softcap is not None:
        raise ValueError("seqpack tree attention does not support logit softcapping (Gemma 2's "
                         "attn_logit_softcapping): run such a model without a tree")
    for sink in ("s_aux", "sinks"):
        if kwargs.get(sink) is not None:
            raise ValueError(f"seqpack tree attention has no attention sinks ({sink}, GPT-OSS): run such a model "
                             f"without a tree")
    config = getattr(module, "config", None)
    for name in ("expert_capacity", "router_capacity"):  # Switch Transformers' and NLLB-MoE's token dropping
        if getattr(config, name, None):
            raise ValueError(f"{name} = {getattr(config, name)}: capacity-limited routing drops tokens by the "
                             "batch's own counts, and a tree holds a shared token once where the rows hold it once "
                             "each, so it would drop other tokens than the rows: run such a model without a tree")
    if not (is_causal if is_causal is not None else getattr(module, "is_causal", True)):
        raise ValueError("seqpack tree attention is causal (ancestors and self); the module asked for non-causal")
    if isinstance(attention_mask, _DeferredMask):
        if not attention_mask.fits(prefix_tree):
            raise ValueError("seqpack tree attention takes no padding attention_mask (the tree is the mask; its pad "
                             "tokens see only themselves): pass attention_mask=None, or the tree's row weights "
                             "(tree_kwargs(tree)'s)")
    elif attention_mask is not None:
        raise ValueError("seqpack tree attention takes no attention_mask (the tree is the mask); pass none")
    t = prefix_tree.num_local_tokens  # a pass of a split tree: its own tokens
    if sliding_window is not None and prefix_tree.num_tokens and int(prefix_tree.position_ids.max()) >= \
            as_positive_int(sliding_window, "sliding_window"):
        raise ValueError(f"sliding_window = {sliding_window} is shorter than the tree's deepest row "
                         f"({int(prefix_tree.position_ids.max()) + 1} tokens); seqpack tree attention has no window")
    if query.shape[0] != 1 or query.shape[2] != t or key.shape[2] != t:
        raise ValueError(f"seqpack tree attention takes one row of the layout's {t} physical tokens (input_ids "
                         f"[1, T], no KV cache); got query {tuple(query.shape)} and key {tuple(key.shape)}")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, D]
    layout = prefix_tree.for_layer(getattr(module, "layer_idx", None))  # a pass reads that layer's earlier K/V
    out = attention(q, k, v, layout, softmax_scale=scaling, backend=backend)
    return out[None], None


def _fallback_attention(fallback: str, module: Any) -> Callable[..., Any]:
    """The attention function transformers would run for ``fallback`` in ``module``'s
    model: the registered one, or for ``"eager"`` the model file's own."""
    from transformers import AttentionInterface

    if fallback == "eager":
        own = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if own is None:
            raise ValueError(f"{type(module).__name__} has no eager_attention_forward in its module: use another "
                             f"fallback attention than 'eager'")
        return own
    return AttentionInterface()[fallback]


def _row_weights_of(padding: Any, layout: Any) -> bool:
    """Whether a padding mask is zero exactly at the tree's pad tokens (its
    :meth:`~seqpack.PrefixTreeBatch.row_weights`, as ``tree_kwargs`` gives it)."""
    import torch

    weights = getattr(layout, "row_weights", None)
    if weights is None or tuple(padding.shape) != (1, layout.num_tokens):
        return False
    real = layout.host_plan(("row_weights_real", str(padding.device)),
                            lambda t: torch.from_numpy(t.row_weights() > 0).to(padding.device))
    return bool(torch.equal(padding[0] != 0, real))


def _dispatch(module, query, key, value, attention_mask, *args: Any, fallback: str = _FALLBACK,
              backend: str = "auto", **kwargs: Any):
    """The registered function: the tree's attention when ``prefix_tree`` is given,
    else ``fallback``'s with the mask it would have had."""
    tree = kwargs.pop(TREE_KWARG, None)
    # A module that declares itself non-causal is an encoder inside the model (a VLM's
    # vision tower, reached by the kwargs the model hands its image encoder): it runs
    # its own attention; the tree is the language model's.
    if tree is not None and getattr(module, "is_causal", True) is not False:
        return tree_attention_forward(module, query, key, value, attention_mask, *args, prefix_tree=tree,
                                      backend=backend, **kwargs)
    if isinstance(attention_mask, _DeferredMask):
        attention_mask = attention_mask.resolve()
    return _fallback_attention(fallback, module)(module, query, key, value, attention_mask, *args, **kwargs)


def _deferred_mask(fallback: str, **kwargs: Any) -> _DeferredMask:
    from transformers.masking_utils import AttentionMaskInterface

    return _DeferredMask(AttentionMaskInterface()[fallback], kwargs)


def tree_name(fallback: str = _FALLBACK) -> str:
    """The name :func:`register_tree` gives the tree implementation over ``fallback``:
    ``"seqpack_tree"`` for SDPA, ``"seqpack_tree_<fallback>"`` otherwise."""
    return TREE_NAME if fallback == _FALLBACK else f"{TREE_NAME}_{fallback}"


def register_tree(name: Optional[str] = None, backend: str = "auto", fallback: str = _FALLBACK) -> str:
    """Registers seqpack's prefix-tree attention with transformers (attention and mask
    function, see the module docstring); use ``attn_implementation=name`` and call the
    model with :func:`tree_kwargs`. Calls without a tree run ``fallback`` (an
    implementation transformers knows and builds masks for: ``"sdpa"``, ``"eager"``,
    ``"flex_attention"``, one registered by name such as seqpack's ``"seqpack"``; not
    flash, paged or Hub kernels, which transformers loads by the name the model runs).
    Returns ``name`` (default :func:`tree_name`)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if not isinstance(fallback, str) or fallback not in AttentionMaskInterface._global_mapping:
        raise ValueError(f"fallback must be an attention implementation transformers builds masks for "
                         f"({sorted(AttentionMaskInterface._global_mapping)}), got {fallback!r}")
    if fallback.startswith(TREE_NAME):
        raise ValueError(f"fallback {fallback!r} is a tree implementation itself: give the model's usual one")
    if not _usable_fallback(fallback):
        raise ValueError(f"fallback {fallback!r}: transformers loads flash, paged and Hub-kernel implementations by "
                         f"the name the model runs, which a tree implementation replaces; use 'sdpa' (exact "
                         f"attention too) or 'eager'")
    name = tree_name(fallback) if name is None else name
    AttentionInterface.register(name, functools.partial(_dispatch, fallback=fallback, backend=backend))
    AttentionMaskInterface.register(name, functools.partial(_deferred_mask, fallback))
    _FALLBACKS[name] = fallback
    return name


_FALLBACKS: Dict[str, str] = {}  # registered tree implementation -> its fallback


def _implementation(model: Any) -> str:
    return model.config._attn_implementation or _FALLBACK


def _usable_fallback(name: str) -> bool:
    """Whether calls without a tree can run ``name`` under another implementation's
    name: not flash / paged / Hub kernels, which transformers loads by that name."""
    return "flash" not in name and "/" not in name and "|" not in name and not name.startswith("paged")


def use_tree_attention(model: Any) -> str:
    """Switches ``model`` (a transformers ``PreTrainedModel``) to the tree
    implementation over the attention it runs now (registered if needed) and returns
    that previous implementation, for :func:`restore_attention`. A model on a tree
    implementation already is left as it is. A model on flash-attention, paged or
    Hub-kernel attention gets the tree over SDPA (calls without a tree then run
    SDPA: exact attention too), with a warning naming the change.

    Raises ValueError for a model whose attention implementation cannot be set."""
    import warnings

    current = _implementation(model)
    if current in _FALLBACKS:
        return current
    fallback = current if _usable_fallback(current) else _FALLBACK
    if fallback != current:
        warnings.warn(f"seqpack tree attention: {type(model).__name__} runs {current!r}, which a tree implementation "
                      f"cannot wrap; calls without a tree (generation, evaluation) run 'sdpa' until "
                      f"restore_attention(model, {current!r})", UserWarning, stacklevel=2)
    model.set_attn_implementation(register_tree(fallback=fallback))
    if _implementation(model) not in _FALLBACKS:  # transformers only logs a warning for such a model
        raise ValueError(f"{type(model).__name__} cannot switch its attention implementation (it does not use "
                         f"transformers' AttentionInterface): it cannot run on a prefix tree")
    return current


def restore_attention(model: Any, previous: str) -> None:
    """Switches ``model`` back to ``previous`` (what :func:`use_tree_attention`
    returned) if it still runs a tree implementation."""
    if _implementation(model) in _FALLBACKS and previous != _implementation(model):
        model.set_attn_implementation(previous)


def pass_forward(model: Any, input_ids: Any, position_ids: Any, layout: Any, **kwargs: Any) -> Any:
    """A transformers causal LM's logits ``[num_local_tokens, V]`` on one pass of a
    tree split under a cap: ``seqpack.prefix_reuse(passes, forward=pass_forward)``
    (the model switched to the tree attention, :func:`use_tree_attention`; each
    layer's attention reads its own layer's K/V of the earlier passes, also when
    gradient checkpointing recomputes it, non-reentrant). ``kwargs`` go to the model.

    >>> import seqpack
    >>> from seqpack.integrations import hf
    >>> passes = seqpack.split_prefix_tree(seqpack.pack_prefix_tree([[1, 2, 3, 4], [1, 2, 3, 5]]), 3)
    >>> step = seqpack.prefix_reuse(passes, forward=hf.pass_forward)   # then: mb.forward(model) for mb in step
    """
    if _implementation(model) not in _FALLBACKS:
        raise ValueError(f"{type(model).__name__} runs {_implementation(model)!r} attention: switch it to seqpack's "
                         "tree attention first (seqpack.integrations.hf.use_tree_attention(model), or load it with "
                         "attn_implementation=seqpack.integrations.hf.register_tree())")
    out = model(input_ids=input_ids[None], position_ids=position_ids[None], **{TREE_KWARG: layout},
                **pass_model_kwargs(model, kwargs))
    logits = out.logits if hasattr(out, "logits") else out[0]
    return logits[0]


_IMAGES = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw")


def pass_model_kwargs(model: Any, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """The model's kwargs for a pass of a tree split under a cap, which gives its
    logits only: an MoE model's router loss is not computed (``output_router_logits``
    off), and asking for it is refused by name - the load-balancing loss is a product
    of means over the whole batch, which does not split over passes. Images are
    refused by name: a pass holds some of a prompt's placeholder tokens and reads the
    others' K/V, so it has no whole image to encode (run a VLM's batch on whole trees)."""
    images = [k for k in _IMAGES if kwargs.get(k) is not None]
    if images:
        raise ValueError(f"{', '.join(images)}: a pass of a tree split under a cap carries no images (its prompt's "
                         "placeholder tokens may sit in an earlier pass): run a VLM's batch on whole trees "
                         "(hf.tree_kwargs, prefix reuse off)")
    if kwargs.get("output_router_logits"):
        raise ValueError("an MoE load-balancing loss (output_router_logits) is a product of means over the whole "
                         "batch and does not split over the passes of a tree run under a cap: run it on whole trees "
                         "(prefix reuse off)")
    config = getattr(getattr(model, "module", model), "config", None)
    if getattr(config, "output_router_logits", None) is not None:
        return {**kwargs, "output_router_logits": False}
    return kwargs


def tree_kwargs(tree: Any, device: Any = None, *, model: Any = None, attention_mask: Any = None,
                **multimodal: Any) -> Dict[str, Any]:
    """What to pass to ``model(**tree_kwargs(tree))`` for a model loaded with the
    implementation :func:`register_tree` registered: ``input_ids`` and
    ``position_ids`` ``[1, T]`` (int64; the position of a token is its depth, so
    RoPE sees what each row alone would), ``prefix_tree`` (read by the attention) and
    ``attention_mask`` ``[1, T]``, the tree's row weights (how many rows hold each
    token; 0 at pad tokens): the attention needs no mask, but an MoE model's
    load-balancing ``aux_loss`` is then the rows' (each token counted once per row).
    The logits ``[1, T, V]`` are per physical token: take each row's with
    ``logits[0, tree.logical_index]`` or its log-probs with
    :func:`seqpack.token_logprobs` (not ``labels=``: the shifted loss of
    transformers would read the DFS order as one sequence).

    A vision-language model's rows (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): pass ``model``
    and the padded batch's ``pixel_values`` / ``image_grid_thw`` (videos:
    ``pixel_values_videos`` / ``video_grid_thw`` / ``second_per_grid_ts``) and
    ``mm_token_type_ids`` ``[B, S]`` (its rows' tokens where ``attention_mask``
    ``[B, S]`` is non-zero; without it, each row's first tokens). The call then
    encodes each distinct image once, in tree order, with the M-RoPE
    ``position_ids`` ``[3, 1, T]`` each physical token has in its rows
    (:mod:`seqpack.frameworks.hf_vlm`; build the tree with its ``image_keys``)."""
    from ..tensors.layout_kinds import as_tree

    tree = as_tree(tree)
    if any(value is not None for value in multimodal.values()):
        from .hf_vlm import multimodal_kwargs

        return multimodal_kwargs(tree, model, device, attention_mask, **multimodal)
    return tree.hf_kwargs(device)
