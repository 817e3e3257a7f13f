"""Losses on packed sequences: NeMo-RL's ``SequencePackingLossWrapper`` (per
sequence, and ``fused=True``: one pass over the packed logits), segment
reductions over the packed stream, and the common RL/SFT losses with NeMo-RL's
normalisation.

Why summing is right: every loss here divides by **global** counts
(``global_valid_toks`` = masked tokens, ``global_valid_seqs`` = valid sequences
of the whole optimizer step, summed over data-parallel ranks). A masked token
mean over the step is then ``sum_t loss_t / N``, which splits into any
partition of the tokens - per sequence, per micro-batch - whose parts simply
add. Losses that couple sequences of a batch (DPO and other preference losses
pair chosen/rejected rows) do not split this way and cannot be packed: the
wrapper refuses them.

Conventions (NeMo-RL's): ``data`` holds the micro-batch **unpacked**, ``[B, S]``;
``next_token_logprobs[b, j]`` is ``log p(input_ids[b, j + 1])`` (``[B, S - 1]``);
``token_mask``, ``advantages``, ``prev_logprobs``, ``reference_policy_logprobs``,
``generation_logprobs`` are ``[B, S]`` and read as ``[:, 1:]``; ``sample_mask``
is ``[B]``.

    >>> import torch
    >>> from seqpack.loss import masked_mean, segment_sum
    >>> segment_sum(torch.tensor([1., 2., 3., 4., 5.]), [0, 2, 5]).tolist()
    [3.0, 12.0]
    >>> round(masked_mean(torch.tensor([1., 2., 3.]), torch.tensor([1., 0., 1.])).item(), 4)
    2.0
"""

from __future__ import annotations

import math
import re
from collections import UserDict
from typing import TYPE_CHECKING, Any, Callable, Dict, Mapping, Optional, Tuple

import numpy as np

from .._equality import ValueEquality
from ..tensors.cp import gather_cp
from ..tensors.layout import PackedLayout, host_offsets
from ..tensors.thd import pack_to_layout
from .._dist import autocast_state, checked_on_every_rank, groups_of, tensor_facts
from .._lengths import as_real, as_temperature
from .logprobs import _linear_plan, _packed_plan

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "ClippedPGLoss",
    "LossConfigError",
    "LossType",
    "MetricNormalization",
    "PG_DEFAULTS",
    "NLLLoss",
    "SequencePackingLossWrapper",
    "calculate_kl",
    "clipped_pg_loss",
    "masked_mean",
    "nll_loss",
    "pg_config",
    "prepare_loss_input",
    "segment_masked_mean",
    "segment_mean",
    "segment_sum",
]


class LossType:
    """NeMo-RL's ``LossType`` values (a loss's ``loss_type`` attribute)."""

    TOKEN_LEVEL = "token_level"
    SEQUENCE_LEVEL = "sequence_level"


class MetricNormalization:
    """What a metric was divided by (NeMo-RL's ``metric_normalizations``): the global
    valid tokens, the global valid sequences, or nothing (counts, extrema). A trainer
    that sums micro-batch metrics computed with a unit normaliser divides by these."""

    TOKENS = "tokens"
    SEQUENCES = "sequences"
    NONE = "none"


MIN_KEYS = {"probs_ratio_min", "probs_ratio_clamped_min"}
MAX_KEYS = {"probs_ratio_max", "probs_ratio_clamped_max"}


def _host_cu(cu: Any, name: str) -> np.ndarray:
    """Offsets on the host (a device tensor is copied: the loss wrapper and the
    segment reductions index with them, as NeMo-RL's do)."""
    return host_offsets(cu, name, copy_device=True)


# ---------------------------------------------------------------- reductions


def _segment_index(cu: np.ndarray, device):
    from ..tensors._device import host_to_device

    lengths = np.diff(cu)
    return host_to_device([np.repeat(np.arange(len(lengths)), lengths)], device)[0], lengths


def segment_sum(values: "torch.Tensor", cu_seqlens: Any) -> "torch.Tensor":
    """Sum of ``values[cu[i]:cu[i + 1]]`` per sequence, ``[B, ...]`` (differentiable)."""
    from ..tensors._device import check_tensor

    check_tensor(values, "values")
    cu = _host_cu(cu_seqlens, "cu_seqlens")
    if values.shape[0] < cu[-1]:
        raise ValueError(f"values has {values.shape[0]} rows, cu_seqlens ends at {int(cu[-1])}")
    index, lengths = _segment_index(cu, values.device)
    out = values.new_zeros((len(lengths), *values.shape[1:]))
    return out.index_add(0, index, values[: int(cu[-1])])


def segment_mean(values: "torch.Tensor", cu_seqlens: Any) -> "torch.Tensor":
    """Mean per sequence (0 for an empty one)."""
    counts = values.new_tensor(np.maximum(np.diff(_host_cu(cu_seqlens, "cu_seqlens")), 1))
    return segment_sum(values, cu_seqlens) / counts.view(-1, *([1] * (values.dim() - 1)))


def masked_mean(values: "torch.Tensor", mask: "torch.Tensor", dim: Optional[int] = None,
                global_normalization_factor: Optional[Any] = None) -> "torch.Tensor":
    """NeMo-RL's ``masked_mean``: ``sum(values * mask) / (factor or sum(mask))``."""
    total = (values * mask).sum() if dim is None else (values * mask).sum(dim)
    denom = (mask.sum() if dim is None else mask.sum(dim)) if global_normalization_factor is None \
        else global_normalization_factor
    return total / (denom + 1e-8)


def segment_masked_mean(values: "torch.Tensor", mask: "torch.Tensor", cu_seqlens: Any) -> "torch.Tensor":
    """Per-sequence masked token mean of packed ``values`` ``[T]`` -> ``[B]``."""
    return segment_sum(values * mask, cu_seqlens) / (segment_sum(mask.to(values.dtype), cu_seqlens) + 1e-8)


