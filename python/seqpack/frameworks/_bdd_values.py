"""The values of a :class:`~seqpack.BatchedDataDict`: its error type, NeMo-RL's
sharding argument types, and the row operations on one value (tensors, NumPy
arrays, lists, NeMo-RL's ``PackedTensor``) that its methods share.

Importing this module does not import torch.
"""

from __future__ import annotations

from typing import Any, Collection, Dict, List, Literal, Mapping, Sequence

import numpy as np

from ._batch import is_packed as _is_packed
from ._batch import is_tensor as _is_tensor
from ._batch import rows as _rows
from ._batch import select as _select
from .._lengths import as_positive_int, check_not_meta

try:  # Python 3.11+
    from typing import NotRequired, TypedDict
except ImportError:  # pragma: no cover
    from typing_extensions import NotRequired, TypedDict


class BatchedDataDictError(ValueError, AssertionError):
    """Invalid arguments or data (a ``ValueError``; also an ``AssertionError`` like
    NeMo-RL's checks, so existing ``except AssertionError`` code keeps working)."""


class SequencePackingArgs(TypedDict):
    """NeMo-RL's sequence-packing arguments of ``shard_by_batch_size``.

    ``balance`` is seqpack's: ``"round_robin"`` (NeMo-RL, default) or
    ``"karmarkar_karp"`` (bins dealt to shards by token load). ``shared_prefix``
    (seqpack's, NeMo-RL PR #4008's ``policy.shared_prefix_training``): plan the bins
    on prefix trees of the rows (physical tokens under the cap, groups whole), then
    iterate them as trees; ``shared_prefix_group_key``: rows share prefixes only
    with rows of the same value of this key (default: any common prefix).
    ``force_group_size`` (seqpack's, verl's name): every group of that many
    consecutive rows of a global batch stays in one bin, rows in order (DPO's
    interleaved chosen / rejected pairs: 2), so a loss coupling them
    (:class:`~seqpack.loss.DPOLoss`) runs packed."""

    max_tokens_per_microbatch: int
    input_key: str
    input_lengths_key: str
    algorithm: str
    sequence_length_pad_multiple: int
    microbatch_order: NotRequired[Literal["packer", "largest_first"]]
    balance: NotRequired[Literal["round_robin", "karmarkar_karp"]]
    shared_prefix: NotRequired[bool]
    shared_prefix_group_key: NotRequired[str]
    force_group_size: NotRequired[int]


class DynamicBatchingArgs(TypedDict):
    """NeMo-RL's dynamic-batching arguments of ``shard_by_batch_size``.

    ``rule`` is seqpack's: ``"nemo_rl"`` (default) or ``"optimal"`` (the fewest
    padded tokens under the same cap, see :func:`seqpack.plan_dynamic_batching`).
    ``shared_prefix`` / ``shared_prefix_group_key`` (seqpack's): micro-batches of
    prefix trees instead, as :class:`SequencePackingArgs`' (a tree has no padding
    to share: each shard gets its own micro-batches of whole trees, their physical
    tokens rounded up to ``sequence_length_round`` under the cap)."""

    max_tokens_per_microbatch: int
    sequence_length_round: int
    input_key: str
    input_lengths_key: str
    rule: NotRequired[Literal["nemo_rl", "optimal"]]
    shared_prefix: NotRequired[bool]
    shared_prefix_group_key: NotRequired[str]


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise BatchedDataDictError(message)


def _positive(value: Any, name: str) -> int:
    """:func:`seqpack._lengths.as_positive_int` (a ``TypeError`` for a non-int), its
    ``ValueError`` as a :class:`BatchedDataDictError`."""
    try:
        return as_positive_int(value, name)
    except ValueError as e:
        raise BatchedDataDictError(str(e)) from None


