"""``make_packed_microbatch_iterator``: a global batch's planned micro-batches ready
for the model, as a function of its :class:`~.shard.ShardRecord`.

=====================  ====================================================================
shard planned as       yields
=====================  ====================================================================
rows                   each micro-batch's ``[rows, S, ...]`` tensors packed to THD
                       (:class:`~seqpack.PackedBatch`): sequences padded to ``pad_multiple``,
                       CP rank ``cp_rank``'s zigzag part, PP and static-shape padding
prefix trees           the planned trees (:class:`~.trees.TreeMicroBatch`); the row-packing
                       options do not apply and are refused by name
a CP step plan         CP rank ``cp_rank``'s :class:`~seqpack.HybridCpBatch` micro-batches
                       (:mod:`.cp_iterator`), parts as trees when the plan has a forest
=====================  ====================================================================

A step plan's shard carries its CP size and forest: ``cp_size`` and ``forest`` may be
left out, and a value other than the plan's is refused.

    >>> import torch
    >>> from seqpack.frameworks.nemo_rl.packed import packed_micro_batches
    >>> from seqpack.frameworks.nemo_rl.shard import ShardRecord
    >>> shard = ShardRecord({"input_ids": torch.ones(3, 4, dtype=torch.long), "input_lengths": torch.tensor([4, 2, 3])},
    ...                     micro_batch_indices=[[[0, 2], [2, 3]]], micro_batch_lengths=[[6, 3]])
    >>> [int(mb.cu_seqlens[-1]) for mb in packed_micro_batches(shard, wrap=dict)]
    [6, 3]

Importing this module does not import torch.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import numpy as np

from ..._lengths import as_int
from ...tensors.layout import alignment, round_up
from .cp_iterator import cp_micro_batches
from .errors import check, positive
from .iterators import packable, tree_plan
from .rows import dummy, lengths, tensor_keys
from .shard import ShardRecord, one_plan

__all__ = ["packed_micro_batches"]


def _cp_size(shard: ShardRecord, cp_size: Any) -> int:
    """The CP size to pack for: a step plan's own (a different one is refused), else
    the given one (default 1)."""
    step = shard.step_shard
    if cp_size is not None:
        cp_size = positive(cp_size, "cp_size")
    if step is None:
        return 1 if cp_size is None else cp_size
    planned = step.plan.cp_size
    replan = "" if planned > 1 else f", or plan with plan_step(..., cp_size={cp_size})"
    check(cp_size is None or cp_size == planned, f"cp_size={cp_size} contradicts the shard's step plan, made with "
                                                 f"cp_size={planned}: leave cp_size out (the shard carries it){replan}")
    return planned


def _check_forest(shard: ShardRecord, forest: Any) -> None:
    """``forest=`` may only repeat the step plan's own forest."""
    if forest is None:
        return
    step = shard.step_shard
    check(step is not None, "forest= applies to a shard of a step plan made on that forest, and the plan carries "
                            "it: leave forest out")
    planned = step.plan.forest
    check(planned is not None and (forest is planned or forest == planned),
          "forest= contradicts the shard's step plan, made " + ("without a PrefixForest" if planned is None else
                                                               "on another PrefixForest") + ": leave forest out")


