"""Pure-Python reference implementations of the planning algorithms.

These follow the frameworks' published algorithms step by step (NeMo-RL v0.6
packers and dynamic batching, verl/ROLL Karmarkar-Karp, ROLL dynamic batching),
including their data structures: linear scans over bins, per-set Python objects
in a heap. They exist to check seqpack's C++ core against (tests) and to measure
it against (benchmarks); they are slow on purpose and not part of the API.
"""

from __future__ import annotations

import bisect
import heapq
import math
import statistics
from typing import Dict, List, Optional, Tuple

Bins = List[List[int]]


def _check_fit(lengths: List[int], capacity: int) -> None:
    for length in lengths:
        if length > capacity:
            raise ValueError(f"Sequence length {length} exceeds bin capacity {capacity}")


def concatenative(lengths: List[int], capacity: int) -> Bins:
    """In order; a sequence that does not fit starts the next bin."""
    _check_fit(lengths, capacity)
    bins: Bins = []
    current: List[int] = []
    load = 0
    for i, length in enumerate(lengths):
        if load + length > capacity and current:
            bins.append(current)
            current, load = [], 0
        current.append(i)
        load += length
    if current:
        bins.append(current)
    return bins


def first_fit(lengths: List[int], capacity: int, order: List[Tuple[int, int]]) -> Bins:
    """First fit with a linear scan over open bins, items in the given order."""
    bins: Bins = []
    room: List[int] = []
    for length, i in order:
        if length > capacity:
            raise ValueError(f"Sequence length {length} exceeds bin capacity {capacity}")
        for b, r in enumerate(room):
            if r >= length:
                bins[b].append(i)
                room[b] -= length
                break
        else:
            bins.append([i])
            room.append(capacity - length)
    return bins


def first_fit_decreasing(lengths: List[int], capacity: int) -> Bins:
    """NeMo-RL's FFD: (length, index) pairs sorted descending, then first fit."""
    return first_fit(lengths, capacity, sorted(((l, i) for i, l in enumerate(lengths)), reverse=True))


def best_fit_decreasing(lengths: List[int], capacity: int) -> Bins:
    """Best fit: the bin with the least room that still fits; among equal room,
    the bin updated most recently. Linear scan over bins."""
    bins: Bins = []
    room: List[int] = []
    updated: List[int] = []
    for step, (length, i) in enumerate(sorted(((l, i) for i, l in enumerate(lengths)), reverse=True)):
        if length > capacity:
            raise ValueError(f"Sequence length {length} exceeds bin capacity {capacity}")
        best: Optional[int] = None
        for b, r in enumerate(room):
            if r >= length and (best is None or (r, -updated[b]) < (room[best], -updated[best])):
                best = b
        if best is None:
            bins.append([])
            room.append(capacity)
            updated.append(step)
            best = len(bins) - 1
        bins[best].append(i)
        room[best] -= length
        updated[best] = step
    return bins


