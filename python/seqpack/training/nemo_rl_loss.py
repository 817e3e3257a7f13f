"""NeMo-RL's losses and their normalisation, on unpacked micro-batches: the
policy-gradient loss (``ClippedPGLoss``, NeMo-RL's current ``ClippedPGLossFn``), the
SFT loss (``NLLLoss``), the KL estimators, masked means and segment reductions over a
packed stream. :mod:`seqpack.training.loss` runs them on packed logits (its
``SequencePackingLossWrapper``) and re-exports every name here.

Why summing is right: every loss here divides by **global** counts
(``global_valid_toks`` = masked tokens, ``global_valid_seqs`` = valid sequences
of the whole optimizer step, summed over data-parallel ranks). A masked token
mean over the step is then ``sum_t loss_t / N``, which splits into any
partition of the tokens - per sequence, per micro-batch - whose parts simply
add. Losses that couple sequences of a batch (DPO and other preference losses
pair chosen/rejected rows) do not split this way: the wrapper runs them only fused,
one call per micro-batch, which must hold each pair whole.

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
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Tuple

import numpy as np

from .._equality import ValueEquality
from .._lengths import as_real
from ..tensors.layout import host_offsets

from .loss_config import LossConfigError, cfg_real, check_config

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "ClippedPGLoss",
    "LossConfigError",
    "LossType",
    "MetricNormalization",
    "PG_DEFAULTS",
    "NLLLoss",
    "calculate_kl",
    "clipped_pg_loss",
    "masked_mean",
    "nll_loss",
    "pg_config",
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


MIN_KEYS = {"probs_ratio_min", "probs_ratio_clamped_min", "values_min"}
MAX_KEYS = {"probs_ratio_max", "probs_ratio_clamped_max", "values_max"}


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
        c[key] = cfg_real(c, key, minimum=0)
    if c["ratio_clip_c"] is not None:
        c["ratio_clip_c"] = cfg_real(c, "ratio_clip_c", minimum=1, minimum_inclusive=False,
                                      rule="> 1 (the dual-clip bound), a finite number")
    check_config(c["reference_policy_kl_type"] in ("k1", "k2", "k3"),
           f"cfg['reference_policy_kl_type'] must be 'k1', 'k2' or 'k3', got {c['reference_policy_kl_type']!r}")
    if c["sequence_level_importance_ratios"]:
        check_config(not c["token_level_loss"], "sequence_level_importance_ratios (GSPO) is mutually exclusive with "
                                          "token-level loss: set token_level_loss to False")
    if c["use_cispo"]:
        for key, bad in (("disable_ppo_ratio", True), ("force_on_policy_ratio", True),
                         ("sequence_level_importance_ratios", True), ("token_level_loss", False)):
            check_config(bool(c[key]) != bad, f"use_cispo is incompatible with {key}={c[key]!r}")
        check_config(c["ratio_clip_c"] is None, "use_cispo is incompatible with ratio_clip_c (dual clip)")
    for key in ("kl_input_clamp_value", "kl_output_clamp_value"):  # None: no clamp
        if c[key] is not None:
            c[key] = cfg_real(c, key, minimum=0, finite=False)
    for key in ("truncated_importance_sampling_ratio", "truncated_importance_sampling_ratio_min"):
        if c[key] is not None:
            c[key] = cfg_real(c, key, minimum=0, minimum_inclusive=False, rule="positive (a finite number > 0)")
    kind, hi, lo = (c["truncated_importance_sampling_type"], c["truncated_importance_sampling_ratio"],
                    c["truncated_importance_sampling_ratio_min"])
    if kind is None:
        check_config(hi is None, "truncated_importance_sampling_ratio needs a truncated_importance_sampling_type "
                           f"(one of {', '.join(_TIS_TYPES)})")
    else:
        check_config(c["use_importance_sampling_correction"],
               "truncated importance sampling needs use_importance_sampling_correction=True")
        check_config(kind in _TIS_TYPES, f"truncated_importance_sampling_type must be one of {_TIS_TYPES}, got {kind!r}")
        check_config(hi is not None and hi > 0, f"truncated_importance_sampling_ratio should be positive, got {hi!r}")
        if lo is not None:
            check_config(lo <= hi, "truncated_importance_sampling_ratio_min must be <= truncated_importance_sampling_ratio")
        if kind in ("icepop", "seq-mask-tis"):
            check_config(lo is not None, f"truncated_importance_sampling_type={kind!r} needs "
                                   "truncated_importance_sampling_ratio_min")
        if kind == "seq-mask-tis":
            check_config(not c["sequence_level_importance_ratios"], "seq-mask-tis is incompatible with "
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
