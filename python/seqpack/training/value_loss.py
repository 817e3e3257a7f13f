"""NeMo-RL's value loss (``MseValueLossFn``, PPO's critic): half the masked mean
squared error between the value head's outputs and the returns, optionally with
PPO's value clipping, normalised by the step's global valid tokens so it adds up
over micro-batches and sequences.

    vf_loss = 0.5 * scale * masked_mean(max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2), mask)
                                         ^ without cliprange: (v - R)^2 alone

``data`` is NeMo-RL's, unpacked: ``returns`` (and ``values``, the old values, with
clipping), ``token_mask`` ``[B, S]`` and ``sample_mask`` ``[B]``; the values are
the value head's outputs ``[B, S]`` or ``[B, S, 1]``, one per token (not shifted).
It is an ``input_type = "logit"`` loss: ``SequencePackingLossWrapper`` hands it each
packed sequence's rows of the value head's output.

    >>> import torch
    >>> from seqpack.loss import MseValueLoss
    >>> data = {"returns": torch.tensor([[1.0, 2.0]]), "token_mask": torch.ones(1, 2), "sample_mask": torch.ones(1)}
    >>> loss, metrics = MseValueLoss({"scale": 2.0})(torch.tensor([[0.0, 2.0]]), data, 1, 2)
    >>> round(loss.item(), 4)   # 0.5 * 2 * ((0 - 1)^2 + 0) / 2
    0.5
"""

from __future__ import annotations

import math
from typing import Any, Dict, Mapping, Optional, Tuple

from .._equality import ValueEquality
from .loss_config import cfg_real, known_keys
from .nemo_rl_loss import LossType, MetricNormalization, masked_mean

__all__ = ["MseValueLoss", "VALUE_LOSS_DEFAULTS"]

# NeMo-RL's MseValueLossConfig: its keys and defaults.
VALUE_LOSS_DEFAULTS: Dict[str, Any] = {"scale": 1.0, "cliprange": None}


def value_loss_config(cfg: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """``cfg`` over :data:`VALUE_LOSS_DEFAULTS`, validated: an unknown key (NeMo-RL's
    config forbids extras) or a value that is not a finite real number raises
    :class:`LossConfigError` naming the key."""
    c = known_keys(cfg, VALUE_LOSS_DEFAULTS, "MseValueLossFn")
    c["scale"] = cfg_real(c, "scale")
    if c["cliprange"] is not None:
        c["cliprange"] = cfg_real(c, "cliprange")  # NeMo-RL clips only when it is > 0
    return c


class MseValueLoss(ValueEquality):
    """NeMo-RL's ``MseValueLossFn``: ``cfg`` keys ``scale`` (default 1.0) and
    ``cliprange`` (default None: no clipping; clipping when it is > 0, as NeMo-RL).

    Called as NeMo-RL calls it, ``loss_fn(values, data, global_valid_seqs,
    global_valid_toks)``, returns ``(loss, metrics)`` with NeMo-RL's metrics:
    ``loss``, ``vf_clipfrac``, ``returns_mean``, ``values_mean``, ``values_min``,
    ``values_max`` (of the masked values; +inf / -inf when none), ``returns_sq_mean``,
    ``residual_sq_mean`` (the explained variance's sufficient statistics) and
    ``num_valid_samples``. Means divide by ``global_valid_toks``, so they add up
    over micro-batches; :class:`~seqpack.SequencePackingLossWrapper` merges
    ``values_min`` / ``values_max`` as running extrema, skipping the infinities of
    sequences without a valid token (a micro-batch with none reports them). Values
    sharded by context parallelism are refused: gather them first.
    """

    input_type = "logit"
    loss_type = LossType.TOKEN_LEVEL
    metric_normalizations = {
        "loss": MetricNormalization.TOKENS, "vf_clipfrac": MetricNormalization.TOKENS,
        "returns_mean": MetricNormalization.TOKENS, "values_mean": MetricNormalization.TOKENS,
        "returns_sq_mean": MetricNormalization.TOKENS, "residual_sq_mean": MetricNormalization.TOKENS,
        "values_min": MetricNormalization.NONE, "values_max": MetricNormalization.NONE,
        "num_valid_samples": MetricNormalization.NONE}

    def __init__(self, cfg: Optional[Mapping[str, Any]] = None):
        self.cfg = value_loss_config(cfg)
        self.scale, self.cliprange = self.cfg["scale"], self.cfg["cliprange"]

    def __call__(self, logits, data: Mapping[str, Any], global_valid_seqs: Any, global_valid_toks: Any,
                 context_parallel_group: Any = None, **_: Any) -> Tuple[Any, Dict[str, Any]]:
        import torch

        from .._dist import active

        if context_parallel_group is not None and active(context_parallel_group):
            raise ValueError("MseValueLoss needs every token's value: gather the context-parallel shards of the "
                             "value head's output first")
        values = logits.squeeze(-1) if logits.dim() > 2 and logits.shape[-1] == 1 else logits
        returns = data["returns"]
        if values.dim() != 2 or values.shape[0] != returns.shape[0] or values.shape[1] < returns.shape[1]:
            raise ValueError(f"the values must be [B, S] (or [B, S, 1]) covering data['returns'] "
                             f"{tuple(returns.shape)}, got {tuple(logits.shape)}")
        values = values[:, :returns.shape[1]]  # a packed sequence's rows padded past its tokens
        mask = data["token_mask"][:, :returns.shape[1]] * data["sample_mask"][:, None]

        def mean(x):
            return masked_mean(x, mask, global_normalization_factor=global_valid_toks)

        unclipped = (values - returns) ** 2
        if self.cliprange is not None and self.cliprange > 0:
            old = data["values"][:, :returns.shape[1]]
            clipped = (torch.clamp(values, old - self.cliprange, old + self.cliprange) - returns) ** 2
            loss = 0.5 * self.scale * mean(torch.maximum(unclipped, clipped))
            clipfrac = mean((clipped > unclipped).to(values.dtype)).item()
        else:
            loss = 0.5 * self.scale * mean(unclipped)
            clipfrac = 0.0
        with torch.no_grad():
            chosen = values[mask.bool()]
            metrics = {
                "loss": float(loss.item()), "vf_clipfrac": clipfrac,
                "returns_mean": mean(returns).item(), "values_mean": mean(values).item(),
                # NeMo-RL's sentinels when nothing is valid: +/-inf, which the wrapper skips
                "values_min": chosen.min().item() if chosen.numel() else math.inf,
                "values_max": chosen.max().item() if chosen.numel() else -math.inf,
                "returns_sq_mean": mean(returns ** 2).item(),
                "residual_sq_mean": mean((returns - values) ** 2).item(),
                "num_valid_samples": int(values.shape[0]),
            }
        return loss, metrics
