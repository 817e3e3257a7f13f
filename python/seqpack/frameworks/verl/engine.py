"""verl's engine workers (0.9.1's training path): micro-batches of the engine's
no-padding TensorDicts, and the FSDP engine's forward on prefix trees.

verl 0.9.1 trains through ``TrainingWorker`` engines. The trainer turns a padded
batch into a TensorDict whose ``input_ids`` / ``position_ids`` are jagged nested
tensors (``left_right_2_no_padding``: real tokens only, a prompt and its response
back to back per row); the engine's ``prepare_micro_batches`` splits it with
``rearrange_micro_batches``; ``FSDPEngineWithLMHead.forward_step`` runs each
micro-batch and returns nested ``log_probs`` / ``entropy`` over every row's full
length, position ``t`` holding log p(token ``t + 1``), of which verl's losses read
the response positions::

    row  p0 p1 p2 r0 r1            input_ids (nested, no padding)
    out  .  .  lp(r0) lp(r1) 0     log_probs (nested); ppo_loss reads lp(r0), lp(r1)

- :func:`prepare_micro_batches`: verl's, on the same TensorDicts and metadata keys,
  with seqpack's rule (``strict=True``: the hard cap, counts agreed over the ranks;
  ``strict=False``: the released rule, identical indices).
- :func:`tree_forward_step`: a micro-batch on its prefix tree, the engine's
  ``model_output`` layout, equal at every position (a row's last one is 0).
- :func:`patch` puts both in verl's engine (``verl.workers.engine.utils``'s
  micro-batching and ``FSDPEngineWithLMHead.forward_step``); a micro-batch the tree
  cannot take, or that shares too little to pay for it, runs verl's own forward.
  Workers are other processes: name this module's :mod:`seqpack.frameworks.verl.
  tree_engine` in ``actor_rollout_ref.model.external_lib`` and every worker patches
  itself when it loads the model (docs/verl.md).

Importing this module does not import verl or torch.
"""

from __future__ import annotations

import contextvars
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np

__all__ = ["counts", "patch", "patched_names", "prepare_micro_batches", "tree_forward_step", "unpatch"]

# A micro-batch runs on its tree when it forwards at most this share of its rows'
# tokens (the tree path's own costs: a tree of rows that share nothing ran at 0.87x
# plain packing on an H200, benchmarks/results/gpu.md).
TREE_MAX_SHARE = 0.85
_ORIGINAL: Dict[str, Any] = {}  # what patch() replaced: "module.name" -> verl's object
_SETTINGS: Dict[str, Any] = {"shared_prefix": False, "strict": True, "prefix_reuse": False}
_COUNTS: Dict[str, int] = {}  # micro-batches run on trees / on verl's forward (by reason)
_RUNNING: "contextvars.ContextVar[Any]" = contextvars.ContextVar("seqpack_verl_engine", default=None)


def counts(reset: bool = False) -> Dict[str, int]:
    """Micro-batches the patched ``forward_step`` ran on trees (``"tree"``) and on
    verl's own forward (by reason) in this process.

    >>> counts()  # before any micro-batch
    {}
    """
    out = dict(_COUNTS)
    if reset:
        _COUNTS.clear()
    return out


def _meta(data: Any, key: str, default: Any) -> Any:
    """A TensorDict's metadata (``NonTensorData`` unwraps on ``[key]``) or ``default``."""
    return data[key] if key in data.keys() else default


