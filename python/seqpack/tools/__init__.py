"""Support tools: :mod:`~seqpack.tools.report` (plan a batch every way and compare),
:mod:`~seqpack.tools.plot` (matplotlib figures of a report) and
:mod:`~seqpack.tools.cli` (the ``seqpack`` command)."""

from .._lazy import submodules

__getattr__ = submodules(__name__, ("cli", "plot", "report"))
