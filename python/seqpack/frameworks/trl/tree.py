"""TRL's GRPO and RLOO on prefix trees: ``seqpack.integrations.trl.patch(shared_prefix=True)``.

TRL's ``GRPOTrainer`` and ``RLOOTrainer`` compute every per-token log-prob they
need - the policy's, the old policy's, the reference model's - in
``_get_per_token_logps_and_entropies``: the padded ``[B, P + C]`` prompt +
completion rows forwarded as they are, so each prompt is forwarded once per
sample of its group (G times). The patch puts seqpack's in its place: the rows
become a :class:`~seqpack.PrefixTreeBatch` (each shared prefix once: a prompt once
per group, and once for the batch where prompts repeat), the model runs on the
tree through the attention :func:`seqpack.integrations.hf.use_tree_attention`
switches it to, and the head scores only the completion tokens
(:func:`seqpack.token_logprobs` with ``weight`` and ``scored``)::

    TRL: B rows x (P + C) tokens         the tree: P + G*C tokens per group
    [pad pad p p p | c c c pad]          p p p -+- c c c
    [pad pad p p p | c c pad pad]               +- c c
    ...  (the prompt G times)                   +- ...

It returns what TRL's does - ``[B, C]`` log-probs (and entropies) of the completion
tokens, 0 where TRL's labels are -100 - with the semantics of TRL's fused LM head
as installed on each model (temperature, ``cast_lm_head_to_fp32``, logit scale;
the compute dtype of autocast), so the loss, gradients and TRL's options
(``num_iterations``, ``beta`` with a reference model, ``importance_sampling_level``,
PEFT / LoRA, gradient checkpointing) are TRL's. The model's own attention stays in
place for every call without a tree: generation, evaluation, TRL's path.

What the tree path cannot take goes to TRL's own path, with one warning naming the
reason: vision inputs, the MoE load-balancing loss, logit soft-capping (Gemma 2),
attention sinks (GPT-OSS), DeepSpeed ZeRO-3, a prompt-learning PEFT adapter, a model
without TRL's fused head, a sliding window shorter than a row, a row whose
completion has no prompt before it.
``AsyncGRPOTrainer`` (``trl.experimental``, which packs its own trees for
flash-attention) is refused by name while the patch is on. A batch the tree can take
still runs on TRL's path where the tree does not pay for it (priced and, on the CPU,
timed per path: :mod:`seqpack.frameworks.trl.choice`; ``patch(trees="always")``
skips that).
"""

from __future__ import annotations

import inspect
import math
import types
import warnings
import weakref
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ...tensors.prefix_tree import HF_TREE_KWARG
from .._completion_trees import completion_tree, to_completions
from ...tensors.prefix_passes import split_prefix_tree
from ..hf_moe import balancing_loss
from ..hf_tree import tree_kwargs
from ..hf_vlm import padded_items, vision_family
from .choice import PathChoice
from .window import after_training_step, window_logps

__all__ = ["patch_trainers", "unpatch_trainers", "patched_trainer_names"]

METHOD = "_get_per_token_logps_and_entropies"
# module, class: the trainers whose method the patch replaces
_TRAINERS = (("trl.trainer.grpo_trainer", "GRPOTrainer"), ("trl.trainer.rloo_trainer", "RLOOTrainer"))
_VISION = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
           "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")
# what a tree takes of them, from a Qwen-VL-style model (hf_vlm): each distinct image once
_VLM_TREE = ("pixel_values", "image_grid_thw", "num_images", "mm_token_type_ids")
_ORIGINAL: Dict[Tuple[str, ...], Any] = {}  # (module, class[, "training_step"]) -> TRL's method, while patched
_BASE_INIT: Dict[str, Any] = {}  # "init": _BaseTrainer.__init__, while patched
_MODELS: "weakref.WeakSet[Any]" = weakref.WeakSet()  # models whose forward and attention the patch changed
_WARNED: set = set()  # the reasons warned about (their kinds: a reason's numbers change from batch to batch)
_COUNTS: Dict[str, Any] = {}  # what report() says; reset by counts(reset=True)
_POLICY: Dict[str, str] = {"trees": "auto"}  # patch(trees=): "auto" (when the tree pays) or "always"


