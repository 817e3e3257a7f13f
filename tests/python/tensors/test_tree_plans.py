"""Host plans of a prefix tree (issue 38): attention segments break at branch points
only (chains are one segment, their keys linear), the key rows keep the stated
bound, plans are built once, carried by the tree, pickled with it and checked when
rebuilt, and cross DataLoader workers (fork and spawn)."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import seqpack
from seqpack.tensors import tree_plans
from seqpack.tensors.tree_plans import attention_plan, attention_segments, prepare_tree


@st.composite
def trees(draw):
    """Chains of turns, fans, duplicates, rows inside rows, empty rows, padding."""
    vocab = draw(st.integers(1, 4))
    rows = []
    for _ in range(draw(st.integers(0, 10))):
        base = draw(st.sampled_from(rows)) if rows and draw(st.booleans()) else []
        keep = draw(st.integers(0, len(base)))
        rows.append(base[:keep] + draw(st.lists(st.integers(0, vocab - 1), max_size=6)))
    return seqpack.pack_prefix_tree(rows, min_shared_tokens=draw(st.integers(0, 2)),
                                    pad_to_multiple_of=draw(st.integers(1, 4)))


def _leaves(tree):
    real = tree.num_tokens - tree.num_pad_tokens
    children = np.bincount(tree.parent[:real][tree.parent[:real] >= 0], minlength=real)
    return np.flatnonzero(children == 0)


@settings(max_examples=150, deadline=None)
@given(trees())
def test_attention_segments_break_at_branch_points_only_and_keys_keep_the_bound(tree):
    offsets, parents = attention_segments(tree)
    real = tree.num_tokens - tree.num_pad_tokens
    children = np.bincount(tree.parent[tree.parent >= 0], minlength=tree.num_tokens)
    assert offsets[0] == 0 and offsets[-1] == tree.num_tokens and (np.diff(offsets) > 0).all()
    for s in range(parents.shape[0]):
        a, b = int(offsets[s]), int(offsets[s + 1])
        # inside a segment: a chain, each token the only child of the one before
        assert all(tree.parent[i] == i - 1 and children[i - 1] == 1 for i in range(a + 1, b))
        # it starts at a root, a pad or a child of a branch point
        p = int(tree.parent[a])
        assert a >= real or p < 0 or children[p] != 1
        assert parents[s] == (-1 if p < 0 else np.searchsorted(offsets, p, side="right") - 1)
    plan = attention_plan(tree)
    for s in range(parents.shape[0]):  # the keys of a segment: its last token's ancestors and itself
        last = int(offsets[s + 1]) - 1
        path, node = [], last
        while node >= 0:
            path.append(node)
            node = int(tree.parent[node])
        assert plan.k_index[plan.cu_k[s]:plan.cu_k[s + 1]].tolist() == path[::-1]
    leaves = _leaves(tree)
    leaf_tokens = int((tree.position_ids[leaves] + 1).sum())
    assert plan.num_keys <= 2 * leaf_tokens - real + tree.num_pad_tokens  # docs/prefix_tree.md's bound
    assert plan.num_keys <= real * max(2 * len(leaves) - 1, 0) + tree.num_pad_tokens
    assert plan.plain == bool((parents < 0).all())


def test_a_chain_of_rows_is_one_segment_whose_keys_are_its_tokens():
    """One row per turn, each a prefix of the next (issue 38's quadratic case): one
    attention segment, keys gathered = physical tokens, the plain kernels."""
    rng = np.random.default_rng(0)
    longest = rng.integers(0, 32000, 10_000).tolist()
    cuts = sorted(rng.choice(np.arange(1, 10_000), 24, replace=False).tolist()) + [10_000]
    tree = seqpack.pack_prefix_tree([longest[:c] for c in cuts])
    assert tree.num_tokens == 10_000 and tree.num_segments == 25  # the layout's segments still end at rows
    plan = attention_plan(tree)
    assert plan.segment_offsets.tolist() == [0, 10_000] and plan.num_keys == 10_000 and plan.plain
    # one branch at the end: two segments below the chain, keys linear in the tokens
    branched = seqpack.pack_prefix_tree([longest[:c] for c in cuts] + [longest[:9_000] + [1, 2, 3]])
    plan = attention_plan(branched)
    assert plan.segment_parent.tolist() == [-1, 0, 0]
    assert plan.num_keys == 9_000 + 10_000 + 9_003


def test_the_docstring_example():
    tree = seqpack.pack_prefix_tree([[5, 6], [5, 6, 7, 8], [5, 6, 7, 8, 9], [5, 6, 7, 8, 4]])
    plan = attention_plan(tree)
    assert plan.segment_offsets.tolist() == [0, 4, 5, 6] and not plan.plain
    assert sorted(plan.groups) == [(1, 0, 4), (2, 4, 1)]


def test_plans_are_built_once_and_travel_with_the_tree():
    tree = prepare_tree(seqpack.pack_prefix_tree([[1, 2, 3], [1, 2, 4, 5], [7]], pad_to_multiple_of=4), cp_size=2)
    assert set(tree.planned()) == {"attention", "targets", ("cp", 2, 0), ("cp", 2, 1)}
    plan = attention_plan(tree)
    assert attention_plan(tree) is plan and tree.host_plan("attention", lambda t: 1 / 0) is plan
    for copied in (pickle.loads(pickle.dumps(tree)), copy.deepcopy(tree)):
        assert copied == tree and set(copied.planned()) == set(tree.planned())
        assert attention_plan(copied) == plan and attention_plan(copied) is not plan
        assert tree_plans.tree_targets(copied) == tree_plans.tree_targets(tree)
    # a plan that cannot be checked is not carried: it is built again when needed
    tree.host_plan("mine", lambda t: object())
    assert "mine" not in pickle.loads(pickle.dumps(tree)).planned()


def _tamper(tree, key, edit):
    """The pickle of ``tree`` with the plan ``key`` (or the arrays, key None) edited."""
    fn, (arrays, pads, plans) = tree.__reduce__()
    if key is None:
        edit(arrays)
    else:
        plans[key] = copy.deepcopy(plans[key])
        edit(plans[key])
    return lambda: fn(arrays, pads, plans)


def test_corrupt_pickles_are_refused():
    """Issue 38, item 5: a tampered subtree_end loaded and made two backends disagree;
    a tampered logical_index failed deep inside torch."""
    tree = prepare_tree(seqpack.pack_prefix_tree([[5, 6, 7], [5, 6, 8, 9], [5, 6], [5]], group_ids=[0, 0, 0, 1]),
                        cp_size=2)

    def subtree_end(a):
        a["subtree_end"] = a["subtree_end"].copy()
        a["subtree_end"][2] = 4

    def logical_index(a):
        a["logical_index"] = a["logical_index"].copy()
        a["logical_index"][3] = 4

    def k_index(p):
        p.k_index[0] = 99

    def targets_index(p):
        p.logprob_index[0] = 1000

    def cp_keys(p):
        p.plan["k_index"][0] = -1

    def segments(p):
        p.segment_parent[-1] = 0

    for key, edit, match in [(None, subtree_end, r"parent\[3\] = 1 breaks the depth-first order"),
                             (None, logical_index, r"logical_index\[3\] = 4: row 1 must be a path from a root"),
                             ("attention", k_index, "k_index must hold values in"),
                             ("attention", segments, "does not match its tree's attention segments"),
                             ("targets", targets_index, "logprob_index must hold values in"),
                             (("cp", 2, 1), cp_keys, "key rows must be int64 rows of its tree")]:
        with pytest.raises(ValueError, match=match):
            _tamper(tree, key, edit)()
    with pytest.raises(ValueError, match="subtree_end"):  # the public constructor checks too
        arrays = {k: np.array(v) for k, v in tree._arrays.items()}
        arrays["subtree_end"][0] = 3
        seqpack.PrefixTreeBatch(**arrays)


def _collate_trees(rows):
    return prepare_tree(seqpack.pack_prefix_tree(rows, pad_to_multiple_of=4))


class _Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return [1, 2, 3] + [i] * (1 + i % 3)


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_prepared_trees_cross_dataloader_workers(start):
    """The collate function builds the tree and its plans in the worker; the loop
    receives them built (and checked)."""
    loader = torch.utils.data.DataLoader(_Rows(), batch_size=4, collate_fn=_collate_trees, num_workers=2,
                                         multiprocessing_context=start, timeout=120)
    for k, tree in enumerate(loader):
        want = _collate_trees([_Rows()[i] for i in range(4 * k, 4 * k + 4)])
        assert tree == want and set(tree.planned()) == {"attention", "targets"}
        assert tree._plans["attention"] == attention_plan(want)


def test_device_copies_are_made_once_and_not_pickled():
    tree = seqpack.pack_prefix_tree([[1, 2, 3], [1, 2, 4, 5]])
    plan = attention_plan(tree)
    first = plan.on_device("cpu", "group_q", "group_k", "inverse")
    assert plan.on_device(torch.device("cpu"), "group_q", "group_k", "inverse") is first
    assert torch.equal(first[1], torch.from_numpy(plan.group_k))
    copied = pickle.loads(pickle.dumps(plan))
    assert copied == plan and copied._devices == {}


def _little_shared(pad_to_multiple_of=1):
    """One shared token under three rows of 41: the rows' pairs are 1.0008x the tree's."""
    rng = np.random.default_rng(0)
    rows = [[7] + (rng.permutation(50)[:40] + 100 * i).tolist() for i in range(1, 4)]
    return seqpack.pack_prefix_tree(rows, pad_to_multiple_of=pad_to_multiple_of)


def test_a_tree_that_shares_little_expands_and_its_flag_is_checked():
    from seqpack.tensors.tree_plans import EXPAND_BELOW

    tree = _little_shared()
    m = tree.metrics()
    assert m.attention_ratio < EXPAND_BELOW and tree.shares_tokens
    plan = attention_plan(tree)
    assert plan.expand and not plan.plain and plan.groups == [] and plan.own_rows.shape == (0,)
    assert plan.row_index.tolist() == tree.logical_index.tolist() and plan.max_row == 41
    shared = seqpack.pack_prefix_tree([[1, 2, 3, 4], [1, 2, 3, 5]])
    assert not attention_plan(shared).expand  # 20 pairs against 14: the tree pays

    def flag(p):
        p.expand = False

    def rows(p):
        p.row_index[0] = 1

    for edit, match in [(flag, "expand flag does not match"), (rows, "rows do not match")]:
        with pytest.raises(ValueError, match=match):
            _tamper(tree, "attention", edit)()
