"""HF TRL's ``pack_dataset`` on Arrow buffers (also ``seqpack.integrations.trl``).

:func:`pack_dataset` has the signature, strategies, output columns and packs of
``trl.data_utils.pack_dataset``: the same rows in the same packs in the same
order. TRL packs each ``datasets.map`` batch (1,000 rows unless ``map_kwargs``
says otherwise) with a Python loop per row; here every batch is packed in one C++
call (best fit decreasing with TRL's tie-breaks, the GIL released) and the packed
columns are built with Arrow kernels (``list_slice``, ``take``) and new list
offsets, never a Python loop per row.

>>> import pyarrow as pa
>>> from seqpack.integrations.trl import pack_dataset
>>> table = pa.table({"input_ids": [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10], [11]]})
>>> pack_dataset(table, seq_length=4).to_pydict()
{'input_ids': [[1, 2, 3, 4], [8, 9, 10, 11], [6, 7]], 'seq_lengths': [[4], [3, 1], [2]]}

Strategies: ``"bfd"`` (truncate sequences to ``seq_length``), ``"bfd_split"``
(split them into ``seq_length`` fragments, the last one shorter), ``"wrapped"``
(concatenate and cut every ``seq_length`` tokens), as TRL; and ``"bfd_global"``
/ ``"bfd_split_global"``, the same rules over the whole dataset at once instead of
batch by batch: fewer, fuller packs (not TRL's packs).

Needs ``pyarrow`` (and ``datasets`` for ``Dataset`` / ``DatasetDict`` inputs):
``pip install seqpack[hf]``.
"""

from __future__ import annotations

import mmap
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .. import _core
from .._lengths import as_positive_int

__all__ = ["pack_dataset", "STRATEGIES"]

STRATEGIES = ("bfd", "bfd_split", "wrapped", "bfd_global", "bfd_split_global")
_DEFAULT_MAP_BATCH = 1000  # datasets.Dataset.map's default batch_size, which TRL packs by
_MAX_CHUNK_VALUES = 1 << 30  # values per output chunk: list<...> offsets are int32


def pack_dataset(dataset: Any, seq_length: int, strategy: str = "bfd",
                 map_kwargs: Optional[Dict[str, Any]] = None, *, progress: Optional[bool] = None) -> Any:
    """Pack the list columns of ``dataset`` into rows of at most ``seq_length`` tokens.

    Args:
        dataset: a ``datasets.Dataset``, ``datasets.DatasetDict`` (each split packed)
            or ``pyarrow.Table``. Every column must be a list column whose rows have
            the same lengths as the first column's (``input_ids``, ``attention_mask``,
            ...), as TRL requires.
        seq_length: tokens per packed row.
        strategy: one of :data:`STRATEGIES` (see the module docstring).
        map_kwargs: TRL's ``map`` arguments; ``batch_size`` (default 1,000; ``None``:
            the whole dataset) sets the batches packed apart, exactly as TRL's
            ``Dataset.map`` does. Other keys (``num_proc``, ``desc``, ...) do not
            change the packs and are ignored. A ``pyarrow.Table`` is packed as one
            batch unless ``batch_size`` is given.
        progress: a tqdm bar over the output chunks (default: for more than 1M rows).

    Returns:
        The same kind of object: packed list columns plus ``seq_lengths`` (the
        lengths of the sequences in each packed row) for the ``bfd`` strategies. A
        ``Dataset`` keeps its format (``seq_lengths`` added to its columns).

    Raises:
        ValueError: an unknown strategy, ``seq_length`` below 1, a non-list column or
            columns whose rows differ in length.
        ImportError: ``pyarrow`` (or ``datasets`` for a Dataset) is not installed.
    """
    pa, _ = _arrow()
    seq_length = as_positive_int(seq_length, "seq_length")
    if strategy not in STRATEGIES:
        raise ValueError(f"Invalid packing strategy '{strategy}', must be one of {STRATEGIES}.")
    map_kwargs = dict(map_kwargs or {})
    if isinstance(dataset, pa.Table):
        batch = map_kwargs.get("batch_size")
        return _pack_table(dataset, seq_length, strategy, batch, progress)
    datasets = _datasets()
    if isinstance(dataset, datasets.DatasetDict):
        return datasets.DatasetDict({name: pack_dataset(split, seq_length, strategy, map_kwargs, progress=progress)
                                     for name, split in dataset.items()})
    if not isinstance(dataset, datasets.Dataset):
        raise TypeError(f"dataset must be a datasets.Dataset, datasets.DatasetDict or pyarrow.Table, "
                        f"got {type(dataset).__name__}")
    batch = map_kwargs.get("batch_size", _DEFAULT_MAP_BATCH)
    fmt = dataset.format
    table = dataset.with_format("arrow")[:]  # the rows in order (indices mappings applied)
    packed = _pack_table(table, seq_length, strategy, batch, progress)
    from datasets.fingerprint import Hasher
    from datasets.table import InMemoryTable

    # A fingerprint from the source's and the arguments (datasets would hash every value).
    fingerprint = Hasher.hash((dataset._fingerprint, seq_length, strategy, batch))
    out = datasets.Dataset(InMemoryTable(packed), split=dataset.split, fingerprint=fingerprint)
    columns = fmt.get("columns")
    if columns is not None and strategy != "wrapped":
        columns = list(columns) + ["seq_lengths"]
    return out.with_format(type=fmt.get("type"), columns=columns, output_all_columns=fmt.get("output_all_columns", False),
                           **fmt.get("format_kwargs", {}))


