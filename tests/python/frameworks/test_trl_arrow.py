"""seqpack.integrations.trl.pack_dataset on every Arrow layout TRL's pack_dataset
reads: list and large_list columns, several chunks (offsets that start past 0),
sliced tables, null rows (with and without values under them), values that are
null, several columns; and the edge inputs: no rows, only empty or null rows.
The packs are compared with TRL's own ``trl.data_utils.pack_dataset`` on the same
``datasets.Dataset``; where TRL fails, seqpack's rule is checked directly."""

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
datasets = pytest.importorskip("datasets")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from seqpack.integrations.trl import pack_dataset  # noqa: E402

trl_data_utils = pytest.importorskip("trl.data_utils")
from datasets.table import InMemoryTable  # noqa: E402

datasets.disable_progress_bars()
BFD = ("bfd", "bfd_split")


def as_dataset(table) -> "datasets.Dataset":
    return datasets.Dataset(InMemoryTable(table))  # the table as it is: chunks, slice offsets, null slots


def list_column(offsets, values, valid, large):
    """A list array over ``values`` (offsets may start past 0) with null slots
    where ``valid`` is False, whatever values the slots span."""
    cls, itype = (pa.LargeListArray, pa.int64()) if large else (pa.ListArray, pa.int32())
    mask = None if valid.all() else pa.array(~valid)
    return cls.from_arrays(pa.array(offsets, type=itype), values, mask=mask)


@st.composite
def tables(draw, strategy):
    """A table of ``n`` visible rows inside ``pre`` + ``n`` + ``post`` rows (sliced
    out), in 1-3 chunks, each chunk's values behind a junk prefix; null rows span
    values or none; ``input_ids`` / ``labels`` (values sometimes null) /
    ``attention_mask`` (int8) null in the same rows, or ``labels`` only in some
    rows where ``input_ids`` is null (bfd: TRL leaves those rows out)."""
    n = draw(st.integers(1, 30))
    pre, post = draw(st.integers(0, 4)), draw(st.integers(0, 4))
    total = pre + n + post
    lengths = np.array(draw(st.lists(st.integers(0, 14), min_size=total, max_size=total)), np.int64)
    valid = np.array(draw(st.lists(st.integers(0, 3), min_size=total, max_size=total)), bool)  # 1 in 4 null
    null_span = draw(st.sampled_from(["empty", "values", "mixed"]))
    if null_span == "empty":
        lengths[~valid] = 0
    elif null_span == "values":
        lengths[~valid] = np.maximum(lengths[~valid], 1)
    batch_size = draw(st.sampled_from([None, 0, -1, 1, 3, 7, 1000]))
    if strategy in BFD:  # a map batch with no row to pack makes TRL fail (tested apart below)
        step = n if batch_size is None or batch_size <= 0 else batch_size
        first = pre + np.arange(0, n, step)
        valid[first], lengths[first] = True, np.maximum(lengths[first], 1)
    labels_valid = valid.copy()
    if strategy in BFD and draw(st.booleans()):
        labels_valid |= np.array(draw(st.lists(st.booleans(), min_size=total, max_size=total)), bool)
    large = draw(st.booleans())
    value_nulls = draw(st.booleans())
    cuts = sorted(set(draw(st.lists(st.integers(1, total - 1), max_size=2)) if total > 1 else []))
    bounds = [0] + cuts + [total]
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    chunks = {"input_ids": [], "labels": [], "attention_mask": []}
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        junk = int(rng.integers(0, 4))  # values before the chunk's first offset
        offsets = junk + np.concatenate([[0], np.cumsum(lengths[lo:hi])])
        ids = rng.integers(0, 1000, offsets[-1])
        labels = pa.array(ids + 1000, mask=(rng.random(len(ids)) < 0.2) if value_nulls else None)
        chunks["input_ids"].append(list_column(offsets, pa.array(ids), valid[lo:hi], large))
        chunks["labels"].append(list_column(offsets, labels, labels_valid[lo:hi], large))
        chunks["attention_mask"].append(list_column(offsets, pa.array(ids % 2, pa.int8()), valid[lo:hi], large))
    table = pa.table({name: pa.chunked_array(parts) for name, parts in chunks.items()}).slice(pre, n)
    return table, batch_size


