"""The loss, training-step, boundary, THD, step-planning, TRL, TRL GRPO, AutoModel, prefix-tree, forest-planning, tree-step,
distillation and DPO benchmark
scripts still run (``--quick``: tiny sizes, a smoke test; their numbers come from full runs recorded in
benchmarks/RESULTS.md)."""

import os
import pathlib
import subprocess
import sys

import pytest

import seqpack

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script, title", [("bench_loss.py", "Packed SFT loss"), ("bench_train.py", "Training step"),
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
                                           ("bench_dpo.py", "DPO training step, padded vs packed pairs")])
def test_quick_run_prints_its_table(script, title, tmp_path):
    # The scripts import the same seqpack as this test (installed, or the source tree).
    here = str(pathlib.Path(seqpack.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--quick", "--csv",
                          str(tmp_path / "out.csv")], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert title in out.stdout and (tmp_path / "out.csv").stat().st_size > 0


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
