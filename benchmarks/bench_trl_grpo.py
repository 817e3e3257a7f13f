"""TRL's GRPO on prefix trees: TRL 1.16's log-prob path vs seqpack.integrations.trl.patch(shared_prefix=True).

The GRPO log-probs: forward + backward of ``GRPOTrainer._get_per_token_logps_and_entropies``
(log-probs and entropies of the completions, TRL's fused LM head, a loss on both)
on a batch laid out as TRL lays it out (prompts left-padded, completions
right-padded, G rows per prompt, completions of random lengths), TRL's own method
vs the patched one on copies of one HF Llama (fp32, no autocast: the same numbers,
checked). Then a whole ``trainer.train()`` step under TRL's defaults (bf16
autocast, gradient checkpointing, generation with ``model.generate`` on the CPU),
unpatched vs patched.

    python benchmarks/bench_trl_grpo.py            # G = 4, 8, 16 x prompt:completion 4:1, 1:1, 1:4
    python benchmarks/bench_trl_grpo.py --quick    # two small cases (a smoke test)
"""

from __future__ import annotations

import copy
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import CsvLog, alternating, announce, environment, format_table, torch_cpu_arguments  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

TITLE = "TRL GRPO log-probs, TRL's padded rows vs prefix trees"
TITLE_CHOICE = "TRL GRPO log-prob call, TRL vs the patch's per-batch choice vs trees always"
TITLE_TRAIN = "TRL GRPO trainer.train() step, TRL vs patched"
ROWS = 16  # rows per micro-batch: 16 / G prompts


def tokenizer(vocab: int):
    import tokenizers
    import transformers

    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t0", pad_token="t1", eos_token="t2")


