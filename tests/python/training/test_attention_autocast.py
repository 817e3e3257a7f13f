"""seqpack attention under ``torch.autocast`` (issue 27): as SDPA, q, k and v are
cast to the autocast dtype (transformers hands an attention function float32 q/k
after the rotary embedding and a bfloat16 v), the result comes back in that dtype
and gradients reach every input in its own dtype; outside autocast mismatched
dtypes still raise, naming the rule. The zigzag CP and Ulysses implementations
(``seqpack.training.attention_cp.cp_attention``,
``seqpack.training.attention_ulysses.ulysses_attention``) follow autocast the same
way (one-process gloo group)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import seqpack
from seqpack import varlen_attention
from seqpack.training.attention_cp import cp_attention
from seqpack.training.attention_ulysses import ulysses_attention

CU = [0, 3, 4, 9]


def _qkv(seed=0, hq=4, hk=2, d=8, rows=9, v_dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, hq, d, generator=g).requires_grad_()
    k = torch.randn(rows, hk, d, generator=g).requires_grad_()
    v = torch.randn(rows, hk, d, generator=g).to(v_dtype).requires_grad_()
    return q, k, v


def _sdpa_per_sequence(q, k, v, cu, causal=True):
    """SDPA, sequence by sequence, as transformers' SDPA path computes them."""
    outs = []
    for b, e in zip(cu[:-1], cu[1:]):
        qq, kk, vv = (t[b:e].transpose(0, 1)[None] for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal, enable_gqa=True)[0].transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
def test_mixed_dtypes_under_autocast_compute_in_its_dtype_like_sdpa(dtype, causal):
    q, k, v = _qkv()
    with torch.autocast("cpu", dtype=dtype):
        out = varlen_attention(q, k, v, CU, CU, 5, 5, causal=causal)
        ref = _sdpa_per_sequence(q, k, v, CU, causal)
    assert out.dtype == ref.dtype == dtype
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    # Exactly the result on inputs cast beforehand: the cast is all autocast changes.
    cast = [t.detach().to(dtype) for t in (q, k, v)]
    torch.testing.assert_close(out, varlen_attention(*cast, CU, CU, 5, 5, causal=causal), rtol=0, atol=0)
    out.float().square().sum().backward()
    for name, t in zip("qkv", (q, k, v)):
        assert t.grad is not None and t.grad.dtype == t.dtype, name
        assert bool(t.grad.abs().sum() > 0), name


def test_outside_autocast_mismatched_dtypes_raise_naming_the_rule():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"must share dtype and device.*torch.float32 / torch.float32 / "
                                         r"torch.bfloat16"):
        varlen_attention(q, k, v, CU, CU, 5, 5)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        with pytest.raises(ValueError, match="must share dtype"):
            varlen_attention(q, k, v, CU, CU, 5, 5)
    # Explicit equal dtypes outside autocast keep their dtype.
    assert varlen_attention(q, k, v.detach().float(), CU, CU, 5, 5).dtype == torch.float32
    # Autocast of another device type changes nothing here.
    with torch.autocast("cuda", dtype=torch.float16, enabled=torch.cuda.is_available()):
        with pytest.raises(ValueError, match="must share dtype"):
            varlen_attention(q, k, v, CU, CU, 5, 5)


def test_float64_is_left_alone_as_autocast_leaves_it():
    q, k, v = _qkv(v_dtype=torch.float64)
    q64, k64 = q.detach().double(), k.detach().double()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = varlen_attention(q64, k64, v, CU, CU, 5, 5)
        assert out.dtype == torch.float64  # SDPA too: autocast never casts float64
        torch.testing.assert_close(out, _sdpa_per_sequence(q64, k64, v, CU), rtol=1e-12, atol=1e-12)
        with pytest.raises(ValueError, match="must share dtype"):  # float32 q cast, float64 k/v not: SDPA fails too
            varlen_attention(q, k64, v, CU, CU, 5, 5)
        # float32 q with float64 k / v: q is cast to bfloat16, and the error says so.
        with pytest.raises(ValueError, match="torch.bfloat16 / torch.float64 / torch.float64"):
            varlen_attention(q, k64, v, CU, CU, 5, 5)


@pytest.fixture
def one_rank_group(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_cp_and_ulysses_follow_autocast(one_rank_group):
    batch = seqpack.pack_sequences({"x": torch.zeros(3, 5)}, seq_lens=[3, 1, 5], pad_multiple=2)  # CP: 2 * cp
    cu = batch.cu_seqlens_padded.tolist()
    assert cu == [0, 4, 6, 12]
    q, k, v = _qkv(rows=12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = varlen_attention(q, k, v, cu, cu, 6, 6)
        for fn in (cp_attention, ulysses_attention):
            out = fn(q, k, v, batch, one_rank_group)
            assert out.dtype == torch.bfloat16, fn.__name__
            torch.testing.assert_close(out, want, rtol=1e-2, atol=1e-2)  # CP tiles differently: bf16 rounding
    for fn in (cp_attention, ulysses_attention):
        with pytest.raises(ValueError, match="must share dtype"):
            fn(q, k, v, batch, one_rank_group)


def test_tiny_llama_under_autocast_matches_sdpa():
    transformers = pytest.importorskip("transformers")
    from seqpack.integrations import hf

    name = hf.register()
    cfg = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64)
    feats = [{"input_ids": torch.randint(1, 97, (n,), generator=torch.Generator().manual_seed(n)).tolist()}
             for n in (7, 3, 12)]
    batch = hf.PackingCollator(return_flash_attn_kwargs=True)(feats)
    losses, grads = {}, {}
    for attn in ("sdpa", name):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg, attn_implementation=attn))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(**batch, use_cache=False)  # no cache: SDPA reads the packed position_ids
        assert out.logits.dtype == torch.bfloat16
        out.loss.backward()
        losses[attn] = out.loss.item()
        grads[attn] = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert abs(losses[name] - losses["sdpa"]) < 2e-2 * abs(losses["sdpa"])
    cos = F.cosine_similarity(grads[name], grads["sdpa"], dim=0)
    assert cos > 0.99
