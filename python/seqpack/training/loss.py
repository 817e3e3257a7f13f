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

from ..tensors.cp import gather_cp
from ..tensors.layout import PackedLayout, host_offsets
from ..tensors.thd import pack_to_layout
from .logprobs import linear_token_logprobs, packed_token_logprobs

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "ClippedPGLoss",
    "LossType",
    "NLLLoss",
    "SequencePackingLossWrapper",
    "calculate_kl",
    "clipped_pg_loss",
    "masked_mean",
    "nll_loss",
    "prepare_loss_input",
    "segment_masked_mean",
    "segment_mean",
    "segment_sum",
]


class LossType:
    """NeMo-RL's ``LossType`` values (a loss's ``loss_type`` attribute)."""

    TOKEN_LEVEL = "token_level"
    SEQUENCE_LEVEL = "sequence_level"


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
                 input_clamp_value: Optional[float] = 20.0, output_clamp_value: Optional[float] = 10.0):
    """Per-token KL estimate of the policy against a reference (NeMo-RL's):
    ``k1 = -d``, ``k2 = d^2 / 2``, ``k3 = e^d - 1 - d`` with ``d = ref - logprobs``."""
    import torch

    d = logprobs_reference - logprobs
    if input_clamp_value is not None:
        d = d.clamp(-input_clamp_value, input_clamp_value)
    if kl_type == "k1":
        kl = -d
    elif kl_type == "k2":
        kl = d * d / 2
    elif kl_type == "k3":
        kl = torch.exp(d) - 1 - d
    else:
        raise ValueError(f"kl_type must be 'k1', 'k2' or 'k3', got {kl_type!r}")
    if output_clamp_value is not None:
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


def clipped_pg_loss(
    logprobs: "torch.Tensor",
    prev_logprobs: "torch.Tensor",
    advantages: "torch.Tensor",
    mask: "torch.Tensor",
    global_valid_toks: Any,
    *,
    ratio_clip_min: float = 0.2,
    ratio_clip_max: float = 0.2,
    ratio_clip_c: Optional[float] = None,
    reference_logprobs: Optional["torch.Tensor"] = None,
    kl_penalty: float = 0.0,
    kl_type: str = "k3",
    kl_input_clamp_value: Optional[float] = 20.0,
    kl_output_clamp_value: Optional[float] = 10.0,
    generation_logprobs: Optional["torch.Tensor"] = None,
    use_importance_sampling_correction: bool = False,
    use_on_policy_kl_approximation: bool = False,
    disable_ppo_ratio: bool = False,
    force_on_policy_ratio: bool = False,
    entropy: Optional["torch.Tensor"] = None,
    entropy_coef: float = 0.0,
    sequence_mean: Optional[Tuple[Any, "torch.Tensor", Any]] = None,
) -> Tuple["torch.Tensor", Dict[str, float]]:
    """PPO / GRPO clipped surrogate (+ dual clip, KL to a reference, importance
    sampling correction, entropy bonus), NeMo-RL's formulas, on tensors of any
    shape (the packed stream ``[T]`` or ``[B, S - 1]``).

    Token level (default): ``sum_t (loss_t * mask_t) / global_valid_toks``.
    ``sequence_mean=(segments, sample_mask, global_valid_seqs)`` gives the
    sequence-level mean of per-sequence token means instead, with ``segments``
    the packed ``cu_seqlens`` (for ``[T]``) or ``None`` (rows of ``[B, S - 1]``).
    """
    import torch

    def reduce(x):
        if sequence_mean is None:
            return masked_mean(x, mask, global_normalization_factor=global_valid_toks)
        segments, sample_mask, global_valid_seqs = sequence_mean
        per_seq = masked_mean(x, mask, dim=-1) if segments is None else segment_masked_mean(x, mask, segments)
        return masked_mean(per_seq, sample_mask, global_normalization_factor=global_valid_seqs)

    if use_importance_sampling_correction or use_on_policy_kl_approximation:
        if generation_logprobs is None:
            raise ValueError("generation_logprobs are needed for importance sampling / the on-policy KL approximation")
    kl = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    if kl_penalty:
        if reference_logprobs is None:
            raise ValueError("reference_logprobs are needed when kl_penalty != 0")
        weight = _finite(torch.exp(logprobs - generation_logprobs)).detach() if use_on_policy_kl_approximation else 1.0
        kl = reduce(weight * kl_penalty * calculate_kl(logprobs, reference_logprobs, kl_type, kl_input_clamp_value,
                                                       kl_output_clamp_value))
    if force_on_policy_ratio:
        ratios = torch.exp(logprobs - logprobs.detach())
        clamped = ratios
    elif not disable_ppo_ratio:
        ratios = torch.exp(logprobs - prev_logprobs)
        clamped = ratios.clamp(1 - ratio_clip_min, 1 + ratio_clip_max)
    else:
        ratios = clamped = logprobs
    clip_loss = torch.maximum(-advantages * ratios, -advantages * clamped)
    if ratio_clip_c is not None:
        clip_loss = torch.where(advantages < 0, torch.minimum(clip_loss, -advantages * ratio_clip_c), clip_loss)
    weights = _finite(torch.exp(prev_logprobs - generation_logprobs)).detach() \
        if use_importance_sampling_correction else None
    actor = reduce(clip_loss if weights is None else weights * clip_loss)
    loss = actor + kl
    if entropy_coef:
        if entropy is None:
            raise ValueError("entropy is needed when entropy_coef != 0")
        loss = loss - entropy_coef * reduce(entropy)
    with torch.no_grad():
        valid = mask.bool()
        picked, picked_clamped = ratios.detach()[valid], clamped.detach()[valid]
        metrics = {
            "loss": loss.item(),
            "probs_ratio": masked_mean(ratios.detach(), mask, global_normalization_factor=global_valid_toks).item(),
            "probs_ratio_clamped": masked_mean(clamped.detach(), mask,
                                               global_normalization_factor=global_valid_toks).item(),
            "probs_ratio_min": picked.min().item() if picked.numel() else math.inf,
            "probs_ratio_max": picked.max().item() if picked.numel() else -math.inf,
            "probs_ratio_clamped_min": picked_clamped.min().item() if picked.numel() else math.inf,
            "probs_ratio_clamped_max": picked_clamped.max().item() if picked.numel() else -math.inf,
            "kl_penalty": kl.item() / kl_penalty if kl_penalty else 0.0,
        }
        if generation_logprobs is not None:
            metrics["sampling_importance_ratio"] = masked_mean(
                _finite(torch.exp(prev_logprobs - generation_logprobs)), mask,
                global_normalization_factor=global_valid_toks).item()
            metrics["approx_entropy"] = -masked_mean(torch.exp(logprobs - generation_logprobs) * logprobs, mask,
                                                     global_normalization_factor=global_valid_toks).item()
        if entropy is not None:
            metrics["entropy"] = masked_mean(entropy.detach(), mask, global_normalization_factor=global_valid_toks).item()
    return loss, metrics


