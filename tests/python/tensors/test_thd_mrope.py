"""M-RoPE position ids (``[3, B, S]``, any ``[..., B, S]``) through seqpack: the THD
pack and unpack (with and without CP, planned and static), the HF collator and
attention path, and a tiny randomly initialised Qwen2-VL / Qwen2.5-VL that gives
the same logits on the packed row as on the padded batch."""

from __future__ import annotations

import doctest
import itertools

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import seqpack
from seqpack import alignment, pack_sequences

from conftest import round_up


# ---------------------------------------------------------------- THD pack / unpack


@st.composite
def position_batches(draw):
    batch = draw(st.integers(0, 4))
    width = draw(st.integers(1, 10))
    kind = draw(st.sampled_from(["right", "left", "random"]))
    mask = torch.zeros(batch, width, dtype=torch.bool)
    for b in range(batch):
        n = draw(st.integers(0, width))
        if kind == "right":
            mask[b, :n] = True
        elif kind == "left":
            mask[b, width - n:] = True
        else:
            mask[b, draw(st.lists(st.integers(0, width - 1), max_size=width, unique=True))] = True
    lead = draw(st.sampled_from([(3,), (2, 4)]))
    cp = draw(st.sampled_from([1, 2]))
    multiple = alignment(cp_size=cp) * draw(st.sampled_from([1, 3]))
    with_ids = draw(st.booleans())
    return mask, lead, cp, multiple, with_ids


@given(case=position_batches(), seed=st.integers(0, 2**16))
def test_position_tensors_round_trip_per_sequence(case, seed):
    mask, lead, cp, multiple, with_ids = case
    batch, width = mask.shape
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, 1000, (*lead, batch, width), generator=g)
    tensors = {"position_ids": pos}
    if with_ids:  # B, S from a [B, S] tensor, else from the position tensor's last two dims
        tensors = {"input_ids": torch.randint(0, 50, (batch, width), generator=g), **tensors}
    restored = torch.full_like(pos, -7)
    owned = torch.zeros_like(mask)
    for rank in range(cp):
        packed = pack_sequences(tensors, attention_mask=mask, pad_multiple=multiple, cp_size=cp, cp_rank=rank,
                                pad_values={"position_ids": -1})
        rows = packed.num_tokens
        got = packed["position_ids"]
        assert got.shape == (*lead, rows) and got.dtype == pos.dtype
        # Every leading index is packed, zigzag-split and padded as a [B, S] tensor.
        for idx in itertools.product(*map(range, lead)):
            alone = pack_sequences({"p": pos[idx]}, attention_mask=mask, pad_multiple=multiple, cp_size=cp,
                                   cp_rank=rank, pad_value=-1)
            assert torch.equal(got[idx], alone["p"])
        if with_ids:
            assert torch.equal(packed["input_ids"], pack_sequences(tensors["input_ids"], attention_mask=mask,
                                                                   pad_multiple=multiple, cp_size=cp,
                                                                   cp_rank=rank)["input"])
        # This rank's tokens come back in place, the rest is the fill.
        mine = packed.unpack(torch.ones(rows, dtype=torch.bool), fill=False) & mask
        back = packed.unpack(got, fill=-7, dim=-1)
        assert back.shape == pos.shape
        if rows != lead[0]:  # else [lead, T] reads as T rows by default (test_views_and_copies)
            assert torch.equal(back, packed.unpack(got, fill=-7))
        assert torch.equal(back[..., mine], pos[..., mine])
        assert bool((back[..., ~mine] == -7).all())
        assert not (owned & mine).any()
        owned |= mine
        restored = torch.where(mine, back, restored)
    assert torch.equal(owned, mask)  # the ranks' tokens: every real token exactly once
    assert torch.equal(restored[..., mask], pos[..., mask])


@given(lengths=st.lists(st.integers(0, 7), min_size=1, max_size=4), cp=st.sampled_from([1, 2]),
       spare=st.integers(0, 5), data=st.data())
