"""Every public object crosses process boundaries (issue 26, item 1).

One sample of every public class of seqpack (found by walking the public
namespace, so a new class without a sample here fails :func:`test_every_public_class_has_a_sample`)
must pickle, deep-copy, cross a ``torch.multiprocessing`` queue into a spawned
process and back, and compare equal afterwards. Packed batches also cross
DataLoader workers started by fork and by spawn through :func:`seqpack.collate_packs`
(the hang the issue reports: the C++ layout could not be pickled, the worker's
queue thread died and the main process waited forever).
"""

from __future__ import annotations

import copy
import importlib
import inspect
import multiprocessing
import os
import pickle
import pkgutil
from pathlib import Path

import numpy as np
import pytest
import torch

import seqpack
from seqpack._equality import values_equal

EXAMPLES = seqpack.config.example("verl_ppo.yaml").parent  # the shipped examples

def public_modules():
    """Every module of the package whose path has no private part (``_core``,
    ``_lengths``, ``tensors._ops``, ... are not API), found on disk: a new module is
    walked without being listed here."""
    names = [m.name for m in pkgutil.walk_packages(seqpack.__path__, "seqpack.")
             if not any(part.startswith("_") for part in m.name.split(".")[1:])]
    return [importlib.import_module(name) for name in sorted(names)]


def public_classes():
    found = {}
    for mod in [seqpack] + public_modules():
        names = getattr(mod, "__all__", None)
        if names is None:
            names = [n for n in vars(mod) if not n.startswith("_")]
        if mod is seqpack:
            names = list(names) + list(seqpack._EXPORTS)
        for name in names:
            obj = getattr(mod, name, None)
            private = any(p.startswith("_") for p in obj.__module__.split(".")[1:] + obj.__qualname__.split(".")) \
                if inspect.isclass(obj) else True
            if inspect.isclass(obj) and obj.__module__.startswith("seqpack") and not private:
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found


# ---- one sample per class ----------------------------------------------------------
def _batch():
    ids = torch.arange(24).view(3, 8)
    return seqpack.pack_sequences({"input_ids": ids, "labels": ids.float()}, seq_lens=[3, 8, 5], pad_multiple=4)


def _cp_batch():
    return seqpack.pack_sequences(torch.arange(32).view(4, 8), seq_lens=[2, 4, 6, 1], cp_size=2, cp_rank=1,
                                  pad_multiple=4)


def _token_logprobs():
    torch.manual_seed(0)
    logits = torch.randn(8, 11, dtype=torch.float64)
    return seqpack.token_logprobs(logits, [0, 3, 8], torch.randint(0, 11, (8,)), return_entropy=True)


def _bdd(cls):
    from seqpack.frameworks.batched_data_dict import BatchedDataDict

    data = cls({"input_ids": torch.arange(12).view(4, 3), "input_lengths": torch.tensor([3, 2, 1, 3]),
                "extra": ["a", "b", "c", "d"]})
    shards = data.shard_by_batch_size(2, dynamic_batching_args={
        "input_key": "input_ids", "input_lengths_key": "input_lengths", "max_tokens_per_microbatch": 6,
        "sequence_length_round": 1})[0] if cls is BatchedDataDict else [data]
    return shards[0]


def _config(name):
    return seqpack.config.load(EXAMPLES / name)


def _report():
    from seqpack.tools.report import analyze

    return analyze([5, 9, 3, 12, 7, 1, 16, 2], capacity=16, dp_size=2, sequence_length_round=1)


def _stream_planner():
    planner = seqpack.StreamPlanner(2, 100, step_tokens=90, max_staleness=1,
                                    options=seqpack.planning.StepOptions(static_shapes=True))
    planner.add([40, 30, 20, 50, 10], group_ids=["a", "a", "b", "b", "c"], version=[0, 0, 1, 1, 1], group_size=2)
    return planner


def _path_choice():
    """A TRL path choice with its measurements (the CPU's turns, each path timed)."""
    from seqpack.frameworks.trl import choice

    c = choice.PathChoice(seqpack.CostModel.from_model(64, 2, 4, 2, 128), head_flops_per_token=6 * 64 * 64)
    for _ in range(2 + 2 * choice.EXPLORE):
        c.run("cpu", True, 100.0, 40.0, lambda: "trl", lambda: "tree")
    return c


def _shared_tree():
    """Two rows sharing a 5-token prefix: split at 4 tokens, two provider passes."""
    return seqpack.pack_prefix_tree([[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 8, 9]])


