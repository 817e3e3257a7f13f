"""Value equality for objects that hold tensors and arrays.

``==`` on a dataclass or dict of tensors asks a tensor for its truth value, which
raises for more than one element. seqpack's containers (packed batches, packed
datasets, ``BatchedDataDict``) compare with :func:`values_equal` instead: same
types, same keys, tensors and arrays equal in dtype, shape, device and every
element. Torch is never imported here (a tensor is recognised by its methods).

    >>> import numpy as np
    >>> values_equal({"a": np.arange(3), "b": [1, (2, 3)]}, {"a": np.arange(3), "b": [1, (2, 3)]})
    True
    >>> values_equal(np.arange(3), np.arange(3).astype(np.int32))
    False
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

import numpy as np

__all__ = ["ValueEquality", "fields_equal", "values_equal"]


def _is_tensor(x: Any) -> bool:
    return hasattr(x, "equal") and hasattr(x, "device") and hasattr(x, "dtype") and hasattr(x, "requires_grad")


def values_equal(a: Any, b: Any) -> bool:
    """True when ``a`` and ``b`` hold the same values (recursively through
    mappings, lists and tuples); tensors and arrays must also agree in dtype and
    shape, tensors in device and ``requires_grad``; NaN equals NaN."""
    if _is_tensor(a) or _is_tensor(b):
        if not (_is_tensor(a) and _is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape
                and a.device == b.device and a.requires_grad == b.requires_grad):
            return False
        if bool(a.equal(b)):
            return True
        # NaN equals NaN here, as in the arrays' branch: a copy of a batch holding NaN is equal to it.
        return bool((a.dtype.is_floating_point or a.dtype.is_complex)
                    and ((a == b) | (a.isnan() & b.isnan())).all())
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and a.shape == b.shape and bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")))
    if isinstance(a, Mapping) or isinstance(b, Mapping):
        return (isinstance(a, Mapping) and isinstance(b, Mapping) and type(a) is type(b)
                and a.keys() == b.keys() and all(values_equal(a[k], b[k]) for k in a))
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return (type(a) is type(b) and len(a) == len(b) and all(values_equal(x, y) for x, y in zip(a, b)))
    return bool(a == b)


def fields_equal(self: Any, other: Any) -> Any:
    """``__eq__`` of a dataclass holding tensors or arrays: the same type and every
    field :func:`values_equal` (``NotImplemented`` for another type). Assign it as
    ``__eq__ = fields_equal`` with ``@dataclass(eq=False)``, and ``__hash__ = None``."""
    if type(other) is not type(self):
        return NotImplemented
    return all(values_equal(getattr(self, f.name), getattr(other, f.name)) for f in fields(self))


class ValueEquality:
    """Mixin for objects that are their attributes (packers, metric trackers, loss
    functions): equal when of the same type with :func:`values_equal` attributes,
    so a pickled or deep-copied one equals its original. Unhashable, as mutable."""

    __slots__ = ()

    def __eq__(self, other: Any) -> Any:
        if type(other) is not type(self):
            return NotImplemented
        return values_equal(vars(self), vars(other))

    __hash__ = None  # type: ignore[assignment]
