"""Losses on packed sequences: NeMo-RL's ``SequencePackingLossWrapper`` (per
sequence, and ``fused=True``: one pass over the packed logits) and
:func:`prepare_loss_input`. The losses it runs (NeMo-RL's, with their global
normalisation, and the segment reductions) are in
:mod:`seqpack.training.nemo_rl_loss`; every name of it is importable from here too.

    >>> import torch
    >>> from seqpack.loss import NLLLoss, SequencePackingLossWrapper
    >>> wrapper = SequencePackingLossWrapper(NLLLoss(), cu_seqlens_q=[0, 3, 5])
    >>> wrapper.cu.tolist(), wrapper.cu_padded.tolist()
    ([0, 3, 5], [0, 3, 5])
"""

from __future__ import annotations

import math
import re
from collections import UserDict
from typing import TYPE_CHECKING, Any, Callable, Dict, Mapping, Optional, Tuple

import numpy as np

from .._dist import autocast_state, checked_on_every_rank, groups_of, size_and_rank, tensor_facts
from .._equality import ValueEquality
from .._lengths import as_temperature
from ..tensors.cp import gather_cp
from ..tensors.layout import PackedLayout
from ..tensors.layout_kinds import is_layout
from ..tensors.thd import pack_to_layout
from . import distillation, nemo_rl_loss, preference_loss, value_loss, vocab_parallel
from .distillation import DISTILLATION_DEFAULTS, DistillationLoss, distillation_loss_input, distillation_topk_logprobs
from .dispatch import loss_route
from .logprobs import linear_plan, packed_plan
from .loss_hybrid_cp import PartsLoss
from .loss_tree import check_tree_logits, tree_loss_plan
from .nemo_rl_loss import (MAX_KEYS, MIN_KEYS, PG_DEFAULTS, ClippedPGLoss, LossConfigError, LossType,
                           MetricNormalization, NLLLoss, _host_cu, calculate_kl, clipped_pg_loss, masked_mean,
                           nll_loss, pg_config, segment_masked_mean, segment_mean, segment_sum)
from .preference_loss import DPO_DEFAULTS, DPOLoss, PreferenceLoss
from .value_loss import VALUE_LOSS_DEFAULTS, MseValueLoss
from .vocab_parallel import vocab_parallel_gather_columns

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = sorted(nemo_rl_loss.__all__ + value_loss.__all__ + vocab_parallel.__all__ + distillation.__all__
                 + preference_loss.__all__
                 + ["SequencePackingLossWrapper", "prepare_loss_input"])


_COUPLED = re.compile(r"dpo|preference|pairwise|contrastive", re.IGNORECASE)


def _check_packable(loss_fn: Any, fused: bool) -> None:
    """A loss that couples a micro-batch's rows (DPO's chosen / rejected pairs) runs
    only fused or on a prefix tree: one call on the whole micro-batch."""
    coupled = getattr(loss_fn, "batch_coupled", None)
    if coupled is None:
        coupled = bool(_COUPLED.search(type(loss_fn).__name__)) or bool(_COUPLED.search(getattr(loss_fn, "__name__", "")))
    if coupled and not fused:
        raise ValueError(f"{type(loss_fn).__name__} couples the sequences of a batch (e.g. DPO's chosen/rejected "
                         "pairs), so it cannot run on packed sequences one at a time: use fused=True or a prefix tree "
                         "(one call on the whole micro-batch, each pair's rows in it; or set loss_fn.batch_coupled = "
                         "False if it is in fact per-sequence)")


def _input_type(loss_fn: Any) -> str:
    """NeMo-RL's ``LossInputType`` of ``loss_fn`` (a string or its enum): ``logprob``
    (the default), ``logit`` or ``distillation``."""
    kind = getattr(loss_fn, "input_type", "logprob")
    return str(getattr(kind, "value", kind)).lower()


def _is_logprob_loss(loss_fn: Any) -> bool:
    return _input_type(loss_fn) == "logprob"


