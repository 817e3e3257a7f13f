"""Conversion of user-provided lengths and numbers without importing torch: the one
place where seqpack decides what counts as an int, a real number or a temperature."""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional, Tuple

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


def host_array(value: Any) -> np.ndarray:
    """``value``'s values as a NumPy array: a torch tensor is detached and copied to
    the host (torch is never imported here), anything else goes to ``np.asarray``."""
    if _is_torch_tensor(value):
        return value.detach().cpu().numpy()
    return np.asarray(value)


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


def shown(value: Any, limit: int = 80, plain: bool = False) -> str:
    """``value`` as an error message shows it: its ``repr`` (cut to ``limit``
    characters), with its type when that is not plain (``np.float32(0.5)``,
    ``tensor(0.5000) (torch.Tensor)``), so that a refused value never looks like an
    acceptable Python number. ``plain``: the ``repr`` only."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a broken __repr__ (or an int past Python's 4300 digits) must not hide the error
        text = f"<an int of {value.bit_length()} bits>" if isinstance(value, int) else f"<{type_name(value)}>"
    if len(text) > limit:
        text = text[:limit - 3] + "..."
    if not plain and type(value) not in (int, float, bool, complex, str, type(None)) and \
            type(value).__name__ not in text:
        text += f" ({type_name(value)})"
    return text


def _number(value: Any, name: str, what: str) -> Tuple[str, Any]:
    """``(kind, item)`` of one number given as a Python or NumPy scalar, a 0-d NumPy
    array or a 0-d torch tensor (on any real device; read with ``.item()``). ``kind``
    is ``"b"`` (bool), ``"i"`` (integer), ``"f"`` (real) or ``"c"`` (complex);
    ``item`` the Python number. Anything else is a ``TypeError`` naming ``name``.
    torch is recognised by module name, never imported."""
    if isinstance(value, (bool, np.bool_)):
        return "b", bool(value)
    if isinstance(value, (int, np.integer)):
        return "i", int(value)
    if isinstance(value, (float, np.floating)):
        return "f", float(value)
    if isinstance(value, (complex, np.complexfloating)):
        return "c", complex(value)
    tensor = _is_torch_tensor(value)
    if tensor or isinstance(value, np.ndarray):
        shape = tuple(value.shape)
        if shape != ():
            raise TypeError(f"{name} must be {what}, got a {type_name(value)} of shape {shape} (one number is "
                            "a Python or NumPy scalar, a 0-d array or a 0-d tensor)")
        if tensor:
            check_not_meta(value, name)
            dtype = value.dtype
            kind = ("b" if str(dtype) == "torch.bool" else "c" if dtype.is_complex
                    else "f" if dtype.is_floating_point else "i")
        else:
            kind = {"b": "b", "i": "i", "u": "i", "f": "f", "c": "c"}.get(value.dtype.kind, "")
            if not kind:
                raise TypeError(f"{name} must be {what}, got a 0-d array of dtype {value.dtype}")
        return kind, value.item()
    if isinstance(value, numbers.Integral):
        return "i", int(value)
    if isinstance(value, numbers.Real):
        return "f", value
    raise TypeError(f"{name} must be {what}, got {type_name(value)}")


def item_of(value: Any, name: str) -> Any:
    """The Python number a 0-d NumPy array or 0-d torch tensor holds (refusing a
    tensor on the meta device); anything else unchanged, for the caller's own rules
    (e.g. a pad value, where bools and NaN can be valid)."""
    if isinstance(value, (bool, int, float, complex)):  # also what torch.compile traces through
        return value
    if (isinstance(value, np.ndarray) or _is_torch_tensor(value)) and tuple(value.shape) == ():
        check_not_meta(value, name)
        return value.item()
    return value


def as_positive_int(value: Any, name: str, allow_zero: bool = False, maximum: int = INT64_MAX) -> int:
    """Validate an integer argument and return it as ``int``: Python and NumPy
    integers, 0-d integer NumPy arrays and 0-d integer torch tensors are accepted;
    bools, floats (also as arrays or tensors), strings, ``None`` and arrays of more
    than one element are a ``TypeError``; a value below 1 (below 0 with
    ``allow_zero``) or above ``maximum`` (by default the int64 limit of the C++
    core) a ``ValueError``. Messages name the argument and show the value as given.

    >>> as_positive_int(np.uint16(3), "k"), as_positive_int(np.array(4), "k")
    (3, 4)
    >>> as_positive_int(2**63, "k")
    Traceback (most recent call last):
    ...
    ValueError: k must fit in int64 (<= 9223372036854775807), got 9223372036854775808
    """
    value = as_int(value, name)
    if value < 0 or (value == 0 and not allow_zero):
        rule = ">= 0" if allow_zero else "positive"
        raise ValueError(f"{name} must be {rule}, got {shown(value)}")
    if value > maximum:
        rule = f"fit in int64 (<= {INT64_MAX})" if maximum == INT64_MAX else f"be <= {maximum}"
        raise ValueError(f"{name} must {rule}, got {shown(value)}")
    return value


def as_int(value: Any, name: str) -> int:
    """Any integer (no range) as ``int``: the inputs and type rules of
    :func:`as_positive_int`."""
    kind, item = _number(value, name, "an int")
    if kind != "i":
        raise TypeError(f"{name} must be an int, got {_kind_of(value)}")
    return item


def _kind_of(value: Any) -> str:
    """``float: 1.5``, ``torch.Tensor of dtype torch.bool: tensor(True)``: the type
    of a refused number, and the value as given."""
    dtype = f" of dtype {value.dtype}" if isinstance(value, np.ndarray) or _is_torch_tensor(value) else ""
    return f"{type_name(value)}{dtype}: {shown(value, plain=True)}"


def as_int64(value: Any, name: str) -> int:
    """Any integer that fits in int64 (negative ones too), e.g. a pad id, as ``int``;
    the inputs, rules and messages of :func:`as_positive_int`."""
    value = as_int(value, name)
    if value < -INT64_MAX - 1:
        raise ValueError(f"{name} must fit in int64 (>= {-INT64_MAX - 1}), got {shown(value)}")
    return value if value < 0 else as_positive_int(value, name, allow_zero=True)


def as_real(value: Any, name: str, *, minimum: Optional[float] = None, minimum_inclusive: bool = True,
            maximum: Optional[float] = None, maximum_inclusive: bool = True, finite: bool = True,
            rule: Optional[str] = None) -> float:
    """A real-number argument as a Python ``float``, the one rule for every number
    seqpack reads: Python ints and floats, NumPy integer and floating scalars, 0-d
    NumPy arrays and 0-d torch tensors of those dtypes (and other
    ``numbers.Real``) are accepted and give the same float.

    Raises:
        TypeError: a bool, string, ``None``, complex number or an array or tensor of
            more than one element (the message names ``name`` and the type).
        ValueError: NaN; an infinity when ``finite``; an integer too large for a
            float64; a value outside ``[minimum, maximum]`` (or the open bound when
            ``minimum_inclusive`` / ``maximum_inclusive`` is false). The message names
            ``name``, the rule (``rule`` when given, else one written from the
            bounds) and the value as given.

    >>> as_real(np.float32(0.5), "temperature"), as_real(np.array(3), "scale")
    (0.5, 3.0)
    >>> as_real(-1.0, "scale", minimum=0, minimum_inclusive=False)
    Traceback (most recent call last):
    ...
    ValueError: scale must be a finite number > 0, got -1.0
    """
    kind, item = _number(value, name, "a real number")
    if kind in "bc":
        raise TypeError(f"{name} must be a real number, got {_kind_of(value)}")

    def refused(extra: str = "") -> ValueError:  # the message is written only on failure (hot paths call this)
        text = rule
        if text is None:
            text = "a finite number" if finite else "a number"
            if minimum is not None:
                text += f" {'>=' if minimum_inclusive else '>'} {minimum:g}"
            if maximum is not None:
                text += f"{' and' if minimum is not None else ''} {'<=' if maximum_inclusive else '<'} {maximum:g}"
        return ValueError(f"{name} must be {text}{extra}, got {shown(value)}")

    try:
        x = float(item)
    except OverflowError:
        raise refused(" (it must fit in a float64)") from None
    if math.isnan(x) or (finite and math.isinf(x)):
        raise refused()
    if minimum is not None and (x < minimum if minimum_inclusive else x <= minimum):
        raise refused()
    if maximum is not None and (x > maximum if maximum_inclusive else x >= maximum):
        raise refused()
    return x


FLOAT32_NORMAL_MIN = float(np.finfo(np.float32).tiny)  # 1.1754944e-38
FLOAT32_MAX = float(np.finfo(np.float32).max)  # 3.4028235e+38


def as_temperature(value: Any, name: str = "temperature") -> float:
    """A softmax temperature as a Python ``float``: any number :func:`as_real` takes
    that lies in ``[1.1754944e-38, 3.4028235e+38]``, the normal float32 range. The
    log-prob kernels compute in float32 and divide by it (or multiply by its
    reciprocal), so below that range it would round to 0 or its reciprocal to
    infinity, and above it it would round to infinity. Checked here, once, with the
    value in the message: what the C++ and CUDA kernels receive is always valid.

    >>> as_temperature(np.float32(0.7)) == float(np.float32(0.7))
    True
    >>> as_temperature(1e-320)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: temperature must be a positive finite number in [1.1754944e-38, 3.4028235e+38] (...), got 1e-320
    """
    return as_real(value, name, minimum=FLOAT32_NORMAL_MIN, maximum=FLOAT32_MAX, rule=_TEMPERATURE_RULE)


_TEMPERATURE_RULE = (f"a positive finite number in [{FLOAT32_NORMAL_MIN:.8g}, {FLOAT32_MAX:.8g}] (a normal float32: "
                     "the kernels divide by it in float32)")


def round_up(x: Any, multiple: int) -> Any:
    """``x`` rounded up to a multiple of ``multiple`` (an int, or elementwise for an
    integer NumPy array).

    >>> round_up(5, 4), round_up(np.array([0, 3, 8]), 4).tolist()
    (8, [0, 4, 8])
    """
    m = as_positive_int(multiple, "multiple")
    return (x + (m - 1)) // m * m


def as_flag(value: Any, name: str) -> bool:
    """``True`` / ``False`` (also NumPy's, and a 0-d bool array or tensor)."""
    item = item_of(value, name)
    if not isinstance(item, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {shown(value)}")
    return bool(item)
