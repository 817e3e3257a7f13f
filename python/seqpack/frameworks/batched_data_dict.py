"""``BatchedDataDict``: a drop-in for NeMo-RL's (v0.6), planned by seqpack's core.

A dict of tensors and lists whose dimension 0 is the batch. Replace::

    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

with ``from seqpack import BatchedDataDict``: the same methods, arguments, return
values and metadata (``micro_batch_indices``, ``micro_batch_lengths``,
``elem_counts_per_gb``), with the sharding plans computed in C++ and each shard
gathered with one indexing per tensor.

    >>> import torch
    >>> from seqpack import BatchedDataDict
    >>> data = BatchedDataDict(input_ids=torch.ones(8, 100, dtype=torch.long),
    ...                        input_lengths=torch.tensor([46, 24, 55, 88, 11, 14, 73, 17]))
    >>> shards, order = data.shard_by_batch_size(2, sequence_packing_args={
    ...     "max_tokens_per_microbatch": 100, "input_key": "input_ids", "input_lengths_key": "input_lengths",
    ...     "algorithm": "modified_first_fit_decreasing", "sequence_length_pad_multiple": 1,
    ...     "microbatch_order": "largest_first"})
    >>> [s.micro_batch_lengths for s in shards], order
    ([[[99, 96]], [[87, 46]]], [3, 4, 2, 7, 1, 6, 5, 0])

Differences from NeMo-RL, all on inputs NeMo-RL mishandles: errors are
:class:`BatchedDataDictError` (both a ``ValueError`` and an ``AssertionError``, so
code written for either keeps working); ``chunk`` accepts every ``rank < chunks``
(NeMo-RL compares with the chunk size); ``reorder_data`` rejects an index list of
the wrong length (NeMo-RL truncates); iterators validate when called, not at the
first ``next()``; lengths may be lists. Like NeMo-RL, dynamic batching's
``sorted_indices`` are chunk-major, so with several global batches they do not
undo the shard order (``reorder_data`` restores it when ``batch_size`` is None,
as NeMo-RL uses it).

Beyond NeMo-RL (opt-in): ``balance="karmarkar_karp"`` in ``sequence_packing_args``
deals bins to shards by load, ``dynamic_batching_args["rule"] = "optimal"``
plans micro-batches with the fewest padded tokens, ``step_plan=`` shards by a
:func:`seqpack.plan_step` plan (ranks and micro-batches planned together; a
rank's empty micro-batch is yielded as a one-token dummy row with zero loss masks),
:meth:`BatchedDataDict.make_packed_microbatch_iterator` yields ready THD
micro-batches, and ``repeat_interleave(..., media_keys=)`` names more row keys whose
leaves are media, shared with ``share_immutable_media`` like NeMo-RL's ``vllm_*`` keys.
"""

from __future__ import annotations

import copy
import pickle
from collections import UserDict
from typing import (TYPE_CHECKING, Any, Collection, Dict, Generic, Iterator, List, Literal, Mapping, Optional,
                    Sequence, Tuple, TypeVar, Union)

import numpy as np

from ._batch import dummy_row
from ._tree_batches import TreeMicroBatch, shared_prefix_bins, tree_micro_batch
from ._batch import is_packed as _is_packed
from ._batch import is_tensor as _is_tensor
from ._batch import rows as _rows
from ._batch import select as _select
from .._equality import values_equal
from .._lengths import as_int, as_lengths, as_positive_int, check_not_meta
from ..planning.balance import get_seqlen_balanced_partitions
from ..planning.dynamic_batching import plan_dynamic_batching
from ..planning.packing import get_packer
from ..tensors.layout import alignment, round_up

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from ..planning.step import StepPlan
    from ..tensors.thd import PackedBatch

try:  # Python 3.11+
    from typing import NotRequired, TypedDict
except ImportError:  # pragma: no cover
    from typing_extensions import NotRequired, TypedDict

__all__ = ["BatchedDataDict", "BatchedDataDictError", "DynamicBatchingArgs", "SequencePackingArgs",
           "SlicedDataDict", "TreeMicroBatch", "bin_assignment_spread"]

DictT = TypeVar("DictT", bound=Mapping[str, Any])


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


