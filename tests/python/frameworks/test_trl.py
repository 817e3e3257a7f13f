"""seqpack.integrations.trl.pack_dataset against TRL's own pack_dataset: the same
packs, columns and format, on random datasets, every strategy and map batch size."""

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
datasets = pytest.importorskip("datasets")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from seqpack.integrations.trl import STRATEGIES, pack_dataset  # noqa: E402

trl_data_utils = pytest.importorskip("trl.data_utils")

datasets.disable_progress_bars()


def random_dataset(rng: np.random.Generator, rows: int, max_len: int, batch=None) -> "datasets.Dataset":
    lengths = rng.integers(0, max_len + 1, rows)
    # Empty rows are dropped; a map batch of only empty rows makes TRL's own
    # pack_dataset fail (pyarrow's take of an empty list), so each batch's first row
    # is non-empty here (test_batches_of_empty_rows_are_dropped covers that case).
    lengths[:: batch or rows] = np.maximum(lengths[:: batch or rows], 1)
    ids = [rng.integers(0, 1000, n).tolist() for n in lengths]
    column = datasets.List(datasets.Value("int64"))  # typed even when every row is empty
    features = datasets.Features({"input_ids": column, "attention_mask": column, "labels": column})
    return datasets.Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(r) for r in ids],
                                       "labels": [[t + 1 for t in r] for r in ids]}, features=features)


def test_trl_docstring_example():
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10], [11]],
                                     "attention_mask": [[1, 1, 1, 0, 0], [1, 0], [1, 1, 0], [1]]})
    assert pack_dataset(ds, seq_length=4, strategy="bfd")[:] == {
        "input_ids": [[1, 2, 3, 4], [8, 9, 10, 11], [6, 7]],
        "attention_mask": [[1, 1, 1, 0], [1, 1, 0, 1], [1, 0]],
        "seq_lengths": [[4], [3, 1], [2]]}
    assert pack_dataset(ds, seq_length=4, strategy="bfd_split")[:] == {
        "input_ids": [[1, 2, 3, 4], [8, 9, 10, 5], [6, 7, 11]],
        "attention_mask": [[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 1]],
        "seq_lengths": [[4], [3, 1], [2, 1]]}


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 2500), max_len=st.integers(1, 80),
       seq_length=st.integers(1, 96), strategy=st.sampled_from(["bfd", "bfd_split", "wrapped"]),
       batch_size=st.sampled_from([1000, 1, 37, None]))
def test_same_packs_as_trl(seed, rows, max_len, seq_length, strategy, batch_size):
    ds = random_dataset(np.random.default_rng(seed), rows, max_len, batch_size)
    kwargs = {"batch_size": batch_size}
    theirs = trl_data_utils.pack_dataset(ds, seq_length, strategy, map_kwargs=kwargs)
    ours = pack_dataset(ds, seq_length, strategy, map_kwargs=kwargs)
    assert ours[:] == theirs[:]
    assert ours.features == theirs.features


@pytest.mark.parametrize("strategy", ["bfd", "wrapped"])
def test_format_split_and_dataset_dict_are_kept(strategy):
    ds = random_dataset(np.random.default_rng(0), 50, 30).with_format("torch", columns=["input_ids"])
    theirs = trl_data_utils.pack_dataset(ds, 16, strategy)
    ours = pack_dataset(ds, 16, strategy)
    assert ours.format == theirs.format
    assert all((a == b).all() for a, b in zip(ours["input_ids"], theirs["input_ids"]))
    split = datasets.DatasetDict({"train": ds, "test": ds.select(range(10))})
    packed = pack_dataset(split, 16, strategy)
    assert set(packed) == {"train", "test"}
    assert packed["test"].with_format(None)[:] == pack_dataset(split["test"], 16, strategy).with_format(None)[:]


def test_a_shuffled_dataset_packs_its_rows_in_their_order():
    ds = random_dataset(np.random.default_rng(1), 300, 40).shuffle(seed=3)  # an indices mapping
    assert pack_dataset(ds, 32)[:] == trl_data_utils.pack_dataset(ds, 32)[:]


