"""seqpack.thd on CUDA tensors: the device kernels against the CPU executor.

Skipped without a CUDA device (and a torch build with CUDA)."""

from __future__ import annotations

import pytest
import torch

import seqpack
from seqpack import alignment, pack_sequences

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and seqpack.build_info()["cuda_device_count"] > 0),
                       reason="no CUDA device"),
]

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
