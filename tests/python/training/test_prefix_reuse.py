"""A shared prefix reused across micro-batches (issue 52): a tree run in passes under
a small cap gives, in fp64, the log-probs, loss and every parameter gradient of the
same tree in one micro-batch and of the rows unshared, in both memory modes; the
step's order is enforced, naming the pass."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import seqpack
from seqpack.testing.tiny_model import TinyCausalLM, TinyConfig

VOCAB = 40


def model_fp64(seed=0, layers=2):
    torch.manual_seed(seed)
    cfg = TinyConfig(vocab_size=VOCAB, hidden_size=32, num_layers=layers, num_heads=4, num_kv_heads=2)
    return TinyCausalLM(cfg).double()


def grpo_rows(groups=2, g=3, prompt=12, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(groups):
        p = list(rng.integers(1, VOCAB, prompt))
        rows += [p + list(rng.integers(1, VOCAB, int(rng.integers(1, 7)))) for _ in range(g)]
    return rows


def agentic_rows(seed=0):
    """Turns of one history, each row the history so far plus a reply, and branches
    off each turn: a prefix shared by many rows, a longer one by fewer."""
    rng = np.random.default_rng(seed)
    history, rows = list(rng.integers(1, VOCAB, 6)), []
    for _ in range(3):
        for _ in range(2):
            rows.append(history + list(rng.integers(1, VOCAB, int(rng.integers(1, 5)))))
        history = history + list(rng.integers(1, VOCAB, 5))
    rows.append(history)
    return rows


def one_micro_batch(model, tree, weights):
    model.zero_grad(set_to_none=True)
    lp = seqpack.token_logprobs(model.forward_tree(tree), tree).logprobs
    (lp * weights).sum().backward()
    return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def in_passes(model, tree, weights, cap, memory, pad=1, **forward):
    model.zero_grad(set_to_none=True)
    total, kinds = torch.zeros_like(weights), []
    for mb in seqpack.prefix_reuse(seqpack.split_prefix_tree(tree, cap), memory=memory, pad_to_multiple_of=pad):
        assert mb.num_local_tokens % pad == 0 and len(mb.input_ids) == mb.num_local_tokens
        lp = seqpack.token_logprobs(mb.forward(model, **forward), mb.layout).logprobs
        total += lp.detach()
        (lp * weights).sum().backward()
        kinds.append(mb.kind)
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}, kinds


def unshared_rows(model, rows, weights):
    """The rows one by one, causal: the reference without any sharing."""
    model.zero_grad(set_to_none=True)
    at, out = 0, []
    for row in rows:
        layout = seqpack.PackedLayout.from_lengths([len(row)])
        ids = torch.tensor(row)
        lp = seqpack.token_logprobs(model.forward_layout(ids, layout), layout, ids).logprobs
        out.append(lp)
        (lp * weights[at:at + len(row)]).sum().backward()
        at += len(row)
    return torch.cat(out).detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same(a, b, tol=1e-11):
    (lp_a, g_a), (lp_b, g_b) = a, b
    assert float((lp_a - lp_b).abs().max()) < tol
    for name in g_b:
        assert float((g_a[name] - g_b[name]).abs().max()) < tol * max(1.0, float(g_b[name].abs().max())), name


@pytest.mark.parametrize("memory", ["activations", "kv"])
@pytest.mark.parametrize("rows_of", [grpo_rows, agentic_rows], ids=["grpo", "agentic"])
def test_passes_equal_one_micro_batch_and_the_rows_unshared(memory, rows_of):
    model, rows = model_fp64(), rows_of()
    tree = seqpack.pack_prefix_tree(rows)
    weights = torch.tensor(np.random.default_rng(1).standard_normal(tree.num_logical_tokens))
    whole = one_micro_batch(model, tree, weights)
    assert_same(unshared_rows(model, rows, weights), whole)
    longest = int(tree.seq_lens.max())
    for cap in (tree.num_tokens, 16, 7, longest - 1, 3, 1):  # the last ones below a row's length
        total, grads, kinds = in_passes(model, tree, weights, cap, memory)
        assert_same((total, grads), whole)
        if cap < tree.num_tokens:
            assert "close" in kinds
    assert seqpack.split_prefix_tree(tree, 3).num_providers > 1  # chunks reading chunks


@pytest.mark.parametrize("backend", ["varlen", "reference"])
def test_the_gathered_keys_path_equals_the_cascade(backend):
    # The CPU runs the cascade (each shared prefix's keys read once); CUDA the varlen
    # path (every sequence's keys gathered): both, on the CPU, against one micro-batch.
    model, rows = model_fp64(), agentic_rows(seed=2)
    tree = seqpack.pack_prefix_tree(rows)
    weights = torch.tensor(np.random.default_rng(4).standard_normal(tree.num_logical_tokens))
    total, grads, _ = in_passes(model, tree, weights, 5, "kv", backend=backend)
    assert_same((total, grads), one_micro_batch(model, tree, weights))


@pytest.mark.parametrize("memory", ["activations", "kv"])
def test_padded_passes_equal_the_unpadded(memory):
    # Each pass's model input padded to a multiple of 4 (TP with sequence parallelism):
    # the pad rows attend to nothing and predict nothing; the results are the unpadded's.
    model, rows = model_fp64(), agentic_rows(seed=3)
    tree = seqpack.pack_prefix_tree(rows)
    weights = torch.tensor(np.random.default_rng(5).standard_normal(tree.num_logical_tokens))
    for cap in (8, 5):
        total, grads, _ = in_passes(model, tree, weights, cap, memory, pad=4)
        assert_same((total, grads), one_micro_batch(model, tree, weights))
    padded = seqpack.split_prefix_tree(tree, 5).passes[0].padded_to(4)
    assert padded.num_local_tokens == 8 and padded.input_ids[5:].tolist() == [0, 0, 0] and padded.pad == 3
    assert pickle.loads(pickle.dumps(padded)) == padded != padded.padded_to(1)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 12), st.sampled_from(["activations", "kv"]))
def test_random_forests_and_caps(seed, cap, memory):
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(int(rng.integers(1, 7))):
        base = rows[int(rng.integers(len(rows)))] if rows and rng.random() < 0.7 else []
        keep = int(rng.integers(0, len(base) + 1))
        rows.append(base[:keep] + list(rng.integers(1, VOCAB, int(rng.integers(1 if keep == 0 else 0, 6)))))
    rows = [r for r in rows if r] or [[1, 2]]
    tree = seqpack.pack_prefix_tree(rows, pad_to_multiple_of=int(rng.integers(1, 4)))
    model = model_fp64(seed=seed % 3, layers=1)
    weights = torch.tensor(rng.standard_normal(tree.num_logical_tokens))
    total, grads, _ = in_passes(model, tree, weights, cap, memory, pad=int(rng.integers(1, 4)))
    assert_same((total, grads), one_micro_batch(model, tree, weights))


def test_without_gradients_the_log_probs_alone():
    model, tree = model_fp64(), seqpack.pack_prefix_tree(grpo_rows())
    with torch.no_grad():
        whole = seqpack.token_logprobs(model.forward_tree(tree), tree).logprobs
        total = sum(seqpack.token_logprobs(mb.forward(model), mb.layout).logprobs
                    for mb in seqpack.prefix_reuse(seqpack.split_prefix_tree(tree, 5)))
    assert float((total - whole).abs().max()) < 1e-12


def test_the_fused_head_and_scored_tokens():
    model, tree = model_fp64(), seqpack.pack_prefix_tree(grpo_rows())
    scored = np.random.default_rng(3).random(tree.num_logical_tokens) < 0.6
    head = model.lm_head.weight

    def hidden(mb_or_tree):
        model.lm_head.forward = lambda x: x  # the model's final hidden states
        try:
            return mb_or_tree.forward(model) if hasattr(mb_or_tree, "kind") else model.forward_tree(mb_or_tree)
        finally:
            del model.lm_head.forward

    whole = seqpack.token_logprobs(hidden(tree), tree, weight=head, scored=scored).logprobs
    with torch.no_grad():
        total = sum(seqpack.token_logprobs(hidden(mb), mb.layout, weight=head, scored=scored).logprobs
                    for mb in seqpack.prefix_reuse(seqpack.split_prefix_tree(tree, 4)))
    assert float((total - whole.detach()).abs().max()) < 1e-12 and (whole[~torch.tensor(scored)] == 0).all()


# ---- the order, enforced --------------------------------------------------------------------------
def _step(cap=4, memory="activations"):
    return seqpack.prefix_reuse(seqpack.split_prefix_tree(seqpack.pack_prefix_tree(grpo_rows()), cap), memory=memory)


def _loss(mb, model):
    return seqpack.token_logprobs(mb.forward(model), mb.layout).logprobs.sum()


def test_a_skipped_micro_batch_raises_by_name():
    model = model_fp64()
    with pytest.raises(RuntimeError, match=r"branch micro-batch of pass \d+ was skipped"):
        for mb in _step():
            if mb.kind == "branch" and mb.index % 2:
                continue
            _loss(mb, model).backward()


def test_a_branch_without_its_backward_raises_before_the_next():
    model = model_fp64()
    with pytest.raises(RuntimeError, match=r"branch pass \d+ ran its forward but not its backward"):
        for mb in _step():
            _loss(mb, model)  # no backward


def test_a_close_without_its_backward_raises():
    model = model_fp64()
    with pytest.raises(RuntimeError, match=r"the close of provider pass \d+ ran its forward but not its backward"):
        for mb in _step():
            loss = _loss(mb, model)
            if mb.kind == "branch":
                loss.backward()


def test_a_close_too_early_or_twice_raises():
    from seqpack.training.prefix_reuse import PassMicroBatch

    model = model_fp64()
    step = _step()
    with pytest.raises(RuntimeError, match=r"branch micro-batch of pass \d+ was skipped"):
        list(step)  # micro-batches run in the loop, one after the other
    step, held = _step(), []
    for mb in step:
        if not held:  # a close reached by hand before its readers ran (the loop never yields one then)
            provider = max(p.index for p in step.passes.passes if p.role == "provider")
            early = PassMicroBatch("close", mb.layout if mb.index == provider else step._bound[provider], step)
            with pytest.raises(RuntimeError, match=rf"provider pass {provider} cannot close yet: passes \[.*\] "
                                                   r"read its K/V"):
                early.forward(model)
        _loss(mb, model).backward()
        held.append(mb)
    with pytest.raises(RuntimeError, match=r"provider pass \d+ is already closed"):
        held[-1].forward(model)
    with pytest.raises(RuntimeError, match="already ran in this step"):
        held[0].forward(model)


def test_a_changed_model_between_passes_raises():
    model = model_fp64()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match=r"parameters changed since the step's first micro-batch .* stale"):
        for mb in _step():
            _loss(mb, model).backward()
            opt.step()  # inside the step: the prefix K/V no longer match the weights
    first, other = model_fp64(), model_fp64(seed=1)
    with pytest.raises(RuntimeError, match="another model than the step's first micro-batch"):
        for n, mb in enumerate(_step()):
            _loss(mb, first if n == 0 else other).backward()
    with pytest.raises(RuntimeError, match="previous step left provider passes"):  # the first step stopped
        for mb in _step():
            _loss(mb, model).backward()


def test_a_step_left_open_stops_the_next_on_that_model():
    model = model_fp64()
    for mb in _step():
        _loss(mb, model).backward()
        break  # the loop stops before the closes: the prefix backward never ran
    with pytest.raises(RuntimeError, match=r"previous step left provider passes \[\d.*\] open"):
        for mb in _step():
            _loss(mb, model).backward()
    model.zero_grad()  # said once: the next step runs
    for mb in _step():
        _loss(mb, model).backward()


def test_a_pass_outside_its_step_raises():
    model, tree = model_fp64(), seqpack.pack_prefix_tree(grpo_rows())
    layout = seqpack.split_prefix_tree(tree, 4).passes[1]
    x = torch.zeros(layout.num_local_tokens, 4, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="not part of a running step"):
        seqpack.attention(x, x[:, :2], x[:, :2], layout)
    step = _step()
    mb = next(iter(step))
    with pytest.raises(RuntimeError, match="outside its mb.forward"):
        seqpack.attention(x[:mb.num_local_tokens], x[:mb.num_local_tokens, :2], x[:mb.num_local_tokens, :2],
                          mb.layout)
    with pytest.raises(TypeError, match="running prefix_reuse step"):
        pickle.dumps(step)
    copied = copy.deepcopy(mb)
    assert copied == mb and copied.layout.runtime is None
    with pytest.raises(RuntimeError, match="a copy outside its running step"):
        copied.forward(model)
    with pytest.raises(RuntimeError, match="runs once"):
        iter(step).__next__() and next(iter(step))
    _ = model


def test_bad_arguments():
    passes = seqpack.split_prefix_tree(seqpack.pack_prefix_tree([[1, 2, 3]]), 2)
    with pytest.raises(TypeError, match="passes must be"):
        seqpack.prefix_reuse(seqpack.pack_prefix_tree([[1, 2, 3]]))
    with pytest.raises(ValueError, match="memory must be one of"):
        seqpack.prefix_reuse(passes, memory="both")
    with pytest.raises(TypeError, match="forward must be callable"):
        seqpack.prefix_reuse(passes, forward=3)
    step = seqpack.prefix_reuse(passes, memory="kv")
    assert pickle.loads(pickle.dumps(step)) == step and copy.deepcopy(step) == step


def test_a_close_needs_a_tensor_output_with_gradients():
    model = model_fp64()

    def as_dict(m, ids, pos, layout):
        return {"logits": m(ids, layout, position_ids=pos)}

    passes = seqpack.split_prefix_tree(seqpack.pack_prefix_tree(grpo_rows()), 4)
    with pytest.raises(TypeError, match=r"the close of provider pass \d+ needs the forward's output as one tensor"):
        for mb in seqpack.prefix_reuse(passes, forward=as_dict):
            out = mb.forward(model)["logits"]
            seqpack.token_logprobs(out, mb.layout).logprobs.sum().backward()
    with torch.no_grad():  # without gradients any output goes (TRL's dict of log-probs)
        with pytest.raises(RuntimeError, match="previous step left"):  # the step above stopped at its close
            for mb in seqpack.prefix_reuse(passes, forward=as_dict):
                mb.forward(model)
        for mb in seqpack.prefix_reuse(passes, forward=as_dict):
            mb.forward(model)


def test_a_model_that_cannot_be_weakly_referenced_still_runs():
    inner = model_fp64()

    class Plain:  # a callable model holding its parameters, no __weakref__
        __slots__ = ()

        def __call__(self, ids, layout, position_ids=None):
            return inner(ids, layout, position_ids=position_ids)

        def parameters(self):
            return inner.parameters()

    tree = seqpack.pack_prefix_tree(grpo_rows())
    weights = torch.ones(tree.num_logical_tokens, dtype=torch.float64)
    plain = Plain()
    inner.zero_grad()
    for mb in seqpack.prefix_reuse(seqpack.split_prefix_tree(tree, 5)):
        (seqpack.token_logprobs(mb.forward(plain), mb.layout).logprobs * weights).sum().backward()
    got = [p.grad.clone() for p in inner.parameters()]
    inner.zero_grad()
    (seqpack.token_logprobs(inner.forward_tree(tree), tree).logprobs * weights).sum().backward()
    assert all(torch.allclose(a, p.grad, atol=1e-12) for a, p in zip(got, inner.parameters()))


@pytest.mark.gpu
@pytest.mark.parametrize("memory", ["activations", "kv"])
def test_passes_on_cuda_equal_one_micro_batch(memory):
    # The CUDA path (each sequence's keys gathered, varlen_attention) against the same
    # tree in one micro-batch on the GPU, fp32.
    torch.manual_seed(0)
    cfg = TinyConfig(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    model = TinyCausalLM(cfg).cuda()
    tree = seqpack.pack_prefix_tree(agentic_rows(seed=5))
    weights = torch.tensor(np.random.default_rng(6).standard_normal(tree.num_logical_tokens), dtype=torch.float32,
                           device="cuda")
    model.zero_grad()
    lp = seqpack.token_logprobs(model.forward_tree(tree), tree).logprobs
    (lp * weights).sum().backward()
    whole, grads = lp.detach(), [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    total = torch.zeros_like(whole)
    for mb in seqpack.prefix_reuse(seqpack.split_prefix_tree(tree, 5), memory=memory):
        lp = seqpack.token_logprobs(mb.forward(model), mb.layout).logprobs
        total += lp.detach()
        (lp * weights).sum().backward()
    torch.testing.assert_close(total, whole, rtol=1e-4, atol=1e-5)
    for a, p in zip(grads, model.parameters()):
        torch.testing.assert_close(p.grad, a, rtol=1e-3, atol=1e-5)


def test_another_steps_layout_inside_a_forward_is_refused():
    # K/V of another tree: a model whose layers are handed the layout of another step
    model = model_fp64()
    other = next(iter(_step(cap=5)))  # a step that never runs a forward

    def foreign(m, ids, pos, layout):
        return m(ids, other.layout if other.num_local_tokens == ids.shape[0] else layout, position_ids=pos)

    step = seqpack.prefix_reuse(seqpack.split_prefix_tree(seqpack.pack_prefix_tree(grpo_rows()), 5), forward=foreign)
    with pytest.raises(RuntimeError, match="a layout of another step or tree"):
        for mb in step:
            _loss(mb, model).backward()


def test_a_dtype_change_between_passes_is_refused():
    model = model_fp64()
    with pytest.raises(RuntimeError, match="dtype/device change"):
        for n, mb in enumerate(_step()):
            if n == 1:
                model.float()  # the K/V of the first pass are fp64
            out = mb.forward(model)
            seqpack.token_logprobs(out, mb.layout).logprobs.sum().backward()
