"""HF TRL's ``pack_dataset`` on Arrow buffers (``seqpack.integrations.trl.pack_dataset``).

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
batch by batch: fewer, fuller packs (not TRL's packs). Empty and null rows are
left out, as TRL leaves them out, on every Arrow layout (``list`` / ``large_list``,
chunked, sliced, null slots that span values); ``map_kwargs`` are read as
``Dataset.map`` reads them.

Needs ``pyarrow`` (and ``datasets`` for ``Dataset`` / ``DatasetDict`` inputs):
``pip install seqpack[hf]``.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np

from ... import _core
from ..._memory import fresh_array
from ..._lengths import as_int64, as_positive_int, type_name

__all__ = ["pack_dataset", "STRATEGIES", "datasets_module"]

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
            ...), as TRL requires. Null rows are left out, as TRL leaves them out
            (the ``bfd`` strategies: every row null in the first column); a row null
            in another column but not in the first is refused (TRL fails on it).
        seq_length: tokens per packed row.
        strategy: one of :data:`STRATEGIES` (see the module docstring).
        map_kwargs: TRL's ``Dataset.map`` arguments, with ``map``'s meaning:
            ``batch_size`` (default 1,000; ``None`` or ``<= 0``: the whole dataset),
            ``num_proc`` (contiguous shards, each batched on its own) and
            ``drop_last_batch`` cut the batches as in TRL; ``features`` casts the
            output, ``new_fingerprint`` enters its fingerprint; ``remove_columns``,
            ``desc``, ``writer_batch_size``, ... do not change it (as in TRL);
            ``cache_file_name`` is warned about (no cache file is written);
            ``batched``, ``fn_kwargs``, ``with_indices``, ... are refused, as TRL's
            call fails with them. A ``pyarrow.Table`` is packed as one batch unless
            ``batch_size`` is given. See docs/trl.md for every key.
        progress: a tqdm bar over the output chunks (default: for more than 1M rows).

    Returns:
        The same kind of object: packed list columns plus ``seq_lengths`` (the
        lengths of the sequences in each packed row) for the ``bfd`` strategies, also
        when there are no rows or every row is empty (no packs: 0 rows). A
        ``Dataset`` keeps its format (``seq_lengths`` added to its columns).

    Raises:
        ValueError: an unknown strategy, ``seq_length`` below 1, a non-list column,
            columns whose rows differ in length or in null rows (the column and row
            named), or a bad ``map_kwargs`` value.
        TypeError: a ``map_kwargs`` key that is not ``Dataset.map``'s or that TRL's
            own call fails with.
        ImportError: ``pyarrow`` (or ``datasets`` for a Dataset) is not installed.
    """
    pa, _ = _arrow()
    seq_length = as_positive_int(seq_length, "seq_length")
    if strategy not in STRATEGIES:
        raise ValueError(f"Invalid packing strategy '{strategy}', must be one of {STRATEGIES}.")
    if isinstance(dataset, pa.Table):
        args = _map_args(map_kwargs, dataset.column_names, default_batch=None)
        packed = _pack_table(dataset, seq_length, strategy, args, progress)
        return packed if args["features"] is None else _cast(packed, args["features"])
    datasets = datasets_module()
    if isinstance(dataset, datasets.DatasetDict):
        split_kwargs = _dict_map_args(map_kwargs)
        return datasets.DatasetDict({name: pack_dataset(split, seq_length, strategy, split_kwargs, progress=progress)
                                     for name, split in dataset.items()})
    if not isinstance(dataset, datasets.Dataset):
        raise TypeError(f"dataset must be a datasets.Dataset, datasets.DatasetDict or pyarrow.Table, "
                        f"got {type(dataset).__name__}")
    args = _map_args(map_kwargs, dataset.column_names, default_batch=_DEFAULT_MAP_BATCH)
    fmt = dataset.format
    table = dataset.with_format("arrow")[:]  # the rows in order (indices mappings applied)
    packed = _pack_table(table, seq_length, strategy, args, progress)
    if args["features"] is not None:
        packed = _cast(packed, args["features"])
    from datasets.fingerprint import Hasher
    from datasets.table import InMemoryTable

    # A fingerprint from the source's and the arguments (datasets would hash every value).
    key = (args["batch"], args["num_proc"], args["drop_last"], args["new_fingerprint"], str(args["features"]))
    fingerprint = Hasher.hash((dataset._fingerprint, seq_length, strategy) + key)
    out = datasets.Dataset(InMemoryTable(packed), split=dataset.split, fingerprint=fingerprint)
    columns = fmt.get("columns")
    if columns is not None and strategy != "wrapped":
        columns = list(columns) + ["seq_lengths"]
    return out.with_format(type=fmt.get("type"), columns=columns, output_all_columns=fmt.get("output_all_columns", False),
                           **fmt.get("format_kwargs", {}))


