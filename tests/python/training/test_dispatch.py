"""The one dispatch table (issue 50): which implementation runs a layout is decided
in ``seqpack.training.dispatch`` and the layout modules, nowhere else.

An AST reading of every source file fails on a branch on a layout's kind outside
them: ``isinstance`` / ``type()`` against a concrete layout class (a class testing
its own instances in its own module aside), ``hasattr`` on a layout attribute,
``select`` with constant arguments, ``rows() is None`` (directly or through a name
it was assigned to), ``.is_tree`` and calls of the kind functions. The checker is
itself tested on snippets that must fail.
"""

import ast
import pathlib

import pytest
import torch

import seqpack
from seqpack.training import dispatch

ROOT = pathlib.Path(seqpack.__file__).parent
# The layout modules and the table: where kinds are looked at.
ALLOWED = {"tensors/token_layout.py", "tensors/layout_kinds.py", "tensors/cp_cut.py", "tensors/sharded_layout.py",
           "tensors/parts_layout.py", "training/dispatch.py"}
LAYOUT_CLASSES = {"TokenLayout", "PackedLayout", "PrefixTreeBatch", "PackedBatch", "StaticPackedBatch",
                  "HybridCpBatch", "HybridCpPart", "ShardedLayout", "PartsLayout"}
LAYOUT_ATTRIBUTES = {"parts", "is_tree", "composite_kind", "cut", "select", "rows", "segment_offsets", "parent",
                     "subtree_end", "shares_tokens", "cu_seqlens_padded", "cp_size", "cp_rank"}
KIND_FUNCTIONS = {"layout_kind", "dispatch_key", "is_composite", "layout_cut"}


def _names(node):
    """The class names an isinstance / type() comparison tests against."""
    if isinstance(node, ast.Tuple):
        return {n for elt in node.elts for n in _names(elt)}
    if isinstance(node, ast.Name):
        return {node.id}
    if isinstance(node, ast.Attribute):
        return {node.attr}
    return set()


def _is_rows_call(node):
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "rows"
            and not node.args and not node.keywords)


def _is_none(node):
    return isinstance(node, ast.Constant) and node.value is None


