"""verl's schema: the composed config (``actor_rollout_ref.{actor,ref,rollout,model}``,
``critic``, ``data``, ``trainer``, ``algorithm``), every micro-batching role at once;
the SFT trainer's config is read by :mod:`._verl_sft`."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from ._async import read_verl_async
from ._dynamic_cp import DYNAMIC_CP_KEYS, read_dynamic_cp
from ._loader import Context, Reader
from ._types import ConfigError, ParallelConfig, SeqpackConfig, VerlConfig, VerlMicroBatching
from ._verl_sft import is_sft, load_verl_sft  # noqa: F401  (is_sft: the schema detection's)

# The keys seqpack reads in each verl section (a key close to one of them is a typo,
# named with a did-you-mean), and verl's own keys that are close to one.
VERL_TOP_SECTIONS = ("actor_rollout_ref", "critic", "data", "trainer", "algorithm", "async_training")
VERL_ARR_SECTIONS = ("actor", "ref", "rollout", "model")
VERL_MICRO_KEYS = ("ppo_mini_batch_size", "ppo_micro_batch_size", "ppo_micro_batch_size_per_gpu", "use_dynamic_bsz",
                   "ppo_max_token_len_per_gpu", "ulysses_sequence_parallel_size", "strategy")
VERL_ACTOR_KEYS = VERL_MICRO_KEYS + ("use_remove_padding", "fsdp_config", "megatron", "use_prefix_grouper")
VERL_LOG_PROB_KEYS = ("log_prob_micro_batch_size", "log_prob_micro_batch_size_per_gpu", "log_prob_use_dynamic_bsz",
                      "log_prob_max_token_len_per_gpu")
VERL_REF_KEYS = VERL_LOG_PROB_KEYS + ("ulysses_sequence_parallel_size", "fsdp_config", "megatron")
VERL_ROLLOUT_KEYS = VERL_LOG_PROB_KEYS + ("n",)
VERL_CRITIC_KEYS = VERL_MICRO_KEYS + ("enable", "forward_max_token_len_per_gpu", "forward_micro_batch_size",
                                      "forward_micro_batch_size_per_gpu", "model", "fsdp", "megatron")
VERL_MEGATRON_KEYS = ("tensor_model_parallel_size", "context_parallel_size", "pipeline_model_parallel_size",
                      "virtual_pipeline_model_parallel_size", "sequence_parallel")
VERL_DATA_KEYS = ("train_batch_size", "max_prompt_length", "max_response_length")
VERL_KNOWN_NEIGHBOURS = ("ppo_infer_micro_batch_size_per_gpu", "ppo_infer_max_token_len_per_gpu")
VERL_DEFAULT_MAX_TOKEN_LEN = 16384  # actor (and, through oc.select, rollout/ref); the critic's is 32768
VERL_DEFAULT_CRITIC_MAX_TOKEN_LEN = 32768


def _check_prefix_reuse(actor: Reader, where: str, strategy: str, sp: int) -> None:
    """What verl's engine runs in prefix-reuse passes: the FSDP engine without Ulysses,
    and losses whose terms sum over the passes (verl/prefix_reuse.py checks the same
    at run time)."""
    from .._loss_split import VERL_SPLITTING_AGGREGATIONS as SPLITTING_AGGREGATIONS
    from .._loss_split import VERL_TOKEN_LEVEL_LOSSES as TOKEN_LEVEL_LOSSES

    if strategy not in ("fsdp", "fsdp2") or sp > 1:
        raise ConfigError(f"{where}: prefix reuse runs in verl's FSDP engine without Ulysses sequence parallelism "
                          f"(strategy {strategy!r}, Ulysses size {sp})")
    agg = actor.text("loss_agg_mode", "token-mean")
    if agg not in SPLITTING_AGGREGATIONS:
        raise ConfigError(f"{actor.key('loss_agg_mode')}: {agg!r} divides by each row's own token count, which prefix "
                          f"reuse splits over passes ({where}); use one of {SPLITTING_AGGREGATIONS}")
    mode = actor.section("policy_loss").text("loss_mode", "vanilla")
    if mode not in TOKEN_LEVEL_LOSSES:
        raise ConfigError(f"{actor.key('policy_loss')}.loss_mode: {mode!r} couples a row's tokens, which prefix reuse "
                          f"splits over passes ({where}); use one of {TOKEN_LEVEL_LOSSES}")


# The worker modules (actor_rollout_ref.model.external_lib) that patch verl's engine:
# prefix trees, and prefix trees with prefix reuse.
TREE_LIBS = ("seqpack.frameworks.verl.tree_engine", "seqpack.frameworks.verl.prefix_reuse_engine")


def _verl_sp(r: Reader, strategy: str, engine: str, default_ulysses: int, default_cp: int):
    """``(sp_size, megatron parallel sizes or None)`` of one verl role.

    FSDP strategies: the role's ``ulysses_sequence_parallel_size`` when above 1 (verl
    copies it into the engine config), else the engine config's (``fsdp_config`` /
    the critic's ``fsdp``). Megatron: ``megatron.context_parallel_size``."""
    if strategy == "megatron":
        meg = r.section("megatron").no_lookalike(VERL_MEGATRON_KEYS, what="key", known=DYNAMIC_CP_KEYS)
        cp = meg.need("context_parallel_size", default_cp)
        return cp, meg
    top = r.need("ulysses_sequence_parallel_size", default_ulysses)
    eng = r.section(engine).no_lookalike(("ulysses_sequence_parallel_size",), what="key")
    inner = eng.need("ulysses_sequence_parallel_size", 1)
    if top > 1 and inner > 1 and top != inner:
        raise ConfigError(f"{r.key('ulysses_sequence_parallel_size')}: {top} disagrees with "
                          f"{eng.key('ulysses_sequence_parallel_size')} = {inner}")
    return (top if top > 1 else inner), None


