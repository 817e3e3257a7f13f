"""Row operations on batches: mappings of tensors, NumPy arrays and lists whose
dimension 0 is the batch (NeMo-RL's BatchedDataDict values, ROLL DataProto-like
dicts, verl TensorDict-like dicts). Torch is imported only when a tensor shows up."""

from __future__ import annotations

from typing import Any, Dict, Mapping, Sequence

import numpy as np


def is_tensor(v: Any) -> bool:
    import sys

    torch = sys.modules.get("torch")  # a tensor implies torch is imported
    return torch is not None and isinstance(v, torch.Tensor)


def is_packed(v: Any) -> bool:
    """NeMo-RL's multimodal ``PackedTensor`` (duck-typed: rows sliced by ``.slice``)."""
    return hasattr(v, "slice") and hasattr(v, "as_tensor") and hasattr(type(v), "concat")


def rows(v: Any) -> int:
    return int(v.shape[0]) if (is_tensor(v) or isinstance(v, np.ndarray)) else len(v)


def select(key: str, v: Any, indices: Sequence[int]) -> Any:
    """Rows ``indices`` of one value, copied (a tensor in one ``index_select``)."""
    if is_tensor(v):
        import torch

        index = torch.as_tensor(np.asarray(indices, dtype=np.int64).reshape(-1))
        return v.index_select(0, index.to(v.device))
    if isinstance(v, np.ndarray):
        return v[np.asarray(indices, dtype=np.int64)]
    if is_packed(v):
        return v.slice(list(indices))
    if isinstance(v, list):
        return [v[i] for i in indices]
    raise TypeError(f"Unsupported type {type(v)} for index selection in BatchedDataDict (key {key!r})")


def select_all(batch: Mapping[str, Any], indices: Sequence[int]) -> Dict[str, Any]:
    return {k: select(k, v, indices) for k, v in batch.items()}


def batch_size(batch: Mapping[str, Any], name: str = "batch") -> int:
    sizes = {k: rows(v) for k, v in batch.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"{name} values must share dimension 0, got sizes {sizes}")
    return next(iter(sizes.values()))


def mask_lengths(batch: Mapping[str, Any], name: str = "batch") -> np.ndarray:
    """Real tokens per row: ``attention_mask.sum(-1)`` of a ``[B, S]`` mask."""
    if "attention_mask" not in batch:
        raise ValueError(f"{name} needs an 'attention_mask' [B, S] (1 on real tokens)")
    mask = batch["attention_mask"]
    if is_tensor(mask):
        mask = mask.detach().cpu().numpy()
    mask = np.asarray(mask)
    if mask.ndim != 2:
        raise ValueError(f"{name}['attention_mask'] must be [B, S], got shape {mask.shape}")
    return (mask != 0).sum(axis=1).astype(np.int64)