def _computes_input(loss_fn: Any) -> bool:
    """Whether seqpack computes the loss's input itself (log-probs, or distillation's
    top-k log-probs): the fused and prefix-tree paths need such a loss."""
    return _input_type(loss_fn) in ("logprob", "distillation")


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
        return packed_plan(rows, input_ids, cu, cu_p, cp_size, cp_rank, return_entropy, temperature,
                            vocab_parallel_group, vocab_start, 0)
    vocab_start = (vocab_parallel_rank or 0) * check_tensor(lm_head_weight, "lm_head_weight").shape[0]
    return linear_plan(rows, lm_head_weight, input_ids, cu, cu_p, lm_head_bias, cp_size, cp_rank, return_entropy,
                        temperature, vocab_parallel_group, vocab_start, None, True, 0)


def prepare_loss_input(logits, data, loss_fn=None, vocab_parallel_rank=None, vocab_parallel_group=None,
                       context_parallel_group=None, temperature: float = 1.0, *, lm_head_weight=None,
                       lm_head_bias=None, agree: bool = True):
    """seqpack's default ``prepare_fn``: the fused log-probs of each row's
    (CP-local, vocab-local) logits ``[B, S, V]`` (one packed sequence: ``B = 1``),
    all-gathered over CP, as ``({"next_token_logprobs": [B, L - 1]}, data)`` with
    ``L`` the width of ``data["input_ids"]`` (and ``next_token_entropy`` when
    ``loss_fn.needs_entropy``). For a distillation loss (``input_type ==
    "distillation"``) NeMo-RL's ``{"student_topk_logprobs", "teacher_topk_logprobs",
    "H_all"}`` instead (:mod:`seqpack.training.distillation`). With ``lm_head_weight`` (``[V, H]``, this
    rank's vocabulary slice under TP; ``lm_head_bias`` optional) ``logits`` holds the
    final hidden states ``[..., H]`` instead, and the logits are never materialised
    (:func:`seqpack.token_logprobs` with ``weight``).

    ``agree`` (default): with a TP or CP group, every check runs before the first
    collective, inside one agreement over both groups (see
    :func:`seqpack.token_logprobs`), so a rank whose inputs fail or differ
    (shapes, dtypes, ``requires_grad``) makes every rank raise."""
    import torch

    cp, cp_rank = size_and_rank(context_parallel_group)

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
        if _input_type(loss_fn) == "distillation":
            layout = PackedLayout.from_offsets([i * width for i in range(batch + 1)],
                                               [i * padded for i in range(batch + 1)])
            run, facts = distillation_loss_input(
                rows, data, layout, loss_fn, temperature=temperature, context_parallel_group=context_parallel_group,
                vocab_parallel_group=vocab_parallel_group, vocab_parallel_rank=vocab_parallel_rank,
                lm_head_weight=lm_head_weight, lm_head_bias=lm_head_bias)
            return run, {**facts, "the shape of logits": tuple(logits.shape)}, None
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
    run, _, shape = checked_on_every_rank(local, groups, "prepare_loss_input", bool(agree) and bool(groups),
                                          fingerprint=lambda r: r[1])
    if shape is None:  # distillation: the top-k log-probs, gathered and unpacked
        return run(), data
    batch, width, padded, cu_p = shape
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
            :class:`~seqpack.PackedLayout` as ``cu_seqlens_q``. Or a
            :class:`~seqpack.PrefixTreeBatch` as ``cu_seqlens_q``: the logits are then
            the tree's physical tokens (with a CP group, a rank's rows of the tree's
            ranges cut, as :func:`seqpack.shard_layout` cuts it), the log-probs those of
            every row's tokens, computed in one pass (as ``fused=True``; a log-prob
            loss, no ``prepare_fn``), and the loss equals the rows' packed without
            sharing (:mod:`seqpack.training.loss_tree`). Or a hybrid-CP micro-batch
            (:func:`seqpack.hybrid_cp_micro_batches`): each part runs with its block's
            group and its loss counts ``1 / degree`` (:mod:`~seqpack.training.loss_hybrid_cp`).
        vocab_parallel_rank / vocab_parallel_group / context_parallel_group: TP and CP.
        fused: compute every sequence's log-probs in one pass over the packed
            logits, one CP all-gather per call, and call ``loss_fn`` once on the whole
            ``[B, S - 1]`` micro-batch (NeMo-RL's ``SequencePackingFusionLossWrapper``);
            needs a log-prob or distillation loss (``input_type``). With a prefix
            tree, the only way to run a loss that couples rows (DPO's pairs: each
            pair's rows in the micro-batch).
        temperature: divide the logits by it (inside the fused kernel; no copy).

    Called as ``wrapper(next_token_logits, data, global_valid_seqs,
    global_valid_toks)``; with ``fused=True`` also as ``wrapper(hidden_states, data,
    global_valid_seqs, global_valid_toks, lm_head_weight=W, lm_head_bias=b)``: the
    final hidden states ``[T, H]`` and the LM head ``[V, H]`` (this rank's slice
    under TP), whose logits are never materialised
    (:func:`seqpack.token_logprobs` with ``weight``).

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
        self.loss_fn, self.prepare_fn, self.fused, self.agree = loss_fn, prepare_fn, fused, bool(agree)
        self.temperature = as_temperature(temperature)
        self.vocab_parallel_rank, self.vocab_parallel_group = vocab_parallel_rank, vocab_parallel_group
        self.context_parallel_group = context_parallel_group
        # Rows back to back run the loss per sequence; a tree's logits are its physical
        # tokens, whose log-probs are every row's at once (loss_tree); a hybrid-CP
        # micro-batch runs each part with its block's group (loss_hybrid_cp).
        route = loss_route(cu_seqlens_q)
        self.parts = cu_seqlens_q if route == "parts" else None
        if self.parts is not None:
            if prepare_fn is not None or cu_seqlens_q_padded is not None or context_parallel_group is not None:
                raise ValueError("a hybrid-CP micro-batch as cu_seqlens_q carries each part's layout and finds its "
                                 "block's group itself: give no prepare_fn, cu_seqlens_q_padded or "
                                 "context_parallel_group")
            self.tree, self.cu, self.cu_padded = None, None, None
            PartsLoss(self.parts, self)  # each part's checks, now
            return
        given = getattr(cu_seqlens_q, "layout", cu_seqlens_q)  # a PackedBatch's layout
        layout = given if is_layout(given) else PackedLayout.from_offsets(
            _host_cu(cu_seqlens_q, "cu_seqlens_q"),
            None if cu_seqlens_q_padded is None else _host_cu(cu_seqlens_q_padded, "cu_seqlens_q_padded"))
        self.tree = layout if route == "tree" else None
        _check_packable(loss_fn, fused or self.tree is not None)  # a tree: one call too
        if self.tree is not None:
            if cu_seqlens_q_padded is not None:
                raise ValueError("cu_seqlens_q_padded does not apply to a prefix tree (its layout has no per-row padding)")
            if prepare_fn is not None or not _is_logprob_loss(loss_fn):
                raise ValueError("a prefix tree (cu_seqlens_q) computes every row's log-probs in one pass: it needs a "
                                 "log-prob loss (loss_fn.input_type == 'logprob'; not "
                                 f"{_input_type(loss_fn)!r}) and no prepare_fn")
            layout = PackedLayout.from_offsets(self.tree.cu_seqlens)
        elif is_layout(given) and cu_seqlens_q_padded is not None:
            raise ValueError("give cu_seqlens_q_padded only with plain offsets: a layout as cu_seqlens_q carries its own")
        self.cu = layout.cu_seqlens.astype(np.int64)
        self.cu_padded = layout.cu_seqlens_padded.astype(np.int64)
        if not fused and self.tree is None and not getattr(loss_fn, "splits_per_sequence", True):
            raise ValueError(f"{type(loss_fn).__name__} does not split over sequences (e.g. VAPO's "
                             "positive_example_nll_weight divides by the micro-batch's own token count): use fused=True")
        if fused and prepare_fn is not None:
            raise ValueError("fused=True computes the loss's input itself: it takes no prepare_fn")
        if fused and not _computes_input(loss_fn):
            raise ValueError("fused=True computes the loss's input itself: it needs a log-prob or distillation loss "
                             f"(loss_fn.input_type 'logprob' or 'distillation', not {_input_type(loss_fn)!r})")

    def for_part(self, layout: Any, group: Any) -> "SequencePackingLossWrapper":
        """This wrapper's loss and options over one part of a hybrid-CP micro-batch:
        the part's ``layout`` and its block's CP ``group``."""
        return SequencePackingLossWrapper(self.loss_fn, cu_seqlens_q=layout, vocab_parallel_rank=self.vocab_parallel_rank,
                                          vocab_parallel_group=self.vocab_parallel_group, context_parallel_group=group,
                                          fused=self.fused, temperature=self.temperature, agree=self.agree)

    def _check(self, logits, data) -> Tuple[Any, int]:
        from ..tensors._device import check_tensor

        check_tensor(logits, "next_token_logits")
        cp, rank = size_and_rank(self.context_parallel_group)
        rows = logits.shape[-2] if logits.dim() == 3 else logits.shape[0]
        if self.tree is not None:
            check_tree_logits(self.tree, logits, cp, rank)
        elif logits.dim() not in (2, 3) or (logits.dim() == 3 and logits.shape[0] != 1):
            raise ValueError(f"next_token_logits must be [T, V] or [1, T, V], got {tuple(logits.shape)}")
        elif rows * cp != int(self.cu_padded[-1]):
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
        if self.parts is not None:
            return PartsLoss(self.parts, self)(next_token_logits, data, global_valid_seqs,
                                                             global_valid_toks, lm_head_weight=lm_head_weight,
                                                             lm_head_bias=lm_head_bias)
        def local():  # every check that can differ between ranks, before the first collective
            cp, batch = self._check(next_token_logits, data)
            if self.tree is not None:
                return cp, batch, tree_loss_plan(
                    self.tree, self.loss_fn, next_token_logits, data, lm_head_weight, lm_head_bias,
                    temperature=self.temperature, cp_size=cp, cp_rank=size_and_rank(self.context_parallel_group)[1],
                    context_parallel_group=self.context_parallel_group, vocab_parallel_group=self.vocab_parallel_group)
            if self.fused:
                return cp, batch, self._fused_plan(next_token_logits, data, lm_head_weight, lm_head_bias)
            if lm_head_weight is not None or lm_head_bias is not None:
                raise ValueError("lm_head_weight / lm_head_bias (hidden states in, no logits) need fused=True")
            return cp, batch, None

        def facts(checked) -> Dict[str, Any]:
            shared = tensor_facts(next_token_logits)
            shape = shared["shape"]
            if self.tree is not None:  # a tree's CP ranks hold different row counts (its cut, among its facts)
                shape = [(len(s), s[-1]) for s in shape]
            out = {"the packed layout (cu_seqlens_q, cu_seqlens_q_padded)": (self.cu, self.cu_padded),
                   "the shape of next_token_logits": shape, "the dtype of next_token_logits":
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
        if plan is not None:  # fused, or a prefix tree
            return plan[0](global_valid_seqs, global_valid_toks)
        logits = next_token_logits if next_token_logits.dim() == 3 else next_token_logits[None]
        lengths = np.diff(self.cu).tolist()
        starts = (self.cu_padded // cp).tolist()
        total, merged = None, {}
        for i in range(batch):
            seq = _slice_row(data, i, lengths[i])
            piece = logits[:, starts[i]: starts[i + 1]]
            if self.prepare_fn is None and not _computes_input(self.loss_fn):
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
        if _input_type(self.loss_fn) == "distillation":
            run, facts = distillation_loss_input(
                logits2d, data, layout, self.loss_fn, temperature=self.temperature,
                context_parallel_group=self.context_parallel_group, vocab_parallel_group=self.vocab_parallel_group,
                vocab_parallel_rank=self.vocab_parallel_rank, lm_head_weight=lm_head_weight, lm_head_bias=lm_head_bias)
            return (lambda global_valid_seqs, global_valid_toks: self.loss_fn(
                data=data, global_valid_seqs=global_valid_seqs, global_valid_toks=global_valid_toks, **run())), facts
        packed = pack_to_layout({"input_ids": ids}, layout)
        cp_size, cp_rank = size_and_rank(self.context_parallel_group)
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
