"""CostModel: evaluation, presets, FLOPs from a model shape, non-negative least squares."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import seqpack
from seqpack.planning.cost import CostModel

micro_batches = st.lists(st.lists(st.integers(0, 4096), max_size=6), min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(micro_batches, st.floats(0, 10), st.floats(0, 10), st.floats(0, 1e-3))
def test_cost_is_its_formula(mbs, c0, c1, c2):
    if c0 == c1 == c2 == 0:
        c1 = 1.0
    model = CostModel(c0, c1, c2)
    costs = model.micro_batch_costs(mbs)
    for mb, cost in zip(mbs, costs):
        expected = c0 + c1 * sum(mb) + c2 * sum(s * s for s in mb)
        assert cost == pytest.approx(expected, rel=1e-12, abs=1e-12)
        assert model(mb) == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_presets():
    assert CostModel.tokens()([3000, 500, 500]) == 4000
    assert CostModel.verl()([3, 5]) == 24576 * 8 + 9 + 25
    assert seqpack.CostModel is CostModel
    assert CostModel.tokens()([]) == 0 and CostModel(2.0, 1.0, 0.0)([]) == 2.0  # a dummy still costs its overhead


def test_from_model_counts_six_flops_per_parameter_and_quadratic_attention():
    h, layers, inter, vocab = 4096, 32, 11008, 32000
    m = CostModel.from_model(h, layers, 32, 32, inter, vocab)
    params = layers * (4 * h * h + 3 * h * inter) + h * vocab  # matmul weights a token passes through
    assert m.per_token == 6 * params
    assert m.per_token_squared == 6 * layers * h  # 4·Hq·d per pair, s²/2 pairs, x3
    gqa = CostModel.from_model(h, layers, 32, 8, inter, vocab)
    assert gqa.per_token == 6 * (layers * (2 * h * h + 2 * h * (h // 4) + 3 * h * inter) + h * vocab)
    assert gqa.per_token_squared == m.per_token_squared  # K/V sharing does not change the score work
    full = CostModel.from_model(h, layers, 32, causal=False)
    assert full.per_token_squared == 2 * m.per_token_squared
    seconds = CostModel.from_model(h, layers, 32, 32, inter, vocab, flops_per_second=1e15, per_micro_batch=0.01)
    assert seconds.per_token == pytest.approx(m.per_token / 1e15) and seconds.per_micro_batch == 0.01
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        CostModel.from_model(h, layers, 32, 5)
    with pytest.raises(ValueError, match="flops_per_second must be a finite number > 0, got 0"):
        CostModel.from_model(h, layers, 32, flops_per_second=0)


@settings(max_examples=100, deadline=None)
@given(st.floats(0, 1), st.floats(0, 1e-2), st.floats(0, 1e-5), st.randoms(use_true_random=False))
def test_fit_recovers_known_coefficients(c0, c1, c2, rnd):
    if c0 + c1 + c2 == 0:
        c1 = 1e-3
    mbs = [[rnd.randint(1, 4096) for _ in range(rnd.randint(1, 8))] for _ in range(12)]
    truth = CostModel(c0, c1, c2)
    fitted = CostModel.fit(mbs, truth.micro_batch_costs(mbs))
    got = fitted.micro_batch_costs(mbs)
    assert got == pytest.approx(truth.micro_batch_costs(mbs), rel=1e-6, abs=1e-9)
    assert fitted.r_squared == pytest.approx(1.0, abs=1e-6)


def test_fit_keeps_coefficients_non_negative_and_reports_r_squared():
    rng = np.random.default_rng(0)
    mbs = [list(rng.integers(100, 2000, size=int(rng.integers(1, 6)))) for _ in range(40)]
    truth = CostModel(0.002, 1e-5, 2e-9)
    noisy = truth.micro_batch_costs(mbs) * rng.normal(1.0, 0.02, size=40)
    fitted = CostModel.fit(mbs, noisy)
    assert min(fitted.per_micro_batch, fitted.per_token, fitted.per_token_squared) >= 0
    assert 0.9 < fitted.r_squared <= 1.0
    # Timings that would want a negative overhead get 0 instead, never a negative.
    lens = [[1000], [2000], [3000], [4000]]
    fitted = CostModel.fit(lens, [0.9, 1.9, 2.9, 3.9])  # 1e-3·s - 0.1: the overhead clamps at 0
    assert fitted.per_micro_batch == 0.0 and fitted.per_token > 0


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="per_token must be a finite number >= 0, got -1.0"):
        CostModel(0.0, -1.0, 0.0)
    with pytest.raises(ValueError, match="at least one positive coefficient"):
        CostModel(0.0, 0.0, 0.0)
    with pytest.raises(TypeError, match="per_micro_batch must be a real number, got str"):
        CostModel("1", 1.0, 0.0)
    with pytest.raises(ValueError, match="seconds has 2 entries for 3 micro-batches"):
        CostModel.fit([[1], [2], [3]], [1.0, 2.0])
    with pytest.raises(ValueError, match="at least 3 timed micro-batches"):
        CostModel.fit([[1], [2]], [1.0, 2.0])
    with pytest.raises(ValueError, match="seconds must be finite"):
        CostModel.fit([[1], [2], [3]], [1.0, float("nan"), 2.0])
    with pytest.raises(ValueError, match=r"micro_batch_lengths\[1\]"):
        CostModel.fit([[1], [-2], [3]], [1.0, 2.0, 3.0])


def test_costs_that_overflow_float64_name_the_coefficient():
    # Issue 26: an integer coefficient of 10**400 was a bare OverflowError, and costs
    # past float64 came back as inf.
    with pytest.raises(ValueError, match=r"^per_token_squared must be a finite number >= 0 \(it must fit in a "
                                         r"float64\)"):
        CostModel(0, 1, 10**400)
    model = CostModel(0.0, 0.0, 1e300)
    assert model([10]) == 1e302
    with pytest.raises(ValueError, match=r"^the cost of micro_batch_lengths\[1\] overflows float64: per_token_squared "
                                         r"= 1e\+300 x Σs² is inf"):
        model.micro_batch_costs([[10], [10**10]])
    with pytest.raises(ValueError, match=r"terms are finite but their sum is not \(the largest: per_micro_batch"):
        CostModel(1.7e308, 1e306, 0.0)([100])
    with pytest.raises(ValueError, match=r"^flops_per_second is too small: .* FLOPs per token take inf seconds at "
                                         r"5e-324 FLOP/s"):
        CostModel.from_model(4096, 32, 32, flops_per_second=5e-324)


def test_default_prices_a_micro_batch_and_reports_seconds():
    # Issue 51: the default model has a per-micro-batch term, and an 8k micro-batch of
    # an 8B model takes about a second on an H200-class GPU (forward + backward).
    m = CostModel.default()
    assert m.per_micro_batch > 0 and m.per_kv_token > 0 and m.per_collective > 0
    assert 0.8 < m([8192]) < 1.5
    # the default plan needs no more micro-batches than NeMo-RL's packer on a batch
    # where tokens alone used more (rl_long_tail, DP 8, cap 8k: 36 against 34)
    from seqpack.testing.distributions import rl_long_tail
    from seqpack.testing.pipelines import nemo_rl_pipeline

    lengths = rl_long_tail(1024, 0, 8192)
    nemo = max(len(r) for r in nemo_rl_pipeline(lengths, 8, 8192)[0])
    assert seqpack.plan_step(lengths, 8, 8192, cost=CostModel.tokens()).num_micro_batches[0] > nemo
    assert seqpack.plan_step(lengths, 8, 8192).num_micro_batches[0] <= nemo