def counts(reset: bool = False) -> Dict[str, Any]:
    """Batches on trees and on TRL's path (by reason), TRL's padded tokens and the
    trees' physical tokens of the batches run as trees, and the difference; of the
    tree batches, those whose chunks ran as one tree in passes (prefix reuse), and the
    accumulation windows run in passes (:mod:`~seqpack.frameworks.trl.window`)."""
    out = dict(tree_batches=_COUNTS.get("tree_batches", 0), trl_batches=_COUNTS.get("trl_batches", 0),
               trl_reasons=dict(_COUNTS.get("trl_reasons", {})), padded_tokens=_COUNTS.get("padded_tokens", 0),
               tree_tokens=_COUNTS.get("tree_tokens", 0),
               prefix_reuse_batches=_COUNTS.get("prefix_reuse_batches", 0),
               prefix_reuse_windows=_COUNTS.get("prefix_reuse_windows", 0))
    out["tokens_saved"] = out["padded_tokens"] - out["tree_tokens"]
    if reset:
        _COUNTS.clear()
    return out


def _count_trl(kind: str) -> None:
    _COUNTS["trl_batches"] = _COUNTS.get("trl_batches", 0) + 1
    reasons = _COUNTS.setdefault("trl_reasons", {})
    reasons[kind] = reasons.get(kind, 0) + 1


# ---- the model: TRL's fused head, read; a forward that runs the tree ----------------------
def _head_of(model: Any) -> Optional[Dict[str, Any]]:
    """The settings of TRL's fused LM head installed on ``model`` (``add_fused_lm_head``),
    or None without one. Found under the wrappers put around it since: accelerate's
    mixed-precision forward (``__wrapped__``, ``_original_forward``), seqpack's."""
    stack = [model.__dict__.get(key) for key in ("_seqpack_trl_forward", "_original_forward", "forward")]
    for _ in range(16):
        if not stack:
            return None
        fn = stack.pop()
        func = getattr(fn, "__func__", fn)
        code = getattr(func, "__code__", None)
        if code is not None and code.co_name == "_fused_forward":  # functools.wraps renamed it "forward"
            head = inspect.getclosurevars(func).nonlocals
            return head if "temperature" in head else None
        stack += [getattr(func, attr) for attr in ("__wrapped__", "model_forward") if hasattr(func, attr)]
    return None


def _tree_forward(self, *args: Any, seqpack_tree: Any = None, labels: Any = None, shift_labels: Any = None,
                  num_items_in_batch: Any = None, **kwargs: Any):
    """The patched model's forward: TRL's when no tree is passed; else the backbone on
    the tree and TRL's head settings on the scored tokens (see the module docstring)."""
    if seqpack_tree is None:
        for key, value in (("labels", labels), ("shift_labels", shift_labels),
                           ("num_items_in_batch", num_items_in_batch)):
            if value is not None:
                kwargs[key] = value
        return self._seqpack_trl_forward(*args, **kwargs)
    import torch

    from ...training.ops import token_logprobs

    tree, scored, entropy, *aux = seqpack_tree  # aux: (True,) for an MoE model's load-balancing loss
    head = _head_of(self)
    kwargs["use_cache"] = False
    kwargs[HF_TREE_KWARG] = tree
    if aux and aux[0]:
        kwargs["output_router_logits"] = True
    backbone = getattr(self, head.get("backbone_attr", "base_model"))(*args, **kwargs)
    hidden = backbone.last_hidden_state[0]
    lm_head = self.get_output_embeddings()
    weight, bias = lm_head.weight, lm_head.bias
    if hasattr(weight, "full_tensor"):  # FSDP2's DTensor, gathered as TRL's head does
        weight = weight.full_tensor()
        bias = bias.full_tensor() if bias is not None else None
    hidden = hidden.to(weight.device)
    device = hidden.device.type
    if head["cast_lm_head_to_fp32"]:
        dtype = torch.float32
    elif torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    else:
        dtype = hidden.dtype
    with torch.autocast(device, enabled=False):
        out = token_logprobs(hidden.to(dtype), tree, weight=weight.to(dtype),  # a tree, or a pass of one
                             bias=None if bias is None else bias.to(dtype),
                             temperature=head["temperature"] / head["logit_scale"], return_entropy=entropy,
                             scored=scored)
    result = {"log_probs": out.logprobs, "entropy": out.entropy}
    if aux and aux[0]:  # the rows' load-balancing loss: each token counted once per row that holds it
        from ..hf_moe import tree_aux_loss

        result["aux_loss"] = tree_aux_loss(self, backbone.router_logits, tree)
    return result


