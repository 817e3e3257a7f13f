"""tree_token_logprobs: equal to seqpack.token_logprobs on the rows packed plainly
(values, entropy, gradients summed onto the physical tokens), the host plan
(tree_targets), reduced precision, scalar temperatures, masked logits, errors."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import seqpack
from seqpack import pack_prefix_tree
from seqpack.tensors.prefix_tree_cp import tree_cp_bounds
from seqpack.training.logprobs_tree import tree_linear_token_logprobs, tree_targets, tree_token_logprobs

VOCAB = 5


# ---- random forests ----------------------------------------------------------------
@st.composite
def forests(draw, max_rows=8):
    """Rows over ids [-1, VOCAB) (-1: "no target"): each a fresh row or a prefix of
    an earlier row plus a fresh tail (chains, fans, duplicates, rows inside rows,
    empty rows), optional groups, padding and sharing thresholds."""
    alphabet = draw(st.integers(1, VOCAB))
    tokens = st.integers(0, alphabet - 1)
    if draw(st.booleans()):
        tokens = tokens | st.just(-1)
    rows = []
    for _ in range(draw(st.integers(0, max_rows))):
        base = draw(st.sampled_from(rows)) if rows and draw(st.booleans()) else []
        keep = draw(st.integers(0, len(base)))
        rows.append(base[:keep] + draw(st.lists(tokens, max_size=6)))
    groups = draw(st.none() | st.lists(st.integers(0, 2), min_size=len(rows), max_size=len(rows)))
    options = dict(group_ids=groups, min_shared_tokens=draw(st.integers(0, 3)),
                   pad_to_multiple_of=draw(st.integers(1, 4)), pad_token_id=draw(st.sampled_from([0, VOCAB + 7])))
    return rows, pack_prefix_tree(rows, **options)


def plain(rows, tree, logits, **kwargs):
    """seqpack.token_logprobs on the rows packed back to back (their offsets as the
    layout), with the logits each logical token reads (logits[logical_index])."""
    ids = torch.tensor([t for row in rows for t in row], dtype=torch.int64)
    return seqpack.token_logprobs(logits[torch.tensor(tree.logical_index)], tree.cu_seqlens, ids, **kwargs)


def random_logits(tree, seed, dtype=torch.float64, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tree.num_tokens, VOCAB, generator=gen, dtype=torch.float64) * 2
    return logits.to(dtype).requires_grad_(requires_grad)


def close(a, b, tol=1e-12):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


# ---- values --------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(forests(), st.sampled_from([1.0, 0.7]), st.integers(0, 2**31))
def test_equals_plain_packing(case, temperature, seed):
    rows, tree = case
    logits = random_logits(tree, seed)
    got = tree_token_logprobs(logits, tree, temperature=temperature, return_entropy=True)
    assert got.logprobs.shape == got.entropy.shape == (tree.num_logical_tokens,)
    assert got.logprobs.dtype == got.entropy.dtype == torch.float64
    if tree.num_logical_tokens == 0:
        return
    want = plain(rows, tree, logits, temperature=temperature, return_entropy=True)
    close(got.logprobs, want.logprobs)
    close(got.entropy, want.entropy)
    assert tree_token_logprobs(logits, tree, temperature=temperature).entropy is None


@settings(max_examples=40, deadline=None)
@given(forests(), st.booleans(), st.integers(0, 2**31))
def test_gradients_are_the_plain_ones_summed_onto_physical_tokens(case, entropy, seed):
    rows, tree = case
    if tree.num_logical_tokens == 0:
        return
    logits = random_logits(tree, seed, requires_grad=True)
    gen = torch.Generator().manual_seed(seed + 1)
    g_lp, g_ent = torch.randn(2, tree.num_logical_tokens, generator=gen, dtype=torch.float64)
    got = tree_token_logprobs(logits, tree, temperature=0.7, return_entropy=entropy)
    loss = (got.logprobs * g_lp).sum() + ((got.entropy * g_ent).sum() if entropy else 0)
    (grad,) = torch.autograd.grad(loss, logits)

    leaf = logits.detach().requires_grad_(True)
    want = plain(rows, tree, leaf, temperature=0.7, return_entropy=entropy)
    loss = (want.logprobs * g_lp).sum() + ((want.entropy * g_ent).sum() if entropy else 0)
    (grad_leaf,) = torch.autograd.grad(loss, leaf)
    close(grad, grad_leaf, tol=1e-10)
    real = tree.num_tokens - tree.num_pad_tokens
    assert not grad[real:].any()  # pad rows: no gradient


BRANCHING = [
    [[1, 2, 3], [1, 2, 4, 0], [1, 2], [1]],                       # the module docstring's shape, a row inside rows
    [[0, 1, 2], [0, 1, 3], [0, 1, 4], [0, 1, 2], [0, 4], [1]],     # a fan of three, a duplicate, two levels
    [[0, 1, 2, 3], [0, 1, 2, 3], [0, 1], [0, 2, -1, 3], [0, 2]],   # a "no target" id after a branch
]


@pytest.mark.parametrize("rows", BRANCHING)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_branch_points_values_and_gradients(rows, dtype):
    """Fixed trees with branch points (the extra targets), fp64 and the fp32 kernels."""
    tree = pack_prefix_tree(rows, pad_to_multiple_of=4)
    assert tree_targets(tree).extra_source.size > 0
    logits = random_logits(tree, 3, dtype=dtype, requires_grad=True)
    g_lp, g_ent = torch.randn(2, tree.num_logical_tokens, generator=torch.Generator().manual_seed(4), dtype=dtype)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    results = []
    for fn in (lambda x: tree_token_logprobs(x, tree, temperature=0.7, return_entropy=True),
               lambda x: plain(rows, tree, x, temperature=0.7, return_entropy=True)):
        leaf = logits.detach().requires_grad_(True)
        out = fn(leaf)
        ((out.logprobs * g_lp).sum() + (out.entropy * g_ent).sum()).backward()
        results.append((out.logprobs, out.entropy, leaf.grad))
    for got, want in zip(*results):
        close(got, want, tol)


@settings(max_examples=25, deadline=None)
@given(forests(), st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), st.integers(0, 2**31))
def test_reduced_precision_matches_fp64(case, dtype, seed):
    """The same (rounded) logits in fp64 give the reference; results are fp32, and
    the gradient comes back in the logits' dtype."""
    rows, tree = case
    logits = random_logits(tree, seed, dtype=dtype, requires_grad=True)
    got = tree_token_logprobs(logits, tree, temperature=0.7, return_entropy=True)
    assert got.logprobs.dtype == got.entropy.dtype == torch.float32
    want = tree_token_logprobs(logits.detach().double(), tree, temperature=0.7, return_entropy=True)
    torch.testing.assert_close(got.logprobs.double(), want.logprobs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.entropy.double(), want.entropy, rtol=1e-5, atol=1e-5)
    if tree.num_logical_tokens:
        (got.logprobs.sum() + got.entropy.sum()).backward()
        assert logits.grad.dtype == dtype and torch.isfinite(logits.grad).all()


