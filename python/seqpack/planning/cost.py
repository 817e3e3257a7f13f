"""What a micro-batch costs: ``t = per_micro_batch + per_token·Σs + per_token_squared·Σs²``.

The three terms are the fixed cost of running a micro-batch at all (kernel launches,
FSDP/ZeRO-3 parameter all-gathers), the work linear in tokens (every matmul, the LM
head) and attention, quadratic in each sequence's length ``s``::

    micro-batch [3000, 500, 500]:  Σs = 4,000   Σs² = 9,500,000
    CostModel.tokens()   ->  4,000               (what token caps balance)
    CostModel.verl()     ->  24576·4,000 + 9.5e6 (verl's and ROLL's workload)

Build one from explicit coefficients, from a transformer's shape
(:meth:`CostModel.from_model`, forward + backward FLOPs), or from a few timed
micro-batches on your hardware (:meth:`CostModel.fit`, least squares with
non-negative coefficients, its R² attached).

    >>> from seqpack.planning.cost import CostModel
    >>> CostModel.tokens()([3000, 500, 500]), CostModel.verl()([3, 5])
    (4000.0, 196642.0)
    >>> fitted = CostModel.fit([[100], [200], [100, 100], [400]], [1.1, 1.8, 1.6, 3.8])
    >>> [round(c, 9) for c in (fitted.per_micro_batch, fitted.per_token, fitted.per_token_squared)]
    [0.6, 0.004, 1e-05]
    >>> round(fitted.r_squared, 9)
    1.0
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, List, Optional, Sequence

import numpy as np

from .._lengths import as_lengths, as_positive_int, as_real, shown

# ROLL's and verl's workload per sequence: 24576 * s + s**2, i.e. the linear layers
# and attention of a 7B-class model (hidden 4096) up to a constant.
WORKLOAD_ATTENTION_COEFF = 24576

__all__ = ["CostModel"]

_TERMS = ("per_micro_batch", "per_token", "per_token_squared")
_CP_TERMS = ("per_kv_token", "per_collective")
# CostModel.default(): the fit of the packed steps measured on one H200 (see there).
_DEFAULT_FLOPS_PER_SECOND = 3.49e14
_DEFAULT_PER_LAYER_OVERHEAD = 6.6e-3 / 4


def _sums(micro_batches: Iterable[Any]) -> np.ndarray:
    """``[n, 3]`` float64 rows ``(1, Σs, Σs²)`` of each micro-batch's lengths."""
    rows: List[List[float]] = []
    for i, mb in enumerate(micro_batches):
        lens = as_lengths(mb, f"micro_batch_lengths[{i}]").astype(np.float64)
        if (lens < 0).any():
            raise ValueError(f"micro_batch_lengths[{i}] must hold lengths >= 0, got {lens.min():.0f}")
        rows.append([1.0, float(lens.sum()), float((lens * lens).sum())])
    return np.asarray(rows, dtype=np.float64).reshape(-1, 3)


