"""Asynchronous training's keys (issue 42, item 4): NeMo-RL's ``grpo.async_grpo``
and verl's ``async_training`` read into a ``StreamConfig``, round-tripped by
``to_dict``, typos caught, bad values named, and ``stream_planner_kwargs`` building
a StreamPlanner."""

import pathlib
import warnings

import pytest

import seqpack
from seqpack import config
from seqpack.config import ConfigError

DOCS = config.example("verl_ppo.yaml").parent  # the shipped examples


def nemo_rl(**async_grpo):
    return {"policy": {"sequence_packing": {"enabled": True, "train_mb_tokens": 16384,
                                            "microbatch_order": "largest_first"},
                       "dynamic_batching": {"enabled": False}},
            "grpo": {"num_generations_per_prompt": 8,
                     "async_grpo": {"enabled": True, "max_trajectory_age_steps": 2, **async_grpo}}}


def verl(**async_training):
    return {"actor_rollout_ref": {"actor": {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 16384},
                                  "rollout": {"n": 8}},
            "async_training": {"trigger_parameter_sync_step": 4, "partial_rollout": True, **async_training}}


def load(data):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return config.load(data)


def test_nemo_rl_async_grpo():
    cfg = load(nemo_rl(step_tokens=1 << 20, static_shapes=8, in_flight_weight_updates=True))
    st = cfg.stream
    assert (st.path, st.enabled, st.max_staleness, st.step_tokens, st.group_size, st.micro_batch_order,
            st.static_shapes) == ("grpo.async_grpo", True, 2, 1 << 20, 8, "largest_first", 8)
    kwargs = cfg.stream_planner_kwargs(8)
    options = seqpack.StepOptions(micro_batch_order="largest_first", static_shapes=8)
    assert kwargs == {"dp_size": 8, "max_tokens": 16384, "step_tokens": 1 << 20, "max_staleness": 2,
                      "group_size": 8, "options": options}
    assert cfg.step_options() == options and cfg.plan_step_kwargs(8)["options"] == options  # one object, shared
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the config's keywords are the current spelling
        planner = seqpack.StreamPlanner(**kwargs)
    assert planner.max_staleness == 2 and planner.step_tokens == 1 << 20 and planner.options == options
    assert load(cfg.to_dict()) == cfg
    off = load(nemo_rl(enabled=False, max_trajectory_age_steps="x"))  # a switched-off section only warns
    assert off.stream.enabled is False
    with pytest.raises(ConfigError, match="grpo.async_grpo.enabled: asynchronous training is not configured"):
        off.stream_planner_kwargs(2)
    assert load({"policy": {}}).stream is None


def test_verl_async_training():
    cfg = load(verl(max_head_offpolicyness=1, step_tokens=1 << 19, static_shapes=[4096, 16384],
                    microbatch_order="largest_first", staleness_threshold=0.1))
    st = cfg.stream
    assert (st.path, st.enabled, st.max_staleness, st.step_tokens, st.group_size, st.micro_batch_order,
            st.static_shapes) == ("async_training", True, 1, 1 << 19, 8, "largest_first", (4096, 16384))
    kwargs = cfg.stream_planner_kwargs(4)
    assert kwargs["max_tokens"] == 16384 and kwargs["options"].static_shapes == (4096, 16384)
    assert kwargs["options"].micro_batch_order == "largest_first"
    seqpack.StreamPlanner(**kwargs)
    assert load(cfg.to_dict()) == cfg
    assert load({"actor_rollout_ref": {}}).stream is None


def test_verl_staleness_threshold_is_not_a_version_lag():
    with pytest.warns(UserWarning, match="not a version lag"):
        cfg = config.load(verl(staleness_threshold=0.5, step_tokens=4096))
    assert cfg.stream.max_staleness is None
    with pytest.raises(ConfigError, match="staleness_threshold: must be a number >= 0"):
        load(verl(staleness_threshold=-1))


