"""Asynchronous training's keys: what :class:`~seqpack.StreamPlanner` takes, read
where each framework configures its asynchronous mode, by the framework's own names
where it has them.

NeMo-RL (async GRPO)::

    grpo:
      num_generations_per_prompt: 8                 # group_size
      async_grpo: {enabled: true, max_trajectory_age_steps: 2,     # max_staleness
                   step_tokens: 1048576, static_shapes: 8}         # seqpack's keys
    policy: {sequence_packing: {microbatch_order: largest_first}}  # NeMo-RL's order key

verl (fully-async recipe)::

    async_training: {staleness_threshold: 0.1, trigger_parameter_sync_step: 4,  # verl's
                     max_head_offpolicyness: 2,     # AReaL's name for max_staleness
                     step_tokens: 1048576, microbatch_order: largest_first, static_shapes: true}
    actor_rollout_ref: {rollout: {n: 8}}            # group_size

verl's ``staleness_threshold`` bounds how many stale samples its rollouter may
produce (a fraction of a step's), not a version lag: seqpack reads it and drops
nothing by it; ``max_head_offpolicyness`` (AReaL's key for the lag) does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

from ..._lengths import as_int
from ._loader import Reader
from ._stream_types import StreamConfig
from ._types import MICROBATCH_ORDERS, ConfigError

SEQPACK_KEYS = ("step_tokens", "static_shapes")
NEMO_RL_ASYNC_KEYS = ("enabled", "max_trajectory_age_steps") + SEQPACK_KEYS
NEMO_RL_ASYNC_FRAMEWORK_KEYS = ("in_flight_weight_updates", "recompute_kv_cache_after_weight_updates")
VERL_ASYNC_KEYS = ("max_head_offpolicyness", "microbatch_order", "staleness_threshold") + SEQPACK_KEYS
VERL_ASYNC_FRAMEWORK_KEYS = ("trigger_parameter_sync_step", "require_batches", "partial_rollout",
                             "use_rollout_log_probs", "compute_prox_log_prob")
_ORDER = {"packer": "planned", "largest_first": "largest_first"}


def _static_shapes(r: Reader) -> Any:
    value = r.get("static_shapes")
    if value is None or value is False:
        return None
    if value is True:
        return True
    if isinstance(value, Mapping):
        raise ConfigError(f"{r.key('static_shapes')}: must be true, a bucket count or a list of bucket sizes, "
                          f"got a mapping")
    if hasattr(value, "__iter__") and not isinstance(value, (str, bytes)):
        sizes = []
        for i, x in enumerate(list(value)):
            try:
                sizes.append(as_int(x, f"{r.key('static_shapes')}[{i}]"))
            except TypeError:
                raise ConfigError(f"{r.key('static_shapes')}[{i}]: must be an integer, got {x!r}") from None
            if sizes[-1] < 1:
                raise ConfigError(f"{r.key('static_shapes')}[{i}]: must be >= 1, got {sizes[-1]}")
        if not sizes:
            raise ConfigError(f"{r.key('static_shapes')}: must hold at least one bucket size")
        return tuple(sizes)
    return r.int("static_shapes")


def read_nemo_rl_async(top: Reader, microbatch_order: str) -> Optional[StreamConfig]:
    """``grpo.async_grpo`` (``None`` without it)."""
    grpo = top.section("grpo")
    grpo.no_lookalike(("async_grpo",))
    if "async_grpo" not in grpo.data:
        return None
    r = grpo.section("async_grpo").known(NEMO_RL_ASYNC_KEYS, NEMO_RL_ASYNC_FRAMEWORK_KEYS, "NeMo-RL")
    on = r.bool("enabled")
    if not on:
        r = r.relaxed("grpo.async_grpo.enabled is false")
    return StreamConfig(path=r.path, enabled=on, max_staleness=r.int("max_trajectory_age_steps", minimum=0),
                        step_tokens=r.int("step_tokens"),
                        group_size=grpo.int("num_generations_per_prompt"),
                        micro_batch_order=_ORDER[microbatch_order], static_shapes=_static_shapes(r))


def read_verl_async(top: Reader, rollout_n: int) -> Optional[StreamConfig]:
    """``async_training`` (``None`` without it): verl's fully-async recipe is on when
    the section is there."""
    if "async_training" not in top.data:
        return None
    r = top.section("async_training").known(VERL_ASYNC_KEYS, VERL_ASYNC_FRAMEWORK_KEYS, "verl")
    threshold = r.get("staleness_threshold")
    if threshold is not None:
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or threshold < 0:
            raise ConfigError(f"{r.key('staleness_threshold')}: must be a number >= 0 (verl's share of stale "
                              f"samples), got {threshold!r}")
        if "max_head_offpolicyness" not in r.data and threshold > 0:
            r.ctx.note(f"{r.key('staleness_threshold')}: verl's bound on how many stale samples the rollouter makes, "
                       "not a version lag; seqpack drops no stale group unless async_training.max_head_offpolicyness "
                       "is set")
    order = r.choice("microbatch_order", MICROBATCH_ORDERS, "packer")
    return StreamConfig(path=r.path, enabled=True, max_staleness=r.int("max_head_offpolicyness", minimum=0),
                        step_tokens=r.int("step_tokens"), group_size=rollout_n, micro_batch_order=_ORDER[order],
                        static_shapes=_static_shapes(r))