def _shifted(data: Mapping[str, Any], key: str):
    return data[key][:, 1:] if key in data else None


class NLLLoss:
    """SFT loss through the wrapper (NeMo-RL's ``NLLLoss`` interface)."""

    loss_type = LossType.TOKEN_LEVEL
    input_type = "logprob"

    def __call__(self, next_token_logprobs, data, global_valid_seqs, global_valid_toks, **_):
        mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
        loss, metrics = nll_loss(next_token_logprobs, mask, global_valid_toks)
        metrics["num_valid_samples"] = float(data["sample_mask"].sum().item())
        return loss, metrics


class ClippedPGLoss:
    """PPO / GRPO loss through the wrapper, configured with NeMo-RL's
    ``ClippedPGLossFn`` keys (``ratio_clip_min/max/c``,
    ``reference_policy_kl_penalty``, ``reference_policy_kl_type``,
    ``kl_input/output_clamp_value``, ``token_level_loss``, ``disable_ppo_ratio``,
    ``force_on_policy_ratio``, ``use_importance_sampling_correction``,
    ``use_on_policy_kl_approximation``) plus seqpack's ``entropy_coef``."""

    input_type = "logprob"
    _UNSUPPORTED = ("truncated_importance_sampling_ratio", "sequence_level_importance_ratios")

    def __init__(self, cfg: Mapping[str, Any]):
        for key in self._UNSUPPORTED:
            if cfg.get(key):
                raise ValueError(f"cfg[{key!r}] is not supported by seqpack's ClippedPGLoss; NeMo-RL's ClippedPGLossFn "
                                 "runs through SequencePackingLossWrapper unchanged")
        self.cfg = dict(cfg)
        self.loss_type = LossType.TOKEN_LEVEL if cfg.get("token_level_loss", True) else LossType.SEQUENCE_LEVEL
        self.needs_entropy = bool(cfg.get("entropy_coef", 0.0))

    def __call__(self, next_token_logprobs, data, global_valid_seqs, global_valid_toks, next_token_entropy=None, **_):
        c = self.cfg
        sample_mask = data["sample_mask"]
        mask = data["token_mask"][:, 1:] * sample_mask[:, None]
        sequence_mean = None if self.loss_type == LossType.TOKEN_LEVEL else (None, sample_mask, global_valid_seqs)
        loss, metrics = clipped_pg_loss(
            next_token_logprobs.float(), _shifted(data, "prev_logprobs"), _shifted(data, "advantages"), mask,
            global_valid_toks, ratio_clip_min=c.get("ratio_clip_min", 0.2), ratio_clip_max=c.get("ratio_clip_max", 0.2),
            ratio_clip_c=c.get("ratio_clip_c"), reference_logprobs=_shifted(data, "reference_policy_logprobs"),
            kl_penalty=c.get("reference_policy_kl_penalty", 0.0), kl_type=c.get("reference_policy_kl_type", "k3"),
            kl_input_clamp_value=c.get("kl_input_clamp_value", 20.0),
            kl_output_clamp_value=c.get("kl_output_clamp_value", 10.0),
            generation_logprobs=_shifted(data, "generation_logprobs"),
            use_importance_sampling_correction=c.get("use_importance_sampling_correction", False),
            use_on_policy_kl_approximation=c.get("use_on_policy_kl_approximation", False),
            disable_ppo_ratio=c.get("disable_ppo_ratio", False), force_on_policy_ratio=c.get("force_on_policy_ratio", False),
            entropy=next_token_entropy, entropy_coef=c.get("entropy_coef", 0.0), sequence_mean=sequence_mean)
        metrics["num_valid_samples"] = float(sample_mask.sum().item())
        return loss, metrics


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


