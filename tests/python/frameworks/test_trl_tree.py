"""TRL's GRPO and RLOO on prefix trees (issue 39, item 1):
``seqpack.integrations.trl.patch(shared_prefix=True)`` on TRL 1.16.

- ``_get_per_token_logps_and_entropies`` gives TRL's log-probs, entropies and
  parameter gradients: in fp64 to 1e-10 (TRL's head made exact in fp64, the
  RMSNorms too: TRL's own head takes its log-sum-exp in fp32), in fp32 with TRL's
  real head within 2e-4 (values) / 1e-3 (gradients) relative;
- two GRPOTrainer and two RLOOTrainer steps under TRL's defaults (bf16 autocast,
  gradient checkpointing, generation through ``model.generate`` on the same model),
  with a reference model (``beta > 0``), ``num_iterations = 2`` and
  ``importance_sampling_level = "sequence"``; LoRA;
- what a tree cannot take runs TRL's path with one warning naming it;
  AsyncGRPOTrainer is refused by name; ``unpatch()`` restores everything.
"""

import copy
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer  # noqa: E402

import seqpack.frameworks.trl as seqpack_trl  # noqa: E402
from seqpack.frameworks.trl import tree as trl_tree  # noqa: E402
from seqpack.frameworks._completion_trees import completion_tree  # noqa: E402
from test_hf_tree import fp64_norms  # noqa: E402,F401  (the fixture)
from test_trl_patch import VOCAB, tokenizer  # noqa: E402

TRAINERS = {"grpo": (GRPOTrainer, GRPOConfig), "rloo": (RLOOTrainer, RLOOConfig)}


@pytest.fixture(autouse=True)
def _restore_trl():
    seqpack_trl.unpatch()
    trl_tree._WARNED.clear()
    yield
    seqpack_trl.unpatch()


def tiny(dtype=torch.float32, kind="llama", **overrides):
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(
        kind, vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0, pad_token_id=1, eos_token_id=2,
        tie_word_embeddings=False, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager" if kind == "gemma2"
                                                          else "sdpa")
    for p in model.parameters():  # larger than the default init, so rows differ visibly
        torch.nn.init.normal_(p, std=0.2)
    return model.to(dtype)


def reward(completions, **kwargs):
    return [float(len(c) % 5) for c in completions]


def prompts(n=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return datasets.Dataset.from_dict({"prompt": [" ".join(f"t{int(i)}" for i in torch.randint(
        3, VOCAB, (12 + k % 3,), generator=g)) for k in range(n)]})


def trainer(kind="grpo", model=None, tmp_path=None, peft_config=None, **kw):
    import pathlib
    import tempfile

    tmp_path = pathlib.Path(tempfile.mkdtemp(prefix="seqpack-trl-tree-")) if tmp_path is None else tmp_path
    cls, config = TRAINERS[kind]
    defaults = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                    max_completion_length=6, max_steps=2, logging_steps=1, report_to="none", save_strategy="no",
                    seed=0, use_cpu=True, temperature=0.7)
    args = config(**{**defaults, **kw})
    model = tiny() if model is None else model
    model.save_pretrained(tmp_path / "model")  # a reference model (beta > 0) is loaded from the policy's path
    model.config._name_or_path = str(tmp_path / "model")
    return cls(model=model, reward_funcs=reward, args=args, train_dataset=prompts(), processing_class=tokenizer(),
               peft_config=peft_config)


def grpo_batch(g=4, groups=2, p=10, c=6, seed=3):
    """TRL's layout: prompts left-padded, completions right-padded; G rows per prompt."""
    gen = torch.Generator().manual_seed(seed)
    b = g * groups
    ids = torch.randint(3, VOCAB, (b, p + c), generator=gen)
    mask = torch.ones(b, p + c, dtype=torch.long)
    for k in range(groups):
        ids[k * g:(k + 1) * g, :p] = torch.randint(3, VOCAB, (p,), generator=gen)
        mask[k * g:(k + 1) * g, :2 * k] = 0  # group k: 2k left pads
    ids[mask == 0] = 1
    mask[1, p + 3:] = 0  # a completion that stopped early
    mask[g + 2, p + 1:] = 0
    ids[:2, p] = ids[2, p]  # completions that start alike branch later
    return ids, mask


def logps_and_grads(t, model, ids, mask, c):
    model.zero_grad()
    lp, ent, aux = t._get_per_token_logps_and_entropies(model, ids, mask, c, compute_entropy=True)
    assert aux is None
    (lp.sum() + 0.3 * ent.sum()).backward()
    return lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