def modified_first_fit_decreasing(lengths: List[int], capacity: int) -> Bins:
    """NeMo-RL v0.6's MFFD, phase by phase, with list scans (empty bins dropped)."""
    if capacity <= 0:
        raise ValueError("bin_capacity must be positive")
    if any(l <= 0 for l in lengths):
        raise ValueError("sequence lengths must be positive")
    _check_fit(lengths, capacity)
    large, medium, small, tiny = [], [], [], []
    for i, s in enumerate(lengths):
        if s > capacity / 2:
            large.append((i, s))
        elif s > capacity / 3:
            medium.append((i, s))
        elif s > capacity / 6:
            small.append((i, s))
        else:
            tiny.append((i, s))
    large.sort(key=lambda x: x[1], reverse=True)
    medium.sort(key=lambda x: x[1], reverse=True)
    small.sort(key=lambda x: x[1])
    tiny.sort(key=lambda x: x[1])
    bins = [[item] for item in large]

    def load(b):
        return sum(s for _, s in b)

    for b in bins:  # phase 2: one medium item per large bin
        room = capacity - load(b)
        for j, (_, s) in enumerate(medium):
            if s <= room:
                b.append(medium.pop(j))
                break
    for b in reversed(bins):  # phase 3: two small items into bins without a medium one
        if any(capacity / 3 < s <= capacity / 2 for _, s in b) or len(small) < 2:
            continue
        room = capacity - load(b)
        if small[0][1] + small[1][1] > room:
            continue
        first = small.pop(0)
        for j in range(len(small) - 1, -1, -1):
            if small[j][1] <= room - first[1]:
                b.extend([first, small.pop(j)])
                break
    rest = sorted(medium + small + tiny, key=lambda x: x[1], reverse=True)
    for b in bins:  # phase 4: greedy fill, largest fitting item first
        while rest:
            room = capacity - load(b)
            if room < rest[-1][1]:
                break
            j = next(j for j, (_, s) in enumerate(rest) if s <= room)
            b.append(rest.pop(j))
    # phase 5: leftovers into the least-filled leftover bin, kept sorted by load
    left_bins: List[list] = [[]]
    left_loads: List[int] = [0]
    for item in sorted(rest, key=lambda x: x[1], reverse=True):
        if item[1] <= capacity - left_loads[0]:
            b, l = left_bins.pop(0), left_loads.pop(0)
        else:
            b, l = [], 0
        b.append(item)
        l += item[1]
        k = bisect.bisect(left_loads, l)
        left_bins.insert(k, b)
        left_loads.insert(k, l)
    return [[i for i, _ in b] for b in bins + left_bins if b]


def adjust_bin_count(bins: Bins, min_bin_count: int = 0, bin_count_multiple: int = 1) -> Bins:
    """NeMo-RL's rule: move single items out of the bins holding the most items."""
    target = max(len(bins), min_bin_count)
    if target % bin_count_multiple:
        target += bin_count_multiple - target % bin_count_multiple
    if target == len(bins):
        return bins
    total = sum(len(b) for b in bins)
    if total < target:
        raise ValueError(f"Cannot create {target} bins with only {total} sequences.")
    out = [list(b) for b in bins]
    by_size = sorted(((len(b), i) for i, b in enumerate(bins)), reverse=True)
    src = 0
    for _ in range(target - len(bins)):
        while len(out[by_size[src][1]]) <= 1:
            src += 1
        out.append([out[by_size[src][1]].pop()])
    return out


class _KKSet:
    def __init__(self) -> None:
        self.sum = 0
        self.items: List[Tuple[int, int]] = []

    def add(self, idx: int, val: int) -> None:
        self.items.append((idx, val))
        self.sum += val

    def merge(self, other: "_KKSet") -> None:
        for idx, val in other.items:
            self.add(idx, val)

    def __lt__(self, other: "_KKSet") -> bool:
        if self.sum != other.sum:
            return self.sum < other.sum
        if len(self.items) != len(other.items):
            return len(self.items) < len(other.items)
        return self.items < other.items


class _KKState:
    def __init__(self, items: List[Tuple[int, int]], k: int) -> None:
        self.k = k
        self.sets = [_KKSet() for _ in range(k)]
        for s, (idx, val) in zip(self.sets, items):
            s.add(idx, val)
        self.sets = sorted(self.sets, reverse=True)

    @property
    def spread(self) -> int:
        return self.sets[0].sum - self.sets[-1].sum

    def merge(self, other: "_KKState") -> None:
        for i in range(self.k):
            self.sets[i].merge(other.sets[self.k - 1 - i])
        self.sets = sorted(self.sets, reverse=True)

    def __lt__(self, other: "_KKState") -> bool:
        # A min-heap that pops the largest spread first, then the largest top set.
        if self.spread != other.spread:
            return self.spread > other.spread
        return self.sets[0] > other.sets[0]


