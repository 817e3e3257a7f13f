"""TRL's trainers with seqpack (issue 27, item 4), as a TRL user runs them: TRL 1.16
defaults (``bf16=True``: autocast, ``gradient_checkpointing=True``), a tiny Llama
built from a config and a tokenizer built in memory (no download).

- ``seqpack.integrations.trl.patch()`` replaces TRL's ``pack_dataset`` where the
  trainers bound it; SFTTrainer then packs with seqpack (a spy sees the call) into
  the rows TRL packs, for every strategy; ``unpatch()`` restores TRL's own.
- ``attn_implementation="seqpack"`` trains under autocast (transformers hands the
  attention float32 q/k and bfloat16 v): SFTTrainer and DPOTrainer give SDPA's
  losses.
"""

import copy

import pytest
import torch

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

import trl.data_utils  # noqa: E402
import trl.trainer.sft_trainer  # noqa: E402
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer  # noqa: E402

import seqpack.frameworks.trl as seqpack_trl  # noqa: E402
from seqpack.integrations import hf  # noqa: E402

VOCAB = 64


@pytest.fixture(autouse=True)
def _restore_trl():
    seqpack_trl.unpatch()
    yield
    seqpack_trl.unpatch()


def tokenizer():
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t0", pad_token="t1",
                                                eos_token="t2")


def tiny_llama(attn):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   bos_token_id=0, pad_token_id=1, eos_token_id=2, attn_implementation=attn)
    return transformers.LlamaForCausalLM(cfg)


def token_rows(n=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (int(m),), generator=g).tolist() for m in torch.randint(1, 40, (n,), generator=g)]


def sft_args(tmp_path, **kw):
    # use_cpu: transformers refuses TRL's bf16=True default without a bf16 GPU unless told to train on the CPU.
    return SFTConfig(output_dir=str(tmp_path), packing=True, max_length=64, per_device_train_batch_size=2,
                     logging_steps=1, report_to="none", save_strategy="no", seed=0, use_cpu=True, **kw)


def test_patch_replaces_every_binding_and_unpatch_restores_them():
    original = trl.data_utils.pack_dataset
    assert trl.trainer.sft_trainer.pack_dataset is original
    names = seqpack_trl.patch()
    assert {"trl.data_utils.pack_dataset", "trl.trainer.sft_trainer.pack_dataset"} <= set(names)
    assert trl.trainer.sft_trainer.pack_dataset is seqpack_trl.trl_pack_dataset
    assert trl.data_utils.pack_dataset is seqpack_trl.trl_pack_dataset
    assert trl.pack_dataset is seqpack_trl.trl_pack_dataset  # the lazy top-level name reads data_utils'
    assert seqpack_trl.patch() == seqpack_trl.patched_names() == sorted(set(names) | {"trl.pack_dataset"})
    restored = seqpack_trl.unpatch()
    assert "trl.trainer.sft_trainer.pack_dataset" in restored
    assert trl.trainer.sft_trainer.pack_dataset is original and trl.data_utils.pack_dataset is original
    assert trl.pack_dataset is original and seqpack_trl.patched_names() == [] and seqpack_trl.unpatch() == []
    with seqpack_trl.patched() as inside:
        assert "trl.trainer.sft_trainer.pack_dataset" in inside
    assert trl.trainer.sft_trainer.pack_dataset is original


@pytest.mark.parametrize("strategy", ["bfd", "bfd_split", "wrapped"])
def test_sft_trainer_packs_with_seqpack_into_trls_rows(strategy, tmp_path, monkeypatch):
    ds = datasets.Dataset.from_dict({"input_ids": token_rows()})
    args = sft_args(tmp_path, packing_strategy=strategy, max_steps=1)
    want = SFTTrainer(model=tiny_llama("sdpa"), args=args, train_dataset=ds, processing_class=tokenizer())
    calls = []
    real = seqpack_trl.pack_dataset

    def spy(*a, **k):
        calls.append(a[2] if len(a) > 2 else k.get("strategy"))
        return real(*a, **k)

    from seqpack.frameworks.trl import patching

    monkeypatch.setattr(patching, "pack_dataset", spy)  # what the patch calls
    seqpack_trl.patch()
    got = SFTTrainer(model=tiny_llama("sdpa"), args=args, train_dataset=ds, processing_class=tokenizer())
    assert calls == [strategy]
    assert got.train_dataset.column_names == want.train_dataset.column_names
    assert got.train_dataset[:] == want.train_dataset[:]


def test_trl_pack_dataset_falls_back_to_trl_and_refuses_what_trl_cannot_train():
    rows = {"input_ids": token_rows(20, seed=3)}
    stream = datasets.Dataset.from_dict(rows).to_iterable_dataset()
    seqpack_trl.patch()
    got = list(seqpack_trl.trl_pack_dataset(stream, 16, "bfd"))  # an IterableDataset: TRL's own function
    seqpack_trl.unpatch()
    assert got == list(trl.data_utils.pack_dataset(stream, 16, "bfd"))
    with pytest.raises(ValueError, match="Invalid packing strategy 'bfd_global'"):
        seqpack_trl.trl_pack_dataset(datasets.Dataset.from_dict(rows), 16, "bfd_global")


def sft_losses(attn, tmp_path, steps=3):
    ds = datasets.Dataset.from_dict({"input_ids": token_rows()})
    args = sft_args(tmp_path, max_steps=steps)
    assert args.bf16 and args.gradient_checkpointing  # TRL's defaults
    trainer = SFTTrainer(model=tiny_llama(attn), args=args, train_dataset=ds, processing_class=tokenizer())
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_sft_trainer_with_seqpack_attention_and_packing_trains_like_sdpa(tmp_path):
    ref = sft_losses("sdpa", tmp_path / "sdpa")
    name = hf.register()
    with seqpack_trl.patched():
        got = sft_losses(name, tmp_path / "seqpack")
    assert len(got) == len(ref) == 3
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=2e-4, atol=0)  # bf16 autocast


def test_dpo_trainer_with_seqpack_attention_trains_like_sdpa(tmp_path):
    g = torch.Generator().manual_seed(5)

    def text(n):
        return " ".join(f"t{int(i)}" for i in torch.randint(3, VOCAB, (n,), generator=g))

    ds = datasets.Dataset.from_dict({"prompt": [text(4 + i % 5) for i in range(8)],
                                     "chosen": [text(2 + i % 3) for i in range(8)],
                                     "rejected": [text(3 + i % 4) for i in range(8)]})
    losses = {}
    for attn in ("sdpa", hf.register()):
        model = tiny_llama(attn)
        args = DPOConfig(output_dir=str(tmp_path / attn), per_device_train_batch_size=4, max_steps=2,
                         logging_steps=1, report_to="none", save_strategy="no", seed=0, use_cpu=True)
        assert args.bf16
        trainer = DPOTrainer(model=model, ref_model=copy.deepcopy(model), args=args, train_dataset=ds,
                             processing_class=tokenizer())
        trainer.train()
        losses[attn] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses["sdpa"]) == 2
    torch.testing.assert_close(torch.tensor(losses["seqpack"]), torch.tensor(losses["sdpa"]), rtol=2e-4, atol=0)
