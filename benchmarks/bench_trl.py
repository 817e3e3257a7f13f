"""TRL dataset packing: seqpack.integrations.trl.pack_dataset vs trl.data_utils.pack_dataset.

Both pack the same in-memory ``datasets.Dataset`` (lognormal lengths, one int32
``input_ids`` column) with the same strategy and map batch size, each in a fresh
process (so the peak RSS rise is its own). The packs must be identical (a digest of
the packed ``input_ids`` and ``seq_lengths``); the table reports wall time, the
speed-up and the peak memory rise, plus seqpack's ``bfd_global`` (the same rule over
the whole dataset: fewer packs, not TRL's).

    python benchmarks/bench_trl.py            # 1M and 10M rows
    python benchmarks/bench_trl.py --quick    # 20k rows (a smoke test)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import (CsvLog, announce, arrow_digest, environment, format_table,  # noqa: E402
                      run_child, timed_runs)

import numpy as np  # noqa: E402


def make_dataset(rows: int, median: float, seq_length: int, seed: int = 0):
    """Lognormal lengths (sigma 1, clipped to [1, 2 * seq_length]) as one int32
    list column built straight from offsets and values (no Python rows)."""
    import datasets
    import pyarrow as pa
    from datasets.table import InMemoryTable

    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(median), 1.0, rows), 1, 2 * seq_length).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    values = pa.array((np.arange(offsets[-1], dtype=np.int64) % 32000).astype(np.int32))
    column = pa.LargeListArray.from_arrays(pa.array(offsets), values) if offsets[-1] >= 2**31 else \
        pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), values)
    return datasets.Dataset(InMemoryTable(pa.table({"input_ids": column}))), int(offsets[-1])


def child(spec: str) -> dict:
    impl, rows, median, seq_length, strategy = spec.split(",")
    rows, median, seq_length = int(rows), float(median), int(seq_length)
    import datasets

    datasets.disable_progress_bars()
    ds, tokens = make_dataset(rows, median, seq_length)
    if impl == "trl":
        from trl.data_utils import pack_dataset
    else:
        from seqpack.integrations.trl import pack_dataset
    packed, seconds, mem = timed_runs(lambda: pack_dataset(ds, seq_length, strategy))
    return {"seconds": seconds, "peak_extra_mib": mem, "packs": len(packed), "tokens": tokens,
            "digest": arrow_digest(packed, ("input_ids", "seq_lengths"))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20k rows only (a smoke test)")
    parser.add_argument("--csv", help="CSV output path (default: benchmarks/results/trl.csv)")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # internal: one run, JSON out
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return 0
    env = announce(environment())
    import trl

    log = CsvLog("trl", env, args.csv)
    # (rows, median length, seq_length): 1M rows of median 256 (~430M tokens) at
    # 4096, and 10M rows of median 32 (~530M tokens) at 8192: TRL's run must fit in
    # 23 GiB of RAM (at median 64 it was killed).
    cases = [(20_000, 128, 4096)] if args.quick else [(1_000_000, 256, 4096), (10_000_000, 32, 8192)]
    table = []
    for rows, median, seq_length in cases:
        for strategy in ("bfd", "bfd_split"):
            got = {impl: run_child(__file__, f"{impl},{rows},{median},{seq_length},{strategy}") for impl in ("trl", "seqpack")}
            same = got["trl"]["digest"] == got["seqpack"]["digest"]
            if not same:
                raise AssertionError(f"{rows} rows, {strategy}: seqpack's packs differ from TRL's")
            best = run_child(__file__, f"seqpack,{rows},{median},{seq_length},{strategy}_global")
            name = f"{rows}/{seq_length}/{strategy}"
            for impl, r in [*got.items(), (f"seqpack_{strategy}_global", best)]:
                for metric in ("seconds", "peak_extra_mib", "packs"):
                    log.add(name, impl, metric, r[metric])
            t, s = got["trl"], got["seqpack"]
            table.append([f"{rows:,}", f"{t['tokens'] / 1e6:,.0f}M", seq_length, strategy, t["seconds"], s["seconds"],
                          t["seconds"] / s["seconds"], t["peak_extra_mib"], s["peak_extra_mib"], t["packs"],
                          "yes" if same else "NO", best["packs"], best["seconds"]])
            print(f"  {name}: TRL {t['seconds']:.2f} s, seqpack {s['seconds']:.3f} s, identical", flush=True)
    print(format_table(
        "TRL pack_dataset: trl.data_utils vs seqpack.integrations.trl (in-memory datasets.Dataset, CPU)",
        ["rows", "tokens", "seq_length", "strategy", "TRL s", "seqpack s", "speed-up", "TRL extra MiB",
         "seqpack extra MiB", "packs", "identical", "global packs", "global s"], table,
        note=f"trl {trl.__version__}. Each run in a fresh process (peak RSS rise while packing). Lognormal lengths, "
             "sigma 1, clipped to [1, 2 x seq_length]; map batch size 1,000 (TRL's default). 'global': seqpack's "
             "bfd_global / bfd_split_global, the same rule over the whole dataset. Target (issue 18): >= 20x at 1M "
             "rows with identical packs."))
    print(f"CSV: {log.write()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
