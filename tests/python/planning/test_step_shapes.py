"""Step shapes: largest-first micro-batch order and static shape buckets, as
properties over random plans (rows, prefix trees, context parallelism), the core's
order and padding against a reference written here, and one core call per
plan_step whatever its options."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import seqpack
from seqpack import CostModel, PrefixForest, plan_step
from seqpack.planning.step_shapes import shape_buckets

costs = st.sampled_from([CostModel.tokens(), CostModel(50.0, 1.0, 0.0), CostModel(3.0, 0.5, 0.01), CostModel.verl()])


def step_time(costs, sync):
    """Reference: one mini-batch's time, ``Σ_k max_r`` or ``max_r Σ_k``."""
    table = np.asarray(costs, dtype=np.float64)
    return float(table.max(axis=0).sum() if sync == "micro_batch" else table.sum(axis=1).max()) if table.size else 0.0


def largest_first_reference(plan):
    """Reference: each CP group's micro-batches of each mini-batch by the group's most
    tokens, then its highest cost, descending, then the planned order."""
    out = []
    for m, mb in enumerate(plan.assignment):
        ranks = []
        for g in range(0, plan.num_ranks, plan.cp_size):
            group = range(g, g + plan.cp_size)
            k = plan.num_micro_batches[m]
            key = [(-max(plan.tokens[m][r][j] for r in group), -max(plan.costs[m][r][j] for r in group), j)
                   for j in range(k)]
            order = [j for *_, j in sorted(key)]
            ranks += [[mb[r][j] for j in order] for r in group]
        out.append(ranks)
    return out


def padded_time_reference(plan, buckets):
    """Reference: the plan's time with every cell padded to its smallest bucket."""
    cost, total = plan.cost, 0.0
    for m in range(len(plan.assignment)):
        costs = []
        for r in range(plan.num_ranks):
            row = []
            for t, c in zip(plan.tokens[m][r], plan.costs[m][r]):
                p = min(b for b in buckets if b >= t) - t
                row.append(c + cost.per_token * p + cost.per_token_squared * p * p)
            costs.append(row)
        total += step_time(costs, plan.sync)
    return total


def _cells(plan):
    """Each rank's multiset of (cell, tokens, cost) per mini-batch."""
    return [[sorted((tuple(c), t, round(x, 9)) for c, t, x in zip(plan.assignment[m][r], plan.tokens[m][r],
                                                                    plan.costs[m][r]))
             for r in range(plan.num_ranks)] for m in range(len(plan.assignment))]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=60), st.integers(1, 4), costs,
       st.sampled_from(["micro_batch", "step"]), st.integers(1, 3))
def test_largest_first_sorts_every_rank_and_keeps_its_cells(lengths, dp_size, cost, sync, mini_batches):
    mini_batches = min(mini_batches, len(lengths))
    plan = plan_step(lengths, dp_size, 300, cost=cost, sync=sync, mini_batches=mini_batches)
    lf = plan_step(lengths, dp_size, 300, cost=cost, sync=sync, mini_batches=mini_batches,
                   micro_batch_order="largest_first")
    assert lf.micro_batch_order == "largest_first"
    assert _cells(lf) == _cells(plan)  # the same micro-batches on the same ranks
    assert lf.num_micro_batches == plan.num_micro_batches and lf.lower_bound == plan.lower_bound
    for mb in lf.tokens:
        for rank in mb:
            assert rank == sorted(rank, reverse=True)
    assert lf.predicted_time == pytest.approx(sum(step_time(c, sync) for c in lf.costs), rel=1e-12)
    if sync == "step" or cost.per_token_squared == 0:  # cost follows tokens: never slower
        assert lf.predicted_time <= plan.predicted_time * (1 + 1e-12)


def test_largest_first_moves_a_cp_group_together():
    lengths = [4000, 300, 2500, 900, 120, 3100, 700, 60, 1800, 2200, 90, 3900]
    for hybrid in (False, True):
        plan = plan_step(lengths, 2, 1024, cp_size=4, hybrid_cp=hybrid, micro_batch_order="largest_first",
                         cost=CostModel(1.0, 1.0, 1e-4, per_kv_token=0.1))
        for mb in plan.assignment:
            for g in range(0, plan.num_ranks, 4):
                # a sharded sequence sits at the same micro-batch on every rank of its block
                for i, (deg, first) in enumerate(zip(plan.cp_degree, plan.cp_first_rank)):
                    ks = {k for r in range(first, first + deg) for k, cell in enumerate(mb[r]) if i in cell}
                    assert len(ks) <= 1
                tokens = np.asarray([plan.tokens[0][r] for r in range(g, g + 4)]).max(axis=0)
                assert tokens.tolist() == sorted(tokens.tolist(), reverse=True)


