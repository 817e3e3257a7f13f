"""NeMo-RL's top-k distillation loss (``DistillationLossFn``) and its input, fused:
the student's log-probs at the teacher's top-k token ids come from one
log-sum-exp per position (:func:`~seqpack.training.logprobs_columns.column_logprobs`),
never a ``[T, V]`` log-softmax.

Per position ``t`` the teacher gives its top-k ids ``I_t`` and their logits; the
teacher's distribution is their softmax ``q``. The student's ``p`` at ``I_t`` is

- ``zero_outside_topk=False``: the softmax of its logits restricted to ``I_t``
  (renormalised over the k ids), and the KL is over those k ids;
- ``zero_outside_topk=True``: its full-vocabulary probabilities at ``I_t``; the
  teacher is taken as zero outside ``I_t`` (log ``-100``), so the reverse KL gains
  the rest of the vocabulary's term ``H_rest + 100 * P_rest`` (with ``H_all =
  sum_v p_v log p_v`` over the whole vocabulary: minus the entropy).

::

    forward  KL(q || p) = sum_k q_k (log q_k - log p_k)
    reverse  KL(p || q) = sum_k p_k (log p_k - log q_k)  [+ H_rest + 100 P_rest]
    mixed    w * forward + (1 - w) * reverse                (w = mixed_kl_weight)

Positions align as NeMo-RL's: the student's logits and the teacher's top-k at
position ``s`` both predict token ``s + 1``; the last position is dropped
(``[B, S - 1, k]``) and ``token_mask[:, 1:] * sample_mask`` masks the mean, divided
by ``global_valid_toks``.

    >>> import torch
    >>> from seqpack.loss import DistillationLoss
    >>> lp = torch.log(torch.tensor([[[0.5, 0.5]]]))                 # student = teacher
    >>> data = {"input_ids": torch.zeros(1, 2, dtype=torch.long), "token_mask": torch.ones(1, 2),
    ...         "sample_mask": torch.ones(1)}
    >>> loss, metrics = DistillationLoss({"kl_type": "mixed"})(lp, lp, None, data, 1, 1)
    >>> round(loss.item(), 6), metrics["num_valid_samples"]
    (0.0, 1)

The cross-tokenizer loss (NeMo-RL's ``DISTILLATION_CROSS_TOKENIZER``: a teacher with
another vocabulary, its full logits projected onto the student's through token
alignment matrices) is not implemented: its config keys raise
:class:`~seqpack.loss.LossConfigError` saying so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Tuple

from .._equality import ValueEquality
from .loss_config import LossConfigError, cfg_bool, cfg_real, check_config, known_keys
from .nemo_rl_loss import LossType, MetricNormalization, masked_mean

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["DISTILLATION_DEFAULTS", "DistillationLoss", "distillation_topk_logprobs"]

# NeMo-RL's DistillationLossConfig: its keys, with the defaults of its distillation recipes.
DISTILLATION_DEFAULTS: Dict[str, Any] = {"kl_type": "mixed", "mixed_kl_weight": 0.5, "zero_outside_topk": False}
KL_TYPES = ("forward", "reverse", "mixed")
LOG_INFINITESIMAL = -100.0  # NeMo-RL's log-probability of the teacher outside its top-k

# Keys of NeMo-RL's cross-tokenizer distillation, which seqpack does not implement.
_CROSS_TOKENIZER_KEYS = ("projection_matrix_paths", "kd_loss_mode", "cross_tokenizer", "xtoken")


def distillation_config(cfg: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """``cfg`` over :data:`DISTILLATION_DEFAULTS`, validated as NeMo-RL validates it:
    ``kl_type`` one of forward / reverse / mixed, ``mixed_kl_weight`` in [0, 1],
    ``zero_outside_topk`` a bool; an unknown key raises :class:`LossConfigError`
    naming it (a cross-tokenizer key says that loss is not implemented)."""
    for key in dict(cfg or {}):
        if any(part in str(key) for part in _CROSS_TOKENIZER_KEYS):
            raise LossConfigError(
                f"cfg[{key!r}] belongs to NeMo-RL's cross-tokenizer distillation, which seqpack does not implement "
                "(it needs the teacher's full logits and token-alignment projection matrices between the two "
                "vocabularies); DistillationLoss is the same-tokenizer top-k loss")
    c = known_keys(cfg, DISTILLATION_DEFAULTS, "DistillationLossFn")
    check_config(c["kl_type"] in KL_TYPES, f"cfg['kl_type'] must be one of {', '.join(KL_TYPES)} (Invalid KL type), "
                                     f"got {c['kl_type']!r}")
    c["mixed_kl_weight"] = cfg_real(c, "mixed_kl_weight", minimum=0, maximum=1)
    c["zero_outside_topk"] = cfg_bool(c, "zero_outside_topk")
    return c


def distillation_per_token_kl(student_topk_logprobs: "torch.Tensor", teacher_topk_logprobs: "torch.Tensor",
                              H_all: Optional["torch.Tensor"], kl_type: str, mixed_kl_weight: float,
                              zero_outside_topk: bool) -> "torch.Tensor":
    """The KL of every position ``[..., k] -> [...]`` (see the module's formulas)."""
    p, q = student_topk_logprobs.exp(), teacher_topk_logprobs.exp()
    forward = q * (teacher_topk_logprobs - student_topk_logprobs)
    reverse = p * (student_topk_logprobs - teacher_topk_logprobs)
    w = mixed_kl_weight
    kl = {"forward": forward, "reverse": reverse}.get(kl_type)
    if kl is None:
        kl = w * forward + (1.0 - w) * reverse
    kl = kl.sum(-1)
    if zero_outside_topk and kl_type != "forward":
        if H_all is None:
            raise ValueError("H_all (sum p log p over the whole vocabulary) is required with zero_outside_topk and a "
                             f"{kl_type!r} KL")
        h_rest = H_all - (p * student_topk_logprobs).sum(-1)
        p_rest = 1.0 - p.sum(-1)
        correction = h_rest - LOG_INFINITESIMAL * p_rest
        kl = kl + (correction * (1.0 - w) if kl_type == "mixed" else correction)
    return kl


class DistillationLoss(ValueEquality):
    """NeMo-RL's ``DistillationLossFn``: ``cfg`` keys ``kl_type`` (forward, reverse
    or mixed; default mixed), ``mixed_kl_weight`` (default 0.5) and
    ``zero_outside_topk`` (default False); see the module for what they compute.

    Called as NeMo-RL calls it, ``loss_fn(student_topk_logprobs,
    teacher_topk_logprobs, H_all, data, global_valid_seqs, global_valid_toks)``
    with ``[B, S - 1, k]`` log-probs (and ``H_all [B, S - 1]`` where
    :attr:`calculate_entropy`), returns ``(loss, {"loss", "num_valid_samples"})``.
    :func:`seqpack.loss.prepare_loss_input` and :class:`~seqpack.SequencePackingLossWrapper`
    build those inputs from the student's logits (or hidden states and LM head) and
    ``data["teacher_topk_logits"]`` / ``data["teacher_topk_indices"]`` ``[B, S, k]``:
    its ``input_type`` is ``"distillation"``.
    """

    input_type = "distillation"
    loss_type = LossType.TOKEN_LEVEL
    metric_normalizations = {"loss": MetricNormalization.TOKENS, "num_valid_samples": MetricNormalization.NONE}
    log_infinitesimal = LOG_INFINITESIMAL

    def __init__(self, cfg: Optional[Mapping[str, Any]] = None):
        self.cfg = distillation_config(cfg)
        self.kl_type, self.mixed_kl_weight = self.cfg["kl_type"], self.cfg["mixed_kl_weight"]
        self.zero_outside_topk = self.cfg["zero_outside_topk"]

    @property
    def calculate_entropy(self) -> bool:
        """Whether the loss reads ``H_all`` (zero_outside_topk with a reverse part)."""
        return self.zero_outside_topk and self.kl_type != "forward"

    def __call__(self, student_topk_logprobs, teacher_topk_logprobs, H_all, data: Mapping[str, Any],
                 global_valid_seqs: Any, global_valid_toks: Any, **_: Any) -> Tuple[Any, Dict[str, Any]]:
        if student_topk_logprobs.shape != teacher_topk_logprobs.shape:
            raise ValueError(f"student_topk_logprobs {tuple(student_topk_logprobs.shape)} and teacher_topk_logprobs "
                             f"{tuple(teacher_topk_logprobs.shape)} must have one shape [B, S - 1, k]")
        kl = distillation_per_token_kl(student_topk_logprobs, teacher_topk_logprobs, H_all, self.kl_type,
                                       self.mixed_kl_weight, self.zero_outside_topk)
        if "token_mask" in data and "sample_mask" in data:
            mask = data["token_mask"][:, 1:][:, : kl.shape[1]] * data["sample_mask"][:, None]
            loss = masked_mean(kl, mask, global_normalization_factor=global_valid_toks)
        else:
            loss = kl.mean()
        return loss, {"loss": float(loss.item()), "num_valid_samples": int(data["input_ids"].shape[0])}


# ---------------------------------------------------------------- the loss input


def check_teacher(data: Mapping[str, Any], batch: int, width: int) -> Tuple["torch.Tensor", "torch.Tensor"]:
    """``data``'s ``teacher_topk_logits`` (floating) and ``teacher_topk_indices``
    (integer), both ``[batch, >= width, k]`` with ``k > 0``; named errors."""
    for key in ("teacher_topk_logits", "teacher_topk_indices"):
        if key not in data:
            raise ValueError(f"data[{key!r}] is required by the distillation loss ([B, S, k] teacher top-k)")
    logits, ids = data["teacher_topk_logits"], data["teacher_topk_indices"]
    if ids.dim() != 3 or ids.shape[-1] <= 0:
        raise ValueError(f"topk must be positive: data['teacher_topk_indices'] must be [B, S, k] with k > 0, got "
                         f"{tuple(ids.shape)} (topk=0 is not supported)")
    if logits.shape != ids.shape:
        raise ValueError(f"data['teacher_topk_logits'] {tuple(logits.shape)} and data['teacher_topk_indices'] "
                         f"{tuple(ids.shape)} must have one shape [B, S, k]")
    if ids.shape[0] != batch or ids.shape[1] < width:
        raise ValueError(f"the teacher's top-k must cover data['input_ids'] [{batch}, {width}], got "
                         f"{tuple(ids.shape[:2])}")
    if not logits.dtype.is_floating_point or ids.dtype.is_floating_point:
        raise TypeError(f"teacher_topk_logits must be floating point and teacher_topk_indices integer, got "
                        f"{logits.dtype} and {ids.dtype}")
    return logits, ids


def teacher_topk_logprobs(teacher_topk_logits: "torch.Tensor", like: "torch.Tensor", width: int) -> "torch.Tensor":
    """The teacher's log-softmax over its k logits, in ``like``'s dtype and device,
    aligned to next-token predictions: ``[B, width - 1, k]``."""
    import torch

    t = teacher_topk_logits[:, : width - 1].to(device=like.device, dtype=like.dtype)
    return torch.log_softmax(t, dim=-1)


def distillation_topk_logprobs(rows: "torch.Tensor", columns: "torch.Tensor", *, zero_outside_topk: bool,
                               calculate_entropy: bool, temperature: float = 1.0, vocab_parallel_group: Any = None,
                               vocab_start: Optional[int] = None, lm_head_weight: Optional["torch.Tensor"] = None,
                               lm_head_bias: Optional["torch.Tensor"] = None
                               ) -> Tuple["torch.Tensor", Optional["torch.Tensor"]]:
    """The student's side of the loss on ``rows`` (logits ``[N, V_local]``, or hidden
    states ``[N, H]`` with ``lm_head_weight [V, H]``) at ``columns [N, k]`` (global
    ids, -1: none): ``(log-probs [N, k], H_all [N] or None)``.

    ``zero_outside_topk``: full-vocabulary log-probs (one log-sum-exp per row, with
    the row's entropy when ``calculate_entropy``: ``H_all = -entropy``); otherwise
    the log-softmax of the k gathered logits (with the LM head, k dot products per
    row). Vocabulary-parallel logits go through
    :func:`~seqpack.training.logprobs_columns_tp.vocab_parallel_column_logprobs` /
    :func:`~seqpack.loss.vocab_parallel_gather_columns`, an LM head split over a TP
    group through :mod:`~seqpack.training.logprobs_columns_tp`."""
    from .._dist import active
    from ._columns import subset_log_softmax
    from .logprobs_columns import column_logprobs, linear_column_logprobs
    from .vocab_parallel import vocab_parallel_gather_columns

    parallel = vocab_parallel_group is not None and active(vocab_parallel_group)
    if lm_head_weight is not None:
        if not zero_outside_topk:  # the k columns' logits alone: k dot products a row, no vocabulary pass
            from .logprobs_columns_tp import vocab_parallel_linear_column_logprobs

            out = vocab_parallel_linear_column_logprobs(rows, lm_head_weight, columns,
                                                        vocab_parallel_group if parallel else None,
                                                        bias=lm_head_bias, vocab_start=vocab_start,
                                                        temperature=temperature, subset=True)
            return out.logprobs, None
        out = linear_column_logprobs(rows, lm_head_weight, columns, bias=lm_head_bias, temperature=temperature,
                                     return_entropy=calculate_entropy, vocab_parallel_group=vocab_parallel_group,
                                     vocab_start=vocab_start)
        return out.logprobs, (-out.entropy if out.entropy is not None else None)
    if zero_outside_topk:
        out = column_logprobs(rows, columns, temperature=temperature, return_entropy=calculate_entropy,
                              vocab_parallel_group=vocab_parallel_group, vocab_start=vocab_start)
        return out.logprobs, (-out.entropy if out.entropy is not None else None)
    z = vocab_parallel_gather_columns(rows, columns, vocab_parallel_group if parallel else None,
                                      vocab_start_index=vocab_start if parallel else None, agree=False)
    return subset_log_softmax(z / temperature, columns.to(z.device)), None


def distillation_loss_input(rows: "torch.Tensor", data: Mapping[str, Any], layout: Any, loss_fn: Any, *,
                            temperature: float, context_parallel_group: Any = None, vocab_parallel_group: Any = None,
                            vocab_parallel_rank: Optional[int] = None, lm_head_weight: Any = None,
                            lm_head_bias: Any = None):
    """Every check of the distillation input of packed ``rows`` (this CP rank's rows
    of ``layout``: logits ``[T / cp, V_local]``, or hidden states with the LM head)
    and the unpacked ``data`` ``[B, S]`` (its ``teacher_topk_*`` ``[B, S, k]``).
    Returns ``(run, facts)``: ``run()`` gives NeMo-RL's loss input
    ``{"student_topk_logprobs", "teacher_topk_logprobs", "H_all"}`` (``[B, S - 1, k]``,
    ``H_all [B, S - 1]`` or None), all-gathered over CP; ``facts`` is what its
    collectives need every rank to share.

    The teacher's ids are packed into the layout (-1 in padding rows: no column),
    the student's side runs on the packed rows in one pass
    (:func:`distillation_topk_logprobs`) and is unpacked back to ``[B, S - 1, k]``."""
    from .._dist import autocast_state, grad_on, size_and_rank
    from ..tensors.cp import gather_cp
    from ..tensors.layout import PackedLayout
    from ..tensors.thd import pack_to_layout

    ids = data["input_ids"]
    if ids.dim() != 2:
        raise ValueError(f"data['input_ids'] must be [B, S], got shape {tuple(ids.shape)}")
    batch, width = ids.shape
    t_logits, t_ids = check_teacher(data, batch, width)
    cp_size, cp_rank = size_and_rank(context_parallel_group)
    local = PackedLayout(layout.cu_seqlens, layout.cu_seqlens_padded, cp_size=cp_size, cp_rank=cp_rank)
    columns = pack_to_layout({"columns": t_ids[:, :width]}, local, pad_value=-1)["columns"]
    if rows.dim() != 2 or rows.shape[0] != columns.shape[0]:
        raise ValueError(f"the student's rows must be [{columns.shape[0]}, ...] (this rank's packed positions), got "
                         f"{tuple(rows.shape)}")
    unpacked = pack_to_layout({"input_ids": ids}, layout)  # its plan maps the packed results back to [B, S]
    entropy = bool(loss_fn.calculate_entropy)
    head_rows = lm_head_weight.shape[0] if lm_head_weight is not None else rows.shape[1]
    vocab_start = vocab_parallel_rank * int(head_rows) if vocab_parallel_rank is not None else None

    def run() -> Dict[str, Any]:
        lp, h_all = distillation_topk_logprobs(
            rows, columns, zero_outside_topk=loss_fn.zero_outside_topk, calculate_entropy=entropy,
            temperature=temperature, vocab_parallel_group=vocab_parallel_group, vocab_start=vocab_start,
            lm_head_weight=lm_head_weight, lm_head_bias=lm_head_bias)
        if cp_size > 1:  # agreed: the rows, dtype and requires_grad follow the logits'
            lp = gather_cp(lp, layout.cu_seqlens_padded, context_parallel_group, agree=False)
            if h_all is not None:
                h_all = gather_cp(h_all, layout.cu_seqlens_padded, context_parallel_group, agree=False)
        student = unpacked.unpack(lp)[:, : width - 1]
        return {"student_topk_logprobs": student,
                "teacher_topk_logprobs": teacher_topk_logprobs(t_logits, student, width),
                "H_all": unpacked.unpack(h_all)[:, : width - 1] if h_all is not None else None}

    return run, {"the rows of the student": int(rows.shape[0]), "the dtype of the student's rows": str(rows.dtype),
                 "whether the student's rows require grad (with grad mode on)": grad_on(rows),
                 "the packed layout": (layout.cu_seqlens, layout.cu_seqlens_padded),
                 "the shape of data['teacher_topk_indices']": tuple(t_ids.shape),
                 "the autocast state": autocast_state(rows.device.type)}
