"""ROLL with shared prefixes (issue 29): ``make_micro_batch_iter_for_sequence_packing(
shared_prefix=True)`` plans prefix trees under the cap (physical tokens, each tree
padded to the pad multiple) and hands each micro-batch its tree, and seqpack's
``sequence_packing_args.shared_prefix`` turns it on through ``seqpack.config``."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import seqpack
from seqpack import config
from seqpack.roll import make_micro_batch_iter_for_sequence_packing


def roll_batch(prompt_lens, response_lens, seed=0):
    """Right-padded rows (ROLL's layout): group g's rows share prompt g."""
    rng = np.random.default_rng(seed)
    rows, groups = [], []
    for g, (p, responses) in enumerate(zip(prompt_lens, response_lens)):
        prompt = rng.integers(1, 60, p).tolist()
        for n in responses:
            rows.append(prompt + rng.integers(1, 60, n).tolist())
            groups.append(g)
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = 1
    return {"input_ids": ids, "attention_mask": mask, "prompt_id": torch.tensor(groups)}, rows, groups


def physical(rows, groups, multiple):
    tokens = seqpack.pack_prefix_tree(rows, group_ids=groups).metrics().physical_tokens
    return -(-tokens // multiple) * multiple


def test_trees_under_the_cap_and_each_micro_batch_carries_its_tree():
    batch, rows, groups = roll_batch([100] * 4, [[20] * 4] * 4)  # 180 physical / 480 logical tokens a group
    mbs = list(make_micro_batch_iter_for_sequence_packing(batch, max_packed_sequence_length=256, pad_multiple=8,
                                                          shared_prefix=True, group_key="prompt_id"))
    assert len(mbs) == 4
    seen = []
    for mb in mbs:
        part = mb.meta_info["partition_indices"]
        tree = mb.meta_info["prefix_tree"]
        assert len({groups[i] for i in part}) == 1  # one group each: 180 fits 256, 360 does not
        assert tree.num_tokens == physical([rows[i] for i in part], [groups[i] for i in part], 8) <= 256
        assert tree.seq_lens.tolist() == [len(rows[i]) for i in part]
        seen += part
    assert sorted(seen) == list(range(len(rows)))
    assert mbs[0].meta_info["sequence_packing_metrics"]["sharing_kept"] == 1.0
    plain = list(make_micro_batch_iter_for_sequence_packing(batch, max_packed_sequence_length=256, pad_multiple=8))
    assert len(plain) == 8 and "prefix_tree" not in plain[0].meta_info


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 20), min_size=1, max_size=4), st.integers(0, 30), st.sampled_from([1, 4]),
       st.integers(0, 1000))
def test_every_row_once_under_the_cap(prompts, extra, multiple, seed):
    rng = np.random.default_rng(seed)
    responses = [rng.integers(1, 9, int(rng.integers(1, 5))).tolist() for _ in prompts]
    batch, rows, groups = roll_batch(prompts, responses, seed=seed)
    cap = -(-(max(len(r) for r in rows) + extra) // multiple) * multiple
    mbs = list(make_micro_batch_iter_for_sequence_packing(batch, max_packed_sequence_length=cap,
                                                          pad_multiple=multiple, shared_prefix=True,
                                                          group_key="prompt_id"))
    parts = [mb.meta_info["partition_indices"] for mb in mbs]
    assert sorted(i for p in parts for i in p) == list(range(len(rows)))
    for mb, part in zip(mbs, parts):
        assert mb.meta_info["prefix_tree"].num_tokens == physical([rows[i] for i in part],
                                                                  [groups[i] for i in part], multiple) <= cap


def test_bad_combinations_are_named():
    batch, _, _ = roll_batch([5, 5], [[2, 2], [3]])
    with pytest.raises(ValueError, match="needs strict=True"):
        list(make_micro_batch_iter_for_sequence_packing(batch, max_packed_sequence_length=64, shared_prefix=True,
                                                        strict=False))
    with pytest.raises(ValueError, match="group_key 'uid' is not a column"):
        list(make_micro_batch_iter_for_sequence_packing(batch, max_packed_sequence_length=64, shared_prefix=True,
                                                        group_key="uid"))
    with pytest.raises(ValueError, match="exceeds max_packed_sequence_length=7"):
        list(make_micro_batch_iter_for_sequence_packing(batch, max_packed_sequence_length=7, pad_multiple=4,
                                                        shared_prefix=True))


def roll_cfg(**args):
    packing = {"algorithm": "load_balance", "max_packed_sequence_length_train": 8192,
               "max_packed_sequence_length_forward": 8192, **args}
    return {"actor_train": {"strategy_args": {"strategy_name": "megatron_train", "strategy_config": {}},
                            "use_sequence_packing": True, "sequence_packing_args": packing}}


def test_sequence_packing_args_shared_prefix_turns_it_on():
    cfg = config.load(roll_cfg(shared_prefix=True))
    assert cfg.load_balance_kwargs("train")["shared_prefix"] is True
    assert "shared_prefix" not in cfg.load_balance_kwargs("forward")
    assert config.load(cfg.to_dict()) == cfg
    assert "shared_prefix" not in config.load(roll_cfg()).load_balance_kwargs("train")
    with pytest.raises(config.ConfigError, match="shared_prefx: unknown key; did you mean 'shared_prefix'"):
        config.load(roll_cfg(shared_prefx=True))
    with pytest.raises(config.ConfigError, match="shared_prefix: prefix trees are planned by algorithm 'load_balance'"):
        config.load(roll_cfg(shared_prefix=True, algorithm="none"))
    batch, rows, _ = roll_batch([30, 30], [[5, 5, 5], [6, 6]])
    mbs = list(make_micro_batch_iter_for_sequence_packing(batch, **cfg.load_balance_kwargs("train")))
    assert sorted(i for mb in mbs for i in mb.meta_info["partition_indices"]) == list(range(len(rows)))


def test_a_forest_step_plan_gives_trees_and_dummies_get_theirs():
    batch, rows, groups = roll_batch([40, 40, 40], [[5, 5], [6], [7, 7, 7]], seed=4)
    forest = seqpack.PrefixForest.from_rows(rows, group_ids=groups)
    plan = seqpack.plan_step(forest.lengths, dp_size=2, max_tokens=128, forest=forest, min_micro_batches=3)
    mine = plan.rank_rows(0)
    local = {k: v[mine] for k, v in batch.items()}
    mbs = list(make_micro_batch_iter_for_sequence_packing(local, max_packed_sequence_length=128, pad_multiple=1,
                                                          step_plan=plan, dp_rank=0, shared_prefix=True,
                                                          group_key="prompt_id"))
    assert len(mbs) == plan.num_micro_batches[0]
    for mb in mbs:
        tree = mb.meta_info["prefix_tree"]
        if mb.meta_info["is_padding_batch"]:
            assert tree.num_logical_tokens == 1  # the dummy's one token
        else:
            assert tree.seq_lens.tolist() == mb["attention_mask"].sum(1).tolist()
    with pytest.raises(ValueError, match="shared_prefix plans prefix trees with algorithm 'load_balance', got 'none'"):
        list(make_micro_batch_iter_for_sequence_packing(batch, algorithm="none", micro_batch_size=1,
                                                        shared_prefix=True))


def test_dynamic_batching_shard_with_a_forest():
    """Issue 40: ROLL's dynamic batching on prefix trees. Every rank the same rows and
    ranges; each rank's micro-batch, as a tree, within the cap; a group's rows on one
    rank when its rows fit; fewer micro-batches than padding the same rows."""
    from seqpack.roll import dynamic_batching_shard

    data, rows, groups = roll_batch([40, 10, 30, 20], [[8, 12, 5, 9], [30, 2, 7, 7], [4, 4, 4, 4], [16, 3, 9, 1]])
    forest = seqpack.PrefixForest.from_padded(data["input_ids"], data["attention_mask"], group_ids=groups)
    cap = 128
    out, metrics = dynamic_batching_shard(data, 2, cap, 8, forest=forest)
    padded, _ = dynamic_batching_shard(data, 2, cap, 8)
    ranges = out.meta_info["micro_batch_indices"]
    assert out.meta_info["num_micro_batchs"] == len(ranges) <= padded.meta_info["num_micro_batchs"]
    order = out["prompt_id"].tolist()
    for rank in range(2):
        mine = list(range(rank * 8, rank * 8 + 8))
        picked = [int(torch.nonzero((data["input_ids"] == out["input_ids"][i]).all(dim=1))[0]) for i in mine]
        for a, b in ranges:
            part = picked[a:b]
            assert physical([rows[i] for i in part], [groups[i] for i in part], 8) <= cap
        assert len({order[i] for i in mine}) == 2  # two whole groups of four rows per rank
    assert metrics["dynamic_batching/actual_tokens"] <= cap * len(ranges) * 2
    with pytest.raises(ValueError, match="keep_dp_partition and forest cannot be combined"):
        dynamic_batching_shard(data, 2, cap, 8, forest=forest, keep_dp_partition=True)
