"""Planning over a prefix forest (plan_micro_batches / plan_step with forest=):
every row once; every micro-batch's physical tokens, recomputed with
pack_prefix_tree, within the cap; equal counts per rank; never worse than the
whole-trees plan or AReaL's first-fit tries (micro-batches, then tokens; predicted
step); whole_trees keeps trees whole and on one rank; bounds below results.
AReaL's packer is replayed here from tokens (its rule, written for these tests)
and must agree with first_fit_trie."""

import re

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import seqpack
from seqpack import PrefixForest, pack_prefix_tree
from seqpack import _core
from seqpack.planning.forest_planning import first_fit_trie

from planning.test_prefix_forest import batches

NAMES = {"trees", "split_trees", "first_fit_rows", "first_fit_trie", "rows", "ranks_of_trees"}


def areal_tries(rows, cap):
    """AReaL 1.0.4's greedy trie building (areal/models/tree_attn/tree.py,
    _greedy_build_tries), re-expressed: rows in order, each joins the first trie
    whose node count plus the nodes it adds stays within the cap. Token tries as
    nested dicts, as theirs are."""
    tries = []  # [root dict, nodes, row ids]
    for r, row in enumerate(rows):
        row = [int(t) for t in row]
        for trie in tries:
            node, added = trie[0], len(row)
            for i, tok in enumerate(row):
                if tok not in node:
                    added = len(row) - i
                    break
                node = node[tok]
            else:
                added = 0
            if trie[1] + added <= cap:
                break
        else:
            if len(row) > cap:
                raise ValueError("row longer than the cap")
            trie = [{}, 0, []]
            tries.append(trie)
            added = len(row)
        node = trie[0]
        for tok in row:
            node = node.setdefault(tok, {})
        trie[1] += added
        trie[2].append(r)
    return [t[2] for t in tries], [t[1] for t in tries]


def physical(rows, options, members):
    groups = None if options.get("group_ids") is None else [options["group_ids"][r] for r in members]
    return pack_prefix_tree([rows[r] for r in members], group_ids=groups,
                            min_shared_tokens=options.get("min_shared_tokens", 1)).num_tokens


def cap_of(rows, slack):
    return max(1, max((len(r) for r in rows), default=0) + slack)


# ---- first_fit_trie: AReaL's rule --------------------------------------------------------
@settings(max_examples=80, deadline=None)
@given(batches(max_rows=12), st.integers(0, 6))
def test_first_fit_trie_is_areals_packing(batch, slack):
    rows, _ = batch
    forest = PrefixForest.from_rows(rows)  # AReaL shares any common prefix: no groups, one token
    cap = cap_of(rows, slack)
    theirs, tokens = areal_tries(rows, cap)
    ours = first_fit_trie(forest, cap)
    assert ours == [sorted(b) for b in theirs]
    assert forest.subset_costs(ours)[0].tolist() == tokens


def test_first_fit_trie_of_a_subset_and_errors():
    forest = PrefixForest.from_rows([[1, 2, 3], [1, 2, 4], [5, 6], [1, 2, 7]])
    assert first_fit_trie(forest, 5, row_indices=[2, 0, 1]) == [[0, 2], [1]]
    with pytest.raises(ValueError, match="row 0 has 3 tokens, more than max_tokens = 2"):
        first_fit_trie(forest, 2)
    with pytest.raises(ValueError, match="row id 4"):
        first_fit_trie(forest, 5, row_indices=[4])
    with pytest.raises(TypeError, match="forest must be a seqpack.PrefixForest"):
        first_fit_trie([[1]], 5)


# ---- plan_micro_batches(forest=...) ------------------------------------------------------
def test_whole_trees_never_cuts_a_tree_that_fits():
    """Two pair-trees asked for three micro-batches: without whole_trees a pair is cut
    (per-token losses do not mind); with it the count is refused, by name."""
    rows = [[1, 2, 3], [1, 2, 4], [5, 6, 7], [5, 6, 8]]
    forest = PrefixForest.from_rows(rows)
    plan = seqpack.plan_micro_batches(forest.lengths, 8, min_num=3, forest=forest)
    assert plan.num_micro_batches == 3
    with pytest.raises(ValueError, match="need at least 3 micro-batches .* these 4 rows form only 2 trees, and "
                                         "whole_trees keeps each tree that fits in one micro-batch"):
        seqpack.plan_micro_batches(forest.lengths, 8, min_num=3, forest=forest, whole_trees=True)
    assert seqpack.plan_micro_batches(forest.lengths, 8, min_num=2, forest=forest,
                                      whole_trees=True).micro_batches in ([[0, 1], [2, 3]], [[2, 3], [0, 1]])


