"""Dynamic batching plans: sort, shard, and cut one shared plan of padded micro-batches.

Three rules (see ``docs/planning.md``):

* ``"nemo_rl"`` - NeMo-RL v0.6 ``shard_by_batch_size(dynamic_batching_args=...)``.
* ``"roll"`` - ROLL ``dynamic_batching_shard`` (with its VPP split when ``pp_size > 1``).
* ``"optimal"`` - dynamic programming over the same sorted order: the fewest padded
  tokens under the same cap (never worse than the greedy rules); with ``pp_size``
  the count is a multiple of it.

Example:
    >>> plan = plan_dynamic_batching([2, 8, 4, 16, 28, 32, 2, 32], shards=2,
    ...     max_tokens_per_microbatch=32, sequence_length_round=4, max_seqlen=128)
    >>> plan.sorted_indices, plan.micro_batch_indices, plan.micro_batch_lengths
    ([0, 2, 3, 5, 6, 1, 4, 7], [[[0, 2], [2, 3], [3, 4]]], [[8, 28, 32]])
"""

from __future__ import annotations

import html
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from .. import _core
from .._lengths import as_lengths, as_positive_int
from .metrics import dynamic_batching_metrics

RULES = ("nemo_rl", "roll", "optimal")


@dataclass
class DynamicBatchingPlan:
    """A dynamic-batching plan shared by all shards.

    Attributes:
        sorted_indices: the data order after sharding (NeMo-RL's
            ``batch_sorted_indices``): chunk by chunk, shard 0's rows then shard 1's...
        micro_batch_indices: per chunk, ``[start, end)`` row ranges within each
            shard's rows of that chunk (the same for every shard).
        micro_batch_lengths: per chunk, the padded length of each micro-batch.
        shards: number of data-parallel shards.
        shard_chunk_size: rows per shard per chunk.
        padded_tokens: tokens computed over all shards (rows x padded length).
        valid_tokens: real tokens.
        rule: the rule that built the plan.
    """

    sorted_indices: List[int]
    micro_batch_indices: List[List[List[int]]]
    micro_batch_lengths: List[List[int]]
    shards: int
    shard_chunk_size: int
    padded_tokens: int
    valid_tokens: int
    rule: str

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per shard over all chunks."""
        return sum(len(c) for c in self.micro_batch_indices)

    def shard_indices(self, shard: int) -> List[int]:
        """Original indices of one shard's rows, in its data order."""
        if not 0 <= shard < self.shards:
            raise ValueError(f"shard must be in [0, {self.shards}), got {shard}")
        per_chunk = self.shard_chunk_size * self.shards
        out: List[int] = []
        for c in range(len(self.micro_batch_indices)):
            start = c * per_chunk + shard * self.shard_chunk_size
            out.extend(self.sorted_indices[start : start + self.shard_chunk_size])
        return out

    def metrics(self, width: int, log_prefix: Optional[str] = None) -> Dict[str, float]:
        """ROLL's ``dynamic_batching/*`` metrics against a padded width."""
        return dynamic_batching_metrics(
            self.valid_tokens, self.padded_tokens, len(self.sorted_indices), width, log_prefix
        )

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{c}</td><td>{s}:{e}</td><td>{e - s}</td><td>{length}</td><td>{(e - s) * length}</td></tr>"
            for c, (idx, lens) in enumerate(zip(self.micro_batch_indices, self.micro_batch_lengths))
            for (s, e), length in zip(idx, lens)
        )
        head = html.escape(
            f"DynamicBatchingPlan ({self.rule}): {self.num_micro_batches} micro-batches per shard, "
            f"{self.shards} shards, {self.padded_tokens} padded tokens for {self.valid_tokens} real"
        )
        return (
            f"<b>{head}</b><table><tr><th>chunk</th><th>rows</th><th>n</th><th>length</th>"
            f"<th>tokens/shard</th></tr>{rows}</table>"
        )


