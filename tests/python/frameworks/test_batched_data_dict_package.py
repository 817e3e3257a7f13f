"""The NeMo-RL adapter as a package (issue 50, "frameworks as packages"): one concept
per module, functions over the data or a plain shard record, no private name used
outside the module that defines it, every module's examples run, and the old import
paths give the same objects. (Import cycles and layers: tests/python/test_layers.py.)"""

from __future__ import annotations

import ast
import doctest
import importlib
import pathlib

import pytest

import seqpack
import seqpack.frameworks.nemo_rl as nemo_rl

PACKAGE = pathlib.Path(nemo_rl.__file__).parent
MODULES = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")


def _private_uses(tree: ast.AST):
    """Private names (``_x``, not dunders) a module imports or reads as an attribute."""
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        for name in names:
            if name.startswith("_") and not name.startswith("__"):
                yield name


@pytest.mark.parametrize("module", MODULES)
def test_no_private_name_crosses_a_module(module):
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    foreign = sorted(set(_private_uses(tree)) - defined)
    assert not foreign, f"nemo_rl/{module}.py uses private names defined elsewhere: {foreign}"


@pytest.mark.parametrize("module", ["", *MODULES])
def test_module_examples_run(module):
    name = "seqpack.frameworks.nemo_rl" + (f".{module}" if module else "")
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
    if module not in ("gather", "cp_iterator"):  # those need a process group: their examples are illustrations
        assert result.attempted > 0, f"{name} has no example"


def test_every_module_is_under_600_lines():
    for path in PACKAGE.glob("*.py"):
        assert len(path.read_text().splitlines()) < 600, path.name


def test_the_old_paths_are_the_same_objects():
    from seqpack.frameworks.batched_data_dict import BatchedDataDict, SlicedDataDict, TreeMicroBatch

    assert BatchedDataDict is seqpack.BatchedDataDict is nemo_rl.BatchedDataDict
    assert SlicedDataDict is nemo_rl.SlicedDataDict and TreeMicroBatch is nemo_rl.TreeMicroBatch