def _samples():
    from seqpack.frameworks import batched_data_dict as bdd, config, hf, nemo_rl, roll
    from seqpack.frameworks.trl import choice as trl_choice
    from seqpack.planning import packing
    from seqpack.tensors import hybrid_cp, packed_tensors, prefix_passes, prefix_tree, token_layout, tree_plans
    from seqpack.training import logprobs_tree
    from seqpack.testing import rollout_stream, tiny_model
    from seqpack.tools import report, report_cp, report_trees
    from seqpack.tensors import cp_cut, parts_layout, sharded_layout
    from seqpack.training import loss, loss_hybrid_cp, prefix_reuse

    lengths = [46, 24, 55, 88, 11, 14, 73, 17]
    tiny = tiny_model.TinyConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1)
    s = {
        # planning
        packing.PackingAlgorithm: lambda: packing.PackingAlgorithm.MODIFIED_FIRST_FIT_DECREASING,
        packing.SequencePacker: lambda: packing.SequencePacker(100, collect_metrics=True,
                                                               algorithm="first_fit_decreasing"),
        seqpack.MicroBatchPlan: lambda: seqpack.plan_micro_batches(lengths, max_tokens=128),
        seqpack.DynamicBatchingPlan: lambda: seqpack.plan_dynamic_batching([2, 8, 4, 16, 28, 32, 2, 32], 2, 32, 4),
        seqpack.PackingMetrics: lambda: _metrics(),
        seqpack.CostModel: lambda: seqpack.CostModel.verl(),
        seqpack.StepPlan: lambda: seqpack.plan_step(lengths, dp_size=2, max_tokens=128, mini_batches=2),
        seqpack.planning.StepOptions: lambda: seqpack.planning.StepOptions(cost=seqpack.CostModel.verl(), cp_size=2,
                                                                           static_shapes=[64, 128]),
        seqpack.StreamPlanner: _stream_planner,
        seqpack.StreamStep: lambda: _stream_planner().next_step(1),
        trl_choice.PathChoice: _path_choice,
        rollout_stream.Rollout: lambda: rollout_stream.grpo_rollouts(2, 2, seed=1)[0],
        # tensors
        seqpack.PackedLayout: lambda: seqpack.PackedLayout.from_lengths([3, 5, 1], pad_multiple=4, cp_size=2,
                                                                        cp_rank=1),
        seqpack.PackedSeqParams: lambda: seqpack.PackedLayout.from_lengths([3, 5]).packed_seq_params(),
        seqpack.PackedBatch: _batch,
        seqpack.StaticPackedBatch: lambda: seqpack.pack_sequences_static(torch.arange(16).view(2, 8), [3, 8],
                                                                         max_tokens=16, max_seqs=4),
        packed_tensors.NamedPackedTensors: lambda: packed_tensors.NamedPackedTensors(
            {"input_ids": torch.arange(8)}, torch.tensor([0, 3, 8], dtype=torch.int32),
            torch.tensor([0, 4, 8], dtype=torch.int32), 5, 4, torch.tensor([3, 5])),
        seqpack.PackedDataset: lambda: seqpack.pack_dataset([[1, 2, 3], [4, 5, 6, 7, 8], [9]], pack_size=8),
        prefix_tree.PrefixTreeMetrics: lambda: seqpack.pack_prefix_tree([[1, 2], [1, 3]]).metrics(),
        seqpack.PrefixForest: lambda: seqpack.PrefixForest.from_rows([[5, 6, 7], [5, 6, 8], [5], []],
                                                                      group_ids=[0, 0, 1, 1]),
        seqpack.planning.ForestItems: lambda: seqpack.PrefixForest.from_rows(
            [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6], [1, 2, 7, 8]]).items(6),
        seqpack.planning.PrefixReusePlan: lambda: seqpack.planning.plan_prefix_reuse(
            seqpack.PrefixForest.from_rows([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8], [9, 9, 5]]), 4, 2),
        prefix_passes.PrefixPasses: lambda: seqpack.split_prefix_tree(_shared_tree(), 4),
        prefix_passes.TreePass: lambda: seqpack.split_prefix_tree(_shared_tree(), 4).passes[1],
        prefix_reuse.PrefixReuseStep: lambda: seqpack.prefix_reuse(seqpack.split_prefix_tree(_shared_tree(), 4),
                                                              memory="kv"),
        prefix_reuse.PassMicroBatch: lambda: next(iter(seqpack.prefix_reuse(seqpack.split_prefix_tree(
            _shared_tree(), 4)))),
        seqpack.PrefixTreeBatch: lambda: seqpack.pack_prefix_tree([[5, 6, 7], [5, 6, 8], [5]], group_ids=[0, 0, 1],
                                                                   pad_to_multiple_of=4),
        tree_plans.TreeAttentionPlan: lambda: tree_plans.attention_plan(seqpack.pack_prefix_tree([[5, 6, 7], [5, 6, 8]])),
        tree_plans.TreeCpPlan: lambda: tree_plans.cp_attention_plan(seqpack.pack_prefix_tree([[5, 6, 7], [5, 6, 8]]), 2, 1),
        # training
        seqpack.TokenLogprobs: _token_logprobs,
        logprobs_tree.TreeTargets: lambda: logprobs_tree.tree_targets(seqpack.pack_prefix_tree([[5, 6, 7], [5, 6, 8]])),
        loss.NLLLoss: loss.NLLLoss,
        loss.ClippedPGLoss: lambda: loss.ClippedPGLoss({"ratio_clip_min": 0.2, "ratio_clip_max": 0.28}),
        loss.SequencePackingLossWrapper: lambda: loss.SequencePackingLossWrapper(
            loss.NLLLoss(), cu_seqlens_q=[0, 3, 5], cu_seqlens_q_padded=[0, 4, 8], temperature=0.7),
        loss.MseValueLoss: lambda: loss.MseValueLoss({"scale": 0.5, "cliprange": 0.2}),
        loss.DistillationLoss: lambda: loss.DistillationLoss({"kl_type": "reverse", "zero_outside_topk": True}),
        loss.DPOLoss: lambda: loss.DPOLoss({"sft_loss_weight": 0.1, "preference_average_log_probs": True}),
        loss.PreferenceLoss: loss.PreferenceLoss,
        loss.LossType: lambda: loss.LossType,  # namespaces of NeMo-RL's constants: the class itself travels
        loss.MetricNormalization: lambda: loss.MetricNormalization,
        loss.LossConfigError: lambda: loss.LossConfigError("cfg['ratio_clip_min'] must be >= 0"),
        # frameworks
        bdd.BatchedDataDict: lambda: _bdd(bdd.BatchedDataDict),
        bdd.SlicedDataDict: lambda: _bdd(bdd.SlicedDataDict),
        bdd.BatchedDataDictError: lambda: bdd.BatchedDataDictError("shards must divide the batch"),
        bdd.TreeMicroBatch: lambda: bdd.TreeMicroBatch(tree=seqpack.pack_prefix_tree([[5, 6, 7], [5, 6]]),
                                                      data=_bdd(bdd.SlicedDataDict), rows=(3, 4)),
        bdd.DynamicBatchingArgs: lambda: bdd.DynamicBatchingArgs(
            input_key="input_ids", input_lengths_key="input_lengths", sequence_length_round=4,
            max_tokens_per_microbatch=64),
        bdd.SequencePackingArgs: lambda: bdd.SequencePackingArgs(
            max_tokens_per_microbatch=64, input_key="input_ids", input_lengths_key="input_lengths",
            algorithm="first_fit_decreasing", sequence_length_pad_multiple=1),
        nemo_rl.ShardRecord: lambda: nemo_rl.ShardRecord(dict(_bdd(bdd.SlicedDataDict)), micro_batch_token_cap=8),
        nemo_rl.StepShard: lambda: nemo_rl.StepShard(seqpack.plan_step([3, 2, 1], 1, 8), 0, (0, 1, 2), 0),
        config.SeqpackConfig: lambda: _config("nemo_rl_sequence_packing.yaml"),
        config.ParallelConfig: lambda: _config("nemo_rl_sequence_packing.yaml").parallel,
        config.SequencePackingConfig: lambda: _config("nemo_rl_sequence_packing.yaml").sequence_packing,
        config.DynamicBatchingConfig: lambda: _config("nemo_rl_dynamic_batching.yaml").dynamic_batching,
        config.RollPackingConfig: lambda: _config("roll_sequence_packing.yaml").roll_packing,
        config.RollDynamicBatchingConfig: lambda: _config("roll_dynamic_batching.yaml").roll_dynamic_batching,
        config.VerlConfig: lambda: _config("verl_ppo.yaml").verl,
        config.StreamConfig: lambda: _config("nemo_rl_async_grpo.yaml").stream,
        config.VerlMicroBatching: lambda: _config("verl_ppo.yaml").verl.actor,
        config.ConfigError: lambda: config.ConfigError("policy.sequence_packing.enabled must be a bool"),
        hf.PackingCollator: lambda: hf.PackingCollator(pad_to_multiple_of=4),
        roll.RollBatch: lambda: roll.RollBatch({"input_ids": torch.arange(6).view(2, 3)}, meta_info={"k": 1}),
        roll.RollError: lambda: roll.RollError("max_tokens_per_microbatch must be positive"),
        roll.SequencePackingConfig: lambda: roll.SequencePackingConfig(algorithm="load_balance",
                                                                       max_packed_sequence_length_train=64),
        roll.SequencePackingPacker: lambda: roll.SequencePackingPacker(roll.SequencePackingConfig(
            algorithm="none", max_packed_sequence_length_train=64)),
        roll.LoadBalancePacker: lambda: roll.LoadBalancePacker(roll.SequencePackingConfig(
            algorithm="load_balance", max_packed_sequence_length_train=64)),
        # tools
        token_layout.TokenLayout: _planned_layout,
        report.Report: _report,
        report_trees.TreeReport: lambda: report_trees.tree_report(
            *report_trees.grpo_rows(prompts=2, group=2, seed=0, max_len=4096), capacity=4096, dp_size=2),
        report_cp.CpReport: lambda: report_cp.cp_report(report_cp.long_context_lengths(8, 2048), 1024, 1, 2),
        hybrid_cp.HybridCpBatch: _hybrid_micro_batch,
        parts_layout.HybridCpPart: lambda: _hybrid_micro_batch().parts[1],
        parts_layout.PartsLayout: _planned_parts_layout,
        cp_cut.CpCut: lambda: cp_cut.CpCut("zigzag", 2, 1),
        loss_hybrid_cp.PartsLoss: lambda: loss_hybrid_cp.PartsLoss(_hybrid_micro_batch(), loss.SequencePackingLossWrapper(
            loss.NLLLoss(), cu_seqlens_q=_hybrid_micro_batch())),
        sharded_layout.ShardedLayout: lambda: seqpack.shard_layout(prefix_tree.pack_prefix_tree(
            [[1, 2, 3, 4, 5], [1, 2, 3, 6]]), 2, 1),
        report.Table: lambda: report.Table("bins", ["a", "b"], [[1, report.Pct(0.5)], [2, report.Ms(3.0)]]),
        report.Pct: lambda: report.Pct(0.25),
        report.Ms: lambda: report.Ms(1.5),
        # testing oracles
        tiny_model.TinyConfig: lambda: tiny,
        tiny_model.RMSNorm: lambda: tiny_model.RMSNorm(16, 1e-6),
        tiny_model.Block: lambda: _seeded(lambda: tiny_model.Block(tiny)),
        tiny_model.TinyCausalLM: lambda: _seeded(lambda: tiny_model.TinyCausalLM(tiny)),
    }
    # Every packer under its NeMo-RL class name, with a seeded shuffle where it has one.
    for name in ("concatenative", "first_fit_decreasing", "first_fit_shuffle", "modified_first_fit_decreasing",
                 "best_fit_decreasing", "greedy_sequential"):
        packer = seqpack.get_packer(name, bin_capacity=100, seed=3) if name == "first_fit_shuffle" else \
            seqpack.get_packer(name, bin_capacity=100)
        s.setdefault(type(packer), lambda p=packer: copy.copy(p))
    s[packing.FirstFitPacker] = lambda: packing.FirstFitPacker(100, algorithm="first_fit_decreasing")
    return s


