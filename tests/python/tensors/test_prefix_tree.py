"""Prefix-tree packing (issue 28, step 1): the trie builder and its layout."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import seqpack
from seqpack.tensors.prefix_tree import PrefixTreeBatch, PrefixTreeMetrics, pack_prefix_tree


# ---- random forests ----------------------------------------------------------------
@st.composite
def forests(draw, max_rows=10):
    """Rows from a tiny vocabulary: each a fresh row or a prefix of an earlier row
    plus a fresh tail (chains, fans, duplicates, rows inside rows, empty rows)."""
    vocab = draw(st.integers(1, 4))
    tokens = st.integers(0, vocab - 1)
    rows = []
    for _ in range(draw(st.integers(0, max_rows))):
        base = draw(st.sampled_from(rows)) if rows and draw(st.booleans()) else []
        keep = draw(st.integers(0, len(base)))
        rows.append(base[:keep] + draw(st.lists(tokens, max_size=6)))
    groups = draw(st.none() | st.lists(st.integers(-2, 2), min_size=len(rows), max_size=len(rows)))
    return rows, groups


options = st.fixed_dictionaries({"min_shared_tokens": st.integers(0, 4), "pad_to_multiple_of": st.integers(1, 4)})


def _key(rows, groups, m, r, p):
    """The physical identity of logical token (r, p) by the definition: rows share
    their first lcp tokens when in one group with lcp >= max(m, 1)."""
    row, big = rows[r], max(m, 1)
    group = None if groups is None else groups[r]
    if len(row) < big:
        return ("own", r, p)
    return ("shared", group, tuple(row[:big]), tuple(row[:p + 1]))


def _flat(rows):
    return [t for row in rows for t in row], [(r, p) for r, row in enumerate(rows) for p in range(len(row))]


def _ancestors(parent, i):
    out = set()
    while i >= 0:
        out.add(i)
        i = parent[i]
    return out


@settings(max_examples=150, deadline=None)
@given(forests(), options)
def test_the_tree_matches_its_definition(forest, opts):
    rows, groups = forest
    tree = pack_prefix_tree(rows, group_ids=groups, **opts)
    m, multiple = opts["min_shared_tokens"], opts["pad_to_multiple_of"]
    flat, where = _flat(rows)
    keys = [_key(rows, groups, m, r, p) for r, p in where]
    real = tree.num_tokens - tree.num_pad_tokens
    assert real == len(set(keys))
    assert tree.num_tokens % multiple == 0 and tree.num_pad_tokens < multiple
    li = tree.logical_index
    assert tree.num_logical_tokens == len(flat)
    assert tree.cu_seqlens.tolist() == np.cumsum([0] + [len(r) for r in rows]).tolist()
    for a in range(len(keys)):  # one physical token per key
        for b in range(len(keys)):
            assert (li[a] == li[b]) == (keys[a] == keys[b])
    assert tree.input_ids[li].tolist() == flat
    assert tree.position_ids[li].tolist() == [p for _, p in where]
    for k, (r, p) in enumerate(where):  # each row is a root-to-node chain
        assert tree.parent[li[k]] == (-1 if p == 0 else li[k - 1])
        assert tree.first_logical[li[k]] <= k and li[tree.first_logical[li[k]]] == li[k]
    assert sorted(set(li.tolist())) == list(range(real))
    pads = np.arange(real, tree.num_tokens)
    assert (tree.input_ids[pads] == 0).all() and (tree.parent[pads] == -1).all()
    assert (tree.subtree_end[pads] == pads + 1).all() and (tree.position_ids[pads] == 0).all()


@settings(max_examples=100, deadline=None)
@given(forests(), options)
def test_the_ancestor_rule_and_the_mask_are_the_rows_causal_masks(forest, opts):
    rows, groups = forest
    tree = pack_prefix_tree(rows, group_ids=groups, **opts)
    t, parent = tree.num_tokens, tree.parent.tolist()
    mask = tree.attention_mask()
    assert mask.shape == (t, t) and mask.dtype == bool
    for i in range(t):
        anc = _ancestors(parent, i)
        for j in range(t):
            assert (j <= i < tree.subtree_end[j]) == (j in anc) == bool(mask[i, j])
    expected = np.zeros((t, t), dtype=bool)
    li, cu = tree.logical_index, tree.cu_seqlens
    for r in range(len(rows)):
        phys = li[cu[r]:cu[r + 1]]
        for a in range(len(phys)):
            expected[phys[a], phys[:a + 1]] = True
    pads = np.arange(t - tree.num_pad_tokens, t)
    expected[pads, pads] = True
    np.testing.assert_array_equal(mask, expected)


@settings(max_examples=100, deadline=None)
@given(forests(), options)
def test_segments_partition_the_tokens_into_chains(forest, opts):
    rows, groups = forest
    tree = pack_prefix_tree(rows, group_ids=groups, **opts)
    off, sp, parent = tree.segment_offsets, tree.segment_parent, tree.parent
    assert off[0] == 0 and off[-1] == tree.num_tokens and len(sp) == len(off) - 1 == tree.num_segments
    assert (np.diff(off) > 0).all()
    children = np.bincount(parent[parent >= 0], minlength=tree.num_tokens)
    ends = np.zeros(tree.num_tokens, dtype=bool)
    cu = tree.cu_seqlens
    nonempty = cu[1:] > cu[:-1]
    ends[tree.logical_index[cu[1:][nonempty] - 1]] = True
    seg_of = np.repeat(np.arange(len(sp)), np.diff(off))
    for s in range(len(sp)):
        a, b = off[s], off[s + 1]
        for i in range(a + 1, b):  # inside a segment: the single child, no row ends before
            assert parent[i] == i - 1 and children[i - 1] == 1 and not ends[i - 1]
        p = parent[a]
        assert sp[s] == (-1 if p < 0 else seg_of[p])
        assert p < 0 or children[p] != 1 or ends[p] or p >= tree.num_tokens - tree.num_pad_tokens
    for r in range(len(rows)):  # every row is a path of whole segments
        phys = tree.logical_index[cu[r]:cu[r + 1]]
        if len(phys):
            assert off[seg_of[phys[-1]] + 1] - 1 == phys[-1]


@settings(max_examples=60, deadline=None)
@given(forests(), options, st.permutations(range(10)))
def test_sharing_does_not_depend_on_the_order_of_the_rows(forest, opts, perm):
    rows, groups = forest
    order = [i for i in perm if i < len(rows)]
    a = pack_prefix_tree(rows, group_ids=groups, **opts)
    b = pack_prefix_tree([rows[i] for i in order], group_ids=None if groups is None else [groups[i] for i in order],
                         **opts)
    assert a.num_tokens == b.num_tokens and a.num_segments == b.num_segments
    assert a.metrics().tree_attention_pairs == b.metrics().tree_attention_pairs


@settings(max_examples=60, deadline=None)
@given(forests(), options, st.integers(0, 2**32))
def test_to_logical_and_to_physical_round_trip(forest, opts, seed):
    rows, groups = forest
    tree = pack_prefix_tree(rows, group_ids=groups, **opts)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tree.num_tokens, 3))
    x[tree.num_tokens - tree.num_pad_tokens:] = -1.0
    np.testing.assert_array_equal(tree.to_physical(tree.to_logical(x), fill=-1.0), x)
    flat, where = _flat(rows)
    ids = np.array(flat, dtype=np.int64)
    assert tree.to_logical(tree.to_physical(ids)).tolist() == flat
    np.testing.assert_array_equal(tree.to_physical(ids)[:len(set(tree.logical_index.tolist()))],
                                  tree.input_ids[:tree.num_tokens - tree.num_pad_tokens])


def test_to_physical_and_to_logical_take_tensors_and_keep_gradients():
    torch = pytest.importorskip("torch")
    tree = pack_prefix_tree([[1, 2, 3], [1, 2, 4], [1]], pad_to_multiple_of=8)
    x = torch.randn(tree.num_tokens, 2, dtype=torch.float64, requires_grad=True)
    y = tree.to_logical(x)
    assert y.shape == (tree.num_logical_tokens, 2)
    back = tree.to_physical(y)
    real = tree.num_tokens - tree.num_pad_tokens
    assert torch.equal(back[:real], x[:real]) and (back[real:] == 0).all()
    back.sum().backward()
    assert x.grad[:real].eq(1).all() and x.grad[real:].eq(0).all()


# ---- examples ------------------------------------------------------------------------
def test_the_docstring_example_and_its_segments():
    tree = seqpack.pack_prefix_tree([[5, 6, 7], [5, 6, 8, 9], [5, 6], [5]], group_ids=[0, 0, 0, 1])
    assert tree.position_ids.tolist() == [0, 1, 2, 2, 3, 0]
    assert tree.segment_offsets.tolist() == [0, 2, 3, 5, 6] and tree.segment_parent.tolist() == [-1, 0, 0, -1]
    metrics = tree.metrics()
    assert metrics == PrefixTreeMetrics(num_rows=4, logical_tokens=10, physical_tokens=6, pad_tokens=0,
                                        num_segments=4, plain_attention_pairs=6 + 10 + 3 + 1,
                                        tree_attention_pairs=1 + 2 + 3 + 3 + 4 + 1)
    assert metrics.token_ratio == 10 / 6 and metrics.attention_ratio == 20 / 14
    assert pickle.loads(pickle.dumps(metrics)) == metrics


def test_min_shared_tokens_shares_only_long_common_prefixes():
    rows = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 7], [1, 2], [1, 2]]
    tree = pack_prefix_tree(rows, min_shared_tokens=np.int64(3))
    assert tree.input_ids.tolist() == [1, 2, 3, 4, 5, 1, 2, 7, 1, 2, 1, 2]
    assert pack_prefix_tree(rows).num_tokens == 6
    assert pack_prefix_tree(rows, min_shared_tokens=0) == pack_prefix_tree(rows)


def test_empty_batches_and_empty_rows():
    assert pack_prefix_tree([]).num_tokens == 0 and pack_prefix_tree([]).num_rows == 0
    tree = pack_prefix_tree([[], [], []], pad_to_multiple_of=4)
    assert tree.num_tokens == 0 and tree.cu_seqlens.tolist() == [0, 0, 0, 0]
    assert tree.attention_mask().shape == (0, 0) and tree.metrics().token_ratio == 1.0


def test_pickling_deepcopy_and_equality():
    tree = pack_prefix_tree([[1, 2, 3], [1, 2], [1]], group_ids=[0, 0, 1], pad_to_multiple_of=8)
    for other in (pickle.loads(pickle.dumps(tree)), copy.deepcopy(tree), copy.copy(tree)):
        assert other == tree and other is not tree and repr(other) == repr(tree)
        assert not other.input_ids.flags.writeable
    assert tree != pack_prefix_tree([[1, 2, 3], [1, 2], [1]], pad_to_multiple_of=8)
    assert tree != pack_prefix_tree([[1, 2, 3], [1, 2], [1]], group_ids=[0, 0, 1], pad_to_multiple_of=4)
    assert tree != "a tree"
    with pytest.raises(ValueError):
        tree.input_ids[0] = 7
    with pytest.raises(TypeError):
        hash(tree)


def test_from_padded_and_from_packed_give_the_same_tree():
    rows = [[3, 1, 4], [3, 1], [3, 1, 5, 9], [2]]
    expected = pack_prefix_tree(rows, group_ids=[0, 0, 0, 1], pad_to_multiple_of=2)
    width = 6
    right = np.zeros((4, width), dtype=np.int32)
    left = np.zeros((4, width), dtype=np.int32)
    right_mask = np.zeros((4, width), dtype=bool)
    left_mask = np.zeros((4, width), dtype=np.int64)
    for b, row in enumerate(rows):
        right[b, :len(row)], right_mask[b, :len(row)] = row, True
        left[b, width - len(row):], left_mask[b, width - len(row):] = row, 1
    kw = dict(group_ids=[0, 0, 0, 1], pad_to_multiple_of=2)
    assert PrefixTreeBatch.from_padded(right, right_mask, **kw) == expected
    assert PrefixTreeBatch.from_padded(left, left_mask, **kw) == expected
    flat = [t for row in rows for t in row]
    assert PrefixTreeBatch.from_packed(flat, [0, 3, 5, 9, 10], **kw) == expected
    assert PrefixTreeBatch.from_rows(rows, **kw) == expected
    torch = pytest.importorskip("torch")
    assert PrefixTreeBatch.from_padded(torch.from_numpy(left), torch.from_numpy(left_mask).bool(), **kw) == expected
    assert PrefixTreeBatch.from_packed(torch.tensor([flat]), torch.tensor([0, 3, 5, 9, 10]), **kw) == expected
    assert pack_prefix_tree([torch.tensor(r) for r in rows], group_ids=torch.tensor([0, 0, 0, 1]),
                            pad_to_multiple_of=torch.tensor(2)) == expected


def test_the_dense_mask_is_refused_when_large():
    tree = pack_prefix_tree([list(range(40))])
    assert tree.attention_mask().shape == (40, 40)
    with pytest.raises(ValueError, match="max_tokens = 16"):
        tree.attention_mask(max_tokens=16)


@pytest.mark.parametrize("call, error, match", [
    (lambda: pack_prefix_tree([[1.5, 2.0]]), TypeError, r"rows\[0\] must hold integers"),
    (lambda: pack_prefix_tree([[1, 2], [[1, 2]]]), ValueError, r"rows\[1\] must be 1-D"),
    (lambda: pack_prefix_tree([np.int64(3)]), ValueError, r"rows\[0\] must be 1-D"),
    (lambda: pack_prefix_tree([[1], [1, [2]]]), TypeError, r"rows\[1\]"),
    (lambda: pack_prefix_tree("abc"), TypeError, "rows must be a list"),
    (lambda: pack_prefix_tree(7), TypeError, "rows must be a list"),
    (lambda: pack_prefix_tree([[True, False]]), TypeError, r"rows\[0\] must hold integers"),
    (lambda: pack_prefix_tree([[1]], min_shared_tokens=-1), ValueError, "min_shared_tokens must be >= 0"),
    (lambda: pack_prefix_tree([[1]], min_shared_tokens=1.0), TypeError, "min_shared_tokens"),
    (lambda: pack_prefix_tree([[1]], pad_to_multiple_of=0), ValueError, "pad_to_multiple_of must be positive"),
    (lambda: pack_prefix_tree([[1]], group_ids=[0, 1]), ValueError, r"group_ids must hold one id per row \(1"),
    (lambda: pack_prefix_tree([[1]], group_ids=[0.5]), TypeError, "group_ids must hold integers"),
    (lambda: pack_prefix_tree([[1]], pad_to_multiple_of=2**62), ValueError, "pad_to_multiple_of"),
    (lambda: PrefixTreeBatch.from_packed([1, 2, 3], [0, 2]), ValueError, "cu_seqlens must end at"),
    (lambda: PrefixTreeBatch.from_packed([1, 2, 3], [0, 2, 1, 3]), ValueError, "never decrease"),
    (lambda: PrefixTreeBatch.from_packed([1, 2, 3], [1, 3]), ValueError, "start at 0"),
    (lambda: PrefixTreeBatch.from_packed([1, 2, 3], []), ValueError, "start at 0"),
    (lambda: PrefixTreeBatch.from_packed([[1, 2], [3, 4]], [0, 4]), ValueError, "input_ids must be 1-D"),
    (lambda: PrefixTreeBatch.from_padded([[1, 2]], [[1, 1, 0]]), ValueError, "attention_mask must have the shape"),
    (lambda: PrefixTreeBatch.from_padded([1, 2], [1, 1]), ValueError, "input_ids must be 2-D"),
    (lambda: PrefixTreeBatch.from_padded([[1, 2]], [[0.5, 1.0]]), TypeError, "attention_mask must be bool"),
    (lambda: pack_prefix_tree([[1, 2]]).to_logical(np.zeros(3)), ValueError, r"num_tokens \(T\) = 2"),
    (lambda: pack_prefix_tree([[1, 2]]).to_physical(np.zeros((3, 1))), ValueError, r"num_logical_tokens \(N\) = 2"),
    # issue 38, item 5
    (lambda: pack_prefix_tree([[1, 2]]).to_logical([1, 2, 3]), ValueError, r"= 2 rows along dim 0, got shape \(3,\)"),
    (lambda: pack_prefix_tree([[1, 2]]).to_physical([1]), ValueError, r"= 2 rows along dim 0, got shape \(1,\)"),
    (lambda: pack_prefix_tree([[1, -2**63 - 1]]), ValueError, r"rows\[0\] must fit in int64 .*got -9223372036854775809"),
    (lambda: pack_prefix_tree([[1, 2**63]]), ValueError, r"rows\[0\] must fit in int64 .*got 9223372036854775808"),
    (lambda: pack_prefix_tree([[1]], pad_to_multiple_of=2**40), ValueError, "pad_to_multiple_of: must be at most 2"),
    (lambda: pack_prefix_tree([[1]], pad_to_multiple_of=2**31), ValueError, "pad_to_multiple_of: must be at most 2"),
    (lambda: pack_prefix_tree([[1]], pad_to_multiple_of=2**24 + 1), ValueError, "pad_to_multiple_of"),
])
def test_bad_input_raises_a_clear_error(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_lists_move_between_the_layouts():
    tree = pack_prefix_tree([[1, 2], [1, 3]])
    assert tree.to_logical([10, 11, 12]).tolist() == [10, 11, 10, 12]
    assert tree.to_physical((1, 2, 3, 4)).tolist() == [1, 2, 4]
