"""Megatron-LM's dynamic (hybrid) context parallelism keys, read the same way from
NeMo-RL's ``policy.megatron_cfg``, verl's ``actor_rollout_ref.actor.megatron`` and
ROLL's ``strategy_args.strategy_config`` (each passes them on to Megatron-Core):

- ``dynamic_context_parallel``: each sequence sharded only over as many CP ranks as
  it needs (``plan_step(..., hybrid_cp=True)``); ``hybrid_context_parallel``, its
  name when Megatron-LM PR #2282 merged it, is read too;
- ``min_dynamic_context_parallel_size``: the smallest degree (``min_cp_degree``);
- ``max_seqlen_per_dp_cp_rank``: a rank's tokens per micro-batch (the planner's
  ``max_tokens``).

A key close to one of these (a typo that would turn the feature off) is an error
with a did-you-mean.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from ._loader import Reader
from ._types import ConfigError

DYNAMIC_CP_KEYS = ("dynamic_context_parallel", "min_dynamic_context_parallel_size", "max_seqlen_per_dp_cp_rank")
OLDER_NAMES = {"hybrid_context_parallel": "dynamic_context_parallel",
               "min_hybrid_context_parallel_size": "min_dynamic_context_parallel_size"}


def read_dynamic_cp(r: Reader, cp: int, known=()) -> Dict[str, Any]:
    """The ``ParallelConfig`` fields of section ``r``'s dynamic-CP keys (``cp``: its
    ``context_parallel_size``; ``known``: the section's other keys seqpack reads)."""
    r.no_lookalike(DYNAMIC_CP_KEYS + tuple(OLDER_NAMES), what="key", known=tuple(known))
    names = {}
    for older, newer in OLDER_NAMES.items():
        if older in r.data and newer in r.data:
            raise ConfigError(f"{r.key(older)}: Megatron-LM's older name of {newer}, which is set too; keep one")
        names[newer] = older if older in r.data else newer
        if older in r.data:
            r.ctx.note(f"{r.key(older)}: read as {newer} (Megatron-LM's current name)")
    on = r.bool(names["dynamic_context_parallel"])
    smallest = r.int(names["min_dynamic_context_parallel_size"], 1)
    per_rank: Optional[int] = r.int("max_seqlen_per_dp_cp_rank")
    if smallest & (smallest - 1) or smallest > cp:
        raise ConfigError(f"{r.key(names['min_dynamic_context_parallel_size'])}: must be a power of two up to "
                          f"context_parallel_size = {cp}, got {smallest}")
    if on and cp & (cp - 1):
        raise ConfigError(f"{r.key(names['dynamic_context_parallel'])}: dynamic CP shards over aligned blocks of "
                          f"a power-of-two number of ranks: context_parallel_size must be a power of two, got {cp}")
    if on and cp == 1:
        r.ctx.note(f"{r.key(names['dynamic_context_parallel'])}: context_parallel_size is 1, so every sequence runs "
                   "whole; dynamic CP changes nothing")
    return {"dynamic_cp": on, "min_dynamic_cp": smallest if on else 1, "max_seqlen_per_rank": per_rank}
