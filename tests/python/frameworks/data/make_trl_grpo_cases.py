"""Record TRL 1.16's GRPO log-probs (``GRPOTrainer._get_per_token_logps_and_entropies``,
TRL's fused LM head) on small batches laid out as TRL lays them out, for
tests/python/frameworks/test_trl_tree.py (which replays them without TRL installed).

    python tests/python/frameworks/data/make_trl_grpo_cases.py   # writes trl_grpo_cases.json beside it

The model is a tiny Llama whose weights come from NumPy (:func:`weights`), so the
replay builds the same model whatever transformers initialises. Each case: the
padded ``input_ids`` / ``attention_mask``, ``logits_to_keep``, the head's temperature
and TRL's ``[B, C]`` log-probs and entropies (fp32, no autocast).
"""

from __future__ import annotations

import json
import pathlib
import tempfile

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
CONFIG = dict(vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=128, bos_token_id=0, pad_token_id=1, eos_token_id=2,
              tie_word_embeddings=False)


def model():
    """The tiny Llama (fp32, SDPA) with :func:`weights`."""
    import torch
    import transformers

    llama = transformers.LlamaForCausalLM._from_config(transformers.LlamaConfig(**CONFIG), attn_implementation="sdpa")
    rng = np.random.default_rng(0)
    with torch.no_grad():
        for name, p in sorted(llama.named_parameters()):  # NumPy weights: the same whatever transformers draws
            scale = 1.0 if "norm" in name else 0.3
            values = 1.0 + 0.1 * rng.standard_normal(p.shape) if "norm" in name else scale * rng.standard_normal(p.shape)
            p.copy_(torch.from_numpy(values.astype(np.float32)))
    return llama


def tokenizer():
    import tokenizers
    import transformers

    vocab = {f"t{i}": i for i in range(CONFIG["vocab_size"])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t0", pad_token="t1", eos_token="t2")


def batch(rng, groups, g, prompt, completion):
    b = groups * g
    ids = np.ones((b, prompt + completion), dtype=np.int64)
    mask = np.zeros_like(ids)
    for k in range(groups):
        n = int(rng.integers(1, prompt + 1))
        ids[k * g:(k + 1) * g, prompt - n:prompt] = rng.integers(3, CONFIG["vocab_size"], n)
        mask[k * g:(k + 1) * g, prompt - n:prompt] = 1
    for r in range(b):
        n = int(rng.integers(0, completion + 1))
        ids[r, prompt:prompt + n] = rng.integers(3, CONFIG["vocab_size"], n)
        mask[r, prompt:prompt + n] = 1
    return ids, mask


def main() -> None:
    import datasets
    import torch
    import trl
    from trl import GRPOConfig, GRPOTrainer

    rng = np.random.default_rng(1)
    cases = []
    for groups, g, prompt, completion, temperature in [(2, 4, 8, 5, 1.0), (1, 8, 12, 3, 0.7), (3, 2, 5, 6, 1.3)]:
        args = GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, num_generations=2,
                          report_to="none", use_cpu=True, bf16=False, temperature=temperature)
        trainer = GRPOTrainer(model=model(), reward_funcs=lambda completions, **_: [0.0] * len(completions),
                              args=args, train_dataset=datasets.Dataset.from_dict({"prompt": ["t3 t4"] * 4}),
                              processing_class=tokenizer())
        ids, mask = batch(rng, groups, g, prompt, completion)
        with torch.no_grad():
            lp, ent, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, torch.from_numpy(ids), torch.from_numpy(mask), completion, compute_entropy=True)
        cases.append({"input_ids": ids.tolist(), "attention_mask": mask.tolist(), "logits_to_keep": completion,
                      "temperature": temperature, "log_probs": lp.tolist(), "entropy": ent.tolist()})
    out = {"trl": trl.__version__, "config": CONFIG, "cases": cases}
    (HERE / "trl_grpo_cases.json").write_text(json.dumps(out, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
