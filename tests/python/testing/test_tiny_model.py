"""End-to-end equivalence on one process: the tiny transformer trained on a padded
long-tail batch and on the same batch packed (THD, varlen attention, fused loss)
gives the same loss and parameter gradients, with and without CP alignment
padding; the CP layout simulated rank by rank is covered by test_distributed."""

import numpy as np
import pytest
import torch

import seqpack
from seqpack.testing.tiny_model import TinyCausalLM, TinyConfig, packed_loss, padded_loss

CFG = TinyConfig(vocab_size=211, hidden_size=48, num_layers=2, num_heads=4, num_kv_heads=2)


def long_tail_batch(seed=0, batch=9, width=40):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([1, 2, 40, 5, 17, 3, 29, 8, 2][:batch])
    ids = torch.randint(0, CFG.vocab_size, (batch, width), generator=g)
    mask = (torch.arange(width)[None] < lengths[:, None]).long()
    return ids * mask, mask, lengths


def rel_close(a, b, rtol):
    scale = b.abs().max().clamp(min=1e-30)
    assert float((a - b).abs().max() / scale) <= rtol, float((a - b).abs().max() / scale)


@pytest.mark.parametrize("pad_multiple", [1, 4, 8])
def test_packed_training_step_equals_padded(pad_multiple):
    ids, mask, lengths = long_tail_batch()
    torch.manual_seed(0)
    model = TinyCausalLM(CFG)
    tokens = float((lengths - 1).clamp(min=0).sum())
    ref = padded_loss(model, ids, mask, tokens)
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    batch = seqpack.pack_sequences({"input_ids": ids}, seq_lens=lengths, pad_multiple=pad_multiple)
    loss = packed_loss(model, batch, tokens)
    loss.backward()
    rel_close(loss.detach(), ref.detach(), 1e-5)
    for n, p in model.named_parameters():
        rel_close(p.grad, ref_grads[n], 1e-5)


def test_packed_logits_equal_padded_rows():
    ids, mask, lengths = long_tail_batch(seed=1)
    torch.manual_seed(1)
    model = TinyCausalLM(CFG).double()
    with torch.no_grad():
        padded = model.forward_padded(ids, mask)
        batch = seqpack.pack_sequences({"input_ids": ids}, seq_lens=lengths, pad_multiple=4)
        packed = model.forward_packed(batch)
    torch.testing.assert_close(batch.unpack(packed)[mask.bool()], padded[mask.bool()], rtol=1e-10, atol=1e-12)
    with torch.no_grad():
        fast = model.forward_padded(ids, mask, right_padded=True)
    torch.testing.assert_close(fast[mask.bool()], padded[mask.bool()], rtol=1e-10, atol=1e-12)


def test_config_errors():
    with pytest.raises(ValueError, match="multiple of num_heads"):
        TinyCausalLM(TinyConfig(hidden_size=30, num_heads=4))
    assert np.isclose(TinyConfig(hidden_size=64, num_heads=4).head_dim, 16)