# ---- the host plan -------------------------------------------------------------------
def test_branch_point_serves_both_children():
    tree = pack_prefix_tree([[5, 6, 7], [5, 6, 8, 9], [5, 6]])
    plan = tree_targets(tree)
    assert plan.primary.tolist() == [6, 7, -1, 9, -1]
    assert (plan.extra_source.tolist(), plan.extra_target.tolist()) == ([1], [8])
    # logical: r0 = 5 6 7, r1 = 5 6 8 9, r2 = 5 6; 5 = T + E is the zero slot
    assert plan.logprob_index.tolist() == [0, 1, 6, 0, 5, 3, 6, 0, 6]
    assert plan.entropy_index.tolist() == [0, 1, 5, 0, 1, 3, 5, 0, 5]


@settings(max_examples=60, deadline=None)
@given(forests())
def test_plan_has_one_pair_per_distinct_physical_target(case):
    """Every (physical token, next id >= 0) pair of the rows appears exactly once:
    the primary (the smallest id) or an extra; and every logical token reads its own."""
    rows, tree = case
    plan = tree_targets(tree)
    pairs = set()
    for r, row in enumerate(rows):
        base = int(tree.cu_seqlens[r])
        for i in range(len(row) - 1):
            if row[i + 1] >= 0:
                pairs.add((int(tree.logical_index[base + i]), row[i + 1]))
    primary = {(p, int(t)) for p, t in enumerate(plan.primary) if t >= 0}
    extra = list(zip(plan.extra_source.tolist(), plan.extra_target.tolist()))
    assert len(set(extra)) == len(extra) and not primary & set(extra)
    assert primary | set(extra) == pairs
    assert all(t == min(q for p, q in pairs if p == s) for s, t in primary)
    t, e = tree.num_tokens, len(extra)
    for r, row in enumerate(rows):
        for i in range(len(row)):
            n = int(tree.cu_seqlens[r]) + i
            target = row[i + 1] if i + 1 < len(row) else -1
            slot = int(plan.logprob_index[n])
            if target < 0:
                assert slot == t + e and plan.entropy_index[n] == t
            else:
                p = int(tree.logical_index[n])
                assert plan.entropy_index[n] == p
                assert (slot == p and plan.primary[p] == target) or extra[slot - t] == (p, target)


