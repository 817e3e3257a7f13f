"""seqpack: balance, pack and shard variable-length sequences for LLM training.

The package has five layers; each imports only the layers above it in this list
(``tests/python/test_layers.py`` enforces it)::

    seqpack._core        the C++/CUDA extension (no Python inside the core)
    seqpack.planning     which sequences go together: packers, DP/micro-batch balance,
                         dynamic batching, metrics. Lists in, lists out; never imports torch.
    seqpack.tensors      the packed (THD) layout: PackedLayout, pack/unpack, context
                         parallelism, dataset packing
    seqpack.training     ops a trainer calls: packed log-probs, the loss wrapper, varlen and tree attention
    seqpack.frameworks   drop-ins for NeMo-RL (BatchedDataDict), ROLL, verl, HF and their
                         YAML configs; adapters never import each other
    seqpack.tools        report, plots, the ``seqpack`` command line
    seqpack.testing      reference implementations and a tiny model (oracles for tests)

The most used names are here at the top:

    >>> import seqpack
    >>> seqpack.get_packer("modified_first_fit_decreasing", bin_capacity=100).pack([30, 30, 30, 30, 30])
    [[3, 4], [0, 1, 2]]
    >>> seqpack.get_seqlen_balanced_partitions([5, 3, 8, 1, 9, 2], k_partitions=2, equal_size=True)
    [[1, 4, 5], [0, 2, 3]]

Everything is imported on first use, so ``import seqpack`` never imports torch;
the planning functions accept lists, NumPy arrays and 1-D torch tensors alike.
The pre-layer module paths (``seqpack.roll``, ``seqpack.loss``, ``seqpack.thd``, ...)
are the same module objects as their new homes.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import TYPE_CHECKING, Any, Dict, List

from ._version import __version__

# name -> the submodule (relative to seqpack) that defines it; loaded on first access.
_EXPORTS: Dict[str, str] = {}


def _export(module: str, *names: str) -> None:
    for name in names:
        _EXPORTS[name] = module


# Planning (torch-free)
_export("planning.packing", "PackingAlgorithm", "SequencePacker", "get_packer", "adjust_bin_count")
_export("planning.balance", "MicroBatchPlan", "get_seqlen_balanced_partitions", "karmarkar_karp",
        "greedy_lpt_partition", "plan_micro_batches", "sequence_workloads", "sorted_stride_partition",
        "log_seqlen_unbalance")
_export("planning.dynamic_batching", "DynamicBatchingPlan", "plan_dynamic_batching")
_export("planning.metrics", "PackingMetrics", "dp_balance_metrics", "dynamic_batching_metrics")
_export("planning.cost", "CostModel")
_export("planning.step", "StepPlan", "plan_step")
_export("planning.prefix_forest", "PrefixForest")
_export("planning.stream", "StreamPlanner", "StreamStep")
# Packed tensors
_export("tensors.layout", "PackedLayout", "alignment")
_export("tensors.thd", "PackedBatch", "PackedSeqParams", "pack_sequences", "pack_to_layout", "unpack_sequences")
_export("tensors.thd_static", "StaticPackedBatch", "pack_sequences_static")
_export("tensors.cp", "cp_partition_indices", "cp_restore_order")
_export("tensors.dataset", "PackedDataset", "collate_packs", "pack_dataset")
_export("tensors.prefix_tree", "PrefixTreeBatch", "PrefixTreeMetrics", "pack_prefix_tree")
_export("tensors.prefix_tree_cp", "tree_cp_bounds", "tree_cp_local_rows")
_export("tensors.tree_plans", "prepare_tree")
_export("tensors.hybrid_cp", "HybridCpBatch", "HybridCpPart", "pack_hybrid_cp", "hybrid_cp_micro_batches")
_export("tensors.hybrid_cp_groups", "hybrid_cp_groups")
# Training ops
_export("training.logprobs", "TokenLogprobs", "packed_token_logprobs", "linear_token_logprobs")
_export("training.logprobs_tree", "tree_token_logprobs", "tree_linear_token_logprobs")
_export("training.logprobs_columns", "column_logprobs", "linear_column_logprobs")
_export("training.loss", "SequencePackingLossWrapper", "prepare_loss_input", "NLLLoss", "ClippedPGLoss")
_export("training.attention_hybrid_cp", "hybrid_cp_attention", "hybrid_cp_token_logprobs")
_export("training.loss_hybrid_cp", "HybridCpLossWrapper")
_export("training.attention", "varlen_attention", "cp_attention", "ulysses_attention", "attention_backends",
        "tree_attention", "tree_attention_backends", "tree_cp_attention")
# Frameworks
_export("frameworks.batched_data_dict", "BatchedDataDict", "DynamicBatchingArgs", "SequencePackingArgs",
        "SlicedDataDict")

__all__ = [
    # planning
    "get_packer", "PackingAlgorithm", "SequencePacker",
    "get_seqlen_balanced_partitions", "karmarkar_karp", "plan_micro_batches", "MicroBatchPlan",
    "plan_dynamic_batching", "DynamicBatchingPlan", "PackingMetrics", "CostModel", "plan_step", "StepPlan",
    "PrefixForest", "StreamPlanner", "StreamStep",
    # packed tensors
    "PackedLayout", "alignment", "PackedBatch", "PackedSeqParams", "pack_sequences", "pack_to_layout",
    "unpack_sequences",
    "StaticPackedBatch", "pack_sequences_static", "cp_partition_indices", "cp_restore_order",
    "collate_packs", "pack_dataset", "pack_prefix_tree", "PrefixTreeBatch", "PrefixTreeMetrics",
    "tree_cp_bounds", "tree_cp_local_rows", "prepare_tree",
    "HybridCpBatch", "HybridCpPart", "pack_hybrid_cp", "hybrid_cp_micro_batches", "hybrid_cp_groups",
    # training
    "packed_token_logprobs", "linear_token_logprobs", "tree_token_logprobs", "tree_linear_token_logprobs",
    "column_logprobs", "linear_column_logprobs",
    "TokenLogprobs",
    "SequencePackingLossWrapper", "HybridCpLossWrapper",
    "prepare_loss_input",
    "varlen_attention", "cp_attention", "ulysses_attention", "tree_attention", "tree_attention_backends",
    "tree_cp_attention", "hybrid_cp_attention", "hybrid_cp_token_logprobs",
    # frameworks
    "BatchedDataDict",
    # support
    "build_info",
]

_SUBPACKAGES = ("planning", "tensors", "training", "frameworks", "tools", "testing")

# Module paths from before the layers; each is an alias of the module that moved.
_MOVED: Dict[str, str] = {
    "packing": "planning.packing",
    "balance": "planning.balance",
    "dynamic_batching": "planning.dynamic_batching",
    "metrics": "planning.metrics",
    "thd": "tensors.thd",
    "cp": "tensors.cp",
    "dataset": "tensors.dataset",
    "logprobs": "training.logprobs",
    "loss": "training.loss",
    "attention": "training.attention",
    "batched_data_dict": "frameworks.batched_data_dict",
    "roll": "frameworks.roll",
    "verl": "frameworks.verl",
    "automodel": "frameworks.automodel",
    "config": "frameworks.config",
    "integrations": "frameworks",
    "integrations.automodel": "frameworks.automodel",
    "integrations.hf": "frameworks.hf",
    "integrations.trl": "frameworks.trl",
    "report": "tools.report",
    "plot": "tools.plot",
    "cli": "tools.cli",
    "reference": "testing.reference",
    "tiny_model": "testing.tiny_model",
}


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec):  # the moved module itself, not a copy
        return importlib.import_module(self.target)

    def exec_module(self, module) -> None:
        pass


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Makes ``import seqpack.roll`` load ``seqpack.frameworks.roll`` (same object)."""

    def find_spec(self, fullname, path=None, target=None):
        head, _, rest = fullname.partition(".")
        if head != __name__ or rest not in _MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(f"{__name__}.{_MOVED[rest]}"))


