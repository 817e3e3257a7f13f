"""Submodules as attributes on first access (PEP 562), so that importing a package
never imports what its submodules need (torch, transformers, matplotlib)."""

from __future__ import annotations

import importlib
from typing import Any, Callable, Iterable


def submodules(package: str, names: Iterable[str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports ``package.<name>`` for
    each of ``names`` when it is first read."""
    known = frozenset(names)

    def __getattr__(name: str) -> Any:
        if name in known:
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
