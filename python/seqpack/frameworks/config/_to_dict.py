"""A loaded configuration back in its framework's schema: what
:meth:`SeqpackConfig.to_dict <seqpack.config.SeqpackConfig.to_dict>` writes
(normalised: defaults filled in; ``load(cfg.to_dict()) == cfg``)."""

from __future__ import annotations

from typing import Any, Dict

__all__ = ["config_to_dict"]


def config_to_dict(cfg: Any) -> Dict[str, Any]:
    """``cfg`` in its framework's schema (what ``SeqpackConfig.to_dict`` returns,
    before its stream section)."""
    p = cfg.parallel
    if cfg.schema == "verl":
        return _verl_to_dict(cfg)
    if cfg.schema == "nemo_rl":
        sp, db = cfg.sequence_packing, cfg.dynamic_batching
        backend = {"enabled": True, "sequence_parallel": p.sequence_parallel}
        if p.backend == "dtensor":
            backend.update(tensor_parallel_size=p.tp, context_parallel_size=p.cp)
        else:
            backend.update(tensor_model_parallel_size=p.tp, context_parallel_size=p.cp,
                           pipeline_model_parallel_size=p.pp, **_dynamic_cp_dict(p))
        policy: Dict[str, Any] = {
            "megatron_cfg" if p.backend == "megatron" else "dtensor_cfg": backend,
            "make_sequence_length_divisible_by": sp.sequence_length_pad_multiple,
            "sequence_packing": {"enabled": sp.enabled, "algorithm": sp.algorithm,
                                 "microbatch_order": sp.microbatch_order},
            "dynamic_batching": {"enabled": db.enabled, "sequence_length_round": db.sequence_length_round},
        }
        for section, obj in (("sequence_packing", sp), ("dynamic_batching", db)):
            for key in ("train_mb_tokens", "logprob_mb_tokens"):
                if getattr(obj, key) is not None:
                    policy[section][key] = getattr(obj, key)
        if cfg.max_seqlen is not None:
            policy["max_total_sequence_length"] = cfg.max_seqlen
        if cfg.global_batch_size is not None:
            policy["train_global_batch_size"] = cfg.global_batch_size
        if sp.shared_prefix:
            policy["shared_prefix_training"] = True
        if sp.prefix_reuse:
            policy["shared_prefix_reuse"] = True
        return {"policy": policy}
    rp, rd = cfg.roll_packing, cfg.roll_dynamic_batching
    strategy_config = {"tensor_model_parallel_size": p.tp, "context_parallel_size": p.cp,
                       "pipeline_model_parallel_size": p.pp, "sequence_parallel": p.sequence_parallel,
                       **_dynamic_cp_dict(p)}
    if p.vpp is not None:
        strategy_config["virtual_pipeline_model_parallel_size"] = p.vpp
    worker: Dict[str, Any] = {
        "use_sequence_packing": rp.enabled,
        "sequence_packing_args": {k: getattr(rp, k) for k in (
            "algorithm", "max_packed_sequence_length_train", "max_packed_sequence_length_forward",
            "min_num_micro_batches_train", "min_num_micro_batches_forward") + (
            ("shared_prefix",) if rp.shared_prefix else ()) + (("prefix_reuse",) if rp.prefix_reuse else ())},
        "use_dynamic_batching_in_train": rd.train, "use_dynamic_batching_in_infer": rd.infer,
    }
    for key in ("max_tokens_per_microbatch_in_train", "max_tokens_per_microbatch_in_infer",
                "sequence_length_round_in_train", "sequence_length_round_in_infer"):
        worker[key] = getattr(rd, key)
    if p.backend is not None:
        worker["strategy_args"] = {"strategy_name": p.backend, "strategy_config": strategy_config}
    out: Dict[str, Any] = {cfg.role: worker}
    if cfg.max_seqlen is not None:
        out["sequence_length"] = cfg.max_seqlen
    if rp.loss_agg_mode is not None:
        out["loss_agg_mode"] = rp.loss_agg_mode
    return out


def _dynamic_cp_dict(p: Any) -> Dict[str, Any]:
    """Megatron-LM's dynamic-CP keys of ``p`` back (none when off and unset), as
    ``config/_dynamic_cp.py`` reads them."""
    out: Dict[str, Any] = {}
    if p.dynamic_cp:
        out["dynamic_context_parallel"] = True
        out["min_dynamic_context_parallel_size"] = p.min_dynamic_cp
    if p.max_seqlen_per_rank is not None:
        out["max_seqlen_per_dp_cp_rank"] = p.max_seqlen_per_rank
    return out