@pytest.mark.parametrize("strategy", ["bfd", "bfd_split", "wrapped"])
@settings(max_examples=20, deadline=None)
@given(data=st.data(), seq_length=st.integers(1, 12), non_list=st.booleans())
def test_same_packs_as_trl_on_every_arrow_layout(strategy, data, seq_length, non_list):
    table, batch_size = data.draw(tables(strategy))
    kwargs = {"batch_size": batch_size}
    if non_list:  # TRL refuses a column that is not a list; so does seqpack, naming it
        bad = as_dataset(table.append_column("score", pa.array(np.arange(table.num_rows))))
        with pytest.raises(TypeError):
            trl_data_utils.pack_dataset(bad, seq_length, strategy, map_kwargs=kwargs)
        with pytest.raises(ValueError, match="column 'score' is int64"):
            pack_dataset(bad, seq_length, strategy, map_kwargs=kwargs)
    ds = as_dataset(table)
    theirs = trl_data_utils.pack_dataset(ds, seq_length, strategy, map_kwargs=kwargs)
    ours = pack_dataset(ds, seq_length, strategy, map_kwargs=kwargs)
    assert ours[:] == theirs[:]
    assert ours.features == theirs.features
    # A pyarrow.Table gives the same rows (one batch unless batch_size is given).
    packed = pack_dataset(table, seq_length, strategy, map_kwargs=kwargs)
    packed.validate(full=True)
    assert packed.to_pydict() == theirs[:]


def null_row_table(large=False):
    """Row 1 is null in every column and spans 3 values (valid Arrow: what
    ``pa.array(..., mask=...)`` and filtered tables give)."""
    offsets, valid = np.array([0, 2, 5, 7, 9]), np.array([True, False, True, True])
    return pa.table({"input_ids": list_column(offsets, pa.array(np.arange(1, 10)), valid, large),
                     "labels": list_column(offsets, pa.array(np.arange(10, 100, 10)), valid, large)})


@pytest.mark.parametrize("large", [False, True])
@pytest.mark.parametrize("strategy", ["bfd", "bfd_split", "wrapped"])
def test_a_null_row_spanning_values_is_left_out(strategy, large):
    # Before: its values were read from flatten() (which skips them) at offsets that
    # count them: every later row shifted, or an internal "corrupt plan" error.
    ds = as_dataset(null_row_table(large))
    expected = {"input_ids": [[1, 2, 6, 7], [8, 9]], "labels": [[10, 20, 60, 70], [80, 90]]}
    if strategy in BFD:
        expected["seq_lengths"] = [[2, 2], [2]]
    assert pack_dataset(ds, 4, strategy)[:] == expected
    assert trl_data_utils.pack_dataset(ds, 4, strategy)[:] == expected
    if strategy in BFD:  # one batch: the global variant packs the same
        assert pack_dataset(ds, 4, strategy + "_global")[:] == expected
    sliced = pa.concat_tables([null_row_table(large)] * 2).slice(1, 6)  # rows 1-3, then 0-2
    assert pack_dataset(sliced, 4, strategy).to_pydict() == \
        trl_data_utils.pack_dataset(as_dataset(sliced), 4, strategy)[:]


