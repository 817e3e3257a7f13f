"""Vision-language models on a prefix tree (issue 53, item 2): tiny Qwen2-VL,
Qwen2.5-VL and Qwen3-VL in fp64 on GRPO rows with images and videos, laid out as a
tree through ``hf.tree_kwargs(tree, model=, pixel_values=, ...)``, give the padded
rows' logits at every logical token and their gradient on every parameter, while
each distinct image is encoded once."""

import functools

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import seqpack  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402
from seqpack.frameworks import hf_vlm  # noqa: E402
from seqpack.integrations import hf  # noqa: E402
from seqpack.testing.tiny_vlm import FAMILIES, IMAGE, tiny_vlm, vlm_grpo_batch  # noqa: E402

PROMPTS = [[(4, 4)], [(4, 6), (2, 2)], [(2, 4, 4)], []]  # images, two images, a video, text only


@pytest.fixture
def fp64_norms(monkeypatch):
    """The families' RMSNorms in fp64 (transformers computes them in fp32 even in an
    fp64 model): exact in the forward either way, but their backward sums a shared
    token's gradient in fp32 once on the tree and per row on the padded batch, a 1e-7
    difference; in fp64 throughout they agree to ~1e-15."""
    import importlib

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)

    for family in FAMILIES:
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        for name in dir(module):
            if name.endswith("RMSNorm"):
                monkeypatch.setattr(getattr(module, name), "forward", forward)


@functools.lru_cache(maxsize=None)
def model_of(family):
    model = tiny_vlm(family, dtype=torch.float64, attn_implementation=hf.register_tree())
    for p in model.parameters():  # larger than the default init: every input moves the logits visibly
        torch.nn.init.normal_(p, std=0.2)
    return model


