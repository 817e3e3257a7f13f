"""seqpack.packing: packers, NeMo-RL compatibility, argument handling."""

from __future__ import annotations

import enum
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import seqpack
from seqpack import PackingAlgorithm, get_packer
from seqpack import reference as ref

from conftest import assert_valid_bins, index_bins, nemo_rl_target_bins, packing_case

ALGORITHMS = list(PackingAlgorithm)
MFFD = PackingAlgorithm.MODIFIED_FIRST_FIT_DECREASING
# Algorithms with a pure-Python reference (greedy_sequential is the concatenative rule).
REFERENCES = {
    PackingAlgorithm.CONCATENATIVE: ref.concatenative,
    PackingAlgorithm.GREEDY_SEQUENTIAL: ref.concatenative,
    PackingAlgorithm.FIRST_FIT_DECREASING: ref.first_fit_decreasing,
    PackingAlgorithm.MODIFIED_FIRST_FIT_DECREASING: ref.modified_first_fit_decreasing,
    PackingAlgorithm.BEST_FIT_DECREASING: ref.best_fit_decreasing,
}


def pack(algorithm, lengths, capacity=100, **kwargs):
    return get_packer(algorithm, bin_capacity=capacity, **kwargs).pack(lengths)


def min_length(algorithm) -> int:
    """MFFD requires positive lengths; the others accept zeros."""
    return 1 if algorithm is MFFD else 0


# ---------------------------------------------------------------- worked examples


@pytest.mark.parametrize(
    "algorithm, lengths, kwargs, expected",
    [
        ("first_fit_decreasing", [30] * 5, {}, [[4, 3, 2], [1, 0]]),
        ("first_fit_decreasing", list(range(10, 100, 10)), {}, [[8, 0], [7, 1], [6, 2], [5, 3], [4]]),
        ("modified_first_fit_decreasing", [46, 24, 55, 88, 11, 14, 73, 17], {}, [[3, 4], [6, 5], [2, 7, 1], [0]]),
        ("modified_first_fit_decreasing", [30] * 5, {}, [[3, 4], [0, 1, 2]]),
        (
            "modified_first_fit_decreasing",
            list(range(10, 100, 10)),
            {"min_bin_count": 7},
            [[8, 0], [7, 1], [6], [5], [4], [3], [2]],
        ),
    ],
)
def test_spec_examples(algorithm, lengths, kwargs, expected):
    assert pack(algorithm, lengths, 100, **kwargs) == expected


@pytest.mark.parametrize(
    "capacity, expected",
    [(5, [[0, 1], [2, 3], [4, 5], [6], [7]]), (8, [[0, 1, 2], [3, 4, 5], [6], [7]])],
)
@pytest.mark.parametrize("algorithm", ["concatenative", "greedy_sequential"])
def test_concatenative_examples(algorithm, capacity, expected):
    assert pack(algorithm, [4, 1, 3, 2, 1, 3, 4, 5], capacity) == expected


# ---------------------------------------------------------------- invariants


@pytest.mark.parametrize("algorithm", ALGORITHMS, ids=lambda a: a.value)
@given(data=st.data())
def test_packer_invariants(algorithm, data):
    lengths, capacity = data.draw(packing_case(min_value=min_length(algorithm)))
    bins = pack(algorithm, lengths, capacity, seed=data.draw(st.integers(0, 2**64 - 1)))
    assert_valid_bins(bins, lengths, capacity)


@pytest.mark.parametrize("algorithm", ALGORITHMS, ids=lambda a: a.value)
@given(data=st.data())
def test_bin_count_constraints(algorithm, data):
    lengths, capacity = data.draw(packing_case(min_value=min_length(algorithm)))
    min_bin_count = data.draw(st.integers(0, 12))
    multiple = data.draw(st.integers(1, 5))
    natural = len(pack(algorithm, lengths, capacity, seed=7))
    target = nemo_rl_target_bins(natural, min_bin_count, multiple)
    packer = get_packer(algorithm, capacity, min_bin_count=min_bin_count, bin_count_multiple=multiple, seed=7)
    if target > len(lengths):
        with pytest.raises(ValueError, match=f"Cannot create {target} bins with only {len(lengths)} sequences"):
            packer.pack(lengths)
        return
    bins = packer.pack(lengths)
    assert len(bins) == target
    assert len(bins) % multiple == 0 and len(bins) >= min_bin_count
    assert_valid_bins(bins, lengths, capacity)


