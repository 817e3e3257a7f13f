"""tree_attention: on random forests (chains, fans, duplicates, rows inside rows,
empty rows, groups, padding) every backend that runs here equals dense masked
attention from ``tree.attention_mask()`` and, the real proof, each row run alone
through plain causal attention; sdpa's gradients equal the reference's; GQA,
autocast, errors."""

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import seqpack
from seqpack.tensors.tree_plans import attention_plan
from seqpack.training import attention_tree

# Eager FlexAttention on the CPU warns that it is unfused; that is what it tests here.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

CPU_BACKENDS = ["reference", "sdpa", "varlen", "flex"]

# Small vocabularies make random rows share prefixes, duplicate each other and end
# inside each other; the lengths include empty and single-token rows.
rows_st = st.lists(st.lists(st.integers(0, 2), max_size=7), max_size=7)


@st.composite
def forests(draw):
    rows = draw(rows_st)
    groups = draw(st.none() | st.lists(st.integers(0, 2), min_size=len(rows), max_size=len(rows)))
    return seqpack.pack_prefix_tree(rows, group_ids=groups, min_shared_tokens=draw(st.integers(0, 3)),
                                    pad_to_multiple_of=draw(st.integers(1, 4)))


@st.composite
def rollouts(draw):
    """GRPO / agentic shape: a few prompts, each sampled G times (wide fans over a
    larger vocabulary), some continued for another turn (branching at each turn)."""
    rows, groups = [], []
    for p in range(draw(st.integers(1, 3))):
        prompt = draw(st.lists(st.integers(0, 50), min_size=1, max_size=6))
        for _ in range(draw(st.integers(1, 12))):
            turn = prompt + draw(st.lists(st.integers(0, 50), max_size=5))
            rows.append(turn)
            groups.append(p)
            if draw(st.booleans()):
                rows.append(turn + draw(st.lists(st.integers(0, 3), min_size=1, max_size=4)))
                groups.append(p)
    return seqpack.pack_prefix_tree(rows, group_ids=groups, pad_to_multiple_of=draw(st.sampled_from([1, 8])))


def _qkv(t, hq=4, hk=2, d=8, seed=0, dtype=torch.float64, grad=False):
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(t, h, d, generator=g, dtype=dtype) for h in (hq, hk, hk)]
    return [x.requires_grad_(grad) for x in out]


def dense(q, k, v, tree, scale=None):
    """Masked softmax from tree.attention_mask() (NumPy bools), fp64, by hand."""
    mask = torch.from_numpy(tree.attention_mask())
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    scale = q.shape[2] ** -0.5 if scale is None else scale
    scores = torch.einsum("ihd,jhd->hij", q.double(), k) * scale
    return torch.einsum("hij,jhd->ihd", torch.softmax(scores.masked_fill(~mask, float("-inf")), -1), v)


def rows_alone(q, k, v, tree):
    """Each row alone: its tokens' q/k/v through causal SDPA; [(physical index, out)]."""
    out = []
    for r in range(tree.num_rows):
        idx = torch.tensor(tree.logical_index[tree.cu_seqlens[r]:tree.cu_seqlens[r + 1]])
        if idx.numel() == 0:
            continue
        qq, kk, vv = (x[idx].transpose(0, 1) for x in (q, k, v))
        alone = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True).transpose(0, 1)
        out.append((idx, alone))
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=forests() | rollouts(), seed=st.integers(0, 2 ** 16), heads=st.sampled_from([(4, 2), (2, 2), (3, 1)]),
       dv=st.sampled_from([8, 5]))
