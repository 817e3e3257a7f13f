"""TRL GRPO with groups larger than the per-device batch: an optimizer step on TRL's padded rows, on each
micro-batch's prefix tree, and on the accumulation window in prefix-reuse passes (issue 52).

GRPOTrainer with G completions per prompt, ``per_device_train_batch_size`` < G and
``steps_per_generation`` = ``gradient_accumulation_steps`` (TRL's default): TRL
shuffles the generation batch and cuts it into micro-batches, so each micro-batch
holds rows of several prompts and forwards each of their prompts. Three sides on
copies of one HF Llama (fp32 on the CPU, TRL's defaults otherwise: gradient
checkpointing, beta 0):

    trl       TRL 1.16's own path (every row padded)
    trees     patch(shared_prefix=True) with the window off: each micro-batch its tree
    window    patch(shared_prefix=True): the window's log-probs once without gradients,
              then its passes with gradients (each prompt once per optimizer step)

Timed: the second optimizer step of each run (``num_iterations = 2``: the step
reuses the first step's generation batch, so it holds no generation), best of the
runs. The bound: the window's physical tokens x 4/3 (a forward without gradients
more) plus a third of its shared prefixes' (forwarded again at their backward)
against the micro-batches' trees' tokens. The parameters after the two steps
are compared with TRL's.

    python benchmarks/bench_trl_window.py            # G = 16 and 32, prompts 256 / 512, completions <= 64
    python benchmarks/bench_trl_window.py --quick    # one small case (a smoke test)
"""

from __future__ import annotations

import copy
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import CsvLog, announce, environment, format_table, torch_cpu_arguments  # noqa: E402
from bench_trl_grpo import llama, tokenizer  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

TITLE = "TRL GRPO optimizer step, groups larger than the per-device batch: TRL vs per-micro-batch trees vs the window"


def run(model, side: str, g: int, prompt: int, completion: int, per_device: int, accumulation: int):
    """Seconds of the second optimizer step, the parameters after it, and what the patch ran."""
    import datasets
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import seqpack.integrations.trl as seqpack_trl
    from seqpack.frameworks.trl import tree as trl_tree
    from seqpack.frameworks.trl import window as trl_window

    vocab = model.config.vocab_size
    seqpack_trl.unpatch()
    trl_tree.counts(reset=True)
    applies = trl_window._applies
    if side != "trl":
        seqpack_trl.patch(shared_prefix=True, trees="always")
    if side == "trees":
        trl_window._applies = lambda *args, **kwargs: None
    rng = np.random.default_rng(1)
    prompts = [" ".join(f"t{int(i)}" for i in rng.integers(3, vocab, prompt)) for _ in range(16)]
    times = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *args, **kwargs):
            times.append(time.perf_counter())

        def on_step_end(self, *args, **kwargs):
            times.append(time.perf_counter())

    try:
        with tempfile.TemporaryDirectory() as out:
            args = GRPOConfig(output_dir=out, per_device_train_batch_size=per_device, num_generations=g,
                              gradient_accumulation_steps=accumulation, steps_per_generation=accumulation,
                              num_iterations=2, max_completion_length=completion, max_steps=2, logging_steps=1,
                              report_to="none", save_strategy="no", seed=0, use_cpu=True, bf16=False,
                              disable_tqdm=True, temperature=1.0)
            trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [float(len(c) % 7)
                                                                                       for c in completions],
                                  args=args, train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
                                  processing_class=tokenizer(vocab))
            trainer.remove_callback(PrinterCallback)
            trainer.add_callback(Timer)
            trainer.train()
    finally:
        trl_window._applies = applies
        ran = seqpack_trl.report()
        seqpack_trl.unpatch()
    return times[3] - times[2], [p.detach().clone() for p in model.parameters()], ran