class _ExactHead:
    """TRL's ``_ChunkedLogProbFunction`` in fp64 throughout (TRL's takes its
    log-sum-exp in fp32): the same per-token fields, exact."""

    @staticmethod
    def apply(hidden, weight, bias, labels, temperature, chunk, softcap, logit_scale, outputs):
        logits = hidden @ weight.T.to(hidden.dtype) + (0 if bias is None else bias)
        logp = torch.log_softmax(logits * logit_scale / temperature, -1)
        lp = logp.gather(-1, labels.clamp(min=0)[:, None])[:, 0]
        return lp, -(logp.exp() * logp).sum(-1), None, None, None


@pytest.fixture
def fp64_rope(monkeypatch):
    """Llama's rotary angles in fp64 (transformers takes them in fp32): TRL's padded
    path numbers a left-padded row's positions from its first pad, the tree from its
    first token, the same attention only up to the angles' rounding."""
    from transformers.models.llama import modeling_llama

    def forward(self, x, position_ids):
        freqs = position_ids[..., None].double() * self.inv_freq.double()
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)

    monkeypatch.setattr(modeling_llama.LlamaRotaryEmbedding, "forward", forward)


@pytest.mark.parametrize("kind", sorted(TRAINERS))
def test_log_probs_entropies_and_gradients_equal_trls_in_fp64(kind, monkeypatch, fp64_norms, fp64_rope):  # noqa: F811
    monkeypatch.setattr(trl.trainer.utils, "_ChunkedLogProbFunction", _ExactHead)
    t = trainer(kind, model=tiny(torch.float64), bf16=False)
    ids, mask = grpo_batch()
    ref = logps_and_grads(t, t.model, ids, mask, 6)
    seqpack_trl.patch(shared_prefix=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="seqpack.integrations.trl")  # the tree path, no fallback
        got = logps_and_grads(t, t.model, ids, mask, 6)
    assert t.model.config._attn_implementation == "seqpack_tree"
    assert rel(got[0], ref[0]) < 1e-10 and rel(got[1], ref[1]) < 1e-10
    assert ref[2].keys() == got[2].keys()
    for name, grad in ref[2].items():
        assert rel(got[2][name], grad) < 1e-10, name
    assert (got[0][mask[:, -6:] == 0] == 0).all()  # 0 where TRL's labels are -100


@pytest.mark.parametrize("kind", sorted(TRAINERS))
def test_log_probs_equal_trls_fused_head_in_fp32(kind):
    t = trainer(kind, bf16=False)
    ids, mask = grpo_batch(g=8, groups=2)
    ref = logps_and_grads(t, t.model, ids, mask, 6)
    seqpack_trl.patch(shared_prefix=True)
    got = logps_and_grads(t, t.model, ids, mask, 6)
    assert rel(got[0], ref[0]) < 2e-4 and rel(got[1], ref[1]) < 2e-4
    for name, grad in ref[2].items():
        assert rel(got[2][name], grad) < 1e-3, name


def test_batch_size_chunks_and_temperature_and_fp32_head_cast():
    """TRL's ``batch_size`` chunks (each chunk a tree), its temperature and
    ``cast_lm_head_to_fp32`` are read from the head TRL installed."""
    t = trainer("grpo", bf16=False, temperature=1.3, cast_lm_head_to_fp32=True)
    ids, mask = grpo_batch(g=4, groups=3)
    with torch.no_grad():
        ref = t._get_per_token_logps_and_entropies(t.model, ids, mask, 6, batch_size=4, compute_entropy=True)
        seqpack_trl.patch(shared_prefix=True)
        got = t._get_per_token_logps_and_entropies(t.model, ids, mask, 6, batch_size=4, compute_entropy=True)
    assert rel(got[0], ref[0]) < 2e-4 and rel(got[1], ref[1]) < 2e-4


@pytest.mark.parametrize("batch_size", [2, 3, 5])
def test_chunks_that_cut_a_group_forward_its_prompt_once(batch_size):
    # Issue 52: without gradients (the old-policy and reference log-probs), TRL's
    # batch_size chunks cut each group of 4; the patch runs the whole batch's tree in
    # passes of at most a chunk's tokens, so each prompt is forwarded once.
    t = trainer("grpo", bf16=False, temperature=0.9)
    ids, mask = grpo_batch(g=4, groups=3)
    with torch.no_grad():
        ref = t._get_per_token_logps_and_entropies(t.model, ids, mask, 6, batch_size=batch_size, compute_entropy=True)
        seqpack_trl.patch(shared_prefix=True, trees="always")
        trl_tree.counts(reset=True)
        got = t._get_per_token_logps_and_entropies(t.model, ids, mask, 6, batch_size=batch_size, compute_entropy=True)
    assert rel(got[0], ref[0]) < 2e-4 and rel(got[1], ref[1]) < 2e-4
    ran = trl_tree.counts()
    whole = completion_tree(ids, mask, 6)[0]
    assert ran["prefix_reuse_batches"] == 1 and ran["tree_tokens"] == whole.num_tokens
    chunked = sum(completion_tree(ids[s:s + batch_size], mask[s:s + batch_size], 6)[0].num_tokens
                  for s in range(0, ids.shape[0], batch_size))
    assert whole.num_tokens < chunked  # what the chunks' own trees would forward
    seqpack_trl.unpatch()