def prepare_micro_batches(data: Any, dp_group=None, num_batches_divided_by: Optional[int] = None,
                          same_micro_num_in_dp: bool = True, min_num_micro_batch: Optional[int] = None,
                          use_dynamic_bsz_balance: bool = True, *, strict: Union[bool, str] = True,
                          shared_prefix: bool = False, group_key: Optional[str] = "uid"
                          ) -> Tuple[List[Any], Optional[List[List[int]]]]:
    """verl's ``verl.workers.engine.utils.prepare_micro_batches``: ``(micro_batches,
    batch_idx_list)`` of an engine TensorDict, reading the same metadata
    (``use_dynamic_bsz``, default on; ``max_token_len_per_gpu`` times ``sp_size``;
    ``force_group_size``; without dynamic batching ``micro_batch_size_per_gpu`` rows
    each, in order, and ``batch_idx_list`` None). Lengths come from the nested
    ``input_ids``' offsets (``attention_mask`` is not needed), rows are selected with
    their nested tensors and metadata (as verl's ``index_select_tensor_dict``).

    The other arguments are :func:`~seqpack.frameworks.verl.rearrange_micro_batches`'
    (``strict=False``: the released rule, identical indices; ``shared_prefix``: each
    micro-batch's prefix tree under the cap, rows sharing within one ``uid``).
    """
    from .seqlen_balancing import rearrange_micro_batches

    group = int(_meta(data, "force_group_size", 1))
    if _meta(data, "use_dynamic_bsz", True):
        if "max_token_len_per_gpu" not in data.keys():
            raise ValueError("use_dynamic_bsz needs 'max_token_len_per_gpu' in the batch (verl's engine sets it)")
        cap = int(data["max_token_len_per_gpu"]) * int(_meta(data, "sp_size", 1))
        return rearrange_micro_batches(data, cap, dp_group, num_batches_divided_by, same_micro_num_in_dp,
                                       min_num_micro_batch, use_dynamic_bsz_balance, group, strict=strict,
                                       shared_prefix=shared_prefix, group_key=group_key)
    rows, size = len(data), int(data["micro_batch_size_per_gpu"]) * group
    if rows % size:
        raise ValueError(f"the batch has {rows} rows, not a multiple of micro_batch_size_per_gpu x force_group_size "
                         f"= {size} (verl asserts the same)")
    from .restore import select_rows

    return [select_rows(data, list(range(s, s + size))) for s in range(0, rows, size)], None


def _rows(micro_batch: Any) -> Tuple[Any, Any, np.ndarray]:
    """A micro-batch's rows right-padded ``[B, W]`` with their mask, and their lengths."""
    import torch

    ids = micro_batch["input_ids"]
    if not (isinstance(ids, torch.Tensor) and ids.is_nested):
        raise ValueError("micro_batch['input_ids'] must be verl's nested rows (left_right_2_no_padding); padded "
                         "micro-batches of older verl go to seqpack.frameworks.verl.tree_forward_micro_batch")
    lengths = ids.offsets().diff()
    width = int(lengths.max()) if lengths.numel() else 0
    mask = torch.arange(width, device=ids.device)[None, :] < lengths[:, None]
    padded = ids.values().new_zeros(mask.shape)
    padded[mask] = ids.values()  # rows in order, real tokens only
    return padded, mask, lengths.cpu().numpy()


def _temperature(micro_batch: Any, temperature: Any) -> float:
    t = _meta(micro_batch, "temperature", 1.0) if temperature is None else temperature
    if hasattr(t, "numel"):
        if t.numel() != 1 and not bool((t == t.reshape(-1)[0]).all()):
            raise ValueError("a per-sample temperature that differs between rows: rows on one tree share their "
                             "prefix's logits (run this micro-batch on verl's own forward)")
        t = t.reshape(-1)[0]
    return float(t)


def tree_forward_step(module: Any, micro_batch: Any, *, temperature: Any = None,
                      calculate_entropy: Optional[bool] = None) -> Dict[str, Any]:
    """verl's engine ``model_output`` of one micro-batch, computed on its prefix tree:
    ``{"log_probs", "entropy"}`` jagged nested over each row's full length
    (``micro_batch['input_ids'].offsets()``), position ``t`` the log-prob of token
    ``t + 1`` of its row at ``temperature``, 0 at a row's last position (verl's own
    holds the next row's first token there; its losses do not read it); ``entropy``
    only with ``calculate_entropy``. Both default to the micro-batch's metadata
    (``temperature``: one value for the micro-batch; ``calculate_entropy``).

    ``module``: the engine's module (a transformers causal LM, bare or under FSDP /
    PEFT), switched to the tree implementation over its own attention once.
    """
    return _tree_outputs(module, micro_batch, temperature, calculate_entropy)


