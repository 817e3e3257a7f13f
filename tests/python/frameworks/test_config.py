"""seqpack.config: NeMo-RL and ROLL schemas, the args they produce, and every error."""

import copy
import os

import pytest
import yaml

from seqpack import config
from seqpack.config import ConfigError, load

EXAMPLES = str(config.example("verl_ppo.yaml").parent)  # the shipped examples


def example(name):
    return os.path.join(EXAMPLES, name)


def nemo(**policy):
    base = {"sequence_packing": {"enabled": False}, "dynamic_batching": {"enabled": False}}
    base.update(policy)
    return {"policy": base}


# ---------------------------------------------------------------- examples


def test_nemo_rl_packing_example():
    cfg = load(example("nemo_rl_sequence_packing.yaml"))
    assert cfg.schema == "nemo_rl"
    assert cfg.parallel == config.ParallelConfig(tp=2, cp=2, pp=1, sequence_parallel=True, backend="megatron")
    assert cfg.sequence_packing_args("train") == {
        "max_tokens_per_microbatch": 16384, "input_key": "input_ids", "input_lengths_key": "input_lengths",
        "algorithm": "modified_first_fit_decreasing", "sequence_length_pad_multiple": 8,
        "microbatch_order": "largest_first"}
    assert cfg.sequence_packing_args("logprob")["max_tokens_per_microbatch"] == 32768
    kwargs = cfg.shard_kwargs(4)
    assert kwargs["shards"] == 4 and kwargs["batch_size"] == 512 and "sequence_packing_args" in kwargs
    assert cfg.shard_kwargs(4, "logprob")["batch_size"] is None
    with pytest.raises(ConfigError, match="dynamic batching is disabled"):
        cfg.dynamic_batching_args()


def test_nemo_rl_shared_prefix_example():
    """policy.shared_prefix_training (NeMo-RL PR #4008's key): the training phase's
    packing args plan prefix trees, the log-prob phase stays dense; a typo is named;
    it needs sequence packing; the dict round-trips."""
    cfg = load(example("nemo_rl_shared_prefix.yaml"))
    assert cfg.sequence_packing.shared_prefix
    assert cfg.sequence_packing_args("train")["shared_prefix"] is True
    assert "shared_prefix" not in cfg.sequence_packing_args("logprob")
    assert cfg.shard_kwargs(2)["sequence_packing_args"]["shared_prefix"] is True
    assert load(cfg.to_dict()) == cfg
    assert "shared_prefix" not in load(example("nemo_rl_sequence_packing.yaml")).sequence_packing_args("train")
    packing = {"enabled": True, "train_mb_tokens": 4096}
    with pytest.raises(ConfigError, match="policy.shared_prefix_trainig: unknown key; did you mean "
                                          "'shared_prefix_training'"):
        load(nemo(shared_prefix_trainig=True, sequence_packing=packing))
    with pytest.raises(ConfigError, match="policy.shared_prefix_training: .*set policy.sequence_packing.enabled"):
        load(nemo(shared_prefix_training=True))
    with pytest.raises(ConfigError, match="policy.shared_prefix_training"):
        load(nemo(shared_prefix_training="maybe", sequence_packing=packing))
    assert not load(nemo(shared_prefix_training=False)).sequence_packing.shared_prefix