def test_the_worked_example_of_the_docs():
    """docs/planning.md: cap 16, four trees of a 1-token prompt and 5 responses of
    2 tokens (11 each). Whole trees need 4 micro-batches; split, 3 (the lower bound
    ceil(44 / 16)), paying two prompts again."""
    rows = [[100 + t, 10 * t + k, 10 * t + k] for t in range(4) for k in range(5)]
    forest = PrefixForest.from_rows(rows)
    whole = seqpack.plan_micro_batches(forest.lengths, 16, forest=forest, whole_trees=True)
    assert whole.num_micro_batches == 4 and sum(whole.tokens) == 44 and whole.method == "whole_trees"
    split = seqpack.plan_micro_batches(forest.lengths, 16, forest=forest)
    assert split.num_micro_batches == 3 == split.lower_bound
    assert sum(split.tokens) == 46 and split.physical_lower_bound == 44
    assert max(split.tokens) <= 16
    assert first_fit_trie(forest, 16) == [[0, 1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12, 13], [14, 15, 16, 17, 18, 19]]


@settings(max_examples=120, deadline=None)
@given(batches(), st.integers(0, 12), st.integers(1, 4), st.integers(1, 2), st.sampled_from([None, 64]),
       st.sampled_from(["heaviest_first", "small_at_ends"]), st.booleans())
@example(([[1], [0, 0], [0, 1]], {"group_ids": None, "min_shared_tokens": 0}), 0, 1, 2, None, "heaviest_first",
         False)
