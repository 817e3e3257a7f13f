"""seqpack.config: verl's schema (actor_rollout_ref.*, critic, data, trainer), its
defaults, each key seqpack reads, the errors, and interpolations."""

import copy
import os
import time
import warnings

import pytest
import yaml

from seqpack import config
from seqpack.config import ConfigError, load

EXAMPLE = str(config.example("verl_ppo.yaml"))



def verl(**sections):
    """A verl config: ``actor=...`` etc. go under actor_rollout_ref, the rest at the top."""
    arr = {k: sections.pop(k) for k in ("actor", "ref", "rollout", "model") if k in sections}
    return {"actor_rollout_ref": arr, **sections}


def with_change(path, value, base):
    data = copy.deepcopy(base)
    node = data
    keys = path.split(".")
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    node[keys[-1]] = value
    return data


DYNAMIC = verl(data={"max_prompt_length": 1024, "max_response_length": 3072, "train_batch_size": 256},
               model={"use_remove_padding": True},
               actor={"strategy": "fsdp", "use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 8192,
                      "ppo_mini_batch_size": 64},
               rollout={"n": 4})
FIXED = verl(data={"train_batch_size": 256},
             actor={"ppo_mini_batch_size": 64, "ppo_micro_batch_size_per_gpu": 4},
             algorithm={"adv_estimator": "gae"})


# ---------------------------------------------------------------- example and defaults


def test_example_file():
    cfg = load(EXAMPLE)
    assert cfg.schema == "verl" and cfg.role is None
    assert cfg.parallel == config.ParallelConfig(backend="fsdp", ulysses=2)
    assert cfg.max_seqlen == 1024 + 3072
    assert cfg.global_batch_size == 512 * 8
    v = cfg.verl
    assert (v.train_batch_size, v.ppo_mini_batch_size, v.rollout_n, v.sequences_per_mini_batch) == (512, 128, 8, 1024)
    assert v.balance_batch and not v.use_critic  # adv_estimator: grpo
    assert v.actor == config.VerlMicroBatching(path="actor_rollout_ref.actor", use_dynamic_bsz=True,
                                               max_token_len_per_gpu=8192, sp_size=2, use_remove_padding=True)
    # ${actor_rollout_ref.actor.use_dynamic_bsz}, ${oc.select:...}, ${.ppo_max_token_len_per_gpu} resolved
    assert v.ref.use_dynamic_bsz and v.ref.sp_size == 2 and v.ref.max_token_len_per_gpu == 16384
    assert v.rollout.use_dynamic_bsz and v.rollout.sp_size == 2
    assert v.critic_forward.max_token_len_per_gpu == 32768 and v.critic_forward.use_dynamic_bsz
    assert cfg.rearrange_kwargs() == {"max_token_len": 16384}
    assert cfg.rearrange_kwargs("ref") == cfg.rearrange_kwargs("rollout") == {"max_token_len": 32768}
    assert cfg.balance_batch_kwargs(8) == {"k_partitions": 8, "equal_size": True}
    # keys seqpack does not read are not resolved: .raw holds the config as written
    assert cfg.raw["trainer"]["default_local_dir"] == "checkpoints/${trainer.project_name}/${trainer.experiment_name}"
    assert cfg.raw["actor_rollout_ref"]["rollout"]["response_length"] == "${data.max_response_length}"


def test_example_as_text_mapping_and_round_trip():
    with open(EXAMPLE) as f:
        text = f.read()
    cfg = load(EXAMPLE)
    assert load(text) == cfg == load(yaml.safe_load(text))
    assert load(yaml.safe_load(yaml.safe_dump(cfg.to_dict()))) == cfg


