"""StreamPlanner: the rules as properties over random arrival orders, versions and
chunk sizes; pickling mid-stream; the comparison with next-fit in arrival order
(torchtitan's batcher); errors."""

from __future__ import annotations

import copy
import pickle
import threading
from typing import Dict, List

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import seqpack
from seqpack import CostModel, StepOptions, StreamPlanner, StreamStep, plan_step
from seqpack.testing.stream_reference import next_fit_rows, next_fit_step

CAP = 256


@st.composite
def streams(draw):
    """Groups of 1-4 rollouts with random lengths, arriving in a random order in
    random chunks; each rollout's lag behind the trainer's version is 0-3."""
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=14))
    items = [(g, draw(st.integers(1, CAP)), draw(st.integers(0, 3))) for g, s in enumerate(sizes) for _ in range(s)]
    order = draw(st.permutations(range(len(items))))
    chunks, at = [], 0
    while at < len(order):
        n = draw(st.integers(1, 6))
        chunks.append([items[i] for i in order[at:at + n]])
        at += n
    return sizes, chunks


def run(planner: StreamPlanner, sizes, chunks, *, pickle_at: int = -1):
    """Feed ``chunks``; plan a step whenever ready (the trainer's version advances
    per step); flush at the end. Returns the steps, what each item was, and the
    planner pickled at chunk ``pickle_at`` with the steps planned before it."""
    version, steps, info, saved = 0, [], {}, None
    arrived: Dict[int, List[int]] = {}
    done = set()
    for c, chunk in enumerate(chunks):
        if c == pickle_at:
            saved = (pickle.dumps(planner), len(steps), version)
        ids = planner.add([x[1] for x in chunk], group_ids=[x[0] for x in chunk],
                          version=[max(0, version - x[2]) for x in chunk], group_size=[sizes[x[0]] for x in chunk])
        for i, x in zip(ids.tolist(), chunk):
            info[i] = dict(group=x[0], length=x[1], version=max(0, version - x[2]), arrived=c)
            arrived.setdefault(x[0], []).append(i)
        while planner.ready(version):
            # the complete groups waiting: (oldest version, the chunk that completed it)
            waiting = {g: (min(info[i]["version"] for i in ids_), max(info[i]["arrived"] for i in ids_))
                       for g, ids_ in arrived.items() if len(ids_) == sizes[g] and g not in done}
            step = planner.next_step(version)
            fresh = {g: key for g, key in waiting.items() if g not in step.dropped_groups}
            taken = [fresh[g] for g in step.groups]
            left = [key for g, key in fresh.items() if g not in step.groups]
            if left:  # oldest first: nothing left behind is older than what was taken
                assert max(taken) <= min(left)
            done.update(step.groups, step.dropped_groups)
            steps.append(step)
            version += 1
    last = planner.flush(version, incomplete="drop")
    if last is not None:
        steps.append(last)
    return steps, info, saved


def check_step_plan(step: StreamStep, info, cap):
    """The step is a plan_step plan of its items: every item once, the cap, equal counts."""
    plan = step.plan
    lens = [info[i]["length"] for i in step.item_ids.tolist()]
    assert plan.lengths.tolist() == lens
    flat = sorted(i for mb in step.assignment for rank in mb for cell in rank for i in cell)
    assert flat == sorted(step.item_ids.tolist())
    for mb in plan.tokens:
        assert len({len(rank) for rank in mb}) == 1
        assert all(t <= cap for rank in mb for t in rank)
    again = plan_step(lens, plan.dp_size, cap, cost=plan.cost, sync=plan.sync,
                      mini_batches=len(plan.assignment))
    assert plan.predicted_time <= again.predicted_time * 1.02


@settings(max_examples=80, deadline=None)
@given(streams(), st.sampled_from([None, 0, 1, 2]), st.integers(1, 3), st.integers(1, 900),
       st.sampled_from([CostModel.tokens(), CostModel(4.0, 1.0, 0.002)]))
