"""PrefixForest: a subset of rows costs what pack_prefix_tree of those rows lays out
(physical tokens, tree attention pairs) for random forests with groups and sharing
thresholds; trees are the rows that share a first token; the constructors agree;
value semantics; clear errors."""

import copy
import pickle

import re

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import seqpack
from seqpack import PrefixForest, pack_prefix_tree


@st.composite
def batches(draw, max_rows=9):
    """Rows over a tiny vocabulary (fresh, or a prefix of an earlier row plus a
    tail), optional groups and a sharing threshold."""
    rows = []
    for _ in range(draw(st.integers(0, max_rows))):
        base = draw(st.sampled_from(rows)) if rows and draw(st.booleans()) else []
        rows.append(base[:draw(st.integers(0, len(base)))] + draw(st.lists(st.integers(0, 2), max_size=5)))
    groups = draw(st.none() | st.lists(st.integers(0, 2), min_size=len(rows), max_size=len(rows)))
    return rows, dict(group_ids=groups, min_shared_tokens=draw(st.integers(0, 3)))


@settings(max_examples=80, deadline=None)
@given(batches(), st.data())
def test_subsets_cost_their_own_prefix_tree(batch, data):
    rows, options = batch
    forest = PrefixForest.from_rows(rows, **options)
    assert forest.num_rows == len(rows)
    assert forest.lengths.tolist() == [len(r) for r in rows]
    assert forest.num_physical_tokens == pack_prefix_tree(rows, **options).num_tokens
    subsets = data.draw(st.lists(st.lists(st.integers(0, max(len(rows) - 1, 0)), max_size=6) if rows
                                 else st.just([]), max_size=5))
    tokens, pairs = forest.subset_costs(subsets)
    for k, subset in enumerate(subsets):
        keep = sorted(set(subset))
        groups = None if options["group_ids"] is None else [options["group_ids"][r] for r in keep]
        tree = pack_prefix_tree([rows[r] for r in keep], group_ids=groups,
                                min_shared_tokens=options["min_shared_tokens"])
        assert tokens[k] == tree.num_tokens and pairs[k] == tree.metrics().tree_attention_pairs
        assert forest.physical_tokens(subset) == tokens[k] and forest.visible_pairs(subset) == pairs[k]


@settings(max_examples=80, deadline=None)
@given(batches())
def test_trees_are_the_rows_sharing_a_first_token(batch):
    rows, options = batch
    forest = PrefixForest.from_rows(rows, **options)
    whole = pack_prefix_tree(rows, **options)
    first = [int(whole.logical_index[whole.cu_seqlens[r]]) if rows[r] else None for r in range(len(rows))]
    trees = forest.trees
    assert len(trees) == forest.num_trees
    assert sorted(np.concatenate(trees).tolist() if trees else []) == list(range(len(rows)))  # each row once
    assert [int(t[0]) for t in trees] == sorted(int(t[0]) for t in trees)  # in order of first row
    for t in trees:
        assert forest.tree_ids[t].tolist() == [forest.tree_ids[t[0]]] * len(t)
    for r in range(len(rows)):
        for s in range(len(rows)):
            same = r == s or (first[r] is not None and first[r] == first[s])
            assert (forest.tree_ids[r] == forest.tree_ids[s]) == same


def test_the_docstring_example_and_grpo_sharing():
    forest = PrefixForest.from_rows([[5, 6, 7], [5, 6, 8, 9], [5, 6], [7]], group_ids=[0, 0, 0, 1])
    assert forest.row_order.tolist() == [2, 0, 1, 3] and forest.adjacent_lcp.tolist() == [0, 2, 2, 0]
    assert forest.num_physical_tokens == 6
    assert [forest.physical_tokens(s) for s in ([0, 1, 2], [1], [0, 2], [2, 3], [])] == [5, 4, 3, 3, 0]
    assert [forest.visible_pairs(s) for s in ([0, 1, 2], [1], [0, 2], [2, 3], [])] == [13, 10, 6, 4, 0]
    # GRPO: 4 prompts x G = 8, prompt 100, response 50: a group costs 100 + 8 * 50.
    rng = np.random.default_rng(0)
    rows, groups = [], []
    for p in range(4):
        prompt = rng.integers(0, 1000, 100)
        rows += [np.concatenate([prompt, rng.integers(0, 1000, 50)]) for _ in range(8)]
        groups += [p] * 8
    forest = PrefixForest.from_rows(rows, group_ids=groups)
    assert forest.num_trees == 4 and forest.num_physical_tokens == 4 * (100 + 8 * 50)
    assert forest.physical_tokens(range(8, 16)) == 500 and forest.physical_tokens([0, 8]) == 300


def test_constructors_agree():
    rows = [[1, 2, 3], [1, 2], [4], [1, 2, 3, 5]]
    want = PrefixForest.from_rows(rows, group_ids=[0, 0, 1, 0])
    width = 5
    ids = np.zeros((4, width), dtype=np.int64)
    mask = np.zeros((4, width), dtype=bool)
    for i, r in enumerate(rows):  # left padding
        ids[i, width - len(r):], mask[i, width - len(r):] = r, True
    assert PrefixForest.from_padded(torch.tensor(ids), torch.tensor(mask), group_ids=[0, 0, 1, 0]) == want
    flat = np.concatenate([np.asarray(r) for r in rows])
    cu = np.cumsum([0] + [len(r) for r in rows])
    assert PrefixForest.from_packed(flat, cu, group_ids=np.array([0, 0, 1, 0])) == want
    assert PrefixForest.from_rows([torch.tensor(r) for r in rows], group_ids=[0, 0, 1, 0]) == want


