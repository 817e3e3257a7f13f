"""docs/architecture.md shows the package as it is: its "Every module" section lists
every module of ``python/seqpack`` found on disk when the test runs, and nothing
else, and no source file is long enough to hold more than one concept (STYLE.md rule 7: split by
concept before a file passes ~600 lines)."""

from __future__ import annotations

import pathlib
import re
from typing import List

import seqpack

ROOT = pathlib.Path(seqpack.__file__).resolve().parent
DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
MAX_LINES = 600
# Written by the build (scikit-build-core's generate), not kept in git: listed, present
# in an installed package, absent from an editable checkout's source tree.
GENERATED = {"_version.py"}


def _sources() -> List[pathlib.Path]:
    return sorted(p for p in ROOT.rglob("*.py") if "__pycache__" not in p.parts)


def _listed(text: str) -> set:
    """The code spans of the "Every module" section (module paths relative to python/seqpack)."""
    section = text.partition("\n## Every module\n")[2].partition("\n## ")[0]
    return set(re.findall(r"`([^`\n]+)`", section))


def _missing(text: str) -> List[str]:
    listed = _listed(text)
    return [path for path in (p.relative_to(ROOT).as_posix() for p in _sources()) if path not in listed]


def test_every_module_is_listed_in_the_architecture_doc():
    missing = _missing(DOC.read_text())
    assert not missing, (f"docs/architecture.md, 'Every module': add a line for each of {missing} "
                         f"(its path relative to python/seqpack/ and its one concept)")


def test_every_listed_module_exists():
    section = DOC.read_text().partition("\n## Every module\n")[2]
    rows = re.findall(r"^\| `([^`\n]+)` \|", section, re.M)  # each table row's first cell
    assert len(rows) >= len([p for p in _sources() if p.name not in GENERATED])
    stale = [row for row in rows if not (ROOT / row).exists() and row not in GENERATED]
    assert not stale, f"docs/architecture.md, 'Every module', lists modules that do not exist: {stale}"


def test_the_listing_check_can_fail():
    text = DOC.read_text()
    assert "tensors/thd.py" in _listed(text) and "__init__.py" in _listed(text)
    without = text.replace("| `tensors/thd.py` |", "| tensors/thd.py |")
    assert _missing(without) == ["tensors/thd.py"]
    elsewhere = text.replace("\n## Every module\n", "\n## Modules\n")  # a span outside the section does not count
    assert "tensors/thd.py" in _missing(elsewhere)


def test_no_source_file_is_over_600_lines():
    long = {p.relative_to(ROOT).as_posix(): n for p in _sources()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split by concept (docs/architecture.md, 'The rules'): {long}"
