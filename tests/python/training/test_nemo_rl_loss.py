"""NeMo-RL's current loss semantics, literally: the golden vectors of its
``test_clipped_pg_loss_goldens`` (float64, loss, gradients and metrics to 1e-12) and
the vectors of its ``test_loss_functions.py`` (CPU: the next-token log-probs are
given directly instead of logits built to produce them), and the configuration
rules (unknown or unimplemented keys raise, naming the key)."""

import math

import pytest
import torch

from seqpack.loss import (ClippedPGLoss, LossConfigError, NLLLoss, SequencePackingLossWrapper, calculate_kl,
                          masked_mean, prepare_loss_input)

# ---- the golden vectors (NeMo-RL tests/unit/algorithms/data/clipped_pg_loss_goldens.json)

BASE = dict(
    input_ids=[[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]],
    token_mask=[[0, 1, 1, 1, 0], [0, 1, 1, 0, 0]],
    sample_mask=[1, 1],
    advantages=[[0, 1.2, -0.7, 0.4, 2.0], [0, -1.1, 0.6, 1.5, -0.3]],
    prev_logprobs=[[0, -1.0, -1.1, -0.8, -1.3], [0, -0.9, -1.0, -1.2, -0.8]],
    generation_logprobs=[[0, -1.2, -1.5, -0.7, -1.1], [0, -1.4, -0.7, -1.3, -1.0]],
    reference_policy_logprobs=[[0, -1.1, -0.7, -1.4, -1.0], [0, -1.3, -0.8, -1.0, -1.4]],
    rewards=[1.0, 0.0],
)
CURR = [[-1.6, -0.8, -1.1, -1.4], [-0.7, -1.4, -0.9, -1.2]]
COMMON = dict(probs_ratio=0.9062422918970267, probs_ratio_clamped=0.95999999808, probs_ratio_min=0.5488116360940264,
              probs_ratio_max=1.3498588075760032, probs_ratio_clamped_min=0.8, probs_ratio_clamped_max=1.2,
              token_mult_prob_error=1.3633956877038524, gen_kl_error=0.0615208729208074,
              policy_kl_error=0.05012223679533659, js_divergence_error=0.013649421513505665,
              sampling_importance_ratio=1.2015208706408074, num_valid_samples=2.0,
              approx_entropy=1.1051425199516978, kl_penalty=0.0, positive_nll_loss=0.0)
PPO_GRAD = [[-0.13171479239913675, 0.18898023268267997, -0.05926545753600652, -0.0],
            [0.26870860625782017, -0.08043840536339991, 0.0, 0.0]]
FORCE_GRAD = [[-0.23999999952, 0.13999999972, -0.07999999984, -0.0],
              [0.21999999956000002, -0.11999999976, -0.0, 0.0]]
ON_POLICY_PROBS = dict(probs_ratio=0.9999999980000001, probs_ratio_clamped=0.9999999980000001, probs_ratio_min=1.0,
                       probs_ratio_max=1.0, probs_ratio_clamped_min=1.0, probs_ratio_clamped_max=1.0)
