"""NeMo-RL's preference losses: ``PreferenceLoss`` (its ``PreferenceLossFn``, a
reward model's Bradley-Terry loss) and ``DPOLoss`` (its ``DPOLossFn``: DPO with an
optional SFT term on the chosen responses).

A micro-batch holds pairs, interleaved: row ``2i`` is pair ``i``'s chosen response,
row ``2i + 1`` its rejected one::

    rows     0         1          2         3
             chosen 0  rejected 0  chosen 1  rejected 1
    reward   r_0       r_1         r_2       r_3
    loss     -log sigmoid(beta (r_0 - r_1)),  -log sigmoid(beta (r_2 - r_3))

DPO's reward of a row is ``sum_t (log pi(y_t) - log pi_ref(y_t))`` over its masked
tokens (their mean with ``preference_average_log_probs``); ``beta`` is
``reference_policy_kl_penalty``. Means divide by ``global_valid_seqs / 2`` (the
step's pairs), so micro-batches add up, provided each pair's two rows are in one
micro-batch: the loss couples them. On packed sequences it runs with
``SequencePackingLossWrapper(..., fused=True)`` (one call per micro-batch); the
per-sequence path refuses it.

Conventions (NeMo-RL's): ``next_token_logprobs [B, S - 1]``, ``token_mask`` read as
``[:, 1:]``, and ``reference_policy_logprobs`` read as ``[:, :-1]``: NeMo-RL's DPO
stores the reference log-probs rolled left by one (column ``t`` holds the log-prob
of token ``t + 1``).

    >>> import torch
    >>> from seqpack.loss import DPOLoss
    >>> data = {"token_mask": torch.tensor([[0, 1, 1], [0, 1, 1]]), "sample_mask": torch.ones(2),
    ...         "reference_policy_logprobs": torch.zeros(2, 3)}
    >>> lp = torch.tensor([[-1.0, -1.0], [-2.0, -2.0]])          # chosen more likely than rejected
    >>> loss, metrics = DPOLoss({"reference_policy_kl_penalty": 0.5})(lp, data, 2, 4)
    >>> round(loss.item(), 4), metrics["accuracy"]                  # -log sigmoid(0.5 * (-2 - -4))
    (0.3133, 1.0)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Tuple

from .._equality import ValueEquality
from .loss_config import cfg_bool, cfg_real, known_keys
from .nemo_rl_loss import LossType, MetricNormalization, masked_mean

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["DPO_DEFAULTS", "DPOLoss", "PreferenceLoss"]

# NeMo-RL's DPOLossConfig: its keys and defaults (its dpo.yaml's values).
DPO_DEFAULTS: Dict[str, Any] = {"reference_policy_kl_penalty": 0.05, "preference_loss_weight": 1.0,
                                "sft_loss_weight": 0.0, "preference_average_log_probs": False,
                                "sft_average_log_probs": False}
# The rest of NeMo-RL's ``dpo`` section, which it hands to DPOLossFn whole: the
# algorithm's keys, not the loss's (accepted, not read).
DPO_SECTION_KEYS = ("max_num_epochs", "max_num_steps", "val_period", "val_batches", "val_global_batch_size",
                    "val_micro_batch_size", "val_at_start", "val_at_end", "seed")

_SEQ = MetricNormalization.SEQUENCES


def dpo_config(cfg: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """``cfg`` (NeMo-RL's ``dpo`` section, or just its loss keys) over
    :data:`DPO_DEFAULTS`, validated: weights and ``beta`` finite reals (weights >= 0),
    the averaging flags bools; a key of neither raises
    :class:`~seqpack.loss.LossConfigError` naming it."""
    cfg = dict(cfg or {})
    for key in DPO_SECTION_KEYS:
        cfg.pop(key, None)
    c = known_keys(cfg, DPO_DEFAULTS, "DPOLossFn (or NeMo-RL dpo section)")
    c["reference_policy_kl_penalty"] = cfg_real(c, "reference_policy_kl_penalty")
    for key in ("preference_loss_weight", "sft_loss_weight"):
        c[key] = cfg_real(c, key, minimum=0)
    for key in ("preference_average_log_probs", "sft_average_log_probs"):
        c[key] = cfg_bool(c, key)
    return c


def _pairs(values: "torch.Tensor", name: str) -> Tuple["torch.Tensor", "torch.Tensor"]:
    """(chosen, rejected): rows ``[::2]`` and ``[1::2]``; an odd row count raises."""
    if values.shape[0] % 2:
        raise ValueError(f"{name} has {values.shape[0]} rows: a preference micro-batch holds (chosen, rejected) "
                         "pairs, interleaved, so an even number (keep each pair's rows in one micro-batch)")
    return values[::2], values[1::2]


class PreferenceLoss(ValueEquality):
    """NeMo-RL's ``PreferenceLossFn``: a reward model's pairwise loss on its rewards
    ``[B]`` (or ``[B, 1]``), rows interleaved chosen / rejected:
    ``-log sigmoid(r_chosen - r_rejected)`` averaged over the step's pairs
    (``global_valid_seqs / 2``), with NeMo-RL's metrics ``loss``, ``accuracy``,
    ``rewards_chosen_mean``, ``rewards_rejected_mean`` and ``num_valid_samples``
    (pairs). Called as ``loss_fn(rewards, data, global_valid_seqs, global_valid_toks)``."""

    input_type = "logit"
    loss_type = LossType.SEQUENCE_LEVEL
    batch_coupled = True  # chosen / rejected rows: the whole micro-batch in one call
    splits_per_sequence = False
    metric_normalizations = {"loss": _SEQ, "accuracy": _SEQ, "rewards_chosen_mean": _SEQ,
                             "rewards_rejected_mean": _SEQ, "num_valid_samples": MetricNormalization.NONE}

    @staticmethod
    def split_output_tensor(tensor: "torch.Tensor") -> Tuple["torch.Tensor", "torch.Tensor"]:
        """``(tensor[::2], tensor[1::2])``: the chosen rows and the rejected ones."""
        return _pairs(tensor, "the tensor")

    @staticmethod
    def _preference_loss(rewards: "torch.Tensor", sample_mask: "torch.Tensor", global_valid_seqs: Any,
                         beta: float = 1.0):
        import torch

        chosen, rejected = _pairs(rewards, "rewards")
        mask_c, mask_r = _pairs(sample_mask, "data['sample_mask']")
        pairs = global_valid_seqs / 2

        def mean(x, mask):
            return masked_mean(x, mask, global_normalization_factor=pairs)

        per_pair = -torch.nn.functional.logsigmoid(beta * (chosen - rejected)) * mask_c
        return (mean(per_pair, mask_c), mean((chosen > rejected).to(rewards.dtype), mask_c), mean(chosen, mask_c),
                mean(rejected, mask_r))

    def __call__(self, rewards, data: Mapping[str, Any], global_valid_seqs: Any, global_valid_toks: Any = None,
                 **_: Any) -> Tuple[Any, Dict[str, Any]]:
        rewards = rewards.squeeze(-1) if rewards.dim() > 1 else rewards
        sample_mask = data["sample_mask"]
        loss, accuracy, chosen, rejected = self._preference_loss(rewards, sample_mask, global_valid_seqs)
        return loss, {"loss": loss.item(), "accuracy": accuracy.item(), "rewards_chosen_mean": chosen.item(),
                      "rewards_rejected_mean": rejected.item(), "num_valid_samples": (sample_mask.sum() / 2).item()}


class DPOLoss(PreferenceLoss):
    """NeMo-RL's ``DPOLossFn``: ``w_p * L_pref + w_s * L_sft``.

    ``cfg`` keys (NeMo-RL's ``dpo`` section may be passed whole):
    ``reference_policy_kl_penalty`` (beta, default 0.05), ``preference_loss_weight``
    (1.0), ``sft_loss_weight`` (0.0), ``preference_average_log_probs`` and
    ``sft_average_log_probs`` (False: sums over tokens). The SFT term is the chosen
    rows' summed (or averaged) negative log-likelihood, averaged over the step's
    pairs. Called as ``loss_fn(next_token_logprobs, data, global_valid_seqs,
    global_valid_toks)``; metrics ``loss``, ``sft_loss``, ``preference_loss``,
    ``accuracy``, ``rewards_chosen_mean``, ``rewards_rejected_mean`` (rewards before
    beta) and ``num_valid_samples`` (pairs).
    """

    input_type = "logprob"
    metric_normalizations = {"loss": _SEQ, "sft_loss": _SEQ, "preference_loss": _SEQ, "accuracy": _SEQ,
                             "rewards_chosen_mean": _SEQ, "rewards_rejected_mean": _SEQ,
                             "num_valid_samples": MetricNormalization.NONE}

    def __init__(self, cfg: Optional[Mapping[str, Any]] = None):
        self.cfg = dpo_config(cfg)
        self.reference_policy_kl_penalty = self.cfg["reference_policy_kl_penalty"]
        self.preference_loss_weight = self.cfg["preference_loss_weight"]
        self.sft_loss_weight = self.cfg["sft_loss_weight"]
        self.preference_average_log_probs = self.cfg["preference_average_log_probs"]
        self.sft_average_log_probs = self.cfg["sft_average_log_probs"]

    def __call__(self, next_token_logprobs, data: Mapping[str, Any], global_valid_seqs: Any,
                 global_valid_toks: Any = None, **_: Any) -> Tuple[Any, Dict[str, Any]]:
        import torch

        lp = next_token_logprobs
        token_mask = data["token_mask"][:, 1:][:, : lp.shape[1]].to(lp.dtype)
        sample_mask = data["sample_mask"]
        if lp.dim() != 2 or token_mask.shape != lp.shape:
            raise ValueError(f"next_token_logprobs must be [B, S - 1] = {tuple(token_mask.shape)} (data's "
                             f"token_mask[:, 1:]), got {tuple(lp.shape)}")
        pairs = global_valid_seqs / 2
        sft = torch.zeros((), dtype=lp.dtype, device=lp.device)
        if self.sft_loss_weight > 0:
            if global_valid_toks is None:
                raise ValueError("global_valid_toks must be provided for the SFT loss (sft_loss_weight > 0)")
            mask = token_mask * sample_mask[:, None]
            per_row = -(lp * mask).sum(-1)
            if self.sft_average_log_probs:
                per_row = per_row / mask.sum(-1).clamp(min=1)
            sft = masked_mean(_pairs(per_row, "next_token_logprobs")[0], _pairs(sample_mask, "sample_mask")[0],
                              global_normalization_factor=pairs)
        if "reference_policy_logprobs" not in data:
            raise ValueError("data['reference_policy_logprobs'] is required (the reference policy's log-probs, "
                             "rolled left by one as NeMo-RL's DPO stores them)")
        ref = data["reference_policy_logprobs"][:, :-1][:, : lp.shape[1]].to(lp.dtype)
        rewards = ((lp - ref) * token_mask).sum(-1)
        if self.preference_average_log_probs:
            rewards = rewards / token_mask.sum(-1).clamp(min=1)
        preference, accuracy, chosen, rejected = self._preference_loss(rewards, sample_mask, global_valid_seqs,
                                                                       self.reference_policy_kl_penalty)
        loss = self.sft_loss_weight * sft + self.preference_loss_weight * preference
        return loss, {"loss": loss.item(), "sft_loss": sft.item(), "preference_loss": preference.item(),
                      "accuracy": accuracy.item(), "rewards_chosen_mean": chosen.item(),
                      "rewards_rejected_mean": rejected.item(),
                      "num_valid_samples": (sample_mask.sum() / 2).item()}