def test_stream_rules(stream, max_staleness, dp_size, step_tokens, cost):
    sizes, chunks = stream
    planner = StreamPlanner(dp_size, CAP, step_tokens=step_tokens, max_staleness=max_staleness,
                            options=StepOptions(cost=cost))
    steps, info, _ = run(planner, sizes, chunks)
    landed = [i for s in steps for i in s.item_ids.tolist()]
    dropped = [i for s in steps for i in s.dropped.tolist()] + planner.dropped.tolist()
    # every item exactly once: in one step or dropped
    assert sorted(landed + dropped) == sorted(info)
    assert planner.pending == 0 and planner.pending_tokens == 0
    group_of: Dict[int, List[int]] = {}
    for i, x in info.items():
        group_of.setdefault(x["group"], []).append(i)
    step_of = {i: k for k, s in enumerate(steps) for i in s.item_ids.tolist()}
    for g, ids in group_of.items():  # a group lands whole, in one step, or not at all
        assert len({step_of.get(i, -1) for i in ids}) == 1
    for k, step in enumerate(steps):
        check_step_plan(step, info, CAP)
        if k < len(steps) - 1 or step.num_tokens >= step_tokens:
            assert step.num_tokens >= step_tokens
            # whole groups, and no more than needed: without its last group the step is short
            last = group_of[step.groups[-1]]
            assert step.num_tokens - sum(info[i]["length"] for i in last) < step_tokens
        if max_staleness is not None:  # nothing stale lands
            assert all(step.version - info[i]["version"] <= max_staleness for i in step.item_ids.tolist())
    if max_staleness is not None:  # a dropped group had a stale item when it was dropped
        for k, step in enumerate(steps):
            for g in set(step.dropped_groups):
                assert min(info[i]["version"] for i in group_of[g]) < step.version - max_staleness
    else:
        assert not any(s.dropped_groups for s in steps[:-1])


@settings(max_examples=40, deadline=None)
@given(streams(), st.sampled_from([None, 1]), st.integers(1, 3), st.integers(1, 900), st.data())
def test_pickle_mid_stream_resumes_to_the_same_steps(stream, max_staleness, dp_size, step_tokens, data):
    sizes, chunks = stream
    at = data.draw(st.integers(0, len(chunks) - 1))
    kwargs = dict(step_tokens=step_tokens, max_staleness=max_staleness,
                  options=StepOptions(micro_batch_order="largest_first"))
    steps, _, saved = run(StreamPlanner(dp_size, CAP, **kwargs), sizes, chunks, pickle_at=at)
    blob, done, version = saved
    resumed = pickle.loads(blob)
    assert resumed == copy.deepcopy(resumed)
    rest, _, _ = run_from(resumed, sizes, chunks[at:], version)
    assert rest == steps[done:]


def run_from(planner, sizes, chunks, version):
    steps = []
    for chunk in chunks:
        planner.add([x[1] for x in chunk], group_ids=[x[0] for x in chunk],
                    version=[max(0, version - x[2]) for x in chunk], group_size=[sizes[x[0]] for x in chunk])
        while planner.ready(version):
            steps.append(planner.next_step(version))
            version += 1
    last = planner.flush(version, incomplete="drop")
    return steps + ([last] if last is not None else []), None, None


