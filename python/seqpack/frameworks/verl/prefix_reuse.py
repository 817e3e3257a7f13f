"""verl's engine micro-batches as prefix-reuse passes (issue 52): a rank's trees larger
than the cap run as :func:`seqpack.split_prefix_tree`'s passes, each shared prefix
forwarded and back-propagated once in the step, inside verl's own loop
(``forward_backward_batch``: ``forward_step`` then ``loss.backward()`` per
micro-batch)::

    rearrange_micro_batches(..., shared_prefix=True, prefix_reuse=True)
        -> one micro-batch per pass, in the step's run order, then dummies; each holds
           every row of the rank's trees (a pass reads the tree), with ``response_mask``
           / ``loss_mask`` kept only where this pass predicts the token, and the pass
           (``seqpack_pass``, a :class:`PassHandle`)
    forward_step (patched)
        -> the pass's logits, as verl's ``model_output``: ``log_probs`` / ``entropy``
           nested over each row's full length, the pass's predictions, 0 elsewhere
    verl's loss (token-mean over the global ``batch_num_tokens``, token-sum,
        seq-mean-token-sum) summed over the passes = the loss of the rows
    restore_dynamic_batch: the passes' outputs of a row summed (each position from
        the one pass that predicts it)

A loss that divides by each row's own token count (``seq-mean-token-mean``) does not
split over passes: plan with ``prefix_reuse=False`` for it.

Importing this module does not import verl or torch.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import numpy as np

__all__ = ["check_loss_splits", "check_pass_inputs", "pass_micro_batches", "pass_outputs"]

PASS_KEY = "seqpack_pass"
MASK_KEYS = ("response_mask", "loss_mask")


class PassHandle:
    """One pass of a running :func:`seqpack.prefix_reuse` step, as verl's micro-batch
    carries it: :meth:`take` advances the step to it (which checks that the micro-batch
    before it ran its forward and backward) and gives its
    :class:`~seqpack.PassMicroBatch`."""

    __slots__ = ("_source", "kind", "index")

    def __init__(self, source: "_Steps", kind: str, index: int) -> None:
        self._source, self.kind, self.index = source, kind, index

    def take(self) -> Any:
        return self._source.take(self.kind, self.index)

    def __repr__(self) -> str:
        return f"PassHandle(kind={self.kind!r}, index={self.index})"


class _Steps:
    """The step's micro-batches in order, taken one by one by verl's loop."""

    def __init__(self, step: Any) -> None:
        self._iter = iter(step)

    def take(self, kind: str, index: int) -> Any:
        mb = next(self._iter, None)
        if mb is None or (mb.kind, mb.index) != (kind, index):
            got = "the end of the step" if mb is None else f"{mb.kind} pass {mb.index}"
            raise RuntimeError(f"prefix_reuse: verl ran the {kind} micro-batch of pass {index} where the step runs "
                               f"{got}: run a step's micro-batches once, in the order rearrange_micro_batches gave")
        return mb


def pass_micro_batches(rows_batch: Any, cap: int, group_key: Optional[str], planned: Any, dummy: Any) -> List[Any]:
    """The micro-batches of ``rows_batch`` (a rank's rows, whole trees, in the order
    the plan lays them out) in passes under ``cap``, checked against ``planned`` (the
    rank's :class:`~seqpack.planning.PrefixReusePlan`) and padded with ``dummy()`` to
    its count."""
    import torch
    from tensordict import NonTensorData

    from ...tensors.prefix_passes import split_prefix_tree
    from ...tensors.prefix_tree import pack_prefix_tree
    from ...training.prefix_reuse import prefix_reuse
    from .._batch import group_codes
    from ..policy_forward import nemo_rl_pass_forward

    ids = rows_batch["input_ids"]
    lengths = ids.offsets().diff().cpu().numpy()
    values = ids.values().cpu().numpy()
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    groups = None
    if group_key is not None and group_key in rows_batch.keys():
        groups = group_codes(rows_batch[group_key])
    tree = pack_prefix_tree([values[cu[r]:cu[r + 1]] for r in range(lengths.shape[0])], group_ids=groups)
    passes = split_prefix_tree(tree, cap)
    why = passes.differs_from(planned.pass_order[0], planned.pass_tokens[0])
    if why:
        raise ValueError(f"prefix_reuse: the rows' tokens: {why}; the batch's input_ids are not the rows the plan "
                         "was made on")
    source = _Steps(prefix_reuse(passes, forward=nemo_rl_pass_forward))
    starts = _response_starts(rows_batch, lengths)
    out = []
    for kind, index in passes.order:
        mb = rows_batch.clone(recurse=False)
        predicts = passes.passes[index].predicted_tokens()  # [N]: logical token t predicts t + 1
        for key in MASK_KEYS:
            if key in mb.keys():
                mask = mb[key]
                keep = _response_columns(predicts, cu, starts, mask.shape[1])
                mb[key] = mask * torch.from_numpy(keep).to(device=mask.device, dtype=mask.dtype)
        mb[PASS_KEY] = NonTensorData(PassHandle(source, kind, index))
        out.append(mb)
    return out + [dummy() for _ in range(planned.num_micro_batches - len(out))]


def check_pass_inputs(batch: Any) -> None:
    """What a pass micro-batch reads of an engine TensorDict: nested ``input_ids``
    (the rows' tokens) and ``prompts`` (nested, or padded with ``attention_mask``: where
    each row's responses start, whose loss mask each pass keeps its share of)."""
    from .._batch import is_nested

    keys = set(batch.keys())
    if not is_nested(batch["input_ids"] if "input_ids" in keys else None):
        raise ValueError("prefix_reuse=True runs passes on verl's engine TensorDicts (nested 'input_ids', verl "
                         "0.9.1's training path), not on padded batches")
    if "prompts" not in keys or not (is_nested(batch["prompts"]) or "attention_mask" in keys):
        raise ValueError("prefix_reuse=True: each pass keeps the loss mask of the responses it predicts, so the batch "
                         "needs 'prompts' (nested, or padded with 'attention_mask'), as verl's losses read them")


def _response_starts(batch: Any, lengths: np.ndarray) -> np.ndarray:
    """Each row's first response token in its no-padding sequence (its prompt's real
    tokens), as verl's ``no_padding_2_padding`` reads it."""
    prompts = batch["prompts"]
    if prompts.is_nested:
        return prompts.offsets().diff().cpu().numpy().astype(np.int64)
    mask = batch["attention_mask"]
    return mask[:, :prompts.shape[1]].sum(1).cpu().numpy().astype(np.int64)


def _response_columns(predicts: np.ndarray, cu: np.ndarray, starts: np.ndarray, width: int) -> np.ndarray:
    """``[B, width]``: response column ``j`` of row ``r`` is predicted in this pass
    (its token ``starts[r] + j`` is predicted by token ``starts[r] + j - 1``)."""
    rows = cu.shape[0] - 1
    keep = np.zeros((rows, width), dtype=bool)
    for r in range(rows):
        n = int(cu[r + 1] - cu[r]) - int(starts[r])  # response tokens
        if n > 0:
            at = cu[r] + starts[r] - 1 + np.arange(min(n, width))
            keep[r, :at.shape[0]] = predicts[at]
    return keep


def pass_outputs(module: Any, micro_batch: Any, temperature: float, entropy: bool) -> Dict[str, Any]:
    """verl's ``model_output`` of a pass micro-batch: ``log_probs`` (and ``entropy``)
    nested over each row's full length, position ``t`` the log-prob of token ``t + 1``
    where this pass predicts it, 0 elsewhere (:func:`seqpack.token_logprobs` on the
    pass: the micro-batch's rows are its tree's logical rows, in order)."""
    import torch

    from ...training.ops import token_logprobs
    from ..policy_forward import tree_model

    tree_model(module)
    mb = micro_batch[PASS_KEY].take()
    logits = mb.forward(module)[0]  # [own tokens, V]
    out = token_logprobs(logits, mb.layout, temperature=temperature, return_entropy=entropy)
    offsets = micro_batch["input_ids"].offsets()
    result = {"log_probs": torch.nested.nested_tensor_from_jagged(out.logprobs.float(), offsets)}
    if entropy:
        result["entropy"] = torch.nested.nested_tensor_from_jagged(out.entropy.float(), offsets)
    return result


def check_loss_splits(loss_function: Any, micro_batch: Any) -> None:
    """Refuse a loss whose terms couple a row's tokens (a sequence-level ratio, batch
    statistics, a per-row mean) or that normalises by the micro-batch's own rows: on
    passes it would give another gradient. Reads verl's ``ppo_loss`` partial's config."""
    from .._loss_split import VERL_SPLITTING_AGGREGATIONS as SPLITTING_AGGREGATIONS
    from .._loss_split import VERL_TOKEN_LEVEL_LOSSES as TOKEN_LEVEL_LOSSES

    config = getattr(loss_function, "keywords", {}).get("config") if loss_function is not None else None
    if config is None:
        return
    agg = getattr(config, "loss_agg_mode", "token-mean")
    policy_loss = getattr(config, "policy_loss", None)
    mode = policy_loss.get("loss_mode", "vanilla") if hasattr(policy_loss, "get") else "vanilla"
    if agg not in SPLITTING_AGGREGATIONS:
        raise ValueError(f"prefix_reuse: loss_agg_mode={agg!r} divides by each row's own token count, which the "
                         f"passes split; use one of {SPLITTING_AGGREGATIONS} or turn prefix reuse off")
    if mode not in TOKEN_LEVEL_LOSSES:
        raise ValueError(f"prefix_reuse: policy_loss.loss_mode={mode!r} couples a row's tokens (a sequence-level "
                         f"ratio or batch statistics), which the passes split; use one of {TOKEN_LEVEL_LOSSES} or "
                         "turn prefix reuse off")
    if agg.startswith("seq-mean") and micro_batch.get("global_batch_size", None) is None:
        raise ValueError(f"prefix_reuse: loss_agg_mode={agg!r} without global_batch_size divides by each micro-batch's "
                         "own rows, which every pass holds; set global_batch_size (verl's trainer does)")