def _completion_tree(ids: Any, mask: Any, module: Any = None, multimodal: Any = None) -> Any:
    """The rows' tree, every token after a row's first scored (None for 1-token rows);
    a VLM's rows keyed by their images."""
    from .._completion_trees import completion_tree

    if ids.shape[1] < 2:
        return None
    keys = None
    if multimodal:
        from ..hf_vlm import image_keys

        keys = image_keys(module, ids, mask.long(), **multimodal)
    return completion_tree(ids, mask.long(), ids.shape[1] - 1, keys=keys)


# verl's per-row multimodal keys a tree reads (concatenated in row order) and those it
# leaves (mm_token_type_ids: per row, of the prompt only; the tree derives the types
# from the model's placeholder ids)
_MM_TAKEN = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
_MM_LEFT = ("mm_token_type_ids",)


def _multimodal_keys(micro_batch: Any) -> List[str]:
    """The keys of a micro-batch's ``multi_modal_inputs`` (a non-None value in some row)."""
    keys: Dict[str, None] = {}
    if "multi_modal_inputs" in micro_batch.keys():
        for inputs in micro_batch["multi_modal_inputs"]:
            for key, value in (getattr(inputs, "data", inputs) or {}).items():
                if value is not None:
                    keys[key] = None
    return list(keys)


def _multimodal(micro_batch: Any) -> Dict[str, Any]:
    """A VLM micro-batch's inputs as verl's engine hands them to the model
    (``multi_modal_inputs``: one dict per row, the images concatenated in row order,
    as ``extract_multi_modal_inputs`` does) with the rows' M-RoPE ``position_ids``
    ``[4, N]`` (the nested ``position_ids``' values); {} for a text micro-batch."""
    import torch

    out: Dict[str, Any] = {}
    if "multi_modal_inputs" in micro_batch.keys():
        collected: Dict[str, List[Any]] = {}
        for inputs in micro_batch["multi_modal_inputs"]:
            for key, value in (getattr(inputs, "data", inputs) or {}).items():  # NonTensorData or a dict
                if value is not None and key in _MM_TAKEN:
                    collected.setdefault(key, []).append(value)
        out = {key: torch.cat(values) for key, values in collected.items()}
    pos = micro_batch["position_ids"] if "position_ids" in micro_batch.keys() else None
    if out and pos is not None and pos.dim() == 3:
        out["position_ids"] = pos.values()
    return out


def _tree_outputs(module: Any, micro_batch: Any, temperature: Any, calculate_entropy: Optional[bool],
                  found: Any = None) -> Dict[str, Any]:
    """:func:`tree_forward_step`, reusing the rows' tree when the caller built it."""
    import torch

    from .._completion_trees import completion_logprobs
    from ..policy_forward import tree_model

    ids, mask, _ = _rows(micro_batch)
    multimodal = _multimodal(micro_batch)
    t = _temperature(micro_batch, temperature)
    entropy = bool(_meta(micro_batch, "calculate_entropy", False)) if calculate_entropy is None else calculate_entropy
    tree_model(module)
    offsets = micro_batch["input_ids"].offsets()
    out: Dict[str, Any] = {}
    if ids.shape[1] < 2:  # no token has a next one
        zeros = torch.zeros(int(mask.sum()), device=ids.device)
        out["log_probs"] = torch.nested.nested_tensor_from_jagged(zeros, offsets)
        if entropy:
            out["entropy"] = torch.nested.nested_tensor_from_jagged(zeros.clone(), offsets)
        return out
    # every token after a row's first is a "completion" token of the padded rows: column
    # j of the result is token j + 1 given the tokens before it, i.e. position j's output
    if found is None and multimodal:
        found = _completion_tree(ids, mask, module, multimodal)
    lp, ent = completion_logprobs(module, ids, mask.long(), ids.shape[1] - 1, temperature=t,
                                  return_entropy=entropy, found=found, multimodal=multimodal or None)
    for key, value in (("log_probs", lp), ("entropy", ent)):
        if value is None:
            continue
        full = torch.cat([value, value.new_zeros(value.shape[0], 1)], dim=1)  # a row's last position
        out[key] = torch.nested.nested_tensor_from_jagged(full[mask], offsets)
    return out