def test_every_backend_equals_dense_mask_and_rows_alone(tree, seed, heads, dv):
    hq, hk = heads
    q, k, v = _qkv(tree.num_tokens, hq=hq, hk=hk, seed=seed)
    v = torch.randn(tree.num_tokens, hk, dv, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    want = dense(q, k, v, tree)
    for backend in ["reference", "sdpa", "varlen"]:
        got = seqpack.attention(q, k, v, tree, backend=backend)
        assert got.shape == (tree.num_tokens, hq, dv) and got.dtype == torch.float64
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=backend)
        # Every row through a shared token gives it the same output: the row's own.
        for idx, alone in rows_alone(q, k, v, tree):
            torch.testing.assert_close(got[idx], alone, rtol=1e-12, atol=1e-12, msg=backend)
        # A pad token sees only itself.
        pads = torch.arange(tree.num_tokens - tree.num_pad_tokens, tree.num_tokens)
        torch.testing.assert_close(got[pads], v[pads].repeat_interleave(hq // hk, 1), rtol=1e-12, atol=1e-12)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=forests(), seed=st.integers(0, 2 ** 16))
def test_flex_forward_equals_rows_alone(tree, seed):
    # Few examples: eager FlexAttention on the CPU costs ~0.1 s a call.
    q, k, v = _qkv(tree.num_tokens, seed=seed)
    got = seqpack.attention(q, k, v, tree, backend="flex")
    torch.testing.assert_close(got, dense(q, k, v, tree), rtol=1e-12, atol=1e-12)
    for idx, alone in rows_alone(q, k, v, tree):
        torch.testing.assert_close(got[idx], alone, rtol=1e-12, atol=1e-12)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=forests() | rollouts(), seed=st.integers(0, 2 ** 16), scale=st.none() | st.floats(0.05, 2.0))
def test_sdpa_and_varlen_gradients_equal_reference(tree, seed, scale):
    q, k, v = _qkv(tree.num_tokens, seed=seed, grad=True)
    g = torch.Generator().manual_seed(seed + 1)
    up = torch.randn(q.shape, generator=g, dtype=torch.float64)
    grads = {}
    for backend in ["reference", "sdpa", "varlen"]:
        out = seqpack.attention(q, k, v, tree, softmax_scale=scale, backend=backend)
        grads[backend] = torch.autograd.grad(out, (q, k, v), up, allow_unused=True)
    if tree.num_tokens == 0:
        return
    for backend in ["sdpa", "varlen"]:
        for name, a, b in zip("qkv", grads[backend], grads["reference"]):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=f"{backend} {name}")


def test_gradcheck_sdpa_on_a_branching_tree():
    tree = seqpack.pack_prefix_tree([[5, 6, 7], [5, 6, 8, 9], [5, 6], [5]], group_ids=[0, 0, 0, 1],
                                    pad_to_multiple_of=4)
    q, k, v = _qkv(tree.num_tokens, hq=2, hk=1, d=3, grad=True)
    for backend in ("sdpa", "varlen"):
        assert torch.autograd.gradcheck(lambda *x: seqpack.attention(*x, tree, backend=backend), (q, k, v))


def test_docstring_tree_and_scalars():
    """The module docstring's tree: row 5 6 8 9 sees 0 1 3 4; NumPy and 0-d tensor
    scales give the same result as a float."""
    tree = seqpack.pack_prefix_tree([[5, 6, 7], [5, 6, 8, 9], [5, 6], [5]], group_ids=[0, 0, 0, 1])
    assert tree.segment_offsets.tolist() == [0, 2, 3, 5, 6]
    q, k, v = _qkv(tree.num_tokens, hq=2, hk=2)
    out = seqpack.attention(q, k, v, tree, softmax_scale=0.5, backend="sdpa")
    for s in (np.float32(0.5), np.int64(1) / 2, torch.tensor(0.5)):
        torch.testing.assert_close(seqpack.attention(q, k, v, tree, softmax_scale=s, backend="sdpa"), out)
    torch.testing.assert_close(out, dense(q, k, v, tree, scale=0.5))
    torch.testing.assert_close(out[5], v[5])  # row "5" alone, in another group


def test_same_shape_segments_are_batched_and_budget_split():
    """GRPO-like: 6 responses of equal length under one prompt form one shape group;
    a tiny budget splits the group into several calls with the same result."""
    prompt = [1, 2, 3, 4]
    tree = seqpack.pack_prefix_tree([prompt + [10 + i, 20 + i] for i in range(6)])
    plan = attention_plan(tree)
    assert sorted(plan.groups) == [(1, 0, 4), (6, 4, 2)]
    q, k, v = _qkv(tree.num_tokens)
    whole = attention_tree._sdpa(q, k, v, tree, 1.0)
    split = attention_tree._sdpa(q, k, v, tree, 1.0, budget=1)
    torch.testing.assert_close(split, whole, rtol=0, atol=0)
    torch.testing.assert_close(whole, dense(q, k, v, tree, scale=1.0))


def test_empty_tree_and_auto():
    tree = seqpack.pack_prefix_tree([[], []])
    q, k, v = _qkv(0)
    for backend in ["auto"] + CPU_BACKENDS:
        assert seqpack.attention(q, k, v, tree, backend=backend).shape == (0, 4, 8)
    tree = seqpack.pack_prefix_tree([[1, 2], [1, 3]])
    q, k, v = _qkv(tree.num_tokens, grad=True)
    out = seqpack.attention(q, k, v, tree)  # auto on the CPU: sdpa, with gradients
    out.sum().backward()
    assert q.grad is not None and k.grad is not None and v.grad is not None


