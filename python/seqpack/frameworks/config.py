"""Sequence-packing / dynamic-batching configuration in NeMo-RL's, ROLL's and verl's schemas.

:func:`load` reads a YAML file, a YAML string or a mapping written for one of these
frameworks, validates it, and returns a typed :class:`SeqpackConfig` whose methods
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

verl (``actor_rollout_ref.*``, ``critic``, ``data``, ``trainer``; the composed config)::

    data: {max_prompt_length: 1024, max_response_length: 3072, train_batch_size: 512}
    actor_rollout_ref:
      model: {use_remove_padding: true}
      actor: {strategy: fsdp, ppo_mini_batch_size: 128, use_dynamic_bsz: true,
              ppo_max_token_len_per_gpu: 16384, ulysses_sequence_parallel_size: 2}
      ref: {log_prob_max_token_len_per_gpu: 32768}
      rollout: {n: 8, log_prob_max_token_len_per_gpu: 32768}
    trainer: {balance_batch: true}

Example:
    >>> cfg = load({"policy": {"sequence_packing": {"enabled": True, "train_mb_tokens": 4096,
    ...     "algorithm": "modified_first_fit_decreasing"}, "dynamic_batching": {"enabled": False}}})
    >>> cfg.sequence_packing_args("train")["max_tokens_per_microbatch"]
    4096

YAML interpolations (``${policy.x}``, NeMo-RL's ``${mul:a,b}``, verl's
``${oc.select:key,default}``) are resolved with OmegaConf when it is installed
(NeMo-RL and verl install it); a mapping that is already an OmegaConf ``DictConfig``
is resolved the same way. Without OmegaConf, seqpack resolves ``${a.b}``, relative
``${.a}`` / ``${..a}`` and ``${oc.select:a.b,default}`` itself; a value that needs
another resolver is an error only if seqpack reads it.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Union

from .._lengths import INT64_MAX, as_int
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
    "VerlConfig",
    "VerlMicroBatching",
    "load",
]

MAX_DEPTH = 100  # nesting levels of a config; real ones have fewer than 10
MICROBATCH_ORDERS = ("packer", "largest_first")
ROLL_ALGORITHMS = ("none", "load_balance")
PHASES = ("train", "logprob")
SCHEMAS = ("nemo_rl", "roll", "verl")
# verl's micro-batching roles: the actor's update, the actor's log-prob recompute
# (configured under ``rollout``), the reference's log-probs, the critic's update and
# the critic's value forward.
VERL_ROLES = ("actor", "rollout", "ref", "critic", "critic_forward")
INTERPOLATION_BUDGET = 100_000  # containers and strings the fallback resolver may produce


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
    backend: str = "megatron"  # NeMo-RL: "megatron" | "dtensor"; ROLL: the strategy name; verl: actor.strategy
    ulysses: int = 1  # verl: the actor's Ulysses sequence-parallel size (FSDP strategies)


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
class VerlMicroBatching:
    """How one verl role splits its batch into micro-batches.

    Attributes:
        path: the section the keys live in (``actor_rollout_ref.actor``, ...).
        use_dynamic_bsz: micro-batches by a token cap (``use_dynamic_bsz`` /
            ``log_prob_use_dynamic_bsz``) instead of a fixed row count.
        max_token_len_per_gpu: the cap per GPU (``ppo_max_token_len_per_gpu``,
            ``log_prob_max_token_len_per_gpu``, ``forward_max_token_len_per_gpu``).
        micro_batch_size_per_gpu: the fixed row count per GPU when dynamic batching is off.
        micro_batch_size: the deprecated global row count (verl divides it by the
            data-parallel size).
        sp_size: the ranks that share one micro-batch: the Ulysses sequence-parallel
            size (FSDP strategies) or the context-parallel size (Megatron). verl caps a
            micro-batch at ``max_token_len_per_gpu * sp_size`` tokens.
        use_remove_padding: the micro-batch runs packed (THD, padding removed).
    """

    path: str
    use_dynamic_bsz: bool = False
    max_token_len_per_gpu: Optional[int] = None
    micro_batch_size_per_gpu: Optional[int] = None
    micro_batch_size: Optional[int] = None
    sp_size: int = 1
    use_remove_padding: bool = True

    @property
    def max_token_len(self) -> Optional[int]:
        """The cap verl gives ``rearrange_micro_batches``: per GPU times ``sp_size``."""
        return None if self.max_token_len_per_gpu is None else self.max_token_len_per_gpu * self.sp_size


@dataclass(frozen=True)
class VerlConfig:
    """verl's batch sizes and per-role micro-batching (see :data:`VERL_ROLES`).

    ``train_batch_size`` and ``ppo_mini_batch_size`` count prompts, as in verl: a step
    trains on ``train_batch_size * rollout_n`` sequences, a mini-batch holds
    ``ppo_mini_batch_size * rollout_n`` (:attr:`sequences_per_mini_batch`).
    """

    actor: VerlMicroBatching
    rollout: VerlMicroBatching
    ref: VerlMicroBatching
    critic: VerlMicroBatching
    critic_forward: VerlMicroBatching
    strategy: str = "fsdp"
    critic_strategy: str = "fsdp"
    train_batch_size: int = 1024
    ppo_mini_batch_size: int = 256
    critic_ppo_mini_batch_size: int = 256
    rollout_n: int = 1
    balance_batch: bool = True
    use_critic: bool = True
    max_prompt_length: int = 512
    max_response_length: int = 512

    @property
    def sequences_per_mini_batch(self) -> int:
        """Sequences in one actor mini-batch, over all data-parallel ranks."""
        return self.ppo_mini_batch_size * self.rollout_n

    def role(self, name: str) -> VerlMicroBatching:
        if name not in VERL_ROLES:
            raise ConfigError(f"role must be one of {VERL_ROLES}, got {name!r}")
        return getattr(self, name)


@dataclass(frozen=True)
class SeqpackConfig:
    """A validated configuration (one schema's sections are set, the others' are ``None``).

    Attributes:
        schema: ``"nemo_rl"``, ``"roll"`` or ``"verl"``.
        parallel: TP/CP/PP/VPP sizes and sequence parallelism (verl: the actor's,
            with its Ulysses size in ``ulysses``).
        max_seqlen: ``policy.max_total_sequence_length`` / ROLL's ``sequence_length`` /
            verl's ``data.max_prompt_length + data.max_response_length``.
        global_batch_size: NeMo-RL ``policy.train_global_batch_size`` (the chunk size
            of ``shard_by_batch_size`` when training); verl: the sequences of a step,
            ``data.train_batch_size * actor_rollout_ref.rollout.n``.
        verl: verl's batch sizes and per-role micro-batching.
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
    verl: Optional[VerlConfig] = None
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def to_dict(self) -> Dict[str, Any]:
        """This config in its framework's schema (normalised: defaults filled in,
        NeMo-RL's pad multiple as ``make_sequence_length_divisible_by``);
        ``load(cfg.to_dict()) == cfg``."""
        p = self.parallel
        if self.schema == "verl":
            return _verl_to_dict(self)
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


    # verl ---------------------------------------------------------------
    def _verl(self, what: str):
        if self.schema != "verl":
            raise ConfigError(f"{what} needs a verl config (actor_rollout_ref.*); this one is {self.schema}'s")

    def micro_batching(self, role: str = "actor") -> VerlMicroBatching:
        """verl's micro-batching of ``role`` (one of :data:`VERL_ROLES`)."""
        self._verl("micro_batching")
        return self.verl.role(role)

    def rearrange_kwargs(self, role: str = "actor") -> Dict[str, Any]:
        """Keyword arguments of :func:`seqpack.verl.rearrange_micro_batches` as verl
        passes them for ``role``: ``max_token_len`` = the per-GPU cap times the
        Ulysses (FSDP) or context-parallel (Megatron) size."""
        mb = self.micro_batching(role)
        if not mb.use_dynamic_bsz:
            key = "use_dynamic_bsz" if role in ("actor", "critic", "critic_forward") else "log_prob_use_dynamic_bsz"
            raise ConfigError(f"{mb.path}.{key}: dynamic batching is disabled")
        return {"max_token_len": mb.max_token_len}

    def balance_batch_kwargs(self, dp_size: int) -> Dict[str, Any]:
        """Keyword arguments of :func:`seqpack.verl.get_seqlen_balanced_partitions`
        (after ``seqlen_list``) for ``trainer.balance_batch``: one equal-size
        partition per data-parallel rank."""
        self._verl("balance_batch_kwargs")
        if not self.verl.balance_batch:
            raise ConfigError("trainer.balance_batch: batch balancing is disabled")
        try:
            dp_size = as_int(dp_size, "dp_size")  # NumPy and 0-d tensor integers too
        except TypeError:
            raise ConfigError(f"dp_size must be an integer >= 1, got {dp_size!r}") from None
        if not 1 <= dp_size <= INT64_MAX:
            raise ConfigError(f"dp_size must be an integer >= 1 (and fit in int64), got {dp_size!r}")
        return {"k_partitions": dp_size, "equal_size": True}


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
        _literal(data, path)
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

    def no_lookalike(self, sections, *, what: str = "section", known=()) -> "_Reader":
        """A key of this mapping that is close to, but not, one of ``sections`` is a
        misspelled section (which would otherwise silently turn its feature off).
        ``known``: the framework's own keys that are close to one (not typos)."""
        for key in self.data:
            if key not in sections and key not in known and _did_you_mean(key, sections, cutoff=0.85):
                raise ConfigError(f"{self.key(key)}: unknown {what}{_did_you_mean(key, sections, cutoff=0.85)}")
        return self

    def get(self, name: str, default: Any = None) -> Any:
        value = self.data.get(name, default)
        _literal(value, self.key(name))
        return value

    def text(self, name: str, default: str) -> str:
        value = self.get(name, default)
        if value is None:
            return default
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(f"{self.key(name)}: must be a non-empty string, got {value!r}")
        return value.strip()

    def bool(self, name: str, default: bool = False) -> bool:
        value = self.get(name, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ConfigError(f"{self.key(name)}: must be true or false, got {value!r}")
        return value

    def int(self, name: str, default: Optional[int] = None, minimum: int = 1) -> Optional[int]:
        value = self.get(name, default)
        if value is None:
            return None
        try:
            value = as_int(value, self.key(name))  # NumPy and 0-d tensor integers too
        except TypeError:
            raise ConfigError(f"{self.key(name)}: must be an integer, got {value!r}") from None
        if value < minimum:
            raise ConfigError(f"{self.key(name)}: must be >= {minimum}, got {value}")
        if value > INT64_MAX:
            raise ConfigError(f"{self.key(name)}: must fit in int64 (<= {INT64_MAX}), got {value}")
        return value

    def need(self, name: str, default: int) -> int:
        """An integer >= 1 that may be left out (``default``) but not set to null."""
        if name in self.data and self.data[name] is None:
            raise ConfigError(f"{self.key(name)}: must be an integer, got None")
        return self.int(name, default)

    def choice(self, name: str, options, default: str) -> str:
        value = self.get(name, default)
        if value is None:
            return default
        if not isinstance(value, str) or value.strip().lower() not in options:
            raise ConfigError(f"{self.key(name)}: must be one of {list(options)}, got {value!r}")
        return value.strip().lower()


def _literal(value: Any, path: str) -> None:
    """A value seqpack reads must not be an interpolation left unresolved (one that
    needs a resolver other than ``oc.select`` while OmegaConf is not installed)."""
    if isinstance(value, str) and "${" in value:
        raise ConfigError(f"{path}: cannot resolve the interpolation {value!r} without OmegaConf; "
                          "install omegaconf, or give a literal value")


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
    strategy_name = strategy.get("strategy_name")
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


# ---------------------------------------------------------------- verl

# The keys seqpack reads in each verl section (a key close to one of them is a typo,
# named with a did-you-mean), and verl's own keys that are close to one.
VERL_TOP_SECTIONS = ("actor_rollout_ref", "critic", "data", "trainer", "algorithm")
VERL_ARR_SECTIONS = ("actor", "ref", "rollout", "model")
VERL_MICRO_KEYS = ("ppo_mini_batch_size", "ppo_micro_batch_size", "ppo_micro_batch_size_per_gpu", "use_dynamic_bsz",
                   "ppo_max_token_len_per_gpu", "ulysses_sequence_parallel_size", "strategy")
VERL_ACTOR_KEYS = VERL_MICRO_KEYS + ("use_remove_padding", "fsdp_config", "megatron")
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


def _verl_sp(r: _Reader, strategy: str, engine: str, default_ulysses: int, default_cp: int):
    """``(sp_size, megatron parallel sizes or None)`` of one verl role.

    FSDP strategies: the role's ``ulysses_sequence_parallel_size`` when above 1 (verl
    copies it into the engine config), else the engine config's (``fsdp_config`` /
    the critic's ``fsdp``). Megatron: ``megatron.context_parallel_size``."""
    if strategy == "megatron":
        meg = r.section("megatron").no_lookalike(VERL_MEGATRON_KEYS, what="key")
        cp = meg.need("context_parallel_size", default_cp)
        return cp, meg
    top = r.need("ulysses_sequence_parallel_size", default_ulysses)
    eng = r.section(engine).no_lookalike(("ulysses_sequence_parallel_size",), what="key")
    inner = eng.need("ulysses_sequence_parallel_size", 1)
    if top > 1 and inner > 1 and top != inner:
        raise ConfigError(f"{r.key('ulysses_sequence_parallel_size')}: {top} disagrees with "
                          f"{eng.key('ulysses_sequence_parallel_size')} = {inner}")
    return (top if top > 1 else inner), None


def _load_verl(data: Mapping[str, Any]) -> SeqpackConfig:
    top = _Reader(data, "").no_lookalike(VERL_TOP_SECTIONS)
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
                                  sequence_parallel=meg.bool("sequence_parallel", True), backend=strategy)
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

    def role(r: _Reader, keys, defaults, sp: int, rmpad: bool, check: bool, exclusive: bool,
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
                      max_prompt_length=prompt, max_response_length=response)
    return SeqpackConfig(schema="verl", parallel=parallel, max_seqlen=longest,
                         global_batch_size=train_batch_size * rollout_n,
                         verl=verl, raw=dict(data))