def test_defaults():
    cfg = load({"actor_rollout_ref": {}})
    assert cfg.schema == "verl"
    assert cfg.parallel == config.ParallelConfig(backend="fsdp")
    assert cfg.max_seqlen == 1024 and cfg.global_batch_size == 1024
    v = cfg.verl
    assert (v.strategy, v.critic_strategy, v.train_batch_size, v.ppo_mini_batch_size, v.critic_ppo_mini_batch_size,
            v.rollout_n, v.balance_batch, v.use_critic) == ("fsdp", "fsdp", 1024, 256, 256, 1, True, True)
    for role in config.VERL_ROLES:
        mb = cfg.micro_batching(role)
        assert not mb.use_dynamic_bsz and mb.sp_size == 1 and mb.use_remove_padding
        assert mb.micro_batch_size is None and mb.micro_batch_size_per_gpu is None
        assert mb.max_token_len_per_gpu == (32768 if role.startswith("critic") else 16384)
    assert [cfg.micro_batching(r).path for r in config.VERL_ROLES] == [
        "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "actor_rollout_ref.ref", "critic", "critic"]
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.actor\.use_dynamic_bsz: dynamic batching is disabled"):
        cfg.rearrange_kwargs()
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.ref\.log_prob_use_dynamic_bsz: dynamic batching"):
        cfg.rearrange_kwargs("ref")
    with pytest.raises(ConfigError, match=r"role must be one of"):
        cfg.micro_batching("reward_model")
    assert load({}, schema="verl") == cfg
    assert load(cfg.to_dict()) == cfg


def test_schema_detection_and_guards():
    assert load({"actor_rollout_ref": {}, "critic": {}}).schema == "verl"
    assert load({"policy": {}}).schema == "nemo_rl"
    nemo = load({"policy": {}})
    with pytest.raises(ConfigError, match="needs a verl config"):
        nemo.rearrange_kwargs()
    with pytest.raises(ConfigError, match="needs a verl config"):
        nemo.balance_batch_kwargs(2)
    cfg = load(DYNAMIC)
    with pytest.raises(ConfigError, match="needs a NeMo-RL config"):
        cfg.shard_kwargs(2)
    with pytest.raises(ConfigError, match="needs a ROLL config"):
        cfg.load_balance_kwargs()
    with pytest.raises(ConfigError, match=r"schema must be one of \['nemo_rl', 'roll', 'verl'\]"):
        load({}, schema="slime")


# ---------------------------------------------------------------- each mapped key


@pytest.mark.parametrize("path, value, check", [
    ("actor_rollout_ref.actor.use_dynamic_bsz", False, lambda c: not c.verl.actor.use_dynamic_bsz),
    ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", 5000,
     lambda c: c.rearrange_kwargs("actor") == {"max_token_len": 5000}),
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", 4, lambda c: c.verl.actor.micro_batch_size_per_gpu == 4),
    ("actor_rollout_ref.actor.ppo_micro_batch_size", 32, lambda c: c.verl.actor.micro_batch_size == 32),
    ("actor_rollout_ref.actor.ppo_mini_batch_size", 32,
     lambda c: c.verl.ppo_mini_batch_size == 32 and c.verl.sequences_per_mini_batch == 128),
    ("actor_rollout_ref.actor.ulysses_sequence_parallel_size", 4,
     lambda c: c.parallel.ulysses == 4 and c.rearrange_kwargs() == {"max_token_len": 32768}),
    ("actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size", 2,
     lambda c: c.verl.actor.sp_size == 2 and c.verl.rollout.sp_size == 2 and c.verl.ref.sp_size == 1),
    ("actor_rollout_ref.actor.use_remove_padding", False,
     lambda c: not c.verl.actor.use_remove_padding and not c.verl.rollout.use_remove_padding
     and c.verl.ref.use_remove_padding),
    ("actor_rollout_ref.model.use_remove_padding", False,
     lambda c: not c.verl.actor.use_remove_padding and not c.verl.ref.use_remove_padding
     and c.verl.critic.use_remove_padding),
    ("actor_rollout_ref.ref.log_prob_use_dynamic_bsz", False,
     lambda c: not c.verl.ref.use_dynamic_bsz and c.verl.rollout.use_dynamic_bsz),
    ("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", 20000,
     lambda c: c.rearrange_kwargs("ref") == {"max_token_len": 20000} and c.verl.rollout.max_token_len_per_gpu == 8192),
    ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", 8, lambda c: c.verl.ref.micro_batch_size_per_gpu == 8),
    ("actor_rollout_ref.ref.log_prob_micro_batch_size", 64, lambda c: c.verl.ref.micro_batch_size == 64),
    ("actor_rollout_ref.ref.ulysses_sequence_parallel_size", 2,
     lambda c: c.verl.ref.sp_size == 2 and c.verl.actor.sp_size == 1),
    ("actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size", 2, lambda c: c.verl.ref.sp_size == 2),
    ("actor_rollout_ref.rollout.log_prob_use_dynamic_bsz", False, lambda c: not c.verl.rollout.use_dynamic_bsz),
    ("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", 12000,
     lambda c: c.rearrange_kwargs("rollout") == {"max_token_len": 12000}),
    ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", 2,
     lambda c: c.verl.rollout.micro_batch_size_per_gpu == 2),
    ("actor_rollout_ref.rollout.log_prob_micro_batch_size", 16, lambda c: c.verl.rollout.micro_batch_size == 16),
    ("actor_rollout_ref.rollout.n", 16, lambda c: c.verl.rollout_n == 16 and c.global_batch_size == 256 * 16),
    ("critic.use_dynamic_bsz", False, lambda c: not c.verl.critic.use_dynamic_bsz
     and not c.verl.critic_forward.use_dynamic_bsz),
    ("critic.ppo_max_token_len_per_gpu", 9000, lambda c: c.rearrange_kwargs("critic") == {"max_token_len": 9000}
     and c.rearrange_kwargs("critic_forward") == {"max_token_len": 9000}),
    ("critic.forward_max_token_len_per_gpu", 40000,
     lambda c: c.verl.critic.max_token_len_per_gpu == 32768 and c.verl.critic_forward.max_token_len_per_gpu == 40000),
    ("critic.ppo_micro_batch_size_per_gpu", 2, lambda c: c.verl.critic.micro_batch_size_per_gpu == 2
     and c.verl.critic_forward.micro_batch_size_per_gpu == 2),
    ("critic.forward_micro_batch_size_per_gpu", 8, lambda c: c.verl.critic_forward.micro_batch_size_per_gpu == 8
     and c.verl.critic.micro_batch_size_per_gpu is None),
    ("critic.ppo_mini_batch_size", 16, lambda c: c.verl.critic_ppo_mini_batch_size == 16),
    ("critic.ulysses_sequence_parallel_size", 2, lambda c: c.verl.critic.sp_size == 2
     and c.rearrange_kwargs("critic_forward") == {"max_token_len": 65536}),
    ("critic.fsdp.ulysses_sequence_parallel_size", 2, lambda c: c.verl.critic.sp_size == 2),
    ("critic.model.use_remove_padding", False, lambda c: not c.verl.critic.use_remove_padding),
    ("critic.enable", False, lambda c: not c.verl.use_critic),
    ("algorithm.adv_estimator", "grpo", lambda c: not c.verl.use_critic),
    ("trainer.balance_batch", False, lambda c: not c.verl.balance_batch),
    ("data.train_batch_size", 128, lambda c: c.verl.train_batch_size == 128 and c.global_batch_size == 512),
    ("data.max_prompt_length", 2048, lambda c: c.max_seqlen == 2048 + 3072),
    ("data.max_response_length", 1024, lambda c: c.max_seqlen == 1024 + 1024),
])
def test_mapped_key(path, value, check):
    cfg = load(with_change(path, value, DYNAMIC))
    assert check(cfg), cfg
    assert load(cfg.to_dict()) == cfg