def multimodal(batch):
    return {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask")}


def tree_of(model, batch, **options):
    keys = hf_vlm.image_keys(model, batch["input_ids"], batch["attention_mask"], **multimodal(batch))
    return seqpack.PrefixTreeBatch.from_padded(batch["input_ids"], batch["attention_mask"], keys=keys, **options)


def tree_call(model, batch, tree):
    return hf.tree_kwargs(tree, model=model, attention_mask=batch["attention_mask"], **multimodal(batch))


def logits_and_grads(model, kwargs, select, weight):
    model.zero_grad(set_to_none=True)
    logits = select(model(**kwargs).logits)
    (logits * weight).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("pad", [1, 8])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_gradients_equal_the_padded_rows(family, pad, fp64_norms):
    model = model_of(family)
    batch = vlm_grpo_batch(PROMPTS, 3, family=family, dtype=torch.float64)
    mask = batch["attention_mask"].bool()
    weight = torch.randn(int(mask.sum()), model.config.text_config.vocab_size, dtype=torch.float64,
                         generator=torch.Generator().manual_seed(1))
    rows, rows_grads = logits_and_grads(model, batch, lambda x: x[mask], weight)
    tree = tree_of(model, batch, pad_to_multiple_of=pad)
    kwargs = tree_call(model, batch, tree)
    index = torch.from_numpy(tree.logical_index.copy())
    got, grads = logits_and_grads(model, kwargs, lambda x: x[0, index], weight)
    torch.testing.assert_close(got, rows, rtol=0, atol=1e-10)
    assert grads.keys() == rows_grads.keys() and any("visual" in n for n in grads)
    # the vision towers apply their rotary embedding in fp32 (q.float()), where the
    # tree sums an image's gradient over its rows before that cast and the rows after
    for name, grad in rows_grads.items():
        err = float((grads[name] - grad).abs().max() / grad.abs().max())
        assert err <= (1e-7 if "visual" in name else 1e-12), (name, err)
    # each prompt's image and video encoded once (the rows: three times)
    assert kwargs["pixel_values"].shape[0] == batch["pixel_values"].shape[0] // 3
    assert kwargs["pixel_values_videos"].shape[0] == batch["pixel_values_videos"].shape[0] // 3
    assert kwargs["position_ids"].shape == (3, 1, tree.num_tokens)
    assert tree.num_tokens < mask.sum()


def test_the_positions_are_each_rows_m_rope():
    """The M-RoPE positions of a physical token are the ones the model gives it in
    every row that holds it; shifting them changes the logits (the test can fail)."""
    model = model_of("qwen2_vl")
    batch = vlm_grpo_batch(PROMPTS, 2, dtype=torch.float64)
    rows_pos, _ = model.model.get_rope_index(batch["input_ids"], mm_token_type_ids=batch["mm_token_type_ids"],
                                             image_grid_thw=batch["image_grid_thw"],
                                             video_grid_thw=batch["video_grid_thw"],
                                             attention_mask=batch["attention_mask"])
    tree = tree_of(model, batch)
    pos = tree_call(model, batch, tree)["position_ids"][:, 0]
    mask = batch["attention_mask"].bool()
    assert torch.equal(pos[:, torch.from_numpy(tree.logical_index.copy())], rows_pos[:, mask])
    assert not torch.equal(pos[0], torch.from_numpy(tree.position_ids.copy()))  # not the tree's depths


def test_different_images_behind_one_text_stay_apart():
    """Two prompts of one text whose images differ: built from the ids alone the tree
    would share the image tokens (refused by name); ``image_keys`` keeps them apart,
    and a repeated image shares its tokens across prompts."""
    model = model_of("qwen2_vl")
    batch = vlm_grpo_batch([[(4, 4)], [(4, 4)]], 2, dtype=torch.float64, text=0, completion=(2, 2), seed=3)
    batch["input_ids"][:, 1:7] = batch["input_ids"][0, 1:7]  # one text before and after the image
    plain = seqpack.PrefixTreeBatch.from_padded(batch["input_ids"], batch["attention_mask"])
    with pytest.raises(ValueError, match="rows 0 and 2 share the placeholder tokens.*image_keys"):
        tree_call(model, batch, plain)
    tree = tree_of(model, batch)
    assert tree.num_tokens == 2 + 2 * 5 + 4 * 2  # "1 VS" shared, each image and its VE once, the completions
    ref = model(**batch).logits[batch["attention_mask"].bool()]
    got = model(**tree_call(model, batch, tree)).logits[0, torch.from_numpy(tree.logical_index.copy())]
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-10)
    same = vlm_grpo_batch([[(4, 4)], [(4, 4)]], 2, dtype=torch.float64, text=0, completion=(2, 2), seed=3,
                          images={(4, 4): torch.randn(16, 24, dtype=torch.float64)})
    same["input_ids"][:, 1:7] = same["input_ids"][0, 1:7]
    shared = tree_of(model, same)
    assert shared.num_tokens == 7 + 4 * 2
    assert tree_call(model, same, shared)["pixel_values"].shape[0] == 16


def test_image_keys_are_one_per_distinct_content():
    model = model_of("qwen2_vl")
    pixels = torch.randn(16, 24, dtype=torch.float64)
    batch = vlm_grpo_batch([[(4, 4)], [(4, 4)], [(4, 4)]], 2, dtype=torch.float64, seed=5)
    batch["pixel_values"][:64] = pixels.repeat(4, 1)  # prompts 0 and 1 (rows 0-3) hold one image
    keys = hf_vlm.image_keys(model, batch["input_ids"], batch["attention_mask"], **multimodal(batch))
    image = batch["input_ids"] == IMAGE
    per_row = [set(keys[b][image[b]].tolist()) for b in range(6)]
    assert all(len(k) == 1 and min(k) < 0 for k in per_row)
    assert per_row[0] == per_row[1] == per_row[2] == per_row[3] != per_row[4] == per_row[5]
    assert torch.equal(keys[~image], batch["input_ids"][~image])


