"""verl's SFT trainer (``verl/trainer/config/sft_trainer_engine.yaml``, run by
``verl.trainer.sft_trainer``): ``data.*`` holds the micro-batching, ``engine.*`` the
parallel sizes, ``model.use_remove_padding`` the packed layout. One role, ``"sft"``.

The trainer hands ``data.use_dynamic_bsz``, ``data.max_token_len_per_gpu`` and
``data.micro_batch_size_per_gpu`` to its engine, whose ``prepare_micro_batches`` calls
``rearrange_micro_batches(max_token_len=max_token_len_per_gpu * sp_size)``, ``sp_size``
being the engine's sequence-sharding size (below); ``trainer.balance_batch`` makes
``sft_trainer_ray`` partition a batch over the data-parallel ranks with
``get_seqlen_balanced_partitions(k_partitions=dp_size, equal_size=True)``.
"""

from __future__ import annotations

from typing import Any, Mapping

from ._dynamic_cp import DYNAMIC_CP_KEYS, read_dynamic_cp
from ._loader import Context, Reader
from ._types import ConfigError, ParallelConfig, SeqpackConfig, VerlConfig, VerlMicroBatching

VERL_SFT_TOP_SECTIONS = ("data", "model", "engine", "trainer")
VERL_SFT_DATA_KEYS = ("train_batch_size", "micro_batch_size_per_gpu", "max_token_len_per_gpu", "use_dynamic_bsz",
                      "max_length")
# The engine key verl's engine passes as ``sp_size`` (verl.workers.engine.*.transformer_impl),
# by engine.strategy; None: the engine passes none (1).
VERL_SFT_ENGINE_SP_KEYS = {"fsdp": "ulysses_sequence_parallel_size", "fsdp2": "ulysses_sequence_parallel_size",
                           "fsdp_turbo": "ulysses_sequence_parallel_size", "megatron": "context_parallel_size",
                           "veomni": "ulysses_parallel_size", "torchtitan": "tensor_parallel_size",
                           "automodel": None}
# engine.strategy left out: the default of the engine class _target_ names.
VERL_SFT_ENGINE_TARGETS = {"FSDPEngineConfig": "fsdp", "McoreEngineConfig": "megatron", "VeOmniEngineConfig": "veomni",
                           "TorchtitanEngineConfig": "torchtitan", "AutomodelEngineConfig": "automodel"}
VERL_SFT_MEGATRON_KEYS = ("tensor_model_parallel_size", "context_parallel_size", "pipeline_model_parallel_size",
                          "virtual_pipeline_model_parallel_size", "sequence_parallel")
# sft_trainer_engine.yaml's values (the defaults of a key a recipe leaves out).
VERL_SFT_DEFAULTS = {"train_batch_size": 256, "micro_batch_size_per_gpu": 4, "max_token_len_per_gpu": 8192,
                     "use_dynamic_bsz": True, "max_length": 1024}
_MARKERS = ("use_dynamic_bsz", "max_token_len_per_gpu", "micro_batch_size_per_gpu")


def is_sft(data: Mapping[str, Any]) -> bool:
    """A config of verl's SFT trainer: no ``actor_rollout_ref``, and a ``data`` section
    holding the trainer's micro-batching keys or an ``engine`` section."""
    if "actor_rollout_ref" in data:
        return False
    section = data.get("data")
    return (isinstance(section, Mapping) and any(k in section for k in _MARKERS)) or \
        isinstance(data.get("engine"), Mapping)


