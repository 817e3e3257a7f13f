"""A StepPlan drives the framework adapters: NeMo-RL's BatchedDataDict sharding and
iterators, verl's rearrange_micro_batches and ROLL's sequence-packing iterator; an
empty micro-batch becomes a one-token dummy with zero loss masks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import seqpack
from seqpack import BatchedDataDict, CostModel, plan_step
from seqpack.frameworks import roll
from seqpack.frameworks._batch import dummy_row
from seqpack.frameworks.batched_data_dict import BatchedDataDictError
from seqpack.verl import get_reverse_idx, rearrange_micro_batches

# 2 global batches of 5 rows at dp 2: 5 rows cannot fill 2 ranks x 3 micro-batches,
# so one rank runs a dummy in each.
LENGTHS = [9, 1, 8, 2, 7, 9, 8, 7, 1, 1]


def make_data(lengths, width=10):
    n = len(lengths)
    ids = torch.arange(n * width).reshape(n, width) + 1
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    return ids, mask


def test_batched_data_dict_shards_follow_the_plan_with_dummies():
    plan = plan_step(LENGTHS, dp_size=2, max_tokens=10, mini_batches=2, min_micro_batches=3)
    assert plan.num_micro_batches == [3, 3] and plan.num_dummies == 2
    ids, mask = make_data(LENGTHS)
    data = BatchedDataDict(input_ids=ids, input_lengths=torch.tensor(LENGTHS), token_mask=mask,
                           sample_mask=torch.ones(len(LENGTHS)))
    shards, order = data.shard_by_batch_size(2, batch_size=5, step_plan=plan)
    assert order == plan.rank_rows(0) + plan.rank_rows(1)
    for s, shard in enumerate(shards):
        assert shard["input_lengths"].tolist() == [LENGTHS[i] for i in plan.rank_rows(s)]
        for m in range(2):
            gb = shard.get_batch(m)
            mbs = list(gb.make_microbatch_iterator_for_packable_sequences())
            assert len(mbs) == 3  # the same count on every rank
            for cell, mb in zip(plan.assignment[m][s], mbs):
                if cell:
                    assert mb["input_lengths"].tolist() == [LENGTHS[i] for i in cell]
                else:  # the dummy: one row, one token, nothing for the loss
                    assert mb["input_lengths"].tolist() == [1]
                    assert mb["token_mask"].sum() == 0 and mb["sample_mask"].sum() == 0
                    assert mb["input_ids"].shape == (1, 10)
            packed = list(gb.make_packed_microbatch_iterator(["input_ids", "token_mask"]))
            assert [int(p.cu_seqlens[-1]) for p in packed] == [
                sum(LENGTHS[i] for i in cell) or 1 for cell in plan.assignment[m][s]]


def test_batched_data_dict_rejects_a_plan_of_other_data():
    data = BatchedDataDict(input_lengths=torch.tensor(LENGTHS))
    plan = plan_step(LENGTHS, dp_size=2, max_tokens=10, mini_batches=2)
    with pytest.raises(ValueError, match="dp_size=2, not shards=3"):
        data.shard_by_batch_size(3, step_plan=plan)
    with pytest.raises(ValueError, match="not the global batches of batch_size=10"):
        data.shard_by_batch_size(2, batch_size=10, step_plan=plan)
    with pytest.raises(ValueError, match="covers 4 rows, the data has 10"):
        data.shard_by_batch_size(2, step_plan=plan_step([1, 2, 3, 4], 2, 10))
    with pytest.raises(ValueError, match="cannot be combined"):
        data.shard_by_batch_size(2, step_plan=plan, sequence_packing_args={})


def test_verl_rearrange_micro_batches_takes_a_plan():
    plan = plan_step(LENGTHS, dp_size=2, max_tokens=10, cost=CostModel.verl(), mini_batches=2, min_micro_batches=3)
    ids, mask = make_data(LENGTHS)
    for r in range(2):
        for m in range(2):
            rows = plan.rank_rows(r, m)
            batch = {"input_ids": ids[rows], "attention_mask": mask[rows], "response_mask": mask[rows]}
            mbs, idx = rearrange_micro_batches(batch, max_token_len=10, step_plan=plan, dp_rank=r, mini_batch=m)
            assert len(mbs) == 3 and idx == plan.local_micro_batches(r, m)
            for part, mb in zip(idx, mbs):
                if part:
                    assert mb["attention_mask"].sum(-1).tolist() == [LENGTHS[rows[p]] for p in part]
                else:
                    assert mb["attention_mask"].sum().item() == 1 and mb["response_mask"].sum() == 0
            flat = sum(idx, [])
            assert sorted(flat) == list(range(len(rows)))
            assert [flat[i] for i in get_reverse_idx(flat)] == list(range(len(rows)))
    batch = {"attention_mask": mask[plan.rank_rows(0, 0)]}
    with pytest.raises(ValueError, match=r"build it from step_plan.rank_rows\(1, 0\)"):
        rearrange_micro_batches(batch, 10, step_plan=plan, dp_rank=1)
    with pytest.raises(ValueError, match="above max_token_len=9"):
        rearrange_micro_batches(batch, 9, step_plan=plan, dp_rank=0)
    with pytest.raises(TypeError, match="dp_rank must be an int"):
        rearrange_micro_batches(batch, 10, step_plan=plan)


def test_roll_iterator_takes_a_plan_and_flags_dummies():
    plan = plan_step(LENGTHS, dp_size=2, max_tokens=10, mini_batches=2, min_micro_batches=3)
    ids, mask = make_data(LENGTHS)
    for r in range(2):
        rows = plan.rank_rows(r, 1)
        mini = roll.RollBatch({"input_ids": ids[rows], "attention_mask": mask[rows]}, meta_info={})
        mbs = list(roll.make_micro_batch_iter_for_sequence_packing(mini, max_packed_sequence_length=10,
                                                                   step_plan=plan, dp_rank=r, mini_batch_index=1))
        assert [mb.meta_info["is_padding_batch"] for mb in mbs] == [not c for c in plan.assignment[1][r]]
        real = [mb for mb in mbs if not mb.meta_info["is_padding_batch"]]
        assert sum(int(mb["attention_mask"].sum()) for mb in real) == sum(LENGTHS[i] for i in rows)


def test_dummy_row_needs_a_row_and_keeps_shapes():
    row = dummy_row({"labels": np.array([[3, 4]]), "attention_mask": np.array([[0, 0]])}, name="mb")
    assert row["labels"].tolist() == [[-100, -100]] and row["attention_mask"].tolist() == [[1, 0]]
    with pytest.raises(ValueError, match="mb has no rows"):
        dummy_row({"attention_mask": np.zeros((0, 3))}, name="mb")
    assert seqpack.StepPlan is type(plan_step([1], 1, 1))


def test_static_shapes_reach_the_packed_micro_batches():
    """A plan with static_shapes: each shard's packed micro-batches come out at their
    bucket sizes (dummies too); a pad multiple that would overflow a bucket is named."""
    lengths = [1800, 400, 950, 1200, 600, 2000, 700, 300, 5, 64, 900]
    plan = seqpack.plan_step(lengths, 2, 2048, static_shapes=[512, 1024, 2048])
    data = BatchedDataDict(input_ids=torch.randint(0, 100, (len(lengths), 2100)),
                           input_lengths=torch.tensor(lengths))
    shards, _ = data.shard_by_batch_size(shards=2, step_plan=plan)
    for r, shard in enumerate(shards):
        batch = shard.get_batch(0)
        assert batch.micro_batch_static_lengths == [plan.padded_tokens[0][r]]
        packed = list(batch.make_packed_microbatch_iterator())
        assert [mb["input_ids"].shape[0] for mb in packed] == plan.padded_tokens[0][r]
        for mb, cell in zip(packed, plan.assignment[0][r]):  # the real tokens are intact
            assert mb.layout.cu_seqlens[len(cell)] == sum(lengths[i] for i in cell) or not cell
    with pytest.raises(BatchedDataDictError, match="more than its static shape"):
        list(shards[1].get_batch(0).make_packed_microbatch_iterator(pad_multiple=256))
    plain = seqpack.plan_step(lengths, 2, 2048)
    shards, _ = data.shard_by_batch_size(shards=2, step_plan=plain)
    assert shards[0].get_batch(0).micro_batch_static_lengths is None
