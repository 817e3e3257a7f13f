"""The packed THD micro-batches of a :class:`~seqpack.BatchedDataDict` global batch
(``make_packed_microbatch_iterator``): each bin's rows packed with the tensor engine
(:class:`~seqpack.PackedBatch`), or, for a batch of a hybrid-CP step plan, each CP
rank's :class:`~seqpack.HybridCpBatch` (:mod:`._bdd_hybrid_cp`).

Importing this module does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, Mapping, Optional, Sequence

import numpy as np

from ._bdd_hybrid_cp import hybrid_iterator
from ._batch import is_tensor as _is_tensor
from ._bdd_values import _check, _lengths, _positive
from ..tensors.layout import alignment, round_up

if TYPE_CHECKING:  # pragma: no cover
    from .batched_data_dict import BatchedDataDict

__all__ = []


def packed_iterator(data: "BatchedDataDict", keys: Optional[Sequence[str]], *, input_lengths_key: str,
                    pad_multiple: Optional[int], cp_size: int, cp_rank: int, tp_size: int, sequence_parallel: bool,
                    pp_size: int, pad_values: Optional[Mapping[str, Any]], group: Any, forest: Any,
                    shard_cls: type) -> Iterator[Any]:
    """What ``data.make_packed_microbatch_iterator(...)`` yields (its docstring)."""
    from ..tensors.thd import pack_sequences

    if data.hybrid_cp is not None:
        _check(pad_multiple is None and tp_size == 1 and pp_size == 1 and not sequence_parallel,
               "a hybrid-CP micro-batch pads as the plan counted: pad_multiple, tp_size, sequence_parallel and "
               "pp_size do not apply")
        return hybrid_iterator(data, keys, cp_size=cp_size, cp_rank=cp_rank, input_lengths_key=input_lengths_key,
                               pad_values=pad_values, group=group, forest=forest, shard_cls=shard_cls)

    indices, _ = data._one_plan()
    multiple = alignment(cp_size=cp_size, tp_size=tp_size, sequence_parallel=sequence_parallel) \
        if pad_multiple is None else _positive(pad_multiple, "pad_multiple")
    pp_size = _positive(pp_size, "pp_size")
    lens = _lengths(data.data, input_lengths_key)
    if keys is None:
        keys = [k for k, v in data.data.items() if _is_tensor(v) and v.dim() >= 2]
    _check(len(keys) > 0, "no [B, S, ...] tensor to pack (give keys=)")
    padded = round_up(lens, multiple)
    pad_to = None
    if pp_size > 1:
        pad_to = max(int(padded[s:e].sum()) for s, e in indices) or None
    static = data.micro_batch_static_lengths[0] if data.micro_batch_static_lengths is not None else None
    if static is not None:  # a step plan's static shapes: each micro-batch to its bucket
        _check(pp_size == 1 or len(set(static)) == 1, "static shapes with pp_size > 1 need one bucket size for "
               "every micro-batch (the pipeline's buffer)")
        over = [k for k, (s, e) in enumerate(indices) if int(padded[s:e].sum()) > static[k]]
        if over:
            k = over[0]
            _check(False, f"micro-batch {k} packs to {int(padded[indices[k][0]:indices[k][1]].sum())} tokens after "
                   f"padding each sequence to a multiple of {multiple}, more than its static shape ({static[k]}): "
                   "plan on the padded lengths")

    def gen():
        for k, (start, end) in enumerate(indices):
            if end > start:
                mb, mb_lens = {k: data.data[k][start:end] for k in keys}, lens[start:end]
            else:  # a dummy: one token, zero loss masks
                dummy = data.dummy_microbatch(input_lengths_key)
                mb, mb_lens = {k: dummy[k] for k in keys}, np.ones(1, dtype=np.int64)
            yield pack_sequences(mb, seq_lens=mb_lens, pad_multiple=multiple, pad_values=pad_values,
                                 pad_packed_to=pad_to if static is None else static[k], cp_size=cp_size,
                                 cp_rank=cp_rank)

    return gen()
