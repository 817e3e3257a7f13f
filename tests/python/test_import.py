"""Package surface: lazy torch, __all__, build_info, doctests, and a GPU smoke test."""

from __future__ import annotations

import doctest
import importlib
import os
import subprocess
import sys

import pytest

import seqpack


def test_import_does_not_import_torch():
    code = "import sys, seqpack, seqpack.testing.reference; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ.copy(), check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_all_names_exist():
    assert len(seqpack.__all__) == len(set(seqpack.__all__))
    for name in seqpack.__all__:
        assert hasattr(seqpack, name), name
    assert isinstance(seqpack.__version__, str)


def test_build_info():
    info = seqpack.build_info()
    assert set(info) == {"version", "built_with_cuda", "cuda_architectures", "cpu_isa", "cuda_runtime_version",
                         "cuda_device_count"}
    assert info["cpu_isa"] in ("avx512", "avx2", "baseline")
    assert info["version"] == seqpack.__version__
    assert isinstance(info["built_with_cuda"], bool)
    assert isinstance(info["cuda_runtime_version"], int)
    assert isinstance(info["cuda_device_count"], int) and info["cuda_device_count"] >= 0
    if not info["built_with_cuda"]:
        assert info["cuda_device_count"] == 0 and info["cuda_architectures"] == []


def _cuobjdump():
    """cuobjdump from the CUDA toolkit on PATH or the nvidia-cuda-cuobjdump wheel."""
    import glob
    import shutil
    import site

    found = shutil.which("cuobjdump")
    if found:
        return found
    for root in site.getsitepackages() + [site.getusersitepackages()]:
        hits = sorted(glob.glob(os.path.join(root, "nvidia", "cu*", "bin", "cuobjdump")))
        if hits:
            return hits[-1]
    return None


def test_extension_carries_ampere_and_hopper_machine_code():
    # The review found a build with only sm_75 cubins (CMake's default was set after
    # enable_language(CUDA) had fixed nvcc's): every Ampere/Hopper GPU would JIT.
    info = seqpack.build_info()
    if not info["built_with_cuda"]:
        pytest.skip("built without CUDA (no nvcc)")
    tool = _cuobjdump()
    assert tool, "cuobjdump not found: install the test extras (nvidia-cuda-cuobjdump)"
    path = seqpack._core.__file__
    elf = subprocess.run([tool, "--list-elf", path], capture_output=True, text=True, check=True).stdout
    ptx = subprocess.run([tool, "--list-ptx", path], capture_output=True, text=True, check=True).stdout
    cubins = {int(m) for m in __import__("re").findall(r"\.sm_(\d+)\.cubin", elf)}
    ptxs = {int(m) for m in __import__("re").findall(r"\.sm_(\d+)\.ptx", ptx)}
    archs = info["cuda_architectures"]
    real = {int(a.split("-")[0]) for a in archs if not a.endswith("-virtual")}
    virtual = {int(a.split("-")[0]) for a in archs if not a.endswith("-real")}
    assert cubins == real, (cubins, archs)
    assert ptxs == virtual, (ptxs, archs)
    if "CUDAARCHS" not in os.environ:  # the default build
        assert {80, 86, 89, 90} <= cubins and 90 in ptxs, elf


@pytest.mark.parametrize(
    "module",
    ["seqpack", "seqpack.planning", "seqpack.planning.packing", "seqpack.planning.balance", "seqpack.planning.metrics",
     "seqpack.planning.dynamic_batching", "seqpack.planning.cost", "seqpack.planning.step", "seqpack.planning.step_shapes",
     "seqpack.planning.stream", "seqpack.testing.rollout_stream", "seqpack.tensors.layout",
     "seqpack.tensors.thd", "seqpack.frameworks._batch", "seqpack.frameworks.verl.seqlen_balancing",
     "seqpack.frameworks.verl.engine", "seqpack.frameworks.trl.choice", "seqpack.frameworks.automodel",
     "seqpack.testing.pipelines", "seqpack.testing.step_simulator", "seqpack.testing.distributions",
     "seqpack.tensors.cp",
     "seqpack.tensors.dataset", "seqpack.tensors.prefix_tree", "seqpack.tensors.prefix_passes", "seqpack.planning.prefix_reuse",
     "seqpack.planning.prefix_forest", "seqpack.frameworks.verl.restore", "seqpack.frameworks._loss_split",
     "seqpack.training.logprobs",
     "seqpack.training.loss",
     "seqpack.training.logprobs_tree",
     "seqpack.training.nemo_rl_loss", "seqpack.training.attention_tree", "seqpack._lengths"],
)
def test_doctests(module):
    result = doctest.testmod(importlib.import_module(module), verbose=False, report=True)
    assert result.attempted > 0
    assert result.failed == 0


@pytest.mark.gpu
def test_cuda_device_name():
    if seqpack.build_info()["cuda_device_count"] <= 0:
        pytest.skip("no CUDA device visible to seqpack")
    name = seqpack._core.cuda_device_name(0)
    assert isinstance(name, str) and name.strip()


def test_readme_example_is_true():
    """Every `expression  # [literal]` line of the README's Python example holds."""
    import ast
    import pathlib
    import re

    readme = pathlib.Path(__file__).resolve().parents[2] / "README.md"
    block = re.search(r"```python\n(.*?)```", readme.read_text(), re.S).group(1)
    namespace: dict = {}
    checked = 0
    pending = None  # an expression whose value may be given on the next (comment) line
    for line in block.splitlines():
        code, _, comment = line.partition("#")
        expected = re.match(r"\s*(\[[\[\]\d, ]*\])", comment)
        if not code.strip():
            if expected and pending is not None:
                assert eval(pending, namespace) == ast.literal_eval(expected.group(1)), pending
                checked += 1
            pending = None
            continue
        if expected:
            assert eval(code, namespace) == ast.literal_eval(expected.group(1)), line
            checked += 1
            pending = None
        else:
            exec(code, namespace)
            pending = code if "=" not in code.split("(")[0] else None
    assert checked == 3


def test_readme_trainer_example_runs(monkeypatch):
    """The README's second Python block (config -> BatchedDataDict -> THD micro-batches) runs."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[2]
    block = re.findall(r"```python\n(.*?)```", (root / "README.md").read_text(), re.S)[1]
    monkeypatch.chdir(root)
    namespace: dict = {}
    exec(block, namespace)
    assert namespace["params"].qkv_format == "thd" and namespace["tokens"].dim() == 1


def test_package_carries_type_information_and_one_version():
    import importlib.metadata
    import pathlib

    root = pathlib.Path(seqpack.__file__).parent
    assert (root / "py.typed").is_file()
    stub = root / "_core.pyi"
    assert stub.is_file(), "the build generates _core.pyi with pybind11-stubgen (a build requirement)"
    text = stub.read_text()
    public = [n for n in dir(seqpack._core) if not n.startswith("_")]
    missing = [n for n in public if n not in text]
    assert not missing, f"_core.pyi lacks {missing}: regenerate it (rebuild)"
    assert importlib.metadata.version("seqpack") == seqpack.__version__