def _planned_layout():
    """A layout of rows that share nothing, with its host plans built."""
    layout = seqpack.PackedLayout.from_lengths([3, 5, 1], pad_multiple=4)
    layout.logical_index, layout.position_ids, layout.pad_index  # noqa: B018 (built and kept)
    return layout


def _hybrid_micro_batch():
    """Rank 0's hybrid-CP micro-batch: a row whole, a row sharded over 2 ranks."""
    plan = seqpack.plan_step([12, 3, 2], 1, 9, cp_size=2, hybrid_cp=True)
    ids = torch.arange(1, 37).view(3, 12)
    mb = seqpack.pack_hybrid_cp({"input_ids": ids}, [12, 3, 2], plan, rank=0, micro_batch=0)
    mb.data = {"input_ids": ids[list(mb.rows)]}
    return mb


def _planned_parts_layout():
    """A hybrid micro-batch's composite layout with host plans built (they are rebuilt
    where it lands)."""
    layout = _hybrid_micro_batch().layout
    layout.logical_index, layout.pad_index
    return layout


def _metrics():
    m = seqpack.PackingMetrics()
    m.update([30, 30, 30, 30, 30], [[4, 3, 2], [1, 0]], 100)
    return m


def _seeded(make):
    torch.manual_seed(0)
    return make()


