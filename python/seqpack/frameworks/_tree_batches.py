"""Prefix trees through :class:`~seqpack.BatchedDataDict` (issue 29): sequence-packing
shards planned on physical tokens, and micro-batches that come out as trees.

``shard_by_batch_size(..., sequence_packing_args={..., "shared_prefix": True})``
plans each global batch's bins with a :class:`~seqpack.PrefixForest` of its rows
(:func:`seqpack.plan_micro_batches` with ``forest=``): a bin's *physical* tokens (its
rows laid out as a tree, padded to ``sequence_length_pad_multiple``) never pass
``max_tokens_per_microbatch``, and a GRPO group (a tree) that fits stays whole in
one bin, so on one rank. ``make_microbatch_iterator_for_packable_sequences(
shared_prefix=True)`` (and the dynamic-batching iterator) then yields a
:class:`TreeMicroBatch` per bin::

    global batch rows      0 1 2 3 | 4 5 6 7          (two prompts, G = 4)
    bins (shards = 2)      [0 1 2 3] [4 5 6 7]        each group whole
    rank 0, micro-batch 0  TreeMicroBatch(tree = prompt 0 once + 4 responses,
                                          data = rows 0..3, rows = [0, 1, 2, 3])

Iterate with the options the shards were planned with (``group_key`` = the
``shared_prefix_group_key``, ``min_shared_tokens`` = 1): the packing iterator
refuses a tree whose real tokens pass its micro-batch's planned length, or whose
``pad_to_multiple_of`` padding passes that length rounded up to the multiple.

Importing this module does not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .._lengths import as_positive_int
from ._batch import coupled_trees, group_codes
from ..tensors.layout import round_up

if TYPE_CHECKING:  # pragma: no cover
    from ..tensors.prefix_tree import PrefixTreeBatch
    from .batched_data_dict import SlicedDataDict

__all__ = ["TreeMicroBatch", "bin_trees", "shared_prefix_bins", "tree_micro_batch"]


@dataclass(frozen=True)
class TreeMicroBatch:
    """One micro-batch as a prefix tree.

    Attributes:
        tree: the :class:`~seqpack.PrefixTreeBatch` of the micro-batch's rows (its
            logical row ``r`` is ``data``'s row ``r``): run the model on
            ``tree.input_ids`` / ``tree.position_ids`` with
            :func:`~seqpack.tree_attention`, and the loss with
            ``SequencePackingLossWrapper(loss_fn, cu_seqlens_q=tree)``.
        data: the micro-batch's rows (a ``SlicedDataDict``, in the tree's logical row
            order); a dummy micro-batch's one zero-loss row.
        rows: the rows' positions in the batch the iterator ran on (a shard's
            ``get_batch``, in the shard's order, as ``micro_batch_indices`` count
            them); empty for a dummy.
    """

    tree: "PrefixTreeBatch"
    data: "SlicedDataDict"
    rows: Tuple[int, ...]

    def forward(self, model: Any, **model_kwargs: Any) -> Any:
        """The logits ``[1, T, V]`` of a transformers ``model`` (bare or under FSDP /
        DDP / PEFT) on the tree's physical tokens, the ``next_token_logits`` of
        ``SequencePackingLossWrapper(loss_fn, cu_seqlens_q=self.tree)(logits,
        self.data, ...)``: NeMo-RL's policy forward on a tree
        (:func:`seqpack.frameworks.policy_forward.nemo_rl_tree_forward`)."""
        from .policy_forward import nemo_rl_tree_forward

        return nemo_rl_tree_forward(model, self, **model_kwargs)

    def logprobs(self, model: Any, *, temperature: Any = 1.0, **model_kwargs: Any) -> Any:
        """NeMo-RL's ``get_logprobs`` on the tree: ``[B, S]`` token log-probs, 0 at
        column 0 and past each row (:func:`seqpack.frameworks.policy_forward.
        nemo_rl_tree_logprobs`)."""
        from .policy_forward import nemo_rl_tree_logprobs

        return nemo_rl_tree_logprobs(model, self, temperature=temperature, **model_kwargs)


def _row_tokens(data: Mapping[str, Any], input_key: str, lengths: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """The rows' real tokens packed back to back (host int64) and their offsets."""
    ids = data[input_key]
    if not hasattr(ids, "dim") or ids.dim() != 2:
        raise ValueError(f"shared_prefix needs {input_key!r} as a [batch, seq] tensor of token ids")
    host = ids.detach().cpu().numpy()
    if lengths.shape[0] != host.shape[0] or (lengths.shape[0] and int(lengths.max()) > host.shape[1]):
        raise ValueError(f"the input lengths ({lengths.shape[0]} rows, longest {int(lengths.max(initial=0))}) do not "
                         f"fit {input_key!r} {tuple(host.shape)}")
    keep = np.arange(host.shape[1])[None, :] < lengths[:, None]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return host[keep].astype(np.int64), cu