@given(lengths_cap=packing_case(min_value=0), seed=st.integers(0, 2**64 - 1))
def test_first_fit_shuffle_seeded_is_deterministic(lengths_cap, seed):
    lengths, capacity = lengths_cap
    a = pack("first_fit_shuffle", lengths, capacity, seed=seed)
    b = get_packer("first_fit_shuffle", capacity, seed=seed).pack(np.asarray(lengths, dtype=np.int64))
    assert a == b


def test_first_fit_shuffle_unseeded_follows_python_random():
    lengths = [random.Random(0).randint(1, 90) for _ in range(200)]
    packer = get_packer("first_fit_shuffle", 100)
    random.seed(1234)
    first = [packer.pack(lengths) for _ in range(3)]
    random.seed(1234)
    again = [packer.pack(lengths) for _ in range(3)]
    assert first == again
    # Successive unseeded calls draw fresh seeds, so they (almost surely) differ.
    assert len({str(b) for b in first}) > 1


@pytest.mark.parametrize("algorithm", ALGORITHMS, ids=lambda a: a.value)
@given(data=st.data())
def test_pack_arrays_matches_pack(algorithm, data):
    lengths, capacity = data.draw(packing_case(min_value=min_length(algorithm)))
    packer = get_packer(algorithm, capacity, seed=11, min_bin_count=data.draw(st.integers(0, 3)))
    try:
        bins = packer.pack(lengths)
    except ValueError:
        with pytest.raises(ValueError):
            packer.pack_arrays(lengths)
        return
    offsets, indices = packer.pack_arrays(lengths)
    assert offsets.dtype == np.int64 and indices.dtype == np.int64
    assert len(offsets) == len(bins) + 1 and offsets[0] == 0
    assert [indices[offsets[b] : offsets[b + 1]].tolist() for b in range(len(bins))] == bins


# ---------------------------------------------------------------- NeMo-RL / reference equality


@pytest.mark.parametrize("algorithm", sorted(REFERENCES, key=lambda a: a.value), ids=lambda a: a.value)
@settings(max_examples=150)
@given(data=st.data())
def test_matches_reference(algorithm, data):
    lengths, capacity = data.draw(packing_case(min_value=min_length(algorithm), max_size=60))
    assert pack(algorithm, lengths, capacity) == REFERENCES[algorithm](lengths, capacity)


@pytest.mark.parametrize("algorithm", sorted(REFERENCES, key=lambda a: a.value), ids=lambda a: a.value)
@given(data=st.data())
def test_constrained_pack_matches_reference(algorithm, data):
    lengths, capacity = data.draw(packing_case(min_value=min_length(algorithm)))
    min_bin_count = data.draw(st.integers(0, 10))
    multiple = data.draw(st.integers(1, 4))
    packer = get_packer(algorithm, capacity, min_bin_count=min_bin_count, bin_count_multiple=multiple)
    base = REFERENCES[algorithm](lengths, capacity)
    try:
        expected = ref.adjust_bin_count(base, min_bin_count, multiple)
    except ValueError:
        with pytest.raises(ValueError, match="Cannot create"):
            packer.pack(lengths)
        return
    assert packer.pack(lengths) == expected


@given(bins=index_bins(), min_bin_count=st.integers(0, 35), multiple=st.integers(1, 6))
def test_adjust_bin_count_matches_reference(bins, min_bin_count, multiple):
    try:
        expected = ref.adjust_bin_count(bins, min_bin_count, multiple)
    except ValueError as e:
        with pytest.raises(ValueError, match=str(e).rstrip(".")):
            seqpack.adjust_bin_count(bins, min_bin_count, multiple)
        return
    assert seqpack.adjust_bin_count(bins, min_bin_count, multiple) == expected


