"""Next-token log-probs on prefix-tree logits (issue 28, step 2): one log-sum-exp
per physical token, results per logical token.

A :class:`~seqpack.PrefixTreeBatch` forwards each shared prefix once, so the model
gives one row of logits per *physical* token, while the loss wants the log-prob of
every row's next token: per *logical* token. A physical token predicts as many
distinct next tokens as it has children that rows continue into - one on a chain,
several at a branch point::

    rows (logical)        physical tokens (DFS)              targets of each physical token
    r0 = 5 6 7            0:5 ── 1:6 ──┬── 2:7               0 -> 6
    r1 = 5 6 8 9                       └── 3:8 ── 4:9        1 -> 7 (primary), 8 (extra)
                                                             3 -> 9;   2 and 4 end rows: none

    logical     r0:  5        6          7  | r1:  5        6          8           9
    logprob          lp(6|5)  lp(7|5 6)  0  |      lp(6|5)  lp(8|5 6)  lp(9|5 6 8) 0

Each physical token with a target gets a *primary* one (the smallest id among its
targets); the other targets of a branch point are its *extra* ones (one per branch
beyond the first). Every row of the logits goes once through seqpack's fused
log-prob kernels (C++ on the CPU, CUDA on the GPU, the arithmetic of
``logprob_math.hpp`` on both): one log-sum-exp per physical token, and every target
of the row, primary or extra, reads its log-prob from it; the backward writes each
row's gradient once, all its targets included. Each logical token then reads the
value of its (physical token, target) pair. The entropy belongs to the physical
token (it does not depend on the target), so every logical token with a target
reads its physical token's.

The result is exactly :func:`seqpack.token_logprobs` on the rows packed back
to back (logits ``logits[tree.logical_index]``, offsets ``tree.cu_seqlens``): 0 at
each row's last token, at a target id < 0 ("no target") and, for the entropy too,
wherever there is no target; the gradient is that of the plain path summed onto
the physical tokens (each shared logit row receives every row's contribution).

    >>> import torch, seqpack
    >>> tree = seqpack.pack_prefix_tree([[5, 6, 7], [5, 6, 8, 9]])
    >>> logits = torch.zeros(tree.num_tokens, 10)            # uniform over 10 tokens
    >>> logits[1, 8] = 1.0                                   # after "5 6", 8 is likelier than 7
    >>> out = seqpack.token_logprobs(logits, tree)
    >>> [round(x, 4) for x in out.logprobs.tolist()]
    [-2.3026, -2.4612, 0.0, -2.3026, -1.4612, -2.3026, 0.0]

:func:`tree_linear_token_logprobs` is the same with the LM head fused in (``hidden``
``[T, H]`` and the head's ``weight``, never a ``[T, V]`` tensor), as
:func:`~seqpack.training.logprobs.linear_token_logprobs` is for packed rows (a
user calls both as :func:`seqpack.token_logprobs` with ``weight``). Vocabulary
(tensor) parallelism is not here: the logits (or the head) hold the whole
vocabulary ``[0, V)``. Context parallelism is (``cp_size``, ``cp_rank``): a rank's
logits are its rows of the tree's ranges cut (:func:`seqpack.shard_layout`), and it
gets the log-probs of the logical tokens those rows predict.
Importing this module does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional, Tuple

import numpy as np

from .._lengths import as_positive_int, as_temperature
from ..tensors.prefix_tree import PrefixTreeBatch
from ..tensors.layout_kinds import as_tree
from ..tensors.tree_plans import TreeTargets, scored_targets, tree_targets
from .logprobs import TokenLogprobs

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["TreeTargets", "tree_targets", "tree_token_logprobs", "tree_linear_token_logprobs"]


def tree_token_logprobs(logits: "torch.Tensor", tree: PrefixTreeBatch, *, temperature: Any = 1.0,
                        return_entropy: bool = False, num_threads: int = 0, cp_size: Any = 1,
                        cp_rank: Any = 0, scored: Any = None) -> TokenLogprobs:
    """Log-probability (and entropy) of each logical token's next token, from the
    logits of ``tree``'s physical tokens; differentiable (see the module docstring).

    Args:
        logits: ``[T, V]`` (fp32, bf16, fp16; fp64 for ``gradcheck``), one row per
            physical token of ``tree`` (``T = tree.num_tokens``; the rows of pad
            tokens are ignored and get no gradient), the whole vocabulary ``[0, V)``.
        tree: the :class:`~seqpack.PrefixTreeBatch` the logits were computed on
            (one whose rows share nothing runs :func:`~seqpack.training.logprobs.packed_token_logprobs`
            on its :meth:`~seqpack.PrefixTreeBatch.rows`: no targets plan). Its token ids (pad tokens aside) must be ``< V``; an id < 0 as a target
            means "no target": log-prob 0, entropy 0, no gradient.
        temperature: logits are divided by it first (positive, finite; a Python,
            NumPy or 0-d tensor number).
        return_entropy: also compute each logical token's entropy.
        num_threads: CPU threads of the kernels (0: seqpack's default).
        cp_size, cp_rank: context parallelism over the tree
            (``seqpack.shard_layout(tree, cp_size, cp_rank)``, what
            :func:`seqpack.token_logprobs` takes): ``logits`` then holds this rank's
            rows ``[bounds[r], bounds[r + 1])`` of that cut's ``bounds``,
            and only the logical tokens those rows predict get values (0 elsewhere):
            the ranks' results sum to the whole tree's.
        scored: ``[N]`` bool (NumPy, a list or a tensor) - only these logical tokens'
            next tokens are wanted (a GRPO batch's completion tokens; TRL's labels
            that are not -100): the others read 0 (entropy too), and the rows of
            the physical tokens that predict no scored token are never computed
            (no log-sum-exp, no gradient). None: every logical token. ``logits``
            may then hold those rows alone, ``scored_targets(tree, scored)[0]``
            (HF: ``model(..., logits_to_keep=rows)``), no CP.

    Returns:
        :class:`~seqpack.TokenLogprobs` ``(logprobs, entropy)`` ``[N]`` in the logical
        layout (``N = tree.num_logical_tokens``, the rows concatenated), fp32 (fp64
        for fp64 logits), on the logits' device; 0 at each row's last token.
        ``entropy`` is ``None`` unless asked for.
    """
    import torch

    from .logprobs import check_logits

    _check_tree(tree)
    check_logits(logits)
    rows = _local_rows(tree, cp_size, cp_rank)
    vocab = int(logits.shape[1])
    temp, entropy = as_temperature(temperature), bool(return_entropy)
    if scored is not None:
        sel, plan, (primary, offsets, ids) = _scored_plan(tree, scored, logits.device, rows)
        logits = _scored_rows(logits, "logits", sel, rows)
        _check_tree_ids(tree, vocab)
        out = torch.ops.seqpack.multi_token_logprobs(logits.contiguous(), primary, offsets, ids, temp, entropy,
                                                     as_positive_int(num_threads, "num_threads", allow_zero=True))
        return _logical(out, plan, entropy)
    _check_rows(logits, "logits", rows, tree)
    _check_tree_ids(tree, vocab)
    plan, (primary, offsets, ids) = _device_plan(tree, logits.device, rows)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    threads = as_positive_int(num_threads, "num_threads", allow_zero=True)
    out = torch.ops.seqpack.multi_token_logprobs(logits, primary, offsets, ids, temp, entropy, threads)
    return _logical(out, plan, entropy)


def tree_linear_token_logprobs(hidden: "torch.Tensor", weight: "torch.Tensor", tree: PrefixTreeBatch, *,
                               bias: Optional["torch.Tensor"] = None, temperature: Any = 1.0,
                               return_entropy: bool = False, chunk_tokens: Optional[int] = None,
                               num_threads: int = 0, cp_size: Any = 1, cp_rank: Any = 0,
                               scored: Any = None) -> TokenLogprobs:
    """:func:`tree_token_logprobs` of ``hidden @ weight.T + bias`` without ever holding
    the ``[T, V]`` logits: the LM head fused in, a chunk of ``chunk_tokens`` physical
    tokens at a time, forward and backward (the chunks of
    :func:`~seqpack.training.logprobs.linear_token_logprobs`). A branch point's extra targets read their
    logits as ``hidden[p] . weight[id] (+ bias[id])``: one dot product each.

    Args:
        hidden: ``[T, H]`` final hidden states of ``tree``'s physical tokens, float32 /
            bfloat16 / float16 / float64.
        weight: ``[V, H]`` the LM head (the whole vocabulary), same dtype and device;
            bias: ``[V]`` or None.
        tree, temperature, return_entropy, cp_size, cp_rank, scored: as
            :func:`tree_token_logprobs` (with CP, ``hidden`` holds this rank's rows;
            with ``scored``, it may hold the scored rows alone).
        chunk_tokens: rows of logits per chunk (default: about 2^24 logits, 2^26 on
            CUDA); >= 1.
        num_threads: CPU threads of the kernels (0: seqpack's default).

    Returns:
        :class:`~seqpack.TokenLogprobs` ``[N]`` in the logical layout, as
        :func:`tree_token_logprobs` gives for the logits ``hidden @ weight.T + bias``.

    >>> import torch, seqpack
    >>> tree = seqpack.pack_prefix_tree([[1, 2, 3], [1, 2, 0]])
    >>> hidden, head = torch.zeros(tree.num_tokens, 8), torch.zeros(4, 8)   # uniform over 4 tokens
    >>> [round(x, 4) for x in seqpack.token_logprobs(hidden, tree, weight=head).logprobs.tolist()]
    [-1.3863, -1.3863, 0.0, -1.3863, -1.3863, 0.0]
    """
    torch = _torch()
    from . import _logprob_ops as ops
    from .logprobs import check_head

    _check_tree(tree)
    check_head(hidden, weight, bias)
    rows = _local_rows(tree, cp_size, cp_rank)
    vocab = int(weight.shape[0])
    temp, entropy = as_temperature(temperature), bool(return_entropy)
    chunk = ops.chunk_rows(0 if chunk_tokens is None else as_positive_int(chunk_tokens, "chunk_tokens"),
                           hidden.shape[0], vocab, hidden.is_cuda)
    threads = as_positive_int(num_threads, "num_threads", allow_zero=True)
    if scored is not None:  # hidden: every row, or the scored rows alone (as tree_token_logprobs takes logits)
        sel, plan, (primary, offsets, ids) = _scored_plan(tree, scored, hidden.device, rows)
        hidden = _scored_rows(hidden, "hidden", sel, rows)
        _check_tree_ids(tree, vocab)
        out = torch.ops.seqpack.linear_multi_token_logprobs(hidden, weight, bias, primary, offsets, ids, temp,
                                                            entropy, threads, chunk)
        return _logical(out, plan, entropy)
    _check_rows(hidden, "hidden", rows, tree)
    _check_tree_ids(tree, vocab)
    plan, (primary, offsets, ids) = _device_plan(tree, hidden.device, rows)
    out = torch.ops.seqpack.linear_multi_token_logprobs(hidden, weight, bias, primary, offsets, ids, temp, entropy,
                                                        threads, chunk)
    return _logical(out, plan, entropy)


def rows_token_logprobs(x: "torch.Tensor", tree: PrefixTreeBatch, *, weight: Optional["torch.Tensor"] = None,
                        bias: Optional["torch.Tensor"] = None, temperature: Any = 1.0, return_entropy: bool = False,
                        chunk_tokens: Optional[int] = None, num_threads: int = 0) -> TokenLogprobs:
    """:func:`tree_token_logprobs` (``weight`` given: :func:`tree_linear_token_logprobs`,
    ``x`` the hidden states) of a tree whose rows share nothing: plain packing's
    kernel on its :meth:`~seqpack.PrefixTreeBatch.rows`, no targets plan, the result
    in the tree's logical layout."""
    from .logprobs import check_head, check_logits, linear_token_logprobs, packed_token_logprobs

    if weight is None:
        check_logits(x)
        vocab = int(x.shape[1])
    else:
        check_head(x, weight, bias)
        vocab = int(weight.shape[0])
    _check_rows(x, "logits" if weight is None else "hidden", (0, tree.num_tokens), tree)
    _check_tree_ids(tree, vocab)
    ids = _on_device(tree, "input_ids", x.device)
    options = dict(temperature=as_temperature(temperature), return_entropy=bool(return_entropy),
                   num_threads=num_threads)
    out = packed_token_logprobs(x, ids, tree.rows(), **options) if weight is None else \
        linear_token_logprobs(x, weight, ids, tree.rows(), bias=bias, chunk_tokens=chunk_tokens, **options)
    return _rows_logical(out, tree)


def _torch():
    import torch

    return torch


def _check_tree(tree: Any) -> None:
    as_tree(tree)


def _on_device(tree: PrefixTreeBatch, name: str, device) -> "torch.Tensor":
    """The tree's ``logical_index``, or its ``input_ids`` with -1 ("no target") at the
    pad tokens (whose ids are never read), on ``device``: copied there once per
    device and kept by the tree (a copy on the CPU too: its arrays are read-only)."""
    device = _torch().device(device)

    def build(t):
        from ..tensors._device import host_to_device

        values = np.array(getattr(t, name))
        if name == "input_ids":
            values[t.num_tokens - t.num_pad_tokens:] = -1
        return host_to_device([values], device)[0]

    return tree.host_plan((name, str(device)), build)


def _rows_logical(out: TokenLogprobs, tree: PrefixTreeBatch) -> TokenLogprobs:
    """Per-physical-row log-probs of a tree that shares nothing, in its logical layout."""
    index = _on_device(tree, "logical_index", out.logprobs.device)
    return TokenLogprobs(out.logprobs.index_select(0, index),
                         None if out.entropy is None else out.entropy.index_select(0, index))


def _local_rows(tree: PrefixTreeBatch, cp_size: Any, cp_rank: Any) -> Tuple[int, int]:
    """The physical rows ``[start, end)`` this CP rank's logits hold (all of them
    without CP)."""
    from ..tensors.prefix_tree_cp import _rank_range

    _check_tree(tree)
    _, start, end = _rank_range(tree, cp_size, cp_rank)
    return start, end


def _check_rows(x, name: str, rows: Tuple[int, int], tree: PrefixTreeBatch) -> None:
    start, end = rows
    if x.shape[0] == end - start:
        return
    if end - start == tree.num_tokens:
        raise ValueError(f"{name} must have one row per physical token of the tree (tree.num_tokens = "
                         f"{tree.num_tokens}), got {x.shape[0]} rows")
    raise ValueError(f"{name} must hold this CP rank's {end - start} rows of the tree (rows [{start}, {end}) of "
                     f"tree_cp_bounds), got {x.shape[0]} rows")


def _device_plan(tree: PrefixTreeBatch, device, rows: Tuple[int, int]) -> Tuple[TreeTargets, List["torch.Tensor"]]:
    """The tree's :class:`TreeTargets` for the physical rows ``[start, end)`` on the
    host (the whole tree's, or a CP rank's share of it: the other rows' pairs read
    the 0) and what the operators read of it (primary targets, extra offsets, extra
    ids) on ``device``; loads the operators."""
    from . import _multi_target_ops  # noqa: F401  (registers seqpack::*multi_token_logprobs)
    from ..tensors._device import host_to_device

    plan = tree_targets(tree)
    start, end = rows
    if (start, end) != (0, tree.num_tokens):
        plan = _local_targets(plan, start, end)
    return plan, host_to_device([plan.primary, plan.extra_offsets, plan.extra_target], device)


def _scored_plan(tree: PrefixTreeBatch, scored: Any, device, rows: Tuple[int, int]):
    """The rows (local to ``rows``: a CP rank's) that predict a scored token, their
    :class:`TreeTargets` and what the operators read of it, on ``device``."""
    from . import _multi_target_ops  # noqa: F401  (registers seqpack::*multi_token_logprobs)
    from ..tensors._device import host_to_device

    if hasattr(scored, "detach"):
        scored = scored.detach().cpu().numpy()
    scored = np.asarray(scored)
    if scored.dtype != np.bool_:
        raise ValueError(f"scored must be bool (one flag per logical token), got {scored.dtype}")
    start, end = rows
    if (start, end) != (0, tree.num_tokens):  # a CP rank: the scored tokens its rows predict
        plan = _local_targets(tree_targets(tree), start, end)
        predicted = plan.logprob_index < plan.primary.shape[0] + plan.extra_source.shape[0]
        scored = scored & predicted if scored.shape == predicted.shape else scored
    sel, plan = scored_targets(tree, scored)
    if (start, end) != (0, tree.num_tokens):
        sel = sel - start
    return (host_to_device([sel], device)[0], plan,
            host_to_device([plan.primary, plan.extra_offsets, plan.extra_target], device))


def _scored_rows(x: "torch.Tensor", name: str, sel: "torch.Tensor", rows: Tuple[int, int]) -> "torch.Tensor":
    """``x``'s rows that predict a scored token: ``x`` holds every physical row (of
    this rank) or those rows alone (``scored_targets(tree, scored)[0]``)."""
    if x.shape[0] == sel.shape[0] and rows[1] - rows[0] != sel.shape[0]:  # the scored rows alone
        return x
    if x.shape[0] != rows[1] - rows[0]:
        raise ValueError(f"{name} must have one row per physical token of the tree ({rows[1] - rows[0]}) or one per "
                         f"row that predicts a scored token (scored_targets(tree, scored)[0]: {sel.shape[0]}), got "
                         f"{x.shape[0]} rows")
    return x.index_select(0, sel)


def _local_targets(plan: TreeTargets, start: int, end: int) -> TreeTargets:
    """``plan`` for the physical rows ``[start, end)`` alone: their targets, and each
    logical token's slot in the local concatenation (primary [n], extra [E_local],
    0), the 0 for a token another rank's rows predict."""
    t, n = plan.primary.shape[0], end - start
    lo, hi = int(plan.extra_offsets[start]), int(plan.extra_offsets[end])
    zero = n + (hi - lo)
    lp, e = plan.logprob_index, plan.extra_source.shape[0]
    is_extra = (lp >= t) & (lp < t + e)
    source = np.where(lp < t, lp, -1)  # each logical token's physical token (-1: no target)
    source[is_extra] = plan.extra_source[lp[is_extra] - t]
    local = (source >= start) & (source < end)
    logprob_index = np.full_like(lp, zero)
    logprob_index[local & ~is_extra] = lp[local & ~is_extra] - start
    logprob_index[local & is_extra] = n + (lp[local & is_extra] - t - lo)
    ent = plan.entropy_index
    entropy_index = np.where((ent >= start) & (ent < end), ent - start, n)
    return TreeTargets(plan.primary[start:end], plan.extra_source[lo:hi] - start, plan.extra_target[lo:hi],
                       plan.extra_offsets[start:end + 1] - lo, logprob_index, entropy_index)


def _logical(out, plan: TreeTargets, entropy: bool) -> TokenLogprobs:
    """The operator's (primary, extra, entropy, ...) read in the logical layout."""
    from ..tensors._device import host_to_device

    torch = _torch()
    lp, lp_extra, ent = out[0], out[1], out[2]
    lp_index, ent_index = host_to_device([plan.logprob_index, plan.entropy_index], lp.device)
    logprobs = torch.cat([lp, lp_extra, lp.new_zeros(1)]).index_select(0, lp_index)
    if not entropy:
        return TokenLogprobs(logprobs, None)
    return TokenLogprobs(logprobs, torch.cat([ent, ent.new_zeros(1)]).index_select(0, ent_index))


def _check_tree_ids(tree: PrefixTreeBatch, vocab: int) -> None:
    """Every real (non-pad) token id of ``tree`` must index the vocabulary ``[0, V)``
    or be negative ("no target"): the rule of packed_token_logprobs on the rows."""
    ids = tree.input_ids[: tree.num_tokens - tree.num_pad_tokens]
    if ids.shape[0] == 0 or int(ids.max()) < vocab:
        return
    pos = int(np.argmax(ids >= vocab))
    raise ValueError(f"tree.input_ids holds id {int(ids[pos])} (first out-of-range id at physical position {pos}); "
                     f"the vocabulary has {vocab} entries (logits.shape[1]); ids must be < {vocab}, or negative for "
                     "no target")
