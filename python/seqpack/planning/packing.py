"""Bin packing of sequence lengths: which sequences share a packed micro-batch.

Drop-in for NeMo-RL's ``nemo_rl.data.packing`` (``get_packer``,
``PackingAlgorithm``, packers with ``.pack()``), backed by the C++ core:

==============================  ===========  =====================================
algorithm                       complexity   notes
==============================  ===========  =====================================
``concatenative``               O(n)         dataset order (NeMo-RL's, exact bins)
``greedy_sequential``           O(n)         same rule; NeMo AutoModel's dataset packing
``first_fit_decreasing``        O(n log n)   NeMo-RL's bins exactly; max-tree over gaps
``best_fit_decreasing``         O(n log n)   tightest fitting bin
``modified_first_fit_decreasing`` O(n log n) NeMo-RL's 5-phase MFFD, exact bins
``first_fit_shuffle``           O(n log n)   seeded shuffle, then first fit
==============================  ===========  =====================================

Every packer guarantees: each index in exactly one bin, no bin over capacity, no
empty bin, the same bins for the same input (and seed) on every platform.

Example:
    >>> packer = get_packer("first_fit_decreasing", bin_capacity=100)
    >>> packer.pack([30, 30, 30, 30, 30])
    [[4, 3, 2], [1, 0]]
"""

from __future__ import annotations

import enum
import random
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from .. import _core
from .._lengths import as_positive_int, core_lengths, type_name
from .metrics import PackingMetrics


class PackingAlgorithm(enum.Enum):
    """Packing algorithms; names match NeMo-RL's enum where NeMo-RL has them."""

    CONCATENATIVE = "concatenative"
    FIRST_FIT_DECREASING = "first_fit_decreasing"
    FIRST_FIT_SHUFFLE = "first_fit_shuffle"
    MODIFIED_FIRST_FIT_DECREASING = "modified_first_fit_decreasing"
    BEST_FIT_DECREASING = "best_fit_decreasing"
    GREEDY_SEQUENTIAL = "greedy_sequential"


def _resolve_algorithm(algorithm: Union[PackingAlgorithm, str, enum.Enum]) -> PackingAlgorithm:
    valid = ", ".join(a.name for a in PackingAlgorithm)
    if isinstance(algorithm, PackingAlgorithm):
        return algorithm
    if isinstance(algorithm, enum.Enum) and isinstance(algorithm.value, str):
        algorithm = algorithm.value  # e.g. NeMo-RL's own PackingAlgorithm member
    if isinstance(algorithm, str):
        key = algorithm.strip().lower()
        for a in PackingAlgorithm:
            if key in (a.value, a.name.lower()):
                return a
    raise ValueError(f"Unknown packing algorithm: {algorithm!r}. Available algorithms: {valid}")


