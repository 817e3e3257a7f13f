"""Tiny Qwen-VL models and GRPO batches with images, built offline: what the VLM
tests, ``benchmarks/bench_vlm_tree.py`` and the docs run (imports torch and
transformers).

A batch holds prompts as a Qwen-VL processor lays them out - text, then each image
as ``<vision_start> <image_pad> x (t*h*w / merge**2) <vision_end>`` - and each
prompt's ``G`` completions, right-padded like the processor's rows::

    [1 VS I I I I VE 5 6 | c c c pad]     pixel_values: the prompt's image, once per row
    [1 VS I I I I VE 5 6 | c c pad pad]   image_grid_thw: [1, h, w] per row's image

>>> from seqpack.testing.tiny_vlm import tiny_vlm, vlm_grpo_batch   # doctest: +SKIP
>>> model = tiny_vlm("qwen2_vl")                                    # doctest: +SKIP
>>> batch = vlm_grpo_batch([[(4, 4)], [(4, 6)]], group_size=8)       # doctest: +SKIP
>>> model(**batch).logits.shape                                     # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

__all__ = ["FAMILIES", "IMAGE", "VIDEO", "VISION_START", "VISION_END", "tiny_vlm", "vlm_grpo_batch"]

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
VOCAB = 128
IMAGE, VIDEO, VISION_START, VISION_END = 120, 121, 122, 123
PATCH, TEMPORAL, MERGE, CHANNELS = 2, 2, 2, 3
PATCH_DIM = CHANNELS * TEMPORAL * PATCH * PATCH  # one row of pixel_values


def tiny_vlm(family: str = "qwen2_vl", *, dtype: Any = None, seed: int = 0, hidden: int = 32, layers: int = 2,
             vision_hidden: int = 16, vision_layers: int = 2, attn_implementation: Optional[str] = None) -> Any:
    """A randomly initialised ``<family>ForConditionalGeneration`` (``FAMILIES``):
    ``layers`` text layers of width ``hidden``, a vision tower of ``vision_layers``
    blocks of width ``vision_hidden``, patch 2 and merge 2, placeholder ids ``IMAGE``
    / ``VIDEO``, in ``dtype`` (default fp32), in eval mode."""
    import torch
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    heads = max(2, hidden // 16)
    head_dim = hidden // heads
    section = [head_dim // 8, head_dim // 8, head_dim // 2 - head_dim // 4]
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}
    text = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), rope_parameters=rope,
                max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    vision = dict(depth=vision_layers, num_heads=max(2, vision_hidden // 32), patch_size=PATCH,
                  spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL, in_channels=CHANNELS)
    if family == "qwen2_vl":
        vision.update(embed_dim=vision_hidden, hidden_size=hidden, mlp_ratio=2)
    elif family == "qwen2_5_vl":
        vision.update(hidden_size=vision_hidden, out_hidden_size=hidden, intermediate_size=2 * vision_hidden,
                      window_size=8, fullatt_block_indexes=[vision_layers - 1], tokens_per_second=2)
    else:
        text.update(head_dim=head_dim)
        rope["mrope_interleaved"] = True
        vision.update(hidden_size=vision_hidden, out_hidden_size=hidden, intermediate_size=2 * vision_hidden,
                      num_position_embeddings=64, deepstack_visual_indexes=[0])
    config = transformers.AutoConfig.for_model(family, text_config=text, vision_config=vision, image_token_id=IMAGE,
                                               video_token_id=VIDEO, vision_start_token_id=VISION_START,
                                               vision_end_token_id=VISION_END, tie_word_embeddings=False)
    torch.manual_seed(seed)
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    model = transformers.AutoModelForImageTextToText.from_config(config, dtype=dtype or torch.float32, **kwargs)
    return model.eval()


def vlm_grpo_batch(prompts: Sequence[Sequence[Tuple[int, ...]]], group_size: int, *, family: str = "qwen2_vl",
                   completion: Tuple[int, int] = (2, 8), text: int = 4, dtype: Any = None, seed: int = 0,
                   images: Optional[Dict[Tuple[int, ...], Any]] = None, trl: bool = False) -> Dict[str, Any]:
    """A padded GRPO batch as a Qwen-VL processor and a trainer hold it:
    ``input_ids`` / ``attention_mask`` / ``mm_token_type_ids`` ``[B, S]`` (right
    padding), ``pixel_values`` / ``image_grid_thw`` (each row's images, in row order;
    and ``pixel_values_videos`` / ``video_grid_thw`` where a prompt has videos).

    ``prompts``: per prompt, its items: ``(h, w)`` an image of ``h x w`` patches,
    ``(t, h, w)`` a video of ``t`` temporal patches (Qwen3-VL lays out each temporal
    patch as a frame after a timestamp token); ``h``, ``w`` even. Each prompt's rows
    share its items' pixels (drawn per ``(prompt, item)``; ``images`` maps an item's
    shape to fixed pixels instead, to repeat one image across prompts). ``text``
    tokens follow the items; completions have ``completion`` = (min, max) tokens.

    ``trl=True``: TRL's GRPO layout instead - prompts left-padded to one width, each
    completion after its prompt, right-padded - with ``num_images`` (per row) and
    ``logits_to_keep`` (the completion columns), as its
    ``_get_per_token_logps_and_entropies`` takes them."""
    import torch

    g = torch.Generator().manual_seed(seed)
    rows, pixels, grids, videos, video_grids = [], {}, {}, {}, {}
    for p, items in enumerate(prompts):
        ids, kinds = [1], [0]
        for shape in items:
            video = len(shape) == 3
            t, h, w = shape if video else (1, *shape)
            if h % MERGE or w % MERGE or t < 1:
                raise ValueError(f"item {tuple(shape)}: h and w must be even and t >= 1")
            fixed = None if images is None else images.get(tuple(shape))
            data = fixed if fixed is not None else torch.randn(t * h * w, PATCH_DIM, generator=g, dtype=torch.float64)
            (videos if video else pixels).setdefault(p, []).append(data.to(dtype or torch.float32))
            (video_grids if video else grids).setdefault(p, []).append([t, h, w])
            token, kind = (VIDEO, 2) if video else (IMAGE, 1)
            n = h * w // (MERGE * MERGE)
            # Qwen3-VL: each temporal patch a frame after its timestamp; else one run
            runs = [(10 + f, n) for f in range(t)] if video and family == "qwen3_vl" else [(None, n * t)]
            for stamp, count in runs:
                if stamp is not None:
                    ids.append(stamp), kinds.append(0)
                ids += [VISION_START] + [token] * count + [VISION_END]
                kinds += [0] + [kind] * count + [0]
        ids += [int(x) for x in torch.randint(20, 100, (text,), generator=g)]
        kinds += [0] * text
        for _ in range(group_size):
            c = int(torch.randint(completion[0], completion[1] + 1, (1,), generator=g))
            rows.append((p, ids, kinds, [int(x) for x in torch.randint(20, 100, (c,), generator=g)]))
    prompt_width = max(len(ids) for _, ids, _, _ in rows) if trl else 0
    width = max(len(ids) + len(c) + prompt_width - (len(ids) if trl else 0) for _, ids, _, c in rows)
    out = {"input_ids": torch.zeros(len(rows), width, dtype=torch.long),
           "attention_mask": torch.zeros(len(rows), width, dtype=torch.long),
           "mm_token_type_ids": torch.zeros(len(rows), width, dtype=torch.long)}
    picked, picked_grid, picked_video, picked_video_grid = [], [], [], []
    for b, (p, ids, kinds, c) in enumerate(rows):
        start = prompt_width - len(ids) if trl else 0  # TRL: prompts left-padded, completions after them
        end = start + len(ids) + len(c)
        out["input_ids"][b, start:end] = torch.tensor(ids + c)
        out["attention_mask"][b, start:end] = 1
        out["mm_token_type_ids"][b, start:start + len(ids)] = torch.tensor(kinds)
        picked += pixels.get(p, [])
        picked_grid += grids.get(p, [])
        picked_video += videos.get(p, [])
        picked_video_grid += video_grids.get(p, [])
    if picked:
        out["pixel_values"] = torch.cat(picked)
        out["image_grid_thw"] = torch.tensor(picked_grid)
    if picked_video:
        out["pixel_values_videos"] = torch.cat(picked_video)
        out["video_grid_thw"] = torch.tensor(picked_video_grid)
        if family == "qwen2_5_vl":
            out["second_per_grid_ts"] = torch.ones(len(picked_video_grid))
    if trl:
        out["num_images"] = [len(grids.get(p, [])) for p, *_ in rows]
        out["logits_to_keep"] = width - prompt_width
    return out
