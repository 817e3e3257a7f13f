"""``DistillationLoss`` (issue 30, item 3): NeMo-RL's top-k distillation loss.

- NeMo-RL's distillation tests (``tests/unit/algorithms/test_loss_functions.py``:
  every KL type with and without ``zero_outside_topk``, top-k filtering, k = 0,
  gradient flow, edge cases, initialisation; ``test_model_utils.py``: the bf16
  student gathered before its fp32 upcast) on the CPU. Their literal losses come
  from CUDA random tensors; here the same settings are compared with a reference
  written as NeMo-RL computes it (log_softmax + gather over the whole vocabulary).
- Hypothesis, fp64: packed (per sequence and fused, logits or the LM head fused
  in, any temperature) = unpacked, values and gradients.
- gloo: TP 2 / 3 (logits, and the LM head fused in) and CP 2 / 3 equal one rank,
  values and each rank's gradient.
"""

import math

import pytest
import torch
import torch.distributed as dist
from _gloo import started_pools, values_of
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack import pack_sequences
from seqpack.cp import cp_local_rows
from seqpack.loss import (DistillationLoss, LossConfigError, SequencePackingLossWrapper, distillation_topk_logprobs,
                          prepare_loss_input)

KL_TYPES = ("forward", "reverse", "mixed")


def make_data(batch=2, seq=4, vocab=8, topk=64, seed=42, dtype=torch.float64, lengths=None):
    """NeMo-RL's ``setup_distillation_test_data`` (its order of random draws), on the
    CPU; ``lengths``: right-padded rows of those lengths instead of full ones."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    lengths = lengths or [seq] * batch
    token_mask = (torch.arange(seq)[None] < torch.tensor(lengths)[:, None]).to(dtype)
    data = {"input_ids": ids * token_mask.long(), "input_lengths": torch.tensor(lengths), "token_mask": token_mask,
            "sample_mask": torch.ones(batch, dtype=dtype),
            "teacher_topk_logits": torch.randn(batch, seq, topk, generator=g, dtype=dtype),
            "teacher_topk_indices": torch.randint(0, vocab, (batch, seq, topk), generator=g)}
    logits = torch.randn(batch, seq, vocab, generator=g, dtype=dtype)
    return data, logits


def reference_loss(logits, data, kl_type, zero_outside_topk, weight, global_valid_toks, temperature=1.0):
    """NeMo-RL's DistillationLossFn with its non-distributed input, written out."""
    x = logits.double() / temperature
    idx = data["teacher_topk_indices"]
    lp = torch.log_softmax(x, -1)
    if zero_outside_topk:
        s, h_all = lp.gather(-1, idx), (lp.exp() * lp).sum(-1)
    else:
        s, h_all = torch.log_softmax(x.gather(-1, idx), -1), None
    t = torch.log_softmax(data["teacher_topk_logits"].double(), -1)[:, :-1]
    s = s[:, :-1]
    p, q = s.exp(), t.exp()
    forward, reverse = (q * (t - s)).sum(-1), (p * (s - t)).sum(-1)
    kl = {"forward": forward, "reverse": reverse, "mixed": weight * forward + (1 - weight) * reverse}[kl_type]
    if zero_outside_topk and kl_type != "forward":
        correction = (h_all[:, :-1] - (p * s).sum(-1)) + 100.0 * (1 - p.sum(-1))
        kl = kl + (correction * (1 - weight) if kl_type == "mixed" else correction)
    mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    return (kl * mask).sum() / (global_valid_toks + 1e-8)


def nemo_rl_call(loss_fn, logits, data, global_valid_toks, **kwargs):
    loss_input, data = prepare_loss_input(logits, data, loss_fn, **kwargs)
    return loss_fn(data=data, global_valid_seqs=data["sample_mask"].sum(), global_valid_toks=global_valid_toks,
                   **loss_input)


def valid_toks(data):
    return (data["sample_mask"][:, None] * data["token_mask"]).sum()