def test_cost_is_one_log_sum_exp_per_physical_token_plus_extras():
    """GRPO-like: 8 samples of a 50-token prompt; the shared prompt's last token
    is the only branch point (8 distinct first completion tokens: 7 extras)."""
    prompt = list(range(50))
    rows = [prompt + [100 + g, 3, 4] for g in range(8)]
    tree = pack_prefix_tree(rows)
    plan = tree_targets(tree)
    assert tree.num_tokens == 50 + 8 * 3
    assert plan.extra_source.tolist() == [49] * 7 and plan.extra_target.tolist() == list(range(101, 108))


# ---- arguments -----------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [np.float32(0.7), torch.tensor(0.7), np.array(0.7), 0.7])
def test_scalar_temperatures(temperature):
    tree = pack_prefix_tree([[1, 2, 3], [1, 2, 4]])
    logits = random_logits(tree, 0)
    want = tree_token_logprobs(logits, tree, temperature=float(temperature))  # a float32 scalar stays float32
    got = tree_token_logprobs(logits, tree, temperature=temperature)
    close(got.logprobs, want.logprobs)


def test_masked_logits_and_empty_trees():
    tree = pack_prefix_tree([[1, 2, 3], [1, 2, 4]])
    logits = random_logits(tree, 1)
    logits[:, 0] = -torch.inf  # a masked vocabulary entry, at every row (the branch point included)
    got = tree_token_logprobs(logits, tree, return_entropy=True)
    want = plain([[1, 2, 3], [1, 2, 4]], tree, logits, return_entropy=True)
    close(got.logprobs, want.logprobs)
    close(got.entropy, want.entropy)
    for rows in ([], [[]], [[], []]):
        empty = pack_prefix_tree(rows, pad_to_multiple_of=4)
        out = tree_token_logprobs(torch.zeros(empty.num_tokens, VOCAB), empty, return_entropy=True)
        assert out.logprobs.shape == out.entropy.shape == (0,)


def test_lazy_exports():
    """The old name is a deprecated alias of the implementation; the one operation is token_logprobs."""
    with pytest.warns(DeprecationWarning, match=r"seqpack\.token_logprobs\(logits, tree\)"):
        assert seqpack.tree_token_logprobs is tree_token_logprobs
    assert "tree_token_logprobs" not in seqpack.__all__ and "token_logprobs" in seqpack.__all__


TREE = pack_prefix_tree([[1, 2, 3], [1, 2, 4]], pad_to_multiple_of=8, pad_token_id=99)  # T = 8


