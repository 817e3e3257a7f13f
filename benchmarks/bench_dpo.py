"""DPO training-step benchmark (issue 30): padded pairs vs packed pairs, one process,
the same model, the same preference batch, forward + backward of every micro-batch.

  padded   NeMo-RL's DPO micro-batches: --pairs-per-mb pairs (chosen, rejected
           interleaved) in data order, each padded to its longest row, causal SDPA,
           log_softmax + gather, ``seqpack.loss.DPOLoss`` on the [2b, S] rows;
  packed   ``seqpack.plan_micro_batches(group_ids=pair ids)``: whole pairs under
           --max-tokens real tokens per micro-batch, packed to THD, varlen attention,
           ``SequencePackingLossWrapper(DPOLoss, fused=True)``.
Both compute the same loss (checked). Tokens/s counts real tokens; "computed / real"
is what the model processes per real token.

Lengths: by default a real preference dataset's, ``data/dpo_en_demo_lengths.csv``
(the 300 pairs of LLaMA-Factory's dpo_en_demo.json tokenized with a real 65k BPE
vocabulary; how they were made: ``data/make_dpo_lengths.py``), the first ``--pairs``
in file order; ``--synthetic`` draws them from lognormals instead (prompt median 150
tokens, chosen 320, rejected 260). Rows are cut at ``--max-len`` tokens (2,048, as
NeMo-RL's DPO recipes' max_total_sequence_length), and a pair whose prompt alone
reaches it is left out.

    python benchmarks/bench_dpo.py            # CPU, tiny model
    python benchmarks/bench_dpo.py --quick    # smoke test
"""

from __future__ import annotations

import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import CsvLog, announce, environment, format_table, torch_cpu_arguments  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

import seqpack  # noqa: E402
from seqpack.loss import DPOLoss, SequencePackingLossWrapper  # noqa: E402
from seqpack.testing.tiny_model import TinyCausalLM, TinyConfig  # noqa: E402

CONFIG = TinyConfig(vocab_size=4096, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2)


REAL_LENGTHS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "dpo_en_demo_lengths.csv")


def preference_lengths(pairs: int, seed: int = 0, max_len: int = 2048, path: str | None = REAL_LENGTHS):
    """(row lengths [2 * pairs], prompt lengths [pairs]): rows 2i / 2i + 1 are pair i's
    chosen / rejected response after its prompt; the first ``pairs`` of ``path``'s
    (prompt, chosen, rejected) token counts whose prompt is under ``max_len``, or
    lognormal draws when ``path`` is None."""
    if path is None:
        rng = np.random.default_rng(seed)
        prompt = np.clip(np.rint(rng.lognormal(math.log(150), 0.9, pairs)), 8, 1024).astype(np.int64)
        chosen = np.clip(np.rint(rng.lognormal(math.log(320), 0.8, pairs)), 4, None).astype(np.int64)
        rejected = np.clip(np.rint(rng.lognormal(math.log(260), 0.9, pairs)), 4, None).astype(np.int64)
    else:
        counts = np.loadtxt(path, delimiter=",", skiprows=1, dtype=np.int64, ndmin=2)
        counts = counts[counts[:, 0] < max_len][:pairs]
        if len(counts) < pairs:
            raise SystemExit(f"{path} has {len(counts)} pairs with a prompt under {max_len} tokens; --pairs {pairs}")
        prompt, chosen, rejected = counts.T
    rows = np.stack([prompt + chosen, prompt + rejected], 1).reshape(-1)
    return np.minimum(rows, max_len), prompt