# ---- NeMo-RL's tests -----------------------------------------------------------------
@pytest.mark.parametrize("kl_type", KL_TYPES)
@pytest.mark.parametrize("zero_outside_topk", [True, False])
def test_distillation_loss_different_settings(kl_type, zero_outside_topk):
    data, logits = make_data()
    loss_fn = DistillationLoss({"kl_type": kl_type, "mixed_kl_weight": 0.3, "zero_outside_topk": zero_outside_topk})
    gvt = valid_toks(data)  # 8, while the shifted mask covers 6 positions (as NeMo-RL's test)
    loss, metrics = nemo_rl_call(loss_fn, logits, data, gvt)
    torch.testing.assert_close(loss, reference_loss(logits, data, kl_type, zero_outside_topk, 0.3, gvt),
                               rtol=1e-12, atol=1e-12)
    assert isinstance(metrics, dict) and metrics["loss"] == pytest.approx(loss.item())
    assert metrics["num_valid_samples"] == 2
    if zero_outside_topk and kl_type != "forward":
        assert loss.item() < -100  # repeated ids: sum p > 1 over the 64, so P_rest < 0 dominates (as NeMo-RL's)


@pytest.mark.parametrize("topk", [1, 32, 64, 1000000])
@pytest.mark.parametrize("zero_outside_topk", [True, False])
def test_distillation_loss_topk_filtering(topk, zero_outside_topk):
    data, logits = make_data(topk=topk, dtype=torch.float32)
    loss_fn = DistillationLoss({"kl_type": "forward", "mixed_kl_weight": 0.5, "zero_outside_topk": zero_outside_topk})
    loss, _ = nemo_rl_call(loss_fn, logits, data, valid_toks(data))
    assert loss.dim() == 0 and torch.isfinite(loss)
    if topk >= 32:
        assert loss.item() != 0.0
    if topk == 1 and not zero_outside_topk:
        assert loss.item() == 0.0  # one column renormalised: the same distribution on both sides


def test_distillation_loss_invalid_k_zero():
    data, logits = make_data(topk=0)
    with pytest.raises(ValueError, match="topk must be positive"):
        prepare_loss_input(logits, data, DistillationLoss({"kl_type": "forward"}))


def test_distillation_loss_gradient_flow():
    data, logits = make_data()
    logits.requires_grad_(True)
    loss, _ = nemo_rl_call(DistillationLoss({"kl_type": "forward", "mixed_kl_weight": 0.5}), logits, data,
                           valid_toks(data))
    loss.backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


@pytest.mark.parametrize("fill", [0.0, 100.0, -100.0])
@pytest.mark.parametrize("kl_type", KL_TYPES)
@pytest.mark.parametrize("zero_outside_topk", [True, False])
def test_distillation_loss_edge_cases(fill, kl_type, zero_outside_topk):
    data, logits = make_data(dtype=torch.float32)
    loss, _ = nemo_rl_call(DistillationLoss({"kl_type": kl_type, "zero_outside_topk": zero_outside_topk}),
                           torch.full_like(logits, fill), data, valid_toks(data))
    assert torch.isfinite(loss)


def test_distillation_loss_fn_initialization_and_call():
    a = DistillationLoss({"kl_type": "forward", "mixed_kl_weight": 0.5, "zero_outside_topk": False})
    assert (a.kl_type, a.mixed_kl_weight, a.zero_outside_topk) == ("forward", 0.5, False)
    b = DistillationLoss({"kl_type": "reverse", "mixed_kl_weight": 0.3, "zero_outside_topk": True})
    assert (b.kl_type, b.mixed_kl_weight, b.zero_outside_topk) == ("reverse", 0.3, True)
    assert b.calculate_entropy and not a.calculate_entropy and b.log_infinitesimal == -100
    assert DistillationLoss().cfg == {"kl_type": "mixed", "mixed_kl_weight": 0.5, "zero_outside_topk": False}
    data, logits = make_data()
    loss, metrics = nemo_rl_call(a, logits, data, valid_toks(data))
    assert isinstance(loss, torch.Tensor) and loss.dim() == 0 and "loss" in metrics


