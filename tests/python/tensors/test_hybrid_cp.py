"""A rank's hybrid-CP micro-batch built from a plan (``pack_hybrid_cp``), one
process: every token of the plan's cells laid out exactly once across the ranks,
each rank's rows within the cap and equal to the plan's count, parts in the order
every rank runs them, positions those of each part's layout; bad inputs name the
rule. The multi-rank execution is tests/python/training/test_attention_hybrid_cp.py."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import seqpack
from seqpack import CostModel

COST = CostModel(per_micro_batch=20.0, per_token=1.0, per_token_squared=0.02, per_kv_token=0.5, per_collective=5.0)


def padded(rows):
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
    return ids, torch.tensor([len(r) for r in rows])


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=12), st.sampled_from([2, 4]), st.integers(1, 2),
       st.integers(0, 10))
def test_micro_batches_lay_out_every_planned_token_once(lengths, cp, dp, slack):
    cap = max(-(-s // (2 * cp)) * 2 for s in lengths) + slack
    plan = seqpack.plan_step(lengths, dp, cap, cost=COST, cp_size=cp, hybrid_cp=True)
    rows = [[1000 * i + t for t in range(n)] for i, n in enumerate(lengths)]
    ids, lens = padded(rows)
    seen = {}
    for r in range(dp * cp):
        for k in range(plan.num_micro_batches[0]):
            mb = seqpack.pack_hybrid_cp({"input_ids": ids}, lens, plan, rank=r, micro_batch=k)
            assert mb.num_tokens <= cap and mb.num_tokens == plan.tokens[0][r][k]
            assert sorted(mb.rows) == sorted(plan.assignment[0][r][k])
            keys = [(p.degree, p.first, min(p.rows)) for p in mb.parts]
            assert keys == sorted(keys)  # whole first, then by degree and block
            for p in mb.parts:
                got = mb["input_ids"][p.start:p.end]
                assert (mb.position_ids[p.start:p.end] == p.layout.position_ids).all()
                for t in got.tolist():
                    if t or not p.degree:  # 0: padding
                        seen.setdefault(t, []).append((r, k))
    for i, n in enumerate(lengths):
        for t in range(1 if i == 0 else 0, n):  # token 0 of row 0 is id 0, read as padding
            assert len(seen[1000 * i + t]) == 1, (i, t)


def test_bad_inputs_name_the_rule():
    plan = seqpack.plan_step([12, 3, 2], 1, 9, cp_size=2, hybrid_cp=True)
    ids = torch.zeros(3, 12, dtype=torch.long)
    with pytest.raises(ValueError, match="rank must be below dp_size x cp_size = 2"):
        seqpack.pack_hybrid_cp({"input_ids": ids}, [12, 3, 2], plan, rank=2, micro_batch=0)
    with pytest.raises(ValueError, match="micro_batch must be below"):
        seqpack.pack_hybrid_cp({"input_ids": ids}, [12, 3, 2], plan, rank=0, micro_batch=1)
    with pytest.raises(ValueError, match="no CP degrees"):
        seqpack.pack_hybrid_cp({"input_ids": ids}, [12, 3, 2], seqpack.plan_step([12, 3, 2], 2, 12), rank=0,
                               micro_batch=0)
    with pytest.raises(TypeError, match="StepPlan"):
        seqpack.pack_hybrid_cp({"input_ids": ids}, [12, 3, 2], [[0]], rank=0, micro_batch=0)


def test_tree_parts_cut_each_tree_across_its_block():
    # GRPO groups as a forest: a whole part holds its trees, a sharded part one tree
    # whose tree_cp_bounds ranges its block's ranks hold, together every physical token.
    rows = []
    for prompt_len, answers in ((40, 3), (6, 2), (3, 3), (9, 1)):
        prompt = list(range(100 * prompt_len, 100 * prompt_len + prompt_len))
        rows += [prompt + [7000 + 10 * len(rows) + j for j in range(2 + len(rows) % 5)] for _ in range(answers)]
    forest = seqpack.PrefixForest.from_rows(rows)
    plan = seqpack.plan_step(forest.lengths, 1, 30, cost=COST, forest=forest, cp_size=4, hybrid_cp=True)
    ids, lens = padded(rows)
    held = {}
    for r in range(4):
        for k in range(plan.num_micro_batches[0]):
            mb = seqpack.pack_hybrid_cp({"input_ids": ids}, lens, plan, rank=r, micro_batch=k, forest=forest)
            assert mb.num_tokens <= plan.tokens[0][r][k] <= 30
            for p in mb.parts:
                assert isinstance(p.layout, seqpack.PrefixTreeBatch) and p.input_ids is None
                if p.degree > 1:
                    assert len({int(forest.tree_ids[i]) for i in p.rows}) == 1
                    held.setdefault(p.rows, []).append(mb["input_ids"][p.start:p.end])
                    tree = p.layout
                    start = seqpack.shard_layout(tree, p.degree, p.cp_rank).bounds[p.cp_rank]
                    assert (mb.position_ids[p.start:p.end] == torch.tensor(
                        tree.position_ids[start:][:p.end - p.start])).all()
    assert held, "the plan shards a tree"
    for tree_rows, pieces in held.items():
        full = seqpack.pack_prefix_tree([rows[i] for i in tree_rows])
        assert torch.cat(pieces).tolist() == full.input_ids.tolist()


def test_lengths_other_than_the_plans_are_refused():
    plan = seqpack.plan_step([12, 3, 2], 1, 9, cp_size=2, hybrid_cp=True)
    ids = torch.zeros(3, 12, dtype=torch.long)
    with pytest.raises(ValueError, match=r"seq_lens\[1\] = 4, but the plan was made with length 3"):
        seqpack.pack_hybrid_cp({"input_ids": ids}, [12, 4, 2], plan, rank=0, micro_batch=0)
    with pytest.raises(ValueError, match="tensors must be \\[B, S, ...\\] with B = len\\(seq_lens\\) = 2"):
        seqpack.pack_hybrid_cp({"input_ids": ids}, [12, 3], plan, rank=0, micro_batch=0)
    with pytest.raises(ValueError, match="exceeds the tensors' width S = 10"):
        seqpack.pack_hybrid_cp({"input_ids": ids[:, :10]}, [12, 3, 2], plan, rank=0, micro_batch=0)
