"""Tree-aware planning benchmark (issues 29 and 40): planning batches as prefix trees
(``plan_micro_batches`` / ``plan_step`` with ``forest=``) against the two lower
bounds, the old whole-trees rule, and AReaL's trie packing.

Table 1, micro-batches and physical tokens. GRPO batches of 512 rows (G = 4, 8, 16
responses per prompt, prompt:response 2:1, 1:1 and 1:2, lognormal lengths around a
512-token response) and a per-turn agentic batch (16 tasks x 4 samples x 8 turns: a
1.5k-token system prompt shared by all, a task prompt, then turns of tool output and
response, each turn a row holding its whole history), at caps of 1x, 2x and 4x the
mean tree (a GRPO group, an agentic task; never below the longest row). For each:
the lower bounds (ceil(physical / cap) micro-batches; the batch's physical tokens),
seqpack's plan and the packing it kept, the whole-trees rule (``whole_trees=True``:
the pre-issue-40 behaviour), and AReaL 1.0.4's first-fit tries (rows in order, a row
joins the first trie where the nodes it adds fit). The forest is built without group
ids, so seqpack shares exactly what AReaL's token tries share. Timing: AReaL's
Python (re-expressed here from its rule: a trie node object per token, as
``_greedy_build_tries``) against seqpack from the same token rows
(``PrefixForest.from_rows`` + ``plan_micro_batches``).

Table 2, predicted step (``plan_step``, DP 4, cap 2x the mean tree, cost 50 per
micro-batch + 1 per token + 1e-4 per attended pair): seqpack's tree plan, the plain
row plan and AReaL's tries placed by the same step planner, each micro-batch costed
from its own physical tokens and attention pairs.

Table 3, planning time at 4k-1M rows (short rows, GRPO G = 8, cap 16x the mean
tree): ``PrefixForest.from_rows``, ``plan_micro_batches(forest=)``,
``plan_step(forest=)`` (DP 64) and ``plan_step`` on the rows.

    python benchmarks/bench_forest_planning.py            # full run
    python benchmarks/bench_forest_planning.py --quick    # small sizes, smoke test
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import format_table, measure, start  # noqa: E402

import numpy as np  # noqa: E402

import seqpack  # noqa: E402
from seqpack import PrefixForest  # noqa: E402
from seqpack import _core  # noqa: E402
from seqpack.planning.forest_planning import first_fit_trie  # noqa: E402

TITLE = "Tree-aware planning: prefix trees vs whole trees vs AReaL's first-fit tries"
COST = seqpack.CostModel(per_micro_batch=50.0, per_token=1.0, per_token_squared=1e-4)


# ---- batches --------------------------------------------------------------------------
def lognormal(rng, mean, size, sigma=0.6):
    return np.maximum(1, rng.lognormal(np.log(mean) - sigma ** 2 / 2, sigma, size).astype(np.int64))


def grpo_batch(rng, group, prompt_ratio, rows=512, response=512):
    out, groups = [], []
    for p in range(rows // group):
        prompt = rng.integers(0, 50_000, int(lognormal(rng, response * prompt_ratio, 1)[0]))
        for n in lognormal(rng, response, group):
            out.append(np.concatenate([prompt, rng.integers(0, 50_000, int(n))]))
            groups.append(p)
    return out, groups


def agentic_batch(rng, tasks=16, samples=4, turns=8):
    system = rng.integers(0, 50_000, 1536)
    out, groups = [], []
    for t in range(tasks):
        task = rng.integers(0, 50_000, int(lognormal(rng, 200, 1)[0]))
        for _ in range(samples):
            history = np.concatenate([system, task])
            for _ in range(turns):
                tool = rng.integers(0, 50_000, int(lognormal(rng, 300, 1)[0]))
                reply = rng.integers(0, 50_000, int(lognormal(rng, 150, 1)[0]))
                history = np.concatenate([history, tool, reply])
                out.append(history)
                groups.append(t)
    return out, groups


def batches(quick):
    rng = np.random.default_rng(0)
    specs = [(8, 1.0, "1:1")] if quick else [(g, r, n) for g in (4, 8, 16) for r, n in ((2.0, "2:1"), (1.0, "1:1"),
                                                                                      (0.5, "1:2"))]
    for group, ratio, name in specs:
        yield (f"GRPO G={group} {name}", *grpo_batch(rng, group, ratio, rows=128 if quick else 512))
    yield ("agentic 16x4x8" if not quick else "agentic 4x4x8", *agentic_batch(rng, tasks=4 if quick else 16))


# ---- AReaL's trie packing, re-expressed ------------------------------------------------
class _Node:
    """A trie node per token, as AReaL's build tries hold them."""

    __slots__ = ("children", "rows")

    def __init__(self):
        self.children = {}
        self.rows = []


