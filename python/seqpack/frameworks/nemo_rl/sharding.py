"""NeMo-RL's ``shard_by_batch_size``: plain shards, dynamic batching and sequence
packing (bins per global batch, dealt round-robin or by load; bins of prefix trees
with ``shared_prefix``), each shard a :class:`~.shard.ShardRecord`. Shards of a
:func:`seqpack.plan_step` plan: :mod:`.step_shards`.

    >>> from seqpack.frameworks.nemo_rl.sharding import plain_shards
    >>> [s.data["problem_id"] for s in plain_shards({"problem_id": [0, 0, 1, 1, 2, 2, 3, 3]}, 2, 4)]
    [[0, 0, 2, 2], [1, 1, 3, 3]]

Importing this module does not import torch.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np

from .._batch import coupled_trees, group_codes, is_tensor
from ..._lengths import as_lengths, as_positive_int
from ...planning.balance import get_seqlen_balanced_partitions
from ...planning.dynamic_batching import plan_dynamic_batching
from ...planning.packing import get_packer
from ...tensors.layout import round_up
from .errors import BatchedDataDictError, check, positive
from .rows import gather, lengths, row_count
from .shard import ShardRecord
from .trees import bin_trees, group_labels, row_tokens

__all__ = ["bin_assignment_spread", "dynamic_shards", "packed_shards", "plain_shards", "reuse_shards"]

Shards = Tuple[List[ShardRecord], List[int]]


def plain_shards(data: Mapping[str, Any], shards: int, batch_size: int, allow_uneven_shards: bool = False
                 ) -> List[ShardRecord]:
    """Shard ``s`` takes the ``s``-th contiguous piece of every global batch
    (``ceil(batch_size / shards)`` rows with ``allow_uneven_shards``, the last ones
    shorter or empty)."""
    total = row_count(data)
    num_chunks = total // batch_size
    shard_size = -(-batch_size // shards) if allow_uneven_shards else batch_size // shards
    out = []
    for s in range(shards):
        rows: List[int] = []
        for c in range(num_chunks):
            start = min(c * batch_size + s * shard_size, total)
            end = min(c * batch_size + (s + 1) * shard_size, total)
            rows.extend(range(start, end))
        out.append(ShardRecord(gather(data, rows)))
    return out


def dynamic_shards(data: Mapping[str, Any], shards: int, batch_size: int, args: Mapping[str, Any]) -> Shards:
    """NeMo-RL's dynamic-batching shards: per global batch, rows sorted by length dealt
    across shards, one shared plan of micro-batches (``rows x padded max length <=
    max_tokens_per_microbatch``); with ``shared_prefix``, sequence packing's bins of
    trees padded to ``sequence_length_round``."""
    if args.get("force_group_size", 1) != 1:
        raise BatchedDataDictError("dynamic batching deals rows sorted by length across shards, which splits "
                                   "force_group_size's groups: use sequence_packing_args (its bins keep each group "
                                   "of consecutive rows whole)")
    if args.get("shared_prefix", False):  # trees: sequence packing's plan, padded as trees
        tree_args = {key: args[key] for key in ("max_tokens_per_microbatch", "input_key", "input_lengths_key",
                                                "sequence_length_round", "shared_prefix_group_key")
                     if key in args}
        return packed_shards(data, shards, batch_size, {**tree_args, "shared_prefix": True},
                             pad_key="sequence_length_round")
    lens = lengths(data, args["input_lengths_key"])
    width_source = data.get(args["input_key"])
    check(is_tensor(width_source) and width_source.dim() >= 2,
          f"input_key {args['input_key']!r} must name a [batch, seq] tensor")
    plan = plan_dynamic_batching(lens, shards, args["max_tokens_per_microbatch"], args["sequence_length_round"],
                                 rule=args.get("rule", "nemo_rl"), batch_size=batch_size,
                                 max_seqlen=int(width_source.shape[1]))
    # Every shard shares the plan's micro-batches, as NeMo-RL's.
    out = [ShardRecord(gather(data, plan.shard_indices(s)), micro_batch_indices=plan.micro_batch_indices,
                       micro_batch_lengths=plan.micro_batch_lengths) for s in range(shards)]
    return out, list(plan.sorted_indices)


def packed_shards(data: Mapping[str, Any], shards: int, batch_size: int, args: Mapping[str, Any],
                  pad_key: str = "sequence_length_pad_multiple") -> Shards:
    """Sequence-packing shards: per global batch the lengths (padded to
    ``args[pad_key]``) packed into a multiple of ``shards`` bins (of prefix trees with
    ``shared_prefix``, whose trees the shards carry), dealt to the shards."""
    if args.get("prefix_reuse", False):
        return reuse_shards(data, shards, batch_size, args, pad_key)
    order = args.get("microbatch_order")
    if order not in (None, "packer", "largest_first"):
        raise BatchedDataDictError(f"sequence packing microbatch_order must be 'packer' or 'largest_first', "
                                   f"got {order!r}")
    balance = args.get("balance", "round_robin")
    if balance not in ("round_robin", "karmarkar_karp"):
        raise BatchedDataDictError(f"sequence packing balance must be 'round_robin' or 'karmarkar_karp', "
                                   f"got {balance!r}")
    lens = lengths(data, args["input_lengths_key"])
    shared = bool(args.get("shared_prefix", False))
    if shared:  # bins of prefix trees: physical tokens under the cap
        bins_per_chunk, loads_per_chunk = shared_prefix_bins(data, lens, shards, batch_size, args, pad_key)
    else:
        bins_per_chunk, padded = pack_chunks(lens, shards, batch_size, args)
        loads_per_chunk = [[int(padded[c * batch_size + np.asarray(b)].sum()) for b in bins]
                           for c, bins in enumerate(bins_per_chunk)]
    rows: List[List[int]] = [[] for _ in range(shards)]
    members: List[List[Any]] = [[] for _ in range(shards)]
    indices: List[List[List[List[int]]]] = [[] for _ in range(shards)]
    loads: List[List[List[int]]] = [[] for _ in range(shards)]
    for c, bins in enumerate(bins_per_chunk):
        base, chunk_loads = c * batch_size, loads_per_chunk[c]
        for s, mine in enumerate(deal(bins, chunk_loads, shards, balance)):
            if order == "largest_first":
                mine = sorted(mine, key=lambda i: -chunk_loads[i])  # stable: ties keep the packer's order
            start, chunk_idx = 0, []
            for i in mine:
                rows[s].extend(base + j for j in bins[i])
                chunk_idx.append([start, start + len(bins[i])])
                start += len(bins[i])
            indices[s].append(chunk_idx)
            loads[s].append([chunk_loads[i] for i in mine])
            members[s].append([[base + j for j in bins[i]] for i in mine])  # each bin's rows, for its tree
    trees = None
    if shared:  # every bin's tree, built once, here (the rows read once)
        group_key = args.get("shared_prefix_group_key")
        built = iter(bin_trees(data, lens, [b for shard in members for chunk in shard for b in chunk],
                               args["input_key"], group_labels(data, group_key)))
        trees = [[[next(built) for _ in chunk] for chunk in shard] for shard in members]
        rule = {"input_key": args["input_key"], "input_lengths_key": args["input_lengths_key"],
                "group_key": group_key, "min_shared_tokens": 1, "pad_to_multiple_of": 1}
    keys = sorted(data)  # NeMo-RL rebuilds packed shards with from_batches: sorted keys
    out = [ShardRecord(gather(data, rows[s], keys), micro_batch_indices=indices[s], micro_batch_lengths=loads[s],
                       elem_counts_per_gb=[c[-1][1] if c else 0 for c in indices[s]],
                       micro_batch_token_cap=int(args["max_tokens_per_microbatch"]),
                       micro_batch_trees=None if trees is None else trees[s],
                       micro_batch_tree_options=None if trees is None else dict(rule))
           for s in range(shards)]
    return out, [i for r in rows for i in r]


def reuse_shards(data: Mapping[str, Any], shards: int, batch_size: int, args: Mapping[str, Any],
                 pad_key: str) -> Shards:
    """``prefix_reuse``: each global batch planned by ``plan_step(..., forest=,
    prefix_reuse=True)`` over the shards (whole trees per shard, in passes where the
    cost model predicts them faster than trees), then sharded as that step plan; trees
    and passes padded to ``args[pad_key]`` under the cap."""
    from ...planning.prefix_forest import PrefixForest
    from ...planning.step import plan_step
    from .step_shards import step_plan_shards

    check(bool(args.get("shared_prefix", False)), "sequence packing prefix_reuse=True runs prefix trees in passes: "
                                                  "it needs shared_prefix=True")
    multiple = as_positive_int(args.get(pad_key, 1), pad_key)
    cap = as_positive_int(args["max_tokens_per_microbatch"], "max_tokens_per_microbatch")
    check(cap >= multiple, f"max_tokens_per_microbatch ({cap}) is below {pad_key} ({multiple})")
    check(args.get("force_group_size", 1) == 1, "sequence packing prefix_reuse=True cuts a tree larger than the cap "
                                                "into passes, so a loss coupling force_group_size rows cannot run")
    from .step_shards import FOREST_RULE

    for key in ("input_key", "input_lengths_key"):
        check(args[key] == FOREST_RULE[key], f"sequence packing prefix_reuse=True shards a step plan, whose trees are "
                                             f"of {key}={FOREST_RULE[key]!r}; got {args[key]!r}")
    ignored = [f"{k}={args[k]!r}" for k, default in (("microbatch_order", "packer"), ("balance", "round_robin"))
               if args.get(k, default) != default]
    if ignored:  # the step planner decides the ranks and the order of the passes
        warnings.warn(f"sequence packing prefix_reuse=True: {', '.join(ignored)} not used (plan_step deals trees to "
                      "the shards by the cost model, and a tree's passes run in their planned order)", UserWarning,
                      stacklevel=4)
    lens = lengths(data, args["input_lengths_key"])
    flat, cu = row_tokens(data, args["input_key"], lens)
    labels = group_labels(data, args.get("shared_prefix_group_key"))
    forest = PrefixForest.from_packed(flat, cu, group_ids=None if labels is None else group_codes(labels))
    # trees and passes padded to the multiple: their physical tokens under the cap rounded down to it
    plan = plan_step(lens, shards, cap // multiple * multiple, forest=forest, prefix_reuse=True,
                     mini_batches=row_count(data) // batch_size)
    return step_plan_shards(data, shards, batch_size, plan, multiple)


def shared_prefix_bins(data: Mapping[str, Any], lens: np.ndarray, shards: int, batch_size: int,
                       args: Mapping[str, Any], pad_key: str) -> Tuple[List[List[List[int]]], List[List[int]]]:
    """Per global batch: its bins (chunk-local row indices, a multiple of ``shards``
    of them) planned on a :class:`~seqpack.PrefixForest` of its rows
    (:func:`seqpack.plan_micro_batches` with ``forest=``: a bin's physical tokens,
    padded to ``args[pad_key]``, never pass the cap, and a group that fits stays in
    one bin), and each bin's physical tokens rounded up to the pad multiple. Trees
    are split where that fills bins, unless ``args["force_group_size"] > 1`` (rows
    the loss couples, NeMo-RL's DPO pairs): then every tree stays whole."""
    from ...planning.balance import plan_micro_batches
    from ...planning.prefix_forest import PrefixForest

    multiple = as_positive_int(args[pad_key], pad_key)
    cap = as_positive_int(args["max_tokens_per_microbatch"], "max_tokens_per_microbatch")
    usable = cap // multiple * multiple  # physical tokens <= usable -> padded tokens <= cap
    if usable == 0:
        raise ValueError(f"max_tokens_per_microbatch ({cap}) is below {pad_key} ({multiple})")
    if lens.size and int(lens.max()) > usable:
        row = int(lens.argmax())
        raise ValueError(f"row {row} has {int(lens[row])} tokens, more than max_tokens_per_microbatch = {cap} "
                         f"holds as a tree padded to {pad_key} = {multiple} ({usable})")
    flat, cu = row_tokens(data, args["input_key"], lens)
    labels = group_labels(data, args.get("shared_prefix_group_key"))
    group = args.get("force_group_size")
    coupled = 1 if group is None else as_positive_int(group, "force_group_size")
    bins_per_chunk, loads_per_chunk = [], []
    for c in range(0, lens.shape[0], batch_size):
        rows = range(c, min(c + batch_size, lens.shape[0]))
        forest = PrefixForest.from_packed(flat[cu[c]: cu[rows.stop]], cu[c: rows.stop + 1] - cu[c],
                                          group_ids=None if labels is None else group_codes([labels[r] for r in rows]))
        if coupled > 1:
            coupled_trees(forest, coupled, usable, "force_group_size", "max_tokens_per_microbatch (rounded down to "
                          f"{pad_key})")
        plan = plan_micro_batches(forest.lengths, usable, min_num=shards, multiple_of=shards, forest=forest,
                                  whole_trees=coupled > 1)
        bins_per_chunk.append([list(b) for b in plan.micro_batches])
        loads_per_chunk.append([int(round_up(t, multiple)) for t in plan.tokens])
    return bins_per_chunk, loads_per_chunk


def pack_chunks(lens: np.ndarray, shards: int, batch_size: int, args: Mapping[str, Any]):
    """Per global batch, the packer's bins (chunk-local indices) of the padded lengths;
    with ``force_group_size`` of its groups of consecutive rows, each whole in a bin."""
    multiple = positive(args["sequence_length_pad_multiple"], "sequence_length_pad_multiple")
    padded = round_up(lens, multiple)
    packer = get_packer(args["algorithm"], bin_capacity=args["max_tokens_per_microbatch"], min_bin_count=shards,
                        bin_count_multiple=shards)
    group = positive(args.get("force_group_size", 1), "force_group_size")
    if group == 1:
        return [packer.pack(padded[c: c + batch_size]) for c in range(0, len(lens), batch_size)], padded
    from ...planning.group_planning import consecutive_groups, pack_groups

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
    batch_size = len(lens) if batch_size is None else positive(batch_size, "batch_size")
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
