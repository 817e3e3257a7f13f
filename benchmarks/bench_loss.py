"""Loss benchmark (SPEC P4): the fused packed log-prob path vs PyTorch and vs the
per-sequence loop wrapper, forward + backward, same packed logits.

  torch    log_softmax + gather on the packed logits [T, V] (+ masked sum, backward):
           the straightforward tensor computation;
  loop     SequencePackingLossWrapper(fused=False) with a PyTorch prepare_fn: per
           sequence, slice the logits, log_softmax + gather (NeMo-RL's wrapper);
  fused    SequencePackingLossWrapper(fused=True): one pass over the logits forward,
           one backward, no [T, V] intermediate.
All three compute the same SFT loss (checked); CPU fp32. Extra peak memory is the
rise of the process's peak RSS (VmHWM, reset before each run) over its RSS before,
minus the [T, V] gradient that every method must return.

    python benchmarks/bench_loss.py            # full run
    python benchmarks/bench_loss.py --quick    # small sizes, smoke test
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import CsvLog, announce, environment, format_table, measure  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from seqpack.loss import NLLLoss, SequencePackingLossWrapper  # noqa: E402
from seqpack.report import synthetic_rl_lengths  # noqa: E402


def rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(field)


def peak_extra_mib(fn) -> float:
    """Peak RSS rise while ``fn`` runs (Linux: VmHWM reset through clear_refs)."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = rss_kib("VmRSS:")
    fn()
    return (rss_kib("VmHWM:") - before) / 1024


def make_case(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = np.asarray(lengths)
    batch, width = len(lengths), int(lengths.max())
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total = int(cu[-1])
    ids = torch.zeros(batch, width, dtype=torch.long)
    token_mask = torch.zeros(batch, width)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(0, vocab, (int(n),), generator=g)
        token_mask[i, :n] = 1.0
    data = {"input_ids": ids, "token_mask": token_mask, "sample_mask": torch.ones(batch)}
    logits = torch.randn(total, vocab, generator=g)
    gvt = float((token_mask[:, 1:]).sum())
    return logits, data, cu, gvt


def torch_prepare(logits, data, loss_fn, **_):
    lp = torch.log_softmax(logits[0, :-1], -1).gather(-1, data["input_ids"][0, 1:, None])[:, 0]
    return {"next_token_logprobs": lp[None]}, data


def run(method, logits, data, cu, gvt):
    x = logits.detach().requires_grad_()
    loss_fn = NLLLoss()
    if method == "torch":
        # Targets rolled within each sequence, as a packed stream.
        targets, mask = PACKED_TARGETS[id(data)]
        lp = torch.log_softmax(x, -1).gather(-1, targets[:, None])[:, 0]
        loss = -(lp * mask).sum() / gvt
    elif method == "loop":
        loss, _ = SequencePackingLossWrapper(loss_fn, torch_prepare, cu)(x, data, len(cu) - 1, gvt)
    else:
        loss, _ = SequencePackingLossWrapper(loss_fn, None, cu, fused=True)(x, data, len(cu) - 1, gvt)
    loss.backward()
    return loss.detach(), x.grad


PACKED_TARGETS = {}


def packed_targets(data, cu):
    ids, lengths = data["input_ids"], np.diff(cu)
    total = int(cu[-1])
    targets = torch.zeros(total, dtype=torch.long)
    mask = torch.zeros(total)
    for i, n in enumerate(lengths):
        if n > 1:
            targets[cu[i]: cu[i] + n - 1] = ids[i, 1:n]
            mask[cu[i]: cu[i] + n - 1] = data["token_mask"][i, 1:n]
    PACKED_TARGETS[id(data)] = (targets, mask)


def bench_case(name, lengths, vocab, log, rows, targets, repeat):
    logits, data, cu, gvt = make_case(lengths, vocab)
    packed_targets(data, cu)
    total = logits.shape[0]
    grad_mib = total * vocab * 4 / 2**20
    results = {m: run(m, logits, data, cu, gvt) for m in ("torch", "loop", "fused")}
    for m in ("loop", "fused"):
        torch.testing.assert_close(results[m][0], results["torch"][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(results[m][1], results["torch"][1], rtol=1e-4, atol=1e-7)
    del results
    times, mems = {}, {}
    for m in ("torch", "loop", "fused"):
        # The loop's backward adds a full-size [T, V] gradient per sequence (each
        # slice's backward): seconds to minutes per run, so it runs once.
        times[m] = measure(lambda: run(m, logits, data, cu, gvt), repeat=1 if m == "loop" else repeat,
                           warmup=0 if m == "loop" else 1, budget_s=60)["min"]
        mems[m] = max(0.0, peak_extra_mib(lambda: run(m, logits, data, cu, gvt)) - grad_mib)
        log.add(f"{name}/V={vocab}", m, "seconds", times[m])
        log.add(f"{name}/V={vocab}", m, "peak_extra_mib", mems[m])
    case = f"{name}/V={vocab}"
    targets[case] = {"vs_torch": times["torch"] / times["fused"], "vs_loop": times["loop"] / times["fused"],
                     "memory_vs_torch": mems["torch"] / max(mems["fused"], 1e-9)}
    print(f"  {name}, V={vocab}: done", flush=True)
    rows.append([name, len(lengths), total, vocab, f"{total * vocab * 4 / 2**30:.2f}", times["torch"] * 1e3,
                 times["loop"] * 1e3, times["fused"] * 1e3, times["torch"] / times["fused"],
                 times["loop"] / times["fused"], mems["torch"], mems["loop"], mems["fused"]])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--csv")
    args = parser.parse_args()
    env = announce(environment(), torch)
    log = CsvLog("loss", env, args.csv)
    rows, targets = [], {}
    rng = np.random.default_rng(0)
    if args.quick:
        cases = [("1024 short", rng.integers(2, 9, 256), [2048]), ("256 long-tail", None, [2048])]
        long_tail = np.clip(synthetic_rl_lengths(64, seed=1, max_len=256) // 16, 2, 64)
    else:
        cases = [("1024 short", rng.integers(2, 17, 1024), [32000, 152064]), ("256 long-tail", None, [32000, 152064])]
        long_tail = np.clip(synthetic_rl_lengths(256, seed=1, max_len=8192) // 64, 2, 128)
    for name, lengths, vocabs in cases:
        lengths = long_tail if lengths is None else lengths
        for vocab in vocabs:
            # Keep [T, V] fp32 within ~1.2 GiB: fewer tokens on the larger vocabulary.
            budget = 300_000_000 if not args.quick else 2_000_000
            keep = lengths
            while int(np.sum(keep)) * vocab > budget and len(keep) > 8:
                keep = keep[: len(keep) * 3 // 4]
            bench_case(name if len(keep) == len(lengths) else f"{name} (first {len(keep)})", keep, vocab, log, rows,
                       targets, repeat=3 if not args.quick else 2)
    print(format_table(
        "Packed SFT loss, forward + backward, CPU fp32: PyTorch vs per-sequence loop vs fused (ms, best run)",
        ["case", "sequences", "tokens T", "vocab V", "logits GiB", "torch ms", "loop ms", "fused ms", "x torch",
         "x loop", "torch extra MiB", "loop extra MiB", "fused extra MiB"], rows,
        note="extra MiB: peak RSS rise during forward+backward minus the [T, V] fp32 gradient every method returns."))
    print(f"\nCSV: {log.write()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
