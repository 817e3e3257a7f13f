"""The package's layers: imports only point down, adapters never import each other,
and there is no import cycle. Every import statement of the source counts, read from
its syntax tree: module-level, function-level and ``TYPE_CHECKING`` ones alike."""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys
from typing import Dict, Iterator, Set, Tuple

import pytest

import seqpack

ROOT = pathlib.Path(seqpack.__file__).resolve().parent

# Lower number = lower layer; a module may import its own layer or lower ones.
# "tools" sit on "testing": the demo compares seqpack's plans with testing's models
# of the frameworks' pipelines; the oracles never import the tools.
LAYERS = {"_core": 0, "_version": 0, "_lengths": 0, "_dist": 0, "_lazy": 0, "_equality": 0, "_readonly": 0, "_memory": 0,
          "planning": 1, "tensors": 2, "training": 3, "frameworks": 4, "testing": 5, "tools": 6}
# A framework adapter is a module or a package of seqpack.frameworks; its own modules
# import each other, never another adapter's. A module kept at an adapter's import path
# from before its package belongs to that adapter.
ADAPTERS = {"nemo_rl", "roll", "verl", "hf", "trl", "automodel", "config"}
OLD_PATHS = {"batched_data_dict": "nemo_rl"}


def _modules() -> Dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(("seqpack",) + parts)] = path
    return out


MODULES = _modules()
KNOWN = set(MODULES) | {"seqpack._core"}  # the extension has no .py source


def _resolve(name: str, package: str, level: int, imported: str) -> Iterator[str]:
    """The seqpack modules an import statement loads (``from X import y`` loads the
    module ``X.y`` when it is one, else ``X``)."""
    if level:
        base = package.split(".")
        base = base[: len(base) - level + 1]
        target = ".".join(base + ([name] if name else []))
    else:
        target = name
    if not target.startswith("seqpack"):
        return
    if imported and f"{target}.{imported}" in KNOWN:
        yield f"{target}.{imported}"
    else:
        yield target