def _rows_logprobs(rows, lm_head_weight, lm_head_bias, vocab_parallel_rank, *args, **kwargs):
    """:func:`packed_token_logprobs` of ``rows`` (logits), or with ``lm_head_weight``
    :func:`linear_token_logprobs` of ``rows`` (hidden states) and that head, with this
    vocabulary-parallel rank's slice start."""
    if lm_head_weight is None:
        if lm_head_bias is not None:
            raise ValueError("lm_head_bias needs lm_head_weight")
        vocab_start = (vocab_parallel_rank or 0) * rows.shape[1]
        return packed_token_logprobs(rows, *args, vocab_start=vocab_start, **kwargs)
    vocab_start = (vocab_parallel_rank or 0) * lm_head_weight.shape[0]
    return linear_token_logprobs(rows, lm_head_weight, *args, bias=lm_head_bias, vocab_start=vocab_start, **kwargs)


def prepare_loss_input(logits, data, loss_fn=None, vocab_parallel_rank=None, vocab_parallel_group=None,
                       context_parallel_group=None, temperature: float = 1.0, *, lm_head_weight=None,
                       lm_head_bias=None):
    """seqpack's default ``prepare_fn`` for one packed sequence: the fused
    log-probs of its (CP-local, vocab-local) logits, all-gathered over CP, as
    ``({"next_token_logprobs": [1, L - 1]}, data)`` (and ``next_token_entropy``
    when ``loss_fn.needs_entropy``). With ``lm_head_weight`` (``[V, H]``, this
    rank's vocabulary slice under TP; ``lm_head_bias`` optional) ``logits`` holds the
    final hidden states ``[..., H]`` instead, and the logits are never materialised
    (:func:`seqpack.linear_token_logprobs`)."""
    import torch

    logits2d = logits.reshape(-1, logits.shape[-1])
    cp, cp_rank = _group_info(context_parallel_group)
    ids = data["input_ids"][0]
    width = ids.shape[0]
    padded = logits2d.shape[0] * cp
    if padded < width:
        raise ValueError(f"the sequence's logits cover {padded} positions, its data {width}")
    packed_ids = torch.zeros(padded, dtype=ids.dtype, device=ids.device)
    packed_ids[:width] = ids
    entropy = bool(getattr(loss_fn, "needs_entropy", False))
    lp, ent = _rows_logprobs(logits2d, lm_head_weight, lm_head_bias, vocab_parallel_rank, packed_ids, [0, width],
                             [0, padded], cp_size=cp, cp_rank=cp_rank, return_entropy=entropy,
                             temperature=temperature, vocab_parallel_group=vocab_parallel_group)
    if cp > 1:
        lp = gather_cp(lp, [0, padded], context_parallel_group)
        ent = gather_cp(ent, [0, padded], context_parallel_group) if ent is not None else None
    loss_input = {"next_token_logprobs": lp[None, : width - 1]}
    if ent is not None:
        loss_input["next_token_entropy"] = ent[None, : width - 1]
    return loss_input, data


