"""Rows as NeMo AutoModel's ``pack_dataset`` (:mod:`seqpack.frameworks.automodel`)
reads them, from any source it takes: a ``datasets.Dataset`` through its Arrow
buffers (:class:`ArrowRows`), a list of dict rows read as Arrow columns in one C++
pass (:class:`ListRows`), or any iterable of dicts row by row (:class:`StreamRows`). Each reader gives the packer the rows'
lengths and, for the rows placed, their token and label buffers::

    source rows               lengths        sources(docs): (values, each doc's start)
    {"input_ids": [..],       [3, 4, ...]    input_ids  11 12 13 21 22 23 24 ...
     "labels": [..],                         labels      1  2  3  4  5  6  7 ...
     "loss_mask": [..]}                      loss_mask zero flags (0 -> label -100)

and raises, at the row AutoModel would reach first, where AutoModel fails or packs
wrongly (labels or a loss_mask of another length, null or non-integral tokens).
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np

from ... import _core
from ..._lengths import host_array, type_name
from ...tensors.dataset import loss_mask_zeros

__all__ = ["ArrowRows", "CROSS_ENTROPY_IGNORE_IDX", "ListRows", "StreamRows"]

CROSS_ENTROPY_IGNORE_IDX = -100  # the label of a token without loss (AutoModel's constant)
_READ = ("input_ids", "labels", "loss_mask")
_QUIET = ("___PAD_TOKEN_IDS___",)  # AutoModel's per-row pad-id metadata: not token data
_LABELS = ("row {row}: labels has {labels} tokens, input_ids {n} (or labels is None); AutoModel's pack_dataset "
           "would pair the labels with the wrong tokens from there on")
_MASK = ("row {row}: loss_mask is not as long as input_ids ({n} tokens); AutoModel's pack_dataset would mask the "
         "wrong labels or fail (IndexError)")
_VALUES = ("row {row}: {name} include a null, non-integral or out-of-int64 value; AutoModel's pack_dataset fails on "
           "it or truncates it")


class ArrowRows:
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


class ListRows(ArrowRows):
    """A list (or tuple) of dict rows read as Arrow columns: each of ``input_ids`` /
    ``labels`` / ``loss_mask`` read in one C++ pass over the Python ints
    (``_core.int_lists``; other values through ``pyarrow.array``), no Python loop
    per token, then packed as a ``datasets.Dataset`` is. Only rows
    :meth:`of` can read whole - every row a dict with ``input_ids`` and ``labels``,
    values Arrow reads as numbers - take this path; the others are read row by row
    (:class:`StreamRows`), whose errors are AutoModel's order of reading."""

    @classmethod
    def of(cls, dataset: Any, datasets: Any) -> Optional["ListRows"]:
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
        """The keys of the placed rows that are not packed, as :class:`StreamRows`
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


class StreamRows:
    """Rows read one by one (lists, tensors or arrays per field), for the packing rule's
    ``plan_stream`` (:mod:`seqpack.frameworks.automodel`)."""

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