def test_arrow_tables_are_packed_as_one_batch_by_default():
    table = pa.table({"input_ids": [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10]]})
    out = pack_dataset(table, 4)
    assert isinstance(out, pa.Table)
    assert out.to_pydict() == {"input_ids": [[7, 8, 9, 10], [1, 2, 3, 4], [5, 6]], "seq_lengths": [[4], [3, 1], [2]]}
    # batch_size splits the table the way datasets.map would.
    assert pack_dataset(table, 4, map_kwargs={"batch_size": 2}).to_pydict()["seq_lengths"] == [[3, 1], [4], [2]]


def test_global_strategies_use_fewer_packs_and_keep_every_token():
    ds = random_dataset(np.random.default_rng(2), 5000, 200)
    for base in ("bfd", "bfd_split"):
        per_batch = pack_dataset(ds, 256, base)
        overall = pack_dataset(ds, 256, base + "_global")
        assert len(overall) <= len(per_batch)
        lengths = [sum(s) for s in overall["seq_lengths"]]
        assert max(lengths) <= 256 and sum(lengths) == sum(sum(s) for s in per_batch["seq_lengths"])
        assert sorted(t for row in overall["input_ids"] for t in row) == \
            sorted(t for row in per_batch["input_ids"] for t in row)
    assert set(STRATEGIES) == {"bfd", "bfd_split", "wrapped", "bfd_global", "bfd_split_global"}


def test_batches_of_empty_rows_are_dropped():
    ds = datasets.Dataset.from_dict({"input_ids": [[], [], [1, 2], [3]]},
                                    features=datasets.Features({"input_ids": datasets.List(datasets.Value("int64"))}))
    assert pack_dataset(ds, 4, map_kwargs={"batch_size": 2})[:] == {"input_ids": [[1, 2, 3]], "seq_lengths": [[2, 1]]}
    assert pack_dataset(ds, 4, "wrapped", map_kwargs={"batch_size": 2})[:] == {"input_ids": [[1, 2, 3]]}


def test_bad_input_is_named():
    ds = random_dataset(np.random.default_rng(0), 5, 5)
    with pytest.raises(ValueError, match="Invalid packing strategy 'best'"):
        pack_dataset(ds, 4, "best")
    with pytest.raises(ValueError, match="seq_length must be positive"):
        pack_dataset(ds, 0)
    with pytest.raises(ValueError, match="column 'score' is int64"):
        pack_dataset(pa.table({"input_ids": [[1, 2]], "score": [3]}), 4)
    with pytest.raises(ValueError, match="column 'labels': all columns must have values of the same length"):
        pack_dataset(pa.table({"input_ids": [[1, 2]], "labels": [[1]]}), 4)
    with pytest.raises(TypeError, match="dataset must be a datasets.Dataset"):
        pack_dataset([[1, 2]], 4)


@pytest.mark.parametrize("strategy", ["bfd", "wrapped"])
@pytest.mark.parametrize("batch_size", [0, -1, np.int64(0)])
def test_a_batch_size_of_none_or_below_one_is_the_whole_dataset(strategy, batch_size):
    # Dataset.map's rule (TRL passes map_kwargs to it); before: "must be positive".
    ds = random_dataset(np.random.default_rng(5), 120, 30)
    whole = pack_dataset(ds, 32, strategy, map_kwargs={"batch_size": None})[:]
    assert whole == pack_dataset(ds, 32, strategy, map_kwargs={"batch_size": len(ds)})[:]
    assert pack_dataset(ds, 32, strategy, map_kwargs={"batch_size": batch_size})[:] == whole
    assert trl_data_utils.pack_dataset(ds, 32, strategy, map_kwargs={"batch_size": batch_size})[:] == whole
    table = ds.with_format("arrow")[:]
    assert pack_dataset(table, 32, strategy, map_kwargs={"batch_size": batch_size}).to_pydict() == whole


@pytest.mark.parametrize("kwargs", [{"num_proc": 2, "batch_size": 7}, {"num_proc": 3},
                                    {"batch_size": 16, "drop_last_batch": True},
                                    {"num_proc": 2, "batch_size": 9, "drop_last_batch": True}])
