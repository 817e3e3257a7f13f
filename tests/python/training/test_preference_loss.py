"""``DPOLoss`` and ``PreferenceLoss`` (issue 30, item 4): NeMo-RL's preference losses.

- NeMo-RL's DPO tests (``tests/unit/algorithms/test_loss_functions.py``:
  ``test_dpo_loss``, ``test_dpo_loss_varying_sequence_lengths``,
  ``test_dpo_sft_matches_nll_loss``) with their literal values, on the CPU.
- Hypothesis, fp64: the fused wrapper on packed pairs = the unpacked loss (values,
  gradients, metrics); micro-batches holding whole pairs add up to the batch; pairs
  as prefix trees (the prompt once) give the same loss.
- gloo: CP 2 / 3 and TP 2 / 3 equal one rank, values and each rank's gradient.
"""

import math

import numpy as np
import pytest
import torch
from _gloo import started_pools, values_of
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack import pack_sequences
from seqpack.loss import DPOLoss, LossConfigError, NLLLoss, PreferenceLoss, SequencePackingLossWrapper


def next_token_logprobs(logits, input_ids):
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, input_ids[:, 1:, None])[..., 0]


def call(loss_fn, logits, data, gvs, gvt):
    return loss_fn(next_token_logprobs(logits, data["input_ids"]), data, gvs, gvt)


# ---- NeMo-RL's tests -----------------------------------------------------------------
def setup_dpo_data(vocab=16):
    data = {"input_ids": torch.arange(8).reshape(2, 4), "token_mask": torch.tensor([[0, 0, 1, 1], [0, 0, 1, 1]]),
            "sample_mask": torch.tensor([1, 1]), "reference_policy_logprobs": torch.zeros(2, 4)}
    return data, torch.zeros(2, 4, vocab)


def test_dpo_loss():
    data, logits = setup_dpo_data()
    gvs, gvt = data["sample_mask"].sum(), (data["token_mask"] * data["sample_mask"][:, None]).sum()
    cfg = {"reference_policy_kl_penalty": 0.0, "preference_loss_weight": 1.0, "sft_loss_weight": 0.0,
           "preference_average_log_probs": False, "sft_average_log_probs": False}
    loss, metrics = call(DPOLoss(cfg), logits, data, gvs, gvt)
    assert torch.isclose(loss, torch.tensor(math.log(2.0)))  # -logsigmoid(0)
    loss, metrics = call(DPOLoss({**cfg, "sft_loss_weight": 0.5}), logits, data, gvs, gvt)
    sft = 2 * math.log(16)  # two masked tokens of the chosen row, uniform over 16
    assert torch.isclose(loss, torch.tensor(0.5 * sft + math.log(2.0)))
    assert metrics["sft_loss"] == pytest.approx(sft) and metrics["num_valid_samples"] == 1


@pytest.mark.parametrize("average, expected", [(False, 5 * math.log(10) / 2), (True, math.log(10))])
def test_dpo_loss_varying_sequence_lengths(average, expected):
    lengths, width, vocab = [3, 5, 4, 6], 6, 10
    ids = torch.zeros(4, width, dtype=torch.long)
    mask = torch.zeros(4, width)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.arange(n)
        mask[i, :n] = 1
    data = {"input_ids": ids, "token_mask": mask, "sample_mask": torch.ones(4),
            "reference_policy_logprobs": torch.zeros(4, width)}
    cfg = {"reference_policy_kl_penalty": 0.1, "preference_loss_weight": 1.0, "sft_loss_weight": 0.5,
           "preference_average_log_probs": average, "sft_average_log_probs": average}
    _, metrics = call(DPOLoss(cfg), torch.zeros(4, width, vocab), data, 4, mask.sum())
    assert torch.isclose(torch.tensor(metrics["sft_loss"]), torch.tensor(expected))