# Dataset.map's keyword arguments, by what they do to TRL's pack_dataset.
_MAP_READ = ("batch_size", "num_proc", "drop_last_batch", "features", "new_fingerprint", "remove_columns",
             "keep_in_memory", "cache_file_name", "desc")
# No change to the packs: the output (and, for remove_columns, its columns) is TRL's either way.
_MAP_NO_EFFECT = ("load_from_cache_file", "writer_batch_size", "suffix_template", "disable_nullable",
                  "try_original_type", "on_mixed_types")
_MAP_SET_BY_TRL = ("function", "batched", "fn_kwargs")  # TRL passes them: "got multiple values"
_MAP_CALL_CHANGERS = ("with_indices", "with_rank", "input_columns")  # set, TRL's packing function fails
_DICT_ONLY = ("cache_file_names", "with_split")  # DatasetDict.map's, instead of cache_file_name / ...
_NOT_DICT = ("cache_file_name", "new_fingerprint", "suffix_template")  # ... which it does not take


def _check_map_kwargs(map_kwargs: Any) -> Dict[str, Any]:
    if map_kwargs is None:
        return {}
    if not isinstance(map_kwargs, Mapping):
        raise TypeError(f"map_kwargs must be a dict of Dataset.map arguments, got {type_name(map_kwargs)}")
    for key in map_kwargs:
        if not isinstance(key, str):
            raise TypeError(f"map_kwargs keys must be Dataset.map argument names, got {key!r}")
    return dict(map_kwargs)


def _dict_map_args(map_kwargs: Any) -> Dict[str, Any]:
    """A DatasetDict's ``map_kwargs`` (``DatasetDict.map``'s arguments) as each
    split's (``Dataset.map``'s)."""
    kw = _check_map_kwargs(map_kwargs)
    for key in _NOT_DICT:
        if key in kw:
            raise TypeError(f"map_kwargs['{key}'] is not an argument of DatasetDict.map (TRL's pack_dataset of a "
                            f"DatasetDict raises TypeError for it too)")
    if kw.pop("with_split", False):
        raise TypeError("map_kwargs['with_split'] passes the split name to the packing function, which TRL's "
                        "pack_dataset fails with; leave it unset")
    if kw.pop("cache_file_names", None) is not None:
        _warn_no_cache("cache_file_names")
    return kw


def _warn_no_cache(key: str) -> None:
    warnings.warn(f"seqpack.integrations.trl.pack_dataset: map_kwargs['{key}'] is not used: the packed dataset "
                  f"is built in memory and no cache file is written", UserWarning, stacklevel=4)