@given(st.data())
@settings(max_examples=40, deadline=None)
def test_completion_tree_places_every_completion_token(data):
    """Every real completion token gets the log-prob of its predecessor's logical
    token (same row, the token before it), at its own ``[b, j]``; nothing else."""
    b = data.draw(st.integers(1, 6))
    p, c = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 5))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    ids = rng.integers(0, 4, size=(b, p + c))
    mask = np.ones((b, p + c), dtype=np.int64)
    for r in range(b):
        mask[r, :rng.integers(0, p)] = 0  # left padding, at least one prompt token
        mask[r, p + rng.integers(0, c + 1):] = 0  # right padding
    tree, scored, source, target = completion_tree(ids, mask, c)
    rows, cols = np.nonzero(mask)
    expected = sorted(int(r) * c + int(col) - p for r, col in zip(rows, cols) if col >= p)
    assert sorted(target.tolist()) == expected and scored.sum() == len(source)
    logical_ids = tree.input_ids[tree.logical_index]
    for s, t in zip(source.tolist(), target.tolist()):
        r, j = divmod(t, c)
        assert rows[s + 1] == r and cols[s + 1] == p + j and logical_ids[s + 1] == ids[r, p + j]
    empty = mask.copy()
    empty[0, :p] = 0  # a completion with no prompt token before it: TRL scores a pad token's state
    if empty[0, p]:
        assert completion_tree(ids, empty, c) is None


def losses(t):
    t.train()
    return [h["loss"] for h in t.state.log_history if "loss" in h]


@pytest.mark.parametrize("kind", sorted(TRAINERS))
def test_two_steps_under_trls_defaults(kind, tmp_path):
    """bf16 autocast and gradient checkpointing (TRL's defaults), a reference model,
    two iterations per generation, sequence-level importance sampling (GRPO);
    generation runs the model's SDPA through the same implementation."""
    extra = dict(beta=0.1, num_iterations=2, steps_per_generation=2)
    if kind == "grpo":
        extra["importance_sampling_level"] = "sequence"
    ref_run = losses(trainer(kind, tmp_path=tmp_path / "trl", **extra))
    seqpack_trl.patch(shared_prefix=True)
    t = trainer(kind, tmp_path=tmp_path / "tree", **extra)
    assert t.args.bf16 and t.args.gradient_checkpointing
    calls = []
    forward = trl_tree._tree_forward
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trl_tree, "_tree_forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
        got = losses(t)
    assert calls and t.model.config._attn_implementation == "seqpack_tree"
    assert len(got) == len(ref_run) == 2 and all(np.isfinite(got))
    np.testing.assert_allclose(got, ref_run, atol=2e-2)  # bf16 autocast: the same steps, up to bf16 rounding


def test_lora_policy_and_reference_through_the_disabled_adapter(tmp_path):
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    t = trainer("grpo", tmp_path=tmp_path, peft_config=lora, bf16=False, beta=0.1)
    ids, mask = grpo_batch()
    ref = logps_and_grads(t, t.model, ids, mask, 6)
    seqpack_trl.patch(shared_prefix=True)
    got = logps_and_grads(t, t.model, ids, mask, 6)
    assert rel(got[0], ref[0]) < 2e-4 and ref[2].keys() == got[2].keys()
    assert all("lora" in name for name in got[2])
    for name, grad in ref[2].items():
        assert rel(got[2][name], grad) < 1e-3, name
    assert len(losses(t)) == 2