if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
    # First, so that ``seqpack.integrations.hf`` is not found again on the path as a second copy.
    sys.meta_path.insert(0, _MovedModuleFinder())


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    elif name in _SUBPACKAGES or name in _MOVED:
        value = importlib.import_module(f"{__name__}.{name}")
    elif name == "_core":
        value = importlib.import_module(f"{__name__}._core")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(_EXPORTS) | set(_SUBPACKAGES) | set(_MOVED))


def build_info() -> Dict[str, Any]:
    """How the extension was built and what it sees: version, CUDA objects and the
    architectures they were compiled for (CMake's list: ``"80-real"`` is sm_80
    machine code, a bare ``"90"`` adds compute_90 PTX), the CPU build of the log-prob
    kernels, devices.

    >>> sorted(build_info())[:3]
    ['built_with_cuda', 'cpu_isa', 'cuda_architectures']
    """
    from . import _core

    return {
        "version": __version__,
        "built_with_cuda": bool(_core.built_with_cuda),
        "cuda_architectures": [a for a in str(_core.cuda_architectures).split(",") if a],
        "cpu_isa": _core.logprob_cpu_isa(),
        "cuda_runtime_version": _core.cuda_runtime_version(),
        "cuda_device_count": _core.cuda_device_count(),
    }


if TYPE_CHECKING:  # what the lazy attributes resolve to, for type checkers and IDEs
    from . import frameworks, planning, tensors, testing, tools, training
    from .frameworks import config, roll, verl
    from .frameworks.batched_data_dict import (BatchedDataDict, DynamicBatchingArgs, SequencePackingArgs,
                                               SlicedDataDict)
    from .planning.balance import (MicroBatchPlan, get_seqlen_balanced_partitions, greedy_lpt_partition,
                                   karmarkar_karp, log_seqlen_unbalance, plan_micro_batches, sequence_workloads,
                                   sorted_stride_partition)
    from .planning.cost import CostModel
    from .planning.dynamic_batching import DynamicBatchingPlan, plan_dynamic_batching
    from .planning.metrics import PackingMetrics, dp_balance_metrics, dynamic_batching_metrics
    from .planning.packing import PackingAlgorithm, SequencePacker, adjust_bin_count, get_packer
    from .planning.prefix_forest import PrefixForest
    from .tensors.cp import cp_partition_indices, cp_restore_order
    from .tensors.dataset import PackedDataset, collate_packs, pack_dataset
    from .tensors.layout import PackedLayout, alignment
    from .tensors.prefix_tree import PrefixTreeBatch, PrefixTreeMetrics, pack_prefix_tree
    from .tensors.prefix_tree_cp import tree_cp_bounds, tree_cp_local_rows
    from .tensors.hybrid_cp import HybridCpBatch, HybridCpPart, hybrid_cp_micro_batches, pack_hybrid_cp
    from .tensors.hybrid_cp_groups import hybrid_cp_groups
    from .tensors.tree_plans import prepare_tree
    from .tensors.thd import PackedBatch, PackedSeqParams, pack_sequences, pack_to_layout, unpack_sequences
    from .tensors.thd_static import StaticPackedBatch, pack_sequences_static
    from .training.attention import (attention_backends, cp_attention, tree_attention, tree_attention_backends,
                                     tree_cp_attention, ulysses_attention, varlen_attention)
    from .training.attention_hybrid_cp import hybrid_cp_attention, hybrid_cp_token_logprobs
    from .training.loss_hybrid_cp import HybridCpLossWrapper
    from .training.logprobs import TokenLogprobs, packed_token_logprobs
    from .training.logprobs_columns import column_logprobs, linear_column_logprobs
    from .training.logprobs_tree import tree_linear_token_logprobs, tree_token_logprobs
    from .training.loss import ClippedPGLoss, NLLLoss, SequencePackingLossWrapper, prepare_loss_input
