"""TRL's accumulation window in prefix-reuse passes (issue 52): with
``steps_per_generation`` equal to the accumulation steps, a GRPO / RLOO step whose
groups are larger than ``per_device_train_batch_size`` (and scattered by TRL's
shuffle) forwards and back-propagates each prompt once per optimizer step. The
gradient the optimizer sees equals TRL's own path in fp64 (TRL's head made exact,
as in test_trl_tree.py), for every loss TRL computes from the log-probs."""

import pytest
import torch

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets")

import seqpack.frameworks.trl as seqpack_trl  # noqa: E402
from seqpack.frameworks.trl import tree as trl_tree  # noqa: E402
from seqpack.frameworks.trl import window as trl_window  # noqa: E402
from test_hf_tree import fp64_norms  # noqa: E402,F401  (the fixture)
from test_trl_tree import _ExactHead, _restore_trl, fp64_rope, rel, tiny, trainer  # noqa: E402,F401 (fixtures)


class _Grads(transformers.TrainerCallback):
    """The gradient the optimizer steps on, at each optimizer step."""

    def __init__(self):
        self.steps = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})


def step_grads(kind, tmp_path, **kw):
    t = trainer(kind, model=tiny(torch.float64), tmp_path=tmp_path, bf16=False, per_device_train_batch_size=2,
                gradient_accumulation_steps=4, steps_per_generation=4, max_steps=2, **kw)
    grads = _Grads()
    t.add_callback(grads)
    t.train()
    return grads.steps, [h["loss"] for h in t.state.log_history if "loss" in h]


@pytest.mark.parametrize("kind,extra", [
    ("grpo", {}),                                                  # TRL's default loss (dapo)
    ("grpo", {"loss_type": "grpo", "importance_sampling_level": "sequence", "beta": 0.1}),
    ("grpo", {"loss_type": "bnpo", "num_iterations": 2, "gradient_checkpointing": False}),
    ("rloo", {}),
], ids=["grpo-dapo", "grpo-seq-is-kl", "grpo-bnpo-iterations", "rloo"])
def test_a_window_in_passes_gives_trls_gradient(kind, extra, tmp_path, monkeypatch, fp64_norms, fp64_rope):  # noqa: F811
    monkeypatch.setattr(trl.trainer.utils, "_ChunkedLogProbFunction", _ExactHead)
    want, want_losses = step_grads(kind, tmp_path / "trl", **extra)
    seqpack_trl.patch(shared_prefix=True, trees="always")
    trl_tree.counts(reset=True)
    got, got_losses = step_grads(kind, tmp_path / "window", **extra)
    ran = trl_tree.counts()
    assert ran["prefix_reuse_windows"] == len(got) == len(want) == 2  # one window per optimizer step
    for before, after in zip(want, got):
        assert before.keys() == after.keys()
        for name, grad in before.items():
            assert rel(after[name], grad) < 1e-9, name
    assert got_losses == pytest.approx(want_losses, rel=1e-9)


def test_a_window_that_does_not_apply_runs_each_micro_batch_as_its_tree(tmp_path):
    seqpack_trl.patch(shared_prefix=True, trees="always")
    trl_tree.counts(reset=True)
    # two optimizer steps per generation: each micro-batch's gradient is its own step's
    t = trainer("grpo", model=tiny(torch.float64), tmp_path=tmp_path, bf16=False, per_device_train_batch_size=2,
                gradient_accumulation_steps=2, steps_per_generation=4, max_steps=2)
    t.train()
    ran = trl_tree.counts()
    assert ran["prefix_reuse_windows"] == 0 and ran["tree_batches"] > 0
    assert trl_window.KEY not in t.__dict__


def test_a_window_checks_its_micro_batches(tmp_path):
    t = trainer("grpo", model=tiny(torch.float64), tmp_path=tmp_path, bf16=False)
    run = trl_window.WindowRun(0, 2, 1, [], None, None, torch.zeros(2, 3), None, [])
    run.serve(0, False)
    with pytest.raises(RuntimeError, match="micro-batch 0 of the accumulation window asked for its log-probs twice"):
        run.serve(0, False)
    with pytest.raises(RuntimeError, match="asked for entropies the window's first micro-batch did not"):
        run.serve(1, True)
    t.__dict__[trl_window.KEY] = run
    t._step = 2
    with pytest.raises(RuntimeError, match=r"micro-batches \[1\] of the accumulation window never asked"):
        trl_window.after_training_step(t, t.model)
    from seqpack.training.prefix_reuse import _parameters

    stale = trl_window.WindowRun(0, 1, 1, [], None, None, torch.zeros(1, 3), None, _parameters(t.model))
    stale.serve(0, False)
    t.__dict__[trl_window.KEY] = stale
    t._step = 1
    with torch.no_grad():
        next(t.model.parameters()).add_(1.0)  # an update inside the window
    with pytest.raises(RuntimeError, match="parameters changed inside the accumulation window"):
        trl_window.after_training_step(t, t.model)