@pytest.mark.parametrize("cfg, match", [
    ({"kl_type": "symmetric"}, "Invalid KL type"),
    ({"mixed_kl_weight": 1.5}, "mixed_kl_weight"),
    ({"mixed_kl_weight": "half"}, "mixed_kl_weight"),
    ({"zero_outside_topk": "yes"}, "zero_outside_topk"),
    ({"kl_typ": "forward"}, "did you mean 'kl_type'"),
    ({"projection_matrix_paths": ["m.pt"]}, "cross-tokenizer distillation, which seqpack does not implement"),
])
def test_config_errors_name_the_key(cfg, match):
    with pytest.raises(LossConfigError, match=match):
        DistillationLoss(cfg)


def test_numpy_and_tensor_config_values():
    import numpy as np

    loss_fn = DistillationLoss({"mixed_kl_weight": np.float32(0.25), "zero_outside_topk": torch.tensor(True)})
    assert loss_fn.mixed_kl_weight == 0.25 and loss_fn.zero_outside_topk is True


def test_bf16_student_is_gathered_before_its_upcast():
    # NeMo-RL test_distillation_topk_non_tp_defers_fp32_upcast: equal to the gather of
    # the bf16 logits upcast, fp32, no H_all; no fp32 copy of the [S, V] logits.
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 512, generator=g).to(torch.bfloat16).requires_grad_()
    idx = torch.stack([torch.randperm(512, generator=g)[:4] for _ in range(8)])
    lp, h_all = distillation_topk_logprobs(logits, idx, zero_outside_topk=False, calculate_entropy=False)
    ref_leaf = logits.detach().clone().requires_grad_()
    ref = torch.log_softmax(ref_leaf.float().gather(-1, idx), -1)
    assert h_all is None and lp.dtype == torch.float32
    torch.testing.assert_close(lp, ref, rtol=0, atol=0)
    w = torch.randn(8, 4, generator=g)
    (lp * w).sum().backward()
    (ref * w).sum().backward()
    torch.testing.assert_close(logits.grad, ref_leaf.grad, rtol=0, atol=0)


def test_missing_or_mismatched_teacher_is_named():
    data, logits = make_data()
    loss_fn = DistillationLoss()
    for key in ("teacher_topk_logits", "teacher_topk_indices"):
        with pytest.raises(ValueError, match=key):
            prepare_loss_input(logits, {k: v for k, v in data.items() if k != key}, loss_fn)
    bad = {**data, "teacher_topk_logits": data["teacher_topk_logits"][..., :3]}
    with pytest.raises(ValueError, match="must have one shape"):
        prepare_loss_input(logits, bad, loss_fn)
    bad = {**data, "teacher_topk_indices": data["teacher_topk_indices"].clone().fill_(8)}
    with pytest.raises(ValueError, match="not a column of the vocabulary"):
        prepare_loss_input(logits, bad, DistillationLoss({"zero_outside_topk": True}))


# ---- packed = unpacked (fp64) ----------------------------------------------------------
def packed_case(lengths, vocab, topk, seed, pad_multiple=1):
    width = max(lengths)
    data, logits = make_data(len(lengths), width, vocab, topk, seed, lengths=lengths)
    packed = pack_sequences({"logits": logits}, attention_mask=data["token_mask"].bool(), pad_multiple=pad_multiple)
    return data, logits, packed


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(1, 9), min_size=1, max_size=4), vocab=st.integers(2, 12),
       topk=st.integers(1, 6), kl_type=st.sampled_from(KL_TYPES), zero=st.booleans(),
       weight=st.floats(0, 1), temperature=st.sampled_from([1.0, 0.7]), pad=st.sampled_from([1, 4]),
       seed=st.integers(0, 2**16))
def test_packed_equals_unpacked(lengths, vocab, topk, kl_type, zero, weight, temperature, pad, seed):
    data, logits, packed = packed_case(lengths, vocab, topk, seed, pad)
    loss_fn = DistillationLoss({"kl_type": kl_type, "mixed_kl_weight": weight, "zero_outside_topk": zero})
    gvt = valid_toks(data)
    base_leaf = logits.clone().requires_grad_()
    base = reference_loss(base_leaf, data, kl_type, zero, weight, gvt, temperature)
    base.backward()
    layout = packed.layout
    for fused in (False, True):
        rows = packed["logits"].detach().clone().requires_grad_()
        wrapper = SequencePackingLossWrapper(loss_fn, cu_seqlens_q=layout.cu_seqlens,
                                             cu_seqlens_q_padded=layout.cu_seqlens_padded, fused=fused,
                                             temperature=temperature)
        loss, metrics = wrapper(rows, data, data["sample_mask"].sum(), gvt)
        torch.testing.assert_close(loss, base, rtol=1e-10, atol=1e-10)
        loss.backward()
        torch.testing.assert_close(packed.unpack(rows.grad), base_leaf.grad, rtol=1e-9, atol=1e-11)
        assert metrics["num_valid_samples"] == len(lengths)


