"""ROLL's sequence packing in prefix-reuse passes (issue 52): a mini-batch whose prefix
trees exceed ``max_packed_sequence_length`` runs as :func:`seqpack.split_prefix_tree`'s
passes, each shared prefix forwarded and back-propagated once in the mini-batch,
whatever the cap::

    make_micro_batch_iter_for_sequence_packing(..., shared_prefix=True, prefix_reuse=True)
        -> one micro-batch per pass, in the step's run order, then dummies; each holds
           every row of the mini-batch (a pass reads the tree), its response masks
           kept only where this pass predicts the token, and meta_info["prefix_pass"]
           (the running step's pass: forward + backward in the order yielded)
    pass_logprobs(model, mb)
        -> ROLL's log-probs [B, S - 1] (column t: token t + 1) where this pass
           predicts the token, 0 elsewhere
    ROLL's loss over the global token / sample counts (token-mean,
        seq-mean-token-sum[-norm]) summed over the passes = the loss of the rows

    rows (prompt P shared)        P P P P P a a a        pass 0 (provider): P's 5 tokens
                                  P P P P P b b b        pass 1 (branch):   a, b
                                  P P P P P c c c        pass 2 (branch):   c, then close 0
    response_mask kept in pass 1  . . . . . 1 1 1        the tokens a's own tokens predict
                                  . . . . . 1 1 1        (its first one: by P's last, in
                                  . . . . . . . .         the close of pass 0)

A loss that divides by each row's own token count (``seq-mean-token-mean``) or
couples a row's tokens (a sequence-level ratio) does not split over passes: plan
with ``prefix_reuse`` off for it (:mod:`seqpack.config` refuses the combination).

Importing this module does not import torch.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Tuple

import numpy as np

from .._batch import is_data_proto, proto_select, select_all
from .common import RollBatch, batch_columns

__all__ = ["pass_logprobs", "pass_micro_batches"]

PASS_KEY = "prefix_pass"
# ROLL's per-token loss masks: [B, S] over the tokens (response_mask) or [B, S - 1]
# over the predictions (final_response_mask, as its loss slices response_mask[:, 1:])
MASK_KEYS = ("response_mask", "final_response_mask", "loss_mask")


def pass_micro_batches(batch: Any, meta: Mapping[str, Any], plan: Any, groups: Optional[Sequence[int]], cap: int,
                       multiple: int, memory: str, dummy: Callable[[int], Any]) -> Iterator[Any]:
    """The micro-batches of a mini-batch planned in passes (``plan.prefix_reuse``) under
    ``cap``: the step's passes over all its rows (each padded to ``multiple``),
    checked against the plan, then ``dummy(k)`` for each of the plan's empty
    micro-batches ``k``."""
    from ...tensors.prefix_passes import split_prefix_tree
    from ...tensors.prefix_tree import PrefixTreeBatch
    from ...training.prefix_reuse import prefix_reuse
    from ..policy_forward import nemo_rl_pass_forward

    cols = batch_columns(batch)
    tree = PrefixTreeBatch.from_padded(cols["input_ids"], cols["attention_mask"], group_ids=groups)
    passes = split_prefix_tree(tree, cap)
    planned = plan.prefix_reuse
    why = passes.differs_from(planned.pass_order[0], planned.pass_tokens[0])
    if why:
        raise ValueError(f"prefix_reuse: the rows' tokens: {why}; the mini-batch is not the rows the plan was "
                         "made on")
    step = prefix_reuse(passes, memory=memory, forward=nemo_rl_pass_forward, pad_to_multiple_of=multiple)
    n, count = tree.num_rows, plan.num_micro_batches
    first, lengths = _spans(cols["attention_mask"])
    cu = np.asarray(tree.cu_seqlens, dtype=np.int64)
    seq_width = int(cols["input_ids"].shape[1])
    proto = is_data_proto(batch)

    def gen():
        for k, mb in enumerate(step):
            predicts = passes.passes[mb.index].predicted_tokens()  # [N]: logical token t predicts t + 1
            if proto:
                out = proto_select(batch, range(n), "mini_batch")
                out.meta_info = copy.deepcopy(dict(meta))
                values = out.batch
            else:
                out = RollBatch(select_all(cols, range(n)), meta_info=copy.deepcopy(dict(meta)))
                values = out
            for key in MASK_KEYS:
                if key in values.keys():
                    values[key] = _kept(key, values[key], predicts, cu, first, lengths, seq_width)
            out.meta_info.update(micro_batch_idx=k, num_micro_batchs=count, partition_indices=list(range(n)),
                                 partition_indices_list=[], mini_batch_size=n, is_padding_batch=False)
            out.meta_info[PASS_KEY] = mb
            yield out
        for k in range(len(passes.order), count):
            yield dummy(k)

    return gen()


def _spans(mask: Any) -> Tuple[np.ndarray, np.ndarray]:
    """Each row's first real column and real tokens (``attention_mask`` ``[B, S]``:
    left padding, right padding or both, the real tokens contiguous)."""
    m = np.asarray(mask.detach().cpu() if hasattr(mask, "detach") else mask) != 0
    lengths = m.sum(1).astype(np.int64)
    first = np.where(lengths > 0, m.argmax(1), 0).astype(np.int64)
    return first, lengths


def _prediction_index(cu: np.ndarray, first: np.ndarray, lengths: np.ndarray, width: int, offset: int):
    """``(rows, columns, logical)`` for every token some real token predicts (all but
    each row's first): its column in a ``[B, width]`` tensor whose column ``c`` is
    padded token ``c + offset``, and the logical token that predicts it."""
    rows, cols, logical = [], [], []
    for r in range(first.shape[0]):
        k = np.arange(1, int(lengths[r]), dtype=np.int64)  # the row's predicted tokens
        c = first[r] + k - offset
        ok = (c >= 0) & (c < width)
        rows.append(np.full(int(ok.sum()), r, dtype=np.int64))
        cols.append(c[ok])
        logical.append(cu[r] + k[ok] - 1)
    if not rows:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    return np.concatenate(rows), np.concatenate(cols), np.concatenate(logical)


def _kept(key: str, mask: Any, predicts: np.ndarray, cu: np.ndarray, first: np.ndarray, lengths: np.ndarray,
          seq_width: int) -> Any:
    """``mask`` (``[B, S]`` over the tokens, or ``[B, S - 1]`` over the predictions)
    zeroed where this pass does not predict the token."""
    import torch

    width = int(mask.shape[1]) if mask.dim() == 2 else -1
    if width not in (seq_width, seq_width - 1):
        raise ValueError(f"prefix_reuse: {key!r} {tuple(mask.shape)} is neither [B, S] nor [B, S - 1] of "
                         f"input_ids [B, S = {seq_width}]: which tokens it masks is unknown")
    rows, cols, logical = _prediction_index(cu, first, lengths, width, seq_width - width)
    keep = np.zeros(tuple(mask.shape), dtype=bool)
    keep[rows, cols] = predicts[logical]
    return mask * torch.from_numpy(keep).to(device=mask.device, dtype=mask.dtype)


def pass_logprobs(model: Any, micro_batch: Any, *, temperature: Any = 1.0, **model_kwargs: Any) -> Any:
    """ROLL's log-probs of a pass micro-batch: ``[B, S - 1]`` (the rows'
    ``input_ids`` ``[B, S]``), column ``t`` the log-prob of token ``t + 1`` where this
    pass predicts it, 0 elsewhere (and past each row's tokens); fp32 (fp64 for fp64
    logits). Runs the pass
    (``micro_batch.meta_info["prefix_pass"]``) on ``model``, a transformers model on
    seqpack's tree attention: summed over the passes, the rows' log-probs.

    >>> # for mb in make_micro_batch_iter_for_sequence_packing(..., shared_prefix=True, prefix_reuse=True):
    >>> #     loss = roll_loss(pass_logprobs(model, mb), mb)   # global token / sample counts
    >>> #     loss.backward()
    """
    import torch

    from ...training.ops import token_logprobs

    meta = getattr(micro_batch, "meta_info", None) or {}
    mb = meta.get(PASS_KEY)
    if mb is None:
        raise ValueError("pass_logprobs runs a micro-batch of prefix_reuse=True: its meta_info has no "
                         f"{PASS_KEY!r} (a dummy or a micro-batch of rows: run the model on its rows or its "
                         "meta_info['prefix_tree'])")
    logits = mb.forward(model, **model_kwargs)[0]  # [own tokens, V]
    lp = token_logprobs(logits, mb.layout, temperature=temperature).logprobs  # [N]: t predicts t + 1
    lp = lp.to(torch.promote_types(lp.dtype, torch.float32))
    cols = batch_columns(micro_batch)
    ids = cols["input_ids"]
    first, lengths = _spans(cols["attention_mask"])
    tree = mb.layout.tree
    cu = np.asarray(tree.cu_seqlens, dtype=np.int64)
    if cu.shape[0] - 1 != int(ids.shape[0]) or not np.array_equal(np.diff(cu), lengths):
        raise ValueError(f"the micro-batch's {int(ids.shape[0])} rows are not its pass's tree of {cu.shape[0] - 1} rows "
                         "(pass the micro-batch as make_micro_batch_iter_for_sequence_packing yielded it)")
    width = int(ids.shape[1]) - 1
    rows, columns, logical = _prediction_index(cu, first, lengths, width, 1)
    target = torch.from_numpy(rows * width + columns).to(lp.device)
    source = torch.from_numpy(logical).to(lp.device)
    return lp.new_zeros(int(ids.shape[0]) * width).index_copy(0, target, lp.index_select(0, source)).view(-1, width)
