"""Shared helpers and hypothesis strategies for the planning-API tests.

Tests import only ``seqpack`` and ``seqpack.reference`` so they run unchanged
against the installed package.
"""

from __future__ import annotations

import math
from typing import List, Sequence

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

# Modest example counts keep the whole suite well under a minute on 2 cores.
settings.register_profile(
    "seqpack",
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("seqpack")


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def nemo_rl_target_bins(natural: int, min_bin_count: int, bin_count_multiple: int) -> int:
    """NeMo-RL's bin count: max(natural, min_bin_count) rounded up to the multiple."""
    return round_up(max(natural, min_bin_count), bin_count_multiple)


def assert_index_partition(groups: List[List[int]], n: int) -> None:
    """Every index in range(n) appears exactly once, and no group is empty."""
    flat = [i for g in groups for i in g]
    assert sorted(flat) == list(range(n)), groups
    assert all(len(g) > 0 for g in groups), groups


def assert_valid_bins(bins: List[List[int]], lengths: Sequence[int], capacity: int) -> None:
    """The packer contract: each index once, no bin over capacity, no empty bin,
    and at least ceil(total / capacity) bins."""
    lengths = [int(x) for x in lengths]
    assert_index_partition(bins, len(lengths))
    for b in bins:
        assert sum(lengths[i] for i in b) <= capacity, (b, [lengths[i] for i in b], capacity)
    assert len(bins) >= math.ceil(sum(lengths) / capacity)


def group_sums(groups: List[List[int]], values: Sequence[int]) -> List[int]:
    return [sum(int(values[i]) for i in g) for g in groups]


def spread(groups: List[List[int]], values: Sequence[int]) -> int:
    sums = group_sums(groups, values)
    return max(sums) - min(sums)


# Lengths drawn either from a tiny range (many ties, which exercise tie-breaks)
# or a wide one.
def lengths_strategy(max_value: int, min_value: int = 1, min_size: int = 0, max_size: int = 40):
    tie_heavy = st.integers(min_value, min(max_value, min_value + 4))
    wide = st.integers(min_value, max_value)
    return st.one_of(
        st.lists(tie_heavy, min_size=min_size, max_size=max_size),
        st.lists(wide, min_size=min_size, max_size=max_size),
    )


@st.composite
def packing_case(draw, min_value: int = 1, max_size: int = 40):
    """(lengths, capacity) with every length <= capacity."""
    capacity = draw(st.sampled_from([1, 2, 5, 10, 16, 100, 1000]) | st.integers(1, 200))
    lengths = draw(lengths_strategy(capacity, min_value=min(min_value, capacity), max_size=max_size))
    return lengths, capacity


@st.composite
def index_bins(draw, max_items: int = 30):
    """A partition of range(n) into non-empty bins (a permutation cut into runs)."""
    n = draw(st.integers(1, max_items))
    perm = draw(st.permutations(list(range(n))))
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=n - 1))) if n > 1 else []
    bounds = [0, *cuts, n]
    return [list(perm[a:b]) for a, b in zip(bounds, bounds[1:])]