# ---------------------------------------------------------------- losses


class LossConfigError(ValueError, AssertionError):
    """A loss configuration seqpack cannot honour: an unknown or unimplemented key, or
    a combination NeMo-RL forbids (a ``ValueError``; also an ``AssertionError``, which
    is what NeMo-RL's own checks raise)."""


def calculate_kl(logprobs: "torch.Tensor", logprobs_reference: "torch.Tensor", kl_type: str = "k3",
                 input_clamp_value: Optional[float] = 20.0, output_clamp_value: Optional[float] = 10.0,
                 importance_sampling_weights: Optional["torch.Tensor"] = None) -> "torch.Tensor":
    """Per-token KL estimate of the policy against a reference (NeMo-RL's, current):
    ``k1 = -d``, ``k2 = d^2 / 2``, ``k3 = e^d - 1 - d`` with ``d = ref - logprobs``
    clamped to ``±input_clamp_value``; multiplied by ``importance_sampling_weights``
    (when given) *before* the ``±output_clamp_value`` clamp. Where the input clamp is
    active the weights are detached, so a clamped token has no gradient at all
    (NeMo-RL #2958); elsewhere a weight that carries a gradient adds the
    score-function term ``kl · d log w`` (NeMo-RL #2506).

    >>> import torch
    >>> calculate_kl(torch.tensor([-1.0, -1.0]), torch.tensor([0.0, -30.0]), "k1").tolist()
    [-1.0, 10.0]
    """
    import torch

    d = logprobs_reference - logprobs
    w = importance_sampling_weights
    if input_clamp_value is not None:
        input_clamp_value = as_real(input_clamp_value, "input_clamp_value", minimum=0, finite=False)
        clamped = d.clamp(-input_clamp_value, input_clamp_value)
        if w is not None:
            w = torch.where(d == clamped, w, w.detach())
        d = clamped
    if kl_type == "k1":
        kl = -d
    elif kl_type == "k2":
        kl = d * d / 2
    elif kl_type == "k3":
        kl = torch.exp(d) - 1 - d
    else:
        raise ValueError(f"kl_type must be 'k1', 'k2' or 'k3', got {kl_type!r}")
    if w is not None:
        kl = w * kl
    if output_clamp_value is not None:
        output_clamp_value = as_real(output_clamp_value, "output_clamp_value", minimum=0, finite=False)
        kl = kl.clamp(-output_clamp_value, output_clamp_value)
    return kl


def nll_loss(token_logprobs: "torch.Tensor", mask: "torch.Tensor", global_valid_toks: Any
             ) -> Tuple["torch.Tensor", Dict[str, float]]:
    """SFT cross-entropy: ``-sum(logprob * mask) / global_valid_toks``."""
    loss = -masked_mean(token_logprobs, mask, global_normalization_factor=global_valid_toks)
    return loss, {"loss": loss.item(), "num_unmasked_tokens": float(mask.sum().item())}


def _finite(t):
    import torch

    return torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0)


# NeMo-RL's ClippedPGLossFn configuration (its current pydantic model), defaults
# included, plus seqpack's entropy_coef. Any other key raises LossConfigError.
PG_DEFAULTS: Dict[str, Any] = {
    "ratio_clip_min": 0.2,
    "ratio_clip_max": 0.2,
    "ratio_clip_c": None,
    "reference_policy_kl_penalty": 0.01,
    "reference_policy_kl_type": "k3",
    "kl_input_clamp_value": 20.0,
    "kl_output_clamp_value": 10.0,
    "use_kl_in_reward": False,
    "disable_ppo_ratio": False,
    "token_level_loss": True,
    "sequence_level_importance_ratios": False,
    "use_on_policy_kl_approximation": False,
    "use_importance_sampling_correction": False,
    "truncated_importance_sampling_type": None,
    "truncated_importance_sampling_ratio": None,
    "truncated_importance_sampling_ratio_min": None,
    "force_on_policy_ratio": False,
    "use_cispo": False,
    "positive_example_nll_weight": 0.0,
    "entropy_coef": 0.0,
}
# Keys of NeMo-RL's ClippedPGLossFn (or of its open branches) that seqpack does not implement.
PG_NOT_IMPLEMENTED = ("seq_logprob_error_in_loss", "metrics_level", "enable_torch_compile", "opd_full",
                      "opd_student_topk")
_TIS_TYPES = ("tis", "icepop", "seq-mask-tis")


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise LossConfigError(message)


class _LossConfigTypeError(LossConfigError, TypeError):
    """A configuration value of the wrong type (a string, a bool, ``None``): a
    :class:`LossConfigError` that is also a ``TypeError``."""


def _cfg_real(c: Dict[str, Any], key: str, **rules: Any) -> float:
    """``c[key]`` as a float by :func:`seqpack._lengths.as_real` (NumPy and 0-d
    tensor numbers accepted), any refusal a :class:`LossConfigError` naming the key
    (also a ``TypeError`` for a value of the wrong type)."""
    try:
        return as_real(c[key], f"cfg[{key!r}]", **rules)
    except TypeError as e:
        raise _LossConfigTypeError(str(e)) from None
    except ValueError as e:
        raise LossConfigError(str(e)) from None


