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
    code = "import sys, seqpack, seqpack.reference; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ.copy(), check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_all_names_exist():
    assert len(seqpack.__all__) == len(set(seqpack.__all__))
    for name in seqpack.__all__:
        assert hasattr(seqpack, name), name
    assert isinstance(seqpack.__version__, str)


def test_build_info():
    info = seqpack.build_info()
    assert set(info) == {"version", "built_with_cuda", "cuda_runtime_version", "cuda_device_count"}
    assert info["version"] == seqpack.__version__
    assert isinstance(info["built_with_cuda"], bool)
    assert isinstance(info["cuda_runtime_version"], int)
    assert isinstance(info["cuda_device_count"], int) and info["cuda_device_count"] >= 0
    if not info["built_with_cuda"]:
        assert info["cuda_device_count"] == 0


@pytest.mark.parametrize(
    "module",
    ["seqpack", "seqpack.packing", "seqpack.balance", "seqpack.metrics", "seqpack.dynamic_batching", "seqpack.thd",
     "seqpack.cp"],
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