def packed_micro_batches(shard: ShardRecord, keys: Optional[Sequence[str]] = None, *,
                         input_lengths_key: str = "input_lengths", pad_multiple: Optional[int] = None,
                         cp_size: Optional[int] = None, cp_rank: int = 0, tp_size: int = 1,
                         sequence_parallel: bool = False, pp_size: int = 1,
                         pad_values: Optional[Mapping[str, Any]] = None, group: Any = None, forest: Any = None,
                         wrap: Callable[[dict], Any]) -> Iterator[Any]:
    """What ``make_packed_microbatch_iterator`` yields (the module's table); ``wrap``
    turns a micro-batch's rows into the caller's mapping type."""
    cp_size = _cp_size(shard, cp_size)
    _check_forest(shard, forest)
    cp_rank = as_int(cp_rank, "cp_rank")
    if shard.cp_plan:
        check(pad_multiple is None and tp_size == 1 and pp_size == 1 and not sequence_parallel,
              "a CP step plan's micro-batch pads as the plan counted: pad_multiple, tp_size, sequence_parallel and "
              "pp_size do not apply")
        return cp_micro_batches(shard, keys, cp_rank=cp_rank, input_lengths_key=input_lengths_key,
                                pad_values=pad_values, group=group, wrap=wrap)
    if tree_plan(shard):
        row_options = {"keys": keys is not None, "pad_multiple": pad_multiple is not None, "cp_size": cp_size != 1,
                       "cp_rank": cp_rank != 0, "tp_size": tp_size != 1, "sequence_parallel": bool(sequence_parallel),
                       "pp_size": pp_size != 1, "pad_values": pad_values is not None}
        named = [name for name, given in row_options.items() if given]
        check(not named, f"make_packed_microbatch_iterator: this shard's micro-batches are the plan's prefix trees, "
                         f"which it yields as they are; {named} pack rows and do not apply to a tree (pad a tree with "
                         "make_microbatch_iterator_for_packable_sequences(pad_to_multiple_of=...))")
        keys_given = {} if input_lengths_key == "input_lengths" else {"input_lengths_key": input_lengths_key}
        return packable(shard, None, keys_given, wrap)
    return _packed_rows(shard, keys, input_lengths_key, pad_multiple, cp_size, cp_rank, tp_size, sequence_parallel,
                        pp_size, pad_values)


def _packed_rows(shard: ShardRecord, keys: Optional[Sequence[str]], input_lengths_key: str,
                 pad_multiple: Optional[int], cp_size: int, cp_rank: int, tp_size: int, sequence_parallel: bool,
                 pp_size: int, pad_values: Optional[Mapping[str, Any]]) -> Iterator[Any]:
    """Each row micro-batch packed to THD (a dummy as one token with zero loss
    masks), padded to its static shape when the plan has them."""
    from ...tensors.thd import pack_sequences

    indices, _ = one_plan(shard)
    multiple = alignment(cp_size=cp_size, tp_size=tp_size, sequence_parallel=sequence_parallel) \
        if pad_multiple is None else positive(pad_multiple, "pad_multiple")
    pp_size = positive(pp_size, "pp_size")
    lens = lengths(shard.data, input_lengths_key)
    keys = tensor_keys(shard.data) if keys is None else list(keys)
    check(len(keys) > 0, "no [B, S, ...] tensor to pack (give keys=)")
    padded = round_up(lens, multiple)
    pad_to = None
    if pp_size > 1:
        pad_to = max(int(padded[s:e].sum()) for s, e in indices) or None
    static = shard.micro_batch_static_lengths[0] if shard.micro_batch_static_lengths is not None else None
    if static is not None:  # a step plan's static shapes: each micro-batch to its bucket
        check(pp_size == 1 or len(set(static)) == 1, "static shapes with pp_size > 1 need one bucket size for "
              "every micro-batch (the pipeline's buffer)")
    cap = shard.micro_batch_token_cap
    for k, (s, e) in enumerate(indices):  # nothing packed passes what it was planned under
        limit, what = (static[k], "its static shape") if static is not None else (cap, "the shard's token cap")
        tokens = int(padded[s:e].sum())
        check(limit is None or tokens <= limit, f"micro-batch {k} packs to {tokens} tokens after padding each "
              f"sequence to a multiple of {multiple}, more than {what} ({limit}): plan on the padded lengths")

    def gen():
        for k, (start, end) in enumerate(indices):
            if end > start:
                mb, mb_lens = {key: shard.data[key][start:end] for key in keys}, lens[start:end]
            else:  # a dummy: one token, zero loss masks
                row = dummy(shard.data, input_lengths_key)
                mb, mb_lens = {key: row[key] for key in keys}, np.ones(1, dtype=np.int64)
            yield pack_sequences(mb, seq_lens=mb_lens, pad_multiple=multiple, pad_values=pad_values,
                                 pad_packed_to=pad_to if static is None else static[k], cp_size=cp_size,
                                 cp_rank=cp_rank)

    return gen()
