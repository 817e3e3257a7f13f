"""One layout for rows and trees (issue 38, item 1): the TokenLayout interface, its
plans, and every consumer taking either kind through one argument."""

from __future__ import annotations

import pathlib
import pickle
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import seqpack
from seqpack.tensors.layout_kinds import as_layout
from seqpack.tensors.token_layout import TokenLayout
from seqpack.tensors.tree_plans import attention_plan

from test_prefix_tree import forests, options  # noqa: E402 (rootdir-relative test helpers)


def _layouts(forest, opts, pad_multiple):
    rows, groups = forest
    tree = seqpack.pack_prefix_tree(rows, group_ids=groups, **opts)
    packed = seqpack.PackedLayout.from_lengths([len(r) for r in rows], pad_multiple=pad_multiple)
    return rows, tree, packed


@settings(max_examples=120, deadline=None)
@given(forests(), options, st.integers(1, 4))
def test_both_kinds_state_the_same_facts(forest, opts, pad_multiple):
    """Every layout maps each logical token to a physical row holding its position,
    reads every physical row but its pad rows, and moves values both ways."""
    rows, tree, packed = _layouts(forest, opts, pad_multiple)
    for layout in (tree, packed):
        assert isinstance(layout, TokenLayout)
        n, t = layout.num_logical_tokens, layout.num_tokens
        assert n == sum(map(len, rows)) and layout.num_rows == len(rows)
        assert layout.cu_seqlens.tolist() == np.cumsum([0] + [len(r) for r in rows]).tolist()
        assert layout.seq_lens.tolist() == [len(r) for r in rows]
        index = layout.logical_index
        assert index.shape == (n,) and ((0 <= index) & (index < t)).all()
        # A logical token sits at its position in its row, in every layout.
        positions = np.concatenate([np.arange(len(r)) for r in rows] + [np.zeros(0, np.int64)])
        assert layout.position_ids[index].tolist() == positions.tolist()
        # Pad rows are exactly the rows no logical token reads.
        assert sorted(set(range(t)) - set(index.tolist())) == layout.pad_index.tolist()
        assert layout.num_pad_tokens == layout.pad_index.shape[0]
        # Values a function of the prefix round-trip; pad rows get the fill.
        flat = np.array([tok for r in rows for tok in r], dtype=np.int64)
        physical = layout.to_physical(flat, fill=-7)
        assert layout.to_logical(physical).tolist() == flat.tolist()
        assert (physical[layout.pad_index] == -7).all()
        assert layout.shares_tokens == (n > t - layout.num_pad_tokens)
    assert not packed.shares_tokens and packed.rows() is packed


@settings(max_examples=120, deadline=None)
@given(forests(), options)
def test_a_tree_that_shares_nothing_is_plain_packing(forest, opts):
    """rows() is the plain packing of the tree's physical tokens exactly when no token
    is shared: the same positions, each row's tokens back to back, each pad alone."""
    rows, tree, _ = _layouts(forest, opts, 1)
    plain = tree.rows()
    if tree.shares_tokens:
        assert plain is None
        return
    assert plain.num_tokens == tree.num_tokens and plain.num_logical_tokens == tree.num_logical_tokens
    assert plain.position_ids.tolist() == tree.position_ids.tolist()
    assert sorted(plain.logical_index.tolist()) == sorted(tree.logical_index.tolist())
    assert plain.pad_index.tolist() == tree.pad_index.tolist()
    assert plain.max_seqlen_padded <= max([1] + [len(r) for r in rows])


def _qkv(t, hq=4, hk=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(t, h, d, generator=g, dtype=torch.float64, requires_grad=True) for h in (hq, hk, hk)]


def _rows_alone(rows_qkv, lens):
    """Each row run alone: causal SDPA in fp64."""
    outs = []
    for q, k, v in zip(*(torch.split(x, lens) for x in rows_qkv)):
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], 1) for x in (k, v))
        o = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                             is_causal=True)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs) if outs else rows_qkv[0][:0]


