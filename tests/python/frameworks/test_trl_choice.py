"""The TRL patch's per-batch choice between TRL's path and the tree (issue 51, item 2:
``patch(shared_prefix=True)`` made small GRPO runs slower):
- the work of each path: TRL's padded rows (tokens, causal pairs, head positions)
  against the tree's physical tokens, visible pairs and scored positions;
- on the CPU the paths take turns (a warm-up, then measured), then the tree runs
  where it is priced ``MARGIN`` lower; the path not taken runs again every
  ``REFRESH`` calls; off the CPU a fixed ratio decides;
- through the patch: a batch where the tree does not pay runs TRL's path, returns
  TRL's values and is counted by ``report()``; ``trees="always"`` keeps the tree;
- the choice pickles and deep-copies with its measurements.
"""

from __future__ import annotations

import collections
import copy
import pickle

import pytest
import torch

from seqpack import CostModel
from seqpack.frameworks.trl import choice as choice_module
from seqpack.frameworks.trl.choice import ACCELERATOR_RATIO, EXPLORE, REFRESH, PathChoice


def fresh():
    return PathChoice(CostModel(0.0, 10.0, 1.0), head_flops_per_token=100.0)


def test_work_counts_each_paths_tokens_pairs_and_head():
    c = fresh()
    trl, tree = c.work(rows=2, columns=3, head_positions=6, tree_tokens=4, tree_pairs=7, scored=3)
    assert trl == 10.0 * 6 + 1.0 * 2 * 3 * 4 + 100.0 * 6  # rows x S tokens, rows x S(S+1) (= 2x the pairs)
    assert tree == 10.0 * 4 + 1.0 * 2 * 7 + 100.0 * 3


class Clock:
    """time.perf_counter for the choice: each path's call lasts what the test says."""

    def __init__(self):
        self.now, self.cost = 0.0, {"trl": 1.0, "tree": 1.0}

    def __call__(self):
        return self.now

    def path(self, name):
        def run():
            self.now += self.cost[name]
            return name
        return run


def test_cpu_explores_then_takes_the_cheaper_path_and_refreshes(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(choice_module.time, "perf_counter", clock)
    c = fresh()

    def call(work_trl, work_tree):
        return c.run("cpu", True, work_trl, work_tree, clock.path("trl"), clock.path("tree"))[1]

    # turns: a warm-up call each, then EXPLORE measured calls each
    clock.cost = {"trl": 1.0, "tree": 3.0}  # the tree's seconds per FLOP: 3x TRL's at these sizes
    assert [call(100.0, 50.0) for _ in range(2 + 2 * EXPLORE)] == ["tree", "trl"] * (1 + EXPLORE)
    assert c.q(True, "tree") == pytest.approx(3.0 / 50) and c.q(True, "trl") == pytest.approx(1.0 / 100)
    assert call(100.0, 50.0) == "trl"  # 0.06 * 50 = 3 > 0.01 * 100 = 1: the tree does not pay
    assert call(100.0, 16.0) == "trl"  # 0.96 < 1, but not by MARGIN
    assert call(100.0, 10.0) == "tree"  # 0.6 < 0.9: a batch that shares more
    # grad and no-grad calls are measured apart (a no-grad call explores its own)
    assert c.run("cpu", False, 100.0, 10.0, clock.path("trl"), clock.path("tree"))[0] == "tree"
    # the path not taken runs again after REFRESH calls, and its new time counts
    clock.cost = {"trl": 1.0, "tree": 0.5}
    taken = [call(100.0, 50.0) for _ in range(REFRESH + 1)]
    assert taken == ["trl"] * REFRESH + ["tree"]
    assert list(c._forward[(True, "tree")])[-1] == (50.0, 0.5)  # measured again
    assert c.q(True, "tree") == pytest.approx(0.06)  # the median of 0.06 x 3, 0.3 and 0.01


def test_off_the_cpu_a_fixed_ratio_decides():
    c = fresh()
    for work_tree, want in ((100.0 / ACCELERATOR_RATIO * 0.99, "tree"), (100.0 / ACCELERATOR_RATIO * 1.01, "trl")):
        path, out, mark = c.run("cuda", True, 100.0, work_tree, lambda: "trl", lambda: "tree")
        assert path == out == want and mark(7) == 7
    assert not c._seen and not c._forward  # nothing timed where calls are asynchronous


def test_a_call_with_gradients_is_timed_through_its_backward(monkeypatch):
    # The tree path's extra operations cost most in the backward (a tiny model's tree
    # ran its forward faster than TRL's and its step slower): a call's time runs from
    # its forward through the backward, from the log-probs' gradient to the embeddings'.
    clock = Clock()
    monkeypatch.setattr(choice_module.time, "perf_counter", clock)
    embed, head = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 1)

    class Slow(torch.autograd.Function):  # a layer whose backward takes `seconds`
        @staticmethod
        def forward(ctx, x, seconds):
            ctx.seconds = seconds
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            clock.now += ctx.seconds
            return grad, None

    def path(backward_seconds):
        def run():
            clock.now += 1.0  # the forward
            return head(Slow.apply(embed(torch.arange(3)), backward_seconds)).sum()
        return run

    def call(c, work_trl, work_tree, backward, run_backward=True):
        taken, out, mark = c.run("cpu", True, work_trl, work_tree, path(backward["trl"]), path(backward["tree"]),
                                 embed)
        out = mark(out)
        clock.now += 5.0  # the loss, other calls: not the call's
        if run_backward:
            out.backward()
        return taken

    c = fresh()
    backward = {"trl": 1.0, "tree": 9.0}  # forwards alike, the tree's backward 9x TRL's
    assert [call(c, 100.0, 50.0, backward) for _ in range(2 + 2 * EXPLORE)] == ["tree", "trl"] * (1 + EXPLORE)
    assert c.q(True, "tree") == pytest.approx(10.0 / 50) and c.q(True, "trl") == pytest.approx(2.0 / 100)
    assert call(c, 100.0, 25.0, backward) == "trl"  # 0.2 x 25 > 0.9 x 0.02 x 100; by forwards: 0.5 < 0.9
    # calls whose backward never runs are priced by their forwards
    c2 = fresh()
    for _ in range(2 + 2 * EXPLORE):
        call(c2, 100.0, 50.0, backward, run_backward=False)
    assert not c2._seen and c2.q(True, "tree") == pytest.approx(1.0 / 50)
    assert call(c2, 100.0, 25.0, backward, run_backward=False) == "tree"


