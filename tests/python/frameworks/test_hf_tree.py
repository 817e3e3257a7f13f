"""HF transformers on a prefix tree (issue 28, item 5): tiny Llama and Qwen2 models
(random weights, fp64) run through the ``"seqpack_tree"`` attention registered the
HF way give, at every row's tokens, the logits of the row run alone with SDPA
(and eager, whose softmax is fp32), and the same summed NLL and parameter gradients; the attention
function's errors name what is wrong."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import seqpack  # noqa: E402
from seqpack.integrations import hf  # noqa: E402

ROWS = [[3, 5, 7, 9, 11], [3, 5, 7, 2], [3, 5, 7, 2, 60, 61], [3, 5], [40, 41, 42]]
GROUPS = [0, 0, 0, 0, 1]


FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "qwen3_moe")


def config(kind):
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, use_cache=False, tie_word_embeddings=False)
    extra = {"qwen3": dict(head_dim=8), "gemma": dict(head_dim=8), "mistral": dict(sliding_window=None),
             # Gemma 2 without attention soft-capping (with it: refused, see test_gemma2_soft_capping_is_named)
             "gemma2": dict(head_dim=8, attn_logit_softcapping=None, final_logit_softcapping=30.0),
             "qwen3_moe": dict(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)}
    return transformers.AutoConfig.for_model(kind, **common, **extra.get(kind, {}))


def tiny(kind, attn, seed=0, **overrides):
    cfg = config(kind)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    torch.manual_seed(seed)
    experts = {"experts_implementation": "eager"} if kind == "qwen3_moe" else {}  # grouped_mm has no fp64
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float64,
                                                          **experts)
    for p in model.parameters():  # larger than the default init, so rows differ visibly
        torch.nn.init.normal_(p, std=0.2)
    return model.eval()


@pytest.fixture(scope="module")
def name():
    return hf.register_tree()


def alone(model, row):
    return model(input_ids=torch.tensor([row])).logits[0]


def nll(logits, row):
    return -torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(row[1:])[:, None]).sum()


@pytest.mark.parametrize("reference", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", FAMILIES)
def test_tree_logits_equal_rows_alone(kind, reference, name):
    if kind == "gemma2" and reference == "sdpa":
        pytest.skip("transformers runs Gemma 2 with eager attention only")
    tree = seqpack.pack_prefix_tree(ROWS, group_ids=GROUPS, pad_to_multiple_of=8)
    model = tiny(kind, name)
    ref = tiny(kind, reference)
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():
        logits = model(**hf.tree_kwargs(tree)).logits[0]
        assert logits.shape == (tree.num_tokens, 64)
        for r, row in enumerate(ROWS):
            at = torch.tensor(tree.logical_index[tree.cu_seqlens[r]:tree.cu_seqlens[r + 1]])
            # eager takes its softmax in fp32 even for fp64 models: fp32 tolerances there
            tol = dict(rtol=1e-10, atol=1e-12) if reference == "sdpa" else dict(rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(logits[at], alone(ref, row), **tol)


@pytest.fixture
def fp64_norms(monkeypatch):
    """HF's RMSNorms compute in fp32 even in an fp64 model: exact in the forward, but
    their backward then sums a shared token's gradients in fp32 (once in the tree, per
    row alone), a 1e-7 difference. In fp64 throughout they agree to ~1e-15."""
    import importlib

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)

    def gemma_forward(self, x):  # Gemma scales by (1 + weight)
        return (1 + self.weight) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    for kind in FAMILIES:
        module = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
        for attr in dir(module):
            if attr.endswith("RMSNorm"):
                monkeypatch.setattr(getattr(module, attr), "forward",
                                    gemma_forward if kind.startswith("gemma") else forward)


def rel_close(a, b, rtol, what):
    err = float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))
    assert err <= rtol, (what, err)


def check_nll_and_gradients(kind, name, rtol):
    tree = seqpack.pack_prefix_tree(ROWS, group_ids=GROUPS)
    model = tiny(kind, name, seed=1)
    ref = tiny(kind, "eager" if kind == "gemma2" else "sdpa", seed=1)  # sdpa: fp64 throughout (eager's softmax is fp32)
    ref.load_state_dict(model.state_dict())

    loss = -seqpack.token_logprobs(model(**hf.tree_kwargs(tree)).logits[0], tree).logprobs.sum()
    loss.backward()
    expected = sum(nll(alone(ref, row), row) for row in ROWS)
    expected.backward()

    torch.testing.assert_close(loss.detach(), expected.detach(), rtol=max(rtol, 1e-10), atol=1e-12)
    grads = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        rel_close(p.grad, grads[n].grad, rtol, n)
    assert tree.num_tokens < tree.num_logical_tokens  # the shared prefixes were forwarded once


@pytest.mark.parametrize("kind", FAMILIES)
def test_tree_nll_and_gradients_equal_rows_alone(kind, name, fp64_norms):
    # Qwen3-MoE's router takes its softmax in fp32: its gradients agree to fp32's precision
    # Gemma 2's reference is eager, whose softmax is fp32
    check_nll_and_gradients(kind, name, rtol={"qwen3_moe": 1e-6, "gemma2": 1e-5}.get(kind, 1e-12))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tree_gradients_stock_models(kind, name):
    """The stock models: their fp32 RMSNorm backward bounds the agreement (~1e-7)."""
    check_nll_and_gradients(kind, name, rtol=1e-5)


def test_tree_kwargs():
    tree = seqpack.pack_prefix_tree([[1, 2, 3], [1, 2, 4]])
    kw = hf.tree_kwargs(tree)
    assert kw["input_ids"].tolist() == [[1, 2, 3, 4]] and kw["position_ids"].tolist() == [[0, 1, 2, 2]]
    assert kw["input_ids"].dtype == kw["position_ids"].dtype == torch.long and kw["prefix_tree"] is tree
    assert kw["attention_mask"].tolist() == [[2, 2, 1, 1]]  # each token's rows: an MoE aux loss's weights
    with pytest.raises(TypeError, match="tree must be a PrefixTreeBatch"):
        hf.tree_kwargs([[1, 2]])
    same = tree.hf_kwargs()  # the method the layout contract names
    assert same.keys() == kw.keys() and same["prefix_tree"] is tree
    assert all(torch.equal(same[k], kw[k]) for k in ("input_ids", "position_ids", "attention_mask"))


def test_tree_attention_errors(name):
    tree = seqpack.pack_prefix_tree([[1, 2, 3], [1, 2, 4]])
    model = tiny("llama", name)
    attn = model.model.layers[0].self_attn
    kw = hf.tree_kwargs(tree)
    with torch.no_grad():  # an all-ones mask pads nothing, the row weights neither: accepted, the same logits
        torch.testing.assert_close(model(**{**kw, "attention_mask": torch.ones(1, 4, dtype=torch.long)}).logits,
                                   model(**{**kw, "attention_mask": None}).logits)
        torch.testing.assert_close(model(**kw).logits, model(**{**kw, "attention_mask": None}).logits)
    with pytest.raises(ValueError, match="no padding attention_mask"):
        model(**{**kw, "attention_mask": torch.tensor([[1, 1, 1, 0]])})
    with pytest.raises(ValueError, match="one row of the layout's 4 physical tokens"):
        model(input_ids=torch.tensor([[1, 2, 3]]), prefix_tree=tree)
    q = torch.zeros(1, 4, 4, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="takes no attention_mask"):
        hf.tree_attention_forward(attn, q, q, q, torch.ones(1, 1, 4, 4, dtype=torch.bool), prefix_tree=tree)
    with pytest.raises(ValueError, match="sliding_window = 2"):
        hf.tree_attention_forward(attn, q, q, q, None, sliding_window=2, prefix_tree=tree)
    hf.tree_attention_forward(attn, q, q, q, None, sliding_window=3, prefix_tree=tree)  # depth 2 < 3: exact
    with pytest.raises(ValueError, match="softcapping"):
        hf.tree_attention_forward(attn, q, q, q, None, softcap=30.0, prefix_tree=tree)


def test_register_tree_backend(name):
    """A named backend is bound into the registered function: the dense fp64
    reference gives what sdpa (auto) gives."""
    assert hf.register_tree("seqpack_tree_reference", backend="reference") == "seqpack_tree_reference"
    tree = seqpack.pack_prefix_tree(ROWS, group_ids=GROUPS, pad_to_multiple_of=4)
    model = tiny("qwen2", name)
    dense = tiny("qwen2", "seqpack_tree_reference")
    dense.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(dense(**hf.tree_kwargs(tree)).logits, model(**hf.tree_kwargs(tree)).logits,
                                   rtol=1e-10, atol=1e-12)


def test_calls_without_a_tree_run_the_models_own_attention(name, monkeypatch):
    """One implementation for the model's whole life: padded batches and generation
    (KV cache) run SDPA with SDPA's mask, bit for bit; a tree call builds no mask."""
    from transformers.masking_utils import AttentionMaskInterface

    built = []
    sdpa_mask = AttentionMaskInterface._global_mapping["sdpa"]
    monkeypatch.setitem(AttentionMaskInterface._global_mapping, "sdpa",
                        lambda *a, **k: built.append(1) or sdpa_mask(*a, **k))
    model, ref = tiny("qwen2", name), tiny("qwen2", "sdpa")
    ref.load_state_dict(model.state_dict())
    ids = torch.tensor([[1, 1, 5, 6, 7], [3, 4, 5, 6, 7]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, ref(input_ids=ids, attention_mask=mask).logits)
        assert built
        out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, use_cache=True)
        assert torch.equal(out, ref.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, use_cache=True))
        built.clear()
        model(**hf.tree_kwargs(seqpack.pack_prefix_tree(ROWS)))
        assert not built  # the tree's depth positions never became a [T, T] packed-sequence mask