def test_adjust_bin_count_example():
    bins = [[8, 0], [7, 1], [6, 2], [5, 3], [4]]
    assert seqpack.adjust_bin_count(bins, min_bin_count=7) == [[8, 0], [7, 1], [6], [5], [4], [3], [2]]
    assert seqpack.adjust_bin_count(bins) == bins
    assert seqpack.adjust_bin_count(bins, bin_count_multiple=3) == [[8, 0], [7, 1], [6, 2], [5], [4], [3]]


# ---------------------------------------------------------------- get_packer and errors


@pytest.mark.parametrize("algorithm", ALGORITHMS, ids=lambda a: a.value)
def test_get_packer_accepts_names_and_members(algorithm):
    lengths = [46, 24, 55, 88, 11, 14, 73, 17]
    expected = pack(algorithm, lengths, seed=3)
    for spelling in (algorithm.value, algorithm.value.upper(), algorithm.name, algorithm.value.title(), f" {algorithm.value} "):
        packer = get_packer(spelling, 100, seed=3)
        assert packer.algorithm is algorithm
        assert packer.pack(lengths) == expected


def test_get_packer_accepts_foreign_enum_members():
    # e.g. NeMo-RL's own PackingAlgorithm enum, whose values are the same names.
    Foreign = enum.Enum("Foreign", {"FFD": "first_fit_decreasing", "MFFD": "modified_first_fit_decreasing"})
    assert get_packer(Foreign.FFD, 100).algorithm is PackingAlgorithm.FIRST_FIT_DECREASING
    assert get_packer(Foreign.MFFD, 100).algorithm is MFFD


@pytest.mark.parametrize("bad", ["ffd", "first-fit-decreasing", "", object(), 3, None])
def test_get_packer_unknown_algorithm(bad):
    with pytest.raises(ValueError, match="Unknown packing algorithm") as info:
        get_packer(bad, 100)
    for a in PackingAlgorithm:
        assert a.name in str(info.value)


@pytest.mark.parametrize(
    "kwargs",
    [{"min_bin_count": -1}, {"bin_count_multiple": 0}, {"bin_count_multiple": -2}, {"bin_capacity": 0}, {"bin_capacity": -5}],
)
def test_get_packer_bad_arguments(kwargs):
    args = {"bin_capacity": 100, **kwargs}
    with pytest.raises(ValueError):
        get_packer("first_fit_decreasing", **args)


@pytest.mark.parametrize("algorithm", ALGORITHMS, ids=lambda a: a.value)
def test_too_few_sequences(algorithm):
    with pytest.raises(ValueError, match="Cannot create 3 bins with only 2 sequences"):
        pack(algorithm, [10, 20], min_bin_count=3)
    with pytest.raises(ValueError, match="Cannot create 4 bins with only 3 sequences"):
        pack(algorithm, [10, 20, 30], bin_count_multiple=4)


@pytest.mark.parametrize("algorithm", ALGORITHMS, ids=lambda a: a.value)
def test_length_over_capacity(algorithm):
    with pytest.raises(ValueError) as info:
        pack(algorithm, [10, 101, 20], 100)
    assert "sequence_lengths" in str(info.value) and "bin_capacity" in str(info.value)


@pytest.mark.parametrize("algorithm", ALGORITHMS, ids=lambda a: a.value)
def test_negative_length(algorithm):
    with pytest.raises(ValueError, match="sequence_lengths"):
        pack(algorithm, [10, -1, 20])


def test_mffd_rejects_zero_length():
    with pytest.raises(ValueError, match="positive"):
        pack(MFFD, [10, 0, 20])
    # The other packers accept zero-length sequences.
    assert_valid_bins(pack("first_fit_decreasing", [10, 0, 20]), [10, 0, 20], 100)


@pytest.mark.parametrize("algorithm", ALGORITHMS, ids=lambda a: a.value)
def test_bad_input_shapes_and_types(algorithm):
    with pytest.raises(TypeError):
        pack(algorithm, [1.0, 2.0])
    with pytest.raises(TypeError):
        pack(algorithm, np.array([1.5, 2.5]))
    with pytest.raises(ValueError, match="1-D"):
        pack(algorithm, [[1, 2], [3, 4]])
    with pytest.raises(ValueError, match="1-D"):
        pack(algorithm, np.int64(5))
    assert pack(algorithm, []) == []
    assert pack(algorithm, np.zeros(0, dtype=np.int32)) == []
    offsets, indices = get_packer(algorithm, 100).pack_arrays([])
    assert offsets.tolist() == [0] and indices.tolist() == []