def llama(quick: bool):
    import transformers

    size = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=512) if quick else \
        dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
             vocab_size=8192)
    cfg = transformers.LlamaConfig(max_position_embeddings=4096, bos_token_id=0, pad_token_id=1, eos_token_id=2,
                                   tie_word_embeddings=False, **size)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def batch(g: int, prompt: int, completion: int, vocab: int, seed: int = 0):
    """TRL's layout: each prompt (length within 75-100 % of ``prompt``) left-padded,
    G completions of random lengths (50-100 % of ``completion``) right-padded."""
    rng = np.random.default_rng(seed)
    ids = np.full((ROWS, prompt + completion), 1, dtype=np.int64)
    mask = np.zeros_like(ids)
    for k in range(ROWS // g):
        n = int(rng.integers(prompt * 3 // 4, prompt + 1))
        ids[k * g:(k + 1) * g, prompt - n:prompt] = rng.integers(3, vocab, n)
        mask[k * g:(k + 1) * g, prompt - n:prompt] = 1
    for r in range(ROWS):
        n = int(rng.integers(completion // 2, completion + 1))
        ids[r, prompt:prompt + n] = rng.integers(3, vocab, n)
        mask[r, prompt:prompt + n] = 1
    return torch.from_numpy(ids), torch.from_numpy(mask)


def grpo_trainer(model, out_dir: str, vocab: int, g: int, completion: int, steps: int, **kw):
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    rng = np.random.default_rng(1)
    length = kw.pop("prompt_tokens", 8)
    prompts = [" ".join(f"t{int(i)}" for i in rng.integers(3, vocab, length)) for _ in range(64)]
    args = GRPOConfig(output_dir=out_dir, per_device_train_batch_size=ROWS, num_generations=g,
                      max_completion_length=completion, max_steps=steps, logging_steps=1, report_to="none",
                      save_strategy="no", seed=0, use_cpu=True, disable_tqdm=True, **kw)
    return GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [float(len(c) % 7) for c in completions],
                       args=args, train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
                       processing_class=tokenizer(vocab))


def logprob_case(trainer, trl_model, tree_model, g: int, prompt: int, completion: int, vocab: int, repeat: int):
    from trl.trainer.grpo_trainer import GRPOTrainer

    from seqpack.frameworks._completion_trees import completion_tree
    from seqpack.frameworks.trl.tree import METHOD

    patched = GRPOTrainer.__dict__[METHOD]
    original = patched._seqpack_original
    ids, mask = batch(g, prompt, completion, vocab)

    def step(method, model):
        def run():
            model.zero_grad(set_to_none=True)
            lp, ent, _ = method(trainer, model, ids, mask, completion, compute_entropy=True)
            (lp.sum() + 0.01 * ent.sum()).backward()
            return lp.detach(), [p.grad for p in model.parameters()]
        return run

    (lp_trl, g_trl), (lp_tree, g_tree) = step(original, trl_model)(), step(patched, tree_model)()
    lp_err = float((lp_trl - lp_tree).abs().max() / lp_trl.abs().max())
    grad_err = max(float((a - b).abs().max() / a.abs().max()) for a, b in zip(g_trl, g_tree))
    if lp_err > 2e-4 or grad_err > 1e-3:
        raise AssertionError(f"G={g} {prompt}:{completion}: the tree path disagrees with TRL's: log-probs rel "
                             f"{lp_err:.1e}, gradients rel {grad_err:.1e}")
    t_trl, t_tree = alternating([step(original, trl_model), step(patched, tree_model)], repeat)
    tree = completion_tree(ids, mask, completion)[0]
    padded = ids.numel()
    return dict(padded=padded, real=int(mask.sum()), physical=tree.num_tokens, t_trl=t_trl, t_tree=t_tree,
                lp_err=lp_err, grad_err=grad_err)


def qwen2_tiny():
    """The small regime of issue 51: a Qwen2 of hidden 64, vocabulary 64."""
    import transformers

    cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=64, max_position_embeddings=4096, bos_token_id=0,
                                   pad_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(cfg)


def choice_calls(model, g: int, prompt: int, completion: int, calls: int, skip: int = 10):
    """Milliseconds of one training call of the log-prob method (forward + backward,
    entropies on) on TRL's path, on the patch's choice (``trees="auto"``) and on trees
    always, the three in turn on the same batches (8 of TRL's layout, in rotation), the
    median of the calls after the first ``skip``; and how many of the choice's calls ran
    as trees."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    import seqpack.integrations.trl as seqpack_trl
    from seqpack.frameworks.trl import tree as trl_tree
    from seqpack.frameworks.trl.tree import METHOD

    vocab = model.config.vocab_size
    seqpack_trl.unpatch()
    trl_tree.counts(reset=True)
    seqpack_trl.patch(shared_prefix=True)
    patched = GRPOTrainer.__dict__[METHOD]
    original = patched._seqpack_original
    models = {"trl": model, "auto": copy.deepcopy(model), "always": copy.deepcopy(model)}
    with tempfile.TemporaryDirectory() as out:  # one trainer (one choice) a side
        trainers = {side: grpo_trainer(m, out, vocab, g, completion, 1, bf16=False, prompt_tokens=prompt)
                    for side, m in models.items()}
    batches = [batch(g, prompt, completion, vocab, seed=s) for s in range(8)]
    times: dict = {side: [] for side in models}
    on_trees = 0  # the choice's calls after the first skip that ran as trees
    for i in range(calls):
        ids, mask = batches[i % len(batches)]
        for side, method in (("trl", original), ("auto", patched), ("always", patched)):
            seqpack_trl.patch(shared_prefix=True, trees="always" if side == "always" else "auto")
            m = models[side]
            m.zero_grad(set_to_none=True)
            before = trl_tree.counts()["tree_batches"]
            start = time.perf_counter()
            lp, ent, _ = method(trainers[side], m, ids, mask, completion, compute_entropy=True)
            (lp.sum() + 0.01 * ent.sum()).backward()
            times[side].append(time.perf_counter() - start)
            if side == "auto" and i >= skip:
                on_trees += trl_tree.counts()["tree_batches"] - before
    seqpack_trl.unpatch()
    ms = {side: 1e3 * float(np.median(t[skip:])) for side, t in times.items()}
    return ms, on_trees, calls - skip


def train_steps(model, g: int, prompt: int, completion: int, patched: bool, steps: int, skip: int = 1):
    """Seconds per ``trainer.train()`` step (TRL's defaults), the median of the steps
    after the first ``skip``, and what the patch ran (``report()``)."""
    import seqpack.integrations.trl as seqpack_trl
    from seqpack.frameworks.trl import tree as trl_tree

    vocab = model.config.vocab_size
    seqpack_trl.unpatch()
    trl_tree.counts(reset=True)
    if patched:
        seqpack_trl.patch(shared_prefix=True)
    with tempfile.TemporaryDirectory() as out:
        trainer = grpo_trainer(model, out, vocab, g, completion, steps + skip, prompt_tokens=prompt)
        times = []

        class Timer:
            def on_step_begin(self, *a, **k):
                times.append(time.perf_counter())

        from transformers import PrinterCallback, TrainerCallback

        trainer.remove_callback(PrinterCallback)
        trainer.add_callback(type("StepTimer", (TrainerCallback,), {"on_step_begin": Timer.on_step_begin}))
        trainer.train()
        times.append(time.perf_counter())
    report = seqpack_trl.report()
    seqpack_trl.unpatch()
    return float(np.median(np.diff(times)[skip:])), report


def main() -> int:
    parser = torch_cpu_arguments(__doc__)
    parser.add_argument("--train-only", action="store_true", help="only the regime tables (a log-prob call and trainer.train())")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    env = announce(environment(), torch)
    import transformers
    import trl

    env["transformers"], env["trl"] = transformers.__version__, trl.__version__
    from trl.trainer.utils import add_fused_lm_head

    import seqpack.integrations.trl as seqpack_trl

    log = CsvLog("trl_grpo", env, args.csv)
    repeat = 1 if args.quick else args.repeat
    cases = [(4, 48, 12), (8, 12, 48)] if args.quick else \
        [(g, p, c) for g in (4, 8, 16) for p, c in ((256, 64), (160, 160), (64, 256))]
    trl_model = llama(args.quick)
    vocab = trl_model.config.vocab_size
    tree_model = copy.deepcopy(trl_model)
    rows_out = []
    if args.train_only:
        cases = []
    with tempfile.TemporaryDirectory() as out:
        trainer = grpo_trainer(trl_model, out, vocab, 4, 8, 1, bf16=False)  # TRL's fused head on trl_model
        add_fused_lm_head(tree_model, temperature=trainer.temperature, outputs=("log_probs", "entropy"))
        seqpack_trl.patch(shared_prefix=True)
        for g, p, c in cases:
            r = logprob_case(trainer, trl_model, tree_model, g, p, c, vocab, repeat)
            name = f"G={g} {p}:{c}"
            rows_out.append([name, r["padded"], r["real"], r["physical"], r["padded"] / r["physical"],
                             r["t_trl"] * 1e3, r["t_tree"] * 1e3, r["t_trl"] / r["t_tree"], f"{r['lp_err']:.1e}",
                             f"{r['grad_err']:.1e}"])
            for key in ("padded", "real", "physical", "lp_err", "grad_err"):
                log.add(name, "-", key, r[key])
            log.add(name, "trl", "seconds_min", r["t_trl"])
            log.add(name, "seqpack_tree", "seconds_min", r["t_tree"])
            print(f"  {name}: done", flush=True)
        seqpack_trl.unpatch()
    if rows_out:
        print(format_table(
            TITLE, ["case", "padded tok", "real tok", "tree tok", "padded / tree", "TRL ms", "tree ms", "speed-up",
                    "log-prob rel diff", "grad rel diff"], rows_out,
            note="CPU fp32, torch threads = %d, %d rows per batch (16 / G prompts), Llama %d layers, hidden %d, vocab %d; "
                 "fwd+bwd of _get_per_token_logps_and_entropies (log-probs + entropies, TRL's fused head) with a loss on "
                 "both; the sides alternate, best of %d after a warm-up. padded / tree = TRL's forwarded tokens over the "
                 "tree's: the bound on the token-wise work (attention aside)." % (
                     args.threads, ROWS, trl_model.config.num_hidden_layers, trl_model.config.hidden_size, vocab, repeat)))

    # The small / large regimes (issue 51): a tiny Qwen2 with short to long prompts, and
    # the Llama above with 256-token prompts. The patch's first 8 log-prob calls (one a
    # step here) try both paths; the median is over the steps after them.
    steps, skip = (2, 1) if args.quick else (8, 8)
    regimes = [("Qwen2 h64 V64", qwen2_tiny, 4, p, 64) for p in ((15,) if args.quick else (15, 64, 128, 512))]
    regimes.append(("Llama h256 V8192", lambda: llama(args.quick), 8, 24 if args.quick else 256,
                    8 if args.quick else 64))
    train_rows, choice_rows = [], []
    calls, skip_calls = (12, 4) if args.quick else (60, 10)
    for name, make, g, prompt, completion in regimes:
        ms, on_trees, counted = choice_calls(make(), g, prompt, completion, calls, skip_calls)
        case = f"{name} G={g} prompt {prompt} completion {completion}"
        for side, key in (("trl", "trl"), ("auto", "seqpack_choice"), ("always", "seqpack_tree")):
            log.add(case, key, "call_ms_median", ms[side])
        log.add(case, "seqpack_choice", "tree_calls", on_trees)
        choice_rows.append([name, g, prompt, completion, ms["trl"], ms["auto"], ms["always"], ms["trl"] / ms["auto"],
                            ms["trl"] / ms["always"], f"{on_trees} / {counted}"])
        print(f"  choice {case}: done", flush=True)
        t_trl, t_tree, ran = float("inf"), float("inf"), {}
        for _ in range(1 if args.quick else 2):  # the sides alternate, best of the runs
            t_trl = min(t_trl, train_steps(make(), g, prompt, completion, False, steps, skip)[0])
            t, ran = train_steps(make(), g, prompt, completion, True, steps, skip)
            t_tree = min(t_tree, t)
        case = f"{name} G={g} prompt {prompt} completion <= {completion}"
        log.add(case, "trl", "seconds_per_step", t_trl)
        log.add(case, "seqpack_tree", "seconds_per_step", t_tree)
        log.add(case, "seqpack_tree", "tree_batches", ran["tree_batches"])
        log.add(case, "seqpack_tree", "trl_batches", ran["trl_batches"])
        train_rows.append([name, g, prompt, completion, t_trl, t_tree, t_trl / t_tree,
                           f"{ran['tree_batches']} / {ran['tree_batches'] + ran['trl_batches']}"])
        print(f"  train {case}: done", flush=True)
    print(format_table(
        TITLE_CHOICE, ["model", "G", "prompt tokens", "completion tokens", "TRL ms", "choice ms", "trees ms",
                       "choice speed-up", "trees speed-up", "choice on trees"], choice_rows,
        note="one training call of _get_per_token_logps_and_entropies (forward + backward, entropies; fp32, no "
             "autocast, no checkpointing), 16 rows of TRL's layout (8 batches in rotation): TRL's path, the patch's "
             "choice (trees='auto', its own trainer: it explores both paths on its first 8 calls) and "
             "trees='always', the three in turn; the median of calls %d-%d. choice on trees: its calls among those "
             "that ran as trees." % (skip_calls + 1, calls)))
    print(format_table(
        TITLE_TRAIN, ["model", "G", "prompt tokens", "completion max", "TRL s/step", "patched s/step", "speed-up",
                      "tree batches / all"], train_rows,
        note="trainer.train() under TRL's defaults (bf16 autocast on the CPU, gradient checkpointing, beta 0), "
             "16 rows per step, generation by model.generate (the same on both sides: the tree path changes only "
             "the log-probs); patch(shared_prefix=True) with its per-batch choice (trees='auto'): the first %d "
             "log-prob calls try both paths, the median is over the %d steps after them; best of 2 runs per side, "
             "alternating. tree batches: the patched run's log-prob calls on trees (the rest on TRL's path)."
             % (skip, steps)))
    print(f"csv: {log.write()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
