"""The asynchronous-training section of a :class:`SeqpackConfig`
(``StreamConfig``) and how ``to_dict`` writes it back; read by config/_async.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional


@dataclass(frozen=True)
class StreamConfig:
    """Asynchronous training's step planning (:class:`~seqpack.StreamPlanner`), read
    where the framework configures its asynchronous mode (config/_async.py).

    Attributes:
        path: the section the keys live in (``grpo.async_grpo``, ``async_training``).
        enabled: the framework's asynchronous mode is on.
        max_staleness: versions a rollout may lag (NeMo-RL's
            ``max_trajectory_age_steps``; AReaL's ``max_head_offpolicyness``, the
            name seqpack reads in verl's section); ``None``: never dropped.
        step_tokens: a step's token budget (seqpack's ``step_tokens``).
        group_size: rollouts per prompt (NeMo-RL's ``num_generations_per_prompt``,
            verl's ``rollout.n``).
        micro_batch_order: ``"planned"`` or ``"largest_first"``.
        static_shapes: ``None``, ``True``, a bucket count or the bucket sizes.
    """

    path: str
    enabled: bool = False
    max_staleness: Optional[int] = None
    step_tokens: Optional[int] = None
    group_size: Optional[int] = None
    micro_batch_order: str = "planned"
    static_shapes: Any = None


def stream_to_dict(st: StreamConfig, out: Dict[str, Any]) -> None:
    """Write ``st`` back into ``out`` (a config in its framework's schema), as
    config/_async.py reads it."""
    shapes = list(st.static_shapes) if isinstance(st.static_shapes, tuple) else st.static_shapes
    extra = {k: v for k, v in (("step_tokens", st.step_tokens), ("static_shapes", shapes)) if v is not None}
    if st.path == "grpo.async_grpo":
        section = {"enabled": st.enabled, **extra}
        if st.max_staleness is not None:
            section["max_trajectory_age_steps"] = st.max_staleness
        grpo = out.setdefault("grpo", {})
        grpo["async_grpo"] = section
        if st.group_size is not None:
            grpo["num_generations_per_prompt"] = st.group_size
        return
    section = {"microbatch_order": "largest_first" if st.micro_batch_order == "largest_first" else "packer", **extra}
    if st.max_staleness is not None:
        section["max_head_offpolicyness"] = st.max_staleness
    out["async_training"] = section
