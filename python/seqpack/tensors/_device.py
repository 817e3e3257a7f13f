"""Host metadata onto a device without stalling it, and the choice between
seqpack's CUDA kernels and the PyTorch path. Imported with the tensor API (torch).
"""

from __future__ import annotations

import functools
import warnings
from typing import List, Optional, Sequence

import numpy as np
import torch
from torch.utils.dlpack import to_dlpack

from .. import _core
from .._lengths import check_not_meta, round_up, type_name

_ALIGN = 16  # bytes: every segment of the pinned buffer starts 16-byte aligned (vector loads)


def check_tensor(x, name: str) -> torch.Tensor:
    """``x`` if it is a torch tensor holding data: anything else (a NumPy array,
    a list, ``None``) is a ``TypeError`` naming its type, and a tensor on the meta
    device (a shape without values) a ``ValueError``. The one check of every tensor
    argument of the tensor and training APIs.

        >>> check_tensor(np.zeros(2), "x")
        Traceback (most recent call last):
        ...
        TypeError: x must be a torch.Tensor (convert with torch.as_tensor), got numpy.ndarray
    """
    if not isinstance(x, torch.Tensor):
        hint = " (convert with torch.as_tensor)" if isinstance(x, np.ndarray) else ""
        raise TypeError(f"{name} must be a torch.Tensor{hint}, got {type_name(x)}")
    check_not_meta(x, name)
    return x


def dlpack(t: Optional[torch.Tensor]):
    """``t`` as the DLPack capsule the extension reads (``None`` stays ``None``).
    The binding checks shape, dtype, strides and device from it. ``to_dlpack`` costs
    0.2 us a tensor where ``Tensor.__dlpack__`` costs about 4 us with its device
    query (measured, torch 2.13 CPU): the fast path for the many small calls."""
    return None if t is None else to_dlpack(t)


def host_to_device(arrays: Sequence[np.ndarray], device: torch.device) -> List[torch.Tensor]:
    """Host arrays as tensors on ``device`` with one copy and no host synchronisation.

    On CUDA the arrays are packed into one pinned buffer (16-byte aligned segments)
    and copied with ``non_blocking=True`` on the current stream; each result is a
    view of the one device buffer. The pinned block comes from PyTorch's caching
    host allocator, which records the copy on the stream and hands the block out
    again only after that copy has completed, so dropping it here is safe. (A
    ``.to(device)`` from pageable memory would wait for the whole stream.)
    On the CPU the arrays are wrapped without a copy.

        >>> import numpy as np, torch
        >>> [t.tolist() for t in host_to_device([np.arange(3), np.zeros(2, np.int32)], torch.device("cpu"))]
        [[0, 1, 2], [0, 0]]
    """
    arrays = [np.ascontiguousarray(a) for a in arrays]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        # A captured copy would replay from a pinned block the allocator may have
        # handed out again: silently wrong metadata. Static shapes do not need it.
        raise RuntimeError("seqpack: host metadata cannot be copied inside CUDA-graph capture; use "
                           "pack_sequences_static and device int32 cu_seqlens for captured steps")
    if device.type != "cuda":
        return [torch.from_numpy(a if a.flags.writeable else a.copy()).to(device) for a in arrays]
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += round_up(a.nbytes, _ALIGN)
    host = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=True)
    staging = host.numpy()
    for a, off in zip(arrays, offsets):
        staging[off: off + a.nbytes] = a.reshape(-1).view(np.uint8)
    dev = host.to(device, non_blocking=True)
    return [dev[off: off + a.nbytes].view(torch.from_numpy(a[:0].reshape(-1)).dtype).view(a.shape)
            for a, off in zip(arrays, offsets)]


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; a CPU tensor bound for CUDA goes through one pinned
    non-blocking copy (:func:`host_to_device`) instead of a synchronising one."""
    if t.device == device:
        return t
    if t.device.type == "cpu" and device.type == "cuda" and not torch.compiler.is_compiling():
        return host_to_device([t.detach().contiguous().numpy()], device)[0]
    return t.to(device)


@functools.lru_cache(maxsize=1)
def _cuda_kernels_missing() -> Optional[str]:
    if not _core.built_with_cuda:
        return "this build of seqpack has no CUDA kernels (nvcc was not found when it was built)"
    if _core.cuda_device_count() <= 0:
        return (f"seqpack's CUDA runtime ({_core.cuda_runtime_version()}) sees no device although PyTorch does "
                f"(a driver older than the runtime?)")
    return None


def cuda_kernels(device: torch.device) -> bool:
    """True when seqpack's CUDA kernels run on ``device``; for a CUDA device they
    cannot run on, warns once (the PyTorch path is used instead)."""
    if device.type != "cuda":
        return False
    reason = _cuda_kernels_missing()
    if reason is not None:
        _warn_once(reason)
    return reason is None


@functools.lru_cache(maxsize=None)
def _warn_once(reason: str) -> None:
    warnings.warn(f"seqpack: {reason}; CUDA tensors take the slower PyTorch path", RuntimeWarning, stacklevel=3)
