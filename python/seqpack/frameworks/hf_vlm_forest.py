"""Planning VLM rows: the vision tower's work in the forest, each distinct image once
(issue 53, item 4).

A micro-batch of VLM rows pays its language model per physical token and pair, and
its vision tower per distinct image it holds: the rows that share a prompt share its
image, and a micro-batch that holds two rows of one prompt encodes its image once,
while a prompt cut over two micro-batches is encoded in both (its placeholder tokens,
like the rest of its prefix, are in both trees). :func:`vision_forest` builds the
:class:`~seqpack.PrefixForest` of the rows with their images keyed by content
(:func:`~seqpack.frameworks.hf_vlm.image_keys`) and each image as a work item
(:attr:`~seqpack.PrefixForest.work_items`) weighing its vision tower's FLOPs in the
language model's pair units, so the planners balance micro-batches whose images
differ in size::

    prompt A: a 64 x 64-patch image, 8 rows      prompt B: a 4 x 4-patch image, 8 rows
    tokens: A ~ B                                vision: A = 256 x B (patches, and their squares)
    a token-balanced plan puts A's rows with B's; the vision-aware one sees A's image

The FLOPs are :meth:`CostModel.from_model <seqpack.CostModel.from_model>`'s count for
each tower, read from the model's config: the vision blocks (patches attend to every
patch of their image; Qwen2.5-VL's windowed blocks are counted as full, an upper
bound) per patch and per patch pair, over the language model's cost per pair.

Importing this module does not import torch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["vision_forest", "vision_work"]


def _towers(owner: Any) -> Any:
    """(vision tower cost model, language model cost model) in FLOPs, from the configs."""
    from ..planning.cost import CostModel

    text = owner.config.get_text_config()
    vision = owner.config.vision_config
    width = getattr(vision, "embed_dim", None) or vision.hidden_size
    inner = getattr(vision, "intermediate_size", None) or int(width * getattr(vision, "mlp_ratio", 4))
    blocks = getattr(getattr(owner, "visual", None), "blocks", None)
    gated = bool(blocks) and hasattr(blocks[0].mlp, "gate_proj")
    tower = CostModel.from_model(width, vision.depth, vision.num_heads, vision.num_heads, inner, 0,
                                 gated_mlp=gated, causal=False)
    language = CostModel.from_model(text.hidden_size, text.num_hidden_layers, text.num_attention_heads,
                                    getattr(text, "num_key_value_heads", None), text.intermediate_size,
                                    text.vocab_size, head_dim=getattr(text, "head_dim", None))
    return tower, language


def vision_work(model: Any, patches: Any) -> np.ndarray:
    """The vision tower's forward + backward work on images of ``patches`` patches
    each (``prod(grid_thw)``), in the language model's pair units (what a cost
    model's ``per_token_squared`` multiplies; a plain row of ``s`` tokens weighs
    about ``s**2``): int64, rounded up."""
    from .hf_vlm import _family

    tower, language = _towers(_family(model))
    p = np.asarray(patches, dtype=np.float64)
    return np.ceil((tower.per_token * p + tower.per_token_squared * p * p) / language.per_token_squared).astype(
        np.int64)


def vision_forest(model: Any, input_ids: Any, attention_mask: Any, *, group_ids: Any = None,
                  min_shared_tokens: Any = 1, **multimodal: Any) -> Any:
    """The :class:`~seqpack.PrefixForest` of padded VLM rows (the batch as the
    processor gives it: ``pixel_values``, ``image_grid_thw``, ...; see
    :func:`~seqpack.frameworks.hf_vlm.multimodal_kwargs`) for the planners: rows share
    an image's tokens exactly when they hold that image, and each image is a work item
    of :func:`vision_work`, counted once per micro-batch whose tree holds it. Plan with
    an attention-aware cost (``plan_micro_batches(..., forest=, attention_coeff=)``,
    ``plan_step(..., forest=, cost=)``) and lay each micro-batch out with
    ``PrefixTreeBatch.from_padded(..., keys=image_keys(...))``."""
    from ..planning.prefix_forest import PrefixForest
    from .hf_vlm import padded_items

    ids, mask, found = padded_items(model, input_ids, attention_mask, multimodal)
    keyed = ids[mask]
    rows, ends, patches = [], [], []
    for (kind, k, row, tokens), cls in zip(found.items, found.classes):
        keyed[tokens] = -1 - cls
        rows.append(row)
        ends.append(int(tokens[-1]) + 1 - int(found.cu[row]))  # the item's end within its row
        patches.append(int(np.prod(found.grids[kind][k])))
    keys = ids.copy()
    keys[mask] = keyed
    work = vision_work(model, patches) if patches else np.zeros(0, dtype=np.int64)
    return PrefixForest.from_padded(keys, mask, group_ids=group_ids, min_shared_tokens=min_shared_tokens,
                                    work_items=(rows, ends, work) if patches else None)