def test_nemo_rl_shared_prefix_reuse():
    """policy.shared_prefix_reuse (seqpack's key): trees larger than the cap in
    passes; it needs shared-prefix training and no CP (trees and passes are padded)."""
    packing = {"enabled": True, "train_mb_tokens": 4096, "logprob_mb_tokens": 8192}
    dtensor = {"enabled": True, "tensor_parallel_size": 1, "context_parallel_size": 1}
    cfg = load(nemo(shared_prefix_training=True, shared_prefix_reuse=True, sequence_packing=packing,
                    make_sequence_length_divisible_by=1, dtensor_cfg=dtensor))
    assert cfg.sequence_packing.prefix_reuse and cfg.prefix_reuse_training
    assert cfg.sequence_packing_args("train")["prefix_reuse"] is True
    assert "prefix_reuse" not in cfg.sequence_packing_args("logprob")
    assert cfg.step_options().prefix_reuse and cfg.step_options().shared_prefix
    assert load(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="policy.shared_prefix_reuse: .*needs policy.shared_prefix_training"):
        load(nemo(shared_prefix_reuse=True, sequence_packing=packing))
    padded = load(nemo(shared_prefix_training=True, shared_prefix_reuse=True, sequence_packing=packing,
                       make_sequence_length_divisible_by=8, dtensor_cfg=dtensor))  # TP + SP: trees, passes padded
    assert padded.sequence_packing_args("train")["sequence_length_pad_multiple"] == 8 and padded.prefix_reuse_training
    with pytest.raises(ConfigError, match="cannot pack sequences with context parallelism"):
        load(nemo(shared_prefix_training=True, shared_prefix_reuse=True, sequence_packing=packing,
                  make_sequence_length_divisible_by=1, dtensor_cfg={**dtensor, "context_parallel_size": 2}))
    with pytest.raises(ConfigError, match="the Megatron backend has no pass attention"):
        load(nemo(shared_prefix_training=True, shared_prefix_reuse=True, sequence_packing=packing,
                  make_sequence_length_divisible_by=1, megatron_cfg={"enabled": True}))
    with pytest.raises(ConfigError, match="did you mean 'shared_prefix_reuse'"):
        load(nemo(shared_prefix_resue=True, sequence_packing=packing))
    assert not load(example("nemo_rl_shared_prefix.yaml")).prefix_reuse_training


def test_nemo_rl_dynamic_batching_example():
    cfg = load(example("nemo_rl_dynamic_batching.yaml"))
    assert cfg.parallel.backend == "dtensor"
    assert cfg.dynamic_batching_args("logprob") == {
        "max_tokens_per_microbatch": 8192, "sequence_length_round": 64, "input_key": "input_ids",
        "input_lengths_key": "input_lengths"}
    assert "dynamic_batching_args" in cfg.shard_kwargs(2)


def test_roll_examples():
    cfg = load(example("roll_sequence_packing.yaml"))
    assert cfg.schema == "roll" and cfg.role == "actor_train"
    assert cfg.load_balance_kwargs("train") == {"algorithm": "load_balance", "max_packed_sequence_length": 16384,
                                                "min_num_micro_batches": 1, "pad_multiple": 8, "vp_size": 1,
                                                "is_train": True}
    dyn = load(example("roll_dynamic_batching.yaml"))
    assert dyn.dynamic_batching_shard_kwargs(8, "infer") == {
        "dp_size": 8, "max_tokens_per_microbatch": 16384, "sequence_length_round": 128,
        "pipeline_model_parallel_size": 1, "virtual_pipeline_model_parallel_size": None}
    ref = load(example("roll_dynamic_batching.yaml"), role="reference")
    assert ref.roll_dynamic_batching.infer and not ref.roll_dynamic_batching.train
    with pytest.raises(ConfigError, match="reference.use_dynamic_batching_in_train: dynamic batching is disabled"):
        ref.dynamic_batching_shard_kwargs(8, "train")


def test_yaml_string_and_mapping_round_trip():
    with open(example("nemo_rl_sequence_packing.yaml")) as f:
        text = f.read()
    from_text = load(text)
    from_map = load(yaml.safe_load(text))
    assert from_text == from_map


@pytest.mark.parametrize("name, role", [("nemo_rl_sequence_packing.yaml", None), ("nemo_rl_dynamic_batching.yaml", None),
                                        ("nemo_rl_shared_prefix.yaml", None),
                                        ("roll_sequence_packing.yaml", "actor_train"),
                                        ("roll_dynamic_batching.yaml", "reference")])
