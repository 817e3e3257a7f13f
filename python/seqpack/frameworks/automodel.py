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

from .. import _core
from .._memory import fresh_array
from .._lengths import as_int, as_int64, as_positive_int, host_array, type_name
from ..tensors.dataset import loss_mask_zeros

__all__ = ["pack_dataset", "packed_sequence_thd_collater", "CROSS_ENTROPY_IGNORE_IDX"]

logger = logging.getLogger(__name__)

CROSS_ENTROPY_IGNORE_IDX = -100
_OUT = ("input_ids", "labels", "position_ids", "seq_lens", "seq_lens_padded")
_READ = ("input_ids", "labels", "loss_mask")
_QUIET = ("___PAD_TOKEN_IDS___",)  # AutoModel's per-row pad-id metadata: not token data
_INT32 = np.iinfo(np.int32)
_LABELS = ("row {row}: labels has {labels} tokens, input_ids {n} (or labels is None); AutoModel's pack_dataset "
           "would pair the labels with the wrong tokens from there on")
_MASK = ("row {row}: loss_mask is not as long as input_ids ({n} tokens); AutoModel's pack_dataset would mask the "
         "wrong labels or fail (IndexError)")
_VALUES = ("row {row}: {name} include a null, non-integral or out-of-int64 value; AutoModel's pack_dataset fails on "
           "it or truncates it")
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
    listed = _ListRows.of(dataset, datasets) if limit is None and not isinstance(dataset, datasets.Dataset) else None
    if isinstance(dataset, datasets.Dataset) or listed is not None:
        rows = _ArrowRows(dataset) if listed is None else listed
        docs, offsets = rule.plan_arrays(rows)
    else:
        rows = _StreamRows()
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

    def plan_arrays(self, rows: "_ArrowRows") -> Tuple[np.ndarray, np.ndarray]:
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

    def plan_stream(self, dataset: Iterable[Any], rows: "_StreamRows") -> Tuple[np.ndarray, np.ndarray]:
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


class _ArrowRows:
    """A ``datasets.Dataset``'s ``input_ids`` / ``labels`` / ``loss_mask`` columns as
    NumPy buffers and offsets, rows in the dataset's order (its indices mapping)."""

    def __init__(self, dataset: Any):
        import pyarrow as pa

        fmt = dataset.format
        visible = list(dataset.column_names)
        if fmt.get("columns") is not None and not fmt.get("output_all_columns"):
            visible = [c for c in visible if c in fmt["columns"]]
        self.visible = visible
        self.num_rows = len(dataset)
        order = dataset._indices  # a shuffle / select: rows are read through it
        self.order = None if order is None else order.column(0).to_numpy().astype(np.int64)
        self.columns: Dict[str, _Column] = {}
        self.unreadable = None
        if self.num_rows:  # (AutoModel reads no row of an empty dataset)
            for name in _READ:
                if name in visible:
                    self.columns[name] = _Column(dataset.data.column(name), name, pa)
            for name in ("input_ids", "labels"):
                if name not in self.columns:
                    raise KeyError(f"'{name}': the dataset has no '{name}' column (its columns: {visible}); "
                                   f"AutoModel's pack_dataset reads input_ids and already-shifted labels")
            ids = self.columns["input_ids"]
            if ids.valid is not None:
                self.unreadable = self._rows(~ids.valid)
            self.lengths = self._rows(ids.lengths)
        else:
            self.lengths = np.zeros(0, np.int64)
        self.attention = dataset.data.column("attention_mask") if "attention_mask" in visible else None

    def _rows(self, per_physical_row: np.ndarray) -> np.ndarray:
        return per_physical_row if self.order is None else per_physical_row[self.order]

    def physical(self, rows: np.ndarray) -> np.ndarray:
        return rows if self.order is None else self.order[rows]

    def unreadable_error(self, row: int) -> TypeError:
        return TypeError(f"row {row}: input_ids is None (a null row); AutoModel's pack_dataset fails on it")

    def check_placed(self, rows: np.ndarray) -> None:
        """The rows that go into packs hold labels and a loss_mask of their length and
        integer tokens (else a ValueError naming the first such row)."""
        if not len(rows):
            return
        phys, n = self.physical(rows), self.lengths[rows]
        ids, labels, mask = self.columns["input_ids"], self.columns["labels"], self.columns.get("loss_mask")
        checks = [(_invalid(labels.valid, phys) | (labels.lengths[phys] != n), _LABELS)]
        checks += [(c.bad_rows[phys], _VALUES.replace("{name}", name)) for name, c in (("input_ids", ids),
                                                                                        ("labels", labels))
                   if c.bad_rows is not None]
        if mask is not None:
            checks.append(((mask.lengths[phys] > 0) & ~_invalid(mask.valid, phys) & (mask.lengths[phys] != n), _MASK))
        found = [(int(np.argmax(flags)), message) for flags, message in checks if flags.any()]
        if found:
            at, message = min(found, key=lambda f: f[0])
            raise ValueError(message.format(row=int(rows[at]), n=int(n[at]), labels=int(labels.lengths[phys[at]])))

    def sources(self, docs: np.ndarray):
        """(values, each doc's start) of input_ids and labels, and (zero flags, starts,
        applied) of the loss_mask or None."""
        phys = self.physical(docs)
        ids, labels = self.columns["input_ids"], self.columns["labels"]
        mask = self.columns.get("loss_mask")
        zero = None
        if mask is not None:
            applied = (mask.lengths[phys] > 0) & ~_invalid(mask.valid, phys)
            zero = (mask.zero, mask.starts[phys], applied)
        return (ids.values, ids.starts[phys]), (labels.values, labels.starts[phys]), zero

    def unused_columns(self) -> List[str]:
        unused = [c for c in self.visible if c not in _READ and c not in _QUIET]
        if "attention_mask" in unused and _all_ones(self.attention):
            unused.remove("attention_mask")
        return unused


