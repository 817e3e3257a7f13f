"""The HF policy forward of NeMo-RL and verl on prefix trees: what each framework's
loss path consumes, from the tree micro-batches seqpack's iterators yield.

NeMo-RL (``shard_by_batch_size`` with ``shared_prefix``, the iterators'
``shared_prefix=True``: a :class:`~seqpack.frameworks.batched_data_dict.TreeMicroBatch`
per micro-batch)::

    for mb in batch.make_microbatch_iterator_for_packable_sequences(shared_prefix=True):
        logits = nemo_rl_tree_forward(model, mb)                       # [1, T, V], T physical tokens
        loss, metrics = SequencePackingLossWrapper(loss_fn, cu_seqlens_q=mb.tree)(logits, mb.data, ...)
        token_logprobs = nemo_rl_tree_logprobs(model, mb)              # get_logprobs: [B, S]

verl (``rearrange_micro_batches(batch, max_token_len, shared_prefix=True)``: padded
rows, prompts left-padded and responses right-padded, each micro-batch's tree under
the cap)::

    out = verl_tree_forward(model, micro_batch, temperature, calculate_entropy=True)
    out["log_probs"], out["entropy"]                                   # [B, response_length]

``model`` is a transformers causal LM, bare or under FSDP / DDP / PEFT: it is called
through its wrappers, and the transformers model under them is switched to the tree
implementation over its own attention once (:func:`~seqpack.frameworks.hf_tree.
use_tree_attention`; calls without a tree still run its own).

Importing this module does not import torch.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import numpy as np

from ._completion_trees import completion_logprobs
from .hf_tree import TREE_KWARG, use_tree_attention, pass_model_kwargs

__all__ = ["tree_model", "nemo_rl_tree_forward", "nemo_rl_tree_logprobs", "verl_tree_forward"]


def tree_model(model: Any) -> Any:
    """``model`` with the transformers model under its wrappers (``.module`` of FSDP /
    DDP, PEFT's ``get_base_model()``) on a tree implementation; returns ``model``."""
    inner = model
    for _ in range(8):
        if hasattr(inner, "set_attn_implementation") and hasattr(inner, "config"):
            use_tree_attention(inner)
            return model
        inner = inner.get_base_model() if hasattr(inner, "get_base_model") else getattr(inner, "module", None)
        if inner is None:
            break
    raise TypeError(f"{type(model).__name__} is not a transformers model (nor one under FSDP, DDP or PEFT): the tree "
                    f"needs a model whose attention implementation can be set")


def nemo_rl_tree_forward(model: Any, mb: Any, **model_kwargs: Any) -> Any:
    """The logits of a :class:`~seqpack.frameworks.batched_data_dict.TreeMicroBatch`:
    ``[1, T, V]`` at its tree's physical tokens, what
    ``SequencePackingLossWrapper(loss_fn, cu_seqlens_q=mb.tree)`` takes as
    ``next_token_logits`` (with ``mb.data``). ``model_kwargs`` go to the model."""
    tree = _tree_of(mb)
    kw = tree.hf_kwargs(_device(model))
    return tree_model(model)(**{**kw, "use_cache": False, **model_kwargs}).logits


def nemo_rl_pass_forward(model: Any, input_ids: Any, position_ids: Any, layout: Any, **model_kwargs: Any) -> Any:
    """The logits ``[1, N, V]`` of one pass of a batch planned for prefix reuse: the
    ``forward=`` of the :func:`seqpack.prefix_reuse` step NeMo-RL's iterators run (a
    transformers ``model``, bare or under FSDP / DDP / PEFT, on the tree attention)."""
    hf_model = tree_model(model)
    out = hf_model(input_ids=input_ids[None], position_ids=position_ids[None], use_cache=False,
                   **{TREE_KWARG: layout}, **pass_model_kwargs(hf_model, model_kwargs))
    return out.logits


def nemo_rl_tree_logprobs(model: Any, mb: Any, *, temperature: Any = 1.0, **model_kwargs: Any) -> Any:
    """NeMo-RL's ``get_logprobs`` of a tree micro-batch: ``[B, S]`` (``mb.data``'s
    ``input_ids`` shape), column ``t`` the log-prob of token ``t`` given the tokens
    before it, 0 at column 0 and past each row's length; fp32. On a pass of a batch
    planned for prefix reuse, the columns this pass predicts (0 elsewhere): the
    passes' results sum to the rows'."""
    import torch

    from ..training.ops import token_logprobs

    if getattr(mb, "pass_micro_batch", None) is not None:
        layout, tree = mb.tree, mb.tree.tree
        logits = mb.forward(model, **model_kwargs)[0]
    else:
        layout = tree = _tree_of(mb)
        logits = nemo_rl_tree_forward(model, mb, **model_kwargs)[0]
    lp = token_logprobs(logits, layout, temperature=temperature).logprobs.float()  # [N]: token i predicts i + 1
    ids = mb.data["input_ids"]
    rows, width = int(ids.shape[0]), int(ids.shape[1])
    cu = np.asarray(tree.cu_seqlens, dtype=np.int64)
    lengths = np.diff(cu)
    if lengths.shape[0] != rows or (rows and int(lengths.max()) > width):
        raise ValueError(f"mb.tree's {lengths.shape[0]} rows (longest {int(lengths.max(initial=0))}) do not fit "
                         f"mb.data['input_ids'] {tuple(ids.shape)}")
    # logical token i of row r (at column j) predicts column j + 1; a row's last token predicts nothing
    row_of = np.repeat(np.arange(rows, dtype=np.int64), lengths)
    column = np.arange(cu[-1], dtype=np.int64) - cu[row_of]
    keep = column + 1 < lengths[row_of]
    source = torch.from_numpy(np.flatnonzero(keep)).to(lp.device)
    target = torch.from_numpy(row_of[keep] * width + column[keep] + 1).to(lp.device)
    return lp.new_zeros(rows * width).index_copy(0, target, lp.index_select(0, source)).view(rows, width)


def verl_tree_forward(model: Any, micro_batch: Any, temperature: Any = 1.0, calculate_entropy: bool = False,
                      **model_kwargs: Any) -> Dict[str, Optional[Any]]:
    """verl's actor forward of one micro-batch on its prefix tree: ``{"log_probs",
    "entropy"}`` ``[B, response_length]`` (``response_length = responses.shape[-1]``)
    as verl's padded path gives them (``logits[:, -response_length - 1:-1] /
    temperature``), 0 at padded response columns (verl masks those with
    ``response_mask``); ``entropy`` None unless ``calculate_entropy``.

    Args:
        model: the actor module (transformers causal LM, or FSDP / DDP / PEFT around one).
        micro_batch: a ``DataProto``, ``TensorDict`` or dict with ``input_ids``,
            ``attention_mask`` ``[B, S]`` and ``responses`` ``[B, R]`` - one of
            ``rearrange_micro_batches(..., shared_prefix=True)``'s micro-batches, or
            verl's own.
        temperature: a number (Python, NumPy or 0-d tensor); verl divides the logits by it.
        calculate_entropy: also the entropy of each response token's distribution.
        model_kwargs: passed to the model.
    """
    data = getattr(micro_batch, "batch", micro_batch)  # a DataProto's tensors
    ids = data["input_ids"] if "input_ids" in data.keys() else None
    if getattr(ids, "is_nested", False):
        raise ValueError("micro_batch is verl's engine TensorDict (nested input_ids, verl >= 0.9): its forward returns "
                         "the engine's nested full-length layout, seqpack.frameworks.verl.tree_forward_step")
    for key in ("input_ids", "attention_mask", "responses"):
        if key not in data.keys():
            raise KeyError(f"micro_batch has no {key!r} (verl's actor forward reads input_ids, attention_mask and "
                           f"responses)")
    extra = getattr(micro_batch, "non_tensor_batch", None) or {}
    if "multi_modal_inputs" in extra or "multi_modal_inputs" in data.keys():
        raise ValueError("micro_batch holds multi_modal_inputs: the tree forward runs text rows only (the images "
                         "would be left out); run vision-language micro-batches on verl's own forward")
    if "position_ids" in data.keys() and data["position_ids"].dim() == 3:
        raise ValueError("micro_batch['position_ids'] is 3-D (M-RoPE): the tree forward numbers tokens by their depth "
                         "(1-D positions); run vision-language micro-batches on verl's own forward")
    if hasattr(temperature, "numel") and temperature.numel() != 1:
        raise ValueError(f"temperature must be one number for the micro-batch (the tree shares rows), got a tensor "
                         f"of shape {tuple(temperature.shape)}")
    ids = data["input_ids"]
    tree_model(model)
    lp, ent = completion_logprobs(model, ids, data["attention_mask"], int(data["responses"].shape[-1]),
                                  temperature=float(temperature), return_entropy=calculate_entropy, **model_kwargs)
    return {"log_probs": lp, "entropy": ent}


def _tree_of(mb: Any) -> Any:
    from ..tensors.layout_kinds import as_tree

    tree = getattr(mb, "tree", None)
    if tree is None:
        raise TypeError(f"mb must be a TreeMicroBatch (the shared_prefix=True iterators' items), got "
                        f"{type(mb).__name__}")
    return as_tree(tree)


def _device(model: Any) -> Any:
    for p in model.parameters():
        return p.device
    return None
