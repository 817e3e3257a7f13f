"""Step shapes and the CUDA caching allocator (issue 42, item 3): the memory a
trainer reserves over 20 streamed steps whose micro-batches change shape, when
each rank runs its micro-batches in planned order, largest first, or padded to
static shape buckets (and, for reference, the planned ones shuffled). GPU only;
on a machine without CUDA it prints the shapes it would run and says it measured
nothing.

Steps come from ``StreamPlanner`` (DP 8, cap 16,384 tokens, steps of at least 768k
tokens; rank 0's micro-batches run) over a simulated asynchronous GRPO stream (``seqpack.testing.rollout_stream``;
lognormal lengths, median 1,500). Each micro-batch runs forward + backward of
bench_prefix_tree.py's model (hidden 1,024, 4 layers, vocab 4,096) on random
tokens, packed back to back (``varlen_attention``); a bucketed micro-batch carries
its padding as one extra segment. Each order runs in a fresh process, so every
allocator starts empty; after each step the process records
``torch.cuda.memory_reserved()`` and the peak so far.

    python benchmarks/bench_stream_memory.py            # 20 steps
    python benchmarks/bench_stream_memory.py --quick    # 4 steps, a smaller model
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import CsvLog, announce, environment, format_table, run_child  # noqa: E402

import numpy as np  # noqa: E402

import seqpack  # noqa: E402
from seqpack.testing.rollout_stream import grpo_rollouts, run_stream  # noqa: E402

TITLE = "Step shapes and the CUDA caching allocator: planned vs largest first vs static buckets"
DP, CAP, STEP_TOKENS = 8, 16_384, 8 * 96 * 1024
# "shuffled": the planned micro-batches in a random order (a planner blind to shapes).
ORDERS = {"shuffled": {}, "planned": {}, "largest_first": {"micro_batch_order": "largest_first"},
          "buckets": {"micro_batch_order": "largest_first", "static_shapes": True}}


def steps(order: str, count: int):
    """Rank 0's micro-batches in the first ``count`` streamed steps: (lengths, padded
    size) each."""
    rollouts = grpo_rollouts(count * 80, 8, median=1500, sigma=1.0, max_length=CAP, prompts_per_second=64.0, seed=5)
    planner = seqpack.StreamPlanner(DP, CAP, step_tokens=STEP_TOKENS, options=seqpack.StepOptions(**ORDERS[order]))
    rng = np.random.default_rng(1)
    out = []
    for step in run_stream(planner, rollouts, flush=False)[:count]:
        lens = step.plan.lengths
        padded = step.padded_tokens
        cells = [([int(lens[i]) for i in cell], padded[0][0][k] if padded else sum(int(lens[i]) for i in cell))
                 for k, cell in enumerate(step.plan.assignment[0][0])]
        out.append([cells[k] for k in rng.permutation(len(cells))] if order == "shuffled" else cells)
    return out


def child(spec: str) -> int:
    import torch
    from bench_prefix_tree import Model, plain_step

    order, count, quick = spec.split(",")
    torch.manual_seed(0)
    size = dict(hidden=256, layers=2) if quick == "1" else dict(hidden=1024, heads=16, head_dim=64, ffn=2816, layers=4)
    model = Model(**size).cuda()
    reserved, peaks = [], []
    rng = np.random.default_rng(0)
    for cells in steps(order, int(count)):
        for lengths, padded in cells:
            rows = [rng.integers(0, 4096, n) for n in lengths]
            if padded > sum(lengths):
                rows.append(np.zeros(padded - sum(lengths), dtype=np.int64))
            plain_step(model, rows, "cuda")
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        reserved.append(torch.cuda.memory_reserved() / 2**30)
        peaks.append(torch.cuda.max_memory_reserved() / 2**30)
    print(json.dumps({"reserved_gib": reserved, "peak_reserved_gib": peaks,
                      "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30}))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--csv")
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        return child(args.child)
    import torch

    env = announce(environment(), torch)
    log = CsvLog("stream_memory", env, args.csv)
    print(TITLE)
    count = 4 if args.quick else 20
    shapes = [[format_table(f"{order}: micro-batch tokens (padded) of the first steps", ["step", "micro-batches"],
                            [[i, " ".join(str(p) for _, p in cells)]
                             for i, cells in enumerate(steps(order, count)[:3])])]
              for order in ORDERS]
    for (text,) in shapes:
        print(text)
    if not torch.cuda.is_available():
        print("\nno CUDA device: nothing to measure (the allocator effect needs a GPU)")
        print(f"\nCSV: {log.write()}")
        return 0
    rows = []
    for order in ORDERS:
        got = run_child(__file__, f"{order},{count},{int(args.quick)}")
        rows.append([order, got["peak_reserved_gib"][-1], got["reserved_gib"][-1], got["peak_allocated_gib"],
                     " ".join(f"{x:.2f}" for x in got["peak_reserved_gib"])])
        log.add("stream", order, "max_memory_reserved_gib", got["peak_reserved_gib"][-1])
        log.add("stream", order, "max_memory_allocated_gib", got["peak_allocated_gib"])
    print(format_table(f"torch.cuda.max_memory_reserved over {count} steps ({torch.cuda.get_device_name()})",
                       ["order", "peak reserved GiB", "reserved at the end GiB", "peak allocated GiB",
                        "peak reserved after each step"], rows))
    print(f"\nCSV: {log.write()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