def test_gradient_checkpointing_recomputes_on_the_tree(name):
    tree = seqpack.pack_prefix_tree(ROWS, group_ids=GROUPS)
    grads = []
    for checkpointing in (False, True):
        model = tiny("llama", name, seed=2).train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        (-seqpack.token_logprobs(model(**hf.tree_kwargs(tree)).logits[0], tree).logprobs.sum()).backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_other_fallbacks_and_switching_a_loaded_model():
    model = tiny("llama", "eager")
    ref = tiny("llama", "eager")
    assert hf.use_tree_attention(model) == "eager" and model.config._attn_implementation == "seqpack_tree_eager"
    assert hf.use_tree_attention(model) == "seqpack_tree_eager"  # on a tree implementation already: left as is
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)  # the model's own eager
    hf.restore_attention(model, "eager")
    assert model.config._attn_implementation == "eager"
    with pytest.raises(ValueError, match="fallback"):
        hf.register_tree(fallback="no_such_attention")
    with pytest.raises(ValueError, match="tree implementation itself"):
        hf.register_tree(fallback="seqpack_tree")


def test_gemma2_soft_capping_is_named(name):
    model = tiny("gemma2", name, attn_logit_softcapping=50.0)
    with pytest.raises(ValueError, match="soft"):
        model(**hf.tree_kwargs(seqpack.pack_prefix_tree(ROWS)))


