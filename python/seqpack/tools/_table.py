"""The tables of the reports: plain rows, printed as text or HTML."""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any, List

import numpy as np

from .._equality import fields_equal


@dataclass
class Table:
    title: str
    columns: List[str]
    rows: List[List[Any]]
    note: str = ""

    def format(self) -> str:
        cells = [[_fmt(v) for v in row] for row in self.rows]
        widths = [max(len(c), *(len(r[i]) for r in cells)) if cells else len(c) for i, c in enumerate(self.columns)]
        line = "  ".join("-" * w for w in widths)
        out = [self.title, line, "  ".join(c.ljust(w) for c, w in zip(self.columns, widths)), line]
        out += ["  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths))) for r in cells]
        if self.note:
            out.append(self.note)
        return "\n".join(out)

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.columns)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(_fmt(v))}</td>" for v in r) + "</tr>" for r in self.rows
        )
        note = f"<p>{html.escape(self.note)}</p>" if self.note else ""
        return f"<b>{html.escape(self.title)}</b><table><tr>{head}</tr>{body}</table>{note}"


@dataclass(eq=False)
class Tables:
    """A report's tables: printed as text (``format``) or HTML in Jupyter; equal by
    value. Reports that add their own fields subclass it as dataclasses."""

    tables: List[Table] = field(default_factory=list)

    __eq__ = fields_equal
    __hash__ = None  # mutable

    def format(self) -> str:
        return "\n\n".join(t.format() for t in self.tables)

    def _repr_html_(self) -> str:
        return "".join(t._repr_html_() for t in self.tables)


class Pct(float):
    """A ratio shown as a percentage (still a float for JSON and arithmetic)."""


class Ms(float):
    """A duration in milliseconds."""


def time_header(name: str, cost: Any) -> str:
    """``name`` with its unit: seconds under :meth:`CostModel.default()
    <seqpack.CostModel.default>`, the caller's units under any other model."""
    from ..planning.cost import CostModel

    return f"{name} (s)" if cost == CostModel.default() else f"{name} (cost units)"


def _fmt(v: Any) -> str:
    if isinstance(v, Pct):
        return f"{v:.2%}"
    if isinstance(v, Ms):
        return f"{v:.2f}"
    if isinstance(v, float):
        return f"{v:,.3f}"
    if isinstance(v, (int, np.integer)):
        return f"{int(v):,}"
    return str(v)


def _plain(v: Any) -> Any:
    if isinstance(v, (Pct, Ms)):
        return float(v)
    return v.item() if isinstance(v, np.generic) else v
