"""Synthetic sequence-length distributions of RL and SFT batches (long-tailed), the
inputs of seqpack's benchmarks and planner tests. Each takes ``(n, seed=0, max_len=...)``
and returns int64 lengths in ``[1, max_len]``; the same seed gives the same lengths.

    >>> rl_long_tail(4, seed=0).tolist()
    [2824, 1813, 1154, 1793]

Torch-free; also re-exported by :mod:`seqpack.testing.pipelines`.
"""

from __future__ import annotations

import math
from typing import Callable, Dict

import numpy as np

from .._lengths import as_positive_int

__all__ = ["DISTRIBUTIONS", "reasoning_tail", "rl_long_tail", "sft", "trl_6092"]


def _finish(x: np.ndarray, max_len: int) -> np.ndarray:
    return np.clip(np.rint(x), 1, as_positive_int(max_len, "max_len")).astype(np.int64)


def rl_long_tail(n: int, seed: int = 0, max_len: int = 16384) -> np.ndarray:
    """RL rollouts: prompt uniform in [64, 1024] plus a log-normal response
    (median 1024, σ 1.0; a synthetic choice), clipped to ``[1, max_len]``."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(64, 1025, size=n)
    response = rng.lognormal(math.log(1024.0), 1.0, size=n)
    return _finish(prompt + response, max_len)


def trl_6092(n: int, seed: int = 0, max_len: int = 5120) -> np.ndarray:
    """The synthetic rollouts of huggingface/trl PR #6092's benchmark: completion
    log-normal with median 700 and σ 0.9 clipped to 4096, with a 10% truncation
    spike at 4096 ("mirrors vLLM EOS-vs-cap"), plus a prompt of median 256; the PR
    reports full lengths min 116 / mean 1597 / max 5120. The prompt's spread is not
    given: here log-normal σ 0.5 clipped to [32, 1024] (a guess; 1024 from the max
    5120 = 1024 + 4096). Exactly ``round(0.1·n)`` completions are set to 4096."""
    rng = np.random.default_rng(seed)
    prompt = np.clip(np.rint(rng.lognormal(math.log(256.0), 0.5, size=n)), 32, 1024)
    completion = np.clip(np.rint(rng.lognormal(math.log(700.0), 0.9, size=n)), 1, 4096)
    spike = rng.choice(n, size=int(round(0.1 * n)), replace=False) if n else np.zeros(0, dtype=np.int64)
    completion[spike] = 4096
    return _finish(prompt + completion, max_len)


def reasoning_tail(n: int, seed: int = 0, max_len: int = 32768) -> np.ndarray:
    """Long reasoning rollouts: prompt uniform in [128, 2048] plus a log-normal
    response (median 4096, σ 1.0), 5% of the sequences truncated at ``max_len``
    (generation hit the cap), clipped to ``[1, max_len]`` (a synthetic choice)."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(128, 2049, size=n)
    total = prompt + rng.lognormal(math.log(4096.0), 1.0, size=n)
    total[rng.random(n) < 0.05] = max_len
    return _finish(total, max_len)


def sft(n: int, seed: int = 0, max_len: int = 4096) -> np.ndarray:
    """Supervised fine-tuning samples: log-normal with median 512 and σ 0.8 (a
    synthetic choice), clipped to ``[1, max_len]``."""
    rng = np.random.default_rng(seed)
    return _finish(rng.lognormal(math.log(512.0), 0.8, size=n), max_len)


DISTRIBUTIONS: Dict[str, Callable[..., np.ndarray]] = {
    "rl_long_tail": rl_long_tail,
    "trl_6092": trl_6092,
    "reasoning_tail": reasoning_tail,
    "sft": sft,
}
