"""How a :class:`~seqpack.BatchedDataDict` is sharded: NeMo-RL's dynamic batching
and sequence packing (bins per global batch, dealt round-robin or by load; bins of
prefix trees with ``shared_prefix``), and shards by a :func:`seqpack.plan_step` plan.

Importing this module does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional

import numpy as np

from ._bdd_values import BatchedDataDictError, _check, _is_tensor, _lengths, _positive
from ._tree_batches import bin_trees, shared_prefix_bins
from .._lengths import as_lengths
from ..planning.balance import get_seqlen_balanced_partitions
from ..planning.dynamic_batching import plan_dynamic_batching
from ..planning.packing import get_packer
from ..tensors.layout import round_up

if TYPE_CHECKING:  # pragma: no cover
    from ..planning.step import StepPlan
    from .batched_data_dict import BatchedDataDict

__all__ = ["bin_assignment_spread"]


def shard_dynamic(data: "BatchedDataDict", shards: int, batch_size: int, args: Mapping[str, Any], shard_cls: type):
    """NeMo-RL's dynamic-batching shards of ``data`` (``shard_cls`` rows each)."""
    if args.get("force_group_size", 1) != 1:
        raise BatchedDataDictError("dynamic batching deals rows sorted by length across shards, which splits "
                                   "force_group_size's groups: use sequence_packing_args (its bins keep each group "
                                   "of consecutive rows whole)")
    if args.get("shared_prefix", False):  # trees: sequence packing's plan, padded as trees
        tree_args = {key: args[key] for key in ("max_tokens_per_microbatch", "input_key", "input_lengths_key",
                                                "sequence_length_round", "shared_prefix_group_key")
                     if key in args}
        return shard_packed(data, shards, batch_size, {**tree_args, "shared_prefix": True}, shard_cls,
                            pad_key="sequence_length_round")
    lens = _lengths(data.data, args["input_lengths_key"])
    width_source = data.data.get(args["input_key"])
    _check(_is_tensor(width_source) and width_source.dim() >= 2,
           f"input_key {args['input_key']!r} must name a [batch, seq] tensor")
    plan = plan_dynamic_batching(lens, shards, args["max_tokens_per_microbatch"], args["sequence_length_round"],
                                 rule=args.get("rule", "nemo_rl"), batch_size=batch_size,
                                 max_seqlen=int(width_source.shape[1]))
    out = []
    for s in range(shards):
        shard = data._gather(plan.shard_indices(s), shard_cls)
        shard.micro_batch_indices = plan.micro_batch_indices  # shared by every shard, as NeMo-RL's
        shard.micro_batch_lengths = plan.micro_batch_lengths
        out.append(shard)
    return out, list(plan.sorted_indices)