def test_value_semantics():
    forest = PrefixForest.from_rows([[1, 2, 3], [1, 2, 4], [], [9]])
    for other in (pickle.loads(pickle.dumps(forest)), copy.deepcopy(forest)):
        assert other == forest and other.trees[0].tolist() == [0, 1]
    assert forest != PrefixForest.from_rows([[1, 2, 3], [1, 2, 4]])
    assert repr(forest) == ("PrefixForest(num_rows=4, num_trees=3, num_logical_tokens=7, "
                            "num_physical_tokens=5)")
    with pytest.raises(ValueError):
        forest.row_order[0] = 5  # read-only
    assert seqpack.PrefixForest is PrefixForest and "PrefixForest" in seqpack.__all__


@pytest.mark.parametrize("call, error, match", [
    (lambda f: f.physical_tokens([0, 4]), ValueError, r"row id 4; the forest has 4 rows"),
    (lambda f: f.physical_tokens([-1]), ValueError, "row id -1"),
    (lambda f: f.subset_costs("ab"), TypeError, "subsets must be a list"),
    (lambda f: f.visible_pairs([0.5]), TypeError, "must hold integers"),
    (lambda f: PrefixForest.from_rows([[1, 2]], group_ids=[0, 1]), ValueError, r"one id per row \(1 rows\)"),
    (lambda f: PrefixForest.from_rows([[1, 2]], min_shared_tokens=-1), ValueError, "min_shared_tokens"),
    (lambda f: PrefixForest.from_rows("abc"), TypeError, "rows must be a list"),
    (lambda f: PrefixForest.from_packed([1, 2], [0, 3]), ValueError, "cu_seqlens must end"),
    (lambda f: PrefixForest(row_length=[2, 1], row_order=[0, 0], adjacent_lcp=[0, 0], tree_of_row=[0, 0],
                            num_trees=1, num_nodes=2), ValueError, "permutation"),
    (lambda f: PrefixForest(row_length=[2, 1], row_order=[0, 1], adjacent_lcp=[0, 2], tree_of_row=[0, 0],
                            num_trees=1, num_nodes=2), ValueError, r"adjacent_lcp\[1\] = 2"),
    (lambda f: PrefixForest(row_length=[2], row_order=[0], adjacent_lcp=[0], tree_of_row=[1], num_trees=1,
                            num_nodes=2), ValueError, "tree_of_row"),
    (lambda f: PrefixForest(row_length=[2], row_order=[0], adjacent_lcp=[0], tree_of_row=[0], num_trees=1,
                            num_nodes=3), ValueError, "num_nodes = 3"),
])
def test_bad_inputs_raise(call, error, match):
    forest = PrefixForest.from_rows([[1, 2, 3], [1, 2, 4], [], [9]])
    with pytest.raises(error, match=match):
        call(forest)


# ---- items under a cap ----------------------------------------------------------------
@settings(max_examples=80, deadline=None)
@given(batches(), st.integers(0, 8))
def test_items_place_every_row_once_within_the_cap(batch, slack):
    rows, options = batch
    forest = PrefixForest.from_rows(rows, **options)
    cap = max(1, max((len(r) for r in rows), default=0) + slack)
    items = forest.items(cap)
    placed = np.concatenate(items.rows) if items.rows else np.zeros(0, dtype=np.int64)
    assert sorted(placed.tolist()) == list(range(len(rows)))
    assert (items.tokens <= cap).all()
    tokens, pairs = forest.subset_costs(items.rows)
    assert tokens.tolist() == items.tokens.tolist() and pairs.tolist() == items.pairs.tolist()
    assert items.duplicated_tokens == int(items.tokens.sum()) - forest.num_physical_tokens >= 0
    for t, members in enumerate(forest.trees):
        parts = [k for k in range(items.num_items) if items.tree[k] == t]
        assert sorted(np.concatenate([items.rows[k] for k in parts]).tolist()) == members.tolist()
        if forest.physical_tokens(members) <= cap:
            assert len(parts) == 1  # a tree that fits stays whole
    if items.duplicated_tokens == 0:
        assert items.sharing_kept == 1.0


def test_items_of_a_grpo_group_larger_than_the_cap():
    """One prompt of 100 tokens, 8 responses of 50: 500 tokens. Under a cap of 300
    the group splits in two parts of 4 responses, each carrying the prompt (100
    tokens duplicated once)."""
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 1000, 100)
    rows = [np.concatenate([prompt, rng.integers(0, 1000, 50)]) for _ in range(8)]
    items = PrefixForest.from_rows(rows).items(300)
    assert [len(r) for r in items.rows] == [4, 4] and items.tokens.tolist() == [300, 300]
    assert items.duplicated_tokens == 100 and items.sharing_kept == pytest.approx(500 / 600)
    assert PrefixForest.from_rows(rows).items(500).num_items == 1
    with pytest.raises(ValueError, match=r"row 0 has 150 tokens, more than max_tokens = 149"):
        PrefixForest.from_rows(rows).items(149)
    with pytest.raises(ValueError, match="max_tokens"):
        PrefixForest.from_rows(rows).items(0)