def test_bad_multimodal_inputs_are_refused_by_name():
    model = model_of("qwen2_vl")
    batch = vlm_grpo_batch([[(4, 4)]], 2, dtype=torch.float64)
    tree = tree_of(model, batch)
    mm = multimodal(batch)
    with pytest.raises(ValueError, match="need model="):
        hf.tree_kwargs(tree, **mm)
    text_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(ValueError, match="LlamaForCausalLM has no get_rope_index"):
        hf.tree_kwargs(tree, model=text_model, **mm)
    with pytest.raises(ValueError, match=r"\['pixel_attention_mask'\] are not taken on a tree"):
        hf.tree_kwargs(tree, model=model, pixel_attention_mask=torch.ones(2, 2), **mm)
    with pytest.raises(ValueError, match=r"the rows hold more images than image_grid_thw gives \(1\)"):
        hf.tree_kwargs(tree, model=model, **{**mm, "image_grid_thw": mm["image_grid_thw"][:1],
                                             "pixel_values": mm["pixel_values"][:16]})
    with pytest.raises(ValueError, match="image_grid_thw gives 3 images; the rows' placeholder tokens hold 2"):
        hf.tree_kwargs(tree, model=model, **{**mm, "image_grid_thw": mm["image_grid_thw"][[0, 1, 1]],
                                             "pixel_values": mm["pixel_values"][:48]})
    with pytest.raises(ValueError, match="longer than its grid_thw"):
        hf.tree_kwargs(tree, model=model, **{**mm, "image_grid_thw": torch.tensor([[1, 2, 2], [1, 2, 2]]),
                                             "pixel_values": mm["pixel_values"][:8]})
    with pytest.raises(ValueError, match="pixel_values must be \\[patches, dim\\]"):
        hf.tree_kwargs(tree, model=model, **{**mm, "pixel_values": mm["pixel_values"][:20]})
    with pytest.raises(ValueError, match="pixel_values and image_grid_thw go together"):
        hf.tree_kwargs(tree, model=model, pixel_values=mm["pixel_values"])
    wrong = mm["mm_token_type_ids"].clone()
    wrong[0, 0] = 1
    with pytest.raises(ValueError, match="mm_token_type_ids disagrees with the model's placeholder ids"):
        hf.tree_kwargs(tree, model=model, **{**mm, "mm_token_type_ids": wrong})
    with pytest.raises(ValueError, match="keys must have the rows' lengths"):
        seqpack.pack_prefix_tree([[1, 2], [1, 3]], keys=[[1, 2], [1]])
    with pytest.raises(ValueError, match="tokens with equal keys must have equal ids"):
        seqpack.pack_prefix_tree([[1, 2], [1, 3]], keys=[[1, 2], [1, 2]])


def test_left_padded_rows_and_types_given_with_their_mask():
    """A left-padded batch (TRL's prompts): ``mm_token_type_ids`` is read where the
    mask is; the tree call is the same as for the right-padded rows."""
    model = model_of("qwen2_vl")
    batch = vlm_grpo_batch(PROMPTS[:2], 2, dtype=torch.float64)
    lengths = batch["attention_mask"].sum(1)
    left = {k: v.clone() for k, v in batch.items()}
    for key in ("input_ids", "attention_mask", "mm_token_type_ids"):
        for b, n in enumerate(lengths.tolist()):
            left[key][b] = torch.roll(batch[key][b], batch[key].shape[1] - n)
    right_tree, left_tree = tree_of(model, batch), tree_of(model, left)
    assert right_tree == left_tree
    a, b = tree_call(model, batch, right_tree), tree_call(model, left, left_tree)
    assert all(torch.equal(a[k], b[k]) for k in a if k != "prefix_tree")


@settings(max_examples=12, deadline=None)
@given(st.lists(st.tuples(st.lists(st.tuples(st.sampled_from([2, 4]), st.sampled_from([2, 4, 6])), max_size=2),
                          st.integers(1, 4)), min_size=1, max_size=3),
       st.integers(0, 2**16), st.sampled_from([1, 4]))
