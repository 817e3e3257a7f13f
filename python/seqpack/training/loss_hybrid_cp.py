"""NeMo-RL's loss wrapper over a hybrid-CP micro-batch (:class:`~seqpack.HybridCpBatch`).

Each part runs :class:`~seqpack.SequencePackingLossWrapper` on its own rows of the
logits and data: a whole part with no CP group, a sharded part with its block's
group (the log-probs all-gathered over the block, so each of its ranks computes the
same loss, NeMo-RL's CP convention). A sharded part's loss (and its summed metrics)
is then divided by its degree, so the ranks' losses add up to the micro-batch's::

    rank 1 of C = 4:   [ E whole | B/2 over (2, 0) | A/4 over (4, 0) ]
    loss               L(E)    +   L(B) / 2      +   L(A) / 4

Summed over the DP x CP ranks (the gradients' all-reduce), every sequence counts
once, normalised by ``global_valid_toks`` / ``global_valid_seqs`` as without CP:
unlike fixed CP, do not divide the loss by the CP size.

    >>> wrapper = HybridCpLossWrapper(NLLLoss(), micro_batch)            # doctest: +SKIP
    >>> loss, metrics = wrapper(logits, data, global_valid_seqs, global_valid_toks)  # doctest: +SKIP

``data`` holds the micro-batch's sequences ``[B, S]`` in ``micro_batch.rows``
order (what :meth:`BatchedDataDict.make_hybrid_cp_microbatch_iterator
<seqpack.BatchedDataDict.make_hybrid_cp_microbatch_iterator>` yields beside each
micro-batch).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from .._equality import ValueEquality
from .._lengths import as_temperature, type_name

__all__ = ["HybridCpLossWrapper"]

_EXTREMES = ("_min", "_max")


def _rows(data: Mapping[str, Any], start: int, end: int) -> Dict[str, Any]:
    return {k: v[start:end] for k, v in data.items()}


def _layout(part: Any) -> Any:
    """What the wrapper takes as ``cu_seqlens_q``: a tree, or a packed part's layout."""
    return part.layout if part.is_tree else part.layout.layout


class HybridCpLossWrapper(ValueEquality):
    """:class:`~seqpack.SequencePackingLossWrapper` over every part of a hybrid-CP
    micro-batch (see the module docstring). It holds the loss, the batch and the
    options (it pickles and compares by them); each part's wrapper, with its
    block's group (``batch.block_group(part)``: the groups
    :func:`~seqpack.hybrid_cp_micro_batches` made), is built when called, in the
    process that runs it.

    Args:
        loss_fn: NeMo-RL's loss function (as the wrapper takes it).
        batch: this rank's :class:`~seqpack.HybridCpBatch`.
        fused / temperature / vocab_parallel_rank / vocab_parallel_group / agree:
            as :class:`~seqpack.SequencePackingLossWrapper`, for every part.
    """

    def __init__(self, loss_fn: Callable, batch: Any, *, fused: bool = False, temperature: float = 1.0,
                 vocab_parallel_rank: Optional[int] = None, vocab_parallel_group: Any = None,
                 agree: bool = True) -> None:
        from ..tensors.hybrid_cp import HybridCpBatch
        from .loss import SequencePackingLossWrapper

        if not isinstance(batch, HybridCpBatch):
            raise TypeError(f"batch must be a seqpack.HybridCpBatch, got {type_name(batch)}")
        self.loss_fn, self.batch = loss_fn, batch
        self.options = dict(fused=bool(fused), temperature=as_temperature(temperature),
                            vocab_parallel_rank=vocab_parallel_rank, vocab_parallel_group=vocab_parallel_group,
                            agree=bool(agree))
        for part in batch.parts:  # the wrapper's own checks of the loss and the layout, now
            SequencePackingLossWrapper(loss_fn, cu_seqlens_q=_layout(part), **self.options)

    def _wrappers(self) -> list:
        from .loss import SequencePackingLossWrapper

        return [SequencePackingLossWrapper(self.loss_fn, cu_seqlens_q=_layout(p), **self.options,
                                           context_parallel_group=self.batch.block_group(p))
                for p in self.batch.parts]

    def __call__(self, next_token_logits: Any, data: Mapping[str, Any], global_valid_seqs: Any,
                 global_valid_toks: Any, *, lm_head_weight: Any = None, lm_head_bias: Any = None
                 ) -> Tuple[Any, Dict[str, float]]:
        rows = next_token_logits.shape[-2] if next_token_logits.dim() == 3 else next_token_logits.shape[0]
        if rows != self.batch.num_tokens:
            raise ValueError(f"next_token_logits has {rows} rows; the hybrid micro-batch holds "
                             f"{self.batch.num_tokens} on this rank")
        sizes = {k: (v.shape[0] if hasattr(v, "shape") else len(v)) for k, v in data.items()}
        wrong = {k: n for k, n in sizes.items() if n != len(self.batch.rows)}
        if wrong:
            raise ValueError(f"data must hold the micro-batch's {len(self.batch.rows)} sequences (in "
                             f"micro_batch.rows order); got rows {wrong}")
        logits = next_token_logits[0] if next_token_logits.dim() == 3 else next_token_logits
        total = logits[:0].sum()  # a rank with no part still has a backward (its dummy micro-batch)
        merged: Dict[str, float] = {}
        first = 0
        for part, wrapper in zip(self.batch.parts, self._wrappers()):
            n = len(part.rows)
            loss, metrics = wrapper(logits[part.start:part.end], _rows(data, first, first + n), global_valid_seqs,
                                    global_valid_toks, lm_head_weight=lm_head_weight, lm_head_bias=lm_head_bias)
            first += n
            total = total + loss / part.degree
            for key, value in metrics.items():
                value = float(value)
                if key.endswith(_EXTREMES):  # running min / max, as the wrapper merges them
                    pick = min if key.endswith("_min") else max
                    merged[key] = pick(merged[key], value) if key in merged else value
                else:  # a sharded part's share, so that the ranks' sums count it once
                    merged[key] = merged.get(key, 0.0) + value / part.degree
        return total, merged
