"""``plan_micro_batches(group_ids=)``: rows of one group stay in one micro-batch
(DPO's pairs, verl's ``force_group_size``). Hypothesis: every row exactly once, each
group whole and in row order, no micro-batch over the cap; the module's worked
example literally; named errors."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import seqpack


def test_worked_example():
    plan = seqpack.plan_micro_batches([5, 3, 9, 7, 2, 2], 16, group_ids=[0, 0, 1, 1, 2, 2])
    assert plan.micro_batches == [[2, 3], [0, 1, 4, 5]]
    assert plan.tokens == [16, 12]


@settings(max_examples=150, deadline=None)
@given(data=st.data(), cap=st.integers(8, 64), min_num=st.integers(1, 3), coeff=st.sampled_from([None, 0, 8]),
       order=st.sampled_from(["heaviest_first", "small_at_ends"]))
def test_groups_whole_rows_once_cap_kept(data, cap, min_num, coeff, order):
    sizes = data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=12))
    labels = np.repeat(np.arange(len(sizes)), sizes)
    perm = data.draw(st.permutations(range(len(labels))))
    labels = [f"g{labels[i]}" for i in perm]  # groups need not be contiguous; labels any hashable
    lengths = [data.draw(st.integers(1, cap // max(sizes))) for _ in labels]
    try:
        plan = seqpack.plan_micro_batches(lengths, cap, min_num=min_num, attention_coeff=coeff, order=order,
                                          group_ids=labels)
    except ValueError as exc:
        assert "micro-batches" in str(exc) and "groups" in str(exc)
        assert min_num > len(sizes)
        return
    rows = sorted(r for mb in plan.micro_batches for r in mb)
    assert rows == list(range(len(labels)))
    where = {r: k for k, mb in enumerate(plan.micro_batches) for r in mb}
    for label in set(labels):
        assert len({where[r] for r, lab in enumerate(labels) if lab == label}) == 1
    for mb, tokens in zip(plan.micro_batches, plan.tokens):
        assert mb == sorted(mb) and tokens == sum(lengths[r] for r in mb) <= cap
    assert len(plan.micro_batches) >= min_num


def test_errors_name_the_group():
    with pytest.raises(ValueError, match=r"group 1 \(rows \[2, 3\]\) holds 17 tokens, more than max_tokens=16"):
        seqpack.plan_micro_batches([5, 3, 9, 8], 16, group_ids=[0, 0, 1, 1])
    with pytest.raises(ValueError, match="one label per row"):
        seqpack.plan_micro_batches([5, 3, 9], 16, group_ids=[0, 0])
    with pytest.raises(TypeError, match="not hashable"):
        seqpack.plan_micro_batches([5, 3], 16, group_ids=[[0], [0]])
    with pytest.raises(ValueError, match="3 groups, each whole"):
        seqpack.plan_micro_batches([1] * 6, 16, min_num=4, group_ids=[0, 0, 1, 1, 2, 2])
    forest = seqpack.PrefixForest.from_rows([[1, 2], [1, 3]])
    with pytest.raises(ValueError, match="cannot be combined"):
        seqpack.plan_micro_batches([2, 2], 16, forest=forest, group_ids=[0, 0])