def _installed(model: Any) -> bool:
    return getattr(getattr(model.__dict__.get("forward"), "__func__", None), "_seqpack_tree", False)


def _install(model: Any) -> None:
    """``model``'s forward takes ``seqpack_tree=`` and its attention takes trees. The
    forward keeps the class's signature (``functools.wraps``, as TRL's own), which
    ``generate`` reads (``logits_to_keep``, the kwargs it validates)."""
    import functools

    from ..hf_tree import use_tree_attention

    if _installed(model):
        return
    previous = use_tree_attention(model)

    @functools.wraps(type(model).forward)
    def forward(self, *args: Any, **kwargs: Any):
        return _tree_forward(self, *args, **kwargs)

    forward._seqpack_tree = True
    model._seqpack_trl_forward = model.forward
    model._seqpack_attention = previous
    model.forward = types.MethodType(forward, model)
    _MODELS.add(model)


def _uninstall(model: Any) -> None:
    from ..hf_tree import restore_attention

    if _installed(model):
        model.forward = model._seqpack_trl_forward
        restore_attention(model, model._seqpack_attention)
        del model._seqpack_trl_forward, model._seqpack_attention


# ---- TRL's method, replaced ---------------------------------------------------------------
def _hf_model(trainer: Any, model: Any) -> Tuple[Any, bool]:
    """The transformers model under the accelerate / PEFT wrappers, and whether a
    prompt-learning PEFT adapter (which changes the inputs) is active."""
    # accelerate's unwrap looks its backends up at every call (importlib metadata: most
    # of a millisecond): each model it unwrapped (the policy, the reference) is kept on
    # the trainer with its answer.
    seen = trainer.__dict__.setdefault("_seqpack_unwrapped", weakref.WeakKeyDictionary())
    inner = seen.get(model)
    if inner is None:
        inner = trainer.accelerator.unwrap_model(model) if hasattr(trainer, "accelerator") else model
        seen[model] = inner
    prompt_learning = bool(getattr(inner, "peft_config", None)) and bool(
        getattr(getattr(inner, "active_peft_config", None), "is_prompt_learning", False))
    if hasattr(inner, "get_base_model"):
        inner = inner.get_base_model()
    return inner, prompt_learning


_SINKS: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()


def _has_sinks(model: Any) -> bool:
    """Whether ``model``'s attention has sinks (a ``*sinks`` parameter), looked up once
    per model: the parameters do not change names."""
    if model not in _SINKS:
        _SINKS[model] = any(name.endswith("sinks") for name, _ in model.named_parameters())
    return _SINKS[model]


def _vision(extra: Dict[str, Any]) -> List[str]:
    """The vision inputs TRL passes with this batch."""
    return [k for k in _VISION if extra.get(k) is not None]


