"""The vision tower's work in the planners' forest (issue 53, item 4): a VLM batch's
``vision_forest`` holds each image as a work item of its FLOPs in the language
model's pair units, shares an image's tokens exactly where the keyed tree does, and
plans that see it keep a large image's prompt away from the others."""

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import seqpack  # noqa: E402
from seqpack.frameworks import hf_vlm  # noqa: E402
from seqpack.frameworks.hf_vlm_forest import vision_forest, vision_work  # noqa: E402
from seqpack.testing.tiny_vlm import tiny_vlm, vlm_grpo_batch  # noqa: E402


def split(batch):
    return batch["input_ids"], batch["attention_mask"], {k: v for k, v in batch.items()
                                                         if k not in ("input_ids", "attention_mask")}


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_the_forest_is_the_keyed_trees_with_each_image_once(family):
    model = tiny_vlm(family)
    batch = vlm_grpo_batch([[(4, 4)], [(4, 6), (2, 2)], [(2, 4, 4)], []], 3, family=family)
    ids, mask, mm = split(batch)
    forest = vision_forest(model, ids, mask, **mm)
    keys = hf_vlm.image_keys(model, ids, mask, **mm)
    assert forest.num_physical_tokens == seqpack.PrefixTreeBatch.from_padded(ids, mask, keys=keys).num_tokens
    rows, ends, work = forest.work_items
    a, b, c, video = [1, 4, 4], [1, 4, 6], [1, 2, 2], [2, 4, 4]  # prompt 1 holds two images, prompt 2 a video
    assert rows.tolist() == [0, 1, 2, 3, 3, 4, 4, 5, 5, 6, 7, 8]
    assert work.tolist() == vision_work(model, [a, a, a, b, c, b, c, b, c, video, video, video]).tolist()
    # each prompt's rows hold its images once; two prompts' rows hold both
    one = vision_work(model, [a, b, c, video])
    assert forest.subset_work([[0, 1, 2], [3, 4, 5], [6, 7], [0, 3], [9, 10, 11]]).tolist() == [
        one[0], one[1] + one[2], one[3], one[0] + one[1] + one[2], 0]
    # the item ends where its row's placeholder tokens end
    first = (ids[0] == model.config.image_token_id).nonzero()[-1].item() + 1
    assert ends[0] == first


def test_vision_work_grows_with_patches_and_their_squares():
    from seqpack.frameworks.hf_vlm_forest import vision_flops

    model = tiny_vlm("qwen2_vl")
    w = vision_work(model, [[1, 2, 2], [1, 4, 4], [1, 8, 8], [1, 16, 16]])
    assert (np.diff(w) > 0).all() and w[3] / w[2] > 4  # attention within an image: more than linear
    assert w.dtype == np.int64
    # a video's patches attend within their temporal patch: t frames cost t times one, not t² times
    frame, video = vision_flops(model, [[1, 16, 16], [4, 16, 16]])
    assert video == pytest.approx(4 * frame)


def test_a_plan_keeps_a_large_images_prompt_apart():
    """Four prompts of one token count (text evens out the placeholder tokens), one with
    an image of 32 x 32 patches, three of 2 x 2: balanced on tokens alone, two prompts
    per micro-batch; with the vision work seen, the large image's prompt alone."""
    model = tiny_vlm("qwen2_vl")
    parts = [vlm_grpo_batch([[(32, 32)]], 2, text=4, completion=(3, 3), seed=1)] + [
        vlm_grpo_batch([[(2, 2)]], 2, text=4 + 255, completion=(3, 3), seed=2 + k) for k in range(3)]
    width = max(p["input_ids"].shape[1] for p in parts)
    batch = {key: torch.cat([torch.nn.functional.pad(p[key], (0, width - p[key].shape[1])) for p in parts])
             for key in ("input_ids", "attention_mask", "mm_token_type_ids")}
    batch["pixel_values"] = torch.cat([p["pixel_values"] for p in parts])
    batch["image_grid_thw"] = torch.cat([p["image_grid_thw"] for p in parts])
    ids, mask, mm = split(batch)
    assert len(set(mask.sum(1).tolist())) == 1  # every row one length
    groups = [0, 0, 1, 1, 2, 2, 3, 3]  # one GRPO group per prompt
    forest = vision_forest(model, ids, mask, group_ids=groups, **mm)
    plain = seqpack.PrefixForest.from_padded(hf_vlm.image_keys(model, ids, mask, **mm), mask, group_ids=groups)
    cap = forest.physical_tokens([2, 3, 4, 5, 6, 7])  # three small prompts fit one micro-batch
    by_tokens = seqpack.plan_micro_batches(forest.lengths, cap, forest=plain, attention_coeff=64, min_num=2)
    assert sorted(len(mb) for mb in by_tokens.micro_batches) == [4, 4]
    seen = seqpack.plan_micro_batches(forest.lengths, cap, forest=forest, attention_coeff=64, min_num=2)
    assert sorted(seen.micro_batches) == [[0, 1], [2, 3, 4, 5, 6, 7]]
    assert max(seen.workloads) < max(forest.subset_work(by_tokens.micro_batches) + by_tokens.workloads)
