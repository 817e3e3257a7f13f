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

Interpolations (``${policy.x}``, NeMo-RL's ``${mul:a,b}``, verl's
``${oc.select:key,default}``) are resolved by OmegaConf, each value once; one that
does not resolve is an error only where seqpack reads it.
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import Any, Mapping, Optional, Sequence, Union

# Re-exported: every public name of the single module this package replaces.
from ..._lengths import INT64_MAX, as_int  # noqa: F401
from ...planning.packing import PackingAlgorithm  # noqa: F401
from ...tensors.layout import alignment, round_up  # noqa: F401
from . import _loader, _nemo_rl, _resolve, _roll, _verl
from ._nemo_rl import NEMO_RL_DYNAMIC_BATCHING_KEYS, NEMO_RL_FRAMEWORK_KEYS, NEMO_RL_SEQUENCE_PACKING_KEYS
from ._resolve import INTERPOLATION_BUDGET
from ._roll import ROLL_SEQUENCE_PACKING_KEYS
from ._types import (MAX_DEPTH, MICROBATCH_ORDERS, PHASES, ROLL_ALGORITHMS, SCHEMAS, VERL_ROLES, ConfigError,
                     DynamicBatchingConfig, ParallelConfig, RollDynamicBatchingConfig, RollPackingConfig,
                     SeqpackConfig, SequencePackingConfig, VerlConfig, VerlMicroBatching)
from ._verl import (VERL_ACTOR_KEYS, VERL_ARR_SECTIONS, VERL_CRITIC_KEYS, VERL_DATA_KEYS,
                    VERL_DEFAULT_CRITIC_MAX_TOKEN_LEN, VERL_DEFAULT_MAX_TOKEN_LEN, VERL_KNOWN_NEIGHBOURS,
                    VERL_LOG_PROB_KEYS, VERL_MEGATRON_KEYS, VERL_MICRO_KEYS, VERL_REF_KEYS, VERL_ROLLOUT_KEYS,
                    VERL_TOP_SECTIONS)

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

# The public classes keep the module path they had before the package was split, so
# pickles and reprs name ``seqpack.frameworks.config.X`` whichever module defines X.
for _cls in (ConfigError, DynamicBatchingConfig, ParallelConfig, RollDynamicBatchingConfig, RollPackingConfig,
             SeqpackConfig, SequencePackingConfig, VerlConfig, VerlMicroBatching):
    _cls.__module__ = __name__
del _cls

# OmegaConf's resolvers are process-wide: a load registers NeMo-RL's for its own
# duration, one load at a time.
_LOCK = threading.RLock()


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
            and anything else ROLL.
        role: the ROLL worker role to read (``actor_train``, ``sft_train``,
            ``actor_infer``, ``reference``, ``critic``...). A verl config holds every
            role (:meth:`SeqpackConfig.micro_batching`).
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
            longest sequence), and for values seqpack does not read that do not
            resolve.
    """
    if schema is not None and schema not in SCHEMAS:
        raise ConfigError(f"schema must be one of {list(SCHEMAS)}, got {schema!r}")
    overrides = _loader.check_overrides(overrides)
    notes: list = []
    with _LOCK:
        added = _resolve.register_resolvers()
        try:
            cfg = _loader.compose(source, overrides, notes)
            resolution = _resolve.Resolution(cfg).run()
        finally:
            _resolve.unregister(added)
    for message in notes:  # about the composition: given even if the config is then refused
        warnings.warn(message, UserWarning, stacklevel=2)
    data = resolution.plain
    _resolve.check_depth(data)
    if schema is None:
        schema = "nemo_rl" if "policy" in data else "verl" if "actor_rollout_ref" in data else "roll"
    ctx = _loader.Context(resolution)
    if schema == "nemo_rl":
        result = _nemo_rl.load_nemo_rl(ctx, data)
    elif schema == "roll":
        result = _roll.load_roll(ctx, data, role)
    else:
        result = _verl.load_verl(ctx, data)
    unresolved = ctx.unresolved()
    for message in ctx.notes + ([unresolved] if unresolved else []):
        warnings.warn(message, UserWarning, stacklevel=2)
    return result
