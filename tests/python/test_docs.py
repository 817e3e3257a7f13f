"""Every Python block of docs/*.md runs (blocks of one page share a namespace, in
order), and every ``expression  # literal`` line in them holds."""

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


PAGES = sorted(p.name for p in DOCS.glob("*.md") if _blocks(p))


@pytest.mark.parametrize("page", PAGES)
def test_page_blocks_run_and_say_true(page, monkeypatch):
    monkeypatch.chdir(DOCS.parent)
    torch.manual_seed(0)
    namespace: dict = {}
    checked = 0
    for block in _blocks(DOCS / page):
        if block.lstrip().startswith(">>>"):  # a doctest session
            test = doctest.DocTestParser().get_doctest(block, namespace, page, page, 0)
            runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
            runner.run(test, clear_globs=False)
            namespace.update(test.globs)  # DocTest works on a copy of the namespace
            assert runner.failures == 0, f"{page}: a doctest block fails (see the output above)"
            checked += runner.tries
            continue
        exec(compile(block, f"{page}", "exec"), namespace)
        for expr, expected in _checked_lines(block):
            assert eval(expr, namespace) == expected, f"{page}: {expr}"
            checked += 1
    assert checked > 0 or page not in ("api.md", "thd.md"), f"{page}: no checked line"
