"""verl with shared prefixes (issue 29): ``rearrange_micro_batches(shared_prefix=True)``
plans prefix trees from ``input_ids`` / ``attention_mask`` (rows sharing only within
a ``uid``), and ``actor_rollout_ref.actor.use_prefix_grouper`` (verl's switch) turns
it on through ``seqpack.config``."""

import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import seqpack
from seqpack import config
from seqpack.verl import rearrange_micro_batches


def verl_batch(prompt_lens, response_lens, seed=0, left_pad=4):
    """verl's layout: a left-padded prompt, then a right-padded response; ``uid``
    names each prompt's group."""
    rng = np.random.default_rng(seed)
    width = left_pad + max(prompt_lens) + max(max(r) for r in response_lens) + 2
    rows, uids = [], []
    for g, (p, responses) in enumerate(zip(prompt_lens, response_lens)):
        prompt = rng.integers(1, 50, p).tolist()
        for n in responses:
            rows.append(prompt + rng.integers(1, 50, n).tolist())
            uids.append(f"prompt-{g}")
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        start = left_pad + max(prompt_lens) - prompt_lens[int(uids[i].split("-")[1])]  # left padding
        ids[i, start: start + len(row)] = torch.tensor(row)
        mask[i, start: start + len(row)] = 1
    return {"input_ids": ids, "attention_mask": mask, "uid": np.array(uids, dtype=object)}, rows, uids


def physical(rows, groups):
    codes = {g: i for i, g in enumerate(dict.fromkeys(groups))}  # uid strings -> integer group ids
    return seqpack.pack_prefix_tree(rows, group_ids=[codes[g] for g in groups]).metrics().physical_tokens if rows else 0


def test_groups_stay_whole_and_the_cap_is_on_physical_tokens():
    batch, rows, uids = verl_batch([60, 60, 60], [[10] * 4] * 3)  # 100 physical / 280 logical tokens a group
    _, parts = rearrange_micro_batches(batch, max_token_len=128, shared_prefix=True)
    assert sorted(i for p in parts for i in p) == list(range(len(rows)))
    for p in parts:
        assert physical([rows[i] for i in p], [uids[i] for i in p]) <= 128
        assert len({uids[i] for i in p}) == 1  # one group each: each fits, two do not
    _, plain = rearrange_micro_batches(batch, max_token_len=128)
    assert len(parts) == 3 < len(plain)


@st.composite
def batches(draw):
    groups = draw(st.integers(1, 5))
    return (draw(st.lists(st.integers(1, 20), min_size=groups, max_size=groups)),
            [draw(st.lists(st.integers(1, 8), min_size=1, max_size=5)) for _ in range(groups)])


@settings(max_examples=40, deadline=None)
@given(batches(), st.integers(0, 40), st.booleans(), st.integers(0, 1000))
def test_every_row_once_and_no_micro_batch_over_the_cap(shape, extra, balance, seed):
    batch, rows, uids = verl_batch(*shape, seed=seed)
    cap = max(len(r) for r in rows) + extra
    micro, parts = rearrange_micro_batches(batch, max_token_len=cap, shared_prefix=True,
                                           use_dynamic_bsz_balance=balance)
    assert sorted(i for p in parts for i in p) == list(range(len(rows)))
    for mb, p in zip(micro, parts):
        assert physical([rows[i] for i in p], [uids[i] for i in p]) <= cap
        assert torch.equal(mb["input_ids"], batch["input_ids"][p])
    # trees are split only where that saves micro-batches: never more than keeping them whole
    forest = seqpack.PrefixForest.from_padded(batch["input_ids"], batch["attention_mask"],
                                              group_ids=[int(u.split("-")[1]) for u in uids])
    assert len(parts) <= seqpack.plan_micro_batches(forest.lengths, cap, forest=forest, whole_trees=True).num_micro_batches


