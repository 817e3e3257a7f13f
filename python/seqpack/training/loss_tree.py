"""The loss wrapper on a prefix tree (issue 29): :class:`~seqpack.SequencePackingLossWrapper`
given a :class:`~seqpack.PrefixTreeBatch` in place of ``cu_seqlens_q``.

The model ran on the tree's physical tokens; the loss is NeMo-RL's, on the
micro-batch's rows. One pass turns the physical logits (or hidden states and the
LM head) into every logical token's next-token log-prob
(:func:`seqpack.token_logprobs`), unpacks them to ``[B, S - 1]`` in the rows'
order and calls the loss once, so loss and gradients are those of the rows packed
without sharing::

    physical logits [T, V]  --token_logprobs-->  logical [N]  --unpack-->  [B, S - 1]  --> loss_fn
    (shared prefixes once)                       (rows back to back)       (NeMo-RL's)

With a context-parallel group, each rank holds its rows of the tree's ranges cut
(:func:`seqpack.shard_layout`) and gets the log-probs of the logical tokens they
predict; one all-reduce sums them (its backward sums the gradients too), so every
rank computes the same loss: divide it by the CP size, NeMo-RL's convention, as for
the zigzag path's all-gather.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, Tuple

import numpy as np

from ..tensors.layout import PackedLayout
from ..tensors.prefix_tree import PrefixTreeBatch

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["check_tree_logits", "tree_loss_plan"]


def _pass_data(loss_fn: Callable, data: Any, predicted: np.ndarray, packed: Any) -> Any:
    """``data`` whose ``token_mask`` keeps only the tokens a pass predicts: the passes'
    token-level losses then sum to the whole tree's (a sequence-level loss needs a
    row's tokens together, and is refused)."""
    import torch

    from .nemo_rl_loss import LossType

    kind = getattr(loss_fn, "loss_type", LossType.TOKEN_LEVEL)
    if getattr(kind, "value", kind) != LossType.TOKEN_LEVEL:  # NeMo-RL's own LossType is an Enum of these values
        raise ValueError(f"{type(loss_fn).__name__} is a sequence-level loss (loss_type {loss_fn.loss_type!r}): a pass "
                         "of a split tree holds only part of some rows, so its loss must be token-level (NeMo-RL's "
                         "token_level_loss: true); run the tree in one micro-batch otherwise")
    if "token_mask" not in data:
        raise ValueError("data must hold 'token_mask' ([B, S]): a pass's loss keeps the tokens it predicts")
    mask = data["token_mask"]
    mine = packed.unpack(torch.from_numpy(predicted.astype(np.float32)).to(mask.device))  # [B, S]
    restricted = mask.clone()
    restricted[:, 1:] = mask[:, 1:] * mine[:, :-1].to(mask.dtype)  # token s is predicted at s - 1
    out = dict(data.items())  # the loss reads it as a mapping
    out["token_mask"] = restricted
    return out


def check_tree_logits(tree: PrefixTreeBatch, logits: "torch.Tensor", cp_size: int, cp_rank: int) -> int:
    """The rows ``logits`` (``[T, V]`` or ``[1, T, V]``; hidden states with a fused
    head) must have: the tree's physical tokens, or this CP rank's share of them.
    Returns that count."""
    from ..tensors.prefix_tree_cp import _rank_range

    if logits.dim() not in (2, 3) or (logits.dim() == 3 and logits.shape[0] != 1):
        raise ValueError(f"next_token_logits must be [T, V] or [1, T, V], got {tuple(logits.shape)}")
    rows = logits.shape[-2] if logits.dim() == 3 else logits.shape[0]
    if tree.predicted_tokens() is not None:  # a pass of a split tree: its own tokens, on one rank
        if cp_size != 1:
            raise ValueError("a pass of a split tree (seqpack.prefix_reuse) runs on one rank: no context parallelism")
        if rows != tree.num_local_tokens:
            raise ValueError(f"next_token_logits must have one row per own token of the pass "
                             f"({tree.num_local_tokens}), got {rows} rows")
        return rows
    _, start, end = _rank_range(tree, cp_size, cp_rank)
    if rows != end - start:
        where = (f"the tree's {tree.num_tokens} physical tokens" if cp_size == 1 else
                 f"this CP rank's {end - start} rows of the tree (rows [{start}, {end}) of tree_cp_bounds(tree, "
                 f"{cp_size}))")
        raise ValueError(f"next_token_logits must have one row per physical token: {where}, got {rows} rows")
    return rows


