"""What the frameworks run, seqpack loads (issue 27, item 5): one recipe of seqpack's
own per class of real recipe seqpack used to refuse, what it warns about (naming the
key), what it still refuses, and how interpolations resolve (OmegaConf, on demand:
only the values seqpack reads are resolved, and must resolve)."""

from __future__ import annotations

import inspect
import os
import warnings

import pytest
from omegaconf import OmegaConf

from seqpack.config import ConfigError, load

RECIPES = os.path.join(os.path.dirname(__file__), "data", "recipes")


def recipe(*parts):
    return os.path.join(RECIPES, *parts)


def load_warns(source, **kwargs):
    """(config, the warnings' messages)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load(source, **kwargs)
    return cfg, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


# ---------------------------------------------------------------- NeMo-RL


def test_fuse_loss_is_a_nemo_rl_key():
    cfg, messages = load_warns(recipe("nemo_rl", "recipes", "fuse_loss.yaml"))
    assert cfg.sequence_packing.enabled and messages == []
    with pytest.raises(ConfigError, match=r"policy\.sequence_packing\.fuse_loss: must be true or false"):
        load(recipe("nemo_rl", "recipes", "fuse_loss.yaml"), overrides=["policy.sequence_packing.fuse_loss=yes"])


def test_an_unknown_key_is_a_typo_when_close_else_the_frameworks():
    base = "policy:\n  sequence_packing:\n    enabled: true\n    train_mb_tokens: 4096\n"
    cfg, messages = load_warns(base + "    pack_across_ranks: true\n")
    assert cfg.sequence_packing.train_mb_tokens == 4096
    assert messages == ["policy.sequence_packing.pack_across_ranks: not a key seqpack reads; left to NeMo-RL"]
    with pytest.raises(ConfigError, match=r"policy\.sequence_packing\.fuse_los: unknown key; did you mean 'fuse_loss'"):
        load(base + "    fuse_los: true\n")
    roll = "actor_train:\n  use_sequence_packing: true\n  sequence_packing_args:\n    algorithm: load_balance\n" \
           "    max_packed_sequence_length_train: 64\n    max_packed_sequence_length_forward: 64\n"
    cfg, messages = load_warns(roll + "    balance_across_dp: true\n")
    assert messages == ["actor_train.sequence_packing_args.balance_across_dp: not a key seqpack reads; left to ROLL"]


def test_a_switched_off_section_is_not_checked():
    cfg, messages = load_warns(recipe("nemo_rl", "recipes", "disabled_sections.yaml"))
    assert not cfg.sequence_packing.enabled and not cfg.dynamic_batching.enabled
    assert cfg.parallel.tp == 4 and cfg.sequence_packing.sequence_length_pad_multiple == 1
    assert cfg.sequence_packing.algorithm == "modified_first_fit_decreasing"  # the default, said so
    assert cfg.sequence_packing.logprob_mb_tokens is None
    assert any(m.startswith("policy.sequence_packing.algorithm: must be one of") and
               m.endswith("got 'modified_ffd'; ignored while policy.sequence_packing.enabled is false") for m in messages)
    assert any(m.startswith("policy.sequence_packing.logprob_mb_tokens: must be >= 1, got 0; ignored") for m in messages)
    assert not any("make_sequence_length_divisible_by" in m or "sequence_length_round" in m for m in messages)
    # switched on, the same values are errors
    with pytest.raises(ConfigError, match=r"policy\.sequence_packing\.algorithm: must be one of"):
        load(recipe("nemo_rl", "recipes", "disabled_sections.yaml"), overrides=[
            "policy.sequence_packing.enabled=true", "policy.sequence_packing.logprob_mb_tokens=4096"])


def test_the_pad_multiple_megatron_really_applies_is_planned_with():
    cfg, messages = load_warns(recipe("nemo_rl", "recipes", "megatron_cp8.yaml"))
    assert messages == ["policy.make_sequence_length_divisible_by: 4 is not a multiple of 64, the padding NeMo-RL's "
                        "Megatron worker gives each packed sequence (2*CP with CP > 1, times TP with sequence "
                        "parallelism); seqpack plans with 64"]
    assert cfg.sequence_packing_args("train")["sequence_length_pad_multiple"] == 64
    cfg, messages = load_warns(recipe("nemo_rl", "recipes", "megatron_cp8.yaml"),
                               overrides=["policy.make_sequence_length_divisible_by=128"])
    assert messages == [] and cfg.sequence_packing.sequence_length_pad_multiple == 128
    # DTensor pads nothing of its own: the key is the pad multiple
    cfg, messages = load_warns("policy:\n  make_sequence_length_divisible_by: 2\n  dtensor_cfg: {enabled: true, "
                               "tensor_parallel_size: 4, sequence_parallel: true}\n  sequence_packing: {enabled: true, "
                               "train_mb_tokens: 4096}\n")
    assert messages == [] and cfg.sequence_packing.sequence_length_pad_multiple == 2


def test_a_cap_below_the_longest_sequence_is_a_warning():
    cfg, messages = load_warns(recipe("nemo_rl", "recipes", "cap_below_longest.yaml"))
    assert cfg.sequence_packing_args("train")["max_tokens_per_microbatch"] == 16384
    assert messages[0] == ("policy.sequence_packing.train_mb_tokens: 16384 is below the longest (padded) sequence, "
                           "policy.max_total_sequence_length = 32768 -> 32768; a longer sequence stops the packer, "
                           "NeMo-RL's as seqpack's ('exceeds bin capacity')")
    assert messages[1].startswith("policy.sequence_packing.logprob_mb_tokens: 16384 is below")
    dyn = ("policy:\n  max_total_sequence_length: 8192\n  sequence_packing: {enabled: false}\n"
           "  dynamic_batching: {enabled: true, train_mb_tokens: 4096}\n")
    cfg, messages = load_warns(dyn)
    assert cfg.dynamic_batching_args()["max_tokens_per_microbatch"] == 4096
    assert messages == ["policy.dynamic_batching.train_mb_tokens: 4096 is below the longest (padded) sequence, "
                        "policy.max_total_sequence_length = 8192 -> 8192; a longer sequence stops seqpack's dynamic "
                        "batching ('exceeds max_tokens_per_microbatch')"]


# ---------------------------------------------------------------- ROLL


def test_rolls_fsdp2_sft_recipe_with_packing_loads_with_packing_off():
    cfg, messages = load_warns(recipe("roll", "sft", "sft_fsdp2_pack.yaml"), role="sft_train")
    assert cfg.role == "sft_train" and cfg.parallel.backend == "fsdp2_train" and cfg.max_seqlen == 8192
    assert not cfg.roll_packing.enabled
    assert messages == ["sft_train.use_sequence_packing: ROLL packs sequences with Megatron strategies only and "
                        "turns packing off for strategy_args.strategy_name = 'fsdp2_train'; so does seqpack"]
    with pytest.raises(ConfigError, match=r"sft_train\.use_sequence_packing: sequence packing is disabled"):
        cfg.load_balance_kwargs()
    assert load(cfg.to_dict(), role="sft_train") == cfg


def test_roll_packing_with_dynamic_batching_loads_with_packing_off():
    # ROLL's WorkerConfig keeps dynamic batching and turns packing off, with a warning.
    worker = {"strategy_args": {"strategy_name": "megatron_train"}, "use_sequence_packing": True,
              "sequence_packing_args": {"algorithm": "load_balance", "max_packed_sequence_length_train": 8192},
              "use_dynamic_batching_in_train": True, "max_tokens_per_microbatch_in_train": 8192}
    cfg, messages = load_warns({"sequence_length": 4096, "actor_train": worker})
    assert not cfg.roll_packing.enabled and cfg.roll_dynamic_batching.train
    assert messages == ["actor_train.use_sequence_packing: sequence packing and dynamic batching "
                        "(actor_train.use_dynamic_batching_in_train) are exclusive; ROLL turns packing off and "
                        "batches dynamically; so does seqpack"]
    assert cfg.dynamic_batching_shard_kwargs(8, "train")["max_tokens_per_microbatch"] == 8192


# ---------------------------------------------------------------- interpolations


def test_values_seqpack_does_not_read_never_block():
    cfg, messages = load_warns(recipe("nemo_rl", "recipes", "unread_values.yaml"))
    assert cfg.sequence_packing.train_mb_tokens == 4096
    raw = cfg.raw
    assert raw["checkpointing"] == {"checkpoint_dir": "${oc.env:SEQPACK_TEST_SURELY_UNSET_CKPT_DIR}",
                                    "run_name": "???", "tag": "${checkpointing.run_name}-seed"}  # as written
    assert raw["policy"]["tokenizer"]["name"] == "${policy.model_name}"  # not read: not resolved either
    assert raw["logger"]["log_dir"] == "logs/${no_such.section}"
    assert messages == []  # what seqpack does not read is the framework's business: no warning


def test_values_seqpack_reads_must_resolve_and_errors_name_the_chain():
    text = ("policy:\n  max_total_sequence_length: ${policy.base_length}\n  base_length: ${policy.missing}\n"
            "  sequence_packing:\n    enabled: true\n    train_mb_tokens: ${mul:${policy.max_total_sequence_length},2}\n")
    with pytest.raises(ConfigError, match=r"^policy\.max_total_sequence_length: the interpolation "
                                          r"'\$\{policy\.base_length\}' does not resolve \(chain: "
                                          r"policy\.max_total_sequence_length -> policy\.base_length\): "
                                          r"InterpolationKeyError: Interpolation key 'policy\.missing' not found"):
        load(text)
    with pytest.raises(ConfigError, match=r"^policy\.sequence_packing\.train_mb_tokens: is '\?\?\?', a value the "
                                          r"recipe leaves to its launcher's command line"):
        load("policy:\n  sequence_packing:\n    enabled: true\n    train_mb_tokens: ???\n")
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.actor: the interpolation '\$\{oc\.env:"):
        load({"actor_rollout_ref": {"actor": "${oc.env:SEQPACK_TEST_SURELY_UNSET_SECTION}"}})


def test_omegaconf_values_and_sections_resolve_as_omegaconf_resolves_them():
    data = {"policy": {"max_total_sequence_length": 1000, "sequence_packing": {
        "enabled": True, "train_mb_tokens": "${max:${div:${policy.max_total_sequence_length},1},4096}",
        "logprob_mb_tokens": "${oc.select:policy.nope,8192}"}}, "copy": "${policy.sequence_packing}",
        "escaped": "\\${policy.max_total_sequence_length}", "text": "len=${policy.max_total_sequence_length}"}
    cfg = load(data)
    assert (cfg.sequence_packing.train_mb_tokens, cfg.sequence_packing.logprob_mb_tokens) == (4096, 8192)
    # .raw holds the config as written (unread: not resolved)
    assert cfg.raw["copy"] == "${policy.sequence_packing}" and cfg.raw["escaped"] == data["escaped"]
    assert cfg.raw["text"] == "len=${policy.max_total_sequence_length}"
    assert data["policy"]["sequence_packing"]["train_mb_tokens"].startswith("${max:")  # the input is untouched
    as_read = load({**data, "policy": {**data["policy"], "sequence_packing": "${copy}"},
                    "copy": data["policy"]["sequence_packing"]})  # a section read through a reference
    assert as_read.sequence_packing == cfg.sequence_packing
    assert load(OmegaConf.create(data)) == cfg


def test_resolvers_are_registered_for_the_load_only_with_omegaconfs_current_api(monkeypatch):
    # OmegaConf 2.4 deprecates register_new_resolver (a warning on every call) for
    # register_resolver(..., replace=, use_cache=); 2.3's register_resolver is the
    # legacy one. On 2.3, 2.4's API is stood in; on either, any warning fails.
    current_api = "use_cache" in inspect.signature(OmegaConf.register_resolver).parameters
    register = OmegaConf.register_resolver if current_api else OmegaConf.register_new_resolver
    if not current_api:
        def deprecated(*args, **kwargs):
            warnings.warn("register_new_resolver() is deprecated", DeprecationWarning, stacklevel=2)
            return register(*args, **kwargs)

        def current(name, resolver, *, replace=False, use_cache=False, annotation_validation="warn"):
            return register(name, resolver, replace=replace, use_cache=use_cache)

        monkeypatch.setattr(OmegaConf, "register_new_resolver", staticmethod(deprecated))
        monkeypatch.setattr(OmegaConf, "register_resolver", staticmethod(current))
    OmegaConf.clear_resolver("mul")
    text = ("policy:\n  max_total_sequence_length: 512\n  sequence_packing:\n    enabled: true\n"
            "    train_mb_tokens: ${mul:${policy.max_total_sequence_length},4}\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load(text).sequence_packing.train_mb_tokens == 2048
    assert not OmegaConf.has_resolver("mul")  # registered for the load, then removed
    register("mul", lambda a, b: -1)  # a resolver the caller registered is the one used, and kept
    try:
        with pytest.raises(ConfigError, match="train_mb_tokens: must be >= 1, got -1"):
            load(text)
        assert OmegaConf.has_resolver("mul")
    finally:
        OmegaConf.clear_resolver("mul")