def _imports(module: str, path: pathlib.Path) -> Tuple[Set[str], Set[str]]:
    """(runtime imports, type-checking-only imports) of one module."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    type_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                 and ast.unparse(block.test).endswith("TYPE_CHECKING") for n in ast.walk(block)}
    runtime: Set[str] = set()
    typing: Set[str] = set()
    for node in ast.walk(tree):
        found = typing if id(node) in type_only else runtime
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.update(_resolve(alias.name, package, 0, ""))
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                found.update(_resolve(node.module or "", package, node.level, alias.name))
    return runtime - {module}, typing - {module}


_BOTH = {m: _imports(m, p) for m, p in MODULES.items()}
GRAPH = {m: runtime for m, (runtime, _) in _BOTH.items()}  # what runs (module- and function-level)
EVERY = {m: runtime | typing for m, (runtime, typing) in _BOTH.items()}  # every import statement: the checks


def _layer(module: str) -> Tuple[str, int]:
    parts = module.split(".")
    if len(parts) == 1:
        return "seqpack", 99  # the facade: nothing inside the package may import it
    return parts[1], LAYERS[parts[1]]


def test_every_module_has_a_layer():
    for module in MODULES:
        if module != "seqpack" and module != "seqpack.__main__":
            assert module.split(".")[1] in LAYERS, f"{module}: add its package to LAYERS"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m not in ("seqpack", "seqpack.__main__")))
def test_imports_point_down(module):
    name, level = _layer(module)
    for target in EVERY[module]:
        tname, tlevel = _layer(target)
        assert tlevel <= level, f"{module} imports {target}: {name} (layer {level}) may not import {tname}"
        if tlevel == level and tname != name:
            pytest.fail(f"{module} imports {target}: {name} and {tname} are peers and must not import each other")


def _adapter(module: str):
    """The adapter ``module`` belongs to (``seqpack.frameworks.<adapter>`` or one of
    its package's modules), or None."""
    parts = module.split(".")
    if len(parts) < 3 or parts[1] != "frameworks":
        return None
    name = OLD_PATHS.get(parts[2], parts[2])
    return name if name in ADAPTERS else None


def test_adapters_never_import_each_other():
    for module, targets in EVERY.items():
        own = _adapter(module)
        if own is not None:
            for target in targets:
                other = _adapter(target)
                assert other is None or other == own, f"adapter {module} imports adapter {target}"


def _find_cycle(graph: Dict[str, Set[str]]):
    """One import cycle of ``graph`` as a list of modules (first == last), or None."""
    state: Dict[str, int] = {}
    stack = []

    def visit(node: str):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            found = visit(module)
            if found:
                return found
    return None


def test_no_import_cycles():
    # Every import statement counts: a cycle kept alive by a function-level import, or
    # closed only by a TYPE_CHECKING one (a module importing its caller for a type), is
    # still two modules that cannot be understood one without the other.
    cycle = _find_cycle(EVERY)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_graph_test_can_fail():
    # The checks read real edges (lazy ones included) and find a planted cycle.
    assert "seqpack.tensors.cp" in GRAPH["seqpack.training.loss"]
    assert "seqpack._core" in GRAPH["seqpack.planning.packing"]
    assert "seqpack.tensors._ops" in GRAPH["seqpack.tensors.thd"]  # imported inside a function
    planted = {**GRAPH, "seqpack.planning.metrics": GRAPH["seqpack.planning.metrics"] | {"seqpack.tools.report"}}
    cycle = _find_cycle(planted)
    assert cycle and "seqpack.tools.report" in cycle and "seqpack.planning.metrics" in cycle


def test_every_kind_of_import_statement_is_read(tmp_path):
    # Module-level, function-level, TYPE_CHECKING (plain and typing.-qualified),
    # absolute and relative: each is an edge, and a cycle closed by a type-only import
    # is found.
    source = tmp_path / "report.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "import typing\n"
        "import seqpack.planning.packing\n"
        "from ..planning import balance\n"
        "if TYPE_CHECKING:\n"
        "    from .plot import Figure\n"
        "if typing.TYPE_CHECKING:\n"
        "    from seqpack.tensors import thd\n"
        "def draw():\n"
        "    from . import _table\n"
        "    import seqpack.testing.pipelines as pipelines\n")
    runtime, typing_only = _imports("seqpack.tools.report", source)
    assert runtime == {"seqpack.planning.packing", "seqpack.planning.balance", "seqpack.tools._table",
                       "seqpack.testing.pipelines"}
    assert typing_only == {"seqpack.tools.plot", "seqpack.tensors.thd"}
    graph = {"seqpack.tools.report": runtime | typing_only, "seqpack.tools.plot": {"seqpack.tools.report"}}
    assert _find_cycle(graph) == ["seqpack.tools.plot", "seqpack.tools.report", "seqpack.tools.plot"]


def test_an_adapter_package_is_one_adapter():
    assert _adapter("seqpack.frameworks.roll") == "roll"
    assert _adapter("seqpack.frameworks.nemo_rl.sharding") == "nemo_rl"
    assert _adapter("seqpack.frameworks.batched_data_dict") == "nemo_rl"
    assert _adapter("seqpack.frameworks._batch") is None
    assert _adapter("seqpack.tensors.thd") is None


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ.copy())
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_import_seqpack_is_lazy_and_torch_free():
    loaded = _run("import sys, seqpack; print(sorted(m for m in sys.modules if m.startswith(('seqpack', 'torch'))))")
    assert loaded == "['seqpack', 'seqpack._version']"
    # Submodules are attributes on first use; the torch-free ones stay torch-free.
    assert _run("import sys, seqpack; seqpack.config; seqpack.planning; seqpack.tensors; seqpack.training; "
                "seqpack.tools; seqpack.testing.reference; print('torch' in sys.modules)") == "False"


def test_moved_module_paths_are_the_same_modules():
    import seqpack.frameworks.hf
    import seqpack.integrations.hf
    import seqpack.loss
    import seqpack.roll
    from seqpack.batched_data_dict import BatchedDataDict

    assert seqpack.roll is seqpack.frameworks.roll
    assert seqpack.loss is seqpack.training.loss
    assert seqpack.integrations.hf is seqpack.frameworks.hf
    assert BatchedDataDict is seqpack.BatchedDataDict
    for old, new in seqpack._MOVED.items():
        assert __import__(f"seqpack.{old}", fromlist=["_"]) is __import__(f"seqpack.{new}", fromlist=["_"]), old


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        seqpack.nope
    with pytest.raises(ModuleNotFoundError):
        __import__("seqpack.nope")
