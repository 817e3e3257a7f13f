"""NeMo AutoModel's THD dataset packing on Arrow buffers (also ``seqpack.integrations.automodel``).

:func:`pack_dataset` has the signature, defaults and result of AutoModel 0.7's
``nemo_automodel.components.datasets.llm.packed_sequence.pack_dataset``: a
``datasets.Dataset`` with the same columns, Arrow types, rows and values, and the same
errors. Rows go into packs in dataset order; a row that does not fit closes the pack
(seqpack's C++ ``greedy_sequential`` packer, on every row's length at once); the packs
are copied out of the Arrow buffers by seqpack's move engine, never a Python loop per
token. :func:`packed_sequence_thd_collater` is the collate function AutoModel pairs with
it (``qkv_format="thd"``).

A pack of ``packed_sequence_size=12`` tokens from rows of 3 and 4 tokens with
``cp_size=2`` (every row padded to a multiple of ``2 * cp_size = 4``)::

    input_ids     11 12 13  0 | 21 22 23 24 |  0  0  0  0
    labels         1  2  3 -100|  4 -100 6  7 |-100 ...      (loss_mask 0 -> -100)
    position_ids   0  1  2  3 |  0  1  2  3 |  4  5  6  7   (tail continues the last row)
    seq_lens [3, 4]   seq_lens_padded [4, 8]                 (tail joins the last row)

>>> from seqpack.integrations.automodel import pack_dataset
>>> rows = [{"input_ids": [11, 12, 13], "labels": [1, 2, 3]},
...         {"input_ids": [21, 22, 23, 24], "labels": [4, 5, 6, 7], "loss_mask": [1, 0, 1, 1]}]
>>> packs = pack_dataset(rows, split=None, packed_sequence_size=12, cp_size=2)
>>> packs[0]["labels"], packs[0]["seq_lens"], packs[0]["seq_lens_padded"]
([1, 2, 3, -100, 4, -100, 6, 7, -100, -100, -100, -100], [3, 4], [4, 8])

The rows are read (from Arrow buffers, a list of dicts, or any iterable of dicts) by
:mod:`seqpack.frameworks.automodel._rows`; this module holds the packing rule, the
packs built from the rows' buffers, and the collate function.

Where it differs from AutoModel on purpose (a ``ValueError`` where AutoModel fails or
packs wrongly, untouched input rows, a warning naming the columns left out): see
docs/automodel.md.
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

import numpy as np

from ... import _core
from ..._lengths import as_int, as_int64, as_positive_int, type_name
from ..._memory import fresh_array
from ._rows import CROSS_ENTROPY_IGNORE_IDX, ArrowRows, ListRows, StreamRows

__all__ = ["pack_dataset", "packed_sequence_thd_collater", "CROSS_ENTROPY_IGNORE_IDX"]

logger = logging.getLogger(__name__)

_OUT = ("input_ids", "labels", "position_ids", "seq_lens", "seq_lens_padded")
_INT32 = np.iinfo(np.int32)
_NO_PACKS = ("No packs were produced: every sample was longer than packed_sequence_size={} and was dropped "
             "(drop_long_samples=True), or the input dataset was empty. Increase `packed_sequence_size` or provide "
             "samples that fit.")


def pack_dataset(dataset: Any, split: Optional[str], packed_sequence_size: int, max_packs: Optional[int] = None,
                 padding_idx: int = 0, drop_long_samples: bool = True, cp_size: int = 1, *,
                 pad_to_multiple_of: int = 1) -> Any:
    """Pack tokenized rows into fixed-size THD packs, as NeMo AutoModel does.

    Args:
        dataset: a ``datasets.Dataset`` (read through its Arrow buffers), a ``DatasetDict``
            (``split`` is packed), or any iterable of dicts (a list, a torch or streaming
            dataset), read no further than AutoModel reads (``max_packs``). Rows hold
            ``input_ids``, already-shifted ``labels`` and optionally ``loss_mask`` (0: -100).
        split: the ``DatasetDict`` split; ignored for other inputs.
        packed_sequence_size: tokens per pack, padding included.
        max_packs: stop after this many packs (rows after the cut are not read).
        padding_idx: the ``input_ids`` padding token (labels are padded with -100).
        drop_long_samples: skip rows longer than ``packed_sequence_size`` (else raise).
        cp_size / pad_to_multiple_of: every row is padded to a multiple of
            ``lcm(2 * cp_size if cp_size > 1 else 1, pad_to_multiple_of)``.

    Returns:
        A ``datasets.Dataset``, one row per pack: ``input_ids`` (``list<int32>``; int64
        when a value does not fit), ``labels``, ``position_ids`` (restarting at every row,
        continuing through the pack's tail), ``seq_lens``, ``seq_lens_padded`` (the tail
        added to the last row).

    Raises:
        ValueError: "No packs were produced", a row too long with ``drop_long_samples=False``,
            a bad argument, or a row AutoModel would pack wrongly (docs/automodel.md).
        KeyError / TypeError: a row without ``input_ids`` / ``labels``, or not a dict.
    """
    size = as_positive_int(packed_sequence_size, "packed_sequence_size", maximum=int(_INT32.max))
    limit = None if max_packs is None else as_positive_int(max_packs, "max_packs", allow_zero=True)
    pad_id = as_int64(padding_idx, "padding_idx")
    if not isinstance(drop_long_samples, (bool, np.bool_)):
        raise TypeError(f"drop_long_samples must be a bool, got {type_name(drop_long_samples)}")
    cp = as_int(cp_size, "cp_size")
    multiple = as_int(pad_to_multiple_of, "pad_to_multiple_of")
    datasets = _datasets()
    if isinstance(dataset, datasets.DatasetDict):
        if split not in dataset:
            logger.warning(f"Dataset {split} not found. Using entire dataset.")
            if len(dataset):  # AutoModel then reads the split names as rows and fails on the first
                raise TypeError(f"split {split!r} is not in the DatasetDict (its splits: {list(dataset)}); "
                                f"AutoModel's pack_dataset then reads the split names as rows and fails")
            dataset = []
        else:
            dataset = dataset[split]
    if multiple < 1 or size % multiple:
        raise ValueError("packed_sequence_size must be divisible by positive pad_to_multiple_of")
    factor = math.lcm(2 * cp if cp > 1 else 1, multiple)
    rule = _Rule(size, factor, limit, bool(drop_long_samples))
    # A list is read whole, column by column; with max_packs row by row (no row after the cut is read).
    listed = ListRows.of(dataset, datasets) if limit is None and not isinstance(dataset, datasets.Dataset) else None
    if isinstance(dataset, datasets.Dataset) or listed is not None:
        rows = ArrowRows(dataset) if listed is None else listed
        docs, offsets = rule.plan_arrays(rows)
    else:
        rows = StreamRows()
        docs, offsets = rule.plan_stream(dataset, rows)
    docs = docs[:offsets[-1]]
    if rule.dropped:
        logger.info(f"Dataset has {rule.dropped} samples longer than {size}; they were skipped "
                    f"(drop_long_samples=True)")
    logger.info(f"Total number of packs created: {len(offsets) - 1}")
    if len(offsets) == 1:
        raise ValueError(_NO_PACKS.format(size))
    _warn_unused(rows.unused_columns())
    return _build(rows, docs, offsets, rule, pad_id, datasets)


class _Rule:
    """AutoModel's packing rule on row lengths: rows in order, each padded to a
    multiple of ``factor``; a row that does not fit closes the pack; ``max_packs``
    stops reading at the row that would open the next pack."""

    def __init__(self, size: int, factor: int, limit: Optional[int], drop: bool):
        self.size, self.factor, self.limit, self.drop = size, factor, limit, drop
        self.dropped = 0

    def padded(self, lengths):
        return lengths if self.factor == 1 else -(-lengths // self.factor) * self.factor

    def too_long(self, row: int, length: int) -> ValueError:
        return ValueError(f"Dataset sample is too long ({length} > {self.size}). Please increase "
                          f"`packed_sequence_size`. (row {row}; drop_long_samples=True skips such rows)")

    def unpackable(self, row: int, length: int) -> ValueError:
        f, size = self.factor, self.size
        return ValueError(f"row {row} has {length} tokens, padded to {int(self.padded(length))} (a multiple of lcm(2 * "
                          f"cp_size, pad_to_multiple_of) = {f}): more than packed_sequence_size={size}, not a multiple "
                          f"of {f}. AutoModel's pack_dataset fails on such a row (IndexError) or cuts it across "
                          f"packs; use a multiple of {f}, or drop the rows over {size - size % f} tokens")

    def plan_arrays(self, rows: "ArrowRows") -> Tuple[np.ndarray, np.ndarray]:
        """The packs of every row at once: (the rows placed, in order; pack offsets)."""
        lengths, size = rows.lengths, self.size
        over = lengths > size
        bad = (over & ~self.drop) | (~over & (self.padded(lengths) > size))
        if rows.unreadable is not None:
            bad |= rows.unreadable
        first_bad = int(np.argmax(bad)) if bad.any() else len(lengths)
        kept = np.flatnonzero(~over[:first_bad]) if self.drop else np.arange(first_bad, dtype=np.int64)
        self.dropped = first_bad - len(kept)
        padded = self.padded(lengths[kept])
        offsets = _core.pack("greedy_sequential", padded, size, as_arrays=True)[0] if len(kept) else np.zeros(1, int)
        packs = len(offsets) - 1
        if self.limit is not None and packs > self.limit:  # the cut: the row opening pack `limit` is the last read
            self.dropped = int(over[:kept[offsets[self.limit]]].sum()) if self.drop else 0
            rows.check_placed(kept[:offsets[self.limit]])
            return kept[:offsets[self.limit]], offsets[:self.limit + 1]
        rows.check_placed(kept)
        if first_bad < len(lengths):
            row = first_bad
            if rows.unreadable is not None and rows.unreadable[row]:
                raise rows.unreadable_error(row)
            if over[row]:
                raise self.too_long(row, int(lengths[row]))
            if self.limit == 0:  # AutoModel stops after the first row it keeps
                return kept[:0], offsets[:1]
            load = int(padded[offsets[-2]:].sum()) if packs else 0
            if load == 0 or self.limit != packs:  # closing the open pack does not reach max_packs
                raise self.unpackable(row, int(lengths[row]))
            return kept, offsets
        if packs and not padded[offsets[-2]:].any():  # a last pack of empty rows only: AutoModel leaves it out
            return kept[:offsets[-2]], offsets[:-1]
        return kept, offsets

    def plan_stream(self, dataset: Iterable[Any], rows: "StreamRows") -> Tuple[np.ndarray, np.ndarray]:
        """The same rule row by row, reading no row after the cut."""
        size, limit = self.size, self.limit
        try:
            iterator = iter(dataset)
        except TypeError:
            raise TypeError(f"dataset must be a datasets.Dataset, DatasetDict or an iterable of dicts, got "
                            f"{type_name(dataset)}") from None
        starts: List[int] = [0]  # pack offsets into `placed`
        load, closed = 0, 0
        for index, sample in enumerate(iterator):
            length = rows.read(sample, index)
            if length > size:
                if self.drop:
                    self.dropped += 1
                    continue
                raise self.too_long(index, length)
            padded = int(self.padded(length))
            if limit == 0:  # AutoModel stops after the first row it keeps
                break
            if load + padded > size:
                if load == 0:
                    raise self.unpackable(index, length)
                starts.append(rows.placed_count())
                closed += 1
                if closed == limit:
                    break
                if padded > size:
                    raise self.unpackable(index, length)
                load = 0
            rows.place(sample, index, length)
            load += padded
        else:
            if load > 0:
                starts.append(rows.placed_count())
        return rows.finish(), np.asarray(starts, dtype=np.int64)


def _warn_unused(unused: List[str]) -> None:
    if not unused:
        return
    named = ", ".join(repr(c) for c in unused)
    note = (" ('attention_mask' holds zeros: those padding tokens are packed as real tokens, as AutoModel "
            "packs them; strip the padding before packing)" if "attention_mask" in unused else "")
    warnings.warn(f"seqpack.integrations.automodel.pack_dataset: {named} not carried into the packs, which hold "
                  f"{', '.join(_OUT)} (AutoModel's pack_dataset leaves them out too){note}",
                  UserWarning, stacklevel=3)


def _build(rows: Any, docs: np.ndarray, offsets: np.ndarray, rule: _Rule, pad_id: int, datasets: Any) -> Any:
    """The packs as AutoModel's ``Dataset.from_dict`` types them, built from copy and
    fill runs over the source buffers (``list<int32>`` input_ids when every value fits)."""
    import pyarrow as pa
    from datasets.table import InMemoryTable

    size = rule.size
    (ids, ids_starts), (labels, labels_starts), mask = rows.sources(docs)
    lengths = rows.lengths[docs]
    padded = rule.padded(lengths)
    packs = len(offsets) - 1
    pack_of = np.repeat(np.arange(packs, dtype=np.int64), np.diff(offsets))
    end = np.cumsum(padded)
    first = end[offsets[:-1]] - padded[offsets[:-1]]  # padded tokens before each pack's first row
    dst = pack_of * size + (end - padded) - first[pack_of]  # each row's first token in the output
    used = end[offsets[1:] - 1] - first
    seq_lens_padded = padded.copy()
    seq_lens_padded[offsets[1:] - 1] += size - used  # the pack's tail joins its last row
    # Position segments: the rows that hold tokens; the tail continues the last of them.
    live = lengths > 0
    seg_end = dst + padded
    last = np.maximum.reduceat(np.where(live, np.arange(len(docs)), -1), offsets[:-1])
    seg_end[last] = (pack_of[last] + 1) * size

    # Dataset.from_dict stores input_ids as int32 when every value fits, else int64.
    direct = ids.dtype == np.int32 and _INT32.min <= pad_id <= _INT32.max  # int32 rows: int32 packs
    ids = ids if direct else ids.astype(np.int64, copy=False)
    step = max(1, int(_INT32.max) // size)  # packs per Arrow chunk: int32 list offsets
    chunks: Dict[str, List[Any]] = {k: [] for k in _OUT}
    ids_chunks = []
    for lo in range(0, packs, step):
        hi = min(packs, lo + step)
        a, b, base, total = int(offsets[lo]), int(offsets[hi]), lo * size, (hi - lo) * size
        copied = np.flatnonzero(live[a:b]) + a  # the rows with tokens: copied, and position segments
        gaps = np.concatenate([np.stack([dst[a:b] + lengths[a:b], padded[a:b] - lengths[a:b]], 1),
                               np.stack([np.arange(lo, hi) * size + used[lo:hi], size - used[lo:hi]], 1)])
        gaps = (gaps[gaps[:, 1] > 0] - [base, 0]).astype(np.int64)

        def gather(values, starts, fill, which=copied, dtype=np.int64, fills=gaps):
            target = fresh_array(total, dtype)
            runs = np.stack([starts[which], dst[which] - base, lengths[which]], 1).astype(np.int64)
            _core.move_rows(runs, fills, values, 1, target, 1, np.array(fill, dtype).tobytes())
            return target

        input_ids = gather(ids, ids_starts, pad_id, dtype=ids.dtype)
        label_out = gather(labels, labels_starts, CROSS_ENTROPY_IGNORE_IDX)
        if mask is not None:  # AutoModel's rule: a label whose loss_mask is 0 becomes -100
            zero, zero_starts, applied = mask
            masked = copied[applied[copied]]
            fills = _complement(np.stack([dst[masked] - base, lengths[masked]], 1).astype(np.int64), total)
            flags = gather(zero, zero_starts, 0, which=masked, dtype=np.uint8, fills=fills)
            np.putmask(label_out, flags.view(bool), CROSS_ENTROPY_IGNORE_IDX)
        cu = np.concatenate([[0], seg_end[copied] - base]).astype(np.int64)
        positions = fresh_array(total, np.int64)
        plan = _core.thd_plan_for_layout(_core.thd_layout_from_offsets(cu, cu), int(np.diff(cu).max()), 0)
        plan.position_ids_into(positions)
        token_offsets = pa.array(np.arange(hi - lo + 1, dtype=np.int32) * size)
        doc_offsets = pa.array((offsets[lo:hi + 1] - a).astype(np.int32))
        ids_chunks.append((token_offsets, input_ids))
        chunks["labels"].append(pa.ListArray.from_arrays(token_offsets, pa.array(label_out)))
        chunks["position_ids"].append(pa.ListArray.from_arrays(token_offsets, pa.array(positions)))
        chunks["seq_lens"].append(pa.ListArray.from_arrays(doc_offsets, pa.array(lengths[a:b])))
        chunks["seq_lens_padded"].append(pa.ListArray.from_arrays(doc_offsets, pa.array(seq_lens_padded[a:b])))
    narrow = direct or all(v.min() >= _INT32.min and v.max() <= _INT32.max for _, v in ids_chunks)
    for token_offsets, values in ids_chunks:
        values = values.astype(np.int32, copy=False) if narrow else values
        chunks["input_ids"].append(pa.ListArray.from_arrays(token_offsets, pa.array(values)))
    types = dict.fromkeys(_OUT, pa.list_(pa.int64()))
    types["input_ids"] = pa.list_(pa.int32() if narrow else pa.int64())
    table = pa.Table.from_arrays([pa.chunked_array(chunks[k], type=types[k]) for k in _OUT], names=list(_OUT))
    features = datasets.Features.from_arrow_schema(table.schema)
    return datasets.Dataset(InMemoryTable(table), info=datasets.DatasetInfo(features=features),
                            fingerprint=_fingerprint(table, size))


def _complement(runs: np.ndarray, total: int) -> np.ndarray:
    """The (start, length) runs of ``[0, total)`` outside ``runs`` (sorted, disjoint)."""
    starts = np.concatenate([[0], runs[:, 0] + runs[:, 1]])
    out = np.stack([starts, np.concatenate([runs[:, 0], [total]]) - starts], 1).astype(np.int64)
    return out[out[:, 1] > 0]


def _fingerprint(table: Any, size: int) -> str:
    """A hash of the packs' Arrow buffers (AutoModel's Dataset hashes their pickle: slower, another value)."""
    import xxhash  # a dependency of datasets

    h = xxhash.xxh64(f"seqpack.integrations.automodel/{size}/{table.schema}".encode())
    for buffer in (b for column in table.columns for chunk in column.chunks for b in chunk.buffers() if b is not None):
        h.update(memoryview(buffer))
    return h.hexdigest()


def packed_sequence_thd_collater(batch: List[Mapping[str, Any]]) -> Dict[str, Any]:
    """AutoModel's THD collate function for :func:`pack_dataset`'s rows, with its output:
    ``input_ids`` / ``labels`` / ``position_ids`` stacked ``[batch, tokens]``, ``seq_lens`` /
    ``seq_lens_padded`` int64 ``[batch, max_docs]`` padded with -1000, ``qkv_format="thd"``.
    Rows without ``seq_lens`` become one-document packs padded to the longest row (ids
    with ``___PAD_TOKEN_IDS___["input_ids"]`` or 0, labels -100). The rows are not modified.

    >>> out = packed_sequence_thd_collater([{"input_ids": [1, 2, 0], "labels": [2, -100, -100],
    ...     "position_ids": [0, 0, 1], "seq_lens": [1, 1], "seq_lens_padded": [1, 2]}])
    >>> out["input_ids"].tolist(), out["seq_lens_padded"].tolist(), out["qkv_format"]
    ([[1, 2, 0]], [[1, 2]], 'thd')
    """
    import torch

    items = [dict(item) for item in batch]
    if not items:
        return {}
    pad_ids = items[0].get("___PAD_TOKEN_IDS___")
    for item in items:
        item.pop("___PAD_TOKEN_IDS___", None)
    if "seq_lens" not in items[0]:  # unpacked rows: one document each, padded to the longest
        pad = (pad_ids or {}).get("input_ids", 0) or 0
        width = max(len(item["input_ids"]) for item in items)
        for item in items:
            length = len(item["input_ids"])
            mask = item.pop("attention_mask", None)
            item["seq_lens"] = [int(sum(mask)) if mask is not None else length]
            item["seq_lens_padded"] = [width]
            item["position_ids"] = list(range(width))
            if length < width:
                item["input_ids"] = list(item["input_ids"]) + [pad] * (width - length)
                item["labels"] = list(item["labels"]) + [CROSS_ENTROPY_IGNORE_IDX] * (width - length)
    out = {name: torch.stack([torch.as_tensor(item[name]) for item in items])
           for name in ("input_ids", "labels", "position_ids")}
    for name in ("seq_lens", "seq_lens_padded"):
        lists = [[int(v) for v in item[name]] for item in items]
        grid = np.full((len(lists), max(len(v) for v in lists)), -1000, dtype=np.int64)
        for row, values in enumerate(lists):
            grid[row, :len(values)] = values
        out[name] = torch.from_numpy(grid)
    out["qkv_format"] = "thd"
    return out


def _datasets() -> Any:
    try:
        import datasets
    except ImportError as e:  # pragma: no cover - exercised without the extra
        raise ImportError("seqpack.integrations.automodel returns a datasets.Dataset: pip install seqpack[hf]") from e
    return datasets