def kind_switches(source, own_classes=()):
    """(line, what) of every branch on a layout's kind in ``source``."""
    tree = ast.parse(source)
    found = []
    for fn in [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
        rows_names = {t.id for n in ast.walk(fn) if isinstance(n, ast.Assign) and _is_rows_call(n.value)
                      for t in n.targets if isinstance(t, ast.Name)}
        for node in ast.walk(fn):
            if isinstance(node, ast.Compare) and any(_is_none(c) for c in [node.left, *node.comparators]):
                sides = [node.left, *node.comparators]
                if any(_is_rows_call(s) or (isinstance(s, ast.Name) and s.id in rows_names) for s in sides):
                    found.append((node.lineno, "rows() compared with None"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            name = node.func.id
            if name == "isinstance" and len(node.args) == 2:
                hit = (_names(node.args[1]) & LAYOUT_CLASSES) - set(own_classes)
                if hit:
                    found.append((node.lineno, f"isinstance against {sorted(hit)}"))
            elif name == "hasattr" and len(node.args) == 2 and isinstance(node.args[1], ast.Constant) \
                    and node.args[1].value in LAYOUT_ATTRIBUTES:
                found.append((node.lineno, f"hasattr(..., {node.args[1].value!r})"))
            elif name in KIND_FUNCTIONS:
                found.append((node.lineno, f"{name}() outside the table"))
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                if isinstance(side, ast.Call) and isinstance(side.func, ast.Name) and side.func.id == "type":
                    others = [s for s in [node.left, *node.comparators] if s is not side]
                    hit = set().union(*(_names(o) for o in others)) & LAYOUT_CLASSES - set(own_classes)
                    if hit:
                        found.append((node.lineno, f"type() against {sorted(hit)}"))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "select" \
                and node.keywords and {k.arg for k in node.keywords} == {"rows", "tree"} \
                and any(isinstance(k.value, ast.Constant) for k in node.keywords):
            found.append((node.lineno, "select() with constant arguments"))
        if isinstance(node, ast.Attribute) and node.attr == "is_tree" and isinstance(node.ctx, ast.Load):
            found.append((node.lineno, ".is_tree"))
    return found


def _own_classes(source):
    return {n.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)}


@pytest.mark.parametrize("snippet", [
    "def f(x):\n    return isinstance(x, PrefixTreeBatch)",
    "def f(x):\n    return isinstance(x, (int, seqpack.HybridCpBatch))",
    "def f(x):\n    return type(x) is PackedLayout",
    "def f(x):\n    return hasattr(x, 'parts')",
    "def f(x):\n    return x.select(rows=False, tree=True)",
    "def f(x):\n    return x.rows() is None",
    "def f(x):\n    rows = x.rows()\n    if rows is not None:\n        return 1",
    "def f(part):\n    return part.is_tree",
    "def f(x):\n    return layout_kind(x) == 'tree'",
])
def test_the_checker_finds_each_kind_switch(snippet):
    assert kind_switches(snippet), snippet


def test_the_checker_lets_a_class_test_its_own_instances():
    source = "class PackedLayout:\n    def __eq__(self, other):\n        return isinstance(other, PackedLayout)"
    assert kind_switches(source, _own_classes(source)) == []


def test_no_kind_switch_outside_the_table_and_the_layout_modules():
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in ALLOWED:
            continue
        source = path.read_text()
        offenders += [f"{rel}:{line}: {what}" for line, what in kind_switches(source, _own_classes(source))]
    assert not offenders, ("branch on a layout's kind in seqpack.training.dispatch's table (or a layout module), "
                           "not here:\n" + "\n".join(offenders))


def test_every_layout_kind_and_cut_has_attention_and_a_missing_pair_names_itself():
    kinds = {k for k, _ in dispatch.ATTENTION}
    assert kinds == {"rows", "tree", "flat_tree", "parts", "tree_pass"}
    for kind in ("rows", "tree", "flat_tree"):
        assert {(kind, "whole"), (kind, "ulysses")} <= set(dispatch.ATTENTION)
    assert set(dispatch.TOKEN_LOGPROBS) <= set(dispatch.ATTENTION)
    assert all(callable(f) for f in {**dispatch.ATTENTION, **dispatch.TOKEN_LOGPROBS}.values())
    layout = seqpack.shard_layout(seqpack.PackedLayout.from_lengths([4, 4]), 2, 0, scheme="ulysses")
    with pytest.raises(TypeError, match=r"token_logprobs has no implementation for a rows layout with a ulysses "
                                        r"cut \(it runs: flat_tree/ranges"):
        seqpack.token_logprobs(torch.zeros(4, 3), layout, torch.zeros(8, dtype=torch.long))


@pytest.mark.parametrize("layout, key", [
    (seqpack.PackedLayout.from_lengths([3, 2]), ("rows", "whole")),
    (seqpack.PackedLayout.from_lengths([4, 4], pad_multiple=4, cp_size=2, cp_rank=1), ("rows", "zigzag")),
    (seqpack.pack_prefix_tree([[1, 2], [1, 3]]), ("tree", "whole")),
    (seqpack.pack_prefix_tree([[1, 2], [3, 4]]), ("flat_tree", "whole")),
    (seqpack.shard_layout(seqpack.pack_prefix_tree([[1, 2], [1, 3]]), 2, 1), ("tree", "ranges")),
    (seqpack.split_prefix_tree(seqpack.pack_prefix_tree([[1, 2], [1, 3]]), 2).passes[0], ("tree_pass", "whole")),
    ([0, 3, 5], ("rows", "whole")),
])
def test_dispatch_keys(layout, key):
    assert dispatch.dispatch_key(layout) == key
