"""GPU benchmark: THD pack/unpack and the fused log-probs on a CUDA device.

Same process, same data, CUDA-event timings (best and median of the runs).
Baselines:
  copy    ``dst.copy_(src)`` of the same bytes on the device: the bandwidth limit;
  loop    the per-sequence PyTorch loop of bench_thd.py (ROLL's ``_pack_sequences``);
  torch   ``log_softmax`` + ``gather`` (+ entropy) forward and backward on the
          same logits; its extra peak memory from ``torch.cuda.max_memory_allocated``;
  NeMo-RL (distillation) the top-k input by log_softmax + gather over the whole
          vocabulary (bench_distillation.py), against seqpack's column log-probs;
  linear  (LM head fused) F.linear + log_softmax + gather, against
          seqpack.token_logprobs(..., weight=);
  plain   (prefix trees) bench_prefix_tree.py's model on GRPO rows packed back to
          back (varlen_attention, token_logprobs), against the same rows as a
          prefix tree (seqpack.attention per tree backend, token_logprobs), bf16.
Bandwidth of the fused log-probs counts the bytes that must move: the logits read
once forward, read once and the gradient written once backward.
Also checked: no host synchronisation on the hot paths
(``torch.cuda.set_sync_debug_mode("error")``) and a CUDA-graph replay of
static pack -> log-probs -> loss against the same step run eagerly.

    python benchmarks/bench_gpu.py --csv benchmarks/results/gpu.csv
    python benchmarks/bench_gpu.py --quick
    python benchmarks/bench_gpu.py --only distillation linear
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import CsvLog, announce, environment, format_table  # noqa: E402
from bench_prefix_tree import Model, grpo_batch, max_rel_diff, plain_step, sft_batch, tree_step  # noqa: E402
from bench_thd import QUICK_SHAPES, SHAPES, case_lengths, loop_pack, loop_unpack  # noqa: E402

import numpy as np  # noqa: E402

import torch  # noqa: E402

import seqpack  # noqa: E402


def cuda_time(fn, repeat=20, warmup=3):
    """Best and median milliseconds of ``fn`` between CUDA events on the current stream."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return {"min": times[0], "median": times[len(times) // 2]}


def gpu_environment(env):
    props = torch.cuda.get_device_properties(0)
    env.update(device=props.name, cuda=str(torch.version.cuda), torch=torch.__version__)
    try:
        env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True).stdout.strip().splitlines()[0]
    except (OSError, IndexError):
        env["driver"] = "unknown"
    return env