def shard_packed(data: "BatchedDataDict", shards: int, batch_size: int, args: Mapping[str, Any], shard_cls: type,
                 pad_key: str = "sequence_length_pad_multiple"):
    """Sequence-packing shards of ``data``: bins per global batch (of trees with
    ``shared_prefix``), dealt to the shards."""
    order = args.get("microbatch_order")
    if order not in (None, "packer", "largest_first"):
        raise BatchedDataDictError(f"sequence packing microbatch_order must be 'packer' or 'largest_first', "
                                   f"got {order!r}")
    balance = args.get("balance", "round_robin")
    if balance not in ("round_robin", "karmarkar_karp"):
        raise BatchedDataDictError(f"sequence packing balance must be 'round_robin' or 'karmarkar_karp', "
                                   f"got {balance!r}")
    lens = _lengths(data.data, args["input_lengths_key"])
    if args.get("shared_prefix", False):  # bins of prefix trees: physical tokens under the cap
        bins_per_chunk, loads_per_chunk = shared_prefix_bins(data.data, lens, shards, batch_size, args, pad_key)
    else:
        bins_per_chunk, padded = pack_chunks(lens, shards, batch_size, args)
        loads_per_chunk = [[int(padded[c * batch_size + np.asarray(b)].sum()) for b in bins]
                           for c, bins in enumerate(bins_per_chunk)]
    rows: List[List[int]] = [[] for _ in range(shards)]
    trees: List[List[Any]] = [[] for _ in range(shards)]
    indices: List[List[List[List[int]]]] = [[] for _ in range(shards)]
    lengths: List[List[List[int]]] = [[] for _ in range(shards)]
    for c, bins in enumerate(bins_per_chunk):
        base, loads = c * batch_size, loads_per_chunk[c]
        for s, mine in enumerate(deal(bins, loads, shards, balance)):
            if order == "largest_first":
                mine = sorted(mine, key=lambda i: -loads[i])  # stable: ties keep the packer's order
            start, chunk_idx, chunk_len = 0, [], []
            for i in mine:
                rows[s].extend(base + j for j in bins[i])
                chunk_idx.append([start, start + len(bins[i])])
                chunk_len.append(loads[i])
                start += len(bins[i])
            indices[s].append(chunk_idx)
            lengths[s].append(chunk_len)
            trees[s].append([[base + j for j in bins[i]] for i in mine])  # each bin's rows, for its tree
    if args.get("shared_prefix", False):  # every bin's tree, built once, here (the rows read once)
        built = iter(bin_trees(data.data, lens, [b for shard in trees for chunk in shard for b in chunk],
                               args["input_key"], args.get("shared_prefix_group_key")))
        trees = [[[next(built) for _ in chunk] for chunk in shard] for shard in trees]
    keys = sorted(data.data)  # NeMo-RL rebuilds packed shards with from_batches: sorted keys
    out = []
    for s in range(shards):
        shard = data._gather(rows[s], shard_cls, keys)
        shard.micro_batch_indices = indices[s]
        shard.micro_batch_lengths = lengths[s]
        shard.elem_counts_per_gb = [c[-1][1] if c else 0 for c in indices[s]]
        shard.micro_batch_token_cap = int(args["max_tokens_per_microbatch"])
        if args.get("shared_prefix", False):
            shard.micro_batch_trees = trees[s]
            shard.micro_batch_tree_options = {"input_key": args["input_key"],
                                              "input_lengths_key": args["input_lengths_key"],
                                              "group_key": args.get("shared_prefix_group_key"),
                                              "min_shared_tokens": 1, "pad_to_multiple_of": 1}
        out.append(shard)
    return out, [i for r in rows for i in r]

def shard_by_plan(data: "BatchedDataDict", shards: int, batch_size: Optional[int], plan: "StepPlan", shard_cls: type):
    """The shards of a :func:`seqpack.plan_step` plan of ``data``'s rows."""
    from ..planning.step import StepPlan

    _check(isinstance(plan, StepPlan), f"step_plan must be a seqpack.StepPlan, got {type(plan).__name__}")
    _check(plan.dp_size == shards, f"step_plan was planned for dp_size={plan.dp_size}, not shards={shards}")
    total = data._batch_size()
    _check(plan.num_sequences == total, f"step_plan covers {plan.num_sequences} rows, the data has {total}")
    if batch_size is not None:
        expected = [(c, c + batch_size) for c in range(0, total, batch_size)]
        _check(plan.mini_batch_ranges == expected,
               f"step_plan's mini-batches {plan.mini_batch_ranges} are not the global batches of "
               f"batch_size={batch_size}")
    if plan.cp_size > 1:  # each DP shard: the rows of its CP group's ranks
        from ._bdd_hybrid_cp import hybrid_shards

        return hybrid_shards(data, shards, plan, shard_cls)
    rows: List[List[int]] = [plan.rank_rows(s) for s in range(shards)]
    out = []
    for s in range(shards):
        shard = data._gather(rows[s], shard_cls, sorted(data.data))
        shard.micro_batch_indices, shard.micro_batch_lengths, shard.elem_counts_per_gb = [], [], []
        for m, mini_batch in enumerate(plan.assignment):
            bounds, start = [], 0  # row ranges within the global batch, as sequence packing's
            for cell in mini_batch[s]:
                bounds.append([start, start + len(cell)])
                start += len(cell)
            shard.micro_batch_indices.append(bounds)
            shard.micro_batch_lengths.append(list(plan.tokens[m][s]))
            shard.elem_counts_per_gb.append(start)
        if plan.padded_tokens is not None:  # static_shapes: the packed iterator pads to these
            shard.micro_batch_static_lengths = [list(mb[s]) for mb in plan.padded_tokens]
        shard.micro_batch_token_cap = int(plan.max_tokens)
        out.append(shard)
    return out, [i for r in rows for i in r]


