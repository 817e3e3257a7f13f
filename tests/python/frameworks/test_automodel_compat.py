"""seqpack.integrations.automodel against the installed NeMo AutoModel 0.7: the same
``datasets.Dataset`` (columns, Arrow types, rows, values) or the same error from
``pack_dataset`` on random datasets and every edge (empty rows, loss masks, CP and
``pad_to_multiple_of`` padding, sizes that are not a multiple of it, ``max_packs``,
over-long rows dropped or raised, no packs), from lists, Arrow datasets (shuffled,
chunked, a DatasetDict split), map-style and iterable datasets; and the same batches
from ``packed_sequence_thd_collater``. Where AutoModel cuts a row across packs or fails
with an IndexError, seqpack's refusal is checked instead."""

import copy
import logging
import warnings

import numpy as np
import pytest

datasets = pytest.importorskip("datasets")
torch = pytest.importorskip("torch")
packed_sequence = pytest.importorskip("nemo_automodel.components.datasets.llm.packed_sequence")
automodel_utils = pytest.importorskip("nemo_automodel.components.datasets.utils")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from seqpack.integrations.automodel import pack_dataset, packed_sequence_thd_collater  # noqa: E402

datasets.disable_progress_bars()


@pytest.fixture(autouse=True)
def _quiet_automodel():
    logging.getLogger(packed_sequence.__name__).setLevel(logging.ERROR)
    yield


def automodel(data, kwargs, split=None):
    try:
        return packed_sequence.pack_dataset(copy.deepcopy(data) if isinstance(data, list) else data, split, **kwargs)
    except Exception as e:  # noqa: BLE001
        return e