def test_static_pack_of_position_tensors_equals_the_planned_pack(lengths, cp, spare, data):
    width, multiple = 7, alignment(cp_size=cp)
    rank = data.draw(st.integers(0, cp - 1))
    pos = torch.randint(0, 100, (3, len(lengths), width))
    capacity = round_up(max(sum(round_up(n, multiple) for n in lengths) + spare, 1), multiple)
    static = seqpack.pack_sequences_static({"position_ids": pos}, torch.tensor(lengths), max_tokens=capacity,
                                           pad_multiple=multiple, pad_value=-1, cp_size=cp, cp_rank=rank)
    planned = pack_sequences({"position_ids": pos}, seq_lens=lengths, pad_multiple=multiple, pad_packed_to=capacity,
                             pad_value=-1, cp_size=cp, cp_rank=rank)
    assert static["position_ids"].shape == (3, capacity // cp)
    assert torch.equal(static["position_ids"], planned["position_ids"])
    assert torch.equal(static.unpack(static["position_ids"]), planned.unpack(planned["position_ids"]))


def test_literal_example_with_context_parallelism():
    # Two sequences (3 and 5 tokens), pad multiple 4, CP 2: rank r holds chunks r and
    # 3 - r of each padded sequence, the same rows for t, h and w.
    t = torch.tensor([[0, 1, 2, 0, 0], [0, 1, 1, 1, 3]])
    pos = torch.stack([t, t + 10, t + 20])                                     # [3, B=2, S=5]
    ranks = [pack_sequences({"position_ids": pos}, seq_lens=[3, 5], pad_multiple=4, cp_size=2, cp_rank=r,
                            pad_value=-1) for r in range(2)]
    assert ranks[0]["position_ids"].tolist() == [[0, -1, 0, 1, -1, -1], [10, -1, 10, 11, -1, -1],
                                                 [20, -1, 20, 21, -1, -1]]
    assert ranks[1]["position_ids"].tolist() == [[1, 2, 1, 1, 3, -1], [11, 12, 11, 11, 13, -1],
                                                 [21, 22, 21, 21, 23, -1]]
    # The text positions of the same rows (the plan's), e.g. for a [4, T] layout.
    assert ranks[0].position_ids.tolist() == [0, 3, 0, 1, 6, 7]


def test_views_and_copies():
    # [3, B, S] costs one copy (to [B, S, 3] rows); the result is a [..., T] view of
    # a contiguous [T, 3], which unpacks without another copy.
    pos = torch.arange(24).view(3, 2, 4)
    packed = pack_sequences({"position_ids": pos}, seq_lens=[4, 2])
    got = packed["position_ids"]
    assert got.stride() == (1, 3) and got.movedim(0, -1).is_contiguous()
    # A tensor that is a moved [B, S, 3] one is not copied on the way in either.
    rows_last = pos.permute(1, 2, 0).contiguous()
    assert torch.equal(pack_sequences({"position_ids": rows_last.permute(2, 0, 1)}, seq_lens=[4, 2])["position_ids"],
                       got)
    # Ambiguous [3, T] with T = 3: rows first by default, dim=-1 for the leading layout.
    small = pack_sequences({"position_ids": pos[:, :1, :3]}, seq_lens=[3])
    assert small["position_ids"].shape == (3, 3)
    assert small.unpack(small["position_ids"]).shape == (1, 3, 3)
    assert small.unpack(small["position_ids"], dim=-1).shape == (3, 1, 3)
    assert torch.equal(small.unpack(small["position_ids"], dim=-1), pos[:, :1, :3])


def test_position_keys_and_a_2d_position_tensor():
    pos = torch.arange(12).view(3, 1, 4)
    # Not a position name: an ordinary [B=3, S=1, 4] tensor, as before.
    assert pack_sequences({"mrope": pos}, seq_lens=[1, 1, 0])["mrope"].shape == (2, 4)
    assert pack_sequences({"mrope": pos}, seq_lens=[4], position_keys=("mrope",))["mrope"].shape == (3, 4)
    assert pack_sequences({"mrope": pos}, seq_lens=[4], position_keys="mrope")["mrope"].shape == (3, 4)
    assert pack_sequences({"position_ids": pos}, seq_lens=[1, 0, 1], position_keys=())["position_ids"].shape == (2, 4)
    # pack_to_layout reads them the same way.
    layout = seqpack.PackedLayout.from_lengths([4, 1, 0], pad_multiple=2)
    pos3 = torch.arange(36).view(3, 3, 4)
    assert torch.equal(seqpack.pack_to_layout({"position_ids": pos3}, layout)["position_ids"],
                       pack_sequences({"position_ids": pos3}, seq_lens=[4, 1, 0], pad_multiple=2)["position_ids"])
    # 2-D position ids are [B, S] as any tensor.
    flat = pack_sequences({"position_ids": pos[0], "x": pos[0]}, seq_lens=[3], pad_multiple=2)
    assert flat["position_ids"].tolist() == [0, 1, 2, 0]
    with pytest.raises(TypeError, match="position_keys"):
        pack_sequences({"position_ids": pos}, seq_lens=[4], position_keys=3)
    with pytest.raises(TypeError, match="position_keys"):
        pack_sequences({"position_ids": pos}, seq_lens=[4], position_keys=[1])


def test_errors():
    ids = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"must be \[\.\.\., B, S\] = \[\.\.\., 2, 4\].*transpose"):
        pack_sequences({"input_ids": ids, "position_ids": torch.zeros(2, 3, 4, dtype=torch.long)}, seq_lens=[1, 1])
    with pytest.raises(ValueError, match=r"\[\.\.\., B, S\]"):
        seqpack.pack_sequences_static({"input_ids": ids, "position_ids": torch.zeros(3, 4, 2)}, [1, 1], max_tokens=4)
    packed = pack_sequences({"input_ids": ids, "position_ids": torch.zeros(3, 2, 4, dtype=torch.long)},
                            seq_lens=[1, 2])
    with pytest.raises(ValueError, match="3 rows .* or 3 entries in its last dimension"):
        packed.unpack(torch.zeros(2, 4))
    with pytest.raises(ValueError, match="dim must be None, 0"):
        packed.unpack(torch.zeros(3, 3), dim=2)
    with pytest.raises(TypeError, match="dim must be an int, got bool"):
        packed.unpack(torch.zeros(3), dim=True)
    assert torch.equal(packed.unpack(torch.arange(3), dim=np.int64(0)), packed.unpack(torch.arange(3), dim=0))
    with pytest.raises(ValueError, match="in dimension -1"):
        packed.unpack(torch.zeros(3, 2), dim=-1)
    with pytest.raises(ValueError, match=r"mrope_position_ids must be .* \[3, T\]"):
        packed.hf_kwargs(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="cp_size > 1"):
        pack_sequences(ids, seq_lens=[1, 2], pad_multiple=4, cp_size=2).hf_kwargs()