def load_verl_sft(ctx: Context, data: Mapping[str, Any]) -> SeqpackConfig:
    top = Reader(ctx, (), data).no_lookalike(VERL_SFT_TOP_SECTIONS)
    data_r = top.section("data").no_lookalike(VERL_SFT_DATA_KEYS, what="key")
    model = top.section("model").no_lookalike(("use_remove_padding",), what="key")
    engine = top.section("engine")
    trainer = top.section("trainer").no_lookalike(("balance_batch",), what="key")

    target = engine.get("_target_")
    strategy = engine.text("strategy", VERL_SFT_ENGINE_TARGETS.get(str(target).rsplit(".", 1)[-1], "fsdp"))
    sp_key = VERL_SFT_ENGINE_SP_KEYS.get(strategy)
    if strategy == "megatron":
        engine.no_lookalike(VERL_SFT_MEGATRON_KEYS + ("strategy",), what="key", known=DYNAMIC_CP_KEYS)
        sp, tp = engine.need("context_parallel_size", 1), engine.need("tensor_model_parallel_size", 1)
        # McoreEngineConfig turns sequence parallelism off with TP = 1.
        parallel = ParallelConfig(tp=tp, cp=sp, pp=engine.need("pipeline_model_parallel_size", 1),
                                  vpp=engine.int("virtual_pipeline_model_parallel_size"),
                                  sequence_parallel=engine.bool("sequence_parallel", True) and tp > 1,
                                  backend=strategy,
                                  **read_dynamic_cp(engine, sp, VERL_SFT_MEGATRON_KEYS + ("strategy", "_target_")))
    elif strategy == "torchtitan":
        engine.no_lookalike(("tensor_parallel_size", "context_parallel_size", "strategy"), what="key")
        sp = engine.need("tensor_parallel_size", 1)
        parallel = ParallelConfig(tp=sp, cp=engine.need("context_parallel_size", 1), backend=strategy)
    elif sp_key is not None:
        engine.no_lookalike((sp_key, "strategy"), what="key")
        sp = engine.need(sp_key, 1)
        parallel = ParallelConfig(backend=strategy, ulysses=sp)
    else:
        sp = 1
        parallel = ParallelConfig(backend=strategy)
        if strategy not in VERL_SFT_ENGINE_SP_KEYS:
            ctx.note(f"engine.strategy: {strategy!r} is not an engine seqpack knows "
                     f"({', '.join(VERL_SFT_ENGINE_SP_KEYS)}); seqpack takes its sequence-parallel size as 1")

    rmpad = model.bool("use_remove_padding", True)
    if sp > 1 and strategy in ("fsdp", "fsdp2", "fsdp_turbo") and not rmpad:
        raise ConfigError(f"engine.{sp_key}: Ulysses sequence parallelism ({sp}) needs "
                          "model.use_remove_padding = true")

    d = VERL_SFT_DEFAULTS
    max_length = data_r.need("max_length", d["max_length"])
    train_batch_size = data_r.need("train_batch_size", d["train_batch_size"])
    dyn = data_r.bool("use_dynamic_bsz", d["use_dynamic_bsz"])
    cap = data_r.int("max_token_len_per_gpu", d["max_token_len_per_gpu"])
    per_gpu = data_r.int("micro_batch_size_per_gpu", d["micro_batch_size_per_gpu"])
    if dyn and cap is None:
        raise ConfigError("data.max_token_len_per_gpu: required with data.use_dynamic_bsz")
    if not dyn and per_gpu is None:
        raise ConfigError("data.micro_batch_size_per_gpu: required when data.use_dynamic_bsz is false")
    if dyn and cap * sp < max_length:
        times = "" if sp == 1 else f" x {sp} ({'engine.' + str(sp_key)}) = {cap * sp}"
        ctx.note(f"data.max_token_len_per_gpu: {cap}{times} is below data.max_length = {max_length}: a longer "
                 "sequence stops verl's rearrange_micro_batches (and seqpack's) at run time")

    mb = VerlMicroBatching(path="data", use_dynamic_bsz=dyn, max_token_len_per_gpu=cap,
                           micro_batch_size_per_gpu=per_gpu, sp_size=sp, use_remove_padding=rmpad)
    verl = VerlConfig(trainer="sft", sft=mb, strategy=strategy, critic_strategy=None,
                      train_batch_size=train_batch_size, ppo_mini_batch_size=None, critic_ppo_mini_batch_size=None,
                      rollout_n=None, balance_batch=trainer.bool("balance_batch", True), use_critic=False,
                      max_prompt_length=None, max_response_length=None)
    return SeqpackConfig(schema="verl", parallel=parallel, max_seqlen=max_length,
                         global_batch_size=train_batch_size, verl=verl)
