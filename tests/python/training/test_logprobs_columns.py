"""Log-probs at k given columns per row from one log-sum-exp (issue 30, item 1):
``column_logprobs`` against fp64 ``log_softmax`` + ``gather`` (values, entropy,
gradients; repeated, negative and no columns; every dtype), the fused LM head
against the logits path for every chunk size, and the argument rules."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack.training.logprobs_columns import column_logprobs, linear_column_logprobs


def reference(logits, columns, temperature=1.0):
    lsm = torch.log_softmax(logits.double() / temperature, dim=-1)
    lp = torch.where(columns >= 0, lsm.gather(1, columns.clamp(min=0)), 0.0)
    return lp, -(lsm.exp() * lsm).sum(-1)


@st.composite
def cases(draw):
    rows, vocab, k = draw(st.integers(0, 9)), draw(st.integers(1, 40)), draw(st.integers(0, 5))
    columns = draw(st.lists(st.lists(st.integers(-1, vocab - 1), min_size=k, max_size=k), min_size=rows,
                            max_size=rows))
    return rows, vocab, torch.tensor(columns, dtype=torch.int64).reshape(rows, k)


@settings(max_examples=80, deadline=None)
@given(cases(), st.sampled_from([1.0, 0.6]), st.integers(0, 2**31))
def test_values_entropy_and_gradients_equal_log_softmax_gather(case, temperature, seed):
    rows, vocab, columns = case
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 3).requires_grad_()
    ref_logits = logits.detach().clone().requires_grad_()
    out = column_logprobs(logits, columns, temperature=temperature, return_entropy=True)
    ref_lp, ref_ent = reference(ref_logits, columns, temperature)
    torch.testing.assert_close(out.logprobs, ref_lp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.entropy, ref_ent, rtol=1e-12, atol=1e-12)
    g_lp = torch.randn(rows, columns.shape[1], generator=g, dtype=torch.float64)
    g_ent = torch.randn(rows, generator=g, dtype=torch.float64)
    ((out.logprobs * g_lp).sum() + (out.entropy * g_ent).sum()).backward()
    ((ref_lp * g_lp).sum() + (ref_ent * g_ent).sum()).backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_reduced_precision_matches_fp64(dtype, tol):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 50, generator=g) * 2
    columns = torch.randint(-1, 50, (6, 4), generator=g)
    out = column_logprobs(logits.to(dtype), columns, return_entropy=True)
    ref_lp, ref_ent = reference(logits.to(dtype).double(), columns)
    assert out.logprobs.dtype == torch.float32
    torch.testing.assert_close(out.logprobs.double(), ref_lp, rtol=tol, atol=tol)
    torch.testing.assert_close(out.entropy.double(), ref_ent, rtol=tol, atol=tol)


@settings(max_examples=40, deadline=None)
@given(cases(), st.sampled_from([None, 1, 2, 5]), st.booleans(), st.integers(0, 2**31))
def test_fused_head_equals_the_logits_path(case, chunk, bias, seed):
    rows, vocab, columns = case
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, 6, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, 6, generator=g, dtype=torch.float64)
    b = torch.randn(vocab, generator=g, dtype=torch.float64) if bias else None
    leaves = [None if t is None else t.clone().requires_grad_() for t in (hidden, weight, b)]
    fused = linear_column_logprobs(leaves[0], leaves[1], columns, bias=leaves[2], chunk_tokens=chunk,
                                   temperature=0.7, return_entropy=True)
    ref_leaves = [None if t is None else t.clone().requires_grad_() for t in (hidden, weight, b)]
    ref = column_logprobs(torch.nn.functional.linear(*ref_leaves), columns, temperature=0.7, return_entropy=True)
    torch.testing.assert_close(fused.logprobs, ref.logprobs, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(fused.entropy, ref.entropy, rtol=1e-10, atol=1e-12)
    g_lp = torch.randn(rows, columns.shape[1], generator=g, dtype=torch.float64)
    for out in (fused, ref):
        ((out.logprobs * g_lp).sum() + out.entropy.sum()).backward()
    for got, want in zip(leaves, ref_leaves):
        if want is not None:
            torch.testing.assert_close(got.grad, want.grad, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("columns, error, match", [
    (torch.tensor([[0, 5]]), ValueError, r"columns\[0, 1\] = 5 is not a column of the vocabulary \(V = 5\)"),
    (torch.tensor([0, 1]), ValueError, r"columns must be \[T = 1, k\]"),
    (torch.tensor([[0.0, 1.0]]), TypeError, "columns must hold integer token ids"),
    ([[0, 1]], TypeError, "columns must be an integer tensor"),
])
def test_bad_columns_are_named(columns, error, match):
    with pytest.raises(error, match=match):
        column_logprobs(torch.zeros(1, 5), columns)


def test_scalars_and_the_empty_cases():
    logits = torch.zeros(3, 4)
    out = column_logprobs(logits, torch.zeros(3, 0, dtype=torch.int64), temperature=np.float32(0.5),
                          num_threads=np.int64(1))
    assert out.logprobs.shape == (3, 0) and out.entropy is None
    out = column_logprobs(torch.zeros(0, 4), torch.zeros(0, 2, dtype=torch.int32), temperature=torch.tensor(2.0))
    assert out.logprobs.shape == (0, 2)


def test_fused_head_gathers_the_columns_a_chunk_at_a_time(monkeypatch):
    # k columns per row make T * k extra logits: their gathered [E, H] rows exist a
    # chunk at a time (distillation at k = 64 would otherwise hold T * 64 * H).
    from seqpack.training import _multi_target_ops as mto

    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(9, 5, generator=g, dtype=torch.float64)
    weight = torch.randn(13, 5, generator=g, dtype=torch.float64)
    columns = torch.randint(-1, 13, (9, 6), generator=g)
    whole = linear_column_logprobs(hidden, weight, columns, return_entropy=True)
    seen = []
    real_bmm = torch.bmm
    monkeypatch.setattr(mto, "_EXTRA_ELEMENTS", 11)  # two extras (H = 5) per chunk
    monkeypatch.setattr(mto.torch, "bmm", lambda a, b: seen.append(a.shape[0]) or real_bmm(a, b))
    chunked = linear_column_logprobs(hidden, weight, columns, return_entropy=True)
    assert max(seen) == 2 and sum(seen) == 9 * 6
    torch.testing.assert_close(chunked.logprobs, whole.logprobs, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(chunked.entropy, whole.entropy, rtol=1e-12, atol=1e-12)
