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
from collections import UserDict
from typing import (TYPE_CHECKING, Any, Collection, Dict, Generic, Iterator, List, Mapping, Optional, Sequence, Tuple,
                    TypeVar, Union)

import numpy as np

from ._batch import dummy_row
from ._bdd_gather import all_gather_rows
from ._bdd_hybrid_cp import batch_of as hybrid_batch_of
from ._bdd_packed import packed_iterator
from ._bdd_sharding import bin_assignment_spread, shard_by_plan, shard_dynamic, shard_packed
from ._bdd_values import (COUPLED_MEDIA_KEYS, NATIVE_MEDIA_KEYS, BatchedDataDictError, DynamicBatchingArgs,
                          SequencePackingArgs, _check, _check_row_counts, _lengths, _media_memo, _positive, _row_mapped,
                          _segment_counts, _take)
from ._tree_batches import TreeMicroBatch, tree_micro_batch
from ._batch import is_packed as _is_packed
from ._batch import is_tensor as _is_tensor
from ._batch import rows as _rows
from ._batch import select as _select
from .._equality import values_equal
from .._lengths import as_int

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from ..planning.step import StepPlan
    from ..tensors.thd import PackedBatch

__all__ = ["BatchedDataDict", "BatchedDataDictError", "DynamicBatchingArgs", "SequencePackingArgs",
           "SlicedDataDict", "TreeMicroBatch", "bin_assignment_spread"]

DictT = TypeVar("DictT", bound=Mapping[str, Any])


