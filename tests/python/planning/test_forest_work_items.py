"""Work items in a prefix forest (issue 53, item 4: a VLM's images priced once per
micro-batch that holds them): a subset holds each item once when its rows share the
item's tokens, as a brute force over the rows' prefixes says; plans count them in
their workloads and step costs; a tree of a heavy image is not paired with another;
subforests, pickling and equality keep them; bad items are refused by name."""

import copy
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import seqpack
from seqpack import PrefixForest
from test_prefix_forest import batches


def shared(a, b, ga, gb, min_shared):
    """Tokens two rows share under pack_prefix_tree's rule."""
    if ga != gb:
        return 0
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n if n >= max(min_shared, 1) else 0


def items_of(rows):
    """An item wherever a row's prefix hashes so, weighing a function of that prefix:
    rows that share a prefix hold the same items along it."""
    out = []
    for r, row in enumerate(rows):
        for end in range(1, len(row) + 1):
            h = hash(tuple(row[:end])) % 7
            if h < 3:
                out.append((r, end, 10 + h * 13 + end))
    return out


def brute_work(rows, groups, min_shared, items, subset):
    counted, total = [], 0
    for r, end, work in items:
        if r not in subset:
            continue
        if any(end == e and shared(rows[r], rows[q], groups[r], groups[q], min_shared) >= end for q, e in counted):
            continue
        counted.append((r, end))
        total += work
    return total


@settings(max_examples=80, deadline=None)
@given(batches(), st.data())
def test_a_subset_holds_each_item_once(batch, data):
    rows, opts = batch
    items = items_of(rows)
    work_items = tuple(np.array([x[i] for x in items], dtype=np.int64) for i in range(3))
    forest = PrefixForest.from_rows(rows, work_items=work_items, **opts)
    groups = opts["group_ids"] or [0] * len(rows)
    subsets = [data.draw(st.lists(st.integers(0, len(rows) - 1), unique=True)) if rows else []
               for _ in range(4)] + [list(range(len(rows)))]
    got = forest.subset_work(subsets)
    for k, subset in enumerate(subsets):
        assert got[k] == brute_work(rows, groups, opts["min_shared_tokens"], items, set(subset))
    sub = data.draw(st.lists(st.integers(0, len(rows) - 1), unique=True)) if rows else []
    part = forest.subforest(sub)  # the same items, on the chosen rows renumbered
    ordered = sorted(sub)
    assert part.subset_work([list(range(len(ordered)))])[0] == forest.subset_work([ordered])[0]


def four_trees(heavy=10_000):
    """Four trees of a 1-token prompt and 3 responses of 2 tokens (7 tokens each);
    tree 0's prompt holds an item of ``heavy`` work, the others one of 10."""
    rows, groups = [], []
    for t in range(4):
        for r in range(3):
            rows.append([100 + t, 10 * t + r, 1])
            groups.append(t)
    items = ([3 * t for t in range(4)], [1] * 4, [heavy, 10, 10, 10])
    return rows, groups, items


def test_a_heavy_image_is_not_paired_with_another_prompt():
    rows, groups, items = four_trees()
    lengths = [len(r) for r in rows]
    plain = PrefixForest.from_rows(rows, group_ids=groups)
    vision = PrefixForest.from_rows(rows, group_ids=groups, work_items=items)
    # tokens alone: two trees per micro-batch
    plan = seqpack.plan_micro_batches(lengths, 28, forest=plain, attention_coeff=1, min_num=2)
    assert sorted(len(mb) for mb in plan.micro_batches) == [6, 6]
    # the image's work seen: the heavy tree alone, the other three together
    plan = seqpack.plan_micro_batches(lengths, 28, forest=vision, attention_coeff=1, min_num=2)
    assert sorted(len(mb) for mb in plan.micro_batches) == [3, 9]
    heavy = [mb for mb in plan.micro_batches if 0 in mb][0]
    assert sorted(heavy) == [0, 1, 2]
    # each workload: attention_coeff * tokens + 2 * pairs - tokens + the items held once
    tokens, pairs = vision.subset_costs(plan.micro_batches)
    work = vision.subset_work(plan.micro_batches)
    assert list(plan.workloads) == list(tokens + 2 * pairs - tokens + work)
    # a token cap does not see the work
    assert seqpack.plan_micro_batches(lengths, 28, forest=vision, min_num=2).workloads == \
        seqpack.plan_micro_batches(lengths, 28, forest=plain, min_num=2).workloads


def test_step_costs_count_the_items():
    rows, groups, items = four_trees()
    lengths = [len(r) for r in rows]
    cost = seqpack.CostModel(0.0, 1.0, 1.0)
    vision = PrefixForest.from_rows(rows, group_ids=groups, work_items=items)
    step = seqpack.plan_step(lengths, 2, 28, cost=cost, forest=vision)
    cells = [cell for mini in step.assignment for rank in mini for cell in rank]
    costs = [c for mini in step.costs for rank in mini for c in rank]
    tokens, pairs = vision.subset_costs(cells)
    assert np.allclose(costs, tokens + (2 * pairs - tokens) + vision.subset_work(cells))
    assert max(costs) >= 10_000
    assert step.lower_bound <= step.predicted_time


