"""seqpack.thd on CUDA tensors: the device kernels against the CPU executor and
against the same rows gathered with PyTorch indexing.

Marked ``gpu``: skipped where PyTorch sees no CUDA device, failed where it sees one
but seqpack's CUDA kernels cannot run (conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import seqpack
from seqpack import alignment, pack_sequences

pytestmark = pytest.mark.gpu

DTYPES = [torch.int64, torch.int32, torch.bool, torch.float32, torch.bfloat16, torch.uint8]
HIDDEN = [(), (1,), (3,), (8,), (4096,)]  # row sizes that are, and are not, 16-byte multiples


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_cuda_matches_cpu(dtype, hidden, cp):
    g = torch.Generator().manual_seed(cp * 7 + len(hidden))
    batch, width = 6, 64
    mask = torch.rand(batch, width, generator=g) < 0.6
    mask[0] = False
    mask[1, :] = True
    x = (torch.randn(batch, width, *hidden, generator=g) * 50).to(dtype)
    kwargs = dict(attention_mask=mask, pad_multiple=alignment(cp_size=cp) * 2, pad_packed_multiple=2 * cp * 16,
                  pad_value=True if dtype == torch.bool else 5)
    for rank in range(cp):
        cpu = pack_sequences({"x": x}, cp_size=cp, cp_rank=rank, **kwargs)
        gpu = pack_sequences({"x": x.cuda()}, cp_size=cp, cp_rank=rank, **{**kwargs, "attention_mask": mask.cuda()})
        torch.cuda.synchronize()
        assert gpu["x"].is_cuda and torch.equal(gpu["x"].cpu(), cpu["x"])
        assert torch.equal(gpu.position_ids.cpu(), cpu.position_ids)
        assert torch.equal(gpu.cu_seqlens_padded.cpu(), cpu.cu_seqlens_padded)
        fill = True if dtype == torch.bool else 3
        assert torch.equal(gpu.unpack(gpu["x"], fill=fill).cpu(), cpu.unpack(cpu["x"], fill=fill))


def test_cuda_gradients_and_stream():
    h = torch.randn(4, 32, 16, device="cuda", requires_grad=True)
    lens = [32, 5, 0, 17]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        packed = pack_sequences({"h": h}, seq_lens=lens, pad_multiple=8)
        (packed["h"] ** 2).sum().backward()
    stream.synchronize()
    expected = 2 * h.detach()
    for b, n in enumerate(lens):
        expected[b, n:] = 0
    assert torch.allclose(h.grad, expected)


def test_cuda_large_hidden_states():
    # One long sequence spans many 64 KiB tasks; bf16 rows of 8 KiB take 16-byte accesses.
    x = torch.randn(8, 4096, 4096, dtype=torch.bfloat16, device="cuda")
    lens = [4096, 1, 300, 2048, 0, 4095, 77, 1024]
    packed = pack_sequences(x, seq_lens=lens, pad_multiple=64, cp_size=2, cp_rank=1)
    ref = pack_sequences(x.cpu(), seq_lens=lens, pad_multiple=64, cp_size=2, cp_rank=1)
    assert torch.equal(packed["input"].cpu(), ref["input"])


# ---- against PyTorch ------------------------------------------------------------------
MOVE_GRID = 132 * 16  # kMaxBlocks of cuda/move.cu: tasks past it loop inside the kernel


def round_up(n, multiple):
    return -(-n // multiple) * multiple


def layout(lens, multiple):
    padded = [round_up(int(n), multiple) for n in lens]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    cu_p = np.concatenate([[0], np.cumsum(padded)]).astype(np.int32)
    return cu, cu_p


def pack_index(lens, width, multiple):
    """For every packed row, its source row ``b * width + s`` in the flattened padded
    batch, -1 for padding (NumPy, independent of seqpack's plans)."""
    parts = []
    for b, n in enumerate(lens):
        n = int(n)
        parts += [b * width + np.arange(n), np.full(round_up(n, multiple) - n, -1)]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def unpack_index(lens, width, multiple):
    """For every padded position ``(b, s)``, the packed row holding it, or -1."""
    _, cu_p = layout(lens, multiple)
    index = np.full((len(lens), width), -1, dtype=np.int64)
    for b, n in enumerate(lens):
        index[b, : int(n)] = cu_p[b] + np.arange(int(n))
    return index.reshape(-1)


def gather_rows(x, index, fill):
    """``x`` ([N, ...]) rows at ``index``, ``fill`` where the index is -1, in PyTorch ops
    (differentiable)."""
    idx = torch.from_numpy(index).to(x.device)
    rows = x.index_select(0, idx.clamp(min=0))
    keep = (idx >= 0).view(-1, *([1] * (x.dim() - 1)))
    return torch.where(keep, rows, torch.full((), fill, dtype=x.dtype, device=x.device))


def torch_pack(x, lens, multiple, fill):
    return gather_rows(x.reshape(-1, *x.shape[2:]), pack_index(lens, x.shape[1], multiple), fill)


def torch_unpack(y, lens, width, multiple, fill):
    out = gather_rows(y, unpack_index(lens, width, multiple), fill)
    return out.view(len(lens), width, *y.shape[1:])


def byte_tasks(packed, row_bytes):
    """How many device tasks the pack of ``packed`` ran (host plan, as seqpack.tensors._ops builds it)."""
    from seqpack import _core
    from seqpack.tensors import _ops

    copies, fills = packed._runs()[:2]
    return _core.byte_tasks(copies.numpy(), fills.numpy(), packed.batch_size * packed.width, packed.num_tokens,
                            row_bytes, _ops.MAX_TASK_BYTES).shape[0]


def sample(shape, dtype, g):
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) < 0.5
    return (torch.randn(shape, generator=g) * 50).to(dtype)


