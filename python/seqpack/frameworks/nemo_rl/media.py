"""NeMo-RL's multimodal rules on a batch's data: which keys hold media, the coupled
media keys whose per-row segment counts must agree, and ``repeat_interleave`` with
only media shared between the copies.

    >>> from seqpack.frameworks.nemo_rl.media import repeat_rows
    >>> out = repeat_rows({"vllm_images": [[{"type": "image", "px": bytearray(b"png")}]], "text": [["hi"]]}, 2,
    ...                   share_immutable_media=True)
    >>> out["vllm_images"][0][0]["px"] is out["vllm_images"][1][0]["px"], out["text"][0] is out["text"][1]
    (True, False)

Importing this module does not import torch.
"""

from __future__ import annotations

import copy
from typing import Any, Collection, Dict, List, Mapping, Sequence

from .._batch import is_packed, is_tensor
from .errors import check

__all__ = ["COUPLED_MEDIA_KEYS", "MEDIA_CONTENT_TYPES", "NATIVE_MEDIA_KEYS", "multimodal_dict", "repeat_rows"]

# NeMo-RL's media vocabulary (nemo_rl.data.multimodal_utils): the row keys holding
# native vLLM media, and the ``"type"`` of a content part that is media.
NATIVE_MEDIA_KEYS = frozenset({"vllm_content", "vllm_images", "vllm_videos", "vllm_audios"})
MEDIA_CONTENT_TYPES = frozenset({"input_image", "image", "image_url", "video", "audio"})
# Media values and the per-segment metadata that must stay aligned with them, as NeMo-RL checks.
COUPLED_MEDIA_KEYS = (("pixel_values", "image_grid_thw"), ("pixel_values", "imgs_sizes"),
                      ("pixel_values", "num_frames"), ("pixel_values_videos", "video_grid_thw"))


def _media_memo(item: Any, media_keys: Collection[str], in_media: bool = False) -> Dict[int, Any]:
    """Prepare one row for sharing its media, as NeMo-RL does: every ``PackedTensor``
    in it is flagged for deduplication (its own ``deepcopy`` then shares its
    segments), and a ``deepcopy`` memo maps to itself every leaf under a media key
    (``media_keys``) or inside a typed media content part (``{"type": "image", ...}``),
    so copies share those leaves. Everything else (``token_ids`` tensors, text, every
    container) is copied."""
    memo: Dict[int, Any] = {}
    stack = [(item, in_media)]
    while stack:
        x, media = stack.pop()
        if is_packed(x):
            if callable(getattr(x, "enable_deduplication", None)):
                x.enable_deduplication()
            else:  # an older PackedTensor, without deduplication: its segments are shared directly
                memo.update((id(t), t) for t in getattr(x, "tensors", ()) if t is not None)
        elif isinstance(x, Mapping):
            kind = x.get("type")
            typed = isinstance(kind, str) and kind in MEDIA_CONTENT_TYPES
            stack.extend((v, media or typed or k in media_keys) for k, v in x.items())
        elif isinstance(x, (list, tuple)):
            stack.extend((v, media) for v in x)
        elif media:
            memo[id(x)] = x
    return memo


def repeat_rows(data: Mapping[str, Any], num_repeats: int, *, share_immutable_media: bool = False,
                media_keys: Collection[str] = ()) -> Dict[str, Any]:
    """Every row repeated ``num_repeats`` times (``BatchedDataDict.repeat_interleave``).
    List items are deep copies; with ``share_immutable_media`` only media is shared
    between the copies (every ``PackedTensor`` flagged for deduplication, the leaves
    under :data:`NATIVE_MEDIA_KEYS` and ``media_keys`` or inside a typed media content
    part); token ids, text and every container are still copied."""
    shared_keys = NATIVE_MEDIA_KEYS.union((media_keys,) if isinstance(media_keys, str) else media_keys)
    out: Dict[str, Any] = {}
    for key, v in data.items():
        if is_tensor(v):
            out[key] = v.repeat_interleave(num_repeats, dim=0)
        elif is_packed(v):
            raise NotImplementedError("PackedTensor does not currently support repeat_interleave")
        else:
            repeated = []
            for item in v:
                memo = _media_memo(item, shared_keys, key in shared_keys) if share_immutable_media else {}
                repeated.extend(copy.deepcopy(item, dict(memo)) for _ in range(num_repeats))
            out[key] = repeated
    return out


def _row_mapped(v: Any) -> bool:
    """A ``PackedTensor`` with deduplication or a row-to-segment map (NeMo-RL's newer
    ones); a plain one holds one segment per row."""
    return bool(getattr(v, "deduplication_enabled", False)) or getattr(v, "_row_offsets", None) is not None


def _segment_counts(v: Any) -> List[int]:
    """Non-empty media segments per logical row of a ``PackedTensor``."""
    if callable(getattr(v, "logical_segment_counts_by_row", None)):
        return list(v.logical_segment_counts_by_row())
    return [int(t is not None) for t in v.tensors]


def multimodal_dict(data: Mapping[str, Any], optional_keys: Sequence[str], as_tensors: bool = False, device=None,
                    pixel_dtype=None) -> Dict[str, Any]:
    """The multimodal values (``PackedTensor``s, as tensors when ``as_tensors``; pixel
    values cast to ``pixel_dtype`` when given) and the ``optional_keys`` tensors
    (``BatchedDataDict.get_multimodal_dict``). With ``as_tensors``, coupled media keys
    (:data:`COUPLED_MEDIA_KEYS`) must have the same ordered per-row segment counts,
    as NeMo-RL checks; like NeMo-RL, only where one of them is deduplicated or
    row-mapped (a plain ``PackedTensor`` has one segment per row)."""
    if as_tensors:
        for value_key, meta_key in COUPLED_MEDIA_KEYS:
            value, meta = data.get(value_key), data.get(meta_key)
            if not (is_packed(value) and is_packed(meta)) or not (_row_mapped(value) or _row_mapped(meta)):
                continue
            value_counts, meta_counts = _segment_counts(value), _segment_counts(meta)
            check(value_counts == meta_counts,
                  f"Coupled multimodal keys must have the same ordered per-row segment counts, but "
                  f"{value_key!r} has {value_counts} and {meta_key!r} has {meta_counts}.")
    out = {}
    for key, v in data.items():
        if is_packed(v):
            if pixel_dtype is not None and key in ("pixel_values", "pixel_values_videos"):
                v = v.to_dtype(pixel_dtype)
            out[key] = v.as_tensor(device=device) if as_tensors else v
        elif key in optional_keys:
            out[key] = v
    return out