@pytest.mark.parametrize("case", ["aux_loss", "softcap", "vision"])
def test_what_a_tree_cannot_take_runs_trls_path_with_one_warning(case, monkeypatch):
    if case == "aux_loss":  # a family whose load-balancing loss seqpack cannot count per row (none known: faked)
        model = tiny(kind="qwen3_moe", head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
        call = dict(compute_aux_loss=True)
        monkeypatch.setattr(trl_tree, "balancing_loss", lambda model: None)
    elif case == "softcap":
        model = tiny(kind="gemma2", head_dim=8, final_logit_softcapping=30.0, attn_logit_softcapping=None)
        call = {}
    else:
        model, call = tiny(), {}
    t = trainer("grpo", model=model, bf16=False)
    ids, mask = grpo_batch()
    if case == "vision":
        call = dict(token_type_ids=torch.zeros_like(ids))
    with torch.no_grad():
        ref = t._get_per_token_logps_and_entropies(t.model, ids, mask, 6, **call)
        seqpack_trl.patch(shared_prefix=True)
        with pytest.warns(UserWarning, match={"aux_loss": "load-balancing", "softcap": "final_logit_softcapping",
                                              "vision": "vision inputs"}[case]):
            got = t._get_per_token_logps_and_entropies(t.model, ids, mask, 6, **call)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="seqpack.integrations.trl")  # once per reason
            t._get_per_token_logps_and_entropies(t.model, ids, mask, 6, **call)
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0)  # TRL's own path


def test_patch_and_unpatch_restore_trainers_models_and_attention():
    original = GRPOTrainer.__dict__[trl_tree.METHOD]
    packing = seqpack_trl.patch()  # (trl.pack_dataset too once another test has read it)
    assert "trl.trainer.sft_trainer.pack_dataset" in packing and all(n.endswith(".pack_dataset") for n in packing)
    assert GRPOTrainer.__dict__[trl_tree.METHOD] is original  # no flag: packing only
    names = seqpack_trl.patch(shared_prefix=True)
    assert "trl.trainer.grpo_trainer.GRPOTrainer._get_per_token_logps_and_entropies" in names
    assert "trl.trainer.rloo_trainer.RLOOTrainer._get_per_token_logps_and_entropies" in names
    assert seqpack_trl.patch(shared_prefix=True) == names and seqpack_trl.patch() == names  # idempotent
    t = trainer("grpo", bf16=False)
    ids, mask = grpo_batch()
    with torch.no_grad():
        t._get_per_token_logps_and_entropies(t.model, ids, mask, 6)
    assert t.model.config._attn_implementation == "seqpack_tree"
    import inspect  # generate reads the forward's signature (logits_to_keep, the kwargs it validates)

    assert inspect.signature(t.model.forward).parameters.keys() == inspect.signature(
        type(t.model).forward).parameters.keys() - {"self"}
    assert seqpack_trl.unpatch() == names
    assert GRPOTrainer.__dict__[trl_tree.METHOD] is original and RLOOTrainer.__dict__[trl_tree.METHOD] is not None
    assert t.model.config._attn_implementation == "sdpa" and "_seqpack_trl_forward" not in t.model.__dict__
    trees_only = [n for n in names if not n.endswith(".pack_dataset")]
    with seqpack_trl.patched(shared_prefix=True) as inside:  # a GRPO run: SFT packing left alone
        assert inside == trees_only
        import trl.trainer.sft_trainer

        assert trl.trainer.sft_trainer.pack_dataset is not seqpack_trl.trl_pack_dataset
    with seqpack_trl.patched(shared_prefix=True, packing=True) as inside:  # asked for: both
        assert inside == names
    assert GRPOTrainer.__dict__[trl_tree.METHOD] is original