def test_docstring_walkthrough_and_step_fields():
    planner = StreamPlanner(dp_size=2, max_tokens=1000, step_tokens=1500, max_staleness=1)
    assert planner.add([400, 300, 500], group_ids=[7, 7, 8], version=0, group_size=2).tolist() == [0, 1, 2]
    assert not planner.ready(0) and planner.pending == 3 and planner.pending_tokens == 700
    planner.add([600, 200], group_ids=np.array([8, 9]), version=np.array([0, 1]), group_size=np.int64(2))
    step = planner.next_step(np.int64(1))
    assert step.groups == [7, 8] and step.item_ids.tolist() == [0, 1, 2, 3]
    assert sorted(i for mb in step.assignment for r in mb for c in r for i in c) == [0, 1, 2, 3]
    assert step.num_tokens == 1800 and planner.pending == 1 and step.pending == 1
    assert sorted(step.rank_items(0) + step.rank_items(1)) == [0, 1, 2, 3]
    assert step.metrics["items"] == 4 and step.metrics["dropped"] == 0
    assert step.predicted_time == plan_step([400, 300, 500, 600], 2, 1000).predicted_time
    with pytest.raises(ValueError, match="current_version must not decrease"):
        planner.ready(0)
    # group 9 (version 1) goes stale at version 3; its late rollout is dropped on arrival
    assert not planner.ready(3) and planner.pending == 0
    planner.add([50], group_ids=9, version=1, group_size=2)
    planner.add([900, 800], group_ids="new", version=3, group_size=2)
    step = planner.next_step(3)
    assert step.dropped.tolist() == [4, 5] and step.dropped_groups == [9] and step.groups == ["new"]


def test_rollouts_arrive_on_another_thread():
    planner = StreamPlanner(2, 512, step_tokens=2000, max_staleness=3)
    rng = np.random.default_rng(0)
    chunks = [(rng.integers(1, 512, 4).tolist(), g) for g in range(300)]
    version = {"now": 0}
    done = threading.Event()

    def receiver():
        for lens, g in chunks:
            planner.add(lens, group_ids=g, version=max(0, version["now"] - int(rng.integers(0, 5))), group_size=4)
        done.set()

    thread = threading.Thread(target=receiver)
    thread.start()
    steps = []
    while not done.is_set() or planner.ready(version["now"]):
        if planner.ready(version["now"]):
            steps.append(planner.next_step(version["now"]))
            version["now"] += 1
    thread.join()
    last = planner.flush(version["now"], incomplete="drop")
    steps += [last] if last is not None else []
    seen = [i for s in steps for i in s.item_ids.tolist() + s.dropped.tolist()] + planner.dropped.tolist()
    assert sorted(seen) == list(range(1200)) and planner.pending == 0
    assert pickle.loads(pickle.dumps(planner)) == planner


def test_a_label_is_reused_after_its_group_lands():
    planner = StreamPlanner(1, 100, step_tokens=10)
    planner.add([10], group_ids="p", version=0, group_size=1)
    assert planner.next_step(0).groups == ["p"]
    planner.add([20], group_ids="p", version=1, group_size=1)
    assert planner.next_step(1).item_ids.tolist() == [1]


