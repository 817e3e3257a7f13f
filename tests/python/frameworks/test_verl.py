"""seqpack.verl: verl's round trip, the strict cap (verl#7553's example), errors."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack.verl import ceildiv, get_reverse_idx, rearrange_micro_batches, roundup_divisible


def random_batch(rows, width, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(width // 2, width + 1, (rows,), generator=g)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    return {"input_ids": torch.randint(0, 1000, (rows, width), generator=g), "attention_mask": mask}


def test_round_trip_like_verls_test():
    batch = random_batch(20, 100)
    mbs, idx = rearrange_micro_batches(batch, max_token_len=300)
    merged = torch.cat([mb["input_ids"] for mb in mbs])
    reverse = get_reverse_idx([i for part in idx for i in part])
    assert torch.equal(merged[reverse], batch["input_ids"])
    assert all(int(mb["attention_mask"].sum()) <= 300 for mb in mbs)
    assert all(part == sorted(part) for part in idx)


def test_strict_cap_on_the_pr_example():
    # verl partitions 8 rows of 7 tokens into ceil(56 / 8) = 7 parts: one holds 14 tokens.
    mask = torch.ones(8, 7, dtype=torch.long)
    mbs, idx = rearrange_micro_batches({"attention_mask": mask}, max_token_len=8)
    assert len(mbs) == 8 and all(len(p) == 1 for p in idx)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 64), min_size=1, max_size=48), cap=st.integers(64, 256),
       divisor=st.sampled_from([None, 2, 3]), min_num=st.sampled_from([None, 1, 4]), balance=st.booleans())
def test_properties(lengths, cap, divisor, min_num, balance):
    mask = (torch.arange(64)[None, :] < torch.tensor(lengths)[:, None]).long()
    try:
        mbs, idx = rearrange_micro_batches({"attention_mask": mask, "row": torch.arange(len(lengths))}, cap,
                                           num_batches_divided_by=divisor, min_num_micro_batch=min_num,
                                           use_dynamic_bsz_balance=balance)
    except ValueError as exc:  # too few rows for min_num or for a multiple of the divisor
        assert "micro-batch" in str(exc) and (divisor or (min_num or 1) > len(lengths))
        return
    assert sorted(i for p in idx for i in p) == list(range(len(lengths)))
    assert all(int(mb["attention_mask"].sum()) <= cap for mb in mbs)
    assert len(mbs) >= max(min_num or 1, ceildiv(sum(lengths), cap)) and len(mbs) % (divisor or 1) == 0
    assert all(mb["row"].tolist() == p for mb, p in zip(mbs, idx))


def test_helpers_and_errors():
    assert ceildiv(7, 3) == 3 and ceildiv(6, 3) == 2 and roundup_divisible(7, 4) == 8 and roundup_divisible(8, 4) == 8
    assert get_reverse_idx([2, 0, 3, 1]) == [1, 3, 0, 2]
    with pytest.raises(ValueError, match="more than max_token_len=4"):
        rearrange_micro_batches({"attention_mask": torch.ones(2, 5)}, 4)
    with pytest.raises(ValueError, match="attention_mask"):
        rearrange_micro_batches({"x": torch.ones(2, 5)}, 4)
    with pytest.raises(ValueError, match="max_token_len must be positive"):
        rearrange_micro_batches({"attention_mask": torch.ones(2, 5)}, 0)
