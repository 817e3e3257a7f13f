"""packed_token_logprobs: equal to the padded PyTorch computation (values and
gradients), CP-local rows, bf16, entropy, temperature, the torch fallback, errors."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import seqpack
from seqpack.tensors.cp import cp_partition_indices
from seqpack.training import _logprob_ops as lpmod
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


def masked_reference(logits, ids, lengths, cu_p, temperature=1.0):
    """:func:`reference` for logits with -inf entries: those become -1e4 (exp is
    exactly 0 in fp64 and 0 * -1e4 = 0, where PyTorch's own 0 * -inf gives NaN in
    the entropy and in every gradient of the row)."""
    logits = logits.double().masked_fill(logits == -float("inf"), -1e4)
    lsm = torch.log_softmax(logits / temperature, -1)
    rows, targets = [], []
    for i, n in enumerate(lengths):
        for t in range(int(cu_p[i]), int(cu_p[i]) + n - 1):
            rows.append(t)
            targets.append(int(ids[t + 1]))
    rows_t = torch.tensor(rows, dtype=torch.long)
    lp = (lsm[:, 0] * 0).index_put((rows_t,), lsm[rows_t, torch.tensor(targets, dtype=torch.long)])
    p = lsm.exp()
    h = -torch.where(p > 0, p * lsm, 0.0).sum(-1)
    ent = (lsm[:, 0] * 0).index_put((rows_t,), h[rows_t])
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
        rows = torch.from_numpy(cp_partition_indices(cu_p, cp, rank))
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
    lp = packed_token_logprobs(logits, ids, cu, cu_p).logprobs
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
    ours = packed_token_logprobs(logits, ids, cu, cu_p).logprobs
    lsm = torch.log_softmax(logits, -1)  # PyTorch's bf16 path
    mask = next_token_sources(cu, cu_p) >= 0
    rows = torch.from_numpy(np.nonzero(mask)[0])
    targets = ids[torch.from_numpy(next_token_sources(cu, cu_p)[mask])]
    theirs = torch.zeros(total, dtype=torch.float64).index_put((rows,), lsm[rows, targets].double())
    err_ours = (ours.double() - exact).abs().max()
    err_torch = (theirs - exact).abs().max()
    assert err_ours <= 2 * err_torch + 1e-6
    logits.requires_grad_()
    packed_token_logprobs(logits, ids, cu, cu_p).logprobs.sum().backward()
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
    seqpack._core.logprob_row_stats(logits, targets, 0, 0.7, k[0], k[1], k[3], k[2], 0)
    torch.testing.assert_close(stats, k, rtol=1e-5, atol=1e-5)
    m, log_se = stats[0], stats[1].log()
    ent = log_se - stats[3] / stats[1]
    g_lp, g_ent = torch.randn(total), torch.randn(total)
    g_lp = torch.where(targets >= 0, g_lp, 0.0)
    g_ent = torch.where(targets >= 0, g_ent, 0.0)
    ours = torch.empty_like(logits)
    lpmod._grad_torch(logits, targets, 0, 0.7, m, log_se, ent, g_lp, g_ent, ours)
    kernel = torch.empty_like(logits)
    seqpack._core.logprob_row_grad(logits, targets, 0, 0.7, m, log_se, ent, g_lp, g_ent, kernel, 0)
    torch.testing.assert_close(ours, kernel, rtol=1e-5, atol=1e-6)  # 1 - p near p = 1 cancels


def test_threads_do_not_change_the_result():
    torch.manual_seed(4)
    cu, cu_p = layout([300, 200, 500], 1)
    logits = torch.randn(1000, 5000)
    ids = torch.randint(0, 5000, (1000,))
    one = packed_token_logprobs(logits, ids, cu, cu_p, num_threads=1).logprobs
    many = packed_token_logprobs(logits, ids, cu, cu_p, num_threads=4).logprobs
    assert torch.equal(one, many)


def test_errors():
    cu, cu_p = layout([3, 2], 1)
    ids = torch.zeros(5, dtype=torch.long)
    with pytest.raises(ValueError, match=r"logits must be a \[T, V\] tensor"):
        packed_token_logprobs(torch.zeros(5), ids, cu, cu_p)
    with pytest.raises(TypeError, match="float32, bfloat16, float16 or float64"):
        packed_token_logprobs(torch.zeros(5, 3, dtype=torch.int32), ids, cu, cu_p)
    with pytest.raises(ValueError, match="logits has 4 rows; the packed layout has 5"):
        packed_token_logprobs(torch.zeros(4, 3), ids, cu, cu_p)
    with pytest.raises(ValueError, match=r"input_ids must hold the full packed ids \[5\]"):
        packed_token_logprobs(torch.zeros(5, 3), ids[:4], cu, cu_p)
    with pytest.raises(TypeError, match="cu_seqlens must hold integers"):
        packed_token_logprobs(torch.zeros(5, 3), ids, cu.astype(np.float64), cu_p)
    with pytest.raises(ValueError, match="sequence 0 has 4 real tokens but a padded length of 3"):
        packed_token_logprobs(torch.zeros(5, 3), ids, [0, 4, 5], [0, 3, 5])
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="temperature must be a positive finite number"):
            packed_token_logprobs(torch.zeros(5, 3), ids, cu, cu_p, temperature=bad)
    with pytest.raises(ValueError, match="multiple of"):
        packed_token_logprobs(torch.zeros(2, 3), ids, cu, cu_p, cp_size=2)


def test_docs_worked_example():
    # docs/losses.md: lengths [5, 3] padded to [8, 4], CP = 2.
    assert cp_partition_indices([0, 8, 12], 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
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
masked = base.clone()
masked[:, 900:] = -float("inf")  # a padded vocabulary: every lane of the tail masked
masked[3, :450] = -float("inf")  # the first half of a row: lanes that start on -inf
x = masked.detach().requires_grad_()
lp, ent = packed_token_logprobs(x, ids % 450 + 450, cu, return_entropy=True)
(lp + ent).sum().backward()
out["masked"] = (lp.detach(), ent.detach(), x.grad)
nan = base.clone()
nan[5, 17] = float("nan")
out["nan"] = tuple(packed_token_logprobs(nan, ids, cu, return_entropy=True))
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
    nan_lp, nan_ent = out.pop("nan")
    assert torch.isnan(nan_lp[5]) and torch.isnan(nan_ent[5]) and torch.isfinite(nan_lp[6:]).all()
    lp, ent, grad = out.pop("masked")
    x = base[:, :900].clone()
    x[3, :450] = -float("inf")
    x = x.double().requires_grad_()
    ref_lp, ref_ent = masked_reference(x, (ids % 450 + 450), lengths, cu_p)
    (ref_lp + ref_ent).sum().backward()
    torch.testing.assert_close(lp.double(), ref_lp.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent.detach(), rtol=1e-5, atol=1e-5)
    assert (grad[:, 900:] == 0).all() and torch.isfinite(grad).all()
    torch.testing.assert_close(grad[:, :900].double(), x.grad, rtol=1e-5, atol=1e-7)
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


# ---- masked vocabularies, NaN, ids, the named result, custom ops, compile ----------
def _issue_case(dtype=torch.float32):
    torch.manual_seed(11)
    logits = torch.randn(18, 40)
    logits[:, 30:] = -float("inf")
    cu = np.array([0, 5, 6, 15, 18], dtype=np.int32)
    ids = torch.randint(0, 30, (18,))
    return logits.to(dtype), ids, cu, [5, 1, 9, 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_masked_vocabulary_gives_finite_entropy_and_zero_gradient(dtype):
    # The issue's reproduction: 140 NaN gradient entries and a non-finite entropy before.
    logits, ids, cu, lengths = _issue_case(dtype)
    x = logits.clone().requires_grad_()
    w = torch.linspace(-1, 1, 18)
    lp, ent = packed_token_logprobs(x, ids, cu, return_entropy=True, temperature=0.9)
    ((lp * w).sum() + (ent * w.flip(0)).sum()).backward()
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all() and torch.isfinite(x.grad).all()
    assert (x.grad[:, 30:] == 0).all()
    # Against log_softmax on the 30 live columns, in fp64.
    live = logits[:, :30].double().requires_grad_()
    ref_lp, ref_ent = masked_reference(live, ids, lengths, cu, 0.9)
    ((ref_lp * w.double()).sum() + (ref_ent * w.flip(0).double()).sum()).backward()
    tol = {torch.float32: 1e-5, torch.float64: 1e-10}.get(dtype, 2e-2)
    torch.testing.assert_close(lp.double(), ref_lp.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(ent.double(), ref_ent.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(x.grad[:, :30].double(), live.grad, rtol=tol, atol=tol)


def test_nan_and_all_masked_rows_are_nan_as_in_log_softmax():
    logits, ids, cu, _ = _issue_case()
    logits[2, 7] = float("nan")  # not row 2's target column
    logits[8, :] = -float("inf")  # every entry masked
    x = logits.clone().requires_grad_()
    lp, ent = packed_token_logprobs(x, ids, cu, return_entropy=True)
    lsm = torch.log_softmax(logits, -1)
    assert torch.isnan(lsm[2]).all() and torch.isnan(lsm[8]).all()
    assert torch.isnan(lp[2]) and torch.isnan(ent[2]) and torch.isnan(lp[8])
    others = [r for r in range(18) if r not in (2, 8)]
    assert torch.isfinite(lp[others]).all() and torch.isfinite(ent[others]).all()
    lp[others].sum().backward()
    assert torch.isfinite(x.grad[others]).all()


def test_target_ids_outside_the_vocabulary():
    logits, ids, cu, _ = _issue_case()
    bad = ids.clone()
    bad[3] = 40  # == V: gather would raise
    with pytest.raises(ValueError, match=r"input_ids holds id 40 .*position 3.*vocabulary has 40 entries"):
        packed_token_logprobs(logits, bad, cu)
    # Where the host cannot check (the ids on a device), the row gets NaN, never a
    # finite wrong value: the operator on targets directly.
    targets = torch.tensor([1, 45, -1, -100])
    lp, _, _, _ = torch.ops.seqpack.token_logprobs(torch.randn(4, 40), targets, 0, 1.0, False, 0)
    assert torch.isfinite(lp[0]) and torch.isnan(lp[1]) and lp[2] == 0 and lp[3] == 0
    # A negative id means "no target": log-prob 0 and no gradient.
    neg = ids.clone()
    neg[1] = -100  # row 0's target
    x = logits.clone().requires_grad_()
    out = packed_token_logprobs(x, neg, cu, return_entropy=True)
    assert out.logprobs[0] == 0 and out.entropy[0] == 0
    (out.logprobs.sum() + out.entropy.sum()).backward()
    assert (x.grad[0] == 0).all()


@pytest.mark.parametrize("fn", ["packed", "linear"])
def test_host_ids_outside_a_shifted_vocabulary_are_refused_on_both_sides(fn):
    # Issue 26, item 4: with vocab_start > 0 and no group the logits hold the whole
    # vocabulary [vocab_start, vocab_start + V); an id below vocab_start gave NaN
    # (only the upper bound was checked).
    g = torch.Generator().manual_seed(7)
    hidden, weight = torch.randn(5, 3, generator=g), torch.randn(4, 3, generator=g)
    logits = hidden @ weight.T

    def call(ids):
        if fn == "packed":
            return packed_token_logprobs(logits, ids, [0, 5], vocab_start=10).logprobs
        return seqpack.token_logprobs(hidden, [0, 5], ids, weight=weight, vocab_start=10).logprobs

    good = torch.tensor([12, 11, 13, -100, 10])  # -100: no target
    lp = call(good)
    ref = torch.log_softmax(logits.double(), -1)
    expect = torch.tensor([ref[0, 1], ref[1, 3], 0.0, ref[3, 0], 0.0], dtype=torch.float64)  # row i: ids[i + 1]
    torch.testing.assert_close(lp.double(), expect, rtol=1e-5, atol=1e-6)
    for bad_id, pos in ((3, 1), (0, 3), (9, 4), (14, 2)):  # below vocab_start (also 0), and at its end
        ids = good.clone()
        ids[pos] = bad_id
        with pytest.raises(ValueError, match=rf"input_ids holds id {bad_id} \(first out-of-range id at packed "
                                              rf"position {pos}\); with vocab_start = 10 .*\[10, 14\)"):
            call(ids)


def test_device_ids_outside_the_vocabulary_are_masked_on_both_sides():
    # Device ids are not read on the host: the operators they run give NaN for an id
    # above the vocabulary and, alike, for one below vocab_start (never a finite
    # wrong value); negative ids stay "no target".
    g = torch.Generator().manual_seed(8)
    hidden, weight = torch.randn(5, 3, generator=g), torch.randn(4, 3, generator=g)
    targets = torch.tensor([11, 9, 14, -1, 0])
    lp, _, _, _ = torch.ops.seqpack.token_logprobs(hidden @ weight.T, targets, 10, 1.0, False, 0)
    lin, _, _, _ = torch.ops.seqpack.linear_token_logprobs(hidden, weight, None, targets, 10, 1.0, False, 0, 2)
    for out in (lp, lin):
        assert torch.isfinite(out[0]) and out[3] == 0, out
        assert torch.isnan(out[[1, 2, 4]]).all(), out


def test_named_result():
    logits, ids, cu, _ = _issue_case()
    out = packed_token_logprobs(logits, ids, cu)
    assert isinstance(out, seqpack.TokenLogprobs) and out.entropy is None and out.logprobs.shape == (18,)
    lp, ent = packed_token_logprobs(logits, ids, cu, return_entropy=True)
    assert ent.shape == (18,) and lp.dtype == torch.float32


def test_offsets_rule_is_the_same_for_tensors_and_arrays():
    # One rule for every function taking offsets (seqpack.tensors.layout.check_offsets):
    # lists, int32/int64 arrays and tensors; varlen_attention takes the same forms.
    logits, ids, cu, _ = _issue_case()
    ref = packed_token_logprobs(logits, ids, cu).logprobs
    for form in (torch.from_numpy(cu), cu.tolist(), cu.astype(np.int64), torch.from_numpy(cu.astype(np.int64))):
        assert torch.equal(packed_token_logprobs(logits, ids, form).logprobs, ref)
    for bad in (cu.astype(np.float32), torch.from_numpy(cu.astype(np.float32))):
        with pytest.raises(TypeError, match="cu_seqlens must"):
            packed_token_logprobs(logits, ids, bad)


def test_gradcheck_in_float64():
    torch.manual_seed(2)
    cu, cu_p = layout([3, 1, 4], 2)
    total = int(cu_p[-1])
    ids = torch.randint(0, 7, (total,))
    x = torch.randn(total, 7, dtype=torch.float64)
    x[:, 6] = -float("inf")  # a masked column keeps the gradient finite (0)
    x.requires_grad_()

    def f(x):
        return tuple(packed_token_logprobs(x, ids, cu, cu_p, return_entropy=True, temperature=0.8))

    live = x.detach()[:, :6].clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda y: f(torch.cat([y, x.detach()[:, 6:]], 1)), (live,))


def test_custom_ops_pass_opcheck():
    torch.manual_seed(3)
    logits = torch.randn(6, 33)
    targets = torch.tensor([3, -1, 32, 0, 5, -1])
    for entropy in (False, True):
        torch.library.opcheck(torch.ops.seqpack.logprob_stats, (logits, targets, 0, 0.7, entropy, 0))
        torch.library.opcheck(torch.ops.seqpack.token_logprobs,
                              (logits.clone().requires_grad_(), targets, 0, 0.7, entropy, 0))
    m, ls = torch.randn(6), torch.randn(6)
    torch.library.opcheck(torch.ops.seqpack.logprob_grad,
                          (logits, targets, 0, 0.7, m, ls, torch.randn(6), torch.randn(6), torch.randn(6), 0))


def test_device_offsets_path_equals_the_host_path():
    # Offsets as int32 tensors take the no-host-read path (what CUDA graphs and
    # torch.compile use); the result is the host path's.
    logits, ids, cu, _ = _issue_case()
    host = packed_token_logprobs(logits, ids, cu, return_entropy=True)
    cu_t = torch.from_numpy(cu)
    targets = seqpack.logprobs.next_token_targets(ids, cu_t, cu_t, 18)
    assert targets.tolist() == [int(ids[s]) if s >= 0 else -1 for s in next_token_sources(cu)]
    lp, ent, _, _ = torch.ops.seqpack.token_logprobs(logits, targets, 0, 1.0, True, 0)
    assert torch.equal(lp, host.logprobs) and torch.equal(ent, host.entropy)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 20), min_size=1, max_size=6), cp=st.sampled_from([1, 2, 3]),
       extra=st.integers(0, 6), data=st.data())
def test_next_token_targets_against_the_cp_index_map(lengths, cp, extra, data):
    # Reference: the core's zigzag positions (TE's thd_get_partitioned_indices) and
    # each row's sequence found by a plain loop.
    cu, cu_p = layout(lengths, 2 * cp if cp > 1 else 1)
    cu_p = cu_p.copy()
    cu_p[-1] += extra * 2 * cp  # padding on the last sequence
    rank = data.draw(st.integers(0, cp - 1))
    total = int(cu_p[-1])
    positions = cp_partition_indices(cu_p, cp, rank) if cp > 1 else np.arange(total)
    expected = []
    for p in positions:
        i = max(k for k in range(len(lengths)) if cu_p[k] <= p and cu_p[k + 1] > p)
        expected.append(int(p) + 1 if p + 1 < cu_p[i] + lengths[i] else -1)
    got = seqpack.logprobs.next_token_targets(torch.arange(total), torch.from_numpy(cu), torch.from_numpy(cu_p),
                                              total // cp, cp, rank)
    assert got.tolist() == expected


def test_compile_fullgraph_pack_logprobs_entropy_loss_backward():
    # The static-shape path end to end under torch.compile(fullgraph=True) on the
    # CPU: no graph break, and the compiled loss and gradients equal eager's.
    torch.manual_seed(0)
    batch, width, vocab, hidden = 4, 12, 50, 16
    emb, head = torch.nn.Embedding(vocab, hidden), torch.nn.Linear(hidden, vocab)
    ids = torch.randint(0, vocab, (batch, width))
    lens = torch.tensor([12, 3, 0, 7])

    def step(ids, lens):
        packed = seqpack.pack_sequences_static({"input_ids": ids}, lens, max_tokens=48, pad_multiple=4)
        logits = head(emb(packed["input_ids"]))
        out = packed_token_logprobs(logits, packed["input_ids"], packed.cu_seqlens, packed.cu_seqlens_padded,
                                    return_entropy=True, temperature=0.9)
        return -out.logprobs.sum() / 18 - 0.01 * out.entropy.sum()

    def run(fn):
        emb.zero_grad(), head.zero_grad()
        loss = fn(ids, lens)
        loss.backward()
        return loss.detach(), head.weight.grad.clone(), emb.weight.grad.clone()

    eager = run(step)
    torch._dynamo.reset()
    compiled = run(torch.compile(step, fullgraph=True))
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # The packed loss is the padded one.
    logits = head(emb(ids)).double()
    lsm = torch.log_softmax(logits / 0.9, -1)
    ref = 0.0
    for b, n in enumerate(lens.tolist()):
        if n < 2:
            continue
        ref = ref - lsm[b, torch.arange(n - 1), ids[b, 1:n]].sum() / 18
        p = lsm[b, : max(n - 1, 0)].exp()
        ref = ref - 0.01 * -(p * lsm[b, : max(n - 1, 0)]).sum()
    torch.testing.assert_close(eager[0].double(), ref.detach(), rtol=1e-5, atol=1e-5)


def test_operators_check_what_the_kernels_read():
    logits = torch.randn(4, 9)
    targets = torch.tensor([1, 2, -1, 3])
    with pytest.raises(ValueError, match="targets must be int64 \\[4\\]"):
        torch.ops.seqpack.logprob_stats(logits, targets.int(), 0, 1.0, False, 0)
    with pytest.raises(ValueError, match="targets must be int64 \\[4\\]"):
        torch.ops.seqpack.logprob_stats(logits, targets[:3], 0, 1.0, False, 0)
    # Strided and expanded logits are read as the values they show, not as raw rows.
    wide = torch.randn(4, 18)
    ref = torch.ops.seqpack.logprob_stats(wide[:, ::2].contiguous(), targets, 0, 1.0, True, 0)
    assert torch.equal(torch.ops.seqpack.logprob_stats(wide[:, ::2], targets, 0, 1.0, True, 0), ref)
    row = torch.randn(1, 9)
    ref = torch.ops.seqpack.logprob_stats(row.expand(4, 9).contiguous(), targets, 0, 1.0, True, 0)
    assert torch.equal(torch.ops.seqpack.logprob_stats(row.expand(4, 9), targets, 0, 1.0, True, 0), ref)
    with pytest.raises(ValueError, match="grad_entropy needs the entropy"):
        torch.ops.seqpack.logprob_grad(logits, targets, 0, 1.0, torch.zeros(4), torch.zeros(4), None,
                                       torch.ones(4), torch.ones(4), 0)


def test_rows_without_upstream_gradient_get_zeros_on_every_path():
    # A padding row full of NaN (garbage from an attention kernel's unused rows) must
    # not poison the gradient: kernel and PyTorch path alike give exact zeros.
    logits = torch.randn(3, 8, dtype=torch.float64)
    logits[0] = float("nan")
    for x in (logits, logits.float()):
        x = x.clone().requires_grad_()
        lp = packed_token_logprobs(x, torch.tensor([1, 2, 3]), [0, 1, 3]).logprobs  # rows 0 and 2: no target
        assert lp[0] == 0 and lp[2] == 0
        lp.sum().backward()
        assert (x.grad[0] == 0).all() and torch.isfinite(x.grad).all()


def test_static_cp_ranks_add_up_to_the_full_log_probs():
    # Static layout with CP = 2: each rank's zigzag rows and the full packed ids (as
    # a trainer all-gathers them) with device-style int32 offsets; the ranks' log-
    # prob sums add up to the full batch's.
    torch.manual_seed(6)
    ids = torch.randint(0, 40, (3, 10))
    lens = torch.tensor([10, 3, 6])
    table = torch.randn(40, 40, dtype=torch.float64)
    full = seqpack.pack_sequences_static(ids, lens, max_tokens=32, pad_multiple=4)
    whole = packed_token_logprobs(table[full["input"]], full["input"], full.cu_seqlens,
                                  full.cu_seqlens_padded, return_entropy=True)
    total_lp, total_ent = 0.0, 0.0
    for rank in range(2):
        local = seqpack.pack_sequences_static(ids, lens, max_tokens=32, pad_multiple=4, cp_size=2, cp_rank=rank)
        assert torch.equal(local["input"], full["input"][full.position_ids.new_tensor(
            cp_partition_indices(full.cu_seqlens_padded.numpy(), 2, rank))])
        lp, ent = packed_token_logprobs(table[local["input"]], full["input"], local.cu_seqlens,
                                        local.cu_seqlens_padded, cp_size=2, cp_rank=rank, return_entropy=True)
        total_lp, total_ent = total_lp + lp.sum(), total_ent + ent.sum()
    torch.testing.assert_close(total_lp, whole.logprobs.sum())
    torch.testing.assert_close(total_ent, whole.entropy.sum())