def areal_first_fit_tries(rows, cap):
    """AReaL 1.0.4's greedy trie building (areal/models/tree_attn/tree.py,
    ``_greedy_build_tries``): sequences read as token lists, then each joins the first
    trie whose node count plus the nodes it would add stays within the cap (a new trie
    otherwise). Returns each trie's row ids and node count."""
    tries = []  # [root, nodes, row ids]
    for r, seq in enumerate(row.tolist() for row in rows):
        chosen = None
        for trie in tries:
            node, added = trie[0], 0
            for i, tok in enumerate(seq):
                child = node.children.get(tok)
                if child is None:
                    added = len(seq) - i
                    break
                node = child
            if trie[1] + added <= cap:
                chosen = trie
                break
        if chosen is None:
            if len(seq) > cap:
                raise ValueError(f"sequence of {len(seq)} tokens exceeds the cap {cap}")
            chosen = [_Node(), 0, []]
            tries.append(chosen)
            added = len(seq)
        node = chosen[0]
        for tok in seq:
            child = node.children.get(tok)
            if child is None:
                child = node.children[tok] = _Node()
            child.rows.append(r)
            node = child
        chosen[1] += added
        chosen[2].append(r)
    return [t[2] for t in tries], [t[1] for t in tries]


# ---- tables ---------------------------------------------------------------------------
def cap_of(forest, grouped, multiple):
    mean_tree = grouped.num_physical_tokens / grouped.num_trees
    return max(int(multiple * mean_tree), int(forest.lengths.max()))