def test_hf_kwargs_put_the_text_row_first():
    t = torch.tensor([[0, 1, 1, 3], [0, 1, 2, 0]])
    pos = torch.stack([t, t, t + 1])
    packed = pack_sequences({"position_ids": pos}, seq_lens=[4, 3], pad_multiple=2, pad_value=-1)
    kw = packed.hf_kwargs(packed["position_ids"])
    assert kw["position_ids"].shape == (4, 1, 8)
    assert kw["position_ids"][:, 0].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3], [0, 1, 1, 3, 0, 1, 2, -1],
                                                 [0, 1, 1, 3, 0, 1, 2, -1], [1, 2, 2, 4, 1, 2, 3, -1]]
    assert kw["cu_seq_lens_q"].tolist() == [0, 4, 8]
    four = packed.hf_kwargs(kw["position_ids"][:, 0])  # [4, T]: taken as is
    assert torch.equal(four["position_ids"], kw["position_ids"])


def test_gradients_and_torch_compile():
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]])
    x = torch.randn(2, 2, 5, dtype=torch.float64, requires_grad=True)  # a float [2, B, S] "position" tensor
    for cp, rank in [(1, 0), (2, 0), (2, 1)]:
        x.grad = None
        packed = pack_sequences({"position_ids": x}, attention_mask=mask, pad_multiple=alignment(cp_size=cp),
                                cp_size=cp, cp_rank=rank)
        w = torch.randn(packed.num_tokens, dtype=torch.float64)
        ((packed["position_ids"] * w).sum() + packed.unpack(packed["position_ids"] * 3).pow(2).sum()).backward()
        # The same loss on the [B, S] slices packed one by one.
        ref = x.detach().clone().requires_grad_()
        loss = 0
        for i in range(2):
            p = pack_sequences({"p": ref[i]}, attention_mask=mask, pad_multiple=alignment(cp_size=cp), cp_size=cp,
                               cp_rank=rank)["p"]
            loss = loss + (p * w).sum() + packed.unpack(p * 3).pow(2).sum()
        loss.backward()
        assert torch.allclose(x.grad, ref.grad)

    def f(pos):
        packed = pack_sequences({"position_ids": pos}, seq_lens=[3, 1], pad_multiple=2)
        return packed.unpack(torch.tanh(packed["position_ids"]))

    h = torch.randn(3, 2, 4)
    assert torch.allclose(torch.compile(f, backend="aot_eager")(h), f(h))
    static = torch.compile(lambda pos, n: seqpack.pack_sequences_static({"position_ids": pos}, n, max_tokens=8,
                                                                        pad_multiple=2)["position_ids"],
                           fullgraph=True, backend="aot_eager")
    expected = seqpack.pack_sequences_static({"position_ids": h}, [3, 1], max_tokens=8, pad_multiple=2)
    assert torch.equal(static(h, torch.tensor([3, 1])), expected["position_ids"])


