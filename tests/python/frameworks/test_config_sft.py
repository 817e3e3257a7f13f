"""seqpack.config reads verl's SFT trainer config (sft_trainer_engine.yaml: data.*,
engine.*, model.use_remove_padding) as the role ``sft``, and ROLL's worker strategy as
ROLL's WorkerConfig builds it (a strategy_args without a name is ROLL's default
strategy, not Megatron)."""

from __future__ import annotations

import importlib.util
import os
import pickle
import warnings

import pytest

from seqpack import config
from seqpack.config import ConfigError, load

SFT = {"data": {"train_batch_size": 64, "micro_batch_size_per_gpu": 2, "max_token_len_per_gpu": 4096,
                "use_dynamic_bsz": True, "max_length": 2048, "pad_mode": "no_padding", "train_files": "x.parquet"},
       "model": {"use_remove_padding": True, "path": "Qwen/Qwen2.5-0.5B"},
       "engine": {"_target_": "verl.workers.config.FSDPEngineConfig", "strategy": "fsdp",
                  "ulysses_sequence_parallel_size": 2, "param_offload": False},
       "optim": {"lr": 1e-5}, "trainer": {"balance_batch": True, "project_name": "sft"}}


def strict_load(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return load(*args, **kwargs)


def changed(section, key, value, base=SFT):
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    out[section][key] = value
    return out


def verl_sft_yaml():
    spec = importlib.util.find_spec("verl")  # where verl is installed, without importing it (slow)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("verl is not installed")
    return os.path.join(spec.submodule_search_locations[0], "trainer", "config", "sft_trainer_engine.yaml")


# ---------------------------------------------------------------- verl's SFT trainer


def test_verls_own_sft_recipe_loads_by_path_with_its_values():
    pytest.importorskip("hydra")
    path = verl_sft_yaml()
    cfg = strict_load(path)  # was read as ROLL's ("actor_train: no such worker role")
    assert cfg.schema == "verl" and cfg.verl.trainer == "sft" and cfg.parallel.backend == "fsdp"
    sft = cfg.micro_batching("sft")  # the recipe's True / 8192 / 4, not the PPO actor's defaults
    assert (sft.path, sft.use_dynamic_bsz, sft.max_token_len_per_gpu, sft.micro_batch_size_per_gpu, sft.sp_size) == (
        "data", True, 8192, 4, 1)
    assert cfg.rearrange_kwargs("sft") == {"max_token_len": 8192}
    assert (cfg.max_seqlen, cfg.global_batch_size) == (1024, 256)
    assert cfg.balance_batch_kwargs(4) == {"k_partitions": 4, "equal_size": True}
    assert strict_load(path, schema="verl") == cfg
    assert strict_load(cfg.to_dict()) == cfg and pickle.loads(pickle.dumps(cfg)) == cfg
    assert cfg.raw["trainer"]["default_local_dir"] == "checkpoints/${trainer.project_name}/${trainer.experiment_name}"


@pytest.mark.parametrize("overrides, backend, sp, tp", [
    (["engine.ulysses_sequence_parallel_size=2"], "fsdp", 2, 1),
    (["engine=megatron", "engine.context_parallel_size=2", "engine.tensor_model_parallel_size=4"], "megatron", 2, 4),
    (["engine=megatron"], "megatron", 1, 1),
    (["engine=veomni", "engine.ulysses_parallel_size=4"], "veomni", 4, 1),
    (["engine=torchtitan", "engine.tensor_parallel_size=2"], "torchtitan", 2, 2),  # verl's torchtitan engine
    (["engine=automodel"], "automodel", 1, 1),
])
def test_verls_sft_engines_give_their_sequence_parallel_size(overrides, backend, sp, tp):
    pytest.importorskip("hydra")
    cfg = strict_load(verl_sft_yaml(), overrides=overrides + ["data.max_token_len_per_gpu=4096"])
    assert cfg.parallel.backend == backend and cfg.parallel.tp == tp and cfg.verl.sft.sp_size == sp
    assert cfg.rearrange_kwargs("sft") == {"max_token_len": 4096 * sp}
    assert strict_load(cfg.to_dict()) == cfg


def test_an_sft_mapping_reads_every_key():
    cfg = strict_load(SFT)
    assert cfg.micro_batching("sft") == config.VerlMicroBatching(
        path="data", use_dynamic_bsz=True, max_token_len_per_gpu=4096, micro_batch_size_per_gpu=2, sp_size=2)
    assert cfg.parallel == config.ParallelConfig(backend="fsdp", ulysses=2)
    assert cfg.rearrange_kwargs("sft") == {"max_token_len": 8192} and cfg.global_batch_size == 64
    fixed = strict_load(changed("data", "use_dynamic_bsz", False))
    assert fixed.verl.sft.micro_batch_size_per_gpu == 2
    with pytest.raises(ConfigError, match=r"^data\.use_dynamic_bsz: dynamic batching is disabled"):
        fixed.rearrange_kwargs("sft")
    assert not strict_load(changed("trainer", "balance_batch", False)).verl.balance_batch
    # verl's SFT defaults (sft_trainer_engine.yaml) for what a recipe leaves out
    bare = strict_load({"data": {"use_dynamic_bsz": True}})
    assert (bare.verl.sft.max_token_len_per_gpu, bare.verl.sft.micro_batch_size_per_gpu, bare.max_seqlen,
            bare.global_batch_size, bare.parallel.backend) == (8192, 4, 1024, 256, "fsdp")
    assert strict_load({"engine": {"_target_": "verl.workers.config.McoreEngineConfig"}}).parallel.backend == "megatron"


def test_an_sft_config_has_the_sft_role_only_and_a_ppo_config_has_no_sft_role():
    cfg = load(SFT)
    for role in config.VERL_ROLES:
        with pytest.raises(ConfigError, match=rf"^role '{role}': this is verl's SFT trainer's .* roles are \['sft'\]"):
            cfg.micro_batching(role)
    assert cfg.verl.actor is None and cfg.verl.ppo_mini_batch_size is None and cfg.verl.rollout_n is None
    with pytest.raises(ConfigError, match="has no PPO mini-batches"):
        cfg.verl.sequences_per_mini_batch
    ppo = load({"actor_rollout_ref": {}})
    with pytest.raises(ConfigError, match=r"^role 'sft': this is verl's PPO trainer's"):
        ppo.rearrange_kwargs("sft")
    with pytest.raises(ConfigError, match="role must be one of"):
        cfg.micro_batching("reward_model")


@pytest.mark.parametrize("section, key, value, message", [
    ("data", "max_token_len_per_gpu", None, r"^data\.max_token_len_per_gpu: required with data\.use_dynamic_bsz"),
    ("data", "max_token_len_per_gpu", 0, r"^data\.max_token_len_per_gpu: must be >= 1, got 0"),
    ("data", "use_dynamic_bsz", "yes", r"^data\.use_dynamic_bsz: must be true or false"),
    ("data", "max_length", None, r"^data\.max_length: must be an integer, got None"),
    ("data", "train_batch_size", 0, r"^data\.train_batch_size: must be >= 1"),
    ("data", "use_dynamic_bs", True, r"^data\.use_dynamic_bs: unknown key; did you mean 'use_dynamic_bsz'"),
    ("model", "use_remove_padding", False, r"^engine\.ulysses_sequence_parallel_size: Ulysses sequence parallelism "
                                           r"\(2\) needs model\.use_remove_padding = true"),
    ("engine", "ulysses_sequence_parallel_size", 0, r"^engine\.ulysses_sequence_parallel_size: must be >= 1"),
    ("engine", "ulysses_sequence_paralel_size", 2, r"did you mean 'ulysses_sequence_parallel_size'"),
])
def test_sft_errors_name_the_key(section, key, value, message):
    with pytest.raises(ConfigError, match=message):
        load(changed(section, key, value))


def test_sft_fixed_micro_batches_need_their_size_and_a_low_cap_warns():
    no_size = changed("data", "micro_batch_size_per_gpu", None, changed("data", "use_dynamic_bsz", False))
    with pytest.raises(ConfigError, match=r"^data\.micro_batch_size_per_gpu: required when data\.use_dynamic_bsz "
                                          r"is false"):
        load(no_size)
    with pytest.warns(UserWarning, match=r"^data\.max_token_len_per_gpu: 512 x 2 \(engine\.ulysses_sequence_parallel"
                                         r"_size\) = 1024 is below data\.max_length = 2048"):
        low = load(changed("data", "max_token_len_per_gpu", 512))
    assert low.rearrange_kwargs("sft") == {"max_token_len": 1024}
    with pytest.warns(UserWarning, match=r"^engine\.strategy: 'mindspeed' is not an engine seqpack knows"):
        assert load(changed("engine", "strategy", "mindspeed")).verl.sft.sp_size == 1


def test_sft_keys_mean_verl_unless_the_config_has_the_roll_role_asked_for():
    assert load(SFT).schema == "verl"  # was ROLL's ("actor_train: no such worker role")
    data = {**SFT, "actor_train": {"strategy_args": {"strategy_name": "megatron_train"}}}
    assert load(data).schema == "roll"
    assert load({"sft_train": {}, "data": {"use_dynamic_bsz": True}}, role="sft_train").schema == "roll"


# ---------------------------------------------------------------- ROLL's strategy


def roll(worker):
    return {"sequence_length": 4096, "actor_train": {
        "use_sequence_packing": True, "sequence_packing_args": {"algorithm": "load_balance",
                                                                "max_packed_sequence_length_train": 8192,
                                                                "max_packed_sequence_length_forward": 8192},
        **worker}}


def test_roll_strategy_args_without_a_name_is_rolls_default_strategy_and_packing_goes_off():
    # ROLL's StrategyArguments default is not a Megatron strategy (fsdp2_train; deepspeed_train
    # in older releases), and its WorkerConfig then turns packing off: seqpack assumed megatron_train.
    with pytest.warns(UserWarning) as caught:
        cfg = load(roll({"strategy_args": {"strategy_config": {"tensor_model_parallel_size": 2}}}))
    assert cfg.parallel.backend == config.ROLL_DEFAULT_STRATEGY == "fsdp2_train" and not cfg.roll_packing.enabled
    assert [str(w.message) for w in caught] == [
        "actor_train.use_sequence_packing: ROLL packs sequences with Megatron strategies only and turns packing off "
        "for strategy_args without a strategy_name (ROLL's default, 'fsdp2_train'; 'deepspeed_train' in older "
        "releases); so does seqpack"]
    assert cfg.parallel.tp == 2 and load(cfg.to_dict()) == cfg
    with pytest.warns(UserWarning, match="ROLL's default, 'fsdp2_train'"):
        assert load(roll({"strategy_args": {}})).parallel.backend == "fsdp2_train"


def test_roll_without_strategy_args_keeps_packing_as_rolls_worker_config_does():
    # WorkerConfig.strategy_args is None: its strategy check does not run, packing stays on.
    for worker in ({}, {"strategy_args": None}):
        cfg = strict_load(roll(worker))
        assert cfg.roll_packing.enabled and cfg.parallel.backend is None and cfg.parallel.tp == 1
        assert cfg.load_balance_kwargs("train")["max_packed_sequence_length"] == 8192
        assert "strategy_args" not in cfg.to_dict()["actor_train"] and strict_load(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match=r"^actor_train\.strategy_args\.strategy_name: must be a non-empty string, "
                                          r"got None"):
        load(roll({"strategy_args": {"strategy_name": None}}))  # dacite refuses None for the Literal


def test_roll_dynamic_batching_turns_packing_off_before_the_strategy_check():
    # ROLL's __post_init__ order: the dynamic-batching conflict first (its warning only).
    with pytest.warns(UserWarning) as caught:
        cfg = load(roll({"strategy_args": {"strategy_name": "fsdp2_train"}, "use_dynamic_batching_in_train": True,
                         "max_tokens_per_microbatch_in_train": 8192}))
    assert not cfg.roll_packing.enabled and cfg.roll_dynamic_batching.train
    assert [str(w.message).split(":")[1].strip().split(" ")[:3] for w in caught] == [
        ["sequence", "packing", "and"]]
    megatron = strict_load(roll({"strategy_args": {"strategy_name": "megatron_train"}}))
    assert megatron.roll_packing.enabled and megatron.parallel.backend == "megatron_train"