@settings(max_examples=15, deadline=None)
@given(lengths=st.lists(st.integers(1, 7), min_size=1, max_size=3), topk=st.integers(1, 5),
       kl_type=st.sampled_from(KL_TYPES), zero=st.booleans(), seed=st.integers(0, 2**16))
def test_lm_head_fused_equals_logits(lengths, topk, kl_type, zero, seed):
    g = torch.Generator().manual_seed(seed)
    hidden_size, vocab = 5, 11
    data, _, _ = packed_case(lengths, vocab, topk, seed)
    hidden = torch.randn(len(lengths), max(lengths), hidden_size, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, hidden_size, generator=g, dtype=torch.float64)
    bias = torch.randn(vocab, generator=g, dtype=torch.float64)
    packed = pack_sequences({"hidden": hidden}, attention_mask=data["token_mask"].bool())
    loss_fn = DistillationLoss({"kl_type": kl_type, "zero_outside_topk": zero})
    gvt = valid_toks(data)
    leaves = [t.clone().requires_grad_() for t in (packed["hidden"], weight, bias)]
    wrapper = SequencePackingLossWrapper(loss_fn, cu_seqlens_q=packed.layout.cu_seqlens, fused=True)
    fused, _ = wrapper(leaves[0], data, 1, gvt, lm_head_weight=leaves[1], lm_head_bias=leaves[2])
    ref_leaves = [t.clone().requires_grad_() for t in (packed["hidden"], weight, bias)]
    ref, _ = wrapper(ref_leaves[0] @ ref_leaves[1].T + ref_leaves[2], data, 1, gvt)
    torch.testing.assert_close(fused, ref, rtol=1e-10, atol=1e-10)
    fused.backward()
    ref.backward()
    for a, b in zip(leaves, ref_leaves):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-11)


def test_a_padding_row_has_no_nan():
    # Rows of no sequence (the layout's padding) have no column: 0, no NaN anywhere.
    data, logits, packed = packed_case([3, 2], 6, 3, 0, pad_multiple=8)
    rows = packed["logits"].detach().clone().requires_grad_()
    for zero in (True, False):
        wrapper = SequencePackingLossWrapper(DistillationLoss({"zero_outside_topk": zero}),
                                             cu_seqlens_q=packed.layout.cu_seqlens,
                                             cu_seqlens_q_padded=packed.layout.cu_seqlens_padded, fused=True)
        loss, _ = wrapper(rows, data, 2, valid_toks(data))
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(rows.grad).all()


# ---- TP and CP on gloo ranks -------------------------------------------------------------
WORLDS = (2, 3)
CASE_TIMEOUT_S = 90


def case_vocab_parallel(rank, world, seed):
    """TP: each rank holds a vocabulary slice of the packed logits; the loss equals
    one rank's and each rank's gradient is its slice of the full one."""
    width = 4
    data, logits, packed = packed_case([5, 2, 4], width * world, 6, seed)
    gvt = valid_toks(data)
    cols = slice(rank * width, (rank + 1) * width)
    for kl_type in KL_TYPES:
        for zero in (True, False):
            loss_fn = DistillationLoss({"kl_type": kl_type, "mixed_kl_weight": 0.3, "zero_outside_topk": zero})
            full = packed["logits"].detach().clone().requires_grad_()
            wrapper = SequencePackingLossWrapper(loss_fn, cu_seqlens_q=packed.layout.cu_seqlens, fused=True)
            ref, _ = wrapper(full, data, 3, gvt)
            ref.backward()
            for fused in (True, False):
                local = packed["logits"][:, cols].detach().clone().requires_grad_()
                wrapper = SequencePackingLossWrapper(loss_fn, cu_seqlens_q=packed.layout.cu_seqlens, fused=fused,
                                                     vocab_parallel_rank=rank, vocab_parallel_group=dist.group.WORLD)
                loss, _ = wrapper(local, data, 3, gvt)
                torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-10)
                loss.backward()
                torch.testing.assert_close(local.grad, full.grad[:, cols], rtol=1e-9, atol=1e-11)
    return True