def load_verl(ctx: Context, data: Mapping[str, Any]) -> SeqpackConfig:
    if is_sft(data):  # the SFT trainer's config: no actor_rollout_ref, its own keys
        return load_verl_sft(ctx, data)
    top = Reader(ctx, (), data).no_lookalike(VERL_TOP_SECTIONS)
    arr = top.section("actor_rollout_ref").no_lookalike(VERL_ARR_SECTIONS)
    model = arr.section("model").no_lookalike(("use_remove_padding",), what="key")
    actor = arr.section("actor").no_lookalike(VERL_ACTOR_KEYS, what="key", known=VERL_KNOWN_NEIGHBOURS)
    ref = arr.section("ref").no_lookalike(VERL_REF_KEYS, what="key")
    rollout = arr.section("rollout").no_lookalike(VERL_ROLLOUT_KEYS, what="key")
    critic = top.section("critic").no_lookalike(VERL_CRITIC_KEYS, what="key", known=VERL_KNOWN_NEIGHBOURS)
    data_r = top.section("data").no_lookalike(VERL_DATA_KEYS, what="key")
    trainer = top.section("trainer").no_lookalike(("balance_batch",), what="key")
    algorithm = top.section("algorithm").no_lookalike(("adv_estimator",), what="key")

    prompt, response = data_r.need("max_prompt_length", 512), data_r.need("max_response_length", 512)
    longest = prompt + response
    train_batch_size = data_r.need("train_batch_size", 1024)
    rollout_n = rollout.need("n", 1)

    strategy = actor.text("strategy", "fsdp")
    critic_strategy = critic.text("strategy", strategy)
    model_rmpad = model.bool("use_remove_padding", True)
    actor_rmpad = actor.bool("use_remove_padding", model_rmpad)
    critic_rmpad = critic.section("model").no_lookalike(("use_remove_padding",), what="key").bool(
        "use_remove_padding", True)

    actor_sp, meg = _verl_sp(actor, strategy, "fsdp_config", 1, 1)
    if meg is not None:
        parallel = ParallelConfig(tp=meg.need("tensor_model_parallel_size", 1), cp=actor_sp,
                                  pp=meg.need("pipeline_model_parallel_size", 1),
                                  vpp=meg.int("virtual_pipeline_model_parallel_size"),
                                  sequence_parallel=meg.bool("sequence_parallel", True), backend=strategy,
                                  **read_dynamic_cp(meg, actor_sp, VERL_MEGATRON_KEYS))
        if parallel.dynamic_cp and parallel.pp > 1:
            raise ConfigError(f"{meg.key('dynamic_context_parallel')}: dynamic CP runs with one pipeline stage "
                              f"(Megatron-LM's, as seqpack's), got pipeline_model_parallel_size = {parallel.pp}")
    else:
        parallel = ParallelConfig(backend=strategy, ulysses=actor_sp)
    # ref's Ulysses size defaults to the actor's key (oc.select), not to the actor's engine config.
    actor_ulysses_key = actor.need("ulysses_sequence_parallel_size", 1)
    ref_sp, _ = _verl_sp(ref, strategy, "fsdp_config", actor_ulysses_key, actor_sp)
    critic_sp, _ = _verl_sp(critic, critic_strategy, "fsdp", 1, 1)

    enable = critic.get("enable")
    if enable is not None:
        use_critic = critic.bool("enable")
    else:
        use_critic = algorithm.text("adv_estimator", "gae") == "gae"

    if strategy != "megatron":
        for r, sp in ((actor, actor_sp), (ref, ref_sp)):
            if sp > 1 and not model_rmpad:
                raise ConfigError(f"{r.key('ulysses_sequence_parallel_size')}: Ulysses sequence parallelism ({sp}) "
                                  "needs actor_rollout_ref.model.use_remove_padding = true")
    if use_critic and critic_strategy != "megatron" and critic_sp > 1 and not critic_rmpad:
        raise ConfigError(f"critic.ulysses_sequence_parallel_size: Ulysses sequence parallelism ({critic_sp}) "
                          "needs critic.model.use_remove_padding = true")

    def role(r: Reader, keys, defaults, sp: int, rmpad: bool, check: bool, exclusive: bool,
             role_strategy: str = strategy) -> VerlMicroBatching:
        dyn_key, cap_key, per_gpu_key, global_key = keys
        dyn_default, cap_default, per_gpu_default, global_default = defaults
        dyn = r.bool(dyn_key, dyn_default)
        cap = r.int(cap_key, cap_default)
        per_gpu = r.int(per_gpu_key, per_gpu_default)
        global_mbs = r.int(global_key, global_default)
        if exclusive and not dyn and per_gpu is not None and global_mbs is not None:
            raise ConfigError(f"{r.key(global_key)}: deprecated, and {r.key(per_gpu_key)} is set too; "
                              f"remove {global_key}")
        if dyn and check:
            if cap is None:
                raise ConfigError(f"{r.key(cap_key)}: required with {r.key(dyn_key)}")
            if cap * sp < longest:
                ranks = "context-parallel" if role_strategy == "megatron" else "Ulysses sequence-parallel"
                times = "" if sp == 1 else f" x {sp} {ranks} ranks = {cap * sp}"
                raise ConfigError(f"{r.key(cap_key)}: {cap}{times} is below the longest sequence, "
                                  f"data.max_prompt_length + data.max_response_length = {prompt} + {response}")
        return VerlMicroBatching(path=r.path, use_dynamic_bsz=dyn, max_token_len_per_gpu=cap,
                                 micro_batch_size_per_gpu=per_gpu, micro_batch_size=global_mbs, sp_size=sp,
                                 use_remove_padding=rmpad)

    train_keys = ("use_dynamic_bsz", "ppo_max_token_len_per_gpu", "ppo_micro_batch_size_per_gpu",
                  "ppo_micro_batch_size")
    log_prob_keys = ("log_prob_use_dynamic_bsz", "log_prob_max_token_len_per_gpu",
                     "log_prob_micro_batch_size_per_gpu", "log_prob_micro_batch_size")
    actor_mb = role(actor, train_keys, (False, VERL_DEFAULT_MAX_TOKEN_LEN, None, None), actor_sp, actor_rmpad,
                    True, True)
    if actor.bool("use_prefix_grouper"):  # verl's shared-prefix switch: the actor's micro-batches as prefix trees
        if not actor_mb.use_dynamic_bsz:
            ctx.note(f"{actor.key('use_prefix_grouper')}: seqpack plans prefix trees in dynamic micro-batches "
                     f"({actor.key('use_dynamic_bsz')}); with fixed micro-batch sizes it plans nothing (verl's own "
                     "PrefixGrouper still groups each micro-batch's rows by uid)")
        actor_mb = dataclasses.replace(actor_mb, shared_prefix=True, prefix_grouper=True)
    lib = model.get("external_lib")
    if lib in TREE_LIBS:  # verl's own key: every worker imports it, and it patches the engine (docs/verl.md)
        if not actor_mb.use_dynamic_bsz:
            raise ConfigError(f"{model.key('external_lib')}: {lib} plans prefix trees in dynamic micro-batches; "
                              f"set {actor.key('use_dynamic_bsz')} = true")
        actor_mb = dataclasses.replace(actor_mb, shared_prefix=True, prefix_reuse=lib == TREE_LIBS[1])
        if actor_mb.prefix_reuse:
            _check_prefix_reuse(actor, model.key("external_lib"), strategy, actor_sp)
    log_prob_defaults = (actor_mb.use_dynamic_bsz, actor_mb.max_token_len_per_gpu, None, None)
    rollout_mb = role(rollout, log_prob_keys, log_prob_defaults, actor_sp, actor_rmpad, True, True)
    ref_mb = role(ref, log_prob_keys, log_prob_defaults, ref_sp, model_rmpad, True, True)
    critic_mb = role(critic, train_keys, (actor_mb.use_dynamic_bsz, VERL_DEFAULT_CRITIC_MAX_TOKEN_LEN, None, None),
                     critic_sp, critic_rmpad, use_critic, False, critic_strategy)
    forward_keys = ("use_dynamic_bsz", "forward_max_token_len_per_gpu", "forward_micro_batch_size_per_gpu",
                    "forward_micro_batch_size")
    critic_forward_mb = role(critic, forward_keys, (critic_mb.use_dynamic_bsz, critic_mb.max_token_len_per_gpu,
                                                    critic_mb.micro_batch_size_per_gpu, critic_mb.micro_batch_size),
                             critic_sp, critic_rmpad, use_critic, False, critic_strategy)

    mini = actor.need("ppo_mini_batch_size", 256)
    critic_mini = critic.need("ppo_mini_batch_size", mini)
    for r, m, mb, check in ((actor, mini, actor_mb, True), (critic, critic_mini, critic_mb, use_critic)):
        if not check or mb.use_dynamic_bsz:
            continue
        if m > train_batch_size:
            raise ConfigError(f"{r.key('ppo_mini_batch_size')}: {m} is above "
                              f"data.train_batch_size = {train_batch_size}")
        if mb.micro_batch_size is not None and m % mb.micro_batch_size:
            raise ConfigError(f"{r.key('ppo_mini_batch_size')}: must be divisible by "
                              f"{r.key('ppo_micro_batch_size')} = {mb.micro_batch_size}, got {m}")

    verl = VerlConfig(actor=actor_mb, rollout=rollout_mb, ref=ref_mb, critic=critic_mb,
                      critic_forward=critic_forward_mb, strategy=strategy, critic_strategy=critic_strategy,
                      train_batch_size=train_batch_size, ppo_mini_batch_size=mini,
                      critic_ppo_mini_batch_size=critic_mini, rollout_n=rollout_n,
                      balance_batch=trainer.bool("balance_batch", True), use_critic=use_critic,
                      max_prompt_length=prompt, max_response_length=response,
                      external_lib=lib if isinstance(lib, str) else None)
    return SeqpackConfig(schema="verl", parallel=parallel, max_seqlen=longest,
                         global_batch_size=train_batch_size * rollout_n,
                         verl=verl, stream=read_verl_async(top, rollout_n))
