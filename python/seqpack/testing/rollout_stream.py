"""A simulated asynchronous GRPO rollout stream, for the stream planner's docs,
tests and benchmark. Not part of the API.

Prompts are launched at a steady rate, each sampled ``group_size`` times; a
rollout's length is lognormal and its finish time grows with its length (decoding
is token by token), so long rollouts arrive last. The trainer takes a step whenever
the planner is ready, and every step advances the policy version; a rollout carries
the version that was current when it was launched::

    time ─────────────────────────────────────────────────────▶
    prompt 0  ├─ 900 ─┤ ├──── 2400 ────┤  ├─────── 6100 ───────┤
    prompt 1     ├ 300 ┤├── 1700 ──┤ ├───── 4000 ─────┤
    trainer           step 0 (v0→1)        step 1 (v1→2)       ...

    >>> from seqpack import StreamPlanner
    >>> rollouts = grpo_rollouts(num_prompts=16, group_size=4, max_length=4096, seed=0)
    >>> planner = StreamPlanner(dp_size=2, max_tokens=8192, step_tokens=16384, max_staleness=2)
    >>> steps = run_stream(planner, rollouts)
    >>> [s.num_tokens for s in steps]                  # each at least step_tokens
    [18650, 17057, 18313]
    >>> landed = sum(s.num_items for s in steps)
    >>> dropped = sum(s.dropped.size for s in steps) + planner.dropped.size   # the last ones, stale at the end
    >>> landed, dropped, landed + dropped == 16 * 4
    (36, 28, True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

import numpy as np

__all__ = ["Rollout", "grpo_rollouts", "run_stream"]


@dataclass(frozen=True)
class Rollout:
    """One finished rollout: its prompt (group) and the group's size, its tokens,
    launch and finish times."""

    prompt: int
    group_size: int
    length: int
    launched: float
    finished: float


def grpo_rollouts(num_prompts: int, group_size: int = 8, *, median: float = 1500.0, sigma: float = 0.9,
                  max_length: int = 16384, prompts_per_second: float = 4.0, tokens_per_second: float = 1000.0,
                  seed: int = 0) -> List[Rollout]:
    """``num_prompts * group_size`` rollouts in the order they finish: lengths
    lognormal (``median``, ``sigma``, at most ``max_length``), prompt ``p`` launched at
    ``p / prompts_per_second``, a rollout finishing ``length / tokens_per_second``
    seconds later (times a jitter in [0.75, 1.25))."""
    rng = np.random.default_rng(seed)
    out = []
    for p in range(num_prompts):
        launched = p / prompts_per_second
        lengths = np.minimum(max_length, rng.lognormal(np.log(median), sigma, group_size).astype(np.int64) + 1)
        for x in lengths.tolist():
            took = x / tokens_per_second * (0.75 + 0.5 * rng.random())
            out.append(Rollout(p, group_size, int(x), launched, launched + took))
    out.sort(key=lambda r: (r.finished, r.prompt))
    return out


def run_stream(planner: Any, rollouts: List[Rollout], *, chunk: int = 1, flush: bool = True,
               on_step: Optional[Any] = None) -> List[Any]:
    """Feed ``rollouts`` (in finish order, ``chunk`` at a time) to ``planner`` (a
    :class:`~seqpack.StreamPlanner`), taking a step whenever it is ready; each step
    advances the version, and a rollout's version is the number of steps taken
    before it was launched. ``flush`` plans what is left (incomplete groups
    dropped). ``on_step(step, lengths)`` sees each step with the lengths of every
    item id so far. Returns the steps."""
    step_times: List[float] = []
    lengths: List[int] = []
    steps: List[Any] = []
    for at in range(0, len(rollouts), chunk):
        part = rollouts[at:at + chunk]
        versions = [int(np.searchsorted(step_times, r.launched, side="right")) for r in part]
        planner.add([r.length for r in part], group_ids=[r.prompt for r in part], version=versions,
                    group_size=[r.group_size for r in part])
        lengths.extend(r.length for r in part)
        while planner.ready(len(step_times)):
            step = planner.next_step(len(step_times))
            step_times.append(part[-1].finished)
            steps.append(step)
            if on_step is not None:
                on_step(step, lengths)
    if flush:
        last = planner.flush(len(step_times), incomplete="drop")
        if last is not None:
            steps.append(last)
            if on_step is not None:
                on_step(last, lengths)
    return steps