def test_num_proc_and_drop_last_batch_cut_the_batches_as_map_does(kwargs):
    # num_proc: contiguous shards, each batched on its own; drop_last_batch: each
    # shard's short last batch left out. Before: both ignored (other packs than TRL's).
    ds = random_dataset(np.random.default_rng(6), 61, 30, batch=7)
    for strategy in ("bfd", "wrapped"):
        ours = pack_dataset(ds, 24, strategy, map_kwargs=kwargs)
        assert ours[:] == trl_data_utils.pack_dataset(ds, 24, strategy, map_kwargs=kwargs)[:]
    with pytest.raises(ValueError, match=r"map_kwargs\['num_proc'\] must be >= 0 or None, got -1"):
        pack_dataset(ds, 24, map_kwargs={"num_proc": -1})
    # A batch_size above the rows and drop_last_batch: map calls nothing, no packs.
    none = pack_dataset(ds, 24, map_kwargs={"batch_size": 2**63 - 1, "drop_last_batch": True})
    assert len(none) == 0 and none.column_names == ["input_ids", "attention_mask", "labels", "seq_lengths"]


def test_map_kwargs_trl_fails_with_are_refused_and_the_rest_are_not_dropped_silently():
    ds = random_dataset(np.random.default_rng(7), 40, 20)
    for key, value in [("batched", True), ("fn_kwargs", {}), ("with_indices", True), ("with_rank", True),
                       ("input_columns", ["input_ids"]), ("num_procs", 2)]:
        with pytest.raises(TypeError, match=rf"map_kwargs\['{key}'\]"):
            pack_dataset(ds, 16, map_kwargs={key: value})
    with pytest.raises(TypeError, match=r"map_kwargs\['batch_size'\] must be an int, got float"):
        pack_dataset(ds, 16, map_kwargs={"batch_size": 2.5})
    with pytest.raises(ValueError, match=r"map_kwargs\['remove_columns'\]: columns \['nope'\]"):
        pack_dataset(ds, 16, map_kwargs={"remove_columns": "nope"})
    # No change to the packs, as in TRL (with_indices=False is map's default).
    quiet = {"with_indices": False, "desc": "packing", "writer_batch_size": 10, "load_from_cache_file": False,
             "keep_in_memory": True, "remove_columns": ["labels"], "disable_nullable": True}
    assert pack_dataset(ds, 16, map_kwargs=quiet)[:] == trl_data_utils.pack_dataset(ds, 16, map_kwargs=quiet)[:]
    with pytest.warns(UserWarning, match=r"map_kwargs\['cache_file_name'\] is not used"):
        pack_dataset(ds, 16, map_kwargs={"cache_file_name": "/nonexistent/packed.arrow"})
    with pytest.warns(UserWarning, match=r"map_kwargs\['cache_file_names'\] is not used"):
        pack_dataset(datasets.DatasetDict({"train": ds}), 16, map_kwargs={"cache_file_names": {"train": "x"}})
    with pytest.raises(TypeError, match=r"map_kwargs\['new_fingerprint'\] is not an argument of DatasetDict.map"):
        pack_dataset(datasets.DatasetDict({"train": ds}), 16, map_kwargs={"new_fingerprint": "f"})
    # features: the output cast to them, as map(features=...) does.
    column = datasets.List(datasets.Value("int32"))
    features = datasets.Features({"input_ids": column, "attention_mask": column, "labels": column,
                                  "seq_lengths": datasets.List(datasets.Value("int64"))})
    ours = pack_dataset(ds, 16, map_kwargs={"features": features})
    theirs = trl_data_utils.pack_dataset(ds, 16, map_kwargs={"features": features})
    assert ours.features == theirs.features == features and ours[:] == theirs[:]
    assert pack_dataset(ds, 16, map_kwargs={"new_fingerprint": "f1"})._fingerprint != \
        pack_dataset(ds, 16, map_kwargs={"new_fingerprint": "f2"})._fingerprint
