"""Megatron-LM's dynamic (hybrid) context parallelism in the NeMo-RL, verl and ROLL
schemas (issue 41, item 3): ``dynamic_context_parallel``,
``min_dynamic_context_parallel_size`` and ``max_seqlen_per_dp_cp_rank`` read from each
framework's Megatron section (and ``hybrid_context_parallel``, Megatron-LM's first
name of the switch), round-tripped by ``to_dict``, a typo caught with a did-you-mean,
bad values named, and ``plan_step_kwargs`` planning the step."""

import warnings

import pytest

import seqpack
from seqpack import config
from seqpack.config import ConfigError


def nemo_rl(**megatron):
    return {"policy": {"megatron_cfg": {"enabled": True, "context_parallel_size": 8, **megatron},
                       "sequence_packing": {"enabled": True, "train_mb_tokens": 131072},
                       "train_global_batch_size": 64, "max_total_sequence_length": 131072}}


def verl(**megatron):
    return {"actor_rollout_ref": {"actor": {"strategy": "megatron", "use_dynamic_bsz": True,
                                            "ppo_max_token_len_per_gpu": 16384,
                                            "megatron": {"context_parallel_size": 4, **megatron}},
                                  "rollout": {"n": 8}},
            "data": {"max_prompt_length": 1024, "max_response_length": 30000}}


def roll(**strategy):
    return {"actor_train": {"use_sequence_packing": True,
                            "sequence_packing_args": {"algorithm": "load_balance",
                                                      "max_packed_sequence_length_train": 131072},
                            "strategy_args": {"strategy_name": "megatron_train",
                                              "strategy_config": {"context_parallel_size": 8, **strategy}}},
            "sequence_length": 131072}


def load(data):
    return config.load(data, role="actor_train") if "actor_train" in data else config.load(data)


SCHEMAS = [(nemo_rl, "policy.megatron_cfg", 8, 131072 // 8), (verl, "actor_rollout_ref.actor.megatron", 4, 16384),
           (roll, "actor_train.strategy_args.strategy_config", 8, 131072 // 8)]


@pytest.mark.parametrize("make, path, cp, cap", SCHEMAS)
def test_each_schema_reads_megatrons_keys(make, path, cp, cap):
    cfg = load(make(dynamic_context_parallel=True, min_dynamic_context_parallel_size=2))
    assert (cfg.parallel.dynamic_cp, cfg.parallel.min_dynamic_cp, cfg.parallel.cp) == (True, 2, cp)
    assert load(cfg.to_dict()) == cfg
    kwargs = cfg.plan_step_kwargs(2)
    options = seqpack.StepOptions(cp_size=cp, hybrid_cp=True, min_cp_degree=2)
    assert kwargs == {"dp_size": 2, "max_tokens": cap, "options": options} and cfg.step_options() == options
    lengths = [cap * cp // 2, 700, 9000, 300, 12000, 50, 4000, 2200]
    plan = seqpack.plan_step(lengths, **kwargs)
    assert plan.cp_size == cp and (plan.cp_degree >= 2).all()
    per_rank = load(make(dynamic_context_parallel=True, max_seqlen_per_dp_cp_rank=4096))
    assert per_rank.plan_step_kwargs(1)["max_tokens"] == 4096 and load(per_rank.to_dict()) == per_rank
    off = load(make())
    assert off.parallel.dynamic_cp is False and off.plan_step_kwargs(1)["options"].hybrid_cp is False


@pytest.mark.parametrize("make, path, cp, cap", SCHEMAS)
def test_a_typo_names_the_key_it_meant(make, path, cp, cap):
    with pytest.raises(ConfigError, match=f"{path}.dynamic_context_paralel: unknown key; did you mean "
                                          "'dynamic_context_parallel'"):
        load(make(dynamic_context_paralel=True))
    with pytest.raises(ConfigError, match="did you mean 'min_dynamic_context_parallel_size'"):
        load(make(dynamic_context_parallel=True, min_dynamic_context_parallel_sizes=2))


@pytest.mark.parametrize("make, path, cp, cap", SCHEMAS)
def test_bad_values_name_the_rule(make, path, cp, cap):
    with pytest.raises(ConfigError, match=f"{path}.min_dynamic_context_parallel_size: must be a power of two up to "
                                          f"context_parallel_size = {cp}, got 3"):
        load(make(dynamic_context_parallel=True, min_dynamic_context_parallel_size=3))
    with pytest.raises(ConfigError, match="dynamic CP runs with one pipeline stage"):
        load(make(dynamic_context_parallel=True, pipeline_model_parallel_size=2))


def test_megatrons_first_name_is_read_with_a_note():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cfg = load(nemo_rl(hybrid_context_parallel=True, min_hybrid_context_parallel_size=4))
    assert cfg.parallel.dynamic_cp and cfg.parallel.min_dynamic_cp == 4
    assert any("read as dynamic_context_parallel" in str(w.message) for w in seen)
    with pytest.raises(ConfigError, match="older name of dynamic_context_parallel, which is set too"):
        load(nemo_rl(hybrid_context_parallel=True, dynamic_context_parallel=True))


def test_dynamic_cp_without_cp_changes_nothing_and_says_so():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cfg = load(nemo_rl(context_parallel_size=1, dynamic_context_parallel=True))
    assert cfg.parallel.cp == 1
    assert any("dynamic CP changes nothing" in str(w.message) for w in seen)