def test_backends_report():
    report = attention_tree.tree_attention_backends()
    assert set(report) == set(attention_tree.TREE_BACKENDS)
    assert report["sdpa"] == report["varlen"] == report["reference"] == "available"


def test_autocast_casts_mixed_dtypes_and_outside_it_they_raise():
    tree = seqpack.pack_prefix_tree([[1, 2, 3], [1, 2, 4], [1]], pad_to_multiple_of=4)
    q, k, v = _qkv(tree.num_tokens, dtype=torch.float32)
    v = v.to(torch.bfloat16).requires_grad_()
    q.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = seqpack.attention(q, k, v, tree, backend="sdpa")
        ref = seqpack.attention(q, k, v, tree, backend="reference")
    assert out.dtype == ref.dtype == torch.bfloat16
    cast = [x.detach().to(torch.bfloat16) for x in (q, k, v)]
    torch.testing.assert_close(out, seqpack.attention(*cast, tree, backend="sdpa"), rtol=0, atol=0)
    torch.testing.assert_close(out.float(), dense(q, k, v, tree).float(), rtol=3e-2, atol=3e-2)
    out.float().sum().backward()
    assert q.grad.dtype == torch.float32 and v.grad.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="share dtype"):
        seqpack.attention(q, k, v, tree)


def test_bad_inputs_name_the_argument_and_rule():
    tree = seqpack.pack_prefix_tree([[1, 2, 3], [1, 2, 4]])
    q, k, v = _qkv(tree.num_tokens)
    with pytest.raises(ValueError, match=r"tree.num_tokens = 4"):
        seqpack.attention(q[:3], k[:3], v[:3], tree)
    with pytest.raises(ValueError, match=r"tree.num_tokens = 4"):
        seqpack.attention(q, k[:3], v[:3], tree)
    with pytest.raises(ValueError, match=r"q must be a \[T, H, D\] tensor"):
        seqpack.attention(q[:, 0], k, v, tree)
    with pytest.raises(TypeError, match=r"\bq\b"):
        seqpack.attention(q.numpy(), k, v, tree)
    with pytest.raises(TypeError, match="layout must be a layout"):
        seqpack.attention(q, k, v, [[1, 2, 3], [1, 2, 4]])
    with pytest.raises(ValueError, match="backend must be 'auto' or one of"):
        seqpack.attention(q, k, v, tree, backend="flash")
    with pytest.raises(TypeError, match="backend must be a string"):
        seqpack.attention(q, k, v, tree, backend=None)
    with pytest.raises(ValueError, match=r"multiple of k/v heads"):
        seqpack.attention(q, k[:, :1].repeat(1, 3, 1), v[:, :1].repeat(1, 3, 1), tree)
    with pytest.raises(TypeError, match="softmax_scale"):
        seqpack.attention(q, k, v, tree, softmax_scale="big")
    with pytest.raises(ValueError, match="no backward on the CPU"):
        seqpack.attention(q, k, v.requires_grad_(), tree, backend="flex")


def test_reference_refuses_large_inputs(monkeypatch):
    tree = seqpack.pack_prefix_tree([[1, 2, 3], [1, 2, 4]])
    q, k, v = _qkv(tree.num_tokens)
    monkeypatch.setattr(attention_tree, "MAX_REFERENCE_SCORES", 4 * 4 * 4 - 1)
    with pytest.raises(ValueError, match="MAX_REFERENCE_SCORES"):
        seqpack.attention(q, k, v, tree, backend="reference")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # sdpa is not limited by it
        seqpack.attention(q, k, v, tree, backend="sdpa")


