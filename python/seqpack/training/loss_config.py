"""The configuration rules every NeMo-RL loss of seqpack shares: the error type, known
keys with a did-you-mean, and typed values (NumPy and 0-d tensor scalars accepted).

    >>> known_keys({"scale": 2}, {"scale": 1.0, "cliprange": None}, "MseValueLossFn")
    {'scale': 2, 'cliprange': None}
    >>> cfg_real({"scale": 2}, "scale")
    2.0

Torch-free.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

import numpy as np

from .._lengths import as_real

__all__ = ["LossConfigError", "cfg_bool", "cfg_real", "check_config", "known_keys"]


class LossConfigError(ValueError, AssertionError):
    """A loss configuration seqpack cannot honour: an unknown or unimplemented key, or
    a combination NeMo-RL forbids (a ``ValueError``; also an ``AssertionError``, which
    is what NeMo-RL's own checks raise)."""


def check_config(condition: bool, message: str) -> None:
    if not condition:
        raise LossConfigError(message)


class LossConfigTypeError(LossConfigError, TypeError):
    """A configuration value of the wrong type (a string, a bool, ``None``): a
    :class:`LossConfigError` that is also a ``TypeError``."""


def known_keys(cfg: Optional[Mapping[str, Any]], defaults: Mapping[str, Any], loss: str) -> Dict[str, Any]:
    """``cfg`` over ``defaults``; a key ``defaults`` lacks (NeMo-RL's loss configs
    forbid extras) raises :class:`LossConfigError` naming it and the closest known
    key."""
    import difflib

    cfg = dict(cfg or {})
    for key in cfg:
        if key not in defaults:
            close = difflib.get_close_matches(str(key), list(defaults), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f" (known: {', '.join(defaults)})"
            raise LossConfigError(f"cfg[{key!r}] is not a {loss} key{hint}")
    return {**defaults, **cfg}


def cfg_bool(c: Dict[str, Any], key: str) -> bool:
    """``c[key]`` as a bool (Python, NumPy or 0-d tensor booleans; 0 / 1 too)."""
    value = c[key]
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, bool) or (isinstance(value, (int, np.integer)) and value in (0, 1)):
        return bool(value)
    if isinstance(value, np.bool_):
        return bool(value)
    raise LossConfigTypeError(f"cfg[{key!r}] must be a bool, got {value!r}")


def cfg_real(c: Dict[str, Any], key: str, **rules: Any) -> float:
    """``c[key]`` as a float by :func:`seqpack._lengths.as_real` (NumPy and 0-d
    tensor numbers accepted), any refusal a :class:`LossConfigError` naming the key
    (also a ``TypeError`` for a value of the wrong type)."""
    try:
        return as_real(c[key], f"cfg[{key!r}]", **rules)
    except TypeError as e:
        raise LossConfigTypeError(str(e)) from None
    except ValueError as e:
        raise LossConfigError(str(e)) from None
