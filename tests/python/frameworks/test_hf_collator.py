"""``seqpack.integrations.hf.PackingCollator`` against transformers'
``DataCollatorWithFlattening`` (5.24; issue 27, item 3): the same keys in the same
order, types, dtypes, shapes and values for every combination of its options
(``return_position_ids``, ``separator_id`` at construction and per call,
``return_flash_attn_kwargs``, ``return_seq_idx``, ``position_ids_start``,
``return_tensors`` "pt" / "np"), with empty examples dropped as transformers drops
them and the all-empty batch refused.

Recorded cases (``data/hf_flattening_cases.json``, written by
``data/make_hf_cases.py`` with transformers) run without transformers; the
differential tests run transformers itself on random batches and input types.
"""

import itertools
import json
import pathlib
import random
import warnings

import numpy as np
import pytest

from seqpack.integrations import hf

CASES = json.loads((pathlib.Path(__file__).parent / "data" / "hf_flattening_cases.json").read_text())
OPTIONS = list(itertools.product([True, False], [True, False], [True, False], [0, 3], [-100, 5]))


def _plain(value):
    """(type, dtype, shape, values) of one output entry."""
    if isinstance(value, int):
        return ("int", None, None, value)
    kind = "np" if isinstance(value, np.ndarray) else "pt"
    array = np.asarray(value)
    return (kind, str(value.dtype).replace("torch.", ""), list(array.shape), array.tolist())


def _decoded(entry):
    if "int" in entry:
        return ("int", None, None, entry["int"])
    return (entry["kind"], entry["dtype"], entry["shape"], entry["values"])


def assert_same(got, want):
    assert list(got) == list(want), "keys (and their order)"
    for key in want:
        assert _plain(got[key]) == _plain(want[key]), key


@pytest.mark.parametrize("i", range(len(CASES["cases"])))
def test_recorded_transformers_outputs(i):
    case = CASES["cases"][i]
    if case["init"].get("return_tensors", "pt") == "pt":
        pytest.importorskip("torch")
    got = hf.PackingCollator(**case["init"])(case["features"], **case["call"])
    assert list(got) == [k for k, _ in case["output"]]
    for key, entry in case["output"]:
        assert _plain(got[key]) == _decoded(entry), key


def test_recorded_refusals():
    assert CASES["errors"]  # all-empty batches and no examples: transformers' ValueError
    for case in CASES["errors"]:
        with pytest.raises(ValueError, match="empty"):
            hf.PackingCollator()(case["features"])


def test_defaults_are_transformers_defaults():
    c = hf.PackingCollator()
    assert (c.return_position_ids, c.separator_id, c.return_seq_idx, c.position_ids_start, c.return_tensors) == \
        (True, -100, False, 0, "pt")
    assert c.flash_attn_kwargs() is False  # transformers' return_flash_attn_kwargs=False
    assert hf.PackingCollator(pad_to_multiple_of=4).flash_attn_kwargs() is True  # seqpack's padded layout
    assert hf.PackingCollator(mrope_text_row=False).flash_attn_kwargs() is True
    assert hf.PackingCollator(pad_to_multiple_of=4, return_flash_attn_kwargs=False).flash_attn_kwargs() is False


def _random_batch(rng, labels, as_type):
    out = []
    for _ in range(rng.randint(1, 6)):
        n = rng.choice([0, 0, 1, 2, 3, 6, 11])
        ids = [rng.randint(0, 500) for _ in range(n)]
        example = {"input_ids": ids}
        if labels:
            example["labels"] = [rng.choice([-100, rng.randint(0, 500)]) for _ in range(n)]
        out.append({k: as_type(v) for k, v in example.items()})
    if all(len(e["input_ids"]) == 0 for e in out):
        out.append({k: as_type([9, 8]) for k in (("input_ids", "labels") if labels else ("input_ids",))})
    return out


@pytest.mark.parametrize("fmt", ["pt", "np"])
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(map(str, o)))
def test_equals_transformers_on_random_batches(opts, fmt):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    position_ids, flash, seq_idx, start, sep = opts
    kw = dict(return_position_ids=position_ids, return_flash_attn_kwargs=flash, return_seq_idx=seq_idx,
              position_ids_start=start, separator_id=sep)
    theirs = transformers.DataCollatorWithFlattening(return_tensors=fmt, **kw)
    ours = hf.PackingCollator(return_tensors=fmt, **kw)
    rng = random.Random(hash(opts) % 1000 + len(fmt))
    types = [list, np.array, lambda v: torch.tensor(v, dtype=torch.long)]
    for trial in range(12):
        feats = _random_batch(rng, labels=trial % 2 == 0, as_type=types[trial % 3])
        assert_same(ours(feats), theirs(feats))
        other = "np" if fmt == "pt" else "pt"  # per-call overrides
        assert_same(ours(feats, return_tensors=other, separator_id=-7), theirs(feats, other, separator_id=-7))


