"""Prefix reuse across micro-batches (issue 52): a tree larger than the cap run in
passes (``seqpack.split_prefix_tree`` + ``seqpack.prefix_reuse``: each shared prefix
forwarded once) against today's split plan (``plan_micro_batches(..., forest=)``:
the groups cut into micro-batches of rows, each piece a tree that repeats its prompt).

Table 1, planning: GRPO batches of 16 prompts (prompt and response lengths uniform
in half to all of their maximum), the physical tokens each plan computes against the
forest's (the bound: every token once) and the micro-batches against the token bound
``ceil(forest tokens / cap)``.

Table 2, planning a step: ``plan_step(..., forest=)`` over 8 ranks against
``plan_step(..., forest=, prefix_reuse=True)`` on the same batches, under
``CostModel.default()`` (an 8B model on an H200-class GPU): what each computes, its
micro-batches per rank, its predicted step and the proven lower bound, the planning time.

Table 3, one training step on the CPU: forward + backward of every micro-batch of a
batch on the reference model (``seqpack.testing.tiny_model``, hidden 128, 2 layers,
attention a large share of the work at these lengths), fp32, 1 thread; the split plan
(each micro-batch a tree) against the passes in both memory modes: seconds (best of
``--repeat``, the sides alternating), peak RSS rise, computed tokens and attention
pairs; and, in fp64, the largest parameter-gradient difference from the whole batch
in one micro-batch.

    python benchmarks/bench_prefix_reuse.py            # both tables
    python benchmarks/bench_prefix_reuse.py --quick    # small sizes; ends with the one-line summary
    python benchmarks/bench_prefix_reuse.py --plan-only  # the planning tables (seconds)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import (CsvLog, announce, environment, format_table, reset_peak_rss, rss_kib,  # noqa: E402
                      run_child, torch_cpu_arguments)

import numpy as np  # noqa: E402
import torch  # noqa: E402

import seqpack  # noqa: E402
from seqpack.planning.prefix_reuse import plan_prefix_reuse  # noqa: E402
from seqpack.testing.tiny_model import TinyCausalLM, TinyConfig  # noqa: E402

TITLE_PLAN = "Prefix reuse: physical tokens and micro-batches, split plan vs passes"
TITLE_STEP = "Prefix reuse: a training step on the CPU, split plan vs passes"
TITLE_STEP_PLAN = f"Prefix reuse: plan_step over {8} ranks, trees vs prefix_reuse=True (predicted)"
MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 << 10)}  # freed tensors go back to the system: RSS is live memory
HIDDEN = 128
DP = 8
PLAN_CASES = [  # (G, prompt max, response max, cap): the batches of issue 52
    (16, 4096, 1024, 8192), (16, 2048, 512, 4096), (8, 6144, 1024, 8192), (32, 1024, 512, 4096)]


def grpo_rows(rng, prompts, g, prompt_max, response_max, vocab=50_000):
    rows, groups = [], []
    for p in range(prompts):
        prompt = rng.integers(1, vocab, int(rng.integers(prompt_max // 2, prompt_max + 1)))
        for _ in range(g):
            rows.append(np.concatenate([prompt, rng.integers(1, vocab, int(rng.integers(response_max // 2,
                                                                                         response_max + 1)))]))
            groups.append(p)
    return rows, groups


def split_plan(rows, groups, cap):
    """Today's plan: micro-batches of rows (groups kept whole where they fit), each a
    tree of its rows; its physical tokens and attention pairs."""
    forest = seqpack.PrefixForest.from_rows(rows, group_ids=groups)
    plan = seqpack.plan_micro_batches(forest.lengths, max_tokens=cap, forest=forest)
    trees = [seqpack.pack_prefix_tree([rows[r] for r in mb], group_ids=[groups[r] for r in mb])
             for mb in plan.micro_batches]
    return forest, plan, trees


def plan_table(log, quick):
    rng = np.random.default_rng(0)
    out = []
    for g, p_max, r_max, cap in PLAN_CASES[:1] if quick else PLAN_CASES:
        prompts = 4 if quick else 16
        rows, groups = grpo_rows(rng, prompts, g, p_max, r_max)
        forest, plan, trees = split_plan(rows, groups, cap)
        split_tokens = sum(t.num_tokens for t in trees)
        whole = seqpack.pack_prefix_tree(rows, group_ids=groups)
        passes = seqpack.split_prefix_tree(whole, cap)
        physical = whole.num_tokens
        bound = math.ceil(physical / cap)
        case = f"G={g} prompt<={p_max} response<={r_max} cap {cap}"
        ranks = plan_prefix_reuse(forest, cap, DP)
        out.append([case, sum(len(r) for r in rows), physical, split_tokens, split_tokens / physical,
                    int(passes.tokens().sum()), int(passes.tokens().sum()) / physical, plan.num_micro_batches,
                    passes.num_passes, bound, f"{ranks.num_micro_batches} / {ranks.bound}"])
        log.add(case, "-", f"dp{DP}_micro_batches", ranks.num_micro_batches)
        log.add(case, "-", f"dp{DP}_bound", ranks.bound)
        for key, value in (("rows_tokens", sum(len(r) for r in rows)), ("forest_tokens", physical),
                           ("split_tokens", split_tokens), ("passes_tokens", int(passes.tokens().sum())),
                           ("split_micro_batches", plan.num_micro_batches), ("passes", passes.num_passes),
                           ("bound_micro_batches", bound)):
            log.add(case, "-", key, value)
    print(format_table(TITLE_PLAN, ["batch", "rows' tokens", "forest tokens", "split plan tokens", "x forest",
                                    "passes' tokens", "x forest", "split micro-batches", "passes",
                                    "bound", f"DP {DP}: per rank / bound"], out,
                       note="split plan: plan_micro_batches(forest=) with each micro-batch a tree of its rows; passes: "
                            "split_prefix_tree of the whole batch's forest at the same cap; bound: "
                            f"ceil(forest tokens / cap); DP {DP}: plan_prefix_reuse over {DP} ranks (whole trees to "
                            "ranks, equal counts), micro-batches per rank against ceil(forest tokens / (ranks x cap))."))
    return out


def step_plan_table(log, quick):
    """plan_step on trees against plan_step with prefix reuse, the same batches and ranks."""
    rng = np.random.default_rng(0)
    out = []
    for g, p_max, r_max, cap in PLAN_CASES[:1] if quick else PLAN_CASES:
        rows, groups = grpo_rows(rng, 4 if quick else 16, g, p_max, r_max)
        forest = seqpack.PrefixForest.from_rows(rows, group_ids=groups)
        case = f"G={g} prompt<={p_max} response<={r_max} cap {cap}"
        cells = []
        for name, reuse in (("trees", False), ("prefix_reuse", True)):
            start = time.perf_counter()
            plan = seqpack.plan_step(forest.lengths, DP, cap, forest=forest, prefix_reuse=reuse)
            seconds = time.perf_counter() - start
            tokens = sum(t for mb in plan.tokens for rank in mb for t in rank)
            cells.append((plan, tokens, seconds))
            for key, value in (("tokens", tokens), ("micro_batches", plan.num_micro_batches[0]),
                               ("predicted_s", plan.predicted_time), ("lower_bound_s", plan.lower_bound),
                               ("planning_s", seconds)):
                log.add(case, f"plan_step_{name}", key, value)
        (plain, plain_tokens, plain_s), (reuse, reuse_tokens, reuse_s) = cells
        out.append([case, plain.planned_on, plain_tokens / forest.num_physical_tokens, plain.num_micro_batches[0],
                    f"{plain.predicted_time:.3f}", reuse.planned_on, reuse_tokens / forest.num_physical_tokens,
                    reuse.num_micro_batches[0], f"{reuse.predicted_time:.3f}",
                    plain.predicted_time / reuse.predicted_time, f"{reuse.lower_bound:.3f}",
                    f"{plain_s * 1e3:.0f} / {reuse_s * 1e3:.0f}"])
    print(format_table(TITLE_STEP_PLAN, ["batch", "trees: kept", "x forest", "per rank", "predicted s",
                                         "reuse: kept", "x forest", "per rank", "predicted s", "speed-up",
                                         "lower bound s", "planning ms"], out,
                       note="plan_step(lengths, 8, cap, forest=) vs the same with prefix_reuse=True (each mini-batch "
                            "in passes where the cost model predicts them faster); CostModel.default(), sync "
                            "'micro_batch'; the lower bound holds for any plan, passes included."))
    return out


def config():
    return TinyConfig(vocab_size=512, hidden_size=HIDDEN, num_layers=2, num_heads=4, num_kv_heads=2)


def model(dtype, device="cpu"):
    torch.manual_seed(0)
    return TinyCausalLM(config()).to(device=device, dtype=dtype)


def work(tokens, pairs):
    """FLOPs (forward + backward) of the reference model on ``tokens`` physical tokens
    and ``pairs`` visible attention pairs (the cost model counts s^2 / 2 per causal
    row: a tree's pairs are twice that), its LM head at every token."""
    c = config()
    inter = c.intermediate_size or (8 * c.hidden_size // 3 + 15) // 16 * 16
    cost = seqpack.CostModel.from_model(c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, inter)
    return (cost.per_token + 6 * c.hidden_size * c.vocab_size) * tokens + cost.per_token_squared * 2 * pairs


def step_case(quick):
    rng = np.random.default_rng(1)
    prompts, g, p_max, r_max, cap = (2, 4, 256, 64, 320) if quick else (4, 8, 1536, 256, 2048)
    rows, groups = grpo_rows(rng, prompts, g, p_max, r_max, vocab=512)
    forest, plan, trees = split_plan(rows, groups, cap)
    whole = seqpack.pack_prefix_tree(rows, group_ids=groups)
    return dict(prompts=prompts, g=g, p_max=p_max, r_max=r_max, cap=cap, plan=plan, trees=trees, whole=whole,
                passes=seqpack.split_prefix_tree(whole, cap))


SIDES = ("split plan", "passes, activations", "passes, kv")


def run_side(m, case, side):
    if side == "split plan":
        step_split(m, case["trees"])
    else:
        step_passes(m, case["passes"], side.split(", ")[1])


def child(spec):
    """One side's peak RSS rise over one step after a warm-up step, in this process alone."""
    quick, side = spec.split(",", 1)
    torch.set_num_threads(1)
    case = step_case(quick == "1")
    m = model(torch.float32)
    run_side(m, case, side)
    m.zero_grad(set_to_none=True)
    base = reset_peak_rss()
    run_side(m, case, side)
    print(json.dumps({"peak_mib": (rss_kib("VmHWM:") - base) / 1024}))


def step_split(m, trees):
    for tree in trees:
        lp = seqpack.token_logprobs(m.forward_tree(tree), tree).logprobs
        (-lp.sum()).backward()


def step_passes(m, passes, memory):
    for mb in seqpack.prefix_reuse(passes, memory=memory):
        lp = seqpack.token_logprobs(mb.forward(m), mb.layout).logprobs
        (-lp.sum()).backward()


def grads_of(m):
    return [p.grad.detach().clone() for p in m.parameters()]


def step_table(log, quick, repeat, device="cpu", dtype=torch.float32):
    case = step_case(quick)
    prompts, g, p_max, r_max, cap = (case[k] for k in ("prompts", "g", "p_max", "r_max", "cap"))
    plan, trees, whole, passes = case["plan"], case["trees"], case["whole"], case["passes"]
    cuda = torch.device(device).type == "cuda"

    # fp64: the passes' gradients against the whole batch in one micro-batch
    m64 = model(torch.float64, device)
    m64.zero_grad()
    step_split(m64, [whole])
    ref = grads_of(m64)
    diffs = {}
    for side in SIDES:
        m64.zero_grad()
        run_side(m64, case, side)
        diffs[side] = max(float((a - b).abs().max()) for a, b in zip(grads_of(m64), ref))
    del m64, ref

    m = model(dtype, device)
    best = {side: float("inf") for side in SIDES}
    peak = {side: 0.0 for side in SIDES}
    for side in SIDES:  # warm-up
        m.zero_grad(set_to_none=True)
        run_side(m, case, side)
    for _ in range(repeat):
        for side in SIDES:
            m.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            start = time.perf_counter()
            run_side(m, case, side)
            if cuda:
                torch.cuda.synchronize()
                peak[side] = max(peak[side], (torch.cuda.max_memory_allocated() - base) / 2**20)
            best[side] = min(best[side], time.perf_counter() - start)
    if not cuda:
        peak = {side: run_child(__file__, f"{int(quick)},{side}", MEMORY_ENV)["peak_mib"] for side in SIDES}
    split_tokens = sum(t.num_tokens for t in trees)
    split_pairs = sum(t.metrics().tree_attention_pairs for t in trees)
    reuse_pairs = whole.metrics().tree_attention_pairs
    counts = {"split plan": (plan.num_micro_batches, split_tokens, split_pairs),
              "passes, activations": (passes.num_passes, whole.num_tokens, reuse_pairs),
              "passes, kv": (passes.num_passes, whole.num_tokens, reuse_pairs)}
    out = []
    base = best["split plan"]
    bound = work(split_tokens, split_pairs) / work(whole.num_tokens, reuse_pairs)
    for name in SIDES:
        mbs, tokens, pairs = counts[name]
        grad = diffs[name]
        out.append([name, mbs, tokens, pairs, best[name], base / best[name], (base / best[name]) / bound
                    if name != "split plan" else "", peak[name], f"{grad:.1e}"])
        for key, value in (("micro_batches", mbs), ("tokens", tokens), ("pairs", pairs), ("seconds_min", best[name]),
                           ("peak_allocated_mib" if cuda else "peak_rss_mib", peak[name]), ("max_grad_diff_fp64", grad)):
            log.add(f"G={g} {prompts} prompts<={p_max} responses<={r_max} cap {cap}", name, key, value)
    print(format_table(TITLE_STEP, ["plan", "micro-batches", "tokens", "attention pairs", "step s", "x split",
                                    "of the work bound", "peak MiB", "max grad diff (fp64)"], out,
                       note=f"{prompts} prompts x G={g}, prompts <= {p_max}, responses <= {r_max}, cap {cap}; "
                            f"tiny Llama (hidden 128, 2 layers), {str(dtype).split('.')[-1]} on {device} (peak MiB: "
                            f"max_memory_allocated on CUDA), torch threads 1, forward + backward of every "
                            f"micro-batch, best of {repeat}, alternating; grad diff: fp64, against the whole batch "
                            f"in one micro-batch; peak MiB: the RSS rise over one step after a warm-up, each side in a "
                            f"process of its own (MALLOC_MMAP_THRESHOLD_ = 128 KiB). Work bound: the split plan's "
                            f"FLOPs over the passes' (CostModel.from_model of this model, LM head at every token) = "
                            f"{bound:.2f}x (tokens {split_tokens / whole.num_tokens:.2f}x, pairs "
                            f"{split_pairs / reuse_pairs:.2f}x)."))
    return dict(tokens=whole.num_tokens / split_tokens, speed=base / best["passes, activations"],
                memory=peak["passes, kv"] / max(peak["split plan"], 1e-9),
                grad=max(diffs["passes, activations"], diffs["passes, kv"]))


def main() -> int:
    parser = torch_cpu_arguments(__doc__, repeat=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (the step table; planning is host work)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--plan-only", action="store_true", help="the planning tables only")
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return 0
    torch.set_num_threads(args.threads)
    env = announce(environment(), torch)
    log = CsvLog("prefix_reuse", env, args.csv)
    plan_table(log, args.quick)
    step_plan_table(log, args.quick)
    if args.plan_only:
        print(f"csv: {log.write()}")
        return 0
    summary = step_table(log, args.quick, 1 if args.quick else args.repeat, args.device, getattr(torch, args.dtype))
    print(f"csv: {log.write()}")
    print(f"prefix reuse: tokens {summary['tokens']:.2f} of the split plan, step {summary['speed']:.2f}x faster, "
          f"peak memory {summary['memory']:.2f} of the split plan, max grad diff {summary['grad']:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
