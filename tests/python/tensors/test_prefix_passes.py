"""A prefix tree split into passes under a cap (issue 52): every token in one pass,
no pass over the cap, every key a token's root path, read from the passes before."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import seqpack
from seqpack.tensors.prefix_passes import PrefixPasses, TreePass, split_prefix_tree

from test_prefix_tree import _ancestors, forests  # noqa: E402 (rootdir-relative test helpers)


def _trees():
    return st.tuples(forests(max_rows=12), st.integers(1, 4)).map(
        lambda f: seqpack.pack_prefix_tree(f[0][0], group_ids=f[0][1], pad_to_multiple_of=f[1]))


def _visible_keys(p: TreePass):
    """Each own token's keys, by the attention plan: its sequence's keys up to the
    causal diagonal aligned at the end, mapped back to physical tokens."""
    tree = p.tree
    buffer = np.concatenate([p_.own for p_ in _providers(p)] + [p.own]) if p.providers else p.own
    out = {}
    for s in range(p.cu_q.shape[0] - 1):
        q0, q1, k0, k1 = (int(x) for x in (p.cu_q[s], p.cu_q[s + 1], p.cu_k[s], p.cu_k[s + 1]))
        keys = buffer[p.k_index[k0:k1]]
        for j in range(q1 - q0):
            out[int(p.own[q0 + j])] = set(keys[:(k1 - k0) - (q1 - q0) + j + 1].tolist())
    assert len(out) == p.num_local_tokens and tree is p.tree
    return out


def _providers(p: TreePass):
    return [_PASSES[id(p.tree)].passes[q] for q in p.providers]


_PASSES = {}


@settings(max_examples=150, deadline=None)
@given(_trees(), st.integers(1, 12))
def test_every_token_once_no_pass_over_the_cap_and_each_key_a_root_path(tree, cap):
    passes = split_prefix_tree(tree, cap)
    _PASSES[id(tree)] = passes
    seen = np.concatenate([p.own for p in passes.passes]) if passes.passes else np.zeros(0, dtype=np.int64)
    assert sorted(seen.tolist()) == list(range(tree.num_tokens))  # every physical token exactly once
    assert (passes.tokens() <= cap).all() and (passes.tokens() > 0).all()
    where = np.empty(tree.num_tokens, dtype=np.int64)
    for p in passes.passes:
        where[p.own] = p.index
    providers = {p.index for p in passes.passes if p.role == "provider"}
    for p in passes.passes:
        assert all(q < p.index and q in providers for q in p.providers)  # read only earlier providers
        for token, keys in _visible_keys(p).items():
            assert keys == _ancestors(tree.parent, token)  # exactly its root path and itself
            assert {int(where[k]) for k in keys} - {p.index} <= set(p.providers)
        assert p.num_context_pairs == sum(int(where[k] != p.index) for keys in _visible_keys(p).values()
                                          for k in keys)
    # A provider's subtree exceeds the cap; a branch's own tokens are whole subtrees that fit.
    size = tree.subtree_end - np.arange(tree.num_tokens)
    for p in passes.passes:
        assert (size[p.own] > cap).all() if p.role == "provider" else (size[p.own] <= cap).all()
    # The loop's order: each branch once, each provider's close once, after every pass
    # that reads it (a branch, or a later provider's close).
    assert sorted(i for kind, i in passes.order if kind == "close") == sorted(providers)
    assert sorted(i for kind, i in passes.order if kind == "branch") == sorted(
        p.index for p in passes.passes if p.role == "branch")
    at = {i: n for n, (_, i) in enumerate(passes.order)}
    for p in passes.passes:
        assert all(at[q] > at[p.index] for q in p.providers)


def test_the_docstring_tree_and_a_prefix_longer_than_the_cap():
    rows = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 9, 10, 11], [1, 2, 3, 4, 5, 12, 13, 14]]
    tree = seqpack.pack_prefix_tree(rows)
    passes = split_prefix_tree(tree, 6)
    assert [(p.role, p.own.tolist(), p.providers) for p in passes.passes] == [
        ("provider", [0, 1, 2, 3, 4], ()), ("branch", [5, 6, 7, 8, 9, 10], (0,)), ("branch", [11, 12, 13], (0,))]
    assert passes.context_pairs().tolist() == [0, 30, 15]  # each response token reads the 5 prompt keys
    # cap 2: the prompt in chunks of 2, each reading the chunks before it; the
    # responses' first tokens are skeleton too (their subtrees hold 3 tokens)
    passes = split_prefix_tree(tree, 2)
    providers = [p for p in passes.passes if p.role == "provider"]
    assert [p.own.tolist() for p in providers] == [[0, 1], [2, 3], [4, 5], [8, 11]]
    assert [p.providers for p in providers] == [(), (0,), (0, 1), (0, 1, 2)]
    assert passes.order[-4:] == (("close", 3), ("close", 2), ("close", 1), ("close", 0))
    # GRPO groups: each prompt closes right after its responses, before the next group runs
    two = split_prefix_tree(seqpack.pack_prefix_tree(
        [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8], [9, 9, 9, 9, 5, 6], [9, 9, 9, 9, 7, 8]]), 4)
    assert two.order == (("branch", 2), ("close", 0), ("branch", 3), ("close", 1))
    # A row longer than the cap alone: a chain of chunks.
    chain = split_prefix_tree(seqpack.pack_prefix_tree([list(range(1, 11))]), 4)
    assert [(p.role, p.own.tolist()) for p in chain.passes] == [
        ("provider", [0, 1, 2, 3]), ("provider", [4, 5]), ("branch", [6, 7, 8, 9])]


def test_a_tree_that_fits_is_branch_passes_reading_nothing():
    tree = seqpack.pack_prefix_tree([[1, 2, 3], [1, 2, 4], [5, 6]])
    passes = split_prefix_tree(tree, 100)
    assert passes.num_passes == 1 and passes.num_providers == 0 and passes.passes[0].providers == ()
    assert passes.order == (("branch", 0),)
    assert split_prefix_tree(tree, 4).tokens().tolist() == [4, 2] and split_prefix_tree(tree, 4).num_providers == 0
    assert split_prefix_tree(tree, 3).tokens().tolist() == [1, 3, 2]  # the shared 1 alone: a provider


def test_pickling_deepcopy_equality_and_read_only_arrays():
    tree = seqpack.pack_prefix_tree([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8]])
    passes = split_prefix_tree(tree, 3)
    for back in (pickle.loads(pickle.dumps(passes)), copy.deepcopy(passes)):
        assert isinstance(back, PrefixPasses) and back == passes and back.order == passes.order
        for a, b in zip(back.passes, passes.passes):
            assert a == b and np.array_equal(a.k_index, b.k_index) and not a.k_index.flags.writeable
            assert a.runtime is None
    one = pickle.loads(pickle.dumps(passes.passes[1]))
    assert one == passes.passes[1] and not one.own.flags.writeable
    assert passes != split_prefix_tree(tree, 4)


def test_local_rows_and_what_a_pass_predicts():
    tree = seqpack.pack_prefix_tree([[1, 2, 3], [1, 2, 4]])   # physical 1 2 3 4; logical 1 2 3 | 1 2 4
    passes = split_prefix_tree(tree, 1)
    first = passes.passes[0]
    assert first.own.tolist() == [0] and first.predicts().tolist() == [True, False, False, True, False, False]
    assert first.local_rows(torch.arange(4)).tolist() == [0] and first.local_rows(np.arange(4)).tolist() == [0]
    with pytest.raises(ValueError, match=r"one row per physical token of the tree \(4\)"):
        first.local_rows(torch.arange(3))
    total = sum(p.predicts().astype(int) for p in passes.passes)
    assert total.tolist() == [1] * 6  # each logical token predicted by exactly one pass


@pytest.mark.parametrize("tree, cap, error, match", [
    ([[1, 2]], 2, TypeError, "tree must be a PrefixTreeBatch"),
    (None, 0, ValueError, "max_tokens"),
    (None, -3, ValueError, "max_tokens"),
    (None, 2.5, TypeError, "max_tokens"),
])
def test_bad_input_names_the_argument(tree, cap, error, match):
    tree = seqpack.pack_prefix_tree([[1, 2, 3]]) if tree is None else tree
    with pytest.raises(error, match=match):
        split_prefix_tree(tree, cap)


def test_numpy_and_tensor_caps():
    tree = seqpack.pack_prefix_tree([[1, 2, 3, 4], [1, 2, 5, 6]])
    assert split_prefix_tree(tree, np.int32(3)) == split_prefix_tree(tree, torch.tensor(3)) == split_prefix_tree(tree, 3)
