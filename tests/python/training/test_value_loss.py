"""NeMo-RL's value loss (``MseValueLoss``, issue 30 item 5): the formula with and
without clipping against a direct PyTorch transcription (fp64, gradients too), its
config keys, NeMo-RL's value-loss tests (basic, clipping, packing keeps the value
range and its sentinels, summed metrics stay summed), and packed = unpacked through
SequencePackingLossWrapper."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack import BatchedDataDict
from seqpack.loss import LossConfigError, MseValueLoss, SequencePackingLossWrapper


def reference(values, data, gvt, scale=1.0, cliprange=None):
    """The value loss written out directly."""
    mask = data["token_mask"] * data["sample_mask"][:, None]
    err = (values - data["returns"]) ** 2
    if cliprange is not None and cliprange > 0:
        old = data["values"]
        clipped = (torch.minimum(torch.maximum(values, old - cliprange), old + cliprange) - data["returns"]) ** 2
        err = torch.where(clipped > err, clipped, err)
    return 0.5 * scale * (err * mask).sum() / (gvt + 1e-8)


def make(batch=3, width=5, seed=0, masked=True):
    g = torch.Generator().manual_seed(seed)
    token_mask = torch.ones(batch, width, dtype=torch.float64)
    sample_mask = torch.ones(batch, dtype=torch.float64)
    if masked:
        token_mask[:, :1] = 0
        sample_mask[-1] = 0
    data = BatchedDataDict(returns=torch.randn(batch, width, generator=g, dtype=torch.float64),
                           values=torch.randn(batch, width, generator=g, dtype=torch.float64),
                           token_mask=token_mask, sample_mask=sample_mask)
    values = torch.randn(batch, width, 1, generator=g, dtype=torch.float64)
    return values, data, sample_mask.sum(), (token_mask * sample_mask[:, None]).sum()


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([None, 0.0, -0.3, 0.2, 1.5]), st.sampled_from([1.0, 0.25]), st.integers(0, 10**6))
def test_equals_the_formula_with_gradients(cliprange, scale, seed):
    values, data, gvs, gvt = make(seed=seed)
    mine = values.clone().requires_grad_()
    loss, metrics = MseValueLoss({"scale": scale, "cliprange": cliprange})(mine, data, gvs, gvt)
    ref_leaf = values[..., 0].clone().requires_grad_()
    ref = reference(ref_leaf, data, gvt, scale, cliprange)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-14)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(mine.grad[..., 0], ref_leaf.grad, rtol=1e-12, atol=1e-14)
    assert metrics["loss"] == pytest.approx(ref.item())
    valid = (data["token_mask"] * data["sample_mask"][:, None]).bool()
    assert metrics["values_min"] == pytest.approx(float(values[..., 0][valid].min()))
    assert metrics["values_max"] == pytest.approx(float(values[..., 0][valid].max()))
    assert metrics["num_valid_samples"] == 3
    if not (cliprange and cliprange > 0):
        assert metrics["vf_clipfrac"] == 0.0


# NeMo-RL's own value-loss tests (tests/unit/algorithms/test_loss_functions.py and the
# packing-metrics tests), on the CPU.
def test_basic_and_clipped_losses_are_scalar_non_negative_and_differentiable():
    for cfg in ({"scale": 1.0, "cliprange": None}, {"scale": 1.0, "cliprange": 0.2}):
        values, data, gvs, gvt = make(batch=2, width=4, masked=False)
        values.requires_grad_()
        loss, metrics = MseValueLoss(cfg)(values, data, gvs, gvt)
        assert loss.ndim == 0 and loss.item() >= 0 and loss.requires_grad
        assert 0.0 <= metrics["vf_clipfrac"] <= 1.0


def _value_prepare_fn(logits, data, loss_fn=None, **kwargs):
    return {"logits": logits}, data


def _packed_and_unpacked(value_rows, sample_mask):
    loss_fn = MseValueLoss()
    values = torch.tensor(value_rows, dtype=torch.float32)
    data = BatchedDataDict(values=values.clone(), returns=torch.zeros_like(values), token_mask=torch.ones_like(values),
                           sample_mask=torch.tensor(sample_mask, dtype=torch.float32))
    logits = values.unsqueeze(-1)
    gvs = data["sample_mask"].sum()
    gvt = (data["token_mask"] * data["sample_mask"].unsqueeze(-1)).sum()
    unpacked_loss, unpacked = loss_fn(logits, data, gvs, gvt)
    width = values.shape[1]
    cu = torch.tensor([i * width for i in range(len(value_rows) + 1)], dtype=torch.int32)
    wrapper = SequencePackingLossWrapper(loss_fn=loss_fn, prepare_fn=_value_prepare_fn, cu_seqlens_q=cu,
                                         cu_seqlens_q_padded=cu)
    packed_loss, packed = wrapper(logits.reshape(1, -1, 1), data, gvs, gvt)
    assert packed_loss.item() == pytest.approx(unpacked_loss.item(), abs=1e-6)
    return unpacked, packed


def test_packing_reports_the_true_value_range():
    unpacked, packed = _packed_and_unpacked([[-3.0, -1.0, 2.0], [1.0, 4.0, 2.0], [6.0, 9.0, 7.0]], [1, 1, 1])
    assert unpacked["values_min"] == pytest.approx(-3.0) and unpacked["values_max"] == pytest.approx(9.0)
    assert packed["values_min"] == pytest.approx(-3.0) and packed["values_max"] == pytest.approx(9.0)


def test_a_fully_masked_sequence_does_not_floor_the_reported_minimum():
    unpacked, packed = _packed_and_unpacked([[3.0, 5.0, 4.0], [6.0, 9.0, 7.0], [8.0, 8.5, 8.2]], [1, 1, 0])
    assert unpacked["values_min"] == pytest.approx(3.0)
    assert packed["values_min"] == pytest.approx(3.0) and packed["values_max"] == pytest.approx(9.0)


def test_globally_normalized_metrics_are_still_summed():
    unpacked, packed = _packed_and_unpacked([[-3.0, -1.0, 2.0], [1.0, 4.0, 2.0], [6.0, 9.0, 7.0]], [1, 1, 1])
    for key in ("values_mean", "returns_mean", "returns_sq_mean", "residual_sq_mean", "loss", "vf_clipfrac"):
        assert packed[key] == pytest.approx(unpacked[key], abs=1e-5), key


def test_an_all_masked_micro_batch_reports_the_sentinels():
    unpacked, packed = _packed_and_unpacked([[3.0, 5.0, 4.0], [6.0, 9.0, 7.0]], [0, 0])
    assert math.isinf(unpacked["values_min"]) and unpacked["values_min"] > 0 and unpacked["values_max"] < 0
    assert math.isinf(packed["values_min"]) and math.isinf(packed["values_max"])


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=5), st.sampled_from([None, 0.3]), st.integers(0, 10**6))
def test_packed_with_padding_equals_unpacked(lengths, cliprange, seed):
    """Rows of several lengths, each packed sequence padded to a multiple of 4: the
    wrapper (per sequence, padding rows ignored) gives the unpacked loss and its
    gradient at each real token."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    batch = len(lengths)
    token_mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).double()
    data = BatchedDataDict(returns=torch.randn(batch, width, generator=g, dtype=torch.float64),
                           values=torch.randn(batch, width, generator=g, dtype=torch.float64),
                           token_mask=token_mask, sample_mask=torch.ones(batch, dtype=torch.float64))
    values = torch.randn(batch, width, generator=g, dtype=torch.float64)
    gvs, gvt = data["sample_mask"].sum(), token_mask.sum()
    loss_fn = MseValueLoss({"cliprange": cliprange})
    leaf = values.clone().requires_grad_()
    ref, _ = loss_fn(leaf, data, gvs, gvt)
    ref.backward()
    padded = [-(-n // 4) * 4 for n in lengths]
    cu = np.concatenate([[0], np.cumsum(lengths)])
    cu_p = np.concatenate([[0], np.cumsum(padded)])
    packed = torch.zeros(int(cu_p[-1]), 1, dtype=torch.float64)
    for i, n in enumerate(lengths):
        packed[cu_p[i]: cu_p[i] + n, 0] = values[i, :n]
    packed.requires_grad_()
    loss, _ = SequencePackingLossWrapper(loss_fn, _value_prepare_fn, cu, cu_p)(packed[None], data, gvs, gvt)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-14)
    loss.backward()
    for i, n in enumerate(lengths):
        torch.testing.assert_close(packed.grad[cu_p[i]: cu_p[i] + n, 0], leaf.grad[i, :n], rtol=1e-12, atol=1e-14)
        assert not packed.grad[cu_p[i] + n: cu_p[i + 1]].any()


@pytest.mark.parametrize("cfg, error, match", [
    ({"clip_range": 0.2}, LossConfigError, "cfg\\['clip_range'\\] is not a MseValueLossFn key; did you mean 'cliprange'"),
    ({"scale": "1"}, TypeError, "cfg\\['scale'\\]"),
    ({"scale": float("nan")}, LossConfigError, "cfg\\['scale'\\]"),
    ({"cliprange": float("inf")}, LossConfigError, "cfg\\['cliprange'\\]"),
])
def test_config_is_checked(cfg, error, match):
    with pytest.raises(error, match=match):
        MseValueLoss(cfg)


def test_numpy_and_tensor_scalars_and_value_semantics():
    import pickle

    loss = MseValueLoss({"scale": np.float32(0.5), "cliprange": torch.tensor(0.2)})
    assert loss.scale == 0.5 and loss.cliprange == pytest.approx(0.2)
    assert pickle.loads(pickle.dumps(loss)) == loss and loss != MseValueLoss()
    values, data, gvs, gvt = make()
    with pytest.raises(ValueError, match="covering data\\['returns'\\]"):
        loss(values[:, :2], data, gvs, gvt)
