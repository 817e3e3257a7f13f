"""Dataset-level packing for SFT: token lists into fixed-size packs, and their collator.

Each example's tokens are padded at the tail to ``pad_multiple`` (``2 * cp_size``
by default, so every sequence splits into context-parallel chunks), the padded
lengths are packed into packs of ``pack_size`` tokens by one of seqpack's packers,
and each pack is filled to exactly ``pack_size``; the extra padding joins the last
sequence, as Megatron-Core's bin padding does::

    pack_size=12, cp_size=2:   [1, 2, 3] -> padded to 4,  [4, 5, 6, 7, 8] -> padded to 8
    input_ids        1    2 3    0 | 4    5 6 7 8    0    0    0
    labels        -100    2 3 -100 | -100 5 6 7 8 -100 -100 -100   (mask_first_label=True)
    position_ids     0    1 2    3 | 0    1 2 3 4    5    6    7
    seq_lens [3, 5], seq_lens_padded [4, 8]

Labels are the model's unshifted targets (the model shifts them): with
``mask_first_label`` every sequence's first label is -100 as well, so no token
is ever trained to predict across a pack boundary. An example's ``loss_mask``
sets its labels to -100 (``label_pad``) where it is 0, as NeMo AutoModel does; an
``attention_mask`` of ones says nothing the packs do not, and any other field is
named in a warning (it is not carried into the packs).

    >>> import seqpack
    >>> packs = seqpack.pack_dataset([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5, 6, 7, 8]}], pack_size=12,
    ...                              cp_size=2, mask_first_label=False)
    >>> packs[0]["input_ids"].tolist(), packs[0]["labels"].tolist()[:4], packs[0]["seq_lens_padded"].tolist()
    ([1, 2, 3, 0, 4, 5, 6, 7, 8, 0, 0, 0], [1, 2, 3, -100], [4, 8])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Mapping, Optional, Sequence

import warnings

import numpy as np

from .._equality import fields_equal
from .._lengths import as_int64, as_positive_int, host_array
from ..planning.packing import get_packer
from .. import _core
from .layout import PackedLayout, alignment, round_up

if TYPE_CHECKING:  # pragma: no cover
    from .thd import PackedBatch

__all__ = ["PackedDataset", "collate_packs", "pack_dataset"]

_ALGORITHMS = ("greedy_sequential", "first_fit_decreasing", "best_fit_decreasing")
_POLICIES = ("error", "drop", "truncate")


@dataclass(eq=False)
class PackedDataset(Sequence):
    """Packs (dicts of int64 NumPy arrays: ``input_ids``, ``labels``,
    ``position_ids`` of ``pack_size`` tokens; ``seq_lens``, ``seq_lens_padded``)
    and what packing did."""

    packs: List[Dict[str, np.ndarray]]
    pack_size: int
    pad_multiple: int
    num_examples: int
    dropped: List[int] = field(default_factory=list)      # indices of examples over pack_size (policy "drop")
    truncated: List[int] = field(default_factory=list)    # indices cut to fit (policy "truncate")
    real_tokens: int = 0

    __eq__ = fields_equal
    __hash__ = None  # mutable

    def __len__(self) -> int:
        return len(self.packs)

    def __getitem__(self, i):
        return self.packs[i]

    @property
    def efficiency(self) -> float:
        """Real tokens / pack tokens."""
        return self.real_tokens / (len(self.packs) * self.pack_size) if self.packs else 0.0

    def __repr__(self) -> str:
        return (f"PackedDataset({len(self.packs)} packs of {self.pack_size} tokens from {self.num_examples} examples, "
                f"efficiency {self.efficiency:.1%}, dropped {len(self.dropped)}, truncated {len(self.truncated)})")


def _tokens(example: Any, index: int, key: str) -> np.ndarray:
    value = example[key] if isinstance(example, Mapping) else (example if key == "input_ids" else None)
    if value is None:
        raise ValueError(f"examples[{index}] has no {key!r}")
    arr = np.asarray(value)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"examples[{index}][{key!r}] must be a 1-D list of token ids, got {arr.dtype} {arr.shape}")
    return arr.astype(np.int64, copy=False)


_KNOWN = ("input_ids", "labels", "loss_mask", "attention_mask")


def loss_mask_zeros(value: Any, what: str) -> np.ndarray:
    """Where a ``loss_mask`` is 0: AutoModel's rule (a label whose mask is 0 gets no loss),
    read from numbers or, element by element, from a list of Python objects (``None`` is
    not 0). Shared by :func:`pack_dataset` and ``seqpack.integrations.automodel``.

    >>> loss_mask_zeros([1, 0, 1], "loss_mask").tolist()
    [False, True, False]
    """
    arr = host_array(value)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be 1-D (0: no loss on that label), got shape {arr.shape}")
    if arr.dtype.kind in "biuf":
        return arr == 0
    if arr.dtype.kind == "O":
        return np.array([v is not None and v == 0 for v in arr.tolist()], dtype=bool)
    raise TypeError(f"{what} holds {arr.dtype} values, not numbers (0: no loss on that label)")


def _loss_mask(example: Mapping, index: int, size: int) -> Optional[np.ndarray]:
    """Where the example's ``loss_mask`` is 0, or None without one."""
    value = example.get("loss_mask")
    if value is None:
        return None
    zero = loss_mask_zeros(value, f"examples[{index}]['loss_mask']")
    if zero.size != size:
        raise ValueError(f"examples[{index}]['loss_mask'] has {zero.size} values, input_ids {size} tokens: it cannot "
                         f"be applied to the labels")
    return zero


