"""Row operations on a batch's data: a mapping of tensors, NumPy arrays, lists and
NeMo-RL ``PackedTensor``s whose dimension 0 is the batch. Every function takes the
data and returns new data (a plain ``dict``) or a count; the ``BatchedDataDict``
methods are these functions on ``self.data``.

    >>> from seqpack.frameworks.nemo_rl.rows import gather, row_count
    >>> data = {"x": [10, 11, 12], "y": ["a", "b", "c"]}
    >>> gather(data, [2, 0]), row_count(data)
    ({'x': [12, 10], 'y': ['c', 'a']}, 3)

Importing this module does not import torch.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, MutableMapping, Optional, Sequence

import numpy as np

from .._batch import dummy_row, is_packed, is_tensor, rows, select
from ..._lengths import check_not_meta
from .errors import BatchedDataDictError, check

__all__ = ["chunk_rows", "consistent_row_count", "dummy", "empty_packed", "gather", "lengths", "reordered",
           "row_count", "rows_to_split", "slice_rows", "take", "tensor_keys", "to_device", "truncate"]


def empty_packed(v: Any) -> Any:
    """No rows of a ``PackedTensor``'s kind: ``empty_rows_like(v, 0)`` (NeMo-RL's own
    empty value); an older ``PackedTensor``, which cannot be built from an empty
    list, as its ``empty_like`` with no rows left."""
    cls = type(v)
    if callable(getattr(cls, "empty_rows_like", None)):
        return cls.empty_rows_like(v, 0)
    if callable(getattr(cls, "empty_like", None)) and hasattr(v, "tensors"):
        empty = cls.empty_like(v)
        empty.tensors = []
        return empty
    return v.slice([])


def take(key: str, v: Any, indices: Sequence[int]) -> Any:
    """Rows ``indices`` of one value (:func:`seqpack.frameworks._batch.select`); no
    rows of a ``PackedTensor`` is its empty value, not an error.

    >>> take("x", [5, 6, 7], [2, 2])
    [7, 7]
    """
    if is_packed(v) and len(indices) == 0:
        return empty_packed(v)
    return select(key, v, indices)


def gather(data: Mapping[str, Any], indices: Sequence[int], keys: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Rows ``indices`` of every value (of ``keys``, in that order, when given):
    tensors in one ``index_select`` each.

    >>> gather({"b": [1, 2], "a": [3, 4]}, [1], keys=["a", "b"])
    {'a': [4], 'b': [2]}
    """
    return {key: take(key, data[key], indices) if (is_tensor(data[key]) or is_packed(data[key]))
            else [data[key][i] for i in indices] for key in (keys if keys is not None else data)}


def slice_rows(data: Mapping[str, Any], start: int, end: int) -> Dict[str, Any]:
    """Rows ``[start, end)`` of every value: tensor views, new lists, a
    ``PackedTensor``'s rows taken (NeMo-RL's ``slice``).

    >>> slice_rows({"x": [1, 2, 3]}, 1, 3)
    {'x': [2, 3]}
    """
    out: Dict[str, Any] = {}
    for key, v in data.items():
        if is_packed(v):
            out[key] = take(key, v, list(range(start, end)))
            continue
        if is_tensor(v):
            check(end <= v.shape[0], f"end: {end} is greater than the shape of the tensor: {v.shape[0]} for key: {key}")
        out[key] = v[start:end]
    return out


def row_count(data: Mapping[str, Any]) -> int:
    """The batch's one row count; no keys, or values of different row counts, are
    refused (NeMo-RL's message).

    >>> row_count({"x": [1, 2], "y": [3, 4]})
    2
    """
    check(bool(data), "the BatchedDataDict has no keys (an empty batch)")
    sizes = {rows(v) for v in data.values()}
    check(len(sizes) == 1, "Batch sizes are not the same across the rollout batch, found sizes: "
                           f"[{','.join(str(s) for s in sorted(sizes))}]")
    return sizes.pop()


def rows_to_split(data: Mapping[str, Any]) -> int:
    """:func:`row_count`, which must be positive: an empty batch has nothing to shard
    or iterate (NeMo-RL divides by zero or yields nothing)."""
    size = row_count(data)
    check(size > 0, "the BatchedDataDict has no rows (every value is empty): nothing to shard or iterate")
    return size