def tree_loss_plan(tree: PrefixTreeBatch, loss_fn: Callable, logits: "torch.Tensor", data: Any, lm_head_weight: Any,
                   lm_head_bias: Any, *, temperature: float, cp_size: int, cp_rank: int,
                   context_parallel_group: Any, vocab_parallel_group: Any) -> Tuple[Callable, Dict[str, Any]]:
    """Every check of the tree path; returns ``(finish, facts)`` as the wrapper's
    fused plan: ``finish(global_valid_seqs, global_valid_toks)`` runs the log-probs,
    the CP all-reduce and the loss; ``facts`` is what every rank must share."""
    from .._dist import active
    from ..tensors.thd import pack_to_layout

    if vocab_parallel_group is not None and active(vocab_parallel_group):
        raise ValueError("a prefix tree's log-probs need the whole vocabulary on each rank: vocabulary (tensor) "
                         "parallelism of the logits is not available with a tree; gather the logits first")
    check_tree_logits(tree, logits, cp_size, cp_rank)
    entropy = bool(getattr(loss_fn, "needs_entropy", False))
    if "input_ids" not in data:
        raise ValueError("data must hold 'input_ids' ([B, S], the rows of the tree): the log-probs are unpacked to "
                         "its rows")
    layout = PackedLayout.from_offsets(tree.cu_seqlens)
    packed = pack_to_layout({"input_ids": data["input_ids"]}, layout)  # its unpack: [N] -> [B, S]
    rows = logits.reshape(-1, logits.shape[-1])
    options = dict(temperature=temperature, return_entropy=entropy, cp_size=cp_size, cp_rank=cp_rank)
    predicted = tree.predicted_tokens()
    if predicted is not None:  # a pass of a split tree: the loss over the tokens its own tokens predict
        data = _pass_data(loss_fn, data, predicted, packed)

        def run():
            from .ops import token_logprobs

            return token_logprobs(rows, tree, weight=lm_head_weight, bias=lm_head_bias, temperature=temperature,
                                  return_entropy=entropy)
    elif lm_head_weight is None:
        if lm_head_bias is not None:
            raise ValueError("lm_head_bias needs lm_head_weight")

        def run():
            from .logprobs_tree import tree_token_logprobs

            return tree_token_logprobs(rows, tree, **options)
    else:
        def run():
            from .logprobs_tree import tree_linear_token_logprobs

            return tree_linear_token_logprobs(rows, lm_head_weight, tree, bias=lm_head_bias, **options)

    def finish(global_valid_seqs, global_valid_toks):
        lp, ent = run()
        if cp_size > 1:  # each rank holds the tokens its rows predict, 0 elsewhere: the sum is the tree's
            from torch.distributed.nn.functional import all_reduce

            lp = all_reduce(lp, group=context_parallel_group)
            if ent is not None:
                ent = all_reduce(ent, group=context_parallel_group)
        loss_input = {"next_token_logprobs": packed.unpack(lp)[:, :-1]}
        if ent is not None:
            loss_input["next_token_entropy"] = packed.unpack(ent)[:, :-1]
        return loss_fn(data=data, global_valid_seqs=global_valid_seqs, global_valid_toks=global_valid_toks,
                       **loss_input)

    from ..tensors.prefix_tree_cp import tree_cp_bounds

    whole = getattr(tree, "tree", tree)  # a pass's tree
    facts = {"the prefix tree's segments": [whole.segment_offsets, whole.segment_parent],
             "the prefix tree's CP cut (tree_cp_bounds)": tree_cp_bounds(whole, cp_size),
             "the prefix tree's rows (cu_seqlens)": np.asarray(tree.cu_seqlens, dtype=np.int64),
             "whether the LM head is fused": lm_head_weight is not None, "entropy": entropy}
    return finish, facts
