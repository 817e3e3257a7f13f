"""NeMo-RL's loss wrapper over a hybrid-CP micro-batch (:class:`~seqpack.HybridCpBatch`):
what :class:`~seqpack.SequencePackingLossWrapper` runs when its layout is one.

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

    >>> wrapper = SequencePackingLossWrapper(NLLLoss(), cu_seqlens_q=micro_batch)  # doctest: +SKIP
    >>> loss, metrics = wrapper(logits, data, global_valid_seqs, global_valid_toks)  # doctest: +SKIP

``data`` holds the micro-batch's sequences ``[B, S]`` in ``micro_batch.rows``
order (what :meth:`BatchedDataDict.make_hybrid_cp_microbatch_iterator
<seqpack.BatchedDataDict.make_hybrid_cp_microbatch_iterator>` yields beside each
micro-batch).
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Tuple

from .._equality import ValueEquality
from ..tensors.layout_kinds import as_layout

__all__ = ["PartsLoss"]

_EXTREMES = ("_min", "_max")


def _rows(data: Mapping[str, Any], start: int, end: int) -> Dict[str, Any]:
    return {k: v[start:end] for k, v in data.items()}


class PartsLoss(ValueEquality):
    """Runs a loss per part of ``batch``: ``wrapper.for_part(layout, group)`` builds
    the loss wrapper of one part (its layout, its block's group:
    ``batch.block_group(part)``, made where it runs, so the object pickles without
    process groups)."""

    def __init__(self, batch: Any, wrapper: Any) -> None:
        self.batch, self.wrapper = as_layout(batch), wrapper  # the composite layout (a PartsLayout)
        for part in self.batch.parts:  # each part's wrapper checks the loss and its layout, now
            wrapper.for_part(as_layout(part.layout), None)

    def __call__(self, next_token_logits: Any, data: Mapping[str, Any], global_valid_seqs: Any,
                 global_valid_toks: Any, *, lm_head_weight: Any = None, lm_head_bias: Any = None
                 ) -> Tuple[Any, Dict[str, float]]:
        batch = self.batch
        rows = next_token_logits.shape[-2] if next_token_logits.dim() == 3 else next_token_logits.shape[0]
        if rows != batch.num_local_tokens:
            raise ValueError(f"next_token_logits has {rows} rows; the hybrid micro-batch holds "
                             f"{batch.num_local_tokens} on this rank")
        sizes = {k: (v.shape[0] if hasattr(v, "shape") else len(v)) for k, v in data.items()}
        wrong = {k: n for k, n in sizes.items() if n != batch.num_rows}
        if wrong:
            raise ValueError(f"data must hold the micro-batch's {batch.num_rows} sequences (in "
                             f"micro_batch.rows order); got rows {wrong}")
        logits = next_token_logits[0] if next_token_logits.dim() == 3 else next_token_logits
        total = logits[:0].sum()  # a rank with no part still has a backward (its dummy micro-batch)
        merged: Dict[str, float] = {}
        first = 0
        for part in batch.parts:
            wrapper = self.wrapper.for_part(as_layout(part.layout), batch.block_group(part))
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