class BatchedDataDict(UserDict, Generic[DictT]):
    """A batch as a dict of tensors (dim 0 = batch) and lists, NeMo-RL compatible."""

    ADDITIONAL_OPTIONAL_KEY_TENSORS = ["token_type_ids", "mm_token_type_ids"]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.micro_batch_indices: Optional[List[List[List[int]]]] = None
        self.micro_batch_lengths: Optional[List[List[int]]] = None
        self.elem_counts_per_gb: Optional[List[int]] = None
        # The token cap the micro-batches were planned under (set by sequence packing
        # and step plans): a tree micro-batch may pad up to it.
        self.micro_batch_token_cap: Optional[int] = None

    def __eq__(self, other: object) -> bool:
        """Same keys and values (tensors equal in dtype, shape, device and every
        element, where a plain dict would ask a tensor for its truth value) and the
        same sharding metadata; a plain mapping compares by its items alone."""
        if not isinstance(other, Mapping):
            return NotImplemented
        if not values_equal(dict(self.data), dict(other.items())):
            return False
        if not isinstance(other, BatchedDataDict):
            return True
        meta = ("micro_batch_indices", "micro_batch_lengths", "elem_counts_per_gb")
        return type(self) is type(other) and all(values_equal(getattr(self, m), getattr(other, m)) for m in meta)

    __hash__ = None  # mutable

    # ---------------------------------------------------------------- building

    @classmethod
    def from_batches(cls, batches: Sequence[Mapping[str, Any]], pad_value_dict: Optional[Dict[str, Any]] = None,
                     *, allow_missing_packed_tensors: bool = False) -> "BatchedDataDict":
        """Concatenate batches along dim 0; keys come out sorted. 1-D tensors are
        concatenated, 2-D and higher are right-padded along dim 1 with
        ``pad_value_dict.get(key, 0)``; lists are concatenated.

        A key missing from a non-empty batch is a ``KeyError``, except, with
        ``allow_missing_packed_tensors``, a ``PackedTensor`` key, which gets empty
        rows there (``empty_rows_like``). With that flag every batch's values must
        agree on their logical row count (else "inconsistent logical row counts");
        without it a batch's rows are its first value's, as in NeMo-RL."""
        import torch

        out = cls()
        if not batches:
            return out
        pad = pad_value_dict or {}
        if allow_missing_packed_tensors:
            counts = {id(b): _check_row_counts(b, f"Source batch {i}") for i, b in enumerate(batches)}

            def rows_of(b: Mapping[str, Any]) -> int:
                return counts[id(b)]
        else:
            def rows_of(b: Mapping[str, Any]) -> int:
                return _rows(next(iter(b.values()))) if len(b) else 0

        for key in sorted(set().union(*(b.keys() for b in batches))):
            missing = [i for i, b in enumerate(batches) if key not in b and rows_of(b) != 0]
            present = [b[key] for b in batches if key in b]
            if missing:
                if not (allow_missing_packed_tensors and present and all(_is_packed(p) for p in present)):
                    raise KeyError(f"Key {key!r} is missing from non-empty batches {missing}.")
                template = present[0]
                present = [b[key] if key in b else type(template).empty_rows_like(template, rows_of(b))
                           for b in batches if key in b or rows_of(b)]
            first = present[0]
            if isinstance(first, list):
                out[key] = [x for v in present for x in v]
            elif _is_packed(first):
                out[key] = type(first).concat(present)
            elif _is_tensor(first):
                if all(v.dim() == 1 for v in present):
                    out[key] = torch.cat(present)
                else:
                    fill = pad.get(key, 0)
                    width = max(v.shape[1] for v in present)
                    parts = []
                    for v in present:
                        if v.shape[1] < width:
                            grown = v.new_full((v.shape[0], width, *v.shape[2:]), fill)
                            grown[:, : v.shape[1]] = v
                            v = grown
                        parts.append(v)
                    out[key] = torch.cat(parts)
            else:
                raise NotImplementedError(f"Attempted to stack for unsupported type {type(first)} with key {key}. "
                                          "Please provide either a tensor or a list of picklable objects.")
        return out

    def all_gather(self, group=None) -> "BatchedDataDict":
        """Every rank's rows, concatenated in rank order, over a ``torch.distributed``
        group (tensors through ``all_gather`` of the row counts and padded rows;
        lists through ``all_gather_object``). Works with gloo and NCCL.

        The ranks may hold different row counts; everything else the gathers
        exchange must match, and is checked before the first one inside one
        all-reduce: the keys and their order, which values are tensors and which
        lists, and each tensor's dtype and shape past its rows. A rank with an
        unsupported value, or ranks that differ there, make every rank raise
        instead of waiting. (The gathered tensors carry no gradient: an
        all-gather is not differentiable, so ``requires_grad`` may differ.)"""
        import torch.distributed as dist

        import torch

        from .._dist import checked_on_every_rank

        world = dist.get_world_size(group)
        items = list(self.data.items())
        payloads: Dict[Any, bytes] = {}

        def local() -> List[tuple]:  # what each key's gathers exchange
            kinds = []
            for key, v in items:
                if _is_tensor(v):
                    if v.dim() < 1:
                        raise ValueError(f"BatchedDataDict.all_gather: {key!r} is a 0-d tensor; every tensor value "
                                         "needs a row dimension to gather")
                    kinds.append((str(key), "tensor", tuple(v.shape[1:]), str(v.dtype)))
                elif isinstance(v, list):  # pickled here: an unpicklable item fails inside the agreement
                    payloads[key] = pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL)
                    kinds.append((str(key), "list", None, None))
                else:
                    raise NotImplementedError(f"Attempted to gather_and_balance_globally for unsupported type "
                                              f"{type(v)} with key {key}. Please provide either a tensor or a list "
                                              "of picklable objects.")
            return kinds

        checked_on_every_rank(local, group, "BatchedDataDict.all_gather", world > 1, fingerprint=lambda kinds: {
            "the keys and their order": [k[0] for k in kinds],
            "which values are tensors and which lists": [k[1] for k in kinds],
            "each tensor's shape past its rows": [k[2] for k in kinds],
            "each tensor's dtype": [k[3] for k in kinds]})
        out = type(self)()
        for key, v in items:
            if _is_tensor(v):
                count = torch.tensor([v.shape[0]], dtype=torch.int64, device=v.device)
                counts = [torch.zeros_like(count) for _ in range(world)]
                dist.all_gather(counts, count, group=group)
                sizes = [int(c.item()) for c in counts]
                most = max(sizes)
                padded = v.new_zeros((most, *v.shape[1:]))
                padded[: v.shape[0]] = v
                parts = [torch.empty_like(padded) for _ in range(world)]
                dist.all_gather(parts, padded.contiguous(), group=group)
                out[key] = torch.cat([p[:n] for p, n in zip(parts, sizes)])
            elif isinstance(v, list):
                out[key] = [x for part in _gather_bytes(payloads[key], world, group) for x in pickle.loads(part)]
            else:
                raise NotImplementedError(f"Attempted to gather_and_balance_globally for unsupported type {type(v)} "
                                          f"with key {key}. Please provide either a tensor or a list of picklable "
                                          "objects.")
        return out

    # ---------------------------------------------------------------- sizes

    def _batch_size(self) -> int:
        _check(bool(self.data), "the BatchedDataDict has no keys (an empty batch)")
        sizes = {_rows(v) for v in self.data.values()}
        _check(len(sizes) == 1, "Batch sizes are not the same across the rollout batch, found sizes: "
                                f"[{','.join(str(s) for s in sorted(sizes))}]")
        return sizes.pop()

    def _rows_to_split(self) -> int:
        """The row count, which must be positive: an empty batch has nothing to
        shard or iterate (NeMo-RL divides by zero or yields nothing)."""
        size = self._batch_size()
        _check(size > 0, "the BatchedDataDict has no rows (every value is empty): nothing to shard or iterate")
        return size

    @property
    def size(self) -> int:
        """Rows of the first value (0 for an empty dict)."""
        if not self.data:
            return 0
        return _rows(next(iter(self.data.values())))

    def get_dict(self) -> dict:
        return self.data

    def get_multimodal_dict(self, as_tensors: bool = False, device=None, pixel_dtype=None) -> dict:
        """The multimodal values (NeMo-RL ``PackedTensor``s, as tensors when
        ``as_tensors``; pixel values cast to ``pixel_dtype`` when given) and the
        optional token-type tensors.

        With ``as_tensors``, coupled media keys (``pixel_values`` with
        ``image_grid_thw`` / ``imgs_sizes`` / ``num_frames``, ``pixel_values_videos`` with
        ``video_grid_thw``) must have the same ordered per-row segment counts, as
        NeMo-RL checks; like NeMo-RL, only where one of them is deduplicated or
        row-mapped (a plain ``PackedTensor`` has one segment per row)."""
        if as_tensors:
            for value_key, meta_key in COUPLED_MEDIA_KEYS:
                value, meta = self.data.get(value_key), self.data.get(meta_key)
                if not (_is_packed(value) and _is_packed(meta)) or not (_row_mapped(value) or _row_mapped(meta)):
                    continue
                value_counts, meta_counts = _segment_counts(value), _segment_counts(meta)
                _check(value_counts == meta_counts,
                       f"Coupled multimodal keys must have the same ordered per-row segment counts, but "
                       f"{value_key!r} has {value_counts} and {meta_key!r} has {meta_counts}.")
        out = {}
        for key, v in self.data.items():
            if _is_packed(v):
                if pixel_dtype is not None and key in ("pixel_values", "pixel_values_videos"):
                    v = v.to_dtype(pixel_dtype)
                out[key] = v.as_tensor(device=device) if as_tensors else v
            elif key in self.ADDITIONAL_OPTIONAL_KEY_TENSORS:
                out[key] = v
        return out

    # ---------------------------------------------------------------- row selection

    def select_indices(self, indices: Union[List[int], "torch.Tensor"]) -> "BatchedDataDict":
        """Rows ``indices`` of every value (copies); metadata is not carried."""
        if _is_tensor(indices):
            indices = indices.tolist()
        return type(self)({k: _take(k, v, indices) for k, v in self.data.items()})

    def slice(self, start: int, end: int) -> "SlicedDataDict":
        """Rows ``[start, end)`` (tensor views, new lists)."""
        out = SlicedDataDict()
        for key, v in self.data.items():
            if _is_packed(v):
                out[key] = _take(key, v, list(range(start, end)))
                continue
            if _is_tensor(v):
                _check(end <= v.shape[0], f"end: {end} is greater than the shape of the tensor: {v.shape[0]} "
                                          f"for key: {key}")
            out[key] = v[start:end]
        return out

    def chunk(self, rank: int, chunks: int) -> "SlicedDataDict":
        """The ``rank``-th of ``chunks`` contiguous, equal parts (copies)."""
        size = self._batch_size()
        _check(chunks > 0 and size % chunks == 0, f"batch size ({size}) is not a multiple of chunks ({chunks})")
        _check(0 <= rank < chunks, f"index OOB: not enough splits for this rank. rollout_batch_size: {size}, "
                                   f"chunks ({chunks}), rank_idx ({rank})")
        per = size // chunks
        indices = list(range(rank * per, (rank + 1) * per))
        out = SlicedDataDict()
        for key, v in self.data.items():
            out[key] = _select(key, v, indices) if (_is_tensor(v) or _is_packed(v)) else [v[i] for i in indices]
        return out

    def reorder_data(self, reorded_indices: List[int]) -> None:
        """Undo a permutation in place: row ``j`` moves to position
        ``reorded_indices[j]`` (pass the ``sorted_indices`` of ``shard_by_batch_size``
        to restore the original order of concatenated shards)."""
        size = self._batch_size()
        order = np.asarray(reorded_indices, dtype=np.int64)
        _check(order.shape == (size,), f"reorded_indices has {order.size} entries for a batch of {size}")
        _check(np.array_equal(np.sort(order), np.arange(size)),
               "reorded_indices must be a permutation of range(batch size)")
        inverse = np.argsort(order, kind="stable").tolist()
        for key, v in self.data.items():
            self.data[key] = _select(key, v, inverse) if (_is_tensor(v) or _is_packed(v)) else [v[i] for i in inverse]

    def repeat_interleave(self, num_repeats: int, *, share_immutable_media: bool = False,
                          media_keys: Collection[str] = ()) -> "BatchedDataDict":
        """Every row repeated ``num_repeats`` times in place. List items are deep
        copies. With ``share_immutable_media`` (NeMo-RL's), only media is shared
        between the copies: every ``PackedTensor`` is flagged for deduplication (its
        segments are shared), and so are the leaves under NeMo-RL's native media keys
        (``vllm_content``, ``vllm_images``, ``vllm_videos``, ``vllm_audios``, plus
        seqpack's ``media_keys``) or inside a typed media content part
        (``{"type": "image", ...}``); token ids, text and every container are still
        copied, so editing one repeat never changes another."""
        shared_keys = NATIVE_MEDIA_KEYS.union((media_keys,) if isinstance(media_keys, str) else media_keys)
        out = type(self)()
        for key, v in self.data.items():
            if _is_tensor(v):
                out[key] = v.repeat_interleave(num_repeats, dim=0)
            elif _is_packed(v):
                raise NotImplementedError("PackedTensor does not currently support repeat_interleave")
            else:
                repeated = []
                for item in v:
                    memo = _media_memo(item, shared_keys, key in shared_keys) if share_immutable_media else {}
                    repeated.extend(copy.deepcopy(item, dict(memo)) for _ in range(num_repeats))
                out[key] = repeated
        return out

    def truncate_tensors(self, dim: int, truncated_len: int) -> None:
        """Narrow every tensor with more than ``dim`` dimensions to ``truncated_len`` along ``dim``."""
        import torch

        for key, v in self.data.items():
            if _is_tensor(v) and v.dim() >= dim + 1:
                self.data[key] = torch.narrow(v, dim, 0, truncated_len)

    def to(self, device) -> "BatchedDataDict":
        for key, v in self.data.items():
            if _is_tensor(v) or _is_packed(v):
                self.data[key] = v.to(device)
        return self

    # ---------------------------------------------------------------- sharding

    def shard_by_batch_size(
        self,
        shards: int,
        batch_size: Optional[int] = None,
        allow_uneven_shards: bool = False,
        dynamic_batching_args: Optional[DynamicBatchingArgs] = None,
        sequence_packing_args: Optional[SequencePackingArgs] = None,
        step_plan: Optional["StepPlan"] = None,
    ) -> Union[List["SlicedDataDict"], Tuple[List["SlicedDataDict"], List[int]]]:
        """Shard each global batch (``batch_size`` rows) across ``shards`` ranks.

        Plain: shard ``s`` takes the ``s``-th contiguous piece of every global batch.
        Dynamic batching: per global batch, rows sorted by length are dealt across
        shards, and all shards share one plan of micro-batches (``rows x padded
        max length <= max_tokens_per_microbatch``). Sequence packing: per global batch
        the lengths (padded to ``sequence_length_pad_multiple``) are packed into a
        multiple of ``shards`` bins, dealt round-robin (or by load with
        ``balance="karmarkar_karp"``). With ``step_plan`` (a
        :func:`seqpack.plan_step` plan of these rows, ``dp_size == shards``, one
        mini-batch per global batch), shard ``s`` takes rank ``s``'s rows and
        micro-batches as planned; an empty micro-batch (a dummy) becomes a one-row,
        one-token micro-batch with zero loss masks in the iterators (plan on the
        lengths as packed, rounded up to the pad multiple, so that the cap and
        ``micro_batch_lengths`` hold after padding). With any of the three, returns
        ``(shards, sorted_indices)``.

        Example:
            >>> data = BatchedDataDict(problem_id=[0, 0, 1, 1, 2, 2, 3, 3])
            >>> [s["problem_id"] for s in data.shard_by_batch_size(shards=2, batch_size=4)]
            [[0, 0, 2, 2], [1, 1, 3, 3]]
        """
        if allow_uneven_shards:
            _check(batch_size is None, "batch_size must be None if allow_uneven_shards is True")
        _check(dynamic_batching_args is None or sequence_packing_args is None,
               "dynamic_batching_args and sequence_packing_args cannot be passed together")
        if step_plan is not None:
            _check(dynamic_batching_args is None and sequence_packing_args is None,
                   "step_plan cannot be combined with dynamic_batching_args or sequence_packing_args")
            return self._shard_by_plan(shards, batch_size, step_plan)
        shards = _positive(shards, "shards")
        total = self._rows_to_split()
        batch_size = total if batch_size is None else _positive(batch_size, "batch_size")
        _check(total % batch_size == 0, f"Total batch size ({total}) is not a multiple of batch_size ({batch_size})")
        if not allow_uneven_shards:
            _check(batch_size % shards == 0, f"Batch size ({batch_size}) is not a multiple of shards ({shards})")
        if dynamic_batching_args is not None:
            return self._shard_dynamic(shards, batch_size, dynamic_batching_args)
        if sequence_packing_args is not None:
            return self._shard_packed(shards, batch_size, sequence_packing_args)
        num_chunks = total // batch_size
        shard_size = -(-batch_size // shards) if allow_uneven_shards else batch_size // shards
        out = []
        for s in range(shards):
            rows: List[int] = []
            for c in range(num_chunks):
                start = min(c * batch_size + s * shard_size, total)
                end = min(c * batch_size + (s + 1) * shard_size, total)
                rows.extend(range(start, end))
            out.append(self._gather(rows, SlicedDataDict))
        return out

    def _gather(self, rows: List[int], cls=None, keys: Optional[Sequence[str]] = None) -> "BatchedDataDict":
        out = (cls or type(self))()
        for key in keys if keys is not None else self.data:
            v = self.data[key]
            out[key] = _take(key, v, rows) if (_is_tensor(v) or _is_packed(v)) else [v[i] for i in rows]
        return out

    def _shard_dynamic(self, shards: int, batch_size: int, args: Mapping[str, Any]):
        if args.get("force_group_size", 1) != 1:
            raise BatchedDataDictError("dynamic batching deals rows sorted by length across shards, which splits "
                                       "force_group_size's groups: use sequence_packing_args (its bins keep each group "
                                       "of consecutive rows whole)")
        if args.get("shared_prefix", False):  # trees: sequence packing's plan, padded as trees
            tree_args = {key: args[key] for key in ("max_tokens_per_microbatch", "input_key", "input_lengths_key",
                                                    "sequence_length_round", "shared_prefix_group_key")
                         if key in args}
            return self._shard_packed(shards, batch_size, {**tree_args, "shared_prefix": True},
                                      pad_key="sequence_length_round")
        lens = _lengths(self.data, args["input_lengths_key"])
        width_source = self.data.get(args["input_key"])
        _check(_is_tensor(width_source) and width_source.dim() >= 2,
               f"input_key {args['input_key']!r} must name a [batch, seq] tensor")
        plan = plan_dynamic_batching(lens, shards, args["max_tokens_per_microbatch"], args["sequence_length_round"],
                                     rule=args.get("rule", "nemo_rl"), batch_size=batch_size,
                                     max_seqlen=int(width_source.shape[1]))
        out = []
        for s in range(shards):
            shard = self._gather(plan.shard_indices(s), SlicedDataDict)
            shard.micro_batch_indices = plan.micro_batch_indices  # shared by every shard, as NeMo-RL's
            shard.micro_batch_lengths = plan.micro_batch_lengths
            out.append(shard)
        return out, list(plan.sorted_indices)

    def _shard_packed(self, shards: int, batch_size: int, args: Mapping[str, Any],
                      pad_key: str = "sequence_length_pad_multiple"):
        order = args.get("microbatch_order")
        if order not in (None, "packer", "largest_first"):
            raise BatchedDataDictError(f"sequence packing microbatch_order must be 'packer' or 'largest_first', "
                                       f"got {order!r}")
        balance = args.get("balance", "round_robin")
        if balance not in ("round_robin", "karmarkar_karp"):
            raise BatchedDataDictError(f"sequence packing balance must be 'round_robin' or 'karmarkar_karp', "
                                       f"got {balance!r}")
        lens = _lengths(self.data, args["input_lengths_key"])
        if args.get("shared_prefix", False) and args.get("force_group_size", 1) != 1:
            raise BatchedDataDictError("shared_prefix keeps its trees (shared_prefix_group_key) whole instead of "
                                       "force_group_size's groups of consecutive rows: give one of them")
        if args.get("shared_prefix", False):  # bins of prefix trees: physical tokens under the cap
            bins_per_chunk, loads_per_chunk = shared_prefix_bins(self.data, lens, shards, batch_size, args, pad_key)
        else:
            bins_per_chunk, padded = _pack_chunks(lens, shards, batch_size, args)
            loads_per_chunk = [[int(padded[c * batch_size + np.asarray(b)].sum()) for b in bins]
                               for c, bins in enumerate(bins_per_chunk)]
        rows: List[List[int]] = [[] for _ in range(shards)]
        indices: List[List[List[List[int]]]] = [[] for _ in range(shards)]
        lengths: List[List[List[int]]] = [[] for _ in range(shards)]
        for c, bins in enumerate(bins_per_chunk):
            base, loads = c * batch_size, loads_per_chunk[c]
            for s, mine in enumerate(_deal(bins, loads, shards, balance)):
                if order == "largest_first":
                    mine = sorted(mine, key=lambda i: -loads[i])  # stable: ties keep the packer's order
                start, chunk_idx, chunk_len = 0, [], []
                for i in mine:
                    rows[s].extend(base + j for j in bins[i])
                    chunk_idx.append([start, start + len(bins[i])])
                    chunk_len.append(loads[i])
                    start += len(bins[i])
                indices[s].append(chunk_idx)
                lengths[s].append(chunk_len)
        keys = sorted(self.data)  # NeMo-RL rebuilds packed shards with from_batches: sorted keys
        out = []
        for s in range(shards):
            shard = self._gather(rows[s], SlicedDataDict, keys)
            shard.micro_batch_indices = indices[s]
            shard.micro_batch_lengths = lengths[s]
            shard.elem_counts_per_gb = [c[-1][1] if c else 0 for c in indices[s]]
            shard.micro_batch_token_cap = int(args["max_tokens_per_microbatch"])
            out.append(shard)
        return out, [i for r in rows for i in r]

    def _shard_by_plan(self, shards: int, batch_size: Optional[int], plan: "StepPlan"):
        from ..planning.step import StepPlan

        _check(isinstance(plan, StepPlan), f"step_plan must be a seqpack.StepPlan, got {type(plan).__name__}")
        _check(plan.dp_size == shards, f"step_plan was planned for dp_size={plan.dp_size}, not shards={shards}")
        total = self._batch_size()
        _check(plan.num_sequences == total, f"step_plan covers {plan.num_sequences} rows, the data has {total}")
        if batch_size is not None:
            expected = [(c, c + batch_size) for c in range(0, total, batch_size)]
            _check(plan.mini_batch_ranges == expected,
                   f"step_plan's mini-batches {plan.mini_batch_ranges} are not the global batches of "
                   f"batch_size={batch_size}")
        rows: List[List[int]] = [plan.rank_rows(s) for s in range(shards)]
        out = []
        for s in range(shards):
            shard = self._gather(rows[s], SlicedDataDict, sorted(self.data))
            shard.micro_batch_indices, shard.micro_batch_lengths, shard.elem_counts_per_gb = [], [], []
            for m, mini_batch in enumerate(plan.assignment):
                bounds, start = [], 0  # row ranges within the global batch, as sequence packing's
                for cell in mini_batch[s]:
                    bounds.append([start, start + len(cell)])
                    start += len(cell)
                shard.micro_batch_indices.append(bounds)
                shard.micro_batch_lengths.append(list(plan.tokens[m][s]))
                shard.elem_counts_per_gb.append(start)
            shard.micro_batch_token_cap = int(plan.max_tokens)
            out.append(shard)
        return out, [i for r in rows for i in r]

    def dummy_microbatch(self, input_lengths_key: str = "input_lengths") -> "SlicedDataDict":
        """A one-row micro-batch that runs one token and adds nothing to the loss
        (row 0 with ``token_mask``/``sample_mask``/``loss_mask`` zeroed and
        ``input_lengths_key`` set to 1): what a rank with no work at a micro-batch
        step runs, so FSDP's per-micro-batch collectives still match."""
        return SlicedDataDict(dummy_row(self.data, length_key=input_lengths_key, name="BatchedDataDict"))

    def _slice_or_dummy(self, start: int, end: int) -> "SlicedDataDict":
        return self.slice(start, end) if end > start else self.dummy_microbatch()

    # ---------------------------------------------------------------- per global batch

    def get_batch(self, batch_idx: int, batch_size: Optional[int] = None) -> "SlicedDataDict":
        """Global batch ``batch_idx`` of a shard, with its metadata (packed shards
        know their per-batch row counts; others need ``batch_size``)."""
        try:
            batch_idx = as_int(batch_idx, "batch_idx")  # NumPy and 0-d tensor integers too
        except TypeError:
            pass  # refused below, by name

        def check_index(count: int) -> None:
            _check(type(batch_idx) is int and 0 <= batch_idx < count,
                   f"batch_idx must be an int in [0, {count}), got {batch_idx!r}")

        if self.elem_counts_per_gb is not None:
            _check(self.micro_batch_indices is not None,
                   "micro_batch_indices must be provided if sequence_packing is True")
            check_index(len(self.elem_counts_per_gb))
            bounds = np.concatenate([[0], np.cumsum(self.elem_counts_per_gb)]).tolist()
            out = self.slice(int(bounds[batch_idx]), int(bounds[batch_idx + 1]))
            out.micro_batch_indices = [self.micro_batch_indices[batch_idx]]
            out.micro_batch_lengths = [self.micro_batch_lengths[batch_idx]]
            out.elem_counts_per_gb = [self.elem_counts_per_gb[batch_idx]]
            out.micro_batch_token_cap = self.micro_batch_token_cap
            return out
        _check(batch_size is not None, "batch_size is required unless the data is a sequence-packed shard")
        batch_size = _positive(batch_size, "batch_size")
        check_index(-(-self.size // batch_size))
        out = self.slice(batch_size * batch_idx, batch_size * (batch_idx + 1))
        if self.micro_batch_indices is not None:
            out.micro_batch_indices = [self.micro_batch_indices[batch_idx]]
            out.micro_batch_lengths = [self.micro_batch_lengths[batch_idx]]
        return out

    def _one_plan(self) -> Tuple[List[List[int]], List[int]]:
        _check(self.micro_batch_indices is not None and len(self.micro_batch_indices) == 1
               and self.micro_batch_lengths is not None,
               "micro-batch metadata for exactly one global batch is required (use get_batch on a shard)")
        return self.micro_batch_indices[0], self.micro_batch_lengths[0]

    def make_microbatch_iterator(self, microbatch_size: int) -> Iterator["SlicedDataDict"]:
        """Consecutive slices of ``microbatch_size`` rows."""
        microbatch_size = _positive(microbatch_size, "microbatch_size")
        _check(bool(self.data), "the BatchedDataDict has no keys (an empty batch)")
        size = self.size
        _check(size > 0, "the BatchedDataDict has no rows (every value is empty): nothing to shard or iterate")
        _check(size % microbatch_size == 0,
               f"Data dict size ({size}) is not a multiple of the provided microbatch size ({microbatch_size})")
        return (self.slice(i, i + microbatch_size) for i in range(0, size, microbatch_size))

    def make_microbatch_iterator_with_dynamic_shapes(self, sequence_dim: int = 1, shared_prefix: bool = False,
                                                     **tree_options: Any) -> Iterator["SlicedDataDict"]:
        """The dynamic-batching micro-batches, each cut to its padded length; with
        ``shared_prefix``, each as a :class:`TreeMicroBatch` (``tree_options`` as
        :meth:`make_microbatch_iterator_for_packable_sequences`)."""
        indices, lengths = self._one_plan()

        def gen():
            for length, (start, end) in zip(lengths, indices):
                mb = self.slice(start, end)
                mb.truncate_tensors(dim=sequence_dim, truncated_len=length)
                yield mb

        if shared_prefix:
            return self._tree_iterator(indices, lambda start, end: self.slice(start, end), tree_options, None)
        return gen()

    def get_microbatch_iterator_dynamic_shapes_len(self) -> int:
        return len(self._one_plan()[0])

    def make_microbatch_iterator_for_packable_sequences(self, shared_prefix: bool = False,
                                                       **tree_options: Any) -> Iterator["SlicedDataDict"]:
        """The packed micro-batches (bins) as row slices (an empty one, a
        :func:`seqpack.plan_step` dummy, as :meth:`dummy_microbatch`).

        ``shared_prefix=True``: each bin as a :class:`TreeMicroBatch` (its rows'
        :class:`~seqpack.PrefixTreeBatch`, the rows, their positions). ``tree_options``:
        ``input_key`` (``"input_ids"``), ``input_lengths_key`` (``"input_lengths"``),
        ``group_key`` (share only within rows of one value of it; default any common
        prefix), ``min_shared_tokens`` and ``pad_to_multiple_of`` (of the tree, e.g.
        :func:`seqpack.alignment`; default 1), as :func:`seqpack.pack_prefix_tree`.
        Use the options the bins were planned with (``group_key`` = the
        ``shared_prefix_group_key``): a tree whose real tokens pass its
        micro-batch's planned length is refused, and so is one padded past the
        shard's token cap (``max_tokens_per_microbatch`` or the step plan's
        ``max_tokens``).
        """
        indices, lengths = self._one_plan()
        if shared_prefix:
            return self._tree_iterator(indices, self._slice_or_dummy, tree_options, lengths)
        return (self._slice_or_dummy(start, end) for start, end in indices)

    def _tree_iterator(self, indices, slice_rows, options: Mapping[str, Any],
                       planned: Optional[Sequence[int]]) -> Iterator[TreeMicroBatch]:
        """A :class:`TreeMicroBatch` per row range; with ``planned`` (packing: each
        micro-batch's planned tokens) a tree above its plan is refused."""
        known = {"input_key", "input_lengths_key", "group_key", "min_shared_tokens", "pad_to_multiple_of"}
        unknown = sorted(set(options) - known)
        _check(not unknown, f"unknown shared-prefix option(s) {unknown}; known: {sorted(known)}")
        options = dict(options)
        lengths_key = options.pop("input_lengths_key", "input_lengths")

        def gen():
            for k, (start, end) in enumerate(indices):
                mb = slice_rows(start, end)
                yield tree_micro_batch(mb, range(start, end), _lengths(mb.data, lengths_key),
                                       planned_tokens=None if planned is None else int(planned[k]),
                                       token_cap=self.micro_batch_token_cap, **options)

        return gen()

    def get_microbatch_iterator_for_packable_sequences_len(self) -> Tuple[int, int]:
        """(micro-batch count, largest packed token count)."""
        indices, lengths = self._one_plan()
        return len(indices), max(lengths, default=0)

    def make_packed_microbatch_iterator(
        self,
        keys: Optional[Sequence[str]] = None,
        *,
        input_lengths_key: str = "input_lengths",
        pad_multiple: Optional[int] = None,
        cp_size: int = 1,
        cp_rank: int = 0,
        tp_size: int = 1,
        sequence_parallel: bool = False,
        pp_size: int = 1,
        pad_values: Optional[Mapping[str, Union[int, float, bool]]] = None,
    ) -> Iterator["PackedBatch"]:
        """Ready THD micro-batches (:class:`seqpack.PackedBatch`) of a packed global batch.

        Each bin's ``[rows, S, ...]`` tensors (``keys``; default every tensor of
        ``[B, S, ...]`` shape) are packed with the tensor engine: every sequence
        padded to ``pad_multiple`` (default :func:`seqpack.alignment` of CP/TP/SP),
        rank ``cp_rank``'s zigzag part with ``cp_size > 1``, and with ``pp_size > 1``
        every micro-batch padded to the largest one (``pad_packed_to``, a fixed
        pipeline buffer, as Megatron-Core needs).
        """
        from ..tensors.thd import pack_sequences

        indices, _ = self._one_plan()
        multiple = alignment(cp_size=cp_size, tp_size=tp_size, sequence_parallel=sequence_parallel) \
            if pad_multiple is None else _positive(pad_multiple, "pad_multiple")
        pp_size = _positive(pp_size, "pp_size")
        lens = _lengths(self.data, input_lengths_key)
        if keys is None:
            keys = [k for k, v in self.data.items() if _is_tensor(v) and v.dim() >= 2]
        _check(len(keys) > 0, "no [B, S, ...] tensor to pack (give keys=)")
        padded = round_up(lens, multiple)
        pad_to = None
        if pp_size > 1:
            pad_to = max(int(padded[s:e].sum()) for s, e in indices) or None

        def gen():
            for start, end in indices:
                if end > start:
                    mb, mb_lens = {k: self.data[k][start:end] for k in keys}, lens[start:end]
                else:  # a dummy: one token, zero loss masks
                    dummy = self.dummy_microbatch(input_lengths_key)
                    mb, mb_lens = {k: dummy[k] for k in keys}, np.ones(1, dtype=np.int64)
                yield pack_sequences(mb, seq_lens=mb_lens, pad_multiple=multiple, pad_values=pad_values,
                                     pad_packed_to=pad_to, cp_size=cp_size, cp_rank=cp_rank)

        return gen()


class SlicedDataDict(BatchedDataDict):
    """A slice or shard of a :class:`BatchedDataDict` (NeMo-RL's marker type)."""


# ---------------------------------------------------------------- packing helpers


def _pack_chunks(lens: np.ndarray, shards: int, batch_size: int, args: Mapping[str, Any]):
    """Per global batch, the packer's bins (chunk-local indices) of the padded lengths;
    with ``force_group_size`` of its groups of consecutive rows, each whole in a bin."""
    multiple = _positive(args["sequence_length_pad_multiple"], "sequence_length_pad_multiple")
    padded = round_up(lens, multiple)
    packer = get_packer(args["algorithm"], bin_capacity=args["max_tokens_per_microbatch"], min_bin_count=shards,
                        bin_count_multiple=shards)
    group = _positive(args.get("force_group_size", 1), "force_group_size")
    if group == 1:
        return [packer.pack(padded[c: c + batch_size]) for c in range(0, len(lens), batch_size)], padded
    from ..planning.group_planning import consecutive_groups, pack_groups

    try:
        members = consecutive_groups(batch_size, group)
        bins = [pack_groups(packer, padded[c: c + batch_size], members)[0] for c in range(0, len(lens), batch_size)]
    except ValueError as exc:
        raise BatchedDataDictError(f"sequence packing with force_group_size={group}: {exc}") from None
    return bins, padded


def _deal(bins: List[List[int]], loads: List[int], shards: int, balance: str) -> List[List[int]]:
    """Bin numbers per shard: round-robin in packer order, or Karmarkar-Karp over the
    bin loads with the same number of bins per shard."""
    if balance == "round_robin" or shards == 1:
        return [list(range(s, len(bins), shards)) for s in range(shards)]
    return get_seqlen_balanced_partitions(loads, shards, equal_size=True)


def bin_assignment_spread(input_lengths: Any, shards: int, sequence_packing_args: Mapping[str, Any],
                          batch_size: Optional[int] = None) -> Dict[str, Dict[str, float]]:
    """Per-shard packed tokens of each global batch under round-robin and
    Karmarkar-Karp bin assignment: ``{"round_robin": {...}, "karmarkar_karp": {...}}``
    with ``max``, ``min`` and ``spread`` (max - min) of the tokens per shard,
    worst over global batches.

    >>> args = {"max_tokens_per_microbatch": 100, "algorithm": "first_fit_decreasing",
    ...         "sequence_length_pad_multiple": 1}
    >>> spread = bin_assignment_spread([90, 80, 70, 60, 50, 40, 30, 20], 2, args)
    >>> spread["karmarkar_karp"]["spread"] <= spread["round_robin"]["spread"]
    True
    """
    lens = as_lengths(input_lengths, "input_lengths").astype(np.int64)
    batch_size = len(lens) if batch_size is None else _positive(batch_size, "batch_size")
    bins_per_chunk, padded = _pack_chunks(lens, shards, batch_size, sequence_packing_args)
    report: Dict[str, Dict[str, float]] = {}
    for balance in ("round_robin", "karmarkar_karp"):
        worst = {"max": 0.0, "min": float("inf"), "spread": 0.0}
        for c, bins in enumerate(bins_per_chunk):
            loads = [int(padded[c * batch_size + np.asarray(b)].sum()) for b in bins]
            per_shard = [sum(loads[i] for i in mine) for mine in _deal(bins, loads, shards, balance)]
            worst["max"] = max(worst["max"], max(per_shard))
            worst["min"] = min(worst["min"], min(per_shard))
            worst["spread"] = max(worst["spread"], max(per_shard) - min(per_shard))
        report[balance] = worst
    return report


def _gather_bytes(payload: bytes, world: int, group: Any) -> List[bytes]:
    """Every rank's ``payload``, in rank order: its length, then the bytes padded to
    the longest, all-gathered (on the current CUDA device for NCCL, else the CPU)."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    lengths = [int(n.item()) for n in sizes]
    buffer = torch.zeros(max(lengths), dtype=torch.uint8)
    if payload:
        buffer[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    buffer = buffer.to(device)
    parts = [torch.empty_like(buffer) for _ in range(world)]
    dist.all_gather(parts, buffer, group=group)
    return [bytes(p[:n].cpu().numpy().tobytes()) for p, n in zip(parts, lengths)]
