"""Which kernel :func:`~seqpack.varlen_attention` runs: its backends, whether each
can run here (:func:`attention_backends`) and the choice for given inputs
(:func:`pick_backend`); the CP, Ulysses and tree attention functions choose theirs
the same way.

Importing this module does not import torch.
"""

from __future__ import annotations

import functools
import inspect
from typing import Dict, Optional

__all__ = ["BACKENDS", "attention_backends", "flash_attn_varlen_func", "pick_backend", "torch_varlen_attn",
           "torch_varlen_params", "why_unavailable"]

BACKENDS = ("flash_attn", "torch_varlen", "flex", "reference")


def _torch():
    import torch

    return torch


def flash_attn_varlen_func():
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func


def torch_varlen_attn():
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn


@functools.lru_cache(maxsize=None)
def why_unavailable(name: str) -> Optional[str]:
    """None when ``name`` can run here, else the reason it cannot (found once per
    process: ``auto`` asks on every call)."""
    torch = _torch()
    if name == "reference":
        return None
    if name == "flex":
        try:
            import torch.nn.attention.flex_attention  # noqa: F401
        except ImportError as e:
            return f"torch.nn.attention.flex_attention not importable ({e})"
        return None
    try:
        flash_attn_varlen_func() if name == "flash_attn" else torch_varlen_attn()
    except ImportError as e:
        return f"not importable ({e})"
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    return None


def attention_backends() -> Dict[str, str]:
    """Every backend of :func:`varlen_attention` and whether it can run here.

    >>> import seqpack
    >>> seqpack.attention_backends()["reference"]
    'available'
    """
    return {name: (why_unavailable(name) or "available") for name in BACKENDS}


def pick_backend(backend: str, q, window, causal) -> str:
    torch = _torch()
    if backend != "auto":
        if backend not in BACKENDS:
            raise ValueError(f"backend must be 'auto' or one of {BACKENDS}, got {backend!r}")
        why = why_unavailable(backend)
        if why is not None:
            raise ValueError(f"attention backend {backend!r} is not available: {why}")
        if backend == "flex" and q.device.type == "cpu" and torch.is_grad_enabled() and q.requires_grad:
            raise ValueError("attention backend 'flex' has no backward on the CPU (PyTorch's FlexAttention); use "
                             "'reference' for training on the CPU")
        if backend in ("flash_attn", "torch_varlen") and (q.device.type != "cuda"
                                                           or q.dtype not in (torch.float16, torch.bfloat16)):
            raise ValueError(f"attention backend {backend!r} needs CUDA fp16/bf16 tensors, got {q.device} {q.dtype}")
        return backend
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16):
        for name in ("flash_attn", "torch_varlen"):
            if why_unavailable(name) is None and (name == "flash_attn" or torch_varlen_supports(window, causal)):
                return name
    return "reference"


@functools.lru_cache(maxsize=1)
def torch_varlen_params() -> frozenset:
    """Keyword names of this PyTorch's varlen_attn (read once: it changed across releases)."""
    return frozenset(inspect.signature(torch_varlen_attn()).parameters)


def torch_varlen_supports(window, causal) -> bool:
    params = torch_varlen_params()
    return "window_size" in params or window == (-1, 0 if causal else -1)