def consistent_row_count(batch: Mapping[str, Any], where: str) -> int:
    """The one logical row count of every value of ``batch`` (``len`` of a
    ``PackedTensor``; 0 for no values), or a :class:`BatchedDataDictError` naming ``where``.

    >>> consistent_row_count({}, "batch 0")
    0
    """
    sizes = {rows(v) for v in batch.values()}
    check(len(sizes) <= 1, f"{where} has inconsistent logical row counts: {sorted(sizes)}")
    return sizes.pop() if sizes else 0


def chunk_rows(data: Mapping[str, Any], rank: int, chunks: int) -> Dict[str, Any]:
    """The ``rank``-th of ``chunks`` contiguous, equal parts (copies).

    >>> chunk_rows({"x": [1, 2, 3, 4]}, 1, 2)
    {'x': [3, 4]}
    """
    size = row_count(data)
    check(chunks > 0 and size % chunks == 0, f"batch size ({size}) is not a multiple of chunks ({chunks})")
    check(0 <= rank < chunks, f"index OOB: not enough splits for this rank. rollout_batch_size: {size}, "
                              f"chunks ({chunks}), rank_idx ({rank})")
    per = size // chunks
    return gather(data, list(range(rank * per, (rank + 1) * per)))


def reordered(data: Mapping[str, Any], order: Sequence[int]) -> Dict[str, Any]:
    """The rows with row ``j`` moved to position ``order[j]`` (the inverse of
    gathering by ``order``).

    >>> reordered({"x": ["a", "b", "c"]}, [2, 0, 1])
    {'x': ['b', 'c', 'a']}
    """
    size = row_count(data)
    positions = np.asarray(order, dtype=np.int64)
    check(positions.shape == (size,), f"reorded_indices has {positions.size} entries for a batch of {size}")
    check(np.array_equal(np.sort(positions), np.arange(size)),
          "reorded_indices must be a permutation of range(batch size)")
    return gather(data, np.argsort(positions, kind="stable").tolist())


def truncate(data: MutableMapping[str, Any], dim: int, length: int) -> None:
    """Narrow, in place, every tensor with more than ``dim`` dimensions to ``length``
    along ``dim``."""
    import torch

    for key, v in data.items():
        if is_tensor(v) and v.dim() >= dim + 1:
            data[key] = torch.narrow(v, dim, 0, length)


def to_device(data: MutableMapping[str, Any], device: Any) -> None:
    """Move, in place, every tensor and ``PackedTensor`` to ``device``."""
    for key, v in data.items():
        if is_tensor(v) or is_packed(v):
            data[key] = v.to(device)


def dummy(data: Mapping[str, Any], input_lengths_key: str = "input_lengths") -> Dict[str, Any]:
    """A one-row micro-batch that runs one token and adds nothing to the loss (row 0
    with ``token_mask`` / ``sample_mask`` / ``loss_mask`` zeroed and
    ``input_lengths_key`` set to 1): what a rank with no work at a micro-batch step
    runs, so FSDP's per-micro-batch collectives still match.

    >>> dummy({"input_lengths": [7, 3], "sample_mask": [1.0, 1.0]})["input_lengths"]
    [1]
    """
    return dummy_row(data, length_key=input_lengths_key, name="BatchedDataDict")


def lengths(data: Mapping[str, Any], key: str) -> np.ndarray:
    """``data[key]`` as host int64 lengths (one per row), the key and the rule named
    when it is missing or not 1-D integers.

    >>> lengths({"input_lengths": [3, 5]}, "input_lengths").tolist()
    [3, 5]
    """
    if key not in data:
        raise BatchedDataDictError(f"input_lengths_key {key!r} is not in the data (keys: {sorted(data)})")
    v = data[key]
    if is_tensor(v):
        check_not_meta(v, f"data[{key!r}]")
        v = v.detach().cpu().numpy()
    out = np.asarray(v)
    check(out.ndim == 1 and (out.size == 0 or np.issubdtype(out.dtype, np.integer)),
          f"data[{key!r}] must be a 1-D sequence of integer lengths, got shape {out.shape} dtype {out.dtype}")
    return out.astype(np.int64, copy=False)


def tensor_keys(data: Mapping[str, Any]) -> List[str]:
    """The keys of ``[B, S, ...]`` tensors (what packing lays out by default)."""
    return [k for k, v in data.items() if is_tensor(v) and v.dim() >= 2]