@settings(max_examples=40, deadline=None)
@given(forests(max_rows=6), options, st.integers(1, 4), st.sampled_from(["auto", "sdpa", "varlen", "reference"]))
def test_tree_attention_of_any_layout_equals_the_rows_alone(forest, opts, pad_multiple, backend):
    """fp64: tree_attention over either layout, at the logical tokens, is every row's
    causal attention run alone (forward and the gradients of q, k and v)."""
    rows, tree, packed = _layouts(forest, opts, pad_multiple)
    lens = [len(r) for r in rows]
    # Values at a shared token are the same in every row through it: drawn per physical token.
    logical = [tree.to_logical(x).detach().requires_grad_(True) for x in _qkv(tree.num_tokens, seed=len(lens))]
    want = _rows_alone(logical, lens)
    grads = torch.autograd.grad(want.pow(2).sum(), logical) if want.numel() else None
    for layout in (tree, packed):
        physical = [layout.to_physical(x.detach()).requires_grad_(True) for x in logical]
        got = layout.to_logical(seqpack.attention(*physical, layout, backend=backend))
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
        if grads is not None:
            got.pow(2).sum().backward()
            for x, g in zip(physical, grads):  # a physical token's gradient: the sum over the rows through it
                torch.testing.assert_close(x.grad, _sum_to_physical(g, layout), rtol=1e-9, atol=1e-10)


def _sum_to_physical(g, layout):
    out = torch.zeros(layout.num_tokens, *g.shape[1:], dtype=g.dtype)
    return out.index_add(0, torch.from_numpy(np.array(layout.logical_index)), g)


def test_rows_that_share_nothing_run_plain_packing_kernels(monkeypatch):
    """A PackedLayout, and a tree with nothing shared, reach varlen_attention once
    with the rows' offsets and build no tree plan; a tree that shares does not."""
    from seqpack.training import attention_tree, attention_varlen

    calls = []
    real = attention_varlen.varlen_attention
    for module in (attention_tree, attention_varlen):
        monkeypatch.setattr(module, "varlen_attention", lambda *a, **kw: calls.append(a[3]) or real(*a, **kw))
    packed = seqpack.PackedLayout.from_lengths([3, 5, 1], pad_multiple=4)
    q, k, v = _qkv(packed.num_tokens)
    seqpack.attention(q, k, v, packed)
    assert [c.tolist() for c in calls] == [[0, 4, 12, 16]]
    tree = seqpack.pack_prefix_tree([[1, 2, 3], [4, 5]], pad_to_multiple_of=4)
    calls.clear()
    q, k, v = _qkv(tree.num_tokens)
    seqpack.attention(q, k, v, tree, backend="sdpa")
    assert [c.tolist() for c in calls] == [[0, 3, 5, 6, 7, 8]] and "attention" not in tree.planned()
    shared = seqpack.pack_prefix_tree([[1, 2, 3], [1, 2, 4]])
    calls.clear()
    q, k, v = _qkv(shared.num_tokens)
    seqpack.attention(q, k, v, shared, backend="sdpa")
    assert calls == [] and "attention" in shared.planned()


def test_the_tiny_model_runs_either_layout_through_one_method():
    from seqpack.testing.tiny_model import TinyCausalLM, TinyConfig

    torch.manual_seed(0)
    model = TinyCausalLM(TinyConfig(vocab_size=16, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1)).double()
    ids = torch.tensor([[1, 2, 3, 4, 0], [5, 6, 0, 0, 0]])
    batch = seqpack.pack_sequences({"input_ids": ids}, seq_lens=[4, 2], pad_multiple=4)
    via_layout = model.forward_layout(batch["input_ids"], batch.layout)
    torch.testing.assert_close(via_layout, model.forward_packed(batch), rtol=1e-12, atol=1e-12)
    tree = seqpack.pack_prefix_tree([[1, 2, 3, 4], [1, 2, 7]])
    torch.testing.assert_close(model.forward_layout(torch.tensor(tree.input_ids), tree), model.forward_tree(tree),
                               rtol=0, atol=0)


def test_log_probs_take_a_tree_that_shares_nothing_as_its_rows():
    tree = seqpack.pack_prefix_tree([[1, 2, 3], [4, 5]], pad_to_multiple_of=4)
    logits = torch.randn(tree.num_tokens, 8, dtype=torch.float64)
    ids = torch.tensor(tree.input_ids)
    got = seqpack.token_logprobs(logits, tree.rows(), ids).logprobs
    by_tree = seqpack.token_logprobs(logits, tree).logprobs
    torch.testing.assert_close(tree.to_logical(got), by_tree, rtol=1e-12, atol=1e-12)
    shared = seqpack.pack_prefix_tree([[1, 2, 3], [1, 2, 4]])
    from seqpack.training.logprobs import packed_token_logprobs

    with pytest.raises(TypeError, match="share tokens.*seqpack.token_logprobs"):
        packed_token_logprobs(torch.randn(shared.num_tokens, 8), torch.tensor(shared.input_ids), shared)


