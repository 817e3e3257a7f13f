"""verl's outputs put back in order: the inverse permutation, the rows of a batch,
and ``restore_dynamic_batch`` (micro-batch outputs concatenated -> the batch's order:
a step plan's dummy rows dropped, a prefix-reuse row's passes summed).

    >>> get_reverse_idx([2, 0, 1])
    [1, 2, 0]

Importing this module does not import torch.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Sequence

import numpy as np

from .._batch import (batch_size, is_data_proto, is_nested, is_tensor, proto_columns, proto_select, rows, select,
                     select_all)

__all__ = ["get_reverse_idx", "restore_dynamic_batch", "select_rows"]


def get_reverse_idx(idx_map: Any) -> Any:
    """The inverse permutation: ``out[idx_map[i]] = i``, of the same kind as
    ``idx_map`` (a list, a NumPy array, a tensor on its device).

    Raises:
        ValueError: ``idx_map`` is not a permutation of ``range(len(idx_map))``
            (verl's gives a wrong map or an ``IndexError``).
    """
    tensor = is_tensor(idx_map)
    values = np.asarray(idx_map.detach().cpu().numpy() if tensor else idx_map)
    if values.ndim != 1:
        raise ValueError(f"idx_map must be 1-D, got shape {values.shape}")
    n = values.size
    if n and values.dtype.kind not in "iu":
        raise TypeError(f"idx_map must hold integers, got dtype {values.dtype}")
    idx = values.astype(np.int64, copy=False)
    if n and (idx.min() < 0 or idx.max() >= n or np.bincount(idx, minlength=n).max() > 1):
        raise ValueError(f"idx_map must be a permutation of range({n}): every index in [0, {n}) exactly once")
    inverse = np.empty(n, dtype=np.int64)
    inverse[idx] = np.arange(n, dtype=np.int64)
    if tensor:
        import torch

        return torch.as_tensor(inverse, dtype=idx_map.dtype if n else torch.long, device=idx_map.device)
    if isinstance(idx_map, np.ndarray):
        return inverse.astype(idx_map.dtype if n else np.int64)
    return inverse.tolist()


def restore_dynamic_batch(data: Any, batch_idx_list: Sequence[Sequence[int]]) -> Any:
    """verl's ``restore_dynamic_batch``: rows computed micro-batch by micro-batch
    and concatenated (in ``batch_idx_list``'s order) put back in the original order.

    ``data`` is a tensor (a jagged nested tensor too), a NumPy array, a list, a
    mapping of them or a DataProto. Its rows are ``sum(len(p) for p in
    batch_idx_list)``; or one more per empty entry (a :func:`prepare_dynamic_batch`
    dummy of a ``step_plan``), whose rows are dropped.

    Prefix-reuse passes (:func:`rearrange_micro_batches` with ``prefix_reuse``)
    each list the rank's rows: a row's outputs of its passes are summed (each
    position comes from the one pass that predicts it, the others hold 0).

    Raises:
        ValueError: ``batch_idx_list`` is not a permutation of the rows, or
            ``data`` has another number of rows.
    """
    filled = [[int(i) for i in p] for p in batch_idx_list if len(p)]
    if len(filled) > 1 and all(p == filled[0] for p in filled):  # prefix-reuse passes: each lists the rank's rows
        return _sum_passes(data, batch_idx_list)
    order = _restore_order(batch_idx_list, _rows_of(data))
    return _take(data, order)


def select_rows(batch: Mapping[str, Any], rows_: List[int]) -> Any:
    if not isinstance(batch, dict) and hasattr(batch, "batch_size"):  # a TensorDict keeps its type
        import torch

        if not any(is_nested(v) for _, v in batch.items()):
            return batch[torch.tensor(rows_, dtype=torch.long)]
        # verl's engine TensorDicts: nested rows re-nested, its metadata kept (as verl's index_select_tensor_dict)
        return type(batch)({k: select(k, v, rows_) for k, v in batch.items()}, batch_size=[len(rows_)])
    out: Dict[str, Any] = select_all(batch, rows_)
    return out


def _rows_of(data: Any) -> int:
    if is_data_proto(data):
        return batch_size(proto_columns(data), "data")
    if isinstance(data, Mapping) or (callable(getattr(data, "keys", None)) and not is_tensor(data)):
        return batch_size(data, "data")
    if is_tensor(data) and data.is_nested:
        return int(data.size(0))
    return rows(data)


def _restore_order(batch_idx_list: Sequence[Sequence[int]], n_rows: int) -> List[int]:
    """Positions of ``data``'s rows, in the original order."""
    kept: List[int] = []  # positions of real rows in data, in batch_idx_list's order
    indices: List[int] = []
    position = empty = 0
    for part in batch_idx_list:
        part = [int(i) for i in part]
        if not part:
            empty += 1
            position += 1  # a dummy's one row
            continue
        indices.extend(part)
        kept.extend(range(position, position + len(part)))
        position += len(part)
    if n_rows == len(indices):  # no dummy rows in data
        kept = list(range(n_rows))
    elif n_rows != position or not empty:
        raise ValueError(f"data has {n_rows} rows but batch_idx_list holds {len(indices)} indices"
                         + (f" (and {empty} empty micro-batches: {position} with one dummy row each)" if empty else ""))
    inverse = get_reverse_idx(indices)
    return [kept[i] for i in inverse]


def _sum_passes(data: Any, batch_idx_list: Sequence[Sequence[int]]) -> Any:
    """The rows of prefix-reuse passes' outputs (a tensor or a mapping of them), each
    original row the sum of its passes' rows."""
    if isinstance(data, Mapping) or (callable(getattr(data, "keys", None)) and not is_tensor(data)):
        return {k: _sum_passes(v, batch_idx_list) for k, v in data.items()}
    if not is_tensor(data):
        raise ValueError(f"restore_dynamic_batch of prefix-reuse passes sums each row's outputs: it takes tensors, "
                         f"got {type(data).__name__}")
    import torch

    parts = list(data.unbind()) if data.is_nested else list(data)
    rows_ = max(int(i) for p in batch_idx_list for i in p) + 1
    total: List[Any] = [None] * rows_
    position = 0
    for part in batch_idx_list:
        for i in (part or [None]):  # a dummy's one row is dropped
            if i is not None:
                total[int(i)] = parts[position] if total[int(i)] is None else total[int(i)] + parts[position]
            position += 1
    if position != len(parts) or any(t is None for t in total):
        raise ValueError(f"data has {len(parts)} rows but batch_idx_list's passes hold {position}")
    return torch.nested.as_nested_tensor(total, layout=torch.jagged) if data.is_nested else torch.stack(total)


def _take(data: Any, order: List[int]) -> Any:
    if is_data_proto(data):
        return proto_select(data, order, "data")
    if is_tensor(data) and data.is_nested:
        import torch

        parts = data.unbind()
        return torch.nested.as_nested_tensor([parts[i] for i in order], layout=torch.jagged)
    if is_tensor(data) or isinstance(data, (np.ndarray, list)):
        return select("data", data, order)
    if isinstance(data, Mapping) or callable(getattr(data, "keys", None)):
        if not isinstance(data, dict) and hasattr(data, "batch_size"):  # a TensorDict keeps its type
            return select_rows(data, order)
        return {k: _take(v, order) for k, v in data.items()}
    return select("data", data, order)