def _arrow() -> Tuple[Any, Any]:
    try:
        import pyarrow as pa
        import pyarrow.compute as pc
    except ImportError as e:  # pragma: no cover - exercised without the extra
        raise ImportError("seqpack.integrations.trl needs pyarrow: pip install seqpack[hf]") from e
    return pa, pc


def _datasets() -> Any:
    try:
        import datasets
    except ImportError as e:  # pragma: no cover
        raise ImportError("packing a datasets.Dataset needs the datasets package: pip install seqpack[hf]") from e
    return datasets


def _list_columns(table) -> Tuple[List[Any], np.ndarray]:
    """Every column as one list array (chunks combined) and the row offsets into
    their values (``flatten()``), checked as TRL checks them: list columns whose rows
    all have the first column's lengths."""
    pa, _ = _arrow()
    columns, offsets = [], None
    for name, column in zip(table.column_names, table.columns):
        if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)):
            raise ValueError(f"column '{name}' is {column.type}; every column to pack must be a list column")
        if isinstance(column, pa.ChunkedArray):  # one chunk: itself; several: concatenated (a copy)
            column = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
        own = np.asarray(column.offsets).astype(np.int64)
        own -= own[0]
        if offsets is not None and not np.array_equal(own, offsets):
            raise ValueError(f"column '{name}': all columns must have values of the same length "
                             f"(rows of '{table.column_names[0]}' differ)")
        columns.append(column)
        offsets = own if offsets is None else offsets
    return columns, offsets


def _batch_bounds(num_rows: int, batch: Optional[int]) -> np.ndarray:
    if batch is None or batch <= 0 or batch >= num_rows:
        return np.array([0, num_rows], dtype=np.int64)
    return np.append(np.arange(0, num_rows, batch, dtype=np.int64), num_rows)