@pytest.mark.parametrize("dtype,hidden", [(torch.int16, (3,)), (torch.float32, (4,)), (torch.bool, ())],
                         ids=["int16x3", "fp32x4", "bool"])
def test_pack_many_sequences_matches_torch(dtype, hidden):
    # 3,000 short sequences: more byte tasks and position runs than one grid of
    # blocks (rows of 6, 16 and 1 bytes: byte, 16-byte and byte accesses).
    rng = np.random.default_rng(5)
    batch, width, multiple = 3000, 6, 4
    lens = rng.integers(0, width + 1, size=batch)
    lens[:2] = [width, 0]
    g = torch.Generator().manual_seed(5)
    x = sample((batch, width, *hidden), dtype, g).cuda()
    fill = True if dtype == torch.bool else 7
    packed = pack_sequences({"x": x}, seq_lens=lens.tolist(), pad_multiple=multiple, pad_value=fill)
    assert byte_tasks(packed, x[0, 0].nbytes) > MOVE_GRID
    assert packed["x"].is_cuda
    assert torch.equal(packed["x"], torch_pack(x, lens, multiple, fill))
    cu, cu_p = layout(lens, multiple)
    assert packed.cu_seqlens.cpu().tolist() == cu.tolist()
    assert packed.cu_seqlens_padded.cpu().tolist() == cu_p.tolist()
    positions = np.concatenate([np.arange(round_up(int(n), multiple)) for n in lens])
    assert torch.equal(packed.position_ids.cpu(), torch.from_numpy(positions))
    back_fill = False if dtype == torch.bool else -3
    assert torch.equal(packed.unpack(packed["x"], fill=back_fill),
                       torch_unpack(packed["x"], lens, width, multiple, back_fill))
    if dtype.is_floating_point:  # gradients: pack's is unpack's scatter and vice versa
        xg = x.clone().requires_grad_()
        ref_x = x.clone().requires_grad_()
        w = torch.randn(packed.num_tokens, *hidden, generator=g).cuda()
        (pack_sequences({"x": xg}, seq_lens=lens.tolist(), pad_multiple=multiple)["x"] * w).sum().backward()
        (torch_pack(ref_x, lens, multiple, 0) * w).sum().backward()
        assert torch.equal(xg.grad, ref_x.grad)
        y = packed["x"].clone().requires_grad_()
        ref_y = packed["x"].clone().requires_grad_()
        w2 = torch.randn(batch, width, *hidden, generator=g).cuda()
        (packed.unpack(y) * w2).sum().backward()
        (torch_unpack(ref_y, lens, width, multiple, 0) * w2).sum().backward()
        assert torch.equal(y.grad, ref_y.grad)