def test_wide_fan_and_deep_chain():
    """A 300-way fan under one prompt and a 40-deep chain of single-token branches."""
    fan = [[7, 8, 9] + [i % 97, i] for i in range(300)]
    chain = [list(range(100, 100 + n)) + [999] for n in range(1, 41)]
    tree = seqpack.pack_prefix_tree(fan + chain, group_ids=[0] * len(fan) + [1] * len(chain))
    q, k, v = _qkv(tree.num_tokens, hq=2, hk=1, d=4)
    for backend in ("sdpa", "varlen"):
        out = seqpack.attention(q, k, v, tree, backend=backend)
        for idx, alone in rows_alone(q, k, v, tree):
            torch.testing.assert_close(out[idx], alone, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("backend", ["sdpa", "varlen"])
def test_low_precision_close_to_reference(dtype, tol, backend):
    tree = seqpack.pack_prefix_tree([[1, 2, 3, 4], [1, 2, 5], [1, 2, 5, 6, 7], [9]], pad_to_multiple_of=8)
    q, k, v = _qkv(tree.num_tokens, dtype=dtype)
    out = seqpack.attention(q, k, v, tree, backend=backend)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), dense(q, k, v, tree), rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("backend, dtype, tol", [("sdpa", torch.float32, 1e-4), ("flex", torch.float32, 1e-4),
                                                 ("varlen", torch.float32, 1e-4), ("varlen", torch.bfloat16, 3e-2),
                                                 ("auto", torch.bfloat16, 3e-2)])
def test_cuda_backends_with_gradients(backend, dtype, tol):
    """On CUDA, bf16 varlen (and auto) is one flash-attn / varlen_attn launch over the
    segments; every backend against the fp64 reference, values and gradients."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if backend != "auto" and attention_tree.tree_attention_backends()[backend] != "available":
        pytest.skip(attention_tree.tree_attention_backends()[backend])
    rows = [[1, 2, 3, 4], [1, 2, 5], [1, 2, 5, 6, 7], [9]] * 3 + [list(range(200)) + [g, 7, 8] for g in range(8)]
    tree = seqpack.pack_prefix_tree(rows, pad_to_multiple_of=8)
    q, k, v = (x.cuda().to(dtype).requires_grad_() for x in _qkv(tree.num_tokens, hq=4, hk=2, d=64))
    up = torch.randn_like(q)
    got = seqpack.attention(q, k, v, tree, backend=backend)
    exact = [x.detach().double().requires_grad_() for x in (q, k, v)]
    want = seqpack.attention(*exact, tree, backend="reference")
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), up), torch.autograd.grad(want, exact, up.double())):
        torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol)


def test_plan_is_built_once_per_tree():
    rows = [[1, 2, 3], [1, 2, 4, 5]]
    tree = seqpack.pack_prefix_tree(rows)
    assert attention_plan(tree) is attention_plan(tree)
    assert tree.planned() == ("attention",)
    other = seqpack.pack_prefix_tree(rows[::-1])  # a different tree: its own plan
    q, k, v = _qkv(tree.num_tokens)
    for t in (tree, other, tree):
        torch.testing.assert_close(seqpack.attention(q, k, v, t, backend="sdpa"), dense(q, k, v, t))


# ---- issue 38: rows that share nothing run plain packing; chains cost their longest row
def test_rows_that_share_nothing_run_plain_packings_kernels(monkeypatch):
    """Nothing shared: whichever of sdpa / varlen is asked for, one varlen_attention
    call on the rows' offsets with q, k and v as they are (no gather, no tree plan)."""
    tree = seqpack.pack_prefix_tree([[1, 2, 3], [4, 5], [6, 7, 8, 9]], pad_to_multiple_of=4)
    q, k, v = _qkv(tree.num_tokens, grad=True)
    calls = []
    real = attention_tree.varlen_attention

    def spy(qq, kk, vv, cu_q, cu_k, *args, **kwargs):
        calls.append((qq is q and kk is k and vv is v, list(cu_q), list(cu_k)))
        return real(qq, kk, vv, cu_q, cu_k, *args, **kwargs)

    monkeypatch.setattr(attention_tree, "varlen_attention", spy)
    for backend in ("sdpa", "varlen", "auto"):
        out = seqpack.attention(q, k, v, tree, backend=backend)
        torch.testing.assert_close(out, dense(q, k, v, tree))
    rows = [0, 3, 5, 9, 10, 11, 12]  # the three rows, then the pads as one-token sequences
    assert calls == [(True, rows, rows)] * 3
    plan = attention_plan(tree)
    assert plan.plain and plan.groups == [] and plan.group_q.size == 0


def test_a_shared_prefix_does_not_take_the_plain_path(monkeypatch):
    tree = seqpack.pack_prefix_tree([[1, 2, 3], [1, 2, 4]])
    monkeypatch.setattr(attention_tree, "_plain", lambda *a: pytest.fail("a tree with sharing ran the plain path"))
    q, k, v = _qkv(tree.num_tokens)
    for backend in ("sdpa", "varlen"):
        torch.testing.assert_close(seqpack.attention(q, k, v, tree, backend=backend), dense(q, k, v, tree))