def test_the_choice_pickles_with_its_measurements(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(choice_module.time, "perf_counter", clock)
    c = fresh()
    for _ in range(2 + 2 * EXPLORE):
        c.run("cpu", True, 100.0, 50.0, clock.path("trl"), clock.path("tree"))
    for other in (pickle.loads(pickle.dumps(c)), copy.deepcopy(c)):
        assert other.q(True, "tree") == c.q(True, "tree") and other.q(True, "trl") == c.q(True, "trl")
        assert repr(other) == repr(c)


trl = pytest.importorskip("trl")
pytest.importorskip("transformers")

import seqpack.frameworks.trl as seqpack_trl  # noqa: E402
from seqpack.frameworks.trl import tree as trl_tree  # noqa: E402
from test_trl_tree import grpo_batch, rel, trainer  # noqa: E402


@pytest.fixture(autouse=True)
def _restore_trl():
    seqpack_trl.unpatch()
    yield
    seqpack_trl.unpatch()


def test_a_batch_the_tree_does_not_pay_for_runs_trls_path():
    t = trainer("grpo", bf16=False)
    ids, mask = grpo_batch()
    with torch.no_grad():
        ref = t._get_per_token_logps_and_entropies(t.model, ids, mask, 6)[0]
        seqpack_trl.patch(shared_prefix=True)
        trl_tree.counts(reset=True)
        # the run's measurements: the tree's FLOPs cost 100x TRL's here
        t._seqpack_path_choice = choice = PathChoice.of_model(t.model)
        choice._calls.update({(False, "tree"): 1 + EXPLORE, (False, "trl"): 1 + EXPLORE})
        choice._seen[(False, "tree")] = collections.deque([(1.0, 100.0)])
        choice._seen[(False, "trl")] = collections.deque([(1.0, 1.0)])
        got = t._get_per_token_logps_and_entropies(t.model, ids, mask, 6)[0]
    assert torch.equal(got, ref)  # TRL's own values
    report = seqpack_trl.report()
    assert report["tree_batches"] == 0 and report["trl_reasons"] == {"tree_does_not_pay": 1}
    # trees="always": the tree whenever it can take the batch, measurements or not
    seqpack_trl.patch(shared_prefix=True, trees="always")
    with torch.no_grad():
        tree = t._get_per_token_logps_and_entropies(t.model, ids, mask, 6)[0]
    assert seqpack_trl.report()["tree_batches"] == 1 and rel(tree, ref) < 2e-4
    with pytest.raises(ValueError, match="trees must be 'auto'"):
        seqpack_trl.patch(trees="sometimes")  # refused before anything is replaced
