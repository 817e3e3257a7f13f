"""NeMo-RL's schema: ``policy.*`` (``megatron_cfg`` / ``dtensor_cfg``,
``sequence_packing``, ``dynamic_batching``, ``make_sequence_length_divisible_by``)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from ...planning.packing import PackingAlgorithm
from ...tensors.layout import alignment, round_up
from ._async import read_nemo_rl_async
from ._dynamic_cp import read_dynamic_cp
from ._loader import Context, Reader
from ._types import (MICROBATCH_ORDERS, ConfigError, DynamicBatchingConfig, ParallelConfig, SeqpackConfig,
                     SequencePackingConfig)

# The keys seqpack reads in policy.megatron_cfg (besides dynamic CP's).
NEMO_RL_MEGATRON_KEYS = ("enabled", "tensor_model_parallel_size", "context_parallel_size",
                         "pipeline_model_parallel_size", "sequence_parallel")
# The keys seqpack reads in the sections it owns.
NEMO_RL_SEQUENCE_PACKING_KEYS = ("enabled", "train_mb_tokens", "logprob_mb_tokens", "algorithm",
                                 "sequence_length_round", "microbatch_order")
NEMO_RL_DYNAMIC_BATCHING_KEYS = ("enabled", "train_mb_tokens", "logprob_mb_tokens", "sequence_length_round")
# NeMo-RL's own keys in those sections that seqpack does not need (its loss wrapper
# takes ``fused=`` directly).
NEMO_RL_FRAMEWORK_KEYS = {"sequence_packing": ("fuse_loss",), "dynamic_batching": ()}


def _algorithm(r: Reader) -> str:
    return r.choice("algorithm", tuple(a.value for a in PackingAlgorithm), "modified_first_fit_decreasing")


def load_nemo_rl(ctx: Context, data: Mapping[str, Any]) -> SeqpackConfig:
    policy = Reader(ctx, ("policy",), ctx.get(("policy",)))
    megatron, dtensor = policy.section("megatron_cfg"), policy.section("dtensor_cfg")
    use_megatron, use_dtensor = megatron.bool("enabled"), dtensor.bool("enabled")
    if use_megatron and use_dtensor:
        raise ConfigError("policy.megatron_cfg.enabled: configure either Megatron or DTensor, not both")
    if use_dtensor:
        parallel = ParallelConfig(tp=dtensor.int("tensor_parallel_size", 1), cp=dtensor.int("context_parallel_size", 1),
                                  sequence_parallel=dtensor.bool("sequence_parallel"), backend="dtensor")
    else:
        cp = megatron.int("context_parallel_size", 1)
        parallel = ParallelConfig(
            tp=megatron.int("tensor_model_parallel_size", 1), cp=cp,
            pp=megatron.int("pipeline_model_parallel_size", 1), sequence_parallel=megatron.bool("sequence_parallel"),
            backend="megatron", **read_dynamic_cp(megatron, cp, NEMO_RL_MEGATRON_KEYS))
    max_seqlen = policy.int("max_total_sequence_length")

    policy.no_lookalike(("sequence_packing", "dynamic_batching"))
    policy.no_lookalike(("shared_prefix_training", "shared_prefix_reuse"), what="key")
    sp_r = policy.section("sequence_packing").known(
        NEMO_RL_SEQUENCE_PACKING_KEYS, NEMO_RL_FRAMEWORK_KEYS["sequence_packing"], "NeMo-RL")
    db_r = policy.section("dynamic_batching").known(
        NEMO_RL_DYNAMIC_BATCHING_KEYS, NEMO_RL_FRAMEWORK_KEYS["dynamic_batching"], "NeMo-RL")
    sp_on, db_on = sp_r.bool("enabled"), db_r.bool("enabled")
    if sp_on and db_on:
        raise ConfigError("policy.sequence_packing.enabled: sequence packing and dynamic batching are exclusive; "
                          "disable one of them")
    if db_on and parallel.pp > 1:
        raise ConfigError("policy.dynamic_batching.enabled: dynamic batching needs a single pipeline stage "
                          f"(policy.megatron_cfg.pipeline_model_parallel_size = {parallel.pp})")
    if parallel.cp > 1 and use_megatron and not sp_on:
        raise ConfigError("policy.megatron_cfg.context_parallel_size: context parallelism with Megatron-Core "
                          "needs policy.sequence_packing.enabled = true")
    if parallel.dynamic_cp and parallel.pp > 1:
        raise ConfigError("policy.megatron_cfg.dynamic_context_parallel: dynamic CP runs with one pipeline stage "
                          f"(Megatron-LM's, as seqpack's), got pipeline_model_parallel_size = {parallel.pp}")
    if parallel.cp > 1 and use_dtensor and sp_on:
        raise ConfigError("policy.dtensor_cfg.context_parallel_size: the DTensor backend cannot pack sequences "
                          "with context parallelism; disable policy.sequence_packing")
    # A switched-off section is not read by NeMo-RL: its odd values are warnings.
    if not sp_on:
        sp_r = sp_r.relaxed("policy.sequence_packing.enabled is false")
    if not db_on:
        db_r = db_r.relaxed("policy.dynamic_batching.enabled is false")

    # Pad multiple: make_sequence_length_divisible_by when given, else NeMo-RL's older
    # formula. NeMo-RL's Megatron worker pads each packed sequence to 2*CP (CP > 1)
    # times TP (with sequence parallelism) whatever the key says, and its planner does
    # not: seqpack plans with a multiple of both, and says so.
    divisible_by = policy.int("make_sequence_length_divisible_by")
    if divisible_by is None:
        pad_multiple = alignment(parallel.cp, parallel.tp, rule="roll")
    else:
        pad_multiple = divisible_by
        minimum = alignment(parallel.cp, parallel.tp, parallel.sequence_parallel)
        if sp_on and use_megatron and divisible_by % minimum:
            pad_multiple = divisible_by * minimum // math.gcd(divisible_by, minimum)
            ctx.note(f"policy.make_sequence_length_divisible_by: {divisible_by} is not a multiple of {minimum}, "
                     "the padding NeMo-RL's Megatron worker gives each packed sequence (2*CP with CP > 1, times TP "
                     f"with sequence parallelism); seqpack plans with {pad_multiple}")

    def caps(r: Reader, on: bool, multiple: int, what: str):
        train = r.int("train_mb_tokens")
        logprob = r.int("logprob_mb_tokens")
        if on and train is None:
            raise ConfigError(f"{r.key('train_mb_tokens')}: required when {r.key('enabled')} is true")
        if on and max_seqlen is not None:
            longest = round_up(max_seqlen, multiple)
            for name, value in (("train_mb_tokens", train), ("logprob_mb_tokens", logprob)):
                if value is not None and value < longest:
                    ctx.note(f"{r.key(name)}: {value} is below the longest (padded) sequence, "
                             f"policy.max_total_sequence_length = {max_seqlen} -> {longest}; {what}")
        return train, logprob

    train, logprob = caps(sp_r, sp_on, pad_multiple,
                          "a longer sequence stops the packer, NeMo-RL's as seqpack's ('exceeds bin capacity')")
    sequence_packing = SequencePackingConfig(
        enabled=sp_on, train_mb_tokens=train, logprob_mb_tokens=logprob, algorithm=_algorithm(sp_r),
        microbatch_order=sp_r.choice("microbatch_order", MICROBATCH_ORDERS, "packer"),
        sequence_length_pad_multiple=pad_multiple)
    if sp_on:
        sp_r.bool("fuse_loss")
    shared_prefix = policy.bool("shared_prefix_training")
    if shared_prefix and not sp_on:
        raise ConfigError("policy.shared_prefix_training: shared-prefix training plans its micro-batches as prefix "
                          "trees in sequence packing (NeMo-RL PR #4008 requires it too); set "
                          "policy.sequence_packing.enabled = true")
    if shared_prefix:
        sequence_packing = dataclasses.replace(sequence_packing, shared_prefix=True)
    if policy.bool("shared_prefix_reuse"):  # seqpack's key: a tree larger than the cap runs in passes
        if not shared_prefix:
            raise ConfigError("policy.shared_prefix_reuse: prefix reuse runs prefix trees larger than the cap in "
                              "passes; it needs policy.shared_prefix_training = true")
        if use_megatron:
            raise ConfigError("policy.shared_prefix_reuse: its passes run a transformers model (DTensor); the Megatron "
                              "backend has no pass attention")
        if parallel.cp > 1:
            raise ConfigError(f"policy.shared_prefix_reuse: its passes are not sharded over context-parallel ranks; "
                              f"it needs CP = 1, got {parallel.cp}")
        sequence_packing = dataclasses.replace(sequence_packing, prefix_reuse=True)
    round_to = db_r.int("sequence_length_round", 64)
    if db_on and round_to % (parallel.tp * parallel.cp):
        raise ConfigError(f"policy.dynamic_batching.sequence_length_round: must be divisible by TP*CP = "
                          f"{parallel.tp * parallel.cp}, got {round_to}")
    train, logprob = caps(db_r, db_on, round_to,
                          "a longer sequence stops seqpack's dynamic batching ('exceeds max_tokens_per_microbatch')")
    dynamic_batching = DynamicBatchingConfig(enabled=db_on, train_mb_tokens=train, logprob_mb_tokens=logprob,
                                             sequence_length_round=round_to)
    stream = read_nemo_rl_async(Reader(ctx, (), data), sequence_packing.microbatch_order)
    return SeqpackConfig(schema="nemo_rl", parallel=parallel, max_seqlen=max_seqlen,
                         global_batch_size=policy.int("train_global_batch_size"),
                         sequence_packing=sequence_packing, dynamic_batching=dynamic_batching, stream=stream)
