"""Tree-aware planning benchmark (issue 29): planning GRPO batches as prefix trees
(``plan_micro_batches`` / ``plan_step`` with ``forest=``) against planning their rows.

Table 1, sharing kept vs cap: one GRPO batch (prompts of 64-2048 tokens, G = 8
responses of 16-1024 each), caps from 1x to 16x the mean tree's physical tokens.
For each cap: the tree plan's micro-batches, its sharing kept (the batch's physical
tokens over the sum of the micro-batches'), the largest micro-batch's physical tokens
(never above the cap), and the plain plan of the same rows under the same cap, counted
in logical tokens (what a row planner must count), with its physical tokens had each
micro-batch been laid out as a tree.

Table 2, planning time: ``plan_step`` (DP 64, cap 16x the mean tree, the default cost
model with an attention term) with the forest vs without it, at 4k to 1M rows; and
``PrefixForest.from_rows`` (the trie: per batch, linear in the tokens). Rows there are
short (prompts of 8-64, responses of 4-32 tokens) so that 1M rows fit in memory; the
planning time depends on the rows, not on their tokens.

    python benchmarks/bench_forest_planning.py            # full run
    python benchmarks/bench_forest_planning.py --quick    # small sizes, smoke test
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import CsvLog, announce, environment, format_table, measure  # noqa: E402

import numpy as np  # noqa: E402

import seqpack  # noqa: E402

TITLE = "Tree-aware planning: GRPO batches as prefix trees vs rows"
COST = seqpack.CostModel(per_micro_batch=50.0, per_token=1.0, per_token_squared=1e-4)


def grpo_rows(rng, prompts, group, prompt_range, response_range):
    rows, groups = [], []
    for p in range(prompts):
        prompt = rng.integers(0, 50_000, int(rng.integers(*prompt_range)))
        for _ in range(group):
            rows.append(np.concatenate([prompt, rng.integers(0, 50_000, int(rng.integers(*response_range)))]))
            groups.append(p)
    return rows, groups


def sharing_table(quick, log):
    rng = np.random.default_rng(0)
    rows, groups = grpo_rows(rng, 32 if quick else 512, 8, (64, 2048), (16, 1024))
    forest = seqpack.PrefixForest.from_rows(rows, group_ids=groups)
    mean_tree = forest.num_physical_tokens / forest.num_trees
    out = []
    for multiple in (1, 2, 4, 8, 16):
        cap = max(int(multiple * mean_tree), int(forest.lengths.max()))
        tree = seqpack.plan_micro_batches(forest.lengths, cap, forest=forest)
        plain = seqpack.plan_micro_batches(forest.lengths, cap)
        plain_physical = forest.subset_costs(plain.micro_batches)[0]
        out.append([f"{multiple}x", cap, tree.num_micro_batches, tree.sharing_kept, max(tree.tokens),
                    plain.num_micro_batches, forest.num_physical_tokens / int(plain_physical.sum())])
        log.add(f"cap {multiple}x", "trees", "micro_batches", tree.num_micro_batches)
        log.add(f"cap {multiple}x", "trees", "sharing_kept", tree.sharing_kept)
        log.add(f"cap {multiple}x", "rows", "micro_batches", plain.num_micro_batches)
    note = (f"{forest.num_rows} rows in {forest.num_trees} groups of 8, {forest.num_logical_tokens:,} logical / "
            f"{forest.num_physical_tokens:,} physical tokens, mean tree {mean_tree:,.0f} physical tokens. "
            "'rows' plans the same rows under the same cap counted in logical tokens; its sharing is what a tree "
            "layout of each of its micro-batches would keep.")
    return format_table("Sharing kept vs cap (plan_micro_batches)",
                        ["cap / mean tree", "cap", "trees: micro-batches", "sharing kept", "largest (physical)",
                         "rows: micro-batches", "rows: sharing kept"], out, note=note)


def timing_table(quick, log):
    out = []
    sizes = (512, 4096) if quick else (4096, 32_768, 262_144, 1_048_576)
    for n_rows in sizes:
        rng = np.random.default_rng(n_rows)
        rows, groups = grpo_rows(rng, n_rows // 8, 8, (8, 64), (4, 32))
        build = measure(lambda: seqpack.PrefixForest.from_rows(rows, group_ids=groups), repeat=1 if n_rows > 100_000
                        else 3, warmup=0)
        forest = seqpack.PrefixForest.from_rows(rows, group_ids=groups)
        cap = int(16 * forest.num_physical_tokens / forest.num_trees)
        dp = 64 if n_rows >= 4096 else 8
        repeat = 1 if n_rows > 100_000 else 3
        t_tree = measure(lambda: seqpack.plan_step(forest.lengths, dp, cap, cost=COST, forest=forest), repeat=repeat,
                         warmup=1)
        t_rows = measure(lambda: seqpack.plan_step(forest.lengths, dp, cap, cost=COST), repeat=repeat, warmup=1)
        plan = seqpack.plan_step(forest.lengths, dp, cap, cost=COST, forest=forest)
        out.append([n_rows, forest.num_trees, forest.num_logical_tokens, dp, build["min"], t_rows["min"] * 1e3,
                    t_tree["min"] * 1e3, plan.planned_on, plan.sharing_kept])
        log.timing(f"{n_rows} rows", "PrefixForest.from_rows", build)
        log.timing(f"{n_rows} rows", "plan_step rows", t_rows)
        log.timing(f"{n_rows} rows", "plan_step forest", t_tree)
    return format_table("Planning time (plan_step, best of runs)",
                        ["rows", "trees", "logical tokens", "DP", "forest build s", "plan rows ms", "plan trees ms",
                         "planned on", "sharing kept"], out,
                        note="plan trees includes the plain plan, a candidate it is compared with, and the exact "
                             "costing of both; cap = 16x the mean tree; cost: 50 per micro-batch, 1 per token, 1e-4 "
                             "per attended pair.")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--csv")
    args = parser.parse_args()
    env = environment()
    announce(env)
    log = CsvLog("forest_planning", env, args.csv)
    print(TITLE)
    print(sharing_table(args.quick, log))
    print()
    print(timing_table(args.quick, log))
    print(f"\nCSV: {log.write()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