# ---------------------------------------------------------------- HF collator and attention path


def test_collator_packs_mrope_examples():
    from seqpack.integrations import hf

    a = {"input_ids": [5, 6, 6, 7], "position_ids": [[0, 1, 1, 3], [0, 1, 2, 3], [0, 1, 2, 3]]}
    b = {"input_ids": [8, 9]}  # text-only: 0 .. n-1 in every row
    c = {"input_ids": [4, 4, 4], "position_ids": torch.tensor([[[0, 0, 0]], [[0, 0, 1]], [[0, 1, 0]]])}  # [3, 1, n]
    out = hf.PackingCollator(pad_to_multiple_of=4)([a, b, c])
    pos = out["position_ids"]
    assert pos.shape == (4, 1, 12) and pos.dtype == torch.int64
    assert pos[0, 0].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3]       # text row: the plan's positions
    # Padding continues from each sequence's largest id, in every row.
    assert pos[1:, 0].tolist() == [[0, 1, 1, 3, 0, 1, 2, 3, 0, 0, 0, 2],
                                   [0, 1, 2, 3, 0, 1, 2, 3, 0, 0, 1, 2],
                                   [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 0, 2]]
    assert out["cu_seq_lens_q"].tolist() == [0, 4, 8, 12]
    three = hf.PackingCollator(pad_to_multiple_of=4, mrope_text_row=False)([a, b, c])["position_ids"]
    assert torch.equal(three, pos[1:])
    # Without M-RoPE examples (1-D ids are the collator's own): the 2-D ids as before.
    plain = hf.PackingCollator()([{"input_ids": [1, 2], "position_ids": [5, 6]}, {"input_ids": [3]}])
    assert plain["position_ids"].tolist() == [[0, 1, 0]]
    assert "position_ids" not in hf.PackingCollator(return_position_ids=False)([a, b])
    # Vision inputs: the examples' concatenated, in order.
    px = [torch.randn(4, 6), torch.randn(8, 6)]
    vis = hf.PackingCollator()([{**a, "pixel_values": px[0], "image_grid_thw": [[1, 2, 2]]}, b,
                                {**c, "pixel_values": px[1], "image_grid_thw": torch.tensor([[1, 2, 4]])}])
    assert torch.equal(vis["pixel_values"], torch.cat(px))
    assert vis["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 4]]
    with pytest.raises(ValueError, match="different row counts"):
        hf.PackingCollator()([a, {"input_ids": [1, 2], "position_ids": [[0, 1]] * 4}])
    with pytest.raises(ValueError, match=r"M-RoPE ids \[k, n\]"):
        hf.PackingCollator()([{"input_ids": [1, 2], "position_ids": [[0, 1, 2]] * 3}])
    with pytest.raises(ValueError, match="one sequence"):
        hf.PackingCollator(mrope_text_row=False, return_flash_attn_kwargs=False)([a])


def test_sequence_starts_and_hf_doctests():
    from seqpack.frameworks import hf

    t = torch.tensor([0, 0, 0, 0, 2, 0, 1])
    h = torch.tensor([0, 0, 1, 1, 2, 0, 1])
    w = torch.tensor([0, 1, 0, 1, 2, 0, 1])
    assert hf.sequence_starts(torch.stack([t, h, w])[:, None]).tolist() == [0, 5]
    text = torch.tensor([0, 1, 2, 3, 4, 0, 1])
    assert hf.sequence_starts(torch.stack([text, t, h, w])[:, None]).tolist() == [0, 5]  # row 0, as transformers
    assert hf.sequence_starts(text[None]).tolist() == [0, 5]
    # The attention reads 3-D ids as it reads cu_seq_lens.
    q, k, v = torch.randn(1, 4, 7, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
    cu = torch.tensor([0, 5, 7], dtype=torch.int32)
    module = torch.nn.Module()
    ref, _ = hf.attention_forward(module, q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=5,
                                  max_length_k=5)
    for ids in (torch.stack([t, h, w])[:, None], torch.stack([text, t, h, w])[:, None]):
        out, _ = hf.attention_forward(module, q, k, v, None, position_ids=ids)
        torch.testing.assert_close(out, ref)
    split, _ = hf.attention_forward(module, q, k, v, None, position_ids=t[None])  # the temporal row: 4 starts
    assert not torch.allclose(split, ref)
    result = doctest.testmod(hf, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


# ---------------------------------------------------------------- a tiny Qwen2-VL / Qwen2.5-VL

IMAGE, VISION_START, VISION_END, VOCAB = 60, 62, 63, 64


def tiny_vlm(kind, attn):
    transformers = pytest.importorskip("transformers")
    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]})
    vision = dict(depth=1, num_heads=2, patch_size=2, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    if kind == "qwen2_vl":
        config, model = transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration
        vision.update(embed_dim=16, hidden_size=32, mlp_ratio=2)
    else:
        config, model = transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration
        vision.update(hidden_size=16, intermediate_size=32, out_hidden_size=32, window_size=8,
                      fullatt_block_indexes=[0])
    cfg = config(text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=61,
                 vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)
    torch.manual_seed(0)
    return model._from_config(cfg, attn_implementation=attn).float().eval()


def vlm_examples(with_images):
    """Examples of text and (2x4, 4x4, 4x2 patch) images; an image opens the third."""
    g = torch.Generator().manual_seed(3)
    specs = [(3, (1, 4, 4), 4), (6, None, 0), (0, (1, 2, 4), 3), (2, (1, 4, 2), 1)]
    examples = []
    for before, grid, after in specs:
        ids = torch.randint(3, IMAGE, (before,), generator=g).tolist()
        ex = {}
        if grid and with_images:
            t, h, w = grid
            ids += [VISION_START] + [IMAGE] * (t * h * w // 4) + [VISION_END]
            ex = {"pixel_values": torch.randn(t * h * w, 3 * 2 * 2 * 2, generator=g), "image_grid_thw": [list(grid)]}
        ids += torch.randint(3, IMAGE, (after + 2,), generator=g).tolist()
        examples.append({"input_ids": ids, **ex})
    return examples


def padded_reference(model, examples):
    width = max(len(e["input_ids"]) for e in examples)
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, e in enumerate(examples):
        ids[i, :len(e["input_ids"])] = torch.tensor(e["input_ids"])
        mask[i, :len(e["input_ids"])] = 1
    vision = {}
    if any("pixel_values" in e for e in examples):
        vision = dict(pixel_values=torch.cat([e["pixel_values"] for e in examples if "pixel_values" in e]),
                      image_grid_thw=torch.tensor([g for e in examples for g in e.get("image_grid_thw", [])]),
                      mm_token_type_ids=(ids == IMAGE).int())
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100), **vision)
    return out, mask


