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
each tower, read from the model's config: the vision blocks per patch and per pair of
patches that attend to each other (those of one temporal patch; Qwen2.5-VL's windowed
blocks are counted as full, an upper bound), over the language model's cost per pair.

Importing this module does not import torch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["vision_flops", "vision_forest", "vision_work"]


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


def vision_flops(model: Any, grid_thw: Any) -> np.ndarray:
    """The vision tower's forward + backward FLOPs on items of these ``grid_thw``
    ([n, 3]: temporal, height and width patches): per patch, its blocks' projections
    and MLP; per pair of patches of one temporal patch, attention (the towers attend
    within each temporal patch: ``t·(h·w)²`` pairs; Qwen2.5-VL's windowed blocks are
    counted as full, an upper bound). float64 [n]."""
    from .hf_vlm import _family

    tower, _ = _towers(_family(model))
    grid = np.asarray(grid_thw, dtype=np.float64).reshape(-1, 3)
    t, hw = grid[:, 0], grid[:, 1] * grid[:, 2]
    return tower.per_token * t * hw + tower.per_token_squared * t * hw * hw


def vision_work(model: Any, grid_thw: Any) -> np.ndarray:
    """:func:`vision_flops` in the language model's pair units (what a cost model's
    ``per_token_squared`` multiplies; a plain row of ``s`` tokens weighs about
    ``s**2``): int64 [n], rounded up."""
    from .hf_vlm import _family

    _, language = _towers(_family(model))
    return np.ceil(vision_flops(model, grid_thw) / language.per_token_squared).astype(np.int64)


def vision_forest(model: Any, input_ids: Any, attention_mask: Any, *, group_ids: Any = None,
                  min_shared_tokens: Any = 1, **multimodal: Any) -> Any:
    """The :class:`~seqpack.PrefixForest` of padded VLM rows (the batch as the
    processor gives it: ``pixel_values``, ``image_grid_thw``, ...; see
    :func:`seqpack.frameworks.hf_tree.tree_kwargs`) for the planners: rows share
    an image's tokens exactly when they hold that image, and each image is a work item
    of :func:`vision_work`, counted once per micro-batch whose tree holds it. Plan with
    an attention-aware cost (``plan_micro_batches(..., forest=, attention_coeff=)``,
    ``plan_step(..., forest=, cost=)``) and lay each micro-batch out with
    ``PrefixTreeBatch.from_padded(..., keys=image_keys(...))``."""
    from ..planning.prefix_forest import PrefixForest
    from .hf_vlm import padded_items

    ids, mask, found = padded_items(model, input_ids, attention_mask, multimodal)
    rows = [row for _, _, row, _ in found.items]
    ends = [int(tokens[-1]) + 1 - int(found.cu[row]) for _, _, row, tokens in found.items]  # within its row
    grids = [found.grid_of(i) for i in range(len(found.items))]
    return PrefixForest.from_padded(found.keys(ids, mask), mask, group_ids=group_ids,
                                    min_shared_tokens=min_shared_tokens,
                                    work_items=(rows, ends, vision_work(model, grids)) if grids else None)
