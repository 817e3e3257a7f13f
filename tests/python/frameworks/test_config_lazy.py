"""seqpack.config resolves on demand: only the values seqpack reads, each with the
values it refers to (issue 27's rule (b)); a value it does not read is never resolved
(its resolvers never run, it never warns nor blocks), and ``.raw`` holds the config as
written."""

from __future__ import annotations

import copy
import os
import pickle
import warnings

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from seqpack import config
from seqpack.config import ConfigError, load

EXAMPLES = str(config.example("verl_ppo.yaml").parent)  # the shipped examples
RECIPES = os.path.join(os.path.dirname(__file__), "data", "recipes")
VERL = {"data": {"max_prompt_length": 512, "max_response_length": 512},
        "actor_rollout_ref": {"actor": {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 4096}}}


def strict_load(*args, **kwargs):
    """load(...) where any warning is an error (``-W error``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return load(*args, **kwargs)


@pytest.fixture
def spy():
    """A resolver ``spy`` that records its calls, registered for the test."""
    calls = []
    OmegaConf.register_new_resolver("seqpack_test_spy", lambda x: calls.append(x) or f"spied-{x}")
    try:
        yield calls
    finally:
        OmegaConf.clear_resolver("seqpack_test_spy")


def test_a_resolver_used_only_under_an_unread_key_is_never_called(spy):
    data = copy.deepcopy(VERL)
    data["logger"] = {"dir": "${seqpack_test_spy:logs}"}
    data["trainer"] = {"default_local_dir": "${logger.dir}/ckpt"}  # unread, refers to an unread value
    cfg = strict_load(data)
    assert spy == [] and cfg.raw["logger"]["dir"] == "${seqpack_test_spy:logs}"
    assert cfg.rearrange_kwargs() == {"max_token_len": 4096}
    # a key seqpack reads calls it (once), with what the value refers to
    data["actor_rollout_ref"]["actor"]["strategy"] = "${seqpack_test_spy:fsdp}"
    assert strict_load(data).verl.strategy == "spied-fsdp" and spy == ["fsdp"]


def test_unread_values_that_do_not_resolve_never_warn_nor_raise():
    data = copy.deepcopy(VERL)
    data["checkpoint_dir"] = "${oc.env:SEQPACK_TEST_SURELY_UNSET_VARIABLE}"
    data["trainer"] = {"year": "${now:%Y}", "run": "${hydra:job.name}", "missing": "${no.such.key}", "later": "???",
                       "cycle": "${trainer.cycle}", "deep": "${trainer.deep.deep.deep}"}
    cfg = strict_load(data)
    assert cfg.raw["checkpoint_dir"] == data["checkpoint_dir"] and cfg.raw["trainer"] == data["trainer"]
    assert strict_load(recipe("nemo_rl", "recipes", "unread_values.yaml")).sequence_packing.train_mb_tokens == 4096


def recipe(*parts):
    return os.path.join(RECIPES, *parts)


def test_a_read_key_resolves_with_its_chain_and_names_it_when_it_does_not():
    data = copy.deepcopy(VERL)
    actor = data["actor_rollout_ref"]["actor"]
    actor["ppo_max_token_len_per_gpu"] = "${c0}"
    data.update({"c0": "${c1}", "c1": "${mul:${c2},2}", "c2": "${oc.select:c3,2048}",
                 "unread": "${oc.env:SEQPACK_TEST_SURELY_UNSET_VARIABLE}"})  # beside it: no warning
    assert strict_load(data).rearrange_kwargs() == {"max_token_len": 4096}
    data["c2"] = "${oc.env:SEQPACK_TEST_SURELY_UNSET_VARIABLE}"
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.actor\.ppo_max_token_len_per_gpu: the interpolation "
                                          r"'\$\{c0\}' does not resolve \(chain: actor_rollout_ref\.actor\."
                                          r"ppo_max_token_len_per_gpu -> c0 -> c1 -> c2\)"):
        load(data)
    data.update({"c2": "${c0}"})
    with pytest.raises(ConfigError, match=r"ppo_max_token_len_per_gpu: .*Recursive interpolation"):
        load(data)
    actor["ppo_max_token_len_per_gpu"] = "???"
    with pytest.raises(ConfigError, match=r"ppo_max_token_len_per_gpu: is '\?\?\?'"):
        load(data)


def test_sections_given_by_a_reference_resolve_as_far_as_read(spy):
    shared = {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": "${data.cap}", "unread": "${seqpack_test_spy:x}",
              "checkpoint": "${oc.env:SEQPACK_TEST_SURELY_UNSET_VARIABLE}", "fsdp_config": "${fsdp}",
              "relative": "${.ppo_max_token_len_per_gpu}"}
    data = {"data": {"cap": 8192, "max_prompt_length": 512, "max_response_length": 512}, "shared": shared,
            "fsdp": {"ulysses_sequence_parallel_size": 2}, "actor_rollout_ref": {"actor": "${shared}"}}
    cfg = strict_load(data)
    assert cfg.verl.actor.max_token_len_per_gpu == 8192 and cfg.verl.actor.sp_size == 2
    assert cfg.rearrange_kwargs() == {"max_token_len": 16384} and spy == []
    assert cfg.raw["actor_rollout_ref"]["actor"] == "${shared}"
    composed = OmegaConf.create(data)
    assert strict_load(composed) == cfg == strict_load(OmegaConf.to_container(composed))


def test_a_read_section_nested_past_the_bound_is_refused_and_names_the_key():
    def nested(depth):
        out = leaf = {}
        for _ in range(depth):
            leaf["k"] = {}
            leaf = leaf["k"]
        return out

    OmegaConf.register_new_resolver("seqpack_test_nested", lambda depth: nested(int(depth)))
    try:
        data = copy.deepcopy(VERL)
        data["critic"] = "${seqpack_test_nested:150}"
        with pytest.raises(ConfigError, match=r"nested deeper than 100 levels \(at critic\.k\.k"):
            load(data)
        data["critic"], data["unread"] = {}, "${seqpack_test_nested:150}"  # not read: fine
        assert strict_load(data).verl.critic.max_token_len_per_gpu == 32768
    finally:
        OmegaConf.clear_resolver("seqpack_test_nested")


def test_a_5000_link_chain_on_a_read_key_resolves():
    links = 5000
    data = copy.deepcopy(VERL)
    data["actor_rollout_ref"]["actor"]["ppo_max_token_len_per_gpu"] = "${c0}"
    data.update({f"c{i}": f"${{c{i + 1}}}" for i in range(links)})
    data[f"c{links}"] = 2048
    data["unread"] = "${c0}"
    cfg = strict_load(data)
    assert cfg.rearrange_kwargs() == {"max_token_len": 2048}
    assert cfg.raw["c0"] == "${c1}" and cfg.raw["unread"] == "${c0}"


def test_raw_is_the_config_as_written_and_results_equal_by_path_and_composed(tmp_path):
    path = tmp_path / "grpo.yaml"
    path.write_text("defaults: " + recipe("nemo_rl", "base", "grpo_base.yaml") + "\n"
                    "logger: {log_dir: 'logs/${policy.model_name}'}\n")
    by_path = strict_load(path)
    assert by_path.raw["policy"]["sequence_packing"]["train_mb_tokens"].startswith("${mul:")
    assert by_path.raw["logger"]["log_dir"] == "logs/${policy.model_name}"
    assert by_path.sequence_packing.train_mb_tokens == 4096
    assert strict_load(by_path.raw) == by_path  # the composed config, as written: the same result
    assert load(by_path.raw).raw == by_path.raw


def test_configs_still_pickle_and_compare():
    for name in ("verl_ppo.yaml", "nemo_rl_sequence_packing.yaml", "roll_sequence_packing.yaml"):
        path = os.path.join(EXAMPLES, name)
        cfg = load(path)
        again = pickle.loads(pickle.dumps(cfg))
        assert again == cfg and copy.deepcopy(cfg) == cfg and again.raw == cfg.raw
        assert type(cfg).__module__ == "seqpack.frameworks.config" and config.SeqpackConfig is type(cfg)
        with open(path) as f:
            assert cfg.raw == yaml.safe_load(f)  # the document as written (verl_ppo.yaml's ${...} too)


_NAMES = st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True)
_UNREAD = st.one_of(
    st.just("???"),
    _NAMES.map(lambda n: "${oc.env:SEQPACK_TEST_UNSET_" + n.upper() + "}"),
    _NAMES.map(lambda n: "${" + n + ".no_such_key}"),
    _NAMES.map(lambda n: "${seqpack_test_unknown_" + n + ":x}"),
    _NAMES.map(lambda n: "logs/${unread." + n + "}/${now:%Y}"),
    _NAMES.map(lambda n: "${unread." + n + "}"),  # may refer to itself: a cycle
)


@settings(max_examples=25, deadline=None)
@given(st.dictionaries(_NAMES, _UNREAD, min_size=1, max_size=6))
def test_unread_values_never_change_the_result_nor_warn(unread):
    base = strict_load(VERL)
    cfg = strict_load({**VERL, "unread": unread, "trainer": {"checkpoint": "${unread}"}})
    assert cfg == base and cfg.raw["unread"] == unread