@pytest.mark.parametrize("logits, tree, kwargs, error, match", [
    (torch.zeros(7, VOCAB), TREE, {}, ValueError, r"one row per physical token .*tree.num_tokens = 8.*got 7"),
    (torch.zeros(8), TREE, {}, ValueError, r"logits must be a \[T, V\] tensor"),
    (np.zeros((8, VOCAB)), TREE, {}, TypeError, "logits must be a torch.Tensor"),
    (torch.zeros(8, VOCAB, dtype=torch.int64), TREE, {}, TypeError, "logits must be float32"),
    (torch.zeros(8, 0), TREE, {}, ValueError, r"at least one vocabulary column"),
    (torch.zeros(8, 4), TREE, {}, ValueError, r"id 4 .*physical position 3.*ids must be < 4"),
    (torch.zeros(8, VOCAB), TREE, {"temperature": 0.0}, ValueError, "temperature must be a positive finite"),
    (torch.zeros(8, VOCAB), TREE, {"temperature": float("nan")}, ValueError, "temperature"),
    (torch.zeros(8, VOCAB), TREE, {"temperature": "hot"}, TypeError, "temperature"),
    (torch.zeros(8, VOCAB), [[1, 2, 3]], {}, TypeError, "tree must be a PrefixTreeBatch .*got list"),
])
def test_bad_inputs_raise(logits, tree, kwargs, error, match):
    with pytest.raises(error, match=match):
        tree_token_logprobs(logits, tree, **kwargs)


def test_pad_token_ids_are_not_checked():
    """Pad ids (99 here, outside the vocabulary) are never read as targets."""
    out = tree_token_logprobs(torch.zeros(TREE.num_tokens, VOCAB), TREE)
    assert out.logprobs.shape == (6,)


def test_tree_targets_needs_a_tree():
    with pytest.raises(TypeError, match="tree must be a PrefixTreeBatch"):
        tree_targets({"input_ids": [1]})


# ---- the LM head fused ---------------------------------------------------------------
HEAD_VOCAB, HEAD_DIM = 37, 6


def head_inputs(tree, seed, dtype=torch.float64, bias=True):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tree.num_tokens, HEAD_DIM, generator=gen, dtype=torch.float64)
    weight = torch.randn(HEAD_VOCAB, HEAD_DIM, generator=gen, dtype=torch.float64)
    b = torch.randn(HEAD_VOCAB, generator=gen, dtype=torch.float64) if bias else None
    return [None if t is None else t.to(dtype).requires_grad_(True) for t in (hidden, weight, b)]


def fused_and_unfused(tree, inputs, g_lp, g_ent, **kwargs):
    """(logprobs, entropy, grads of hidden / weight / bias) of the fused path and of
    tree_token_logprobs on the materialised logits."""
    results = []
    for fused in (True, False):
        leaves = [None if t is None else t.detach().requires_grad_(True) for t in inputs]
        hidden, weight, bias = leaves
        chunk = kwargs.pop("chunk_tokens", None) if not fused else kwargs.get("chunk_tokens")
        extra = {k: v for k, v in kwargs.items() if k != "chunk_tokens"}
        if fused:
            out = tree_linear_token_logprobs(hidden, weight, tree, bias=bias, chunk_tokens=chunk, **extra)
        else:
            out = tree_token_logprobs(torch.nn.functional.linear(hidden, weight, bias), tree, **extra)
        loss = (out.logprobs * g_lp).sum() + ((out.entropy * g_ent).sum() if out.entropy is not None else 0)
        loss.backward()
        results.append((out.logprobs, out.entropy, *(t.grad for t in leaves if t is not None)))
    return results


