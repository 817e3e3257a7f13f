"""seqpack.loss: the wrapper (per sequence and fused) equals the unpacked
computation in loss, gradients and metrics; NeMo-RL's loss test vectors; segment
reductions; errors."""

import math

import numpy as np
import pytest
import torch

from seqpack import BatchedDataDict
from seqpack.loss import (ClippedPGLoss, MseValueLoss, NLLLoss, SequencePackingLossWrapper, calculate_kl,
                          clipped_pg_loss, masked_mean, nll_loss, prepare_loss_input, segment_masked_mean, segment_mean,
                          segment_sum)

PG_CFG = {"ratio_clip_min": 0.2, "ratio_clip_max": 0.28, "ratio_clip_c": 3.0, "reference_policy_kl_penalty": 0.05,
          "reference_policy_kl_type": "k3", "use_importance_sampling_correction": True}


def make_batch(lengths, width, vocab, seed=0, multiple=1):
    g = torch.Generator().manual_seed(seed)
    batch = len(lengths)
    padded = [-(-n // multiple) * multiple for n in lengths]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    cu_p = np.concatenate([[0], np.cumsum(padded)]).astype(np.int32)
    unpacked = torch.randn(batch, width, vocab, generator=g) * 2
    packed = torch.randn(int(cu_p[-1]), vocab, generator=g) * 2  # padding rows hold noise
    ids = torch.zeros(batch, width, dtype=torch.long)
    token_mask = torch.zeros(batch, width)
    for i, n in enumerate(lengths):
        packed[cu_p[i]: cu_p[i] + n] = unpacked[i, :n]
        ids[i, :n] = torch.randint(0, vocab, (n,), generator=g)
        token_mask[i, min(2, n):n] = 1.0  # a short "prompt" is masked
    sample_mask = torch.ones(batch)
    if batch > 2:
        sample_mask[1] = 0.0
    data = BatchedDataDict(
        input_ids=ids, token_mask=token_mask, sample_mask=sample_mask,
        advantages=torch.randn(batch, width, generator=g),
        prev_logprobs=-torch.rand(batch, width, generator=g) * 3,
        reference_policy_logprobs=-torch.rand(batch, width, generator=g) * 3,
        generation_logprobs=-torch.rand(batch, width, generator=g) * 3,
    )
    gvt = (token_mask[:, 1:] * sample_mask[:, None]).sum()
    return data, unpacked, packed, cu, cu_p, gvt, sample_mask.sum()


def unpacked_loss(loss_fn, logits, data, gvs, gvt):
    lp = torch.log_softmax(logits[:, :-1].double(), -1).gather(-1, data["input_ids"][:, 1:, None])[..., 0]
    kwargs = {}
    if getattr(loss_fn, "needs_entropy", False):
        lsm = torch.log_softmax(logits[:, :-1].double(), -1)
        kwargs["next_token_entropy"] = -(lsm.exp() * lsm).sum(-1).float()
    return loss_fn(data=data, global_valid_seqs=gvs, global_valid_toks=gvt, next_token_logprobs=lp.float(), **kwargs)


@pytest.mark.parametrize("loss_fn", [NLLLoss(), ClippedPGLoss(PG_CFG), ClippedPGLoss({**PG_CFG, "entropy_coef": 0.01}),
                                     ClippedPGLoss({**PG_CFG, "token_level_loss": False})],
                         ids=["nll", "clipped_pg", "pg+entropy", "pg_sequence_level"])
@pytest.mark.parametrize("fused", [False, True])
def test_wrapper_equals_the_unpacked_loss(loss_fn, fused):
    lengths = [7, 1, 12, 4, 9]
    data, unpacked, packed, cu, cu_p, gvt, gvs = make_batch(lengths, 12, 50, multiple=4)
    base_logits = unpacked.clone().requires_grad_()
    base_loss, base_metrics = unpacked_loss(loss_fn, base_logits, data, gvs, gvt)
    base_loss.backward()
    logits = packed.clone().requires_grad_()
    wrapper = SequencePackingLossWrapper(loss_fn, None, cu, cu_p, fused=fused)
    loss, metrics = wrapper(logits[None], data, gvs, gvt)
    torch.testing.assert_close(loss, base_loss, rtol=1e-6, atol=1e-7)
    loss.backward()
    for i, n in enumerate(lengths):
        torch.testing.assert_close(logits.grad[cu_p[i]: cu_p[i] + n], base_logits.grad[i, :n], rtol=1e-5, atol=1e-7)
        assert not logits.grad[cu_p[i] + n: cu_p[i + 1]].any()  # padding rows get nothing
    assert set(metrics) == set(base_metrics)
    for key, value in base_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("loss_fn", [NLLLoss(), ClippedPGLoss({**PG_CFG, "entropy_coef": 0.01})], ids=["nll", "pg+entropy"])
def test_hidden_states_and_lm_head_instead_of_logits(loss_fn):
    # The wrapper (fused) and prepare_loss_input take the final hidden states and
    # the LM head: the same loss and gradients as through F.linear's logits.
    lengths = [7, 1, 12, 4]
    data, _, _, cu, cu_p, gvt, gvs = make_batch(lengths, 12, 50, multiple=4)
    g = torch.Generator().manual_seed(5)
    hidden0, head0, bias0 = (torch.randn(int(cu_p[-1]), 16, generator=g), torch.randn(50, 16, generator=g) / 4,
                             torch.randn(50, generator=g))
    wrapper = SequencePackingLossWrapper(loss_fn, None, cu, cu_p, fused=True)
    results = []
    for through_logits in (True, False):
        hidden, head, bias = (t.clone().requires_grad_() for t in (hidden0, head0, bias0))
        if through_logits:
            loss, metrics = wrapper(torch.nn.functional.linear(hidden, head, bias), data, gvs, gvt)
        else:
            loss, metrics = wrapper(hidden, data, gvs, gvt, lm_head_weight=head, lm_head_bias=bias)
        loss.backward()
        results.append((loss, metrics, hidden.grad, head.grad, bias.grad))
    (loss_a, m_a, *grads_a), (loss_b, m_b, *grads_b) = results
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-6, atol=1e-7)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert m_a.keys() == m_b.keys()
    seq = {k: v[2:3, :12] if v.dim() > 1 else v[2:3] for k, v in data.items()}
    rows = slice(int(cu_p[2]), int(cu_p[3]))
    via_logits, _ = prepare_loss_input(torch.nn.functional.linear(hidden0[rows], head0), seq, loss_fn)
    via_head, _ = prepare_loss_input(hidden0[rows], seq, loss_fn, lm_head_weight=head0)
    for key in via_logits:
        torch.testing.assert_close(via_head[key], via_logits[key])
    with pytest.raises(ValueError, match="need fused=True"):
        SequencePackingLossWrapper(loss_fn, None, cu, cu_p)(hidden0, data, gvs, gvt, lm_head_weight=head0)


def test_per_sequence_metric_merge_is_nemo_rls():
    # Min/max keys merge by min/max (infinities skipped), everything else sums.
    data, unpacked, packed, cu, cu_p, gvt, gvs = make_batch([5, 6, 3], 6, 20)
    data["token_mask"][2] = 0.0  # no valid token: +-inf sentinels for that sequence
    loss_fn = ClippedPGLoss(PG_CFG)
    wrapper = SequencePackingLossWrapper(loss_fn, None, cu, cu_p)
    _, metrics = wrapper(packed, data, gvs, gvt)
    per_seq = []
    for i, n in enumerate([5, 6, 3]):
        seq = {k: v[i:i + 1, :n] if v.dim() > 1 else v[i:i + 1] for k, v in data.items()}
        per_seq.append(unpacked_loss(loss_fn, unpacked[i:i + 1, :n], seq, gvs, gvt)[1])
    assert metrics["probs_ratio_min"] == pytest.approx(min(m["probs_ratio_min"] for m in per_seq[:2]))
    assert metrics["probs_ratio_max"] == pytest.approx(max(m["probs_ratio_max"] for m in per_seq[:2]))
    assert math.isinf(per_seq[2]["probs_ratio_min"])
    assert metrics["num_valid_samples"] == sum(m["num_valid_samples"] for m in per_seq)


def test_logit_input_losses_and_custom_prepare_fn():
    data, unpacked, packed, cu, cu_p, gvt, gvs = make_batch([4, 6], 6, 16)
    seen = []

    class LogitLoss:  # an old-style NeMo-RL loss: it receives the sequence's logits
        input_type = "logit"

        def __call__(self, logits, data, global_valid_seqs, global_valid_toks, **groups):
            seen.append((tuple(logits.shape), tuple(data["input_ids"].shape), sorted(groups)))
            return logits.sum() * 0 + 1.0, {"calls": 1}

    loss, metrics = SequencePackingLossWrapper(LogitLoss(), None, cu, cu_p)(packed, data, gvs, gvt)
    assert loss.item() == 2.0 and metrics == {"calls": 2}
    assert seen[0] == ((1, 4, 16), (1, 4), ["context_parallel_group", "vocab_parallel_group", "vocab_parallel_rank"])

    def prepare_fn(logits, data, loss_fn, **_):
        return {"next_token_logprobs": torch.log_softmax(logits[0, :-1], -1)[None, :, 0]}, data

    calls = []
    loss_fn = lambda data, global_valid_seqs, global_valid_toks, next_token_logprobs: (  # noqa: E731
        calls.append(next_token_logprobs.shape) or next_token_logprobs.sum(), {})
    SequencePackingLossWrapper(loss_fn, prepare_fn, cu, cu_p)(packed, data, gvs, gvt)
    assert calls == [torch.Size([1, 3]), torch.Size([1, 5])]


def test_wrapper_errors():
    data, _, packed, cu, cu_p, gvt, gvs = make_batch([4, 6], 6, 16, multiple=4)
    with pytest.raises(ValueError, match="rows .*cu_seqlens_q_padded ends at 12"):
        SequencePackingLossWrapper(NLLLoss(), None, cu, cu_p)(packed[:10], data, gvs, gvt)
    with pytest.raises(ValueError, match=r"\[T, V\] or \[1, T, V\]"):
        SequencePackingLossWrapper(NLLLoss(), None, cu, cu_p)(packed[None, None], data, gvs, gvt)
    with pytest.raises(ValueError, match="data must hold the 2 sequences"):
        SequencePackingLossWrapper(NLLLoss(), None, cu, cu_p)(packed, data.slice(0, 1), gvs, gvt)
    with pytest.raises(ValueError, match="entries"):
        SequencePackingLossWrapper(NLLLoss(), None, cu, cu_p[:-1])
    with pytest.raises(ValueError, match="sequence 0 has 5 real tokens but a padded length of 4"):
        SequencePackingLossWrapper(NLLLoss(), None, np.array([0, 5, 10], np.int32), np.array([0, 4, 10], np.int32))
    with pytest.raises(TypeError, match="cu_seqlens_q must be a 1-D int32 or int64 tensor"):
        SequencePackingLossWrapper(NLLLoss(), None, torch.tensor([0.0, 4.0, 10.0]))
    with pytest.raises(ValueError, match="takes no prepare_fn"):
        SequencePackingLossWrapper(NLLLoss(), lambda **kw: None, cu, cu_p, fused=True)
    with pytest.raises(ValueError, match="needs a log-prob or distillation loss"):
        SequencePackingLossWrapper(MseValueLoss(), None, cu, cu_p, fused=True)

    class DPOLossFn:
        def __call__(self, *args, **kwargs):
            raise AssertionError("never called")

    with pytest.raises(ValueError, match="couples the sequences of a batch"):
        SequencePackingLossWrapper(DPOLossFn(), None, cu, cu_p)
    with pytest.raises(ValueError, match="needs a truncated_importance_sampling_type"):
        ClippedPGLoss({"truncated_importance_sampling_ratio": 2.0})


# ---------------------------------------------------------------- NeMo-RL's vectors


def vec(*values):
    return torch.tensor(values, dtype=torch.float32)


def test_clipped_pg_loss_function_is_the_class():
    # The functional form takes NeMo-RL's (data, counts, cfg) like the class; the
    # literal NeMo-RL vectors are in test_nemo_rl_loss.py.
    data = {"token_mask": torch.tensor([[0, 1, 1, 1]]), "sample_mask": torch.ones(1),
            "advantages": torch.tensor([[0, 1.0, -1, 2]]), "prev_logprobs": torch.full((1, 4), -1.0),
            "generation_logprobs": torch.full((1, 4), -1.0)}
    curr = vec(-1.69315, -1.0, -0.59453)[None]
    cfg = {"reference_policy_kl_penalty": 0.0}
    loss, metrics = clipped_pg_loss(curr, data, torch.tensor(1.0), torch.tensor(3.0), cfg)
    assert loss.item() == pytest.approx(-0.6333, abs=1e-4)
    assert (loss, metrics) == ClippedPGLoss(cfg)(curr, data, torch.tensor(1.0), torch.tensor(3.0))


def test_nemo_rl_kl_and_nll_vectors():
    lp, ref = vec(-1, -1, -1), vec(0, -15, -30)
    assert calculate_kl(lp, ref, "k1", None, None).tolist() == pytest.approx([-1, 14, 29])
    assert calculate_kl(lp, ref, "k2", None, None).tolist() == pytest.approx([0.5, 98, 420.5])
    assert calculate_kl(lp, ref, "k3", None, None).tolist() == pytest.approx([0.7183, 13, 28], abs=1e-4)
    assert calculate_kl(lp, ref, "k3").tolist() == pytest.approx([0.7183, 10, 10], abs=1e-4)
    with pytest.raises(ValueError, match="kl_type"):
        calculate_kl(lp, ref, "k4")
    # SFT: 999 on the wrong next token -> loss 999 over 2 valid tokens.
    logits = torch.zeros(1, 4, 8)
    ids = torch.tensor([[0, 1, 2, 3]])
    logits[0, torch.arange(3), (ids[0, 1:] + 1) % 8] = 999.0
    data = {"input_ids": ids, "token_mask": vec(0, 0, 1, 1)[None], "sample_mask": vec(1)}
    loss, metrics = unpacked_loss(NLLLoss(), logits, data, 1, 2)
    assert loss.item() == pytest.approx(999.0) and metrics["num_unmasked_tokens"] == 2
    assert masked_mean(vec(1, 2, 3, 4), torch.zeros(4)).item() == 0.0


def test_segment_reductions():
    x = vec(1, 2, 3, 4, 5, 6).requires_grad_()
    assert segment_sum(x, [0, 2, 2, 6]).tolist() == [3.0, 0.0, 18.0]
    assert segment_mean(x, [0, 2, 2, 6]).tolist() == [1.5, 0.0, 4.5]
    mask = vec(1, 0, 1, 1, 0, 0)
    assert segment_masked_mean(x, mask, [0, 2, 6]).tolist() == pytest.approx([1.0, 3.5])
    segment_masked_mean(x, mask, [0, 2, 6]).sum().backward()
    assert x.grad.tolist() == pytest.approx([1.0, 0, 0.5, 0.5, 0, 0])
    two_d = torch.arange(12.0).reshape(6, 2)
    assert segment_sum(two_d, [0, 3, 6]).tolist() == [[6.0, 9.0], [24.0, 27.0]]
    with pytest.raises(ValueError, match="values has 2 rows"):
        segment_sum(vec(1, 2), [0, 3])
    loss, metrics = nll_loss(vec(-1, -2, -3), vec(1, 1, 0), 2)
    assert loss.item() == pytest.approx(1.5) and metrics["num_unmasked_tokens"] == 2