SAMPLES = _samples()


# ---- equality after the trip -----------------------------------------------------------
def same(a, b) -> bool:
    """``a == b`` (and not ``a != b``): every public class has value equality, tensors
    and arrays compared element by element. Only torch modules (compared by their
    state dicts) and exceptions (by type and args) keep Python's identity ``==``."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.nn.Module):
        return values_equal(dict(a.state_dict()), dict(b.state_dict()))
    if isinstance(a, BaseException):
        return a.args == b.args
    return bool(a == b) and not bool(a != b)


def test_the_loss_wrapper_of_a_hybrid_micro_batch_pickles():
    from seqpack.training.loss import NLLLoss

    wrapper = seqpack.SequencePackingLossWrapper(NLLLoss(), cu_seqlens_q=_hybrid_micro_batch())
    for back in (pickle.loads(pickle.dumps(wrapper)), copy.deepcopy(wrapper)):
        assert same(back, wrapper) and back.parts is not None


def test_every_public_class_has_a_sample():
    missing = sorted(name for name, cls in public_classes().items() if cls not in SAMPLES)
    assert not missing, f"public classes without a pickling sample in {__file__}: {missing}"


IDS = {cls: f"{cls.__module__.split('.')[-1]}.{cls.__qualname__}" for cls in SAMPLES}


@pytest.mark.parametrize("cls", list(SAMPLES), ids=[IDS[c] for c in SAMPLES])
def test_pickle_and_deepcopy_round_trip(cls):
    obj = SAMPLES[cls]()
    typed_dict = type(cls).__name__ == "_TypedDictMeta"  # TypedDicts build plain dicts
    assert isinstance(obj, dict) if typed_dict else (inspect.isclass(obj) or isinstance(obj, cls))
    for protocol in (2, pickle.HIGHEST_PROTOCOL):
        back = pickle.loads(pickle.dumps(obj, protocol=protocol))
        assert same(obj, back), (obj, back)
    twin = copy.deepcopy(obj)
    assert same(obj, twin)
    assert same(copy.copy(obj), obj)


# ---- the C++ objects and the layout: plain arrays in, checked on the way back ---------------------
def test_layout_pickles_through_its_offsets_and_keeps_working():
    b = _cp_batch()
    back = pickle.loads(pickle.dumps(b))
    assert back == b and back.layout == b.layout and hash(back.layout) == hash(b.layout)
    assert back.layout.cp_size == 2 and back.layout.cp_rank == 1
    # The restored plan runs: unpack of the restored batch equals the original's.
    assert torch.equal(back.unpack(back["input"]), b.unpack(b["input"]))
    assert torch.equal(back.position_ids, b.position_ids)
    state = b.layout._core_layout.__getstate__()
    assert [type(x).__name__ for x in state] == ["ndarray", "ndarray", "int"]


def test_corrupt_pickled_state_is_refused():
    core = seqpack.PackedLayout.from_lengths([3, 5]).__reduce__()[1][0]
    cu, padded, cp = core.__getstate__()
    with pytest.raises(ValueError, match="never decrease|start at 0"):
        type(core).__new__(type(core)).__setstate__((np.array([0, 5, 3], np.int32), padded, cp))
    plan = _batch()._plan
    state = list(plan.__getstate__())
    copies = state[4].copy()
    copies[0, 1] = 10 ** 6  # a copy run that leaves the packed buffer
    state[4] = copies
    with pytest.raises(ValueError, match="corrupt"):
        type(plan).__new__(type(plan)).__setstate__(tuple(state))
    state = list(plan.__getstate__())
    state[8] += 1  # rows that do not match the layout
    with pytest.raises(ValueError, match="corrupt"):
        type(plan).__new__(type(plan)).__setstate__(tuple(state))
    with pytest.raises(ValueError, match="cp_rank"):
        seqpack.PackedLayout._from_core(core, 1, 1)


def test_layout_never_aliases_the_tensors_it_hands_out():
    """Item 5: an in-place edit of a batch's offsets (or of offsets_on's result)
    changes neither the layout nor what seqpack's kernels read from it."""
    b = _batch()
    logits = torch.randn(b.num_tokens, 40, dtype=torch.float64)
    ids = torch.randint(0, 40, (b.num_tokens,))
    before = seqpack.token_logprobs(logits, b.layout, ids).logprobs
    b.cu_seqlens += 1
    b.cu_seqlens_padded[1] = 0
    handed = b.layout.offsets_on("cpu")
    handed[0].zero_()
    b.layout.packed_seq_params().cu_seqlens_q.fill_(7)
    assert b.layout.cu_seqlens.tolist() == [0, 3, 11, 16]
    assert b.layout.offsets_on("cpu")[0].tolist() == [0, 3, 11, 16]
    assert torch.equal(seqpack.token_logprobs(logits, b.layout, ids).logprobs, before)
    with pytest.raises(ValueError):
        b.layout.cu_seqlens[0] = 1


