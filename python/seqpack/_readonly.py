"""Read-only arrays that stay read-only through pickle and ``copy.deepcopy``.

NumPy's pickle does not carry an array's ``writeable`` flag: a plan whose arrays are
documented read-only would come back from a DataLoader worker (or a deepcopy) with
writable ones, and a stray write would change what it describes while it still
compares equal. :class:`ReadOnlyArrays` records which of an object's arrays were
read-only and sets them so again where the object lands.

    >>> import copy, numpy as np
    >>> class Plan(ReadOnlyArrays):
    ...     def __init__(self):
    ...         self.ids = np.arange(3)
    ...         self.ids.flags.writeable = False
    >>> copy.deepcopy(Plan()).ids.flags.writeable
    False
"""

from __future__ import annotations

from typing import Any, Dict

import numpy as np

__all__ = ["ReadOnlyArrays"]

_KEY = "__read_only_arrays__"


class ReadOnlyArrays:
    """Mixin for objects (dataclasses included, frozen or not) whose ``__dict__``
    holds NumPy arrays: the read-only ones stay read-only in a pickled or copied
    object."""

    __slots__ = ()

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        frozen = [k for k, v in state.items() if isinstance(v, np.ndarray) and not v.flags.writeable]
        if frozen:
            state[_KEY] = frozen
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        state = dict(state)
        for name in state.pop(_KEY, ()):
            state[name].flags.writeable = False
        self.__dict__.update(state)
