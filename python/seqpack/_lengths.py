"""Conversion of user-provided lengths to NumPy without importing torch."""

from __future__ import annotations

from typing import Any

import numpy as np

INT64_MAX = 2**63 - 1


def type_name(x: Any) -> str:
    """The type of ``x`` as an error message names it: ``int``, ``generator``,
    ``numpy.ndarray``, ``torch.Tensor``."""
    t = type(x)
    module = t.__module__.split(".")[0]
    return t.__qualname__ if module == "builtins" else f"{module}.{t.__qualname__}"


def _is_torch_tensor(x: Any) -> bool:
    # Checked by module name so that `import seqpack` never imports torch.
    return type(x).__module__.split(".")[0] == "torch" and hasattr(x, "detach")


def check_not_meta(t: Any, name: str) -> None:
    """A tensor on PyTorch's meta device has a shape but no values; seqpack reads
    values, so it is refused by name (torch would raise NotImplementedError)."""
    if getattr(getattr(t, "device", None), "type", None) == "meta":
        raise ValueError(f"{name} is on the meta device; seqpack needs real data (a CPU or CUDA tensor)")


def as_lengths(x: Any, name: str = "sequence_lengths") -> np.ndarray:
    """Return a 1-D integer NumPy array viewing ``x`` where possible.

    Accepts Python sequences of ints, NumPy arrays of any integer dtype (no copy)
    and 1-D torch tensors (no copy on CPU; a CUDA tensor is copied to the host,
    which synchronises its stream).

    Raises:
        TypeError: ``x`` does not hold integers, or is not a sequence (a generator,
            set, dict or string: the message names its type).
        ValueError: ``x`` is not 1-D (a number included), or is a tensor on the
            meta device.
    """
    if isinstance(x, np.ndarray):
        arr = x
    elif _is_torch_tensor(x):
        check_not_meta(x, name)
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
        if arr.ndim == 0 and arr.dtype.kind in "OSUV":  # a generator, set, dict or string, wrapped whole
            raise TypeError(f"{name} must be a 1-D sequence of integers, got {type_name(x)}")
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


def as_positive_int(value: Any, name: str, allow_zero: bool = False, maximum: int = INT64_MAX) -> int:
    """Validate an integer argument and return it as ``int``: Python and NumPy
    integers are accepted; bools, floats, strings and ``None`` are a ``TypeError``;
    a value below 1 (below 0 with ``allow_zero``) or above ``maximum`` (by default
    the int64 limit of the C++ core) a ``ValueError``. Messages name the argument
    and show the value as given.

    >>> as_positive_int(np.uint16(3), "k")
    3
    >>> as_positive_int(2**63, "k")
    Traceback (most recent call last):
    ...
    ValueError: k must fit in int64 (<= 9223372036854775807), got 9223372036854775808
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type_name(value)}")
    value = int(value)
    if value < 0 or (value == 0 and not allow_zero):
        rule = ">= 0" if allow_zero else "positive"
        raise ValueError(f"{name} must be {rule}, got {value}")
    if value > maximum:
        rule = f"fit in int64 (<= {INT64_MAX})" if maximum == INT64_MAX else f"be <= {maximum}"
        raise ValueError(f"{name} must {rule}, got {value}")
    return value


def as_int64(value: Any, name: str) -> int:
    """Any integer that fits in int64 (negative ones too), e.g. a pad id, as ``int``;
    the rules and messages of :func:`as_positive_int`."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)) and value < 0:
        if int(value) < -INT64_MAX - 1:
            raise ValueError(f"{name} must fit in int64 (>= {-INT64_MAX - 1}), got {int(value)}")
        return int(value)
    return as_positive_int(value, name, allow_zero=True)


def round_up(x: Any, multiple: int) -> Any:
    """``x`` rounded up to a multiple of ``multiple`` (an int, or elementwise for an
    integer NumPy array).

    >>> round_up(5, 4), round_up(np.array([0, 3, 8]), 4).tolist()
    (8, [0, 4, 8])
    """
    m = as_positive_int(multiple, "multiple")
    return (x + (m - 1)) // m * m
