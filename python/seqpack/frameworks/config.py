"""Sequence-packing / dynamic-batching configuration in NeMo-RL's and ROLL's schemas.

:func:`load` reads a YAML file, a YAML string or a mapping written for either
framework, validates it, and returns a typed :class:`SeqpackConfig` whose methods
produce the arguments seqpack's APIs take. Errors are :class:`ConfigError`
(a ``ValueError``) naming the key path and the rule broken.

NeMo-RL (``policy.*``)::

    policy:
      max_total_sequence_length: 4096
      train_global_batch_size: 512
      make_sequence_length_divisible_by: 8        # optional: the per-sequence pad multiple
      megatron_cfg: {enabled: true, tensor_model_parallel_size: 2, context_parallel_size: 2,
                     pipeline_model_parallel_size: 1, sequence_parallel: true}
      sequence_packing: {enabled: true, train_mb_tokens: 8192, logprob_mb_tokens: 16384,
                         algorithm: modified_first_fit_decreasing, microbatch_order: largest_first}
      dynamic_batching: {enabled: false}

ROLL (a worker role such as ``actor_train``)::

    actor_train:
      strategy_args:
        strategy_name: megatron_train
        strategy_config: {tensor_model_parallel_size: 2, context_parallel_size: 2}
      use_sequence_packing: true
      sequence_packing_args: {algorithm: load_balance, max_packed_sequence_length_train: 8192,
                              max_packed_sequence_length_forward: 8192}

Example:
    >>> cfg = load({"policy": {"sequence_packing": {"enabled": True, "train_mb_tokens": 4096,
    ...     "algorithm": "modified_first_fit_decreasing"}, "dynamic_batching": {"enabled": False}}})
    >>> cfg.sequence_packing_args("train")["max_tokens_per_microbatch"]
    4096

YAML interpolations (``${policy.x}``, NeMo-RL's ``${mul:a,b}``) are resolved with
OmegaConf when it is installed (NeMo-RL installs it); a mapping that is already an
OmegaConf ``DictConfig`` is resolved the same way.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Union

from ..planning.packing import PackingAlgorithm
from ..tensors.layout import alignment, round_up

__all__ = [
    "ConfigError",
    "DynamicBatchingConfig",
    "ParallelConfig",
    "RollDynamicBatchingConfig",
    "RollPackingConfig",
    "SeqpackConfig",
    "SequencePackingConfig",
    "load",
]

MAX_DEPTH = 100  # nesting levels of a config; real ones have fewer than 10
MICROBATCH_ORDERS = ("packer", "largest_first")
ROLL_ALGORITHMS = ("none", "load_balance")
PHASES = ("train", "logprob")


class ConfigError(ValueError):
    """A configuration value breaks a rule; the message starts with its key path."""


# ---------------------------------------------------------------- typed sections


@dataclass(frozen=True)
class ParallelConfig:
    """Model-parallel sizes the packing rules depend on."""

    tp: int = 1
    cp: int = 1
    pp: int = 1
    vpp: Optional[int] = None
    sequence_parallel: bool = False
    backend: str = "megatron"  # NeMo-RL: "megatron" | "dtensor"; ROLL: the strategy name


@dataclass(frozen=True)
class SequencePackingConfig:
    """NeMo-RL ``policy.sequence_packing`` plus the pad multiple it implies."""

    enabled: bool = False
    train_mb_tokens: Optional[int] = None
    logprob_mb_tokens: Optional[int] = None
    algorithm: str = "modified_first_fit_decreasing"
    microbatch_order: str = "packer"
    sequence_length_pad_multiple: int = 1


@dataclass(frozen=True)
class DynamicBatchingConfig:
    """NeMo-RL ``policy.dynamic_batching``."""

    enabled: bool = False
    train_mb_tokens: Optional[int] = None
    logprob_mb_tokens: Optional[int] = None
    sequence_length_round: int = 64


@dataclass(frozen=True)
class RollPackingConfig:
    """ROLL ``use_sequence_packing`` + ``sequence_packing_args``."""

    enabled: bool = False
    algorithm: str = "none"
    max_packed_sequence_length_train: Optional[int] = None
    max_packed_sequence_length_forward: Optional[int] = None
    min_num_micro_batches_train: int = 1
    min_num_micro_batches_forward: int = 1
    pad_multiple: int = 1


@dataclass(frozen=True)
class RollDynamicBatchingConfig:
    """ROLL ``use_dynamic_batching_in_train/infer`` and their caps and rounding."""

    train: bool = False
    infer: bool = False
    max_tokens_per_microbatch_in_train: Optional[int] = None
    max_tokens_per_microbatch_in_infer: Optional[int] = None
    sequence_length_round_in_train: int = 4
    sequence_length_round_in_infer: int = 4


@dataclass(frozen=True)
class SeqpackConfig:
    """A validated configuration (one schema's sections are set, the other's are ``None``).

    Attributes:
        schema: ``"nemo_rl"`` or ``"roll"``.
        parallel: TP/CP/PP/VPP sizes and sequence parallelism.
        max_seqlen: ``policy.max_total_sequence_length`` / ROLL's ``sequence_length``.
        global_batch_size: NeMo-RL ``policy.train_global_batch_size`` (the chunk size
            of ``shard_by_batch_size`` when training).
    """

    schema: str
    parallel: ParallelConfig
    max_seqlen: Optional[int] = None
    global_batch_size: Optional[int] = None
    sequence_packing: Optional[SequencePackingConfig] = None
    dynamic_batching: Optional[DynamicBatchingConfig] = None
    roll_packing: Optional[RollPackingConfig] = None
    roll_dynamic_batching: Optional[RollDynamicBatchingConfig] = None
    role: Optional[str] = None
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def to_dict(self) -> Dict[str, Any]:
        """This config in its framework's schema (normalised: defaults filled in,
        NeMo-RL's pad multiple as ``make_sequence_length_divisible_by``);
        ``load(cfg.to_dict()) == cfg``."""
        p = self.parallel
        if self.schema == "nemo_rl":
            sp, db = self.sequence_packing, self.dynamic_batching
            backend = {"enabled": True, "sequence_parallel": p.sequence_parallel}
            if p.backend == "dtensor":
                backend.update(tensor_parallel_size=p.tp, context_parallel_size=p.cp)
            else:
                backend.update(tensor_model_parallel_size=p.tp, context_parallel_size=p.cp,
                               pipeline_model_parallel_size=p.pp)
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
            if self.max_seqlen is not None:
                policy["max_total_sequence_length"] = self.max_seqlen
            if self.global_batch_size is not None:
                policy["train_global_batch_size"] = self.global_batch_size
            return {"policy": policy}
        rp, rd = self.roll_packing, self.roll_dynamic_batching
        strategy_config = {"tensor_model_parallel_size": p.tp, "context_parallel_size": p.cp,
                           "pipeline_model_parallel_size": p.pp, "sequence_parallel": p.sequence_parallel}
        if p.vpp is not None:
            strategy_config["virtual_pipeline_model_parallel_size"] = p.vpp
        worker: Dict[str, Any] = {
            "strategy_args": {"strategy_name": p.backend, "strategy_config": strategy_config},
            "use_sequence_packing": rp.enabled,
            "sequence_packing_args": {k: getattr(rp, k) for k in (
                "algorithm", "max_packed_sequence_length_train", "max_packed_sequence_length_forward",
                "min_num_micro_batches_train", "min_num_micro_batches_forward")},
            "use_dynamic_batching_in_train": rd.train, "use_dynamic_batching_in_infer": rd.infer,
        }
        for key in ("max_tokens_per_microbatch_in_train", "max_tokens_per_microbatch_in_infer",
                    "sequence_length_round_in_train", "sequence_length_round_in_infer"):
            worker[key] = getattr(rd, key)
        out: Dict[str, Any] = {self.role: worker}
        if self.max_seqlen is not None:
            out["sequence_length"] = self.max_seqlen
        return out

    # NeMo-RL ------------------------------------------------------------
    def _nemo(self, what: str):
        if self.schema != "nemo_rl":
            raise ConfigError(f"{what} needs a NeMo-RL config (policy.*); this one is {self.schema}'s")

    def sequence_packing_args(self, phase: str = "train") -> Dict[str, Any]:
        """NeMo-RL ``SequencePackingArgs`` for ``shard_by_batch_size`` (``phase``:
        ``"train"`` uses ``train_mb_tokens``, ``"logprob"`` ``logprob_mb_tokens``)."""
        self._nemo("sequence_packing_args")
        sp = self.sequence_packing
        if not sp.enabled:
            raise ConfigError("policy.sequence_packing.enabled: sequence packing is disabled")
        return {
            "max_tokens_per_microbatch": _phase_tokens(sp, phase, "policy.sequence_packing"),
            "input_key": "input_ids",
            "input_lengths_key": "input_lengths",
            "algorithm": sp.algorithm,
            "sequence_length_pad_multiple": sp.sequence_length_pad_multiple,
            "microbatch_order": sp.microbatch_order,
        }

    def dynamic_batching_args(self, phase: str = "train") -> Dict[str, Any]:
        """NeMo-RL ``DynamicBatchingArgs`` for ``shard_by_batch_size``."""
        self._nemo("dynamic_batching_args")
        db = self.dynamic_batching
        if not db.enabled:
            raise ConfigError("policy.dynamic_batching.enabled: dynamic batching is disabled")
        return {
            "max_tokens_per_microbatch": _phase_tokens(db, phase, "policy.dynamic_batching"),
            "sequence_length_round": db.sequence_length_round,
            "input_key": "input_ids",
            "input_lengths_key": "input_lengths",
        }

    def shard_kwargs(self, shards: int, phase: str = "train") -> Dict[str, Any]:
        """Keyword arguments of ``BatchedDataDict.shard_by_batch_size`` as NeMo-RL's
        policy passes them (``batch_size`` = the global batch when training)."""
        self._nemo("shard_kwargs")
        kwargs: Dict[str, Any] = {
            "shards": shards,
            "batch_size": self.global_batch_size if phase == "train" else None,
        }
        if self.sequence_packing.enabled:
            kwargs["sequence_packing_args"] = self.sequence_packing_args(phase)
        elif self.dynamic_batching.enabled:
            kwargs["dynamic_batching_args"] = self.dynamic_batching_args(phase)
        return kwargs

    # ROLL ---------------------------------------------------------------
    def _roll(self, what: str):
        if self.schema != "roll":
            raise ConfigError(f"{what} needs a ROLL config (a worker role); this one is {self.schema}'s")

    def load_balance_kwargs(self, phase: str = "train") -> Dict[str, Any]:
        """Keyword arguments of :func:`seqpack.roll.make_micro_batch_iter_for_sequence_packing`
        (``phase``: ``"train"`` or ``"forward"``)."""
        self._roll("load_balance_kwargs")
        rp = self.roll_packing
        if not rp.enabled:
            raise ConfigError(f"{self.role}.use_sequence_packing: sequence packing is disabled")
        if phase not in ("train", "forward"):
            raise ConfigError(f"phase must be 'train' or 'forward', got {phase!r}")
        return {
            "algorithm": rp.algorithm,
            "max_packed_sequence_length": getattr(rp, f"max_packed_sequence_length_{phase}"),
            "min_num_micro_batches": getattr(rp, f"min_num_micro_batches_{phase}"),
            "pad_multiple": rp.pad_multiple,
            "vp_size": self.parallel.vpp or 1,
        }

    def dynamic_batching_shard_kwargs(self, dp_size: int, phase: str = "train") -> Dict[str, Any]:
        """Keyword arguments of :func:`seqpack.roll.dynamic_batching_shard`
        (``phase``: ``"train"`` or ``"infer"``)."""
        self._roll("dynamic_batching_shard_kwargs")
        rd = self.roll_dynamic_batching
        if phase not in ("train", "infer"):
            raise ConfigError(f"phase must be 'train' or 'infer', got {phase!r}")
        if not getattr(rd, phase):
            raise ConfigError(f"{self.role}.use_dynamic_batching_in_{phase}: dynamic batching is disabled")
        return {
            "dp_size": dp_size,
            "max_tokens_per_microbatch": getattr(rd, f"max_tokens_per_microbatch_in_{phase}"),
            "sequence_length_round": getattr(rd, f"sequence_length_round_in_{phase}"),
            "pipeline_model_parallel_size": self.parallel.pp,
            "virtual_pipeline_model_parallel_size": self.parallel.vpp,
        }


def _phase_tokens(section, phase: str, path: str) -> int:
    if phase not in PHASES:
        raise ConfigError(f"phase must be one of {PHASES}, got {phase!r}")
    value = getattr(section, f"{phase}_mb_tokens")
    if value is None:
        raise ConfigError(f"{path}.{phase}_mb_tokens: required for the {phase} phase")
    return value


# ---------------------------------------------------------------- reading values


class _Reader:
    """Typed access to a nested mapping that names the key path in every error."""

    def __init__(self, data: Mapping[str, Any], path: str):
        if not isinstance(data, Mapping):
            raise ConfigError(f"{path}: must be a mapping, got {type(data).__name__}")
        self.data, self.path = data, path

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def section(self, name: str) -> "_Reader":
        value = self.data.get(name)
        return _Reader({} if value is None else value, self.key(name))

    def only(self, allowed) -> "_Reader":
        """A section seqpack owns: any other key is a typo, named with a did-you-mean."""
        for key in self.data:
            if key not in allowed:
                raise ConfigError(f"{self.key(key)}: unknown key{_did_you_mean(key, allowed)} "
                                  f"(known: {', '.join(sorted(allowed))})")
        return self

    def no_lookalike(self, sections) -> None:
        """A key of this mapping that is close to, but not, one of ``sections`` is a
        misspelled section (which would otherwise silently turn its feature off)."""
        for key in self.data:
            if key not in sections and _did_you_mean(key, sections, cutoff=0.85):
                raise ConfigError(f"{self.key(key)}: unknown section{_did_you_mean(key, sections, cutoff=0.85)}")

    def bool(self, name: str, default: bool = False) -> bool:
        value = self.data.get(name, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ConfigError(f"{self.key(name)}: must be true or false, got {value!r}")
        return value

    def int(self, name: str, default: Optional[int] = None, minimum: int = 1) -> Optional[int]:
        value = self.data.get(name, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{self.key(name)}: must be an integer, got {value!r}")
        if value < minimum:
            raise ConfigError(f"{self.key(name)}: must be >= {minimum}, got {value}")
        return value

    def choice(self, name: str, options, default: str) -> str:
        value = self.data.get(name, default)
        if value is None:
            return default
        if not isinstance(value, str) or value.strip().lower() not in options:
            raise ConfigError(f"{self.key(name)}: must be one of {list(options)}, got {value!r}")
        return value.strip().lower()


def _did_you_mean(key: Any, options, cutoff: float = 0.6) -> str:
    import difflib

    close = difflib.get_close_matches(str(key), list(options), n=1, cutoff=cutoff)
    return f"; did you mean {close[0]!r}?" if close else ""


# The keys seqpack reads in the sections it owns.
NEMO_RL_SEQUENCE_PACKING_KEYS = ("enabled", "train_mb_tokens", "logprob_mb_tokens", "algorithm",
                                 "sequence_length_round", "microbatch_order")
NEMO_RL_DYNAMIC_BATCHING_KEYS = ("enabled", "train_mb_tokens", "logprob_mb_tokens", "sequence_length_round")
ROLL_SEQUENCE_PACKING_KEYS = ("algorithm", "max_packed_sequence_length_train", "max_packed_sequence_length_forward",
                              "min_num_micro_batches_train", "min_num_micro_batches_forward")


def _packing_algorithm(r: _Reader, name: str) -> str:
    options = tuple(a.value for a in PackingAlgorithm)
    return r.choice(name, options, "modified_first_fit_decreasing")


# ---------------------------------------------------------------- NeMo-RL


def _load_nemo_rl(data: Mapping[str, Any]) -> SeqpackConfig:
    policy = _Reader(data.get("policy"), "policy")
    megatron, dtensor = policy.section("megatron_cfg"), policy.section("dtensor_cfg")
    use_megatron, use_dtensor = megatron.bool("enabled"), dtensor.bool("enabled")
    if use_megatron and use_dtensor:
        raise ConfigError("policy.megatron_cfg.enabled: configure either Megatron or DTensor, not both")
    if use_dtensor:
        parallel = ParallelConfig(tp=dtensor.int("tensor_parallel_size", 1), cp=dtensor.int("context_parallel_size", 1),
                                  sequence_parallel=dtensor.bool("sequence_parallel"), backend="dtensor")
    else:
        parallel = ParallelConfig(
            tp=megatron.int("tensor_model_parallel_size", 1), cp=megatron.int("context_parallel_size", 1),
            pp=megatron.int("pipeline_model_parallel_size", 1), sequence_parallel=megatron.bool("sequence_parallel"),
            backend="megatron")
    max_seqlen = policy.int("max_total_sequence_length")

    policy.no_lookalike(("sequence_packing", "dynamic_batching"))
    sp_r = policy.section("sequence_packing").only(NEMO_RL_SEQUENCE_PACKING_KEYS)
    db_r = policy.section("dynamic_batching").only(NEMO_RL_DYNAMIC_BATCHING_KEYS)
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
    if parallel.cp > 1 and use_dtensor and sp_on:
        raise ConfigError("policy.dtensor_cfg.context_parallel_size: the DTensor backend cannot pack sequences "
                          "with context parallelism; disable policy.sequence_packing")

    # Pad multiple: make_sequence_length_divisible_by when given (NeMo-RL's newer
    # rule, checked against the minimum Megatron needs), else the older formula.
    minimum = alignment(parallel.cp, parallel.tp, parallel.sequence_parallel)
    divisible_by = policy.int("make_sequence_length_divisible_by")
    if divisible_by is None:
        pad_multiple = alignment(parallel.cp, parallel.tp, rule="roll")
    else:
        if divisible_by % minimum:
            raise ConfigError(f"policy.make_sequence_length_divisible_by: must be a multiple of {minimum} "
                              f"(2*CP with CP > 1, times TP with sequence parallelism), got {divisible_by}")
        pad_multiple = divisible_by

    def caps(r: _Reader, on: bool, multiple: int):
        train = r.int("train_mb_tokens")
        logprob = r.int("logprob_mb_tokens")
        if on and train is None:
            raise ConfigError(f"{r.key('train_mb_tokens')}: required when {r.key('enabled')} is true")
        if on and max_seqlen is not None:
            longest = round_up(max_seqlen, multiple)
            for name, value in (("train_mb_tokens", train), ("logprob_mb_tokens", logprob)):
                if value is not None and value < longest:
                    raise ConfigError(f"{r.key(name)}: {value} is below the longest (padded) sequence, "
                                      f"policy.max_total_sequence_length = {max_seqlen} -> {longest}")
        return train, logprob

    train, logprob = caps(sp_r, sp_on, pad_multiple)
    sequence_packing = SequencePackingConfig(
        enabled=sp_on, train_mb_tokens=train, logprob_mb_tokens=logprob,
        algorithm=_packing_algorithm(sp_r, "algorithm"),
        microbatch_order=sp_r.choice("microbatch_order", MICROBATCH_ORDERS, "packer"),
        sequence_length_pad_multiple=pad_multiple)
    round_to = db_r.int("sequence_length_round", 64)
    if db_on and round_to % (parallel.tp * parallel.cp):
        raise ConfigError(f"policy.dynamic_batching.sequence_length_round: must be divisible by TP*CP = "
                          f"{parallel.tp * parallel.cp}, got {round_to}")
    train, logprob = caps(db_r, db_on, round_to)
    dynamic_batching = DynamicBatchingConfig(enabled=db_on, train_mb_tokens=train, logprob_mb_tokens=logprob,
                                             sequence_length_round=round_to)
    return SeqpackConfig(schema="nemo_rl", parallel=parallel, max_seqlen=max_seqlen,
                         global_batch_size=policy.int("train_global_batch_size"),
                         sequence_packing=sequence_packing, dynamic_batching=dynamic_batching, raw=dict(data))


# ---------------------------------------------------------------- ROLL


def _load_roll(data: Mapping[str, Any], role: str) -> SeqpackConfig:
    if role not in data:
        raise ConfigError(f"{role}: no such worker role in the config (roles: {sorted(data)})")
    worker = _Reader(data[role], role)
    strategy = worker.section("strategy_args")
    strategy_name = strategy.data.get("strategy_name")
    if strategy_name is None:
        strategy_name = "megatron_train"
    elif not isinstance(strategy_name, str) or not strategy_name.strip():
        raise ConfigError(f"{strategy.key('strategy_name')}: must be a non-empty string, got {strategy_name!r}")
    sc = strategy.section("strategy_config")
    parallel = ParallelConfig(
        tp=sc.int("tensor_model_parallel_size", 1), cp=sc.int("context_parallel_size", 1),
        pp=sc.int("pipeline_model_parallel_size", 1), vpp=sc.int("virtual_pipeline_model_parallel_size"),
        sequence_parallel=sc.bool("sequence_parallel"), backend=str(strategy_name))
    sequence_length = _Reader(data, "").int("sequence_length")
    if sequence_length is None:
        top = _Reader(data, "")
        prompt, response = top.int("prompt_length"), top.int("response_length")
        if prompt is not None and response is not None:
            sequence_length = prompt + response

    packing_on = worker.bool("use_sequence_packing")
    train_on, infer_on = worker.bool("use_dynamic_batching_in_train"), worker.bool("use_dynamic_batching_in_infer")
    if packing_on and (train_on or infer_on):
        raise ConfigError(f"{role}.use_sequence_packing: sequence packing and dynamic batching "
                          f"({role}.use_dynamic_batching_in_{'train' if train_on else 'infer'}) are exclusive")
    if packing_on and "megatron" not in str(strategy_name):
        raise ConfigError(f"{role}.use_sequence_packing: ROLL packs sequences with Megatron strategies only, "
                          f"got strategy_args.strategy_name = {strategy_name!r}")

    worker.no_lookalike(("sequence_packing_args", "use_sequence_packing"))
    args = worker.section("sequence_packing_args").only(ROLL_SEQUENCE_PACKING_KEYS)
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
        pad_multiple=pad_multiple)

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
                         roll_dynamic_batching=roll_dynamic, role=role, raw=dict(data))


# ---------------------------------------------------------------- entry point


def _resolve(data: Any) -> Any:
    """Plain containers, with OmegaConf interpolations resolved when present."""
    try:
        from omegaconf import DictConfig, OmegaConf
    except ImportError:
        DictConfig = None
    if DictConfig is not None and isinstance(data, DictConfig):
        return OmegaConf.to_container(data, resolve=True)
    if _has_interpolation(data):
        if DictConfig is None:
            raise ConfigError("the config uses ${...} interpolations; install omegaconf to resolve them, "
                              "or give literal values")
        if not OmegaConf.has_resolver("mul"):  # NeMo-RL's resolver
            OmegaConf.register_new_resolver("mul", lambda a, b: a * b)
        return OmegaConf.to_container(OmegaConf.create(data), resolve=True)
    return data


def _check_depth(data: Any) -> None:
    """Refuse containers nested deeper than :data:`MAX_DEPTH` (OmegaConf, ``==`` and
    ``repr`` recurse, and would raise ``RecursionError``). Iterative; a container is
    expanded again only when reached deeper than before, so nodes shared through
    YAML aliases cost at most ``MAX_DEPTH`` visits, and a self-referencing one counts
    as too deep."""
    best: Dict[int, int] = {}
    stack = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, (Mapping, list, tuple)) or best.get(id(node), 0) >= depth:
            continue
        if depth > MAX_DEPTH:
            raise ConfigError(f"the config is nested deeper than {MAX_DEPTH} levels")
        best[id(node)] = depth
        stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, Mapping) else node))


@functools.lru_cache(maxsize=1)
def _yaml_loader():
    """PyYAML's safe loader with the nesting limit applied while composing (its
    composer recurses once per level)."""
    import yaml

    class Loader(yaml.SafeLoader):
        depth = 0

        def compose_node(self, parent, index):
            self.depth += 1
            try:
                if self.depth > MAX_DEPTH:
                    raise ConfigError(f"the config is nested deeper than {MAX_DEPTH} levels "
                                      f"(line {self.peek_event().start_mark.line + 1})")
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

    return Loader


def _read_source(source: Union[str, os.PathLike]) -> Any:
    """The data of a YAML file or string. A string that looks like a path (no line
    break nor ``": "``, and a path separator or a ``.yaml``/``.yml``/``.json``
    ending) names a file: a missing one is a ``FileNotFoundError``, not YAML text."""
    import yaml

    text = str(source)
    looks_like_path = "\n" not in text and ": " not in text and (
        "/" in text or os.sep in text or text.strip().lower().endswith((".yaml", ".yml", ".json")))
    if isinstance(source, os.PathLike) or looks_like_path or (os.path.exists(text) and "\n" not in text):
        if not os.path.exists(text):
            raise FileNotFoundError(f"no such config file: {text!r}")
        with open(text, encoding="utf-8") as f:
            text = f.read()
    try:
        return yaml.load(text, Loader=_yaml_loader())
    except yaml.YAMLError as exc:
        raise ConfigError(f"the YAML does not parse: {exc}") from exc


def _has_interpolation(data: Any) -> bool:
    """Whether any string holds ``${``. Each container is visited once: YAML aliases
    share nodes, and a "billion laughs" document of nested aliases would otherwise
    take exponential time to walk."""
    seen, stack = set(), [data]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            if "${" in node:
                return True
        elif isinstance(node, (Mapping, list, tuple)):
            if id(node) in seen:
                continue
            seen.add(id(node))
            stack.extend(node.values() if isinstance(node, Mapping) else node)
    return False


def load(source: Union[str, os.PathLike, Mapping[str, Any]], *, schema: Optional[str] = None,
         role: str = "actor_train") -> SeqpackConfig:
    """Read and validate a config.

    Args:
        source: a path to a YAML file, a YAML string, or a mapping (an OmegaConf
            ``DictConfig`` too).
        schema: ``"nemo_rl"`` or ``"roll"``; by default a top-level ``policy`` key
            means NeMo-RL and anything else ROLL.
        role: the ROLL worker role to read (``actor_train``, ``actor_infer``,
            ``reference``, ``critic``...).

    Raises:
        ConfigError: naming the key path and the rule broken (a ``ValueError``);
            also for a config nested deeper than :data:`MAX_DEPTH` levels.
        FileNotFoundError: ``source`` is a path (or a string that looks like one,
            e.g. ending in ``.yaml``) and no such file exists.
    """
    data = _read_source(source) if isinstance(source, (str, os.PathLike)) else source
    _check_depth(data)
    data = _resolve(data)
    if not isinstance(data, Mapping):
        raise ConfigError(f"the config must be a mapping at the top level, got {type(data).__name__}")
    if schema is None:
        schema = "nemo_rl" if "policy" in data else "roll"
    if schema == "nemo_rl":
        return _load_nemo_rl(data)
    if schema == "roll":
        return _load_roll(data, role)
    raise ConfigError(f"schema must be 'nemo_rl' or 'roll', got {schema!r}")
