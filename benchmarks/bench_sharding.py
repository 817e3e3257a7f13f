"""Sharding and micro-batching benchmark: BatchedDataDict / ROLL / verl helpers vs Python.

Same process, same data:
  * ``shard_by_batch_size`` with sequence packing and with dynamic batching, 16
    global batches of 512 sequences, 8 ranks: seqpack's BatchedDataDict vs
    seqpack.testing.reference.shard_by_batch_size, a faithful pure-Python version of
    NeMo-RL's (Python packers, per-bin ``select_indices`` and ``from_batches``);
    outputs checked equal. Also the per-rank token spread with NeMo-RL's
    round-robin bin assignment vs ``balance="karmarkar_karp"``.
  * ROLL ``load_balance`` / verl ``rearrange_micro_batches`` on per-rank mini-batches:
    their rule (k = ceil(tokens / cap) parts by Python Karmarkar-Karp on the
    workload, as in ROLL/verl) vs seqpack's hard-cap planner: time, micro-batches,
    workload imbalance, micro-batches over the cap.

    python benchmarks/bench_sharding.py            # full run
    python benchmarks/bench_sharding.py --quick    # small sizes, smoke test
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import CsvLog, announce, environment, format_table, measure  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from seqpack import BatchedDataDict, plan_micro_batches, reference  # noqa: E402
from seqpack.batched_data_dict import bin_assignment_spread  # noqa: E402
from seqpack.tools.report import synthetic_rl_lengths  # noqa: E402
from seqpack.roll import ROLL_ATTENTION_COEFF  # noqa: E402


def make_data(rows: int, width: int, seed: int = 0, tokens: bool = True) -> BatchedDataDict:
    """A rollout batch: int64 token ids (or, without ``tokens``, only a bool
    ``[rows, width]`` mask, so that the planning dominates), lengths, a per-row
    tensor and a list."""
    lengths = np.minimum(synthetic_rl_lengths(rows, seed=seed, max_len=width), width)
    ids = torch.randint(0, 150000, (rows, width)) if tokens else torch.zeros(rows, width, dtype=torch.bool)
    return BatchedDataDict(
        input_ids=ids,
        input_lengths=torch.from_numpy(lengths),
        advantages=torch.randn(rows),
        prompt_ids=[f"prompt-{i // 16}" for i in range(rows)],
    )


def same(ours, theirs, meta) -> bool:
    for shard, ref, m in zip(ours, theirs, meta):
        for key, value in ref.items():
            if isinstance(value, list) and shard[key] != value:
                return False
            if not isinstance(value, list) and not torch.equal(shard[key], value):
                return False
        if shard.micro_batch_indices != m["micro_batch_indices"] or shard.micro_batch_lengths != m["micro_batch_lengths"]:
            return False
    return True


def bench_shard(label, data, shards, batch_size, cap, log, rows, spread_rows=None):
    modes = {
        "sequence packing (MFFD, pad 8)": dict(sequence_packing_args=dict(
            max_tokens_per_microbatch=cap, input_key="input_ids", input_lengths_key="input_lengths",
            algorithm="modified_first_fit_decreasing", sequence_length_pad_multiple=8)),
        "sequence packing (FFD, pad 8)": dict(sequence_packing_args=dict(
            max_tokens_per_microbatch=cap, input_key="input_ids", input_lengths_key="input_lengths",
            algorithm="first_fit_decreasing", sequence_length_pad_multiple=8)),
        "dynamic batching (round 64)": dict(dynamic_batching_args=dict(
            max_tokens_per_microbatch=cap, sequence_length_round=64, input_key="input_ids",
            input_lengths_key="input_lengths")),
    }
    plain = dict(data)
    for name, kwargs in modes.items():
        ours, _ = data.shard_by_batch_size(shards, batch_size, **kwargs)
        theirs, _, meta = reference.shard_by_batch_size(plain, shards, batch_size, **kwargs)
        ok = same(ours, theirs, meta)
        m_ours = measure(lambda: data.shard_by_batch_size(shards, batch_size, **kwargs), repeat=7)
        m_py = measure(lambda: reference.shard_by_batch_size(plain, shards, batch_size, **kwargs), repeat=3,
                       budget_s=60)
        case = f"shard/{label}/{name}"
        log.timing(case, "seqpack", m_ours)
        log.timing(case, "python", m_py)
        rows.append([name, label, data.size, batch_size, shards, m_py["min"] * 1e3, m_ours["min"] * 1e3,
                     m_py["min"] / m_ours["min"], "yes" if ok else "NO"])
        if "sequence_packing_args" in kwargs and spread_rows is not None:
            spread = bin_assignment_spread(data["input_lengths"].numpy(), shards, kwargs["sequence_packing_args"],
                                           batch_size)
            rr, kk = spread["round_robin"], spread["karmarkar_karp"]
            log.add(case, "round_robin", "token_spread", rr["spread"])
            log.add(case, "karmarkar_karp", "token_spread", kk["spread"])
            spread_rows.append([name, rr["spread"], rr["max"], kk["spread"], kk["max"]])


def python_soft_cap(lengths, cap):
    """ROLL load_balance / verl: k = ceil(total / cap) parts, Python KK on the workload."""
    k = max(1, min(len(lengths), math.ceil(sum(lengths) / cap)))
    work = [ROLL_ATTENTION_COEFF * s + s * s for s in lengths]
    return reference.get_seqlen_balanced_partitions(work, k, equal_size=False)


def python_verl_released(lengths, cap):
    """verl 0.9.1 (since verl#7553): from k = ceil(total / cap), one part more until
    the Karmarkar-Karp parts all fit the cap (k = len(lengths) always does)."""
    k = max(1, min(len(lengths), math.ceil(sum(lengths) / cap)))
    work = [ROLL_ATTENTION_COEFF * s + s * s for s in lengths]
    while True:
        parts = reference.get_seqlen_balanced_partitions(work, k, equal_size=False)
        if k >= len(lengths) or all(sum(lengths[i] for i in p) <= cap for p in parts):
            return parts
        k += 1


def imbalance(parts, work):
    loads = [sum(work[i] for i in p) for p in parts]
    return max(loads) / (sum(loads) / len(loads)) - 1


def bench_micro(trials, mini_batch, cap, log, rows):
    rng = np.random.default_rng(5)
    stats = {"python": [0.0, 0, 0, 0, []], "python_verl_0.9.1": [0.0, 0, 0, 0, []],
             "seqpack": [0.0, 0, 0, 0, []]}  # time, mbs, over, worst, imbalance
    for _ in range(trials):
        lengths = synthetic_rl_lengths(mini_batch, seed=int(rng.integers(1 << 30)), max_len=8192).tolist()
        work = [ROLL_ATTENTION_COEFF * s + s * s for s in lengths]
        for impl, fn in (("python", lambda: python_soft_cap(lengths, cap)),
                         ("python_verl_0.9.1", lambda: python_verl_released(lengths, cap)),
                         ("seqpack", lambda: plan_micro_batches(lengths, cap, attention_coeff=ROLL_ATTENTION_COEFF,
                                                                order="small_at_ends").micro_batches)):
            m = measure(fn, repeat=3, warmup=0)
            parts = fn()
            tokens = [sum(lengths[i] for i in p) for p in parts]
            s = stats[impl]
            s[0] += m["min"]
            s[1] += len(parts)
            s[2] += sum(t > cap for t in tokens)
            s[3] = max(s[3], max(tokens))
            s[4].append(imbalance(parts, work))
    for impl, (t, mbs, over, worst, imb) in stats.items():
        case = f"micro/{mini_batch}/cap={cap}"
        log.add(case, impl, "seconds_per_call", t / trials)
        log.add(case, impl, "over_cap", over)
        rows.append([impl, trials, mini_batch, cap, t / trials * 1e3, mbs, over, worst, float(np.mean(imb))])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--csv")
    args = parser.parse_args()
    env = announce(environment(), torch)
    log = CsvLog("sharding", env, args.csv)
    torch.manual_seed(0)
    rows_total, width, batch_size, trials, mini = (512, 1024, 128, 5, 128) if args.quick else (512 * 16, 2048, 512,
                                                                                                  50, 512)
    rows, spread_rows, micro_rows = [], [], []
    bench_shard("int64 tokens", make_data(rows_total, width), 8, batch_size, 8192, log, rows, spread_rows)
    bench_shard("bool mask", make_data(rows_total, width, tokens=False), 8, batch_size, 8192, log, rows)
    print(format_table(
        "shard_by_batch_size: NeMo-RL's logic in Python vs seqpack.BatchedDataDict (ms, best run)",
        ["mode", "[rows, width] tensor", "rows", "global batch", "ranks", "python ms", "seqpack ms", "speedup",
         "same output"], rows,
        note=f"width {width}. python: seqpack.testing.reference.shard_by_batch_size (NeMo-RL v0.6's steps); same output: "
             "shards, order and micro-batch metadata identical. 'int64 tokens': both copy 128 MiB of ids into the "
             "shards; 'bool mask': the same with 16 MiB, so the planning and per-bin work weigh more."))
    print()
    print(format_table(
        "Packed tokens per rank, worst global batch: NeMo-RL round-robin vs balance='karmarkar_karp'",
        ["mode", "round-robin max-min", "round-robin max", "KK max-min", "KK max"], spread_rows))
    print()
    for cap in (8192, 16384):
        bench_micro(trials, mini, cap, log, micro_rows)
    print(format_table(
        "Load-balanced micro-batches (ROLL load_balance / verl rearrange_micro_batches): soft vs hard cap",
        ["planner", "mini-batches", "rows each", "cap", "ms per call", "micro-batches", "over cap", "largest",
         "mean imbalance"], micro_rows,
        note="python: k = ceil(tokens / cap) parts by Karmarkar-Karp on 24576*s + s^2 (ROLL; verl before verl#7553); "
             "python_verl_0.9.1: the same k, grown by one until every part fits (verl 0.9.1); seqpack: "
             "plan_micro_batches, the smallest k whose balanced parts all fit. Imbalance: max / mean workload - 1."))
    print(f"\nCSV: {log.write()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
