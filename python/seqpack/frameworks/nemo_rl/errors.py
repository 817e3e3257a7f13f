"""The one error type of the NeMo-RL adapter, and the checks that raise it.

    >>> from seqpack.frameworks.nemo_rl.errors import BatchedDataDictError, check
    >>> try:
    ...     check(False, "shards must divide the batch")
    ... except AssertionError as e:  # also a ValueError
    ...     print(e)
    shards must divide the batch

Importing this module does not import torch.
"""

from __future__ import annotations

from typing import Any

from ..._lengths import as_positive_int

__all__ = ["BatchedDataDictError", "check", "positive"]


class BatchedDataDictError(ValueError, AssertionError):
    """Invalid arguments or data (a ``ValueError``; also an ``AssertionError`` like
    NeMo-RL's checks, so existing ``except AssertionError`` code keeps working)."""


def check(condition: bool, message: str) -> None:
    """Raise :class:`BatchedDataDictError` with ``message`` unless ``condition``."""
    if not condition:
        raise BatchedDataDictError(message)


def positive(value: Any, name: str) -> int:
    """``value`` as a positive ``int`` (:func:`seqpack._lengths.as_positive_int`: a
    ``TypeError`` for a non-integer), its ``ValueError`` as a :class:`BatchedDataDictError`.

    >>> positive(4, "shards")
    4
    """
    try:
        return as_positive_int(value, name)
    except ValueError as e:
        raise BatchedDataDictError(str(e)) from None
