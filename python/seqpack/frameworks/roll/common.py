"""What ROLL's adapters share (:mod:`seqpack.roll`): the result dict, the error that
is also ROLL's ``AssertionError``, batch metadata and columns of a ``DataProto`` or
a mapping, and whether a DP group takes part in an agreement.

Importing this module does not import torch.
"""

from __future__ import annotations

import copy
import functools
import types
from typing import Any, Callable, Dict, Iterator, Mapping, MutableMapping, Optional


from .._batch import batch_size, is_data_proto, proto_columns
from ..._dist import active
from ..._equality import values_equal
from ..._lengths import as_int


class RollBatch(dict):
    """A DataProto-like batch: tensors by name, plus ``meta_info``."""

    def __init__(self, *args, meta_info: Optional[Dict[str, Any]] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.meta_info: Dict[str, Any] = dict(meta_info or {})

    def __eq__(self, other: object) -> bool:
        """Same tensors (element by element) and the same ``meta_info``."""
        if not isinstance(other, RollBatch):
            return NotImplemented
        return values_equal(dict(self), dict(other)) and values_equal(self.meta_info, other.meta_info)

    def __ne__(self, other: object) -> bool:  # dict's own __ne__ would compare the tensors' truth values
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = None  # mutable

    @property
    def num_rows(self) -> int:
        """Rows (``len()`` of a DataProto; ``len()`` of this dict counts keys)."""
        return batch_size(self) if self else 0

    def slice(self, start: int, end: int) -> "RollBatch":
        return RollBatch({k: v[start:end] for k, v in self.items()}, meta_info=copy.deepcopy(self.meta_info))


class RollError(ValueError, AssertionError):
    """Invalid arguments or data of the dynamic-batching functions: a ``ValueError``,
    and also an ``AssertionError`` like ROLL's own checks there, so code (and ROLL's
    tests) catching either keeps working."""


def int_like(value: Any) -> Any:
    """An integer given as a Python or NumPy integer or a 0-d integer array or tensor,
    as ``int``; anything else (a bool, a float, None) unchanged, for the caller's
    check to refuse by name."""
    try:
        return as_int(value, "value")
    except TypeError:
        return value


def _as_roll_error(exc: ValueError) -> RollError:
    return RollError(*exc.args).with_traceback(exc.__traceback__)


def _guarded(gen: Iterator[Any]) -> Iterator[Any]:
    try:
        yield from gen
    except ValueError as exc:
        if type(exc) is not ValueError:
            raise
        raise _as_roll_error(exc) from None


def roll_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Plain ``ValueError``s of ``fn`` (and of the generator it returns) become
    :class:`RollError` with the same message; other errors pass unchanged."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            out = fn(*args, **kwargs)
        except ValueError as exc:
            if type(exc) is not ValueError:
                raise
            raise _as_roll_error(exc) from None
        return _guarded(out) if isinstance(out, types.GeneratorType) else out

    return wrapper


def roll_meta(batch: Any) -> Dict[str, Any]:
    return getattr(batch, "meta_info", None) or {}


def batch_columns(batch: Any) -> Mapping[str, Any]:
    """The batch's values by name: a DataProto's tensors and non-tensor arrays, or the mapping itself."""
    return proto_columns(batch) if is_data_proto(batch) else batch


def write_meta(batch: Any, **values: Any) -> None:
    """Keys ROLL writes on its input's ``meta_info`` (a DataProto's, a RollBatch's)."""
    meta = getattr(batch, "meta_info", None)
    if isinstance(meta, MutableMapping):
        meta.update(values)


def ranks_agree(dp_group: Any) -> bool:
    """Whether the micro-batch count is agreed over a process group. ROLL agrees only
    when ``torch.distributed`` is initialised, so a stand-in ``dp_group`` (ROLL's
    tests pass a bare object) is ignored without one. Initialised, ``dp_group=None``
    is the default group (when it has more than one rank); anything else must be a
    ``ProcessGroup``."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    if dp_group is None:
        return active()
    if not isinstance(dp_group, dist.ProcessGroup):
        raise TypeError(f"dp_group must be a torch.distributed ProcessGroup (or None for the default group) once "
                        f"torch.distributed is initialised, got {type(dp_group).__name__}")
    return True
