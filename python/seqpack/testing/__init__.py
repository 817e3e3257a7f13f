"""Test oracles, like :mod:`torch.testing`: :mod:`~seqpack.testing.reference` (plain
Python implementations of every planner, to compare with),
:mod:`~seqpack.testing.pipelines` (how RL frameworks plan a step today),
:mod:`~seqpack.testing.step_simulator` (the step time of such a plan),
:mod:`~seqpack.testing.distributions` (synthetic long-tailed
lengths), :mod:`~seqpack.testing.tiny_model` (a small Llama-shaped model
that trains on packed or padded batches; imports torch) and
:mod:`~seqpack.testing.tiny_vlm` (tiny Qwen-VL models and GRPO batches with images,
built offline; imports torch and transformers)."""

from .._lazy import submodules

__getattr__ = submodules(__name__, ("distributions", "pipelines", "reference", "step_simulator", "tiny_model",
                                       "tiny_vlm"))