def karmarkar_karp(values: List[int], k: int, equal_size: bool) -> Bins:
    """verl's largest differencing method with per-set objects in a heapq."""
    ordered = sorted((v, i) for i, v in enumerate(values))
    heap: List[_KKState] = []
    step = k if equal_size else 1
    if equal_size and len(values) % k:
        raise ValueError(f"{len(values)} % {k} != 0")
    for off in range(0, len(ordered), step):
        heapq.heappush(heap, _KKState([(i, v) for v, i in ordered[off : off + step]], k))
    while len(heap) > 1:
        a = heapq.heappop(heap)
        b = heapq.heappop(heap)
        a.merge(b)
        heapq.heappush(heap, a)
    return [[i for i, _ in s.items] for s in heap[0].sets]


def get_seqlen_balanced_partitions(values: List[int], k: int, equal_size: bool) -> Bins:
    if len(values) < k:
        raise ValueError(f"number of items {len(values)} < k_partitions {k}")
    return [sorted(p) for p in karmarkar_karp(values, k, equal_size)]


def dynamic_batching(
    lengths: List[int],
    shards: int,
    cap: int,
    round_to: int,
    batch_size: Optional[int] = None,
    max_seqlen: Optional[int] = None,
    initial_max: int = 0,
) -> Tuple[List[int], List[List[List[int]]], List[List[int]]]:
    """NeMo-RL's dynamic batching (ROLL's with ``initial_max=round_to``, no clamp).

    Returns (sorted_indices, micro_batch_indices per chunk, micro_batch_lengths per chunk).
    """
    n = len(lengths)
    chunk = batch_size or n
    sorted_indices: List[int] = []
    all_idx, all_len = [], []
    for c in range(n // chunk if chunk else 0):
        base = c * chunk
        order = sorted(range(chunk), key=lambda i: lengths[base + i])
        order = [base + i for i in order]
        per_shard = [order[s::shards] for s in range(shards)]
        sorted_indices.extend(sum(per_shard, []))
        ranges, lens = [[0, 0]], [0]
        run_max = initial_max
        for j in range(chunk // shards):
            m = max(lengths[rows[j]] for rows in per_shard)
            m = (m + round_to - 1) // round_to * round_to
            if max_seqlen is not None:
                m = min(m, max_seqlen)
            if m > cap:
                raise ValueError(f"padded length {m} exceeds max_tokens_per_microbatch {cap}")
            rows_in_mb = ranges[-1][1] - ranges[-1][0] + 1
            run_max = max(run_max, m)
            if rows_in_mb * run_max <= cap:
                ranges[-1][1] += 1
                lens[-1] = run_max
            else:
                ranges.append([j, j + 1])
                run_max = m
                lens.append(m)
        all_idx.append(ranges)
        all_len.append(lens)
    return sorted_indices, all_idx, all_len


def packing_stats(lengths: List[int], bins: Bins, capacity: int) -> Dict[str, float]:
    """NeMo-RL's per-solution packing metrics."""
    if not bins:
        return {"num_bins": 0}
    loads = [sum(lengths[i] for i in b) for b in bins]
    total, cap_total = sum(lengths), len(bins) * capacity
    util = total / cap_total
    utils = [l / capacity for l in loads]
    return {
        "num_sequences": len(lengths),
        "num_bins": len(bins),
        "total_sequence_length": total,
        "total_bin_capacity": cap_total,
        "total_waste": cap_total - total,
        "average_utilization": util,
        "waste_ratio": (cap_total - total) / cap_total,
        "bin_balance": 1.0 - statistics.stdev(utils) / util if len(bins) > 1 else 1.0,
        "theoretical_min_bins": math.ceil(total / capacity),
        "bin_efficiency": math.ceil(total / capacity) / len(bins),
    }


# ---------------------------------------------------------------- NeMo-RL BatchedDataDict sharding

_PACKERS = {
    "concatenative": concatenative,
    "first_fit_decreasing": first_fit_decreasing,
    "best_fit_decreasing": best_fit_decreasing,
    "modified_first_fit_decreasing": modified_first_fit_decreasing,
}


def _take(value, rows: List[int]):
    return value[rows] if hasattr(value, "index_select") else [value[i] for i in rows]


def _stack(pieces: list):
    """NeMo-RL ``from_batches`` for one key: lists concatenate, 1-D tensors too,
    2-D tensors are right-padded row by row to the widest piece."""
    import torch

    first = pieces[0]
    if isinstance(first, list):
        return [x for p in pieces for x in p]
    if all(p.dim() == 1 for p in pieces):
        return torch.cat(pieces)
    rows = [row.flatten() for p in pieces for row in p]
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=0)


def shard_by_batch_size(data: Dict[str, object], shards: int, batch_size: Optional[int] = None,
                        dynamic_batching_args: Optional[dict] = None,
                        sequence_packing_args: Optional[dict] = None):
    """NeMo-RL v0.6 ``BatchedDataDict.shard_by_batch_size`` as it runs there: per
    global batch, Python sorting / packing, then per-bin ``select_indices`` and
    ``from_batches`` (packing) or one gather per shard (plain, dynamic). Returns
    ``(shards as dicts, sorted_indices or None, metadata per shard)``."""
    total = len(next(iter(data.values())))
    batch_size = batch_size or total
    num_chunks = total // batch_size
    shard_size = batch_size // shards
    if sequence_packing_args is None:
        order = list(range(total))
        meta = [{} for _ in range(shards)]
        if dynamic_batching_args is not None:
            lengths = [int(x) for x in data[dynamic_batching_args["input_lengths_key"]]]
            width = data[dynamic_batching_args["input_key"]].shape[1]
            order, idx, lens = dynamic_batching(
                lengths, shards, dynamic_batching_args["max_tokens_per_microbatch"],
                dynamic_batching_args["sequence_length_round"], batch_size, width)
            meta = [{"micro_batch_indices": idx, "micro_batch_lengths": lens} for _ in range(shards)]
        out = []
        for s in range(shards):
            rows = [order[c * batch_size + s * shard_size + j] for c in range(num_chunks) for j in range(shard_size)]
            out.append({k: _take(v, rows) for k, v in data.items()})
        return out, (order if dynamic_batching_args is not None else None), meta
    args = sequence_packing_args
    multiple = args["sequence_length_pad_multiple"]
    lengths = [(int(x) + multiple - 1) // multiple * multiple for x in data[args["input_lengths_key"]]]
    packer = _PACKERS[args["algorithm"]]
    pieces: List[list] = [[] for _ in range(shards)]
    order_per_shard: List[List[int]] = [[] for _ in range(shards)]
    meta = [{"micro_batch_indices": [], "micro_batch_lengths": [], "elem_counts_per_gb": []} for _ in range(shards)]
    for c in range(num_chunks):
        base = c * batch_size
        chunk = lengths[base: base + batch_size]
        bins = adjust_bin_count(packer(chunk, args["max_tokens_per_microbatch"]), shards, shards)
        for s in range(shards):
            mine = bins[s::shards]
            if args.get("microbatch_order") == "largest_first":
                mine = sorted(mine, key=lambda b: -sum(chunk[i] for i in b))
            idx, lens, start = [], [], 0
            for b in mine:
                rows = [base + i for i in b]
                pieces[s].append({k: _take(v, rows) for k, v in data.items()})
                order_per_shard[s].extend(rows)
                idx.append([start, start + len(b)])
                lens.append(sum(chunk[i] for i in b))
                start += len(b)
            meta[s]["micro_batch_indices"].append(idx)
            meta[s]["micro_batch_lengths"].append(lens)
            meta[s]["elem_counts_per_gb"].append(start)
    out = [{k: _stack([p[k] for p in pieces[s]]) for k in sorted(data)} for s in range(shards)]
    return out, [i for rows in order_per_shard for i in rows], meta