GOLDENS = [
    # name, config, data overrides, loss, d loss / d next_token_logprobs, metrics (over COMMON)
    ("ppo_token", {"reference_policy_kl_penalty": 0.0}, {}, 0.18627018364195694, PPO_GRAD, {}),
    ("force_on_policy", {"reference_policy_kl_penalty": 0.0, "force_on_policy_ratio": True}, {}, -0.07999999984,
     FORCE_GRAD, dict(ON_POLICY_PROBS, token_mult_prob_error=1.8049814999288314, gen_kl_error=0.19294616177483598,
                      policy_kl_error=0.1781145417109382, js_divergence_error=0.04397054964336933,
                      sampling_importance_ratio=1.1729461598148359)),
    ("reinforce", {"reference_policy_kl_penalty": 0.0, "disable_ppo_ratio": True}, {}, 0.373999999252, FORCE_GRAD,
     dict(probs_ratio=-1.1199999977600001, probs_ratio_clamped=-1.1199999977600001, probs_ratio_min=-1.6,
          probs_ratio_max=-0.7, probs_ratio_clamped_min=-1.6, probs_ratio_clamped_max=-0.7)),
    ("dual_clip", {"reference_policy_kl_penalty": 0.0, "ratio_clip_c": 3.0},
     {"prev_logprobs": [[0, -1.0, -3.0, -0.8, -1.3], [0, -0.9, -1.0, -1.2, -0.8]]}, 0.417289950119277,
     [[-0.13171479239913675, 0.0, -0.05926545753600652, -0.0], [0.26870860625782017, -0.08043840536339991, 0.0, 0.0]],
     dict(probs_ratio=2.4412732271985886, probs_ratio_max=9.025013499434122, token_mult_prob_error=1.9613685610472653,
          gen_kl_error=0.18778196516971712, policy_kl_error=0.43239604089127404,
          js_divergence_error=0.061329026534706434, sampling_importance_ratio=0.947781963649717)),
    ("cispo_with_token_is", {"reference_policy_kl_penalty": 0.0, "use_cispo": True,
                             "use_importance_sampling_correction": True}, {}, 0.03329652014119518,
     [[-0.23450932909773395, 0.2506265487024803, -0.057909594638482234, -0.0],
      [0.435262414594309, -0.07111854904320782, -0.0, 0.0]], {}),
    ("tis_token", {"reference_policy_kl_penalty": 0.0, "use_importance_sampling_correction": True,
                   "truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 1.3,
                   "truncated_importance_sampling_ratio_min": 0.7}, {}, 0.3209028399844618,
     [[-0.1608768107267998, 0.24567430248748398, -0.05362560357559994, -0.0],
      [0.3493211881351662, -0.059590236335788666, 0.0, 0.0]],
     dict(sampling_importance_ratio=1.093411677188746, is_oob_ratio=0.3999999992)),
    ("icepop_token", {"reference_policy_kl_penalty": 0.0, "use_importance_sampling_correction": True,
                      "truncated_importance_sampling_type": "icepop", "truncated_importance_sampling_ratio": 1.25,
                      "truncated_importance_sampling_ratio_min": 0.75}, {}, -0.21450241430239975,
     [[-0.1608768107267998, 0.0, -0.05362560357559994, -0.0], [0.0, 0.0, 0.0, 0.0]],
     dict(sampling_importance_ratio=0.4252480343887298, is_oob_ratio=0.5999999988)),
    ("seq_mask_tis", {"reference_policy_kl_penalty": 0.0, "use_importance_sampling_correction": True,
                      "truncated_importance_sampling_type": "seq-mask-tis", "truncated_importance_sampling_ratio": 1.15,
                      "truncated_importance_sampling_ratio_min": 0.95}, {}, 0.383435358421665,
     [[0.0, 0.0, 0.0, -0.0], [0.4430255947574536, -0.059590236335788666, 0.0, 0.0]],
     dict(sampling_importance_ratio=0.4779078973205534, is_oob_ratio=0.4999999975)),
    ("gspo_sequence_is", {"reference_policy_kl_penalty": 0.0, "use_importance_sampling_correction": True,
                          "sequence_level_importance_ratios": True, "token_level_loss": False}, {},
     -0.06433245613699731,
     [[-0.06749293963637779, -0.06749293963637779, -0.06749293963637779, -0.0],
      [0.06907318137816686, 0.06907318137816686, 0.0, 0.0]],
     dict(probs_ratio=0.8531734178632858, probs_ratio_clamped=0.8531734178632858, probs_ratio_min=0.8187307536238023,
          probs_ratio_max=0.9048374184883784, probs_ratio_clamped_min=0.8187307536238023,
          probs_ratio_clamped_max=0.9048374184883784, sampling_importance_ratio=1.4350620072548388)),
    ("vapo_mixed_rewards", {"reference_policy_kl_penalty": 0.0, "positive_example_nll_weight": 0.3}, {},
     0.5362701824752902,
     [[-0.23171479206580342, 0.0889802330160133, -0.15926545720267318, -0.0],
      [0.26870860625782017, -0.08043840536339991, 0.0, 0.0]], dict(positive_nll_loss=1.1666666627777778)),
    ("vapo_no_positive_rewards", {"reference_policy_kl_penalty": 0.0, "positive_example_nll_weight": 0.3},
     {"rewards": [-1.0, 0.0]}, 0.18627018364195694, PPO_GRAD, {}),
]


