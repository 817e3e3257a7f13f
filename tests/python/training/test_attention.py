"""varlen_attention: every backend that runs here against a per-sequence fp64
softmax written out by hand (causal, bottom-right alignment, windows, GQA, empty
rows, tiling), gradients included; errors."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import seqpack
from seqpack.training import attention as att
from seqpack.training import attention_cp as cp_att
from seqpack.training import attention_varlen


def naive(q, k, v, cu_q, cu_k, causal=True, scale=None, window=(-1, -1)):
    """Per sequence, per head: explicit scores, mask, softmax (fp64); 0 for rows
    that see no key and rows outside every sequence."""
    q, k, v = q.double(), k.double(), v.double()
    hq, hk = q.shape[1], k.shape[1]
    scale = scale if scale is not None else q.shape[2] ** -0.5
    out = torch.zeros(q.shape[0], hq, v.shape[2], dtype=torch.float64)
    for s in range(len(cu_q) - 1):
        lq, lk = cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s]
        for i in range(lq):
            shift = i + lk - lq
            keys = [j for j in range(lk)
                    if (not causal or j <= shift) and (causal or window[1] < 0 or j <= shift + window[1])
                    and (window[0] < 0 or j >= shift - window[0])]
            for h in range(hq):
                if not keys:
                    continue
                kk = k[cu_k[s] + torch.tensor(keys), h // (hq // hk)]
                vv = v[cu_k[s] + torch.tensor(keys), h // (hq // hk)]
                p = torch.softmax(kk @ q[cu_q[s] + i, h] * scale, 0)
                out = out.index_put((torch.tensor([cu_q[s] + i]), torch.tensor([h])), (p @ vv)[None])
    return out


def lengths_to_cu(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def run(backend, q, k, v, cu_q, cu_k, **kw):
    return seqpack.varlen_attention(q, k, v, cu_q, cu_k, int(max(np.diff(cu_q), default=0)),
                                    int(max(np.diff(cu_k), default=0)), backend=backend, **kw)


CPU_BACKENDS = ["reference", "flex"]


@pytest.mark.parametrize("backend", ["reference"])
def test_causal_gqa_values_and_gradients(backend):
    torch.manual_seed(0)
    cu = lengths_to_cu([5, 1, 9, 3])
    q = torch.randn(18, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(18, 2, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(18, 2, 8, dtype=torch.float64, requires_grad=True)
    ours = run(backend, q.float(), k.float(), v.float(), cu, cu)
    ref = naive(q, k, v, cu, cu)
    torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-6)
    w = torch.randn_like(ref)
    g_ours = torch.autograd.grad((ours.double() * w).sum(), (q, k, v))
    g_ref = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(g_ours, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@torch.no_grad()
def test_sequences_never_see_each_other(backend):
    torch.manual_seed(1)
    cu = lengths_to_cu([4, 6])
    q, k, v = (torch.randn(10, 2, 4) for _ in range(3))
    base = run(backend, q, k, v, cu, cu)
    k2, v2 = k.clone(), v.clone()
    k2[4:] += 5.0  # change only the second sequence's keys and values
    v2[4:] -= 3.0
    torch.testing.assert_close(run(backend, q, k2, v2, cu, cu)[:4], base[:4])
    assert not torch.allclose(run(backend, q, k2, v2, cu, cu)[4:], base[4:])


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_properties_against_the_naive_softmax(data):
    n = data.draw(st.integers(1, 5))
    lq = data.draw(st.lists(st.integers(0, 9), min_size=n, max_size=n))
    lk = data.draw(st.lists(st.integers(0, 9), min_size=n, max_size=n))
    causal = data.draw(st.booleans())
    window = (data.draw(st.integers(-1, 4)), data.draw(st.integers(-1, 4)))
    hk = data.draw(st.sampled_from([1, 2]))
    hq = hk * data.draw(st.sampled_from([1, 2]))
    extra = data.draw(st.integers(0, 2))  # rows after the last sequence
    budget = data.draw(st.sampled_from([1, 7, 50, att.MAX_SCORE_ELEMENTS]))  # tiles and row chunks
    cu_q, cu_k = lengths_to_cu(lq), lengths_to_cu(lk)
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 1000)))
    q = torch.randn(int(cu_q[-1]) + extra, hq, 4, generator=g, dtype=torch.float64)
    k = torch.randn(int(cu_k[-1]), hk, 4, generator=g, dtype=torch.float64)
    v = torch.randn(int(cu_k[-1]), hk, 3, generator=g, dtype=torch.float64)
    ours = attention_varlen._reference(q, k, v, cu_q.astype(np.int64), cu_k.astype(np.int64), causal, 0.5,
                          (window[0], 0 if causal else window[1]), budget=budget)
    torch.testing.assert_close(ours, naive(q, k, v, cu_q, cu_k, causal, 0.5, window), rtol=1e-9, atol=1e-10)


@torch.no_grad()
def test_flex_matches_reference_with_windows_and_unequal_lengths():
    torch.manual_seed(2)
    cu_q, cu_k = lengths_to_cu([3, 0, 7, 5]), lengths_to_cu([6, 2, 7, 4])
    q = torch.randn(int(cu_q[-1]) + 2, 4, 8)
    k, v = torch.randn(int(cu_k[-1]), 1, 8), torch.randn(int(cu_k[-1]), 1, 8)
    for causal, window in [(True, (-1, -1)), (True, (2, -1)), (False, (1, 2)), (False, (-1, -1))]:
        a = run("flex", q, k, v, cu_q, cu_k, causal=causal, window_size=window)
        b = run("reference", q, k, v, cu_q, cu_k, causal=causal, window_size=window)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_long_sequence_is_chunked_under_the_budget(monkeypatch):
    torch.manual_seed(3)
    cu = lengths_to_cu([200, 3])
    q, k, v = (torch.randn(203, 2, 4, dtype=torch.float64) for _ in range(3))
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(qq, kk, vv, **kw):
        calls.append(qq.shape[2] * kk.shape[2] * qq.shape[1])
        return real(qq, kk, vv, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    out = attention_varlen._reference(q, k, v, cu.astype(np.int64), cu.astype(np.int64), True, 0.5, (150, 0), budget=4000)
    assert len(calls) > 5 and max(calls) <= 4000  # a window needs a mask: row chunks under the budget
    torch.testing.assert_close(out, naive(q, k, v, cu, cu, scale=0.5, window=(150, 0)), rtol=1e-9, atol=1e-10)
    calls.clear()
    out = attention_varlen._reference(q, k, v, cu.astype(np.int64), cu.astype(np.int64), True, 0.5, (-1, 0), budget=4000)
    assert calls[0] == 200 * 200 * 2  # plain causal: the long sequence whole, SDPA's own causal kernel
    torch.testing.assert_close(out, naive(q, k, v, cu, cu, scale=0.5), rtol=1e-9, atol=1e-10)


def test_docstring_example_and_backends():
    backends = seqpack.attention_backends()
    assert set(backends) == set(att.BACKENDS)
    assert backends["reference"] == "available"
    if not torch.cuda.is_available():
        assert "CUDA" in backends["torch_varlen"] or "importable" in backends["torch_varlen"]


def test_errors():
    q = torch.zeros(5, 2, 4)
    cu = [0, 3, 5]
    with pytest.raises(ValueError, match=r"q must be a \[T, H, D\] tensor"):
        seqpack.varlen_attention(q[0], q, q, cu, cu, 3, 3)
    with pytest.raises(ValueError, match="multiple of k/v heads"):
        seqpack.varlen_attention(torch.zeros(5, 3, 4), q, q, cu, cu, 3, 3)
    with pytest.raises(ValueError, match="same head dim"):
        seqpack.varlen_attention(torch.zeros(5, 2, 8), q, q, cu, cu, 3, 3)
    with pytest.raises(ValueError, match="same sequences"):
        seqpack.varlen_attention(q, q, q, cu, [0, 5], 3, 5)
    with pytest.raises(ValueError, match="exceed the rows"):
        seqpack.varlen_attention(q, q, q, [0, 3, 6], [0, 3, 6], 3, 3)
    with pytest.raises(ValueError, match="below the longest sequence"):
        seqpack.varlen_attention(q, q, q, cu, cu, 2, 3)
    with pytest.raises(ValueError, match="never decrease"):
        seqpack.varlen_attention(q, q, q, [0, 3, 2], [0, 3, 2], 3, 3)
    with pytest.raises(ValueError, match="window_size"):
        seqpack.varlen_attention(q, q, q, cu, cu, 3, 3, window_size=(-2, 0))
    with pytest.raises(ValueError, match="backend must be"):
        seqpack.varlen_attention(q, q, q, cu, cu, 3, 3, backend="xformers")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="not available"):
            seqpack.varlen_attention(q, q, q, cu, cu, 3, 3, backend="torch_varlen")
    with pytest.raises(ValueError, match="no backward on the CPU"):
        seqpack.varlen_attention(q.requires_grad_(), q, q, cu, cu, 3, 3, backend="flex")


def test_scale_default_is_inverse_sqrt_head_dim():
    torch.manual_seed(4)
    cu = lengths_to_cu([4])
    q, k, v = (torch.randn(4, 1, 16) for _ in range(3))
    torch.testing.assert_close(run("reference", q, k, v, cu, cu),
                               run("reference", q, k, v, cu, cu, softmax_scale=1 / math.sqrt(16)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["flash_attn", "torch_varlen", "flex"])
def test_gpu_backends_match_the_reference(backend):
    why = seqpack.attention_backends()[backend]
    if why != "available":
        pytest.skip(why)
    torch.manual_seed(6)
    cu = lengths_to_cu([70, 1, 300, 129])
    q = torch.randn(int(cu[-1]), 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(int(cu[-1]), 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(int(cu[-1]), 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cu_dev = torch.from_numpy(cu).cuda()
    for window in [(-1, -1), (32, -1)]:
        ours = seqpack.varlen_attention(q, k, v, cu_dev, cu_dev, 300, 300, window_size=window, backend=backend)
        ref = seqpack.varlen_attention(q.float(), k.float(), v.float(), cu, cu, 300, 300, window_size=window,
                                       backend="reference")
        torch.testing.assert_close(ours.float(), ref, rtol=2e-2, atol=2e-2)
        w = torch.randn_like(ref)
        g_ours = torch.autograd.grad((ours.float() * w).sum(), (q, k, v))
        g_ref = torch.autograd.grad((ref * w).sum(), (q, k, v))
        for a, b in zip(g_ours, g_ref):
            torch.testing.assert_close(a.float(), b.float(), rtol=5e-2, atol=5e-2)


def test_cp_plan_zigzag_prefixes():
    # Sequences of padded length 8 and 4, CP = 2: rank 0 holds chunks 0 and 3 of each,
    # rank 1 chunks 1 and 2; causal keys run from the sequence start to the chunk end.
    p0 = cp_att._cp_plan(np.array([0, 8, 12]), 2, 0, True)
    assert p0["cu_q"].tolist() == [0, 2, 4, 5, 6] and p0["cu_k"].tolist() == [0, 2, 10, 11, 15]
    assert p0["k_index"].tolist() == [0, 1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 8, 9, 10, 11]
    p1 = cp_att._cp_plan(np.array([0, 8, 12]), 2, 1, True)
    assert p1["cu_k"].tolist() == [0, 4, 10, 12, 15] and (p1["max_q"], p1["max_k"]) == (2, 6)
    full = cp_att._cp_plan(np.array([0, 8, 12]), 2, 1, False)  # not causal: every chunk sees its whole sequence
    assert full["cu_k"].tolist() == [0, 8, 16, 20, 24]
    with pytest.raises(ValueError, match="multiple of 2 \\* cp_size = 4"):
        cp_att._cp_plan(np.array([0, 6]), 2, 0, True)