def _check_attention_mask(example: Mapping, index: int) -> None:
    value = example.get("attention_mask")
    if value is None:
        return
    arr = host_array(value)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "biuf") or not (arr == 1).all():
        raise ValueError(f"examples[{index}]['attention_mask'] is not all ones: the example holds padding, which "
                         f"would be packed as real tokens; strip the padding (or drop the field) before packing")


def pack_dataset(
    examples: Iterable[Any],
    pack_size: int,
    algorithm: str = "greedy_sequential",
    *,
    cp_size: int = 1,
    pad_multiple: Optional[int] = None,
    padding_idx: int = 0,
    label_pad: int = -100,
    mask_first_label: bool = True,
    too_long: str = "error",
    max_packs: Optional[int] = None,
    progress: Optional[bool] = None,
) -> PackedDataset:
    """Pack token-list examples into packs of exactly ``pack_size`` tokens.

    Args:
        examples: dicts with ``input_ids`` (and optionally ``labels``, default a copy
            of the ids, and ``loss_mask``: labels where it is 0 become ``label_pad``), or
            plain token lists. An ``attention_mask`` must be all ones (packs hold no
            padding of the examples'); other fields are not carried into the packs, and a
            ``UserWarning`` names them.
        pack_size: tokens per pack.
        algorithm: ``"greedy_sequential"`` (dataset order; a sequence that does not
            fit closes the pack), ``"first_fit_decreasing"`` or ``"best_fit_decreasing"``.
        cp_size: context parallelism; sequences are padded to multiples of
            ``2 * cp_size`` unless ``pad_multiple`` is given (it must then be one).
        padding_idx / label_pad: pad values of ``input_ids`` / ``labels``.
        mask_first_label: set every sequence's first label to ``label_pad``.
        too_long: examples whose padded length exceeds ``pack_size``: ``"error"``
            (raise, naming the example), ``"drop"`` (skip, listed in ``.dropped``) or
            ``"truncate"`` (cut to fit, listed in ``.truncated``).
        max_packs: stop after this many packs.
        progress: tqdm progress bar (default: on for more than 100k examples).
    """
    size = as_positive_int(pack_size, "pack_size")
    if size > np.iinfo(np.int32).max:  # each pack's cu_seqlens are int32 (and a pack is allocated whole)
        raise ValueError(f"pack_size must fit the int32 offsets of a pack (<= {np.iinfo(np.int32).max}), got {size}")
    cp = as_positive_int(cp_size, "cp_size")
    multiple = as_positive_int(pad_multiple, "pad_multiple") if pad_multiple is not None else alignment(cp_size=cp)
    if cp > 1 and multiple % (2 * cp):
        raise ValueError(f"pad_multiple ({multiple}) must be a multiple of 2 * cp_size ({2 * cp})")
    if size % multiple:
        raise ValueError(f"pack_size ({size}) must be a multiple of pad_multiple ({multiple})")
    if algorithm not in _ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(_ALGORITHMS)}; got {algorithm!r}")
    if too_long not in _POLICIES:
        raise ValueError(f"too_long must be one of {', '.join(_POLICIES)}; got {too_long!r}")
    if max_packs is not None:
        as_positive_int(max_packs, "max_packs")
    padding_idx, label_pad = as_int64(padding_idx, "padding_idx"), as_int64(label_pad, "label_pad")

    examples = examples if isinstance(examples, Sequence) else list(examples)
    from tqdm.auto import tqdm

    show = progress if progress is not None else len(examples) > 100_000
    ids_list, labels_list, dropped, truncated = [], [], [], []
    kept_index = []
    unused: Dict[str, int] = {}  # fields not carried into the packs -> first example holding them
    for i, ex in enumerate(tqdm(examples, desc="seqpack: reading", disable=not show, unit="ex")):
        ids = _tokens(ex, i, "input_ids")
        labels = _tokens(ex, i, "labels") if isinstance(ex, Mapping) and "labels" in ex else ids.copy()
        if labels.shape != ids.shape:
            raise ValueError(f"examples[{i}]: labels has {labels.size} tokens, input_ids {ids.size}")
        if isinstance(ex, Mapping):
            zero = _loss_mask(ex, i, ids.size)
            if zero is not None:
                labels = np.where(zero, np.int64(label_pad), labels)
            _check_attention_mask(ex, i)
            for key in ex:
                if key not in _KNOWN and key not in unused:
                    unused[key] = i
        if round_up(ids.size, multiple) > size:
            if too_long == "error":
                raise ValueError(f"examples[{i}] has {ids.size} tokens, more than pack_size={size} "
                                 f"(after padding to a multiple of {multiple}); use too_long='drop' or 'truncate'")
            if too_long == "drop":
                dropped.append(i)
                continue
            ids, labels = ids[:size], labels[:size]
            truncated.append(i)
        ids_list.append(ids)
        labels_list.append(labels)
        kept_index.append(i)

    if unused:
        named = ", ".join(f"{key!r} (first in examples[{i}])" for key, i in unused.items())
        warnings.warn(f"seqpack.pack_dataset: {named} not carried into the packs, which hold input_ids, labels "
                      f"(loss_mask applied), position_ids, seq_lens and seq_lens_padded", UserWarning, stacklevel=2)
    padded = [round_up(ids.size, multiple) for ids in ids_list]
    bins = get_packer(algorithm, size).pack(padded) if padded else []
    if max_packs is not None:
        bins = bins[:max_packs]

    packs: List[Dict[str, np.ndarray]] = []
    real = 0
    id_fill, label_fill = np.int64(padding_idx).tobytes(), np.int64(label_pad).tobytes()
    for members in tqdm(bins, desc="seqpack: packing", disable=not show, unit="pack"):
        # Each pack is a PackedLayout whose tail padding joins its last sequence
        # (pad_packed_to), filled through the C++ plan: the rules of every THD batch.
        lens = np.array([ids_list[k].size for k in members], dtype=np.int64)
        layout = PackedLayout.from_lengths(lens, pad_multiple=multiple, pad_packed_to=size)
        width = int(lens.max())
        rows_ids = np.empty((len(members), width), dtype=np.int64)
        rows_labels = np.empty((len(members), width), dtype=np.int64)
        for i, k in enumerate(members):
            rows_ids[i, :lens[i]] = ids_list[k]
            rows_labels[i, :lens[i]] = labels_list[k]
        if mask_first_label and width:
            rows_labels[lens > 0, 0] = label_pad
        plan = _core.thd_plan_for_layout(layout._core_layout, width, 0)
        pack = dict(input_ids=np.empty(size, dtype=np.int64), labels=np.empty(size, dtype=np.int64),
                    position_ids=np.empty(size, dtype=np.int64), seq_lens=layout.seq_lens,
                    seq_lens_padded=layout.padded_lens)
        plan.pack_into(rows_ids, pack["input_ids"], id_fill)
        plan.pack_into(rows_labels, pack["labels"], label_fill)
        plan.position_ids_into(pack["position_ids"])
        packs.append(pack)
        real += int(lens.sum())
    return PackedDataset(packs=packs, pack_size=size, pad_multiple=multiple, num_examples=len(examples),
                         dropped=dropped, truncated=truncated, real_tokens=real)


