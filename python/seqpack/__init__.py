"""seqpack: balance, pack and shard variable-length sequences for LLM training.

The planning layer (this release) decides which sequences go together:

    >>> import seqpack
    >>> seqpack.get_packer("modified_first_fit_decreasing", bin_capacity=100).pack([30, 30, 30, 30, 30])
    [[3, 4], [0, 1, 2]]
    >>> seqpack.get_seqlen_balanced_partitions([5, 3, 8, 1, 9, 2], k_partitions=2, equal_size=True)
    [[1, 4, 5], [0, 2, 3]]

``import seqpack`` never imports torch; functions accept lists, NumPy arrays and
1-D torch tensors alike.
"""

from __future__ import annotations

from typing import Any, Dict

from . import _core
from .balance import (
    MicroBatchPlan,
    get_seqlen_balanced_partitions,
    greedy_lpt_partition,
    karmarkar_karp,
    log_seqlen_unbalance,
    plan_micro_batches,
    sequence_workloads,
    sorted_stride_partition,
)
from .dynamic_batching import DynamicBatchingPlan, plan_dynamic_batching
from .metrics import PackingMetrics, dp_balance_metrics, dynamic_batching_metrics
from .packing import PackingAlgorithm, SequencePacker, adjust_bin_count, get_packer
from .thd import (PackedBatch, PackedSeqParams, StaticPackedBatch, alignment, pack_sequences, pack_sequences_static,
                  unpack_sequences)
from .cp import cp_partition_indices, cp_restore_order
from .logprobs import TokenLogprobs, packed_token_logprobs
from .loss import ClippedPGLoss, NLLLoss, SequencePackingLossWrapper, prepare_loss_input
from .attention import attention_backends, cp_attention, varlen_attention
from .dataset import PackedDataset, collate_packs, pack_dataset
from .batched_data_dict import BatchedDataDict, DynamicBatchingArgs, SequencePackingArgs, SlicedDataDict

__version__ = "0.1.0"

__all__ = [
    "BatchedDataDict",
    "DynamicBatchingArgs",
    "SequencePackingArgs",
    "SlicedDataDict",
    "PackedDataset",
    "collate_packs",
    "pack_dataset",
    "PackedBatch",
    "PackedSeqParams",
    "StaticPackedBatch",
    "pack_sequences_static",
    "alignment",
    "cp_partition_indices",
    "packed_token_logprobs",
    "TokenLogprobs",
    "ClippedPGLoss",
    "NLLLoss",
    "SequencePackingLossWrapper",
    "prepare_loss_input",
    "attention_backends",
    "cp_attention",
    "varlen_attention",
    "cp_restore_order",
    "pack_sequences",
    "unpack_sequences",
    "DynamicBatchingPlan",
    "MicroBatchPlan",
    "PackingAlgorithm",
    "PackingMetrics",
    "SequencePacker",
    "adjust_bin_count",
    "build_info",
    "dp_balance_metrics",
    "dynamic_batching_metrics",
    "get_packer",
    "get_seqlen_balanced_partitions",
    "greedy_lpt_partition",
    "karmarkar_karp",
    "log_seqlen_unbalance",
    "plan_dynamic_batching",
    "plan_micro_batches",
    "sequence_workloads",
    "sorted_stride_partition",
]


def build_info() -> Dict[str, Any]:
    """How the extension was built and what it sees: version, CUDA objects and the
    architectures they were compiled for (CMake's list: ``"80-real"`` is sm_80
    machine code, a bare ``"90"`` adds compute_90 PTX), the CPU build of the log-prob
    kernels, devices.

    >>> sorted(build_info())[:3]
    ['built_with_cuda', 'cpu_isa', 'cuda_architectures']
    """
    return {
        "version": __version__,
        "built_with_cuda": bool(_core.built_with_cuda),
        "cuda_architectures": [a for a in str(_core.cuda_architectures).split(",") if a],
        "cpu_isa": _core.logprob_cpu_isa(),
        "cuda_runtime_version": _core.cuda_runtime_version(),
        "cuda_device_count": _core.cuda_device_count(),
    }
