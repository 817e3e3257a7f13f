"""Planning: which sequences go together. Torch-free; lengths in, indices out.

- :mod:`~seqpack.planning.packing`: bin packers (concatenative, FFD, BFD, modified FFD,
  first-fit-shuffle, greedy sequential) behind :func:`get_packer`.
- :mod:`~seqpack.planning.balance`: Karmarkar–Karp / greedy partitions over DP ranks,
  micro-batch plans under a token cap.
- :mod:`~seqpack.planning.dynamic_batching`: NeMo-RL's dynamic batching plan.
- :mod:`~seqpack.planning.metrics`: packing, balance and padding metrics.
- :mod:`~seqpack.planning.cost`: :class:`CostModel`, what a micro-batch costs.
- :mod:`~seqpack.planning.step`: :func:`plan_step`, ranks and micro-batches planned together.
- :mod:`~seqpack.planning.step_options`: :class:`StepOptions`, a step plan's options as one object.
- :mod:`~seqpack.planning.prefix_forest`: :class:`PrefixForest`, what any subset of rows costs as a
  prefix tree.
- :mod:`~seqpack.planning.step_shapes`: the options of the largest-first micro-batch order and of static shape buckets (planned and costed in the core).
- :mod:`~seqpack.planning.stream`: :class:`StreamPlanner`, steps planned as asynchronous rollouts arrive.

>>> from seqpack.planning import get_packer
>>> get_packer("first_fit_decreasing", bin_capacity=10).pack([6, 5, 4, 3])
[[0, 2], [1, 3]]
"""

from .balance import (MicroBatchPlan, get_seqlen_balanced_partitions, greedy_lpt_partition, karmarkar_karp,
                      log_seqlen_unbalance, plan_micro_batches, sequence_workloads, sorted_stride_partition)
from .cost import CostModel
from .dynamic_batching import DynamicBatchingPlan, plan_dynamic_batching
from .metrics import PackingMetrics, dp_balance_metrics, dynamic_batching_metrics
from .packing import (BestFitDecreasingPacker, ConcatenativePacker, FirstFitDecreasingPacker, FirstFitPacker,
                      FirstFitShufflePacker, GreedySequentialPacker, ModifiedFirstFitDecreasingPacker, PackingAlgorithm,
                      SequencePacker, adjust_bin_count, get_packer)
from .prefix_forest import ForestItems, PrefixForest
from .prefix_reuse import PrefixReusePlan, plan_prefix_reuse
from .step import StepPlan, plan_step
from .step_options import StepOptions
from .stream import StreamPlanner
from .stream_step import StreamStep

__all__ = [
    "BestFitDecreasingPacker", "ConcatenativePacker", "FirstFitDecreasingPacker", "FirstFitPacker",
    "FirstFitShufflePacker", "GreedySequentialPacker", "ModifiedFirstFitDecreasingPacker",
    "CostModel", "DynamicBatchingPlan", "ForestItems", "MicroBatchPlan", "PackingAlgorithm", "PackingMetrics",
    "PrefixForest", "PrefixReusePlan", "SequencePacker",
    "adjust_bin_count", "dp_balance_metrics", "dynamic_batching_metrics", "get_packer",
    "get_seqlen_balanced_partitions", "greedy_lpt_partition", "karmarkar_karp", "log_seqlen_unbalance",
    "plan_dynamic_batching", "plan_micro_batches", "plan_prefix_reuse", "plan_step", "sequence_workloads", "sorted_stride_partition",
    "StepOptions", "StepPlan",
    "StreamPlanner", "StreamStep",
]
