"""packed_token_logprobs on CUDA tensors: the device kernels against the CPU kernels.

Skipped without a CUDA device (and a torch build with CUDA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import seqpack
from seqpack.logprobs import packed_token_logprobs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and seqpack.build_info()["cuda_device_count"] > 0),
                       reason="no CUDA device"),
]

TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (1.6e-2, 1e-4), torch.float16: (2e-3, 1e-5)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [7, 4096, 32000 + 3])  # odd sizes take the unvectorised path
@pytest.mark.parametrize("cp", [1, 2])
def test_cuda_matches_cpu(dtype, vocab, cp):
    g = torch.Generator().manual_seed(vocab + cp)
    lengths = [1, 37, 9, 128]
    multiple = 2 * cp
    padded = [max(multiple, -(-n // multiple) * multiple) for n in lengths]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    cu_p = np.concatenate([[0], np.cumsum(padded)]).astype(np.int32)
    total = int(cu_p[-1])
    ids = torch.randint(0, vocab, (total,), generator=g)
    full = (torch.randn(total, vocab, generator=g) * 3).to(dtype)
    rows = torch.from_numpy(seqpack.cp_partition_indices(cu_p, cp, cp - 1)) if cp > 1 else torch.arange(total)
    local = full[rows]
    w = torch.randn(local.shape[0], generator=g)
    results = []
    for device in ("cpu", "cuda"):
        x = local.to(device).requires_grad_()
        lp, ent = packed_token_logprobs(x, ids.to(device), cu, cu_p, cp_size=cp, cp_rank=cp - 1,
                                        return_entropy=True, temperature=0.8)
        ((lp * w.to(device)).sum() + ent.sum()).backward()
        results.append((lp.detach().cpu(), ent.detach().cpu(), x.grad.float().cpu()))
    (lp_c, ent_c, g_c), (lp_g, ent_g, g_g) = results
    torch.testing.assert_close(lp_g, lp_c, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent_g, ent_c, rtol=1e-5, atol=1e-5)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(g_g, g_c, rtol=rtol, atol=atol)


def test_wrapper_on_cuda_equals_cpu():
    from seqpack.loss import ClippedPGLoss, SequencePackingLossWrapper

    g = torch.Generator().manual_seed(0)
    lengths, vocab, width = [5, 9, 2], 1000, 9
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    logits = torch.randn(int(cu[-1]), vocab, generator=g)
    data = {"input_ids": torch.randint(0, vocab, (3, width), generator=g), "token_mask": torch.ones(3, width),
            "sample_mask": torch.ones(3), "advantages": torch.randn(3, width, generator=g),
            "prev_logprobs": -torch.rand(3, width, generator=g)}
    loss_fn = ClippedPGLoss({})
    out = []
    for device in ("cpu", "cuda"):
        d = {k: v.to(device) for k, v in data.items()}
        x = logits.to(device).requires_grad_()
        loss, _ = SequencePackingLossWrapper(loss_fn, None, cu, fused=True)(x, d, 3, 15)
        loss.backward()
        out.append((loss.item(), x.grad.cpu()))
    assert out[0][0] == pytest.approx(out[1][0], rel=1e-5)
    torch.testing.assert_close(out[1][1], out[0][1], rtol=1e-5, atol=1e-7)
