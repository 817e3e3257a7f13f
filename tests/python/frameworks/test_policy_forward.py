"""The HF policy forward of NeMo-RL and verl on prefix trees (issue 39, item 3), in
fp64 against each framework's non-tree path on a tiny HF Llama:

- NeMo-RL: ``TreeMicroBatch.forward(model)`` logits through
  ``SequencePackingLossWrapper(loss_fn, cu_seqlens_q=mb.tree)`` give the loss and
  parameter gradients of the same rows packed plainly (NeMo-RL's sequence packing);
  ``mb.logprobs(model)`` gives ``get_logprobs``' ``[B, S]``;
- verl: ``tree_forward_micro_batch`` on ``rearrange_micro_batches(shared_prefix=True)``'s
  micro-batches (and, where the released verl is importable, on verl's own
  ``prepare_dynamic_batch`` micro-batches) gives the padded path's ``log_probs`` and
  ``entropy`` ``[B, response_length]`` (verl's ``logprobs_from_logits`` /
  ``entropy_from_logits`` when importable) at every response token.
"""

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import seqpack  # noqa: E402
from seqpack.frameworks import verl as seqpack_verl  # noqa: E402
from seqpack.frameworks.batched_data_dict import TreeMicroBatch  # noqa: E402
from seqpack.integrations import hf  # noqa: E402
from seqpack.loss import ClippedPGLoss, SequencePackingLossWrapper  # noqa: E402
from test_batched_data_dict_tree import VOCAB, grpo_data, packing_args  # noqa: E402
from test_hf_tree import fp64_norms  # noqa: E402,F401  (the fixture)


def llama(attn, seed=0):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation=attn, dtype=torch.float64)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return model


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


@pytest.fixture(scope="module")
def packed_name():
    return hf.register()  # NeMo-RL's sequence packing: rows back to back, attention kept per row


def test_nemo_rl_tree_loss_and_gradients_equal_sequence_packing(fp64_norms, packed_name):  # noqa: F811
    data, rows, groups = grpo_data([12, 9, 15], [[4, 6, 3], [5, 5], [2, 7, 4, 3]], seed=3)
    shards, _ = data.shard_by_batch_size(1, sequence_packing_args=packing_args(64, shared_prefix_group_key="idx"))
    loss_fn = ClippedPGLoss({"ratio_clip_min": 0.2, "ratio_clip_max": 0.28, "ratio_clip_c": None,
                             "reference_policy_kl_penalty": 0.01, "use_importance_sampling_correction": False})
    tree_model, packed_model = llama("sdpa"), llama(packed_name)
    for tmb in shards[0].get_batch(0).make_microbatch_iterator_for_packable_sequences(shared_prefix=True,
                                                                                        group_key="idx"):
        assert isinstance(tmb, TreeMicroBatch)
        gvs, gvt = tmb.data["sample_mask"].sum(), tmb.data["token_mask"][:, 1:].sum()
        tree_model.zero_grad()
        loss, _ = SequencePackingLossWrapper(loss_fn, cu_seqlens_q=tmb.tree)(tmb.forward(tree_model), tmb.data, gvs,
                                                                            gvt)
        loss.backward()
        assert tree_model.config._attn_implementation == "seqpack_tree"
        # NeMo-RL's sequence packing: the rows back to back, positions restarting per row
        lengths = tmb.data["input_lengths"].tolist()
        flat = torch.cat([tmb.data["input_ids"][i, :n] for i, n in enumerate(lengths)])[None]
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
        packed_model.zero_grad()
        logits = packed_model(input_ids=flat, position_ids=positions).logits
        ref, _ = SequencePackingLossWrapper(loss_fn, cu_seqlens_q=np.concatenate([[0], np.cumsum(lengths)]))(
            logits, tmb.data, gvs, gvt)
        ref.backward()
        assert rel(loss.detach(), ref.detach()) < 1e-10
        grads = dict(packed_model.named_parameters())
        for name, p in tree_model.named_parameters():
            assert rel(p.grad, grads[name].grad) < 1e-10, name
        assert tmb.tree.num_tokens < tmb.tree.num_logical_tokens

        with torch.no_grad():  # get_logprobs: column t = log p(token t | tokens before it), 0 at column 0
            got = tmb.logprobs(tree_model, temperature=0.7)
            width = tmb.data["input_ids"].shape[1]
            expected = torch.zeros_like(got)
            start = 0
            for r, n in enumerate(lengths):
                row_logp = torch.log_softmax(logits[0, start:start + n - 1] / 0.7, -1)
                expected[r, 1:n] = row_logp.gather(-1, flat[0, start + 1:start + n, None])[:, 0]
                start += n
            assert got.shape == (len(lengths), width) and got.dtype == torch.float32  # NeMo-RL's get_logprobs: fp32
            torch.testing.assert_close(got, expected.float(), rtol=1e-7, atol=1e-7)