def test_log_prob_and_critic_defaults_follow_the_actor():
    cfg = load(verl(actor={"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 4096}))
    for role in ("rollout", "ref", "critic", "critic_forward"):
        assert cfg.micro_batching(role).use_dynamic_bsz
    assert cfg.verl.ref.max_token_len_per_gpu == cfg.verl.rollout.max_token_len_per_gpu == 4096
    assert cfg.verl.critic.max_token_len_per_gpu == 32768  # the critic's own default
    # ref's Ulysses size follows the actor's key, not the actor's engine config (verl's oc.select)
    cfg = load(verl(model={"use_remove_padding": True}, actor={"ulysses_sequence_parallel_size": 2}))
    assert cfg.verl.ref.sp_size == 2
    cfg = load(verl(actor={"fsdp_config": {"ulysses_sequence_parallel_size": 2}}))
    assert cfg.verl.actor.sp_size == 2 and cfg.verl.ref.sp_size == 1


def test_megatron_strategy():
    cfg = load(verl(data={"max_prompt_length": 1024, "max_response_length": 7168},
                    actor={"strategy": "megatron", "use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 4096,
                           "megatron": {"tensor_model_parallel_size": 4, "context_parallel_size": 2,
                                        "pipeline_model_parallel_size": 2,
                                        "virtual_pipeline_model_parallel_size": 2}}))
    assert cfg.parallel == config.ParallelConfig(tp=4, cp=2, pp=2, vpp=2, sequence_parallel=True,
                                                 backend="megatron")
    assert cfg.rearrange_kwargs() == {"max_token_len": 8192}  # per GPU x CP
    assert cfg.verl.ref.sp_size == 2 and cfg.verl.critic_strategy == "megatron"
    assert load(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match=r"ppo_max_token_len_per_gpu: 2048 x 2 context-parallel ranks = 4096 "
                                          r"is below the longest sequence"):
        load(with_change("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", 2048, cfg.to_dict()))


def test_balance_batch():
    cfg = load(with_change("trainer.balance_batch", False, DYNAMIC))
    with pytest.raises(ConfigError, match=r"^trainer\.balance_batch: batch balancing is disabled"):
        cfg.balance_batch_kwargs(4)
    for bad in (0, True, 2.0):
        with pytest.raises(ConfigError, match="dp_size must be an integer >= 1"):
            load(DYNAMIC).balance_batch_kwargs(bad)


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("path, value, message", [
    ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", 0,
     r"^actor_rollout_ref\.actor\.ppo_max_token_len_per_gpu: must be >= 1, got 0$"),
    ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "8k",
     r"^actor_rollout_ref\.actor\.ppo_max_token_len_per_gpu: must be an integer, got '8k'"),
    ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", None,
     r"^actor_rollout_ref\.actor\.ppo_max_token_len_per_gpu: required with actor_rollout_ref\.actor\.use_dynamic_bsz"),
    ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", 1024,
     r"^actor_rollout_ref\.actor\.ppo_max_token_len_per_gpu: 1024 x 2 Ulysses sequence-parallel ranks = 2048 is "
     r"below the longest sequence, data\.max_prompt_length \+ data\.max_response_length = 1024 \+ 3072$"),
    ("actor_rollout_ref.actor.use_dynamic_bsz", "true",
     r"^actor_rollout_ref\.actor\.use_dynamic_bsz: must be true or false, got 'true'"),
    ("actor_rollout_ref.actor.ppo_mini_batch_size", 0, r"^actor_rollout_ref\.actor\.ppo_mini_batch_size: must be >= 1"),
    ("actor_rollout_ref.actor.ppo_mini_batch_size", None,
     r"^actor_rollout_ref\.actor\.ppo_mini_batch_size: must be an integer, got None"),
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", -1,
     r"^actor_rollout_ref\.actor\.ppo_micro_batch_size_per_gpu: must be >= 1, got -1"),
    ("actor_rollout_ref.actor.strategy", "", r"^actor_rollout_ref\.actor\.strategy: must be a non-empty string"),
    ("actor_rollout_ref.actor.ulysses_sequence_parallel_size", 0,
     r"^actor_rollout_ref\.actor\.ulysses_sequence_parallel_size: must be >= 1, got 0"),
    ("actor_rollout_ref.actor.fsdp_config", {"ulysses_sequence_parallel_size": 4},
     r"^actor_rollout_ref\.actor\.ulysses_sequence_parallel_size: 2 disagrees with "
     r"actor_rollout_ref\.actor\.fsdp_config\.ulysses_sequence_parallel_size = 4"),
    ("actor_rollout_ref.model.use_remove_padding", False,
     r"^actor_rollout_ref\.actor\.ulysses_sequence_parallel_size: Ulysses sequence parallelism \(2\) needs "
     r"actor_rollout_ref\.model\.use_remove_padding = true"),
    ("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", 1024,
     r"^actor_rollout_ref\.ref\.log_prob_max_token_len_per_gpu: 1024 x 2 Ulysses sequence-parallel ranks = 2048 "
     r"is below the longest sequence"),
    ("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", 0,
     r"^actor_rollout_ref\.rollout\.log_prob_max_token_len_per_gpu: must be >= 1, got 0"),
    ("actor_rollout_ref.rollout.log_prob_use_dynamic_bsz", 1,
     r"^actor_rollout_ref\.rollout\.log_prob_use_dynamic_bsz: must be true or false, got 1"),
    ("actor_rollout_ref.rollout.n", 0, r"^actor_rollout_ref\.rollout\.n: must be >= 1, got 0"),
    ("critic.ppo_max_token_len_per_gpu", 1000,
     r"^critic\.ppo_max_token_len_per_gpu: 1000 is below the longest sequence"),
    ("critic.forward_max_token_len_per_gpu", 0, r"^critic\.forward_max_token_len_per_gpu: must be >= 1, got 0"),
    ("critic.ulysses_sequence_parallel_size", 2, None),  # fine: critic.model.use_remove_padding defaults to true
    ("critic.enable", "auto", r"^critic\.enable: must be true or false"),
    ("data.train_batch_size", 0, r"^data\.train_batch_size: must be >= 1, got 0"),
    ("data.max_response_length", "long", r"^data\.max_response_length: must be an integer"),
    ("trainer.balance_batch", "yes", r"^trainer\.balance_batch: must be true or false"),
    ("algorithm.adv_estimator", 3, r"^algorithm\.adv_estimator: must be a non-empty string"),
    ("actor_rollout_ref.actor", [1], r"^actor_rollout_ref\.actor: must be a mapping, got list"),
])
def test_errors(path, value, message):
    base = with_change("actor_rollout_ref.actor.ulysses_sequence_parallel_size", 2, DYNAMIC)
    base = with_change("algorithm.adv_estimator", "gae", base)
    data = with_change(path, value, base)
    if message is None:
        load(data)
        return
    with pytest.raises(ConfigError, match=message):
        load(data)


