"""docs/training.md: the one-process example runs (config -> shards -> packed
micro-batches -> fused loss -> optimizer step) and trains on every token."""

import pathlib
import re

import torch


def test_training_guide_example_runs():
    root = pathlib.Path(__file__).resolve().parents[2]
    block = re.findall(r"```python\n(.*?)```", (root / "docs" / "training.md").read_text(), re.S)[0]
    torch.manual_seed(0)
    namespace: dict = {}
    exec(block, namespace)
    shard = namespace["shards"][0].get_batch(0)
    packed = sum(int(mb.cu_seqlens[-1]) for mb in shard.make_packed_microbatch_iterator(["input_ids"]))
    assert packed == int(namespace["lengths"].sum())  # every real token in exactly one micro-batch
    assert torch.isfinite(namespace["loss"])
    assert all(p.grad is not None for p in namespace["model"].parameters())
