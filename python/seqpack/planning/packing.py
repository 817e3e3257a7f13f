"""Bin packing of sequence lengths: which sequences share a packed micro-batch.

Drop-in for NeMo-RL's ``nemo_rl.data.packing`` (``get_packer``,
``PackingAlgorithm``, the ``SequencePacker`` base and the packer classes of NeMo-RL's
names, e.g. ``ModifiedFirstFitDecreasingPacker(bin_capacity)``), backed by the C++ core:

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

from .._equality import ValueEquality
from .. import _core
from .._lengths import as_int, as_lengths, as_positive_int, core_lengths
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


class SequencePacker(ValueEquality):
    """Packs sequence lengths into bins of ``bin_capacity`` tokens: NeMo-RL's
    ``SequencePacker`` base class, backed by the C++ core.

    Build one with :func:`get_packer`, or with the class of NeMo-RL's name
    (:class:`ConcatenativePacker`, :class:`FirstFitDecreasingPacker`,
    :class:`FirstFitShufflePacker`, :class:`ModifiedFirstFitDecreasingPacker`; seqpack's
    :class:`BestFitDecreasingPacker` and :class:`GreedySequentialPacker`), whose
    constructors take NeMo-RL's arguments (``bin_capacity, collect_metrics=False,
    min_bin_count=None, bin_count_multiple=None``) plus the keyword ``seed``.
    Attributes mirror NeMo-RL's (``bin_capacity``, ``collect_metrics``,
    ``min_bin_count``, ``bin_count_multiple``, ``metrics``).

    As in NeMo-RL, :meth:`pack` is :meth:`_pack_implementation` (the natural bins)
    followed by :meth:`_adjust_bin_count` (the bin-count rule); a subclass that
    overrides either (a NeMo-RL custom packer) runs exactly that, in Python. The
    built-in packers run both steps in one core call.

    >>> ModifiedFirstFitDecreasingPacker(10).pack([6, 6, 3, 3, 1, 1])
    [[0, 2, 4], [1, 3, 5]]
    >>> class AllInOne(SequencePacker):  # a packer written against NeMo-RL's base
    ...     def _pack_implementation(self, sequence_lengths):
    ...         return [list(range(len(sequence_lengths)))]
    >>> AllInOne(100, min_bin_count=2).pack([5, 6, 7])
    [[0, 1], [2]]
    """

    #: The core algorithm of this class (``None``: a subclass gives ``_pack_implementation``).
    algorithm: Optional[PackingAlgorithm] = None

    def __init__(
        self,
        bin_capacity: int,
        collect_metrics: bool = False,
        min_bin_count: Optional[int] = None,
        bin_count_multiple: Optional[int] = None,
        *,
        seed: Optional[int] = None,
        algorithm: Union[PackingAlgorithm, str, None] = None,
    ):
        if isinstance(bin_capacity, (str, enum.Enum)):
            raise TypeError(
                f"{type(self).__name__}'s first argument is bin_capacity (NeMo-RL's signature); the algorithm is "
                f"given by the class or algorithm=: get_packer({bin_capacity!r}, bin_capacity) or "
                f"SequencePacker(bin_capacity, algorithm={bin_capacity!r})")
        if algorithm is not None:
            algorithm = _resolve_algorithm(algorithm)
            if type(self).algorithm not in (None, algorithm):
                raise ValueError(f"{type(self).__name__} runs {type(self).algorithm.value!r}, not {algorithm.value!r}")
            self.algorithm = algorithm
        if min_bin_count is not None:
            min_bin_count = as_positive_int(min_bin_count, "min_bin_count", allow_zero=True)
        if bin_count_multiple is not None:
            bin_count_multiple = as_positive_int(bin_count_multiple, "bin_count_multiple")
        if seed is not None:
            seed = as_int(seed, "seed (an int or None)")
        self.bin_capacity = as_positive_int(bin_capacity, "bin_capacity")
        self.collect_metrics = collect_metrics
        self.min_bin_count = min_bin_count
        self.bin_count_multiple = bin_count_multiple
        self.seed = seed  # any int: the core takes it modulo 2**64
        self.metrics: Optional[PackingMetrics] = PackingMetrics() if collect_metrics else None

    def _core_args(self, natural: bool = False) -> Dict[str, Any]:
        seed = self.seed
        if seed is None:
            # Like NeMo-RL, an unseeded shuffle follows Python's global `random`
            # state, so `random.seed(...)` makes it reproducible.
            seed = random.getrandbits(64) if self.algorithm is PackingAlgorithm.FIRST_FIT_SHUFFLE else 0
        return dict(
            bin_capacity=self.bin_capacity,
            min_bin_count=0 if natural or self.min_bin_count is None else self.min_bin_count,
            bin_count_multiple=1 if natural or self.bin_count_multiple is None else self.bin_count_multiple,
            seed=int(seed) & 0xFFFFFFFFFFFFFFFF,
        )

    def _core_backed(self) -> bool:
        """Whether this packer's own hooks are the core's (overridden where a
        NeMo-RL hook, e.g. a custom ``_prepare_sequences``, takes over)."""
        return True

    def _runs_in_core(self) -> bool:
        cls = type(self)
        return (self.algorithm is not None and cls._pack_implementation in _CORE_IMPLEMENTATIONS
                and cls._adjust_bin_count is SequencePacker._adjust_bin_count and self._core_backed())

    def _pack_implementation(self, sequence_lengths: Any) -> List[List[int]]:
        """The natural bins, before the bin-count rule (NeMo-RL's hook: override it
        to write a packer; :meth:`pack` then adds :meth:`_adjust_bin_count`)."""
        if self.algorithm is None:
            raise NotImplementedError(f"{type(self).__name__} must implement _pack_implementation "
                                      "(or be built with algorithm=, or by get_packer)")
        return _core.pack(self.algorithm.value, core_lengths(sequence_lengths), **self._core_args(natural=True))

    def _adjust_bin_count(self, bins: List[List[int]]) -> List[List[int]]:
        """NeMo-RL's bin-count rule (:func:`adjust_bin_count`) with this packer's
        ``min_bin_count`` and ``bin_count_multiple``."""
        return adjust_bin_count(bins, 0 if self.min_bin_count is None else self.min_bin_count,
                                1 if self.bin_count_multiple is None else self.bin_count_multiple)

    def _bins(self, sequence_lengths: Any) -> Tuple[Any, List[List[int]]]:
        if self._runs_in_core():
            lengths = core_lengths(sequence_lengths)
            return lengths, _core.pack(self.algorithm.value, lengths, **self._core_args())
        lengths = as_lengths(sequence_lengths).tolist()  # NeMo-RL's hooks take a list of ints
        return lengths, self._adjust_bin_count(self._pack_implementation(lengths))

    def pack(self, sequence_lengths: Any) -> List[List[int]]:
        """Pack lengths (list, NumPy array or 1-D tensor) into bins of indices.

        Raises:
            ValueError: a length exceeds ``bin_capacity``, a length is negative (or
                not positive for MFFD), or there are fewer sequences than the bin
                count that ``min_bin_count`` / ``bin_count_multiple`` require.
        """
        lengths, bins = self._bins(sequence_lengths)
        if self.metrics is not None:
            self.metrics.update(lengths, bins, self.bin_capacity)
        return bins

    def pack_arrays(self, sequence_lengths: Any) -> Tuple[np.ndarray, np.ndarray]:
        """Like :meth:`pack`, as CSR arrays ``(offsets, indices)`` (int64).

        Bin ``b`` holds ``indices[offsets[b]:offsets[b+1]]``. Avoids building Python
        lists, which dominates for 10^5+ sequences. Metrics are not collected.
        """
        if self._runs_in_core():
            return _core.pack(self.algorithm.value, core_lengths(sequence_lengths), as_arrays=True,
                              **self._core_args())
        bins = self._bins(sequence_lengths)[1]
        offsets = np.cumsum([0] + [len(b) for b in bins], dtype=np.int64)
        return offsets, np.asarray([i for b in bins for i in b], dtype=np.int64)

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

    # NeMo-RL's helpers for packers written as subclasses.

    def _validate_sequence_lengths(self, sequence_lengths: Sequence[int]) -> None:
        """``ValueError`` for a length above ``bin_capacity``."""
        for length in sequence_lengths:
            if length > self.bin_capacity:
                raise ValueError(f"Sequence length {length} exceeds bin capacity {self.bin_capacity}")

    def _create_indexed_lengths(self, sequence_lengths: Sequence[int], reverse: bool = False) -> List[Tuple[int, int]]:
        """``(length, index)`` pairs, in input order or (``reverse``) sorted descending."""
        pairs = [(length, i) for i, length in enumerate(sequence_lengths)]
        return sorted(pairs, reverse=True) if reverse else pairs

    def _estimate_bins_needed(self, sequence_lengths: Sequence[int]) -> int:
        """``max(1, ceil(total / bin_capacity))``."""
        return max(1, -(-sum(sequence_lengths) // self.bin_capacity))

    def __repr__(self) -> str:
        name = self.algorithm.value if self.algorithm is not None else None
        return (
            f"{type(self).__name__}(algorithm={name!r}, bin_capacity={self.bin_capacity}, "
            f"min_bin_count={self.min_bin_count}, bin_count_multiple={self.bin_count_multiple})"
        )


class ConcatenativePacker(SequencePacker):
    """Sequences in order; a new bin when the next one does not fit (NeMo-RL's name).

    ``max_sequences_per_bin`` (NeMo-RL's class attribute; ``-1`` or ``None``: no
    limit) also starts a new bin after that many sequences.
    """

    algorithm = PackingAlgorithm.CONCATENATIVE
    max_sequences_per_bin: Optional[int] = -1

    def _limit(self) -> Optional[int]:
        limit = self.max_sequences_per_bin
        return None if limit is None or limit == -1 else as_positive_int(limit, "max_sequences_per_bin")

    def _core_backed(self) -> bool:
        return self._limit() is None

    def _pack_implementation(self, sequence_lengths: Any) -> List[List[int]]:
        limit = self._limit()
        if limit is None:
            return super()._pack_implementation(sequence_lengths)
        lengths = as_lengths(sequence_lengths).tolist()
        self._validate_sequence_lengths(lengths)
        bins: List[List[int]] = []
        load = 0
        for i, length in enumerate(lengths):
            if bins and load + length <= self.bin_capacity and len(bins[-1]) < limit:
                bins[-1].append(i)
                load += length
            else:
                bins.append([i])
                load = length
        return bins


class FirstFitPacker(SequencePacker):
    """First fit in the order :meth:`_prepare_sequences` gives (NeMo-RL's base of
    FFD and first-fit-shuffle). A subclass overriding ``_prepare_sequences`` runs
    first fit over its order in Python; the built-in orders run in the core."""

    def _prepare_sequences(self, sequence_lengths: Sequence[int]) -> List[Tuple[int, int]]:
        """``(length, index)`` pairs in the order to place them."""
        raise NotImplementedError("Subclasses must implement _prepare_sequences")

    def _core_backed(self) -> bool:
        return type(self)._prepare_sequences in _CORE_ORDERS

    def _pack_implementation(self, sequence_lengths: Any) -> List[List[int]]:
        if self.algorithm is not None and self._core_backed():
            return super()._pack_implementation(sequence_lengths)
        bins: List[List[int]] = []
        room: List[int] = []
        for length, index in self._prepare_sequences(as_lengths(sequence_lengths).tolist()):
            if length > self.bin_capacity:
                raise ValueError(f"Sequence length {length} exceeds bin capacity {self.bin_capacity}")
            for b, free in enumerate(room):
                if free >= length:
                    bins[b].append(index)
                    room[b] -= length
                    break
            else:
                bins.append([index])
                room.append(self.bin_capacity - length)
        return bins


class FirstFitDecreasingPacker(FirstFitPacker):
    """First fit, longest first (ties: the higher index first), as NeMo-RL's."""

    algorithm = PackingAlgorithm.FIRST_FIT_DECREASING

    def _prepare_sequences(self, sequence_lengths: Sequence[int]) -> List[Tuple[int, int]]:
        return self._create_indexed_lengths(sequence_lengths, reverse=True)


class FirstFitShufflePacker(FirstFitPacker):
    """First fit in a shuffled order. :meth:`pack` shuffles in the core (seeded by
    ``seed``, else drawn from Python's ``random``); ``_prepare_sequences`` is
    NeMo-RL's ``random.shuffle`` hook, for subclasses."""

    algorithm = PackingAlgorithm.FIRST_FIT_SHUFFLE

    def _prepare_sequences(self, sequence_lengths: Sequence[int]) -> List[Tuple[int, int]]:
        pairs = self._create_indexed_lengths(sequence_lengths)
        (random.Random(self.seed) if self.seed is not None else random).shuffle(pairs)
        return pairs


class ModifiedFirstFitDecreasingPacker(SequencePacker):
    """Johnson & Garey's modified first fit decreasing: NeMo-RL's 5-phase MFFD, the same bins."""

    algorithm = PackingAlgorithm.MODIFIED_FIRST_FIT_DECREASING


class BestFitDecreasingPacker(SequencePacker):
    """Longest first, each into the fullest bin it fits (seqpack's)."""

    algorithm = PackingAlgorithm.BEST_FIT_DECREASING


class GreedySequentialPacker(SequencePacker):
    """Concatenative's rule under NeMo AutoModel's name (seqpack's)."""

    algorithm = PackingAlgorithm.GREEDY_SEQUENTIAL


_CORE_IMPLEMENTATIONS = frozenset({SequencePacker._pack_implementation, ConcatenativePacker._pack_implementation,
                                   FirstFitPacker._pack_implementation})
_CORE_ORDERS = frozenset({FirstFitDecreasingPacker._prepare_sequences, FirstFitShufflePacker._prepare_sequences})
_PACKERS: Dict[PackingAlgorithm, type] = {
    PackingAlgorithm.CONCATENATIVE: ConcatenativePacker,
    PackingAlgorithm.FIRST_FIT_DECREASING: FirstFitDecreasingPacker,
    PackingAlgorithm.FIRST_FIT_SHUFFLE: FirstFitShufflePacker,
    PackingAlgorithm.MODIFIED_FIRST_FIT_DECREASING: ModifiedFirstFitDecreasingPacker,
    PackingAlgorithm.BEST_FIT_DECREASING: BestFitDecreasingPacker,
    PackingAlgorithm.GREEDY_SEQUENTIAL: GreedySequentialPacker,
}


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
    return _PACKERS[_resolve_algorithm(algorithm)](
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