def _fallback_reason(hf_model: Any, prompt_learning: bool, compute_aux_loss: bool, extra: Dict[str, Any],
                     longest: int) -> Optional[Tuple[str, str]]:
    """(its kind, the reason) why this batch runs on TRL's path, or None."""
    vision = _vision(extra)
    if vision:
        other = [k for k in vision if k not in _VLM_TREE]
        if other or vision_family(hf_model) is None:
            return "vision", (f"vision inputs ({', '.join(other or vision)}) of {type(hf_model).__name__}, which a tree "
                              "takes from Qwen-VL-style models only (get_rope_index; pixel_values, image_grid_thw, "
                              "mm_token_type_ids)")
    if compute_aux_loss and balancing_loss(hf_model) is None:
        return "moe_aux_loss", (f"the MoE load-balancing loss of {type(hf_model).__name__} (compute_aux_loss), a "
                                "family without transformers' load_balancing_loss_func to count per row")
    if prompt_learning:
        return "prompt_learning", "a prompt-learning PEFT adapter (it changes the model's inputs)"
    head = _head_of(hf_model)
    if head is None:
        return "no_fused_head", "a model without TRL's fused LM head (add_fused_lm_head)"
    if head["final_logit_softcapping"] is not None:
        return "logit_softcapping", f"final_logit_softcapping = {head['final_logit_softcapping']} (a tree head without soft-capping)"
    scale = float(head["logit_scale"])
    if not (math.isfinite(scale) and scale > 0):
        return "logit_scale", f"logit_scale = {head['logit_scale']} (must be positive to fold into the temperature)"
    try:
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    except ImportError:  # pragma: no cover
        def is_deepspeed_zero3_enabled() -> bool:
            return False
    if is_deepspeed_zero3_enabled():
        return "zero3", "DeepSpeed ZeRO-3 (the LM head's weight is a shard outside TRL's gather)"
    if _has_sinks(hf_model):
        return "attention_sinks", "attention sinks (GPT-OSS: tree attention has none)"
    config = hf_model.config.get_text_config()
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "attn_softcapping", f"attn_logit_softcapping = {config.attn_logit_softcapping} (tree attention has no soft-capping)"
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True) and longest > int(window):
        return "sliding_window", f"sliding_window = {window}, shorter than a row of {longest} tokens (tree attention has no window)"
    if not getattr(hf_model, "_can_set_attn_implementation", lambda: True)():
        return "attention_switch", f"{type(hf_model).__name__} cannot switch its attention implementation"
    return None


def _warn_once(kind: str, reason: str) -> None:
    """One warning per kind of reason (the first batch's words), and the batch counted."""
    _count_trl(kind)
    if kind not in _WARNED:
        _WARNED.add(kind)
        warnings.warn(f"seqpack.integrations.trl (shared_prefix=True): {reason}; these log-probs run on TRL's own "
                      f"path (warned once; seqpack.integrations.trl.report() counts them)", UserWarning, stacklevel=4)


