"""ROLL's balancing and micro-batching, on ROLL's ``DataProto`` or on mappings.

A batch is ROLL's ``DataProto`` (``.batch`` tensors, ``.non_tensor_batch`` NumPy
object arrays, ``.meta_info``; duck-typed, ROLL is never imported), whose results
are built by its own ``select_idxs``/``slice`` and so keep its class, or a mapping
of tensors (and NumPy arrays or lists) sharing dimension 0, whose results are
:class:`RollBatch` dicts. Either needs an ``attention_mask [B, S]``; results carry
the ``meta_info`` keys ROLL writes. Invalid input raises ``ValueError``; in
dynamic batching, where ROLL asserts, a :class:`RollError` (also an ``AssertionError``).

* :func:`batch_balance` - Karmarkar-Karp over DP ranks with equal sizes, rows
  reordered in place so rank ``r`` takes the ``r``-th contiguous block.
* :func:`dynamic_batching_shard` + :func:`make_mini_batch_iter_for_dynamic_batching`
  + :func:`make_micro_batch_iter_for_dynamic_batching` - ROLL's dynamic batching
  (sort, stride across DP, one shared greedy plan, VPP split), its metrics and
  metadata. ``keep_dp_partition=True`` keeps a :func:`batch_balance` assignment
  instead of re-sorting the whole batch (ROLL re-sorts it away).
* :func:`make_micro_batch_iter_for_sequence_packing` (``load_balance``) - packed
  micro-batches under a **hard** cap (ROLL's may exceed
  ``max_packed_sequence_length``), at least ``min_num_micro_batches``, a multiple
  of the VPP size, the count agreed across the DP group when ``torch.distributed``
  is initialised; and :func:`restore_results_order`. ROLL's
  :class:`LoadBalancePacker`, :class:`SequencePackingPacker`,
  :class:`SequencePackingConfig`, :func:`get_sequence_packing_packer` and
  :func:`calculate_workload` are thin adapters over them with ROLL's signatures.
  With ``shared_prefix`` it plans prefix trees, and with ``prefix_reuse`` passes
  (:func:`pass_logprobs` runs one).

Example (ROLL's load-balance example: two micro-batches of exactly 4096 tokens):
    >>> import torch
    >>> lens = [512, 1024, 256, 2048, 128, 768, 1536, 384, 896, 640]
    >>> mask = (torch.arange(2048)[None, :] < torch.tensor(lens)[:, None]).long()
    >>> mbs = list(make_micro_batch_iter_for_sequence_packing({"attention_mask": mask},
    ...                                                       max_packed_sequence_length=4096))
    >>> [int(mb["attention_mask"].sum()) for mb in mbs]
    [4096, 4096]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Mapping, Optional, Sequence

import numpy as np

from .._batch import batch_size, is_data_proto, is_tensor, mask_lengths, select_all
from ..._equality import ValueEquality
from ..._lengths import as_positive_int
from ...tensors.layout import alignment
from ...planning.balance import WORKLOAD_ATTENTION_COEFF, get_seqlen_balanced_partitions, sequence_workloads
from ...planning.metrics import dp_balance_metrics
from .common import RollBatch, RollError, batch_columns, int_like
from .dynamic import (dynamic_batching_shard, make_micro_batch_iter_for_dynamic_batching,
                            make_mini_batch_iter_for_dynamic_batching)
from .packing import phase_value, pad_factor, pack_sequences_of, calculate_workload
from .prefix_reuse import pass_logprobs

if TYPE_CHECKING:  # pragma: no cover
    from ...planning.step import StepPlan

__all__ = [
    "LoadBalancePacker",
    "ROLL_ATTENTION_COEFF",
    "RollBatch",
    "RollError",
    "SequencePackingConfig",
    "SequencePackingPacker",
    "batch_balance",
    "calculate_workload",
    "dynamic_batching_shard",
    "get_sequence_packing_packer",
    "make_micro_batch_iter_for_dynamic_batching",
    "make_micro_batch_iter_for_sequence_packing",
    "make_mini_batch_iter_for_dynamic_batching",
    "pass_logprobs",
    "restore_results_order",
]

ROLL_ATTENTION_COEFF = WORKLOAD_ATTENTION_COEFF  # ROLL's name for it


# ---------------------------------------------------------------- batch balance


def batch_balance(batch: Any, dp_size: int, minibatch_size: int,
                  logging_prefix: str = "global_seqlen", keep_minibatch: bool = False) -> Dict[str, float]:
    """Balance the global batch over ``dp_size`` ranks, in place (ROLL's ``batch_balance``).

    Karmarkar-Karp with equal sizes on the workload ``24576·s + s²`` (``s`` = real
    tokens); each rank's rows ordered small…large…small, then rank 0's rows, rank
    1's... so that the usual contiguous dispatch hands rank ``r`` its part. With
    ``keep_minibatch`` each mini-batch of ``minibatch_size`` rows is balanced on its
    own. A DataProto is reordered with its own ``reorder`` (as ROLL does), a mapping
    key by key. Returns ``{prefix}/min, max, minmax_diff`` (contiguous split),
    ``balanced_min/max`` and ``mean`` in tokens.
    """
    dp_size = as_positive_int(dp_size, "dp_size")
    cols = batch_columns(batch)
    lengths = mask_lengths(cols)
    n = batch_size(cols)
    if n % dp_size:
        raise ValueError(f"the batch has {n} rows, not a multiple of dp_size={dp_size}")
    work = sequence_workloads(lengths, ROLL_ATTENTION_COEFF)
    if keep_minibatch:
        minibatch_size = int_like(minibatch_size)
        if type(minibatch_size) is not int or minibatch_size <= 0 or n % minibatch_size or minibatch_size % dp_size:
            raise ValueError(f"keep_minibatch needs a minibatch_size > 0 dividing the batch ({n} rows) and "
                             f"divisible by dp_size={dp_size}, got {minibatch_size!r}")
        parts: List[List[int]] = [[] for _ in range(dp_size)]
        for start in range(0, n, minibatch_size):
            local = get_seqlen_balanced_partitions(work[start:start + minibatch_size], dp_size, equal_size=True)
            for r in range(dp_size):
                parts[r].extend(start + i for i in local[r])
    else:
        parts = get_seqlen_balanced_partitions(work, dp_size, equal_size=True)
    ordered = []
    for part in parts:
        part = sorted(part, key=lambda i: (work[i], i))
        ordered.extend(part[0::2] + part[1::2][::-1])
    if is_data_proto(batch):
        _reorder_proto(batch, cols, ordered)
    else:
        for key, value in select_all(batch, ordered).items():
            batch[key] = value
    return dp_balance_metrics(lengths.tolist(), parts, logging_prefix)


def _reorder_proto(proto: Any, cols: Mapping[str, Any], order: List[int]) -> None:
    if callable(getattr(proto, "reorder", None)):
        import torch

        proto.reorder(torch.as_tensor(order, dtype=torch.long))
        return
    tensors = proto.batch
    tensor_keys = set(tensors.keys()) if tensors is not None else set()
    for key, value in select_all(cols, order).items():
        if key in tensor_keys:
            tensors[key] = value
        else:
            proto.non_tensor_batch[key] = value


# ---------------------------------------------------------------- sequence packing


def make_micro_batch_iter_for_sequence_packing(
    mini_batch: Any,
    tp_size: int = 1,
    cp_size: int = 1,
    vp_size: Optional[int] = 1,
    is_train: bool = False,
    dp_group=None,
    micro_batch_size: Optional[int] = None,
    config: Any = None,
    pp_size: Optional[int] = None,
    *,
    max_packed_sequence_length: Optional[int] = None,
    algorithm: Optional[str] = None,
    min_num_micro_batches: Optional[int] = None,
    pad_multiple: Optional[int] = None,
    step_plan: Optional["StepPlan"] = None,
    dp_rank: Optional[int] = None,
    mini_batch_index: int = 0,
    strict: bool = True,
    shared_prefix: bool = False,
    group_key: Optional[str] = None,
    prefix_reuse: bool = False,
    prefix_reuse_memory: str = "activations",
) -> Iterator[Any]:
    """Micro-batches of a mini-batch for sequence packing (ROLL ``algorithm``
    ``"none"``: consecutive chunks of ``micro_batch_size`` rows; ``"load_balance"``:
    balanced micro-batches under a hard cap).

    ROLL's positional form ``(mini_batch, tp_size, cp_size, vp_size, is_train,
    dp_group, micro_batch_size, config, pp_size)`` with a :class:`SequencePackingConfig`
    (or ROLL's own) runs that config's packer (:func:`get_sequence_packing_packer`):
    its algorithm, the phase's cap and minimum (``is_train``), ROLL's pad factor
    ``lcm(16, 2·CP·TP)`` and, with ``vp_size > 1``, a count that is a multiple of
    ``pp_size``. Without ``config`` the keywords say it all: ``algorithm``
    (default ``"load_balance"``), ``max_packed_sequence_length``,
    ``min_num_micro_batches`` (default 1), every sequence padded to ``pad_multiple``
    (default ``2·CP·TP`` with CP, ``TP`` without) and a count that is a multiple of
    ``vp_size`` (of ``pp_size`` when it is given and ``vp_size > 1``). A keyword
    given with ``config`` overrides the config's value.

    ``load_balance``: at least ``min_num_micro_batches``, the fewest such that
    Karmarkar-Karp (or LPT) balances the workload ``24576·s + s²`` with every
    micro-batch's padded tokens <= the cap; when ``torch.distributed`` is
    initialised every rank of ``dp_group`` (``None``: the default group) uses the
    largest rank's count. Without an initialised process group no collective runs,
    whatever ``dp_group`` is (ROLL's tests pass a stand-in object). Micro-batches run
    light, heavy, ..., heavy, light (pipeline bubbles at the ends are small).

    ``strict=False`` restores ROLL's rules exactly: ``load_balance`` takes
    ``max(1, ceil(padded tokens / cap))`` micro-batches (at most the rows, at least
    the minimum, the largest rank's, rounded up to the multiple), Karmarkar-Karp on
    the workloads of the padded lengths, ordered as ROLL orders them, so a
    micro-batch can exceed the cap; ``none`` takes ``rows // micro_batch_size``
    chunks of ``np.array_split`` sizes instead of requiring the size to divide the
    rows. A sequence longer than the cap is refused either way.

    ``step_plan`` (with ``dp_rank``, ``mini_batch_index``): rank ``dp_rank``'s
    micro-batches of that mini-batch from a :func:`seqpack.plan_step` plan
    (``mini_batch`` holds ``step_plan.rank_rows(dp_rank, mini_batch_index)``); the
    count is the same on every rank by construction, so no collective runs. An
    empty micro-batch is yielded as a one-row dummy (one token, zero loss masks)
    with ``is_padding_batch=True``: drop its outputs before
    :func:`restore_results_order`. Plan on the lengths as packed (each rounded up
    to the pad multiple) so that the cap holds after padding.

    ``shared_prefix`` (seqpack's ``sequence_packing_args.shared_prefix``;
    ``load_balance``, ``strict``): plan prefix trees of the rows (the trie of
    ``input_ids`` under ``attention_mask``; rows share only within one value of the
    ``group_key`` column when given): each micro-batch's *physical* tokens, padded
    as a whole to the pad multiple, stay under the cap, and a tree that fits stays
    whole. Each micro-batch's ``meta_info["prefix_tree"]`` is its rows'
    :class:`~seqpack.PrefixTreeBatch` (padded to the pad multiple). With
    ``step_plan`` the plan decides the micro-batches (plan it with ``forest=``) and
    each still gets its tree.

    ``prefix_reuse`` (seqpack's ``sequence_packing_args.prefix_reuse``; with
    ``shared_prefix``, no CP, no ``step_plan``; each pass padded to the pad
    multiple): where the mini-batch's trees would need more micro-batches than passes
    (a group over the cap, a row longer than it), each shared prefix is forwarded and
    back-propagated once
    (:mod:`seqpack.frameworks.roll.prefix_reuse`): one micro-batch per pass, each
    holding every row with its response masks kept where that pass predicts the
    token and ``meta_info["prefix_pass"]`` the pass to run (forward, then backward, in
    the order yielded; :func:`pass_logprobs` gives ROLL's log-probs of it), then the
    dummies. ``prefix_reuse_memory``: ``"activations"`` or ``"kv"``
    (:func:`seqpack.prefix_reuse`).

    A DataProto's micro-batches are its own ``select_idxs`` (its class); a mapping's
    are :class:`RollBatch`. As ROLL, the mini-batch's own ``meta_info`` (a
    DataProto's or a RollBatch's) gets ``partition_indices_list`` and
    ``sequence_packing_metrics`` (and, for ``"none"``, ``num_micro_batchs``), written
    when this is called. Each micro-batch's ``meta_info`` is a copy of it plus
    ``micro_batch_idx``, ``num_micro_batchs``, ``partition_indices``,
    ``partition_indices_list``, ``mini_batch_size`` and ``is_padding_batch``.
    ``sequence_packing_metrics`` holds ROLL's ``{train|forward}/num_micro_batches``,
    ``/effective_ratio``, ``/seq_len_balance_ratio``, ``/avg_samples_per_pack`` and
    seqpack's own (``load_balance``: ``num_micro_batches``, ``max_packed_tokens``,
    ``mean_packed_tokens``, ``fill``, ``workload_imbalance``, ``padding_tokens``).
    """
    if config is not None:
        packer = get_sequence_packing_packer(config) if algorithm is None else _packer_for(algorithm, config)
        return packer.make_micro_batch_iter_for_sequence_packing(
            mini_batch, tp_size, cp_size, vp_size, is_train, dp_group, micro_batch_size,
            1 if pp_size is None else pp_size, max_packed_sequence_length=max_packed_sequence_length,
            min_num_micro_batches=min_num_micro_batches, pad_multiple=pad_multiple, step_plan=step_plan,
            dp_rank=dp_rank, mini_batch_index=mini_batch_index, strict=strict, shared_prefix=shared_prefix,
            group_key=group_key, prefix_reuse=prefix_reuse, prefix_reuse_memory=prefix_reuse_memory)
    return pack_sequences_of(
        mini_batch, algorithm="load_balance" if algorithm is None else algorithm, cap=max_packed_sequence_length,
        min_num=1 if min_num_micro_batches is None else min_num_micro_batches, pad_multiple=pad_multiple,
        pad_rule=lambda cp, tp: alignment(cp, tp, rule="roll"), tp_size=tp_size, cp_size=cp_size, vp_size=vp_size,
        pp_size=pp_size, is_train=is_train, dp_group=dp_group, micro_batch_size=micro_batch_size,
        step_plan=step_plan, dp_rank=dp_rank, mini_batch_index=mini_batch_index, strict=strict,
        shared_prefix=shared_prefix, group_key=group_key, prefix_reuse=prefix_reuse,
        prefix_reuse_memory=prefix_reuse_memory)


def restore_results_order(results: Mapping[str, Any], partition_indices_list: Sequence[Sequence[int]],
                          config: Any = None) -> Dict[str, Any]:
    """Put per-row results of the packed micro-batches (concatenated in the order
    they were yielded) back in the mini-batch's row order. Scalars and non-tensor
    values pass through; an empty ``partition_indices_list`` (algorithm ``none``)
    changes nothing, nor does a ROLL ``config`` whose algorithm is ``"none"``
    (``results`` is returned as it is, as ROLL does)."""
    if config is not None and getattr(config, "algorithm", None) == "none":
        return results  # type: ignore[return-value]
    if not results:
        return {}
    if not partition_indices_list:
        return dict(results)
    flat = [i for part in partition_indices_list for i in part]
    if sorted(flat) != list(range(len(flat))):
        raise ValueError(f"partition_indices_list must hold each of the {len(flat)} rows 0..{len(flat) - 1} exactly "
                         "once (a permutation); it has duplicates or gaps")
    inverse = np.empty(len(flat), dtype=np.int64)
    inverse[np.asarray(flat, dtype=np.int64)] = np.arange(len(flat))
    out = {}
    for key, value in results.items():
        if is_tensor(value) and value.dim() > 0:
            if value.shape[0] != len(flat):
                raise ValueError(f"results[{key!r}] has {value.shape[0]} rows, the partitions {len(flat)}")
            import torch

            out[key] = value.index_select(0, torch.from_numpy(inverse).to(value.device))
        else:
            out[key] = value
    return out


# ---------------------------------------------------------------- ROLL's packer classes


@dataclass
class SequencePackingConfig:
    """ROLL's ``sequence_packing_args`` (``roll.configs.worker_config.SequencePackingConfig``):
    the same fields and defaults. ``max_packed_sequence_length`` (an older ROLL's
    single cap) is read for a phase whose own cap is ``None``."""

    algorithm: str = "none"
    max_packed_sequence_length_forward: Optional[int] = None
    max_packed_sequence_length_train: Optional[int] = None
    min_num_micro_batches_forward: int = 1
    min_num_micro_batches_train: int = 1
    max_packed_sequence_length: Optional[int] = None


class SequencePackingPacker(ValueEquality):
    """ROLL's packer for ``algorithm: none``: consecutive chunks of
    ``micro_batch_size`` rows (here their count must divide the rows), order kept.

    ``config`` is a :class:`SequencePackingConfig` or ROLL's own (read by attribute).
    """

    algorithm = "none"

    def __init__(self, config: Any = None):
        self.config = config if config is not None else SequencePackingConfig()

    def get_pad_factor(self, cp_size: int, tp_size: int) -> int:
        """ROLL's pad multiple: ``lcm(16, 2·CP·TP)`` with CP, ``lcm(16, TP)`` without."""
        return pad_factor(cp_size, tp_size)

    calculate_workload = staticmethod(calculate_workload)

    @staticmethod
    def ceildiv(a: int, b: int) -> int:
        return -(a // -b)

    def make_micro_batch_iter_for_sequence_packing(
        self, mini_batch: Any, tp_size: int = 1, cp_size: int = 1, vp_size: Optional[int] = 1,
        is_train: bool = False, dp_group=None, micro_batch_size: Optional[int] = None, pp_size: int = 1, *,
        max_packed_sequence_length: Optional[int] = None, min_num_micro_batches: Optional[int] = None,
        pad_multiple: Optional[int] = None, step_plan: Optional["StepPlan"] = None, dp_rank: Optional[int] = None,
        mini_batch_index: int = 0, strict: bool = True, shared_prefix: bool = False, group_key: Optional[str] = None,
        prefix_reuse: bool = False, prefix_reuse_memory: str = "activations",
    ) -> Iterator[Any]:
        """ROLL's signature; see :func:`make_micro_batch_iter_for_sequence_packing`
        (the keywords after ``pp_size`` are seqpack's and override the config)."""
        cap = (phase_value(self.config, is_train, "max_packed_sequence_length")
               if max_packed_sequence_length is None else max_packed_sequence_length)
        min_num = (phase_value(self.config, is_train, "min_num_micro_batches", 1)
                   if min_num_micro_batches is None else min_num_micro_batches)
        return pack_sequences_of(
            mini_batch, algorithm=self.algorithm, cap=cap, min_num=min_num, pad_multiple=pad_multiple,
            pad_rule=self.get_pad_factor, tp_size=tp_size, cp_size=cp_size, vp_size=vp_size,
            pp_size=1 if pp_size is None else pp_size, is_train=is_train, dp_group=dp_group,
            micro_batch_size=micro_batch_size, step_plan=step_plan, dp_rank=dp_rank,
            mini_batch_index=mini_batch_index, strict=strict, shared_prefix=shared_prefix, group_key=group_key,
            prefix_reuse=prefix_reuse, prefix_reuse_memory=prefix_reuse_memory)

    @staticmethod
    def restore_results_order(results: Mapping[str, Any], partition_indices_list: Sequence[Sequence[int]]) -> Any:
        """Nothing to restore: the rows kept their order (``results`` as it is)."""
        return results


class LoadBalancePacker(SequencePackingPacker):
    """ROLL's packer for ``algorithm: load_balance``, over seqpack's planner
    (:func:`seqpack.plan_micro_batches`): the same signature, metadata and
    ``partition_indices_list`` written on the mini-batch, but a **hard** cap (ROLL
    splits into ``ceil(tokens / cap)`` parts, which can exceed it; ``strict=False``
    restores that). ``dp_group`` may be ``None``; without an initialised process
    group no collective runs."""

    algorithm = "load_balance"

    @staticmethod
    def roundup_divisible(a: int, b: int) -> int:
        return ((a + b - 1) // b) * b

    @staticmethod
    def calculate_workload_batch(seqlen_tensor: Any) -> Any:
        return calculate_workload(seqlen_tensor)

    @staticmethod
    def get_device_name() -> str:
        import torch

        return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"

    @staticmethod
    def restore_results_order(results: Mapping[str, Any], partition_indices_list: Sequence[Sequence[int]]) -> Any:
        """:func:`restore_results_order`."""
        return restore_results_order(results, partition_indices_list)


def _packer_for(algorithm: Any, config: Any) -> SequencePackingPacker:
    if algorithm == "load_balance":
        return LoadBalancePacker(config)
    if algorithm == "none":
        return SequencePackingPacker(config)
    raise ValueError(f"Illegal sequence packing algorithm {algorithm!r}, algorithm must be in "
                     "['none', 'load_balance']")


def get_sequence_packing_packer(config: Any = None) -> SequencePackingPacker:
    """ROLL's factory: the packer of ``config.algorithm`` (``None``: a default
    :class:`SequencePackingConfig`, algorithm ``"none"``)."""
    if config is None:
        config = SequencePackingConfig()
    return _packer_for(getattr(config, "algorithm", "none"), config)