def test_the_patch_says_it_is_on_and_reports_what_ran_as_trees(caplog, monkeypatch):
    # Issue 51, item 2: the patch confirmed itself only at INFO; nothing said how many
    # batches ran as trees; a fallback warning holding the row length printed every step.
    import logging

    trl_tree.counts(reset=True)
    with caplog.at_level(logging.WARNING):
        seqpack_trl.patch(shared_prefix=True)
    assert any("replaced by seqpack's" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    t = trainer("grpo", bf16=False)
    ids, mask = grpo_batch()
    with torch.no_grad():
        t._get_per_token_logps_and_entropies(t.model, ids, mask, 6)
        monkeypatch.setattr(trl_tree, "_fallback_reason", lambda *a: ("test_kind", "a reason of this test"))
        with pytest.warns(UserWarning, match="a reason of this test"):
            t._get_per_token_logps_and_entropies(t.model, ids, mask, 6)
    got = seqpack_trl.report()
    assert got["tree_batches"] == 1 and got["trl_batches"] == 1 and got["trl_reasons"] == {"test_kind": 1}
    assert got["padded_tokens"] == ids.numel() and 0 < got["tree_tokens"] < got["padded_tokens"]
    assert got["tokens_saved"] == got["padded_tokens"] - got["tree_tokens"]
    seqpack_trl.unpatch()


def test_each_model_is_unwrapped_once_per_trainer(monkeypatch):
    # accelerate's unwrap_model looks its backends up through importlib at every call
    # (0.65 ms a call, twice a batch): the price a batch on TRL's path paid for the patch.
    seqpack_trl.patch(shared_prefix=True)
    t = trainer("grpo", bf16=False)
    ref = copy.deepcopy(t.model)  # a reference model: unwrapped apart
    seen = []
    unwrap = t.accelerator.unwrap_model
    monkeypatch.setattr(t.accelerator, "unwrap_model", lambda m, *a, **k: seen.append(m) or unwrap(m, *a, **k))
    ids, mask = grpo_batch()
    with torch.no_grad():
        for model in (t.model, ref, t.model, ref, t.model):
            t._get_per_token_logps_and_entropies(model, ids, mask, 6)
    assert seen == [t.model, ref]
    seqpack_trl.unpatch()


def test_a_fallback_reason_warns_once_whatever_its_numbers():
    trl_tree._WARNED.discard("sliding_window")  # a fallback's kind is fixed, its words carry the batch's numbers
    with pytest.warns(UserWarning, match="shorter than a row of 17 tokens") as record:
        trl_tree._warn_once("sliding_window", "sliding_window = 8, shorter than a row of 17 tokens")
        trl_tree._warn_once("sliding_window", "sliding_window = 8, shorter than a row of 23 tokens")
    assert len([w for w in record if "sliding_window" in str(w.message)]) == 1


def test_async_grpo_is_refused_by_name(tmp_path):
    async_grpo = pytest.importorskip("trl.experimental.async_grpo")
    seqpack_trl.patch(shared_prefix=True)
    args = async_grpo.AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False)
    tiny().save_pretrained(tmp_path / "model")
    with pytest.raises(RuntimeError, match="AsyncGRPOTrainer"):
        async_grpo.AsyncGRPOTrainer(model=str(tmp_path / "model"), reward_funcs=reward, args=args, train_dataset=prompts(),
                                    processing_class=tokenizer())


def test_a_logit_scale_is_folded_into_the_temperature():
    """Cohere multiplies its logits by ``logit_scale``; TRL's head reads it from the
    config, and so does the tree's (as a temperature divided by it)."""
    t = trainer("grpo", model=tiny(kind="cohere", logit_scale=0.5), bf16=False, temperature=0.8)
    ids, mask = grpo_batch()
    ref = logps_and_grads(t, t.model, ids, mask, 6)
    seqpack_trl.patch(shared_prefix=True)
    got = logps_and_grads(t, t.model, ids, mask, 6)
    assert t.model.config._attn_implementation == "seqpack_tree"
    assert rel(got[0], ref[0]) < 2e-4 and rel(got[1], ref[1]) < 2e-4
    for name, grad in ref[2].items():
        assert rel(got[2][name], grad) < 1e-3, name


def test_an_moe_aux_loss_runs_on_trees_counted_per_row():
    """Issue 53: TRL's GRPO with an MoE model and its load-balancing loss
    (``compute_aux_loss``) no longer falls back: each chunk's tree gives TRL's
    per-chunk aux loss (the padded rows', each prompt token once per row), the
    log-probs, and the gradient of both."""
    cfg = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=8, output_router_logits=True,
               router_aux_loss_coef=0.02)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model("qwen3_moe", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=256, bos_token_id=0, pad_token_id=1,
                                          eos_token_id=2, tie_word_embeddings=False, **cfg),
        experts_implementation="eager", dtype=torch.float64)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    t = trainer("grpo", model=model, bf16=False)
    assert t.aux_loss_enabled
    ids, mask = grpo_batch(g=4, groups=2)

    def run():
        t.model.zero_grad()
        lp, ent, aux = t._get_per_token_logps_and_entropies(t.model, ids, mask, 6, batch_size=4,
                                                             compute_entropy=True, compute_aux_loss=True)
        (lp.sum() + 0.3 * ent.sum() + 10 * aux).backward()
        return lp.detach(), aux.detach(), {n: p.grad.clone() for n, p in t.model.named_parameters()
                                           if p.grad is not None}

    ref = run()
    seqpack_trl.patch(shared_prefix=True, trees="always")
    trl_tree.counts(reset=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="seqpack.integrations.trl")  # no fallback
        got = run()
    assert trl_tree.counts()["tree_batches"] == 1 and trl_tree.counts()["trl_batches"] == 0
    assert rel(got[1], ref[1]) < 1e-6 and rel(got[0], ref[0]) < 2e-4  # aux: HF sums in fp32; TRL's head fp32 lse
    for name, grad in ref[2].items():
        assert rel(got[2][name], grad) < 1e-3, name