@settings(max_examples=40, deadline=None)
@given(forests(), st.sampled_from([None, 1, 2, 3, 64]), st.booleans(), st.booleans(), st.integers(0, 2**31))
def test_fused_head_equals_the_logits_path(case, chunk, entropy, bias, seed):
    """fp64: values, entropy and the gradients of hidden, weight and bias; chunks of
    rows, and (chunk < rows < V) of vocabulary slices."""
    rows, tree = case
    inputs = head_inputs(tree, seed, bias=bias)
    gen = torch.Generator().manual_seed(seed + 1)
    g_lp, g_ent = torch.randn(2, tree.num_logical_tokens, generator=gen, dtype=torch.float64)
    fused, unfused = fused_and_unfused(tree, inputs, g_lp, g_ent, chunk_tokens=chunk, temperature=0.7,
                                       return_entropy=entropy)
    for got, want in zip(fused, unfused):
        if want is None:
            assert got is None
        else:
            close(got, want, 1e-10)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2), (torch.float16, 4e-3)])
def test_fused_head_reduced_precision(dtype, tol):
    rows = [[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 2, 7], [1, 8], [9]]
    tree = pack_prefix_tree(rows, pad_to_multiple_of=4)
    assert tree_targets(tree).extra_source.size >= 3
    inputs = head_inputs(tree, 5, dtype=dtype)
    g_lp, g_ent = torch.randn(2, tree.num_logical_tokens, generator=torch.Generator().manual_seed(6))
    fused, unfused = fused_and_unfused(tree, inputs, g_lp, g_ent, chunk_tokens=3, return_entropy=True)
    for got, want in zip(fused, unfused):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol)


def test_fused_head_worked_example():
    """Uniform logits over the head's 4 entries; the branch point (token 1 of "1 2")
    predicts 3 and 0 from one log-sum-exp."""
    tree = pack_prefix_tree([[1, 2, 3], [1, 2, 0]])
    hidden, head = torch.zeros(tree.num_tokens, 8), torch.zeros(4, 8)
    out = seqpack.token_logprobs(hidden, tree, weight=head, return_entropy=True)
    assert out.logprobs.tolist() == pytest.approx([-np.log(4)] * 2 + [0.0] + [-np.log(4)] * 2 + [0.0])
    assert out.entropy.tolist() == pytest.approx([np.log(4)] * 2 + [0.0] + [np.log(4)] * 2 + [0.0])