def test_empty_examples_are_dropped_before_numbering():
    out = hf.PackingCollator(return_seq_idx=True, return_flash_attn_kwargs=True)(
        [{"input_ids": []}, {"input_ids": [4, 5]}, {"input_ids": [], "pixel_values": None}, {"input_ids": [6]}])
    assert out["seq_idx"].tolist() == [[0, 0, 1]] and out["cu_seq_lens_q"].tolist() == [0, 2, 3]
    for feats in ([], [{"input_ids": []}], [{"input_ids": np.zeros(0, dtype=np.int64)}]):
        with pytest.raises(ValueError, match="every example of the batch is empty"):
            hf.PackingCollator()(feats)


def test_refusals_name_the_rule():
    with pytest.raises(ValueError, match="return_tensors must be one of"):
        hf.PackingCollator(return_tensors="tf")([{"input_ids": [1]}])
    with pytest.raises(ValueError, match="return_tensors must be one of"):
        hf.PackingCollator()([{"input_ids": [1]}], return_tensors="jax")
    with pytest.raises(TypeError, match="separator_id"):
        hf.PackingCollator(separator_id="x")([{"input_ids": [1]}])
    with pytest.raises(TypeError, match="position_ids_start"):
        hf.PackingCollator(position_ids_start=1.5)([{"input_ids": [1]}])
    # transformers reads labels from the first example's choice (KeyError, or later labels ignored).
    with pytest.raises(ValueError, match=r"features\[2\] has none, features\[0\] has some"):
        hf.PackingCollator()([{"input_ids": [1], "labels": [1]}, {"input_ids": []}, {"input_ids": [3]}])
    with pytest.raises(ValueError, match=r"features\[1\]: labels and input_ids differ in length"):
        hf.PackingCollator()([{"input_ids": [1], "labels": [1]}, {"input_ids": [3, 4], "labels": [3]}])


def test_numpy_scalars_and_dropped_keys():
    out = hf.PackingCollator(separator_id=np.int64(-1), position_ids_start=np.int32(2), return_tensors="np")(
        [{"input_ids": [1, 2], "attention_mask": [1, 1]}])
    assert out["labels"].tolist() == [[-1, 2]] and out["position_ids"].tolist() == [[2, 3]]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf.PackingCollator()([{"input_ids": [1, 2], "token_type_ids": [0, 0], "attention_mask": [1, 1]}])
    assert len(caught) == 1 and "['token_type_ids']" in str(caught[0].message)  # attention_mask: no warning


def test_seqpack_extras_with_the_new_options():
    out = hf.PackingCollator(pad_to_multiple_of=4, pad_token_id=9, return_seq_idx=True, position_ids_start=2,
                             separator_id=-1, return_tensors="np")(
        [{"input_ids": [1, 2, 3]}, {"input_ids": []}, {"input_ids": [4]}])
    assert list(out) == ["input_ids", "labels", "position_ids", "seq_idx", "cu_seq_lens_q", "cu_seq_lens_k",
                         "max_length_q", "max_length_k"]
    assert out["input_ids"].tolist() == [[1, 2, 3, 9, 4, 9, 9, 9]]
    assert out["labels"].tolist() == [[-1, 2, 3, -100, -1, -100, -100, -100]]
    assert out["position_ids"].tolist() == [[2, 3, 4, 5, 2, 3, 4, 5]]  # padding continues the positions
    assert out["seq_idx"].tolist() == [[0, 0, 0, 0, 1, 1, 1, 1]] and out["seq_idx"].dtype == np.int32
    assert out["cu_seq_lens_q"].tolist() == [0, 4, 8] and out["max_length_q"] == 4
    # M-RoPE examples in NumPy: the text row starts at position_ids_start, the M-RoPE rows as given.
    mrope = [[0, 1, 1, 3], [0, 1, 2, 3], [0, 1, 2, 3]]
    out = hf.PackingCollator(position_ids_start=1, return_tensors="np")(
        [{"input_ids": [7, 8, 8, 9], "position_ids": mrope, "image_grid_thw": [[1, 2, 2]]}, {"input_ids": [4]}])
    assert out["position_ids"].shape == (4, 1, 5) and isinstance(out["position_ids"], np.ndarray)
    assert out["position_ids"][:, 0].tolist() == [[1, 2, 3, 4, 1], [0, 1, 1, 3, 0], [0, 1, 2, 3, 0],
                                                  [0, 1, 2, 3, 0]]
    assert isinstance(out["image_grid_thw"], np.ndarray) and out["image_grid_thw"].tolist() == [[1, 2, 2]]