def make_batch(lengths: np.ndarray, prompt: np.ndarray, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n, width = len(lengths), int(lengths.max())
    ids = torch.zeros(n, width, dtype=torch.long)
    token_mask = torch.zeros(n, width)
    for i, length in enumerate(lengths.tolist()):
        p = int(prompt[i // 2])
        ids[i, :length] = torch.randint(1, CONFIG.vocab_size, (length,), generator=g)
        if i % 2:  # the pair shares its prompt
            ids[i, :p] = ids[i - 1, :p]
        token_mask[i, p:length] = 1.0  # the response's tokens
    return {"input_ids": ids, "token_mask": token_mask, "sample_mask": torch.ones(n),
            "reference_policy_logprobs": -torch.rand(n, width, generator=g) * 4}


def take(data, rows, width):
    index = torch.as_tensor(rows, dtype=torch.long)
    return {k: (v[index, :width] if v.dim() == 2 else v[index]) for k, v in data.items()}


def step(model, mode, data, lengths, plan, loss_fn, gvs, gvt):
    total = 0.0
    for rows in plan:
        width = int(lengths[rows].max())
        mb = take(data, rows, width)
        lens = torch.as_tensor(lengths[rows])
        if mode == "packed":
            batch = seqpack.pack_sequences({"input_ids": mb["input_ids"]}, seq_lens=lens)
            logits = model.forward_packed(batch)
            wrapper = SequencePackingLossWrapper(loss_fn, cu_seqlens_q=batch.cu_seqlens, fused=True)
            loss, _ = wrapper(logits, mb, gvs, gvt)
        else:
            mask = (torch.arange(width)[None] < lens[:, None]).long()
            logits = model.forward_padded(mb["input_ids"], mask, right_padded=True)
            lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, mb["input_ids"][:, 1:, None])[..., 0]
            loss, _ = loss_fn(lp, mb, gvs, gvt)
        loss.backward()
        total += float(loss.detach())
    return total


def main() -> int:
    parser = torch_cpu_arguments(__doc__, repeat=3)
    parser.add_argument("--pairs", type=int, default=64)
    parser.add_argument("--pairs-per-mb", type=int, default=4, help="padded: pairs per micro-batch (NeMo-RL mbs)")
    parser.add_argument("--max-tokens", type=int, default=4096, help="packed: real tokens per micro-batch")
    parser.add_argument("--max-len", type=int, default=2048, help="rows cut at this many tokens")
    parser.add_argument("--synthetic", action="store_true", help="lognormal lengths instead of the real dataset's")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.quick:
        args.pairs, args.repeat, args.max_tokens, args.max_len = 8, 1, 2048, 1024
    env = announce(environment(), torch)
    log = CsvLog("dpo", env, args.csv)
    lengths, prompt = preference_lengths(args.pairs, max_len=args.max_len,
                                         path=None if args.synthetic else REAL_LENGTHS)
    source = "synthetic lognormal" if args.synthetic else "dpo_en_demo's real pairs"
    data = make_batch(lengths, prompt)
    loss_fn = DPOLoss({"reference_policy_kl_penalty": 0.1, "sft_loss_weight": 0.1})
    gvs, gvt = float(2 * args.pairs), float(data["token_mask"][:, 1:].sum())
    per = 2 * args.pairs_per_mb
    plans = {"padded": [list(range(i, min(len(lengths), i + per))) for i in range(0, len(lengths), per)],
             "packed": seqpack.plan_micro_batches(lengths, args.max_tokens,
                                                  group_ids=np.arange(len(lengths)) // 2).micro_batches}
    torch.manual_seed(0)
    model = TinyCausalLM(CONFIG)
    real = int(lengths.sum())
    results, losses = {}, {}
    for mode in ("padded", "packed"):
        step(model, mode, data, lengths, plans[mode][:1], loss_fn, gvs, gvt)  # warm-up
        best = float("inf")
        for _ in range(args.repeat):
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            losses[mode] = step(model, mode, data, lengths, plans[mode], loss_fn, gvs, gvt)
            best = min(best, time.perf_counter() - t0)
        computed = real if mode == "packed" else sum(int(lengths[r].max()) * len(r) for r in plans[mode])
        results[mode] = (best, computed)
        case = f"pairs={args.pairs}/{'synthetic' if args.synthetic else 'dpo_en_demo'}"
        log.add(case, mode, "seconds", best)
        log.add(case, mode, "tokens_per_s", real / best)
        log.add(case, mode, "micro_batches", len(plans[mode]))
    assert abs(losses["packed"] - losses["padded"]) <= 1e-3 * abs(losses["padded"]) + 1e-4, losses
    base = results["padded"][0]
    rows = [[mode, len(plans[mode]), real / t, computed / real, base / t] for mode, (t, computed) in results.items()]
    print(format_table(
        f"DPO training step, padded vs packed pairs ({args.pairs} pairs, {real:,} real tokens, tiny model, CPU)",
        ["mode", "micro-batches", "real tokens/s", "computed / real", "speed-up vs padded"], rows,
        note=f"padded: {args.pairs_per_mb} pairs per micro-batch, each padded to its longest row; packed: whole pairs "
             f"(plan_micro_batches group_ids) under {args.max_tokens} real tokens, fused DPO loss. Best of "
             f"{args.repeat} step(s); the step losses agree ({losses['padded']:.6f} vs {losses['packed']:.6f}). "
             f"Row lengths: median {int(np.median(lengths))}, p90 {int(np.percentile(lengths, 90))}, max "
             f"{int(lengths.max())} ({source}, see the module docstring)."))
    print(f"\nCSV: {log.write()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
