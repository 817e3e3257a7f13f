"""Conversion of user-provided lengths to NumPy without importing torch."""

from __future__ import annotations

from typing import Any

import numpy as np


def _is_torch_tensor(x: Any) -> bool:
    # Checked by module name so that `import seqpack` never imports torch.
    return type(x).__module__.split(".")[0] == "torch" and hasattr(x, "detach")


def as_lengths(x: Any, name: str = "sequence_lengths") -> np.ndarray:
    """Return a 1-D integer NumPy array viewing ``x`` where possible.

    Accepts Python sequences of ints, NumPy arrays of any integer dtype (no copy)
    and 1-D torch tensors (no copy on CPU; a CUDA tensor is copied to the host,
    which synchronises its stream).

    Raises:
        TypeError: ``x`` does not hold integers.
        ValueError: ``x`` is not 1-D.
    """
    if isinstance(x, np.ndarray):
        arr = x
    elif _is_torch_tensor(x):
        t = x.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.dtype.is_floating_point or t.dtype.is_complex or str(t.dtype) == "torch.bool":
            raise TypeError(f"{name} must hold integers, got {t.dtype}")
        arr = t.numpy()
    else:
        try:
            arr = np.asarray(x)
        except (ValueError, OverflowError) as e:
            raise TypeError(f"{name} must be a 1-D sequence of integers: {e}") from None
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(arr.shape)}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    return arr


def core_lengths(x: Any, name: str = "sequence_lengths") -> Any:
    """``x`` ready for the C++ core: lists and tuples pass through (the core reads
    them directly, checking every item); anything else goes through :func:`as_lengths`."""
    if isinstance(x, (list, tuple)):
        return x
    return as_lengths(x, name)


def as_positive_int(value: Any, name: str, allow_zero: bool = False) -> int:
    """Validate an integer argument (bools rejected) and return it as ``int``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if value < 0 or (value == 0 and not allow_zero):
        rule = ">= 0" if allow_zero else "positive"
        raise ValueError(f"{name} must be {rule}, got {value}")
    return value


def round_up(x: Any, multiple: int) -> Any:
    """``x`` rounded up to a multiple of ``multiple`` (an int, or elementwise for an
    integer NumPy array).

    >>> round_up(5, 4), round_up(np.array([0, 3, 8]), 4).tolist()
    (8, [0, 4, 8])
    """
    m = as_positive_int(multiple, "multiple")
    return (x + (m - 1)) // m * m
