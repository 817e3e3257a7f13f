"""The extension's tensor boundary: tensors cross as DLPack and the binding checks
shape, dtype, strides, device and output sizes before any kernel runs, raising
ValueError / TypeError that name the function and the argument."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import seqpack  # noqa: E402
from seqpack import _core  # noqa: E402


def _stats_args(rows=5, vocab=7, **over):
    logits = torch.randn(rows, vocab)
    targets = torch.randint(0, vocab, (rows,))
    out = torch.zeros(4, rows)
    args = dict(logits=logits, targets=targets, vocab_start=0, temperature=1.0, max=out[0], sumexp=out[1],
                zexp=out[3], target_z=out[2])
    args.update(over)
    return args


def test_row_stats_accepts_well_formed_tensors_and_numpy():
    args = _stats_args()
    _core.logprob_row_stats(**args)
    z = args["logits"]
    assert torch.allclose(args["max"], z.max(1).values)
    assert torch.allclose(args["target_z"], z.gather(1, args["targets"][:, None])[:, 0])
    # NumPy arrays cross the same way (they implement __dlpack__).
    np_args = {k: (v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in _stats_args().items()}
    _core.logprob_row_stats(**np_args)


@pytest.mark.parametrize("bad, error, message", [
    (dict(logits=torch.randn(5, 7, 1)), ValueError, r"\[logprob_row_stats\] logits must have 2 dimensions"),
    (dict(logits=torch.randn(5, 7, dtype=torch.float64)), TypeError,
     "logits must be one of float32, bfloat16, float16"),
    (dict(logits=torch.randn(7, 5).t()), ValueError, "logits must have unit column stride"),
    (dict(logits=[[0.0] * 7] * 5), TypeError, r"logits must be a tensor \(an object with __dlpack__\), got list"),
    (dict(targets=torch.zeros(5, dtype=torch.int32)), TypeError, "targets must be int64"),
    (dict(targets=torch.zeros(4, dtype=torch.int64)), ValueError, r"targets must have shape \[5\]"),
    (dict(max=torch.zeros(4)), ValueError, r"max must have shape \[5\] \(got float32 \[4\] on cpu\)"),
    (dict(sumexp=torch.zeros(5, dtype=torch.float64)), TypeError, "sumexp must be float32"),
    (dict(target_z=torch.zeros(10)[::2]), ValueError, "target_z must be contiguous"),
    (dict(max=None), TypeError, "max, sumexp and target_z must be a tensor, got None"),
    (dict(logits=torch.randn(5, 7, requires_grad=True)), TypeError, "logits cannot be exported through DLPack"),
])
def test_row_stats_rejects_bad_tensors(bad, error, message):
    with pytest.raises(error, match=message):
        _core.logprob_row_stats(**_stats_args(**bad))


def test_row_grad_checks_its_output():
    rows, vocab = 4, 6
    logits = torch.randn(rows, vocab)
    targets = torch.randint(0, vocab, (rows,))
    vec = [torch.zeros(rows) for _ in range(3)]
    ok = dict(logits=logits, targets=targets, vocab_start=0, temperature=1.0, max=logits.max(1).values,
              log_sumexp=torch.logsumexp(logits, 1) - logits.max(1).values, entropy=None, grad_logprob=torch.ones(rows), grad_entropy=None,
              grad=torch.empty(rows, vocab))
    _core.logprob_row_grad(**ok)
    expected = torch.nn.functional.one_hot(targets, vocab) - torch.softmax(logits, 1)
    assert torch.allclose(ok["grad"], expected, atol=1e-6)
    for grad, error, message in [(torch.empty(rows, vocab - 1), ValueError, r"grad must have shape \[4, 6\]"),
                                 (torch.empty(rows, vocab, dtype=torch.bfloat16), TypeError,
                                  "grad must have the dtype of logits"),
                                 (torch.empty(vocab, rows).t(), ValueError, "grad must have unit column stride")]:
        with pytest.raises(error, match=message):
            _core.logprob_row_grad(**{**ok, "grad": grad})
    with pytest.raises(ValueError, match=r"grad_logprob must have shape \[4\]"):
        _core.logprob_row_grad(**{**ok, "grad_logprob": vec[0][:3]})


def _plan():
    return _core.thd_plan([2, 3], None, 2, 4, 2, 0, 1, 1, 0)  # batch 2, width 4, pad to 2: 2 + 4 = 6 rows


def test_pack_into_checks_both_tensors_against_the_plan():
    plan = _plan()
    src = torch.arange(8 * 3, dtype=torch.float32).view(2, 4, 3)
    dst = torch.empty(6, 3)
    plan.pack_into(src, dst)
    assert dst[:2].tolist() == src[0, :2].tolist()
    with pytest.raises(ValueError, match=r"dst must have 6 rows"):
        plan.pack_into(src, torch.empty(5, 3))
    with pytest.raises(ValueError, match=r"src must start with \[batch, width\] = \[2, 4\]"):
        plan.pack_into(torch.zeros(2, 3, 3), dst)
    with pytest.raises(TypeError, match="dst must have the dtype of src"):
        plan.pack_into(src, torch.empty(6, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="rows differ: 12 bytes per source row, 8 per destination row"):
        plan.pack_into(src, torch.empty(6, 2))
    with pytest.raises(ValueError, match="dst must be contiguous"):
        plan.pack_into(src, torch.empty(3, 6).t())
    with pytest.raises(ValueError, match=r"\[ThdPlan.unpack_into\] src must have 6 rows"):
        plan.unpack_into(src, torch.empty(2, 4, 3))


def test_position_ids_and_move_rows_check_sizes():
    plan = _plan()
    out = torch.empty(6, dtype=torch.int64)
    plan.position_ids_into(out)
    assert out.tolist() == [0, 1, 0, 1, 2, 3]
    host = np.empty(6, dtype=np.int64)
    plan.position_ids_into(host)
    assert host.tolist() == out.tolist()
    with pytest.raises(ValueError, match=r"out must have shape \[6\]"):
        plan.position_ids_into(torch.empty(5, dtype=torch.int64))
    with pytest.raises(TypeError, match="out must be int64"):
        plan.position_ids_into(torch.empty(6, dtype=torch.int32))
    copies = np.array([[0, 0, 4]], dtype=np.int64)  # 4 rows from row 0 to row 0
    fills = np.zeros((0, 2), dtype=np.int64)
    dst = torch.zeros(4, 2)
    _core.move_rows(copies, fills, torch.ones(4, 2), 1, dst, 1)
    assert dst.sum() == 8
    with pytest.raises(ValueError):  # the runs leave a destination of 3 rows: refused, never written
        _core.move_rows(copies, fills, torch.ones(4, 2), 1, torch.zeros(3, 2), 1)
    with pytest.raises(ValueError, match="src must have at least 3 dimensions"):
        _core.move_rows(copies, fills, torch.ones(4, 2), 3, dst, 1)


def test_read_only_arrays_are_read_through_dlpack_1_and_never_written():
    # A NumPy view of an Arrow buffer is read-only: it has no legacy DLPack capsule,
    # DLPack 1.0 exports it with a read-only flag (seqpack.integrations.trl reads one).
    src = np.arange(8, dtype=np.int32)
    src.setflags(write=False)
    dst = np.zeros(4, dtype=np.int32)
    runs, no_fills = np.array([[1, 0, 2], [5, 2, 2]], np.int64), np.zeros((0, 2), np.int64)
    _core.move_rows(runs, no_fills, src, 1, dst, 1)
    assert dst.tolist() == [1, 2, 5, 6]
    with pytest.raises(ValueError, match="dst is read-only"):
        _core.move_rows(runs, no_fills, dst, 1, src, 1)


def test_cuda_entry_points_refuse_host_tensors():
    if not _core.built_with_cuda:
        pytest.skip("built without CUDA")
    x = torch.zeros(4, 2)
    tasks = torch.zeros(0, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"\[cuda_move\] src must be on a CUDA device"):
        _core.cuda_move(x, 1, x, 1, tasks, None, 0)
    with pytest.raises(ValueError, match=r"\[cuda_positions\] out must be on a CUDA device"):
        _core.cuda_positions(torch.zeros(1, 3, dtype=torch.int64), torch.zeros(4, dtype=torch.int64), 0)


def test_empty_tensors_are_contiguous_whatever_their_strides():
    plan = _core.thd_plan([0], None, 1, 0, 1, 0, 1, 1, 0)
    src = np.empty((1, 0), dtype=np.int64)  # NumPy gives this strides (0, 8)
    dst = np.empty(0, dtype=np.int64)
    plan.pack_into(src, dst, np.int64(0).tobytes())


def test_huge_page_advice_takes_a_tensor():
    assert _core.advise_huge_pages(torch.empty(16)) in (True, False)
    with pytest.raises(ValueError, match="tensor must be contiguous"):
        _core.advise_huge_pages(torch.empty(4, 4).t())


def test_public_ops_still_reach_the_kernels():
    # The Python layer passes tensors (not addresses): an end-to-end call works.
    logits = torch.randn(6, 5)
    ids = torch.tensor([1, 2, 3, 0, 4, 1])
    lp = seqpack.token_logprobs(logits, [0, 3, 6], ids).logprobs
    ref = torch.log_softmax(logits, 1)
    assert torch.allclose(lp[0], ref[0, 2]) and lp[2] == 0


@pytest.mark.gpu
def test_device_mismatches_are_refused_before_any_launch():
    logits = torch.randn(5, 7, device="cuda")
    args = _stats_args(logits=logits, targets=torch.zeros(5, dtype=torch.int64))  # targets on the host
    with pytest.raises(ValueError, match="targets must be on the device of logits"):
        _core.logprob_row_stats(**args)
    out = torch.zeros(4, 5, device="cuda")
    args = _stats_args(logits=logits, targets=torch.zeros(5, dtype=torch.int64, device="cuda"), max=out[0],
                       sumexp=out[1], zexp=out[3], target_z=out[2])
    _core.logprob_row_stats(**args, stream=torch.cuda.current_stream().cuda_stream)
    torch.testing.assert_close(out[0], logits.max(1).values)
    plan = _plan()
    with pytest.raises(ValueError, match=r"\[ThdPlan.pack_into\] src must be on the CPU"):
        plan.pack_into(torch.zeros(2, 4, 3, device="cuda"), torch.empty(6, 3, device="cuda"))
    with pytest.raises(ValueError, match="out must be on the CPU"):
        plan.position_ids_into(torch.empty(6, dtype=torch.int64, device="cuda"))
    x = torch.zeros(4, 2, device="cuda")
    with pytest.raises(ValueError, match="dst must be on the device of src"):
        _core.cuda_move(x, 1, torch.zeros(4, 2), 1, torch.zeros(0, 3, dtype=torch.int64, device="cuda"), None, 0)
    with pytest.raises(ValueError, match=r"fill must have shape \[8\]"):
        _core.cuda_move(x, 1, x.clone(), 1, torch.zeros(0, 3, dtype=torch.int64, device="cuda"),
                        torch.zeros(4, dtype=torch.uint8, device="cuda"), 0)


def test_int_lists_reads_python_rows_or_names_the_first_it_cannot():
    offsets, values, bad = _core.int_lists([[1, 2, 3], (4, 5), [], [True, -7], [2**63 - 1]])
    assert bad == -1 and offsets.tolist() == [0, 3, 5, 5, 7, 8]
    assert values.tolist() == [1, 2, 3, 4, 5, 1, -7, 2**63 - 1] and values.dtype == np.int64
    assert _core.int_lists([])[2] == -1 and _core.int_lists([[]])[0].tolist() == [0, 0]
    assert _core.int_lists([[1], [2.0]])[2] == 1  # a float: read by Arrow instead
    assert _core.int_lists([[1], [2], np.arange(3)])[2] == 2  # an array row
    assert _core.int_lists([[1], None])[2] == 1
    assert _core.int_lists([[0], [2**63]])[2] == 1 and _core.int_lists([[-(2**63) - 1]])[2] == 0  # past int64
    with pytest.raises(TypeError):
        _core.int_lists(([1],))  # the rows must be a list
