"""seqpack.config.load composes a recipe given by path as its framework does (NeMo-RL's
``defaults:`` inheritance, Hydra defaults lists for verl and ROLL), takes Hydra-style
overrides as the launchers do, and gives the same result by path and composed.

Recipes: tests/python/frameworks/data/recipes/, all seqpack's own (those under
nemo_rl/real are shaped like two of NeMo-RL's example recipes: their keys and values).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings

import pytest
from omegaconf import OmegaConf

from seqpack import config
from seqpack.config import ConfigError, load

RECIPES = os.path.join(os.path.dirname(__file__), "data", "recipes")


def recipe(*parts):
    return os.path.join(RECIPES, *parts)


def quiet_load(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load(*args, **kwargs)


def merged(*paths):
    """NeMo-RL's merge, spelled out: parents in order, then the child (no markers)."""
    out = OmegaConf.create({})
    for path in paths:
        part = OmegaConf.load(path)
        part.pop("defaults", None)
        out = OmegaConf.merge(out, part)
    return out


# ---------------------------------------------------------------- NeMo-RL defaults


def test_a_child_recipe_inherits_its_parent():
    cfg = quiet_load(recipe("nemo_rl", "recipes", "megatron_cp8.yaml"))
    assert cfg.parallel == config.ParallelConfig(tp=4, cp=8, sequence_parallel=True, backend="megatron")
    assert cfg.max_seqlen == 8192 and cfg.global_batch_size == 512  # the child's length, the parent's batch
    # the parent's ${mul:...} caps follow the child's max_total_sequence_length
    assert (cfg.sequence_packing.train_mb_tokens, cfg.sequence_packing.logprob_mb_tokens) == (8192 * 4, 8192 * 4)
    assert cfg.raw["grpo"]["num_prompts_per_step"] == 32 and cfg.raw["logger"]["log_dir"] == "logs/megatron_cp8"
    assert "defaults" not in cfg.raw


def test_a_list_of_parents_merges_in_order_and_override_replaces_a_section():
    path = recipe("nemo_rl", "recipes", "long_megatron.yaml")
    cfg = quiet_load(path)
    assert cfg.max_seqlen == 16384 and cfg.parallel.cp == 8  # the second parent over the first
    assert cfg.sequence_packing.train_mb_tokens == 16384  # train_micro_batch_size 1 from the second parent
    assert cfg.raw["logger"] == {"log_dir": "logs/long"}  # `_override_: true` replaced the section
    assert cfg.raw["cluster"] == {"gpus_per_node": 8, "num_nodes": 4}  # merged, the child last
    # by path == the composed mapping
    parts = [recipe("nemo_rl", "base", "grpo_base.yaml"), recipe("nemo_rl", "recipes", "megatron_cp8.yaml"),
             recipe("nemo_rl", "base", "long_context.yaml"), path]
    composed = merged(*parts)
    composed.logger = {"log_dir": "logs/long"}
    assert quiet_load(composed) == cfg == quiet_load(OmegaConf.to_container(composed))


def test_inheritance_errors_name_the_file_and_the_entry():
    with pytest.raises(ConfigError, match=r"cycle_b\.yaml: defaults: 'cycle_a\.yaml' inherits from itself "
                                          r"\(cycle_a\.yaml -> cycle_b\.yaml -> cycle_a\.yaml\)"):
        load(recipe("nemo_rl", "recipes", "cycle_a.yaml"))
    with pytest.raises(ConfigError, match=r"missing_parent\.yaml: defaults: no such parent recipe "
                                          r"'\.\./base/no_such_parent\.yaml'"):
        load(recipe("nemo_rl", "recipes", "missing_parent.yaml"))


def test_a_recipe_given_as_text_is_read_alone_with_a_warning(tmp_path):
    text = open(recipe("nemo_rl", "recipes", "fuse_loss.yaml")).read()
    with pytest.warns(UserWarning, match=r"^defaults: not composed"):
        with pytest.raises(ConfigError, match="train_mb_tokens: required"):
            load(text.replace("fuse_loss: true", "fuse_loss: true\n    enabled: true"))


def test_real_nemo_rl_recipes_compose():
    base = recipe("nemo_rl", "real", "examples", "configs", "grpo_math_1B.yaml")
    child = recipe("nemo_rl", "real", "examples", "configs", "recipes", "llm", "performance",
                   "grpo-qwen3-30ba3b-4n8g-128K.yaml")
    cfg = load(base)
    assert cfg.sequence_packing.train_mb_tokens == 512 * 4 and cfg.parallel.backend == "dtensor"
    with pytest.warns(UserWarning, match=r"make_sequence_length_divisible_by: 4 is not a multiple of 64"):
        long = load(child)
    assert long.parallel == config.ParallelConfig(tp=4, cp=8, sequence_parallel=True, backend="megatron")
    assert long.sequence_packing_args("train")["max_tokens_per_microbatch"] == 131072
    assert long.sequence_packing_args("logprob")["max_tokens_per_microbatch"] == 131072 * 4
    assert long.sequence_packing.sequence_length_pad_multiple == 64
    optimizer = long.raw["policy"]["megatron_cfg"]["optimizer"]
    assert (optimizer["lr"], optimizer["weight_decay"]) == (3e-7, 0.01)  # merged into the parent's section
    assert long.raw["policy"]["optimizer"] is None and long.raw["policy"]["dtensor_cfg"]["_v2"] is True