def test_errors_of_fixed_micro_batches():
    # verl's own rules when dynamic batching is off
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.actor\.ppo_micro_batch_size: deprecated, and "
                                          r"actor_rollout_ref\.actor\.ppo_micro_batch_size_per_gpu is set too"):
        load(with_change("actor_rollout_ref.actor.ppo_micro_batch_size", 16, FIXED))
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.ref\.log_prob_micro_batch_size: deprecated"):
        load(with_change("actor_rollout_ref.ref", {"log_prob_micro_batch_size": 8,
                                                   "log_prob_micro_batch_size_per_gpu": 1}, FIXED))
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.actor\.ppo_mini_batch_size: 512 is above "
                                          r"data\.train_batch_size = 256"):
        load(with_change("actor_rollout_ref.actor.ppo_mini_batch_size", 512, FIXED))
    no_per_gpu = with_change("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", None, FIXED)
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.actor\.ppo_mini_batch_size: must be divisible by "
                                          r"actor_rollout_ref\.actor\.ppo_micro_batch_size = 24, got 64"):
        load(with_change("actor_rollout_ref.actor.ppo_micro_batch_size", 24, no_per_gpu))
    with pytest.raises(ConfigError, match=r"^critic\.ppo_mini_batch_size: 300 is above data\.train_batch_size"):
        load(with_change("critic.ppo_mini_batch_size", 300, FIXED))
    # with dynamic batching on, verl skips these checks, and so does seqpack
    dyn = with_change("actor_rollout_ref.actor.use_dynamic_bsz", True, FIXED)
    assert load(with_change("actor_rollout_ref.actor.ppo_micro_batch_size", 16, dyn)).verl.actor.micro_batch_size == 16