def _make_method(original: Any) -> Any:
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **extra):
        import torch

        def trl_path():
            return original(self, model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                            compute_aux_loss, **extra)

        longest = int(attention_mask.sum(1).max()) if attention_mask.numel() else 0
        hf_model, prompt_learning = _hf_model(self, model)
        reason = _fallback_reason(hf_model, prompt_learning, compute_aux_loss, extra, longest)
        c = int(logits_to_keep)
        # a training micro-batch: its accumulation window in passes, where that pays (an MoE load-balancing loss,
        # a product of means over the batch, does not split over passes; a pass carries no images)
        vision = bool(_vision(extra))
        if torch.is_grad_enabled() and not compute_aux_loss and not vision:
            def usable(inputs: Dict[str, Any]) -> bool:  # a buffered micro-batch of the window, as this one
                mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
                return not _vision(inputs) and _fallback_reason(
                    hf_model, prompt_learning, compute_aux_loss, inputs,
                    int(mask.sum(1).max()) if mask.numel() else 0) is None

            served = window_logps(self, model, input_ids, attention_mask, c, bool(compute_entropy), usable,
                                  _micro_tree_tokens(c), _POLICY["trees"] == "always", _in_window)
            if served is not None:
                return served
        if reason is not None:
            _warn_once(*reason)
            return trl_path()
        rows = input_ids.shape[0]
        batch_size = batch_size or rows
        # a VLM batch: the images' placeholder tokens keyed by content, so rows share an
        # image's tokens only where they hold that image
        keys = found_images = None
        if vision:
            try:
                ids_host, mask_host, found_images = padded_items(hf_model, input_ids, attention_mask,
                                                                 _images(extra, 0, rows, rows))
            except ValueError as exc:  # e.g. TRL dropped a truncated tool image's pixels but kept its placeholders
                _warn_once("vision", f"vision inputs a tree cannot place ({exc})")
                return trl_path()
            keys = found_images.keys(ids_host, mask_host)
        chunks = []
        for start in range(0, rows, batch_size):
            end = min(start + batch_size, rows)
            found = completion_tree(input_ids[start:end], attention_mask[start:end], c,
                                    keys=None if keys is None else keys[start:end])
            if found is None:
                _warn_once("no_prompt", "a row whose first completion token has no prompt token before it")
                return trl_path()
            chunks.append((start, end, found))
        tree_tokens = sum(found[0].num_tokens for *_, found in chunks)
        # Without gradients (the old-policy and reference log-probs, chunked by TRL's
        # batch_size), a prompt whose rows fall in several chunks is forwarded once:
        # the whole batch's tree in passes of at most a chunk's tokens (prefix reuse;
        # not for images, which a pass does not carry).
        whole = passes = None
        if len(chunks) > 1 and not torch.is_grad_enabled() and not compute_aux_loss and not vision:
            whole = completion_tree(input_ids, attention_mask, c)
            if whole is not None and whole[0].num_tokens < tree_tokens:
                passes = split_prefix_tree(whole[0], batch_size * input_ids.shape[1])
                chunks, tree_tokens = [(0, rows, whole)], whole[0].num_tokens

        def tree_path():
            _install(hf_model)
            _COUNTS["tree_batches"] = _COUNTS.get("tree_batches", 0) + 1
            _COUNTS["padded_tokens"] = _COUNTS.get("padded_tokens", 0) + int(input_ids.numel())
            _COUNTS["tree_tokens"] = _COUNTS.get("tree_tokens", 0) + tree_tokens
            if passes is not None:
                _COUNTS["prefix_reuse_batches"] = _COUNTS.get("prefix_reuse_batches", 0) + 1
                return _in_passes(self, model, passes, whole, (rows, c), bool(compute_entropy))
            logps, entropies, aux = [], [], []
            for start, end, (tree, scored, source, target) in chunks:
                if vision:  # each distinct image once, the rows' M-RoPE positions
                    kw = tree_kwargs(tree, input_ids.device, model=hf_model, attention_mask=attention_mask[start:end],
                                     **_images(extra, start, end, rows))
                    kw = {k: v for k, v in kw.items() if k not in ("attention_mask", HF_TREE_KWARG)}
                else:
                    kw = tree.hf_kwargs(input_ids.device)
                    kw = {"input_ids": kw["input_ids"], "position_ids": kw["position_ids"]}
                with self.accelerator.autocast():
                    out = model(**kw, seqpack_tree=(tree, scored, bool(compute_entropy), bool(compute_aux_loss)))
                lp, ent = to_completions((out["log_probs"], out["entropy"]), source, target, (end - start, c))
                logps.append(lp)
                if ent is not None:
                    entropies.append(ent)
                if compute_aux_loss:  # each chunk's rows' value, TRL's mean over its chunks
                    aux.append(out["aux_loss"])
            return (torch.cat(logps), (torch.cat(entropies) if compute_entropy else None),
                    torch.stack(aux).mean() if compute_aux_loss else None)

        if _POLICY["trees"] == "always":
            return tree_path()
        # Whether the tree pays for this batch (choice.py): TRL's padded rows against the
        # trees' tokens and pairs, each path's seconds per FLOP measured on the CPU.
        choice = self.__dict__.get("_seqpack_path_choice")
        if choice is None:
            choice = self._seqpack_path_choice = PathChoice.of_model(hf_model)
        device = input_ids.device.type
        vision_trl, vision_tree = _vision_flops(hf_model, found_images, [(start, end) for start, end, _ in chunks])
        work_trl, work_tree = choice.work(
            rows=rows, columns=input_ids.shape[1],
            head_positions=rows * (input_ids.shape[1] if device == "cpu" else c + 1),  # TRL's head off Triton: all
            tree_tokens=tree_tokens, tree_pairs=sum(found[0].metrics().tree_attention_pairs for *_, found in chunks),
            scored=sum(int(found[1].sum()) for *_, found in chunks))
        work_trl, work_tree = work_trl + vision_trl, work_tree + vision_tree
        path, out, mark = choice.run(device, torch.is_grad_enabled(), work_trl, work_tree, trl_path, tree_path,
                                     hf_model.get_input_embeddings())
        if path == "trl":
            _count_trl("tree_does_not_pay")
        return (mark(out[0]),) + tuple(out[1:])

    _get_per_token_logps_and_entropies.__doc__ = (
        "seqpack's: TRL's log-probs and entropies computed on prefix trees "
        "(seqpack.integrations.trl.patch(shared_prefix=True)); TRL's own for what a tree cannot take.")
    _get_per_token_logps_and_entropies._seqpack_original = original
    return _get_per_token_logps_and_entropies