class _ListRows(_ArrowRows):
    """A list (or tuple) of dict rows read as Arrow columns: each of ``input_ids`` /
    ``labels`` / ``loss_mask`` read in one C++ pass over the Python ints
    (``_core.int_lists``; other values through ``pyarrow.array``), no Python loop
    per token, then packed as a ``datasets.Dataset`` is. Only rows
    :meth:`of` can read whole - every row a dict with ``input_ids`` and ``labels``,
    values Arrow reads as numbers - take this path; the others are read row by row
    (:class:`_StreamRows`), whose errors are AutoModel's order of reading."""

    @classmethod
    def of(cls, dataset: Any, datasets: Any) -> Optional["_ListRows"]:
        if not isinstance(dataset, (list, tuple)) or not dataset:
            return None
        if not all(isinstance(r, Mapping) and r.get("input_ids") is not None and r.get("labels") is not None
                   for r in dataset):
            return None  # read row by row: AutoModel's error at AutoModel's row
        import pyarrow as pa
        from datasets.table import InMemoryTable

        columns = {}
        try:
            for name in _READ:
                if name == "loss_mask" and not any("loss_mask" in r for r in dataset):
                    continue
                values = [r.get(name) for r in dataset]
                if name == "loss_mask":  # None or missing: not applied, as an empty mask
                    values = [() if v is None else v for v in values]
                offsets, flat, bad = _core.int_lists(values)  # Python ints read in C++
                column = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(flat)) if bad < 0 else \
                    pa.array(values)  # other values (floats, arrays, ...): Arrow's conversion
                kind = column.type
                if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not (
                        pa.types.is_integer(kind.value_type) or pa.types.is_floating(kind.value_type)
                        or pa.types.is_boolean(kind.value_type) or pa.types.is_null(kind.value_type)):
                    return None
                columns[name] = column
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            return None
        # (a fingerprint given: datasets would hash every value of the table)
        return cls(datasets.Dataset(InMemoryTable(pa.table(columns)), fingerprint="seqpack-list-rows"), dataset)

    def __init__(self, dataset: Any, rows: Any):
        super().__init__(dataset)
        self.source, self.placed = rows, np.zeros(0, np.int64)

    def check_placed(self, rows: np.ndarray) -> None:
        super().check_placed(rows)
        self.placed = rows

    def unused_columns(self) -> List[str]:
        """The keys of the placed rows that are not packed, as :class:`_StreamRows`
        names them (an all-ones ``attention_mask`` quietly)."""
        unused: Dict[str, None] = {}
        for i in self.placed.tolist():
            for key, value in self.source[i].items():
                if key not in _READ and key not in _QUIET and key not in unused:
                    if key == "attention_mask" and _ones(value):
                        continue
                    unused[key] = None
        return list(unused)