def test_flush_modes():
    def make():
        p = StreamPlanner(2, 100, step_tokens=1000)
        p.add([30, 40, 50], group_ids=["a", "a", "b"], version=0, group_size=2)
        return p
    p = make()
    step = p.flush(0)
    assert step.groups == ["a"] and p.pending == 1  # "wait": b still open
    assert p.flush(0) is None
    p = make()
    step = p.flush(0, incomplete="drop")
    assert step.groups == ["a"] and step.dropped.tolist() == [2] and p.pending == 0
    p = make()
    step = p.flush(0, incomplete="keep")
    assert step.groups == ["a", "b"] and step.item_ids.tolist() == [0, 1, 2] and p.pending == 0
    with pytest.raises(ValueError, match="incomplete must be one of"):
        p.flush(0, incomplete="all")
    p = StreamPlanner(1, 100, step_tokens=10, options=StepOptions(mini_batches=3))
    p.add([5, 6], group_ids=["x", "y"], version=0, group_size=1)
    assert len(p.flush(0).plan.assignment) == 2  # a short last step: one mini-batch per item


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="step_tokens"):
        StreamPlanner(2, 100, step_tokens=0)
    with pytest.raises(ValueError, match="max_staleness"):
        StreamPlanner(2, 100, step_tokens=10, max_staleness=-1)
    with pytest.raises(ValueError, match="sync"):
        StreamPlanner(2, 100, step_tokens=10, options=StepOptions(sync="async"))
    with pytest.raises(TypeError, match="cost"):
        StreamPlanner(2, 100, step_tokens=10, options=StepOptions(cost="tokens"))
    with pytest.raises(ValueError, match="whole_trees=True needs shared_prefix=True"):
        StreamPlanner(2, 100, step_tokens=10, options=StepOptions(whole_trees=True))
    with pytest.raises(TypeError, match="options must be a seqpack.StepOptions, got dict"):
        StreamPlanner(2, 100, step_tokens=10, options={"cp_size": 2})
    with pytest.raises(TypeError, match="unexpected keyword argument 'cpsize'"):
        StreamPlanner(2, 100, step_tokens=10, cpsize=2)
    p = StreamPlanner(2, 100, step_tokens=10)
    with pytest.raises(ValueError, match=r"lengths\[1\] = 101 cannot be planned"):
        p.add([5, 101], group_ids=0, version=0, group_size=2)
    with pytest.raises(ValueError, match=r"lengths\[0\] = 0"):
        p.add([0], group_ids=0, version=0, group_size=2)
    with pytest.raises(ValueError, match="more than its group_size=2"):
        p.add([5, 6, 7], group_ids=0, version=0, group_size=2)
    with pytest.raises(ValueError, match="group_ids must be one label or one per rollout"):
        p.add([5, 6], group_ids=[0], version=0, group_size=2)
    with pytest.raises(ValueError, match="version must be one value or one per rollout"):
        p.add([5, 6], group_ids=0, version=[0], group_size=2)
    with pytest.raises(TypeError, match="not hashable"):
        p.add([5], group_ids=[[1]], version=0, group_size=2)
    assert p.pending == 0 and p.num_items == 0  # nothing was added by a failed call
    p.add([5], group_ids=0, version=0, group_size=2)
    with pytest.raises(ValueError, match="was given group_size=2, now 3"):
        p.add([5], group_ids=0, version=0, group_size=3)
    with pytest.raises(ValueError, match="not ready"):
        p.next_step(0)
    with pytest.raises(ValueError, match="tokens is required with shared_prefix=True"):
        StreamPlanner(2, 100, step_tokens=10, shared_prefix=True).add([5], group_ids=0, version=0, group_size=1)
    with pytest.raises(ValueError, match="sharded over cp_size=2"):
        StreamPlanner(1, 100, step_tokens=10, options=StepOptions(cp_size=2)).add([300], group_ids=0, version=0,
                                                                                    group_size=1)


def test_forest_steps_plan_groups_as_trees():
    rng = np.random.default_rng(0)
    planner = StreamPlanner(2, 400, step_tokens=1500, shared_prefix=True, max_staleness=2)
    rows_of = {}
    version = 0
    steps = []
    for prompt in range(24):
        head = rng.integers(1, 1000, int(rng.integers(50, 150))).tolist()
        rows = [head + rng.integers(1, 1000, int(rng.integers(1, 120))).tolist() for _ in range(4)]
        ids = planner.add(tokens=rows, group_ids=prompt, version=version, group_size=4)
        rows_of.update(zip(ids.tolist(), rows))
        while planner.ready(version):
            steps.append(planner.next_step(version))
            version += 1
    assert steps
    for step in steps:
        plan = step.plan
        assert plan.planned_on is not None and plan.sharing_kept is not None
        logical = sum(len(rows_of[i]) for i in step.item_ids.tolist())
        physical = sum(t for mb in plan.tokens for r in mb for t in r)
        assert physical < logical  # the prompts are forwarded once per micro-batch, not per rollout
        assert all(t <= 400 for mb in plan.tokens for r in mb for t in r)
        flat = sorted(i for mb in step.assignment for r in mb for c in r for i in c)
        assert flat == sorted(step.item_ids.tolist())


