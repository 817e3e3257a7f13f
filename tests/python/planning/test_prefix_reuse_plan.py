"""Planning prefix reuse (issue 52): whole trees to ranks, each rank's passes by the
one rule the tensors layer cuts with, so the passes a rank builds are the ones
planned; every physical token once a step, no pass over the cap, equal counts."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import example, given, settings
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
        assert plan.pass_order[r] == list(built.order)  # the micro-batches in the order the step runs them
        at = [i for _, i in built.order]
        assert built.tokens()[at].tolist() == plan.pass_tokens[r]  # what the rank runs is what was planned
        assert built.context_pairs()[at].tolist() == plan.context_pairs[r]  # the K/V each pass reads
        ran = [built.passes[i] for i in at]
        assert plan.pass_pairs[r] == [int((tree.position_ids[p.own] + 1).sum()) for p in ran]
        assert plan.pass_roles[r] == [p.role for p in ran]
        row_of = np.repeat(np.asarray(rank), np.diff(tree.cu_seqlens))  # each logical token's row
        for p, members in zip(ran, plan.pass_rows[r]):
            assert members == sorted(set(row_of[np.isin(tree.logical_index, p.own)].tolist()))
    assert sum(plan.physical_tokens) == forest.num_physical_tokens  # every token once a step
    assert plan.num_micro_batches == max(len(p) for p in plan.pass_tokens)
    assert plan.num_micro_batches >= plan.bound == -(-forest.num_physical_tokens // (dp * cap))
    assert plan.predicted == pytest.approx([sum(c) + (plan.num_micro_batches - len(c))
                                            * seqpack.CostModel.default().per_micro_batch for c in plan.pass_costs])


@settings(max_examples=100, deadline=None)
@given(batches(), st.integers(1, 12), st.integers(1, 3), st.data())
def test_a_subset_of_rows_plans_as_the_forest_of_those_rows(batch, cap, dp, data):
    rows, groups = batch
    chosen = sorted(data.draw(st.sets(st.integers(0, len(rows) - 1), min_size=1)))
    least, multiple = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 3))
    forest = seqpack.PrefixForest.from_rows(rows, group_ids=groups)
    plan = plan_prefix_reuse(forest, cap, dp, row_indices=np.array(chosen), min_micro_batches=least,
                             multiple_of=multiple)
    for r, rank in enumerate(plan.rank_rows):  # each rank builds the planned passes from its rows alone
        assert set(rank) <= set(chosen)
        if rank:
            tree = seqpack.pack_prefix_tree([rows[x] for x in rank], group_ids=None if groups is None else
                                            [groups[x] for x in rank])
            built = seqpack.split_prefix_tree(tree, cap)
            assert built.tokens()[[i for _, i in built.order]].tolist() == plan.pass_tokens[r]
    assert sorted(x for rank in plan.rank_rows for x in rank) == chosen
    assert sum(plan.physical_tokens) == forest.physical_tokens(chosen)
    alone = plan_prefix_reuse(forest, cap, dp, row_indices=chosen)
    assert plan.num_micro_batches >= max(least, alone.num_micro_batches) and plan.num_micro_batches % multiple == 0
    assert plan.num_micro_batches < max(least, alone.num_micro_batches) + multiple


def test_a_row_longer_than_the_cap_is_planned():
    rows = [list(range(1, 40)) + [50, 51], list(range(1, 40)) + [60], list(range(70, 80))]
    plan = plan_prefix_reuse(seqpack.PrefixForest.from_rows(rows), max_tokens=8, dp_size=2)
    # 42 tokens: depths 0-33 have subtrees over 8 (providers: 34 tokens in chunks of 8),
    # the rest (5 shared, then 2 + 1) one branch of 8; the 10-token row: 2 + 8
    # in run order: the branch, then each provider chunk's close, the deepest first
    assert plan.physical_tokens == [42, 10] and plan.pass_tokens == [[8, 2, 8, 8, 8, 8], [8, 2]]
    assert plan.pass_order[0] == [("branch", 5), ("close", 4), ("close", 3), ("close", 2), ("close", 1), ("close", 0)]
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
    # the 10-token row: 8 tokens reading 2 keys each (context 16), then the close of those 2 (pairs 1 + 2)
    assert plan.pass_pairs[1] == [sum(range(3, 11)), 3] and plan.context_pairs[1] == [16, 0]


def test_numpy_scalars():
    f = seqpack.PrefixForest.from_rows([[1, 2, 3, 4], [1, 2, 3, 5]])
    assert plan_prefix_reuse(f, np.int64(3), np.int32(1)) == plan_prefix_reuse(f, 3, 1)


@settings(max_examples=150, deadline=None)
@given(batches(), st.integers(1, 12), st.integers(1, 3), st.integers(1, 2), st.sampled_from(["micro_batch", "step"]))
def test_plan_step_keeps_passes_only_where_they_are_faster(batch, cap, dp, minis, sync):
    rows, groups = batch
    if len(rows) < minis:
        return
    forest = seqpack.PrefixForest.from_rows(rows, group_ids=groups)
    cost = seqpack.CostModel(per_micro_batch=3.0, per_token=1.0, per_token_squared=0.25)
    plan = seqpack.plan_step(forest.lengths, dp, cap, forest=forest, prefix_reuse=True, mini_batches=minis,
                             sync=sync, cost=cost)
    if int(forest.lengths.max()) <= cap:  # never slower than the plan on trees
        plain = seqpack.plan_step(forest.lengths, dp, cap, forest=forest, mini_batches=minis, sync=sync, cost=cost)
        assert plan.predicted_time <= plain.predicted_time + 1e-9
        assert plan.mini_batch_ranges == plain.mini_batch_ranges
    assert plan.predicted_time >= plan.lower_bound - 1e-9
    assert len(plan.prefix_reuse) == minis == len(plan.context_pairs)
    names = plan.planned_on.split(",") if "," in plan.planned_on else [plan.planned_on] * minis
    for m, (begin, end) in enumerate(plan.mini_batch_ranges):
        passes = plan.prefix_reuse[m]
        assert (passes is not None) == (names[m] == "prefix_reuse")
        held = sorted(i for r in range(dp) for i in plan.rank_rows(r, m))
        assert held == list(range(begin, end))  # every row of the mini-batch on one rank, once
        for r in range(dp):
            assert len(plan.assignment[m][r]) == plan.num_micro_batches[m]  # counts equal across ranks
            assert all(t <= cap for t in plan.tokens[m][r])
            local = plan.local_micro_batches(r, m)
            mine = plan.rank_rows(r, m)
            assert [[mine[i] for i in cell] for cell in local] == plan.assignment[m][r]
        if passes is not None:  # each physical token computed once in the mini-batch
            assert sum(t for rank in plan.tokens[m] for t in rank) == forest.physical_tokens(range(begin, end))
            assert plan.context_pairs[m] == [c + [0] * (plan.num_micro_batches[m] - len(c))
                                             for c in passes.context_pairs]
            assert plan.costs[m] == [c + [3.0] * (plan.num_micro_batches[m] - len(c)) for c in passes.pass_costs]
        else:
            assert all(c == 0 for rank in plan.context_pairs[m] for c in rank)


@settings(max_examples=150, deadline=None)
@given(batches(), st.integers(1, 12), st.integers(1, 3), st.integers(1, 2), st.sampled_from([None, 4]))
@example(([[0, 0, 0, 0], [1], [0, 0, 0, 1]], None), 4, 1, 2, None)  # trees need 4 micro-batches, 3 rows (CI)
def test_plan_micro_batches_keeps_passes_where_they_need_fewer(batch, cap, least, multiple, coeff):
    rows, groups = batch
    forest = seqpack.PrefixForest.from_rows(rows, group_ids=groups)
    plan = seqpack.plan_micro_batches(forest.lengths, cap, least, multiple, coeff, forest=forest, prefix_reuse=True)
    assert all(t <= cap for t in plan.tokens) and len(plan) % multiple == 0 and len(plan) >= least
    if int(forest.lengths.max()) <= cap:
        try:
            plain = seqpack.plan_micro_batches(forest.lengths, cap, least, multiple, coeff, forest=forest)
        except ValueError as exc:  # more micro-batches than rows: only passes (some empty) plan it
            assert "but there are only" in str(exc) and plan.method == "prefix_reuse"
        else:
            assert (len(plan), sum(plan.tokens)) <= (len(plain), sum(plain.tokens))
    if plan.method == "prefix_reuse":
        assert sum(plan.tokens) == forest.num_physical_tokens and plan.sharing_kept == 1.0
        assert plan.micro_batches[:len(plan.prefix_reuse.pass_rows[0])] == plan.prefix_reuse.pass_rows[0]
        assert sorted({r for mb in plan.micro_batches for r in mb}) == list(range(len(rows)))
    else:
        assert plan.prefix_reuse is None


def test_the_issue_row_longer_than_the_cap_is_planned_by_both_planners():
    prompt = list(range(1, 8001))  # an 8k prompt with a 1k response does not fit an 8k cap
    rows = [prompt + [9000 + i] * 333 for i in range(3)]
    forest = seqpack.PrefixForest.from_rows(rows)
    with pytest.raises(ValueError, match="max_tokens"):
        seqpack.plan_micro_batches(forest.lengths, 8192, forest=forest)
    plan = seqpack.plan_micro_batches(forest.lengths, 8192, forest=forest, prefix_reuse=True)
    # the provider: the tokens whose subtree exceeds the cap; the branch: the 8,192 below them
    assert plan.method == "prefix_reuse" and plan.tokens == [8192, 807] and plan.lower_bound == 2
    assert plan.prefix_reuse.pass_roles == [["branch", "provider"]]
    step = seqpack.plan_step(forest.lengths, 2, 8192, forest=forest, prefix_reuse=True)
    assert step.planned_on == "prefix_reuse" and sum(t for rank in step.tokens[0] for t in rank) == 8999
    assert step.num_micro_batches == [2] and step.num_dummies == 2  # one rank holds the tree, the other waits
    assert [8192 * 807, 0] in step.context_pairs[0]  # each branch token reads the provider's 807 keys


@pytest.mark.parametrize("options, match", [
    (dict(prefix_reuse=True), "prefix_reuse=True needs shared_prefix=True"),
    (dict(prefix_reuse=True, shared_prefix=True, whole_trees=True), "whole_trees=True cannot be combined"),
    (dict(prefix_reuse=True, shared_prefix=True, cp_size=2), "cp_size=2 cannot be combined"),
    (dict(prefix_reuse=True, shared_prefix=True, static_shapes=True), "static_shapes=8 cannot be combined"),
    (dict(prefix_reuse=True, shared_prefix=True, micro_batch_order="largest_first"), "micro_batch_order"),
])
def test_options_that_passes_cannot_honour_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        seqpack.StepOptions(**options)


def test_plan_micro_batches_refuses_prefix_reuse_without_a_forest():
    with pytest.raises(ValueError, match="prefix_reuse=True needs forest="):
        seqpack.plan_micro_batches([3, 4], 8, prefix_reuse=True)
    with pytest.raises(TypeError, match="prefix_reuse must be True or False"):
        seqpack.plan_micro_batches([3, 4], 8, prefix_reuse="yes")


def test_ranks_are_balanced_by_the_cost_models_work_not_tokens():
    # A: one 100-token row (5,050 visible pairs); B: 110 tokens as a fan of 11 rows from one
    # token (716 pairs); C: 60 tokens as a fan. By tokens B and A would lead two ranks and C join A;
    # attention-heavy costs put A alone and B with C.
    chain = [list(range(1000, 1100))]
    fan = lambda first, n: [[first] + list(range(first * 100 + 10 * i, first * 100 + 10 * i + 9)) for i in range(n)]
    rows = chain + fan(7, 11) + fan(8, 6) + [[8]]  # C: 1 + 6 x 9 tokens, and its one-token row
    forest = seqpack.PrefixForest.from_rows(rows)
    attention = seqpack.CostModel(per_micro_batch=0.0, per_token=1.0, per_token_squared=10.0)
    plan = plan_prefix_reuse(forest, 1000, 2, attention)
    assert sorted(map(sorted, plan.rank_rows)) == [[0], list(range(1, len(rows)))]
    tokens = seqpack.CostModel(per_micro_batch=0.0, per_token=1.0, per_token_squared=0.0)
    by_tokens = plan_prefix_reuse(forest, 1000, 2, tokens)
    assert sorted(map(sorted, by_tokens.rank_rows)) == [[0] + list(range(12, len(rows))), list(range(1, 12))]


@settings(max_examples=150, deadline=None)
@given(batches(), st.data())
def test_a_subforest_is_the_forest_of_its_rows(batch, data):
    rows, groups = batch
    chosen = sorted(data.draw(st.sets(st.integers(0, len(rows) - 1), min_size=1)))
    forest = seqpack.PrefixForest.from_rows(rows, group_ids=groups)
    alone = seqpack.PrefixForest.from_rows([rows[i] for i in chosen],
                                           group_ids=None if groups is None else [groups[i] for i in chosen])
    sub = forest.subforest(np.array(chosen))
    assert sub.num_physical_tokens == alone.num_physical_tokens == forest.physical_tokens(chosen)
    assert sub.lengths.tolist() == alone.lengths.tolist() and sub.num_trees == alone.num_trees
    assert sub.tree_ids.tolist() == alone.tree_ids.tolist()
    every = [list(range(len(chosen)))] + [[i] for i in range(len(chosen))]
    assert [a.tolist() for a in sub.subset_costs(every)] == [a.tolist() for a in alone.subset_costs(every)]


def test_a_row_over_the_cap_sends_only_its_mini_batch_to_passes():
    small = [[1, 2, 3, 4], [1, 2, 3, 5], [6, 7], [6, 8]]  # mini-batch 0: trees of 5 and 3 tokens
    long = [list(range(10, 40)), list(range(10, 38)) + [99]]  # mini-batch 1: 30-token rows, cap 16
    forest = seqpack.PrefixForest.from_rows(small + long)
    plan = seqpack.plan_step(forest.lengths, 1, 16, forest=forest, prefix_reuse=True, mini_batches=2,
                             cost=seqpack.CostModel(per_micro_batch=5.0, per_token=1.0, per_token_squared=0.0))
    assert plan.mini_batch_ranges == [(0, 3), (3, 6)]  # the long rows in mini-batch 1
    kinds = plan.planned_on.split(",")
    assert kinds[0] != "prefix_reuse" and kinds[1] == "prefix_reuse"
    assert plan.prefix_reuse[0] is None and plan.prefix_reuse[1] is not None
    alone = seqpack.plan_step(forest.subforest(range(*plan.mini_batch_ranges[0])).lengths, 1, 16,
                              forest=forest.subforest(range(*plan.mini_batch_ranges[0])),
                              cost=seqpack.CostModel(per_micro_batch=5.0, per_token=1.0, per_token_squared=0.0))
    begin = plan.mini_batch_ranges[0][0]
    assert plan.assignment[0] == [[[i + begin for i in cell] for cell in rank] for rank in alone.assignment[0]]
    assert plan.predicted_time >= plan.lower_bound


def test_plan_micro_batches_refuses_prefix_reuse_with_coupled_rows():
    f = seqpack.PrefixForest.from_rows([[1, 2], [1, 3]])
    with pytest.raises(ValueError, match="neither whole_trees=True nor group_ids"):
        seqpack.plan_micro_batches(f.lengths, 8, forest=f, prefix_reuse=True, whole_trees=True)