@pytest.mark.parametrize("hidden", [16384, 20001], ids=["64KiB_rows", "80KiB_rows"])
def test_pack_large_rows_many_tasks_matches_torch(hidden):
    # Rows of 64 KiB (one row per task, 16-byte accesses) and of 80,004 bytes (over
    # MAX_TASK_BYTES, 4-byte accesses): more tasks than one grid.
    rng = np.random.default_rng(hidden)
    batch, width, multiple = 40, 80, 8
    lens = rng.integers(30, width + 1, size=batch)
    lens[[3, 7]] = [0, width]
    x = torch.randn(batch, width, hidden, device="cuda")
    packed = pack_sequences(x, seq_lens=lens.tolist(), pad_multiple=multiple, pad_value=-2.5)
    assert byte_tasks(packed, x[0, 0].nbytes) > MOVE_GRID
    assert torch.equal(packed["input"], torch_pack(x, lens, multiple, -2.5))
    assert torch.equal(packed.unpack(packed["input"], fill=1.5),
                       torch_unpack(packed["input"], lens, width, multiple, 1.5))


def test_empty_batch_and_empty_sequences():
    x = torch.randn(0, 5, 3, device="cuda")
    packed = pack_sequences({"x": x}, seq_lens=[], pad_multiple=4)
    assert packed["x"].shape == (0, 3) and packed["x"].is_cuda
    assert packed.unpack(packed["x"]).shape == (0, 5, 3)
    assert packed.position_ids.shape == (0,) and packed.cu_seqlens.cpu().tolist() == [0]
    y = torch.randn(3, 5, 3, device="cuda")
    packed = pack_sequences({"y": y}, seq_lens=[0, 0, 0], pad_multiple=4)
    assert packed["y"].shape == (0, 3)
    assert torch.equal(packed.unpack(packed["y"], fill=2), torch.full((3, 5, 3), 2.0, device="cuda"))
    lens = torch.zeros(0, dtype=torch.int64, device="cuda")
    static = seqpack.pack_sequences_static(x, lens, max_tokens=8, max_seqs=2, pad_value=-1)
    assert static["input"].shape == (8, 3) and static["input"].is_cuda and (static["input"] == -1).all()
    assert static.unpack(static["input"]).shape == (0, 5, 3)
    torch.cuda.synchronize()


def test_zero_size_trailing_dimension():
    # [B, S, 0] tensors pack to [T, 0] and back, with gradients, next to a real tensor.
    x = torch.randn(2, 4, 0, device="cuda", requires_grad=True)
    z = torch.zeros(2, 4, 3, 0, dtype=torch.bfloat16, device="cuda")
    ids = torch.arange(8, device="cuda").view(2, 4)
    packed = pack_sequences({"x": x, "z": z, "ids": ids}, seq_lens=[3, 1], pad_multiple=2)
    assert packed["x"].shape == (6, 0) and packed["x"].is_cuda and packed["z"].shape == (6, 3, 0)
    assert packed["ids"].cpu().tolist() == [0, 1, 2, 0, 4, 0]
    assert packed.unpack(packed["x"]).shape == (2, 4, 0)
    assert packed.unpack(packed["z"]).shape == (2, 4, 3, 0)
    packed["x"].sum().backward()
    assert x.grad.shape == (2, 4, 0) and x.grad.is_cuda
    y = torch.zeros(6, 0, device="cuda", requires_grad=True)
    packed.unpack(y).sum().backward()
    assert y.grad.shape == (6, 0)
    static = seqpack.pack_sequences_static({"x": x.detach(), "ids": ids}, torch.tensor([3, 1], device="cuda"),
                                           max_tokens=8, pad_multiple=2)
    assert static["x"].shape == (8, 0) and static.unpack(static["x"]).shape == (2, 4, 0)
    assert static["ids"].cpu().tolist() == [0, 1, 2, 0, 4, 0, 0, 0]
    torch.cuda.synchronize()
