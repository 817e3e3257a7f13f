"""seqpack: balance, pack and shard variable-length sequences for LLM training.

The package is the C++ core's extension and six layers on it; each imports only the
layers above it in this list, every import statement counted
(``tests/python/test_layers.py`` enforces it; docs/architecture.md lists every module)::

    seqpack._core        the C++/CUDA extension (no Python inside the core)
    seqpack.planning     which sequences go together: packers, DP/micro-batch balance,
                         step plans, dynamic batching, metrics. Lengths in, indices out;
                         never imports torch.
    seqpack.tensors      the layouts of packed tokens (rows, prefix trees, hybrid-CP parts)
                         and their context-parallel cut; pack/unpack, dataset packing
    seqpack.training     what a trainer's step calls on any layout: attention, token
                         log-probs, the loss wrapper (one table picks the implementation)
    seqpack.frameworks   drop-ins for NeMo-RL (BatchedDataDict), ROLL, verl, NeMo AutoModel,
                         HF transformers, TRL and their YAML configs; adapters never import
                         each other
    seqpack.testing      reference planners, the frameworks' step plans, a tiny model (oracles)
    seqpack.tools        report, plots, the ``seqpack`` command line

The most used names are here at the top:

    >>> import seqpack
    >>> seqpack.get_packer("modified_first_fit_decreasing", bin_capacity=100).pack([30, 30, 30, 30, 30])
    [[3, 4], [0, 1, 2]]
    >>> seqpack.get_seqlen_balanced_partitions([5, 3, 8, 1, 9, 2], k_partitions=2, equal_size=True)
    [[1, 4, 5], [0, 2, 3]]

One operation per concept: ``seqpack.attention(q, k, v, layout)``,
``seqpack.token_logprobs(logits, layout, ...)`` and ``SequencePackingLossWrapper`` take
any layout (rows, a prefix tree, a CP cut of either from ``seqpack.shard_layout``, a
hybrid-CP micro-batch). The names of 0.1's per-kind functions still resolve, with a
``DeprecationWarning`` naming the new call (``_DEPRECATED``, docs/migration.md).

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
import warnings
from typing import TYPE_CHECKING, Any, Dict, List, Tuple

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
_export("planning.step_options", "StepOptions")
_export("planning.prefix_forest", "PrefixForest")
_export("planning.stream", "StreamPlanner")
_export("planning.stream_step", "StreamStep")
# Packed tensors: one layout (rows or a tree), its CP cut, what builds it
_export("tensors.token_layout", "TokenLayout")
_export("tensors.layout", "PackedLayout", "alignment")
_export("tensors.sharded_layout", "shard_layout")
_export("tensors.thd", "PackedBatch", "PackedSeqParams", "pack_sequences", "pack_to_layout", "unpack_sequences")
_export("tensors.thd_static", "StaticPackedBatch", "pack_sequences_static")
_export("tensors.dataset", "PackedDataset", "collate_packs", "pack_dataset")
_export("tensors.prefix_tree", "PrefixTreeBatch", "PrefixTreeMetrics", "pack_prefix_tree")
_export("tensors.tree_plans", "prepare_tree")
_export("tensors.prefix_passes", "split_prefix_tree")
_export("tensors.hybrid_cp", "HybridCpBatch", "pack_hybrid_cp", "hybrid_cp_micro_batches")
_export("tensors.hybrid_cp_groups", "hybrid_cp_groups")
# Training ops: one per concept, on any layout
_export("training.ops", "attention", "token_logprobs", "varlen_attention")
_export("training.logprobs", "TokenLogprobs")
_export("training.logprobs_columns", "column_logprobs", "linear_column_logprobs")
_export("training.loss", "SequencePackingLossWrapper", "prepare_loss_input", "NLLLoss", "ClippedPGLoss")
_export("training.prefix_reuse", "prefix_reuse")
_export("training.attention_varlen", "attention_backends")
# Frameworks
_export("frameworks.nemo_rl", "BatchedDataDict", "DynamicBatchingArgs", "SequencePackingArgs",
        "SlicedDataDict")

# The public names: every top-level name is here or a deprecated alias below
# (tests/python/test_api.py compares this list with a checked-in copy).
__all__ = [
    # planning
    "get_packer", "PackingAlgorithm", "SequencePacker", "adjust_bin_count",
    "get_seqlen_balanced_partitions", "karmarkar_karp", "greedy_lpt_partition", "sorted_stride_partition",
    "log_seqlen_unbalance", "plan_micro_batches", "MicroBatchPlan", "sequence_workloads",
    "plan_dynamic_batching", "DynamicBatchingPlan", "PackingMetrics", "dp_balance_metrics",
    "dynamic_batching_metrics", "CostModel", "plan_step", "StepPlan", "StepOptions", "PrefixForest", "StreamPlanner", "StreamStep",
    # packed tensors
    "TokenLayout", "PackedLayout", "alignment", "shard_layout", "PackedBatch", "PackedSeqParams", "pack_sequences",
    "pack_to_layout", "unpack_sequences", "StaticPackedBatch", "pack_sequences_static",
    "PackedDataset", "collate_packs", "pack_dataset", "pack_prefix_tree", "PrefixTreeBatch", "PrefixTreeMetrics",
    "prepare_tree", "HybridCpBatch", "pack_hybrid_cp", "hybrid_cp_micro_batches", "hybrid_cp_groups",
    "split_prefix_tree",
    # training
    "attention", "varlen_attention", "attention_backends", "token_logprobs", "TokenLogprobs",
    "column_logprobs", "linear_column_logprobs",
    "SequencePackingLossWrapper", "prepare_loss_input", "NLLLoss", "ClippedPGLoss", "prefix_reuse",
    # frameworks
    "BatchedDataDict", "DynamicBatchingArgs", "SequencePackingArgs", "SlicedDataDict",
    # support
    "build_info",
]

# Names of seqpack 0.1 kept for one release: name -> (module, attribute, the call
# that replaces it). ``seqpack.<name>`` still works and warns (DeprecationWarning);
# none is in __all__. docs/migration.md has the table.
_DEPRECATED: Dict[str, Tuple[str, str, str]] = {
    "packed_token_logprobs": ("training.logprobs", "packed_token_logprobs",
                              "seqpack.token_logprobs(logits, layout, input_ids)"),
    "linear_token_logprobs": ("training.logprobs", "linear_token_logprobs",
                              "seqpack.token_logprobs(hidden, layout, input_ids, weight=weight)"),
    "tree_token_logprobs": ("training.logprobs_tree", "tree_token_logprobs", "seqpack.token_logprobs(logits, tree)"),
    "tree_linear_token_logprobs": ("training.logprobs_tree", "tree_linear_token_logprobs",
                                   "seqpack.token_logprobs(hidden, tree, weight=weight)"),
    "hybrid_cp_token_logprobs": ("training.deprecated", "hybrid_cp_token_logprobs",
                                 "seqpack.token_logprobs(logits, micro_batch) (the parts back to back)"),
    "tree_attention": ("training.deprecated", "tree_attention", "seqpack.attention(q, k, v, tree)"),
    "cp_attention": ("training.deprecated", "cp_attention", "seqpack.attention(q, k, v, layout, group=group)"),
    "tree_cp_attention": ("training.attention_tree_cp", "tree_cp_attention",
                          "seqpack.attention(q, k, v, seqpack.shard_layout(tree, cp_size, cp_rank), group=group)"),
    "ulysses_attention": ("training.deprecated", "ulysses_attention",
                          "seqpack.attention(q, k, v, seqpack.shard_layout(layout, size, rank, scheme='ulysses'), "
                          "group=group)"),
    "hybrid_cp_attention": ("training.deprecated", "hybrid_cp_attention", "seqpack.attention(q, k, v, micro_batch)"),
    "HybridCpLossWrapper": ("training.deprecated", "HybridCpLossWrapper",
                            "seqpack.SequencePackingLossWrapper(loss_fn, cu_seqlens_q=micro_batch)"),
    "HybridCpPart": ("tensors.parts_layout", "HybridCpPart", "micro_batch.parts[i] (its cut_layout for the ops)"),
    "tree_attention_backends": ("training.attention_tree", "tree_attention_backends",
                                "seqpack.training.attention_tree.tree_attention_backends()"),
    "tree_cp_bounds": ("tensors.prefix_tree_cp", "tree_cp_bounds",
                       "seqpack.shard_layout(tree, cp_size, cp_rank).bounds"),
    "tree_cp_local_rows": ("tensors.prefix_tree_cp", "tree_cp_local_rows",
                           "seqpack.shard_layout(tree, cp_size, cp_rank).local_rows(full)"),
    "cp_partition_indices": ("tensors.cp", "cp_partition_indices",
                             "seqpack.shard_layout(layout, cp_size, cp_rank).local_rows(full) (or "
                             "seqpack.tensors.cp.cp_partition_indices)"),
    "cp_restore_order": ("tensors.cp", "cp_restore_order",
                         "seqpack.shard_layout(layout, cp_size, cp_rank).gather(local, group) (or "
                         "seqpack.tensors.cp.cp_restore_order)"),
}

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
    if name in _DEPRECATED:  # warns on every access (not cached), so each use site hears it
        module, attr, instead = _DEPRECATED[name]
        warnings.warn(f"seqpack.{name} is deprecated and goes in the next release: use {instead} "
                      "(docs/migration.md)", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(f"{__name__}.{module}"), attr)
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
    from .frameworks.nemo_rl import BatchedDataDict, DynamicBatchingArgs, SequencePackingArgs, SlicedDataDict
    from .planning.balance import (MicroBatchPlan, get_seqlen_balanced_partitions, greedy_lpt_partition,
                                   karmarkar_karp, log_seqlen_unbalance, plan_micro_batches, sequence_workloads,
                                   sorted_stride_partition)
    from .planning.cost import CostModel
    from .planning.dynamic_batching import DynamicBatchingPlan, plan_dynamic_batching
    from .planning.metrics import PackingMetrics, dp_balance_metrics, dynamic_batching_metrics
    from .planning.packing import PackingAlgorithm, SequencePacker, adjust_bin_count, get_packer
    from .planning.prefix_forest import PrefixForest
    from .planning.step import StepPlan, plan_step
    from .planning.step_options import StepOptions
    from .planning.stream import StreamPlanner
    from .planning.stream_step import StreamStep
    from .tensors.dataset import PackedDataset, collate_packs, pack_dataset
    from .tensors.hybrid_cp import HybridCpBatch, hybrid_cp_micro_batches, pack_hybrid_cp
    from .tensors.hybrid_cp_groups import hybrid_cp_groups
    from .tensors.layout import PackedLayout, alignment
    from .tensors.prefix_tree import PrefixTreeBatch, PrefixTreeMetrics, pack_prefix_tree
    from .tensors.sharded_layout import shard_layout
    from .tensors.thd import PackedBatch, PackedSeqParams, pack_sequences, pack_to_layout, unpack_sequences
    from .tensors.thd_static import StaticPackedBatch, pack_sequences_static
    from .tensors.token_layout import TokenLayout
    from .tensors.tree_plans import prepare_tree
    from .tensors.prefix_passes import split_prefix_tree
    from .training.attention_varlen import attention_backends
    from .training.logprobs import TokenLogprobs
    from .training.logprobs_columns import column_logprobs, linear_column_logprobs
    from .training.loss import ClippedPGLoss, NLLLoss, SequencePackingLossWrapper, prepare_loss_input
    from .training.ops import attention, token_logprobs, varlen_attention
    from .training.prefix_reuse import prefix_reuse
