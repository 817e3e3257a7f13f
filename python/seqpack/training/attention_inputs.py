"""What every attention function of seqpack checks and derives from its arguments
(varlen, CP, Ulysses and tree attention share these rules): q / k / v shapes,
dtypes and devices, the autocast cast, the softmax scale and the window.

    >>> import torch
    >>> q = torch.zeros(5, 4, 8)
    >>> softmax_scale(None, q), check_qkv(q, q[:, :2], q[:, :2], None, True)
    (0.3535533905932738, (-1, 0))

Importing this module does not import torch.
"""

from __future__ import annotations

from typing import Any, Tuple

from .._lengths import as_int64, as_real

__all__ = ["check_qkv", "follow_autocast", "softmax_scale", "window"]


def _torch():
    import torch

    return torch


def follow_autocast(q, k, v):
    """q, k and v as ``torch.nn.functional.scaled_dot_product_attention`` takes them
    under ``torch.autocast`` for q's device type (SDPA is on autocast's lower-precision
    list): float32 / float16 / bfloat16 tensors on that device type in the autocast
    dtype (float64 and other devices' tensors as they are, as autocast leaves them),
    so the attention computes in, and returns, the autocast dtype. Outside autocast
    (or for non-tensors, left to the checks) unchanged: mismatched dtypes raise."""
    torch = _torch()
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return q, k, v
    device = q.device.type
    try:
        if not torch.is_autocast_enabled(device):
            return q, k, v
        dtype = torch.get_autocast_dtype(device)
    except (RuntimeError, TypeError, AttributeError):  # a device type without autocast
        return q, k, v
    castable = (torch.float32, torch.float16, torch.bfloat16)
    return tuple(t.to(dtype) if t.dtype in castable and t.device.type == device else t for t in (q, k, v))


def check_qkv(q, k, v, window_size, causal) -> Tuple[int, int]:
    """The argument rules of the attention functions; returns the ``(left, right)``
    window (``right`` is 0 when causal)."""
    from ..tensors._device import check_tensor

    for name, t in (("q", q), ("k", k), ("v", v)):
        if check_tensor(t, name).dim() != 3:
            raise ValueError(f"{name} must be a [T, H, D] tensor, got {tuple(t.shape)}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
        if t.shape[1] == 0:
            raise ValueError(f"{name} must have at least one head, got shape {tuple(t.shape)} (H = 0)")
    if q.shape[2] == 0:
        raise ValueError(f"the head dim D must be positive, got q of shape {tuple(q.shape)}")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k and v must have the same rows and heads, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must have the same head dim, got {q.shape[2]} and {k.shape[2]}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of k/v heads ({k.shape[1]}) (GQA)")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must share dtype and device (under torch.autocast they are cast to its dtype "
                         f"first), got {q.dtype} / {k.dtype} / {v.dtype} on {q.device} / {k.device} / {v.device}")
    left, right = window(window_size)
    return left, (0 if causal else right)


def softmax_scale(softmax_scale: Any, q) -> float:
    """``softmax_scale`` as a float (any finite number, as flash-attn takes it; any
    NumPy or 0-d tensor number), by default ``1 / sqrt(D)``."""
    if softmax_scale is None:
        return q.shape[2] ** -0.5
    return as_real(softmax_scale, "softmax_scale")


def window(window_size: Any) -> Tuple[int, int]:
    """``window_size`` as ``(left, right)`` ints >= -1; ``None`` is no window,
    ``(-1, -1)``, as flash-attn's default."""
    if window_size is None:
        return -1, -1
    if isinstance(window_size, (str, bytes)) or not hasattr(window_size, "__len__") or len(window_size) != 2:
        raise TypeError(f"window_size must be a (left, right) pair of ints (-1: unbounded) or None, got "
                        f"{window_size!r}")
    left, right = (as_int64(w, f"window_size[{i}]") for i, w in enumerate(window_size))
    if left < -1 or right < -1:
        raise ValueError(f"window_size must be (left, right) with each >= -1, got {tuple(window_size)}")
    return left, right
