"""End-to-end training step on GRPO batches (issue 29): plain packing vs prefix
trees, each planned by ``seqpack.plan_step`` under the same cap, forward + backward
of every micro-batch of the step (gradients accumulated), one process, the model
of bench_prefix_tree.py.

  plain   plan_step(lengths, dp_size=1, max_tokens=cap): micro-batches of rows,
          each packed back to back (varlen_attention, token_logprobs);
  trees   PrefixForest.from_rows + plan_step(..., forest=forest): micro-batches of
          whole trees (their physical tokens under the cap), each laid out by
          pack_prefix_tree (attention on the tree, sdpa; token_logprobs).
Both steps sum the same loss (-sum of every logical token's next-token log-prob)
over their micro-batches; the losses and every weight's accumulated gradient are
checked to agree before anything is timed. Each step's time includes its planning
and (trees) the forest and every micro-batch's tree: per-step costs.

    python benchmarks/bench_tree_step.py            # full run (CPU, 1 thread)
    python benchmarks/bench_tree_step.py --quick    # small shapes, smoke test
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import CsvLog, announce, environment, format_table, measure, torch_cpu_arguments  # noqa: E402
from bench_prefix_tree import Model, grpo_batch, max_rel_diff, plain_step, prepared_tree, tree_step  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

import seqpack  # noqa: E402

TITLE = "GRPO training step, plain packing vs prefix trees, both planned by plan_step"


def plan(rows, groups, cap, trees):
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    if not trees:
        return seqpack.plan_step(lengths, dp_size=1, max_tokens=cap), None
    forest = seqpack.PrefixForest.from_rows(rows, group_ids=groups)
    return seqpack.plan_step(forest.lengths, dp_size=1, max_tokens=cap, forest=forest), forest


def step(model, rows, groups, cap, trees):
    """One step: plan, then forward + backward of every micro-batch; returns the
    summed loss and the plan (gradients stay accumulated in the model)."""
    p, _ = plan(rows, groups, cap, trees)
    total = 0.0
    for cell in p.assignment[0][0]:
        mb_rows = [rows[i] for i in cell]
        if trees:
            total += float(tree_step(model, prepared_tree(mb_rows, [groups[i] for i in cell])))
        else:
            total += float(plain_step(model, mb_rows))
    return total, p


def cases(quick):
    rng = np.random.default_rng(0)
    if quick:
        return [("GRPO G=8 2:1 (64/32) x4", *grpo_batch(rng, 4, 8, 64, 32), 1024)]
    out = []
    for g, prompts, (p, r) in ((8, 8, (512, 256)), (8, 8, (256, 512)), (16, 4, (512, 256)), (4, 16, (512, 256))):
        name = f"GRPO G={g} {p // r}:1 ({p}/{r}) x{prompts}" if p > r else f"GRPO G={g} 1:{r // p} ({p}/{r}) x{prompts}"
        out.append((name, *grpo_batch(rng, prompts, g, p, r), 8192))
    return out


def main() -> int:
    parser = torch_cpu_arguments(__doc__)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    env = announce(environment(), torch)
    log = CsvLog("tree_step", env, args.csv)
    model = Model()
    repeat = 1 if args.quick else args.repeat
    table, checks, targets = [], [], {}
    for name, rows, groups, cap in cases(args.quick):
        results = {}
        for trees in (False, True):
            model.zero_grad(set_to_none=True)
            loss, p = step(model, rows, groups, cap, trees)
            results[trees] = (loss, [q.grad.clone() for q in model.parameters()], p)
        (loss_p, grads_p, plan_p), (loss_t, grads_t, plan_t) = results[False], results[True]
        loss_rel = abs(loss_t - loss_p) / abs(loss_p)
        grad_rel = max_rel_diff(grads_t, grads_p)
        if loss_rel > 1e-4 or grad_rel > 1e-3:
            raise AssertionError(f"{name}: the tree step disagrees with plain packing: loss {loss_t} vs {loss_p} "
                                 f"(rel {loss_rel:.2e}), gradients rel {grad_rel:.2e}")
        checks.append(f"{name}: loss rel diff {loss_rel:.1e}; gradients max rel diff {grad_rel:.1e}")

        def timed(trees):
            def run():
                model.zero_grad(set_to_none=True)
                step(model, rows, groups, cap, trees)
            return measure(run, repeat=repeat, warmup=0 if args.quick else 1, budget_s=120)

        t_p, t_t = timed(False), timed(True)
        logical = sum(len(r) for r in rows)
        tokens_p, tokens_t = sum(map(sum, plan_p.tokens[0])), sum(map(sum, plan_t.tokens[0]))
        speedup = t_p["min"] / t_t["min"]
        table.append([name, len(rows), logical, cap, plan_p.num_micro_batches[0], plan_t.num_micro_batches[0],
                      tokens_p, tokens_t, plan_t.sharing_kept, plan_t.planned_on, t_p["min"] * 1e3, t_t["min"] * 1e3,
                      speedup, plan_p.predicted_time / plan_t.predicted_time])
        log.timing(name, "plain", t_p)
        log.timing(name, "trees", t_t)
        for impl, pl, tokens in (("plain", plan_p, tokens_p), ("trees", plan_t, tokens_t)):
            log.add(name, impl, "micro_batches", pl.num_micro_batches[0])
            log.add(name, impl, "tokens", tokens)
            log.add(name, impl, "predicted_time", pl.predicted_time)
        log.add(name, "trees", "sharing_kept", plan_t.sharing_kept)
        log.add(name, "-", "loss_rel_diff", loss_rel)
        log.add(name, "-", "grad_max_rel_diff", grad_rel)
        targets[name] = speedup
        print(f"  {name}: done", flush=True)

    print(format_table(
        TITLE, ["case", "rows", "logical tok", "cap", "plain mbs", "tree mbs", "plain tok", "tree tok",
                "sharing kept", "planned on", "plain ms", "trees ms", "speed-up", "predicted"], table,
        note="CPU fp32, torch threads = %d, best of %d run(s)%s on a shared 2-core VM. Model: bench_prefix_tree.py's "
             "(2 layers, hidden 256, vocab 4096). A step = plan_step (+ the forest and each micro-batch's tree for "
             "trees) + fwd+bwd of every micro-batch, gradients accumulated. tok = the plan's token sums (physical "
             "for trees); predicted = plan_step's predicted time, plain / trees (the token cost model)." % (
                 args.threads, repeat, "" if args.quick else " after a warm-up")))
    print("\nSame result (checked before timing):")
    for line in checks:
        print("  " + line)
    g8 = [(k, v) for k, v in targets.items() if k.startswith("GRPO G=8 2:1")]
    lines = [["GRPO G=8, prompt = 2x response: end-to-end step speed-up", ">= 1.8x", f"{v:.2f}x",
              "yes" if v >= 1.8 else "no"] for _, v in g8]
    print()
    print(format_table("Tree-step target (issue 29), CPU", ["target", "wanted", "measured", "met"], lines))
    print(f"\nCSV: {log.write()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