class SequencePackingLossWrapper:
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
    """

    def __init__(self, loss_fn: Callable, prepare_fn: Optional[Callable] = None, cu_seqlens_q: Any = None,
                 cu_seqlens_q_padded: Any = None, vocab_parallel_rank: Optional[int] = None,
                 vocab_parallel_group=None, context_parallel_group=None, *, fused: bool = False,
                 temperature: float = 1.0):
        if cu_seqlens_q is None:
            raise ValueError("cu_seqlens_q is required")
        _check_packable(loss_fn)
        self.loss_fn, self.prepare_fn, self.fused, self.temperature = loss_fn, prepare_fn, fused, float(temperature)
        if isinstance(cu_seqlens_q, PackedLayout):
            layout = cu_seqlens_q
        else:
            layout = PackedLayout.from_offsets(_host_cu(cu_seqlens_q, "cu_seqlens_q"), None if cu_seqlens_q_padded is
                                               None else _host_cu(cu_seqlens_q_padded, "cu_seqlens_q_padded"))
        self.cu = layout.cu_seqlens.astype(np.int64)
        self.cu_padded = layout.cu_seqlens_padded.astype(np.int64)
        self.vocab_parallel_rank, self.vocab_parallel_group = vocab_parallel_rank, vocab_parallel_group
        self.context_parallel_group = context_parallel_group
        if fused and (prepare_fn is not None or not _is_logprob_loss(loss_fn)):
            raise ValueError("fused=True computes the log-probs itself: it needs a log-prob loss "
                             "(loss_fn.input_type == 'logprob') and no prepare_fn")

    def _check(self, logits, data) -> Tuple[Any, int]:
        cp, _ = _group_info(self.context_parallel_group)
        rows = logits.shape[-2] if logits.dim() == 3 else logits.shape[0]
        if logits.dim() not in (2, 3) or (logits.dim() == 3 and logits.shape[0] != 1):
            raise ValueError(f"next_token_logits must be [T, V] or [1, T, V], got {tuple(logits.shape)}")
        if rows * cp != int(self.cu_padded[-1]):
            raise ValueError(f"next_token_logits has {rows} rows (x cp_size {cp}); cu_seqlens_q_padded ends at "
                             f"{int(self.cu_padded[-1])}")
        batch = len(self.cu) - 1
        sizes = {k: (v.shape[0] if hasattr(v, "shape") else len(v)) for k, v in data.items()}
        wrong = {k: n for k, n in sizes.items() if n != batch}
        if wrong:
            raise ValueError(f"data must hold the {batch} sequences of cu_seqlens_q; got rows {wrong}")
        return cp, batch

    def __call__(self, next_token_logits, data, global_valid_seqs, global_valid_toks, *, lm_head_weight=None,
                 lm_head_bias=None):
        cp, batch = self._check(next_token_logits, data)
        if self.fused:
            return self._fused(next_token_logits, data, global_valid_seqs, global_valid_toks, lm_head_weight,
                               lm_head_bias)
        if lm_head_weight is not None or lm_head_bias is not None:
            raise ValueError("lm_head_weight / lm_head_bias (hidden states in, no logits) need fused=True")
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
                prepare = self.prepare_fn or (lambda **kw: prepare_loss_input(temperature=self.temperature, **kw))
                loss_input, seq = prepare(logits=piece, data=seq, loss_fn=self.loss_fn,
                                          vocab_parallel_rank=self.vocab_parallel_rank,
                                          vocab_parallel_group=self.vocab_parallel_group,
                                          context_parallel_group=self.context_parallel_group)
                loss, metrics = self.loss_fn(data=seq, global_valid_seqs=global_valid_seqs,
                                             global_valid_toks=global_valid_toks, **loss_input)
            total = loss if total is None else total + loss
            _merge_metrics(merged, metrics)
        return total, merged

    def _fused(self, logits, data, global_valid_seqs, global_valid_toks, lm_head_weight, lm_head_bias):
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
        lp, ent = _rows_logprobs(logits2d, lm_head_weight, lm_head_bias, self.vocab_parallel_rank, packed["input_ids"],
                                 PackedLayout(layout.cu_seqlens, layout.cu_seqlens_padded, cp_size=cp_size,
                                              cp_rank=cp_rank), return_entropy=entropy, temperature=self.temperature,
                                 vocab_parallel_group=self.vocab_parallel_group)
        if cp_size > 1:
            lp = gather_cp(lp, layout.cu_seqlens_padded, self.context_parallel_group)
            if ent is not None:
                ent = gather_cp(ent, layout.cu_seqlens_padded, self.context_parallel_group)
        # A row's log-prob is its next token's: [B, S] -> NeMo-RL's [B, S - 1] (0 past
        # each sequence's last real token, where the packed values are 0 already).
        loss_input = {"next_token_logprobs": packed.unpack(lp)[:, :-1]}
        if ent is not None:
            loss_input["next_token_entropy"] = packed.unpack(ent)[:, :-1]
        return self.loss_fn(data=data, global_valid_seqs=global_valid_seqs, global_valid_toks=global_valid_toks,
                            **loss_input)


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