class BatchedDataDict(UserDict, Generic[DictT]):
    """A batch as a dict of tensors (dim 0 = batch) and lists, NeMo-RL compatible."""

    ADDITIONAL_OPTIONAL_KEY_TENSORS = ["token_type_ids", "mm_token_type_ids"]
    # Defaults for batches pickled before these existed (instances set their own).
    micro_batch_token_cap: Optional[int] = None
    micro_batch_trees: Optional[List[List[Any]]] = None
    micro_batch_tree_options: Optional[Dict[str, Any]] = None
    hybrid_cp: Optional[Any] = None  # a shard of a hybrid-CP step plan (_bdd_hybrid_cp.HybridCpShard)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.micro_batch_indices: Optional[List[List[List[int]]]] = None
        self.micro_batch_lengths: Optional[List[List[int]]] = None
        self.elem_counts_per_gb: Optional[List[int]] = None
        # The token cap the micro-batches were planned under (set by sequence packing
        # and step plans): a tree micro-batch may pad up to it.
        self.micro_batch_token_cap: Optional[int] = None
        # A step plan with static_shapes: each micro-batch's padded size, per global
        # batch (the packed iterator pads each micro-batch to it).
        self.micro_batch_static_lengths: Optional[List[List[int]]] = None
        # With sequence packing's shared_prefix: each micro-batch's prefix tree, built
        # (with its host plans) when the shards were, per global batch; and the options
        # they were built with. The iterators then build no trie.
        self.micro_batch_trees: Optional[List[List[Any]]] = None
        self.micro_batch_tree_options: Optional[Dict[str, Any]] = None

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
        return all_gather_rows(self, group)

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
            return shard_by_plan(self, shards, batch_size, step_plan, SlicedDataDict)
        shards = _positive(shards, "shards")
        total = self._rows_to_split()
        batch_size = total if batch_size is None else _positive(batch_size, "batch_size")
        _check(total % batch_size == 0, f"Total batch size ({total}) is not a multiple of batch_size ({batch_size})")
        if not allow_uneven_shards:
            _check(batch_size % shards == 0, f"Batch size ({batch_size}) is not a multiple of shards ({shards})")
        if dynamic_batching_args is not None:
            return shard_dynamic(self, shards, batch_size, dynamic_batching_args, SlicedDataDict)
        if sequence_packing_args is not None:
            return shard_packed(self, shards, batch_size, sequence_packing_args, SlicedDataDict)
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

        if self.hybrid_cp is not None:
            check_index(len(self.elem_counts_per_gb))
            return hybrid_batch_of(self, batch_idx, SlicedDataDict)
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
            if self.micro_batch_static_lengths is not None:
                out.micro_batch_static_lengths = [self.micro_batch_static_lengths[batch_idx]]
            if self.micro_batch_trees is not None:
                out.micro_batch_trees = [self.micro_batch_trees[batch_idx]]
                out.micro_batch_tree_options = self.micro_batch_tree_options
            return out
        _check(batch_size is not None, "batch_size is required unless the data is a sequence-packed shard")
        batch_size = _positive(batch_size, "batch_size")
        check_index(-(-self.size // batch_size))
        out = self.slice(batch_size * batch_idx, batch_size * (batch_idx + 1))
        if self.micro_batch_indices is not None:
            out.micro_batch_indices = [self.micro_batch_indices[batch_idx]]
            out.micro_batch_lengths = [self.micro_batch_lengths[batch_idx]]
            out.micro_batch_token_cap = self.micro_batch_token_cap
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

    def make_microbatch_iterator_with_dynamic_shapes(self, sequence_dim: int = 1, shared_prefix: Optional[bool] = None,
                                                     **tree_options: Any) -> Iterator["SlicedDataDict"]:
        """The dynamic-batching micro-batches, each cut to its padded length; with
        ``shared_prefix``, each as a :class:`TreeMicroBatch` (``shared_prefix`` and
        ``tree_options`` as :meth:`make_microbatch_iterator_for_packable_sequences`)."""
        indices, lengths = self._one_plan()

        def gen():
            for length, (start, end) in zip(lengths, indices):
                mb = self.slice(start, end)
                mb.truncate_tensors(dim=sequence_dim, truncated_len=length)
                yield mb

        if self._iterates_trees(shared_prefix):
            return self._tree_iterator(indices, lambda start, end: self.slice(start, end), tree_options, None)
        return gen()

    def get_microbatch_iterator_dynamic_shapes_len(self) -> int:
        return len(self._one_plan()[0])

    def make_microbatch_iterator_for_packable_sequences(self, shared_prefix: Optional[bool] = None,
                                                       **tree_options: Any) -> Iterator["SlicedDataDict"]:
        """The packed micro-batches (bins) as row slices (an empty one, a
        :func:`seqpack.plan_step` dummy, as :meth:`dummy_microbatch`).

        ``shared_prefix=True``: each bin as a :class:`TreeMicroBatch` (its rows'
        :class:`~seqpack.PrefixTreeBatch`, the rows, their positions). The default,
        ``None``, is what the shard was planned with: trees for a shard of
        ``shard_by_batch_size(..., {"shared_prefix": True})``, whose trees were
        built (with their host plans) when the shards were; given options other
        than those, the trees are built again here. ``tree_options``:
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
        if self._iterates_trees(shared_prefix):
            return self._tree_iterator(indices, self._slice_or_dummy, tree_options, lengths)
        return (self._slice_or_dummy(start, end) for start, end in indices)

    def _iterates_trees(self, shared_prefix: Optional[bool]) -> bool:
        return self.micro_batch_trees is not None if shared_prefix is None else bool(shared_prefix)

    def _tree_iterator(self, indices, slice_rows, options: Mapping[str, Any],
                       planned: Optional[Sequence[int]]) -> Iterator[TreeMicroBatch]:
        """A :class:`TreeMicroBatch` per row range; with ``planned`` (packing: each
        micro-batch's planned tokens) a tree above its plan is refused."""
        known = {"input_key", "input_lengths_key", "group_key", "min_shared_tokens", "pad_to_multiple_of"}
        unknown = sorted(set(options) - known)
        _check(not unknown, f"unknown shared-prefix option(s) {unknown}; known: {sorted(known)}")
        carried = self.micro_batch_trees[0] if self.micro_batch_trees is not None else None
        built_with = self.micro_batch_tree_options or {}
        if carried is not None and all(built_with.get(k) == v for k, v in options.items()):
            return (TreeMicroBatch(tree=tree, data=slice_rows(start, end), rows=tuple(range(start, end)))
                    for tree, (start, end) in zip(carried, indices))
        options = dict(options)
        if carried is not None:  # built again with other options: the shard's own keys, unless given
            for key in ("input_key", "group_key", "input_lengths_key"):
                options.setdefault(key, built_with[key])
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
        group: Any = None,
        forest: Any = None,
    ) -> Iterator["PackedBatch"]:
        """Ready THD micro-batches (:class:`seqpack.PackedBatch`) of a packed global batch.

        Each bin's ``[rows, S, ...]`` tensors (``keys``; default every tensor of
        ``[B, S, ...]`` shape) are packed with the tensor engine: every sequence
        padded to ``pad_multiple`` (default :func:`seqpack.alignment` of CP/TP/SP),
        rank ``cp_rank``'s zigzag part with ``cp_size > 1``, and with ``pp_size > 1``
        every micro-batch padded to the largest one (``pad_packed_to``, a fixed
        pipeline buffer, as Megatron-Core needs).

        A global batch of a hybrid-CP step plan (``shard_by_batch_size(D,
        step_plan=plan_step(..., cp_size=C, hybrid_cp=True))``, then ``get_batch``)
        yields rank ``cp_rank``'s :class:`seqpack.HybridCpBatch` micro-batches
        instead (its whole rows and its parts of the sharded ones, each padded as
        the plan counted; ``pad_multiple``, TP and PP do not apply), each with
        ``.data`` (its rows, in ``.rows`` order) for
        :class:`seqpack.HybridCpLossWrapper`; every rank of
        ``group`` (the DP x CP ranks, default WORLD) agrees on the plan first.
        """
        return packed_iterator(self, keys, input_lengths_key=input_lengths_key, pad_multiple=pad_multiple,
                               cp_size=cp_size, cp_rank=cp_rank, tp_size=tp_size, sequence_parallel=sequence_parallel,
                               pp_size=pp_size, pad_values=pad_values, group=group, forest=forest,
                               shard_cls=SlicedDataDict)


class SlicedDataDict(BatchedDataDict):
    """A slice or shard of a :class:`BatchedDataDict` (NeMo-RL's marker type)."""