def _cp_sums(micro_batches: Sequence[Any], degrees: Sequence[Any]) -> np.ndarray:
    """``[n, 5]`` float64 rows ``(1, Σ local tokens, Σ s²/d, Σ s(d-1)/d, sharded)``
    of each micro-batch as one CP rank runs it: its sequences' lengths ``s`` and
    degrees ``d`` (a rank's tokens of a sharded sequence are its zigzag share,
    ``round_up(s, 2d) / d``)."""
    if len(degrees) != len(micro_batches):
        raise ValueError(f"cp_degrees has {len(degrees)} entries for {len(micro_batches)} micro-batches")
    rows: List[List[float]] = []
    for i, (mb, deg) in enumerate(zip(micro_batches, degrees)):
        lens = as_lengths(mb, f"micro_batch_lengths[{i}]").astype(np.int64)
        d = as_lengths(deg, f"cp_degrees[{i}]").astype(np.int64)
        if d.shape != lens.shape:
            raise ValueError(f"cp_degrees[{i}] must give one degree per sequence of micro_batch_lengths[{i}] "
                             f"({lens.shape[0]}), got {d.shape[0]}")
        if (lens < 0).any() or (d < 1).any() or (d & (d - 1)).any():
            raise ValueError(f"micro_batch_lengths[{i}] must hold lengths >= 0 and cp_degrees[{i}] powers of two")
        local = np.where(d > 1, -(-lens // (2 * d)) * 2, lens).astype(np.float64)
        s, df = lens.astype(np.float64), d.astype(np.float64)
        rows.append([1.0, float(local.sum()), float((s * s / df).sum()), float((s * (df - 1) / df).sum()),
                     float((d > 1).sum())])
    return np.asarray(rows, dtype=np.float64).reshape(-1, 5)


@dataclass(frozen=True)
class CostModel:
    """Predicted time (or work) of one micro-batch of sequence lengths ``s``:
    ``per_micro_batch + per_token·Σs + per_token_squared·Σs²``. The units are the
    caller's (seconds after :meth:`fit`, FLOPs from :meth:`from_model` without a
    ``flops_per_second``); plans compare costs, so only ratios matter there.

    Attributes:
        per_micro_batch / per_token / per_token_squared: the coefficients (>= 0).
        r_squared: the fit's coefficient of determination, for a fitted model.
    """

    per_micro_batch: float = 0.0
    per_token: float = 1.0
    per_token_squared: float = 0.0
    r_squared: Optional[float] = field(default=None, compare=False)
    # Context parallelism (plan_step with cp_size > 1): per token of K/V a rank
    # gathers from the other ranks of its block, and per sharded sequence a rank
    # holds in a micro-batch (the collectives' latency).
    per_kv_token: float = 0.0
    per_collective: float = 0.0

    def __post_init__(self) -> None:
        # Any number (NumPy scalars, 0-d arrays and tensors too) that is a finite
        # float64 >= 0; an int too large for a float64 is a ValueError naming it.
        for name in _TERMS + _CP_TERMS:
            object.__setattr__(self, name, as_real(getattr(self, name), name, minimum=0))
        if all(getattr(self, name) == 0 for name in _TERMS):
            raise ValueError("a cost model needs at least one positive coefficient")
        if self.r_squared is not None:
            object.__setattr__(self, "r_squared", as_real(self.r_squared, "r_squared", finite=False))

    # ---- presets ------------------------------------------------------------------
    @classmethod
    def tokens(cls) -> "CostModel":
        """Tokens only (what a token cap balances): ``Σs``."""
        return cls(0.0, 1.0, 0.0)

    @classmethod
    def default(cls) -> "CostModel":
        """What a plan costs when it is given no model, in seconds: forward + backward
        of a Llama-3-8B-shaped model (hidden 4096, 32 layers, 32 heads, 8 K/V heads,
        MLP 14336, vocabulary 128256, by :meth:`from_model`) at 349 TFLOP/s, 52.8 ms
        per micro-batch, and for context parallelism 450 GB/s of NVLink per direction
        and 20 µs per collective.

        Source: the packed forward + backward steps measured on one H200
        (``benchmarks/results/gpu.md``, prefix trees, the plain column, 2026-11-26):
        four steps of 61,480 and 98,304 tokens of a 4-layer model (hidden 1024)
        at 328-337 TFLOP/s by :meth:`from_model`'s count. A least-squares fit of
        their times on their FLOPs gives 349 TFLOP/s and 6.6 ms per micro-batch,
        1.65 ms per layer (kernel launches and per-layer synchronisation grow with
        depth): 52.8 ms at 32 layers. The interconnect terms are NVLink 4's
        specification. A plan compares costs, so the model's size matters only
        through the weight of the per-micro-batch term: an extra micro-batch must
        save more than 52.8 ms (about 410 tokens of this model) to be used. Fit
        your machine and model with :meth:`fit`.

        >>> m = CostModel.default()
        >>> round(m.per_micro_batch, 4), round(m.per_micro_batch / m.per_token)
        (0.0528, 409)
        """
        return cls.from_model(4096, 32, 32, 8, 14336, 128256, flops_per_second=_DEFAULT_FLOPS_PER_SECOND,
                              per_micro_batch=_DEFAULT_PER_LAYER_OVERHEAD * 32,
                              interconnect_bytes_per_second=4.5e11, collective_latency=2e-5)

    @classmethod
    def verl(cls) -> "CostModel":
        """verl's and ROLL's per-sequence workload ``24576·s + s²`` (the linear layers
        and attention of a hidden-4096 model, up to a constant)."""
        return cls(0.0, float(WORKLOAD_ATTENTION_COEFF), 1.0)

    @classmethod
    def from_model(cls, hidden_size: int, num_layers: int, num_attention_heads: int,
                   num_key_value_heads: Optional[int] = None, intermediate_size: Optional[int] = None,
                   vocab_size: int = 0, *, head_dim: Optional[int] = None, gated_mlp: bool = True,
                   causal: bool = True, flops_per_second: Optional[float] = None,
                   per_micro_batch: float = 0.0, interconnect_bytes_per_second: Optional[float] = None,
                   collective_latency: float = 0.0, bytes_per_element: int = 2) -> "CostModel":
        """Forward + backward FLOPs of a decoder-only transformer (Llama-shaped by
        default: grouped-query attention, gated MLP), per micro-batch.

        Per token and layer, the projections cost ``2·h·d·(2·Hq + 2·Hkv)`` and the MLP
        ``2·k·h·i`` (``k = 3`` gated, 2 plain), plus ``2·h·V`` for the LM head once;
        attention scores and their weighted sum cost ``4·Hq·d`` per attended pair,
        ``s²/2`` pairs per causal sequence (``s²`` without the causal mask). The
        backward pass is counted as twice the forward (x3 in total), as in the usual
        ``6·N`` FLOPs per token. ``flops_per_second`` turns FLOPs into seconds;
        ``per_micro_batch`` (in those units) adds a fixed cost per micro-batch.

        Context parallelism (with ``flops_per_second``, so that every term is in
        seconds): ``interconnect_bytes_per_second`` prices each token of K/V a rank
        gathers, ``2·Hkv·d·bytes_per_element`` bytes per layer, three times (the
        forward's all-gather, the backward's all-gather and reduce-scatter of
        dK/dV); ``collective_latency`` (seconds) is paid three times per layer for
        each sharded sequence a rank holds in a micro-batch.

        >>> m = CostModel.from_model(4096, 32, 32, 32, 11008, 32000)  # Llama-2-7B, 6.74e9 parameters
        >>> round(m.per_token / (6 * 6.74e9), 2), m.per_token_squared == 6 * 32 * 4096
        (0.98, True)
        """
        h = as_positive_int(hidden_size, "hidden_size")
        layers = as_positive_int(num_layers, "num_layers")
        heads = as_positive_int(num_attention_heads, "num_attention_heads")
        kv = heads if num_key_value_heads is None else as_positive_int(num_key_value_heads, "num_key_value_heads")
        if heads % kv:
            raise ValueError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv})")
        d = as_positive_int(head_dim, "head_dim") if head_dim is not None else h // heads
        if d == 0:
            raise ValueError(f"hidden_size ({h}) must be at least num_attention_heads ({heads}) without head_dim")
        inter = 4 * h if intermediate_size is None else as_positive_int(intermediate_size, "intermediate_size")
        vocab = as_positive_int(vocab_size, "vocab_size", allow_zero=True)
        projections = 2 * h * d * (2 * heads + 2 * kv)
        mlp = 2 * (3 if gated_mlp else 2) * h * inter
        forward_per_token = layers * (projections + mlp) + 2 * h * vocab
        forward_per_pair = layers * 4 * heads * d
        pairs = 0.5 if causal else 1.0  # attended pairs per s² (the diagonal's s/2 is left out)
        per_micro_batch = as_real(per_micro_batch, "per_micro_batch", minimum=0)
        per_token, per_pair = 3.0 * forward_per_token, 3.0 * forward_per_pair * pairs  # < 2^260: finite floats
        if flops_per_second is not None:
            flops = as_real(flops_per_second, "flops_per_second", minimum=0, minimum_inclusive=False)
            per_token, per_pair = per_token / flops, per_pair / flops
            if not math.isfinite(per_token):  # a subnormal rate: FLOPs / rate past float64
                raise ValueError(f"flops_per_second is too small: this model's {3.0 * forward_per_token:.6g} FLOPs "
                                 f"per token take inf seconds at {shown(flops_per_second)} FLOP/s")
        per_kv = per_collective = 0.0
        if interconnect_bytes_per_second is not None or collective_latency:
            if flops_per_second is None:
                raise ValueError("interconnect_bytes_per_second and collective_latency need flops_per_second: the "
                                 "cost model is then in seconds")
            element = as_positive_int(bytes_per_element, "bytes_per_element")
            if interconnect_bytes_per_second is not None:
                bandwidth = as_real(interconnect_bytes_per_second, "interconnect_bytes_per_second", minimum=0,
                                    minimum_inclusive=False)
                per_kv = 3.0 * layers * 2 * kv * d * element / bandwidth
            per_collective = 3.0 * layers * as_real(collective_latency, "collective_latency", minimum=0)
        return cls(per_micro_batch, per_token, per_pair, per_kv_token=per_kv, per_collective=per_collective)

    @classmethod
    def fit(cls, micro_batch_lengths: Sequence[Any], seconds: Sequence[float],
            cp_degrees: Optional[Sequence[Any]] = None) -> "CostModel":
        """Least-squares coefficients (all >= 0) from timed micro-batches: each
        ``micro_batch_lengths[i]`` (the sequence lengths of one micro-batch) took
        ``seconds[i]``. Use micro-batches of varied counts and lengths (a handful
        each of short, long, few, many), at least three. The result carries its
        ``r_squared`` on the samples.

        ``cp_degrees`` (context parallelism): ``cp_degrees[i]`` the degree of each
        sequence of micro-batch ``i`` as one CP rank ran it (1: whole there; ``d``:
        sharded over ``d`` ranks, this rank holding its zigzag share), its time that
        rank's, collectives included. Then ``per_kv_token`` and ``per_collective``
        are fitted too, with the cost :func:`~seqpack.plan_step` uses for a rank:
        ``per_micro_batch + per_token·Σ local tokens + per_token_squared·Σ s²/d +
        per_kv_token·Σ s(d−1)/d + per_collective·(sharded sequences)``. Time
        micro-batches with and without sharded sequences, or the K/V terms cannot
        be told from the others.

        Non-negativity is exact: every subset of the terms is solved by least
        squares and the best feasible one kept (7 small solves; 31 with CP).
        """
        x = _sums(micro_batch_lengths) if cp_degrees is None else _cp_sums(list(micro_batch_lengths), list(cp_degrees))
        y = np.asarray(seconds, dtype=np.float64).reshape(-1)
        if y.shape[0] != x.shape[0]:
            raise ValueError(f"seconds has {y.shape[0]} entries for {x.shape[0]} micro-batches")
        if x.shape[0] < 3:
            raise ValueError(f"fit needs at least 3 timed micro-batches, got {x.shape[0]}")
        if not np.all(np.isfinite(y)) or (y < 0).any():
            raise ValueError("seconds must be finite and >= 0")
        terms = x.shape[1]
        scale = np.maximum(np.abs(x).max(axis=0), 1.0)  # columns of similar size: a stable solve
        xs = x / scale
        best, best_err = None, math.inf
        for k in range(1, terms + 1):
            for cols in itertools.combinations(range(terms), k):
                coef, *_ = np.linalg.lstsq(xs[:, cols], y, rcond=None)
                if (coef < 0).any():
                    continue
                err = float(np.sum((xs[:, cols] @ coef - y) ** 2))
                if err < best_err * (1 - 1e-12):
                    full = np.zeros(terms)
                    full[list(cols)] = coef
                    best, best_err = full / scale, err
        if best is None or not (best[:3] > 0).any():
            raise ValueError("no cost model with a positive coefficient fits these timings")
        total, energy = float(np.sum((y - y.mean()) ** 2)), float(np.sum(y * y))
        if total > 1e-24 * energy:
            r2 = 1.0 - best_err / total
        else:  # equal timings: explained exactly (an overhead alone) or not at all
            r2 = 1.0 if best_err <= 1e-12 * max(energy, 1e-300) else 0.0
        cp = {} if terms == 3 else {"per_kv_token": float(best[3]), "per_collective": float(best[4])}
        return cls(float(best[0]), float(best[1]), float(best[2]), r_squared=r2, **cp)

    # ---- evaluation ---------------------------------------------------------------
    def __call__(self, lengths: Any) -> float:
        """The cost of one micro-batch with these sequence lengths; an empty one (a
        dummy micro-batch that still runs the collectives) costs ``per_micro_batch``."""
        return float(self.micro_batch_costs([lengths])[0])

    def micro_batch_costs(self, micro_batches: Sequence[Any]) -> np.ndarray:
        """``[n]`` float64: the cost of each micro-batch (a list of lengths).

        Raises:
            ValueError: a cost overflows float64; the message names the micro-batch
                and the coefficient whose term overflows.
        """
        x = _sums(micro_batches)
        coeffs = np.array([self.per_micro_batch, self.per_token, self.per_token_squared])
        with np.errstate(over="ignore", invalid="ignore"):
            terms = x * coeffs
            costs = terms.sum(axis=1)
        if not np.all(np.isfinite(costs)):
            i = int(np.argmin(np.isfinite(costs)))
            self._overflow(f"micro_batch_lengths[{i}]", terms[i])
        return costs

    def check_finite(self, max_tokens: int, name: str = "max_tokens") -> None:
        """Raise ``ValueError`` unless a micro-batch of ``max_tokens`` tokens (the
        costliest: one sequence, ``max_tokens²`` attended pairs) has a finite cost,
        naming the coefficient whose term overflows float64."""
        cap = float(max_tokens)
        self._overflow(f"a micro-batch of {name} = {max_tokens} tokens",
                       np.array([self.per_micro_batch, self.per_token * cap, self.per_token_squared * cap * cap]))

    def _overflow(self, what: str, terms: np.ndarray) -> None:
        """Raise when the three terms of a cost (or their sum) are not finite."""
        units = ("", " x Σs", " x Σs²")
        for name, unit, term in zip(_TERMS, units, terms):
            if not math.isfinite(term):
                raise ValueError(f"the cost of {what} overflows float64: {name} = {getattr(self, name):.6g}{unit} "
                                 "is inf; scale the cost model down (plans depend only on its ratios)")
        with np.errstate(over="ignore"):
            total = float(np.sum(terms))
        if not math.isfinite(total):
            name = _TERMS[int(np.argmax(terms))]
            raise ValueError(f"the cost of {what} overflows float64: its terms are finite but their sum is not (the "
                             f"largest: {name} = {getattr(self, name):.6g}); scale the cost model down")

    def __repr__(self) -> str:
        fit = "" if self.r_squared is None else f", r_squared={self.r_squared:.4f}"
        cp = "".join(f", {name}={getattr(self, name):.6g}" for name in _CP_TERMS if getattr(self, name))
        return (f"CostModel(per_micro_batch={self.per_micro_batch:.6g}, per_token={self.per_token:.6g}, "
                f"per_token_squared={self.per_token_squared:.6g}{cp}{fit})")