def collate_packs(packs: Sequence[Mapping[str, Any]], cp_size: int = 1, cp_rank: int = 0) -> "PackedBatch":
    """Concatenate packs into one THD :class:`~seqpack.PackedBatch` for a training step.

    The batch holds ``input_ids`` and ``labels`` (``[T]`` int64, or rank ``cp_rank``'s
    zigzag-local ``[T / cp_size]`` rows), its :class:`~seqpack.PackedLayout` over every
    sequence of every pack (``cu_seqlens`` / ``cu_seqlens_padded`` int32; each pack's
    tail padding belongs to its last sequence), ``position_ids`` and
    ``packed_seq_params()`` / ``flash_attn_kwargs()``; ``unpack`` turns ``[T, ...]``
    rows (e.g. per-token losses) back into ``[num_sequences, max_seqlen, ...]``.

    >>> import seqpack
    >>> packs = seqpack.pack_dataset([[1, 2, 3], [4, 5]], pack_size=8, mask_first_label=False)
    >>> batch = seqpack.collate_packs(packs)
    >>> batch["input_ids"].tolist(), batch.cu_seqlens_padded.tolist(), batch.position_ids.tolist()
    ([1, 2, 3, 4, 5, 0, 0, 0], [0, 3, 8], [0, 1, 2, 0, 1, 2, 3, 4])
    """
    import torch

    from .thd import batch_from_plan

    if not packs:
        raise ValueError("packs must not be empty")
    seq_lens = np.concatenate([np.asarray(p["seq_lens"], dtype=np.int64) for p in packs])
    seq_lens_padded = np.concatenate([np.asarray(p["seq_lens_padded"], dtype=np.int64) for p in packs])
    layout = PackedLayout.from_offsets(np.concatenate([[0], np.cumsum(seq_lens)]),
                                       np.concatenate([[0], np.cumsum(seq_lens_padded)]),
                                       cp_size=cp_size, cp_rank=cp_rank)
    streams = {}
    for key in ("input_ids", "labels"):
        stream = np.concatenate([np.asarray(p[key], dtype=np.int64) for p in packs])
        if stream.size != layout.num_tokens:
            raise ValueError(f"{key}: the packs hold {stream.size} tokens but seq_lens_padded sums to "
                             f"{layout.num_tokens}")
        streams[key] = stream
    # The packs are the full THD already; the plan (for positions, the CP rows and
    # unpacking) reads the sequences from right-padded rows of width max_seqlen.
    plan = _core.thd_plan_for_layout(layout._core_layout, layout.max_seqlen, layout.cp_rank)
    batch = batch_from_plan(plan, layout, torch.device("cpu"))
    rows = None if layout.cp_size == 1 else _core.cp_partition_indices(layout.cu_seqlens_padded, layout.cp_size,
                                                                       layout.cp_rank)
    for key, stream in streams.items():
        batch.tensors[key] = torch.from_numpy(stream if rows is None else stream[rows])
    return batch