def test_to_dict_round_trips(name, role):
    cfg = load(example(name), role=role or "actor_train")
    again = load(yaml.safe_load(yaml.safe_dump(cfg.to_dict())), role=role or "actor_train")
    assert again == cfg


def test_legacy_pad_multiple_without_divisible_by():
    for tp, cp, want in ((1, 1, 1), (4, 1, 4), (1, 2, 4), (2, 4, 16)):
        cfg = load(nemo(megatron_cfg={"enabled": True, "tensor_model_parallel_size": tp,
                                      "context_parallel_size": cp},
                        sequence_packing={"enabled": True, "train_mb_tokens": 4096}))
        assert cfg.sequence_packing.sequence_length_pad_multiple == want


def test_roll_auto_fills_packed_lengths():
    data = {"sequence_length": 1000, "actor_train": {
        "training_args": {"per_device_train_batch_size": 3}, "infer_batch_size": 5,
        "strategy_args": {"strategy_name": "megatron_train"}, "use_sequence_packing": True,
        "sequence_packing_args": {"algorithm": "load_balance"}}}
    cfg = load(data)
    assert cfg.roll_packing.max_packed_sequence_length_train == 3000
    assert cfg.roll_packing.max_packed_sequence_length_forward == 5000


def test_interpolations_are_resolved_with_nemo_rls_resolvers():
    data = nemo(max_total_sequence_length=512, train_micro_batch_size=4,
                sequence_packing={"enabled": True, "algorithm": "first_fit_decreasing",
                                  "train_mb_tokens": "${mul:${policy.max_total_sequence_length}, "
                                                     "${policy.train_micro_batch_size}}"})
    assert load(data).sequence_packing.train_mb_tokens == 2048


# ---------------------------------------------------------------- errors


def with_change(path, value, base):
    data = copy.deepcopy(base)
    node = data
    keys = path.split(".")
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    node[keys[-1]] = value
    return data


PACKING = nemo(max_total_sequence_length=4096, megatron_cfg={"enabled": True},
               sequence_packing={"enabled": True, "train_mb_tokens": 8192})


@pytest.mark.parametrize("path, value, message", [
    ("policy.dynamic_batching", {"enabled": True, "train_mb_tokens": 8192}, "policy.sequence_packing.enabled: "
     "sequence packing and dynamic batching are exclusive"),
    ("policy.sequence_packing.algorithm", "best_fit", r"policy.sequence_packing.algorithm: must be one of"),
    ("policy.sequence_packing.microbatch_order", "smallest", r"microbatch_order: must be one of"),
    ("policy.sequence_packing.train_mb_tokens", "many", r"train_mb_tokens: must be an integer"),
    ("policy.sequence_packing.train_mb_tokens", None, r"train_mb_tokens: required"),
    ("policy.sequence_packing.enabled", "yes", r"policy.sequence_packing.enabled: must be true or false"),
    ("policy.megatron_cfg.context_parallel_size", 0, r"context_parallel_size: must be >= 1"),
    ("policy.dtensor_cfg.enabled", True, r"either Megatron or DTensor"),
])
def test_nemo_rl_errors(path, value, message):
    with pytest.raises(ConfigError, match=message):
        load(with_change(path, value, PACKING))


