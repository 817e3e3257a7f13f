"""MoE models on a prefix tree, counted per row (issue 53, item 1): a tiny Qwen3-MoE,
Mixtral and Qwen2-MoE (shared experts) in fp64 on GRPO rows laid out as a tree
through ``model(**hf.tree_kwargs(tree))`` give the padded rows' load-balancing
``aux_loss`` (each shared prompt token counted once per row, as the rows count it),
its gradient on every parameter, and the rows' logits at every logical token;
``hf.router_counts`` gives the rows' per-expert token counts."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import seqpack  # noqa: E402
from seqpack.integrations import hf  # noqa: E402

ROWS = [[3, 5, 7, 9, 11, 13, 4], [3, 5, 7, 9, 11, 2], [3, 5, 7, 9, 11, 2, 60, 61], [3, 5, 7, 9, 30],
        [40, 41, 42, 43], [40, 41, 42, 44, 45]]
GROUPS = [0, 0, 0, 0, 1, 1]
FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe")


def tiny_moe(kind, seed=0):
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, use_cache=False, tie_word_embeddings=False,
                  output_router_logits=True, router_aux_loss_coef=0.01)
    extra = {"qwen3_moe": dict(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
             "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
             "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                               shared_expert_intermediate_size=48)}[kind]
    cfg = transformers.AutoConfig.for_model(kind, **common, **extra)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=hf.register_tree(),
                                                          dtype=torch.float64, experts_implementation="eager")
    for p in model.parameters():  # larger than the default init, so routing differs visibly between tokens
        torch.nn.init.normal_(p, std=0.2)
    return model.eval()


def padded(rows):
    """The rows right-padded, and their attention mask."""
    pad = torch.nn.utils.rnn.pad_sequence
    return (pad([torch.tensor(r) for r in rows], batch_first=True),
            pad([torch.ones(len(r), dtype=torch.long) for r in rows], batch_first=True))


def run(model, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(**kwargs)
    out.aux_loss.backward(retain_graph=True)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


@pytest.mark.parametrize("pad", [1, 8])
@pytest.mark.parametrize("kind", FAMILIES)
def test_the_aux_loss_and_its_gradient_are_the_rows(kind, pad):
    model = tiny_moe(kind)
    ids, mask = padded(ROWS)
    rows_out, rows_grads = run(model, input_ids=ids, attention_mask=mask)
    tree = seqpack.pack_prefix_tree(ROWS, group_ids=GROUPS, pad_to_multiple_of=pad)
    tree_out, tree_grads = run(model, **hf.tree_kwargs(tree))
    assert tree.num_tokens < tree.num_logical_tokens  # the prompts shared
    torch.testing.assert_close(tree_out.aux_loss, rows_out.aux_loss, rtol=1e-6, atol=0)  # HF sums in fp32
    assert rows_grads.keys() == tree_grads.keys() and any("gate" in n for n in rows_grads)
    for name, grad in rows_grads.items():
        torch.testing.assert_close(tree_grads[name], grad, rtol=1e-5, atol=1e-9, msg=name)
    logical = tree_out.logits[0, torch.tensor(tree.logical_index)]
    torch.testing.assert_close(logical, rows_out.logits[mask.bool()], rtol=1e-10, atol=1e-10)
    # unweighted (one count per physical token) it is not the rows' value: what the weights fix
    plain = model(**{**hf.tree_kwargs(tree), "attention_mask": None}).aux_loss
    assert abs(float((plain - rows_out.aux_loss).detach())) > 1e-6


@pytest.mark.parametrize("kind", FAMILIES)
def test_router_counts_are_the_rows(kind):
    model = tiny_moe(kind, seed=1)
    ids, mask = padded(ROWS)
    top_k = model.config.num_experts_per_tok
    with torch.no_grad():
        rows_logits = model(input_ids=ids, attention_mask=mask).router_logits
        tree = seqpack.pack_prefix_tree(ROWS, group_ids=GROUPS)
        tree_logits = model(**hf.tree_kwargs(tree)).router_logits
    want = hf.router_counts(rows_logits, top_k, mask)
    got = hf.router_counts(tree_logits, top_k, tree)
    assert got.shape == (model.config.num_hidden_layers, want.shape[1])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert float(got.sum()) == top_k * model.config.num_hidden_layers * sum(len(r) for r in ROWS)


def test_the_row_weights_and_what_the_attention_takes():
    tree = seqpack.pack_prefix_tree([[1, 2, 3], [1, 2, 4], [5]], pad_to_multiple_of=8)
    assert tree.row_weights().tolist() == [2, 2, 1, 1, 1, 0, 0, 0]
    model = tiny_moe("qwen3_moe")
    kw = hf.tree_kwargs(tree)
    model(**kw)  # the row weights: accepted
    wrong = kw["attention_mask"].clone()
    wrong[0, 1] = 0  # a real token masked: a padding mask the tree cannot honour
    with pytest.raises(ValueError, match="takes no padding attention_mask"):
        model(**{**kw, "attention_mask": wrong})
    with pytest.raises(ValueError, match="router_logits must be"):
        hf.router_counts(torch.zeros(3, 4), 2, tree)
    from seqpack.frameworks.hf_moe import balancing_loss

    # FSDP2's fully_shard swaps the model's class for one made in torch's module
    sharded = tiny_moe("qwen3_moe")
    sharded.__class__ = type("FSDPQwen3MoeForCausalLM", (type(model),), {"__module__": "torch.distributed.fsdp"})
    assert balancing_loss(model) is not None and balancing_loss(sharded) is balancing_loss(model)


def test_passes_run_without_the_load_balancing_loss_and_refuse_it_when_asked():
    model = tiny_moe("qwen3_moe")  # output_router_logits=True in its config: off in a pass (its logits only)
    passes = seqpack.split_prefix_tree(seqpack.pack_prefix_tree(ROWS, group_ids=GROUPS), 6)
    with torch.no_grad():
        for mb in seqpack.prefix_reuse(passes, forward=hf.pass_forward):
            mb.forward(model)
    with pytest.raises(ValueError, match="does not split over the passes"):
        for mb in seqpack.prefix_reuse(passes, forward=hf.pass_forward):
            mb.forward(model, output_router_logits=True)


def test_capacity_limited_routing_is_refused_by_name():
    # transformers' decoder MoE families route every token (no capacity): a tree drops nothing the rows keep.
    # Token dropping (Switch Transformers' expert_capacity) counts the batch's tokens: refused on a tree.
    model = tiny_moe("qwen3_moe")
    tree = seqpack.pack_prefix_tree(ROWS, group_ids=GROUPS)
    model.config.expert_capacity = 4
    with pytest.raises(ValueError, match="expert_capacity = 4: capacity-limited routing drops tokens"):
        model(**hf.tree_kwargs(tree))