def _map_args(map_kwargs: Any, names: List[str], default_batch: Optional[int]) -> Dict[str, Any]:
    """The ``map_kwargs`` that set the packs, read as ``Dataset.map`` reads them;
    the others checked (see :func:`pack_dataset`)."""
    kw = _check_map_kwargs(map_kwargs)
    for key, value in kw.items():
        if key in _MAP_SET_BY_TRL:
            raise TypeError(f"map_kwargs['{key}'] is set by pack_dataset itself (TRL's pack_dataset raises "
                            f"TypeError for it too)")
        if key in _MAP_CALL_CHANGERS:
            if value is not None and value is not False:
                raise TypeError(f"map_kwargs['{key}']={value!r} changes the arguments of the packing function, "
                                f"which TRL's pack_dataset fails with; leave it unset")
        elif key not in _MAP_READ and key not in _MAP_NO_EFFECT:
            if key in _dataset_map_parameters():  # a Dataset.map argument newer than this module
                warnings.warn(f"seqpack.integrations.trl.pack_dataset: map_kwargs['{key}'] is not used",
                              UserWarning, stacklevel=3)
            else:
                raise TypeError(f"map_kwargs['{key}'] is not an argument of datasets.Dataset.map")
    batch = kw.get("batch_size", default_batch)
    if batch is not None:
        batch = as_int64(batch, "map_kwargs['batch_size']")
        batch = batch if batch > 0 else None  # None or <= 0: one batch (per shard), as Dataset.map
    num_proc = kw.get("num_proc")
    if num_proc is not None:
        num_proc = as_int64(num_proc, "map_kwargs['num_proc']")
        if num_proc < 0:
            raise ValueError(f"map_kwargs['num_proc'] must be >= 0 or None, got {num_proc}")
    drop_last = kw.get("drop_last_batch", False)
    if not isinstance(drop_last, (bool, np.bool_)):
        raise TypeError(f"map_kwargs['drop_last_batch'] must be a bool, got {type_name(drop_last)}")
    remove = kw.get("remove_columns")
    if remove is not None:  # checked as map checks it; the packed columns replace them, as in TRL
        missing = [c for c in ([remove] if isinstance(remove, str) else list(remove)) if c not in names]
        if missing:
            raise ValueError(f"map_kwargs['remove_columns']: columns {missing} are not in the dataset "
                             f"(its columns: {names})")
    cache_file = kw.get("cache_file_name")
    if kw.get("keep_in_memory") and cache_file is not None:
        raise ValueError("map_kwargs: use either 'keep_in_memory' or 'cache_file_name', not both (as Dataset.map)")
    if cache_file is not None:
        _warn_no_cache("cache_file_name")
    features = kw.get("features")
    if features is not None and not isinstance(features, datasets_module().Features):
        raise TypeError(f"map_kwargs['features'] must be a datasets.Features, got {type_name(features)}")
    fingerprint = kw.get("new_fingerprint")
    if fingerprint is not None:
        from datasets.fingerprint import validate_fingerprint

        validate_fingerprint(fingerprint)
    desc = kw.get("desc")
    return {"batch": batch, "num_proc": num_proc or 1, "drop_last": bool(drop_last), "features": features,
            "new_fingerprint": fingerprint, "desc": desc if isinstance(desc, str) else None}


def _dataset_map_parameters() -> Tuple[str, ...]:
    try:
        import datasets
    except ImportError:  # pragma: no cover
        return ()
    return tuple(inspect.signature(datasets.Dataset.map).parameters)


def _cast(table, features):
    """``table`` cast to ``features`` (``map(features=...)``): their Arrow schema,
    with the ``huggingface`` metadata that gives a Dataset those features."""
    from datasets.table import table_cast

    missing = sorted(set(table.column_names) ^ set(features))
    if missing:
        raise ValueError(f"map_kwargs['features'] must name the packed columns {table.column_names}, "
                         f"differs in {missing}")
    return table_cast(table, features.arrow_schema)


def _arrow() -> Tuple[Any, Any]:
    try:
        import pyarrow as pa
        import pyarrow.compute as pc
    except ImportError as e:  # pragma: no cover - exercised without the extra
        raise ImportError("seqpack.integrations.trl needs pyarrow: pip install seqpack[hf]") from e
    return pa, pc


def datasets_module() -> Any:
    try:
        import datasets
    except ImportError as e:  # pragma: no cover
        raise ImportError("packing a datasets.Dataset needs the datasets package: pip install seqpack[hf]") from e
    return datasets