def test_grpo_forests_with_images_of_different_sizes(prompts, seed, pad):
    """Any GRPO forest of prompts with 0-2 images of different sizes and groups of 1-4:
    logits at every logical token equal the padded rows'; each distinct image's
    patches are encoded once."""
    model = model_of("qwen2_vl")
    items = [p for p, _ in prompts]
    rows = []
    for g, (p, size) in enumerate(prompts):
        rows.append(vlm_grpo_batch([p], size, dtype=torch.float64, seed=seed + g, completion=(1, 3)))
    width = max(r["input_ids"].shape[1] for r in rows)
    batch = {}
    for key in ("input_ids", "attention_mask", "mm_token_type_ids"):
        batch[key] = torch.cat([torch.nn.functional.pad(r[key], (0, width - r[key].shape[1])) for r in rows])
    if any(items):
        batch["pixel_values"] = torch.cat([r["pixel_values"] for r in rows if "pixel_values" in r])
        batch["image_grid_thw"] = torch.cat([r["image_grid_thw"] for r in rows if "image_grid_thw" in r])
    mask = batch["attention_mask"].bool()
    tree = tree_of(model, batch, pad_to_multiple_of=pad)
    kwargs = tree_call(model, batch, tree)
    with torch.no_grad():
        ref = model(**batch).logits[mask]
        got = model(**kwargs).logits[0, torch.from_numpy(tree.logical_index.copy())]
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-10)
    patches = sum(h * w for p in items for h, w in p)
    assert kwargs.get("pixel_values", torch.zeros(0)).shape[0] == patches
    assert np.array_equal(tree.row_weights()[:tree.num_tokens - tree.num_pad_tokens] > 0,
                          np.ones(tree.num_tokens - tree.num_pad_tokens, dtype=bool))


def test_passes_refuse_images_by_name():
    """A pass of a tree split under a cap may hold part of a prompt's placeholder
    tokens and read the rest's K/V: it has no whole image to encode."""
    model = model_of("qwen2_vl")
    batch = vlm_grpo_batch([[(4, 4)]], 3, dtype=torch.float64)
    passes = seqpack.split_prefix_tree(tree_of(model, batch), 12)
    with pytest.raises(ValueError, match="pixel_values, image_grid_thw: a pass of a tree split under a cap carries "
                                         "no images"):
        for mb in seqpack.prefix_reuse(passes, forward=hf.pass_forward):
            mb.forward(model, pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"])


def test_images_whose_fingerprints_collide_stay_apart():
    """Two images whose rows hold the same values in another order have one integer
    fingerprint (row sums): the comparison keeps them apart; a repeat of the second
    joins it."""
    model = model_of("qwen2_vl")
    batch = vlm_grpo_batch([[(4, 4)], [(4, 4)], [(4, 4)]], 1, dtype=torch.float64, seed=4)
    a = batch["pixel_values"][:16].clone()
    batch["pixel_values"][16:32] = a.flip(1)  # each row's values reversed: the same row sums
    batch["pixel_values"][32:48] = a.flip(1)
    keys = hf_vlm.image_keys(model, batch["input_ids"], batch["attention_mask"], **multimodal(batch))
    image = batch["input_ids"] == IMAGE
    first, second, third = (set(keys[b][image[b]].tolist()) for b in range(3))
    assert first != second == third


def test_images_reach_the_model_in_tree_order_not_row_order():
    """Row 2 continues row 0's prompt with a second image C after row 1's prompt (image
    B): the rows hold A, B, A, C; the tree lays out A, then C under it, then B - the
    order the model fills the placeholders - and the logits are the rows'."""
    from seqpack.testing.tiny_vlm import PATCH_DIM, VISION_END as VE, VISION_START as VS

    model = model_of("qwen2_vl")
    prompt = [1, VS] + [IMAGE] * 4 + [VE, 30, 31]
    rows = [prompt + [40, 41], [2, VS] + [IMAGE] * 6 + [VE, 32, 42], prompt + [43, VS, IMAGE, VE, 44]]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = (ids != 0).long()
    g = torch.Generator().manual_seed(5)
    a, b, c = (torch.randn(n, PATCH_DIM, generator=g, dtype=torch.float64) for n in (16, 24, 4))
    batch = {"input_ids": ids, "attention_mask": mask, "mm_token_type_ids": (ids == IMAGE).long(),
             "pixel_values": torch.cat([a, b, a, c]),
             "image_grid_thw": torch.tensor([[1, 4, 4], [1, 4, 6], [1, 4, 4], [1, 2, 2]])}
    tree = tree_of(model, batch)
    kwargs = tree_call(model, batch, tree)
    assert kwargs["image_grid_thw"].tolist() == [[1, 4, 4], [1, 2, 2], [1, 4, 6]]
    assert torch.equal(kwargs["pixel_values"], torch.cat([a, c, b]))
    with torch.no_grad():
        ref = model(**batch).logits[mask.bool()]
        got = model(**kwargs).logits[0, torch.from_numpy(tree.logical_index.copy())]
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-10)