def bench_thd(shapes, log, repeat):
    rows = []
    for name, ((batch, width), hidden, dtype) in shapes.items():
        lens = case_lengths(batch, width)
        if dtype.is_floating_point:
            x = torch.empty((batch, width, *hidden), dtype=dtype, device="cuda").normal_()
        else:
            x = torch.randint(0, 150000, (batch, width, *hidden), dtype=dtype, device="cuda")
        for cp in (1, 2):
            multiple = seqpack.alignment(cp_size=cp)
            packed = seqpack.pack_sequences(x, seq_lens=lens, pad_multiple=multiple, cp_size=cp, cp_rank=0)
            y = packed["input"]
            assert torch.equal(y, loop_pack(x, lens.tolist(), multiple, cp, 0, 0)), name
            back = packed.unpack(y)
            assert torch.equal(back, loop_unpack(y, lens.tolist(), packed.padded_lens.tolist(), width, cp, 0))
            nbytes = y.numel() * y.element_size()
            src, dst = x.reshape(-1)[: y.numel()], torch.empty_like(y).reshape(-1)
            t_copy = cuda_time(lambda: dst.copy_(src), repeat)
            t_pack = cuda_time(lambda: seqpack.pack_sequences(x, seq_lens=lens, pad_multiple=multiple,
                                                              cp_size=cp), repeat)
            t_unpack = cuda_time(lambda: packed.unpack(y), repeat)
            t_loop = cuda_time(lambda: loop_pack(x, lens.tolist(), multiple, cp, 0, 0), max(3, repeat // 4), 1)
            case = f"{name}/cp={cp}"
            for impl, t in (("copy", t_copy), ("seqpack_pack", t_pack), ("seqpack_unpack", t_unpack),
                            ("loop_pack", t_loop)):
                log.add(case, impl, "ms_min", t["min"])
                log.add(case, impl, "ms_median", t["median"])
            log.add(case, "-", "packed_bytes", nbytes)
            gbs = lambda t: 2 * nbytes / t["min"] / 1e6  # noqa: E731 (read + write)
            rows.append([name, cp, nbytes / 2**20, gbs(t_copy), gbs(t_pack), t_copy["min"] / t_pack["min"],
                         t_loop["min"] / t_pack["min"], t_unpack["min"]])
    return format_table("pack/unpack on the GPU (CUDA events, best of the runs)",
                        ["shape", "CP", "packed MiB", "copy GB/s", "pack GB/s", "pack / copy", "x loop",
                         "unpack ms"], rows)


def torch_logprobs(logits, targets, entropy):
    lsm = torch.log_softmax(logits.float(), -1)
    lp = lsm.gather(1, targets.clamp(min=0)[:, None])[:, 0]
    ent = -(lsm.exp() * lsm).sum(-1) if entropy else None
    return lp, ent


def bench_logprobs(cases, log, repeat):
    rows = []
    copy_src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    copy_dst = torch.empty_like(copy_src)
    t_ref = cuda_time(lambda: copy_dst.copy_(copy_src), repeat)
    copy_gbs = 2 * copy_src.numel() / t_ref["min"] / 1e6
    del copy_src, copy_dst
    for tokens, vocab, dtype, entropy in cases:
        case = f"T={tokens},V={vocab},{str(dtype).split('.')[1]},entropy={entropy}"
        logits = torch.randn(tokens, vocab, dtype=dtype, device="cuda")
        ids = torch.randint(0, vocab, (tokens,), device="cuda")
        cu = torch.tensor([0, tokens // 3, tokens], dtype=torch.int32)
        targets = seqpack.logprobs.next_token_targets(ids, cu.cuda(), cu.cuda(), tokens)

        def fused():
            x = logits.detach().requires_grad_()
            lp, ent = seqpack.token_logprobs(x, cu, ids, return_entropy=entropy)
            (lp.sum() + (ent.sum() if entropy else 0)).backward()

        def unfused():
            x = logits.detach().requires_grad_()
            lp, ent = torch_logprobs(x, targets, entropy)
            (torch.where(targets >= 0, lp, 0).sum() + (ent.sum() if entropy else 0)).backward()

        result = {}
        for impl, fn in (("seqpack", fused), ("torch", unfused)):
            try:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                fn()
                torch.cuda.synchronize()
                extra = (torch.cuda.max_memory_allocated() - base) / 2**20
                result[impl] = (cuda_time(fn, repeat), extra)
            except torch.OutOfMemoryError:
                result[impl] = None
                torch.cuda.empty_cache()
            for key, value in (("ms_min", result[impl][0]["min"] if result[impl] else "oom"),
                               ("extra_peak_mib", result[impl][1] if result[impl] else "oom")):
                log.add(case, impl, key, value)
        moved = 3 * logits.numel() * logits.element_size()  # read fwd, read bwd, write the gradient
        ours, theirs = result["seqpack"], result["torch"]
        gbs = moved / ours[0]["min"] / 1e6 if ours else float("nan")
        rows.append([case, ours[0]["min"] if ours else "oom", theirs[0]["min"] if theirs else "oom",
                     theirs[0]["min"] / ours[0]["min"] if ours and theirs else "-",
                     ours[1] if ours else "-", theirs[1] if theirs else "oom", gbs, gbs / copy_gbs])
        del logits
        torch.cuda.empty_cache()
    return format_table(f"fused log-probs forward+backward on the GPU (device copy: {copy_gbs:,.0f} GB/s)",
                        ["case", "fused ms", "torch ms", "x torch", "fused extra MiB", "torch extra MiB",
                         "fused GB/s", "of copy"], rows)


def cuda_extra_mib(fn, returned_bytes=0):
    """Peak allocated-memory rise of one ``fn()`` (MiB), minus ``returned_bytes``
    (gradients both methods return)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base - returned_bytes) / 2**20


def measure(fn, repeat, returned_bytes=0, runs=1):
    """(timings, [extra MiB of each of ``runs`` runs]) or None when it does not fit."""
    try:
        extra = [cuda_extra_mib(fn, returned_bytes) for _ in range(runs)]
        return cuda_time(fn, repeat, warmup=1), extra
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


def rel_diff(ours, theirs):
    """|ours - theirs| / |theirs| (the absolute difference where theirs is 0)."""
    ours, theirs = float(ours), float(theirs)
    return abs(ours - theirs) / abs(theirs) if theirs else abs(ours - theirs)


def ratio_row(ours, theirs):
    """[ours ms, theirs ms, ours / theirs, ours MiB (worst run), theirs MiB (best run), ratio]."""
    cell = (lambda r, f: f(r) if r else "oom")  # noqa: E731
    t_ratio = ours[0]["min"] / theirs[0]["min"] if ours and theirs else "-"
    m_ratio = max(ours[1]) / min(theirs[1]) if ours and theirs else "-"
    return [cell(ours, lambda r: r[0]["min"]), cell(theirs, lambda r: r[0]["min"]), t_ratio,
            cell(ours, lambda r: max(r[1])), cell(theirs, lambda r: min(r[1])), m_ratio]


def bench_distillation(log, repeat, quick):
    """Issue 30: the student's side of top-k distillation (input + mixed KL, forward and
    backward) at V = 152k, seqpack's fused column log-probs against NeMo-RL's
    log_softmax + gather (bench_distillation.py's two methods, on the device)."""
    from bench_distillation import make_case, run
    from seqpack.loss import DistillationLoss

    tokens, vocab = (2048, 32000) if quick else (16384, 151936)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for zero in (True, False):
            for k in ((8,) if quick else (1, 8, 64)):
                loss_fn = DistillationLoss({"kl_type": "mixed", "mixed_kl_weight": 0.5, "zero_outside_topk": zero})
                logits, data = make_case(tokens, vocab, k, device="cuda", dtype=dtype)
                grad_bytes = logits.numel() * logits.element_size()
                case = f"T={tokens},V={vocab},{str(dtype).split('.')[1]},k={k},zero_outside_topk={zero}"
                got, losses = {}, {}
                for method in ("seqpack", "torch"):
                    losses[method] = run(method, logits, data, loss_fn)[0]
                    got[method] = measure(lambda m=method: run(m, logits, data, loss_fn), repeat, grad_bytes, runs=2)
                    for key, value in (("ms_min", got[method][0]["min"] if got[method] else "oom"),
                                       ("extra_peak_mib", max(got[method][1]) if got[method] else "oom")):
                        log.add(case, method, key, value)
                rows.append([case, *ratio_row(got["seqpack"], got["torch"]), rel_diff(*losses.values())])
                del logits, data
                torch.cuda.empty_cache()
    return format_table(
        "distillation loss input + mixed KL, forward+backward on the GPU: seqpack vs NeMo-RL's log_softmax + gather",
        ["case", "seqpack ms", "torch ms", "seqpack / torch", "seqpack extra MiB", "torch extra MiB",
         "memory ratio", "loss rel diff"], rows,
        note="CUDA events, best of the runs; extra MiB = max_memory_allocated rise minus the [T, V] logits gradient "
             "both return, seqpack's worst of 2 runs against torch's best. torch upcasts bf16 logits to fp32 "
             "first, as NeMo-RL's loss does.")


def bench_linear_head(log, repeat, quick):
    """Issue 30 item 7 on the device: token_logprobs with weight= (LM head fused, tile
    workspaces) against F.linear + log_softmax + gather, bf16 head, extra peak memory
    of each of 4 runs; seqpack at its default chunk and at larger ``chunk_tokens``."""
    from bench_loss import linear_case, run_linear

    shapes = [(2048, 256, 32000)] if quick else [(8192, 4096, 151936), (16384, 4096, 151936)]
    chunks = (None, 1024) if quick else (None, 255, 2048)
    rows = []
    for tokens, hidden, vocab in shapes:
        h, w, ids, cu, targets, mask = linear_case(tokens, hidden, vocab)
        h, w = h.to("cuda", torch.bfloat16), w.to("cuda", torch.bfloat16)
        ids, targets, mask = ids.cuda(), targets.cuda(), mask.cuda()
        returned = (h.numel() + w.numel()) * h.element_size()
        case = f"T={tokens},H={hidden},V={vocab},bf16"
        runs = {}
        for method, chunk in [("torch", None)] + [("seqpack", c) for c in chunks if c is None or c < tokens]:
            name = method if method == "torch" else f"seqpack chunk={chunk or 'default'}"
            loss = run_linear(method, h, w, ids, cu, targets, mask, chunk)[0]
            got = measure(lambda m=method, c=chunk: run_linear(m, h, w, ids, cu, targets, mask, c), repeat,
                          returned, runs=4)
            runs[name] = (got, loss)
            if got:
                log.add(case, name, "ms_min", got[0]["min"])
                for i, mib in enumerate(got[1]):
                    log.add(case, name, f"extra_peak_mib_run{i}", mib)
        theirs, torch_loss = runs.pop("torch")
        for name, (ours, loss) in runs.items():
            spread = "/".join(f"{m:,.0f}" for m in ours[1]) if ours else "-"
            rows.append([case, name, *ratio_row(ours, theirs), spread, rel_diff(loss, torch_loss)])
        del h, w
        torch.cuda.empty_cache()
    return format_table(
        "LM head fused (token_logprobs, weight=) forward+backward on the GPU vs F.linear + log_softmax + gather",
        ["case", "seqpack", "seqpack ms", "torch ms", "seqpack / torch", "seqpack extra MiB", "torch extra MiB",
         "memory ratio", "seqpack MiB per run", "loss rel diff"], rows,
        note="CUDA events, best of the runs; extra MiB = max_memory_allocated rise minus the hidden and head "
             "gradients both return; 4 runs each, seqpack's worst against torch's best. torch upcasts the bf16 "
             "logits to fp32 before log_softmax. chunk = rows' worth of logits per tile (default on CUDA: about 2^26 logits); with fewer rows than vocabulary entries, tiles are vocabulary slices of every row.")


def check_sync_free_and_graph(log):
    """No host sync on the hot paths; a CUDA graph of static pack -> log-probs -> loss."""
    lines = []
    x = torch.randint(0, 1000, (64, 512), device="cuda")
    lens = case_lengths(64, 512)
    cu = torch.tensor([0, 300, 1000], dtype=torch.int32)
    logits = torch.randn(1000, 4096, device="cuda", requires_grad=True)
    ids = torch.randint(0, 4096, (1000,), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        packed = seqpack.pack_sequences(x, seq_lens=lens, pad_multiple=4)
        packed.unpack(packed["input"])
        lp, ent = seqpack.token_logprobs(logits, cu, ids, return_entropy=True)
        (lp.sum() + ent.sum()).backward()
        verdict = "no host synchronisation"
    except RuntimeError as e:
        verdict = f"SYNC: {e}"
    finally:
        torch.cuda.set_sync_debug_mode(0)
    lines.append(f"pack / unpack / log-probs fwd+bwd: {verdict}")
    log.add("sync_debug", "seqpack", "verdict", verdict)

    head = torch.nn.Linear(256, 4096, device="cuda")
    emb = torch.nn.Embedding(4096, 256, device="cuda")
    static_ids = torch.randint(0, 4096, (16, 256), device="cuda")
    static_lens = torch.randint(1, 257, (16,), device="cuda")

    # Device offsets with their padded form, nothing read back: the implementation's
    # signature (seqpack.token_logprobs takes no cu_seqlens_padded; a PackedLayout reads
    # its offsets on the host).
    from seqpack.training.logprobs import packed_token_logprobs

    def step():
        p = seqpack.pack_sequences_static({"input_ids": static_ids}, static_lens, max_tokens=16 * 256,
                                          pad_multiple=8)
        out = packed_token_logprobs(head(emb(p["input_ids"])), p["input_ids"], p.cu_seqlens, p.cu_seqlens_padded,
                                    return_entropy=True)
        return -out.logprobs.sum() - 0.01 * out.entropy.sum()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step()
    static_ids.copy_(torch.randint(0, 4096, (16, 256), device="cuda"))
    static_lens.copy_(torch.randint(1, 257, (16,), device="cuda"))
    graph.replay()
    eager = step()
    torch.cuda.synchronize()
    same = torch.allclose(static_loss, eager, rtol=1e-5)
    t_graph = cuda_time(graph.replay)["min"]
    t_eager = cuda_time(step)["min"]
    lines.append(f"CUDA graph of static pack -> log-probs -> loss: replay = eager: {same}; "
                 f"replay {t_graph:.3f} ms, eager {t_eager:.3f} ms")
    log.add("cuda_graph", "seqpack", "replay_equals_eager", same)
    log.add("cuda_graph", "replay", "ms_min", t_graph)
    log.add("cuda_graph", "eager", "ms_min", t_eager)
    return "\n".join(lines)


def tree_cases(quick):
    rng = np.random.default_rng(0)
    if quick:
        return [("GRPO G=8 2:1 (256/128) x2", *grpo_batch(rng, 2, 8, 256, 128)),
                ("SFT, nothing shared (128-512)", *sft_batch(rng, 8, 128, 512))]
    return [("GRPO G=8 2:1 (2048/1024) x4", *grpo_batch(rng, 4, 8, 2048, 1024)),
            ("GRPO G=8 1:2 (1024/2048) x4", *grpo_batch(rng, 4, 8, 1024, 2048)),
            ("GRPO G=16 2:1 (2048/1024) x2", *grpo_batch(rng, 2, 16, 2048, 1024)),
            ("SFT, nothing shared (1024-4096)", *sft_batch(rng, 24, 1024, 4096))]


def bench_prefix_trees(log, repeat, quick):
    """Forward + backward of one batch, plain packing vs the prefix tree (bf16)."""
    torch.manual_seed(0)
    dims = dict(hidden=256, heads=4, head_dim=64, ffn=688, layers=2) if quick else \
        dict(hidden=1024, heads=16, head_dim=64, ffn=2816, layers=4)
    vocab = 32000
    model = Model(vocab=vocab, **dims).to("cuda", torch.bfloat16)
    model.inv_freq = model.inv_freq.cuda()
    from seqpack.training.attention_tree import tree_attention_backends

    backends = [b for b in ("varlen", "sdpa") if tree_attention_backends()[b] == "available"]
    plain_backend = next((b for b in ("flash_attn", "torch_varlen") if seqpack.attention_backends()[b] == "available"),
                         "reference")
    rows_out = []
    for name, rows, groups in tree_cases(quick):
        m = seqpack.pack_prefix_tree(rows, group_ids=groups).metrics()

        def run(fn):
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            loss = fn()
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            grads = [p.grad.float() for p in model.parameters()]
            model.zero_grad(set_to_none=True)
            return loss, grads, peak

        def timed(fn):
            def step():
                fn()
                model.zero_grad(set_to_none=True)
            return cuda_time(step, repeat, 2)

        plain = lambda: plain_step(model, rows, "cuda")  # noqa: E731
        loss_p, grads_p, peak_p = run(plain)
        t_p = timed(plain)
        log.add(name, "plain", "ms_min", t_p["min"])
        log.add(name, "plain", "extra_peak_mib", peak_p)
        for backend in backends:
            tree = lambda: tree_step(model, rows, groups, "cuda", backend)  # noqa: E731
            loss_t, grads_t, peak_t = run(tree)
            loss_rel = abs(float(loss_t) - float(loss_p)) / abs(float(loss_p))
            grad_rel = max_rel_diff(grads_t, grads_p)
            t_t = timed(tree)
            impl = f"tree/{backend}"
            for key, value in (("ms_min", t_t["min"]), ("extra_peak_mib", peak_t), ("loss_rel_diff", loss_rel),
                               ("grad_max_rel_diff", grad_rel)):
                log.add(name, impl, key, value)
            rows_out.append([name, backend, m.logical_tokens, m.physical_tokens, t_p["min"], t_t["min"],
                             t_p["min"] / t_t["min"], peak_p, peak_t, loss_rel, grad_rel])
        log.add(name, "-", "logical_tokens", m.logical_tokens)
        log.add(name, "-", "physical_tokens", m.physical_tokens)
    return format_table(
        "Prefix trees on the GPU: fwd+bwd of one batch, plain packing vs the tree (bf16)",
        ["case", "tree attention", "logical tok", "physical tok", "plain ms", "tree ms", "speed-up",
         "plain extra MiB", "tree extra MiB", "loss rel diff", "grad max rel diff"], rows_out,
        note=f"Model: {dims['layers']} layers, hidden {dims['hidden']}, {dims['heads']} heads x {dims['head_dim']}, "
             f"SwiGLU {dims['ffn']}, vocab {vocab}, bf16 weights. plain: varlen_attention (auto: {plain_backend}) + "
             "token_logprobs; tree: pack_prefix_tree on the host (timed: a per-batch cost) + attention on the tree "
             "+ token_logprobs. CUDA events, best of the runs; extra MiB = max_memory_allocated rise of one step. "
             "Differences are bf16 rounding of two summation orders (relative, max over weights).")


def section(title, fn, *args):
    """Runs one section; a failure is printed and reported, the later sections still run."""
    try:
        print(fn(*args), flush=True)
        return True
    except Exception:  # noqa: BLE001 - a benchmark section's failure must not lose the others' numbers
        import traceback
        print(f"\n{title} FAILED:", flush=True)
        traceback.print_exc()
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--csv")
    parser.add_argument("--only", nargs="*", choices=["thd", "logprobs", "sync", "trees", "distillation", "linear"],
                        help="run these sections only (default: all)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    env = announce(gpu_environment(environment()), torch)
    log = CsvLog("gpu", env, args.csv)
    repeat = 5 if args.quick else 20
    cases = [(4096, 32000, torch.bfloat16, True)] if args.quick else [
        (t, v, d, e) for t in (16384, 65536) for v in (32000, 151936) for d in (torch.bfloat16, torch.float32)
        for e in (False, True)]
    sections = {
        "thd": ("pack/unpack", bench_thd, QUICK_SHAPES if args.quick else SHAPES, log, repeat),
        "logprobs": ("fused log-probs", bench_logprobs, cases, log, repeat),
        "sync": ("sync / CUDA graph", check_sync_free_and_graph, log),
        "trees": ("prefix trees", bench_prefix_trees, log, 3 if args.quick else 5, args.quick),
        "distillation": ("distillation", bench_distillation, log, 3 if args.quick else 10, args.quick),
        "linear": ("LM head fused", bench_linear_head, log, 3 if args.quick else 5, args.quick),
    }
    ok = [section(*sections[name]) for name in (args.only or sections)]
    print(f"\nwrote {log.write()}")
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