def test_unused_critic_is_not_cross_checked():
    small = with_change("critic.ppo_max_token_len_per_gpu", 100, DYNAMIC)
    with pytest.raises(ConfigError, match="critic.ppo_max_token_len_per_gpu: 100 is below"):
        load(small)  # adv_estimator defaults to gae: the critic runs
    assert not load(with_change("algorithm.adv_estimator", "grpo", small)).verl.use_critic
    assert not load(with_change("critic.enable", False, small)).verl.use_critic
    with pytest.raises(ConfigError, match="must be >= 1"):  # a value's own rule still holds
        load(with_change("critic.enable", False, with_change("critic.ppo_max_token_len_per_gpu", 0, DYNAMIC)))
    no_rmpad = with_change("critic.model.use_remove_padding", False,
                           with_change("critic.ulysses_sequence_parallel_size", 2, DYNAMIC))
    with pytest.raises(ConfigError, match=r"^critic\.ulysses_sequence_parallel_size: Ulysses sequence parallelism "
                                          r"\(2\) needs critic\.model\.use_remove_padding = true"):
        load(no_rmpad)
    assert load(with_change("critic.enable", False, no_rmpad)).verl.critic.sp_size == 2


# ---------------------------------------------------------------- did-you-mean


@pytest.mark.parametrize("path, message", [
    ("actor_rollout_ref.actor.use_dynamic_bs", r"^actor_rollout_ref\.actor\.use_dynamic_bs: unknown key; "
                                               r"did you mean 'use_dynamic_bsz'\?"),
    ("actor_rollout_ref.actor.ppo_max_token_len_per_gpus", r"did you mean 'ppo_max_token_len_per_gpu'"),
    ("actor_rollout_ref.actor.ulysses_sequence_paralel_size", r"did you mean 'ulysses_sequence_parallel_size'"),
    ("actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel", r"^actor_rollout_ref\.actor\.fsdp_config\."
                                                                      r"ulysses_sequence_parallel: unknown key"),
    ("actor_rollout_ref.ref.log_prob_max_token_len_per_gpus", r"^actor_rollout_ref\.ref\.log_prob_max_token_len_"
                                                              r"per_gpus: unknown key; did you mean"),
    ("actor_rollout_ref.rollout.log_prob_use_dynamic_bs", r"did you mean 'log_prob_use_dynamic_bsz'"),
    ("actor_rollout_ref.model.use_remove_paddings", r"^actor_rollout_ref\.model\.use_remove_paddings: unknown key; "
                                                    r"did you mean 'use_remove_padding'"),
    ("critic.forward_max_token_len_per_gpus", r"did you mean 'forward_max_token_len_per_gpu'"),
    ("critic.model.use_remove_padings", r"^critic\.model\.use_remove_padings: unknown key"),
    ("data.train_batch_sizes", r"^data\.train_batch_sizes: unknown key; did you mean 'train_batch_size'"),
    ("trainer.balance_batchs", r"^trainer\.balance_batchs: unknown key; did you mean 'balance_batch'"),
    ("actor_rollout_ref.actr.use_dynamic_bsz", r"^actor_rollout_ref\.actr: unknown section; did you mean 'actor'"),
    ("actor_rollout_reff.actor.use_dynamic_bsz", r"^actor_rollout_reff: unknown section; did you mean "
                                                 r"'actor_rollout_ref'"),
    ("critc.use_dynamic_bsz", r"^critc: unknown section; did you mean 'critic'"),
])
def test_did_you_mean(path, message):
    with pytest.raises(ConfigError, match=message):
        load(with_change(path, True, DYNAMIC), schema="verl")