def case_context_parallel(rank, world, seed):
    """CP: each rank holds its zigzag rows; the loss (the same on every rank) / cp
    backwards into the rank's rows of the one-rank gradient."""
    data, logits, packed = packed_case([7, 1, 6], 9, 4, seed, pad_multiple=2 * world)
    layout = packed.layout
    gvt = valid_toks(data)
    for kl_type in ("forward", "mixed"):
        for zero in (True, False):
            loss_fn = DistillationLoss({"kl_type": kl_type, "zero_outside_topk": zero})
            full = packed["logits"].detach().clone().requires_grad_()
            ref, _ = SequencePackingLossWrapper(loss_fn, cu_seqlens_q=layout.cu_seqlens,
                                                cu_seqlens_q_padded=layout.cu_seqlens_padded, fused=True)(
                full, data, 3, gvt)
            ref.backward()
            for fused in (True, False):
                local = cp_local_rows(packed["logits"], layout.cu_seqlens_padded, world, rank)
                local = local.detach().clone().requires_grad_()
                wrapper = SequencePackingLossWrapper(loss_fn, cu_seqlens_q=layout.cu_seqlens,
                                                     cu_seqlens_q_padded=layout.cu_seqlens_padded, fused=fused,
                                                     context_parallel_group=dist.group.WORLD)
                loss, _ = wrapper(local, data, 3, gvt)
                torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-10)
                (loss / world).backward()
                torch.testing.assert_close(local.grad, cp_local_rows(full.grad, layout.cu_seqlens_padded, world,
                                                                     rank), rtol=1e-9, atol=1e-11)
    return True


def case_column_logprobs_tp(rank, world, seed):
    """column_logprobs of a vocabulary slice = of the whole vocabulary (values,
    entropy and the slice's gradient), -1 columns included."""
    from seqpack.training.logprobs_columns import column_logprobs

    g = torch.Generator().manual_seed(seed)
    width = 5
    full = torch.randn(6, width * world, generator=g, dtype=torch.float64)
    columns = torch.randint(-1, width * world, (6, 4), generator=g)
    w, we = torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randn(6, generator=g, dtype=torch.float64)
    leaf = full.clone().requires_grad_()
    ref = column_logprobs(leaf, columns, temperature=0.8, return_entropy=True)
    ((ref.logprobs * w).sum() + (ref.entropy * we).sum()).backward()
    cols = slice(rank * width, (rank + 1) * width)
    mine = full[:, cols].clone().requires_grad_()
    out = column_logprobs(mine, columns, temperature=0.8, return_entropy=True, vocab_parallel_group=dist.group.WORLD)
    torch.testing.assert_close(out.logprobs, ref.logprobs.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.entropy, ref.entropy.detach(), rtol=1e-12, atol=1e-12)
    ((out.logprobs * w).sum() + (out.entropy * we).sum()).backward()
    torch.testing.assert_close(mine.grad, leaf.grad[:, cols], rtol=1e-10, atol=1e-12)
    return True


