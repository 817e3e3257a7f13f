"""Prefix-tree packing benchmark (issue 28): plain packing vs the prefix tree, one
process, the same small model and weights, forward + backward of one batch.

  plain   the rows concatenated (THD), position ids restart per row,
          seqpack.varlen_attention (causal per row) and seqpack.token_logprobs;
  tree    seqpack.pack_prefix_tree (one group per prompt / episode): the shared
          prefixes laid out once, position ids = depth, seqpack.attention on the
          tree (backend "sdpa") and seqpack.token_logprobs (logical layout).
Both steps compute loss = -sum of every logical token's next-token log-prob; the
two losses (and every weight's gradient) are checked to agree before any time is
reported. The tree is built where a batch is built (a collate function:
pack_prefix_tree + prepare_tree, its host plans included); that host time is
reported on its own ("prepare ms"), outside the step (issue 38). "work bound" is the
speed-up the tree would get if time were work (the model's multiply-adds per token
plus per visible attention pair); "of bound" is the measured speed-up over it.

Batches: GRPO (G responses per prompt, prompt:response 2:1 and 1:2), an agentic
batch (episodes of 3-5 turns; each turn samples two replies, one continues, the
other ends a row) and an SFT batch with nothing shared. Also: building a tree (and
the planners' PrefixForest) from 1M logical tokens.

Times: this process, glibc's default allocator (what a trainer runs with). Peak
memory: the CPU peak RSS rise (VmHWM) of one step after a warm-up step, each side in
a fresh child process with glibc's mmap threshold fixed at 128 KiB
(MALLOC_MMAP_THRESHOLD_) so that freed memory goes back to the system and the
step's rise is its own. (An earlier version timed inside such a process too: every
large tensor then costs fresh page faults, which slowed the tree step by ~45% and
the plain step by ~20%, a penalty real training does not pay.)

    python benchmarks/bench_prefix_tree.py            # full run (CPU, 1 thread)
    python benchmarks/bench_prefix_tree.py --quick    # small shapes, smoke test
    python benchmarks/bench_prefix_tree.py --model attention   # hidden 128, vocab 512: mostly attention
"""

from __future__ import annotations

import os
import sys

import argparse
import json
import math

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import (CsvLog, alternating, announce, environment, format_table, measure, peak_extra_mib,  # noqa: E402
                      run_child, torch_cpu_arguments)

import numpy as np  # noqa: E402
import torch  # noqa: E402

import seqpack  # noqa: E402

MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 << 10)}  # the children that measure peak memory

TITLE = "Prefix-tree packing vs plain packing: fwd+bwd of a 2-layer model"
VOCAB = 4096
# --model: the default model, and one whose time is mostly attention (a small
# hidden size and vocabulary: the issue-38 "attention-dominated" model).
MODELS = {"default": dict(vocab=4096, hidden=256, heads=8, head_dim=32, ffn=688, layers=2),
          "attention": dict(vocab=512, hidden=128, heads=4, head_dim=32, ffn=344, layers=2)}
# Row lengths of each model's batches, times those of the default (the attention
# model's rows are twice as long, so that attention is most of its plain step).
ROW_SCALE = {"default": 1, "attention": 2}


def work_per_token_and_pair(cfg):
    """Multiply-adds of the model per token (projections, MLP, LM head) and per
    visible attention pair (q.k and p.v over every head and layer): the forward's;
    the backward scales both alike."""
    h, hd, f, layers = cfg["hidden"], cfg["heads"] * cfg["head_dim"], cfg["ffn"], cfg["layers"]
    per_token = layers * (h * 3 * hd + hd * h + h * 2 * f + f * h) + h * cfg["vocab"]
    return per_token, layers * 2 * hd


def work_bound(cfg, m):
    """The tree's speed-up if time were its work: (tokens x per-token work + pairs x
    per-pair work), rows over tree."""
    token, pair = work_per_token_and_pair(cfg)
    return (token * m.logical_tokens + pair * m.plain_attention_pairs) / (
        token * m.physical_tokens + pair * m.tree_attention_pairs)


