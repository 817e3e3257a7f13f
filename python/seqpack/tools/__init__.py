"""Support tools: :mod:`~seqpack.tools.report` (plan a batch every way and compare),
:mod:`~seqpack.tools.plot` (matplotlib figures of a report), :mod:`~seqpack.tools.cli`
(the ``seqpack`` command) and the notebook shipped with the package
(:func:`notebook`: ``jupyter lab "$(python -c 'import seqpack.tools as t; print(t.notebook())')"``)."""

import pathlib

from .._lazy import submodules

__all__ = ["notebook"]

__getattr__ = submodules(__name__, ("cli", "plot", "report"))


def notebook(name: str = "packing_metrics.ipynb") -> pathlib.Path:
    """The path of a notebook shipped with seqpack (installed with the package):
    ``packing_metrics.ipynb`` plans a batch every way and plots the metrics.

    >>> notebook().name
    'packing_metrics.ipynb'
    """
    folder = pathlib.Path(__file__).resolve().parent / "notebooks"
    names = sorted(p.name for p in folder.glob("*.ipynb"))
    if str(name) not in names:
        raise ValueError(f"no notebook {name!r}; seqpack ships {names}")
    return folder / str(name)
