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


def tiny(kind, attn, seed=0):
    cfg_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[kind]
    cfg = cfg_cls(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, use_cache=False, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float64)
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
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tree_logits_equal_rows_alone(kind, reference, name):
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
    """HF's RMSNorm computes in fp32 even in an fp64 model: exact in the forward, but
    its backward then sums a shared token's gradients in fp32 (once in the tree, per
    row alone), a 1e-7 difference. In fp64 throughout they agree to ~1e-15."""
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen2 import modeling_qwen2

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)

    for cls in (modeling_llama.LlamaRMSNorm, modeling_qwen2.Qwen2RMSNorm):
        monkeypatch.setattr(cls, "forward", forward)


def rel_close(a, b, rtol, what):
    err = float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))
    assert err <= rtol, (what, err)


def check_nll_and_gradients(kind, name, rtol):
    tree = seqpack.pack_prefix_tree(ROWS, group_ids=GROUPS)
    model = tiny(kind, name, seed=1)
    ref = tiny(kind, "sdpa", seed=1)  # sdpa: fp64 throughout (eager's softmax is fp32)
    ref.load_state_dict(model.state_dict())

    loss = -seqpack.tree_token_logprobs(model(**hf.tree_kwargs(tree)).logits[0], tree).logprobs.sum()
    loss.backward()
    expected = sum(nll(alone(ref, row), row) for row in ROWS)
    expected.backward()

    torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-10, atol=1e-12)
    grads = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        rel_close(p.grad, grads[n].grad, rtol, n)
    assert tree.num_tokens < tree.num_logical_tokens  # the shared prefixes were forwarded once


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tree_nll_and_gradients_equal_rows_alone(kind, name, fp64_norms):
    check_nll_and_gradients(kind, name, rtol=1e-12)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tree_gradients_stock_models(kind, name):
    """The stock models: their fp32 RMSNorm backward bounds the agreement (~1e-7)."""
    check_nll_and_gradients(kind, name, rtol=1e-5)


def test_tree_kwargs():
    tree = seqpack.pack_prefix_tree([[1, 2, 3], [1, 2, 4]])
    kw = hf.tree_kwargs(tree)
    assert kw["input_ids"].tolist() == [[1, 2, 3, 4]] and kw["position_ids"].tolist() == [[0, 1, 2, 2]]
    assert kw["input_ids"].dtype == kw["position_ids"].dtype == torch.long and kw["prefix_tree"] is tree
    with pytest.raises(TypeError, match="tree must be a PrefixTreeBatch"):
        hf.tree_kwargs([[1, 2]])
    same = tree.hf_kwargs()  # the method the layout contract names
    assert same.keys() == kw.keys() and same["prefix_tree"] is tree
    assert all(torch.equal(same[k], kw[k]) for k in ("input_ids", "position_ids"))


def test_tree_attention_errors(name):
    tree = seqpack.pack_prefix_tree([[1, 2, 3], [1, 2, 4]])
    model = tiny("llama", name)
    attn = model.model.layers[0].self_attn
    with pytest.raises(ValueError, match="prefix_tree"):
        model(input_ids=torch.tensor([[1, 2, 3, 4]]))
    kw = hf.tree_kwargs(tree)
    with torch.no_grad():  # an all-ones mask pads nothing: accepted, the same logits
        torch.testing.assert_close(model(**kw, attention_mask=torch.ones(1, 4, dtype=torch.long)).logits,
                                   model(**kw).logits)
    with pytest.raises(ValueError, match="no padding attention_mask"):
        model(**kw, attention_mask=torch.tensor([[1, 1, 1, 0]]))
    with pytest.raises(ValueError, match="one row of the tree's 4 physical tokens"):
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