def main() -> int:
    parser = torch_cpu_arguments(__doc__, repeat=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    env = announce(environment(), torch)
    import transformers
    import trl

    from seqpack import split_prefix_tree
    from seqpack.frameworks._completion_trees import completion_tree

    env["transformers"], env["trl"] = transformers.__version__, trl.__version__
    log = CsvLog("trl_window", env, args.csv)
    # the second case's groups (512 + 32 x 64 tokens) exceed a micro-batch (4 x 576): its prompts run as
    # provider passes read by several branches
    cases = [(8, 48, 12, 2, 4)] if args.quick else [(16, 256, 64, 4, 8), (32, 512, 64, 4, 16)]
    base = llama(args.quick)
    rows = []
    for g, prompt, completion, per_device, accumulation in cases:
        name = f"G={g} prompt {prompt} completion <= {completion}, {per_device} rows x {accumulation}"
        best = {}
        params = {}
        ran = {}
        for _ in range(1 if args.quick else args.repeat):
            for side in ("trl", "trees", "window"):  # the sides alternate, best of the runs
                seconds, params[side], ran[side] = run(copy.deepcopy(base), side, g, prompt, completion, per_device,
                                                       accumulation)
                best[side] = min(best.get(side, float("inf")), seconds)
        diff = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(params["window"], params["trl"]))
        # the window's tokens against its micro-batches' trees (a window of this shape, its rows as TRL lays them)
        rng = np.random.default_rng(0)
        width = prompt + completion
        ids = torch.tensor(rng.integers(3, base.config.vocab_size, (per_device * accumulation, width)))
        for r in range(ids.shape[0]):
            ids[r, :prompt] = ids[(r // g) * g, :prompt]  # whole groups, then TRL's shuffle
        ids = ids[torch.randperm(ids.shape[0], generator=torch.Generator().manual_seed(0))]
        mask = torch.ones_like(ids)
        tree = completion_tree(ids, mask, completion)[0]
        window = tree.num_tokens
        micro = sum(completion_tree(ids[s:s + per_device], mask[s:s + per_device], completion)[0].num_tokens
                    for s in range(0, ids.shape[0], per_device))
        passes = split_prefix_tree(tree, per_device * width)
        prefixes = sum(p.own.shape[0] for p in passes.passes if p.role == "provider")
        bound = micro / (4 / 3 * window + prefixes / 3)
        rows.append([name, ids.numel(), micro, window, prefixes, best["trl"], best["trees"], best["window"],
                     best["trees"] / best["window"], bound, best["trl"] / best["window"],
                     ran["window"]["prefix_reuse_windows"], f"{diff:.1e}"])
        for side in ("trl", "trees", "window"):
            log.add(name, side, "seconds_per_step", best[side])
        log.add(name, "window", "windows", ran["window"]["prefix_reuse_windows"])
        log.add(name, "-", "param_rel_diff_vs_trl", diff)
        print(f"  {name}: done", flush=True)
    print(format_table(
        TITLE, ["case", "padded tok", "micro trees tok", "window tok", "prefix tok", "TRL s", "trees s", "window s",
                "window vs trees", "bound", "window vs TRL", "windows", "params vs TRL"], rows,
        note="CPU fp32, torch threads = %d, Llama %d layers hidden %d vocab %d; GRPOTrainer (TRL %s) with "
             "steps_per_generation = gradient_accumulation_steps, num_iterations 2, gradient checkpointing; the "
             "second optimizer step (no generation), best of %d runs per side, alternating. Token columns: one "
             "window of this shape (whole groups shuffled as TRL does); prefix tok: its provider passes' (prompts "
             "read by several passes). bound = micro trees tok / (4/3 x window tok + 1/3 x prefix tok): the window "
             "forwards its tokens twice, back-propagates them once and forwards its prefixes once more (their "
             "passes keep only K/V). params vs TRL: the largest "
             "relative difference of a parameter after the two steps (TRL's fused head takes its log-sum-exp in "
             "fp32)." % (args.threads, base.config.num_hidden_layers, base.config.hidden_size,
                          base.config.vocab_size, trl.__version__, 1 if args.quick else args.repeat)))
    print(f"csv: {log.write()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