@pytest.mark.parametrize("args, kwargs, error, match", [
    ((torch.zeros(7, 4), torch.zeros(5, 4)), {}, ValueError, r"one row per physical token .*= 8.*got 7"),
    ((torch.zeros(8, 4), torch.zeros(5, 3)), {}, ValueError, r"weight must be the \[V, H = 4\] LM head"),
    ((torch.zeros(8, 4), torch.zeros(0, 4)), {}, ValueError, "at least one vocabulary row"),
    ((torch.zeros(8, 4), torch.zeros(4, 4)), {}, ValueError, r"id 4 .*ids must be < 4"),
    ((torch.zeros(8, 4), torch.zeros(5, 4, dtype=torch.float64)), {}, TypeError, "weight must be torch.float32"),
    ((torch.zeros(8, 4), torch.zeros(5, 4)), {"bias": torch.zeros(4)}, ValueError, r"bias must be \[V = 5\]"),
    ((torch.zeros(8, 4), torch.zeros(5, 4)), {"chunk_tokens": 0}, ValueError, "chunk_tokens"),
    ((torch.zeros(8, 4), torch.zeros(5, 4)), {"num_threads": -1}, ValueError, "num_threads"),
    ((torch.zeros(8, 4), torch.zeros(5, 4)), {"temperature": -1.0}, ValueError, "temperature"),
])
def test_fused_head_bad_inputs_raise(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        tree_linear_token_logprobs(*args, TREE, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_fused_head_chunks_of_rows_with_branch_points(dtype, chunk):
    """More physical tokens than vocabulary entries: the head is tiled by rows, and a
    chunk after the first holds extra targets (the PyTorch fallback for fp64 once read
    their rows from offsets it took to start at 0)."""
    tree = pack_prefix_tree([[1, 2, 3], [1, 2, 0], [1, 3, 2, 1], [1, 3, 0]])
    assert tree_targets(tree).extra_source.tolist() == [0, 1, 4]  # "1", "1 2", "1 3": each predicts two ids
    gen = torch.Generator().manual_seed(chunk)
    hidden = torch.randn(tree.num_tokens, 6, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(True)
    weight = torch.randn(4, 6, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(True)
    fused = tree_linear_token_logprobs(hidden, weight, tree, chunk_tokens=chunk, return_entropy=True)
    got = torch.autograd.grad(fused.logprobs.sum() + fused.entropy.sum(), (hidden, weight))
    plain = tree_token_logprobs(hidden @ weight.T, tree, return_entropy=True)
    want = torch.autograd.grad(plain.logprobs.sum() + plain.entropy.sum(), (hidden, weight))
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    close(fused.logprobs, plain.logprobs, tol)
    for a, b in zip(got, want):
        close(a, b, tol)


# ---- context parallelism: each rank's rows of the tree --------------------------------
@settings(max_examples=50, deadline=None)
@given(forests(), st.integers(1, 4), st.booleans(), st.integers(0, 2**31))
def test_cp_ranks_sum_to_the_whole_tree(case, cp, fused, seed):
    """Every CP rank's log-probs and entropies (its rows of tree_cp_bounds) sum to the
    whole tree's, each value on exactly one rank; its logits' (or hidden states')
    gradient is its rows of the whole gradient, the head's sums over the ranks."""
    rows, tree = case
    gen = torch.Generator().manual_seed(seed + 1)
    g_lp, g_ent = torch.randn(2, tree.num_logical_tokens, generator=gen, dtype=torch.float64)
    inputs = head_inputs(tree, seed)

    def run(x, weight, bias, **cp):
        if fused:
            return tree_linear_token_logprobs(x, weight, tree, bias=bias, chunk_tokens=2, return_entropy=True, **cp)
        return tree_token_logprobs(torch.nn.functional.linear(x, weight, bias), tree, return_entropy=True, **cp)

    whole = [t.detach().requires_grad_(True) for t in inputs]
    ref = run(*whole)
    ((ref.logprobs * g_lp).sum() + (ref.entropy * g_ent).sum()).backward()
    bounds = tree_cp_bounds(tree, cp)
    total_lp, total_ent = torch.zeros_like(ref.logprobs), torch.zeros_like(ref.entropy)
    weight_grad = torch.zeros_like(whole[1])
    for rank in range(cp):
        s, e = int(bounds[rank]), int(bounds[rank + 1])
        hidden = inputs[0].detach()[s:e].requires_grad_(True)
        weight, bias = (t.detach().requires_grad_(True) for t in inputs[1:])
        out = run(hidden, weight, bias, cp_size=cp, cp_rank=rank)
        ((out.logprobs * g_lp).sum() + (out.entropy * g_ent).sum()).backward()
        assert not torch.any((out.logprobs != 0) & (total_lp != 0))  # each value on one rank
        total_lp, total_ent = total_lp + out.logprobs.detach(), total_ent + out.entropy.detach()
        close(hidden.grad, whole[0].grad[s:e], 1e-10)
        weight_grad += weight.grad
    close(total_lp, ref.logprobs.detach(), 1e-12)
    close(total_ent, ref.entropy.detach(), 1e-12)
    close(weight_grad, whole[1].grad, 1e-10)


def test_cp_rows_must_be_the_rank_share():
    tree = pack_prefix_tree([[1, 2, 3, 4], [1, 2, 3, 0]])
    bounds = seqpack.shard_layout(tree, 2, 0).bounds
    logits = torch.zeros(tree.num_tokens, VOCAB)
    with pytest.raises(ValueError, match=r"must hold this CP rank's \d+ rows of the tree"):
        tree_token_logprobs(logits, tree, cp_size=2, cp_rank=1)
    with pytest.raises(ValueError, match="cp_rank must be below cp_size = 2"):
        tree_token_logprobs(logits[: bounds[1]], tree, cp_size=2, cp_rank=2)
    out = tree_token_logprobs(logits[bounds[1]:], tree, cp_size=np.int64(2), cp_rank=torch.tensor(1))
    assert out.logprobs.shape == (tree.num_logical_tokens,)