def _value_head(engine: Any) -> bool:
    """An engine whose outputs are not the LM head's log-probs (verl's critic,
    ``FSDPEngineWithValueHead``: it overrides ``prepare_model_outputs``)."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    return type(engine).prepare_model_outputs is not FSDPEngineWithLMHead.prepare_model_outputs


def _tree_reason(engine: Any, micro_batch: Any) -> Optional[str]:
    """Why verl's own forward runs this micro-batch, or None for the tree."""
    if _value_head(engine):
        return "a value head"
    if int(_meta(micro_batch, "sp_size", 1)) != 1 or getattr(engine, "ulysses_sequence_parallel_size", 1) != 1:
        return "Ulysses sequence parallelism"
    if _meta(micro_batch, "use_fused_kernels", False):
        return "fused kernels"
    for key in ("calculate_sum_pi_squared", "distillation_use_topk"):
        if _meta(micro_batch, key, False):
            return key
    if any(k.startswith("teacher_") for k in micro_batch.keys()):
        return "distillation"
    pos = micro_batch["position_ids"] if "position_ids" in micro_batch.keys() else None
    if "multi_modal_inputs" in micro_batch.keys() or (pos is not None and pos.dim() != 2):
        from ..hf_vlm import vision_family

        if vision_family(engine.module) is None:
            return "multi-modal inputs or 3-D position ids (M-RoPE) of a model without get_rope_index"
        unknown = sorted(set(_multimodal_keys(micro_batch)) - set(_MM_TAKEN) - set(_MM_LEFT))
        if unknown:
            return f"multi-modal inputs {unknown}"
    if _meta(micro_batch, "pad_to_length", None):
        return "pad_to_length"
    return None


def _forward_step(original: Any):
    def forward_step(self, micro_batch, loss_function, forward_only):
        passes = "seqpack_pass" in micro_batch.keys()
        reason = "shared_prefix off" if not _SETTINGS["shared_prefix"] else _tree_reason(self, micro_batch)
        if passes and reason is not None:
            raise ValueError(f"prefix_reuse: a pass micro-batch cannot run on verl's own forward ({reason}): patch "
                             "with prefix_reuse=False for such batches")
        found = None
        if passes and set(_multimodal_keys(micro_batch)) & set(_MM_TAKEN):
            raise ValueError("prefix_reuse: a pass carries no images; run a VLM's batches with prefix_reuse=False "
                             "(each micro-batch on its tree encodes every distinct image once)")
        if reason is None and not passes:  # the tree is built once: to price the micro-batch, then to run it
            ids, mask, _ = _rows(micro_batch)
            found = _completion_tree(ids, mask, self.module, _multimodal(micro_batch))
            if found is None or found[0].num_tokens > TREE_MAX_SHARE * int(mask.sum()):
                reason = "shares too little"
        name = reason or ("prefix_reuse" if passes else "tree")
        _COUNTS[name] = _COUNTS.get(name, 0) + 1
        if reason is not None:
            return original(self, micro_batch, loss_function, forward_only)
        import contextlib

        import torch
        from verl.utils.device import get_device_id, get_device_name
        from verl.workers.engine.utils import detach_tree

        device = get_device_name()
        micro_batch = micro_batch.to(get_device_id())
        dtype = getattr(self, "_autocast_dtype", torch.bfloat16)  # the engine's mixed precision, as its own step
        autocast = contextlib.nullcontext() if dtype == torch.float32 else torch.autocast(device_type=device,
                                                                                            dtype=dtype)
        with autocast:
            if passes:
                from .prefix_reuse import check_loss_splits, pass_outputs

                check_loss_splits(loss_function, micro_batch)
                model_output = pass_outputs(self.module, micro_batch, _temperature(micro_batch, None),
                                            bool(_meta(micro_batch, "calculate_entropy", False)))
            else:
                model_output = _tree_outputs(self.module, micro_batch, None, None, found)
            if loss_function is not None:
                loss, metrics = loss_function(model_output=model_output, data=micro_batch,
                                              dp_group=self.get_data_parallel_group())
            else:
                loss, metrics = torch.tensor(1.0, device=device), {}
        return loss, {"model_output": detach_tree(model_output), "loss": loss.detach().item(), "metrics": metrics}

    forward_step._seqpack_original = original
    return forward_step


