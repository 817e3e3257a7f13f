"""The configuration types :func:`seqpack.config.load` returns, and their methods."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

from ..._lengths import INT64_MAX, as_int
from ._stream_types import StreamConfig, stream_to_dict

if TYPE_CHECKING:
    from ...planning.step_options import StepOptions

MAX_DEPTH = 100  # nesting levels of a config; real ones have fewer than 10
MICROBATCH_ORDERS = ("packer", "largest_first")
ROLL_ALGORITHMS = ("none", "load_balance")
PHASES = ("train", "logprob")
SCHEMAS = ("nemo_rl", "roll", "verl")
# verl's micro-batching roles: the actor's update, the actor's log-prob recompute
# (configured under ``rollout``), the reference's log-probs, the critic's update and
# the critic's value forward.
VERL_ROLES = ("actor", "rollout", "ref", "critic", "critic_forward")
# verl's SFT trainer (sft_trainer_engine.yaml): one role, its data.* micro-batching.
VERL_SFT_ROLES = ("sft",)


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
    # NeMo-RL: "megatron" | "dtensor"; ROLL: the strategy name (None: the worker has no
    # strategy_args); verl: actor.strategy (the SFT trainer: engine.strategy)
    backend: Optional[str] = "megatron"
    ulysses: int = 1  # verl: the actor's Ulysses sequence-parallel size (FSDP strategies)
    # Megatron-LM's dynamic (hybrid) CP: dynamic_context_parallel,
    # min_dynamic_context_parallel_size, max_seqlen_per_dp_cp_rank (config/_dynamic_cp.py).
    dynamic_cp: bool = False
    min_dynamic_cp: int = 1
    max_seqlen_per_rank: Optional[int] = None


@dataclass(frozen=True)
class SequencePackingConfig:
    """NeMo-RL ``policy.sequence_packing`` plus the pad multiple it implies,
    ``policy.shared_prefix_training`` (NeMo-RL PR #4008: training micro-batches as
    prefix trees) and seqpack's ``policy.shared_prefix_reuse`` (a tree larger than
    the cap in passes, each shared prefix once a step)."""

    enabled: bool = False
    train_mb_tokens: Optional[int] = None
    logprob_mb_tokens: Optional[int] = None
    algorithm: str = "modified_first_fit_decreasing"
    microbatch_order: str = "packer"
    sequence_length_pad_multiple: int = 1
    shared_prefix: bool = False
    prefix_reuse: bool = False


@dataclass(frozen=True)
class DynamicBatchingConfig:
    """NeMo-RL ``policy.dynamic_batching``."""

    enabled: bool = False
    train_mb_tokens: Optional[int] = None
    logprob_mb_tokens: Optional[int] = None
    sequence_length_round: int = 64


@dataclass(frozen=True)
class RollPackingConfig:
    """ROLL ``use_sequence_packing`` + ``sequence_packing_args`` (and seqpack's
    ``sequence_packing_args.shared_prefix``: training micro-batches as prefix trees;
    ``sequence_packing_args.prefix_reuse``: trees larger than the cap in passes)."""

    enabled: bool = False
    algorithm: str = "none"
    max_packed_sequence_length_train: Optional[int] = None
    max_packed_sequence_length_forward: Optional[int] = None
    min_num_micro_batches_train: int = 1
    min_num_micro_batches_forward: int = 1
    pad_multiple: int = 1
    shared_prefix: bool = False
    prefix_reuse: bool = False
    loss_agg_mode: Optional[str] = None  # the top-level key, read (and written back) with prefix_reuse


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
        shared_prefix: the actor's ``use_prefix_grouper`` (verl's switch for
            forwarding a prompt once for its responses), or seqpack's engine module
            in ``actor_rollout_ref.model.external_lib``: micro-batches planned as
            prefix trees (``rearrange_kwargs`` passes ``shared_prefix=True``).
        prefix_reuse: ``external_lib`` names
            ``seqpack.frameworks.verl.prefix_reuse_engine``: a tree larger than the
            cap runs in passes (``rearrange_kwargs`` passes ``prefix_reuse=True``).
        prefix_grouper: the actor's ``use_prefix_grouper`` itself (verl's own
            PrefixGrouper switch, written back by ``to_dict``).
    """

    path: str
    use_dynamic_bsz: bool = False
    max_token_len_per_gpu: Optional[int] = None
    micro_batch_size_per_gpu: Optional[int] = None
    micro_batch_size: Optional[int] = None
    sp_size: int = 1
    use_remove_padding: bool = True
    shared_prefix: bool = False
    prefix_reuse: bool = False
    prefix_grouper: bool = False

    @property
    def max_token_len(self) -> Optional[int]:
        """The cap verl gives ``rearrange_micro_batches``: per GPU times ``sp_size``."""
        return None if self.max_token_len_per_gpu is None else self.max_token_len_per_gpu * self.sp_size


