"""A prefix tree's CP shards (issue 29, item 3): ``tree_cp_bounds`` cuts the DFS
layout into contiguous ranges of even attention work, ``tree_cp_local_rows`` takes
a rank's rows (``seqpack.shard_layout(tree, cp, rank)``'s ``bounds`` and
``local_rows``; the functions of ``seqpack.tensors.prefix_tree_cp`` here, ``cp = 1``
included); the gather itself runs on gloo ranks in
training/test_attention_tree_cp.py."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import seqpack
from seqpack.tensors.prefix_tree_cp import rank_major_order, tree_cp_bounds, tree_cp_local_rows, tree_cp_work


def _grpo(prompt, responses):
    return [list(range(1, prompt + 1)) + [100 + 10 * i + j for j in range(n)] for i, n in enumerate(responses)]


def test_the_docstring_example_cuts_by_work_not_tokens():
    tree = seqpack.pack_prefix_tree([[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 8, 9, 10]])
    assert tree_cp_work(tree).tolist() == [1, 2, 3, 4, 5, 6, 7, 5, 6, 7]
    assert tree_cp_bounds(tree, 2).tolist() == [0, 6, 10]  # work 21 / 25 (by tokens: 15 / 31)
    assert tree_cp_bounds(tree, 3).tolist() == [0, 5, 8, 10]  # work 15 / 18 / 13
    assert tree_cp_bounds(tree, 1).tolist() == [0, 10]


def test_more_ranks_than_tokens_leaves_some_empty():
    tree = seqpack.pack_prefix_tree([[7]])
    bounds = tree_cp_bounds(tree, 3)
    assert bounds[0] == 0 and bounds[-1] == 1 and np.all(np.diff(bounds) >= 0)
    empty = seqpack.pack_prefix_tree([])
    assert tree_cp_bounds(empty, 2).tolist() == [0, 0, 0]


@st.composite
def trees(draw):
    groups = draw(st.integers(1, 4))
    rows, group_ids = [], []
    for g in range(groups):
        prompt = draw(st.integers(0, 12))
        for n in draw(st.lists(st.integers(1 if prompt == 0 else 0, 9), min_size=1, max_size=5)):
            rows.append([1000 * g + t for t in range(prompt)] + draw(st.lists(st.integers(0, 3), min_size=n,
                                                                               max_size=n)))
            group_ids.append(g)
    return seqpack.pack_prefix_tree(rows, group_ids=group_ids, pad_to_multiple_of=draw(st.sampled_from([1, 4])))


@settings(max_examples=60, deadline=None)
@given(trees(), st.integers(1, 7))
def test_bounds_cover_the_tree_with_even_work(tree, cp):
    bounds = tree_cp_bounds(tree, cp)
    work = tree_cp_work(tree)
    assert bounds.shape == (cp + 1,) and bounds[0] == 0 and bounds[-1] == tree.num_tokens
    assert np.all(np.diff(bounds) >= 0)
    depth = np.zeros(tree.num_tokens, dtype=np.int64)  # the keys each query sees, from the parents
    for i, p in enumerate(tree.parent.tolist()):
        depth[i] = 0 if p < 0 else depth[p] + 1
    assert np.array_equal(work, depth + 1)
    share = work.sum() / cp
    cum = np.concatenate([[0], np.cumsum(work)])
    for r in range(1, cp):  # every cut within one token's work of its share's edge
        assert abs(cum[bounds[r]] - r * share) <= work.max() / 2 + 1e-9
    # the gather's buffer positions: each token once, inside its rank's padded block
    order = rank_major_order(bounds)
    width = int(np.diff(bounds).max(initial=0))
    assert len(set(order.tolist())) == tree.num_tokens
    ranks = np.repeat(np.arange(cp), np.diff(bounds))
    assert np.all(order // max(width, 1) == ranks)


def test_local_rows_are_the_rank_ranges():
    tree = seqpack.pack_prefix_tree(_grpo(6, [3, 4, 2]), pad_to_multiple_of=4)
    full = torch.arange(tree.num_tokens * 2).view(-1, 2)
    bounds = tree_cp_bounds(tree, 3)
    parts = [tree_cp_local_rows(full, tree, 3, r) for r in range(3)]
    assert torch.equal(torch.cat(parts), full)
    assert all(p.shape[0] == bounds[r + 1] - bounds[r] for r, p in enumerate(parts))
    assert np.array_equal(tree_cp_local_rows(full.numpy(), tree, 3, 1), parts[1].numpy())
    for r in range(3):  # the cut a user takes: seqpack.shard_layout
        cut = seqpack.shard_layout(tree, 3, r)
        assert np.array_equal(cut.bounds, bounds) and torch.equal(cut.local_rows(full), parts[r])


@pytest.mark.parametrize("args, error, match", [
    (dict(cp_size=0), ValueError, "cp_size"),
    (dict(cp_size=2.5), TypeError, "cp_size"),
    (dict(cp_rank=2), ValueError, "cp_rank must be below cp_size = 2"),
    (dict(cp_rank=-1), ValueError, "cp_rank"),
    (dict(full=torch.zeros(3, 2)), ValueError, "one row per physical token"),
    (dict(tree=[[1, 2]]), TypeError, "tree must be a PrefixTreeBatch"),
])
def test_bad_arguments_are_named(args, error, match):
    tree = seqpack.pack_prefix_tree(_grpo(3, [2, 2]))
    call = dict(full=torch.zeros(tree.num_tokens), tree=tree, cp_size=2, cp_rank=0)
    call.update(args)
    with pytest.raises(error, match=match):
        tree_cp_local_rows(call["full"], call["tree"], call["cp_size"], call["cp_rank"])


def test_numpy_and_tensor_scalars_are_accepted():
    tree = seqpack.pack_prefix_tree(_grpo(5, [3, 3]))
    expected = tree_cp_bounds(tree, 2).tolist()
    assert tree_cp_bounds(tree, np.int64(2)).tolist() == expected
    assert tree_cp_bounds(tree, torch.tensor(2)).tolist() == expected
    full = torch.zeros(tree.num_tokens)
    assert tree_cp_local_rows(full, tree, np.int32(2), torch.tensor(1)).shape[0] == expected[2] - expected[1]