def test_micro_batches_of_trees(batch, slack, min_num, multiple_of, coeff, order, whole_trees):
    rows, options = batch
    forest = PrefixForest.from_rows(rows, **options)
    cap = cap_of(rows, slack)
    kwargs = dict(min_num=min_num, multiple_of=multiple_of, attention_coeff=coeff, order=order, forest=forest)
    try:
        plan = seqpack.plan_micro_batches(forest.lengths, cap, whole_trees=whole_trees, **kwargs)
    except ValueError as e:  # more micro-batches needed than rows can fill: min_num, or what the rows need
        # under the cap, rounded up to multiple_of (rows [1], [0 0], [0 1] under a cap of 2 need 3, so 4); with
        # whole_trees, more than the trees can fill without cutting one that fits
        need = re.search(r"need at least (\d+) micro-batches .* (there are only (\d+) sequences|form only (\d+) "
                         r"trees, and whole_trees)", str(e))
        assert need is not None, str(e)
        assert int(need.group(1)) % multiple_of == 0 and int(need.group(1)) >= min_num
        if need.group(3) is not None:
            assert int(need.group(3)) == len(rows) < int(need.group(1))
        else:
            assert whole_trees and int(need.group(4)) == forest.num_trees < int(need.group(1)) <= len(rows)
        return
    placed = sorted(r for mb in plan.micro_batches for r in mb)
    assert placed == list(range(len(rows)))
    if rows:
        assert plan.num_micro_batches >= min_num and plan.num_micro_batches % multiple_of == 0
    for mb, tokens in zip(plan.micro_batches, plan.tokens):
        assert tokens == physical(rows, options, mb) <= cap  # the cap is on what memory sees, recomputed here
    total = sum(plan.tokens)
    assert plan.sharing_kept == (1.0 if total == 0 else forest.num_physical_tokens / total)
    assert plan.physical_lower_bound == forest.num_physical_tokens <= total
    assert plan.lower_bound == (max(min_num, -(-forest.num_physical_tokens // cap)) if rows else 0)
    assert plan.lower_bound <= plan.num_micro_batches
    where = {r: k for k, mb in enumerate(plan.micro_batches) for r in mb}
    if whole_trees:
        for members in forest.trees:
            if forest.physical_tokens(members) <= cap:
                assert len({where[int(r)] for r in members}) == 1  # a tree that fits is never split
        return
    try:
        whole = seqpack.plan_micro_batches(forest.lengths, cap, whole_trees=True, **kwargs)
    except ValueError as e:  # the count needs a tree cut: only the plan without whole_trees may cut one
        assert "whole_trees keeps each tree" in str(e)
    else:
        assert (plan.num_micro_batches, total) <= (whole.num_micro_batches, sum(whole.tokens))
    if min_num == multiple_of == 1:
        tries = first_fit_trie(forest, cap)
        assert (plan.num_micro_batches, total) <= (len(tries), int(forest.subset_costs(tries)[0].sum()))

def grpo_rows(prompts, group, prompt_len, response_len, seed=0):
    rng = np.random.default_rng(seed)
    rows, groups = [], []
    for p in range(prompts):
        prompt = rng.integers(0, 50_000, int(prompt_len[p] if np.ndim(prompt_len) else prompt_len))
        for _ in range(group):
            rows.append(np.concatenate([prompt, rng.integers(0, 50_000, int(rng.integers(1, response_len + 1)))]))
            groups.append(p)
    return rows, groups


@pytest.mark.parametrize("multiple", [4, 6, 16])
def test_sharing_kept_at_caps_of_several_mean_trees(multiple):
    """Issue 29: at caps >= 4x the mean tree, >= 95% of the batch's sharing is kept."""
    rng = np.random.default_rng(multiple)
    rows, groups = grpo_rows(64, 8, rng.integers(64, 1024, 64), 512, seed=multiple)
    forest = PrefixForest.from_rows(rows, group_ids=groups)
    mean_tree = forest.num_physical_tokens / forest.num_trees
    plan = seqpack.plan_micro_batches(forest.lengths, int(multiple * mean_tree), forest=forest)
    assert plan.sharing_kept >= 0.95
    assert max(plan.tokens) <= plan.max_tokens
    plain = seqpack.plan_micro_batches(forest.lengths, int(multiple * mean_tree))
    assert plan.num_micro_batches < plain.num_micro_batches  # the cap holds more rows as trees


def test_forest_must_match_the_lengths():
    forest = PrefixForest.from_rows([[1, 2, 3], [1, 2]])
    with pytest.raises(ValueError, match=r"lengths must be the forest's row lengths \(forest.lengths: 2 rows"):
        seqpack.plan_micro_batches([3, 3], 10, forest=forest)
    with pytest.raises(TypeError, match="forest must be a seqpack.PrefixForest"):
        seqpack.plan_micro_batches([3, 2], 10, forest=[[1, 2, 3], [1, 2]])
    with pytest.raises(ValueError, match="row 0 has 3 tokens, more than max_tokens = 2"):
        seqpack.plan_micro_batches([3, 2], 2, forest=forest)


# ---- plan_step(forest=...) -----------------------------------------------------------------
COSTS = [seqpack.CostModel.tokens(), seqpack.CostModel(per_micro_batch=50.0, per_token=1.0, per_token_squared=0.01)]


def exact_time(forest, cells, dp_size, k, cost, sync):
    """A mini-batch's time, each cell costed from its own physical tokens and pairs."""
    tokens, pairs = forest.subset_costs(cells)
    costs = [cost.per_micro_batch + cost.per_token * t + cost.per_token_squared * (2 * p - t)
             for t, p in zip(tokens.tolist(), pairs.tolist())]
    grid = np.asarray(costs, dtype=np.float64).reshape(dp_size, k)
    return float(grid.max(axis=0).sum() if sync == "micro_batch" else grid.sum(axis=1).max())


def first_fit_trie_step(forest, dp_size, cap, cost, sync, mini_batches):
    """The reference the tree planner must never lose to: each mini-batch's
    AReaL tries, placed on ranks and micro-batches by the step planner as items
    (their physical tokens, their pairs standing in for s²), costed exactly."""
    n = forest.num_rows
    bounds = np.cumsum([0] + [n // mini_batches + (m < n % mini_batches) for m in range(mini_batches)])
    total = 0.0
    for m in range(mini_batches):
        tries = first_fit_trie(forest, cap, row_indices=np.arange(bounds[m], bounds[m + 1]))
        tokens, pairs = forest.subset_costs(tries)
        raw = _core.plan_step(tokens, dp_size, cap, cost.per_micro_batch, cost.per_token, cost.per_token_squared,
                              sync=sync, squares=2 * pairs - tokens)
        mb = raw["mini_batches"][0]
        cells = [[r for k in cell for r in tries[k]] for cell in mb["cells"]]
        total += exact_time(forest, cells, dp_size, mb["num_micro_batches"], cost, sync)
    return total


@settings(max_examples=60, deadline=None)
@given(batches(max_rows=12), st.integers(0, 12), st.integers(1, 3), st.sampled_from(["micro_batch", "step"]),
       st.integers(1, 2), st.sampled_from(COSTS), st.booleans())
def test_step_plans_of_trees(batch, slack, dp_size, sync, mini_batches, cost, whole_trees):
    """Every row once; every micro-batch's physical tokens (recomputed) within the
    cap; the same count on every rank; with whole_trees every tree that fits in one
    micro-batch and every tree on one rank; never a slower predicted step than the
    plain plan or AReaL's tries costed the same way; the bound below the prediction."""
    rows, options = batch
    forest = PrefixForest.from_rows(rows, **options)
    cap = cap_of(rows, slack)
    if len(rows) < mini_batches:
        with pytest.raises(ValueError, match="cannot fill mini_batches"):
            seqpack.plan_step(forest.lengths, dp_size, cap, mini_batches=mini_batches, forest=forest)
        return
    plan = seqpack.plan_step(forest.lengths, dp_size, cap, cost=cost, sync=sync, mini_batches=mini_batches,
                             forest=forest, whole_trees=whole_trees)
    assert set(plan.planned_on.split(",")) <= NAMES
    placed = sorted(r for mb in plan.assignment for rank in mb for cell in rank for r in cell)
    assert placed == list(range(len(rows)))
    time = 0.0
    for m, mb in enumerate(plan.assignment):
        assert len(mb) == dp_size and len({len(rank) for rank in mb}) == 1
        begin, end = plan.mini_batch_ranges[m]
        for r, rank in enumerate(mb):
            for k, cell in enumerate(rank):
                assert all(begin <= i < end for i in cell)
                assert plan.tokens[m][r][k] == physical(rows, options, cell) <= cap
        time += exact_time(forest, [c for rank in mb for c in rank], dp_size, plan.num_micro_batches[m], cost, sync)
    assert plan.predicted_time == pytest.approx(time)
    assert plan.lower_bound <= plan.predicted_time
    if whole_trees:
        where = {i: (m, r, k) for m, mb in enumerate(plan.assignment) for r, rank in enumerate(mb)
                 for k, cell in enumerate(rank) for i in cell}
        for b, e in plan.mini_batch_ranges:
            for t in np.unique(forest.tree_ids[b:e]):
                members = [i for i in range(b, e) if forest.tree_ids[i] == t]
                assert len({where[i][:2] for i in members}) == 1  # one rank
                if forest.physical_tokens(members) <= cap:
                    assert len({where[i] for i in members}) == 1  # one micro-batch
        return
    plain = seqpack.plan_step(forest.lengths, dp_size, cap, cost=cost, sync=sync, mini_batches=mini_batches)
    plain_time = sum(exact_time(forest, [c for rank in mb for c in rank], dp_size, plain.num_micro_batches[m], cost,
                                sync) for m, mb in enumerate(plain.assignment))
    assert plan.predicted_time <= plain_time * (1 + 1e-9)
    assert plan.predicted_time <= first_fit_trie_step(forest, dp_size, cap, cost, sync, mini_batches) * (1 + 1e-9)
    whole = seqpack.plan_step(forest.lengths, dp_size, cap, cost=cost, sync=sync, mini_batches=mini_batches,
                              forest=forest, whole_trees=True)
    assert plan.predicted_time <= whole.predicted_time * (1 + 1e-9)


def test_step_of_a_grpo_batch_keeps_groups_whole():
    rows, groups = grpo_rows(16, 8, 300, 200, seed=3)
    forest = PrefixForest.from_rows(rows, group_ids=groups)
    cap = 4 * int(forest.num_physical_tokens / forest.num_trees)
    plan = seqpack.plan_step(forest.lengths, 4, cap, cost=COSTS[1], forest=forest)
    plain = seqpack.plan_step(forest.lengths, 4, cap, cost=COSTS[1])
    assert plan.predicted_time < plain.predicted_time  # fewer tokens, fewer micro-batches
    assert sum(plan.num_micro_batches) <= sum(plain.num_micro_batches)
    whole = seqpack.plan_step(forest.lengths, 4, cap, cost=COSTS[1], forest=forest, whole_trees=True)
    assert whole.sharing_kept == 1.0 and plan.predicted_time <= whole.predicted_time


# ---- plan_dynamic_batching(forest=...) -------------------------------------------------
@settings(max_examples=80, deadline=None)
@given(batches(max_rows=12), st.integers(0, 10), st.integers(1, 3), st.integers(1, 3), st.integers(1, 2),
       st.booleans())
def test_dynamic_batching_of_trees(batch, slack, shards, round_to, pp_size, chunked):
    """Every row once; every shard the same rows per chunk and the same ranges (so the
    same count); each shard's micro-batch, laid out as a tree (recomputed), within
    the cap once rounded; counts a multiple of pp_size; lengths and padded tokens
    as documented."""
    rows, options = batch
    rows = rows[:len(rows) - len(rows) % (2 * shards)]  # chunks of 2 x shards rows divide the batch
    if options["group_ids"] is not None:
        options = dict(options, group_ids=options["group_ids"][:len(rows)])
    forest = PrefixForest.from_rows(rows, **options)
    cap = -(-cap_of(rows, slack) // round_to) * round_to
    size = 2 * shards if chunked and rows else None
    try:
        plan = seqpack.plan_dynamic_batching(forest.lengths, shards, cap, round_to, batch_size=size, pp_size=pp_size,
                                             forest=forest)
    except ValueError as e:
        assert "pp_size" in str(e) and pp_size > 1, str(e)  # too few rows per shard to split to a multiple
        return
    assert plan.rule == "forest" and sorted(plan.sorted_indices) == list(range(len(rows)))
    per_chunk = plan.shard_chunk_size * shards
    total = 0
    for c, (ranges, widths) in enumerate(zip(plan.micro_batch_indices, plan.micro_batch_lengths)):
        assert ranges[0][0] == 0 and ranges[-1][1] == plan.shard_chunk_size
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        if pp_size > 1:
            assert len(ranges) % pp_size == 0
        for s in range(shards):
            mine = plan.sorted_indices[c * per_chunk + s * plan.shard_chunk_size:][:plan.shard_chunk_size]
            assert all(c * per_chunk <= i < (c + 1) * per_chunk for i in mine)
            for (a, b), width in zip(ranges, widths):
                tokens = -(-physical(rows, options, mine[a:b]) // round_to) * round_to
                assert tokens <= cap
                assert max(-(-len(rows[i]) // round_to) * round_to for i in mine[a:b]) <= width
                total += tokens
    assert plan.padded_tokens == total and plan.valid_tokens == sum(len(r) for r in rows)


def test_dynamic_batching_keeps_grpo_groups_on_one_shard():
    rows, groups = grpo_rows(8, 4, 200, 100, seed=5)
    forest = PrefixForest.from_rows(rows, group_ids=groups)
    cap = 2 * int(forest.num_physical_tokens / forest.num_trees)
    plan = seqpack.plan_dynamic_batching(forest.lengths, 2, cap, 8, forest=forest)
    for s in range(2):
        mine = plan.shard_indices(s)
        assert len({groups[i] for i in mine}) == 4  # four whole groups of four rows each
    plain = seqpack.plan_dynamic_batching(forest.lengths, 2, cap, 8, rule="optimal")
    assert plan.num_micro_batches <= plain.num_micro_batches
    with pytest.raises(ValueError, match="lengths must be the forest's row lengths"):
        seqpack.plan_dynamic_batching(forest.lengths[::-1], 2, cap, 8, forest=forest)