def pack_chunks(lens: np.ndarray, shards: int, batch_size: int, args: Mapping[str, Any]):
    """Per global batch, the packer's bins (chunk-local indices) of the padded lengths;
    with ``force_group_size`` of its groups of consecutive rows, each whole in a bin."""
    multiple = _positive(args["sequence_length_pad_multiple"], "sequence_length_pad_multiple")
    padded = round_up(lens, multiple)
    packer = get_packer(args["algorithm"], bin_capacity=args["max_tokens_per_microbatch"], min_bin_count=shards,
                        bin_count_multiple=shards)
    group = _positive(args.get("force_group_size", 1), "force_group_size")
    if group == 1:
        return [packer.pack(padded[c: c + batch_size]) for c in range(0, len(lens), batch_size)], padded
    from ..planning.group_planning import consecutive_groups, pack_groups

    try:
        members = consecutive_groups(batch_size, group)
        bins = [pack_groups(packer, padded[c: c + batch_size], members)[0] for c in range(0, len(lens), batch_size)]
    except ValueError as exc:
        raise BatchedDataDictError(f"sequence packing with force_group_size={group}: {exc}") from None
    return bins, padded


def deal(bins: List[List[int]], loads: List[int], shards: int, balance: str) -> List[List[int]]:
    """Bin numbers per shard: round-robin in packer order, or Karmarkar-Karp over the
    bin loads with the same number of bins per shard."""
    if balance == "round_robin" or shards == 1:
        return [list(range(s, len(bins), shards)) for s in range(shards)]
    return get_seqlen_balanced_partitions(loads, shards, equal_size=True)


def bin_assignment_spread(input_lengths: Any, shards: int, sequence_packing_args: Mapping[str, Any],
                          batch_size: Optional[int] = None) -> Dict[str, Dict[str, float]]:
    """Per-shard packed tokens of each global batch under round-robin and
    Karmarkar-Karp bin assignment: ``{"round_robin": {...}, "karmarkar_karp": {...}}``
    with ``max``, ``min`` and ``spread`` (max - min) of the tokens per shard,
    worst over global batches.

    >>> args = {"max_tokens_per_microbatch": 100, "algorithm": "first_fit_decreasing",
    ...         "sequence_length_pad_multiple": 1}
    >>> spread = bin_assignment_spread([90, 80, 70, 60, 50, 40, 30, 20], 2, args)
    >>> spread["karmarkar_karp"]["spread"] <= spread["round_robin"]["spread"]
    True
    """
    lens = as_lengths(input_lengths, "input_lengths").astype(np.int64)
    batch_size = len(lens) if batch_size is None else _positive(batch_size, "batch_size")
    bins_per_chunk, padded = pack_chunks(lens, shards, batch_size, sequence_packing_args)
    report: Dict[str, Dict[str, float]] = {}
    for balance in ("round_robin", "karmarkar_karp"):
        worst = {"max": 0.0, "min": float("inf"), "spread": 0.0}
        for c, bins in enumerate(bins_per_chunk):
            loads = [int(padded[c * batch_size + np.asarray(b)].sum()) for b in bins]
            per_shard = [sum(loads[i] for i in mine) for mine in deal(bins, loads, shards, balance)]
            worst["max"] = max(worst["max"], max(per_shard))
            worst["min"] = min(worst["min"], min(per_shard))
            worst["spread"] = max(worst["spread"], max(per_shard) - min(per_shard))
        report[balance] = worst
    return report
