"""``BatchedDataDict`` and ``SlicedDataDict``: NeMo-RL's classes, each method one of
this package's functions on the batch's data and its :class:`~.shard.ShardRecord`
(the attributes NeMo-RL's shards carry, plus seqpack's plan metadata).

    >>> from seqpack.frameworks.nemo_rl import BatchedDataDict
    >>> data = BatchedDataDict(problem_id=[0, 0, 1, 1, 2, 2, 3, 3])
    >>> [s["problem_id"] for s in data.shard_by_batch_size(shards=2, batch_size=4)]
    [[0, 0, 2, 2], [1, 1, 3, 3]]

Importing this module does not import torch.
"""

from __future__ import annotations

from collections import UserDict
from typing import (TYPE_CHECKING, Any, Collection, Dict, Generic, Iterator, List, Mapping, Optional, Sequence, Tuple,
                    TypeVar, Union)

from .._batch import is_tensor, rows
from ..._equality import values_equal
from .args import DynamicBatchingArgs, SequencePackingArgs
from .concat import concat_batches
from .errors import check, positive
from .gather import all_gather_rows
from .iterators import dynamic_shapes, fixed_size, packable
from .media import multimodal_dict, repeat_rows
from .packed import packed_micro_batches
from .rows import chunk_rows, dummy, reordered, rows_to_split, slice_rows, take, to_device, truncate
from .shard import META, ShardRecord, global_batch, one_plan
from .sharding import dynamic_shards, packed_shards, plain_shards
from .step_shards import step_plan_shards

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from ...planning.step import StepPlan
    from ...tensors.prefix_tree import PrefixTreeBatch
    from .shard import StepShard

__all__ = ["BatchedDataDict", "SlicedDataDict"]

DictT = TypeVar("DictT", bound=Mapping[str, Any])