def _vision_flops(model: Any, found: Any, chunks: List[Tuple[int, int]]) -> Tuple[float, float]:
    """The vision tower's FLOPs on TRL's path (every row's images) and on the trees
    (each chunk's distinct images); 0, 0 for a text batch."""
    if found is None or not found.items:
        return 0.0, 0.0
    from ..hf_vlm_forest import vision_flops

    flops = vision_flops(model, [found.grid_of(i) for i in range(len(found.items))])
    rows = np.asarray([row for _, _, row, _ in found.items])
    tree = 0.0
    for start, end in chunks:
        inside = np.flatnonzero((rows >= start) & (rows < end))
        _, first = np.unique(found.classes[inside], return_index=True)
        tree += float(flops[inside[first]].sum())
    return float(flops.sum()), tree


def _images(extra: Dict[str, Any], start: int, end: int, rows: int) -> Dict[str, Any]:
    """The vision inputs of rows ``start:end`` (of ``rows``) as TRL slices them for a
    chunk: each row's ``num_images`` images, ``prod(grid_thw)`` pixel rows each."""
    types = extra.get("mm_token_type_ids")
    out = {"mm_token_type_ids": None if types is None else types[start:end]}
    pixels, grid, counts = extra.get("pixel_values"), extra.get("image_grid_thw"), extra.get("num_images")
    if pixels is None or (start, end) == (0, rows):
        return {**out, "pixel_values": pixels, "image_grid_thw": grid}
    if counts is None:
        raise ValueError("pixel_values without num_images (each row's image count) cannot be cut into chunks")
    first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    patch_rows = np.concatenate([[0], np.cumsum(grid.prod(-1).cpu().numpy())]).astype(np.int64)
    a, b = int(first[start]), int(first[end])
    if a == b:  # rows without images (TRL would hand the model empty pixels)
        return {**out, "pixel_values": None, "image_grid_thw": None}
    return {**out, "pixel_values": pixels[int(patch_rows[a]):int(patch_rows[b])], "image_grid_thw": grid[a:b]}


def _in_passes(trainer: Any, model: Any, passes: Any, found: Any, shape: Tuple[int, int], entropy: bool) -> Any:
    """TRL's ``(log-probs, entropies, None)`` ``[B, C]`` from the whole batch's tree run
    in ``passes`` without gradients (:func:`seqpack.prefix_reuse`): each pass gives
    the scored tokens its own tokens predict, the passes' sum is the tree's."""
    from ...training.prefix_reuse import prefix_reuse

    tree, scored, source, target = found

    def forward(m, ids, pos, layout):
        with trainer.accelerator.autocast():
            return m(input_ids=ids[None], position_ids=pos[None], seqpack_tree=(layout, scored, entropy))

    logps = ents = None
    for mb in prefix_reuse(passes, forward=forward):
        out = mb.forward(model)
        logps = out["log_probs"] if logps is None else logps + out["log_probs"]
        if entropy:
            ents = out["entropy"] if ents is None else ents + out["entropy"]
    lp, ent = to_completions((logps, ents), source, target, shape)
    return lp, ent, None


def _micro_tree_tokens(c: int) -> Any:
    """``tokens(ids, mask)``: the physical tokens of one micro-batch's own tree."""
    def tokens(ids: Any, mask: Any) -> int:
        found = completion_tree(ids, mask, c)
        return int(ids.numel()) if found is None else found[0].num_tokens
    return tokens


def _in_window(trainer: Any, model: Any, passes: Any, found: Any, shape: Tuple[int, int], entropy: bool,
               padded: int) -> Any:
    """An accumulation window's log-probs (:mod:`~seqpack.frameworks.trl.window`; its
    rows ``padded`` tokens as TRL pads them): the model's forward and attention on
    trees, then :func:`_in_passes`, counted."""
    hf_model, _ = _hf_model(trainer, model)
    _install(hf_model)
    _COUNTS["prefix_reuse_windows"] = _COUNTS.get("prefix_reuse_windows", 0) + 1
    _COUNTS["padded_tokens"] = _COUNTS.get("padded_tokens", 0) + int(padded)
    _COUNTS["tree_tokens"] = _COUNTS.get("tree_tokens", 0) + found[0].num_tokens
    return _in_passes(trainer, model, passes, found, shape, entropy)