def case_lm_head_vocab_parallel(rank, world, seed):
    """TP with the LM head fused in: each rank holds a vocabulary slice of the head;
    the loss equals one rank's (the whole head), each rank's head gradient is its
    slice, the hidden states' gradient the whole one; linear_column_logprobs on the
    slice equals the whole head's too."""
    from seqpack.training.logprobs_columns import linear_column_logprobs

    g = torch.Generator().manual_seed(seed)
    width, hidden_size = 4, 5
    vocab = width * world
    data, _, _ = packed_case([5, 2, 4], vocab, 6, seed)
    hidden = torch.randn(3, 5, hidden_size, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, hidden_size, generator=g, dtype=torch.float64)
    bias = torch.randn(vocab, generator=g, dtype=torch.float64)
    packed = pack_sequences({"hidden": hidden}, attention_mask=data["token_mask"].bool())
    gvt = valid_toks(data)
    cols = slice(rank * width, (rank + 1) * width)
    for kl_type, zero in (("mixed", True), ("reverse", True), ("forward", False), ("mixed", False)):
        loss_fn = DistillationLoss({"kl_type": kl_type, "mixed_kl_weight": 0.3, "zero_outside_topk": zero})
        wrapper = SequencePackingLossWrapper(loss_fn, cu_seqlens_q=packed.layout.cu_seqlens, fused=True)
        ref_leaves = [t.clone().requires_grad_() for t in (packed["hidden"], weight, bias)]
        ref, _ = wrapper(ref_leaves[0], data, 3, gvt, lm_head_weight=ref_leaves[1], lm_head_bias=ref_leaves[2])
        ref.backward()
        mine = [packed["hidden"].clone().requires_grad_(), weight[cols].clone().requires_grad_(),
                bias[cols].clone().requires_grad_()]
        tp = SequencePackingLossWrapper(loss_fn, cu_seqlens_q=packed.layout.cu_seqlens, fused=True,
                                        vocab_parallel_rank=rank, vocab_parallel_group=dist.group.WORLD)
        loss, _ = tp(mine[0], data, 3, gvt, lm_head_weight=mine[1], lm_head_bias=mine[2])
        torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-10)
        loss.backward()
        torch.testing.assert_close(mine[0].grad, ref_leaves[0].grad, rtol=1e-9, atol=1e-11)
        torch.testing.assert_close(mine[1].grad, ref_leaves[1].grad[cols], rtol=1e-9, atol=1e-11)
        torch.testing.assert_close(mine[2].grad, ref_leaves[2].grad[cols], rtol=1e-9, atol=1e-11)
    h = torch.randn(6, hidden_size, generator=g, dtype=torch.float64)
    columns = torch.randint(-1, vocab, (6, 3), generator=g)
    w = torch.randn(6, 3, generator=g, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (h, weight)]
    ref = linear_column_logprobs(*leaves, columns, return_entropy=True, temperature=0.9)
    ((ref.logprobs * w).sum() + ref.entropy.sum()).backward()
    mine = [h.clone().requires_grad_(), weight[cols].clone().requires_grad_()]
    out = linear_column_logprobs(*mine, columns, return_entropy=True, temperature=0.9,
                                 vocab_parallel_group=dist.group.WORLD)
    torch.testing.assert_close(out.logprobs, ref.logprobs.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.entropy, ref.entropy.detach(), rtol=1e-12, atol=1e-12)
    ((out.logprobs * w).sum() + out.entropy.sum()).backward()
    torch.testing.assert_close(mine[0].grad, leaves[0].grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(mine[1].grad, leaves[1].grad[cols], rtol=1e-10, atol=1e-12)
    return True


@pytest.fixture(scope="module")
def pools():
    yield from started_pools(WORLDS)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case, args", [(case_vocab_parallel, (1,)), (case_context_parallel, (2,)),
                                        (case_column_logprobs_tp, (3,)), (case_lm_head_vocab_parallel, (4,))],
                         ids=["tp", "cp", "columns-tp", "lm-head-tp"])
def test_on_gloo_ranks(pools, world, case, args):
    assert values_of(pools[world], case, *args, timeout_s=CASE_TIMEOUT_S) == [True] * world  # a hang raises


def test_no_stray_nan_in_docs_example():
    lp = torch.log(torch.tensor([[[0.5, 0.5]]]))
    data = {"input_ids": torch.zeros(1, 2, dtype=torch.long), "token_mask": torch.ones(1, 2),
            "sample_mask": torch.ones(1)}
    loss, _ = DistillationLoss({"kl_type": "reverse", "zero_outside_topk": True})(lp, lp, torch.tensor([[math.log(
        0.5)]]), data, 1, 1)
    assert abs(loss.item()) < 1e-6  # H_all = sum p log p over a 2-token vocabulary: no rest
