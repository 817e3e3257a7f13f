"""TRL's GRPO and RLOO with a vision-language model on prefix trees (issue 53):
``patch(shared_prefix=True)`` runs a Qwen2-VL batch (``pixel_values``,
``image_grid_thw``, ``num_images``, ``mm_token_type_ids``, TRL's left-padded
prompts) on trees, each prompt's image encoded once, and gives TRL's log-probs,
entropies and gradients; a whole GRPOTrainer step with an image dataset and a
processor built offline runs on trees."""

import warnings

import pytest
import torch

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")

import seqpack.frameworks.trl as seqpack_trl  # noqa: E402
from seqpack.frameworks.trl import tree as trl_tree  # noqa: E402
from seqpack.testing.tiny_vlm import IMAGE, VOCAB, tiny_vlm, vlm_grpo_batch  # noqa: E402
from test_hf_vlm import fp64_norms  # noqa: E402,F401  (the fixture)
from test_trl_tree import _ExactHead, _restore_trl, rel, trainer  # noqa: E402,F401  (_restore_trl: autouse)

INPUTS = ("pixel_values", "image_grid_thw", "num_images", "mm_token_type_ids")


def vlm(dtype=torch.float64):
    model = tiny_vlm("qwen2_vl", dtype=dtype)
    for p in model.parameters():  # larger than the default init: every input moves the log-probs visibly
        torch.nn.init.normal_(p, std=0.2)
    return model


def run(t, batch, **kw):
    t.model.zero_grad()
    lp, ent, _ = t._get_per_token_logps_and_entropies(t.model, batch["input_ids"], batch["attention_mask"],
                                                      batch["logits_to_keep"], compute_entropy=True,
                                                      **{k: batch[k] for k in INPUTS}, **kw)
    (lp.sum() + 0.3 * ent.sum()).backward()
    return lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in t.model.named_parameters()
                                       if p.grad is not None}


@pytest.mark.parametrize("batch_size", [None, 6])  # 6: chunks that cut a group (TRL's own fails on a chunk without images)
@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_log_probs_entropies_and_gradients_equal_trls_in_fp64(kind, batch_size, monkeypatch, fp64_norms):  # noqa: F811
    monkeypatch.setattr(trl.trainer.utils, "_ChunkedLogProbFunction", _ExactHead)
    t = trainer(kind, model=vlm(), bf16=False)
    batch = vlm_grpo_batch([[(4, 4)], [(4, 6), (2, 2)], [(2, 2)]], 4, dtype=torch.float64, trl=True)
    ref = run(t, batch, batch_size=batch_size)
    seqpack_trl.patch(shared_prefix=True, trees="always")
    trl_tree.counts(reset=True)
    seen = []
    visual = t.model.model.visual
    hook = visual.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0]))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="seqpack.integrations.trl")  # no fallback
        got = run(t, batch, batch_size=batch_size)
    hook.remove()
    assert trl_tree.counts()["tree_batches"] == 1 and trl_tree.counts()["trl_batches"] == 0
    # each prompt's images once per chunk holding its rows (TRL: once per row); 6 cuts prompt 1's group
    assert sum(seen) == {None: 16 + 28 + 4, 6: (16 + 28) + (28 + 4)}[batch_size] < batch["pixel_values"].shape[0]
    assert rel(got[0], ref[0]) < 1e-10 and rel(got[1], ref[1]) < 1e-10
    assert ref[2].keys() == got[2].keys()
    for name, grad in ref[2].items():  # the vision tower's rotary runs in fp32 (see test_hf_vlm)
        assert rel(got[2][name], grad) < (1e-7 if "visual" in name else 1e-10), name


def test_a_vision_model_trl_feeds_other_inputs_still_falls_back():
    """Vision inputs a tree does not take (Gemma's ``token_type_ids``, a model without
    ``get_rope_index``) keep TRL's path, with the warning naming them."""
    t = trainer("grpo", model=vlm(torch.float32), bf16=False)
    batch = vlm_grpo_batch([[(4, 4)]], 4, trl=True)
    seqpack_trl.patch(shared_prefix=True)
    with torch.no_grad(), pytest.warns(UserWarning, match=r"vision inputs \(token_type_ids\)"):
        t._get_per_token_logps_and_entropies(t.model, batch["input_ids"], batch["attention_mask"],
                                             batch["logits_to_keep"], token_type_ids=batch["mm_token_type_ids"],
                                             **{k: batch[k] for k in INPUTS})


