"""Plan quality metrics, keyed as the frameworks users compare against log them.

* :class:`PackingMetrics` - NeMo-RL's packing metrics (same keys and formulas).
* :func:`dp_balance_metrics` - verl/ROLL ``log_seqlen_unbalance`` keys.
* :func:`dynamic_batching_metrics` - ROLL's ``dynamic_batching/*`` keys.

Every planner on one batch, side by side (HTML tables, plots), is
:func:`seqpack.tools.report.analyze`.

    >>> dp_balance_metrics([1, 1, 9, 9], [[0, 3], [1, 2]], prefix="p")["p/balanced_max"]
    10
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence

from .. import _core
from .._equality import ValueEquality
from .._lengths import as_lengths, as_positive_int, as_real

_STAT_KEYS = (
    "num_sequences",
    "num_bins",
    "total_sequence_length",
    "total_bin_capacity",
    "total_waste",
    "average_utilization",
    "waste_ratio",
    "bin_balance",
    "theoretical_min_bins",
    "bin_efficiency",
)


class PackingMetrics(ValueEquality):
    """Track packing quality across calls (drop-in for NeMo-RL's ``PackingMetrics``).

    Per solution (``calculate_stats_only``): ``average_utilization`` = total length /
    (bins x capacity), ``waste_ratio`` = 1 - utilization, ``bin_balance`` =
    1 - stdev(per-bin utilization) / average utilization (sample stdev; 1.0 for a
    single bin), ``theoretical_min_bins`` = ceil(total / capacity) and
    ``bin_efficiency`` = theoretical_min_bins / bins.

    Example:
        >>> m = PackingMetrics()
        >>> m.calculate_stats_only([30, 30, 30, 30, 30], [[4, 3, 2], [1, 0]], 100)["average_utilization"]
        0.75
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget every recorded solution."""
        self.total_sequences = 0
        self.total_bins = 0
        self.total_sequence_length = 0
        self.total_bin_capacity = 0
        self.total_waste = 0
        self.bin_utilizations: List[float] = []
        self.bin_counts: List[int] = []
        self.packing_times: List[float] = []
        self.min_utilization = 1.0
        self.max_utilization = 0.0
        self.min_waste_ratio = 1.0
        self.max_waste_ratio = 0.0

    def calculate_stats_only(
        self, sequence_lengths: Sequence[int], bins: List[List[int]], bin_capacity: int
    ) -> Dict[str, float]:
        """Metrics of one packing solution, without recording it."""
        lengths = as_lengths(sequence_lengths)
        stats = _core.packing_stats(lengths, bins, as_positive_int(bin_capacity, "bin_capacity"))
        return {k: stats[k] for k in _STAT_KEYS}

    def update(
        self,
        sequence_lengths: Sequence[int],
        bins: List[List[int]],
        bin_capacity: int,
        packing_time: Optional[float] = None,
    ) -> Dict[str, float]:
        """Record one solution and return its metrics."""
        stats = self.calculate_stats_only(sequence_lengths, bins, bin_capacity)
        lengths = as_lengths(sequence_lengths)
        self.total_sequences += len(lengths)
        self.total_bins += len(bins)
        self.total_sequence_length += int(lengths.sum())
        self.total_bin_capacity += len(bins) * int(bin_capacity)
        self.total_waste += stats["total_waste"]
        self.bin_utilizations.append(stats["average_utilization"])
        self.bin_counts.append(len(bins))
        if packing_time is not None:
            self.packing_times.append(as_real(packing_time, "packing_time", minimum=0))
        self.min_utilization = min(self.min_utilization, stats["average_utilization"])
        self.max_utilization = max(self.max_utilization, stats["average_utilization"])
        self.min_waste_ratio = min(self.min_waste_ratio, stats["waste_ratio"])
        self.max_waste_ratio = max(self.max_waste_ratio, stats["waste_ratio"])
        return stats

    def get_aggregated_stats(self) -> Dict[str, float]:
        """Metrics over every recorded solution ({} before the first)."""
        if not self.bin_utilizations:
            return {}
        cap = self.total_bin_capacity
        stats: Dict[str, Any] = {
            "total_sequences": self.total_sequences,
            "total_bins": self.total_bins,
            "average_utilization": self.total_sequence_length / cap if cap > 0 else 0.0,
            "min_utilization": self.min_utilization,
            "max_utilization": self.max_utilization,
            "average_waste_ratio": self.total_waste / cap if cap > 0 else 0.0,
            "min_waste_ratio": self.min_waste_ratio,
            "max_waste_ratio": self.max_waste_ratio,
            "average_bin_count": sum(self.bin_counts) / len(self.bin_counts),
        }
        if self.total_bins > 0:
            min_bins = math.ceil(self.total_sequence_length / (cap / self.total_bins))
            stats["bin_efficiency"] = min_bins / self.total_bins
        else:
            stats["bin_efficiency"] = 0.0
        if self.packing_times:
            stats["average_packing_time"] = sum(self.packing_times) / len(self.packing_times)
        return stats

    def print_aggregated_stats(self) -> None:
        """Print the aggregated metrics as a short report."""
        stats = self.get_aggregated_stats()
        if not stats:
            print("No metrics collected yet.")
            return
        print("\n=== Packing Metrics Summary ===")
        print(f"Total sequences packed: {stats['total_sequences']}")
        print(f"Total bins used: {stats['total_bins']}")
        print(
            f"Average bin utilization: {stats['average_utilization']:.4f} "
            f"(min: {stats['min_utilization']:.4f}, max: {stats['max_utilization']:.4f})"
        )
        print(
            f"Average waste ratio: {stats['average_waste_ratio']:.4f} "
            f"(min: {stats['min_waste_ratio']:.4f}, max: {stats['max_waste_ratio']:.4f})"
        )
        print(f"Bin efficiency (theoretical min bins / actual bins): {stats['bin_efficiency']:.4f}")
        if "average_packing_time" in stats:
            print(f"Average packing time: {stats['average_packing_time']:.6f} seconds")
        print("===============================\n")


def dp_balance_metrics(
    seqlen_list: Sequence[int], partitions: List[List[int]], prefix: str = "global_seqlen"
) -> Dict[str, float]:
    """Token sums per data-parallel rank, before and after balancing.

    Same keys as verl/ROLL ``log_seqlen_unbalance``: ``{prefix}/min``, ``/max`` and
    ``/minmax_diff`` of the contiguous split (``n // k`` rows per rank, what the
    ranks would get without balancing), ``/balanced_min`` and ``/balanced_max`` of
    ``partitions``, and ``/mean`` = total / k.

    Example:
        >>> dp_balance_metrics([1, 1, 9, 9], [[0, 3], [1, 2]], prefix="p")["p/minmax_diff"]
        16
    """
    stats = _core.dp_balance_stats(as_lengths(seqlen_list, "seqlen_list"), partitions)
    return {f"{prefix}/{k}": v for k, v in stats.items()}


def dynamic_batching_metrics(
    valid_tokens: int, actual_tokens: int, num_sequences: int, width: int, log_prefix: Optional[str] = None
) -> Dict[str, float]:
    """ROLL's dynamic-batching metrics.

    ``actual_tokens_origin`` = rows x padded width before dynamic batching,
    ``actual_tokens`` = tokens computed after it (all shards), and
    ``removed_padding_ratio`` = (origin - actual) / origin.

    Example:
        >>> dynamic_batching_metrics(44, 52, 8, 10)["dynamic_batching/removed_padding_ratio"]
        0.35
    """
    origin = num_sequences * width
    prefix = f"dynamic_batching/{log_prefix}" if log_prefix else "dynamic_batching"
    removed = origin - actual_tokens
    return {
        f"{prefix}/valid_tokens": valid_tokens,
        f"{prefix}/actual_tokens_origin": origin,
        f"{prefix}/actual_tokens": actual_tokens,
        f"{prefix}/removed_padding_tokens": removed,
        f"{prefix}/removed_padding_ratio": removed / origin if origin > 0 else 0.0,
    }