def _verl_to_dict(cfg: SeqpackConfig) -> Dict[str, Any]:
    v, p = cfg.verl, cfg.parallel

    def keys(mb: VerlMicroBatching, prefix: str, names=("use_dynamic_bsz", "max_token_len_per_gpu",
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
    if v.strategy == "megatron":
        actor["megatron"].update(tensor_model_parallel_size=p.tp, pipeline_model_parallel_size=p.pp,
                                 virtual_pipeline_model_parallel_size=p.vpp, sequence_parallel=p.sequence_parallel)
    critic = sp({"strategy": v.critic_strategy, "enable": v.use_critic,
                 "ppo_mini_batch_size": v.critic_ppo_mini_batch_size,
                 "model": {"use_remove_padding": v.critic.use_remove_padding}, **keys(v.critic, "ppo_"),
                 **{k: val for k, val in keys(v.critic_forward, "forward_").items() if k != "use_dynamic_bsz"}},
                v.critic_strategy, v.critic.sp_size, "fsdp")
    return {
        "data": {"train_batch_size": v.train_batch_size, "max_prompt_length": v.max_prompt_length,
                 "max_response_length": v.max_response_length},
        "actor_rollout_ref": {
            "model": {"use_remove_padding": v.ref.use_remove_padding},
            "actor": actor,
            "ref": sp(keys(v.ref, "log_prob_", log_prob), v.strategy, v.ref.sp_size, "fsdp_config"),
            "rollout": {"n": v.rollout_n, **keys(v.rollout, "log_prob_", log_prob)},
        },
        "critic": critic,
        "trainer": {"balance_batch": v.balance_batch},
    }


# ---------------------------------------------------------------- entry point


class _Unsupported(Exception):
    """An interpolation the fallback resolver leaves for OmegaConf."""


def _interpolation_spans(text: str):
    """``(start, end)`` of each top-level ``${...}`` in ``text`` (nested braces and
    interpolations inside count); escaped or unbalanced ones are unsupported."""
    spans, i = [], 0
    while True:
        start = text.find("${", i)
        if start < 0:
            return spans
        if start and text[start - 1] == "\\":
            raise _Unsupported
        depth, j = 0, start + 1
        while j < len(text):
            if text[j] == "{":
                depth += 1
            elif text[j] == "}":
                depth -= 1
                if depth == 0:
                    break
            j += 1
        if depth:
            raise _Unsupported
        spans.append((start, j + 1))
        i = j + 1


def _split_args(text: str):
    """Split resolver arguments at the commas outside brackets, braces and quotes."""
    parts, depth, quote, start = [], 0, None, 0
    for i, ch in enumerate(text):
        if quote:
            if ch == quote and text[i - 1] != "\\":
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


class _Need(Exception):
    """Raised by :class:`_PlainResolver` while a value reads another that is not
    resolved yet: the resolver resolves that one first, then tries again."""

    def __init__(self, node: Any, path: tuple):
        super().__init__(path)
        self.node, self.path = node, path


class _PlainResolver:
    """Resolves ``${a.b}``, ``${.a}`` / ``${..a}`` (relative to the value's mapping)
    and ``${oc.select:key[,default]}`` without OmegaConf, like OmegaConf does: a
    string that is one interpolation takes the value's type, interpolations inside a
    longer string are formatted into it. Other resolvers (``${mul:...}``,
    ``${oc.env:...}``) are left as written; reading such a value is an error. A
    missing key or a cycle is an error naming the key, as with OmegaConf.

    Iterative: values wait on an explicit stack for the values they read, so a
    chain of references of any length resolves (Python's recursion limit does not
    apply); only the config's own nesting (at most :data:`MAX_DEPTH`) recurses.
    Subtrees without interpolations are shared, not copied; a subtree whose
    interpolations are all absolute is resolved once however many YAML aliases
    reach it, and :data:`INTERPOLATION_BUDGET` bounds the rest."""

    _RELATIVE = ("${.", ":.", ",.")

    def __init__(self, root: Any):
        self.root = root
        self.kinds: Dict[int, int] = {}      # id -> 0 no interpolation, 1 absolute only, 2 relative
        self.memo: Dict[int, Any] = {}       # id -> resolved (kind 1)
        self.at_path: Dict[tuple, Any] = {}  # resolved values by the path they are written at
        self.produced = 0

    def kind(self, node: Any) -> int:
        if isinstance(node, str):
            if "${" not in node:
                return 0
            return 2 if any(m in node for m in self._RELATIVE) else 1
        if not isinstance(node, (Mapping, list, tuple)):
            return 0
        key = id(node)
        if key not in self.kinds:
            self.kinds[key] = 0  # a self-reference (refused earlier by the depth check) adds nothing
            children = node.values() if isinstance(node, Mapping) else node
            self.kinds[key] = max((self.kind(c) for c in children), default=0)
        return self.kinds[key]

    def run(self) -> Any:
        """The whole config, resolved."""
        return self.resolve(self.root, ())

    def resolve(self, node: Any, path: tuple) -> Any:
        """The resolved value of ``node``, written at ``path``. A stack of values
        to resolve: a container first puts its children on it, a string that reads
        a value not resolved yet puts that one on it and is tried again once it is.
        A value read while it waits on the stack for others is a cycle."""
        if self.kind(node) == 0:
            return node
        stack = [(node, path, False)]  # (node, path, children queued)
        waiting = set()                # paths tried and waiting for others
        while stack:
            node_, path_, queued = stack[-1]
            if path_ in self.at_path:  # resolved meanwhile, for another reader
                stack.pop()
                continue
            waiting.add(path_)
            try:
                if isinstance(node_, str):
                    value = self.string(node_, path_)
                elif not queued and not (self.kind(node_) == 1 and id(node_) in self.memo):
                    stack[-1] = (node_, path_, True)
                    items = node_.items() if isinstance(node_, Mapping) else enumerate(node_)
                    for key, child in reversed(list(items)):
                        if self.kind(child) and path_ + (key,) not in self.at_path:
                            stack.append((child, path_ + (key,), False))
                    continue
                else:
                    value = self.container(node_, path_)
            except _Need as need:
                if need.path in waiting:
                    what = (f"the interpolation {node_!r} is part of a cycle" if isinstance(node_, str)
                            else "an interpolation in it refers to it (a cycle)")
                    raise ConfigError(f"{self.where(path_)}: {what}") from None
                stack.append((need.node, need.path, False))
                continue
            self.produced += 1
            if self.produced > INTERPOLATION_BUDGET:
                raise ConfigError(f"the config's interpolations expand to more than {INTERPOLATION_BUDGET} values "
                                  "(YAML aliases of interpolated sections)")
            self.at_path[path_] = value
            waiting.discard(path_)
            stack.pop()
        return self.at_path[path]

    def value(self, node: Any, path: tuple) -> Any:
        """The resolved value of ``node`` (written at ``path``), or :class:`_Need`."""
        if self.kind(node) == 0:
            return node
        if path in self.at_path:
            return self.at_path[path]
        if not isinstance(node, str) and self.kind(node) == 1 and id(node) in self.memo:
            return self.memo[id(node)]
        raise _Need(node, path)

    def container(self, node: Any, path: tuple) -> Any:
        """A container whose children are resolved (or :class:`_Need`)."""
        if self.kind(node) == 1 and id(node) in self.memo:
            return self.memo[id(node)]
        if isinstance(node, Mapping):
            out: Any = {k: self.value(v, path + (k,)) for k, v in node.items()}
        else:
            out = [self.value(v, path + (i,)) for i, v in enumerate(node)]
        if self.kind(node) == 1:
            self.memo[id(node)] = out
        return out

    def where(self, path: tuple) -> str:
        return ".".join(str(p) for p in path) or "the config"

    def string(self, text: str, path: tuple) -> Any:
        try:
            return self.interpolate(text, path)
        except _Unsupported:
            return text

    def interpolate(self, text: str, path: tuple) -> Any:
        spans = _interpolation_spans(text)
        if len(spans) == 1 and spans[0] == (0, len(text)):
            return self.expression(text[2:-1], text, path)
        out, last = [], 0
        for start, end in spans:
            value = self.expression(text[start + 2:end - 1], text, path)
            out.append(text[last:start] + str(value))
            last = end
        return "".join(out) + text[last:]

    def expression(self, inner: str, text: str, path: tuple) -> Any:
        inner = inner.strip()
        if inner.startswith("oc.select:"):
            args = _split_args(inner[len("oc.select:"):])
            if len(args) > 2:
                raise _Unsupported
            found, value = self.lookup(args[0].strip(), text, path)
            if found and value != "???":
                return value
            return self.literal(args[1], path) if len(args) == 2 else None
        if ":" in inner or "${" in inner or not inner:
            raise _Unsupported  # another resolver, or a computed key
        found, value = self.lookup(inner, text, path)
        if not found:
            raise ConfigError(f"{self.where(path)}: the interpolation {text!r} refers to a missing key {inner!r}")
        return value

    def literal(self, text: str, path: tuple) -> Any:
        text = text.strip()
        if "${" in text:
            return self.interpolate(text, path)
        if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
            return text[1:-1].replace("\\" + text[0], text[0])
        import yaml

        try:
            return yaml.safe_load(text) if text else ""
        except yaml.YAMLError:
            return text

    def lookup(self, key: str, text: str, path: tuple):
        """``(found, resolved value)`` of ``key`` seen from the value at ``path``
        (:class:`_Need` when that value, or a section on the way given by an
        interpolation, is not resolved yet)."""
        if key.startswith("."):
            dots = len(key) - len(key.lstrip("."))
            base = path[:-1]
            if dots - 1 > len(base):
                return False, None
            base = base[:len(base) - (dots - 1)]
            rest = key[dots:]
        else:
            base, rest = (), key
        parts = [p for p in rest.split(".")] if rest else []
        if any(not p for p in parts) or "[" in rest:
            raise _Unsupported
        node, where = self.root, ()
        for step in list(base) + parts:
            if isinstance(node, str):  # an interpolation that gives a section
                node = self.value(node, where)
            if isinstance(node, Mapping):
                if step in node:
                    key_ = step
                elif isinstance(step, str) and step.lstrip("-").isdigit() and int(step) in node:
                    key_ = int(step)
                else:
                    return False, None
            elif isinstance(node, list):
                try:
                    key_ = int(step)
                    node[key_]
                except (ValueError, IndexError):
                    return False, None
            else:
                return False, None
            node, where = node[key_], where + (key_,)
        return True, self.value(node, where)


def _resolve(data: Any) -> Any:
    """Plain containers, with interpolations resolved when present (by OmegaConf when
    it is installed, else by :class:`_PlainResolver`)."""
    try:
        from omegaconf import DictConfig, OmegaConf
    except ImportError:
        DictConfig = OmegaConf = None
    if DictConfig is not None and isinstance(data, DictConfig):
        return _omegaconf_container(OmegaConf, lambda: data)
    if not _has_interpolation(data):
        return data
    if OmegaConf is None:
        resolved = _PlainResolver(data).run()
        _check_depth(resolved)  # a reference copies a section into another
        return resolved
    if not OmegaConf.has_resolver("mul"):  # NeMo-RL's resolver
        OmegaConf.register_new_resolver("mul", lambda a, b: a * b)
    return _omegaconf_container(OmegaConf, lambda: OmegaConf.create(data))


class _RecursionInOmegaConf(ConfigError):
    """OmegaConf ran out of Python recursion (it follows references recursively)."""


def _omegaconf_container(OmegaConf, make) -> Any:
    """``OmegaConf.to_container(make(), resolve=True)``, its errors as
    :class:`ConfigError`. OmegaConf follows a chain of references recursively and
    runs out of Python's recursion limit after a few hundred links; then the
    references it shares with the fallback resolver (``${a.b}``, relative ones,
    ``oc.select``) are resolved first by :class:`_PlainResolver`, iteratively, and
    OmegaConf resolves the rest: a chain of any length resolves either way."""
    try:
        return _to_container(OmegaConf, make)
    except _RecursionInOmegaConf:
        raw = OmegaConf.to_container(make(), resolve=False)  # the values as written
        plain = _PlainResolver(raw).run()
        _check_depth(plain)
        return _to_container(OmegaConf, lambda: OmegaConf.create(plain))


def _to_container(OmegaConf, make) -> Any:
    try:
        return OmegaConf.to_container(make(), resolve=True)
    except ConfigError:
        raise
    except Exception as exc:  # omegaconf's own errors: a missing key, a cycle, an unknown resolver
        cause, seen = exc, 0
        while cause is not None and not isinstance(cause, RecursionError) and seen < 8:
            cause, seen = cause.__cause__ or cause.__context__, seen + 1
        kind = _RecursionInOmegaConf if isinstance(cause, RecursionError) else ConfigError
        raise kind(f"the config's interpolations do not resolve: {type(exc).__name__}: {exc}") from exc


def _check_depth(data: Any) -> None:
    """Refuse containers nested deeper than :data:`MAX_DEPTH` (OmegaConf, ``==`` and
    ``repr`` recurse, and would raise ``RecursionError``). Iterative; a container is
    expanded again only when reached deeper than before, so nodes shared through
    YAML aliases cost at most ``MAX_DEPTH`` visits, and a self-referencing one counts
    as too deep."""
    best: Dict[int, int] = {}
    stack: list = [(data, 1, None)]  # (node, depth, (key, parent's link) or None at the top)
    while stack:
        node, depth, link = stack.pop()
        if not isinstance(node, (Mapping, list, tuple)) or best.get(id(node), 0) >= depth:
            continue
        if depth > MAX_DEPTH:
            keys = []
            while link is not None:
                keys.append(str(link[0]))
                link = link[1]
            where = ".".join(reversed(keys))
            shown = where if len(where) <= 120 else where[:60] + " ... " + where[-55:]
            raise ConfigError(f"the config is nested deeper than {MAX_DEPTH} levels (at {shown}; a section "
                              "holding itself through a reference, or a chain of sections referring to the next)")
        best[id(node)] = depth
        items = node.items() if isinstance(node, Mapping) else enumerate(node)
        stack.extend((child, depth + 1, (key, link)) for key, child in items)


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
        schema: ``"nemo_rl"``, ``"roll"`` or ``"verl"``; by default a top-level
            ``policy`` key means NeMo-RL, a top-level ``actor_rollout_ref`` key verl,
            and anything else ROLL.
        role: the ROLL worker role to read (``actor_train``, ``actor_infer``,
            ``reference``, ``critic``...). A verl config holds every role
            (:meth:`SeqpackConfig.micro_batching`).

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
        schema = "nemo_rl" if "policy" in data else "verl" if "actor_rollout_ref" in data else "roll"
    if schema == "nemo_rl":
        return _load_nemo_rl(data)
    if schema == "roll":
        return _load_roll(data, role)
    if schema == "verl":
        return _load_verl(data)
    raise ConfigError(f"schema must be one of {list(SCHEMAS)}, got {schema!r}")
