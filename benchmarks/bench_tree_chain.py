"""Trees as the layout (issue 38): chains, nothing shared, and host work off the step.

Three tables, CPU, one process per measurement where memory is read:

  chains        multi-turn rollouts logged one row per turn: a chain of rows, each a
                prefix of the next. seqpack.attention (sdpa and varlen backends) forward +
                backward on the chain's tree against the longest row alone through
                varlen_attention: peak RSS rise (each in a fresh child process) and time.
                Attention segments break at branch points only, so the chain is one
                segment (issue 38 measured +583 / +700 MB at 2,500 tokens before).
  nothing shared  a tree whose rows share nothing against plain packing, forward +
                backward of an attention-dominated model (2 layers, hidden 128, 4 heads):
                the tree runs plain packing's kernels.
  tree attention  seqpack.attention on a tree alone (CPU: the cascade path, each shared prefix read
                once) against varlen_attention on the rows, on GRPO batches, forward and
                forward + backward, next to the visible-pairs ratio (the work bound's
                speed-up) and the segment-gather path it replaced (cascade off).
  host work     milliseconds per micro-batch the training loop spends on host work for a
                GRPO tree: building the tree and its plans inside the step (before)
                against receiving them built by the collate function (after,
                seqpack.prepare_tree in the DataLoader worker).

    python benchmarks/bench_tree_chain.py            # full run
    python benchmarks/bench_tree_chain.py --quick    # small shapes, smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import CsvLog, announce, environment, format_table, measure, peak_extra_mib, run_child  # noqa: E402
from _harness import alternating, torch_cpu_arguments  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

import seqpack  # noqa: E402
from bench_prefix_tree import MEMORY_ENV, Model, grpo_batch, plain_step  # noqa: E402

HEADS, HEAD_DIM = 4, 32


def chain_rows(tokens: int, turns: int) -> list:
    ids = np.random.default_rng(0).integers(0, 4096, tokens)
    cuts = np.linspace(tokens / turns, tokens, turns).astype(np.int64)
    return [ids[:c] for c in cuts]


def chain_step(kind: str, tokens: int, turns: int, backend: str):
    """fwd + bwd of attention alone on a chain's tree (``kind="chain"``) or on its
    longest row through varlen_attention (``"row"``)."""
    rows = chain_rows(tokens, turns)
    tree = seqpack.pack_prefix_tree(rows) if kind == "chain" else None
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(tokens, HEADS, HEAD_DIM, generator=g).requires_grad_() for _ in range(3))
    cu = [0, tokens]

    def step():
        if tree is not None:
            out = seqpack.attention(q, k, v, tree, backend=backend)
        else:
            out = seqpack.varlen_attention(q, k, v, cu, cu, tokens, tokens, causal=True)
        out.sum().backward()
        for x in (q, k, v):
            x.grad = None

    return step


def child(spec: str) -> int:
    kind, tokens, turns, backend = spec.split(",")
    torch.set_num_threads(1)
    step = chain_step(kind, int(tokens), int(turns), backend)
    step()
    print(json.dumps({"peak_mib": peak_extra_mib(step)}))
    return 0


def tree_step(model, tree):
    ids, positions = torch.tensor(tree.input_ids), torch.tensor(tree.position_ids)
    logits = model(ids, positions, lambda q, k, v: seqpack.attention(q, k, v, tree))
    (-seqpack.token_logprobs(logits, tree).logprobs.sum()).backward()
    model.zero_grad(set_to_none=True)


def main() -> int:
    parser = torch_cpu_arguments(__doc__)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child)
    torch.set_num_threads(args.threads)
    env = environment()
    announce(env, torch)
    log = CsvLog("tree_chain", env, args.csv)
    repeat = 1 if args.quick else args.repeat

    # ---- chains -----------------------------------------------------------------------
    rows_out = []
    for tokens in ((1000,) if args.quick else (2500, 4000, 10000)):
        turns = 8 if args.quick else 25
        alone_mem = run_child(__file__, f"row,{tokens},{turns},sdpa", MEMORY_ENV)["peak_mib"]
        alone_t = measure(chain_step("row", tokens, turns, "sdpa"), repeat=repeat, warmup=1)["min"]
        for backend in ("sdpa", "varlen"):
            mem = run_child(__file__, f"chain,{tokens},{turns},{backend}", MEMORY_ENV)["peak_mib"]
            t = measure(chain_step("chain", tokens, turns, backend), repeat=repeat, warmup=1)["min"]
            rows_out.append([tokens, turns, backend, mem, alone_mem, mem / max(alone_mem, 1e-9), t * 1e3,
                             alone_t * 1e3, t / alone_t])
            log.add(f"chain {tokens}", backend, "peak_rss_rise_mib", mem)
            log.add(f"chain {tokens}", backend, "seconds_min", t)
        log.add(f"chain {tokens}", "longest row alone", "peak_rss_rise_mib", alone_mem)
        log.add(f"chain {tokens}", "longest row alone", "seconds_min", alone_t)
    print(format_table("Chains of rows (each a prefix of the next) vs the longest row alone: attention fwd+bwd",
                       ["tokens", "rows", "backend", "chain MiB", "row MiB", "memory ratio", "chain ms", "row ms",
                        "time ratio"], rows_out,
                       note=f"CPU fp32, {HEADS} heads x {HEAD_DIM}, 1 thread for memory (fresh child, "
                            "MALLOC_MMAP_THRESHOLD_=128 KiB), best of %d for time. Target: within 10%%." % repeat))

    # ---- nothing shared -----------------------------------------------------------------
    rng = np.random.default_rng(3)
    lens = rng.integers(64 if args.quick else 256, 128 if args.quick else 1024, 4 if args.quick else 12)
    rows = [rng.integers(0, 4096, n) for n in lens]
    model = Model(hidden=128, heads=HEADS, head_dim=HEAD_DIM, ffn=344)
    tree = seqpack.prepare_tree(seqpack.pack_prefix_tree(rows))
    assert seqpack.tensors.tree_plans.attention_plan(tree).plain
    t_plain, t_tree = alternating([lambda: (plain_step(model, rows), model.zero_grad(set_to_none=True)),
                                   lambda: tree_step(model, tree)], repeat * 3)
    log.add("nothing shared", "plain", "seconds_min", t_plain)
    log.add("nothing shared", "tree", "seconds_min", t_tree)
    print()
    print(format_table("Nothing shared: tree vs plain packing, fwd+bwd (2 layers, hidden 128, 4 heads)",
                       ["rows", "tokens", "plain ms", "tree ms", "tree speed vs plain"],
                       [[len(rows), int(lens.sum()), t_plain * 1e3, t_tree * 1e3, t_plain / t_tree]],
                       note="Target >= 0.97x. Both step times exclude building the batch; the two sides "
                            "alternate, best of %d each. Both read their log-probs with token_logprobs (the tree's "
                            "layout, the rows' offsets); attention is the same call." % (repeat * 3)))

    # ---- tree attention alone ---------------------------------------------------------------
    from seqpack.tensors.tree_plans import attention_plan
    from seqpack.training import attention_tree

    att_rows = []
    # The last four share almost nothing (a prompt of 4-64 tokens): the plan expands them to their rows.
    shapes = [(8, 64, 32), (4, 2, 64)] if args.quick else [(4, 512, 256), (8, 512, 256), (16, 512, 256),
                                                           (8, 256, 512), (8, 8, 512), (8, 32, 512), (4, 4, 1024),
                                                           (4, 64, 256)]
    for g, p, r in shapes:
        rows_g, groups_g = grpo_batch(rng, 1, g, p, r)
        tree_g = seqpack.pack_prefix_tree(rows_g, group_ids=groups_g)
        pairs = tree_g.metrics().attention_ratio
        lens_g = [len(x) for x in rows_g]
        cu_g = np.concatenate([[0], np.cumsum(lens_g)])
        gen = torch.Generator().manual_seed(1)
        qt, kt, vt = (torch.randn(tree_g.num_tokens, HEADS, HEAD_DIM, generator=gen).requires_grad_() for _ in range(3))
        qp, kp, vp = (torch.randn(int(cu_g[-1]), HEADS, HEAD_DIM, generator=gen).requires_grad_() for _ in range(3))
        longest = max(lens_g)

        def plain_fn(backward):
            def run():
                out = seqpack.varlen_attention(qp, kp, vp, cu_g, cu_g, longest, longest, causal=True)
                if backward:
                    out.sum().backward()
            return run

        def tree_fn(backward, cascade=True):
            def run():
                saved = attention_tree.cascade_available
                if not cascade:
                    attention_tree.cascade_available = lambda *a: False
                try:
                    out = seqpack.attention(qt, kt, vt, tree_g, backend="sdpa")
                    if backward:
                        out.sum().backward()
                finally:
                    attention_tree.cascade_available = saved
            return run

        for backward in (False, True):
            t_plain, t_tree, t_old = alternating([plain_fn(backward), tree_fn(backward), tree_fn(backward, False)],
                                                 repeat * 3)
            kind = "fwd+bwd" if backward else "fwd"
            name = f"GRPO G={g} {p}/{r}" + (" (expanded)" if attention_plan(tree_g).expand else "")
            att_rows.append([name, kind, pairs, t_plain * 1e3, t_tree * 1e3, t_plain / t_tree,
                             (t_plain / t_tree) / pairs, t_plain / t_old])
            for side, value in (("plain", t_plain), ("tree cascade", t_tree), ("tree segment gathers", t_old)):
                log.add(f"{name} {kind}", side, "seconds_min", value)
    print()
    print(format_table("Tree attention alone vs varlen_attention on the rows (CPU)",
                       ["batch", "pass", "pairs ratio", "plain ms", "tree ms", "speed-up", "of pairs ratio",
                        "speed-up before"], att_rows,
                       note=f"{HEADS} heads x {HEAD_DIM}, fp32, 1 thread; the three sides alternate, best of "
                            f"{repeat * 3} each. Target (issue 38): speed-up >= 0.8 of the pairs ratio. "
                            "'speed-up before': the same backend with the cascade off (keys gathered per segment, "
                            "masked SDPA), against plain."))

    # ---- host work per micro-batch ----------------------------------------------------------
    rows, groups = grpo_batch(rng, 1, 8, 64 if args.quick else 512, 32 if args.quick else 256)
    model = Model(hidden=128, heads=HEADS, head_dim=HEAD_DIM, ffn=344)
    built = seqpack.prepare_tree(seqpack.pack_prefix_tree(rows, group_ids=groups))

    def before():  # the trie, the attention plan and the targets inside the step
        tree_step(model, seqpack.pack_prefix_tree(rows, group_ids=groups))

    def after():  # received prepared from the collate function
        tree_step(model, built)

    host = measure(lambda: seqpack.prepare_tree(seqpack.pack_prefix_tree(rows, group_ids=groups)), repeat=20,
                   warmup=2)["min"]
    in_loop = measure(lambda: [seqpack.tensors.tree_plans.attention_plan(built),
                               seqpack.tensors.tree_plans.tree_targets(built)], repeat=20, warmup=2)["min"]
    t_before, t_after = alternating([before, after], repeat * 3)
    for side, value in (("host in step, before", host), ("host in step, after", in_loop),
                        ("step before", t_before), ("step after", t_after)):
        log.add("GRPO G=8 host work", side, "seconds_min", value)
    print()
    print(format_table("Host work per micro-batch in the training loop (GRPO G=8)",
                       ["", "host ms in the loop", "step ms"],
                       [["before: tree + plans built in the step", host * 1e3, t_before * 1e3],
                        ["after: prepare_tree in the collate function", in_loop * 1e3, t_after * 1e3]],
                       note="host ms: building the trie, the attention plan and the targets (before) against "
                            "reading the plans the tree carries (after); best of 20. Step ms: the two sides "
                            "alternate, best of %d each." % (repeat * 3)))
    print(f"\nCSV: {log.write()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
