"""Planning prefix reuse (issue 52): whole trees to ranks, each rank's passes by the
one rule the tensors layer cuts with, so the passes a rank builds are the ones
planned; every physical token once a step, no pass over the cap, equal counts."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import seqpack
from seqpack.planning.prefix_reuse import PrefixReusePlan, plan_prefix_reuse


@st.composite
def batches(draw):
    """Rows sharing prefixes (chains, fans, rows inside rows), in groups."""
    rows = []
    for _ in range(draw(st.integers(1, 14))):
        base = draw(st.sampled_from(rows)) if rows and draw(st.booleans()) else []
        keep = draw(st.integers(0, len(base)))
        tail = draw(st.lists(st.integers(0, 3), min_size=0 if keep else 1, max_size=8))
        rows.append(base[:keep] + tail)
    groups = draw(st.none() | st.lists(st.integers(0, 2), min_size=len(rows), max_size=len(rows)))
    return rows, groups


@settings(max_examples=200, deadline=None)
@given(batches(), st.integers(1, 12), st.integers(1, 4), st.integers(0, 2))
def test_the_planned_passes_are_the_ones_each_rank_builds(batch, cap, dp, min_shared):
    rows, groups = batch
    forest = seqpack.PrefixForest.from_rows(rows, group_ids=groups, min_shared_tokens=min_shared)
    plan = plan_prefix_reuse(forest, cap, dp)
    assert sorted(r for rank in plan.rank_rows for r in rank) == list(range(len(rows)))  # every row on one rank
    trees = {int(t) for t in forest.tree_ids}
    for t in trees:  # a tree's rows (and passes) on one rank
        assert len({r for r, rank in enumerate(plan.rank_rows) for x in rank if forest.tree_ids[x] == t}) == 1
    for r, rank in enumerate(plan.rank_rows):
        assert all(n <= cap for n in plan.pass_tokens[r]) and all(n > 0 for n in plan.pass_tokens[r])
        assert sum(plan.pass_tokens[r]) == plan.physical_tokens[r] == (forest.physical_tokens(rank) if rank else 0)
        if not rank:
            continue
        tree = seqpack.pack_prefix_tree([rows[x] for x in rank], group_ids=None if groups is None else
                                        [groups[x] for x in rank], min_shared_tokens=min_shared)
        built = seqpack.split_prefix_tree(tree, cap)
        assert built.tokens().tolist() == plan.pass_tokens[r]  # what the rank runs is what was planned
        assert built.context_pairs().tolist() == plan.context_pairs[r]  # the K/V each pass reads
        assert plan.pass_pairs[r] == [int((tree.position_ids[p.own] + 1).sum()) for p in built.passes]
    assert sum(plan.physical_tokens) == forest.num_physical_tokens  # every token once a step
    assert plan.num_micro_batches == max(len(p) for p in plan.pass_tokens)
    assert plan.num_micro_batches >= plan.bound == -(-forest.num_physical_tokens // (dp * cap))


def test_a_row_longer_than_the_cap_is_planned():
    rows = [list(range(1, 40)) + [50, 51], list(range(1, 40)) + [60], list(range(70, 80))]
    plan = plan_prefix_reuse(seqpack.PrefixForest.from_rows(rows), max_tokens=8, dp_size=2)
    # 42 tokens: depths 0-33 have subtrees over 8 (providers: 34 tokens in chunks of 8),
    # the rest (5 shared, then 2 + 1) one branch of 8; the 10-token row: 2 + 8
    assert plan.physical_tokens == [42, 10] and plan.pass_tokens == [[8, 8, 8, 8, 2, 8], [2, 8]]
    assert plan.num_micro_batches == 6 and plan.bound == 4


def test_the_docstring_plan_and_its_value_semantics():
    rows = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8], [9, 9, 9, 9, 5, 6], [9, 9, 9, 9, 7, 8]]
    plan = plan_prefix_reuse(seqpack.PrefixForest.from_rows(rows), max_tokens=4, dp_size=2)
    assert plan.rank_rows == [[0, 1], [2, 3]] and plan.pass_tokens == [[4, 4], [4, 4]]
    assert plan.num_micro_batches == 2 and plan.bound == 2 and plan.dp_size == 2
    assert pickle.loads(pickle.dumps(plan)) == plan and isinstance(plan, PrefixReusePlan)
    assert "num_micro_batches=2" in repr(plan)


@pytest.mark.parametrize("call, error, match", [
    (lambda f: plan_prefix_reuse([[1, 2]], 4), TypeError, "forest must be a seqpack.PrefixForest"),
    (lambda f: plan_prefix_reuse(f, 0), ValueError, "max_tokens"),
    (lambda f: plan_prefix_reuse(f, 4, dp_size=0), ValueError, "dp_size"),
    (lambda f: plan_prefix_reuse(f, 4, cost="fast"), TypeError, "cost must be a seqpack.CostModel"),
])
def test_bad_input_names_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call(seqpack.PrefixForest.from_rows([[1, 2, 3]]))


def test_the_predicted_step_prices_every_pass_and_the_empty_ones():
    rows = [list(range(1, 40)) + [50, 51], list(range(1, 40)) + [60], list(range(70, 80))]
    cost = seqpack.CostModel(per_micro_batch=10.0, per_token=1.0, per_token_squared=0.5)
    plan = plan_prefix_reuse(seqpack.PrefixForest.from_rows(rows), max_tokens=8, dp_size=2, cost=cost)
    for r in range(2):
        n, pairs = np.array(plan.pass_tokens[r]), np.array(plan.pass_pairs[r])
        empty = plan.num_micro_batches - len(n)
        assert plan.predicted[r] == pytest.approx((10 + n + 0.5 * (2 * pairs - n)).sum() + 10 * empty)
    assert plan.step_time == max(plan.predicted)
    # the 10-token row: 2 tokens (pairs 1 + 2), then 8 reading their 2 keys each (context 16)
    assert plan.pass_pairs[1] == [3, sum(range(3, 11))] and plan.context_pairs[1] == [0, 16]


def test_numpy_scalars():
    f = seqpack.PrefixForest.from_rows([[1, 2, 3, 4], [1, 2, 3, 5]])
    assert plan_prefix_reuse(f, np.int64(3), np.int32(1)) == plan_prefix_reuse(f, 3, 1)