class _Column:
    """One list column: its values (int64, or the zero flags of a loss_mask), each
    physical row's start and length, the null rows and rows with unusable values."""

    def __init__(self, chunked: Any, name: str, pa: Any):
        array = chunked.combine_chunks() if chunked.num_chunks != 1 else chunked.chunk(0)
        kind = array.type
        if pa.types.is_fixed_size_list(kind):
            width = kind.list_size
            values = array.flatten()
            self.starts = np.arange(len(array), dtype=np.int64) * width
            self.lengths = np.full(len(array), width, np.int64)
        elif pa.types.is_list(kind) or pa.types.is_large_list(kind):
            offsets = np.asarray(array.offsets).astype(np.int64)
            values = array.values
            self.starts, self.lengths = offsets[:-1], np.diff(offsets)
        else:
            raise TypeError(f"column '{name}' is {kind}; AutoModel's pack_dataset reads lists of token ids")
        self.valid = None if array.null_count == 0 else array.is_valid().to_numpy(zero_copy_only=False)
        self.lengths = self.lengths if self.valid is None else np.where(self.valid, self.lengths, 0)
        numbers, bad = _numbers(values, name, pa)
        if name == "loss_mask":  # AutoModel masks where the value == 0 (a null value is not 0)
            zero = numbers == 0
            self.zero = (zero if bad is None else zero & ~bad).view(np.uint8)
            bad = None
        else:
            self.values = numbers
        self.bad_rows = None  # the rows holding an unusable value
        if bad is not None and bad.any() and len(self.starts):
            where = np.flatnonzero(bad)
            rows = np.maximum(np.searchsorted(self.starts, where, side="right") - 1, 0)
            inside = (where >= self.starts[rows]) & (where < self.starts[rows] + self.lengths[rows])
            self.bad_rows = np.bincount(rows[inside], minlength=len(self.starts)) > 0


def _numbers(values: Any, name: str, pa: Any) -> Tuple[np.ndarray, Optional[np.ndarray]]:
    """A list column's values as int64 (a loss_mask's as they are) and the values no
    token can be (null, non-integral, out of int64), or None when there are none."""
    kind = values.type
    bad = None
    if pa.types.is_null(kind):  # lists of None only (or empty lists only)
        return np.zeros(len(values), np.int64), (np.ones(len(values), bool) if len(values) else None)
    if values.null_count:
        bad = values.is_null().to_numpy(zero_copy_only=False)
    if pa.types.is_integer(kind) or pa.types.is_boolean(kind):
        array = (values.fill_null(0) if bad is not None else values).to_numpy(zero_copy_only=False)
        if name == "loss_mask":
            return array, bad
        if array.dtype == np.uint64:
            high = array > np.uint64(np.iinfo(np.int64).max)
            bad = high if bad is None else bad | high
        if array.dtype == np.int32 and name == "input_ids":  # (datasets' own type for input_ids)
            return array, bad  # copied as it is: into int32 packs when the padding id fits
        return array.astype(np.int64, copy=False), bad
    if pa.types.is_floating(kind):
        array = values.to_numpy(zero_copy_only=False).astype(np.float64, copy=False)
        if name == "loss_mask":
            return np.nan_to_num(array, nan=1.0), bad
        with np.errstate(invalid="ignore"):
            odd = ~np.isfinite(array) | (array != np.trunc(array)) | (np.abs(array) >= 2.0 ** 63)
        bad = odd if bad is None else bad | odd
        return np.where(odd, 0, array).astype(np.int64), bad if bad.any() else None
    raise TypeError(f"column '{name}' holds {kind} values; AutoModel's pack_dataset reads integer token ids"
                    + (" and a numeric loss_mask" if name == "loss_mask" else ""))


def _invalid(valid: Optional[np.ndarray], phys: np.ndarray) -> np.ndarray:
    return np.zeros(len(phys), bool) if valid is None else ~valid[phys]


def _all_ones(chunked: Any) -> bool:
    import pyarrow.compute as pc

    flat = [] if chunked is None else [chunk.flatten() for chunk in chunked.chunks]
    return chunked is not None and not chunked.null_count and all(
        not f.null_count and (not len(f) or pc.all(pc.equal(f, 1)).as_py()) for f in flat)