def _pack_table(table, seq_length: int, strategy: str, batch: Optional[int], progress: Optional[bool]):
    pa, _ = _arrow()
    if table.num_columns == 0 or table.num_rows == 0:
        return table
    columns, row_offsets = _list_columns(table)
    names = list(table.column_names)
    if strategy.endswith("_global"):
        batch, strategy = None, strategy[: -len("_global")]
    elif batch is not None:
        batch = as_positive_int(batch, "map_kwargs['batch_size']")
    bounds = _batch_bounds(table.num_rows, batch)
    if strategy == "wrapped":
        return _pack_wrapped(columns, names, seq_length, bounds, row_offsets)

    # Rows become fragments (empty rows none, as TRL filters them): the row cut to
    # seq_length ("bfd"), or ceil(length / seq_length) consecutive slices.
    lengths = np.diff(row_offsets)
    rows = np.flatnonzero(lengths > 0)
    if strategy == "bfd":
        frag_rows, frag_starts = rows, row_offsets[rows]
        frag_lengths = np.minimum(lengths[rows], seq_length)
    else:  # bfd_split
        pieces = -(-lengths[rows] // seq_length)
        frag_rows = np.repeat(rows, pieces)
        index_in_row = np.arange(len(frag_rows), dtype=np.int64) - np.repeat(np.cumsum(pieces) - pieces, pieces)
        frag_starts = row_offsets[frag_rows] + index_in_row * seq_length
        frag_lengths = np.minimum(lengths[frag_rows] - index_in_row * seq_length, seq_length)
    # A batch holds the fragments of its rows (batches are over the input rows).
    frag_bounds = np.searchsorted(frag_rows, bounds, side="left").astype(np.int64)
    offsets, order = _core.best_fit_decreasing_fifo(frag_lengths, seq_length, frag_bounds)
    return _gather(columns, names, frag_starts[order], frag_lengths[order], offsets, progress)


def _fresh_array(size: int, dtype: np.dtype) -> np.ndarray:
    """An uninitialised array; a large one (64 MiB and more) from an anonymous
    mapping populated by the kernel in one call (Linux ``MAP_POPULATE``): half the
    time of faulting its pages in one by one as the copy first writes them."""
    nbytes = size * np.dtype(dtype).itemsize
    populate = getattr(mmap, "MAP_POPULATE", None)
    if populate is None or nbytes < (64 << 20):
        return np.empty(size, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
    return np.frombuffer(mapping, dtype=dtype)  # the array keeps the mapping alive


def _gather_values(values, starts: np.ndarray, lengths: np.ndarray):
    """``values[starts[k]:starts[k] + lengths[k]]`` concatenated over k: one
    multi-threaded copy run per fragment for fixed-width values (seqpack's move
    engine, the GIL released), else Arrow's take."""
    pa, _ = _arrow()
    dst_starts = np.cumsum(lengths) - lengths
    total = int(lengths.sum())
    if pa.types.is_primitive(values.type) and not pa.types.is_boolean(values.type) and values.null_count == 0:
        src = values.to_numpy(zero_copy_only=True)
        out = _fresh_array(total, src.dtype)
        runs = np.stack([starts, dst_starts, lengths], axis=1).astype(np.int64)
        _core.move_rows(runs, np.zeros((0, 2), np.int64), src, 1, out, 1)  # src: read-only, DLPack 1.0
        return pa.array(out, type=values.type)
    index = np.repeat(starts - dst_starts, lengths) + np.arange(total, dtype=np.int64)
    return values.take(pa.array(index))


def _gather(columns, names, starts, frag_lengths, offsets, progress):
    """Packed rows: the fragments (``starts`` / ``frag_lengths``, in pack order)
    copied out, one list row per pack of ``offsets``. Built in chunks of at most
    2^30 values, so int32 list offsets never overflow."""
    pa, _ = _arrow()
    from tqdm.auto import tqdm

    num_bins = len(offsets) - 1
    cum = np.concatenate([[0], np.cumsum(frag_lengths)])[offsets]  # values before each pack
    cuts = [0]
    while cuts[-1] < num_bins:  # packs [cuts[i], cuts[i + 1]) hold at most _MAX_CHUNK_VALUES values
        nxt = int(np.searchsorted(cum, cum[cuts[-1]] + _MAX_CHUNK_VALUES, side="right")) - 1
        cuts.append(max(nxt, cuts[-1] + 1))
    show = progress if progress is not None else len(starts) > 1_000_000
    flat = [c.flatten() for c in columns]
    out_columns: List[List[Any]] = [[] for _ in range(len(columns) + 1)]
    # seq_lengths: the fragments' lengths per pack, as TRL writes them (list offsets
    # int32, values as wide as the first column's list lengths).
    seq_type = pa.int64() if pa.types.is_large_list(columns[0].type) else pa.int32()
    for lo, hi in tqdm(list(zip(cuts[:-1], cuts[1:])), desc="seqpack: packing", disable=not show):
        a, b = offsets[lo], offsets[hi]
        row_offsets = cum[lo:hi + 1] - cum[lo]
        for k, (column, values) in enumerate(zip(columns, flat)):
            dtype = np.int64 if pa.types.is_large_list(column.type) else np.int32
            packed = _gather_values(values, starts[a:b], frag_lengths[a:b])
            out_columns[k].append(type(column).from_arrays(pa.array(row_offsets.astype(dtype)), packed))
        counts = (offsets[lo:hi + 1] - a).astype(np.int32)
        out_columns[-1].append(pa.ListArray.from_arrays(pa.array(counts), pa.array(frag_lengths[a:b], type=seq_type)))
    arrays = [pa.chunked_array(chunks) for chunks in out_columns]
    return pa.Table.from_arrays(arrays, names=names + ["seq_lengths"])


def _pack_wrapped(columns, names, seq_length: int, bounds: np.ndarray, row_offsets: np.ndarray):
    """TRL's "wrapped": each batch's values concatenated and cut every seq_length
    (new list offsets over the same values, no copy)."""
    pa, _ = _arrow()
    starts, ends = row_offsets[bounds[:-1]], row_offsets[bounds[1:]]
    cuts = [np.arange(s, e, seq_length, dtype=np.int64) for s, e in zip(starts, ends)]
    flat = np.concatenate(cuts + [row_offsets[-1:]])
    arrays = []
    for column in columns:
        dtype = np.int64 if pa.types.is_large_list(column.type) else np.int32
        arrays.append(type(column).from_arrays(pa.array(flat.astype(dtype)), column.flatten()))
    return pa.Table.from_arrays(arrays, names=names)