def padded_rollouts(groups=3, g=4, prompt=10, response=6, seed=0):
    """verl's layout: prompts left-padded, responses right-padded, a uid per prompt."""
    rng = np.random.default_rng(seed)
    b = groups * g
    ids = np.zeros((b, prompt + response), dtype=np.int64)
    mask = np.zeros_like(ids)
    for k in range(groups):
        n = int(rng.integers(prompt // 2, prompt + 1))
        ids[k * g:(k + 1) * g, prompt - n:prompt] = rng.integers(1, VOCAB, n)
        mask[k * g:(k + 1) * g, prompt - n:prompt] = 1
    for r in range(b):
        n = int(rng.integers(1, response + 1))
        ids[r, prompt:prompt + n] = rng.integers(1, VOCAB, n)
        mask[r, prompt:prompt + n] = 1
    ids, mask = torch.from_numpy(ids), torch.from_numpy(mask)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
            "responses": ids[:, prompt:], "response_mask": mask[:, prompt:],
            "uid": np.repeat(np.array([f"u{k}" for k in range(groups)], dtype=object), g)}


def verl_padded_forward(model, mb, temperature):
    """verl's padded actor forward: logits[:, -R - 1:-1] / temperature, then verl's
    logprobs_from_logits / entropy_from_logits (transcribed when verl is not importable)."""
    try:
        from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits
    except ImportError:
        def logprobs_from_logits(logits, labels):
            return torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]

        def entropy_from_logits(logits):
            p = torch.softmax(logits, -1)
            return torch.logsumexp(logits, -1) - (p * logits).sum(-1)

    r = mb["responses"].shape[-1]
    logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                   position_ids=mb["position_ids"], use_cache=False).logits
    logits = logits[:, -r - 1:-1] / temperature
    return logprobs_from_logits(logits, mb["responses"]), entropy_from_logits(logits)


def check_verl(model, ref_model, micro_batches):
    for mb in micro_batches:
        got = seqpack_verl.tree_forward_micro_batch(model, mb, 0.8, calculate_entropy=True)
        lp, ent = verl_padded_forward(ref_model, getattr(mb, "batch", mb), 0.8)
        mask = getattr(mb, "batch", mb)["response_mask"].bool()
        assert got["log_probs"].shape == lp.shape and rel(got["log_probs"][mask], lp[mask]) < 1e-10
        assert rel(got["entropy"][mask], ent[mask]) < 1e-10
        assert (got["log_probs"][~mask] == 0).all()


def test_verl_tree_forward_equals_the_padded_path(fp64_norms):  # noqa: F811
    batch = padded_rollouts()
    model, ref = llama("sdpa"), llama("sdpa")
    micro_batches, _ = seqpack_verl.rearrange_micro_batches(batch, 64, shared_prefix=True)
    assert len(micro_batches) > 1
    with torch.no_grad():
        check_verl(model, ref, micro_batches)
    assert model.config._attn_implementation == "seqpack_tree"

    # gradients: a loss on log-probs and entropies, tree vs padded
    mb = micro_batches[0]
    out = seqpack_verl.tree_forward_micro_batch(model, mb, 0.8, calculate_entropy=True)
    (out["log_probs"].sum() + 0.1 * out["entropy"].sum()).backward()
    lp, ent = verl_padded_forward(ref, mb, 0.8)
    mask = mb["response_mask"].bool()
    (lp[mask].sum() + 0.1 * ent[mask].sum()).backward()
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert rel(p.grad, grads[name].grad) < 1e-10, name


def test_verl_tree_forward_on_the_released_verls_micro_batches(fp64_norms):  # noqa: F811
    balancing = pytest.importorskip("verl.utils.seqlen_balancing", exc_type=ImportError)
    tensordict = pytest.importorskip("tensordict")
    from verl.protocol import DataProto

    batch = padded_rollouts(seed=1)
    tensors = {k: v for k, v in batch.items() if k != "uid"}
    proto = DataProto(batch=tensordict.TensorDict(tensors, batch_size=[tensors["input_ids"].shape[0]]))
    micro_batches, _ = balancing.prepare_dynamic_batch(proto, max_token_len=64)
    with torch.no_grad():
        check_verl(llama("sdpa"), llama("sdpa"), micro_batches)


def test_verl_tree_forward_errors_are_named():
    batch = padded_rollouts()
    model = llama("sdpa")
    with pytest.raises(KeyError, match="responses"):
        seqpack_verl.tree_forward_micro_batch(model, {k: v for k, v in batch.items() if k != "responses"})
    with pytest.raises(ValueError, match="one number"):
        seqpack_verl.tree_forward_micro_batch(model, batch, torch.ones(3))
    empty = dict(batch, attention_mask=batch["attention_mask"].clone())
    empty["attention_mask"][0, :10] = 0  # a response with no prompt before it
    with pytest.raises(ValueError, match="no prompt token"):
        seqpack_verl.tree_forward_micro_batch(model, empty)
    with pytest.raises(ValueError, match="multi_modal_inputs"):
        seqpack_verl.tree_forward_micro_batch(model, dict(batch, multi_modal_inputs=np.zeros(12)))
    with pytest.raises(ValueError, match="M-RoPE"):
        seqpack_verl.tree_forward_micro_batch(model, dict(batch, position_ids=batch["position_ids"][None].repeat(3, 1, 1)))
    with pytest.raises(TypeError, match="TreeMicroBatch"):
        seqpack.frameworks.policy_forward.nemo_rl_tree_forward(model, batch)