def test_dpo_sft_matches_nll_loss():
    g = torch.Generator().manual_seed(0)
    data = {"input_ids": torch.randint(0, 8, (4, 5), generator=g),
            "token_mask": torch.tensor([[0, 0, 1, 1, 0], [0, 0, 1, 1, 1], [0, 1, 1, 1, 1], [0, 1, 1, 1, 0]]),
            "sample_mask": torch.ones(4), "reference_policy_logprobs": torch.randn(4, 5, generator=g)}
    logits = torch.randn(4, 5, 8, generator=g)
    chosen = {k: v[::2] for k, v in data.items()}
    gvt = (data["sample_mask"][::2].unsqueeze(-1) * data["token_mask"][::2].sum()).sum()  # NeMo-RL's 12
    nll, _ = NLLLoss()(next_token_logprobs(logits[::2], chosen["input_ids"]), chosen, None, gvt)
    cfg = {"reference_policy_kl_penalty": 0.0, "preference_loss_weight": 0.0, "sft_loss_weight": 1.0,
           "preference_average_log_probs": False, "sft_average_log_probs": False}
    dpo, _ = call(DPOLoss(cfg), logits, data, data["sample_mask"].sum(), gvt)
    torch.testing.assert_close(dpo * data["sample_mask"][::2].sum() / gvt, nll)


def test_preference_loss_of_a_reward_model():
    rewards = torch.tensor([[2.0], [0.0], [-1.0], [1.0], [5.0], [9.0]])  # pairs (2, 0), (-1, 1), (5, 9)
    data = {"sample_mask": torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0])}  # the last pair masked
    loss, metrics = PreferenceLoss()(rewards, data, data["sample_mask"].sum(), None)
    expected = (-torch.nn.functional.logsigmoid(torch.tensor(2.0)) - torch.nn.functional.logsigmoid(
        torch.tensor(-2.0))) / 2
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert metrics == pytest.approx({"loss": expected.item(), "accuracy": 0.5, "rewards_chosen_mean": 0.5,
                                     "rewards_rejected_mean": 0.5, "num_valid_samples": 2.0}, rel=1e-6)


def test_config_keys_and_errors():
    section = {"max_num_epochs": 1, "max_num_steps": 150, "val_period": 25, "val_batches": 8,
               "val_global_batch_size": 8, "val_micro_batch_size": 1, "val_at_start": True, "val_at_end": False,
               "seed": 42, "reference_policy_kl_penalty": 0.1, "preference_average_log_probs": np.bool_(True),
               "sft_average_log_probs": True, "preference_loss_weight": 1, "sft_loss_weight": np.float64(0.2)}
    loss_fn = DPOLoss(section)  # NeMo-RL hands DPOLossFn its whole dpo section
    assert loss_fn.cfg == {"reference_policy_kl_penalty": 0.1, "preference_loss_weight": 1.0, "sft_loss_weight": 0.2,
                           "preference_average_log_probs": True, "sft_average_log_probs": True}
    assert DPOLoss().cfg["reference_policy_kl_penalty"] == 0.05
    for cfg, match in (({"reference_policy_kl_penalt": 0.1}, "did you mean 'reference_policy_kl_penalty'"),
                       ({"sft_loss_weight": -1.0}, "sft_loss_weight"),
                       ({"preference_average_log_probs": "no"}, "must be a bool")):
        with pytest.raises(LossConfigError, match=match):
            DPOLoss(cfg)


def test_odd_rows_and_the_per_sequence_wrapper_are_refused():
    data, logits = setup_dpo_data()
    odd = {k: v[:1] for k, v in data.items()}
    with pytest.raises(ValueError, match="even number"):
        call(DPOLoss(), logits[:1], odd, 1, 2)
    with pytest.raises(ValueError, match="use fused=True"):
        SequencePackingLossWrapper(DPOLoss(), cu_seqlens_q=[0, 4, 8])


# ---- packed = unpacked (fp64) ----------------------------------------------------------
def pairs_case(lengths, vocab, seed, masked_pair=None):
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    batch = len(lengths)
    ids = torch.zeros(batch, width, dtype=torch.long)
    token_mask = torch.zeros(batch, width, dtype=torch.float64)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(0, vocab, (n,), generator=g)
        token_mask[i, min(1, n - 1):n] = 1.0  # the prompt's first token is masked
    sample_mask = torch.ones(batch, dtype=torch.float64)
    if masked_pair is not None:
        sample_mask[2 * masked_pair: 2 * masked_pair + 2] = 0
    data = {"input_ids": ids, "token_mask": token_mask, "sample_mask": sample_mask,
            "reference_policy_logprobs": -torch.rand(batch, width, generator=g, dtype=torch.float64) * 3}
    logits = torch.randn(batch, width, vocab, generator=g, dtype=torch.float64)
    return data, logits


