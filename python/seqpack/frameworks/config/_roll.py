"""ROLL's schema: a worker role (``actor_train``, ``sft_train``, ``reference``, ...) with
its ``strategy_args``, ``use_sequence_packing`` + ``sequence_packing_args`` and
``use_dynamic_batching_in_train/infer``."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

from ...tensors.layout import alignment, round_up
from ._dynamic_cp import read_dynamic_cp
from ._loader import Context, Reader
from ._types import (ROLL_ALGORITHMS, ConfigError, ParallelConfig, RollDynamicBatchingConfig, RollPackingConfig,
                     SeqpackConfig)

# The keys seqpack reads in strategy_args.strategy_config (besides dynamic CP's).
ROLL_STRATEGY_KEYS = ("tensor_model_parallel_size", "context_parallel_size", "pipeline_model_parallel_size",
                      "virtual_pipeline_model_parallel_size", "sequence_parallel")

# StrategyArguments.strategy_name's default in the ROLL whose WorkerConfig turns packing
# off for other strategies than Megatron's; older releases defaulted to deepspeed_train
# (not Megatron either).
ROLL_DEFAULT_STRATEGY = "fsdp2_train"
ROLL_OLDER_DEFAULT_STRATEGY = "deepspeed_train"
ROLL_SEQUENCE_PACKING_KEYS = ("algorithm", "max_packed_sequence_length_train", "max_packed_sequence_length_forward",
                              "min_num_micro_batches_train", "min_num_micro_batches_forward",
                              "shared_prefix", "prefix_reuse")  # seqpack's keys: ROLL has no such switches yet


def load_roll(ctx: Context, data: Mapping[str, Any], role: str) -> SeqpackConfig:
    if role not in data:
        roles = sorted(map(str, data))
        shown = ", ".join(roles[:12]) + (f", ... ({len(roles)} keys)" if len(roles) > 12 else "")
        raise ConfigError(f"{role}: no such worker role in the config (roles: {shown}); pass role=... "
                          "(load(..., role='sft_train'))")
    worker = Reader(ctx, (role,), ctx.value((role,)))
    # ROLL builds the worker's StrategyArguments from strategy_args (dacite): a name
    # left out takes the dataclass default, a missing (or null) strategy_args is None.
    strategy_name: Optional[str] = None
    named = False
    if worker.get("strategy_args") is not None:
        strategy = worker.section("strategy_args")
        named = "strategy_name" in strategy.data
        strategy_name = strategy.get("strategy_name", ROLL_DEFAULT_STRATEGY)
        if not isinstance(strategy_name, str) or not strategy_name.strip():
            raise ConfigError(f"{strategy.key('strategy_name')}: must be a non-empty string, got {strategy_name!r}")
        sc = strategy.section("strategy_config")
    else:
        sc = worker.section("strategy_args")  # {}: every size 1
    cp = sc.int("context_parallel_size", 1)
    parallel = ParallelConfig(
        tp=sc.int("tensor_model_parallel_size", 1), cp=cp,
        pp=sc.int("pipeline_model_parallel_size", 1), vpp=sc.int("virtual_pipeline_model_parallel_size"),
        sequence_parallel=sc.bool("sequence_parallel"), backend=strategy_name,
        **read_dynamic_cp(sc, cp, ROLL_STRATEGY_KEYS))
    if parallel.dynamic_cp and parallel.pp > 1:
        raise ConfigError(f"{sc.key('dynamic_context_parallel')}: dynamic CP runs with one pipeline stage "
                          f"(Megatron-LM's, as seqpack's), got pipeline_model_parallel_size = {parallel.pp}")
    top = Reader(ctx, (), data)
    sequence_length = top.int("sequence_length")
    if sequence_length is None:
        prompt, response = top.int("prompt_length"), top.int("response_length")
        if prompt is not None and response is not None:
            sequence_length = prompt + response

    # ROLL's WorkerConfig.__post_init__, in its order: dynamic batching first, then
    # the strategy (only when the worker has strategy_args).
    packing_on = worker.bool("use_sequence_packing")
    train_on, infer_on = worker.bool("use_dynamic_batching_in_train"), worker.bool("use_dynamic_batching_in_infer")
    if packing_on and (train_on or infer_on):
        ctx.note(f"{role}.use_sequence_packing: sequence packing and dynamic batching "
                 f"({role}.use_dynamic_batching_in_{'train' if train_on else 'infer'}) are exclusive; ROLL turns "
                 "packing off and batches dynamically; so does seqpack")
        packing_on = False
    if packing_on and strategy_name is not None and "megatron" not in strategy_name:
        which = (f"strategy_args.strategy_name = {strategy_name!r}" if named else
                 f"strategy_args without a strategy_name (ROLL's default, {strategy_name!r}; "
                 f"{ROLL_OLDER_DEFAULT_STRATEGY!r} in older releases)")
        ctx.note(f"{role}.use_sequence_packing: ROLL packs sequences with Megatron strategies only and turns "
                 f"packing off for {which}; so does seqpack")
        packing_on = False

    worker.no_lookalike(("sequence_packing_args", "use_sequence_packing"))
    args = worker.section("sequence_packing_args").known(ROLL_SEQUENCE_PACKING_KEYS, (), "ROLL")
    if not packing_on:
        args = args.relaxed(f"{role}.use_sequence_packing is off")
    pad_multiple = alignment(parallel.cp, parallel.tp, rule="roll")

    def packed_cap(phase: str, batch: Optional[int]) -> Optional[int]:
        name = f"max_packed_sequence_length_{phase}"
        value = args.int(name)
        if value is None and packing_on and sequence_length is not None and batch is not None:
            value = sequence_length * batch  # ROLL's auto-fill
        if packing_on and value is None:
            raise ConfigError(f"{args.key(name)}: required with {role}.use_sequence_packing (or give "
                              f"sequence_length and the batch size for ROLL's auto-fill)")
        if packing_on and sequence_length is not None and value < sequence_length:
            raise ConfigError(f"{args.key(name)}: {value} is below sequence_length = {sequence_length}")
        return value

    per_device = worker.section("training_args").int("per_device_train_batch_size")
    roll_packing = RollPackingConfig(
        enabled=packing_on, algorithm=args.choice("algorithm", ROLL_ALGORITHMS, "none"),
        max_packed_sequence_length_train=packed_cap("train", per_device),
        max_packed_sequence_length_forward=packed_cap("forward", worker.int("infer_batch_size", 16)),
        min_num_micro_batches_train=args.int("min_num_micro_batches_train", 1),
        min_num_micro_batches_forward=args.int("min_num_micro_batches_forward", 1),
        pad_multiple=pad_multiple, shared_prefix=args.bool("shared_prefix"))
    if packing_on and roll_packing.shared_prefix and roll_packing.algorithm != "load_balance":
        raise ConfigError(f"{args.key('shared_prefix')}: prefix trees are planned by algorithm 'load_balance', "
                          f"got {args.key('algorithm')} = {roll_packing.algorithm!r}")
    if args.bool("prefix_reuse") and packing_on:
        roll_packing = dataclasses.replace(roll_packing, prefix_reuse=True,
                                           loss_agg_mode=_check_prefix_reuse(top, args, roll_packing, parallel.cp))

    def dyn(phase: str, on: bool):
        cap_name, round_name = f"max_tokens_per_microbatch_in_{phase}", f"sequence_length_round_in_{phase}"
        # ROLL's default cap is 0 (unset): accepted while dynamic batching is off,
        # and then "must be >= 1", not "required", when it is on.
        cap = worker.int(cap_name, minimum=1 if on else 0)
        cap = None if cap == 0 else cap
        round_to = worker.int(round_name, 4)
        if not on:
            return cap, round_to
        if cap is None:
            raise ConfigError(f"{worker.key(cap_name)}: required with {worker.key('use_dynamic_batching_in_' + phase)}")
        if round_to % (parallel.tp * parallel.cp):
            raise ConfigError(f"{worker.key(round_name)}: must be divisible by TP*CP = {parallel.tp * parallel.cp}, "
                              f"got {round_to}")
        if sequence_length is not None and cap < round_up(sequence_length, round_to):
            raise ConfigError(f"{worker.key(cap_name)}: {cap} is below the longest (rounded) sequence, "
                              f"sequence_length = {sequence_length}")
        return cap, round_to

    train_cap, train_round = dyn("train", train_on)
    infer_cap, infer_round = dyn("infer", infer_on)
    roll_dynamic = RollDynamicBatchingConfig(
        train=train_on, infer=infer_on, max_tokens_per_microbatch_in_train=train_cap,
        max_tokens_per_microbatch_in_infer=infer_cap, sequence_length_round_in_train=train_round,
        sequence_length_round_in_infer=infer_round)
    return SeqpackConfig(schema="roll", parallel=parallel, max_seqlen=sequence_length, roll_packing=roll_packing,
                         roll_dynamic_batching=roll_dynamic, role=role)


def _check_prefix_reuse(top: Reader, args: Reader, packing: RollPackingConfig, cp: int) -> str:
    """``sequence_packing_args.prefix_reuse``: trees larger than the cap in passes, each
    holding a share of every row's loss tokens. It needs trees (``shared_prefix``),
    one rank per pass (no CP) and a loss whose terms sum over the passes (ROLL's ``agg_loss``
    over the global counts); the ``loss_agg_mode`` read is returned."""
    from .._loss_split import ROLL_ROW_COUPLING, ROLL_SPLITTING_AGGREGATIONS

    where = args.key("prefix_reuse")
    if not packing.shared_prefix:
        raise ConfigError(f"{where}: runs prefix trees in passes; it needs {args.key('shared_prefix')}: true")
    if cp > 1:
        raise ConfigError(f"{where}: its passes run on one rank each; it needs context_parallel_size = 1, got {cp}")
    agg = top.text("loss_agg_mode", "seq-mean-token-mean")  # ROLL's PPOConfig default
    if agg not in ROLL_SPLITTING_AGGREGATIONS:
        raise ConfigError(f"{top.key('loss_agg_mode')}: {agg!r} divides by each row's own token count, which "
                          f"prefix reuse splits over passes ({where}); set one of {ROLL_SPLITTING_AGGREGATIONS}")
    epochs = top.int("ppo_epochs", 1)
    if epochs > 1 and not top.bool("enable_old_logprobs_recompute"):
        raise ConfigError(f"{top.key('ppo_epochs')}: {epochs} reuses each pass's old log-probs from ROLL's cache, "
                          f"which keeps a row's first micro-batch's (in passes: only that pass's tokens) ({where}); "
                          f"set enable_old_logprobs_recompute: true")
    for name, on in ROLL_ROW_COUPLING:
        if top.get(name) == on:
            raise ConfigError(f"{top.key(name)}: {on!r} couples a row's tokens (a sequence-level term), which prefix "
                              f"reuse splits over passes ({where})")
    correction = top.get("train_infer_correction")
    if isinstance(correction, Mapping):
        parts = [("is_weight", correction.get("is_weight"), "weight_type")]
        parts += [(f"filters[{i}]", f, "agg_type") for i, f in enumerate(correction.get("filters") or [])]
        for name, part, level in parts:
            if isinstance(part, Mapping) and part.get("enabled") and part.get(level, "token") != "token":
                raise ConfigError(f"{top.key('train_infer_correction')}.{name}.{level}: {part.get(level)!r} couples "
                                  f"a row's tokens, which prefix reuse splits over passes ({where})")
    return agg
