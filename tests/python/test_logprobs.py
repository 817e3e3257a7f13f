"""packed_token_logprobs: equal to the padded PyTorch computation (values and
gradients), CP-local rows, bf16, entropy, temperature, the torch fallback, errors."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import seqpack
from seqpack import logprobs as lpmod
from seqpack.logprobs import next_token_sources, packed_token_logprobs


def layout(lengths, multiple):
    padded = [max(multiple, -(-n // multiple) * multiple) for n in lengths]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    cu_p = np.concatenate([[0], np.cumsum(padded)]).astype(np.int32)
    return cu, cu_p


def reference(logits, ids, lengths, cu_p, temperature=1.0):
    """Per-sequence log_softmax + gather on the padded rows, in fp64: [T] (0 elsewhere)."""
    lsm = torch.log_softmax(logits.double() / temperature, -1)
    lp = lsm[:, 0] * 0  # zeros, part of the graph even when no row has a target
    ent = lsm[:, 0] * 0
    rows, targets = [], []
    for i, n in enumerate(lengths):
        for t in range(int(cu_p[i]), int(cu_p[i]) + n - 1):
            rows.append(t)
            targets.append(int(ids[t + 1]))
    if rows:
        rows_t = torch.tensor(rows)
        lp = lp.index_put((rows_t,), lsm[rows_t, torch.tensor(targets)])
        h = -(lsm.exp() * lsm).sum(-1)
        ent = ent.index_put((rows_t,), h[rows_t])
    return lp, ent


def test_docstring_layout_and_sources():
    assert next_token_sources([0, 3, 5], [0, 4, 6]).tolist() == [1, 2, -1, -1, 5, -1]
    # CP=2: rank 1 of [0, 8]: positions 2..5, real length 5 -> sources 3, 4, -1, -1
    assert next_token_sources([0, 5], [0, 8], cp_size=2, cp_rank=1).tolist() == [3, 4, -1, -1]


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_cp_ranks_equal_the_padded_computation(cp):
    torch.manual_seed(cp)
    lengths = [1, 5, 9, 3, 12, 2]  # a length-1 sequence; tails that cross CP chunk boundaries
    cu, cu_p = layout(lengths, 2 * cp)
    total, vocab = int(cu_p[-1]), 97
    logits = torch.randn(total, vocab) * 3
    ids = torch.randint(0, vocab, (total,))
    ref_lp, ref_ent = reference(logits, ids, lengths, cu_p, 0.9)
    w, w2 = torch.randn(total, dtype=torch.float64), torch.randn(total, dtype=torch.float64)
    full = logits.double().requires_grad_()
    lr, er = reference(full, ids, lengths, cu_p, 0.9)
    ((lr * w).sum() + (er * w2).sum()).backward()
    grad_sum = torch.zeros_like(logits)
    for rank in range(cp):
        rows = torch.from_numpy(seqpack.cp_partition_indices(cu_p, cp, rank))
        local = logits[rows].clone().requires_grad_()
        lp, ent = packed_token_logprobs(local, ids, cu, cu_p, cp_size=cp, cp_rank=rank, return_entropy=True,
                                        temperature=0.9)
        torch.testing.assert_close(lp.double(), ref_lp[rows], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ent.double(), ref_ent[rows], rtol=1e-5, atol=2e-6)
        ((lp.double() * w[rows]).sum() + (ent.double() * w2[rows]).sum()).backward()
        grad_sum[rows] += local.grad
    torch.testing.assert_close(grad_sum.double(), full.grad, rtol=1e-5, atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=8), vocab=st.integers(2, 700),
       scale=st.sampled_from([0.1, 3.0, 30.0]))
def test_properties_against_the_padded_reference(lengths, vocab, scale):
    cu, cu_p = layout(lengths, 1)
    total = int(cu_p[-1])
    g = torch.Generator().manual_seed(len(lengths) * 1000 + vocab)
    logits = (torch.randn(total, vocab, generator=g) * scale).requires_grad_()
    ids = torch.randint(0, vocab, (total,), generator=g)
    lp = packed_token_logprobs(logits, ids, cu, cu_p)
    full = logits.detach().double().requires_grad_()
    ref, _ = reference(full, ids, lengths, cu_p)
    torch.testing.assert_close(lp.double(), ref, rtol=1e-6, atol=2e-6)
    lp.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(logits.grad.double(), full.grad, rtol=1e-5, atol=1e-6)


def test_bf16_within_twice_pytorchs_own_error():
    torch.manual_seed(0)
    lengths = [40, 7, 90]
    cu, cu_p = layout(lengths, 1)
    total, vocab = int(cu_p[-1]), 3000
    logits = (torch.randn(total, vocab) * 2).bfloat16()
    ids = torch.randint(0, vocab, (total,))
    exact, _ = reference(logits.double(), ids, lengths, cu_p)
    ours = packed_token_logprobs(logits, ids, cu, cu_p)
    lsm = torch.log_softmax(logits, -1)  # PyTorch's bf16 path
    mask = next_token_sources(cu, cu_p) >= 0
    rows = torch.from_numpy(np.nonzero(mask)[0])
    targets = ids[torch.from_numpy(next_token_sources(cu, cu_p)[mask])]
    theirs = torch.zeros(total, dtype=torch.float64).index_put((rows,), lsm[rows, targets].double())
    err_ours = (ours.double() - exact).abs().max()
    err_torch = (theirs - exact).abs().max()
    assert err_ours <= 2 * err_torch + 1e-6
    logits.requires_grad_()
    packed_token_logprobs(logits, ids, cu, cu_p).sum().backward()
    full = logits.detach().double().requires_grad_()
    reference(full, ids, lengths, cu_p)[0].sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(logits.grad.double(), full.grad, rtol=1.6e-2, atol=1e-4)


def test_torch_fallback_matches_the_kernel():
    torch.manual_seed(3)
    lengths = [6, 3, 11]
    cu, cu_p = layout(lengths, 4)
    total, vocab = int(cu_p[-1]), 300
    logits = torch.randn(total, vocab) * 4
    targets = torch.from_numpy(next_token_sources(cu, cu_p))
    targets = torch.where(targets >= 0, torch.randint(0, vocab, (total,)), targets)
    stats = torch.empty(4, total)
    lpmod._stats_torch(logits, targets, 0, 0.7, True, stats)
    k = torch.empty(4, total)
    seqpack._core.logprob_row_stats(logits.data_ptr(), total, vocab, vocab, "float32", targets.data_ptr(), 0, 0.7,
                                    k[0].data_ptr(), k[1].data_ptr(), k[3].data_ptr(), k[2].data_ptr(), 0)
    torch.testing.assert_close(stats, k, rtol=1e-5, atol=1e-5)
    m, log_se = stats[0], stats[1].log()
    ent = log_se - stats[3] / stats[1]
    g_lp, g_ent = torch.randn(total), torch.randn(total)
    g_lp = torch.where(targets >= 0, g_lp, 0.0)
    g_ent = torch.where(targets >= 0, g_ent, 0.0)
    ours = torch.empty_like(logits)
    lpmod._grad_torch(logits, targets, 0, 0.7, m, log_se, ent, g_lp, g_ent, ours)
    kernel = torch.empty_like(logits)
    seqpack._core.logprob_row_grad(logits.data_ptr(), total, vocab, vocab, "float32", targets.data_ptr(), 0, 0.7,
                                   m.data_ptr(), log_se.data_ptr(), ent.data_ptr(), g_lp.data_ptr(), g_ent.data_ptr(),
                                   kernel.data_ptr(), vocab, 0)
    torch.testing.assert_close(ours, kernel, rtol=1e-5, atol=1e-6)  # 1 - p near p = 1 cancels


def test_threads_do_not_change_the_result():
    torch.manual_seed(4)
    cu, cu_p = layout([300, 200, 500], 1)
    logits = torch.randn(1000, 5000)
    ids = torch.randint(0, 5000, (1000,))
    one = packed_token_logprobs(logits, ids, cu, cu_p, num_threads=1)
    many = packed_token_logprobs(logits, ids, cu, cu_p, num_threads=4)
    assert torch.equal(one, many)


def test_errors():
    cu, cu_p = layout([3, 2], 1)
    ids = torch.zeros(5, dtype=torch.long)
    with pytest.raises(ValueError, match=r"logits must be a \[T, V\] tensor"):
        packed_token_logprobs(torch.zeros(5), ids, cu, cu_p)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        packed_token_logprobs(torch.zeros(5, 3, dtype=torch.float64), ids, cu, cu_p)
    with pytest.raises(ValueError, match="logits has 4 rows; the packed layout has 5"):
        packed_token_logprobs(torch.zeros(4, 3), ids, cu, cu_p)
    with pytest.raises(ValueError, match=r"input_ids must hold the full packed ids \[5\]"):
        packed_token_logprobs(torch.zeros(5, 3), ids[:4], cu, cu_p)
    with pytest.raises(TypeError, match="int32"):
        packed_token_logprobs(torch.zeros(5, 3), ids, cu.astype(np.int64), cu_p)
    with pytest.raises(ValueError, match="padded length must be >= the real length"):
        packed_token_logprobs(torch.zeros(5, 3), ids, [0, 4, 5], [0, 3, 5])
    with pytest.raises(ValueError, match="temperature must be positive"):
        packed_token_logprobs(torch.zeros(5, 3), ids, cu, cu_p, temperature=0.0)
    with pytest.raises(ValueError, match="multiple of"):
        packed_token_logprobs(torch.zeros(2, 3), ids, cu, cu_p, cp_size=2)


def test_docs_worked_example():
    # docs/loss.md: lengths [5, 3] padded to [8, 4], CP = 2.
    assert seqpack.cp_partition_indices([0, 8, 12], 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert next_token_sources([0, 5, 8], [0, 8, 12], cp_size=2, cp_rank=0).tolist() == [1, 2, -1, -1, 9, -1]
    assert next_token_sources([0, 5, 8], [0, 8, 12], cp_size=2, cp_rank=1).tolist() == [3, 4, -1, -1, 10, -1]


_EVERY_BUILD = """
import sys, torch
from seqpack import _core
from seqpack.logprobs import packed_token_logprobs
torch.manual_seed(5)
lengths, vocab = [9, 1, 17, 40], 1001  # a vocabulary that is not a multiple of any lane count
rows = sum(lengths)
cu = torch.tensor([0, 9, 10, 27, 67], dtype=torch.int32).numpy()
ids = torch.randint(0, vocab, (rows,))
base = torch.randn(rows, vocab) * 3
out = {}
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    for temperature in (1.0, 0.7):
        x = base.to(dtype).detach().requires_grad_()
        lp, ent = packed_token_logprobs(x, ids, cu, return_entropy=True, temperature=temperature)
        (lp * torch.linspace(-1, 2, rows) + ent * torch.linspace(1, -0.5, rows)).sum().backward()
        out[f"{dtype}/{temperature}"] = (lp.detach(), ent.detach(), x.grad.float())