def _list_columns(table) -> Tuple[List[Any], List[Any], np.ndarray, List[Optional[np.ndarray]]]:
    """Every column as one list array (chunks combined), the values its rows span
    (null rows' included: read through the offsets, never ``flatten()``, which
    skips them), the row offsets into those values and the rows that are not null
    (``None``: all), checked as TRL checks them: list columns whose rows all span
    the first column's lengths."""
    pa, _ = _arrow()
    columns, values, valid, offsets = [], [], [], None
    for name, column in zip(table.column_names, table.columns):
        if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)):
            raise ValueError(f"column '{name}' is {column.type}; every column to pack must be a list column")
        if isinstance(column, pa.ChunkedArray):  # one chunk: itself; several: concatenated (a copy)
            column = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
        raw = np.asarray(column.offsets)  # this array's own (a slice's offsets start past 0)
        own = raw.astype(np.int64) if len(raw) else np.zeros(1, np.int64)
        own -= own[0]
        if offsets is not None and not np.array_equal(own, offsets):
            row = int(np.argmax(np.diff(own) != np.diff(offsets)))
            raise ValueError(f"column '{name}': all columns must have values of the same length (row {row} spans "
                             f"{own[row + 1] - own[row]} values, '{table.column_names[0]}' "
                             f"{offsets[row + 1] - offsets[row]})")
        columns.append(column)
        values.append(column.values.slice(int(raw[0]) if len(raw) else 0, int(own[-1])))
        valid.append(None if column.null_count == 0 else column.is_valid().to_numpy(zero_copy_only=False))
        offsets = own if offsets is None else offsets
    return columns, values, offsets, valid


def _check_null_rows(names: List[str], valid: List[Optional[np.ndarray]], rows: np.ndarray, lengths: np.ndarray,
                     same: bool) -> None:
    """Null rows as TRL can pack them: each row of ``rows`` not null in any column
    (``same=False``: the bfd strategies, where a null row of the first column is left
    out, whatever the others hold), or null in every column or in none
    (``same=True``: "wrapped", where TRL would mix the rows of the columns up)."""
    first = valid[0]
    for name, own in zip(names[1:], valid[1:]):
        if own is None and (first is None or not same):
            continue
        is_valid = np.ones(len(rows), bool) if own is None else own
        bad = rows & ~is_valid if not same else rows & (is_valid != (True if first is None else first))
        if bad.any():
            row = int(np.argmax(bad))
            if not is_valid[row]:
                raise ValueError(f"column '{name}': row {row} is null, but '{names[0]}' holds {lengths[row]} "
                                 f"values there; a row null in any column must be null in '{names[0]}' too")
            raise ValueError(f"column '{name}': row {row} holds {lengths[row]} values, but '{names[0]}' is null "
                             f"there; the 'wrapped' strategy needs every column null in the same rows")