def test_without_a_uid_column_rows_share_any_common_prefix():
    batch, rows, _ = verl_batch([8, 8], [[3, 3], [2]], seed=2)
    del batch["uid"]
    _, parts = rearrange_micro_batches(batch, max_token_len=64, shared_prefix=True)
    assert sorted(i for p in parts for i in p) == list(range(len(rows)))


def test_rows_the_loss_couples_keep_their_trees_whole():
    """force_group_size=2 (reward-model pairs sharing a prompt): every tree whole in
    one micro-batch; a pair that is not one tree, or a tree over the cap, is named."""
    batch, rows, uids = verl_batch([30, 30, 30, 30], [[10, 10]] * 4)  # 50 physical tokens a pair
    _, parts = rearrange_micro_batches(batch, max_token_len=128, shared_prefix=True, force_group_size=2)
    assert sorted(i for p in parts for i in p) == list(range(len(rows)))
    for p in parts:
        assert len(p) % 2 == 0 and all(p[k] // 2 == p[k + 1] // 2 for k in range(0, len(p), 2))
        assert physical([rows[i] for i in p], [uids[i] for i in p]) <= 128
    with pytest.raises(ValueError, match="more than max_token_len=40: rows the loss couples cannot be split"):
        rearrange_micro_batches(batch, max_token_len=40, shared_prefix=True, force_group_size=2)
    odd, _, _ = verl_batch([30, 30], [[10, 10, 10], [10]])  # rows 2 and 3 belong to different prompts
    with pytest.raises(ValueError, match=r"rows 2..3 share no prefix"):
        rearrange_micro_batches(odd, max_token_len=128, shared_prefix=True, force_group_size=2)


@pytest.mark.parametrize("kwargs, match", [
    (dict(strict=False), "needs strict=True"),
])
def test_bad_combinations_are_named(kwargs, match):
    batch, _, _ = verl_batch([5, 5], [[2, 2], [3, 3]])
    with pytest.raises(ValueError, match=match):
        rearrange_micro_batches(batch, max_token_len=64, shared_prefix=True, **kwargs)
    with pytest.raises(ValueError, match="needs the batch's 'input_ids'"):
        rearrange_micro_batches({"attention_mask": batch["attention_mask"]}, max_token_len=64, shared_prefix=True)


def verl_cfg(**actor):
    return {"actor_rollout_ref": {"actor": {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 4096, **actor}},
            "data": {"max_prompt_length": 1024, "max_response_length": 1024}}


def test_use_prefix_grouper_turns_it_on():
    cfg = config.load(verl_cfg(use_prefix_grouper=True))
    assert cfg.rearrange_kwargs("actor") == {"max_token_len": 4096, "shared_prefix": True}
    assert cfg.rearrange_kwargs("rollout") == {"max_token_len": 4096}  # the log-prob pass stays dense
    assert config.load(cfg.to_dict()) == cfg
    assert "shared_prefix" not in config.load(verl_cfg()).rearrange_kwargs("actor")
    with pytest.raises(config.ConfigError, match="use_prefix_groupr: unknown key; did you mean 'use_prefix_grouper'"):
        config.load(verl_cfg(use_prefix_groupr=True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config.load(verl_cfg(use_prefix_grouper=True, use_dynamic_bsz=False, ppo_micro_batch_size_per_gpu=4))
    assert any("use_prefix_grouper: seqpack plans prefix trees in dynamic micro-batches" in str(w.message)
               for w in caught)
    batch, rows, _ = verl_batch([30, 30], [[5, 5, 5], [6, 6]])
    _, parts = rearrange_micro_batches(batch, **cfg.rearrange_kwargs("actor"))
    assert sorted(i for p in parts for i in p) == list(range(len(rows)))


def test_the_engine_module_in_external_lib_turns_prefix_reuse_on():
    # verl's own key names the worker module: trees, or trees with prefix reuse
    def with_lib(lib, **actor):
        cfg = verl_cfg(**actor)
        cfg["actor_rollout_ref"]["model"] = {"external_lib": lib}
        return cfg

    cfg = config.load(with_lib("seqpack.frameworks.verl.prefix_reuse_engine"))
    assert cfg.prefix_reuse_training and cfg.shared_prefix_training
    assert cfg.rearrange_kwargs("actor") == {"max_token_len": 4096, "shared_prefix": True, "prefix_reuse": True}
    assert cfg.step_options().prefix_reuse
    assert config.load(cfg.to_dict()) == cfg
    trees = config.load(with_lib("seqpack.frameworks.verl.tree_engine"))
    assert trees.shared_prefix_training and not trees.prefix_reuse_training
    assert not config.load(with_lib("my_project.plugins")).shared_prefix_training
    with pytest.raises(config.ConfigError, match="external_lib: seqpack.frameworks.verl.prefix_reuse_engine plans "
                                                 "prefix trees in dynamic micro-batches"):
        config.load(with_lib("seqpack.frameworks.verl.prefix_reuse_engine", use_dynamic_bsz=False,
                             ppo_micro_batch_size_per_gpu=4))
    assert "use_prefix_grouper" not in cfg.to_dict()["actor_rollout_ref"]["actor"]  # verl's own switch stays off
    assert trees.to_dict()["actor_rollout_ref"]["model"]["external_lib"] == "seqpack.frameworks.verl.tree_engine"
    own = config.load(with_lib("my_project.plugins", use_prefix_grouper=True))
    assert own.to_dict()["actor_rollout_ref"]["model"]["external_lib"] == "my_project.plugins"  # kept, not dropped
    assert own.to_dict()["actor_rollout_ref"]["actor"]["use_prefix_grouper"] is True
    lib = "seqpack.frameworks.verl.prefix_reuse_engine"
    for actor, match in ((dict(loss_agg_mode="seq-mean-token-mean"), "loss_agg_mode: 'seq-mean-token-mean'"),
                         (dict(policy_loss={"loss_mode": "gspo"}), "loss_mode: 'gspo' couples a row's tokens"),
                         (dict(ulysses_sequence_parallel_size=2), "without Ulysses"),
                         (dict(strategy="megatron"), "strategy 'megatron'")):
        with pytest.raises(config.ConfigError, match=match):
            base = with_lib(lib, **actor)
            base["actor_rollout_ref"]["model"]["use_remove_padding"] = True
            config.load(base)
    batch, _, _ = verl_batch([30, 30], [[5, 5, 5], [6, 6]])
    with pytest.raises(ValueError, match="passes on verl's engine TensorDicts"):  # test_verl_engine.py runs them
        rearrange_micro_batches(batch, **cfg.rearrange_kwargs("actor"))


def test_rows_with_different_images_are_planned_apart():
    """verl's VLM rows (``multi_modal_inputs``, one dict per row): two prompts of one
    text whose images differ have the same placeholder ids; the plan's forest shares
    nothing between them (the tree the rows run on, keyed by image, never holds more),
    and rows of one image share their prompt as before."""
    from seqpack.frameworks._batch import padded_forest

    batch, rows, _ = verl_batch([6, 6], [[3, 3], [2, 2]], seed=3)
    del batch["uid"]
    same_text = batch["input_ids"][0].clone()
    batch["input_ids"][2:] = torch.where(batch["attention_mask"][2:] > 0, same_text, batch["input_ids"][2:])
    image = [{"pixel_values": torch.full((4, 3), float(k)), "image_grid_thw": torch.tensor([[1, 2, 2]])}
             for k in (0, 0, 1, 1)]
    plain, _ = padded_forest(batch, None, missing_group_ok=True)
    keyed, groups = padded_forest({**batch, "multi_modal_inputs": np.array(image, dtype=object)}, None,
                                  missing_group_ok=True)
    assert groups == [0, 0, 1, 1]
    assert keyed.num_trees == 2 and plain.num_trees == 1
    assert keyed.physical_tokens([0, 1]) == plain.physical_tokens([0, 1])
