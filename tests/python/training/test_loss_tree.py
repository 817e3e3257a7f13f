"""SequencePackingLossWrapper on a prefix tree (issue 29, item 4): the loss of the
rows' logits laid out as a tree equals the loss of the same rows packed without
sharing, and the gradient of each physical token's logits is the sum of its
logical tokens' gradients (fp64; NLL, clipped PG, PG with entropy; logits and the
fused LM head). The CP form runs on gloo ranks in test_attention_tree_cp.py."""

import numpy as np
import pytest
import torch

import seqpack
from seqpack import BatchedDataDict
from seqpack.loss import ClippedPGLoss, NLLLoss, SequencePackingLossWrapper

PG_CFG = {"ratio_clip_min": 0.2, "ratio_clip_max": 0.28, "ratio_clip_c": 3.0, "reference_policy_kl_penalty": 0.05,
          "reference_policy_kl_type": "k3", "use_importance_sampling_correction": True}
VOCAB, HIDDEN = 23, 6


def grpo_rows(seed=0, prompts=2, group=3):
    rng = np.random.default_rng(seed)
    rows, groups = [], []
    for p in range(prompts):
        prompt = rng.integers(0, VOCAB, int(rng.integers(2, 7))).tolist()
        for _ in range(group):
            rows.append(prompt + rng.integers(0, VOCAB, int(rng.integers(1, 6))).tolist())
            groups.append(p)
    rows.append(rows[0] + [5, 6])  # a row that continues another one
    groups.append(0)
    return rows, groups


def tree_batch(seed=0, pad=1):
    """The tree of some GRPO rows, and NeMo-RL's data of those rows ([B, S])."""
    rows, groups = grpo_rows(seed)
    tree = seqpack.pack_prefix_tree(rows, group_ids=groups, pad_to_multiple_of=pad)
    width = max(len(r) for r in rows) + 2
    g = torch.Generator().manual_seed(seed)
    batch = len(rows)
    ids = torch.zeros(batch, width, dtype=torch.long)
    token_mask = torch.zeros(batch, width)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
        token_mask[i, 2:len(row)] = 1.0  # the first tokens are a masked "prompt"
    sample_mask = torch.ones(batch)
    sample_mask[1] = 0.0
    data = BatchedDataDict(input_ids=ids, token_mask=token_mask, sample_mask=sample_mask,
                           advantages=torch.randn(batch, width, generator=g),
                           prev_logprobs=-torch.rand(batch, width, generator=g) * 3,
                           reference_policy_logprobs=-torch.rand(batch, width, generator=g) * 3,
                           generation_logprobs=-torch.rand(batch, width, generator=g) * 3)
    gvt = (token_mask[:, 1:] * sample_mask[:, None]).sum()
    return tree, data, gvt, sample_mask.sum()


LOSSES = [NLLLoss(), ClippedPGLoss(PG_CFG), ClippedPGLoss({**PG_CFG, "entropy_coef": 0.01})]


@pytest.mark.parametrize("loss_fn", LOSSES, ids=["nll", "clipped_pg", "pg+entropy"])
@pytest.mark.parametrize("pad", [1, 4])
def test_tree_loss_equals_the_rows_packed_plainly(loss_fn, pad):
    tree, data, gvt, gvs = tree_batch(pad=pad)
    g = torch.Generator().manual_seed(3)
    physical = torch.randn(tree.num_tokens, VOCAB, generator=g, dtype=torch.float64) * 2
    logical_index = torch.tensor(tree.logical_index)
    plain = physical[logical_index].clone().requires_grad_()  # each logical token: its physical token's logits
    ref, ref_metrics = SequencePackingLossWrapper(loss_fn, cu_seqlens_q=tree.cu_seqlens, fused=True)(plain, data, gvs,
                                                                                                    gvt)
    ref.backward()
    leaf = physical.clone().requires_grad_()
    loss, metrics = SequencePackingLossWrapper(loss_fn, cu_seqlens_q=tree)(leaf[None], data, gvs, gvt)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    loss.backward()
    summed = torch.zeros_like(physical).index_add_(0, logical_index, plain.grad)
    torch.testing.assert_close(leaf.grad, summed, rtol=1e-10, atol=1e-12)
    assert set(metrics) == set(ref_metrics)
    for key, value in ref_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