def test_prefix_reuse_steps_run_groups_larger_than_the_cap_in_passes():
    """StepOptions(shared_prefix=True, prefix_reuse=True): a group whose tree exceeds
    the cap (and a rollout longer than the cap) is planned in passes, every physical
    token of the step once."""
    rng = np.random.default_rng(1)
    options = seqpack.StepOptions(shared_prefix=True, prefix_reuse=True)
    planner = StreamPlanner(2, 256, step_tokens=1500, options=options)
    rows_of, steps = {}, []
    for prompt in range(12):
        head = rng.integers(1, 1000, int(rng.integers(150, 300))).tolist()  # some rollouts pass the 256 cap
        rows = [head + rng.integers(1, 1000, int(rng.integers(1, 80))).tolist() for _ in range(4)]
        ids = planner.add(tokens=rows, group_ids=prompt, version=0, group_size=4)
        rows_of.update(zip(ids.tolist(), rows))
        while planner.ready(0):
            steps.append(planner.next_step(0))
    assert steps and planner.too_long_groups == 0
    for step in steps:
        plan = step.plan
        assert "prefix_reuse" in plan.planned_on
        rows = [rows_of[i] for i in step.item_ids.tolist()]
        tree = seqpack.pack_prefix_tree(rows, group_ids=np.repeat(np.arange(len(rows) // 4), 4))
        assert sum(t for mb in plan.tokens for r in mb for t in r) == tree.num_tokens  # each token once
        assert all(t <= 256 for mb in plan.tokens for r in mb for t in r)
        held = sorted(i for m in range(len(plan.assignment)) for r in range(2) for i in plan.rank_rows(r, m))
        assert held == list(range(len(rows)))


def test_beats_next_fit_in_arrival_order_on_the_same_stream():
    """Every step of a GRPO-like stream (8 rollouts a prompt, lognormal lengths,
    long ones finishing last) against torchtitan's next-fit of the same items in
    their arrival order."""
    rng = np.random.default_rng(3)
    cost = CostModel(2000.0, 1.0, 1.0 / 4096)
    planner = StreamPlanner(4, 8192, step_tokens=64 * 1024, options=StepOptions(cost=cost), max_staleness=2)
    arrival: List[int] = []
    lengths: Dict[int, int] = {}
    events = []
    for prompt in range(160):
        lens = np.minimum(rng.lognormal(7.0, 0.9, 8).astype(int) + 1, 8192)
        start = prompt * 40.0
        for x in lens:
            events.append((start + x * (0.5 + rng.random()), prompt, int(x)))
    events.sort()
    ratios, version = [], 0
    for t, prompt, x in events:
        i = int(planner.add([x], group_ids=prompt, version=version, group_size=8)[0])
        arrival.append(i)
        lengths[i] = x
        if planner.ready(version):
            step = planner.next_step(version)
            order = sorted(step.item_ids.tolist())  # arrival order = id order
            _, baseline = next_fit_step([lengths[i] for i in order], 4, 8192, cost)
            assert step.predicted_time <= baseline
            ratios.append(baseline / step.predicted_time)
            version += 1
    assert len(ratios) >= 6
    assert float(np.exp(np.mean(np.log(ratios)))) >= 1.15


def test_next_fit_reference():
    assert next_fit_rows([5, 4, 3, 6, 1], 9) == [[0, 1], [2, 3], [4]]
    cells, t = next_fit_step([5, 4, 3, 6, 1], 2, 9, CostModel(1.0, 1.0, 0.0))
    assert cells == [[[0, 1], [4]], [[2, 3], []]] and t == 10.0 + 2.0
    with pytest.raises(ValueError, match="exceeds max_tokens"):
        next_fit_rows([10], 9)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4), st.integers(0, 40)), min_size=1, max_size=8), st.integers(1, 2),
       st.integers(20, 300), st.data())
