"""The ``seqpack`` command line: ``demo``, ``plan`` and ``bench``.

    seqpack demo                          # synthetic long-tail RL batch, all planners; a GRPO batch as prefix trees
    seqpack demo --cp 8                   # also fixed vs hybrid context parallelism on a long-context batch
    seqpack plan --lengths lens.txt       # your lengths (one per line, or .npy)
    seqpack bench                         # planner speed on 1k..1M lengths
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import List, Optional

import numpy as np


def load_lengths(path: str, capacity: Optional[int] = None) -> np.ndarray:
    """Read lengths from ``.npy`` or text (one integer per line; blank and # lines
    skipped). One rule for every planner: each length is at least 1 and, with
    ``capacity``, at most it; a length that breaks it is named where it is
    (``file:line``, or ``file[index]`` in a ``.npy``)."""
    if path.endswith(".npy"):
        arr = np.load(path)
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise ValueError(f"{path}: expected a 1-D array of integer lengths, got {arr.dtype} {arr.shape}")
        where = [f"{path}[{i}]" for i in range(arr.shape[0])]
    else:
        values, where = [], []
        with open(path) as f:
            for lineno, line in enumerate(f, 1):
                line = line.split("#", 1)[0].strip()
                if not line:
                    continue
                try:
                    values.append(int(line))
                except ValueError:
                    raise ValueError(f"{path}:{lineno}: not an integer length: {line!r}") from None
                where.append(f"{path}:{lineno}")
        if any(not -2**63 <= v < 2**63 for v in values):
            i = next(i for i, v in enumerate(values) if not -2**63 <= v < 2**63)
            raise ValueError(f"{where[i]}: length {values[i]} does not fit in int64")
        arr = np.asarray(values, dtype=np.int64)
    arr = arr.astype(np.int64)
    for i, v in enumerate(arr.tolist()):
        if v < 1:
            raise ValueError(f"{where[i]}: a length must be >= 1 (a sequence of at least one token), got {v}")
        if capacity is not None and v > capacity:
            raise ValueError(f"{where[i]}: length {v} exceeds --capacity {capacity} (no micro-batch can hold it)")
    return arr


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--capacity", type=int, default=8192, help="tokens per micro-batch (default 8192)")
    p.add_argument("--dp", type=int, default=8, help="data-parallel ranks (default 8)")
    p.add_argument("--round", type=int, default=64, help="dynamic-batching length multiple (default 64)")
    p.add_argument("--algorithm", action="append", help="packing algorithm(s) to run (default: all)")
    p.add_argument("--plot", metavar="PNG", help="save bin-fill / rank-load figures (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print the tables as JSON")


def _tables_json(tables) -> str:
    return json.dumps([{"title": t.title, "columns": t.columns, "rows": t.rows} for t in tables],
                      default=lambda o: o.item() if hasattr(o, "item") else str(o), indent=1)


def _run_report(lengths: np.ndarray, args: argparse.Namespace, trees: bool = False) -> int:
    """The planners' report of ``lengths``; with ``trees`` (the demo) also a GRPO batch
    (G = 8) plainly and as prefix trees. ``--json``: every table in one JSON array."""
    from .report import analyze

    rep = analyze(lengths, capacity=args.capacity, dp_size=args.dp, sequence_length_round=args.round,
                  algorithms=args.algorithm)
    tree_rep = None
    if trees:
        from .report_trees import grpo_rows, tree_report

        prompts = max(args.dp, args.num_sequences // 64)  # 64 prompts x 8 responses by default
        tree_rep = tree_report(*grpo_rows(prompts=prompts, group=8, seed=args.seed, max_len=args.capacity),
                               capacity=args.capacity, dp_size=args.dp)
    if args.json:
        print(_tables_json(rep.tables + (tree_rep.tables if tree_rep else [])))
    else:
        print(rep.format() + ("\n\n" + tree_rep.format() if tree_rep else ""))
    if args.plot:
        rep.plot(args.plot)
        print(f"\nfigure saved to {args.plot}")
        if tree_rep:
            path = _sibling(args.plot, "trees")
            tree_rep.plot(path)
            print(f"figure saved to {path}")
    return 0


def _sibling(path: str, name: str) -> str:
    """``fig.png`` -> ``fig_<name>.png``: another figure beside the first."""
    stem, dot, ext = path.rpartition(".")
    return f"{stem}_{name}.{ext}" if dot else f"{path}_{name}"


def _bench(args: argparse.Namespace) -> int:
    from ..planning import get_packer, karmarkar_karp
    from .report import Table

    rows = []
    rng = np.random.default_rng(0)
    for n in args.sizes:
        lengths = np.clip(np.rint(rng.lognormal(np.log(600), 1.0, n)), 1, args.capacity).astype(np.int64)
        for name in ("first_fit_decreasing", "best_fit_decreasing", "modified_first_fit_decreasing"):
            packer = get_packer(name, args.capacity)
            best = min(_time(lambda: packer.pack_arrays(lengths)) for _ in range(3))
            rows.append([name, n, best * 1e3])
        if n <= 65536:
            best = min(_time(lambda: karmarkar_karp(lengths, 64, False)) for _ in range(3))
            rows.append(["karmarkar_karp k=64", n, best * 1e3])
    print(Table("Planner speed (best of 3, ms)", ["planner", "n", "ms"], rows,
                note="Baselines against the pure-Python frameworks: benchmarks/bench_planning.py").format())
    return 0


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="seqpack", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="plan a built-in synthetic long-tail RL batch")
    demo.add_argument("-n", "--num-sequences", type=int, default=4096)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--cp", type=int, default=1,
                      help="also plan a long-context batch with fixed and hybrid context parallelism over this many "
                           "CP ranks (a power of two; --capacity is then per rank)")
    _add_plan_args(demo)
    plan = sub.add_parser("plan", help="plan your own lengths")
    plan.add_argument("--lengths", required=True, help="text file (one length per line) or .npy")
    _add_plan_args(plan)
    bench = sub.add_parser("bench", help="time the C++ planners")
    bench.add_argument("--capacity", type=int, default=8192)
    bench.add_argument("--sizes", type=int, nargs="+", default=[1024, 8192, 32768, 1048576])
    args = parser.parse_args(argv)
    try:
        if args.command == "demo":
            from .report import synthetic_rl_lengths

            lengths = synthetic_rl_lengths(args.num_sequences, seed=args.seed, max_len=args.capacity)
            code = _run_report(lengths, args, trees=True)
            if args.cp > 1:
                from .report_cp import cp_report, long_context_lengths

                rep = cp_report(long_context_lengths(min(args.num_sequences, 512), args.cp * args.capacity, args.seed),
                                capacity=args.capacity, dp_size=args.dp, cp_size=args.cp)
                print(_tables_json(rep.tables) if args.json else "\n" + rep.format())
                if args.plot:
                    path = _sibling(args.plot, "cp")
                    rep.plot(path)
                    print(f"figure saved to {path}")
            return code
        if args.command == "plan":
            return _run_report(load_lengths(args.lengths, args.capacity), args)
        return _bench(args)
    except (ValueError, TypeError, OSError, ImportError) as e:
        print(f"seqpack {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