@pytest.mark.parametrize("strategy", ["bfd", "bfd_split", "wrapped"])
def test_null_rows_that_differ_between_columns_are_named(strategy):
    table = null_row_table()
    valid_ids = pa.ListArray.from_arrays(pa.array([0, 2, 5, 7, 9], pa.int32()), pa.array(np.arange(1, 10)))
    # labels null where input_ids holds values: TRL fails inside pyarrow.
    swapped = table.set_column(0, "input_ids", valid_ids).set_column(1, "labels", table.column("input_ids"))
    with pytest.raises(pa.ArrowInvalid):
        trl_data_utils.pack_dataset(as_dataset(swapped), 4, strategy)
    with pytest.raises(ValueError, match=r"column 'labels': row 1 is null, but 'input_ids' holds 3 values"):
        pack_dataset(swapped, 4, strategy)
    # input_ids null where labels holds values: the bfd strategies leave the row out
    # of every column, as TRL does; TRL's "wrapped" would pair each column's
    # remaining values wrongly (labels keep the row), so seqpack refuses it.
    only_ids = table.set_column(1, "labels", valid_ids)
    if strategy in BFD:
        assert pack_dataset(only_ids, 4, strategy).to_pydict() == \
            trl_data_utils.pack_dataset(as_dataset(only_ids), 4, strategy)[:]
    else:
        with pytest.raises(ValueError, match=r"column 'labels': row 1 holds 3 values, but 'input_ids' is null"):
            pack_dataset(only_ids, 4, strategy)


@pytest.mark.parametrize("kind", ["dataset", "table"])
@pytest.mark.parametrize("strategy", ["bfd", "bfd_split", "wrapped", "bfd_global", "bfd_split_global"])
@pytest.mark.parametrize("rows", [[], [[], []], [None, None], [[], None, []]])
def test_no_rows_or_only_empty_rows_give_no_packs(strategy, rows, kind):
    # Before: ArrowInvalid (the bfd strategies), or a 0-row result without seq_lengths.
    column = pa.array(rows, pa.list_(pa.int64()))
    table = pa.table({"input_ids": column, "labels": column})
    out = pack_dataset(as_dataset(table) if kind == "dataset" else table, 4, strategy)
    out = out.with_format("arrow")[:] if kind == "dataset" else out
    names = ["input_ids", "labels"] + ([] if strategy == "wrapped" else ["seq_lengths"])
    assert out.num_rows == 0 and out.column_names == names
    assert out.schema.field("labels").type == pa.list_(pa.int64())
    if strategy != "wrapped":
        assert out.schema.field("seq_lengths").type == pa.list_(pa.int32())
    if strategy == "wrapped" and kind == "dataset":  # TRL gives the same; its bfd strategies fail here
        assert out.to_pydict() == trl_data_utils.pack_dataset(as_dataset(table), 4, strategy)[:]


def test_large_list_columns_with_no_packs_keep_their_types():
    table = pa.table({"input_ids": pa.array([[]], pa.large_list(pa.int32()))})
    out = pack_dataset(table, 4)
    assert out.schema.field("input_ids").type == pa.large_list(pa.int32())
    assert out.schema.field("seq_lengths").type == pa.list_(pa.int64())


@pytest.mark.parametrize("strategy", ["bfd", "bfd_split", "wrapped"])
def test_empty_and_null_rows_among_others(strategy):
    # [[], [1, 2, 3], None, [], [4, 5, 6, 7, 8], [9], None], the null rows over values.
    offsets = np.array([0, 0, 3, 5, 5, 10, 11, 12])
    valid = np.array([True, True, False, True, True, True, False])
    values = pa.array([1, 2, 3, -1, -1, 4, 5, 6, 7, 8, 9, -1])
    ds = as_dataset(pa.table({"input_ids": list_column(offsets, values, valid, large=False)}))
    assert pack_dataset(ds, 4, strategy)[:] == trl_data_utils.pack_dataset(ds, 4, strategy)[:]
    # Map batches 2 and 4 hold nothing to pack (TRL's own bfd fails on them): no packs.
    expected = {"bfd": {"input_ids": [[1, 2, 3], [4, 5, 6, 7], [9]], "seq_lengths": [[3], [4], [1]]},
                "bfd_split": {"input_ids": [[1, 2, 3], [4, 5, 6, 7], [8, 9]], "seq_lengths": [[3], [4], [1, 1]]},
                "wrapped": {"input_ids": [[1, 2, 3], [4, 5, 6, 7], [8, 9]]}}[strategy]
    assert pack_dataset(ds, 4, strategy, map_kwargs={"batch_size": 2})[:] == expected


def test_a_dataset_with_no_columns_is_refused():
    with pytest.raises(ValueError, match="dataset has no columns"):
        pack_dataset(pa.table({}), 4)