def test_forest_stream_rules(groups, dp_size, step_tokens, data):
    """shared_prefix=True: each group's rows share a prompt; steps are plan_step(forest=) plans
    of their groups' rows, physical tokens under the cap, every item once."""
    rows, labels = [], []
    for g, (size, prompt) in enumerate(groups):
        head = [1000 + g] * prompt
        for _ in range(size):
            rows.append(head + data.draw(st.lists(st.integers(1, 9), min_size=1, max_size=30)))
            labels.append(g)
    order = data.draw(st.permutations(range(len(rows))))
    planner = StreamPlanner(dp_size, 80, step_tokens=step_tokens, shared_prefix=True)
    steps, given_rows, label_of = [], {}, {}
    for i in order:
        item = int(planner.add(tokens=[rows[i]], group_ids=labels[i], version=0,
                               group_size=groups[labels[i]][0])[0])
        given_rows[item], label_of[item] = rows[i], labels[i]
        while planner.ready(0):
            steps.append(planner.next_step(0))
    last = planner.flush(0)
    steps += [last] if last is not None else []
    landed = sorted(i for s in steps for i in s.item_ids.tolist())
    assert landed == sorted(given_rows)
    for step in steps:
        ids = step.item_ids.tolist()
        forest = seqpack.PrefixForest.from_rows([given_rows[i] for i in ids],
                                                group_ids=[step.groups.index(label_of[i]) for i in ids])
        again = plan_step(forest.lengths, dp_size, 80, forest=forest)
        assert step.predicted_time == again.predicted_time and step.plan.tokens == again.tokens
        assert step.plan.forest == forest  # the step's forest: row p is position p's rollout
        assert all(t <= 80 for mb in step.tokens for r in mb for t in r)



def test_context_parallel_steps():
    """cp_size / hybrid_cp pass through: each step is the CP plan of its items."""
    cost = CostModel(1e-3, 1e-4, 2e-9, per_kv_token=1e-6, per_collective=2e-3)
    for hybrid in (False, True):
        options = StepOptions(cp_size=4, hybrid_cp=hybrid, cost=cost)
        planner = StreamPlanner(2, 4096, step_tokens=20000, options=options)
        planner.add([15000, 900, 700, 1200], group_ids=0, version=0, group_size=4)
        planner.add([3000, 800, 5000, 600], group_ids=1, version=0, group_size=4)
        step = planner.next_step(0)
        again = plan_step(step.plan.lengths, 2, 4096, cost=cost, cp_size=4, hybrid_cp=hybrid)
        assert step.plan.num_ranks == 8 and step.predicted_time == again.predicted_time
        assert step.plan.kv_tokens == again.kv_tokens
        assert sorted({i for mb in step.assignment for r in mb for c in r for i in c}) == list(range(8))
    assert hybrid and sorted(set(step.plan.cp_degree.tolist())) != [4]


def test_at_most_ten_parameters():
    """StreamPlanner takes plan_step's options as one object, not a copied signature."""
    import inspect

    params = inspect.signature(StreamPlanner).parameters
    assert len(params) <= 10, list(params)
    assert "options" in params and "shared_prefix" in params and "forest" not in params


OLD_KEYWORDS = [("cost", CostModel.verl()), ("sync", "step"), ("mini_batches", 2), ("min_micro_batches", 2),
                ("multiple_of", 2), ("seed", 3), ("cp_size", 2), ("hybrid_cp", True),
                ("micro_batch_order", "largest_first"), ("static_shapes", 4)]


@pytest.mark.parametrize("name, value", OLD_KEYWORDS, ids=[n for n, _ in OLD_KEYWORDS])
def test_each_old_keyword_warns_and_still_works(name, value):
    with pytest.warns(DeprecationWarning, match=rf"StreamPlanner\({name}=...\) is deprecated: .*"
                                                 rf"options=seqpack.StepOptions\({name}=...\)"):
        old = StreamPlanner(2, 1000, step_tokens=100, **{name: value})
    new = StreamPlanner(2, 1000, step_tokens=100, options=StepOptions(**{name: value}))
    assert old.options == new.options == StepOptions(**{name: value})
    for p in (old, new):
        p.add([300, 200, 400, 100], group_ids=[0, 0, 1, 1], version=0, group_size=2)
    assert old.next_step(0) == new.next_step(0)


