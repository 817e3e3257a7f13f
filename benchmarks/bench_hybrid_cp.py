"""Hybrid context parallelism, measured (issue 41): a training step of 4 gloo CPU
processes (one CP group of 4, DP 1) on a long-tailed batch, fixed CP (every
sequence zigzag-cut over the 4 ranks) against hybrid CP (each over the fewest ranks
its length needs), both planned by ``plan_step`` on one cost model fitted on this
machine, both run by the same code (``hybrid_cp_micro_batches``, the tiny model's
forward and backward with ``seqpack.attention`` on each part's cut).

The cost model is ``CostModel.fit(..., cp_degrees=)`` on micro-batches timed in
lock-step on the 4 ranks: plain rows whole on each rank, and rows sharded at
degree 2 and 4 (their K/V gathered over the block). The step: every rank's
micro-batches of the plan, forward + backward (the blocks' K/V all-gathers and
reduce-scatters included), then one all-reduce of the gradients; median of the
repeats, the plans run round-robin.

    python benchmarks/bench_hybrid_cp.py            # full run
    python benchmarks/bench_hybrid_cp.py --quick    # small sizes, smoke test
"""

from __future__ import annotations

import datetime
import math
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import format_table, run_gloo_ranks, start  # noqa: E402

import numpy as np  # noqa: E402

TITLE = "Hybrid context parallelism, measured: a gloo step on 4 CPU processes"
WORLD, CP = 4, 4
MODEL = dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2)


