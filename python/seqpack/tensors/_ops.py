"""The torch operators behind seqpack.thd: ``seqpack::pack`` and ``seqpack::unpack``.

Registered with ``torch.library.custom_op`` (with fake implementations, so
``torch.compile`` traces through them, and autograd formulas: pack is a gather,
unpack the matching scatter, each the other's backward). Their plans travel as
CPU int64 tensors of row runs, so the ops are plain functions of tensors:

    copies [n, 3]: (src row, dst row, rows)     fills [n, 2]: (dst row, rows)

The fill is a ``Scalar`` (``torch.types.Number``): an integer pad reaches an
integer tensor exactly (a ``float`` would round 2**53 + 1, and 2**63 - 1 to
-2**63); :func:`check_fill` validates it against the tensor's dtype first.

``pack_rows`` / ``unpack_rows`` are what seqpack.thd calls: for plain tensors that
need no gradient, outside ``torch.compile`` and dispatch modes, they run the
plan's kernels directly (the operator dispatch costs ~10 µs, as much as a small
copy); otherwise they go through the registered operators.

Imported on first use of the tensor API; ``import seqpack`` does not import torch.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence, Tuple, Union

import numpy as np
import torch
from torch.types import Number
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .. import _core
from .._lengths import item_of, type_name
from ._device import cuda_kernels, dlpack, host_to_device

# Bytes per device task: big enough to amortise a thread block's start, small
# enough that a long sequence spreads over many blocks.
MAX_TASK_BYTES = 1 << 16


def check_fill(value: Any, dtype: torch.dtype, name: str) -> Union[int, float, bool, complex]:
    """``value`` as the pad of a ``dtype`` tensor, exactly: an ``int`` for integer
    and bool dtypes (integral floats such as ``-100.0`` are accepted; it must lie in
    the dtype's range), a ``float`` (any, ``-inf`` and NaN included) for floating
    dtypes.

    Raises:
        TypeError: ``value`` is not a number (a string, ``None``).
        ValueError: for an integer or bool dtype, a non-integral value (1.5, NaN,
            inf) or one outside ``torch.iinfo(dtype)`` (bool: 0 and 1).

    >>> check_fill(2**53 + 1, torch.int64, "pad_value")
    9007199254740993
    >>> check_fill(256, torch.uint8, "pad_value")
    Traceback (most recent call last):
    ...
    ValueError: pad_value = 256 is outside torch.uint8's range [0, 255]
    """
    value = item_of(value, name)  # a 0-d array or tensor: the number it holds
    if not isinstance(value, (bool, int, float, np.bool_, np.integer, np.floating)):
        if isinstance(value, (complex, np.complexfloating)) and dtype.is_complex:
            return complex(value)
        raise TypeError(f"{name} must be a number, got {type_name(value)}")
    if dtype.is_floating_point or dtype.is_complex:
        try:
            return float(value)
        except OverflowError:
            raise ValueError(f"{name} = {value} does not fit in a float ({dtype})") from None
    if isinstance(value, (float, np.floating)):
        if not (math.isfinite(value) and float(value).is_integer()):
            raise ValueError(f"{name} must be an integer for {dtype}, got {value}")
    value = int(value)
    low, high = (0, 1) if dtype == torch.bool else (torch.iinfo(dtype).min, torch.iinfo(dtype).max)
    if not low <= value <= high:
        raise ValueError(f"{name} = {value} is outside {dtype}'s range [{low}, {high}]")
    return bool(value) if dtype == torch.bool else value


def _fill_bytes(dtype: torch.dtype, trailing: Tuple[int, ...], fill: Number) -> bytes:
    """One padded row of ``fill`` as raw bytes."""
    # Cached by the fill's type and repr as well: 0.0 == -0.0 and 1 == 1.0 == True hash alike.
    return _fill_row(dtype, trailing, type(fill), repr(fill), fill)


@functools.lru_cache(maxsize=256)
def _fill_row(dtype: torch.dtype, trailing: Tuple[int, ...], kind: type, text: str, fill: Number) -> bytes:
    return torch.full((1, *trailing), fill, dtype=dtype).view(torch.uint8).numpy().tobytes()


def _move(src: torch.Tensor, move, out_shape: Sequence[int], trailing: Sequence[int], src_rows: int,
          dst_rows: int, fill: Number, num_threads: int) -> torch.Tensor:
    """Rows of ``src`` into a new ``out_shape`` tensor. ``move`` is a pair of run
    tensors ``(copies, fills)``, or (CPU only) a plan's ``pack_into``/``unpack_into``."""
    src = src.contiguous()
    out = torch.empty(tuple(out_shape), dtype=src.dtype, device=src.device)
    row_bytes = math.prod(trailing) * src.element_size()
    if row_bytes == 0 or dst_rows == 0:
        return out  # nothing to move (e.g. a zero-size trailing dimension)
    fill_row = _fill_bytes(src.dtype, tuple(trailing), fill)
    src_lead, dst_lead = src.dim() - len(trailing), len(out_shape) - len(trailing)
    if src.device.type == "cpu":
        if callable(move):
            move(dlpack(src), dlpack(out), fill_row, num_threads)
        else:
            _core.move_rows(move[0].numpy(), move[1].numpy(), dlpack(src), src_lead, dlpack(out), dst_lead,
                            fill=fill_row, num_threads=num_threads)
        return out
    copies, fills = move
    if not cuda_kernels(src.device):
        return _move_torch(src, copies.numpy(), out, src_rows, dst_rows, fill)
    # CUDA: the runs become byte tasks on the host; tasks and fill row reach the
    # device in one pinned non-blocking copy, and one kernel runs them on the
    # current stream. Nothing waits on the host.
    tasks = _core.byte_tasks(copies.numpy(), fills.numpy(), src_rows, dst_rows, row_bytes, MAX_TASK_BYTES)
    task_device, fill_device = host_to_device([tasks, np.frombuffer(fill_row, dtype=np.uint8)], src.device)
    with torch.cuda.device(src.device):
        _core.cuda_move(dlpack(src), src_lead, dlpack(out), dst_lead, dlpack(task_device), dlpack(fill_device),
                        torch.cuda.current_stream(src.device).cuda_stream)
    return out


def _move_torch(src: torch.Tensor, copies: np.ndarray, out: torch.Tensor, src_rows: int, dst_rows: int,
                fill: Number) -> torch.Tensor:
    """The same move in PyTorch ops (a row index on the host, a gather on the
    device), for CUDA tensors where seqpack's kernels cannot run."""
    index = np.full(dst_rows, -1, dtype=np.int64)
    counts = copies[:, 2]
    if counts.sum():
        within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        index[np.repeat(copies[:, 1], counts) + within] = np.repeat(copies[:, 0], counts) + within
    (rows,) = host_to_device([index], src.device)
    flat = src.reshape(src_rows, -1)
    gathered = flat.index_select(0, rows.clamp(min=0))
    value = torch.full((), fill, dtype=src.dtype, device=src.device)
    out.view(dst_rows, -1).copy_(torch.where(rows[:, None] >= 0, gathered, value))
    return out


def _pack_impl(x, move, rows, fill, num_threads):
    trailing = tuple(x.shape[2:])
    return _move(x, move, (rows, *trailing), trailing, x.shape[0] * x.shape[1], rows, fill, num_threads)


def _unpack_impl(y, move, batch, width, fill, num_threads):
    trailing = tuple(y.shape[1:])
    return _move(y, move, (batch, width, *trailing), trailing, y.shape[0], batch * width, fill, num_threads)


@torch.library.custom_op("seqpack::pack", mutates_args=())
def pack(x: torch.Tensor, pack_copies: torch.Tensor, pack_fills: torch.Tensor, unpack_copies: torch.Tensor,
         unpack_fills: torch.Tensor, rows: int, fill: Number, num_threads: int) -> torch.Tensor:
    """``[B, S, ...] -> [rows, ...]`` by the pack runs (the unpack runs serve the backward)."""
    return _pack_impl(x, (pack_copies, pack_fills), rows, fill, num_threads)


@pack.register_fake
def _pack_fake(x, pack_copies, pack_fills, unpack_copies, unpack_fills, rows, fill, num_threads):
    return x.new_empty((rows, *x.shape[2:]))


@torch.library.custom_op("seqpack::unpack", mutates_args=())
def unpack(y: torch.Tensor, pack_copies: torch.Tensor, pack_fills: torch.Tensor, unpack_copies: torch.Tensor,
           unpack_fills: torch.Tensor, batch: int, width: int, fill: Number, num_threads: int) -> torch.Tensor:
    """``[rows, ...] -> [batch, width, ...]`` by the unpack runs."""
    return _unpack_impl(y, (unpack_copies, unpack_fills), batch, width, fill, num_threads)


@unpack.register_fake
def _unpack_fake(y, pack_copies, pack_fills, unpack_copies, unpack_fills, batch, width, fill, num_threads):
    return y.new_empty((batch, width, *y.shape[1:]))


def _runs(ctx) -> Tuple[torch.Tensor, ...]:
    return ctx.saved_tensors


def _pack_setup(ctx, inputs, output):
    x, pc, pf, uc, uf, rows, fill, num_threads = inputs
    ctx.save_for_backward(pc, pf, uc, uf)
    ctx.batch, ctx.width, ctx.num_threads = x.shape[0], x.shape[1], num_threads


def _pack_backward(ctx, grad):
    return (unpack(grad, *_runs(ctx), ctx.batch, ctx.width, 0.0, ctx.num_threads),) + (None,) * 7


def _unpack_setup(ctx, inputs, output):
    y, pc, pf, uc, uf, batch, width, fill, num_threads = inputs
    ctx.save_for_backward(pc, pf, uc, uf)
    ctx.rows, ctx.num_threads = y.shape[0], num_threads


def _unpack_backward(ctx, grad):
    return (pack(grad, *_runs(ctx), ctx.rows, 0.0, ctx.num_threads),) + (None,) * 8


torch.library.register_autograd("seqpack::pack", _pack_backward, setup_context=_pack_setup)
torch.library.register_autograd("seqpack::unpack", _unpack_backward, setup_context=_unpack_setup)


def _direct(x: torch.Tensor) -> bool:
    """True when calling the kernel directly is indistinguishable from the operator."""
    return (type(x) is torch.Tensor and not (x.requires_grad and torch.is_grad_enabled())
            and not torch.compiler.is_compiling() and _get_current_dispatch_mode() is None
            and not torch._C._is_torch_function_mode_enabled())


def pack_rows(x: torch.Tensor, plan, runs: Callable[[], Tuple[torch.Tensor, ...]], fill: Number,
              num_threads: int) -> torch.Tensor:
    """``seqpack::pack`` of ``x`` by a ThdPlan (``runs()`` gives its four run tensors)."""
    if _direct(x):
        return _pack_impl(x, plan.pack_into if x.device.type == "cpu" else runs()[:2], plan.local_rows, fill,
                          num_threads)
    return pack(x, *runs(), plan.local_rows, fill, num_threads)


def unpack_rows(y: torch.Tensor, plan, runs: Callable[[], Tuple[torch.Tensor, ...]], fill: Number,
                num_threads: int) -> torch.Tensor:
    """``seqpack::unpack`` of ``y`` by a ThdPlan (``runs()`` gives its four run tensors)."""
    if _direct(y):
        return _unpack_impl(y, plan.unpack_into if y.device.type == "cpu" else runs()[2:], plan.batch, plan.width,
                            fill, num_threads)
    return unpack(y, *runs(), plan.batch, plan.width, fill, num_threads)