def test_typos_and_bad_values_are_named():
    cases = [
        (nemo_rl(max_trajectory_age_step=1), "max_trajectory_age_step: unknown key; did you mean"),
        ({**nemo_rl(), "grpo": {"async_grp": {}}}, "grpo.async_grp: unknown section"),
        (verl(step_token=4), "async_training.step_token: unknown key; did you mean 'step_tokens'"),
        ({"async_trainig": {}, "actor_rollout_ref": {}}, "async_trainig: unknown section"),
        (verl(static_shapes={"a": 1}), "static_shapes: must be true, a bucket count or a list"),
        (verl(static_shapes=[0, 4096]), r"static_shapes\[0\]: must be >= 1"),
        (verl(static_shapes=["x"]), r"static_shapes\[0\]: must be an integer"),
        (verl(microbatch_order="smallest"), "microbatch_order: must be one of"),
        (verl(max_head_offpolicyness=-1), "max_head_offpolicyness: must be >= 0"),
        (nemo_rl(step_tokens=0), "step_tokens: must be >= 1"),
    ]
    for data, message in cases:
        with pytest.raises(ConfigError, match=message):
            load(data)
    with pytest.raises(ConfigError, match="async_training.step_tokens: required"):
        load(verl()).stream_planner_kwargs(2)


def test_the_documented_example_loads_and_plans():
    cfg = load(str(DOCS / "nemo_rl_async_grpo.yaml"))
    planner = seqpack.StreamPlanner(**cfg.stream_planner_kwargs(8))
    ids = planner.add([5000] * 8, group_ids=0, version=0, group_size=cfg.stream.group_size)
    assert ids.tolist() == list(range(8)) and planner.pending == 8


def test_the_shared_prefix_switch_reaches_the_step_options():
    # One spelling: each framework's shared-prefix training switch becomes
    # StepOptions.shared_prefix, so a StreamPlanner built from the config plans trees
    # and plan_step asks for the batch's forest instead of planning rows.
    nemo = nemo_rl(step_tokens=1 << 20)
    nemo["policy"]["shared_prefix_training"] = True
    roll = {"actor_train": {"use_sequence_packing": True, "sequence_packing_args": {
        "algorithm": "load_balance", "max_packed_sequence_length_train": 8192,
        "max_packed_sequence_length_forward": 8192, "shared_prefix": True}}}
    grouper = verl(step_tokens=1 << 20)
    grouper["actor_rollout_ref"]["actor"]["use_prefix_grouper"] = True
    for data in (nemo, roll, grouper):
        cfg = load(data)
        assert cfg.shared_prefix_training and cfg.step_options().shared_prefix
        kwargs = cfg.plan_step_kwargs(2)
        with pytest.raises(ValueError, match="plan_step needs forest="):
            seqpack.plan_step([5, 3], **kwargs)
        if cfg.stream is not None and cfg.stream.enabled:
            assert seqpack.StreamPlanner(**cfg.stream_planner_kwargs(2)).shared_prefix
    nemo["policy"]["shared_prefix_training"] = False
    assert not load(nemo).step_options().shared_prefix


def test_the_prefix_reuse_switches_reach_the_stream_planner():
    nemo = nemo_rl(step_tokens=1 << 20)
    nemo["policy"].update(shared_prefix_training=True, shared_prefix_reuse=True, make_sequence_length_divisible_by=1,
                          dtensor_cfg={"enabled": True})
    nemo["policy"]["sequence_packing"]["microbatch_order"] = "packer"
    lib = verl(step_tokens=1 << 20)
    lib["actor_rollout_ref"]["model"] = {"external_lib": "seqpack.frameworks.verl.prefix_reuse_engine"}
    for data in (nemo, lib):
        cfg = load(data)
        planner = seqpack.StreamPlanner(**cfg.stream_planner_kwargs(2))
        assert planner.options.prefix_reuse and planner.shared_prefix
    nemo["policy"]["sequence_packing"]["microbatch_order"] = "largest_first"  # the stream's order: passes have theirs
    with pytest.raises(config.ConfigError, match="prefix_reuse=True and micro_batch_order='largest_first'"):
        load(nemo)  # named when the config is read