def test_verl_keys_seqpack_does_not_read_are_left_alone():
    data = copy.deepcopy(DYNAMIC)
    data["actor_rollout_ref"]["actor"].update(
        clip_ratio=0.2, ppo_epochs=1, ppo_infer_max_token_len_per_gpu=4096, ppo_infer_micro_batch_size_per_gpu=8,
        use_torch_compile=True, entropy_from_logits_with_chunking=False, loss_agg_mode="token-mean",
        fsdp_config={"param_offload": False, "fsdp_size": -1, "model_dtype": "fp32", "wrap_policy": {}})
    data["actor_rollout_ref"]["rollout"].update(name="vllm", max_num_batched_tokens=8192, max_model_len=None,
                                                tensor_model_parallel_size=2, prompt_length=1024)
    data["actor_rollout_ref"]["model"].update(path="~/models/x", use_fused_kernels=False, truncate_padding=False)
    data["actor_rollout_ref"].update(hybrid_engine=True, nccl_timeout=600)
    data["critic"] = {"ppo_infer_max_token_len_per_gpu": 8192, "cliprange_value": 0.5, "rollout_n": 4,
                      "model": {"path": "~/models/x", "fsdp_config": {}}, "fsdp": {"fsdp_size": -1}}
    data["data"].update(val_batch_size=None, gen_batch_size=512, max_samples=-1)
    data["trainer"] = {"total_epochs": 30, "n_gpus_per_node": 8, "critic_warmup": 0}
    data["reward_model"] = {"enable": False}
    data["algorithm"] = {"adv_estimator": "grpo", "use_kl_in_reward": False}
    data["global_profiler"] = {"tool": None}
    assert load(data).verl == load(with_change("algorithm.adv_estimator", "grpo", DYNAMIC)).verl