# ---------------------------------------------------------------- overrides


def test_overrides_apply_as_nemo_rls_launcher_applies_them():
    path = recipe("nemo_rl", "recipes", "megatron_cp8.yaml")
    cfg = quiet_load(path, overrides=["policy.max_total_sequence_length=4096", "+policy.new_key=1",
                                      "policy.sequence_packing.algorithm=first_fit_decreasing"])
    assert cfg.max_seqlen == 4096 and cfg.sequence_packing.train_mb_tokens == 4096 * 4  # ${mul:...} follows
    assert cfg.sequence_packing.algorithm == "first_fit_decreasing" and cfg.raw["policy"]["new_key"] == 1
    with pytest.raises(ConfigError, match=r"^overrides: .*no_such_key"):  # struct mode: a new key needs '+'
        quiet_load(path, overrides=["policy.no_such_key=1"])
    text = "policy:\n  sequence_packing: {enabled: true, train_mb_tokens: 4096}\n"
    assert load(text, overrides=["policy.sequence_packing.train_mb_tokens=8192"]).sequence_packing.train_mb_tokens \
        == 8192
    for bad in ("policy.x=1", ["policy.x=1", 3]):
        with pytest.raises(ConfigError, match="overrides must be a list of strings"):
            load(text, overrides=bad)


# ---------------------------------------------------------------- Hydra defaults lists


def test_a_hydra_defaults_list_is_composed_by_hydra():
    pytest.importorskip("hydra")
    path = recipe("verl", "trainer.yaml")
    cfg = load(path)  # no warning: the `???` values are in sections seqpack does not read
    actor = cfg.micro_batching("actor")
    assert (actor.use_dynamic_bsz, actor.max_token_len_per_gpu, actor.sp_size) == (True, 12288, 2)
    assert cfg.verl.ref.sp_size == 2 and cfg.micro_batching("rollout").max_token_len == 12288 * 2
    assert (cfg.max_seqlen, cfg.global_batch_size) == (2048 + 6144, 128 * 4)
    assert cfg.raw["reward"]["reward_model"]["rollout"] == {"name": "???",
                                                            "response_length": "${data.max_response_length}"}
    # overrides go to Hydra's compose, as verl's launcher passes them
    small = load(path, overrides=["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=8192",
                                  "actor_rollout_ref.rollout.name=vllm"])
    assert small.rearrange_kwargs("actor") == {"max_token_len": 16384} and small.raw["actor_rollout_ref"][
        "rollout"]["name"] == "vllm"
    # by path == Hydra's composed config == its plain form
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=os.path.dirname(path), version_base=None):
        composed = compose(config_name="trainer")
        assert load(path) == cfg  # inside a Hydra app too
    assert load(composed) == cfg == load(OmegaConf.to_container(composed))


def test_a_roll_recipe_with_a_defaults_list_is_composed():
    pytest.importorskip("hydra")
    cfg = load(recipe("roll", "rlvr", "rlvr_pack.yaml"))
    assert cfg.parallel.tp == 2 and cfg.parallel.cp == 2 and cfg.parallel.backend == "megatron_train"
    assert cfg.load_balance_kwargs("train") == {"algorithm": "load_balance", "max_packed_sequence_length": 8192,
                                                "min_num_micro_batches": 1, "pad_multiple": 8, "vp_size": 1,
                                                "is_train": True}
    assert cfg.roll_packing.max_packed_sequence_length_forward == 4096 * 4  # ROLL's auto-fill


def test_without_hydra_a_hydra_recipe_is_refused_not_read_half_composed(monkeypatch):
    for name in [m for m in sys.modules if m == "hydra" or m.startswith("hydra.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "hydra", None)  # `import hydra` raises ImportError
    with pytest.raises(ConfigError, match=r"trainer\.yaml: defaults: a Hydra defaults list .* is composed by Hydra; "
                                          r"install hydra-core"):
        load(recipe("verl", "trainer.yaml"))
    with pytest.raises(ConfigError, match=r"^overrides: .*install hydra-core"):
        load("policy: {}\n", overrides=["policy.x=1"])
    assert load(recipe("nemo_rl", "base", "grpo_base.yaml")).max_seqlen == 1024  # no Hydra needed


def test_verls_own_ppo_trainer_loads_by_path():
    hydra = pytest.importorskip("hydra")
    spec = importlib.util.find_spec("verl")  # where verl is installed, without importing it (slow)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("verl is not installed")
    directory = os.path.join(spec.submodule_search_locations[0], "trainer", "config")
    path = os.path.join(directory, "ppo_trainer.yaml")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # rollout.name and reward's rollout name are `???`: not read, no warning
        cfg = load(path)
    assert cfg.schema == "verl" and cfg.parallel.backend == "fsdp" and cfg.verl.use_critic  # adv_estimator: gae
    assert cfg.raw["actor_rollout_ref"]["rollout"]["name"] == "???"
    with hydra.initialize_config_dir(config_dir=directory, version_base=None):
        composed = hydra.compose(config_name="ppo_trainer")
    assert load(composed) == cfg
    megatron = load(path, overrides=["model_engine=megatron", "actor_rollout_ref.actor.use_dynamic_bsz=true"])
    assert megatron.parallel.backend == "megatron" and megatron.micro_batching("ref").use_dynamic_bsz
