"""Issue 50, "the plan carries its options": a shard keeps what its plan decided
(forest / sharing rule, CP size, cap, static shapes) and every iterator takes them
from the shard. The proof: every iterator on a shard of a tree step (a
``StreamPlanner(shared_prefix=True)`` step, a ``plan_step(forest=)`` plan, a CP plan
on a forest) yields the planned trees within the cap, or refuses by name; an option
that contradicts the plan is refused, the same value accepted."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _gloo import run_world

import seqpack
from seqpack import BatchedDataDict
from seqpack.frameworks.nemo_rl import BatchedDataDictError, TreeMicroBatch

CAP = 600


def grpo_rows(seed, prompts=12, group=4, prompt_len=(150, 250), answer_len=(10, 90)):
    """GRPO groups of token rows: ``group`` answers share each prompt."""
    rng = np.random.default_rng(seed)
    rows, groups = [], []
    for p in range(prompts):
        head = rng.integers(1, 1000, int(rng.integers(*prompt_len))).tolist()
        for _ in range(group):
            rows.append(head + rng.integers(1, 1000, int(rng.integers(*answer_len))).tolist())
            groups.append(p)
    return rows, groups


def batch_of(rows, groups=None):
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
    lengths = torch.tensor([len(r) for r in rows])
    data = BatchedDataDict(input_ids=ids, input_lengths=lengths,
                           token_mask=(torch.arange(width)[None] < lengths[:, None]).float(),
                           sample_mask=torch.ones(len(rows)))
    if groups is not None:
        data["idx"] = torch.tensor(groups)
    return data


def stream_step(seed=0):
    """The docs/async.md flow: a StreamPlanner of prefix trees, its first step's rows
    gathered in ``item_ids`` order."""
    rows, groups = grpo_rows(seed)
    planner = seqpack.StreamPlanner(2, CAP, step_tokens=4 * CAP, shared_prefix=True)
    given = {}
    for g in range(max(groups) + 1):
        mine = [r for r, x in zip(rows, groups) if x == g]
        given.update(zip(planner.add(tokens=mine, group_ids=g, version=0, group_size=len(mine)).tolist(), mine))
        if planner.ready(0):
            step = planner.next_step(0)
            return step.plan, batch_of([given[i] for i in step.item_ids.tolist()])
    raise AssertionError("the stream made no step")


def forest_plan(seed=1, **options):
    rows, groups = grpo_rows(seed, prompts=8)
    forest = seqpack.PrefixForest.from_rows(rows, group_ids=groups)
    return seqpack.plan_step(forest.lengths, 2, CAP, forest=forest, **options), batch_of(rows, groups)


# Every iterator, as NeMo-RL calls them, and with options that contradict a tree plan.
ITERATORS = {
    "packable": lambda b: b.make_microbatch_iterator_for_packable_sequences(),
    "packable, shared_prefix=True": lambda b: b.make_microbatch_iterator_for_packable_sequences(shared_prefix=True),
    "packable, padded trees": lambda b: b.make_microbatch_iterator_for_packable_sequences(pad_to_multiple_of=8),
    "dynamic shapes": lambda b: b.make_microbatch_iterator_with_dynamic_shapes(),
    "packed": lambda b: b.make_packed_microbatch_iterator(),
    "packed, cp_size=1": lambda b: b.make_packed_microbatch_iterator(cp_size=1),
    "fixed size": lambda b: b.make_microbatch_iterator(2),
    "packable as rows": lambda b: b.make_microbatch_iterator_for_packable_sequences(shared_prefix=False),
    "dynamic shapes as rows": lambda b: b.make_microbatch_iterator_with_dynamic_shapes(shared_prefix=False),
    "packed, cp_size=2": lambda b: b.make_packed_microbatch_iterator(cp_size=2, cp_rank=0),
    "packed, pad_multiple=8": lambda b: b.make_packed_microbatch_iterator(pad_multiple=8),
    "packed, keys": lambda b: b.make_packed_microbatch_iterator(["input_ids"]),
    "packable, another input_key": lambda b: b.make_microbatch_iterator_for_packable_sequences(input_key="labels"),
}
# What a refusal names: the option or the iterator.
NAMES = {"fixed size": "make_microbatch_iterator", "packable as rows": "shared_prefix=False",
         "dynamic shapes as rows": "shared_prefix=False", "packed, cp_size=2": "cp_size=2",
         "packed, pad_multiple=8": "pad_multiple", "packed, keys": "keys", "packable, another input_key": "input_key"}


def check_every_iterator(plan, data, refused=None):
    names = {**NAMES, **(refused or {})}
    shards, order = data.shard_by_batch_size(2, step_plan=plan)
    assert sorted(order) == list(range(plan.num_sequences))
    yielded = set()
    for s, shard in enumerate(shards):
        assert shard.step_shard.plan is plan and shard.micro_batch_token_cap == CAP
        for m in range(len(plan.assignment)):
            batch = shard.get_batch(m)
            for name, iterate in ITERATORS.items():
                try:
                    mbs = list(iterate(batch))
                except BatchedDataDictError as e:
                    assert name in names and names[name] in str(e), (name, str(e))
                    continue
                assert name not in names, f"{name}: should be refused"
                assert len(mbs) == plan.num_micro_batches[m]  # every rank the same count
                for mb, cell, tokens in zip(mbs, plan.assignment[m][s], plan.tokens[m][s]):
                    assert isinstance(mb, TreeMicroBatch), name
                    assert mb.tree.num_tokens <= CAP, name
                    if cell:  # the planned tree: its rows, its physical tokens
                        assert mb.tree.num_tokens - mb.tree.num_pad_tokens == tokens, name
                        ids = [batch.step_shard.row_ids[r] for r in mb.rows]
                        assert ids == cell
                        yielded.update((name, i) for i in ids)
                    else:  # a dummy: one token, nothing for the loss
                        assert mb.tree.num_tokens - mb.tree.num_pad_tokens == 1 and mb.data["sample_mask"].sum() == 0
    for name in ITERATORS:
        if name not in names:  # every row once, as a tree
            assert sorted(i for n, i in yielded if n == name) == list(range(plan.num_sequences)), name


def test_every_iterator_on_a_stream_tree_step_yields_trees_within_the_cap_or_refuses():
    plan, data = stream_step()
    assert plan.forest is not None
    rows_tokens = max(sum(plan.lengths[i] for i in cell) for mb in plan.assignment for r in mb for cell in r)
    assert rows_tokens > CAP  # as rows, some micro-batch would pass the cap: the bug of issue 50
    check_every_iterator(plan, data)


@pytest.mark.parametrize("options", [{}, {"mini_batches": 2, "min_micro_batches": 3}, {"whole_trees": True}])
def test_every_iterator_on_a_forest_plan_yields_trees_within_the_cap_or_refuses(options):
    check_every_iterator(*forest_plan(**options))


def test_a_forest_plan_needs_the_rows_it_was_made_of():
    plan, data = forest_plan()
    with pytest.raises(BatchedDataDictError, match="needs 'input_ids'.*and 'input_lengths'"):
        BatchedDataDict(input_lengths=data["input_lengths"]).shard_by_batch_size(2, step_plan=plan)
    other = data.select_indices(list(range(data.size)))
    other["input_ids"] = other["input_ids"].flip(0)
    other["input_lengths"] = other["input_lengths"].flip(0)
    with pytest.raises(BatchedDataDictError, match="forest has rows of other lengths|not those the plan's forest"):
        other.shard_by_batch_size(2, step_plan=plan)
    shuffled = data.select_indices(list(range(data.size)))
    shuffled["input_ids"] = torch.where(shuffled["token_mask"] > 0, shuffled["input_ids"] + 1, 0)
    shuffled["input_ids"][::4, 0] += 1  # one answer of each group no longer shares its prompt
    with pytest.raises(BatchedDataDictError, match="are not those the plan's forest was made of"):
        shuffled.shard_by_batch_size(2, step_plan=plan)


def test_the_sharing_rule_is_the_plans():
    plan, data = forest_plan()
    batch = data.shard_by_batch_size(2, step_plan=plan)[0][0].get_batch(0)
    same = list(batch.make_microbatch_iterator_for_packable_sequences(group_key="idx"))  # the forest's groups
    assert [t.tree for t in same] == [t.tree for t in batch.make_microbatch_iterator_for_packable_sequences()]
    batch["half"] = torch.arange(batch.size) % 2  # splits every tree of the plan
    with pytest.raises(BatchedDataDictError, match="group_key='half' contradicts the shard's plan"):
        batch.make_microbatch_iterator_for_packable_sequences(group_key="half")
    rows, groups = grpo_rows(3, prompts=4)
    shards, _ = batch_of(rows, groups).shard_by_batch_size(1, sequence_packing_args={
        "max_tokens_per_microbatch": CAP, "input_key": "input_ids", "input_lengths_key": "input_lengths",
        "algorithm": "modified_first_fit_decreasing", "sequence_length_pad_multiple": 1, "shared_prefix": True,
        "shared_prefix_group_key": "idx"})
    packed = shards[0].get_batch(0)
    assert all(isinstance(t, TreeMicroBatch) for t in packed.make_packed_microbatch_iterator())
    with pytest.raises(BatchedDataDictError, match="group_key=None contradicts.*shared_prefix_group_key='idx'"):
        packed.make_microbatch_iterator_for_packable_sequences(group_key=None)


def test_a_row_plan_keeps_its_cp_size_and_cap():
    lengths = [300, 250, 200, 120, 90, 40]
    data = batch_of([list(range(1, n + 1)) for n in lengths])
    plan = seqpack.plan_step(lengths, 2, CAP)
    batch = data.shard_by_batch_size(2, step_plan=plan)[0][0].get_batch(0)
    assert [int(mb.cu_seqlens[-1]) for mb in batch.make_packed_microbatch_iterator(cp_size=1)] == plan.tokens[0][0]
    with pytest.raises(BatchedDataDictError, match=r"cp_size=2 contradicts the shard's step plan, made with "
                                                   r"cp_size=1.*plan_step\(\.\.\., cp_size=2\)"):
        batch.make_packed_microbatch_iterator(cp_size=2, cp_rank=1)
    with pytest.raises(BatchedDataDictError, match="forest= contradicts the shard's step plan, made without"):
        batch.make_packed_microbatch_iterator(forest=seqpack.PrefixForest.from_rows([[1, 2]]))
    with pytest.raises(BatchedDataDictError, match="more than the shard's token cap"):
        list(batch.make_packed_microbatch_iterator(pad_multiple=512))
    with pytest.raises(BatchedDataDictError, match="micro_batch_lengths are token sums, not padded widths"):
        batch.make_microbatch_iterator_with_dynamic_shapes()  # before: a torch narrow error past the width
    with pytest.raises(BatchedDataDictError, match="make_microbatch_iterator: .* planned as rows under a cap"):
        batch.make_microbatch_iterator(1)


def test_a_cp_plan_shard_iterates_per_cp_rank_only():
    rows, groups = grpo_rows(4, prompts=3, group=2, prompt_len=(20, 40), answer_len=(5, 30))
    forest = seqpack.PrefixForest.from_rows(rows, group_ids=groups)
    plan = seqpack.plan_step(forest.lengths, 1, 64, cp_size=2, forest=forest)
    batch = batch_of(rows).shard_by_batch_size(1, step_plan=plan)[0][0].get_batch(0)
    for iterate in (lambda: batch.make_microbatch_iterator_for_packable_sequences(),
                    lambda: batch.make_microbatch_iterator_with_dynamic_shapes(),
                    lambda: batch.make_microbatch_iterator(1)):
        with pytest.raises(BatchedDataDictError, match=r"cp_size=2: each CP rank runs its own part.*cp_rank="):
            iterate()
    with pytest.raises(BatchedDataDictError, match="cp_size=4 contradicts the shard's step plan, made with cp_size=2"):
        batch.make_packed_microbatch_iterator(cp_size=4)
    with pytest.raises(BatchedDataDictError, match="forest= contradicts the shard's step plan, made on another"):
        batch.make_packed_microbatch_iterator(forest=seqpack.PrefixForest.from_rows(rows[:-1]))
    with pytest.raises(BatchedDataDictError, match=r"cp_rank must be an int in \[0, 2\)"):
        batch.make_packed_microbatch_iterator(cp_rank=2)


def cp_ranks_iterate_the_plans_trees(rank, world):
    rows, groups = grpo_rows(4, prompts=3, group=2, prompt_len=(20, 40), answer_len=(5, 30))
    forest = seqpack.PrefixForest.from_rows(rows, group_ids=groups)
    plan = seqpack.plan_step(forest.lengths, 1, 64, cp_size=2, hybrid_cp=True, forest=forest)
    batch = batch_of(rows).shard_by_batch_size(1, step_plan=plan)[0][0].get_batch(0)
    mbs = list(batch.make_packed_microbatch_iterator(cp_rank=rank))  # cp_size and forest: the plan's
    assert len(mbs) == plan.num_micro_batches[0]
    for mb in mbs:
        assert mb.num_tokens <= plan.max_tokens
        assert all(isinstance(part.layout, seqpack.PrefixTreeBatch) for part in mb.parts)
        assert mb.data["input_lengths"].tolist() == [len(rows[i]) for i in mb.rows]


def test_cp_ranks_take_cp_size_and_the_forest_from_the_shard():
    run_world(2, cp_ranks_iterate_the_plans_trees, (), 120)


@pytest.mark.parametrize("static_shapes", [True, [300, 450, 600]])
def test_a_forest_plan_with_static_shapes_yields_trees_of_its_buckets(static_shapes):
    # Issue 51, finding 11: the plan priced each micro-batch at its bucket, the tree
    # iterator yielded the bare trees (29 and 18 tokens where the plan said 32 and 32).
    plan, data = forest_plan(static_shapes=static_shapes, mini_batches=2, min_micro_batches=3)
    assert plan.padded_tokens is not None
    shards, _ = data.shard_by_batch_size(2, step_plan=plan)
    seen = 0
    for s, shard in enumerate(shards):
        for m in range(len(plan.assignment)):
            batch = shard.get_batch(m)
            for name in ("packable", "packable, shared_prefix=True", "dynamic shapes", "packed"):
                mbs = list(ITERATORS[name](batch))
                for mb, cell, tokens, size in zip(mbs, plan.assignment[m][s], plan.tokens[m][s],
                                                  plan.padded_tokens[m][s]):
                    assert mb.tree.num_tokens == size, (name, cell, tokens, size)
                    assert mb.tree.num_tokens - mb.tree.num_pad_tokens == (tokens if cell else 1)
                    seen += 1
    assert seen and any(not c for mb in plan.assignment for r in mb for c in r)  # dummies covered too
    check_every_iterator(plan, data, refused={"packable, padded trees": "pad_to_multiple_of=8 contradicts"})