def seqpack_(data, kwargs, split=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return pack_dataset(data, split, **kwargs)
        except Exception as e:  # noqa: BLE001
            return e


def padded(length, kwargs):
    cp, multiple = kwargs.get("cp_size", 1), kwargs.get("pad_to_multiple_of", 1)
    factor = np.lcm(2 * cp if cp > 1 else 1, multiple)
    return -(-length // factor) * factor


def assert_same(theirs, ours, rows, kwargs):
    size = kwargs["packed_sequence_size"]
    if isinstance(ours, ValueError) and "padded to" in str(ours):
        # seqpack refuses a row that fits but whose padding does not: AutoModel fails on it
        # (IndexError), cuts it across packs (packs whose padded lengths do not sum to the
        # size), or fails later on.
        row = int(str(ours).split()[1])
        assert len(rows[row]["input_ids"]) <= size < padded(len(rows[row]["input_ids"]), kwargs)
        assert isinstance(theirs, (IndexError, ValueError)) or any(
            sum(p["seq_lens_padded"]) != size or not p["seq_lens"] for p in theirs)
        return
    if isinstance(theirs, Exception):
        assert type(ours) is type(theirs) and str(ours).startswith(str(theirs)), (theirs, ours)
        return
    assert not isinstance(ours, Exception), (ours, theirs)
    assert ours.to_dict() == theirs.to_dict()
    assert ours.features == theirs.features and ours.info == theirs.info
    assert ours.data.schema.equals(theirs.data.schema, check_metadata=True)
    assert ours.format == theirs.format and ours.split == theirs.split


def random_case(rng):
    size = int(rng.integers(1, 40))
    kwargs = dict(packed_sequence_size=size, cp_size=int(rng.choice([1, 1, 2, 3, 4])),
                  drop_long_samples=bool(rng.random() < 0.7), padding_idx=int(rng.integers(-3, 6)))
    if rng.random() < 0.4:
        kwargs["max_packs"] = int(rng.integers(0, 5))
    if rng.random() < 0.3:
        kwargs["pad_to_multiple_of"] = int(rng.choice([d for d in range(1, size + 1) if size % d == 0]))
    mask = rng.random() < 0.5
    rows = []
    for _ in range(int(rng.integers(1, 30))):
        n = int(rng.integers(0, size + 5)) if rng.random() < 0.85 else 0
        row = {"input_ids": rng.integers(0, 1000, n).tolist(), "labels": rng.integers(-100, 1000, n).tolist()}
        if mask:
            row["loss_mask"] = rng.integers(0, 2, n).tolist()
        rows.append(row)
    return rows, kwargs


@pytest.mark.parametrize("seed", range(6))
def test_random_datasets_as_lists_and_arrow(seed):
    rng = np.random.default_rng(seed)
    for _ in range(40):
        rows, kwargs = random_case(rng)
        assert_same(automodel(rows, kwargs), seqpack_(rows, kwargs), rows, kwargs)
        ds = datasets.Dataset.from_list(rows)
        assert_same(automodel(ds, kwargs), seqpack_(ds, kwargs), rows, kwargs)


def test_shuffled_chunked_selected_and_dataset_dict():
    rng = np.random.default_rng(7)
    for _ in range(25):
        rows, kwargs = random_case(rng)
        ds = datasets.Dataset.from_list(rows)
        shuffled = datasets.concatenate_datasets([ds, ds.select(range(len(ds) // 2))]).shuffle(seed=1)
        view = [shuffled[i] for i in range(len(shuffled))]
        assert_same(automodel(shuffled, kwargs), seqpack_(shuffled, kwargs), view, kwargs)
        dd = datasets.DatasetDict({"train": shuffled, "test": ds})
        assert_same(automodel(dd, kwargs, "train"), seqpack_(dd, kwargs, "train"), view, kwargs)


def test_map_style_iterable_and_streaming_inputs():
    rng = np.random.default_rng(11)
    for _ in range(15):
        rows, kwargs = random_case(rng)

        class MapStyle(torch.utils.data.Dataset):
            def __len__(self):
                return len(rows)

            def __getitem__(self, i):
                return copy.deepcopy(rows[i])

        class Iterable(torch.utils.data.IterableDataset):
            def __iter__(self):
                return iter(copy.deepcopy(rows))

        for data in (MapStyle(), Iterable(), datasets.Dataset.from_list(rows).to_iterable_dataset()):
            assert_same(automodel(data, kwargs), seqpack_(data, kwargs), rows, kwargs)


def test_edges():
    def seq(*lengths):
        return [{"input_ids": [7 * i + k for k in range(n)], "labels": [k for k in range(n)],
                 "loss_mask": [k % 2 for k in range(n)]} for i, n in enumerate(lengths)]

    cases = [(seq(), dict(packed_sequence_size=8)), (seq(0, 0, 0), dict(packed_sequence_size=8)),
             (seq(9, 10), dict(packed_sequence_size=8)), (seq(9, 3), dict(packed_sequence_size=8,
                                                                           drop_long_samples=False)),
             (seq(8, 0, 0, 8, 0), dict(packed_sequence_size=8)), (seq(0, 8, 1), dict(packed_sequence_size=8)),
             (seq(5, 5, 5, 99), dict(packed_sequence_size=8, max_packs=2, drop_long_samples=False)),
             (seq(5, 5, 5), dict(packed_sequence_size=8, max_packs=3)),
             (seq(5, 5), dict(packed_sequence_size=8, max_packs=0)),
             (seq(99, 5), dict(packed_sequence_size=8, max_packs=0, drop_long_samples=False)),
             (seq(3, 2, 5, 1), dict(packed_sequence_size=11, cp_size=2)),
             (seq(3, 11, 2), dict(packed_sequence_size=11, cp_size=2)),
             (seq(11, 2), dict(packed_sequence_size=11, cp_size=2)),
             (seq(5, 5, 11), dict(packed_sequence_size=11, cp_size=2, max_packs=2)),
             (seq(3, 5, 1, 6, 2), dict(packed_sequence_size=24, cp_size=2, pad_to_multiple_of=3)),
             (seq(3), dict(packed_sequence_size=10, pad_to_multiple_of=3)),
             (seq(3, 2), dict(packed_sequence_size=8, padding_idx=2 ** 40)),
             (seq(1, 1, 1), dict(packed_sequence_size=1))]
    for rows, kwargs in cases:
        assert_same(automodel(rows, kwargs), seqpack_(rows, kwargs), rows, kwargs)
        if rows:
            ds = datasets.Dataset.from_list(rows)
            assert_same(automodel(ds, kwargs), seqpack_(ds, kwargs), rows, kwargs)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 20), max_size=25), st.integers(1, 20), st.sampled_from([1, 2, 3]),
       st.one_of(st.none(), st.integers(0, 4)), st.booleans())
def test_hypothesis_lengths(lengths, size, cp, max_packs, drop):
    rows = [{"input_ids": [i] * n, "labels": list(range(n)), "loss_mask": [(i + k) % 2 for k in range(n)]}
            for i, n in enumerate(lengths)]
    kwargs = dict(packed_sequence_size=size, cp_size=cp, max_packs=max_packs, drop_long_samples=drop)
    assert_same(automodel(rows, kwargs), seqpack_(rows, kwargs), rows, kwargs)


def test_thd_collater_matches():
    rng = np.random.default_rng(3)
    for _ in range(10):
        rows, kwargs = random_case(rng)
        kwargs.pop("max_packs", None)
        kwargs["drop_long_samples"] = True
        packs = seqpack_(rows, kwargs)
        if isinstance(packs, Exception):
            continue
        batch = [packs[i] for i in range(len(packs))]
        theirs = automodel_utils.packed_sequence_thd_collater(copy.deepcopy(batch))
        ours = packed_sequence_thd_collater(batch)
        assert theirs.keys() == ours.keys()
        for key in theirs:
            if isinstance(theirs[key], torch.Tensor):
                assert theirs[key].dtype == ours[key].dtype and torch.equal(theirs[key], ours[key]), key
            else:
                assert theirs[key] == ours[key]
    unpacked = [{"input_ids": [1, 2, 3], "labels": [2, 3, -100], "attention_mask": [1, 1, 0],
                 "___PAD_TOKEN_IDS___": {"input_ids": 9}}, {"input_ids": [4], "labels": [5], "attention_mask": [1]}]
    theirs = automodel_utils.packed_sequence_thd_collater(copy.deepcopy(unpacked))
    ours = packed_sequence_thd_collater(unpacked)
    assert all(torch.equal(theirs[k], ours[k]) for k in theirs if k != "qkv_format")