def _ddp_window(rank, world):
    """Each rank's window in passes under DDP (its own rows, its own loss gradients):
    the gradient after the window is the ranks' mean of each rank's plain-tree
    gradient of sum(log-probs * g), as DDP averages any micro-batch's."""
    import contextlib
    import types

    import torch.distributed as dist

    from seqpack.frameworks._completion_trees import completion_tree, to_completions
    from seqpack.tensors.prefix_passes import split_prefix_tree
    from seqpack.training.prefix_reuse import _parameters
    from test_trl_tree import grpo_batch

    seqpack_trl.patch(shared_prefix=True, trees="always")
    t = trainer("grpo", model=tiny(torch.float64), bf16=False)  # TRL's head on the model, the same on every rank
    model = t.model
    trl_tree._install(model)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ids, mask = grpo_batch(g=4, groups=2, seed=rank)
    found = completion_tree(ids, mask, 6)
    passes = split_prefix_tree(found[0], 2 * ids.shape[1])
    accelerator = types.SimpleNamespace(autocast=contextlib.nullcontext, no_sync=lambda model: model.no_sync(),
                                        num_processes=world)
    host = types.SimpleNamespace(accelerator=accelerator)
    with torch.no_grad():
        lp, ent, _ = trl_tree._in_passes(host, ddp, passes, found, (8, 6), True)
    run = trl_window.WindowRun(0, 4, 2, [ids], found, passes, lp, ent, _parameters(model))
    gen = torch.Generator().manual_seed(100 + rank)
    run.grad_logps = torch.randn(lp.shape, generator=gen, dtype=lp.dtype)
    run.grad_entropies = torch.randn(ent.shape, generator=gen, dtype=ent.dtype)
    model.zero_grad(set_to_none=True)
    run.finish(host, ddp)
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    tree, scored, source, target = found
    kw = tree.hf_kwargs(ids.device)
    out = model(input_ids=kw["input_ids"], position_ids=kw["position_ids"], seqpack_tree=(tree, scored, True))
    lp2, ent2 = to_completions((out["log_probs"], out["entropy"]), source, target, (8, 6))
    torch.testing.assert_close(lp2.detach(), lp, rtol=1e-12, atol=1e-12)
    ((lp2 * run.grad_logps).sum() + (ent2 * run.grad_entropies).sum()).backward()
    for name, p in model.named_parameters():
        want = p.grad.clone()
        dist.all_reduce(want)
        torch.testing.assert_close(got[name], want / world, rtol=1e-9, atol=1e-12, msg=name)


def test_a_window_under_ddp_reduces_its_gradient_once():
    from _gloo import run_world

    run_world(2, _ddp_window, (), 240)


def _ddp_trainer_steps(rank, world, port):
    """GRPO under accelerate's DDP (gloo): two optimizer steps, TRL's path and the
    window in passes, the same gradients on every rank."""
    import os

    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import tempfile

    out, windows = [], []
    for patched in (False, True, "rank 1 declines"):
        seqpack_trl.unpatch()
        if patched:
            seqpack_trl.patch(shared_prefix=True, trees="always")
            trl_tree.counts(reset=True)
        if patched == "rank 1 declines" and rank == 1:  # its window would not pay: no rank runs one
            trl_window._plan = lambda *args, **kwargs: None
        t = trainer("grpo", model=tiny(torch.float64), tmp_path=__import__("pathlib").Path(tempfile.mkdtemp()),
                    bf16=False, per_device_train_batch_size=2, gradient_accumulation_steps=4, steps_per_generation=4,
                    max_steps=2, gradient_checkpointing=False)
        assert t.accelerator.num_processes == world
        grads = _Grads()
        t.add_callback(grads)
        t.train()
        out.append(grads.steps)
        windows.append(trl_tree.counts()["prefix_reuse_windows"])
    assert windows == [0, 2, 0]
    for run in out[1:]:
        for before, after in zip(out[0], run):
            for name, grad in before.items():
                assert rel(after[name], grad) < 1e-6, name  # TRL's fp32 head against seqpack's fp64 one


def test_grpo_under_ddp_runs_windows_in_passes():
    from _gloo import free_port, run_world

    run_world(2, _ddp_trainer_steps, (free_port(),), 300)


def test_a_window_applies_only_where_every_micro_batch_can_run_in_it(tmp_path):
    """Every buffered micro-batch must be one a tree takes (the fallback checks run on
    each, not only on the first); reentrant checkpointing and other accumulations
    decline the window; a padded step pickles with its padding."""
    import types

    t = trainer("grpo", model=tiny(torch.float64), tmp_path=tmp_path, bf16=False, per_device_train_batch_size=2,
                gradient_accumulation_steps=2, steps_per_generation=2)
    t.current_gradient_accumulation_steps = 2
    ids = torch.randint(3, 30, (2, 8))
    mask = torch.ones_like(ids)
    inputs = {"prompt_ids": ids[:, :5], "completion_ids": ids[:, 5:], "prompt_mask": mask[:, :5],
              "completion_mask": mask[:, 5:]}
    t._buffered_inputs = [inputs, dict(inputs)]
    count = trl_tree._micro_tree_tokens(3)
    assert trl_window._applies(t, t.model) == 2
    assert trl_window._plan(t, ids, 3, 2, count, True, lambda x: True) is not None
    assert trl_window._plan(t, ids, 3, 2, count, True, lambda x: x is inputs) is None  # the second is refused
    t.args = types.SimpleNamespace(**{**vars(t.args), "gradient_checkpointing": True,
                                     "gradient_checkpointing_kwargs": {"use_reentrant": True}})
    assert trl_window._applies(t, t.model) is None
    import pickle

    import seqpack

    passes = seqpack.split_prefix_tree(seqpack.pack_prefix_tree([[1, 2, 3, 4], [1, 2, 3, 5]]), 3)
    step = seqpack.prefix_reuse(passes, pad_to_multiple_of=4)
    back = pickle.loads(pickle.dumps(step))
    assert back == step and back.multiple == 4 and step != seqpack.prefix_reuse(passes)