def _group_ids(data: Mapping[str, Any], group_key: Optional[str], rows: Sequence[int]) -> Optional[List[Any]]:
    if group_key is None:
        return None
    if group_key not in data:
        raise ValueError(f"shared_prefix_group_key {group_key!r} is not a key of the data")
    values = data[group_key]
    if hasattr(values, "tolist"):  # a tensor or array: its items (0-d tensors hash by identity)
        values = values.tolist()
    return group_codes([values[i] for i in rows])


def shared_prefix_bins(data: Mapping[str, Any], lengths: np.ndarray, shards: int, batch_size: int,
                       args: Mapping[str, Any], pad_key: str = "sequence_length_pad_multiple"
                       ) -> Tuple[List[List[List[int]]], List[List[int]]]:
    """Per global batch: its bins (chunk-local row indices, a multiple of ``shards``
    of them) planned on a forest of its rows, and each bin's physical tokens rounded
    up to ``args[pad_key]`` (the pad multiple). Trees are split where that fills
    bins, unless ``args["force_group_size"] > 1`` (rows the loss couples, NeMo-RL's
    DPO pairs): then every tree stays whole, each group of rows in one tree."""
    from ..planning.balance import plan_micro_batches
    from ..planning.prefix_forest import PrefixForest

    multiple = as_positive_int(args[pad_key], pad_key)
    cap = as_positive_int(args["max_tokens_per_microbatch"], "max_tokens_per_microbatch")
    usable = cap // multiple * multiple  # physical tokens <= usable -> padded tokens <= cap
    if usable == 0:
        raise ValueError(f"max_tokens_per_microbatch ({cap}) is below {pad_key} ({multiple})")
    if lengths.size and int(lengths.max()) > usable:
        row = int(lengths.argmax())
        raise ValueError(f"row {row} has {int(lengths[row])} tokens, more than max_tokens_per_microbatch = {cap} "
                         f"holds as a tree padded to {pad_key} = {multiple} ({usable})")
    flat, cu = _row_tokens(data, args["input_key"], lengths)
    group_key = args.get("shared_prefix_group_key")
    bins_per_chunk, loads_per_chunk = [], []
    for c in range(0, lengths.shape[0], batch_size):
        rows = range(c, min(c + batch_size, lengths.shape[0]))
        forest = PrefixForest.from_packed(flat[cu[c]: cu[rows.stop]], cu[c: rows.stop + 1] - cu[c],
                                          group_ids=_group_ids(data, group_key, rows))
        group = args.get("force_group_size")
        coupled = 1 if group is None else as_positive_int(group, "force_group_size")
        if coupled > 1:
            coupled_trees(forest, coupled, usable, "force_group_size", "max_tokens_per_microbatch (rounded down to "
                          f"{pad_key})")
        plan = plan_micro_batches(forest.lengths, usable, min_num=shards, multiple_of=shards, forest=forest,
                                  whole_trees=coupled > 1)
        bins_per_chunk.append([list(b) for b in plan.micro_batches])
        loads_per_chunk.append([int(round_up(t, multiple)) for t in plan.tokens])
    return bins_per_chunk, loads_per_chunk


