"""The measured results are findable: benchmarks/RESULTS.md is an index of one page per
area, each page opens with a table of its measurements (date, machine, command), and
every link into benchmarks/ from the README, docs/ and the pages themselves reaches an
existing file and heading."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
INDEX = BENCH / "RESULTS.md"
AREAS = ("planning", "tensors", "trees", "losses", "cp", "trainers", "streaming", "gpu")
PAGES = [BENCH / "results" / f"{area}.md" for area in AREAS]
SOURCES = [ROOT / "README.md", INDEX, *sorted((ROOT / "docs").glob("*.md")), *PAGES]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: pathlib.Path) -> set:
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", page.read_text(), re.M)}


def _first_table(page: pathlib.Path):
    lines = page.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows[0], rows[2:]


def test_the_index_links_every_area_page():
    text = INDEX.read_text()
    for page in PAGES:
        assert page.is_file(), page
        assert f"](results/{page.name})" in text, f"RESULTS.md does not link {page.name}"
    assert len(text.splitlines()) <= 40, "RESULTS.md is the index; the numbers go on the area pages"


@pytest.mark.parametrize("page", PAGES, ids=AREAS)
def test_each_page_opens_with_its_measurements(page):
    header, rows = _first_table(page)
    for column in ("date", "machine", "command"):
        assert column in header, f"{page.name}: the first table has no '{column}' column: {header}"
    assert rows, page.name
    for row in rows:
        cells = dict(zip(header, row))
        assert re.search(r"\d{4}-\d{2}-\d{2}", cells["date"]), (page.name, row)
        assert cells["machine"] and cells["command"], (page.name, row)
        link = LINK.search(cells[header[0]])
        assert link and link.group(1).lstrip("#") in _anchors(page), f"{page.name}: {row[0]} names no section"


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_into_the_benchmarks_resolve(source):
    text = source.read_text()
    for target in LINK.findall(text):
        if "://" in target or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        resolved = (source.parent / path).resolve() if path else source
        if BENCH not in resolved.parents and resolved != source:
            continue
        assert resolved.exists(), f"{source.name}: link to missing {target}"
        if anchor and resolved.suffix == ".md":
            assert anchor in _anchors(resolved), f"{source.name}: {target}: no such heading"
    for path in re.findall(r"benchmarks/results/[\w.-]+\.md", text):
        assert (ROOT / path).is_file(), f"{source.name} names {path}, which does not exist"


def test_the_anchor_rule_is_githubs():
    assert _slug("THD pack / unpack on the CPU") == "thd-pack--unpack-on-the-cpu"
    assert _slug("The shared CPU/GPU math") == "the-shared-cpugpu-math"
    assert _slug("Tree vs plain packing, first run") == "tree-vs-plain-packing-first-run"