def test_nemo_rl_parallel_rules():
    with pytest.warns(UserWarning, match="make_sequence_length_divisible_by: 4 is not a multiple of 8"):
        cfg = load(nemo(make_sequence_length_divisible_by=4,
                        megatron_cfg={"enabled": True, "tensor_model_parallel_size": 2, "context_parallel_size": 2,
                                      "sequence_parallel": True},
                        sequence_packing={"enabled": True, "train_mb_tokens": 4096}))
    assert cfg.sequence_packing.sequence_length_pad_multiple == 8
    with pytest.raises(ConfigError, match="needs policy.sequence_packing.enabled"):
        load(nemo(megatron_cfg={"enabled": True, "context_parallel_size": 2}))
    with pytest.raises(ConfigError, match="DTensor backend cannot pack"):
        load(nemo(dtensor_cfg={"enabled": True, "context_parallel_size": 2},
                  sequence_packing={"enabled": True, "train_mb_tokens": 4096}))
    with pytest.raises(ConfigError, match="single pipeline stage"):
        load(nemo(megatron_cfg={"enabled": True, "pipeline_model_parallel_size": 2},
                  dynamic_batching={"enabled": True, "train_mb_tokens": 4096}))
    with pytest.raises(ConfigError, match="sequence_length_round: must be divisible by TP\\*CP = 4"):
        load(nemo(megatron_cfg={"enabled": True, "tensor_model_parallel_size": 4},
                  dynamic_batching={"enabled": True, "train_mb_tokens": 4096, "sequence_length_round": 6}))
    cfg = load(nemo(sequence_packing={"enabled": True, "train_mb_tokens": 4096}))
    with pytest.raises(ConfigError, match="logprob_mb_tokens: required for the logprob phase"):
        cfg.sequence_packing_args("logprob")
    with pytest.raises(ConfigError, match="phase must be one of"):
        cfg.sequence_packing_args("eval")
    with pytest.raises(ConfigError, match="needs a ROLL config"):
        cfg.load_balance_kwargs()


ROLL = {"sequence_length": 4096, "actor_train": {
    "strategy_args": {"strategy_name": "megatron_train",
                      "strategy_config": {"tensor_model_parallel_size": 2, "context_parallel_size": 2}},
    "use_sequence_packing": True,
    "sequence_packing_args": {"algorithm": "load_balance", "max_packed_sequence_length_train": 8192,
                              "max_packed_sequence_length_forward": 8192}}}


@pytest.mark.parametrize("path, value, message", [
    ("actor_train.sequence_packing_args.algorithm", "greedy", r"algorithm: must be one of \['none', 'load_balance'\]"),
    ("actor_train.sequence_packing_args.max_packed_sequence_length_train", 1024, "below sequence_length"),
    ("actor_train.sequence_packing_args.min_num_micro_batches_train", 0, "must be >= 1"),
])
def test_roll_errors(path, value, message):
    with pytest.raises(ConfigError, match=message):
        load(with_change(path, value, ROLL))


def test_roll_dynamic_batching_errors():
    base = {"sequence_length": 4096, "actor_train": {
        "strategy_args": {"strategy_config": {"tensor_model_parallel_size": 2, "context_parallel_size": 2}},
        "use_dynamic_batching_in_train": True, "max_tokens_per_microbatch_in_train": 8192,
        "sequence_length_round_in_train": 128}}
    assert load(base).roll_dynamic_batching.train
    with pytest.raises(ConfigError, match="sequence_length_round_in_train: must be divisible by TP\\*CP = 4"):
        load(with_change("actor_train.sequence_length_round_in_train", 6, base))
    with pytest.raises(ConfigError, match="max_tokens_per_microbatch_in_train: must be >= 1, got 0"):
        load(with_change("actor_train.max_tokens_per_microbatch_in_train", 0, base))
    with pytest.raises(ConfigError, match="below the longest"):
        load(with_change("actor_train.max_tokens_per_microbatch_in_train", 2048, base))
    with pytest.raises(ConfigError, match="critic: no such worker role"):
        load(base, role="critic")


def test_top_level_errors(tmp_path):
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="does not parse"):
        load("policy: [1,\n")
    with pytest.raises(ConfigError, match="schema must be"):
        load({"policy": {}}, schema="slime")
    path = tmp_path / "c.yaml"
    path.write_text("policy:\n  sequence_packing: {enabled: false}\n")
    assert load(path).schema == "nemo_rl" and load(str(path)).schema == "nemo_rl"
    assert isinstance(ConfigError("x"), ValueError)
