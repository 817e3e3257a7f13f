"""NeMo-RL's ``BatchedDataDict`` (v0.6), planned by seqpack's core: a package, one
concept per module, each a set of functions over a batch's data or a plain shard
record (:class:`~.shard.ShardRecord`), with the class's methods calling them.

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

Modules (none imports the class; the class imports them):

- :mod:`.errors` / :mod:`.args`: :class:`BatchedDataDictError`, the sharding argument types.
- :mod:`.rows`, :mod:`.concat`, :mod:`.media`, :mod:`.gather`: row operations on the
  data (``slice``, ``chunk``, ``reorder_data``, ``from_batches``, the multimodal rules,
  ``all_gather``).
- :mod:`.shard`: the shard record, its global batches (``get_batch``).
- :mod:`.sharding` (NeMo-RL's plain, dynamic-batching and sequence-packing shards) and
  :mod:`.step_shards` (shards of a :func:`seqpack.plan_step` plan).
- :mod:`.trees`: :class:`TreeMicroBatch` and the trees of a shard's micro-batches.
- :mod:`.iterators`, :mod:`.packed`, :mod:`.cp_iterator`: what each iterator yields
  for what the shard was planned as (rows, prefix trees, a CP step plan).
- :mod:`.batched_data_dict`: the classes.

Differences from NeMo-RL, all on inputs NeMo-RL mishandles: errors are
:class:`BatchedDataDictError` (both a ``ValueError`` and an ``AssertionError``, so
code written for either keeps working); ``chunk`` accepts every ``rank < chunks``
(NeMo-RL compares with the chunk size); ``reorder_data`` rejects an index list of
the wrong length (NeMo-RL truncates); iterators validate when called, not at the
first ``next()``; lengths may be lists; an iterator never yields a micro-batch past
the cap its shard was planned under (it yields the planned trees, or refuses by
name). Like NeMo-RL, dynamic batching's ``sorted_indices`` are chunk-major, so with
several global batches they do not undo the shard order (``reorder_data`` restores
it when ``batch_size`` is None, as NeMo-RL uses it).

Beyond NeMo-RL (opt-in): ``balance="karmarkar_karp"`` in ``sequence_packing_args``
deals bins to shards by load, ``dynamic_batching_args["rule"] = "optimal"``
plans micro-batches with the fewest padded tokens, ``step_plan=`` shards by a
:func:`seqpack.plan_step` plan (ranks and micro-batches planned together, the shard
keeping the plan's cap, static shapes, CP size and forest; a rank's empty micro-batch
is yielded as a one-token dummy row with zero loss masks),
:meth:`BatchedDataDict.make_packed_microbatch_iterator` yields ready THD
micro-batches, and ``repeat_interleave(..., media_keys=)`` names more row keys whose
leaves are media, shared with ``share_immutable_media`` like NeMo-RL's ``vllm_*`` keys.
"""

from .args import DynamicBatchingArgs, SequencePackingArgs
from .batched_data_dict import BatchedDataDict, SlicedDataDict
from .errors import BatchedDataDictError
from .shard import ShardRecord, StepShard
from .sharding import bin_assignment_spread
from .trees import TreeMicroBatch

__all__ = ["BatchedDataDict", "BatchedDataDictError", "DynamicBatchingArgs", "SequencePackingArgs", "ShardRecord",
           "SlicedDataDict", "StepShard", "TreeMicroBatch", "bin_assignment_spread"]