def bin_trees(data: Mapping[str, Any], lengths: np.ndarray, bins: Sequence[Sequence[int]], input_key: str,
              group_key: Optional[str]) -> List["PrefixTreeBatch"]:
    """The prefix tree of each bin's rows (positions in ``data``, in the bin's
    order), as the iterator would build it with its default options, with its host
    plans built (:func:`seqpack.prepare_tree`): built once where the shards are, so
    iterating a shard builds no trie and no plan."""
    from ..tensors.prefix_tree import PrefixTreeBatch
    from ..tensors.tree_plans import prepare_tree

    flat, cu = _row_tokens(data, input_key, lengths)
    out = []
    for rows in bins:
        rows = list(rows)
        tokens = np.concatenate([flat[cu[r]:cu[r + 1]] for r in rows]) if rows else np.zeros(0, dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths[rows])]).astype(np.int64)
        out.append(prepare_tree(PrefixTreeBatch.from_packed(tokens, offsets, group_ids=_group_ids(data, group_key, rows))))
    return out


def tree_micro_batch(mb: "SlicedDataDict", rows: Sequence[int], lengths: np.ndarray, *, input_key: str = "input_ids",
                     group_key: Optional[str] = None, min_shared_tokens: Any = 1, pad_to_multiple_of: Any = 1,
                     planned_tokens: Optional[int] = None, token_cap: Optional[int] = None) -> TreeMicroBatch:
    """The :class:`TreeMicroBatch` of the micro-batch ``mb`` (at positions ``rows``
    of the batch iterated; ``lengths`` its rows' real tokens). ``planned_tokens``:
    the micro-batch's planned length, which the tree's real tokens must not pass;
    ``token_cap``: the cap it was planned under, which its padding must not pass
    (without one, the planned length rounded up to ``pad_to_multiple_of``)."""
    from ..tensors.prefix_tree import PrefixTreeBatch

    flat, cu = _row_tokens(mb.data, input_key, lengths)
    tree = PrefixTreeBatch.from_packed(flat, cu, group_ids=_group_ids(mb.data, group_key, range(lengths.shape[0])),
                                       min_shared_tokens=min_shared_tokens, pad_to_multiple_of=pad_to_multiple_of)
    if rows and planned_tokens is not None:
        # The plan counts physical tokens (a sequence-packing plan already rounded up
        # to its pad multiple, a plan_step(forest=) plan not): the tree's real tokens
        # must fit its entry, and its padding the cap it was planned under.
        real, multiple = tree.num_tokens - tree.num_pad_tokens, as_positive_int(pad_to_multiple_of, "pad_to_multiple_of")
        cap = round_up(planned_tokens, multiple) if token_cap is None else max(int(token_cap), planned_tokens)
        if real > planned_tokens:
            raise ValueError(f"the tree of rows {list(rows)[:8]} has {real} tokens, more than its planned "
                             f"micro_batch_lengths entry ({planned_tokens}): iterate with the options the shards were "
                             f"planned with (group_key = the shared_prefix_group_key, got {group_key!r}; "
                             f"min_shared_tokens = 1, got {min_shared_tokens!r})")
        if tree.num_tokens > cap:
            raise ValueError(f"the tree of rows {list(rows)[:8]} has {real} tokens, {tree.num_tokens} padded to "
                             f"pad_to_multiple_of = {multiple}: more than the {cap} tokens its micro-batch was planned "
                             f"under ({'the token cap' if token_cap is not None else 'its entry rounded up'})")
    return TreeMicroBatch(tree=tree, data=mb, rows=tuple(int(r) for r in rows))
