"""Sequence-packing / dynamic-batching configuration in NeMo-RL's, ROLL's and verl's schemas.

:func:`load` reads a recipe (a YAML file, a YAML string, a mapping or an OmegaConf
``DictConfig``) written for one of these frameworks, composes it as the framework
does, validates the keys seqpack uses, and returns a typed :class:`SeqpackConfig`
whose methods produce the arguments seqpack's APIs take. Errors are
:class:`ConfigError` (a ``ValueError``) naming the key path and the rule broken; what
the framework ignores, and what seqpack corrects, is a ``UserWarning`` naming the key.
See docs/config.md.

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

verl's SFT trainer (``sft_trainer_engine.yaml``: ``data.*``, ``engine.*``; the role ``sft``)::

    data: {train_batch_size: 256, micro_batch_size_per_gpu: 4, max_token_len_per_gpu: 8192,
           use_dynamic_bsz: true, max_length: 1024}
    model: {use_remove_padding: true}
    engine: {strategy: fsdp, ulysses_sequence_parallel_size: 2}

Interpolations (``${policy.x}``, NeMo-RL's ``${mul:a,b}``, verl's
``${oc.select:key,default}``) are resolved by OmegaConf on demand: only the values
seqpack reads, each with the values it refers to. A value seqpack does not read is
never resolved (its resolvers never run; it never warns nor blocks); ``.raw`` holds
the config as written.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import threading
import warnings
from typing import Any, List, Mapping, Optional, Sequence, Union

from omegaconf import OmegaConf

# Re-exported: every public name of the single module this package replaces.
from ..._lengths import INT64_MAX, as_int  # noqa: F401
from ...planning.packing import PackingAlgorithm  # noqa: F401
from ...tensors.layout import alignment, round_up  # noqa: F401
from . import _loader, _nemo_rl, _resolve, _roll, _verl
from ._nemo_rl import NEMO_RL_DYNAMIC_BATCHING_KEYS, NEMO_RL_FRAMEWORK_KEYS, NEMO_RL_SEQUENCE_PACKING_KEYS
from ._resolve import INTERPOLATION_BUDGET
from ._roll import ROLL_DEFAULT_STRATEGY, ROLL_SEQUENCE_PACKING_KEYS
from ._types import (MAX_DEPTH, MICROBATCH_ORDERS, PHASES, ROLL_ALGORITHMS, SCHEMAS, VERL_ROLES, VERL_SFT_ROLES,
                     ConfigError,
                     DynamicBatchingConfig, ParallelConfig, RollDynamicBatchingConfig, RollPackingConfig,
                     SeqpackConfig, SequencePackingConfig, StreamConfig, VerlConfig, VerlMicroBatching)
from ._verl import (VERL_ACTOR_KEYS, VERL_ARR_SECTIONS, VERL_CRITIC_KEYS, VERL_DATA_KEYS,
                    VERL_DEFAULT_CRITIC_MAX_TOKEN_LEN, VERL_DEFAULT_MAX_TOKEN_LEN, VERL_KNOWN_NEIGHBOURS,
                    VERL_LOG_PROB_KEYS, VERL_MEGATRON_KEYS, VERL_MICRO_KEYS, VERL_REF_KEYS, VERL_ROLLOUT_KEYS,
                    VERL_TOP_SECTIONS)
from ._verl_sft import VERL_SFT_DATA_KEYS, VERL_SFT_DEFAULTS, VERL_SFT_ENGINE_SP_KEYS

__all__ = [
    "ConfigError",
    "DynamicBatchingConfig",
    "ParallelConfig",
    "RollDynamicBatchingConfig",
    "RollPackingConfig",
    "SeqpackConfig",
    "SequencePackingConfig",
    "StreamConfig",
    "VerlConfig",
    "VerlMicroBatching",
    "example",
    "examples",
    "load",
]

# The public classes keep the module path they had before the package was split, so
# pickles and reprs name ``seqpack.frameworks.config.X`` whichever module defines X.
for _cls in (ConfigError, DynamicBatchingConfig, ParallelConfig, RollDynamicBatchingConfig, RollPackingConfig,
             SeqpackConfig, SequencePackingConfig, StreamConfig, VerlConfig, VerlMicroBatching):
    _cls.__module__ = __name__
del _cls

# OmegaConf's resolvers are process-wide: a load registers NeMo-RL's for its own
# duration, one load at a time.
_LOCK = threading.RLock()


_EXAMPLES = pathlib.Path(__file__).resolve().parent / "examples"


def examples() -> List[str]:
    """The config examples shipped with seqpack (in every schema it reads), by name.

    >>> "verl_ppo.yaml" in examples()
    True
    """
    return sorted(p.name for p in _EXAMPLES.glob("*.yaml"))


def example(name: str) -> pathlib.Path:
    """The path of the config example ``name`` shipped with seqpack (installed with
    the package, so a docs section runs from any directory):
    ``config.load(config.example("verl_ppo.yaml"))``.

    Raises:
        ValueError: no such example (the message lists them).
    """
    path = _EXAMPLES / str(name)
    if str(name) not in examples():
        raise ValueError(f"no config example {name!r}; seqpack ships {examples()}")
    return path


def load(source: Union[str, os.PathLike, Mapping[str, Any]], *, schema: Optional[str] = None,
         role: str = "actor_train", overrides: Optional[Sequence[str]] = None) -> SeqpackConfig:
    """Read, compose and validate a config.

    Args:
        source: a path to a YAML recipe, a YAML string, or a mapping (an OmegaConf
            ``DictConfig`` too). A path is composed as its framework composes it:
            NeMo-RL's ``defaults:`` inheritance, or a Hydra defaults list (verl, ROLL;
            needs ``hydra-core``).
        schema: ``"nemo_rl"``, ``"roll"`` or ``"verl"``; by default a top-level
            ``policy`` key means NeMo-RL, a top-level ``actor_rollout_ref`` key verl,
            verl's SFT trainer keys (``data.use_dynamic_bsz`` /
            ``data.max_token_len_per_gpu`` / ``data.micro_batch_size_per_gpu``, or an
            ``engine`` section) without a section named ``role`` verl's SFT trainer,
            and anything else ROLL.
        role: the ROLL worker role to read (``actor_train``, ``sft_train``,
            ``actor_infer``, ``reference``, ``critic``...). A verl config holds every
            role (:meth:`SeqpackConfig.micro_batching`: the PPO trainer's
            :data:`VERL_ROLES`, the SFT trainer's ``"sft"``).
        overrides: Hydra-style overrides (``["policy.max_total_sequence_length=8192",
            "+policy.new_key=1", "~policy.key"]``) applied as the framework's launcher
            applies them (needs ``hydra-core``).

    Raises:
        ConfigError: naming the key path and the rule broken (a ``ValueError``);
            also for a config nested deeper than :data:`MAX_DEPTH` levels.
        FileNotFoundError: ``source`` is a path (or a string that looks like one,
            e.g. ending in ``.yaml``) and no such file exists.

    Warns:
        UserWarning: naming the key, for what the framework ignores (an unknown key
            in a section seqpack reads, a value in a switched-off section) and what
            seqpack corrects or only the run can tell (a pad multiple, a cap below the
            longest sequence). A value seqpack does not read is never resolved, so
            never warns.
    """
    if schema is not None and schema not in SCHEMAS:
        raise ConfigError(f"schema must be one of {list(SCHEMAS)}, got {schema!r}")
    overrides = _loader.check_overrides(overrides)
    notes: list = []
    with _LOCK:
        added = _resolve.register_resolvers()
        try:
            cfg = _loader.compose(source, overrides, notes)
            for message in notes:  # about the composition: given even if the config is then refused
                warnings.warn(message, UserWarning, stacklevel=2)
            written = OmegaConf.to_container(cfg, resolve=False)
            _resolve.check_depth(written)
            # Values are resolved as seqpack reads them (with what they refer to), in a
            # working copy; .raw keeps the config as written.
            ctx = _loader.Context(_resolve.Resolution(cfg, _resolve.copy_plain(written)))
            data = ctx.res.plain
            if schema is None:
                schema = _detect(data, role)
            if schema == "nemo_rl":
                result = _nemo_rl.load_nemo_rl(ctx, data)
            elif schema == "roll":
                result = _roll.load_roll(ctx, data, role)
            else:
                result = _verl.load_verl(ctx, data)
        finally:
            _resolve.unregister(added)
    for message in ctx.notes:
        warnings.warn(message, UserWarning, stacklevel=2)
    if result.prefix_reuse_training:  # options a tree's passes cannot honour (a stream's order, shapes): named now
        result.step_options()
    return dataclasses.replace(result, raw=written)


def _detect(data: Mapping[str, Any], role: str) -> str:
    """The schema of a config by its top-level keys: ``policy`` -> NeMo-RL,
    ``actor_rollout_ref`` or ``async_training`` -> verl, verl's SFT trainer keys
    (:func:`_verl.is_sft`) -> verl, anything else ROLL."""
    if "policy" in data:
        return "nemo_rl"
    if "actor_rollout_ref" in data or "async_training" in data or (role not in data and _verl.is_sft(data)):
        return "verl"
    return "roll"
