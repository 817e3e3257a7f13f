"""seqpack.pack_dataset reads an example's ``loss_mask`` (labels where it is 0 become
``label_pad``, NeMo AutoModel's rule) or refuses it, accepts an ``attention_mask`` of
ones, refuses one that marks padding, and names every other field it does not carry
into the packs."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack import pack_dataset


def test_loss_mask_sets_labels_to_label_pad():
    rows = [{"input_ids": [1, 2, 3], "labels": [4, 5, 6], "loss_mask": [1, 0, 1]},
            {"input_ids": [7, 8], "loss_mask": [False, True]}]
    p = pack_dataset(rows, pack_size=8, mask_first_label=False)[0]
    assert p["labels"].tolist() == [4, -100, 6, -100, 8, -100, -100, -100]
    p = pack_dataset(rows, pack_size=8, label_pad=-1)[0]
    assert p["labels"].tolist() == [-1, -1, 6, -1, 8, -1, -1, -1]


def test_loss_mask_types_and_none():
    rows = [{"input_ids": [1, 2, 3], "labels": [4, 5, 6], "loss_mask": np.array([0.0, 2.5, 1.0])},
            {"input_ids": [7, 8], "labels": [9, 10], "loss_mask": torch.tensor([1, 0])},
            {"input_ids": [11], "labels": [12], "loss_mask": None}]
    p = pack_dataset(rows, pack_size=6, mask_first_label=False)[0]
    assert p["labels"].tolist() == [-100, 5, 6, 9, -100, 12]
    assert rows[0]["labels"] == [4, 5, 6]  # the examples are not modified


def test_loss_mask_applies_before_truncation_and_with_cp():
    rows = [{"input_ids": list(range(1, 10)), "loss_mask": [0, 1, 1, 1, 1, 1, 1, 0, 1]}]
    cut = pack_dataset(rows, pack_size=8, too_long="truncate", mask_first_label=False)[0]
    assert cut["labels"].tolist() == [-100, 2, 3, 4, 5, 6, 7, -100]
    cp = pack_dataset([{"input_ids": [1, 2, 3], "loss_mask": [1, 1, 0]}], pack_size=8, cp_size=2,
                      mask_first_label=False)[0]
    assert cp["labels"].tolist() == [1, 2, -100, -100, -100, -100, -100, -100]


@pytest.mark.parametrize("mask, error, message", [([1, 0], ValueError, r" has 2 values, input_ids 3 tokens"),
                                                  ([[1, 0, 1]], ValueError, r"must be 1-D \(0: no loss"),
                                                  (["a", "b", "c"], TypeError, "values, not numbers"),
                                                  ([], ValueError, r"has 0 values, input_ids 3 tokens")])
def test_loss_mask_that_cannot_be_applied_is_refused(mask, error, message):
    with pytest.raises(error, match=r"examples\[1\]\['loss_mask'\]" + ".*" + message):
        pack_dataset([{"input_ids": [1]}, {"input_ids": [1, 2, 3], "loss_mask": mask}], pack_size=8)


def test_attention_mask_of_ones_is_understood_padding_refused():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pack_dataset([{"input_ids": [1, 2], "attention_mask": [1, 1]}], pack_size=4)
    with pytest.raises(ValueError, match=r"examples\[0\]\['attention_mask'\] is not all ones.*strip the padding"):
        pack_dataset([{"input_ids": [1, 2, 0], "attention_mask": [1, 1, 0]}], pack_size=4)


def test_other_fields_are_named_in_one_warning():
    rows = [{"input_ids": [1, 2]}, {"input_ids": [3], "position_ids": [0], "text": "x"},
            {"input_ids": [4], "text": "y"}]
    with pytest.warns(UserWarning, match=r"'position_ids' \(first in examples\[1\]\), 'text' \(first in "
                                         r"examples\[1\]\) not carried into the packs") as record:
        pack_dataset(rows, pack_size=8)
    assert len(record) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pack_dataset([[1, 2], {"input_ids": [3], "labels": [4], "loss_mask": [1]}], pack_size=8)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 2)), max_size=8), min_size=1, max_size=8))
def test_every_label_is_masked_exactly_where_the_mask_is_zero(examples):
    rows = [{"input_ids": [t for t, _ in ex], "loss_mask": [m for _, m in ex]} for ex in examples]
    packs = pack_dataset(rows, pack_size=8, mask_first_label=False)
    got = []
    for p in packs:
        start = 0
        for n, span in zip(p["seq_lens"].tolist(), p["seq_lens_padded"].tolist()):
            got.append(p["labels"][start:start + n].tolist())
            start += span
    assert got == [[t if m else -100 for t, m in ex] for ex in examples]