def test_old_keywords_together_warn_once_naming_them_all():
    with pytest.warns(DeprecationWarning, match=r"StreamPlanner\(cp_size=..., hybrid_cp=..., min_cp_degree=...\) is "
                                                 r"deprecated: .*StepOptions\(cp_size=..., hybrid_cp=..., "):
        old = StreamPlanner(1, 1000, step_tokens=100, cp_size=4, hybrid_cp=True, min_cp_degree=2)
    assert old.options == StepOptions(cp_size=4, hybrid_cp=True, min_cp_degree=2)


def test_old_tree_keywords_warn_and_still_work():
    with pytest.warns(DeprecationWarning, match=r"StreamPlanner\(forest=True\) is deprecated: use "
                                                 r"StreamPlanner\(shared_prefix=True\)"):
        old = StreamPlanner(2, 100, step_tokens=10, forest=True)
    with pytest.warns(DeprecationWarning, match=r"StreamPlanner\(whole_trees=...\) is deprecated"):
        whole = StreamPlanner(2, 100, step_tokens=10, shared_prefix=True, whole_trees=True)
    assert old.shared_prefix and old.options == StepOptions(shared_prefix=True)
    assert whole.options == StepOptions(shared_prefix=True, whole_trees=True)
    with pytest.warns(DeprecationWarning, match=r"StreamPlanner.forest is deprecated: use StreamPlanner.shared_prefix"):
        assert old.forest is True
    with pytest.raises(TypeError, match="forest must be True or False .*StreamPlanner\\(shared_prefix=True\\)"):
        StreamPlanner(2, 100, step_tokens=10, forest=seqpack.PrefixForest.from_rows([[1, 2]]))
    with pytest.raises(ValueError, match=r"StreamPlanner: cp_size=4 and options.cp_size=2 disagree"):
        with pytest.warns(DeprecationWarning):
            StreamPlanner(2, 100, step_tokens=10, options=StepOptions(cp_size=2), cp_size=4)


def test_shared_prefix_from_options_or_the_switch():
    rows = [[7, 7, 7, 1], [7, 7, 7, 2, 3], [9, 9, 4]]
    steps = []
    for planner in (StreamPlanner(2, 100, step_tokens=10, shared_prefix=True),
                    StreamPlanner(2, 100, step_tokens=10, options=StepOptions(shared_prefix=True))):
        planner.add(tokens=rows, group_ids=[0, 0, 1], version=0, group_size=[2, 2, 1])
        steps.append(planner.next_step(0))
    assert steps[0] == steps[1]
    step = steps[0]
    forest = step.plan.forest  # row p: the rollout at the step's position p
    assert forest is not None and forest.lengths.tolist() == [len(rows[i]) for i in step.item_ids.tolist()]
    assert forest == seqpack.PrefixForest.from_rows([rows[i] for i in step.item_ids.tolist()], group_ids=[0, 0, 1])
    restored = pickle.loads(pickle.dumps(step))
    assert restored == step and restored.plan.forest == forest


def test_a_checkpoint_from_before_step_options_resumes():
    """A planner pickled when it kept plan_step's keywords (and ``forest``) loads with
    the same options."""
    planner = StreamPlanner(2, 100, step_tokens=50, shared_prefix=True, options=StepOptions(seed=3, mini_batches=2))
    planner.add(tokens=[[1, 2, 3], [1, 2, 4]], group_ids=0, version=0, group_size=2)
    old = planner.__getstate__()
    options = old.pop("options")
    old.update(forest=True, mini_batches=2, cost=options.cost, _plan_kwargs=dict(
        dp_size=2, max_tokens=100, cost=options.cost, sync="micro_batch", mini_batches=2, min_micro_batches=1,
        multiple_of=1, seed=3, cp_size=1, hybrid_cp=False, min_cp_degree=1, micro_batch_order="planned",
        static_shapes=None, whole_trees=False))
    resumed = StreamPlanner.__new__(StreamPlanner)
    resumed.__setstate__(old)
    assert resumed == planner and resumed.options == options