# ---- DataLoader workers (fork and spawn) and torch.multiprocessing queues ----------------
def _dataset():
    return seqpack.pack_dataset([list(range(1, n + 1)) for n in (5, 9, 3, 12, 7, 1, 4, 6)], pack_size=16,
                                mask_first_label=False)


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_collate_packs_in_dataloader_workers(start):
    packs = _dataset()
    loader = torch.utils.data.DataLoader(packs, batch_size=2, collate_fn=seqpack.collate_packs, num_workers=2,
                                         multiprocessing_context=start, timeout=120)
    got = list(loader)
    want = [seqpack.collate_packs([packs[i] for i in range(k, min(k + 2, len(packs)))])
            for k in range(0, len(packs), 2)]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert isinstance(g, seqpack.PackedBatch) and g == w
        assert torch.equal(g.unpack(g["input_ids"]), w.unpack(w["input_ids"]))


def _echo(inbox, outbox):
    while True:
        item = inbox.get()
        if item is None:
            return
        outbox.put(item)


def test_every_sample_crosses_a_torch_multiprocessing_queue():
    ctx = torch.multiprocessing.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    worker = ctx.Process(target=_echo, args=(inbox, outbox), daemon=True)
    worker.start()
    try:
        for cls, make in SAMPLES.items():
            obj = make()
            inbox.put(obj)
            back = outbox.get(timeout=120)
            assert same(obj, back), IDS[cls]
    finally:
        inbox.put(None)
        worker.join(timeout=60)
        if worker.is_alive():
            worker.kill()
    assert worker.exitcode == 0


