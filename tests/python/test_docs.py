"""Every ``## `` section of docs/*.md runs alone, as a reader copies it: its Python
blocks in one fresh namespace, in order, from an empty directory with the installed
package; every ``expression  # literal`` line in them holds. A section whose first
block starts with ``# not run: <why>`` (a GPU, a multi-process launch) is run by a
test elsewhere."""

from __future__ import annotations

import ast
import doctest
import pathlib
import re

import pytest

torch = pytest.importorskip("torch")

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"


def _blocks(page: pathlib.Path):
    return re.findall(r"```python\n(.*?)```", page.read_text(), re.S)


def _checked_lines(block: str):
    """(expression, literal) of each line written ``expr  # literal``."""
    for line in block.splitlines():
        code, sep, comment = line.partition("  # ")
        if not sep or not code.strip() or code.startswith((" ", "\t")):
            continue
        try:
            ast.parse(code.strip(), mode="eval")
            expected = ast.literal_eval(comment.strip())
        except (SyntaxError, ValueError):
            continue
        yield code.strip(), expected


def _sections(page: pathlib.Path):
    """(title, blocks) of each ``## `` section with Python blocks (the page's
    introduction, before its first section, is a section of its own)."""
    out = []
    for part in re.split(r"(?m)^## ", page.read_text()):
        title = part.splitlines()[0] if part else ""
        blocks = re.findall(r"```python\n(.*?)```", part, re.S)
        if blocks:
            out.append((title, blocks))
    return out


SECTIONS = [(p.name, title, blocks) for p in sorted(DOCS.glob("*.md")) for title, blocks in _sections(p)]
NOT_RUN = re.compile(r"\s*# not run: \S")


@pytest.mark.parametrize("page, title, blocks", SECTIONS, ids=[f"{p}::{t[:40]}" for p, t, _ in SECTIONS])
def test_each_section_runs_alone_from_any_directory(page, title, blocks, tmp_path, monkeypatch):
    if NOT_RUN.match(blocks[0]):
        pytest.skip(blocks[0].strip().splitlines()[0])
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    namespace: dict = {}
    checked = 0
    where = f"{page}, section {title!r}"
    for block in blocks:
        if block.lstrip().startswith(">>>"):  # a doctest session
            test = doctest.DocTestParser().get_doctest(block, namespace, where, page, 0)
            runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
            runner.run(test, clear_globs=False)
            namespace.update(test.globs)  # DocTest works on a copy of the namespace
            assert runner.failures == 0, f"{where}: a doctest block fails (see the output above)"
            checked += runner.tries
            continue
        exec(compile(block, where, "exec"), namespace)
        for expr, expected in _checked_lines(block):
            assert eval(expr, namespace) == expected, f"{where}: {expr}"
            checked += 1


def test_every_page_checks_something():
    for page in ("api.md", "thd.md"):
        assert any(_checked_lines(b) or b.lstrip().startswith(">>>") for _, bs in _sections(DOCS / page) for b in bs)