def _batches(num_rows: int, batch: Optional[int], num_proc: int, drop_last: bool) -> Tuple[np.ndarray, np.ndarray]:
    """``Dataset.map``'s batches, as row ranges ``[starts[i], ends[i])``: ``num_proc``
    contiguous shards (``Dataset.shard``), each cut every ``batch`` rows (``None``:
    one batch), a shard's last short batch left out with ``drop_last``."""
    shards = max(1, min(num_proc, num_rows))
    k = np.arange(shards, dtype=np.int64)
    div, mod = divmod(num_rows, shards)
    first, size = div * k + np.minimum(k, mod), div + (k < mod)
    every = np.maximum(size if batch is None else np.full(shards, batch, np.int64), 1)
    count = size // every if drop_last else -(-size // every)
    step = np.minimum(every, np.maximum(size, 1))  # the same batches; no int64 overflow below
    index = np.arange(int(count.sum()), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
    starts = np.repeat(first, count) + index * np.repeat(step, count)
    return starts, np.minimum(starts + np.repeat(step, count), np.repeat(first + size, count))


def _back_to_back(starts: np.ndarray, ends: np.ndarray, total: int) -> bool:
    """Whether the ranges ``[starts[i], ends[i])`` tile ``[0, total)`` in order."""
    if len(starts) == 0:
        return total == 0
    return starts[0] == 0 and ends[-1] == total and np.array_equal(starts[1:], ends[:-1])


def _rows_to_pack(lengths: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The rows that hold values and lie in a batch (``drop_last_batch`` leaves
    some out), as a mask."""
    rows = lengths > 0
    if not _back_to_back(starts, ends, len(lengths)):
        seen = np.zeros(len(lengths) + 1, np.int64)
        np.add.at(seen, starts, 1)
        np.add.at(seen, ends, -1)
        rows &= np.cumsum(seen[:-1]) > 0
    return rows


def _pack_table(table, seq_length: int, strategy: str, args: Dict[str, Any], progress: Optional[bool]):
    if table.num_columns == 0:
        raise ValueError("dataset has no columns; pack_dataset packs list columns (input_ids, ...)")
    columns, values, row_offsets, valid = _list_columns(table)
    names = list(table.column_names)
    num_rows = len(row_offsets) - 1
    if strategy.endswith("_global"):  # one batch of every row
        strategy = strategy[: -len("_global")]
        starts, ends = _batches(num_rows, None, 1, False)
    else:
        starts, ends = _batches(num_rows, args["batch"], args["num_proc"], args["drop_last"])
    if strategy == "wrapped":
        if any(own is not None for own in valid):
            lengths = np.diff(row_offsets)
            _check_null_rows(names, valid, _rows_to_pack(lengths, starts, ends), lengths, same=True)
        return _pack_wrapped(columns, names, seq_length, starts, ends, row_offsets, valid)

    # Rows become fragments (empty and null rows none, as TRL filters them): the row
    # cut to seq_length ("bfd"), or ceil(length / seq_length) consecutive slices.
    lengths = np.diff(row_offsets)
    rows = _rows_to_pack(lengths, starts, ends)
    if valid[0] is not None:
        rows &= valid[0]
    _check_null_rows(names, valid, rows, lengths, same=False)
    rows = np.flatnonzero(rows)
    if strategy == "bfd":
        frag_rows, frag_starts = rows, row_offsets[rows]
        frag_lengths = np.minimum(lengths[rows], seq_length)
    else:  # bfd_split
        pieces = -(-lengths[rows] // seq_length)
        frag_rows = np.repeat(rows, pieces)
        index_in_row = np.arange(len(frag_rows), dtype=np.int64) - np.repeat(np.cumsum(pieces) - pieces, pieces)
        frag_starts = row_offsets[frag_rows] + index_in_row * seq_length
        frag_lengths = np.minimum(lengths[frag_rows] - index_in_row * seq_length, seq_length)
    # A batch holds the fragments of its rows (no fragment lies between batches).
    edges = np.append(starts, ends[-1:]) if len(starts) else np.zeros(1, np.int64)
    frag_bounds = np.searchsorted(frag_rows, edges, side="left").astype(np.int64)
    offsets, order = _core.best_fit_decreasing_fifo(frag_lengths, seq_length, frag_bounds)
    return _gather(columns, values, names, frag_starts[order], frag_lengths[order], offsets, progress, args["desc"])


def _gather_values(values, starts: np.ndarray, lengths: np.ndarray):
    """``values[starts[k]:starts[k] + lengths[k]]`` concatenated over k: one
    multi-threaded copy run per fragment for fixed-width values (seqpack's move
    engine, the GIL released), else Arrow's take."""
    pa, _ = _arrow()
    dst_starts = np.cumsum(lengths) - lengths
    total = int(lengths.sum())
    if pa.types.is_primitive(values.type) and not pa.types.is_boolean(values.type) and values.null_count == 0:
        src = values.to_numpy(zero_copy_only=True)
        out = fresh_array(total, src.dtype)
        runs = np.stack([starts, dst_starts, lengths], axis=1).astype(np.int64)
        _core.move_rows(runs, np.zeros((0, 2), np.int64), src, 1, out, 1)  # src: read-only, DLPack 1.0
        return pa.array(out, type=values.type)
    index = np.repeat(starts - dst_starts, lengths) + np.arange(total, dtype=np.int64)
    return values.take(pa.array(index))


def _list_type(column, values):
    pa, _ = _arrow()
    return pa.large_list(values.type) if pa.types.is_large_list(column.type) else pa.list_(values.type)


def _gather(columns, values, names, starts, frag_lengths, offsets, progress, desc=None):
    """Packed rows: the fragments (``starts`` / ``frag_lengths`` into ``values``, in
    pack order) copied out, one list row per pack of ``offsets``. Built in chunks of
    at most 2^30 values, so int32 list offsets never overflow."""
    pa, _ = _arrow()
    from tqdm.auto import tqdm

    num_bins = len(offsets) - 1
    cum = np.concatenate([[0], np.cumsum(frag_lengths)])[offsets]  # values before each pack
    cuts = [0]
    while cuts[-1] < num_bins:  # packs [cuts[i], cuts[i + 1]) hold at most _MAX_CHUNK_VALUES values
        nxt = int(np.searchsorted(cum, cum[cuts[-1]] + _MAX_CHUNK_VALUES, side="right")) - 1
        cuts.append(max(nxt, cuts[-1] + 1))
    show = progress if progress is not None else len(starts) > 1_000_000
    out_columns: List[List[Any]] = [[] for _ in range(len(columns) + 1)]
    # seq_lengths: the fragments' lengths per pack, as TRL writes them (list offsets
    # int32, values as wide as the first column's list lengths).
    seq_type = pa.int64() if pa.types.is_large_list(columns[0].type) else pa.int32()
    for lo, hi in tqdm(list(zip(cuts[:-1], cuts[1:])), desc=desc or "seqpack: packing", disable=not show):
        a, b = offsets[lo], offsets[hi]
        row_offsets = cum[lo:hi + 1] - cum[lo]
        for k, (column, column_values) in enumerate(zip(columns, values)):
            dtype = np.int64 if pa.types.is_large_list(column.type) else np.int32
            packed = _gather_values(column_values, starts[a:b], frag_lengths[a:b])
            out_columns[k].append(type(column).from_arrays(pa.array(row_offsets.astype(dtype)), packed))
        counts = (offsets[lo:hi + 1] - a).astype(np.int32)
        out_columns[-1].append(pa.ListArray.from_arrays(pa.array(counts), pa.array(frag_lengths[a:b], type=seq_type)))
    types = [_list_type(c, v) for c, v in zip(columns, values)] + [pa.list_(seq_type)]
    arrays = [pa.chunked_array(chunks, type=t) for chunks, t in zip(out_columns, types)]  # typed: no packs too
    return pa.Table.from_arrays(arrays, names=names + ["seq_lengths"])


def _pack_wrapped(columns, names, seq_length: int, starts: np.ndarray, ends: np.ndarray, row_offsets: np.ndarray,
                  valid: List[Optional[np.ndarray]]):
    """TRL's "wrapped": each batch's values (those of its rows that are not null)
    concatenated and cut every seq_length: new list offsets over the same values, no
    copy, unless null rows span values or rows are left out of every batch."""
    pa, _ = _arrow()
    arrays, cuts = [], None
    for column, own in zip(columns, valid):
        flat = column.flatten()  # the values of the rows that are not null
        held = row_offsets if own is None else np.concatenate([[0], np.cumsum(np.where(own, np.diff(row_offsets), 0))])
        first, last = held[starts], held[ends]  # each batch's values in flat
        if cuts is None:  # the same for every column (null rows checked)
            sizes = last - first
            pieces = -(-sizes // seq_length)
            index = np.arange(int(pieces.sum()), dtype=np.int64) - np.repeat(np.cumsum(pieces) - pieces, pieces)
            cuts = np.append(np.repeat(np.cumsum(sizes) - sizes, pieces) + index * seq_length, sizes.sum())
        if not _back_to_back(first, last, len(flat)):
            flat = _gather_values(flat, first, last - first)  # only the batches' values, back to back
        dtype = np.int64 if pa.types.is_large_list(column.type) else np.int32
        arrays.append(type(column).from_arrays(pa.array(cuts.astype(dtype)), flat))
    return pa.Table.from_arrays(arrays, names=names)


# ---- patching TRL's trainers ------------------------------------------------------
# TRL's trainer modules bind pack_dataset when they are imported (``from
# ..data_utils import pack_dataset``), so importing seqpack's under that name in a
# user's script changes nothing: the binding is replaced where it lives.