def with_mrope_ids(model, examples):
    """Each example's [3, 1, n] M-RoPE ids, as the model computes them (text: 0 .. n-1)."""
    out = []
    for e in examples:
        ids = torch.tensor(e["input_ids"])[None]
        if "pixel_values" in e:
            pos, _ = model.model.get_rope_index(ids, (ids == IMAGE).int(),
                                                image_grid_thw=torch.tensor(e["image_grid_thw"]))
        else:
            pos = torch.arange(ids.shape[1]).expand(3, 1, -1)
        out.append({**e, "position_ids": pos})
    return out


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
@pytest.mark.parametrize("with_images", [False, True])
def test_tiny_vlm_packed_equals_padded(kind, with_images):
    from seqpack.integrations import hf

    name = hf.register()
    examples = vlm_examples(with_images)
    ref_out, mask = padded_reference(tiny_vlm(kind, "sdpa"), examples)
    lengths = mask.sum(1).tolist()
    # seqpack attention on the packed row (text model; the vision tower keeps SDPA),
    # transformers' SDPA on it (its mask from the text row of the [4, 1, T] ids).
    cases = [({"text_config": name, "vision_config": "sdpa"}, {}), (name, {}), ("sdpa", {"use_cache": False})]
    for attn, extra in cases:
        model = tiny_vlm(kind, attn)
        for collator in (hf.PackingCollator(pad_to_multiple_of=4),
                         hf.PackingCollator(return_flash_attn_kwargs=False),  # sequences from the text row
                         hf.PackingCollator(mrope_text_row=False)):           # [3, 1, T] + cu_seq_lens
            if attn == "sdpa" and not collator.mrope_text_row:
                continue  # SDPA reads [3, 1, T] as one sequence: the pitfall, see docs/vlm.md
            batch = collator(with_mrope_ids(model, examples))
            assert batch["position_ids"].shape[0] == (4 if collator.mrope_text_row else 3)
            with torch.no_grad():
                out = model(**batch, **extra)
            starts = [0] + list(itertools.accumulate(round_up(n, collator.pad_to_multiple_of) for n in lengths))
            for i, n in enumerate(lengths):
                torch.testing.assert_close(out.logits[0, starts[i]:starts[i] + n], ref_out.logits[i, :n],
                                           atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(out.loss, ref_out.loss, atol=1e-5, rtol=1e-5)
    # The comparison sees a leak: [3, 1, T] ids without cu_seq_lens (what transformers
    # gets from a collator that knows no M-RoPE) make the row one sequence.
    model = tiny_vlm(kind, name)
    packed = hf.PackingCollator(mrope_text_row=False)(with_mrope_ids(model, examples))
    leak = {k: v for k, v in packed.items() if not k.startswith(("cu_seq", "max_length"))}
    with torch.no_grad():
        leaked = model(**leak).logits
    last = sum(lengths[:-1])
    assert not torch.allclose(leaked[0, last:last + lengths[-1]], ref_out.logits[-1, :lengths[-1]], atol=1e-3)