def _forward_backward_batch(original: Any):
    """verl's ``forward_backward_batch``, the running engine remembered: the engine's
    micro-batching (a module function) runs passes for an LM-head engine only (verl's
    critic runs the trees, its values not split over passes)."""
    def forward_backward_batch(self, data, loss_function, forward_only=False):
        token = _RUNNING.set(self)
        try:
            return original(self, data, loss_function, forward_only)
        finally:
            _RUNNING.reset(token)

    forward_backward_batch._seqpack_original = original
    return forward_backward_batch


def _engine_rearrange(original: Any):
    def rearrange_micro_batches(batch, max_token_len, dp_group=None, num_batches_divided_by=None,
                                same_micro_num_in_dp=True, min_num_micro_batch=None, use_dynamic_bsz_balance=True,
                                force_group_size=1):
        from .seqlen_balancing import rearrange_micro_batches as ours

        shared = _SETTINGS["shared_prefix"] and _SETTINGS["strict"] is True
        engine = _RUNNING.get()
        lm_head = engine is not None and not _value_head(engine)
        return ours(batch, max_token_len, dp_group, num_batches_divided_by, same_micro_num_in_dp, min_num_micro_batch,
                    use_dynamic_bsz_balance, force_group_size, strict=_SETTINGS["strict"], shared_prefix=shared,
                    prefix_reuse=shared and _SETTINGS["prefix_reuse"] and lm_head)

    rearrange_micro_batches._seqpack_original = original
    return rearrange_micro_batches