def test_uint64_overflow_rejected():
    with pytest.raises(ValueError, match="int64"):
        pack("first_fit_decreasing", np.array([1, 2**63], dtype=np.uint64))


# ---------------------------------------------------------------- input types

TYPE_LENGTHS = [46, 24, 55, 88, 11, 14, 73, 17, 30, 30, 99, 1, 64, 64, 2, 50]


@pytest.mark.parametrize("algorithm", ALGORITHMS, ids=lambda a: a.value)
@pytest.mark.parametrize("dtype", ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"])
def test_numpy_dtypes_give_the_same_bins(algorithm, dtype):
    expected = pack(algorithm, TYPE_LENGTHS, seed=5)
    assert pack(algorithm, np.array(TYPE_LENGTHS, dtype=dtype), seed=5) == expected
    # A non-contiguous view: every other element of an interleaved buffer.
    interleaved = np.zeros(2 * len(TYPE_LENGTHS), dtype=dtype)
    interleaved[::2] = TYPE_LENGTHS
    interleaved[1::2] = 127
    view = interleaved[::2]
    assert not view.flags["C_CONTIGUOUS"]
    assert pack(algorithm, view, seed=5) == expected


@pytest.mark.parametrize("algorithm", ALGORITHMS, ids=lambda a: a.value)
def test_torch_tensors_give_the_same_bins(algorithm):
    torch = pytest.importorskip("torch")
    expected = pack(algorithm, TYPE_LENGTHS, seed=5)
    for dtype in (torch.int32, torch.int64):
        assert pack(algorithm, torch.tensor(TYPE_LENGTHS, dtype=dtype), seed=5) == expected
    strided = torch.tensor(TYPE_LENGTHS, dtype=torch.int64).repeat_interleave(2)[::2]
    assert pack(algorithm, strided, seed=5) == expected
    with pytest.raises(TypeError):
        pack(algorithm, torch.tensor(TYPE_LENGTHS, dtype=torch.float32))
    with pytest.raises(ValueError, match="1-D"):
        pack(algorithm, torch.tensor([TYPE_LENGTHS]))


# ---------------------------------------------------------------- metrics collection


def test_collect_metrics_aggregates_two_calls():
    packer = get_packer("first_fit_decreasing", 100, collect_metrics=True)
    assert packer.get_aggregated_metrics() == {}
    assert packer.pack([30] * 5) == [[4, 3, 2], [1, 0]]  # 150 tokens in 2 bins: 0.75
    assert packer.pack([90, 20, 10]) == [[0, 2], [1]]  # 120 tokens in 2 bins: 0.60
    stats = packer.get_aggregated_metrics()
    expected = {
        "total_sequences": 8,
        "total_bins": 4,
        "average_utilization": 270 / 400,
        "min_utilization": 0.6,
        "max_utilization": 0.75,
        "average_waste_ratio": 130 / 400,
        "min_waste_ratio": 0.25,
        "max_waste_ratio": 0.4,
        "average_bin_count": 2.0,
        "bin_efficiency": 3 / 4,  # ceil(270 / (400 / 4)) / 4
    }
    assert set(stats) == set(expected)
    assert stats == pytest.approx(expected)
    packer.reset_metrics()
    assert packer.get_aggregated_metrics() == {}


def test_metrics_off_by_default(capsys):
    packer = get_packer("first_fit_decreasing", 100)
    packer.pack([30] * 5)
    assert packer.metrics is None and packer.get_aggregated_metrics() == {}
    packer.print_metrics()
    assert "not enabled" in capsys.readouterr().out
    # compute_metrics works without collection and records nothing.
    stats = packer.compute_metrics([30] * 5, [[4, 3, 2], [1, 0]])
    assert stats["average_utilization"] == pytest.approx(0.75)
