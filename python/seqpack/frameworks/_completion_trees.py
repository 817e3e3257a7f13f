"""Prompt + completion rows as RL trainers hold them, on a prefix tree.

TRL (``_get_per_token_logps_and_entropies``) and verl (``_forward_micro_batch``)
hold a batch as padded rows - prompts left-padded, completions (responses)
right-padded - and want ``[B, C]`` log-probs of the completion tokens: column ``j``
the log-prob of completion token ``j`` given everything before it. On a tree those
come from the logical tokens just before each real completion token::

    row  [pad p0 p1 | c0 c1 pad]      logical: p0 p1 c0 c1
    out  [lp(c0|p0 p1), lp(c1|p0 p1 c0), 0]      scored: p1, c0 (they predict c0, c1)

:func:`completion_tree` builds the tree and that map; :func:`to_completions` lays
the tree's logical values out as ``[B, C]``; :func:`completion_logprobs` runs a
transformers model end to end (its LM head applied only at the physical tokens
that predict a completion token: ``logits_to_keep``).

Importing this module does not import torch.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import numpy as np

__all__ = ["completion_tree", "to_completions", "completion_logprobs"]


def _host(x: Any, dtype=None) -> np.ndarray:
    return np.asarray(x.detach().cpu() if hasattr(x, "detach") else x, dtype=dtype)


def completion_tree(input_ids: Any, attention_mask: Any, completion_length: int, keys: Any = None):
    """The tree of padded rows and where its log-probs go in the ``[B, C]`` output
    (``C = completion_length``, the last columns): ``(tree, scored, source,
    target)`` - ``scored`` ``[N]`` the logical tokens whose next token is a real
    completion token, ``source`` their logical indices and ``target`` the flat
    ``b * C + j`` positions they fill. Host (NumPy) arrays; ``source`` / ``target``
    int64. Returns None when a real completion token has nothing before it in its
    row (TRL and verl score it from a pad token's hidden state; a tree cannot).
    ``keys`` [B, S]: what the rows share by (a VLM's images:
    :func:`seqpack.frameworks.hf_vlm.image_keys`); default the ids.

    >>> import torch
    >>> ids = torch.tensor([[0, 7, 8, 1, 2], [0, 7, 8, 3, 0]])   # prompt "7 8", completions "1 2" and "3"
    >>> mask = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 1, 0]])
    >>> tree, scored, source, target = completion_tree(ids, mask, 2)
    >>> tree.num_tokens, scored.astype(int).tolist(), source.tolist(), target.tolist()
    (5, [0, 1, 1, 0, 0, 1, 0], [1, 2, 5], [0, 1, 2])
    """
    from ..tensors.prefix_tree import PrefixTreeBatch

    ids = _host(input_ids, np.int64)
    mask = _host(attention_mask) != 0
    if ids.ndim != 2 or mask.shape != ids.shape:
        raise ValueError(f"input_ids and attention_mask must be [B, S] of one shape, got {ids.shape} and {mask.shape}")
    s, c = ids.shape[1], int(completion_length)
    if not 0 <= c <= s:
        raise ValueError(f"completion_length must be in [0, {s}] (the rows' columns), got {c}")
    rows, cols = np.nonzero(mask)  # the logical tokens, row by row in column order
    completion = cols >= s - c
    same_row = np.zeros(rows.shape[0], dtype=bool)
    same_row[1:] = rows[1:] == rows[:-1]
    if bool((completion & ~same_row).any()):
        return None
    scored = np.zeros(rows.shape[0], dtype=bool)
    scored[:-1] = completion[1:] & same_row[1:]
    source = np.flatnonzero(scored)
    target = rows[source + 1] * c + (cols[source + 1] - (s - c))
    return PrefixTreeBatch.from_padded(ids, mask, keys=keys), scored, source, target.astype(np.int64)


def to_completions(values: Sequence[Optional[Any]], source: np.ndarray, target: np.ndarray,
                   shape: Tuple[int, int]) -> Tuple[Optional[Any], ...]:
    """Each of ``values`` (logical ``[N]`` tensors, or None) laid out as ``shape``
    ``[B, C]``: ``out.view(-1)[target] = v[source]``, 0 elsewhere; differentiable."""
    import torch

    out = []
    for v in values:
        if v is None:
            out.append(None)
            continue
        src = torch.from_numpy(source).to(v.device)
        dst = torch.from_numpy(target).to(v.device)
        out.append(v.new_zeros(shape[0] * shape[1]).index_copy(0, dst, v.index_select(0, src)).view(shape))
    return tuple(out)


def completion_logprobs(model: Any, input_ids: Any, attention_mask: Any, completion_length: int, *,
                        temperature: Any = 1.0, return_entropy: bool = False, found: Any = None,
                        multimodal: Any = None, **model_kwargs: Any):
    """``[B, C]`` log-probs (and entropies) of the completion tokens of padded rows,
    from a transformers causal LM run once on their prefix tree: ``model(input_ids
    [1, T], position_ids [1, T] (depths), prefix_tree=tree, logits_to_keep=rows)``
    through whatever wraps it (FSDP, DDP, PEFT), its LM head applied only at the
    ``rows`` that predict a completion token, then :func:`seqpack.token_logprobs`
    on those rows (``temperature`` divides the logits first). 0 where a completion
    column is padding. The model must run a tree implementation
    (:func:`seqpack.frameworks.hf_tree.use_tree_attention`).

    ``found``: :func:`completion_tree` of the same rows, when the caller built it already
    (for a VLM, with the rows keyed by :func:`~seqpack.frameworks.hf_vlm.image_keys`).
    ``multimodal``: a VLM's inputs of the rows (``pixel_values``, ``image_grid_thw``,
    ..., optionally their M-RoPE ``position_ids``), each distinct image encoded once
    (:func:`seqpack.frameworks.hf_tree.tree_kwargs`).

    Raises ValueError where a real completion token has no token before it."""
    import torch

    from ..tensors.tree_plans import scored_targets
    from ..training.logprobs_tree import tree_token_logprobs

    if found is None:
        keys = None
        if multimodal:
            from .hf_vlm import image_keys

            keys = image_keys(model, input_ids, attention_mask, **multimodal)
        found = completion_tree(input_ids, attention_mask, completion_length, keys=keys)
    if found is None:
        raise ValueError("a row's first completion (response) token has no prompt token before it: its log-prob "
                         "would come from a pad token's hidden state; give every row a prompt")
    tree, scored, source, target = found
    rows = torch.from_numpy(scored_targets(tree, scored)[0])
    device = input_ids.device if hasattr(input_ids, "device") else None
    if multimodal:
        from .hf_tree import tree_kwargs

        kw = tree_kwargs(tree, device, model=model, attention_mask=attention_mask, **multimodal)
    else:
        kw = tree.hf_kwargs(device)
    # attention_mask: the tree's row weights (an MoE model's load-balancing loss counted per row)
    out = model(**kw, use_cache=False, logits_to_keep=rows.to(kw["input_ids"].device), **model_kwargs)
    logits = out.logits[0]
    res = tree_token_logprobs(logits, tree, temperature=temperature, return_entropy=return_entropy, scored=scored)
    lp, ent = to_completions((res.logprobs, res.entropy), source, target, (int(input_ids.shape[0]),
                                                                          int(completion_length)))
    return lp, ent