def golden_data(overrides):
    data = {k: torch.tensor(v, dtype=torch.float64) for k, v in {**BASE, **overrides}.items()}
    data["input_ids"] = data["input_ids"].long()
    return data


def counts(data):
    return data["sample_mask"].sum(), (data["token_mask"][:, 1:] * data["sample_mask"][:, None]).sum()


@pytest.mark.parametrize("name, cfg, overrides, loss, grad, metrics", GOLDENS, ids=[g[0] for g in GOLDENS])
def test_goldens(name, cfg, overrides, loss, grad, metrics):
    data = golden_data(overrides)
    curr = torch.tensor(CURR, dtype=torch.float64, requires_grad=True)
    got, got_metrics = ClippedPGLoss(cfg)(curr, data, *counts(data))
    (g,) = torch.autograd.grad(got, curr)
    assert got.item() == pytest.approx(loss, rel=1e-12, abs=1e-12)
    torch.testing.assert_close(g, torch.tensor(grad, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    expected = {**COMMON, **metrics, "loss": loss}
    if "is_oob_ratio" not in metrics:
        assert "is_oob_ratio" not in got_metrics
    assert set(got_metrics) == set(expected)  # NeMo-RL's metric names, no more
    for key, value in expected.items():
        assert got_metrics[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key


def test_golden_kl_score_function_gradient_with_unfiltered_logprobs():
    # kl_on_policy_unfiltered: pins the KL's score-function gradient (NeMo-RL #2506).
    data = golden_data({})
    curr = torch.tensor(CURR, dtype=torch.float64, requires_grad=True)
    data["curr_logprobs_unfiltered"] = unfiltered = torch.tensor(
        [[-1.3, -0.9, -1.0, -1.2], [-0.8, -1.2, -1.1, -1.0]], dtype=torch.float64, requires_grad=True)
    loss, metrics = ClippedPGLoss({"reference_policy_kl_penalty": 0.17, "use_on_policy_kl_approximation": True})(
        curr, data, *counts(data))
    g_curr, g_unfiltered = torch.autograd.grad(loss, (curr, unfiltered))
    assert loss.item() == pytest.approx(0.19851918573481045, rel=1e-12, abs=1e-12)
    torch.testing.assert_close(g_curr, torch.tensor(PPO_GRAD, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_unfiltered, torch.tensor(
        [[-0.0061528944303387316, -0.012390407817874646, 0.010075127781121107, 0.0],
         [0.03097601954468661, -0.008248816955594178, 0.0, 0.0]], dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert metrics["kl_penalty"] == pytest.approx(0.07205295348737359, rel=1e-12)


# ---- NeMo-RL tests/unit/algorithms/test_loss_functions.py, on the CPU


def unit_data(adv, prev=None, gen=None, ref=None, batch=1):
    """``_setup_clipped_pg_test_data``: token_mask [[0, 1, 1, 1]], zeros elsewhere, the
    test's three values written after column 0."""
    zeros = [[0.0, 0.0, 0.0]] * batch
    rows = lambda v: torch.tensor([[0.0] + list(r) for r in (v if v is not None else zeros)])  # noqa: E731
    return {"input_ids": torch.zeros(batch, 4, dtype=torch.long), "token_mask": torch.tensor([[0, 1, 1, 1]] * batch),
            "sample_mask": torch.ones(batch, dtype=torch.long), "advantages": rows(adv), "prev_logprobs": rows(prev),
            "generation_logprobs": rows(gen), "reference_policy_logprobs": rows(ref)}


A, P, C, GEN = [[1, -1, 2]], [[-1, -1, -1]], [[-1.69315, -1.0, -0.59453]], [[-0.5, -1.5, -0.8]]


def unit_loss(cfg, data, curr):
    sm = data["sample_mask"]
    return ClippedPGLoss(cfg)(torch.tensor(curr), data, sm.sum(), (data["token_mask"] * sm[:, None]).sum())


@pytest.mark.parametrize("cfg, data, curr, expected", [
    ({"use_cispo": True}, unit_data(A, P), C, 0.5937973314),
    ({"use_cispo": True, "use_importance_sampling_correction": True}, unit_data(A, P, GEN), C, 0.1136868748),
    ({"use_on_policy_kl_approximation": True, "use_importance_sampling_correction": True},
     unit_data(A, P, GEN, P), C, -0.2064990031),
    ({"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "tis",
      "truncated_importance_sampling_ratio": 0.8, "sequence_level_importance_ratios": True,
      "token_level_loss": False}, unit_data(A, P, GEN, P), C, -0.4845658199),
    ({"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "tis",
      "truncated_importance_sampling_ratio": 0.8}, unit_data(A, P, GEN, P), C, -0.4744214900),
    ({"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "icepop",
      "truncated_importance_sampling_ratio": 5.0, "truncated_importance_sampling_ratio_min": 0.5},
     unit_data(A, P, [[-0.5, -3.5, -0.8]]), P, -0.7479973861),
    ({"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "seq-mask-tis",
      "truncated_importance_sampling_ratio": 1.002, "truncated_importance_sampling_ratio_min": 0.999},
     unit_data(A, P, [[-1.0005] * 3]), P, -0.6670000811),
    ({"ratio_clip_c": 3.0}, unit_data([[1, -1, -4]], [[-1, -1, -3]]), [[-1.69315, -1.0, -0.69741]], 4.1666671227),
    ({"sequence_level_importance_ratios": True, "token_level_loss": False}, unit_data(A, P), C, -0.6057072748),
    ({"sequence_level_importance_ratios": True, "token_level_loss": False},
     unit_data(A * 2, [[-1, -1, -1], [-2, -2, -2]], batch=2), C * 2, -0.4912328636),
    ({"use_importance_sampling_correction": True, "sequence_level_importance_ratios": True,
      "token_level_loss": False}, unit_data(A, P, GEN, P), C, -0.4959111733),
], ids=["cispo", "cispo+is", "on_policy_kl_is", "tis_sequence", "tis_token", "icepop", "seq_mask_tis", "dual_clip",
        "gspo", "gspo_batch_2", "gspo_is"])
def test_unit_vectors(cfg, data, curr, expected):
    loss, _ = unit_loss({"reference_policy_kl_penalty": 0.0, **cfg}, data, curr)
    assert loss.item() == pytest.approx(expected, rel=1e-3, abs=1e-4)


def test_kl_penalty_and_entropy_metric_vectors():
    loss, _ = unit_loss({"reference_policy_kl_penalty": 0.1}, unit_data([[0, 0, 0]], None, None, P), [[0.0, -1.0, -2.0]])
    assert loss.item() == pytest.approx(0.0362053755, rel=1e-5)
    _, metrics = unit_loss({"reference_policy_kl_penalty": 0.0},
                           unit_data([[0, 0, 0]], [[-0.4, -0.9, -1.4]], [[-0.6, -1.1, -1.6]]), [[-0.5, -1.0, -1.5]])
    assert metrics["approx_entropy"] == pytest.approx(1.1051709144, rel=1e-3, abs=1e-5)


def test_seq_mask_tis_with_a_masked_generation_logprob_is_finite():
    loss, _ = unit_loss({"reference_policy_kl_penalty": 0.0, "use_importance_sampling_correction": True,
                         "truncated_importance_sampling_type": "seq-mask-tis",
                         "truncated_importance_sampling_ratio": 1.002, "truncated_importance_sampling_ratio_min": 0.999},
                        unit_data(A, P, [[-1.0005, -math.inf, -1.0005]]), P)
    assert math.isfinite(loss.item())


@pytest.mark.parametrize("on_policy, expected", [(False, [[-0.045, 0.06]]),
                                                  (True, [[-0.060743646341, 0.044449093241]])])
def test_kl_gradient_includes_the_sampling_term(on_policy, expected):
    # NeMo-RL >= v0.7 (#2506, #2958): the KL's gradient adds beta * w * kl (v0.6 gave
    # [[-0.05248, 0.04945]] / [[-0.07084, 0.03663]] here).
    data = {"token_mask": torch.tensor([[0, 1, 1]]), "sample_mask": torch.ones(1),
            "advantages": torch.tensor([[0, 0.4, -0.2]]), "prev_logprobs": torch.tensor([[0, -1.0, -0.8]]),
            "generation_logprobs": torch.tensor([[0, -1.5, -0.4]]),
            "reference_policy_logprobs": torch.tensor([[0, -0.9, -1.1]])}
    grads = []
    for beta in (0.3, 0.0):
        curr = torch.tensor([[-1.2, -0.7]], requires_grad=True)
        loss, _ = ClippedPGLoss({"reference_policy_kl_penalty": beta, "use_on_policy_kl_approximation": on_policy})(
            curr, data, torch.tensor(1.0), torch.tensor(2.0))
        grads.append(torch.autograd.grad(loss, curr)[0])
    torch.testing.assert_close(grads[0] - grads[1], torch.tensor(expected), rtol=1e-5, atol=1e-6)


def test_calculate_kl_clamps_detach_the_weights():
    lp = torch.tensor([[-3.0, -1.0]], requires_grad=True)
    kl = calculate_kl(lp, torch.zeros(1, 2), "k3", input_clamp_value=2.0, output_clamp_value=None,
                      importance_sampling_weights=torch.exp(lp - lp.detach()))
    torch.testing.assert_close(kl.detach(), torch.tensor([[4.389056, 0.7182818]]))
    torch.testing.assert_close(torch.autograd.grad(kl.sum(), lp)[0], torch.tensor([[0.0, -1.0]]))
    lp = torch.tensor([[-1.0]], requires_grad=True)
    kl = calculate_kl(lp, torch.zeros(1, 1), "k3", input_clamp_value=None, output_clamp_value=1.0,
                      importance_sampling_weights=100 * torch.exp(lp - lp.detach()))
    assert kl.item() == 1.0 and torch.autograd.grad(kl.sum(), lp)[0].item() == 0.0


def test_tis_reports_out_of_bounds_and_its_lower_bound_defaults_to_zero():
    _, metrics = unit_loss({"reference_policy_kl_penalty": 0.0, "use_importance_sampling_correction": True,
                            "truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 2.0},
                           unit_data([[1, 1, 1]], [[0.0, math.log(3.0), math.log(0.5)]], [[0, 0, 0]]), [[0, 0, 0]])
    assert metrics["is_oob_ratio"] == pytest.approx(1 / 3)
    for low, loss_value, oob in ((None, -1.0333333, 1 / 3), (0.5, -1.1666667, 2 / 3)):
        loss, metrics = unit_loss({"reference_policy_kl_penalty": 0.0, "use_importance_sampling_correction": True,
                                   "force_on_policy_ratio": True, "truncated_importance_sampling_type": "tis",
                                   "truncated_importance_sampling_ratio": 2.0,
                                   "truncated_importance_sampling_ratio_min": low},
                                  unit_data([[1, 1, 1]], None, [[0, 0, 0]]), [[math.log(v) for v in (0.1, 1.0, 3.0)]])
        assert loss.item() == pytest.approx(loss_value, rel=1e-6)
        assert metrics["is_oob_ratio"] == pytest.approx(oob)


def test_masked_mean_all_zeros_and_nll_vectors():
    assert masked_mean(torch.tensor([1.0, 2, 3, 4]), torch.zeros(4)).item() == 0.0
    assert masked_mean(torch.tensor([1.0, 2, 3, 4]), torch.tensor([1.0, 0, 0, 0])).item() == pytest.approx(1.0)
    assert masked_mean(torch.tensor([[1.0, 2], [3, 4]]), torch.zeros(2, 2), dim=1).tolist() == [0.0, 0.0]
    data = {"input_ids": torch.tensor([[0, 1, 2, 3]]), "token_mask": torch.tensor([[0, 0, 1, 1]]),
            "sample_mask": torch.ones(1)}
    for value, expected in ((0.0, 0.0), (-999.0, 999.0)):
        loss, metrics = NLLLoss()(torch.full((1, 3), value), data, torch.tensor(1.0), torch.tensor(2.0))
        assert loss.item() == pytest.approx(expected) and metrics["num_unmasked_tokens"] == 2


# ---- configuration rules


@pytest.mark.parametrize("cfg, match", [
    ({"use_cispo": True, "disable_ppo_ratio": True}, "use_cispo is incompatible with disable_ppo_ratio"),
    ({"use_cispo": True, "ratio_clip_c": 3.0}, "use_cispo is incompatible with ratio_clip_c"),
    ({"use_cispo": True, "token_level_loss": False}, "use_cispo is incompatible with token_level_loss"),
    ({"sequence_level_importance_ratios": True}, "mutually exclusive with token-level loss"),
    ({"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "tis",
      "truncated_importance_sampling_ratio": 1.0, "truncated_importance_sampling_ratio_min": 2.0},
     "truncated_importance_sampling_ratio_min must be <= truncated_importance_sampling_ratio"),
    ({"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "icepop",
      "truncated_importance_sampling_ratio": 1.0}, "needs truncated_importance_sampling_ratio_min"),
    ({"truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 1.0},
     "needs use_importance_sampling_correction"),
    ({"truncated_importance_sampling_ratio": 2.0}, "needs a truncated_importance_sampling_type"),
    ({"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "clip",
      "truncated_importance_sampling_ratio": 1.0}, "must be one of"),
    ({"ratio_clip_c": 1.0}, r"ratio_clip_c.*must be > 1"),
    ({"reference_policy_kl_type": "k4"}, "reference_policy_kl_type"),
    ({"ratio_clip_min": -0.1}, "ratio_clip_min"),
    ({"seq_logprob_error_in_loss": True}, r"cfg\['seq_logprob_error_in_loss'\] is a NeMo-RL ClippedPGLossFn option"),
    ({"use_cispo_typo": True}, r"cfg\['use_cispo_typo'\] is not a ClippedPGLossFn key"),
])
def test_configuration_errors_name_the_rule(cfg, match):
    with pytest.raises(LossConfigError, match=match) as info:
        ClippedPGLoss(cfg)
    assert isinstance(info.value, ValueError) and isinstance(info.value, AssertionError)


@pytest.mark.parametrize("cfg, expected", [
    ({}, dict(loss="tokens", kl_penalty="tokens", sampling_importance_ratio="tokens", probs_ratio="tokens",
              approx_entropy="tokens", num_valid_samples="none", probs_ratio_min="none", positive_nll_loss="none")),
    ({"sequence_level_importance_ratios": True, "token_level_loss": False},
     dict(loss="sequences", kl_penalty="sequences", sampling_importance_ratio="sequences")),
    ({"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "seq-mask-tis",
      "truncated_importance_sampling_ratio": 1.5, "truncated_importance_sampling_ratio_min": 0.5},
     dict(loss="tokens", is_oob_ratio="sequences")),
    ({"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "tis",
      "truncated_importance_sampling_ratio": 1.5, "token_level_loss": False},
     dict(loss="sequences", is_oob_ratio="tokens")),
])
def test_metric_normalizations_as_advertised(cfg, expected):
    advertised = ClippedPGLoss(cfg).metric_normalizations
    for key, value in expected.items():
        assert advertised[key] == value, key
    assert ("is_oob_ratio" in advertised) == ("truncated_importance_sampling_type" in cfg)
    data = golden_data({})
    _, metrics = ClippedPGLoss(cfg)(torch.tensor(CURR, dtype=torch.float64), data, *counts(data))
    assert set(metrics) == set(advertised)  # every metric is advertised
    assert NLLLoss.metric_normalizations == {"loss": "tokens", "num_unmasked_tokens": "none",
                                             "num_valid_samples": "none"}


def test_vapo_does_not_split_over_sequences():
    with pytest.raises(ValueError, match="use fused=True"):
        SequencePackingLossWrapper(ClippedPGLoss({"positive_example_nll_weight": 0.3}), None, [0, 3])


def test_prepare_loss_input_takes_every_row():
    # [B, S, V] logits with B > 1: every row's log-probs, [B, S - 1] (not row 0's alone).
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g)
    ids = torch.randint(0, 11, (3, 5), generator=g)
    out, _ = prepare_loss_input(logits, {"input_ids": ids})
    expected = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    assert out["next_token_logprobs"].shape == (3, 4)
    torch.testing.assert_close(out["next_token_logprobs"], expected)
