"""The loss, training-step, boundary, THD, step-planning, TRL, TRL GRPO, AutoModel, prefix-tree, forest-planning, tree-step,
distillation, DPO, CP-planning, streaming and prefix-reuse benchmark
scripts still run (``--quick``: tiny sizes, a smoke test; their numbers come from full runs recorded in
benchmarks/RESULTS.md)."""

import concurrent.futures
import os
import pathlib
import subprocess
import sys

import pytest

import seqpack

ROOT = pathlib.Path(__file__).resolve().parents[2]


SCRIPTS = [("bench_loss.py", "Packed SFT loss"), ("bench_train.py", "Training step"),
           ("bench_boundary.py", "Small calls through the boundary"),
           ("bench_thd.py", "THD pack / unpack on the CPU"),
           ("bench_step.py", "Simulated step time"),
           ("bench_trl.py", "TRL pack_dataset"),
           ("bench_trl_grpo.py", "TRL GRPO log-probs"),
           ("bench_automodel.py", "AutoModel pack_dataset"),
           ("bench_prefix_tree.py", "Prefix-tree packing vs plain packing"),
           ("bench_forest_planning.py", "Tree-aware planning"),
           ("bench_tree_chain.py", "Chains of rows"),
           ("bench_tree_step.py", "GRPO training step, plain packing vs prefix trees"),
           ("bench_distillation.py", "Distillation loss input + mixed KL"),
           ("bench_dpo.py", "DPO training step, padded vs packed pairs"),
           ("bench_cp_step.py", "Hybrid context parallelism"),
           ("bench_hybrid_cp.py", "Hybrid context parallelism, measured"),
           ("bench_stream.py", "Streaming packing for asynchronous RL"),
           ("bench_stream_memory.py", "Step shapes and the CUDA caching allocator"),
           ("bench_prefix_reuse.py", "Prefix reuse"),
           ("bench_trl_window.py", "TRL GRPO optimizer step, groups larger than the per-device batch"),
           ("bench_moe_tree.py", "MoE GRPO batch with the load-balancing loss"),
           ("bench_vlm_tree.py", "VLM GRPO batch (Qwen2-VL)")]


def _quick_run(script, tmp_dir):
    # The scripts import the same seqpack as this test (installed, or the source tree).
    here = str(pathlib.Path(seqpack.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    csv = pathlib.Path(tmp_dir) / f"{script}.csv"
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--quick", "--csv", str(csv)], env=env,
                         capture_output=True, text=True, timeout=600)
    return out, csv


@pytest.fixture(scope="module")
def quick_runs(request, tmp_path_factory):
    """The selected scripts' quick runs, two at a time (each uses one core: torch
    threads = 1, and much of a run is importing torch in children)."""
    wanted = [s for s, _ in SCRIPTS if any(f"[{s}-" in item.nodeid for item in request.session.items)]
    tmp_dir = tmp_path_factory.mktemp("bench")
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(wanted, pool.map(lambda s: _quick_run(s, tmp_dir), wanted)))


@pytest.mark.parametrize("script, title", SCRIPTS)
def test_quick_run_prints_its_table(script, title, quick_runs):
    out, csv = quick_runs[script]
    assert out.returncode == 0, out.stderr[-2000:]
    assert title in out.stdout and csv.stat().st_size > 0


def test_prefix_reuse_ends_with_its_summary_line(quick_runs, tmp_path):
    # Issue 52: the quick run's last line, with the fp64 gradient check in it.
    import re

    out, _ = quick_runs.get("bench_prefix_reuse.py") or _quick_run("bench_prefix_reuse.py", tmp_path)
    last = out.stdout.strip().splitlines()[-1]
    match = re.fullmatch(r"prefix reuse: tokens ([\d.]+) of the split plan, step ([\d.]+)x faster, peak memory "
                         r"([\d.]+) of the split plan, max grad diff ([\d.e+-]+)", last)
    assert match, last
    assert float(match.group(1)) < 1 and float(match.group(4)) < 1e-9


def test_gpu_benchmark_imports_and_says_when_there_is_no_device(tmp_path):
    # bench_gpu.py runs only on a GPU (scripts/gpu_check.sh); here: it imports its
    # helpers from bench_thd.py and says what it did not measure.
    import torch

    here = str(pathlib.Path(seqpack.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py"), "--quick", "--csv",
                          str(tmp_path / "gpu.csv")], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    if not torch.cuda.is_available():
        assert "no CUDA device: nothing to measure" in out.stdout
