"""Prefix trees of a batch's rows (issue 29): the :class:`TreeMicroBatch` the
iterators yield, and the trees of a shard's micro-batches, built from its rows'
tokens under one sharing rule::

    global batch rows      0 1 2 3 | 4 5 6 7          (two prompts, G = 4)
    bins (shards = 2)      [0 1 2 3] [4 5 6 7]        each group whole
    rank 0, micro-batch 0  TreeMicroBatch(tree = prompt 0 once + 4 responses,
                                          data = rows 0..3, rows = [0, 1, 2, 3])

A sharing rule is a label per row (rows share prefixes only with rows of their
label: a ``group_key`` column, or the trees of a plan's
:class:`~seqpack.PrefixForest`) and ``min_shared_tokens``.

    >>> import torch
    >>> from seqpack.frameworks.nemo_rl.trees import bin_trees
    >>> data = {"input_ids": torch.tensor([[5, 6, 7], [5, 6, 8], [9, 9, 0]])}
    >>> [t.num_tokens for t in bin_trees(data, np.array([3, 3, 2]), [[0, 1], [2], []], "input_ids", None)[:2]]
    [4, 2]

Importing this module does not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .._batch import group_codes
from ..._lengths import as_positive_int
from ...tensors.layout import round_up
from .errors import BatchedDataDictError

if TYPE_CHECKING:  # pragma: no cover
    from ...tensors.prefix_tree import PrefixTreeBatch

__all__ = ["TreeMicroBatch", "bin_trees", "checked_tree", "group_labels", "row_tokens"]


@dataclass(frozen=True)
class TreeMicroBatch:
    """One micro-batch as a prefix tree.

    Attributes:
        tree: the :class:`~seqpack.PrefixTreeBatch` of the micro-batch's rows (its
            logical row ``r`` is ``data``'s row ``r``): run the model on
            ``tree.input_ids`` / ``tree.position_ids`` with
            :func:`~seqpack.attention`, and the loss with
            ``SequencePackingLossWrapper(loss_fn, cu_seqlens_q=tree)``.
        data: the micro-batch's rows (a ``SlicedDataDict``, in the tree's logical row
            order); a dummy micro-batch's one zero-loss row.
        rows: the rows' positions in the batch the iterator ran on (a shard's
            ``get_batch``, in the shard's order, as ``micro_batch_indices`` count
            them); empty for a dummy.
        pass_micro_batch: on a batch planned in passes (prefix reuse), the
            :class:`~seqpack.PassMicroBatch` of the running step whose forward
            :meth:`forward` runs (``tree`` is then its pass's layout and ``data``
            the whole batch's rows); None otherwise.
    """

    tree: "PrefixTreeBatch"
    data: Mapping[str, Any]
    rows: Tuple[int, ...]
    pass_micro_batch: Any = None

    def forward(self, model: Any, **model_kwargs: Any) -> Any:
        """The logits ``[1, T, V]`` of a transformers ``model`` (bare or under FSDP /
        DDP / PEFT) on the tree's physical tokens, the ``next_token_logits`` of
        ``SequencePackingLossWrapper(loss_fn, cu_seqlens_q=self.tree)(logits,
        self.data, ...)``: NeMo-RL's policy forward on a tree
        (:func:`seqpack.frameworks.policy_forward.nemo_rl_tree_forward`). On a pass
        of a batch planned for prefix reuse, the pass's logits ``[1, N, V]`` (its own
        tokens, the prefixes it reads forwarded once in the step; ``self.tree`` is
        the pass's :class:`~seqpack.TreePass`)."""
        if self.pass_micro_batch is not None:
            return self.pass_micro_batch.forward(model, **model_kwargs)
        from ..policy_forward import nemo_rl_tree_forward

        return nemo_rl_tree_forward(model, self, **model_kwargs)

    def logprobs(self, model: Any, *, temperature: Any = 1.0, **model_kwargs: Any) -> Any:
        """NeMo-RL's ``get_logprobs`` on the tree: ``[B, S]`` token log-probs, 0 at
        column 0 and past each row (:func:`seqpack.frameworks.policy_forward.
        nemo_rl_tree_logprobs`); on a pass, the columns it predicts (sum a batch's
        passes, run under ``torch.no_grad()`` in their order)."""
        from ..policy_forward import nemo_rl_tree_logprobs

        return nemo_rl_tree_logprobs(model, self, temperature=temperature, **model_kwargs)


def row_tokens(data: Mapping[str, Any], input_key: str, lengths: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """The rows' real tokens packed back to back (host int64) and their offsets."""
    ids = data.get(input_key)
    if not hasattr(ids, "dim") or ids.dim() != 2:
        raise ValueError(f"shared_prefix needs {input_key!r} as a [batch, seq] tensor of token ids")
    host = ids.detach().cpu().numpy()
    if lengths.shape[0] != host.shape[0] or (lengths.shape[0] and int(lengths.max()) > host.shape[1]):
        raise ValueError(f"the input lengths ({lengths.shape[0]} rows, longest {int(lengths.max(initial=0))}) do not "
                         f"fit {input_key!r} {tuple(host.shape)}")
    keep = np.arange(host.shape[1])[None, :] < lengths[:, None]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return host[keep].astype(np.int64), cu


def group_labels(data: Mapping[str, Any], group_key: Optional[str]) -> Optional[List[Any]]:
    """Each row's value of ``group_key`` (None without one): the sharing rule's labels."""
    if group_key is None:
        return None
    if group_key not in data:
        raise ValueError(f"shared_prefix_group_key {group_key!r} is not a key of the data")
    values = data[group_key]
    return values.tolist() if hasattr(values, "tolist") else list(values)  # 0-d tensors hash by identity


def _ids(labels: Optional[Sequence[Any]], rows: Sequence[int]) -> Optional[List[int]]:
    return None if labels is None else group_codes([labels[r] for r in rows])


def bin_trees(data: Mapping[str, Any], lengths: np.ndarray, bins: Sequence[Sequence[int]], input_key: str,
              labels: Optional[Sequence[Any]], pad_to: Optional[Sequence[int]] = None
              ) -> List[Optional["PrefixTreeBatch"]]:
    """The prefix tree of each bin's rows (positions in ``data``, in the bin's order;
    rows share only within one of ``labels``, one per row of ``data``), with its host
    plans built (:func:`seqpack.prepare_tree`): built once where the shards are, so
    iterating a shard builds no trie and no plan. An empty bin (a dummy) has None.
    ``pad_to``: each bin's static shape (a step plan's bucket), its tree padded to it."""
    from ...tensors.prefix_tree import PrefixTreeBatch
    from ...tensors.tree_plans import prepare_tree

    flat, cu = row_tokens(data, input_key, lengths)
    out: List[Optional["PrefixTreeBatch"]] = []
    for b, rows in enumerate(bins):
        rows = list(rows)
        if not rows:
            out.append(None)
            continue
        tokens = np.concatenate([flat[cu[r]:cu[r + 1]] for r in rows])
        offsets = np.concatenate([[0], np.cumsum(lengths[rows])]).astype(np.int64)
        # a tree of T <= bucket physical tokens rounds up to exactly the bucket
        multiple = 1 if pad_to is None else int(pad_to[b])
        out.append(prepare_tree(PrefixTreeBatch.from_packed(tokens, offsets, group_ids=_ids(labels, rows),
                                                            pad_to_multiple_of=multiple)))
    return out


def checked_tree(mb: Mapping[str, Any], rows: Sequence[int], lengths: np.ndarray, *, input_key: str,
                 labels: Optional[Sequence[Any]], min_shared_tokens: Any = 1, pad_to_multiple_of: Any = 1,
                 planned_tokens: Optional[int] = None, token_cap: Optional[int] = None,
                 group_key: Optional[str] = None) -> "PrefixTreeBatch":
    """The prefix tree of the micro-batch ``mb`` (at positions ``rows`` of the batch
    iterated; ``lengths`` its rows' real tokens; ``labels`` one per row of ``mb``).
    ``planned_tokens``: the micro-batch's planned length, which the tree's real tokens
    must not pass; ``token_cap``: the cap it was planned under, which its padding
    must not pass (without one, the planned length rounded up to
    ``pad_to_multiple_of``). ``group_key`` only names the rule in the errors."""
    from ...tensors.prefix_tree import PrefixTreeBatch

    flat, cu = row_tokens(mb, input_key, lengths)
    tree = PrefixTreeBatch.from_packed(flat, cu, group_ids=_ids(labels, range(lengths.shape[0])),
                                       min_shared_tokens=min_shared_tokens, pad_to_multiple_of=pad_to_multiple_of)
    if rows and planned_tokens is not None:
        # The plan counts physical tokens (a sequence-packing plan already rounded up
        # to its pad multiple, a plan_step(forest=) plan not): the tree's real tokens
        # must fit its entry, and its padding the cap it was planned under.
        real = tree.num_tokens - tree.num_pad_tokens
        multiple = as_positive_int(pad_to_multiple_of, "pad_to_multiple_of")
        cap = round_up(planned_tokens, multiple) if token_cap is None else max(int(token_cap), planned_tokens)
        if real > planned_tokens:
            raise BatchedDataDictError(
                f"the tree of rows {list(rows)[:8]} has {real} tokens, more than its planned micro_batch_lengths entry "
                f"({planned_tokens}): iterate with the options the shards were planned with (group_key = the "
                f"shared_prefix_group_key, got {group_key!r}; min_shared_tokens = 1, got {min_shared_tokens!r})")
        if tree.num_tokens > cap:
            raise BatchedDataDictError(
                f"the tree of rows {list(rows)[:8]} has {real} tokens, {tree.num_tokens} padded to "
                f"pad_to_multiple_of = {multiple}: more than the {cap} tokens its micro-batch was planned under "
                f"({'the token cap' if token_cap is not None else 'its entry rounded up'})")
    return tree