def test_pool_workers_get_and_return_batches():
    """A batch sent to a plain multiprocessing pool (spawn) is packed again by nobody:
    the worker unpacks it with the pickled plan."""
    b = _batch()
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        out = pool.apply_async(_unpack_input_ids, (b,)).get(timeout=120)
    assert torch.equal(out, b.unpack(b["input_ids"]))


def _unpack_input_ids(batch):
    assert os.getpid() != 0
    return batch.unpack(batch["input_ids"])


def _read_only_arrays(obj, path=(), depth=4, seen=None):
    """(path, array) of every read-only NumPy array reachable from ``obj`` through
    attributes, mappings and sequences (``depth`` levels)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth < 0:
        return
    seen.add(id(obj))
    if isinstance(obj, np.ndarray):
        if not obj.flags.writeable:
            yield path, obj
        return
    if isinstance(obj, dict):
        items = list(obj.items())
    elif isinstance(obj, (list, tuple)):
        items = list(enumerate(obj))
    elif hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module)):
        items = list(vars(obj).items())
    else:
        return
    for key, value in items:
        yield from _read_only_arrays(value, path + (key,), depth - 1, seen)


def _follow(obj, path):
    for key in path:
        obj = obj[key] if isinstance(obj, (dict, list, tuple)) else vars(obj)[key]
    return obj


@pytest.mark.parametrize("cls", list(SAMPLES), ids=[IDS[c] for c in SAMPLES])
def test_read_only_arrays_stay_read_only(cls):
    # NumPy's pickle drops the flag: a plan documented read-only must not come back
    # writable from a worker or a deepcopy (a stray write would change what it says).
    obj = SAMPLES[cls]()
    frozen = list(_read_only_arrays(obj))
    for back in (pickle.loads(pickle.dumps(obj)), copy.deepcopy(obj)):
        for path, _ in frozen:
            try:
                arr = _follow(back, path)
            except (KeyError, IndexError, TypeError):
                continue  # a lazily built plan the copy rebuilds where it lands
            assert not arr.flags.writeable, f"{IDS[cls]}: {'.'.join(map(str, path))} came back writable"