def test_work_items_pickle_compare_and_are_read_only():
    rows, groups, items = four_trees()
    forest = PrefixForest.from_rows(rows, group_ids=groups, work_items=items)
    for copied in (pickle.loads(pickle.dumps(forest)), copy.deepcopy(forest)):
        assert copied == forest and copied.work_items[2].tolist() == [10_000, 10, 10, 10]
    assert forest != PrefixForest.from_rows(rows, group_ids=groups)
    assert forest != PrefixForest.from_rows(rows, group_ids=groups, work_items=(items[0], items[1], [1, 1, 1, 1]))
    with pytest.raises(ValueError):
        forest.work_items[2][0] = 0
    assert PrefixForest.from_rows(rows).work_items is None
    assert PrefixForest.from_rows(rows).subset_work([[0, 1]]).tolist() == [0]


@pytest.mark.parametrize("items, error, match", [
    (([0], [4], [1]), ValueError, r"item_end\[0\] = 4 of row 0 must be in \[1, 3\]"),
    (([0], [0], [1]), ValueError, r"item_end\[0\] = 0 of row 0 must be in \[1, 3\]"),
    (([0], [1], [-1]), ValueError, r"item_work\[0\] must be >= 0"),
    (([12], [1], [1]), ValueError, r"item_row must hold row ids in \[0, 12\)"),
    (([0, 0], [1], [1]), ValueError, "must have one length"),
    ([[0], [1]], TypeError, r"work_items must be \(item_row, item_end, item_work\)"),
    (([0], [1], [2.5]), TypeError, "item_work must hold integers"),
])
def test_bad_work_items_are_refused_by_name(items, error, match):
    rows, groups, _ = four_trees()
    with pytest.raises(error, match=match):
        PrefixForest.from_rows(rows, group_ids=groups, work_items=items)


def test_items_of_a_split_tree_carry_the_prefix_work_in_each_part():
    """A tree larger than the cap is cut into parts, each carrying its prefix, and with
    it the prefix's work item: each part's work, and the whole's once."""
    rows = [[7, 9, 9, k, k] for k in range(1, 7)]  # one prompt "7 9 9" (an image ends at 3), 6 responses
    items = (list(range(6)), [3] * 6, [100] * 6)
    forest = PrefixForest.from_rows(rows, work_items=items)
    parts = forest.items(9)  # 3 + 2 per response: 3 responses a part
    assert parts.num_items == 2 and parts.work.tolist() == [100, 100]
    assert forest.subset_work([range(6)]).tolist() == [100]
    assert PrefixForest.from_rows(rows).items(9).work.tolist() == [0, 0]


def test_cp_step_costs_count_the_items_and_prefix_reuse_refuses_them():
    rows, groups, items = four_trees()
    lengths = [len(r) for r in rows]
    cost = seqpack.CostModel(0.0, 1.0, 1.0)
    vision = PrefixForest.from_rows(rows, group_ids=groups, work_items=items)
    plain = PrefixForest.from_rows(rows, group_ids=groups)
    with_cp = seqpack.plan_step(lengths, 2, 28, cost=cost, forest=vision, cp_size=2)
    without = seqpack.plan_step(lengths, 2, 28, cost=cost, forest=plain, cp_size=2)
    # the heavy tree's image counted (split over its CP pair), and that tree kept alone
    assert with_cp.predicted_time > 10_000 / 2 > without.predicted_time
    assert [0, 1, 2] in [cell for mini in with_cp.assignment for rank in mini for cell in rank]
    with pytest.raises(ValueError, match="prefix_reuse=True: the forest has work items"):
        seqpack.plan_micro_batches(lengths, 8, forest=vision, prefix_reuse=True)
    with pytest.raises(ValueError, match="prefix_reuse=True: the forest has work items"):
        seqpack.plan_step(lengths, 2, 8, forest=vision, prefix_reuse=True)


def test_keys_decide_the_sharing_and_must_match_the_rows():
    rows = [[9, 9, 1], [9, 9, 2]]
    assert PrefixForest.from_rows(rows).num_physical_tokens == 4
    assert PrefixForest.from_rows(rows, keys=[[-1, -1, 1], [-2, -2, 2]]).num_physical_tokens == 6
    with pytest.raises(ValueError, match="keys must have the rows' lengths"):
        PrefixForest.from_rows(rows, keys=[[1], [1, 2, 3, 4]])
    tree = seqpack.PrefixTreeBatch.from_packed([9, 9, 1, 9, 9, 2], [0, 3, 6], keys=[-1, -1, 1, -2, -2, 2])
    assert tree.input_ids.tolist() == [9, 9, 1, 9, 9, 2]