def packing_table(quick, log):
    out, worst = [], 1.0
    for name, rows, groups in batches(quick):
        forest = PrefixForest.from_rows(rows)  # AReaL's sharing: any common prefix
        grouped = PrefixForest.from_rows(rows, group_ids=groups)
        for multiple in (1, 2) if quick else (1, 2, 4):
            cap = cap_of(forest, grouped, multiple)
            plan = seqpack.plan_micro_batches(forest.lengths, cap, forest=forest)
            whole = seqpack.plan_micro_batches(forest.lengths, cap, forest=forest, whole_trees=True)
            tries, trie_tokens = areal_first_fit_tries(rows, cap)
            ours_tries = first_fit_trie(forest, cap)
            if ours_tries != [sorted(t) for t in tries]:
                raise AssertionError(f"{name}: first_fit_trie differs from AReaL's rule")
            t_areal = measure(lambda: areal_first_fit_tries(rows, cap), repeat=1 if not quick else 1, warmup=0)
            t_ours = measure(lambda: seqpack.plan_micro_batches(
                forest.lengths, cap, forest=PrefixForest.from_rows(rows)), repeat=5, warmup=1)
            tokens, areal_tokens = sum(plan.tokens), sum(trie_tokens)
            dominates = plan.num_micro_batches <= len(tries) and tokens <= areal_tokens
            speedup = t_areal["min"] / t_ours["min"]
            worst = min(worst, speedup) if out else speedup
            bound_mb = -(-forest.num_physical_tokens // cap)
            out.append([name, f"{multiple}x", cap, bound_mb, forest.num_physical_tokens, plan.num_micro_batches,
                        tokens, plan.method, whole.num_micro_batches, sum(whole.tokens), len(tries), areal_tokens,
                        "yes" if dominates else "NO", t_areal["min"] * 1e3, t_ours["min"] * 1e3, speedup])
            case = f"{name} cap {multiple}x"
            log.add(case, "seqpack", "micro_batches", plan.num_micro_batches)
            log.add(case, "seqpack", "physical_tokens", tokens)
            log.add(case, "whole_trees", "micro_batches", whole.num_micro_batches)
            log.add(case, "whole_trees", "physical_tokens", sum(whole.tokens))
            log.add(case, "first_fit_trie", "micro_batches", len(tries))
            log.add(case, "first_fit_trie", "physical_tokens", areal_tokens)
            log.timing(case, "areal_python", t_areal)
            log.timing(case, "seqpack_build_and_plan", t_ours)
    note = ("bound: ceil(physical / cap) micro-batches and the batch's physical tokens (its rows as one prefix tree); "
            "'<= tries': seqpack needs no more micro-batches and no more physical tokens than AReaL's tries. "
            "AReaL ms: its Python rule on the token rows; seqpack ms: PrefixForest.from_rows + plan_micro_batches "
            "from the same rows (best of 5).")
    return format_table("Micro-batches and physical tokens (plan_micro_batches, forest=)",
                        ["batch", "cap / mean tree", "cap", "bound: mbs", "bound: tokens", "seqpack: mbs",
                         "seqpack: tokens", "kept", "whole trees: mbs", "whole trees: tokens", "AReaL tries: mbs",
                         "AReaL tries: tokens", "<= tries", "AReaL ms", "seqpack ms", "speed-up"], out,
                        note=note), worst


def step_table(quick, log):
    out = []
    dp = 4
    for name, rows, groups in batches(quick):
        forest = PrefixForest.from_rows(rows)
        grouped = PrefixForest.from_rows(rows, group_ids=groups)
        cap = cap_of(forest, grouped, 2)
        plan = seqpack.plan_step(forest.lengths, dp, cap, cost=COST, forest=forest)
        plain = seqpack.plan_step(forest.lengths, dp, cap, cost=COST)
        tries = first_fit_trie(forest, cap)
        tokens, pairs = forest.subset_costs(tries)
        raw = _core.plan_step(tokens, dp, cap, COST.per_micro_batch, COST.per_token, COST.per_token_squared,
                              squares=2 * pairs - tokens)["mini_batches"][0]
        times = []
        for cells, k in (([[r for i in c for r in tries[i]] for c in raw["cells"]], raw["num_micro_batches"]),
                         ([c for rank in plain.assignment[0] for c in rank], plain.num_micro_batches[0])):
            t, p = forest.subset_costs(cells)
            costs = COST.per_micro_batch + COST.per_token * t + COST.per_token_squared * (2 * p - t)
            grid = np.asarray(costs, dtype=np.float64).reshape(dp, k)
            times.append(float(grid.max(axis=0).sum()))
        out.append([name, cap, plan.num_micro_batches[0], plan.predicted_time, plan.planned_on, times[0], times[1],
                    times[0] / plan.predicted_time, plan.lower_bound])
        log.add(name, "seqpack", "predicted_step", plan.predicted_time)
        log.add(name, "first_fit_trie", "predicted_step", times[0])
        log.add(name, "rows", "predicted_step", times[1])
    return format_table("Predicted step (plan_step, forest=; DP 4, cap 2x the mean tree)",
                        ["batch", "cap", "seqpack: micro-batches / rank", "seqpack: step", "planned on",
                         "AReaL tries: step", "rows: step", "tries / seqpack", "lower bound"], out,
                        note="Every plan's micro-batches costed from their own physical tokens and attention pairs "
                             "(FSDP sync: the sum over micro-batches of the slowest rank).")


def short_grpo(n_rows):
    rng = np.random.default_rng(n_rows)
    rows, groups = [], []
    for p in range(n_rows // 8):
        prompt = rng.integers(0, 50_000, int(rng.integers(8, 64)))
        for _ in range(8):
            rows.append(np.concatenate([prompt, rng.integers(0, 50_000, int(rng.integers(4, 32)))]))
            groups.append(p)
    return rows, groups


def timing_table(quick, log):
    out = []
    for n_rows in (512, 4096) if quick else (4096, 32_768, 262_144, 1_048_576):
        rows, groups = short_grpo(n_rows)
        repeat = 1 if n_rows > 100_000 else 3
        start = time.perf_counter()
        forest = PrefixForest.from_rows(rows, group_ids=groups)
        build = time.perf_counter() - start
        cap = int(16 * forest.num_physical_tokens / forest.num_trees)
        dp = 64 if n_rows >= 4096 else 8
        t_mb = measure(lambda: seqpack.plan_micro_batches(forest.lengths, cap, forest=forest), repeat=repeat,
                       warmup=1)
        t_tree = measure(lambda: seqpack.plan_step(forest.lengths, dp, cap, cost=COST, forest=forest),
                         repeat=repeat, warmup=1)
        t_rows = measure(lambda: seqpack.plan_step(forest.lengths, dp, cap, cost=COST), repeat=repeat, warmup=1)
        t_items = measure(lambda: forest.items(cap, min_items=n_rows // 2), repeat=repeat, warmup=1)
        plan = seqpack.plan_step(forest.lengths, dp, cap, cost=COST, forest=forest)
        out.append([n_rows, forest.num_trees, forest.num_logical_tokens, build, t_mb["min"] * 1e3,
                    t_tree["min"] * 1e3, t_rows["min"] * 1e3, t_items["min"] * 1e3, plan.planned_on,
                    plan.sharing_kept])
        log.add(f"{n_rows} rows", "PrefixForest.from_rows", "seconds", build)
        log.timing(f"{n_rows} rows", "plan_micro_batches forest", t_mb)
        log.timing(f"{n_rows} rows", "plan_step forest", t_tree)
        log.timing(f"{n_rows} rows", "plan_step rows", t_rows)
        log.timing(f"{n_rows} rows", "items min_items", t_items)
    return format_table("Planning time (best of runs)",
                        ["rows", "trees", "logical tokens", "forest build s", "plan_micro_batches ms",
                         "plan_step trees ms", "plan_step rows ms", "items(min_items=rows/2) ms", "planned on",
                         "sharing kept"], out,
                        note="cap = 16x the mean tree; plan_step: DP 64; plan_step trees plans every candidate "
                             "(whole trees, split packing, first-fit tries, rows) and costs each exactly.")


def main() -> int:
    args, log = start(__doc__, "forest_planning", TITLE)
    table, worst = packing_table(args.quick, log)
    print(table)
    print(f"\nslowest speed-up over AReaL's Python: {worst:.1f}x")
    print()
    print(step_table(args.quick, log))
    print()
    print(timing_table(args.quick, log))
    print(f"\nCSV: {log.write()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