torch.save(out, sys.argv[1])
print(_core.logprob_cpu_isa())
"""


@pytest.mark.parametrize("isa", ["baseline", "avx2", "native"])
def test_every_cpu_build_agrees_with_fp64(isa, tmp_path):
    """Each CPU build of the kernels (4/8/16 lanes) against the fp64 reference; the
    build is chosen by SEQPACK_CPU_ISA in a fresh process (it is fixed per process)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ)
    env.pop("SEQPACK_CPU_ISA", None)
    if isa != "native":
        env["SEQPACK_CPU_ISA"] = isa
    path = tmp_path / "out.pt"
    ran = subprocess.run([sys.executable, "-c", _EVERY_BUILD, str(path)], env=env, check=True, capture_output=True,
                         text=True).stdout.strip()
    if isa != "native" and ran != isa:
        pytest.skip(f"this CPU has no {isa} build (runs {ran})")
    out = torch.load(path)
    torch.manual_seed(5)
    lengths, vocab = [9, 1, 17, 40], 1001
    rows = sum(lengths)
    ids = torch.randint(0, vocab, (rows,))
    base = torch.randn(rows, vocab) * 3
    cu_p = np.concatenate([[0], np.cumsum(lengths)])
    for key, (lp, ent, grad) in out.items():
        dtype, temperature = key.split("/")
        x = base.to(getattr(torch, dtype.split(".")[1])).double().requires_grad_()
        ref_lp, ref_ent = reference(x, ids, lengths, cu_p, float(temperature))
        (ref_lp * torch.linspace(-1, 2, rows).double() + ref_ent * torch.linspace(1, -0.5, rows).double()).sum() \
            .backward()
        tol = 1e-5 if dtype == "torch.float32" else 1e-2  # the gradient is stored in the logits' dtype
        torch.testing.assert_close(lp.double(), ref_lp.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent.double(), ref_ent.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad.double(), x.grad, rtol=tol, atol=tol * 1e-2)