# ---- the model ----------------------------------------------------------------------
class Model(torch.nn.Module):
    """Embedding, ``layers`` x (RMSNorm, q/k/v/o with RoPE from the given position
    ids, attention, RMSNorm, SwiGLU MLP), RMSNorm, LM head. The attention is a
    callable ``attend(q, k, v)`` on ``[T, H, D]``: the only difference of the paths."""

    def __init__(self, vocab=VOCAB, hidden=256, heads=8, head_dim=32, ffn=688, layers=2, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)

        def w(*shape):
            return torch.nn.Parameter(torch.randn(*shape, generator=g) / math.sqrt(shape[0]))

        self.heads, self.head_dim = heads, head_dim
        self.embed = torch.nn.Parameter(torch.randn(vocab, hidden, generator=g) * 0.5)
        self.blocks = torch.nn.ModuleList()
        for _ in range(layers):
            block = torch.nn.Module()
            block.norm1 = torch.nn.Parameter(torch.ones(hidden))
            block.wqkv = w(hidden, 3 * heads * head_dim)
            block.wo = w(heads * head_dim, hidden)
            block.norm2 = torch.nn.Parameter(torch.ones(hidden))
            block.w_gate_up = w(hidden, 2 * ffn)
            block.w_down = w(ffn, hidden)
            self.blocks.append(block)
        self.norm = torch.nn.Parameter(torch.ones(hidden))
        self.head = w(hidden, vocab)
        self.inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))

    @staticmethod
    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight

    def rope(self, x, cos, sin):
        a, b = x[..., : self.head_dim // 2], x[..., self.head_dim // 2:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    def forward(self, ids, positions, attend):
        x = self.embed[ids]
        # RoPE angles in fp32 whatever the weights' dtype (bf16 loses positions past 256)
        angles = positions.to(torch.float32)[:, None] * self.inv_freq.to(positions.device)[None, :]  # [T, D/2]
        cos, sin = angles.cos()[:, None, :].to(x.dtype), angles.sin()[:, None, :].to(x.dtype)
        t = ids.shape[0]
        for blk in self.blocks:
            q, k, v = (self.rms(x, blk.norm1) @ blk.wqkv).view(t, 3, self.heads, self.head_dim).unbind(1)
            x = x + attend(self.rope(q, cos, sin), self.rope(k, cos, sin), v).reshape(t, -1) @ blk.wo
            gate, up = (self.rms(x, blk.norm2) @ blk.w_gate_up).chunk(2, dim=-1)
            x = x + (torch.nn.functional.silu(gate) * up) @ blk.w_down
        return self.rms(x, self.norm) @ self.head


# ---- the two steps --------------------------------------------------------------------
def plain_step(model, rows, device="cpu", attention=True):
    """Forward + backward of the rows packed back to back; returns the loss.
    ``attention=False`` puts ``v`` in attention's place (the step's time without it)."""
    lens = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    cu = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    ids = torch.from_numpy(np.concatenate(rows)).to(device)
    positions = torch.from_numpy(np.arange(cu[-1], dtype=np.int64) - np.repeat(cu[:-1], lens)).to(device)
    longest = int(lens.max())

    def attend(q, k, v):
        if not attention:
            return v.repeat_interleave(q.shape[1] // k.shape[1], 1) * 1.0
        return seqpack.varlen_attention(q, k, v, cu, cu, longest, longest, causal=True)

    logits = model(ids, positions, attend)
    loss = -seqpack.token_logprobs(logits, cu, ids).logprobs.sum()
    loss.backward()
    return loss.detach()


def prepared_tree(rows, groups):
    """What a collate function hands the step: the rows' tree with its host plans."""
    return seqpack.prepare_tree(seqpack.pack_prefix_tree(rows, group_ids=groups))


def tree_step(model, tree, device="cpu", backend="sdpa"):
    """Forward + backward of a prefix tree built where the batch is built; returns the loss."""
    # its arrays are read-only: copies
    ids, positions = torch.tensor(tree.input_ids, device=device), torch.tensor(tree.position_ids, device=device)

    def attend(q, k, v):
        return seqpack.attention(q, k, v, tree, backend=backend)

    logits = model(ids, positions, attend)
    loss = -seqpack.token_logprobs(logits, tree).logprobs.sum()
    loss.backward()
    return loss.detach()


def run_and_grads(model, fn):
    model.zero_grad(set_to_none=True)
    loss = fn()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss, grads


# ---- batches ----------------------------------------------------------------------------
def grpo_batch(rng, prompts, group, prompt_len, response_len, vocab=VOCAB):
    rows, groups = [], []
    for p in range(prompts):
        prompt = rng.integers(0, vocab, prompt_len)
        for _ in range(group):
            rows.append(np.concatenate([prompt, rng.integers(0, vocab, response_len)]))
            groups.append(p)
    return rows, groups


def agentic_batch(rng, turns_per_episode, prompt_len, reply_len, obs_len, vocab=VOCAB):
    """Each episode: a prompt, then at every turn two sampled replies; one ends a row,
    the other gets an observation and goes on (the last turn ends both)."""
    rows, groups = [], []
    for e, turns in enumerate(turns_per_episode):
        history = rng.integers(0, vocab, prompt_len)
        for turn in range(turns):
            replies = [rng.integers(0, vocab, reply_len) for _ in range(2)]
            rows.append(np.concatenate([history, replies[0]]))
            groups.append(e)
            if turn == turns - 1:
                rows.append(np.concatenate([history, replies[1]]))
                groups.append(e)
            else:
                history = np.concatenate([history, replies[1], rng.integers(0, vocab, obs_len)])
    return rows, groups


def sft_batch(rng, count, lo, hi, vocab=VOCAB):
    rows = [rng.integers(0, vocab, int(rng.integers(lo, hi + 1))) for _ in range(count)]
    return rows, list(range(count))  # one group per row: nothing is shared


def cases(quick, vocab=VOCAB, scale=1):
    rng = np.random.default_rng(0)
    out = []
    if quick:
        out.append(("GRPO G=8 2:1 (48/24)", *grpo_batch(rng, 1, 8, 48, 24, vocab)))
        out.append(("agentic 3 turns", *agentic_batch(rng, (3,), 32, 16, 8, vocab)))
        out.append(("SFT, nothing shared", *sft_batch(rng, 3, 32, 96, vocab)))
        return out
    x = scale
    for g in (4, 8, 16):
        prompts = max(1, 8 // g)  # 6,144 logical tokens (12,288 at G = 16), times the scale
        for name, (p, r) in (("2:1", (512 * x, 256 * x)), ("1:2", (256 * x, 512 * x))):
            out.append((f"GRPO G={g} {name} ({p}/{r}) x{prompts}", *grpo_batch(rng, prompts, g, p, r, vocab)))
    out.append((f"agentic 3/4/5 turns ({256 * x} + {64 * x}/turn)",
                *agentic_batch(rng, (3, 4, 5), 256 * x, 64 * x, 64 * x, vocab)))
    out.append((f"SFT, nothing shared ({256 * x}-{1024 * x})", *sft_batch(rng, 10, 256 * x, 1024 * x, vocab)))
    return out


def build_rows(quick):
    """GRPO rows of ~1M logical tokens (prompt 512, G = 8, response 256)."""
    rng = np.random.default_rng(1)
    target = 1 << 16 if quick else 1 << 20
    prompts = -(-target // (8 * 768))
    return grpo_batch(rng, prompts, 8, 512, 256)


def max_rel_diff(a, b):
    return max(float((x - y).abs().max()) / max(float(y.abs().max()), 1e-30) for x, y in zip(a, b))


def step_fn(model, side, rows, tree):
    """One step of ``side`` ("plain" / "tree") that leaves no gradient behind."""
    def step():
        if side == "tree":
            tree_step(model, tree)
        else:
            plain_step(model, rows, attention=side == "plain")
        model.zero_grad(set_to_none=True)
    return step


def child(spec: str) -> int:
    """``--child quick,threads,case,side``: the peak RSS rise of one step (after one
    warm-up step) in this fresh process; prints it as JSON."""
    quick, threads, index, side, model_name = spec.split(",")
    torch.set_num_threads(int(threads))
    torch.manual_seed(0)
    cfg = MODELS[model_name]
    _, rows, groups = cases(quick == "1", cfg["vocab"], ROW_SCALE[model_name])[int(index)]
    step = step_fn(Model(**cfg), side, rows, prepared_tree(rows, groups))
    step()
    print(json.dumps({"peak_mib": peak_extra_mib(step)}))
    return 0


def main() -> int:
    parser = torch_cpu_arguments(__doc__)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=sorted(MODELS), default="default",
                        help="default: hidden 256, vocab 4096; attention: hidden 128, vocab 512 (mostly attention)")
    args = parser.parse_args()
    if args.child:
        return child(args.child)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    env = environment()
    env["memory_children_env"] = " ".join(f"{k}={v}" for k, v in MEMORY_ENV.items())
    announce(env, torch)
    log = CsvLog("prefix_tree" if args.model == "default" else f"prefix_tree_{args.model}", env, args.csv)
    cfg = MODELS[args.model]
    model = Model(**cfg)
    repeat = 1 if args.quick else args.repeat
    rows_out, checks, targets = [], [], {}
    for index, (name, rows, groups) in enumerate(cases(args.quick, cfg["vocab"], ROW_SCALE[args.model])):
        t_prepare = measure(lambda: prepared_tree(rows, groups), repeat=3, warmup=1)["min"]
        tree = prepared_tree(rows, groups)  # in the collate function: not part of the step
        m = tree.metrics()
        # The same loss and gradients first: never a speed-up for a wrong result.
        loss_p, grads_p = run_and_grads(model, lambda: plain_step(model, rows))
        loss_t, grads_t = run_and_grads(model, lambda: tree_step(model, tree))
        loss_rel = abs(float(loss_t) - float(loss_p)) / abs(float(loss_p))
        grad_rel = max_rel_diff(grads_t, grads_p)
        if loss_rel > 1e-4 or grad_rel > 1e-3:
            raise AssertionError(f"{name}: the tree path disagrees with plain packing: loss {float(loss_t)} vs "
                                 f"{float(loss_p)} (rel {loss_rel:.2e}), gradients rel {grad_rel:.2e}")
        checks.append(f"{name}: loss {float(loss_p):.2f} (plain) vs {float(loss_t):.2f} (tree), "
                      f"rel diff {loss_rel:.1e}; gradients max rel diff {grad_rel:.1e}")

        mem_p, mem_t = (run_child(__file__, f"{int(args.quick)},{args.threads},{index},{side},{args.model}",
                                  MEMORY_ENV)["peak_mib"] for side in ("plain", "tree"))
        # The sides alternate (best of `repeat` each), so a noisy neighbour slows both alike.
        t_p, t_t, t_bare = alternating([step_fn(model, "plain", rows, tree), step_fn(model, "tree", rows, tree),
                                        step_fn(model, "plain without attention", rows, tree)], repeat)
        speedup = t_p / t_t
        ratio = m.logical_tokens / m.physical_tokens
        bound = work_bound(cfg, m)
        rows_out.append([name, m.num_rows, m.logical_tokens, m.physical_tokens, ratio, 1 - t_bare / t_p, t_p * 1e3,
                         t_t * 1e3, speedup, bound, speedup / bound, t_prepare * 1e3, mem_p, mem_t])
        log.add(name, "plain", "seconds_min", t_p)
        log.add(name, "tree", "seconds_min", t_t)
        log.add(name, "tree", "prepare_seconds_min", t_prepare)
        log.add(name, "-", "work_bound", bound)
        log.add(name, "plain", "attention_share", 1 - t_bare / t_p)
        log.add(name, "plain", "peak_rss_rise_mib", mem_p)
        log.add(name, "tree", "peak_rss_rise_mib", mem_t)
        log.add(name, "-", "logical_tokens", m.logical_tokens)
        log.add(name, "-", "physical_tokens", m.physical_tokens)
        log.add(name, "-", "loss_rel_diff", loss_rel)
        log.add(name, "-", "grad_max_rel_diff", grad_rel)
        targets[name] = (speedup, ratio, mem_p, mem_t, bound)
        print(f"  {name}: done", flush=True)

    print(format_table(
        TITLE, ["case", "rows", "logical tok", "physical tok", "token ratio", "attn share", "plain ms", "tree ms",
                "speed-up",
                "work bound", "of bound", "prepare ms", "plain peak MiB", "tree peak MiB"], rows_out,
        note="CPU fp32, torch threads = %d, timings taken on a shared 2-core VM (the sides alternate, best of %d "
             "each after a warm-up). Model %r: %d layers, hidden %d, %d heads x %d, SwiGLU %d, vocab %d; loss = -sum "
             "of the logical tokens' log-probs, fwd+bwd. plain: rows concatenated, varlen_attention, "
             "token_logprobs. tree: attention on the tree (sdpa) + token_logprobs on a tree built where the "
             "batch is built (pack_prefix_tree + prepare_tree: 'prepare ms', host, not in the step). work bound = "
             "(per-token work x tokens + per-pair work x visible pairs), rows / tree, with the model's multiply-adds; "
             "of bound = speed-up / work bound. attn share: 1 - (the plain step with v in attention's place) / "
             "(the plain step). token ratio = logical / physical. Times: glibc's default allocator. "
             "peak MiB: CPU peak RSS rise (VmHWM) of one warm step in a fresh child process with "
             "MALLOC_MMAP_THRESHOLD_=128 KiB, for both sides." % (
                 args.threads, repeat, args.model, cfg["layers"], cfg["hidden"], cfg["heads"], cfg["head_dim"],
                 cfg["ffn"], cfg["vocab"])))
    print("\nSame result (checked before timing):")
    for line in checks:
        print("  " + line)

    # Building a tree from ~1M logical tokens (C++ trie; best of 3).
    rows, groups = build_rows(args.quick)
    n = sum(len(r) for r in rows)
    t_rows = measure(lambda: seqpack.pack_prefix_tree(rows, group_ids=groups), repeat=3, warmup=1)["min"]
    flat = np.concatenate(rows)
    cu = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([len(r) for r in rows], out=cu[1:])
    t_packed = measure(lambda: seqpack.PrefixTreeBatch.from_packed(flat, cu, group_ids=groups), repeat=3,
                       warmup=1)["min"]
    t_forest = measure(lambda: seqpack.PrefixForest.from_rows(rows, group_ids=groups), repeat=3, warmup=1)["min"]
    log.add(f"build {n}", "pack_prefix_tree(rows)", "seconds_min", t_rows)
    log.add(f"build {n}", "PrefixTreeBatch.from_packed", "seconds_min", t_packed)
    log.add(f"build {n}", "PrefixForest.from_rows", "seconds_min", t_forest)

    sft = [r for r in rows_out if r[0].startswith("SFT")][0]
    overhead = sft[7] / sft[6] - 1
    g8 = [(k, v) for k, v in targets.items() if k.startswith("GRPO G=8 2:1")]
    lines = []
    for k, (sp, ratio, _, _, _) in g8:
        lines.append(["GRPO G=8, prompt = 2x response: speed-up", ">= 2.2x", f"{sp:.2f}x (tokens {ratio:.2f}x fewer)",
                      "yes" if sp >= 2.2 else "no"])
    lines.append(["nothing shared (SFT): tree / plain time", "<= 1.03 (>= 0.97x)", f"{1 + overhead:.3f}",
                  "yes" if overhead <= 0.03 else "no"])
    lines.append([f"build a tree, {n:,} logical tokens (rows)", "<= 0.2 s", f"{t_rows:.3f} s",
                  "yes" if t_rows <= 0.2 else "no"])
    lines.append([f"build a tree, {n:,} logical tokens (from_packed)", "<= 0.2 s", f"{t_packed:.3f} s",
                  "yes" if t_packed <= 0.2 else "no"])
    lines.append([f"PrefixForest.from_rows, {n:,} logical tokens (issue 29)", "<= 0.2 s", f"{t_forest:.3f} s",
                  "yes" if t_forest <= 0.2 else "no"])
    worse = [k for k, (_, _, mp, mt, _) in targets.items() if mt >= mp]
    shared = {k: sp / b for k, (sp, _, _, _, b) in targets.items() if not k.startswith("SFT")}
    lowest = min(shared, key=shared.get)
    lines.append(["speed-up / work bound, trees that share (issue 38)", ">= 0.9", f"{shared[lowest]:.2f} (lowest: "
                  f"{lowest})", "yes" if shared[lowest] >= 0.9 else "no"])
    lines.append(["tree peak memory below plain", "every case", f"{len(targets) - len(worse)}/{len(targets)} cases",
                  "yes" if not worse else "no: " + ", ".join(worse)])
    print()
    print(format_table("Prefix-tree targets (issue 28), CPU", ["target", "wanted", "measured", "met"], lines,
                       note="GPU kernels unmeasured here. Build: GRPO rows (prompt 512, G = 8, response 256), one "
                            "group per prompt; best of 3."))
    print(f"\nCSV: {log.write()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