def plan_dynamic_batching(
    input_lengths: Any,
    shards: int,
    max_tokens_per_microbatch: int,
    sequence_length_round: int,
    *,
    rule: str = "nemo_rl",
    batch_size: Optional[int] = None,
    max_seqlen: Optional[int] = None,
    pp_size: int = 1,
    forest: Any = None,
) -> DynamicBatchingPlan:
    """Plan dynamic batching for a batch of sequence lengths.

    Args:
        input_lengths: real length of every sequence.
        shards: data-parallel shards (DP size).
        max_tokens_per_microbatch: cap on rows x padded length per micro-batch.
        sequence_length_round: micro-batch lengths are rounded up to this.
        rule: ``"nemo_rl"``, ``"roll"`` or ``"optimal"``.
        batch_size: chunk size (global batch per optimizer step); ``None`` is the
            whole batch. Sorting never crosses a chunk boundary.
        max_seqlen: padded width of the batch: every length must fit in it, and
            rounded micro-batch lengths are clamped to it (NeMo-RL's rule;
            ``"optimal"`` plans on the rounded lengths, then clamps).
        pp_size: ``"roll"``: split micro-batches until the count is a multiple
            (ROLL does this with VPP); ``"optimal"``: the count is a multiple.
        forest: a :class:`~seqpack.PrefixForest` of the same rows
            (``input_lengths`` must be ``forest.lengths``): the micro-batches are
            prefix trees (the rule is then ``"forest"``, one C++ call). The plan
            keeps its shape (every shard the same rows per chunk, one list of row
            ranges shared by all shards, so equal counts), but the cap bounds each
            shard's micro-batch *physical* tokens rounded up to
            ``sequence_length_round``. Trees go to shards whole (heaviest first,
            to the least-loaded shard with room for their rows), cut in depth-first
            order only when no shard has room; the fewest ranges follow, split to
            a multiple of ``pp_size``. ``micro_batch_lengths``: each range's
            longest row, rounded (the width of its padded rows); ``padded_tokens``:
            the micro-batches' rounded physical tokens::

                shard 0: [A A A | B B]   A, B, C: trees; "|": the shared ranges
                shard 1: [C C C | D E]   each side of a "|" within the cap on every
                                         shard, as trees (a prompt once per part)

    Raises:
        ValueError: a padded length above the cap, a length above ``max_seqlen``,
            sizes that do not divide, an unknown rule.
    """
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    lengths = as_lengths(input_lengths, "input_lengths")
    core_forest = None
    if forest is not None:
        from .forest_planning import checked_forest

        if rule != "nemo_rl":
            warnings.warn(f"plan_dynamic_batching: rule={rule!r} is not used with forest= (the forest plan has the "
                          "fewest micro-batches, then the fewest physical tokens)", stacklevel=2)
        core_forest = checked_forest(forest, lengths)._core_forest()
    shards = as_positive_int(shards, "shards")
    width = 0 if max_seqlen is None else as_positive_int(max_seqlen, "max_seqlen")
    if width and lengths.size and lengths.max() > width:
        i = int(lengths.argmax())
        raise ValueError(f"input_lengths[{i}] = {int(lengths[i])} exceeds max_seqlen = {width} (the padded width of "
                         f"the batch): a micro-batch cannot be cut wider than its tensors")
    raw = _core.plan_dynamic_batching(
        lengths,
        rule,
        shards,
        0 if batch_size is None else as_positive_int(batch_size, "batch_size"),
        as_positive_int(max_tokens_per_microbatch, "max_tokens_per_microbatch"),
        as_positive_int(sequence_length_round, "sequence_length_round"),
        width,
        as_positive_int(pp_size, "pp_size"),
        forest=core_forest,
    )
    micro_batch_lengths, padded_tokens = raw["micro_batch_lengths"], raw["padded_tokens"]
    if width and rule != "nemo_rl" and forest is None:  # the core clamps for NeMo-RL's rule only
        micro_batch_lengths = [[min(length, width) for length in chunk] for chunk in micro_batch_lengths]
        padded_tokens = shards * sum((e - s) * length for idx, lens in zip(raw["micro_batch_indices"],
                                                                           micro_batch_lengths)
                                     for (s, e), length in zip(idx, lens))
    return DynamicBatchingPlan(
        sorted_indices=raw["sorted_indices"],
        micro_batch_indices=raw["micro_batch_indices"],
        micro_batch_lengths=micro_batch_lengths,
        shards=shards,
        shard_chunk_size=raw["shard_chunk_size"],
        padded_tokens=padded_tokens,
        valid_tokens=raw["valid_tokens"],
        rule="forest" if forest is not None else rule,
    )