class BatchedDataDict(UserDict, Generic[DictT]):
    """A batch as a dict of tensors (dim 0 = batch) and lists, NeMo-RL compatible.

    Besides NeMo-RL's ``micro_batch_indices``, ``micro_batch_lengths`` and
    ``elem_counts_per_gb``, a shard carries what its plan decided (the
    :class:`~.shard.ShardRecord` fields): ``micro_batch_token_cap``,
    ``micro_batch_static_lengths``, ``micro_batch_trees`` / ``micro_batch_tree_options``,
    ``micro_batch_passes`` and, for a :func:`seqpack.plan_step` plan, ``step_shard`` (the plan, so its CP size
    and forest). The iterators read them; an option that contradicts them is refused.

        >>> BatchedDataDict(x=[1, 2, 3]).slice(1, 3)
        {'x': [2, 3]}
    """

    ADDITIONAL_OPTIONAL_KEY_TENSORS = ["token_type_ids", "mm_token_type_ids"]
    # Defaults for batches pickled before these existed (instances set their own).
    micro_batch_token_cap: Optional[int] = None
    micro_batch_static_lengths: Optional[List[List[int]]] = None
    micro_batch_trees: Optional[List[List[Optional["PrefixTreeBatch"]]]] = None
    micro_batch_tree_options: Optional[Dict[str, Any]] = None
    step_shard: Optional["StepShard"] = None
    micro_batch_passes: Optional[List[Any]] = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for name in META:  # micro_batch_indices, micro_batch_lengths, elem_counts_per_gb, then seqpack's
            setattr(self, name, None)

    def _record(self) -> ShardRecord:
        return ShardRecord(self.data, **{name: getattr(self, name) for name in META})

    @classmethod
    def _of(cls, record: ShardRecord) -> "BatchedDataDict":
        out = cls(record.data)
        for name in META:
            setattr(out, name, getattr(record, name))
        return out

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
        without it a batch's rows are its first value's, as in NeMo-RL.

            >>> BatchedDataDict.from_batches([{"x": [1]}, {"x": [2, 3]}])
            {'x': [1, 2, 3]}
        """
        return cls(concat_batches(batches, pad_value_dict, allow_missing_packed_tensors=allow_missing_packed_tensors))

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
        return type(self)(all_gather_rows(self.data, group))

    # ---------------------------------------------------------------- sizes

    @property
    def size(self) -> int:
        """Rows of the first value (0 for an empty dict)."""
        return rows(next(iter(self.data.values()))) if self.data else 0

    def get_dict(self) -> dict:
        return self.data

    def get_multimodal_dict(self, as_tensors: bool = False, device=None, pixel_dtype=None) -> dict:
        """The multimodal values (NeMo-RL ``PackedTensor``s, as tensors when
        ``as_tensors``; pixel values cast to ``pixel_dtype`` when given) and the
        optional token-type tensors; with ``as_tensors`` coupled media keys must
        agree on their per-row segment counts (:func:`.media.multimodal_dict`)."""
        return multimodal_dict(self.data, self.ADDITIONAL_OPTIONAL_KEY_TENSORS, as_tensors, device, pixel_dtype)

    # ---------------------------------------------------------------- row selection

    def select_indices(self, indices: Union[List[int], "torch.Tensor"]) -> "BatchedDataDict":
        """Rows ``indices`` of every value (copies); metadata is not carried."""
        if is_tensor(indices):
            indices = indices.tolist()
        return type(self)({k: take(k, v, indices) for k, v in self.data.items()})

    def slice(self, start: int, end: int) -> "SlicedDataDict":
        """Rows ``[start, end)`` (tensor views, new lists)."""
        return SlicedDataDict(slice_rows(self.data, start, end))

    def chunk(self, rank: int, chunks: int) -> "SlicedDataDict":
        """The ``rank``-th of ``chunks`` contiguous, equal parts (copies)."""
        return SlicedDataDict(chunk_rows(self.data, rank, chunks))

    def reorder_data(self, reorded_indices: List[int]) -> None:
        """Undo a permutation in place: row ``j`` moves to position
        ``reorded_indices[j]`` (pass the ``sorted_indices`` of ``shard_by_batch_size``
        to restore the original order of concatenated shards)."""
        self.data.update(reordered(self.data, reorded_indices))

    def repeat_interleave(self, num_repeats: int, *, share_immutable_media: bool = False,
                          media_keys: Collection[str] = ()) -> "BatchedDataDict":
        """Every row repeated ``num_repeats`` times. List items are deep copies. With
        ``share_immutable_media`` (NeMo-RL's), only media is shared between the
        copies: every ``PackedTensor`` is flagged for deduplication (its segments are
        shared), and so are the leaves under NeMo-RL's native media keys
        (``vllm_content``, ``vllm_images``, ``vllm_videos``, ``vllm_audios``, plus
        seqpack's ``media_keys``) or inside a typed media content part
        (``{"type": "image", ...}``); token ids, text and every container are still
        copied, so editing one repeat never changes another."""
        return type(self)(repeat_rows(self.data, num_repeats, share_immutable_media=share_immutable_media,
                                      media_keys=media_keys))

    def truncate_tensors(self, dim: int, truncated_len: int) -> None:
        """Narrow every tensor with more than ``dim`` dimensions to ``truncated_len`` along ``dim``."""
        truncate(self.data, dim, truncated_len)

    def to(self, device) -> "BatchedDataDict":
        to_device(self.data, device)
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
        micro-batches as planned, and keeps the plan (its cap, static shapes, CP size
        and forest: a forest plan's micro-batches are its prefix trees, built here
        from ``input_ids``); an empty micro-batch (a dummy) becomes a one-row,
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
            check(batch_size is None, "batch_size must be None if allow_uneven_shards is True")
        check(dynamic_batching_args is None or sequence_packing_args is None,
              "dynamic_batching_args and sequence_packing_args cannot be passed together")
        if step_plan is not None:
            check(dynamic_batching_args is None and sequence_packing_args is None,
                  "step_plan cannot be combined with dynamic_batching_args or sequence_packing_args")
            return self._shards(*step_plan_shards(self.data, shards, batch_size, step_plan))
        shards = positive(shards, "shards")
        total = rows_to_split(self.data)
        batch_size = total if batch_size is None else positive(batch_size, "batch_size")
        check(total % batch_size == 0, f"Total batch size ({total}) is not a multiple of batch_size ({batch_size})")
        if not allow_uneven_shards:
            check(batch_size % shards == 0, f"Batch size ({batch_size}) is not a multiple of shards ({shards})")
        if dynamic_batching_args is not None:
            return self._shards(*dynamic_shards(self.data, shards, batch_size, dynamic_batching_args))
        if sequence_packing_args is not None:
            return self._shards(*packed_shards(self.data, shards, batch_size, sequence_packing_args))
        return [SlicedDataDict._of(s) for s in plain_shards(self.data, shards, batch_size, allow_uneven_shards)]

    @staticmethod
    def _shards(records: List[ShardRecord], order: List[int]) -> Tuple[List["SlicedDataDict"], List[int]]:
        return [SlicedDataDict._of(r) for r in records], order

    def dummy_microbatch(self, input_lengths_key: str = "input_lengths") -> "SlicedDataDict":
        """A one-row micro-batch that runs one token and adds nothing to the loss
        (row 0 with ``token_mask``/``sample_mask``/``loss_mask`` zeroed and
        ``input_lengths_key`` set to 1): what a rank with no work at a micro-batch
        step runs, so FSDP's per-micro-batch collectives still match."""
        return SlicedDataDict(dummy(self.data, input_lengths_key))

    # ---------------------------------------------------------------- per global batch

    def get_batch(self, batch_idx: int, batch_size: Optional[int] = None) -> "SlicedDataDict":
        """Global batch ``batch_idx`` of a shard, with its metadata (packed and
        step-plan shards know their per-batch row counts; others need ``batch_size``)."""
        return SlicedDataDict._of(global_batch(self._record(), batch_idx, batch_size))

    def make_microbatch_iterator(self, microbatch_size: int) -> Iterator["SlicedDataDict"]:
        """Consecutive slices of ``microbatch_size`` rows (a shard planned under a
        token cap iterates its planned micro-batches instead: refused here)."""
        return fixed_size(self._record(), microbatch_size, SlicedDataDict)

    def make_microbatch_iterator_with_dynamic_shapes(self, sequence_dim: int = 1, shared_prefix: Optional[bool] = None,
                                                     **tree_options: Any) -> Iterator["SlicedDataDict"]:
        """The dynamic-batching micro-batches, each cut to its padded length; with
        ``shared_prefix``, or on a shard planned as trees, each as a
        :class:`~seqpack.frameworks.nemo_rl.TreeMicroBatch` (``shared_prefix`` and
        ``tree_options`` as :meth:`make_microbatch_iterator_for_packable_sequences`).
        A shard whose ``micro_batch_lengths`` are packed token sums (sequence packing
        or a step plan, as rows) is refused."""
        return dynamic_shapes(self._record(), sequence_dim, shared_prefix, tree_options, SlicedDataDict)

    def get_microbatch_iterator_dynamic_shapes_len(self) -> int:
        return len(one_plan(self._record())[0])

    def make_microbatch_iterator_for_packable_sequences(self, shared_prefix: Optional[bool] = None,
                                                       **tree_options: Any) -> Iterator["SlicedDataDict"]:
        """The packed micro-batches (bins) as row slices (an empty one, a
        :func:`seqpack.plan_step` dummy, as :meth:`dummy_microbatch`).

        A shard planned as prefix trees (``sequence_packing_args["shared_prefix"]``,
        or a step plan made on a :class:`~seqpack.PrefixForest`) yields each bin as a
        :class:`~seqpack.frameworks.nemo_rl.TreeMicroBatch` (its rows'
        :class:`~seqpack.PrefixTreeBatch`, the rows, their positions), the trees built
        when the shards were; ``shared_prefix=False`` is refused there (as rows the
        bins may pass the cap). ``shared_prefix=True`` makes trees of a row plan's
        bins too. ``tree_options``: ``input_key`` (``"input_ids"``),
        ``input_lengths_key`` (``"input_lengths"``), ``group_key`` (share only within
        rows of one value of it; default any common prefix), ``min_shared_tokens``
        and ``pad_to_multiple_of`` (of the tree, e.g. :func:`seqpack.alignment`;
        default 1), as :func:`seqpack.pack_prefix_tree`. On a tree shard the keys and
        the sharing rule are the plan's (another is refused); other padding or
        sharing depth builds the trees again, and a tree whose real tokens pass its
        micro-batch's planned length is refused, and so is one padded past the
        shard's token cap (``max_tokens_per_microbatch`` or the step plan's
        ``max_tokens``).
        """
        return packable(self._record(), shared_prefix, tree_options, SlicedDataDict)

    def get_microbatch_iterator_for_packable_sequences_len(self) -> Tuple[int, int]:
        """(micro-batch count, largest packed token count)."""
        indices, lengths = one_plan(self._record())
        return len(indices), max(lengths, default=0)

    def make_packed_microbatch_iterator(
        self,
        keys: Optional[Sequence[str]] = None,
        *,
        input_lengths_key: str = "input_lengths",
        pad_multiple: Optional[int] = None,
        cp_size: Optional[int] = None,
        cp_rank: int = 0,
        tp_size: int = 1,
        sequence_parallel: bool = False,
        pp_size: int = 1,
        pad_values: Optional[Mapping[str, Union[int, float, bool]]] = None,
        group: Any = None,
        forest: Any = None,
    ) -> Iterator[Any]:
        """Ready micro-batches of a global batch, as its plan made them.

        Rows: each bin's ``[rows, S, ...]`` tensors (``keys``; default every tensor
        of ``[B, S, ...]`` shape) packed with the tensor engine
        (:class:`seqpack.PackedBatch`): every sequence padded to ``pad_multiple``
        (default :func:`seqpack.alignment` of CP/TP/SP), rank ``cp_rank``'s zigzag
        part with ``cp_size > 1``, and with ``pp_size > 1`` every micro-batch padded
        to the largest one (``pad_packed_to``, a fixed pipeline buffer, as
        Megatron-Core needs); a step plan's static shapes pad each to its bucket. A
        micro-batch packed past the shard's token cap (or its static shape) is
        refused.

        Prefix trees (a tree shard): the planned
        :class:`~seqpack.frameworks.nemo_rl.TreeMicroBatch` es; the row-packing
        options are refused.

        A global batch of a CP step plan (``shard_by_batch_size(D,
        step_plan=plan_step(..., cp_size=C))``, then ``get_batch``) yields rank
        ``cp_rank``'s :class:`seqpack.HybridCpBatch` micro-batches (its whole rows
        and its parts of the sharded ones, each padded as the plan counted; prefix
        trees when the plan was made on a forest; ``pad_multiple``, TP and PP do not
        apply), each with ``.data`` (its rows, in ``.rows`` order) for the loss
        wrapper; every rank of ``group`` (the DP x CP ranks, default WORLD) agrees on
        the plan first.

        A step plan's shard carries its CP size and forest: leave ``cp_size`` and
        ``forest`` out (the same value is accepted, another refused).
        """
        return packed_micro_batches(self._record(), keys, input_lengths_key=input_lengths_key,
                                    pad_multiple=pad_multiple, cp_size=cp_size, cp_rank=cp_rank, tp_size=tp_size,
                                    sequence_parallel=sequence_parallel, pp_size=pp_size, pad_values=pad_values,
                                    group=group, forest=forest, wrap=SlicedDataDict)


class SlicedDataDict(BatchedDataDict):
    """A slice or shard of a :class:`BatchedDataDict` (NeMo-RL's marker type)."""