def _warn_unused(unused: List[str]) -> None:
    if not unused:
        return
    named = ", ".join(repr(c) for c in unused)
    note = (" ('attention_mask' holds zeros: those padding tokens are packed as real tokens, as AutoModel "
            "packs them; strip the padding before packing)" if "attention_mask" in unused else "")
    warnings.warn(f"seqpack.integrations.automodel.pack_dataset: {named} not carried into the packs, which hold "
                  f"{', '.join(_OUT)} (AutoModel's pack_dataset leaves them out too){note}",
                  UserWarning, stacklevel=3)


class _StreamRows:
    """Rows read one by one (lists, tensors or arrays per field) for :meth:`_Rule.plan_stream`."""

    def __init__(self):
        self.ids: List[np.ndarray] = []
        self.labels: List[np.ndarray] = []
        self.unused: Dict[str, None] = {}

    def read(self, sample: Any, index: int) -> int:
        if not isinstance(sample, Mapping):
            raise TypeError(f"row {index} is a {type_name(sample)}; AutoModel's pack_dataset reads dicts with "
                            f"'input_ids' and 'labels'")
        for name in ("input_ids", "labels"):
            if name not in sample:
                raise KeyError(f"'{name}': row {index} has no '{name}' (its keys: {list(sample)}); AutoModel's "
                               f"pack_dataset reads input_ids and already-shifted labels")
        if not hasattr(sample["input_ids"], "__len__"):
            raise TypeError(f"row {index}: input_ids is {type_name(sample['input_ids'])}, not a list of token ids "
                            f"(AutoModel's pack_dataset fails on it)")
        return len(sample["input_ids"])

    def place(self, sample: Mapping, index: int, length: int) -> None:
        ids = _tokens(sample["input_ids"], index, "input_ids")
        labels = _tokens(sample["labels"], index, "labels")
        if labels.size != length:
            raise ValueError(_LABELS.format(row=index, labels=labels.size, n=length))
        mask = sample.get("loss_mask")
        if mask is not None and len(mask):  # AutoModel applies a loss_mask that is not empty
            zero = loss_mask_zeros(mask, f"row {index}: loss_mask")
            if zero.size != length:
                raise ValueError(_MASK.format(row=index, n=length))
            labels = np.where(zero, CROSS_ENTROPY_IGNORE_IDX, labels)
        for key in sample:
            if key not in _READ and key not in _QUIET and key not in self.unused:
                if key == "attention_mask" and _ones(sample[key]):
                    continue
                self.unused[key] = None
        self.ids.append(ids)
        self.labels.append(labels)

    def placed_count(self) -> int:
        return len(self.ids)

    def finish(self) -> np.ndarray:
        self.lengths = np.array([a.size for a in self.ids], dtype=np.int64)
        self.starts = np.cumsum(self.lengths) - self.lengths
        empty = [np.zeros(0, np.int64)]
        self.ids_values, self.labels_values = (np.concatenate(v + empty) for v in (self.ids, self.labels))
        self.ids = self.labels = []
        return np.arange(len(self.lengths), dtype=np.int64)

    def sources(self, docs: np.ndarray):
        return (self.ids_values, self.starts[docs]), (self.labels_values, self.starts[docs]), None

    def unused_columns(self) -> List[str]:
        return list(self.unused)


def _tokens(value: Any, index: int, name: str) -> np.ndarray:
    if value is None:
        raise ValueError(f"row {index}: {name} is None; AutoModel's pack_dataset fails on it")
    array = host_array(value)
    if array.ndim != 1:
        raise ValueError(f"row {index}: {name} must be a 1-D list of token ids, got shape {array.shape}")
    if array.size == 0:
        return np.zeros(0, np.int64)
    kind = array.dtype.kind
    if kind in "iub" and not (array.dtype == np.uint64 and (array > np.uint64(np.iinfo(np.int64).max)).any()):
        return array.astype(np.int64, copy=False)
    if kind == "f" and np.isfinite(array).all() and (array == np.trunc(array)).all() and (abs(array) < 2.0 ** 63).all():
        return array.astype(np.int64)
    raise ValueError(_VALUES.format(row=index, name=name) + f" ({array.dtype})")


def _ones(value: Any) -> bool:
    try:
        array = host_array(value)
    except (TypeError, ValueError):
        return False
    return array.dtype.kind in "iubf" and bool((array == 1).all())


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