def long_tail(n, longest, seed):
    """A long-tailed batch: one sequence of ``longest`` tokens, a few long ones, many short."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(longest / 24), 1.0, n), 16, longest).astype(np.int64)
    lengths[0] = longest
    return lengths


def calibration(cap, quick):
    """(lengths, degree) micro-batches every rank runs alike: whole rows, rows sharded
    over blocks of 2 and of 4 ranks."""
    c = cap
    items = [([c], 1), ([c // 2] * 2, 1), ([c // 8] * 8, 1), ([c // 4], 1), ([2 * c], 2), ([c, c // 2], 2),
             ([c // 2] * 4, 2), ([4 * c], 4), ([2 * c, c], 4), ([c] * 4, 4), ([c // 2] * 2, 4)]
    return items[:7] if quick else items


def worker(rank, world, port, job, results):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    import seqpack
    from seqpack.testing.tiny_model import TinyCausalLM, TinyConfig, packed_loss

    try:
        store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=False, timeout=datetime.timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=300))
        cfg = TinyConfig(**MODEL)
        torch.manual_seed(0)
        model = TinyCausalLM(cfg)
        groups = seqpack.hybrid_cp_groups(1, CP)
        lengths = np.asarray(job["lengths"], dtype=np.int64)
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(1, cfg.vocab_size, (len(lengths), int(lengths.max())), generator=g)
        tokens = float((lengths - 1).sum())

        def timed(fn):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the lock-step: the slowest rank's
            return float(t)

        def calibration_mb(lens, d):
            x = torch.randint(1, cfg.vocab_size, (len(lens), max(lens)), generator=torch.Generator().manual_seed(2))
            sl = torch.tensor(lens)
            if d == 1:
                return lambda: packed_loss(model, seqpack.pack_sequences({"input_ids": x}, seq_lens=sl),
                                           tokens).backward()
            first = rank // d * d
            batch = seqpack.pack_sequences({"input_ids": x}, seq_lens=sl, pad_multiple=2 * d, cp_size=d,
                                           cp_rank=rank - first)
            group = groups.block(0, d, first)
            return lambda: packed_loss(model, batch, tokens, group).backward()

        calib = job["calibration"]
        runs = [calibration_mb(lens, d) for lens, d in calib]
        runs[0]()  # warm-up
        secs = [math.inf] * len(calib)
        for _ in range(job["calib_repeat"]):
            for i, run in enumerate(runs):
                secs[i] = min(secs[i], timed(run))
                model.zero_grad(set_to_none=False)
        fitted = seqpack.CostModel.fit([lens for lens, _ in calib], secs,
                                       cp_degrees=[[d] * len(lens) for lens, d in calib])
        plans, batches = {}, {}
        for name, hybrid in (("fixed", False), ("hybrid", True)):
            plans[name] = seqpack.plan_step(lengths, 1, job["cap"], cost=fitted, cp_size=CP, hybrid_cp=hybrid)
            batches[name] = seqpack.hybrid_cp_micro_batches({"input_ids": ids}, lengths, plans[name])

        def step(name):
            for mb in batches[name]:
                packed_loss(model, mb, tokens).backward()
            flat = torch._utils._flatten_dense_tensors([p.grad for p in model.parameters()])
            dist.all_reduce(flat)

        times = {name: [] for name in plans}
        for r in range(job["repeat"] + 1):  # round 0 warms up; plans round-robin
            for name in plans:
                model.zero_grad(set_to_none=False)
                t = timed(lambda: step(name))
                if r:
                    times[name].append(t)
        if rank == 0:
            results.put(("ok", {
                "fit": fitted, "calib": [(list(lens), d, s, fitted.micro_batch_costs([lens])[0]) for (lens, d), s in
                                         zip(calib, secs)],
                "plans": {n: dict(kv=p.kv_tokens, least=p.least_kv_tokens, predicted=p.predicted_time,
                                  bound=p.lower_bound, mbs=p.num_micro_batches[0],
                                  degrees=np.bincount(p.cp_degree, minlength=CP + 1).tolist(), times=times[n])
                          for n, p in plans.items()}}))
        dist.barrier()
    except BaseException:
        results.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def cp_cost(fit, lens, d):
    """The fitted per-rank cost of a calibration micro-batch (what plan_step uses)."""
    local = [s if d == 1 else -(-s // (2 * d)) * 2 for s in lens]
    cost = fit.per_micro_batch + fit.per_token * sum(local) + fit.per_token_squared * sum(s * s / d for s in lens)
    if d > 1:
        cost += fit.per_kv_token * sum(s * (d - 1) / d for s in lens) + fit.per_collective * len(lens)
    return cost


def main() -> int:
    args, log = start(__doc__, "hybrid_cp", TITLE, repeat=5)
    n, longest, cap = (12, 512, 160) if args.quick else (48, 4096, 1024)
    lengths = long_tail(n, longest, seed=7)
    job = {"lengths": lengths.tolist(), "cap": cap, "calibration": calibration(cap, args.quick),
           "calib_repeat": 1 if args.quick else 3, "repeat": 1 if args.quick else args.repeat}
    print(f"batch: {n} sequences, {int(lengths.sum()):,} tokens, longest {longest}, median "
          f"{int(np.median(lengths))}; CP {CP}, DP 1, cap {cap} tokens per rank; tiny model {MODEL}; "
          f"{WORLD} gloo processes x 1 thread on {os.cpu_count()} cores", flush=True)
    t0 = time.perf_counter()
    got = run_gloo_ranks(worker, WORLD, job, 180 if args.quick else 1200, "the gloo step")
    fit = got["fit"]
    print(format_table(
        "Cost model fitted on this machine (one micro-batch on each of the 4 ranks in lock-step, forward + backward, "
        "sharded rows' K/V gathered over their block)",
        ["lengths", "degree", "measured ms", "fitted ms"],
        [[str(c) if len(c) <= 4 else f"{len(c)} x {c[0]}", d, s * 1e3, cp_cost(fit, c, d) * 1e3]
         for c, d, s, _ in got["calib"]],
        note=f"fit: per_micro_batch {fit.per_micro_batch * 1e3:.3f} ms, per_token {fit.per_token * 1e6:.3f} us, "
             f"per_token_squared {fit.per_token_squared * 1e9:.4f} ns, per_kv_token {fit.per_kv_token * 1e6:.3f} us, "
             f"per_collective {fit.per_collective * 1e3:.3f} ms; R² = {fit.r_squared:.4f}"))
    case = f"gloo/cp{CP}/n{n}/cap{cap}"
    for term in ("per_micro_batch", "per_token", "per_token_squared", "per_kv_token", "per_collective", "r_squared"):
        log.add(case, "fit", term, getattr(fit, term))
    rows = []
    base = statistics.median(got["plans"]["fixed"]["times"])
    for name, p in got["plans"].items():
        med = statistics.median(p["times"])
        spread = (max(p["times"]) - min(p["times"])) / med
        degrees = " ".join(f"{d}:{c}" for d, c in enumerate(p["degrees"]) if c)
        rows.append([name, degrees, p["mbs"], p["kv"], p["least"], p["predicted"], p["bound"], med, f"{spread:.1%}",
                     med / p["predicted"], med / base])
        for metric, value in (("step_s_median", med), ("step_s_min", min(p["times"])), ("predicted_s", p["predicted"]),
                              ("lower_bound_s", p["bound"]), ("kv_tokens", p["kv"])):
            log.add(case, name, metric, value)
    print()
    print(format_table(
        f"Fixed vs hybrid CP, measured (median of {job['repeat']} steps after a warm-up, round-robin)",
        ["plan", "degrees", "mbs/rank", "K/V tokens", "least K/V", "predicted s", "bound s", "measured s",
         "(max-min)/median", "measured / predicted", "x fixed (measured)"], rows,
        note=f"K/V tokens: gathered over all ranks per layer and pass. The run took {time.perf_counter() - t0:.0f} s; "
             f"{WORLD} processes share {os.cpu_count()} cores, so the ranks of a block wait on one another's time "
             "slices too: the ratio, not the seconds, is the result."))
    print(f"\nCSV: {log.write()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