def _make_training_step(original: Any) -> Any:
    def training_step(self, model, inputs, num_items_in_batch=None):
        out = original(self, model, inputs, num_items_in_batch)
        after_training_step(self, model)  # an accumulation window's passes, after its last micro-batch's backward
        return out

    training_step.__doc__ = ("seqpack's: TRL's training_step, then (after an accumulation window's last micro-batch) "
                             "the window's prefix-reuse passes (seqpack.frameworks.trl.window).")
    training_step._seqpack_original = original
    return training_step


def _trainer_classes() -> List[Tuple[Tuple[str, str], Any]]:
    import importlib

    return [((module, name), getattr(importlib.import_module(module), name)) for module, name in _TRAINERS]


def _refuse_async(init: Any) -> Any:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if any(cls.__name__ == "AsyncGRPOTrainer" and cls.__module__.startswith("trl.experimental")
               for cls in type(self).__mro__):
            raise RuntimeError("seqpack.integrations.trl.patch(shared_prefix=True) does not cover AsyncGRPOTrainer "
                               "(trl.experimental packs its own prefix trees for flash-attention through vLLM): "
                               "call seqpack.integrations.trl.unpatch() before building it")
        init(self, *args, **kwargs)

    __init__._seqpack_original = init
    return __init__


def patched_trainer_names() -> List[str]:
    """The ``Trainer.method`` names that are seqpack's now."""
    return sorted(f"{module}.{name}.{METHOD}" for (module, name), cls in _trainer_classes()
                  if hasattr(cls.__dict__.get(METHOD), "_seqpack_original"))


def patch_trainers(trees: str = "auto") -> List[str]:
    """Replaces ``_get_per_token_logps_and_entropies`` of TRL's ``GRPOTrainer`` and
    ``RLOOTrainer`` (idempotent) and refuses ``AsyncGRPOTrainer``; returns the
    replaced ``module.Class.method`` names. ``trees``: ``"auto"`` runs a batch as a
    tree when the tree pays for it (:mod:`~seqpack.frameworks.trl.choice`),
    ``"always"`` whenever a tree can take it."""
    from trl.trainer import base_trainer

    if trees not in ("auto", "always"):
        raise ValueError(f"trees must be 'auto' (a tree when it pays) or 'always', got {trees!r}")
    _POLICY["trees"] = trees

    for key, cls in _trainer_classes():
        if not hasattr(cls.__dict__.get(METHOD), "_seqpack_original"):
            _ORIGINAL[key] = cls.__dict__[METHOD]
            setattr(cls, METHOD, _make_method(_ORIGINAL[key]))
        if "training_step" in cls.__dict__ and not hasattr(cls.__dict__["training_step"], "_seqpack_original"):
            _ORIGINAL[key + ("training_step",)] = cls.__dict__["training_step"]
            cls.training_step = _make_training_step(cls.__dict__["training_step"])
    base = base_trainer._BaseTrainer
    if not hasattr(base.__dict__["__init__"], "_seqpack_original"):
        _BASE_INIT["init"] = base.__dict__["__init__"]
        base.__init__ = _refuse_async(_BASE_INIT["init"])
    return patched_trainer_names()


def unpatch_trainers() -> List[str]:
    """Restores TRL's methods and every model's forward and attention the patch
    changed; returns the restored names."""
    from trl.trainer import base_trainer

    restored = patched_trainer_names()
    for key, cls in _trainer_classes():
        if key in _ORIGINAL and hasattr(cls.__dict__.get(METHOD), "_seqpack_original"):
            setattr(cls, METHOD, _ORIGINAL.pop(key))
        step_key = key + ("training_step",)
        if step_key in _ORIGINAL and hasattr(cls.__dict__.get("training_step"), "_seqpack_original"):
            cls.training_step = _ORIGINAL.pop(step_key)
    if "init" in _BASE_INIT:
        base_trainer._BaseTrainer.__init__ = _BASE_INIT.pop("init")
    for model in list(_MODELS):
        _uninstall(model)
    _MODELS.clear()
    return restored
