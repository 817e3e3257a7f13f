"""seqpack.metrics: NeMo-RL packing metrics and ROLL dynamic-batching metrics."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import seqpack
from seqpack import PackingMetrics
from seqpack import reference as ref

from conftest import index_bins

# NeMo-RL's PackingMetrics.calculate_stats_only for an empty solution.
NEMO_RL_EMPTY = {
    "num_sequences": 0,
    "num_bins": 0,
    "total_sequence_length": 0,
    "total_bin_capacity": 0,
    "total_waste": 0,
    "average_utilization": 0.0,
    "waste_ratio": 0.0,
    "bin_balance": 0.0,
    "theoretical_min_bins": 0,
    "bin_efficiency": 0.0,
}


@st.composite
def stats_case(draw):
    """(lengths, bins, capacity): any partition of the indices (bins may exceed the
    capacity; metrics do not check), positive total."""
    bins = draw(index_bins(max_items=30))
    n = sum(len(b) for b in bins)
    lengths = draw(st.lists(st.integers(0, 500), min_size=n, max_size=n).filter(lambda l: sum(l) > 0))
    capacity = draw(st.integers(1, 1000))
    return lengths, bins, capacity


@given(case=stats_case())
def test_calculate_stats_only_matches_nemo_rl(case):
    lengths, bins, capacity = case
    got = PackingMetrics().calculate_stats_only(lengths, bins, capacity)
    expected = ref.packing_stats(lengths, bins, capacity)
    assert list(got) == list(NEMO_RL_EMPTY)
    assert set(got) == set(expected)
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-12)
    for key in ("num_sequences", "num_bins", "total_sequence_length", "total_bin_capacity", "total_waste", "theoretical_min_bins"):
        assert got[key] == expected[key] and isinstance(got[key], int)


@given(case=stats_case())
def test_calculate_stats_only_accepts_arrays(case):
    lengths, bins, capacity = case
    expected = PackingMetrics().calculate_stats_only(lengths, bins, capacity)
    assert PackingMetrics().calculate_stats_only(np.asarray(lengths, dtype=np.int32), bins, capacity) == expected


def test_thirty_times_five_by_hand():
    stats = PackingMetrics().calculate_stats_only([30] * 5, [[4, 3, 2], [1, 0]], 100)
    # Bin utilizations 0.9 and 0.6: mean 0.75, sample stdev sqrt(0.045).
    assert stats == {
        "num_sequences": 5,
        "num_bins": 2,
        "total_sequence_length": 150,
        "total_bin_capacity": 200,
        "total_waste": 50,
        "average_utilization": 0.75,
        "waste_ratio": 0.25,
        "bin_balance": pytest.approx(1 - math.sqrt(0.045) / 0.75),
        "theoretical_min_bins": 2,
        "bin_efficiency": 1.0,
    }


def test_single_bin_balance_is_one():
    assert PackingMetrics().calculate_stats_only([10, 20], [[0, 1]], 100)["bin_balance"] == 1.0


def test_empty_solution_gives_nemo_rl_zero_dict():
    assert PackingMetrics().calculate_stats_only([], [], 100) == NEMO_RL_EMPTY
    # NeMo-RL returns the zero dict whenever there are no bins.
    assert PackingMetrics().calculate_stats_only([1, 2], [], 100) == NEMO_RL_EMPTY


def test_out_of_range_index():
    with pytest.raises(ValueError, match="out of range"):
        PackingMetrics().calculate_stats_only([1, 2], [[0, 2]], 100)
    with pytest.raises(ValueError, match="out of range"):
        PackingMetrics().calculate_stats_only([1, 2], [[-1]], 100)
    with pytest.raises(ValueError):
        PackingMetrics().calculate_stats_only([1, 2], [[0, 1]], 0)


def test_update_and_aggregate():
    m = PackingMetrics()
    assert m.get_aggregated_stats() == {}
    m.update([30] * 5, [[4, 3, 2], [1, 0]], 100, packing_time=0.5)
    m.update([90, 20, 10], [[0, 2], [1]], 100, packing_time=1.5)
    stats = m.get_aggregated_stats()
    assert stats["average_packing_time"] == pytest.approx(1.0)
    assert stats["total_sequences"] == 8 and stats["total_bins"] == 4
    assert stats["bin_efficiency"] == pytest.approx(0.75)
    m.reset()
    assert m.get_aggregated_stats() == {}


def test_print_aggregated_stats(capsys):
    m = PackingMetrics()
    m.print_aggregated_stats()
    assert "No metrics collected yet." in capsys.readouterr().out
    m.update([30] * 5, [[4, 3, 2], [1, 0]], 100)
    m.print_aggregated_stats()
    out = capsys.readouterr().out
    assert "Total sequences packed: 5" in out and "Average bin utilization: 0.7500" in out


DB_KEYS = ("valid_tokens", "actual_tokens_origin", "actual_tokens", "removed_padding_tokens", "removed_padding_ratio")


def test_dynamic_batching_metrics_keys():
    plain = seqpack.dynamic_batching_metrics(44, 52, 8, 10)
    assert list(plain) == [f"dynamic_batching/{k}" for k in DB_KEYS]
    assert plain == {
        "dynamic_batching/valid_tokens": 44,
        "dynamic_batching/actual_tokens_origin": 80,
        "dynamic_batching/actual_tokens": 52,
        "dynamic_batching/removed_padding_tokens": 28,
        "dynamic_batching/removed_padding_ratio": pytest.approx(0.35),
    }
    prefixed = seqpack.dynamic_batching_metrics(44, 52, 8, 10, log_prefix="train")
    assert list(prefixed) == [f"dynamic_batching/train/{k}" for k in DB_KEYS]
    assert list(prefixed.values()) == list(plain.values())
    assert seqpack.dynamic_batching_metrics(0, 0, 0, 10)["dynamic_batching/removed_padding_ratio"] == 0.0
