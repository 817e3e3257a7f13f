"""Hybrid context parallelism, planned (issue 41): fixed CP (every sequence cut over
the whole CP group) against hybrid CP (each sequence over an aligned block of the
fewest ranks its length needs, ``plan_step(..., cp_size=C, hybrid_cp=True)``) on
long-tailed batches, under one H100-class cost model.

For batches of 512 sequences whose lengths are lognormal (median 2k tokens, σ = 1.3)
with the longest at 32k / 128k / 256k, CP 4 / 8 / 16 and per-rank caps of 8k-32k,
DP 2: the K/V tokens each plan gathers against the least any degrees allow (every
sequence at its smallest degree), the predicted step and its lower bound, the
predicted compute alone (the same placement with the CP terms set to zero), the
micro-batches per rank, and the planning time.

Cost model: ``CostModel.from_model`` of a Llama-3-8B shape (hidden 4096, 32 layers,
32 heads, 8 K/V heads, MLP 14336, vocab 128256) at 400 TFLOP/s (about 40% of an
H100's dense bf16), 450 GB/s of NVLink per direction, 20 µs per collective, 2 ms
per micro-batch; bf16 K/V.

    python benchmarks/bench_cp_step.py            # full run
    python benchmarks/bench_cp_step.py --quick    # small sizes, smoke test
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import CsvLog, announce, environment, format_table, measure  # noqa: E402

import numpy as np  # noqa: E402

import seqpack  # noqa: E402
from seqpack.tools.report_cp import h100_cost_model, long_context_lengths  # noqa: E402

TITLE = "Hybrid context parallelism: fixed vs hybrid CP, planned"
COST = h100_cost_model()
COMPUTE = seqpack.CostModel(COST.per_micro_batch, COST.per_token, COST.per_token_squared)


def compute_time(plan, lengths):
    """The plan's step under the cost model without its CP terms (the same placement)."""
    total = 0.0
    degree = plan.cp_degree
    for m, mb in enumerate(plan.assignment):
        grid = np.zeros((plan.num_ranks, plan.num_micro_batches[m]))
        for r, rank in enumerate(mb):
            for k, cell in enumerate(rank):
                cost = COMPUTE.per_micro_batch
                for i in cell:
                    s, d = int(lengths[i]), int(degree[i])
                    local = s if d == 1 else -(-s // (2 * d)) * 2
                    cost += COMPUTE.per_token * local + COMPUTE.per_token_squared * s * s / d
                grid[r, k] = cost
        total += grid.max(axis=0).sum()
    return total


def table(quick, log):
    rows, worst_traffic, worst_compute = [], 0.0, 0.0
    cases = [(32_768, 4, 8_192), (131_072, 8, 16_384)] if quick else [
        (32_768, 4, 8_192), (32_768, 4, 16_384), (131_072, 8, 16_384), (131_072, 8, 32_768), (262_144, 16, 16_384),
        (262_144, 16, 32_768)]
    n = 96 if quick else 512
    dp = 2
    for longest, cp, cap in cases:
        lengths = long_context_lengths(n, longest, seed=longest + cap)
        plans = {}
        for name, hybrid in (("fixed", False), ("hybrid", True)):
            plans[name] = seqpack.plan_step(lengths, dp, cap, cost=COST, cp_size=cp, hybrid_cp=hybrid)
            t = measure(lambda: seqpack.plan_step(lengths, dp, cap, cost=COST, cp_size=cp, hybrid_cp=hybrid),
                        repeat=1 if not quick else 1, warmup=0)
            log.timing(f"{longest}/cp{cp}/cap{cap}", name, t)
            plans[name + "_ms"] = t["min"] * 1e3
        fixed, hybrid = plans["fixed"], plans["hybrid"]
        least = hybrid.least_kv_tokens
        traffic = hybrid.kv_tokens / least if least else 1.0
        comp_f, comp_h = compute_time(fixed, lengths), compute_time(hybrid, lengths)
        worst_traffic, worst_compute = max(worst_traffic, traffic), max(worst_compute, comp_h / comp_f)
        degrees = np.bincount(hybrid.cp_degree, minlength=cp + 1)
        spread = " ".join(f"{d}:{int(degrees[d])}" for d in range(1, cp + 1) if degrees[d])
        rows.append([f"{longest // 1024}k", cp, f"{cap // 1024}k", int(lengths.sum()), fixed.kv_tokens / 1e6,
                     hybrid.kv_tokens / 1e6, least / 1e6, traffic, fixed.predicted_time, hybrid.predicted_time,
                     hybrid.lower_bound, comp_h / comp_f, fixed.num_micro_batches[0], hybrid.num_micro_batches[0],
                     spread, plans["fixed_ms"], plans["hybrid_ms"]])
        case = f"{longest}/cp{cp}/cap{cap}"
        for name in ("fixed", "hybrid"):
            log.add(case, name, "kv_tokens", plans[name].kv_tokens)
            log.add(case, name, "predicted_s", plans[name].predicted_time)
            log.add(case, name, "lower_bound_s", plans[name].lower_bound)
        log.add(case, "hybrid", "compute_over_fixed", comp_h / comp_f)
    note = (f"{n} sequences per batch, DP {dp}; K/V in millions of tokens gathered over all ranks; 'least': every "
            "sequence at its smallest degree; steps in seconds under the stated cost model (FSDP sync: the slowest "
            "rank of each micro-batch); 'compute': hybrid's step with the CP terms zeroed over fixed's; degrees: "
            "hybrid's degree:count.")
    return format_table("Fixed vs hybrid CP (plan_step, cp_size)",
                        ["longest", "CP", "cap", "tokens", "fixed K/V M", "hybrid K/V M", "least K/V M",
                         "hybrid / least", "fixed step s", "hybrid step s", "bound s", "compute hybrid / fixed",
                         "fixed mbs", "hybrid mbs", "degrees", "fixed plan ms", "hybrid plan ms"], rows,
                        note=note), worst_traffic, worst_compute


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--csv")
    args = parser.parse_args()
    env = environment()
    announce(env)
    log = CsvLog("cp_step", env, args.csv)
    print(TITLE)
    print(f"cost model: {COST}")
    text, traffic, compute = table(args.quick, log)
    print(text)
    print(f"\nissue 41 targets: K/V within 25% of the least (worst {traffic:.3f}x), predicted compute within 3% of "
          f"fixed CP's (worst {compute:.3f}x)")
    print(f"\nCSV: {log.write()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
