"""seqpack.roll: ROLL's test vectors and doc examples, hard caps, restore order, errors."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack import reference, roll


def batch(lengths, width=None, extra=True):
    width = width or max(lengths)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    out = {"attention_mask": mask}
    if extra:
        out["input_ids"] = torch.arange(len(lengths) * width).reshape(len(lengths), width)
        out["row"] = torch.arange(len(lengths))
        out["names"] = [f"r{i}" for i in range(len(lengths))]
    return out


# ---------------------------------------------------------------- dynamic batching


def test_roll_test_vector_and_mini_batches():
    data, metrics = roll.dynamic_batching_shard(batch([2, 4, 7, 6, 3, 4], width=20), 2, 20, 2)
    assert data.meta_info["global_micro_batch_indices"] == [[0, 2], [2, 3]]
    assert data.meta_info["global_micro_batch_lengths"] == [4, 8] and data.meta_info["num_micro_batchs"] == 2
    first_rank = data.slice(0, 3)
    mini = next(roll.make_mini_batch_iter_for_dynamic_batching(first_rank, epochs=1, ga_steps=1))
    assert mini.meta_info["micro_batch_indices"] == [[0, 2]]
    micro = next(roll.make_micro_batch_iter_for_dynamic_batching(mini))
    assert tuple(micro["input_ids"].shape) == (2, 4)
    assert metrics["dynamic_batching/actual_tokens_origin"] == 120
    assert metrics["dynamic_batching/actual_tokens"] == 2 * (2 * 4 + 8)


def test_roll_doc_example_at_cap_10_is_52_tokens():
    # The doc's picture totals 56 tokens only by breaking its own cap of 10 (2 rows x 6);
    # ROLL's rule gives four single-row micro-batches per shard: 52 tokens.
    data, metrics = roll.dynamic_batching_shard(batch([7, 6, 8, 5, 1, 3, 8, 6], width=10), 2, 10, 2)
    assert data.meta_info["micro_batch_lengths"] == [4, 6, 8, 8]
    assert data["row"].tolist() == [4, 3, 7, 2, 5, 1, 0, 6]
    assert metrics["dynamic_batching/actual_tokens"] == 52 and metrics["dynamic_batching/valid_tokens"] == 44
    _, at_12 = roll.dynamic_batching_shard(batch([7, 6, 8, 5, 1, 3, 8, 6], width=10), 2, 12, 2)
    assert at_12["dynamic_batching/actual_tokens"] == 56


def test_vpp_split_and_keep_mini_batch():
    full = {"attention_mask": torch.ones(8, 8, dtype=torch.long), "input_ids": torch.arange(64).reshape(8, 8)}
    data, _ = roll.dynamic_batching_shard(full, 1, 8, 8)
    assert data.meta_info["global_micro_batch_indices"] == [[i, i + 1] for i in range(8)]
    minis = list(roll.make_mini_batch_iter_for_dynamic_batching(data, epochs=3, ga_steps=2, keep_mini_batch=True,
                                                                mini_batch_size=4))
    assert len(minis) == 6 and all(m.meta_info["micro_batch_indices"] == [[0, 1], [1, 2], [2, 3], [3, 4]]
                                   for m in minis)
    one, _ = roll.dynamic_batching_shard(full, 1, 64, 8)
    assert one.meta_info["global_micro_batch_indices"] == [[0, 8]]
    minis = list(roll.make_mini_batch_iter_for_dynamic_batching(one, epochs=3, ga_steps=2, keep_mini_batch=True,
                                                                mini_batch_size=4))
    assert len(minis) == 6 and minis[0].meta_info["micro_batch_indices"] == [[0, 4]]
    assert minis[1]["input_ids"][:, 0].tolist() == [32, 40, 48, 56]
    split, _ = roll.dynamic_batching_shard(full, 1, 64, 8, 4, 2)
    assert split.meta_info["global_micro_batch_indices"] == [[0, 2], [2, 4], [4, 6], [6, 8]]
    minis = list(roll.make_mini_batch_iter_for_dynamic_batching(split, 1, keep_mini_batch=True, mini_batch_size=4,
                                                                pipeline_model_parallel_size=4,
                                                                virtual_pipeline_model_parallel_size=2))
    assert [m.meta_info["micro_batch_indices"] for m in minis] == [[[0, 1], [1, 2], [2, 3], [3, 4]]] * 2
    assert "micro_batch_indices" in split.meta_info and split.meta_info["micro_batch_indices"] == \
        [[0, 2], [2, 4], [4, 6], [6, 8]]


def test_mini_batch_metadata_cases():
    def with_ranges(ranges, lengths, rows):
        b = roll.RollBatch({"input_ids": torch.zeros(rows, 8)})
        b.meta_info.update(global_micro_batch_indices=ranges, global_micro_batch_lengths=lengths)
        return b

    minis = list(roll.make_mini_batch_iter_for_dynamic_batching(
        with_ranges([[0, 2], [2, 4], [4, 5], [5, 8]], [8] * 4, 8), 1, keep_mini_batch=True, mini_batch_size=4))
    assert [m.meta_info["micro_batch_indices"] for m in minis] == [[[0, 2], [2, 4]], [[0, 1], [1, 4]]]
    minis[0].meta_info["micro_batch_lengths"].append(99)
    assert minis[1].meta_info["micro_batch_lengths"] == [8, 8]
    six = list(roll.make_mini_batch_iter_for_dynamic_batching(with_ranges([[0, 6]], [2], 6), 1, ga_steps=8,
                                                              keep_mini_batch=True, mini_batch_size=2))
    assert [m.meta_info["micro_batch_indices"] for m in six] == [[[0, 2]]] * 3
    pp = list(roll.make_mini_batch_iter_for_dynamic_batching(with_ranges([[0, 4], [4, 8]], [2, 2], 8), 1,
                                                             keep_mini_batch=True, mini_batch_size=4,
                                                             pipeline_model_parallel_size=4,
                                                             virtual_pipeline_model_parallel_size=2))
    assert [m.meta_info["micro_batch_lengths"] for m in pp] == [[2, 2, 2, 2]] * 2
    with pytest.raises(ValueError, match="cannot be split into a multiple"):
        list(roll.make_mini_batch_iter_for_dynamic_batching(with_ranges([[0, 1], [1, 2]], [2, 2], 2), 1,
                                                            keep_mini_batch=True, mini_batch_size=2,
                                                            pipeline_model_parallel_size=4,
                                                            virtual_pipeline_model_parallel_size=2))
    for ranges, message in (([[0, 2], [3, 4]], "contiguous"), ([[0, 2]], "complete local batch"),
                            ([[0, 3], [2, 4]], "contiguous")):
        with pytest.raises(ValueError, match=message):
            roll.make_mini_batch_iter_for_dynamic_batching(with_ranges(ranges, [1] * len(ranges), 4), 1,
                                                           keep_mini_batch=True, mini_batch_size=2)


@pytest.mark.filterwarnings("ignore:The attention_mask is all zero")
@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 60), min_size=2, max_size=40), dp=st.sampled_from([1, 2]),
       round_to=st.sampled_from([1, 4, 8]))
def test_dynamic_batching_matches_reference(lengths, dp, round_to):
    lengths = lengths[: len(lengths) // dp * dp]
    cap = 128
    data, metrics = roll.dynamic_batching_shard(batch(lengths, width=64), dp, cap, round_to)
    order, idx, lens = reference.dynamic_batching(lengths, dp, cap, round_to, initial_max=round_to)
    assert data["row"].tolist() == order and data.meta_info["micro_batch_indices"] == idx[0]
    assert data.meta_info["micro_batch_lengths"] == lens[0]
    assert metrics["dynamic_batching/actual_tokens"] == dp * sum((e - s) * n for (s, e), n in zip(idx[0], lens[0]))


def test_keep_dp_partition_keeps_the_balance():
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 500, 64).tolist()
    b = batch(lengths, width=512)
    metrics = roll.batch_balance(b, dp_size=4, minibatch_size=64)
    per_rank = [sum(b["attention_mask"][r * 16:(r + 1) * 16].sum(1).tolist()) for r in range(4)]
    assert max(per_rank) == metrics["global_seqlen/balanced_max"] and min(per_rank) == metrics["global_seqlen/balanced_min"]
    kept, _ = roll.dynamic_batching_shard(b, 4, 4096, 8, keep_dp_partition=True)
    assert [sorted(kept["row"][r * 16:(r + 1) * 16].tolist()) for r in range(4)] == \
        [sorted(b["row"][r * 16:(r + 1) * 16].tolist()) for r in range(4)]
    for r in range(4):
        block = kept["attention_mask"][r * 16:(r + 1) * 16].sum(1)
        assert (block[1:] >= block[:-1]).all()
        for (s, e), n in zip(kept.meta_info["micro_batch_indices"], kept.meta_info["micro_batch_lengths"]):
            assert (e - s) * n <= 4096 and block[s:e].max() <= n
    resorted, _ = roll.dynamic_batching_shard(b, 4, 4096, 8)
    spread = lambda d: np.ptp([d["attention_mask"][r * 16:(r + 1) * 16].sum().item() for r in range(4)])  # noqa: E731
    assert spread(kept) == metrics["global_seqlen/balanced_max"] - metrics["global_seqlen/balanced_min"]
    assert spread(resorted) >= 0


# ---------------------------------------------------------------- batch balance


def test_batch_balance_vector_and_errors():
    b = batch([10, 20, 30, 40, 50, 60, 70, 80], width=80)
    metrics = roll.batch_balance(b, dp_size=2, minibatch_size=8)
    assert metrics == {"global_seqlen/min": 100, "global_seqlen/max": 260, "global_seqlen/minmax_diff": 160,
                       "global_seqlen/balanced_min": 180, "global_seqlen/balanced_max": 180, "global_seqlen/mean": 180.0}
    assert b["names"] == [f"r{i}" for i in b["row"].tolist()]
    assert sum(b["attention_mask"][:4].sum(1).tolist()) == 180
    small = batch([1, 2, 3, 4])
    for size in (0, 3, 8):
        with pytest.raises(ValueError, match="minibatch_size|divisible"):
            roll.batch_balance(small, dp_size=2, minibatch_size=size, keep_minibatch=True)
    with pytest.raises(ValueError, match="multiple of dp_size=3"):
        roll.batch_balance(small, dp_size=3, minibatch_size=4)


# ---------------------------------------------------------------- sequence packing


def test_load_balance_example_and_restore_order():
    lengths = [512, 1024, 256, 2048, 128, 768, 1536, 384, 896, 640]
    b = batch(lengths, width=2048)
    mbs = list(roll.make_micro_batch_iter_for_sequence_packing(b, max_packed_sequence_length=4096))
    assert [int(mb["attention_mask"].sum()) for mb in mbs] == [4096, 4096]
    parts = mbs[0].meta_info["partition_indices_list"]
    assert sorted(sum(parts, [])) == list(range(10)) and mbs[1].meta_info["micro_batch_idx"] == 1
    results = {"logprobs": torch.cat([mb["row"].float() for mb in mbs]), "loss": torch.tensor(1.0)}
    restored = roll.restore_results_order(results, parts)
    assert restored["logprobs"].tolist() == list(range(10)) and restored["loss"] is results["loss"]
    assert roll.restore_results_order({}, parts) == {}


def test_load_balance_hard_cap_where_roll_exceeds_it():
    # ROLL: ceil(8*112/128) = 7 micro-batches, one of them 224 tokens. Here: 8, all <= 128.
    b = batch([112] * 8, width=128)
    mbs = list(roll.make_micro_batch_iter_for_sequence_packing(b, max_packed_sequence_length=128, pad_multiple=16))
    assert len(mbs) == 8 and all(int(mb["attention_mask"].sum()) <= 128 for mb in mbs)


@settings(max_examples=50, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=40), cp=st.sampled_from([1, 2]),
       tp=st.sampled_from([1, 2]), vp=st.sampled_from([1, 2]), min_num=st.integers(1, 3))
def test_load_balance_properties(lengths, cp, tp, vp, min_num):
    pad = 2 * cp * tp if cp > 1 else tp
    b = batch(lengths, width=300)
    try:
        mbs = list(roll.make_micro_batch_iter_for_sequence_packing(
            b, max_packed_sequence_length=512, min_num_micro_batches=min_num, tp_size=tp, cp_size=cp, vp_size=vp))
    except ValueError as exc:  # too few rows for min_num, or for a multiple of vp that fits the cap
        assert "micro-batch" in str(exc) and (vp > 1 or len(lengths) < min_num)
        return
    assert len(mbs) >= min_num and len(mbs) % vp == 0
    rows = sorted(r for mb in mbs for r in mb["row"].tolist())
    assert rows == list(range(len(lengths)))
    for mb in mbs:
        padded = (-(-mb["attention_mask"].sum(1) // pad) * pad).sum()
        assert padded <= 512 and mb.meta_info["num_micro_batchs"] == len(mbs)


def test_sequence_packing_none_and_errors():
    b = batch([3, 5, 2, 7])
    mbs = list(roll.make_micro_batch_iter_for_sequence_packing(b, algorithm="none", micro_batch_size=2))
    assert [mb["row"].tolist() for mb in mbs] == [[0, 1], [2, 3]] and mbs[0].meta_info["partition_indices_list"] == []
    assert roll.restore_results_order({"x": torch.arange(4)}, [])["x"].tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="Illegal sequence packing algorithm"):
        roll.make_micro_batch_iter_for_sequence_packing(b, algorithm="greedy")
    with pytest.raises(ValueError, match="micro_batch_size"):
        roll.make_micro_batch_iter_for_sequence_packing(b, algorithm="none")
    with pytest.raises(ValueError, match="max_packed_sequence_length is required"):
        roll.make_micro_batch_iter_for_sequence_packing(b)
    with pytest.raises(ValueError, match="exceeds max_packed_sequence_length=6"):
        roll.make_micro_batch_iter_for_sequence_packing(b, max_packed_sequence_length=6)
    with pytest.raises(ValueError, match="attention_mask"):
        roll.make_micro_batch_iter_for_sequence_packing({"x": torch.ones(2)}, max_packed_sequence_length=6)
    with pytest.raises(ValueError, match="has 3 rows, the partitions 4"):
        roll.restore_results_order({"x": torch.arange(3)}, [[0, 1], [2, 3]])
    with pytest.raises(ValueError, match="multiple of dp_size=3"):
        roll.dynamic_batching_shard(b, 3, 16, 2)
    with pytest.raises(ValueError, match="exceeds max_tokens_per_microbatch"):
        roll.dynamic_batching_shard(b, 2, 6, 4)
    with pytest.warns(UserWarning, match="all zero"):
        roll.dynamic_batching_shard(batch([0, 3], width=4), 1, 16, 2)
