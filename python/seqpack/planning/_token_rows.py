"""Token rows as the prefix-tree builders take them: flat int64 tokens and offsets
from a list of rows, from padded ``input_ids`` + ``attention_mask``, or from packed
ids + ``cu_seqlens``; and per-row group ids. Shared by
:class:`~seqpack.PrefixTreeBatch` and :class:`~seqpack.PrefixForest`. Torch-free
(tensors are read through their host copy)."""

from __future__ import annotations

import numbers
from typing import Any, Iterable, Optional, Tuple

import numpy as np

from .._lengths import INT64_MAX, _is_torch_tensor, check_not_meta, host_array, shown, type_name


def _refuse_big_python_ints(value: Any, name: str) -> None:
    """Python integers past int64 (either way) make NumPy build an object or float
    array: say so, naming the value, instead of "not an integer"."""
    if isinstance(value, np.ndarray) or _is_torch_tensor(value):
        return
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, numbers.Integral) and not -INT64_MAX - 1 <= int(item) <= INT64_MAX:
            raise ValueError(f"{name} must fit in int64 ([{-INT64_MAX - 1}, {INT64_MAX}]), got {int(item)}")


def int_array(value: Any, name: str, ndim: int) -> np.ndarray:
    """``value`` as an int64 NumPy array of ``ndim`` dimensions, or a clear error."""
    if _is_torch_tensor(value):
        check_not_meta(value, name)
        if value.dtype.is_floating_point or value.dtype.is_complex or str(value.dtype) == "torch.bool":
            raise TypeError(f"{name} must hold integers, got a tensor of dtype {value.dtype}")
    if isinstance(value, (str, bytes)) or value is None:
        raise TypeError(f"{name} must be a {ndim}-D sequence of integers, got {type_name(value)}")
    try:
        arr = host_array(value)
    except (TypeError, ValueError) as e:  # ragged nested lists, odd objects
        raise TypeError(f"{name} must be a {ndim}-D sequence of integers, got {type_name(value)}") from e
    if arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(arr.shape)}")
    if arr.size == 0:
        return np.zeros(arr.shape, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        _refuse_big_python_ints(value, name)
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.dtype == np.uint64 and int(arr.max()) > INT64_MAX:
        raise ValueError(f"{name} must fit in int64, got {int(arr.max())}")
    return arr.astype(np.int64, copy=False)


def rows_flat(rows: Any) -> Tuple[np.ndarray, np.ndarray]:
    """Flat int64 tokens and offsets of ``rows`` (a list of 1-D token sequences)."""
    if isinstance(rows, (str, bytes, dict)) or not isinstance(rows, Iterable) and not hasattr(rows, "__len__"):
        raise TypeError(f"rows must be a list of 1-D token sequences, got {type_name(rows)}")
    arrays = [int_array(row, f"rows[{i}]", 1) for i, row in enumerate(rows)]
    lengths = np.fromiter((a.shape[0] for a in arrays), dtype=np.int64, count=len(arrays))
    cu = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu[1:])
    tokens = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
    return tokens, cu


def group_array(group_ids: Any, rows: int) -> Optional[np.ndarray]:
    """``group_ids`` (one integer per row) as int64, or None."""
    if group_ids is None:
        return None
    groups = int_array(group_ids, "group_ids", 1)
    if groups.shape[0] != rows:
        raise ValueError(f"group_ids must hold one id per row ({rows} rows), got {groups.shape[0]}")
    return groups


def padded_rows(input_ids: Any, attention_mask: Any) -> Tuple[np.ndarray, np.ndarray]:
    """Flat tokens and offsets of padded rows ``input_ids`` [B, S] whose real tokens
    are where ``attention_mask`` [B, S] (bool or 0/1 integers) is non-zero, in column
    order: left padding, right padding or holes."""
    ids = int_array(input_ids, "input_ids", 2)
    if _is_torch_tensor(attention_mask):
        check_not_meta(attention_mask, "attention_mask")
    mask = host_array(attention_mask)
    if mask.shape != ids.shape:
        raise ValueError(f"attention_mask must have the shape of input_ids {tuple(ids.shape)}, "
                         f"got {tuple(mask.shape)}")
    if mask.size and mask.dtype.kind not in "biu":
        raise TypeError(f"attention_mask must be bool or integer, got dtype {mask.dtype}")
    real = mask.astype(bool)
    cu = np.zeros(ids.shape[0] + 1, dtype=np.int64)
    np.cumsum(real.sum(axis=1), out=cu[1:])
    return np.ascontiguousarray(ids[real]), cu


def packed_rows(input_ids: Any, cu_seqlens: Any) -> Tuple[np.ndarray, np.ndarray]:
    """Flat tokens and offsets of rows packed back to back: ``input_ids`` [N] (or
    [1, N]) and ``cu_seqlens`` [R + 1] (starting at 0, non-decreasing, ending at N)."""
    ids = host_array(input_ids) if not isinstance(input_ids, (list, tuple)) else np.asarray(input_ids)
    if getattr(ids, "ndim", 0) == 2 and ids.shape[0] == 1:
        input_ids = input_ids[0]
    tokens = int_array(input_ids, "input_ids", 1)
    cu = int_array(cu_seqlens, "cu_seqlens", 1)
    if cu.shape[0] < 1 or cu[0] != 0 or (np.diff(cu) < 0).any():
        raise ValueError(f"cu_seqlens must start at 0 and never decrease; got {shown(cu.tolist())}")
    if cu[-1] != tokens.shape[0]:
        raise ValueError(f"cu_seqlens must end at the number of input_ids ({tokens.shape[0]}), got {int(cu[-1])}")
    return tokens, cu
