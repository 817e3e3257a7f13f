"""Host buffers for large outputs."""

from __future__ import annotations

import mmap

import numpy as np

__all__ = ["fresh_array"]

_POPULATE_FROM = 64 << 20  # bytes: smaller arrays come from NumPy's allocator


def fresh_array(size: int, dtype: np.dtype) -> np.ndarray:
    """An uninitialised array; a large one (64 MiB and more) from an anonymous
    mapping populated by the kernel in one call (Linux ``MAP_POPULATE``): half the
    time of faulting its pages in one by one as a copy first writes them."""
    nbytes = size * np.dtype(dtype).itemsize
    populate = getattr(mmap, "MAP_POPULATE", None)
    if populate is None or nbytes < _POPULATE_FROM:
        return np.empty(size, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
    return np.frombuffer(mapping, dtype=dtype)  # the array keeps the mapping alive