def test_largest_first_with_a_forest_keeps_the_forest_plan():
    rows = [[1, 2, 3] + [10 + i] * (i % 5 + 1) for i in range(12)] + [[9] * 40, [8] * 25]
    forest = PrefixForest.from_rows(rows, group_ids=[i // 4 for i in range(14)])
    plan = plan_step(forest.lengths, 2, 48, forest=forest)
    lf = plan_step(forest.lengths, 2, 48, forest=forest, micro_batch_order="largest_first")
    assert _cells(lf) == _cells(plan) and lf.planned_on == plan.planned_on


def test_shape_buckets():
    assert shape_buckets(True, 8192) == tuple(range(1024, 8193, 1024))
    assert shape_buckets(4, 8192) == (2048, 4096, 6144, 8192)
    assert shape_buckets(3, 10) == (4, 7, 10)
    assert shape_buckets(np.int64(1), 10) == (10,)
    assert shape_buckets([512, 4096, 512], 4096) == (512, 4096)
    with pytest.raises(ValueError, match="largest bucket .2048. must hold a full micro-batch"):
        shape_buckets([1024, 2048], 4096)
    with pytest.raises(ValueError, match="sizes >= 1"):
        shape_buckets([0, 4096], 4096)
    with pytest.raises(ValueError, match="at least one"):
        shape_buckets([], 4096)
    with pytest.raises(TypeError, match="static_shapes must be True"):
        shape_buckets("auto", 4096)
    with pytest.raises(ValueError, match="static_shapes"):
        plan_step([5, 3], 1, 8, static_shapes=0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=60), st.integers(1, 4), costs,
       st.sampled_from(["micro_batch", "step"]), st.sampled_from([True, 2, 5, (37, 150, 300, 400)]),
       st.booleans())
def test_static_shapes_pad_each_cell_to_its_smallest_bucket(lengths, dp_size, cost, sync, spec, lf):
    order = "largest_first" if lf else "planned"
    base = plan_step(lengths, dp_size, 300, cost=cost, sync=sync, micro_batch_order=order)
    plan = plan_step(lengths, dp_size, 300, cost=cost, sync=sync, micro_batch_order=order, static_shapes=spec)
    buckets = shape_buckets(spec, 300)
    assert plan.shape_buckets == buckets and plan.max_tokens == 300 and plan.lower_bound == base.lower_bound
    flat = sorted(i for mb in plan.assignment for rank in mb for cell in rank for i in cell)
    assert flat == list(range(len(lengths)))
    pad = 0
    for m, mb in enumerate(plan.padded_tokens):
        assert len({len(rank) for rank in mb}) == 1
        for r, rank in enumerate(mb):
            for k, size in enumerate(rank):
                cell = [lengths[i] for i in plan.assignment[m][r][k]]
                tokens = plan.tokens[m][r][k]
                assert tokens == sum(cell) <= 300
                assert size in buckets and size >= tokens
                assert all(b < tokens for b in buckets if b < size)  # the smallest bucket that holds it
                p = size - tokens
                pad += p
                extra = cost.per_token * p + cost.per_token_squared * p * p
                assert plan.costs[m][r][k] == pytest.approx(cost(cell) + extra, rel=1e-9)
    assert plan.padding_tokens == pad
    assert plan.metrics["padding"] == pytest.approx(pad / sum(lengths))
    # never slower than padding the plan under the full cap
    assert plan.predicted_time <= padded_time_reference(base, buckets) * (1 + 1e-12)
    assert plan.predicted_time >= base.predicted_time * (1 - 1e-12) or plan.assignment != base.assignment
    assert plan.predicted_time == pytest.approx(sum(step_time(c, sync) for c in plan.costs), rel=1e-12)
    assert pickle.loads(pickle.dumps(plan)) == plan


def test_static_shapes_literal():
    plan = plan_step([700, 300, 500, 100], dp_size=1, max_tokens=1000, static_shapes=[256, 512, 1000],
                     cost=seqpack.CostModel.tokens())
    assert plan.tokens == [[[800, 800]]] and plan.padded_tokens == [[[1000, 1000]]]
    assert plan.padding_tokens == 400 and plan.predicted_time == 2000.0
    dummy = plan_step([5, 5], dp_size=3, max_tokens=8, static_shapes=[4, 8])
    assert sorted(dummy.padded_tokens[0]) == [[4], [8], [8]]  # a dummy pads to the smallest bucket
    with pytest.raises(ValueError, match="larger than the largest bucket"):  # the core's own check
        seqpack._core.plan_step([700, 300], 1, 1000, 0.0, 1.0, 0.0, buckets=[512])


def test_micro_batch_order_is_checked():
    with pytest.raises(ValueError, match="micro_batch_order must be one of"):
        plan_step([5, 3], 1, 8, micro_batch_order="smallest_first")
    with pytest.raises(ValueError, match="micro_batch_order must be 'planned' or 'largest_first'"):
        seqpack._core.plan_step([5, 3], 1, 8, 0.0, 1.0, 0.0, micro_batch_order="smallest_first")


def _forest_case():
    rows = [[1, 2, 3] + [10 + i] * (i % 5 + 1) for i in range(12)] + [[9] * 40, [8] * 25]
    return PrefixForest.from_rows(rows, group_ids=[i // 4 for i in range(14)])


@pytest.mark.parametrize("case", ["rows", "cp", "hybrid_cp", "forest", "forest_cp"])
def test_largest_first_is_the_reference_order(case):
    forest = _forest_case() if case.startswith("forest") else None
    lengths = forest.lengths if forest is not None else \
        [4000, 300, 2500, 900, 120, 3100, 700, 60, 1800, 2200, 90, 3900, 1500, 640]
    kwargs = dict(cost=CostModel(3.0, 1.0, 1e-4, per_kv_token=0.1), mini_batches=2, forest=forest)
    if case != "rows" and case != "forest":
        kwargs.update(cp_size=2 if forest is not None else 4, hybrid_cp=case == "hybrid_cp" or forest is not None)
    cap = 48 if forest is not None else 4096 if case == "rows" else 1024
    plan = plan_step(lengths, 2, cap, **kwargs)
    lf = plan_step(lengths, 2, cap, micro_batch_order="largest_first", **kwargs)
    assert lf.assignment == largest_first_reference(plan)
    assert lf.predicted_time == pytest.approx(sum(step_time(c, plan.sync) for c in lf.costs), rel=1e-12)
    for name in ("cp_degree", "cp_first_rank"):
        a, b = getattr(plan, name), getattr(lf, name)
        assert (a is None and b is None) or a.tolist() == b.tolist()


class _CountingCore:
    """seqpack._core with every call counted by name."""

    def __init__(self, core):
        self._core, self.calls = core, []

    def __getattr__(self, name):
        attr = getattr(self._core, name)
        if not callable(attr):
            return attr

        def counted(*args, **kwargs):
            self.calls.append(name)
            return attr(*args, **kwargs)
        return counted


@pytest.mark.parametrize("options", [
    {}, {"static_shapes": True}, {"static_shapes": [64, 128, 512, 2048], "micro_batch_order": "largest_first"},
    {"cp_size": 4, "hybrid_cp": True, "static_shapes": 4}, {"forest": True}, {"forest": True, "static_shapes": 3},
    {"forest": True, "cp_size": 2, "micro_batch_order": "largest_first"}, {"mini_batches": 2, "cp_size": 2}])
def test_one_core_call_per_plan_step(monkeypatch, options):
    # The core owns the costing: whatever the options (static shapes' smaller buckets,
    # largest first, CP, trees, CP over trees), plan_step is one call into the core.
    import seqpack.planning.step as step

    options = dict(options)
    forest = _forest_case() if options.pop("forest", False) else None
    lengths = forest.lengths if forest is not None else [400, 30, 250, 90, 12, 310, 70, 6, 180, 220, 9, 390]
    counting = _CountingCore(step._core)
    monkeypatch.setattr(step, "_core", counting)
    plan = plan_step(lengths, 2, 2048 if forest is None else 48, forest=forest, **options)
    assert counting.calls == ["plan_step"]
    assert plan.num_sequences == len(lengths)