_CHAIN_SCRIPT = r"""
import resource, sys, time, numpy as np, torch, seqpack
torch.manual_seed(0)
n, backend, kind = 10_000, sys.argv[1], sys.argv[2]
ids = np.random.default_rng(0).integers(0, 1000, n).tolist()
rows = [ids[:c] for c in range(400, n + 1, 400)] if kind == "chain" else [ids]
tree = seqpack.pack_prefix_tree(rows)
assert tree.num_tokens == n
q, k, v = (torch.randn(n, 2, 16, requires_grad=True) for _ in range(3))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
seqpack.attention(q, k, v, tree, backend=backend).sum().backward()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024, time.perf_counter() - start)
"""


@pytest.mark.parametrize("backend", ["sdpa", "varlen"])
def test_a_chain_of_10k_tokens_costs_what_its_longest_row_costs(backend):
    """25 rows, each a prefix of the next (one row per turn of a 10k-token rollout):
    forward + backward grow peak memory by no more than the longest row alone does,
    within 10% (plus 8 MiB of allocator noise). Before issue 38 each row end started
    a segment whose keys were gathered along its whole path (+583 / +700 MB at 2.5k)."""
    import subprocess
    import sys

    def peak(kind):
        out = subprocess.run([sys.executable, "-c", _CHAIN_SCRIPT, backend, kind], capture_output=True, text=True,
                             check=True, timeout=300)
        return float(out.stdout.split()[0])

    chain, alone = peak("chain"), peak("row")
    assert chain <= 1.1 * alone + 8, (chain, alone)


def test_the_cpu_sdpa_backend_reads_each_shared_prefix_once(monkeypatch):
    """CPU, shared prefixes: the cascade path (each parent's path gathered once for all
    its children, two fused-kernel parts merged by log-sum-exp); its values and
    gradients equal the segment-gather path's and the fp64 reference's."""
    from seqpack.training import attention_tree_cascade

    prompt = [1, 2, 3, 4, 5]
    tree = seqpack.pack_prefix_tree([prompt + [10 + i, 20 + i, 30] for i in range(4)] + [prompt + [10, 20, 30, 7]]
                                    + [[9, 9]], pad_to_multiple_of=4)
    plan = attention_plan(tree)
    # the prompt's 4 child segments (10 20 30 7 continues a chain: one segment) as one query block of
    # 13 rows against the prompt's 5 keys, gathered once, not once per child
    assert plan.prefix_groups == [(13, 5)] and plan.prefix_k.tolist() == [0, 1, 2, 3, 4]
    calls = []
    real = attention_tree.tree_cascade_attention
    monkeypatch.setattr(attention_tree, "tree_cascade_attention", lambda *a: calls.append(1) or real(*a))
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        q, k, v = (x.to(dtype).requires_grad_() for x in _qkv(tree.num_tokens))
        up = torch.randn(tree.num_tokens, 4, 8, dtype=torch.float64)
        got = seqpack.attention(q, k, v, tree, backend="sdpa")
        exact = [x.detach().double().requires_grad_() for x in (q, k, v)]
        want = seqpack.attention(*exact, tree, backend="reference")
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
        for a, b in zip(torch.autograd.grad(got, (q, k, v), up.to(dtype)), torch.autograd.grad(want, exact, up)):
            torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol)
    assert len(calls) == 3


@pytest.mark.parametrize("backend", ["sdpa", "varlen"])
@pytest.mark.parametrize("pad", [1, 8])
def test_a_tree_that_shares_little_runs_as_its_rows(backend, pad):
    """Expanded (the plan's choice when the rows' pairs are under EXPAND_BELOW times
    the tree's): the rows' plain attention, each token's output at its first
    occurrence, pad tokens their own v; fp64 values and gradients as the dense mask."""
    rng = np.random.default_rng(0)
    rows = [[7] + (rng.permutation(50)[:40] + 100 * i).tolist() for i in range(1, 4)]
    tree = seqpack.pack_prefix_tree(rows, pad_to_multiple_of=pad)
    assert attention_plan(tree).expand
    q, k, v = _qkv(tree.num_tokens, grad=True)
    out = seqpack.attention(q, k, v, tree, backend=backend)
    want = dense(q, k, v, tree)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
    for got, ref in zip(torch.autograd.grad(out.pow(2).sum(), (q, k, v)),
                        torch.autograd.grad(want.pow(2).sum(), (q, k, v))):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
