"""Shared helpers and hypothesis strategies for the planning-API tests, and the
gate of the GPU tests.

Tests import only ``seqpack`` and ``seqpack.testing.reference`` so they run unchanged
against the installed package.

GPU tests: every test marked ``gpu`` (``pytestmark = pytest.mark.gpu`` in the GPU
modules) is skipped where PyTorch sees no CUDA device, and fails, with the reason,
where PyTorch sees one but seqpack cannot use it (an extension built without nvcc,
or a CUDA runtime that sees no device): a GPU machine must never pass the GPU tests
by skipping them, or by running the PyTorch fallback instead of seqpack's kernels.
The hooks at the end apply this; :func:`require_cuda` does the same from inside a
test that is not marked.
"""

from __future__ import annotations

import functools
import math
from typing import List, Sequence, Tuple

import pytest
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


# ---- the GPU gate --------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def cuda_status() -> Tuple[str, str]:
    """``("run", "")``, ``("skip", why)`` or ``("fail", why)`` for the GPU tests.

    skip: PyTorch sees no CUDA device (a CPU machine or a CPU build of torch).
    fail: PyTorch sees a device but seqpack's CUDA kernels cannot run on it, so the
    GPU tests would silently exercise the PyTorch fallback. torch is imported here,
    lazily: the planning tests never need it."""
    import torch

    if not torch.cuda.is_available():
        return "skip", (f"PyTorch sees no CUDA device (torch {torch.__version__}, "
                        f"built for CUDA {torch.version.cuda or 'none'})")
    import seqpack

    info = seqpack.build_info()
    try:
        name = torch.cuda.get_device_name(0)
    except Exception as err:  # pragma: no cover - the name is only for the message
        name = f"name unavailable: {err}"
    seen = (f"PyTorch {torch.__version__} (CUDA {torch.version.cuda}) sees {torch.cuda.device_count()} CUDA "
            f"device(s) ({name})")
    if not info["built_with_cuda"]:
        return "fail", (f"{seen}, but the installed seqpack {info['version']} was built without its CUDA objects "
                        f"(build_info()['built_with_cuda'] is False: nvcc was not found at build time). Rebuild "
                        f"on this machine with the CUDA toolkit (bash scripts/gpu_check.sh), or hide the GPU "
                        f"(CUDA_VISIBLE_DEVICES=) to skip the GPU tests.")
    if info["cuda_device_count"] == 0:
        return "fail", (f"{seen}, but seqpack's CUDA runtime {info['cuda_runtime_version']} sees no device "
                        f"(build_info()['cuda_device_count'] == 0): is the driver older than the runtime "
                        f"seqpack was built with? nvidia-smi shows the driver's CUDA version.")
    return "run", ""


def pytest_runtest_setup(item):
    # Before the test's fixtures are set up: no GPU, nothing to run.
    if item.get_closest_marker("gpu") is not None and cuda_status()[0] == "skip":
        pytest.skip(cuda_status()[1])


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    # In the call phase, so that an unusable seqpack build is reported as a failed
    # test (not a setup error) and the test body never runs.
    if item.get_closest_marker("gpu") is not None and cuda_status()[0] == "fail":
        pytest.fail(cuda_status()[1], pytrace=False)