@pytest.mark.parametrize("loss_fn", LOSSES[1:], ids=["clipped_pg", "pg+entropy"])
def test_tree_loss_with_the_lm_head_fused(loss_fn):
    tree, data, gvt, gvs = tree_batch(seed=2)
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(tree.num_tokens, HIDDEN, generator=g, dtype=torch.float64)
    weight = torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64)
    bias = torch.randn(VOCAB, generator=g, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    wrapper = SequencePackingLossWrapper(loss_fn, cu_seqlens_q=tree)
    ref, _ = wrapper(torch.nn.functional.linear(*leaves), data, gvs, gvt)
    ref.backward()
    fused = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    loss, _ = wrapper(fused[0], data, gvs, gvt, lm_head_weight=fused[1], lm_head_bias=fused[2])
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    loss.backward()
    for got, want in zip(fused, leaves):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-10, atol=1e-12)


def test_tree_wrapper_checks():
    tree, data, gvt, gvs = tree_batch()
    logits = torch.zeros(tree.num_tokens, VOCAB)
    with pytest.raises(ValueError, match="one row per physical token: the tree's"):
        SequencePackingLossWrapper(NLLLoss(), cu_seqlens_q=tree)(logits[1:], data, gvs, gvt)
    with pytest.raises(ValueError, match="needs a log-prob loss"):
        SequencePackingLossWrapper(NLLLoss(), prepare_fn=lambda **kw: kw, cu_seqlens_q=tree)
    with pytest.raises(ValueError, match="cu_seqlens_q_padded does not apply to a prefix tree"):
        SequencePackingLossWrapper(NLLLoss(), cu_seqlens_q=tree, cu_seqlens_q_padded=tree.cu_seqlens)
    short = BatchedDataDict({k: v[:-1] for k, v in data.items()})
    with pytest.raises(ValueError, match="data must hold the"):
        SequencePackingLossWrapper(NLLLoss(), cu_seqlens_q=tree)(logits, short, gvs, gvt)
    narrow = BatchedDataDict({k: (v[:, :3] if v.dim() == 2 else v) for k, v in data.items()})
    with pytest.raises(ValueError, match="must cover every real token"):
        SequencePackingLossWrapper(NLLLoss(), cu_seqlens_q=tree)(logits, narrow, gvs, gvt)


# ---- a tree larger than the cap, in passes (issue 52) ------------------------------------------
@pytest.mark.parametrize("loss_fn", LOSSES, ids=["nll", "clipped_pg", "pg+entropy"])
@pytest.mark.parametrize("memory", ["activations", "kv"])
def test_the_passes_losses_sum_to_the_trees(loss_fn, memory):
    # NeMo-RL's token-level losses through the wrapper on each pass's layout: their sum,
    # and the model's gradients, equal the whole tree's in one micro-batch (fp64).
    from seqpack.testing.tiny_model import TinyCausalLM, TinyConfig

    tree, data, gvt, gvs = tree_batch(seed=5)
    torch.manual_seed(0)
    model = TinyCausalLM(TinyConfig(vocab_size=VOCAB, hidden_size=16, num_layers=2, num_heads=2,
                                    num_kv_heads=1)).double()
    model.zero_grad()
    whole, _ = SequencePackingLossWrapper(loss_fn, cu_seqlens_q=tree)(model.forward_tree(tree), data, gvs, gvt)
    whole.backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    total = 0.0
    for mb in seqpack.prefix_reuse(seqpack.split_prefix_tree(tree, 4), memory=memory):
        loss, _ = SequencePackingLossWrapper(loss_fn, cu_seqlens_q=mb.layout)(mb.forward(model), data, gvs, gvt)
        loss.backward()
        total += float(loss.detach())
    assert total == pytest.approx(float(whole.detach()), rel=1e-11, abs=1e-12)
    for got, want in zip((p.grad for p in model.parameters()), expected):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_a_pass_refuses_a_sequence_level_loss():
    tree, data, gvt, gvs = tree_batch(seed=5)
    seq_level = ClippedPGLoss({**PG_CFG, "token_level_loss": False})
    layout = seqpack.split_prefix_tree(tree, 4).passes[0]
    logits = torch.zeros(layout.num_local_tokens, VOCAB, dtype=torch.float64)
    with pytest.raises(ValueError, match="sequence-level loss .* must be token-level"):
        SequencePackingLossWrapper(seq_level, cu_seqlens_q=layout)(logits, data, gvs, gvt)
    with pytest.raises(ValueError, match="one row per own token of the pass"):
        SequencePackingLossWrapper(NLLLoss(), cu_seqlens_q=layout)(logits[:-1], data, gvs, gvt)