@settings(max_examples=30, deadline=None)
@given(pair_lengths=st.lists(st.tuples(st.integers(1, 9), st.integers(1, 9)), min_size=1, max_size=4),
       beta=st.floats(0.01, 2.0), w_sft=st.sampled_from([0.0, 0.5]), avg_pref=st.booleans(), avg_sft=st.booleans(),
       pad=st.sampled_from([1, 8]), masked=st.booleans(), seed=st.integers(0, 2**16))
def test_fused_wrapper_on_packed_pairs_equals_unpacked(pair_lengths, beta, w_sft, avg_pref, avg_sft, pad, masked,
                                                       seed):
    lengths = [n for pair in pair_lengths for n in pair]
    data, logits = pairs_case(lengths, 7, seed, masked_pair=0 if masked and len(pair_lengths) > 1 else None)
    loss_fn = DPOLoss({"reference_policy_kl_penalty": beta, "sft_loss_weight": w_sft,
                       "preference_average_log_probs": avg_pref, "sft_average_log_probs": avg_sft})
    gvs, gvt = data["sample_mask"].sum(), (data["token_mask"][:, 1:] * data["sample_mask"][:, None]).sum()
    base_leaf = logits.clone().requires_grad_()
    base, base_metrics = call(loss_fn, base_leaf, data, gvs, gvt)
    base.backward()
    packed = pack_sequences({"logits": logits}, attention_mask=torch.arange(max(lengths))[None] < torch.tensor(
        lengths)[:, None], pad_multiple=pad)
    rows = packed["logits"].detach().clone().requires_grad_()
    wrapper = SequencePackingLossWrapper(loss_fn, cu_seqlens_q=packed.layout.cu_seqlens,
                                         cu_seqlens_q_padded=packed.layout.cu_seqlens_padded, fused=True)
    loss, metrics = wrapper(rows, data, gvs, gvt)
    torch.testing.assert_close(loss, base, rtol=1e-10, atol=1e-12)
    assert metrics == pytest.approx(base_metrics, rel=1e-9, abs=1e-12)
    loss.backward()
    torch.testing.assert_close(packed.unpack(rows.grad), base_leaf.grad, rtol=1e-9, atol=1e-12)


def test_micro_batches_of_whole_pairs_add_up():
    lengths = [4, 6, 3, 3, 8, 2, 5, 5]
    data, logits = pairs_case(lengths, 9, 3)
    loss_fn = DPOLoss({"sft_loss_weight": 0.3})
    gvs, gvt = data["sample_mask"].sum(), (data["token_mask"][:, 1:] * data["sample_mask"][:, None]).sum()
    whole, whole_metrics = call(loss_fn, logits, data, gvs, gvt)
    parts, summed = 0.0, {}
    for rows in ([0, 1, 4, 5], [2, 3], [6, 7]):  # micro-batches of whole pairs
        part, metrics = call(loss_fn, logits[rows], {k: v[rows] for k, v in data.items()}, gvs, gvt)
        parts = parts + part
        for key, value in metrics.items():
            summed[key] = summed.get(key, 0.0) + value
    torch.testing.assert_close(parts, whole, rtol=1e-12, atol=1e-12)
    summed["num_valid_samples"] = whole_metrics["num_valid_samples"]  # a count: micro-batches' counts add
    assert summed == pytest.approx({**whole_metrics}, rel=1e-9)