class SequencePacker:
    """Packs sequence lengths into bins of ``bin_capacity`` tokens.

    Use :func:`get_packer` to build one. Attributes mirror NeMo-RL's packers
    (``bin_capacity``, ``collect_metrics``, ``min_bin_count``,
    ``bin_count_multiple``, ``metrics``).
    """

    def __init__(
        self,
        algorithm: PackingAlgorithm,
        bin_capacity: int,
        collect_metrics: bool = False,
        min_bin_count: Optional[int] = None,
        bin_count_multiple: Optional[int] = None,
        seed: Optional[int] = None,
    ):
        if min_bin_count is not None:
            min_bin_count = as_positive_int(min_bin_count, "min_bin_count", allow_zero=True)
        if bin_count_multiple is not None:
            bin_count_multiple = as_positive_int(bin_count_multiple, "bin_count_multiple")
        if seed is not None and (isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer))):
            raise TypeError(f"seed must be an int or None, got {type_name(seed)}")
        self.algorithm = algorithm
        self.bin_capacity = as_positive_int(bin_capacity, "bin_capacity")
        self.collect_metrics = collect_metrics
        self.min_bin_count = min_bin_count
        self.bin_count_multiple = bin_count_multiple
        self.seed = seed  # any int: the core takes it modulo 2**64
        self.metrics: Optional[PackingMetrics] = PackingMetrics() if collect_metrics else None

    def _core_args(self) -> Dict[str, Any]:
        seed = self.seed
        if seed is None:
            # Like NeMo-RL, an unseeded shuffle follows Python's global `random`
            # state, so `random.seed(...)` makes it reproducible.
            seed = random.getrandbits(64) if self.algorithm is PackingAlgorithm.FIRST_FIT_SHUFFLE else 0
        return dict(
            bin_capacity=self.bin_capacity,
            min_bin_count=0 if self.min_bin_count is None else self.min_bin_count,
            bin_count_multiple=1 if self.bin_count_multiple is None else self.bin_count_multiple,
            seed=int(seed) & 0xFFFFFFFFFFFFFFFF,
        )

    def pack(self, sequence_lengths: Any) -> List[List[int]]:
        """Pack lengths (list, NumPy array or 1-D tensor) into bins of indices.

        Raises:
            ValueError: a length exceeds ``bin_capacity``, a length is negative (or
                not positive for MFFD), or there are fewer sequences than the bin
                count that ``min_bin_count`` / ``bin_count_multiple`` require.
        """
        lengths = core_lengths(sequence_lengths)
        bins = _core.pack(self.algorithm.value, lengths, **self._core_args())
        if self.metrics is not None:
            self.metrics.update(lengths, bins, self.bin_capacity)
        return bins

    def pack_arrays(self, sequence_lengths: Any) -> Tuple[np.ndarray, np.ndarray]:
        """Like :meth:`pack`, as CSR arrays ``(offsets, indices)`` (int64).

        Bin ``b`` holds ``indices[offsets[b]:offsets[b+1]]``. Avoids building Python
        lists, which dominates for 10^5+ sequences. Metrics are not collected.
        """
        return _core.pack(self.algorithm.value, core_lengths(sequence_lengths), as_arrays=True, **self._core_args())

    def compute_metrics(self, sequence_lengths: Sequence[int], bins: List[List[int]]) -> Dict[str, float]:
        """Metrics of a solution without recording it (NeMo-RL keys)."""
        return (self.metrics or PackingMetrics()).calculate_stats_only(sequence_lengths, bins, self.bin_capacity)

    def get_aggregated_metrics(self) -> Dict[str, float]:
        """Aggregated metrics over every ``pack`` call ({} unless ``collect_metrics``)."""
        return self.metrics.get_aggregated_stats() if self.metrics else {}

    def reset_metrics(self) -> None:
        if self.metrics:
            self.metrics.reset()

    def print_metrics(self) -> None:
        if not self.metrics:
            print("Metrics collection is not enabled. Initialize with collect_metrics=True.")
            return
        self.metrics.print_aggregated_stats()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(algorithm={self.algorithm.value!r}, bin_capacity={self.bin_capacity}, "
            f"min_bin_count={self.min_bin_count}, bin_count_multiple={self.bin_count_multiple})"
        )


def get_packer(
    algorithm: Union[PackingAlgorithm, str],
    bin_capacity: int,
    collect_metrics: bool = False,
    min_bin_count: Optional[int] = None,
    bin_count_multiple: Optional[int] = None,
    seed: Optional[int] = None,
) -> SequencePacker:
    """Build a packer (same signature as NeMo-RL's ``get_packer``, plus ``seed``).

    Args:
        algorithm: a :class:`PackingAlgorithm` or its name, case-insensitive.
        bin_capacity: tokens per bin (e.g. ``max_tokens_per_microbatch``).
        collect_metrics: record :class:`PackingMetrics` on every ``pack``.
        min_bin_count: at least this many bins (NeMo-RL passes the DP size).
        bin_count_multiple: the bin count is a multiple of this.
        seed: ``first_fit_shuffle`` seed; ``None`` draws from Python's ``random``.

    Raises:
        ValueError: unknown algorithm (the message lists the valid names), or
            invalid ``bin_capacity`` / ``min_bin_count`` / ``bin_count_multiple``.

    Example:
        >>> get_packer("MODIFIED_FIRST_FIT_DECREASING", 100).pack([46, 24, 55, 88, 11, 14, 73, 17])
        [[3, 4], [6, 5], [2, 7, 1], [0]]
    """
    return SequencePacker(
        _resolve_algorithm(algorithm),
        bin_capacity,
        collect_metrics=collect_metrics,
        min_bin_count=min_bin_count,
        bin_count_multiple=bin_count_multiple,
        seed=seed,
    )


def adjust_bin_count(bins: List[List[int]], min_bin_count: int = 0, bin_count_multiple: int = 1) -> List[List[int]]:
    """Apply NeMo-RL's bin-count rule to existing bins.

    The count is raised to ``min_bin_count`` and rounded up to a multiple of
    ``bin_count_multiple``; each new bin takes the last item of the bin holding the
    most items (ties: the higher bin index).

    Example:
        >>> adjust_bin_count([[8, 0], [7, 1], [6, 2], [5, 3], [4]], min_bin_count=7)
        [[8, 0], [7, 1], [6], [5], [4], [3], [2]]
    """
    return _core.adjust_bin_count(bins, as_positive_int(min_bin_count, "min_bin_count", allow_zero=True),
                                  as_positive_int(bin_count_multiple, "bin_count_multiple"))
