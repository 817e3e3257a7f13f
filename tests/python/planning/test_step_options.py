"""StepOptions (issue 50, item 3): plan_step's options as one object that plan_step,
StreamPlanner and the configs share; checked once, fields named in errors; keywords
and options give equal plans, a conflict between them is refused; the options and a
StepPlan holding its forest pickle; a plan keeps its forest and sharing rule."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch

import seqpack
from seqpack import CostModel, PrefixForest, StepOptions, plan_step

LENGTHS = [700, 300, 500, 200, 900, 100, 400, 600]
ROWS = [[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 2, 7], [8, 9], [8, 9, 10, 11], [12]]


def test_defaults_and_repr():
    assert StepOptions() == StepOptions(cost=CostModel.default(), static_shapes=None, seed=None)
    assert repr(StepOptions()) == "StepOptions()"
    assert repr(StepOptions(mini_batches=2, static_shapes=True)) == "StepOptions(mini_batches=2, static_shapes=8)"
    assert StepOptions(static_shapes=[4096, 1024, 4096]).static_shapes == (1024, 4096)
    assert StepOptions(static_shapes=False).static_shapes is None
    assert StepOptions(static_shapes=True) == StepOptions(static_shapes=8)


def test_numpy_and_tensor_scalars_are_accepted():
    options = StepOptions(mini_batches=np.int64(2), seed=np.uint64(2**64 - 1), cp_size=torch.tensor(4),
                          hybrid_cp=np.bool_(True), min_cp_degree=np.array(2), whole_trees=torch.tensor(False),
                          static_shapes=np.array([512, 1024]))
    assert options == StepOptions(mini_batches=2, seed=2**64 - 1, cp_size=4, hybrid_cp=True, min_cp_degree=2,
                                  static_shapes=(512, 1024))
    assert type(options.mini_batches) is int and type(options.hybrid_cp) is bool and type(options.cp_size) is int


BAD = [
    (dict(cost="tokens"), TypeError, "cost must be a seqpack.CostModel, got str"),
    (dict(sync="async"), ValueError, "sync must be 'micro_batch' .* or 'step' .*, got 'async'"),
    (dict(mini_batches=0), ValueError, "mini_batches must be positive, got 0"),
    (dict(min_micro_batches=1.5), TypeError, "min_micro_batches must be an int, got float"),
    (dict(multiple_of=None), TypeError, "multiple_of must be an int"),
    (dict(seed=-1), ValueError, "seed must be >= 0"),
    (dict(seed=2**64), ValueError, "seed must be <= 18446744073709551615"),
    (dict(shared_prefix=1), TypeError, "shared_prefix must be True or False, got 1"),
    (dict(whole_trees="yes"), TypeError, "whole_trees must be True or False"),
    (dict(whole_trees=True), ValueError, "whole_trees=True needs shared_prefix=True"),
    (dict(cp_size=3), ValueError, "cp_size must be a power of two, got 3"),
    (dict(hybrid_cp=None), TypeError, "hybrid_cp must be True or False"),
    (dict(cp_size=4, min_cp_degree=2), ValueError, "min_cp_degree applies to hybrid CP"),
    (dict(cp_size=4, hybrid_cp=True, min_cp_degree=8), ValueError,
     r"min_cp_degree must be a power of two in \[1, cp_size=4\], got 8"),
    (dict(micro_batch_order="smallest_first"), ValueError, "micro_batch_order must be one of"),
    (dict(static_shapes="auto"), TypeError, "static_shapes must be True, a bucket count or a list"),
    (dict(static_shapes=[0, 8]), ValueError, "static_shapes must hold sizes >= 1"),
    (dict(static_shapes=[]), ValueError, "static_shapes must hold at least one bucket size"),
    (dict(static_shapes=torch.tensor([1.5])), TypeError, "static_shapes must hold integers"),
]


@pytest.mark.parametrize("kwargs, kind, message", BAD, ids=[next(iter(k)) + str(i) for i, (k, _, _) in enumerate(BAD)])
def test_each_field_is_checked_and_named(kwargs, kind, message):
    with pytest.raises(kind, match=message):
        StepOptions(**kwargs)
    if "shared_prefix" not in kwargs:  # plan_step's keywords go through the same checks (forest= is its switch)
        with pytest.raises(kind, match=message):
            plan_step([5, 3], 1, 8, **kwargs)


def test_frozen_and_pickled():
    options = StepOptions(cost=CostModel(1.0, 1.0, 0.001, per_kv_token=0.5), sync="step", seed=7, cp_size=2,
                          hybrid_cp=True, shared_prefix=True, whole_trees=True, static_shapes=[256, 1024])
    with pytest.raises(AttributeError):
        options.cp_size = 4
    assert pickle.loads(pickle.dumps(options)) == options and copy.deepcopy(options) == options
    assert hash(options) == hash(copy.deepcopy(options))


CASES = [
    dict(),
    dict(cost=CostModel(50.0, 1.0, 0.001), sync="step", mini_batches=2, min_micro_batches=2),
    dict(multiple_of=2, seed=5, micro_batch_order="largest_first"),
    dict(static_shapes=4, cost=CostModel(10.0, 1.0, 0.0)),
    dict(cp_size=2, hybrid_cp=True, cost=CostModel(1.0, 1.0, 0.0, per_kv_token=0.1)),
    dict(cp_size=4, hybrid_cp=True, min_cp_degree=2),
]


@pytest.mark.parametrize("kwargs", CASES)
def test_keywords_and_options_plan_the_same_step(kwargs):
    by_keywords = plan_step(LENGTHS, 2, 1000, **kwargs)
    by_options = plan_step(LENGTHS, 2, 1000, options=StepOptions(**kwargs))
    assert by_keywords == by_options and by_keywords.predicted_time == by_options.predicted_time
    # a keyword at its default, or equal to the options' value, agrees with them
    assert plan_step(LENGTHS, 2, 1000, options=StepOptions(**kwargs), sync=kwargs.get("sync", "micro_batch"),
                     **{k: v for k, v in kwargs.items() if k == "cost"}) == by_options


def test_keywords_fill_what_options_leave_and_refuse_a_conflict():
    options = StepOptions(cost=CostModel.verl(), mini_batches=2)
    merged = plan_step(LENGTHS, 2, 1000, options=options, seed=3, multiple_of=2)
    assert merged == plan_step(LENGTHS, 2, 1000, cost=CostModel.verl(), mini_batches=2, seed=3, multiple_of=2)
    with pytest.raises(ValueError, match=r"plan_step: mini_batches=4 and options.mini_batches=2 disagree; give "
                                         r"mini_batches once"):
        plan_step(LENGTHS, 2, 1000, options=options, mini_batches=4)
    with pytest.raises(ValueError, match="plan_step: cost=.* and options.cost=.* disagree"):
        plan_step(LENGTHS, 2, 1000, options=options, cost=CostModel(2.0, 1.0, 0.0))
    with pytest.raises(TypeError, match="options must be a seqpack.StepOptions, got dict"):
        plan_step(LENGTHS, 2, 1000, options={"mini_batches": 2})


def test_a_forest_plan_keeps_its_forest_and_pickles():
    forest = PrefixForest.from_rows(ROWS)
    plan = plan_step(forest.lengths, 2, 8, forest=forest, whole_trees=True)
    assert plan.forest is forest and plan.whole_trees is True
    same = plan_step(forest.lengths, 2, 8, forest=forest, options=StepOptions(shared_prefix=True, whole_trees=True))
    assert same == plan and same.forest is forest
    for again in (pickle.loads(pickle.dumps(plan)), copy.deepcopy(plan)):
        assert again == plan and again.forest == forest and again.whole_trees
    assert "forest" not in repr(plan)  # not shown, not compared: the cells say what was planned
    shaped = plan_step(forest.lengths, 2, 8, forest=forest, micro_batch_order="largest_first", static_shapes=[4, 8])
    assert shaped.forest is forest  # step shapes keep it
    cp = plan_step(forest.lengths, 1, 8, forest=forest, cp_size=2)
    assert cp.forest is forest and cp.cp_size == 2 and cp.planned_on == "trees"
    assert plan_step(LENGTHS, 2, 1000).forest is None


def test_shared_prefix_needs_the_forest():
    with pytest.raises(ValueError, match="shared_prefix=True plans prefix trees: plan_step needs forest="):
        plan_step([4, 5], 1, 8, options=StepOptions(shared_prefix=True))
    with pytest.raises(ValueError, match="whole_trees=True needs shared_prefix=True .*forest="):
        plan_step([4, 5], 1, 8, whole_trees=True)
    forest = PrefixForest.from_rows(ROWS)  # forest= alone turns trees on: options need not say it
    assert plan_step(forest.lengths, 1, 8, forest=forest, options=StepOptions()).planned_on is not None


def test_top_level_name():
    assert seqpack.StepOptions is StepOptions is seqpack.planning.StepOptions