# NeMo-RL's media vocabulary (nemo_rl.data.multimodal_utils): the row keys holding
# native vLLM media, and the ``"type"`` of a content part that is media.
NATIVE_MEDIA_KEYS = frozenset({"vllm_content", "vllm_images", "vllm_videos", "vllm_audios"})
MEDIA_CONTENT_TYPES = frozenset({"input_image", "image", "image_url", "video", "audio"})
# Media values and the per-segment metadata that must stay aligned with them, as NeMo-RL checks.
COUPLED_MEDIA_KEYS = (("pixel_values", "image_grid_thw"), ("pixel_values", "imgs_sizes"),
                      ("pixel_values", "num_frames"), ("pixel_values_videos", "video_grid_thw"))


def _media_memo(item: Any, media_keys: Collection[str], in_media: bool = False) -> Dict[int, Any]:
    """Prepare one row for ``repeat_interleave(share_immutable_media=True)``, as
    NeMo-RL does: every ``PackedTensor`` in it is flagged for deduplication (its own
    ``deepcopy`` then shares its segments), and a ``deepcopy`` memo maps to itself
    every leaf under a media key (``media_keys``) or inside a typed media content
    part (``{"type": "image", ...}``), so copies share those leaves. Everything else
    (``token_ids`` tensors, text, every container) is copied."""
    memo: Dict[int, Any] = {}
    stack = [(item, in_media)]
    while stack:
        x, media = stack.pop()
        if _is_packed(x):
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


def _empty_packed(v: Any) -> Any:
    """No rows of a ``PackedTensor``'s kind: ``empty_rows_like(v, 0)`` (NeMo-RL's own
    empty value); an older ``PackedTensor``, which cannot be built from an empty
    list, as its ``empty_like`` with no rows left."""
    cls = type(v)
    if callable(getattr(cls, "empty_rows_like", None)):
        return cls.empty_rows_like(v, 0)
    if callable(getattr(cls, "empty_like", None)) and hasattr(v, "tensors"):
        empty = cls.empty_like(v)
        empty.tensors = []
        return empty
    return v.slice([])


def _take(key: str, v: Any, rows: Sequence[int]) -> Any:
    """Rows ``rows`` of one value (:func:`seqpack.frameworks._batch.select`); no rows
    of a ``PackedTensor`` is its empty value, not an error."""
    if _is_packed(v) and len(rows) == 0:
        return _empty_packed(v)
    return _select(key, v, rows)


def _check_row_counts(batch: Mapping[str, Any], where: str) -> int:
    """The one logical row count of every value of ``batch`` (``len`` of a
    ``PackedTensor``), or a :class:`BatchedDataDictError`."""
    sizes = {_rows(v) for v in batch.values()}
    _check(len(sizes) <= 1, f"{where} has inconsistent logical row counts: {sorted(sizes)}")
    return sizes.pop() if sizes else 0


def _row_mapped(v: Any) -> bool:
    """A ``PackedTensor`` with deduplication or a row-to-segment map (NeMo-RL's newer
    ones); a plain one holds one segment per row."""
    return bool(getattr(v, "deduplication_enabled", False)) or getattr(v, "_row_offsets", None) is not None


def _segment_counts(v: Any) -> List[int]:
    """Non-empty media segments per logical row of a ``PackedTensor``."""
    if callable(getattr(v, "logical_segment_counts_by_row", None)):
        return list(v.logical_segment_counts_by_row())
    return [int(t is not None) for t in v.tensors]


def _lengths(data: Mapping[str, Any], key: str) -> np.ndarray:
    if key not in data:
        raise BatchedDataDictError(f"input_lengths_key {key!r} is not in the data (keys: {sorted(data)})")
    v = data[key]
    if _is_tensor(v):
        check_not_meta(v, f"data[{key!r}]")
        v = v.detach().cpu().numpy()
    lens = np.asarray(v)
    _check(lens.ndim == 1 and (lens.size == 0 or np.issubdtype(lens.dtype, np.integer)),
           f"data[{key!r}] must be a 1-D sequence of integer lengths, got shape {lens.shape} dtype {lens.dtype}")
    return lens.astype(np.int64, copy=False)
