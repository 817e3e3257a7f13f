"""``BatchedDataDict.from_batches``: batches concatenated along dim 0, NeMo-RL's
padding rules, and its multimodal rule for missing ``PackedTensor`` keys.

    >>> from seqpack.frameworks.nemo_rl.concat import concat_batches
    >>> concat_batches([{"b": [1], "a": [2]}, {"b": [3], "a": [4]}])
    {'a': [2, 4], 'b': [1, 3]}

Importing this module does not import torch (a tensor implies it is imported).
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Sequence

from .._batch import is_packed, is_tensor, rows
from .rows import consistent_row_count

__all__ = ["concat_batches"]


def _padded_cat(present: Sequence[Any], fill: Any) -> Any:
    """Tensors concatenated along dim 0: 1-D as they are, others right-padded along
    dim 1 to the widest with ``fill``."""
    import torch

    if all(v.dim() == 1 for v in present):
        return torch.cat(list(present))
    width = max(v.shape[1] for v in present)
    parts = []
    for v in present:
        if v.shape[1] < width:
            grown = v.new_full((v.shape[0], width, *v.shape[2:]), fill)
            grown[:, : v.shape[1]] = v
            v = grown
        parts.append(v)
    return torch.cat(parts)


def concat_batches(batches: Sequence[Mapping[str, Any]], pad_value_dict: Optional[Dict[str, Any]] = None, *,
                   allow_missing_packed_tensors: bool = False) -> Dict[str, Any]:
    """The batches concatenated along dim 0, keys sorted (see
    ``BatchedDataDict.from_batches``): 1-D tensors concatenated, 2-D and higher
    right-padded along dim 1 with ``pad_value_dict.get(key, 0)``, lists concatenated.

    A key missing from a non-empty batch is a ``KeyError``, except, with
    ``allow_missing_packed_tensors``, a ``PackedTensor`` key, which gets empty rows
    there (``empty_rows_like``). With that flag every batch's values must agree on
    their logical row count; without it a batch's rows are its first value's, as in
    NeMo-RL."""
    out: Dict[str, Any] = {}
    if not batches:
        return out
    pad = pad_value_dict or {}
    if allow_missing_packed_tensors:
        counts = [consistent_row_count(b, f"Source batch {i}") for i, b in enumerate(batches)]
    else:
        counts = [rows(next(iter(b.values()))) if len(b) else 0 for b in batches]
    for key in sorted(set().union(*(b.keys() for b in batches))):
        missing = [i for i, b in enumerate(batches) if key not in b and counts[i] != 0]
        present = [b[key] for b in batches if key in b]
        if missing:
            if not (allow_missing_packed_tensors and present and all(is_packed(p) for p in present)):
                raise KeyError(f"Key {key!r} is missing from non-empty batches {missing}.")
            template = present[0]
            present = [b[key] if key in b else type(template).empty_rows_like(template, counts[i])
                       for i, b in enumerate(batches) if key in b or counts[i]]
        first = present[0]
        if isinstance(first, list):
            out[key] = [x for v in present for x in v]
        elif is_packed(first):
            out[key] = type(first).concat(present)
        elif is_tensor(first):
            out[key] = _padded_cat(present, pad.get(key, 0))
        else:
            raise NotImplementedError(f"Attempted to stack for unsupported type {type(first)} with key {key}. "
                                      "Please provide either a tensor or a list of picklable objects.")
    return out
