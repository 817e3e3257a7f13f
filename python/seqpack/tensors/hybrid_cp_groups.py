"""The process groups of hybrid context parallelism: one per aligned block of ``d``
ranks (``d`` = 2, 4 .. ``cp_size``) of every CP group, created once and cached.

``D * C`` ranks of ``group`` (default WORLD), ``rank = dp_rank * C + cp_rank``; the
blocks of one CP group (C = 4)::

    cp_rank        0   1   2   3
    d = 4        [ block 0       ]
    d = 2        [ b 0 ] [ b 2   ]     (a block is named by its first cp_rank)
    d = 1          whole sequences: no group

``torch.distributed.new_group`` must be entered by every process of the default
group, in the same order, members or not: :func:`hybrid_cp_groups` creates all
``D * (C - 1)`` groups at once, in one fixed order, the first time any rank asks
(so call it on every rank, as the hybrid iterators do), and returns the cached set
afterwards. On NCCL the communicators are created lazily, by a group's first
collective.

    >>> groups = hybrid_cp_groups(dp_size=1, cp_size=4)          # doctest: +SKIP
    >>> groups.block(dp_rank=0, degree=2, first=2)               # doctest: +SKIP
    <torch.distributed.ProcessGroup ...>  # ranks 2 and 3
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from .._lengths import as_positive_int

__all__ = ["hybrid_cp_groups"]  # its HybridCpGroups holds process groups: no data, no pickling


class HybridCpGroups:
    """Every aligned block's process group of ``dp_size`` CP groups of ``cp_size``
    ranks inside ``group`` (its ranks in order; ``None``: WORLD). Use
    :func:`hybrid_cp_groups` (cached); this constructor runs ``new_group`` on every
    call."""

    def __init__(self, dp_size: Any, cp_size: Any, group: Any = None) -> None:
        import torch.distributed as dist

        self.dp_size = as_positive_int(dp_size, "dp_size")
        self.cp_size = as_positive_int(cp_size, "cp_size")
        if self.cp_size & (self.cp_size - 1):
            raise ValueError(f"cp_size must be a power of two, got {self.cp_size}")
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("hybrid CP needs torch.distributed initialised (init_process_group) on every rank")
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        if len(ranks) != self.dp_size * self.cp_size:
            raise ValueError(f"the group has {len(ranks)} ranks, not dp_size x cp_size = "
                             f"{self.dp_size} x {self.cp_size}")
        self.group = group
        self.ranks: Tuple[int, ...] = tuple(int(r) for r in ranks)
        me = dist.get_rank()
        self.rank = self.ranks.index(me) if me in self.ranks else -1
        self._blocks: Dict[Tuple[int, int, int], Any] = {}
        for dp in range(self.dp_size):  # every process creates every group, in this order
            d = 2
            while d <= self.cp_size:
                for first in range(0, self.cp_size, d):
                    members = [self.ranks[dp * self.cp_size + first + j] for j in range(d)]
                    self._blocks[(dp, d, first)] = dist.new_group(members)
                d *= 2

    def block(self, dp_rank: int, degree: int, first: int) -> Any:
        """The group of the block of ``degree`` ranks starting at cp_rank ``first`` of
        CP group ``dp_rank`` (``None`` for degree 1: no collective)."""
        if degree == 1:
            return None
        try:
            return self._blocks[(int(dp_rank), int(degree), int(first))]
        except KeyError:
            raise ValueError(f"no aligned block of degree {degree} at cp_rank {first} in CP group {dp_rank} "
                             f"(cp_size {self.cp_size}, dp_size {self.dp_size})") from None

    def __repr__(self) -> str:
        return f"HybridCpGroups(dp_size={self.dp_size}, cp_size={self.cp_size}, groups={len(self._blocks)})"

    def __reduce__(self):  # process groups do not cross processes: a worker re-creates (collectively) its own
        raise TypeError("HybridCpGroups holds this process's process groups and does not pickle: call "
                        "hybrid_cp_groups(dp_size, cp_size) in each process")


_CACHE: Dict[Tuple[int, int, Tuple[int, ...]], HybridCpGroups] = {}


def hybrid_cp_groups(dp_size: Any, cp_size: Any, group: Any = None) -> HybridCpGroups:
    """The cached :class:`HybridCpGroups` of ``dp_size`` CP groups of ``cp_size``
    ranks of ``group`` (default WORLD); created (collectively: call it on every
    process of the default group) the first time."""
    import torch.distributed as dist

    dp, cp = as_positive_int(dp_size, "dp_size"), as_positive_int(cp_size, "cp_size")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("hybrid CP needs torch.distributed initialised (init_process_group) on every rank")
    ranks: List[int] = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    key = (dp, cp, tuple(int(r) for r in ranks))
    if key not in _CACHE:
        _CACHE[key] = HybridCpGroups(dp, cp, group)
    return _CACHE[key]


def cached_hybrid_cp_groups(dp_size: int, cp_size: int, ranks: Tuple[int, ...]) -> HybridCpGroups:
    """The groups :func:`hybrid_cp_groups` created for ``dp_size`` x ``cp_size`` ranks of
    the group whose ranks are ``ranks`` (empty: WORLD's, created now if need be, as
    :func:`hybrid_cp_groups` does). Never creates a group for a named set of ranks
    (creating is collective): a miss is an error saying what to call first."""
    if not ranks:
        return hybrid_cp_groups(dp_size, cp_size)
    got = _CACHE.get((int(dp_size), int(cp_size), tuple(int(r) for r in ranks)))
    if got is None:
        raise RuntimeError(f"no hybrid-CP groups for dp_size={dp_size}, cp_size={cp_size} over ranks {list(ranks)} "
                           "in this process: call hybrid_cp_groups(dp_size, cp_size, group) on every rank first "
                           "(hybrid_cp_micro_batches does)")
    return got