def pg_config(cfg: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """``cfg`` over :data:`PG_DEFAULTS`, validated as NeMo-RL's ``ClippedPGLossFn``
    validates it (plus the checks it defers to the first call); unknown and
    unimplemented keys raise :class:`LossConfigError` naming the key."""
    cfg = dict(cfg or {})
    for key in cfg:
        if key in PG_NOT_IMPLEMENTED:
            raise LossConfigError(f"cfg[{key!r}] is a NeMo-RL ClippedPGLossFn option that seqpack does not implement")
        if key not in PG_DEFAULTS:
            raise LossConfigError(f"cfg[{key!r}] is not a ClippedPGLossFn key (known: {', '.join(PG_DEFAULTS)})")
    c = {**PG_DEFAULTS, **cfg}
    for key in ("ratio_clip_min", "ratio_clip_max", "reference_policy_kl_penalty", "positive_example_nll_weight",
                "entropy_coef"):
        c[key] = _cfg_real(c, key, minimum=0)
    if c["ratio_clip_c"] is not None:
        c["ratio_clip_c"] = _cfg_real(c, "ratio_clip_c", minimum=1, minimum_inclusive=False,
                                      rule="> 1 (the dual-clip bound), a finite number")
    _check(c["reference_policy_kl_type"] in ("k1", "k2", "k3"),
           f"cfg['reference_policy_kl_type'] must be 'k1', 'k2' or 'k3', got {c['reference_policy_kl_type']!r}")
    if c["sequence_level_importance_ratios"]:
        _check(not c["token_level_loss"], "sequence_level_importance_ratios (GSPO) is mutually exclusive with "
                                          "token-level loss: set token_level_loss to False")
    if c["use_cispo"]:
        for key, bad in (("disable_ppo_ratio", True), ("force_on_policy_ratio", True),
                         ("sequence_level_importance_ratios", True), ("token_level_loss", False)):
            _check(bool(c[key]) != bad, f"use_cispo is incompatible with {key}={c[key]!r}")
        _check(c["ratio_clip_c"] is None, "use_cispo is incompatible with ratio_clip_c (dual clip)")
    for key in ("kl_input_clamp_value", "kl_output_clamp_value"):  # None: no clamp
        if c[key] is not None:
            c[key] = _cfg_real(c, key, minimum=0, finite=False)
    for key in ("truncated_importance_sampling_ratio", "truncated_importance_sampling_ratio_min"):
        if c[key] is not None:
            c[key] = _cfg_real(c, key, minimum=0, minimum_inclusive=False, rule="positive (a finite number > 0)")
    kind, hi, lo = (c["truncated_importance_sampling_type"], c["truncated_importance_sampling_ratio"],
                    c["truncated_importance_sampling_ratio_min"])
    if kind is None:
        _check(hi is None, "truncated_importance_sampling_ratio needs a truncated_importance_sampling_type "
                           f"(one of {', '.join(_TIS_TYPES)})")
    else:
        _check(c["use_importance_sampling_correction"],
               "truncated importance sampling needs use_importance_sampling_correction=True")
        _check(kind in _TIS_TYPES, f"truncated_importance_sampling_type must be one of {_TIS_TYPES}, got {kind!r}")
        _check(hi is not None and hi > 0, f"truncated_importance_sampling_ratio should be positive, got {hi!r}")
        if lo is not None:
            _check(lo <= hi, "truncated_importance_sampling_ratio_min must be <= truncated_importance_sampling_ratio")
        if kind in ("icepop", "seq-mask-tis"):
            _check(lo is not None, f"truncated_importance_sampling_type={kind!r} needs "
                                   "truncated_importance_sampling_ratio_min")
        if kind == "seq-mask-tis":
            _check(not c["sequence_level_importance_ratios"], "seq-mask-tis is incompatible with "
                                                              "sequence_level_importance_ratios")
    return c


def _require(data: Mapping[str, Any], key: str, why: str):
    if key not in data:
        raise ValueError(f"data[{key!r}] is required ({why})")
    return data[key][:, 1:]


def clipped_pg_loss(next_token_logprobs: "torch.Tensor", data: Mapping[str, Any], global_valid_seqs: Any,
                    global_valid_toks: Any, cfg: Optional[Mapping[str, Any]] = None,
                    next_token_entropy: Optional["torch.Tensor"] = None) -> Tuple["torch.Tensor", Dict[str, float]]:
    """NeMo-RL's current ``ClippedPGLossFn``: PPO / GRPO clipped surrogate, dual clip,
    REINFORCE (``disable_ppo_ratio``), ``force_on_policy_ratio``, CISPO, GSPO
    (sequence-level ratios), importance-sampling correction with truncation
    (``tis`` / ``icepop`` / ``seq-mask-tis``), the KL penalty to a reference with
    its score-function gradient (optionally the on-policy approximation and
    ``curr_logprobs_unfiltered``), VAPO's positive-example NLL, token- or
    sequence-level reduction over the global counts, and its metrics; plus
    seqpack's ``entropy_coef`` (an entropy bonus on ``next_token_entropy``).

    ``next_token_logprobs`` is ``[B, S - 1]``; ``data`` holds ``token_mask``,
    ``sample_mask`` ``[B]``, ``advantages``, ``generation_logprobs``,
    ``prev_logprobs`` (unless ``force_on_policy_ratio``),
    ``reference_policy_logprobs`` (with a KL penalty) as ``[B, S]`` (read as
    ``[:, 1:]``), optionally ``curr_logprobs_unfiltered`` ``[B, S - 1]`` and
    ``rewards`` ``[B]``. ``cfg`` is validated by :func:`pg_config`.
    """
    import torch

    c = pg_config(cfg) if not isinstance(cfg, _PGConfig) else cfg.values
    curr = next_token_logprobs
    if curr.dtype in (torch.bfloat16, torch.float16):
        curr = curr.float()
    tok = data["token_mask"][:, 1:].to(curr.dtype)
    sm = data["sample_mask"].to(curr.dtype)
    mask = tok * sm[:, None]
    adv = _require(data, "advantages", "the policy gradient's advantages")
    gen = _require(data, "generation_logprobs", "NeMo-RL's ClippedPGLossFn reads the generation log-probs")
    prev = curr.detach() if c["force_on_policy_ratio"] else _require(data, "prev_logprobs", "the PPO ratio")
    g_tok, g_seq = global_valid_toks, global_valid_seqs
    token_level = c["token_level_loss"]
    kl_type = c["reference_policy_kl_type"]

    def reduce(x):
        if token_level:
            return masked_mean(x, mask, global_normalization_factor=g_tok)
        return masked_mean(masked_mean(x, tok, dim=-1), sm, global_normalization_factor=g_seq)

    metrics: Dict[str, float] = {}
    with torch.no_grad():
        mean = lambda x: masked_mean(x, mask, global_normalization_factor=g_tok).item()  # noqa: E731
        metrics["token_mult_prob_error"] = mean(torch.exp((gen - prev).abs() * mask))
        metrics["gen_kl_error"] = mean(calculate_kl(gen, prev, kl_type, None, None))
        metrics["policy_kl_error"] = mean(calculate_kl(prev, gen, kl_type, None, None))
        mid = torch.logaddexp(prev, gen) - math.log(2.0)
        metrics["js_divergence_error"] = mean(0.5 * (torch.exp(prev - mid) - (prev - mid) - 1)
                                              + 0.5 * (torch.exp(gen - mid) - (gen - mid) - 1))

    beta = 0.0 if c["use_kl_in_reward"] else c["reference_policy_kl_penalty"]
    kl = torch.zeros((), dtype=curr.dtype, device=curr.device)
    if beta:
        unfiltered = data.get("curr_logprobs_unfiltered", curr)
        ref = _require(data, "reference_policy_logprobs", "the KL penalty (reference_policy_kl_penalty != 0)")
        if c["use_on_policy_kl_approximation"]:
            weights = torch.exp(unfiltered - gen)
        else:  # 1 in value, d log pi in gradient: the KL's score-function term
            weights = torch.exp(unfiltered - unfiltered.detach())
        kl = reduce(beta * calculate_kl(unfiltered, ref, kl_type, c["kl_input_clamp_value"],
                                        c["kl_output_clamp_value"], importance_sampling_weights=_finite(weights)))

    lo_clip, hi_clip = 1 - c["ratio_clip_min"], 1 + c["ratio_clip_max"]
    if c["force_on_policy_ratio"]:
        ratios = torch.exp(curr - curr.detach())
        clamped = ratios
    elif not c["disable_ppo_ratio"]:
        log_ratio = curr - prev
        if c["sequence_level_importance_ratios"]:  # GSPO: the geometric mean over each sequence's tokens
            ratios = torch.exp(masked_mean(log_ratio, tok, dim=-1))[:, None].expand_as(log_ratio)
        else:
            ratios = torch.exp(log_ratio)
        clamped = ratios.clamp(lo_clip, hi_clip)
    else:
        ratios = clamped = curr
    if c["use_cispo"]:
        clip_loss = -adv * clamped.detach() * curr
    else:
        clip_loss = torch.maximum(-adv * ratios, -adv * clamped)
    if c["ratio_clip_c"] is not None:
        clip_loss = torch.where(adv < 0, torch.minimum(clip_loss, -adv * c["ratio_clip_c"]), clip_loss)

    with torch.no_grad():  # the actor's importance weights never carry a gradient
        if c["sequence_level_importance_ratios"]:
            weights = _finite(torch.exp(((prev - gen) * mask).sum(-1)))[:, None]
        else:
            weights = _finite(torch.exp(prev - gen))
        kind, hi, lo = (c["truncated_importance_sampling_type"], c["truncated_importance_sampling_ratio"],
                        c["truncated_importance_sampling_ratio_min"])
        if kind == "tis":
            lo = 0.0 if lo is None else lo
            metrics["is_oob_ratio"] = mean(((weights > hi) | (weights < lo)).to(curr.dtype))
            weights = weights.clamp(lo, hi)
        elif kind == "icepop":
            keep = (weights >= lo) & (weights <= hi)
            metrics["is_oob_ratio"] = mean((~keep).to(curr.dtype))
            weights = torch.where(keep, weights, 0.0)
        elif kind == "seq-mask-tis":
            geo = torch.exp(masked_mean(_finite(prev - gen), tok, dim=-1))
            keep = ((geo >= lo) & (geo <= hi)).to(curr.dtype)
            metrics["is_oob_ratio"] = masked_mean(1 - keep, sm, global_normalization_factor=g_seq).item()
            weights = weights * keep[:, None]
    actor = reduce(weights * clip_loss if c["use_importance_sampling_correction"] else clip_loss)

    nll = torch.zeros((), dtype=curr.dtype, device=curr.device)
    mu = c["positive_example_nll_weight"]
    if mu > 0 and "rewards" in data:  # VAPO: NLL on the sequences with a positive reward
        positive = mask * (data["rewards"] > 0).to(curr.dtype)[:, None]
        count = positive.sum()
        if count > 0:
            nll = masked_mean(-curr, positive, global_normalization_factor=count)
    loss = actor + kl + mu * nll
    if c["entropy_coef"]:
        if next_token_entropy is None:
            raise ValueError("next_token_entropy is needed when entropy_coef != 0")
        loss = loss - c["entropy_coef"] * reduce(next_token_entropy)

    with torch.no_grad():
        valid = mask.bool()
        picked, picked_clamped = ratios.detach()[valid], clamped.detach()[valid]
        metrics.update({
            "loss": loss.item(),
            "probs_ratio": mean(ratios.detach()),
            "probs_ratio_clamped": mean(clamped.detach()),
            "probs_ratio_min": picked.min().item() if picked.numel() else math.inf,
            "probs_ratio_max": picked.max().item() if picked.numel() else -math.inf,
            "probs_ratio_clamped_min": picked_clamped.min().item() if picked.numel() else math.inf,
            "probs_ratio_clamped_max": picked_clamped.max().item() if picked.numel() else -math.inf,
            "kl_penalty": kl.item() / beta if beta and kl.item() else 0.0,
            "sampling_importance_ratio": (
                masked_mean(weights[:, 0], sm, global_normalization_factor=g_seq).item()
                if c["sequence_level_importance_ratios"] else mean(weights)),
            "num_valid_samples": float(data["sample_mask"].sum().item()),
            "approx_entropy": -mean(torch.exp(curr - gen) * curr),
            "positive_nll_loss": nll.item(),
        })
        if next_token_entropy is not None:
            metrics["entropy"] = mean(next_token_entropy.detach())
    return loss, metrics


def _pg_metric_normalizations(c: Mapping[str, Any]) -> Dict[str, str]:
    """NeMo-RL's advertised normaliser of each ClippedPG metric."""
    n = MetricNormalization
    level = n.TOKENS if c["token_level_loss"] else n.SEQUENCES
    out = {"loss": level, "kl_penalty": level,
           "sampling_importance_ratio": n.SEQUENCES if c["sequence_level_importance_ratios"] else n.TOKENS}
    for key in ("probs_ratio", "probs_ratio_clamped", "token_mult_prob_error", "gen_kl_error", "policy_kl_error",
                "js_divergence_error", "approx_entropy"):
        out[key] = n.TOKENS
    for key in ("num_valid_samples", "positive_nll_loss", "probs_ratio_min", "probs_ratio_max",
                "probs_ratio_clamped_min", "probs_ratio_clamped_max"):
        out[key] = n.NONE
    kind = c["truncated_importance_sampling_type"]
    if kind is not None:
        out["is_oob_ratio"] = n.SEQUENCES if kind == "seq-mask-tis" else n.TOKENS
    if c["entropy_coef"]:
        out["entropy"] = n.TOKENS
    return out


class _PGConfig(ValueEquality):
    """A validated configuration (so a loss object validates once)."""

    def __init__(self, cfg: Optional[Mapping[str, Any]]):
        self.values = pg_config(cfg)


def _shifted(data: Mapping[str, Any], key: str):
    return data[key][:, 1:] if key in data else None


class NLLLoss(ValueEquality):
    """SFT loss through the wrapper (NeMo-RL's ``NLLLoss`` interface)."""

    loss_type = LossType.TOKEN_LEVEL
    input_type = "logprob"
    metric_normalizations = {"loss": MetricNormalization.TOKENS, "num_unmasked_tokens": MetricNormalization.NONE,
                             "num_valid_samples": MetricNormalization.NONE}

    def __call__(self, next_token_logprobs, data, global_valid_seqs, global_valid_toks, **_):
        mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
        loss, metrics = nll_loss(next_token_logprobs, mask, global_valid_toks)
        metrics["num_valid_samples"] = float(data["sample_mask"].sum().item())
        return loss, metrics


class ClippedPGLoss(ValueEquality):
    """PPO / GRPO loss through the wrapper: NeMo-RL's current ``ClippedPGLossFn``
    (see :func:`clipped_pg_loss` for what it computes and :data:`PG_DEFAULTS` for
    the keys), validated at construction: an unknown or unimplemented key, or a
    combination NeMo-RL forbids, raises :class:`LossConfigError` naming it.

    With ``positive_example_nll_weight > 0`` (VAPO) the loss divides by the
    micro-batch's own count of positive-reward tokens, so it does not split over
    sequences: the per-sequence wrapper refuses it (use ``fused=True``).
    """

    input_type = "logprob"

    def __init__(self, cfg: Optional[Mapping[str, Any]] = None):
        self._config = _PGConfig(cfg)
        self.cfg = self._config.values
        self.loss_type = LossType.TOKEN_LEVEL if self.cfg["token_level_loss"] else LossType.SEQUENCE_LEVEL
        self.needs_entropy = bool(self.cfg["entropy_coef"])
        self.splits_per_sequence = not self.cfg["positive_example_nll_weight"]
        self.metric_normalizations = _pg_metric_normalizations(self.cfg)

    def __call__(self, next_token_logprobs, data, global_valid_seqs, global_valid_toks, next_token_entropy=None, **_):
        return clipped_pg_loss(next_token_logprobs, data, global_valid_seqs, global_valid_toks, self._config,
                               next_token_entropy)


# ---------------------------------------------------------------- the wrapper

_COUPLED = re.compile(r"dpo|preference|pairwise|contrastive", re.IGNORECASE)


def _check_packable(loss_fn: Any) -> None:
    coupled = getattr(loss_fn, "batch_coupled", None)
    if coupled is None:
        coupled = bool(_COUPLED.search(type(loss_fn).__name__)) or bool(_COUPLED.search(getattr(loss_fn, "__name__", "")))
    if coupled:
        raise ValueError(f"{type(loss_fn).__name__} couples the sequences of a batch (e.g. DPO's chosen/rejected "
                         "pairs), so it cannot run on packed sequences one at a time; disable sequence packing for it "
                         "(or set loss_fn.batch_coupled = False if it is in fact per-sequence)")


def _is_logprob_loss(loss_fn: Any) -> bool:
    kind = getattr(loss_fn, "input_type", "logprob")
    return str(getattr(kind, "value", kind)).lower() == "logprob"


def _group_info(group) -> Tuple[int, int]:
    if group is None:
        return 1, 0
    import torch.distributed as dist

    return dist.get_world_size(group), dist.get_rank(group)


def _rows_plan(rows, lm_head_weight, lm_head_bias, vocab_parallel_rank, input_ids, cu, cu_p, *, cp_size, cp_rank,
               return_entropy, temperature, vocab_parallel_group):
    """Every check of :func:`packed_token_logprobs` of ``rows`` (logits), or with
    ``lm_head_weight`` of :func:`linear_token_logprobs` of ``rows`` (hidden states)
    and that head, with this vocabulary-parallel rank's slice start; returns the
    call and what its all-reduces need every rank to share."""
    from ..tensors._device import check_tensor

    if lm_head_weight is None:
        if lm_head_bias is not None:
            raise ValueError("lm_head_bias needs lm_head_weight")
        vocab_start = (vocab_parallel_rank or 0) * rows.shape[1]
        return _packed_plan(rows, input_ids, cu, cu_p, cp_size, cp_rank, return_entropy, temperature,
                            vocab_parallel_group, vocab_start, 0)
    vocab_start = (vocab_parallel_rank or 0) * check_tensor(lm_head_weight, "lm_head_weight").shape[0]
    return _linear_plan(rows, lm_head_weight, input_ids, cu, cu_p, lm_head_bias, cp_size, cp_rank, return_entropy,
                        temperature, vocab_parallel_group, vocab_start, None, True, 0)


def prepare_loss_input(logits, data, loss_fn=None, vocab_parallel_rank=None, vocab_parallel_group=None,
                       context_parallel_group=None, temperature: float = 1.0, *, lm_head_weight=None,
                       lm_head_bias=None, agree: bool = True):
    """seqpack's default ``prepare_fn``: the fused log-probs of each row's
    (CP-local, vocab-local) logits ``[B, S, V]`` (one packed sequence: ``B = 1``),
    all-gathered over CP, as ``({"next_token_logprobs": [B, L - 1]}, data)`` with
    ``L`` the width of ``data["input_ids"]`` (and ``next_token_entropy`` when
    ``loss_fn.needs_entropy``). With ``lm_head_weight`` (``[V, H]``, this
    rank's vocabulary slice under TP; ``lm_head_bias`` optional) ``logits`` holds the
    final hidden states ``[..., H]`` instead, and the logits are never materialised
    (:func:`seqpack.linear_token_logprobs`).

    ``agree`` (default): with a TP or CP group, every check runs before the first
    collective, inside one agreement over both groups (see
    :func:`seqpack.packed_token_logprobs`), so a rank whose inputs fail or differ
    (shapes, dtypes, ``requires_grad``) makes every rank raise."""
    import torch

    cp, cp_rank = _group_info(context_parallel_group)

    def local():
        rows = logits.reshape(-1, logits.shape[-1])
        ids = data["input_ids"]
        if ids.dim() != 2:
            raise ValueError(f"data['input_ids'] must be [B, S], got shape {tuple(ids.shape)}")
        batch, width = ids.shape
        if batch == 0 or rows.shape[0] % batch:
            raise ValueError(f"logits hold {rows.shape[0]} positions, not a multiple of data's {batch} rows")
        padded = rows.shape[0] // batch * cp  # each row a sequence of this padded width (CP-sharded like one)
        if padded < width:
            raise ValueError(f"the sequence's logits cover {padded} positions, its data {width}")
        packed_ids = torch.zeros(batch, padded, dtype=ids.dtype, device=ids.device)
        packed_ids[:, :width] = ids
        cu = [i * width for i in range(batch + 1)]
        cu_p = [i * padded for i in range(batch + 1)]
        entropy = bool(getattr(loss_fn, "needs_entropy", False))
        run, facts = _rows_plan(rows, lm_head_weight, lm_head_bias, vocab_parallel_rank, packed_ids.reshape(-1), cu,
                                cu_p, cp_size=cp, cp_rank=cp_rank, return_entropy=entropy, temperature=temperature,
                                vocab_parallel_group=vocab_parallel_group)
        return run, {**facts, "the shape of logits": tuple(logits.shape), "the shape of data['input_ids']": (
            batch, width)}, (batch, width, padded, cu_p)

    groups = groups_of(vocab_parallel_group, context_parallel_group)
    run, _, (batch, width, padded, cu_p) = checked_on_every_rank(local, groups, "prepare_loss_input",
                                                                 bool(agree) and bool(groups),
                                                                 fingerprint=lambda r: r[1])
    lp, ent = run()
    if cp > 1:  # agreed above: lp's rows, dtype and requires_grad follow the logits'
        lp = gather_cp(lp, cu_p, context_parallel_group, agree=False)
        ent = gather_cp(ent, cu_p, context_parallel_group, agree=False) if ent is not None else None
    loss_input = {"next_token_logprobs": lp.view(batch, padded)[:, : width - 1]}
    if ent is not None:
        loss_input["next_token_entropy"] = ent.view(batch, padded)[:, : width - 1]
    return loss_input, data


class SequencePackingLossWrapper(ValueEquality):
    """Run an unpacked-data loss on packed logits (NeMo-RL's wrapper, and a fused path).

    Args:
        loss_fn: ``loss_fn(data=, global_valid_seqs=, global_valid_toks=, **loss_input)
            -> (loss, metrics)`` (NeMo-RL's ``LossFunction``; ``input_type="logit"``
            losses get ``loss_fn(logits, data, global_valid_seqs, global_valid_toks,
            vocab_parallel_rank=, vocab_parallel_group=, context_parallel_group=)``).
        prepare_fn: ``prepare_fn(logits=, data=, loss_fn=, vocab_parallel_rank=,
            vocab_parallel_group=, context_parallel_group=) -> (loss_input, data)``;
            default :func:`prepare_loss_input` (fused log-probs of the sequence).
        cu_seqlens_q / cu_seqlens_q_padded: ``[B + 1]`` offsets of the packed
            sequences before CP sharding (real / padded; any form of
            :func:`seqpack.tensors.layout.check_offsets`, read to the host once), or a
            :class:`~seqpack.PackedLayout` as ``cu_seqlens_q``.
        vocab_parallel_rank / vocab_parallel_group / context_parallel_group: TP and CP.
        fused: compute every sequence's log-probs in one pass over the packed
            logits, one CP all-gather per call, and call ``loss_fn`` once on the whole
            ``[B, S - 1]`` micro-batch (NeMo-RL's ``SequencePackingFusionLossWrapper``);
            needs a log-prob loss (``input_type == "logprob"``).
        temperature: divide the logits by it (inside the fused kernel; no copy).

    Called as ``wrapper(next_token_logits, data, global_valid_seqs,
    global_valid_toks)``; with ``fused=True`` also as ``wrapper(hidden_states, data,
    global_valid_seqs, global_valid_toks, lm_head_weight=W, lm_head_bias=b)``: the
    final hidden states ``[T, H]`` and the LM head ``[V, H]`` (this rank's slice
    under TP), whose logits are never materialised
    (:func:`seqpack.linear_token_logprobs`).

    Per sequence ``i`` (``fused=False``) the logits rows ``[cu_p[i] // cp,
    cu_p[i + 1] // cp)`` and the data row trimmed to ``cu[i + 1] - cu[i]`` columns go
    through ``prepare_fn`` and ``loss_fn``; losses are summed, metrics summed except
    ``probs_ratio*_min`` / ``*_max`` (running min / max, infinities skipped).

    With a TP or CP group, every check of a call (and, fused, of its log-probs)
    runs before the first collective, inside one agreement over both groups: a
    rank whose inputs fail them, or differ from the other ranks' (the layout, the
    logits' shape, dtype and ``requires_grad``, the data's shapes, the autocast
    state), makes every rank raise instead of leaving the others waiting. It costs
    one small all-reduce per call (on NCCL a host synchronisation); ``agree=False``
    skips it where the caller knows the ranks' inputs agree.
    """

    def __init__(self, loss_fn: Callable, prepare_fn: Optional[Callable] = None, cu_seqlens_q: Any = None,
                 cu_seqlens_q_padded: Any = None, vocab_parallel_rank: Optional[int] = None,
                 vocab_parallel_group=None, context_parallel_group=None, *, fused: bool = False,
                 temperature: float = 1.0, agree: bool = True):
        if cu_seqlens_q is None:
            raise ValueError("cu_seqlens_q is required")
        _check_packable(loss_fn)
        self.loss_fn, self.prepare_fn, self.fused, self.agree = loss_fn, prepare_fn, fused, bool(agree)
        self.temperature = as_temperature(temperature)
        if isinstance(cu_seqlens_q, PackedLayout):
            layout = cu_seqlens_q
        else:
            layout = PackedLayout.from_offsets(_host_cu(cu_seqlens_q, "cu_seqlens_q"), None if cu_seqlens_q_padded is
                                               None else _host_cu(cu_seqlens_q_padded, "cu_seqlens_q_padded"))
        self.cu = layout.cu_seqlens.astype(np.int64)
        self.cu_padded = layout.cu_seqlens_padded.astype(np.int64)
        self.vocab_parallel_rank, self.vocab_parallel_group = vocab_parallel_rank, vocab_parallel_group
        self.context_parallel_group = context_parallel_group
        if not fused and not getattr(loss_fn, "splits_per_sequence", True):
            raise ValueError(f"{type(loss_fn).__name__} does not split over sequences (e.g. VAPO's "
                             "positive_example_nll_weight divides by the micro-batch's own token count): use fused=True")
        if fused and (prepare_fn is not None or not _is_logprob_loss(loss_fn)):
            raise ValueError("fused=True computes the log-probs itself: it needs a log-prob loss "
                             "(loss_fn.input_type == 'logprob') and no prepare_fn")

    def _check(self, logits, data) -> Tuple[Any, int]:
        from ..tensors._device import check_tensor

        check_tensor(logits, "next_token_logits")
        cp, _ = _group_info(self.context_parallel_group)
        rows = logits.shape[-2] if logits.dim() == 3 else logits.shape[0]
        if logits.dim() not in (2, 3) or (logits.dim() == 3 and logits.shape[0] != 1):
            raise ValueError(f"next_token_logits must be [T, V] or [1, T, V], got {tuple(logits.shape)}")
        if rows * cp != int(self.cu_padded[-1]):
            raise ValueError(f"next_token_logits has {rows} rows (x cp_size {cp}); cu_seqlens_q_padded ends at "
                             f"{int(self.cu_padded[-1])}")
        batch = len(self.cu) - 1
        ids = data.get("input_ids") if hasattr(data, "get") else None
        longest = int(np.diff(self.cu).max()) if batch else 0
        if ids is not None and getattr(ids, "dim", lambda: 0)() == 2 and ids.shape[1] < longest:
            raise ValueError(f"data['input_ids'] has {ids.shape[1]} columns but cu_seqlens_q has a sequence of "
                             f"{longest} tokens: the data rows must cover every real token")
        sizes = {k: (v.shape[0] if hasattr(v, "shape") else len(v)) for k, v in data.items()}
        wrong = {k: n for k, n in sizes.items() if n != batch}
        if wrong:
            raise ValueError(f"data must hold the {batch} sequences of cu_seqlens_q; got rows {wrong}")
        return cp, batch

    def __call__(self, next_token_logits, data, global_valid_seqs, global_valid_toks, *, lm_head_weight=None,
                 lm_head_bias=None):
        def local():  # every check that can differ between ranks, before the first collective
            cp, batch = self._check(next_token_logits, data)
            if self.fused:
                return cp, batch, self._fused_plan(next_token_logits, data, lm_head_weight, lm_head_bias)
            if lm_head_weight is not None or lm_head_bias is not None:
                raise ValueError("lm_head_weight / lm_head_bias (hidden states in, no logits) need fused=True")
            return cp, batch, None

        def facts(checked) -> Dict[str, Any]:
            shared = tensor_facts(next_token_logits)
            out = {"the packed layout (cu_seqlens_q, cu_seqlens_q_padded)": (self.cu, self.cu_padded),
                   "the shape of next_token_logits": shared["shape"], "the dtype of next_token_logits":
                   shared["dtype"], "whether next_token_logits requires grad (with grad mode on)":
                   shared["requires_grad"], "the autocast state": autocast_state(next_token_logits.device.type),
                   "the shapes of data's tensors": sorted((str(k), tuple(v.shape)) for k, v in data.items()
                                                          if hasattr(v, "shape"))}
            if checked[2] is not None:
                out.update(checked[2][1])
            return out

        # One agreement over the TP and CP groups: a rank whose checks fail, or whose
        # inputs differ from the others', makes every rank raise instead of leaving
        # the others in the log-probs' all-reduces or the CP all-gather.
        groups = groups_of(self.vocab_parallel_group, self.context_parallel_group)
        cp, batch, plan = checked_on_every_rank(local, groups, "SequencePackingLossWrapper",
                                                self.agree and bool(groups), fingerprint=facts)
        if self.fused:
            return plan[0](global_valid_seqs, global_valid_toks)
        logits = next_token_logits if next_token_logits.dim() == 3 else next_token_logits[None]
        lengths = np.diff(self.cu).tolist()
        starts = (self.cu_padded // cp).tolist()
        total, merged = None, {}
        for i in range(batch):
            seq = _slice_row(data, i, lengths[i])
            piece = logits[:, starts[i]: starts[i + 1]]
            if self.prepare_fn is None and not _is_logprob_loss(self.loss_fn):
                loss, metrics = self.loss_fn(piece, seq, global_valid_seqs, global_valid_toks,
                                             vocab_parallel_rank=self.vocab_parallel_rank,
                                             vocab_parallel_group=self.vocab_parallel_group,
                                             context_parallel_group=self.context_parallel_group)
            else:
                # Agreed once above for the whole micro-batch (layout, logits, data shapes): no
                # all-reduce per sequence.
                prepare = self.prepare_fn or (lambda **kw: prepare_loss_input(temperature=self.temperature,
                                                                              agree=False, **kw))
                loss_input, seq = prepare(logits=piece, data=seq, loss_fn=self.loss_fn,
                                          vocab_parallel_rank=self.vocab_parallel_rank,
                                          vocab_parallel_group=self.vocab_parallel_group,
                                          context_parallel_group=self.context_parallel_group)
                loss, metrics = self.loss_fn(data=seq, global_valid_seqs=global_valid_seqs,
                                             global_valid_toks=global_valid_toks, **loss_input)
            total = loss if total is None else total + loss
            _merge_metrics(merged, metrics)
        return total, merged

    def _fused_plan(self, logits, data, lm_head_weight, lm_head_bias):
        """Every check of the fused path; returns ``(finish, facts)``: ``finish(
        global_valid_seqs, global_valid_toks)`` runs the log-probs, the CP gather
        and the loss, and ``facts`` is what their collectives need every rank to
        share."""
        logits2d = logits.reshape(-1, logits.shape[-1])
        ids = data["input_ids"]
        width = ids.shape[1]
        # The packed ids through the C++ plan of this layout (real lengths cut to the
        # rows' width, as NeMo-RL's trim); its unpack maps results back to [B, S].
        layout = PackedLayout.from_offsets(np.concatenate([[0], np.cumsum(np.minimum(np.diff(self.cu), width))]),
                                           self.cu_padded)
        packed = pack_to_layout({"input_ids": ids}, layout)
        cp_size, cp_rank = _group_info(self.context_parallel_group)
        entropy = bool(getattr(self.loss_fn, "needs_entropy", False))
        run, facts = _rows_plan(logits2d, lm_head_weight, lm_head_bias, self.vocab_parallel_rank, packed["input_ids"],
                                PackedLayout(layout.cu_seqlens, layout.cu_seqlens_padded, cp_size=cp_size,
                                             cp_rank=cp_rank), None, return_entropy=entropy,
                                temperature=self.temperature, cp_size=cp_size, cp_rank=cp_rank,
                                vocab_parallel_group=self.vocab_parallel_group)

        def finish(global_valid_seqs, global_valid_toks):
            lp, ent = run()
            if cp_size > 1:  # agreed: lp's rows, dtype and requires_grad follow the logits'
                lp = gather_cp(lp, layout.cu_seqlens_padded, self.context_parallel_group, agree=False)
                if ent is not None:
                    ent = gather_cp(ent, layout.cu_seqlens_padded, self.context_parallel_group, agree=False)
            # A row's log-prob is its next token's: [B, S] -> NeMo-RL's [B, S - 1] (0 past
            # each sequence's last real token, where the packed values are 0 already).
            loss_input = {"next_token_logprobs": packed.unpack(lp)[:, :-1]}
            if ent is not None:
                loss_input["next_token_entropy"] = packed.unpack(ent)[:, :-1]
            return self.loss_fn(data=data, global_valid_seqs=global_valid_seqs, global_valid_toks=global_valid_toks,
                                **loss_input)

        return finish, facts


def _slice_row(data: Mapping[str, Any], i: int, length: int):
    """Row ``i`` of every value, 2-D+ tensors cut to ``length`` columns (NeMo-RL's trim)."""
    out = {}
    for key, v in data.items():
        row = v[i: i + 1]
        if hasattr(row, "dim") and row.dim() > 1 and row.shape[1] > 1:
            row = row[:, :length]
        out[key] = row
    return type(data)(out) if isinstance(data, UserDict) else out  # keeps a BatchedDataDict one


def _merge_metrics(acc: Dict[str, float], metrics: Mapping[str, Any]) -> None:
    for key, value in metrics.items():
        if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
            value = value.item()
        if key in MIN_KEYS:
            if not (isinstance(value, float) and math.isinf(value)):
                acc[key] = min(acc.get(key, math.inf), value)
            else:
                acc.setdefault(key, math.inf)
        elif key in MAX_KEYS:
            if not (isinstance(value, float) and math.isinf(value)):
                acc[key] = max(acc.get(key, -math.inf), value)
            else:
                acc.setdefault(key, -math.inf)
        else:
            acc[key] = acc.get(key, 0) + value