# ---------------------------------------------------------------- interpolations


def test_interpolations():
    data = verl(data={"max_prompt_length": 512, "max_response_length": 1536, "train_batch_size": 64},
                model={"use_remove_padding": True},
                actor={"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": "${data.max_response_length}",
                       "ppo_mini_batch_size": "${oc.select:data.mini,16}",
                       "use_remove_padding": "${oc.select:actor_rollout_ref.model.use_remove_padding,false}",
                       "ulysses_sequence_parallel_size": 2},
                ref={"log_prob_max_token_len_per_gpu": "${oc.select:actor_rollout_ref.actor.ppo_max_token_len_per_gpu,"
                                                       "16384}",
                     "ulysses_sequence_parallel_size": "${..actor.ulysses_sequence_parallel_size}"},
                critic={"ppo_max_token_len_per_gpu": 4096,
                        "forward_max_token_len_per_gpu": "${.ppo_max_token_len_per_gpu}",
                        "enable": "${oc.select:critic.nope,false}"},
                trainer={"project_name": "p",
                         "default_local_dir": "ckpt/${trainer.project_name}/${data.train_batch_size}"})
    cfg = load(data)
    assert cfg.verl.actor.max_token_len_per_gpu == 1536 and cfg.verl.ppo_mini_batch_size == 16
    assert cfg.verl.actor.use_remove_padding and cfg.verl.ref.sp_size == 2
    assert cfg.verl.ref.max_token_len_per_gpu == 1536
    assert cfg.verl.critic_forward.max_token_len_per_gpu == 4096 and not cfg.verl.use_critic
    assert cfg.raw["trainer"]["default_local_dir"] == "ckpt/${trainer.project_name}/${data.train_batch_size}"
    assert cfg.raw["actor_rollout_ref"]["actor"]["ppo_max_token_len_per_gpu"] == "${data.max_response_length}"
    assert data["actor_rollout_ref"]["actor"]["ppo_max_token_len_per_gpu"] == "${data.max_response_length}"  # untouched