def test_the_loss_wrapper_takes_a_packed_batch_as_its_layout():
    from seqpack.training.loss import SequencePackingLossWrapper

    ids = torch.tensor([[1, 2, 3, 4, 0], [5, 6, 0, 0, 0]])
    batch = seqpack.pack_sequences({"input_ids": ids}, seq_lens=[4, 2], pad_multiple=4)
    loss = seqpack.NLLLoss()
    by_batch = SequencePackingLossWrapper(loss, cu_seqlens_q=batch)
    by_offsets = SequencePackingLossWrapper(loss, cu_seqlens_q=batch.layout.cu_seqlens,
                                            cu_seqlens_q_padded=batch.layout.cu_seqlens_padded)
    assert by_batch.cu.tolist() == by_offsets.cu.tolist() and by_batch.cu_padded.tolist() == by_offsets.cu_padded.tolist()
    with pytest.raises(ValueError, match="cu_seqlens_q_padded only with plain offsets"):
        SequencePackingLossWrapper(loss, cu_seqlens_q=batch.layout, cu_seqlens_q_padded=[0, 4, 8])


def test_as_layout_takes_what_seqpack_takes_in_place_of_a_layout():
    layout = seqpack.PackedLayout.from_lengths([3, 5], pad_multiple=4)
    batch = seqpack.pack_sequences(torch.arange(10).view(2, 5), seq_lens=[3, 5], pad_multiple=4)
    assert as_layout(layout) is layout and as_layout(batch) is batch.layout
    assert as_layout(batch).cu_seqlens_padded.tolist() == layout.cu_seqlens_padded.tolist()
    assert as_layout(np.array([0, 3, 8]), cu_seqlens_padded=[0, 4, 12]) == seqpack.PackedLayout.from_offsets(
        [0, 3, 8], [0, 4, 12])
    assert as_layout(torch.tensor([0, 3, 8], dtype=torch.int32)).cu_seqlens.tolist() == [0, 3, 8]
    with pytest.raises(TypeError, match="layout must be a layout"):
        as_layout([[1, 2], [3]])
    with pytest.raises(TypeError, match="layout must be a layout"):
        as_layout("0,3,8")
    with pytest.raises(ValueError, match="cu_seqlens_padded only with plain offsets"):
        as_layout(layout, cu_seqlens_padded=[0, 4, 12])


def test_plans_pickle_with_either_layout_and_are_checked():
    tree = seqpack.pack_prefix_tree([[1, 2, 3], [1, 2, 4]])
    plan = attention_plan(tree)
    back = pickle.loads(pickle.dumps(tree))
    assert "attention" in back.planned() and back.host_plan("attention", None).k_index.tolist() == plan.k_index.tolist()
    # A tree's plan smuggled into a packed layout's pickle is refused, not adopted.
    layout = seqpack.PackedLayout.from_lengths([2, 2])
    layout._plans["attention"] = plan
    with pytest.raises(TypeError, match="must be a PrefixTreeBatch"):
        pickle.loads(pickle.dumps(layout))
    # A plan that cannot be checked never travels; one forced into a pickle is refused.
    layout = seqpack.PackedLayout.from_lengths([2, 2])
    reduce = layout.__reduce__()
    with pytest.raises(TypeError, match="cannot be checked"):
        reduce[0](*reduce[1][:3], {"x": np.arange(3)})


# ---- the rule: outside the layout module nothing branches on a layout's kind ----------
_KINDS = r"(PrefixTreeBatch|PackedLayout|PackedBatch|TokenLayout)"


def test_no_consumer_branches_on_the_layout_kind():
    root = pathlib.Path(seqpack.__file__).parent
    offenders = []
    for path in sorted(root.rglob("*.py")):
        if path.name in ("token_layout.py", "layout_kinds.py"):
            continue
        for no, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(rf"isinstance\([^)]*\b{_KINDS}\b", line) and "isinstance(other" not in line:
                offenders.append(f"{path.relative_to(root)}:{no}: {line.strip()}")
    assert not offenders, "branch through the layout (seqpack.tensors.layout_kinds), not on its type:\n" + \
        "\n".join(offenders)