def test_pairs_as_prefix_trees_share_the_prompt():
    # A pair's two rows share their prompt: as a prefix tree the prompt runs once, and
    # the DPO loss through the wrapper (one call on every row) is the unpacked one.
    from seqpack import pack_prefix_tree
    from seqpack.testing.tiny_model import TinyCausalLM, TinyConfig

    torch.manual_seed(0)
    model = TinyCausalLM(TinyConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2,
                                    num_kv_heads=1)).double()
    g = torch.Generator().manual_seed(1)
    rows = []
    for prompt_len, (c, r) in ((5, (3, 4)), (2, (6, 1))):
        prompt = torch.randint(1, 32, (prompt_len,), generator=g).tolist()
        rows += [prompt + torch.randint(1, 32, (c,), generator=g).tolist(),
                 prompt + torch.randint(1, 32, (r,), generator=g).tolist()]
    lengths = [len(x) for x in rows]
    width = max(lengths)
    ids = torch.tensor([x + [0] * (width - len(x)) for x in rows])
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).double()
    data = {"input_ids": ids, "token_mask": mask, "sample_mask": torch.ones(4, dtype=torch.float64),
            "reference_policy_logprobs": -torch.rand(4, width, generator=g, dtype=torch.float64)}
    loss_fn = DPOLoss({"reference_policy_kl_penalty": 0.4, "sft_loss_weight": 0.3})
    logits = model.forward_padded(ids, mask.long(), right_padded=True)
    base, _ = call(loss_fn, logits, data, 4, mask[:, 1:].sum())
    tree = pack_prefix_tree(rows, group_ids=[0, 0, 1, 1])
    assert tree.num_tokens < sum(lengths)  # the prompts once
    loss, _ = SequencePackingLossWrapper(loss_fn, cu_seqlens_q=tree)(model.forward_tree(tree), data, 4,
                                                                     mask[:, 1:].sum())
    torch.testing.assert_close(loss, base, rtol=1e-10, atol=1e-12)


# ---- CP and TP on gloo ranks -------------------------------------------------------------
def case_dpo_parallel(rank, world, seed):
    """The fused DPO wrapper with each rank's zigzag rows (CP) or vocabulary slice
    (TP) equals one rank's, values and the rank's part of the gradient."""
    import torch.distributed as dist

    from seqpack.cp import cp_local_rows

    data, logits = pairs_case([5, 3, 7, 2], 6 * world, seed)
    lengths = [5, 3, 7, 2]
    mask = torch.arange(7)[None] < torch.tensor(lengths)[:, None]
    packed = pack_sequences({"logits": logits}, attention_mask=mask, pad_multiple=2 * world)
    layout = packed.layout
    loss_fn = DPOLoss({"reference_policy_kl_penalty": 0.2, "sft_loss_weight": 0.1})
    gvs, gvt = data["sample_mask"].sum(), (data["token_mask"][:, 1:] * data["sample_mask"][:, None]).sum()
    full = packed["logits"].detach().clone().requires_grad_()
    kwargs = dict(cu_seqlens_q=layout.cu_seqlens, cu_seqlens_q_padded=layout.cu_seqlens_padded, fused=True)
    ref, _ = SequencePackingLossWrapper(loss_fn, **kwargs)(full, data, gvs, gvt)
    ref.backward()
    local = cp_local_rows(packed["logits"], layout.cu_seqlens_padded, world, rank).detach().clone().requires_grad_()
    loss, _ = SequencePackingLossWrapper(loss_fn, context_parallel_group=dist.group.WORLD, **kwargs)(
        local, data, gvs, gvt)
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-12)
    (loss / world).backward()
    torch.testing.assert_close(local.grad, cp_local_rows(full.grad, layout.cu_seqlens_padded, world, rank),
                               rtol=1e-9, atol=1e-12)
    cols = slice(rank * 6, (rank + 1) * 6)
    sliced = packed["logits"][:, cols].detach().clone().requires_grad_()
    loss, _ = SequencePackingLossWrapper(loss_fn, vocab_parallel_rank=rank, vocab_parallel_group=dist.group.WORLD,
                                         **kwargs)(sliced, data, gvs, gvt)
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-12)
    loss.backward()
    torch.testing.assert_close(sliced.grad, full.grad[:, cols], rtol=1e-9, atol=1e-12)
    return True


@pytest.fixture(scope="module")
def pools():
    yield from started_pools((2, 3))


@pytest.mark.parametrize("world", (2, 3))
def test_cp_and_tp_on_gloo_ranks(pools, world):
    assert values_of(pools[world], case_dpo_parallel, 5, timeout_s=90) == [True] * world
