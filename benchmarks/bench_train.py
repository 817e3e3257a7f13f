"""Training-step benchmark (SPEC P5): padded vs dynamic batching vs packing, one
process, the same model, the same long-tailed RL batch, forward + backward of
every micro-batch of one optimizer step.

  padded     micro-batches of --mbs rows in data order, each padded to its longest
             row (HF-style per-batch padding), causal SDPA;
  dynamic    seqpack.plan_dynamic_batching (rows sorted by length, rows x padded
             length <= --max-tokens, lengths rounded to 64), causal SDPA;
  packed     seqpack.plan_micro_batches (token sum <= --max-tokens, balanced), each
             micro-batch packed to THD (seqpack.pack_sequences), varlen attention and
             the fused log-prob loss.
All three compute the same loss (checked). Tokens/s counts real tokens; "computed /
real" is the rows x width the model processes per real token. Peak memory: CPU peak
RSS rise of the step (VmHWM), GPU torch.cuda.max_memory_allocated.

    python benchmarks/bench_train.py            # CPU, tiny model
    python benchmarks/bench_train.py --quick    # smoke test
    python benchmarks/bench_train.py --device cuda --model 1b   # on a GPU
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import CsvLog, announce, environment, format_table, reset_peak_rss, rss_kib  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

import seqpack  # noqa: E402
from seqpack.tools.report import synthetic_rl_lengths  # noqa: E402
from seqpack.testing.tiny_model import TinyCausalLM, TinyConfig, packed_loss, padded_loss  # noqa: E402

MODELS = {
    "tiny": TinyConfig(vocab_size=4096, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2),
    "1b": TinyConfig(vocab_size=32000, hidden_size=2048, num_layers=16, num_heads=16, num_kv_heads=8),
}


def mb_width(mode, lens, max_width):
    """Padded width of a micro-batch: its longest row (dynamic batching: rounded up
    to 64, within the batch's width)."""
    width = int(lens.max())
    return min(max_width, -(-width // 64) * 64) if mode == "dynamic" else width


def step(model, mode, ids, lengths, plan, tokens, device):
    """Forward + backward of every micro-batch; returns the summed loss."""
    total = 0.0
    for rows in plan:
        index = torch.as_tensor(rows, dtype=torch.long)
        lens = lengths[index]
        width = mb_width(mode, lens, ids.shape[1])
        mb = ids[index, :width].to(device)
        if mode == "packed":
            batch = seqpack.pack_sequences({"input_ids": mb}, seq_lens=lens)
            loss = packed_loss(model, batch, tokens)
        else:
            mask = (torch.arange(width)[None] < lens[:, None]).long().to(device)
            loss = padded_loss(model, mb, mask, tokens, right_padded=True)
        loss.backward()
        total += float(loss.detach())
    return total


def plans(lengths, mbs, max_tokens):
    n = len(lengths)
    padded = [list(range(i, min(n, i + mbs))) for i in range(0, n, mbs)]
    dyn = seqpack.plan_dynamic_batching(lengths, shards=1, max_tokens_per_microbatch=max_tokens,
                                        sequence_length_round=64, rule="optimal")
    order = dyn.sorted_indices
    dynamic = [[int(order[i]) for i in range(s, e)] for chunk in dyn.micro_batch_indices for s, e in chunk]
    packed = seqpack.plan_micro_batches(lengths, max_tokens=max_tokens).micro_batches
    return {"padded": padded, "dynamic": dynamic, "packed": packed}


def computed_tokens(mode, lengths, plan):
    if mode == "packed":
        return int(lengths.sum())
    total = 0
    for rows in plan:
        total += mb_width(mode, lengths[rows], int(lengths.max())) * len(rows)
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="tiny", choices=sorted(MODELS))
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=8192)
    parser.add_argument("--max-tokens", type=int, default=None, help="micro-batch token cap (default: max-len)")
    parser.add_argument("--mbs", type=int, default=4, help="rows per padded micro-batch")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--csv")
    args = parser.parse_args()
    if args.quick:
        args.sequences, args.max_len, args.repeat = 8, 512, 1
    device = torch.device(args.device)
    env = announce(environment(), torch)
    env.update(model=args.model, device=str(device))
    log = CsvLog("train", env, args.csv)
    cfg = MODELS[args.model]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = TinyCausalLM(cfg).to(device=device, dtype=dtype)
    lengths_np = synthetic_rl_lengths(args.sequences, seed=0, max_len=args.max_len)
    if args.quick:
        lengths_np = np.clip(lengths_np // 16, 2, args.max_len)
    lengths = torch.from_numpy(lengths_np)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (len(lengths), int(lengths.max())), generator=g)
    tokens = float((lengths - 1).sum())
    max_tokens = args.max_tokens or args.max_len
    print(f"  {len(lengths)} sequences, {int(lengths.sum())} tokens (mean {lengths_np.mean():.0f}, max "
          f"{lengths_np.max()}), micro-batch cap {max_tokens} tokens, model {args.model} {dtype}", flush=True)
    rows, results = [], {}
    for mode, plan in plans(lengths_np, args.mbs, max_tokens).items():
        times = []
        for r in range(args.repeat + 1):  # the first run warms up
            model.zero_grad(set_to_none=True)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            else:
                base = reset_peak_rss() * 1024
            t0 = time.perf_counter()
            loss = step(model, mode, ids, lengths, plan, tokens, device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                peak = torch.cuda.max_memory_allocated(device) - base
            else:
                peak = rss_kib("VmHWM:") * 1024 - base
            if r:
                times.append(time.perf_counter() - t0)
        results[mode] = loss
        best = min(times)
        computed = computed_tokens(mode, lengths_np, plan)
        log.add(mode, "seqpack" if mode == "packed" else "baseline", "seconds", best)
        log.add(mode, "seqpack" if mode == "packed" else "baseline", "peak_mib", peak / 2**20)
        rows.append([mode, len(plan), computed / lengths_np.sum(), best, lengths_np.sum() / best, peak / 2**20])
        print(f"  {mode}: done", flush=True)
    for mode in ("dynamic", "packed"):
        assert abs(results[mode] - results["padded"]) <= 1e-3 * abs(results["padded"]), results
    base = rows[0][4]
    for row in rows:
        row.append(row[4] / base)
    print(format_table(
        f"Training step (forward + backward, every micro-batch), {args.model} model on {device}",
        ["mode", "micro-batches", "computed / real", "step s", "tokens/s", "peak MiB", "x padded"], rows,
        note=f"{len(lengths)} RL lengths (prompt 64-1024 + lognormal response, cap {args.max_len}); "
             "tokens/s counts real tokens; the losses of the three modes agree."))
    print(f"\nCSV: {log.write()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