@dataclass(frozen=True)
class VerlConfig:
    """verl's batch sizes and per-role micro-batching.

    ``trainer`` is ``"ppo"`` (``actor_rollout_ref.*``; the roles of :data:`VERL_ROLES`)
    or ``"sft"`` (the SFT trainer's ``data.*`` / ``engine.*``; the role ``sft``,
    :data:`VERL_SFT_ROLES`). A role, or a PPO batch size, that the trainer's config
    does not have is ``None``.

    ``train_batch_size`` and ``ppo_mini_batch_size`` count prompts, as in verl: a step
    trains on ``train_batch_size * rollout_n`` sequences, a mini-batch holds
    ``ppo_mini_batch_size * rollout_n`` (:attr:`sequences_per_mini_batch`). The SFT
    trainer's ``train_batch_size`` counts sequences.
    """

    actor: Optional[VerlMicroBatching] = None
    rollout: Optional[VerlMicroBatching] = None
    ref: Optional[VerlMicroBatching] = None
    critic: Optional[VerlMicroBatching] = None
    critic_forward: Optional[VerlMicroBatching] = None
    strategy: str = "fsdp"
    critic_strategy: Optional[str] = "fsdp"
    train_batch_size: int = 1024
    ppo_mini_batch_size: Optional[int] = 256
    critic_ppo_mini_batch_size: Optional[int] = 256
    rollout_n: Optional[int] = 1
    balance_batch: bool = True
    use_critic: bool = True
    max_prompt_length: Optional[int] = 512
    max_response_length: Optional[int] = 512
    trainer: str = "ppo"
    sft: Optional[VerlMicroBatching] = None
    external_lib: Optional[str] = None  # actor_rollout_ref.model.external_lib, written back by to_dict

    @property
    def roles(self) -> Tuple[str, ...]:
        """The roles this trainer's config holds."""
        return VERL_SFT_ROLES if self.trainer == "sft" else VERL_ROLES

    @property
    def sequences_per_mini_batch(self) -> int:
        """Sequences in one actor mini-batch, over all data-parallel ranks."""
        if self.trainer == "sft":
            raise ConfigError("sequences_per_mini_batch: verl's SFT trainer has no PPO mini-batches "
                              "(data.train_batch_size sequences a step)")
        return self.ppo_mini_batch_size * self.rollout_n

    def role(self, name: str) -> VerlMicroBatching:
        if name not in VERL_ROLES + VERL_SFT_ROLES:
            raise ConfigError(f"role must be one of {VERL_ROLES + VERL_SFT_ROLES}, got {name!r}")
        if name not in self.roles:
            kind = ("SFT trainer's (data.*, engine.*)" if self.trainer == "sft"
                    else "PPO trainer's (actor_rollout_ref.*)")
            raise ConfigError(f"role {name!r}: this is verl's {kind} config, whose roles are {list(self.roles)}")
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
    stream: Optional[StreamConfig] = None
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def to_dict(self) -> Dict[str, Any]:
        """This config in its framework's schema (normalised: defaults filled in,
        NeMo-RL's pad multiple as ``make_sequence_length_divisible_by``);
        ``load(cfg.to_dict()) == cfg``."""
        from ._to_dict import config_to_dict

        out = config_to_dict(self)
        if self.stream is not None:
            stream_to_dict(self.stream, out)
        return out

    # NeMo-RL ------------------------------------------------------------
    def _nemo(self, what: str):
        if self.schema != "nemo_rl":
            raise ConfigError(f"{what} needs a NeMo-RL config (policy.*); this one is {self.schema}'s")

    def sequence_packing_args(self, phase: str = "train") -> Dict[str, Any]:
        """NeMo-RL ``SequencePackingArgs`` for ``shard_by_batch_size`` (``phase``:
        ``"train"`` uses ``train_mb_tokens``, ``"logprob"`` ``logprob_mb_tokens``).
        With ``policy.shared_prefix_training`` the training phase's args also hold
        ``shared_prefix: True`` (bins planned on prefix trees; the log-prob phase stays
        dense, as in NeMo-RL PR #4008), and with ``policy.shared_prefix_reuse``
        ``prefix_reuse: True`` (trees larger than the cap in passes)."""
        self._nemo("sequence_packing_args")
        sp = self.sequence_packing
        if not sp.enabled:
            raise ConfigError("policy.sequence_packing.enabled: sequence packing is disabled")
        args = {
            "max_tokens_per_microbatch": _phase_tokens(sp, phase, "policy.sequence_packing"),
            "input_key": "input_ids",
            "input_lengths_key": "input_lengths",
            "algorithm": sp.algorithm,
            "sequence_length_pad_multiple": sp.sequence_length_pad_multiple,
            "microbatch_order": sp.microbatch_order,
        }
        if sp.shared_prefix and phase == "train":
            args["shared_prefix"] = True
            if sp.prefix_reuse:
                args["prefix_reuse"] = True
        return args

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

    # Any schema ---------------------------------------------------------
    @property
    def shared_prefix_training(self) -> bool:
        """Whether this config trains on prefix trees: NeMo-RL's
        ``policy.shared_prefix_training``, ROLL's
        ``sequence_packing_args.shared_prefix`` (with packing on), verl's actor
        ``use_prefix_grouper``."""
        if self.schema == "nemo_rl":
            return bool(self.sequence_packing is not None and self.sequence_packing.shared_prefix)
        if self.schema == "roll":
            return bool(self.roll_packing is not None and self.roll_packing.enabled and self.roll_packing.shared_prefix)
        if self.schema == "verl":
            return bool(self.verl is not None and self.verl.role("sft" if self.verl.trainer == "sft" else "actor"
                                                                  ).shared_prefix)
        return False

    @property
    def prefix_reuse_training(self) -> bool:
        """Whether this config runs prefix trees larger than the cap in passes
        (:attr:`shared_prefix_training` on, and NeMo-RL's
        ``policy.shared_prefix_reuse`` or verl's
        ``actor_rollout_ref.model.external_lib:
        seqpack.frameworks.verl.prefix_reuse_engine``, ROLL's
        ``sequence_packing_args.prefix_reuse``)."""
        if not self.shared_prefix_training:
            return False
        if self.schema == "nemo_rl":
            return self.sequence_packing.prefix_reuse
        if self.schema == "verl":
            return self.verl.role("sft" if self.verl.trainer == "sft" else "actor").prefix_reuse
        return self.roll_packing.prefix_reuse

    def step_options(self) -> "StepOptions":
        """The :class:`seqpack.StepOptions` every step of this config is planned
        with: its context parallelism (``cp_size``, ``hybrid_cp`` from Megatron's
        ``dynamic_context_parallel``, ``min_cp_degree``) and, with asynchronous
        training on, the stream section's ``micro_batch_order`` and
        ``static_shapes``, and the framework's shared-prefix training switch
        (:attr:`shared_prefix_training`) as ``shared_prefix`` and its prefix-reuse
        switch (:attr:`prefix_reuse_training`) as ``prefix_reuse``.
        :meth:`plan_step_kwargs` and :meth:`stream_planner_kwargs` both pass it as
        ``options`` (with ``shared_prefix``, ``plan_step`` then needs the batch's
        ``forest=``; a :class:`~seqpack.StreamPlanner` builds each step's)."""
        from ...planning.step_options import StepOptions

        p, st = self.parallel, self.stream
        order = {} if st is None or not st.enabled else dict(micro_batch_order=st.micro_batch_order,
                                                             static_shapes=st.static_shapes)
        try:
            return StepOptions(cp_size=p.cp, hybrid_cp=p.dynamic_cp, min_cp_degree=p.min_dynamic_cp,
                               shared_prefix=self.shared_prefix_training, prefix_reuse=self.prefix_reuse_training,
                               **order)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"the config's step options: {exc}") from None

    def plan_step_kwargs(self, dp_size: int) -> Dict[str, Any]:
        """Keyword arguments of :func:`seqpack.plan_step` for a training step of this
        config: ``dp_size``, ``max_tokens`` (a rank's tokens per micro-batch:
        ``max_seqlen_per_dp_cp_rank`` when set, else the framework's training cap,
        NeMo-RL's ``train_mb_tokens`` and ROLL's ``max_packed_sequence_length_train``
        (which count a micro-batch before its CP split) divided by the CP size,
        verl's ``ppo_max_token_len_per_gpu``) and ``options``, :meth:`step_options`."""
        try:
            dp_size = as_int(dp_size, "dp_size")
        except TypeError:
            raise ConfigError(f"dp_size must be an integer >= 1, got {dp_size!r}") from None
        if not 1 <= dp_size <= INT64_MAX:
            raise ConfigError(f"dp_size must be an integer >= 1 (and fit in int64), got {dp_size!r}")
        p = self.parallel
        cap, where_ = p.max_seqlen_per_rank, "max_seqlen_per_dp_cp_rank"
        if cap is None:
            if self.schema == "nemo_rl":
                cap, where_ = self.sequence_packing.train_mb_tokens, "policy.sequence_packing.train_mb_tokens"
                cap = None if cap is None else cap // p.cp
            elif self.schema == "roll":
                cap, where_ = self.roll_packing.max_packed_sequence_length_train, \
                    f"{self.role}.sequence_packing_args.max_packed_sequence_length_train"
                cap = None if cap is None else cap // p.cp
            else:
                cap, where_ = self.verl.role("sft" if self.verl.trainer == "sft" else "actor").max_token_len_per_gpu, \
                    "the actor's max_token_len_per_gpu"
        if not cap:
            raise ConfigError(f"{where_}: a rank's token cap is needed to plan the step (set "
                              "max_seqlen_per_dp_cp_rank in the Megatron section, or the framework's cap)")
        return {"dp_size": dp_size, "max_tokens": int(cap), "options": self.step_options()}

    def stream_planner_kwargs(self, dp_size: int) -> Dict[str, Any]:
        """Keyword arguments of :class:`seqpack.StreamPlanner` for this config's
        asynchronous mode: :meth:`plan_step_kwargs` (the same ``options``) plus
        ``step_tokens``, ``max_staleness`` and ``group_size`` (given once: ``add``
        then needs none)."""
        st = self.stream
        if st is None or not st.enabled:
            where_ = {"nemo_rl": "grpo.async_grpo.enabled", "verl": "async_training"}.get(self.schema, "the config")
            raise ConfigError(f"{where_}: asynchronous training is not configured; the stream planner plans its steps")
        if st.step_tokens is None:
            raise ConfigError(f"{st.path}.step_tokens: required to plan streamed steps (a step's token budget)")
        return {**self.plan_step_kwargs(dp_size), "step_tokens": st.step_tokens, "max_staleness": st.max_staleness,
                "group_size": st.group_size}

    # ROLL ---------------------------------------------------------------
    def _roll(self, what: str):
        if self.schema != "roll":
            raise ConfigError(f"{what} needs a ROLL config (a worker role); this one is {self.schema}'s")

    def load_balance_kwargs(self, phase: str = "train") -> Dict[str, Any]:
        """Keyword arguments of :func:`seqpack.roll.make_micro_batch_iter_for_sequence_packing`
        (``phase``: ``"train"`` or ``"forward"``, also given as ``is_train``; ``shared_prefix`` for training
        with ``sequence_packing_args.shared_prefix``, and ``prefix_reuse`` with
        ``sequence_packing_args.prefix_reuse``)."""
        self._roll("load_balance_kwargs")
        rp = self.roll_packing
        if not rp.enabled:
            raise ConfigError(f"{self.role}.use_sequence_packing: sequence packing is disabled")
        if phase not in ("train", "forward"):
            raise ConfigError(f"phase must be 'train' or 'forward', got {phase!r}")
        kwargs = {
            "algorithm": rp.algorithm,
            "max_packed_sequence_length": getattr(rp, f"max_packed_sequence_length_{phase}"),
            "min_num_micro_batches": getattr(rp, f"min_num_micro_batches_{phase}"),
            "pad_multiple": rp.pad_multiple,
            "vp_size": self.parallel.vpp or 1,
            "is_train": phase == "train",
        }
        if rp.shared_prefix and phase == "train":  # the forward (log-prob) pass stays dense
            kwargs["shared_prefix"] = True
            if rp.prefix_reuse:
                kwargs["prefix_reuse"] = True
        return kwargs

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
            key = "use_dynamic_bsz" if role in ("actor", "critic", "critic_forward", "sft") else \
                "log_prob_use_dynamic_bsz"
            raise ConfigError(f"{mb.path}.{key}: dynamic batching is disabled")
        if mb.shared_prefix:
            return {"max_token_len": mb.max_token_len, "shared_prefix": True,
                    **({"prefix_reuse": True} if mb.prefix_reuse else {})}
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