def test_flash_models_get_the_tree_over_sdpa_and_models_that_cannot_switch_are_named():
    model = tiny("llama", "sdpa")
    model.config._attn_implementation = "flash_attention_2"  # as loaded on a GPU (no kernel needed to switch)
    with pytest.warns(UserWarning, match="'flash_attention_2'.*run 'sdpa'"):
        assert hf.use_tree_attention(model) == "flash_attention_2"
    assert model.config._attn_implementation == "seqpack_tree"
    with pytest.raises(ValueError, match="loads flash"):
        hf.register_tree(fallback="flash_attention_2")
    stuck = tiny("llama", "sdpa")
    stuck._can_set_attn_implementation = lambda: False
    with pytest.raises(ValueError, match="cannot switch its attention implementation"):
        hf.use_tree_attention(stuck)


# ---- a tree larger than the cap, in passes (issue 52) --------------------------------------
def _nll_and_grads_in_passes(model, tree, cap, memory):
    model.zero_grad(set_to_none=True)
    total = 0.0
    for mb in seqpack.prefix_reuse(seqpack.split_prefix_tree(tree, cap), memory=memory, forward=hf.pass_forward):
        loss = -seqpack.token_logprobs(mb.forward(model), mb.layout).logprobs.sum()
        loss.backward()
        total += float(loss.detach())
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral", "gemma"])
def test_passes_equal_the_tree_in_one_micro_batch(kind, name, fp64_norms):
    rows = [r * 3 for r in ROWS]  # longer rows: prefixes of 9 to 15 tokens
    tree = seqpack.pack_prefix_tree(rows, group_ids=GROUPS)
    model = tiny(kind, name, seed=3).train()
    model.zero_grad()
    whole = -seqpack.token_logprobs(model(**hf.tree_kwargs(tree)).logits[0], tree).logprobs.sum()
    whole.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    for cap, memory in ((6, "activations"), (4, "kv")):
        loss, grads = _nll_and_grads_in_passes(model, tree, cap, memory)
        assert abs(loss - float(whole)) < 1e-10 * abs(float(whole))
        for n, g in grads.items():
            rel_close(g, expected[n], 1e-11, (kind, cap, memory, n))


@pytest.mark.parametrize("memory", ["activations", "kv"])
def test_passes_under_gradient_checkpointing(name, memory, fp64_norms):
    rows = [r * 3 for r in ROWS]
    tree = seqpack.pack_prefix_tree(rows, group_ids=GROUPS)
    model = tiny("llama", name, seed=4).train()
    model.zero_grad()
    (-seqpack.token_logprobs(model(**hf.tree_kwargs(tree)).logits[0], tree).logprobs.sum()).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _, grads = _nll_and_grads_in_passes(model, tree, 5, memory)
    for n, g in grads.items():
        rel_close(g, expected[n], 1e-11, n)
    model.gradient_checkpointing_disable()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(RuntimeError, match="reentrant gradient checkpointing"):  # the prefix's layers under no_grad
        _nll_and_grads_in_passes(model, tree, 5, memory)


def test_a_pass_needs_the_tree_attention(name):
    model = tiny("llama", "sdpa")
    passes = seqpack.split_prefix_tree(seqpack.pack_prefix_tree(ROWS, group_ids=GROUPS), 4)
    with pytest.raises(ValueError, match="switch it to seqpack's tree attention first"):
        for mb in seqpack.prefix_reuse(passes, forward=hf.pass_forward):
            mb.forward(model)