def test_varlen_attention_takes_a_layout_of_rows_alone():
    batch = seqpack.pack_sequences(torch.arange(10).view(2, 5), seq_lens=[3, 5], pad_multiple=4)
    q, k, v = _qkv(batch.num_tokens)
    cu, longest = batch.cu_seqlens_padded, batch.max_seqlen_padded
    want = seqpack.varlen_attention(q, k, v, cu, cu, longest, longest)
    torch.testing.assert_close(seqpack.varlen_attention(q, k, v, batch), want, rtol=0, atol=0)
    torch.testing.assert_close(seqpack.varlen_attention(q, k, v, batch.layout), want, rtol=0, atol=0)
    tree = seqpack.pack_prefix_tree([[1, 2, 3], [4, 5]])
    q, k, v = _qkv(tree.num_tokens)
    torch.testing.assert_close(seqpack.varlen_attention(q, k, v, tree), seqpack.attention(q, k, v, tree),
                               rtol=0, atol=0)
    shared = seqpack.pack_prefix_tree([[1, 2, 3], [1, 2, 4]])
    q2, k2, v2 = _qkv(shared.num_tokens)  # a layout as cu_seqlens_q: seqpack.attention on it
    torch.testing.assert_close(seqpack.varlen_attention(q2, k2, v2, shared), seqpack.attention(q2, k2, v2, shared),
                               rtol=0, atol=0)
    with pytest.raises(ValueError, match="give no cu_seqlens_k"):
        seqpack.varlen_attention(q, k, v, tree, [0, 3, 5])
    with pytest.raises(ValueError, match="causal=True and no window"):
        seqpack.varlen_attention(q, k, v, tree, causal=False)
    with pytest.raises(TypeError, match="needs cu_seqlens_k"):
        seqpack.varlen_attention(q, k, v, [0, 3, 5])


def test_megatron_params_of_any_layout_whose_rows_share_nothing():
    layout = seqpack.PackedLayout.from_lengths([3, 5], pad_multiple=4)
    assert layout.packed_seq_params() == layout.packed_seq_params()
    tree = seqpack.pack_prefix_tree([[1, 2, 3], [4, 5]], pad_to_multiple_of=4)
    params = tree.packed_seq_params()
    assert params.qkv_format == "thd" and params.cu_seqlens_q_padded.tolist() == [0, 3, 5, 6, 7, 8]
    assert params.cu_seqlens_q.tolist() == [0, 3, 5, 5, 5, 5]
    with pytest.raises(TypeError, match="share tokens.*seqpack.attention"):
        seqpack.pack_prefix_tree([[1, 2, 3], [1, 2, 4]]).packed_seq_params()


@pytest.mark.parametrize("fused", [False, True])
def test_tree_log_probs_of_rows_that_share_nothing_run_the_packed_kernels(fused):
    """No targets plan, the packed operator, the same values as the rows packed plainly
    (fp64, log-probs and entropies, gradients)."""
    rows = [[1, 2, 3, 0], [4, 5], [6]]
    tree = seqpack.pack_prefix_tree(rows, pad_to_multiple_of=4)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tree.num_tokens, 8, generator=g, dtype=torch.float64, requires_grad=True)
    head = torch.randn(7, 8, generator=g, dtype=torch.float64)
    if fused:
        got = seqpack.token_logprobs(hidden, tree, weight=head, return_entropy=True)
    else:
        got = seqpack.token_logprobs(hidden @ head.T, tree, return_entropy=True)
    assert "targets" not in tree.planned()
    flat = torch.tensor([t for r in rows for t in r])
    cu = np.cumsum([0] + [len(r) for r in rows])
    want = seqpack.token_logprobs(tree.to_logical(hidden) @ head.T, cu, flat, return_entropy=True)
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.entropy, want.entropy, rtol=1e-12, atol=1e-12)
    (grad,) = torch.autograd.grad(got.logprobs.sum() + got.entropy.sum(), hidden)
    (grad_want,) = torch.autograd.grad(want.logprobs.sum() + want.entropy.sum(), hidden)
    torch.testing.assert_close(grad, grad_want, rtol=1e-12, atol=1e-12)


def test_a_plan_built_for_another_layout_of_the_same_sizes_is_refused():
    # Issue 51, finding 10: tree A's pickle carrying tree B's log-prob plan (same
    # sizes, other tokens) loaded, and its log-probs were off by 1.8.
    from seqpack.tensors.prefix_tree import _rebuild
    from seqpack.tensors.tree_plans import tree_targets

    a = seqpack.pack_prefix_tree([[1, 2, 3], [1, 2, 4]])
    b = seqpack.pack_prefix_tree([[5, 6, 7], [5, 6, 8]])
    tree_targets(a), tree_targets(b)
    arrays, pad, plans = b.__reduce__()[1][0], b.__reduce__()[1][1], a._pickled_plans()
    with pytest.raises(ValueError, match="built for another layout"):
        _rebuild(arrays, pad, plans)
    assert pickle.loads(pickle.dumps(b)).planned() == b.planned() == ("targets",)  # its own plans still travel
    plans.pop("identity_digest")  # an older seqpack's pickle: its plans are not adopted, with a warning
    with pytest.warns(UserWarning, match="carry no digest"):
        assert _rebuild(arrays, pad, plans).planned() == ()
