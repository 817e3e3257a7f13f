"""The torch operators behind seqpack.thd: ``seqpack::pack`` and ``seqpack::unpack``.

Registered with ``torch.library.custom_op`` (with fake implementations, so
``torch.compile`` traces through them, and autograd formulas: pack is a gather,
unpack the matching scatter, each the other's backward). Their plans travel as
CPU int64 tensors of row runs, so the ops are plain functions of tensors:

    copies [n, 3]: (src row, dst row, rows)     fills [n, 2]: (dst row, rows)

Imported on first use of the tensor API; ``import seqpack`` does not import torch.
"""

from __future__ import annotations

import math
from typing import Sequence, Tuple

import torch

from . import _core

# Bytes per device task: big enough to amortise a thread block's start, small
# enough that a long sequence spreads over many blocks.
MAX_TASK_BYTES = 1 << 16


def _move(src: torch.Tensor, copies: torch.Tensor, fills: torch.Tensor, out_shape: Sequence[int],
          trailing: Sequence[int], src_rows: int, dst_rows: int, fill: float, num_threads: int) -> torch.Tensor:
    src = src.contiguous()
    out = torch.empty(tuple(out_shape), dtype=src.dtype, device=src.device)
    row_bytes = math.prod(trailing) * src.element_size()
    fill_row = torch.full((1, *trailing), fill, dtype=src.dtype)
    copies_np, fills_np = copies.cpu().numpy(), fills.cpu().numpy()
    if src.device.type == "cpu":
        _core.move_rows(copies_np, fills_np, src.data_ptr(), src_rows, out.data_ptr(), dst_rows, row_bytes,
                        fill=fill_row.view(torch.uint8).numpy().tobytes(), num_threads=num_threads)
        return out
    # CUDA: the runs become byte tasks on the host, go to the device with the fill
    # row, and one kernel runs them on the current stream; nothing is read back.
    tasks = _core.byte_tasks(copies_np, fills_np, src_rows, dst_rows, row_bytes, MAX_TASK_BYTES)
    with torch.cuda.device(src.device):
        task_tensor = torch.from_numpy(tasks).to(src.device)
        fill_device = fill_row.to(src.device)
        _core.cuda_move(src.data_ptr(), out.data_ptr(), task_tensor.data_ptr(), tasks.shape[0],
                        fill_device.data_ptr(), row_bytes, torch.cuda.current_stream(src.device).cuda_stream)
    return out


@torch.library.custom_op("seqpack::pack", mutates_args=())
def pack(x: torch.Tensor, pack_copies: torch.Tensor, pack_fills: torch.Tensor, unpack_copies: torch.Tensor,
         unpack_fills: torch.Tensor, rows: int, fill: float, num_threads: int) -> torch.Tensor:
    """``[B, S, ...] -> [rows, ...]`` by the pack runs (the unpack runs serve the backward)."""
    trailing = tuple(x.shape[2:])
    return _move(x, pack_copies, pack_fills, (rows, *trailing), trailing, x.shape[0] * x.shape[1], rows, fill,
                 num_threads)


@pack.register_fake
def _pack_fake(x, pack_copies, pack_fills, unpack_copies, unpack_fills, rows, fill, num_threads):
    return x.new_empty((rows, *x.shape[2:]))


@torch.library.custom_op("seqpack::unpack", mutates_args=())
def unpack(y: torch.Tensor, pack_copies: torch.Tensor, pack_fills: torch.Tensor, unpack_copies: torch.Tensor,
           unpack_fills: torch.Tensor, batch: int, width: int, fill: float, num_threads: int) -> torch.Tensor:
    """``[rows, ...] -> [batch, width, ...]`` by the unpack runs."""
    trailing = tuple(y.shape[1:])
    return _move(y, unpack_copies, unpack_fills, (batch, width, *trailing), trailing, y.shape[0], batch * width,
                 fill, num_threads)


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