def test_other_resolvers_need_omegaconf_only_where_seqpack_reads():
    unread = with_change("trainer.default_local_dir", "${oc.env:HOME}/ckpt", DYNAMIC)
    assert load(unread).raw["trainer"]["default_local_dir"] == "${oc.env:HOME}/ckpt"  # as written
    unset = "${oc.env:SEQPACK_SURELY_UNSET_VARIABLE}"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not read: not resolved, no warning
        cfg = load(with_change("trainer.default_local_dir", unset, DYNAMIC))
    assert cfg.raw["trainer"]["default_local_dir"] == unset
    read = with_change("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", unset, DYNAMIC)
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.actor\.ppo_max_token_len_per_gpu: the interpol"):
        load(read)


@pytest.mark.parametrize("doc, message", [
    ("actor_rollout_ref:\n  actor:\n    ppo_mini_batch_size: ${data.nope}\n",
     r"^actor_rollout_ref\.actor\.ppo_mini_batch_size: the interpolation '\$\{data\.nope\}' does not resolve"),
    ("actor_rollout_ref:\n  actor: {}\ndata:\n  train_batch_size: ${data.max_prompt_length}\n"
     "  max_prompt_length: ${data.train_batch_size}\n", r"Recursive interpolation"),
])
def test_resolver_errors_name_the_key(doc, message):
    with pytest.raises(ConfigError, match=message):
        load(doc)


def test_resolver_bounds_aliases_and_chains():
    # Aliased sections that expand past 100,000 values are refused at once ...
    levels = ["a0: &a0 [" + ", ".join(["'${s}'"] * 10) + "]"]
    levels += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 10)]
    start = time.perf_counter()
    with pytest.raises(ConfigError, match="expands to more than 100000 values"):
        load("s: 1\nactor_rollout_ref: {}\n" + "\n".join(levels) + "\n")
    assert time.perf_counter() - start < 10
    # ... and a chain of sections, each referring to the next, under a key seqpack reads:
    # a section is resolved as far as it is read, so the chain never nests the result
    # (it nested it 150 levels deep when every value was resolved at load).
    chain = "\n".join(f"k{i}:\n  v: ${{k{i + 1}}}" for i in range(150)) + "\nk150: 1\n"
    cfg = load("actor_rollout_ref: ${k0}\n" + chain)
    assert cfg.verl.actor == load({"actor_rollout_ref": {}}).verl.actor and cfg.raw["k0"] == {"v": "${k1}"}


def _chain(links: int) -> str:
    """A verl config whose actor cap is read through ``links`` references."""
    return ("actor_rollout_ref:\n  actor:\n    use_dynamic_bsz: true\n    ppo_max_token_len_per_gpu: ${c0}\n"
            + "".join(f"c{i}: ${{c{i + 1}}}\n" for i in range(links)) + f"c{links}: 4096\n")


@pytest.mark.parametrize("links", [150, 250, 5000])
def test_a_chain_of_references_of_any_length_resolves(links):
    # Issue 26: 250 links raised a bare RecursionError (the resolver recursed ~6
    # Python frames per link); it is iterative now.
    cfg = load(_chain(links))
    assert cfg.raw["c0"] == "${c1}" and cfg.raw[f"c{links}"] == 4096  # .raw: as written
    assert cfg.micro_batching("actor").max_token_len == 4096