def patch(shared_prefix: bool = False, *, strict: Union[bool, str] = True, prefix_reuse: bool = False) -> List[str]:
    """seqpack in verl's engine workers, in this process:

    - ``verl.workers.engine.utils.rearrange_micro_batches`` (what the engine's
      ``prepare_micro_batches`` calls) and ``restore_dynamic_batch`` become
      seqpack's: the hard cap (``strict=True``) or the released rule
      (``strict=False``), dummies of a step plan dropped on restore;
    - with ``shared_prefix``, micro-batches planned as prefix trees under the cap and
      ``FSDPEngineWithLMHead.forward_step`` running each on its tree
      (:func:`tree_forward_step`, verl's autocast and loss), verl's own forward for a
      micro-batch the tree cannot take (Ulysses SP, fused kernels, multi-modal or
      distillation inputs, ``pad_to_length``) or that shares too little to pay
      (its tree above ``TREE_MAX_SHARE`` of its tokens);
    - with ``prefix_reuse`` too, a tree larger than the cap runs as passes
      (:mod:`seqpack.frameworks.verl.prefix_reuse`: each shared prefix forwarded and
      back-propagated once in the step; ``counts()["prefix_reuse"]`` counts them) in
      the LM-head engines (``forward_backward_batch`` remembers the running engine;
      verl's critic keeps micro-batches of rows, on verl's own forward).

    Idempotent (a later call changes the settings); :func:`unpatch` restores verl's.
    Returns the names that are seqpack's now."""
    import logging

    import verl.workers.engine.utils as engine_utils
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    from .seqlen_balancing import _mode_of, restore_dynamic_batch

    _mode_of(strict)
    if prefix_reuse and not (shared_prefix and strict is True):
        raise ValueError("patch(prefix_reuse=True) runs prefix trees in passes: it needs shared_prefix=True and "
                         "strict=True")
    _SETTINGS.update(shared_prefix=bool(shared_prefix), strict=strict, prefix_reuse=bool(prefix_reuse))
    replaced = []
    if not hasattr(engine_utils.rearrange_micro_batches, "_seqpack_original"):
        _ORIGINAL["rearrange_micro_batches"] = engine_utils.rearrange_micro_batches
        _ORIGINAL["restore_dynamic_batch"] = engine_utils.restore_dynamic_batch
        engine_utils.rearrange_micro_batches = _engine_rearrange(engine_utils.rearrange_micro_batches)
        engine_utils.restore_dynamic_batch = restore_dynamic_batch
        replaced += ["verl.workers.engine.utils.rearrange_micro_batches",
                     "verl.workers.engine.utils.restore_dynamic_batch"]
    if not hasattr(FSDPEngineWithLMHead.__dict__["forward_step"], "_seqpack_original"):
        _ORIGINAL["forward_step"] = FSDPEngineWithLMHead.__dict__["forward_step"]
        FSDPEngineWithLMHead.forward_step = _forward_step(_ORIGINAL["forward_step"])
        replaced.append("verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead.forward_step")
    if not hasattr(FSDPEngineWithLMHead.forward_backward_batch, "_seqpack_original"):
        # set on the LM-head class (inherited from FSDPEngine until now; the critic's subclass inherits it)
        FSDPEngineWithLMHead.forward_backward_batch = _forward_backward_batch(
            FSDPEngineWithLMHead.forward_backward_batch)
        replaced.append("verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead.forward_backward_batch")
    if replaced:
        logging.getLogger(__name__).warning("seqpack.frameworks.verl.engine.patch(): verl's %s replaced by seqpack's "
                                            "(shared_prefix=%s, strict=%r, prefix_reuse=%s)", ", ".join(replaced),
                                            shared_prefix, strict, prefix_reuse)
    return patched_names()


def patched_names() -> List[str]:
    """The verl names that are seqpack's now."""
    import sys

    utils = sys.modules.get("verl.workers.engine.utils")
    impl = sys.modules.get("verl.workers.engine.fsdp.transformer_impl")
    names = []
    if utils is not None and hasattr(utils.rearrange_micro_batches, "_seqpack_original"):
        names += ["verl.workers.engine.utils.rearrange_micro_batches", "verl.workers.engine.utils.restore_dynamic_batch"]
    if impl is not None and hasattr(impl.FSDPEngineWithLMHead.__dict__["forward_step"], "_seqpack_original"):
        names.append("verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead.forward_step")
    if impl is not None and hasattr(impl.FSDPEngineWithLMHead.forward_backward_batch, "_seqpack_original"):
        names.append("verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead.forward_backward_batch")
    return names


def unpatch() -> List[str]:
    """verl's own again; returns the names restored."""
    import sys

    restored = patched_names()
    utils = sys.modules.get("verl.workers.engine.utils")
    impl = sys.modules.get("verl.workers.engine.fsdp.transformer_impl")
    if utils is not None and "rearrange_micro_batches" in _ORIGINAL:
        utils.rearrange_micro_batches = _ORIGINAL.pop("rearrange_micro_batches")
        utils.restore_dynamic_batch = _ORIGINAL.pop("restore_dynamic_batch")
    if impl is not None and "forward_step" in _ORIGINAL:
        impl.FSDPEngineWithLMHead.forward_step = _ORIGINAL.pop("forward_step")
    if impl is not None and "forward_backward_batch" in impl.FSDPEngineWithLMHead.__dict__:
        del impl.FSDPEngineWithLMHead.forward_backward_batch  # FSDPEngine's again
    _SETTINGS.update(shared_prefix=False, strict=True, prefix_reuse=False)
    return restored
