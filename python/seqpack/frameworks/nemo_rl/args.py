"""NeMo-RL's sharding arguments of ``BatchedDataDict.shard_by_batch_size``, with
seqpack's additions marked.

    >>> from seqpack.frameworks.nemo_rl.args import SequencePackingArgs
    >>> args = SequencePackingArgs(max_tokens_per_microbatch=4096, input_key="input_ids",
    ...                            input_lengths_key="input_lengths", algorithm="modified_first_fit_decreasing",
    ...                            sequence_length_pad_multiple=8)
    >>> args["algorithm"]
    'modified_first_fit_decreasing'

Importing this module does not import torch.
"""

from __future__ import annotations

from typing import Literal

try:  # Python 3.11+
    from typing import NotRequired, TypedDict
except ImportError:  # pragma: no cover
    from typing_extensions import NotRequired, TypedDict

__all__ = ["DynamicBatchingArgs", "SequencePackingArgs"]


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
    (:class:`~seqpack.loss.DPOLoss`) runs packed. ``prefix_reuse`` (seqpack's, with
    ``shared_prefix``): each global batch planned by
    ``plan_step(..., forest=, prefix_reuse=True)`` over the shards, a tree larger
    than the cap run in passes (its shared prefix once in the step), a row longer
    than the cap planned; trees and passes padded to ``sequence_length_pad_multiple``."""

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
    prefix_reuse: NotRequired[bool]


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