def _verl_to_dict(cfg: Any) -> Dict[str, Any]:
    v, p = cfg.verl, cfg.parallel
    if v.trainer == "sft":
        return _verl_sft_to_dict(cfg)

    def keys(mb: Any, prefix: str, names=("use_dynamic_bsz", "max_token_len_per_gpu",
                                                         "micro_batch_size_per_gpu", "micro_batch_size")):
        dyn, cap, per_gpu, global_mbs = names
        return {dyn: mb.use_dynamic_bsz, f"{prefix}{cap}": mb.max_token_len_per_gpu,
                f"{prefix}{per_gpu}": mb.micro_batch_size_per_gpu, f"{prefix}{global_mbs}": mb.micro_batch_size}

    def sp(section: Dict[str, Any], strategy: str, size: int, engine: str) -> Dict[str, Any]:
        if strategy == "megatron":
            section["megatron"] = {"context_parallel_size": size}
        else:
            section["ulysses_sequence_parallel_size"] = size
            section[engine] = {"ulysses_sequence_parallel_size": size}
        return section

    log_prob = ("log_prob_use_dynamic_bsz", "max_token_len_per_gpu", "micro_batch_size_per_gpu", "micro_batch_size")
    actor = sp({"strategy": v.strategy, "ppo_mini_batch_size": v.ppo_mini_batch_size,
                "use_remove_padding": v.actor.use_remove_padding, **keys(v.actor, "ppo_")},
               v.strategy, v.actor.sp_size, "fsdp_config")
    if v.actor.prefix_grouper:
        actor["use_prefix_grouper"] = True
    if v.strategy == "megatron":
        actor["megatron"].update(tensor_model_parallel_size=p.tp, pipeline_model_parallel_size=p.pp,
                                 virtual_pipeline_model_parallel_size=p.vpp, sequence_parallel=p.sequence_parallel,
                                 **_dynamic_cp_dict(p))
    critic = sp({"strategy": v.critic_strategy, "enable": v.use_critic,
                 "ppo_mini_batch_size": v.critic_ppo_mini_batch_size,
                 "model": {"use_remove_padding": v.critic.use_remove_padding}, **keys(v.critic, "ppo_"),
                 **{k: val for k, val in keys(v.critic_forward, "forward_").items() if k != "use_dynamic_bsz"}},
                v.critic_strategy, v.critic.sp_size, "fsdp")
    return {
        "data": {"train_batch_size": v.train_batch_size, "max_prompt_length": v.max_prompt_length,
                 "max_response_length": v.max_response_length},
        "actor_rollout_ref": {
            "model": {"use_remove_padding": v.ref.use_remove_padding,
                      **({"external_lib": v.external_lib} if v.external_lib is not None else {})},
            "actor": actor,
            "ref": sp(keys(v.ref, "log_prob_", log_prob), v.strategy, v.ref.sp_size, "fsdp_config"),
            "rollout": {"n": v.rollout_n, **keys(v.rollout, "log_prob_", log_prob)},
        },
        "critic": critic,
        "trainer": {"balance_batch": v.balance_batch},
    }


def _verl_sft_to_dict(cfg: Any) -> Dict[str, Any]:
    v, p, mb = cfg.verl, cfg.parallel, cfg.verl.sft
    engine: Dict[str, Any] = {"strategy": v.strategy}
    if v.strategy == "megatron":
        engine.update(tensor_model_parallel_size=p.tp, context_parallel_size=p.cp, pipeline_model_parallel_size=p.pp,
                      virtual_pipeline_model_parallel_size=p.vpp, sequence_parallel=p.sequence_parallel,
                      **_dynamic_cp_dict(p))
    elif v.strategy == "torchtitan":
        engine.update(tensor_parallel_size=p.tp, context_parallel_size=p.cp)
    elif v.strategy == "veomni":
        engine["ulysses_parallel_size"] = p.ulysses
    elif v.strategy in ("fsdp", "fsdp2", "fsdp_turbo"):
        engine["ulysses_sequence_parallel_size"] = p.ulysses
    return {
        "data": {"train_batch_size": v.train_batch_size, "micro_batch_size_per_gpu": mb.micro_batch_size_per_gpu,
                 "max_token_len_per_gpu": mb.max_token_len_per_gpu, "use_dynamic_bsz": mb.use_dynamic_bsz,
                 "max_length": cfg.max_seqlen},
        "model": {"use_remove_padding": mb.use_remove_padding},
        "engine": engine,
        "trainer": {"balance_batch": v.balance_batch},
    }
