"""HF transformers integration: a tiny randomly initialised Llama gives the same
loss, logits and gradients on a padded batch (transformers' SDPA) and on the
packed row (seqpack attention + PackingCollator)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from seqpack.integrations import hf  # noqa: E402


def tiny_llama(attn):
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   attn_implementation=attn)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).double()


def examples():
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(1, 97, (n,), generator=g).tolist()} for n in (7, 1, 12, 3)]


def padded_batch(feats):
    width = max(len(f["input_ids"]) for f in feats)
    ids = torch.zeros(len(feats), width, dtype=torch.long)
    mask = torch.zeros(len(feats), width, dtype=torch.long)
    for i, f in enumerate(feats):
        ids[i, :len(f["input_ids"])] = torch.tensor(f["input_ids"])
        mask[i, :len(f["input_ids"])] = 1
    return ids, mask


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("pad_to", [1, 4])
def test_packed_equals_padded(pad_to):
    name = hf.register()
    feats = examples()
    ids, mask = padded_batch(feats)
    ref = tiny_llama("sdpa")
    labels = ids.masked_fill(mask == 0, -100)
    out_ref = ref(input_ids=ids, attention_mask=mask, labels=labels)
    out_ref.loss.backward()

    model = tiny_llama(name)
    batch = hf.PackingCollator(pad_to_multiple_of=pad_to, return_flash_attn_kwargs=True)(feats)
    out = model(**batch)
    out.loss.backward()
    torch.testing.assert_close(out.loss, out_ref.loss, rtol=1e-6, atol=0)  # transformers takes the loss in fp32
    cu = batch["cu_seq_lens_q"].tolist()
    for i, f in enumerate(feats):
        n = len(f["input_ids"])
        torch.testing.assert_close(out.logits[0, cu[i]:cu[i] + n], out_ref.logits[i, :n], rtol=1e-9, atol=1e-10)
    g_ref, g = grads(ref), grads(model)
    for n in g_ref:
        torch.testing.assert_close(g[n], g_ref[n], rtol=1e-8, atol=1e-11)


def test_padding_mask_reaches_seqpack_attention():
    # The registered mask function keeps the 2-D padding mask: seqpack attention on
    # the padded batch equals SDPA on it (without the mask function transformers
    # would drop the mask and the padded rows would leak into the real ones).
    name = hf.register()
    ids, mask = padded_batch(examples())
    ref = tiny_llama("sdpa")(input_ids=ids, attention_mask=mask).logits
    ours = tiny_llama(name)(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(ours[real], ref[real], rtol=1e-9, atol=1e-10)


def test_packed_position_ids_without_cu_seqlens():
    name = hf.register()
    feats = examples()
    batch = hf.PackingCollator(return_flash_attn_kwargs=False)(feats)
    full = hf.PackingCollator(return_flash_attn_kwargs=True)(feats)
    assert "cu_seq_lens_q" not in batch and "cu_seq_lens_q" in full
    model = tiny_llama(name)
    torch.testing.assert_close(model(**batch).logits, model(**full).logits)


def test_collator_contract_and_errors():
    out = hf.PackingCollator(pad_to_multiple_of=4, pad_token_id=9)([{"input_ids": [1, 2, 3], "labels": [7, 8, 9]},
                                                                     {"input_ids": [4], "labels": [3]}])
    assert out["input_ids"].tolist() == [[1, 2, 3, 9, 4, 9, 9, 9]]
    assert out["labels"].tolist() == [[-100, 8, 9, -100, -100, -100, -100, -100]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    assert out["cu_seq_lens_q"].dtype == torch.int32 and out["cu_seq_lens_k"].tolist() == [0, 4, 8]
    assert out["max_length_q"] == out["max_length_k"] == 4
    with pytest.raises(ValueError, match="no 'input_ids'"):
        hf.PackingCollator()([{"labels": [1]}])
    with pytest.raises(ValueError, match="differ in length"):
        hf.PackingCollator()([{"input_ids": [1, 2], "labels": [1]}])
    with pytest.raises(ValueError, match="all have labels or none"):  # transformers: KeyError / labels ignored
        hf.PackingCollator()([{"input_ids": [1, 2], "labels": [1, 2]}, {"input_ids": [4]}])
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        hf.PackingCollator(pad_to_multiple_of=0)([{"input_ids": [1]}])


def test_attention_forward_refuses_what_it_cannot_do():
    model = tiny_llama(hf.register())
    attn = model.model.layers[0].self_attn
    q = torch.zeros(1, 4, 3, 8, dtype=torch.float64)
    kv = torch.zeros(1, 2, 3, 8, dtype=torch.float64)
    model.train()
    with pytest.raises(ValueError, match="attention dropout"):
        hf.attention_forward(attn, q, kv, kv, None, dropout=0.1)
    with pytest.raises(ValueError, match="softcapping"):
        hf.attention_forward(attn, q, kv, kv, None, softcap=30.0)
    with pytest.raises(ValueError, match="4-D masks"):
        hf.attention_forward(attn, q, kv, kv, torch.ones(1, 1, 3, 3, dtype=torch.bool))
    out, weights = hf.attention_forward(attn, q, kv, kv, None)
    assert out.shape == (1, 3, 4, 8) and weights is None