def processor(monkeypatch):
    """A Qwen2-VL processor built offline: a word-level tokenizer whose placeholder
    tokens have the tiny model's ids, a chat template that puts each image before
    the text, and Qwen2-VL's image processor at patch 2, merge 2 (its PIL backend;
    the processor's video half needs torchvision, not installed here: left out)."""
    tokenizers = pytest.importorskip("tokenizers")
    from seqpack.testing.tiny_vlm import VIDEO, VISION_END, VISION_START

    specials = {"<|image_pad|>": IMAGE, "<|video_pad|>": VIDEO, "<|vision_start|>": VISION_START,
                "<|vision_end|>": VISION_END}
    vocab = {f"t{i}": i for i in range(VOCAB) if i not in specials.values()}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({**vocab, **specials}, unk_token="t3"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(specials))
    template = ("{% for m in messages %}{% for c in m['content'] %}{% if c['type'] == 'image' %}"
                "<|vision_start|><|image_pad|><|vision_end|> {% else %}{{ c['text'] }} {% endif %}{% endfor %}"
                "{% endfor %}{% if add_generation_prompt %}t4 {% endif %}")
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t1", pad_token="t0",
                                                     eos_token="t2", chat_template=template,
                                                     padding_side="left")  # as TRL loads a processor itself
    check = transformers.ProcessorMixin.check_argument_for_proper_class
    monkeypatch.setattr(transformers.ProcessorMixin, "check_argument_for_proper_class",
                        lambda self, name, arg: None if name == "video_processor" and arg is None
                        else check(self, name, arg))
    images = transformers.Qwen2VLImageProcessorPil(patch_size=2, temporal_patch_size=2, merge_size=2, min_pixels=16,
                                                   max_pixels=256)
    return transformers.Qwen2VLProcessor(image_processor=images, tokenizer=tokenizer, chat_template=template)


def image_prompts(n=4):
    datasets = pytest.importorskip("datasets")
    import numpy as np
    from PIL import Image

    rng = np.random.RandomState(0)
    sizes = [(8, 8), (8, 12), (12, 8), (4, 8)]
    return datasets.Dataset.from_dict({
        "prompt": [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"t{5 + k} t{9 + k}"}]}]
                   for k in range(n)],
        "image": [Image.fromarray((rng.rand(*sizes[k % 4], 3) * 255).astype(np.uint8)) for k in range(n)]})


def grpo_losses(monkeypatch, tmp_path, patched):
    from trl import GRPOConfig, GRPOTrainer

    if patched:
        seqpack_trl.patch(shared_prefix=True, trees="always")
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=4, max_steps=2, logging_steps=1, report_to="none", save_strategy="no",
                      seed=0, use_cpu=True, bf16=False, temperature=0.7, beta=0.1,
                      # a random model would sample placeholder tokens, which no VLM forward can place
                      generation_kwargs={"suppress_tokens": list(range(IMAGE, VOCAB))})
    model = vlm(torch.float32)
    model.save_pretrained(tmp_path / "model")  # the reference model (beta > 0) is loaded from the policy's path
    model.config._name_or_path = str(tmp_path / "model")
    t = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [float(len(str(c)) % 5)
                                                                                     for c in completions],
                    args=args, train_dataset=image_prompts(), processing_class=processor(monkeypatch))
    t.train()
    return [h["loss"] for h in t.state.log_history if "loss" in h]


def test_grpo_steps_with_images_run_on_trees(monkeypatch, tmp_path):
    """Two GRPOTrainer steps on an image dataset (generation with the images, a
    reference model): on trees, no fallback, TRL's losses."""
    ref = grpo_losses(monkeypatch, tmp_path / "trl", patched=False)
    trl_tree.counts(reset=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="seqpack.integrations.trl")
        got = grpo_losses(monkeypatch, tmp_path / "tree", patched=True)
    counts = trl_tree.counts()
    assert counts["tree_batches"] >= 2 and counts["trl_batches"] == 0 and counts["tokens_saved"] > 0
    assert len(got) == len(ref) == 2
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=0, atol=1e-4)


def test_a_chunk_without_images_runs_without_pixels():
    """TRL cuts its batch into chunks of ``batch_size`` rows; a chunk of text-only
    prompts gets no pixels (TRL's own path hands the model an empty pixel tensor and
    fails): the chunked log-probs equal the whole batch's."""
    t = trainer("grpo", model=vlm(), bf16=False)
    batch = vlm_grpo_batch([[(4, 4)], []], 4, dtype=torch.float64, trl=True)
    seqpack_trl.patch(shared_prefix=True, trees="always")
    with torch.no_grad():
        whole = run_no_grad(t, batch, batch_size=None)
        chunked = run_no_grad(t, batch, batch_size=4)
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-12)


def run_no_grad(t, batch, batch_size):
    lp, _, _ = t._get_per_token_logps_and_entropies(t.model, batch["input_ids"], batch["attention_mask"],
                                                    batch["logits_to_keep"], batch_size=batch_size,
                                                    **{k: batch[k] for k in INPUTS})
    return lp
