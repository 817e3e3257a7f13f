"""NeMo-RL's flow with prefix reuse (issue 52): ``plan_step(..., forest=,
prefix_reuse=True)`` -> ``shard_by_batch_size(step_plan=)`` -> each shard's passes
from ``make_microbatch_iterator_for_packable_sequences()``, NeMo-RL's loss wrapper on
each pass; the step's loss and every parameter gradient of a tiny HF Llama (fp64)
equal the same rows planned at a cap that holds every tree (one micro-batch per tree)."""

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import seqpack  # noqa: E402
from seqpack.frameworks.batched_data_dict import TreeMicroBatch  # noqa: E402
from seqpack.integrations import hf  # noqa: E402
from seqpack.loss import ClippedPGLoss, NLLLoss, SequencePackingLossWrapper  # noqa: E402

from test_batched_data_dict_tree import grpo_data  # noqa: E402

PG = {"ratio_clip_min": 0.2, "ratio_clip_max": 0.28, "ratio_clip_c": None, "reference_policy_kl_penalty": 0.01,
      "use_importance_sampling_correction": False}


def tiny_llama():
    cfg = transformers.AutoConfig.for_model(
        "llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=128, use_cache=False, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=hf.register_tree(),
                                                          dtype=torch.float64)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return model.train()


@pytest.fixture
def exact_norms(monkeypatch):
    """Llama's RMSNorm in fp64 throughout (HF's upcasts to fp32), so that summing a
    shared token's gradient in another order differs at 1e-15, not 1e-7."""
    from transformers.models.llama import modeling_llama

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", lambda self, x: self.weight * x * torch.rsqrt(
        x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def run_step(model, data, plan, loss_fn, dp, shard_kwargs=None, **iterator_options):
    """Every shard's micro-batches of every global batch, NeMo-RL's loop; the loss
    summed over ranks (the gradient of DP ranks summed, as an all-reduce would)."""
    model.zero_grad(set_to_none=True)
    gvs, gvt = data["sample_mask"].sum(), (data["token_mask"][:, 1:] * data["sample_mask"][:, None]).sum()
    shards, _ = data.shard_by_batch_size(dp, **(shard_kwargs or {"step_plan": plan}))
    total, counts, kinds = 0.0, [], []
    batches = [shard.get_batch(b) for shard in shards for b in range(len(shard.elem_counts_per_gb))]
    for batch in batches:
        mbs = []
        for tmb in batch.make_microbatch_iterator_for_packable_sequences(**iterator_options):
            assert isinstance(tmb, TreeMicroBatch)
            logits = tmb.forward(model)
            loss, _ = SequencePackingLossWrapper(loss_fn, cu_seqlens_q=tmb.tree)(logits, tmb.data, gvs, gvt)
            loss.backward()
            total += float(loss.detach())
            mbs.append(None if tmb.pass_micro_batch is None else tmb.pass_micro_batch.kind)
        counts.append(len(mbs))
        kinds.append(mbs)
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}, counts, kinds


@pytest.mark.parametrize("loss_fn", [NLLLoss(), ClippedPGLoss(PG)], ids=["nll", "clipped_pg"])
@pytest.mark.parametrize("memory", ["activations", "kv"])
def test_passes_through_nemo_rl_sharding_equal_whole_trees(loss_fn, memory, exact_norms):
    # Three prompts of 20-36 tokens; a cap of 16 cuts every group into passes.
    data, rows, groups = grpo_data([36, 20, 28], [[5, 7, 3, 6], [4, 9], [6, 2, 5]], seed=11)
    forest = seqpack.PrefixForest.from_rows(rows, group_ids=groups)
    model = tiny_llama()
    whole = seqpack.plan_step(forest.lengths, 2, 128, forest=forest)
    expected, want, _, _ = run_step(model, data, whole, loss_fn, 2)
    plan = seqpack.plan_step(forest.lengths, 2, 16, forest=forest, prefix_reuse=True)
    assert plan.planned_on == "prefix_reuse"
    total, grads, counts, kinds = run_step(model, data, plan, loss_fn, 2, prefix_reuse_memory=memory)
    assert counts == [plan.num_micro_batches[0]] * 2  # equal counts (dummies included)
    assert any("close" in k for k in kinds) and any("branch" in k for k in kinds)
    assert total == pytest.approx(expected, rel=1e-11)
    for n, g in grads.items():
        torch.testing.assert_close(g, want[n], rtol=1e-9, atol=1e-12)


def test_a_row_longer_than_the_cap_trains_through_the_shards(exact_norms):
    data, rows, groups = grpo_data([40], [[6, 3]], seed=2)  # 46-token rows, cap 24
    forest = seqpack.PrefixForest.from_rows(rows, group_ids=groups)
    model = tiny_llama()
    expected, want, _, _ = run_step(model, data, seqpack.plan_step(forest.lengths, 1, 64, forest=forest),
                                    NLLLoss(), 1)
    plan = seqpack.plan_step(forest.lengths, 1, 24, forest=forest, prefix_reuse=True)
    total, grads, _, _ = run_step(model, data, plan, NLLLoss(), 1)
    assert total == pytest.approx(expected, rel=1e-11)
    for n, g in grads.items():
        torch.testing.assert_close(g, want[n], rtol=1e-9, atol=1e-12)


def test_the_shards_check_the_plan_and_the_options():
    data, rows, groups = grpo_data([20, 12], [[4, 5], [3, 2, 6]], seed=5)
    forest = seqpack.PrefixForest.from_rows(rows, group_ids=groups)
    plan = seqpack.plan_step(forest.lengths, 1, 8, forest=forest, prefix_reuse=True)
    shards, _ = data.shard_by_batch_size(1, step_plan=plan)
    batch = shards[0].get_batch(0)
    assert batch.micro_batch_passes[0] is not None and batch.micro_batch_lengths[0] == plan.tokens[0][0]
    with pytest.raises(ValueError, match="pad_to_multiple_of=8 contradicts the shard's plan: this batch runs in "
                                         "the passes"):
        batch.make_microbatch_iterator_for_packable_sequences(pad_to_multiple_of=8)
    ids = data["input_ids"].clone()
    ids[0, 3] = (ids[0, 3] + 1) % 31 + 1  # a row that no longer shares its group's prompt
    changed = type(data)({**data.data, "input_ids": ids})
    with pytest.raises(ValueError, match="the data's tokens are not those the plan's forest was made of"):
        changed.shard_by_batch_size(1, step_plan=plan)
    plain = seqpack.plan_step(forest.lengths, 1, 64, forest=forest)
    shards, _ = data.shard_by_batch_size(1, step_plan=plain)
    trees = list(shards[0].get_batch(0).make_microbatch_iterator_for_packable_sequences(prefix_reuse_memory="kv"))
    assert trees and all(mb.pass_micro_batch is None for mb in trees)  # valid everywhere, used where passes run
    with pytest.raises(ValueError, match="prefix_reuse_memory must be one of"):
        shards[0].get_batch(0).make_microbatch_iterator_for_packable_sequences(prefix_reuse_memory="graph")


def test_sequence_packing_args_with_prefix_reuse_plan_the_step(exact_norms):
    """NeMo-RL's packing args (``policy.shared_prefix_reuse`` gives ``prefix_reuse``):
    each global batch planned by plan_step(..., prefix_reuse=True); two global batches
    train as the step plan of the same rows does."""
    data, rows, groups = grpo_data([30, 22, 26, 18], [[5, 7], [4, 9], [6, 2], [3, 8]], seed=8)
    args = {"max_tokens_per_microbatch": 20, "input_key": "input_ids", "input_lengths_key": "input_lengths",
            "algorithm": "modified_first_fit_decreasing", "sequence_length_pad_multiple": 1, "shared_prefix": True,
            "shared_prefix_group_key": "idx", "prefix_reuse": True}
    forest = seqpack.PrefixForest.from_rows(rows, group_ids=groups)
    plan = seqpack.plan_step(forest.lengths, 2, 20, forest=forest, prefix_reuse=True, mini_batches=2)
    shards, order = data.shard_by_batch_size(2, batch_size=4, sequence_packing_args=args)
    by_plan, plan_order = data.shard_by_batch_size(2, batch_size=4, step_plan=plan)
    assert order == plan_order and [s.micro_batch_lengths for s in shards] == [s.micro_batch_lengths for s in by_plan]
    assert all(p is not None for s in shards for p in s.micro_batch_passes)
    model = tiny_llama()  # two global batches trained in passes equal the same batches on whole trees
    whole = seqpack.plan_step(forest.lengths, 2, 128, forest=forest, mini_batches=2)
    expected, want, _, _ = run_step(model, data, whole, NLLLoss(), 2)
    total, grads, counts, _ = run_step(model, data, None, NLLLoss(), 2,
                                       shard_kwargs={"batch_size": 4, "sequence_packing_args": args})
    assert len(counts) == 4 and total == pytest.approx(expected, rel=1e-11)
    for n, g in grads.items():
        torch.testing.assert_close(g, want[n], rtol=1e-9, atol=1e-12)
    # padded to 8 (TP with sequence parallelism): every model input a multiple of 8, the same step
    padded = {**args, "sequence_length_pad_multiple": 8, "max_tokens_per_microbatch": 21}  # cap 16 after rounding
    inputs = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(transformers.LlamaForCausalLM, "forward", _recording(transformers.LlamaForCausalLM.forward, inputs))
        total8, grads8, _, kinds8 = run_step(model, data, None, NLLLoss(), 2,
                                             shard_kwargs={"batch_size": 4, "sequence_packing_args": padded})
    assert inputs and all(n % 8 == 0 and n <= 16 for n in inputs)
    assert any("close" in k for k in kinds8) and total8 == pytest.approx(expected, rel=1e-11)
    for n, g in grads8.items():
        torch.testing.assert_close(g, want[n], rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match=r"max_tokens_per_microbatch \(4\) is below sequence_length_pad_multiple"):
        data.shard_by_batch_size(2, batch_size=4, sequence_packing_args={**padded, "max_tokens_per_microbatch": 4})
    with pytest.raises(ValueError, match="prefix_reuse=True runs prefix trees in passes: it needs shared_prefix"):
        data.shard_by_batch_size(2, batch_size=4, sequence_packing_args={**args, "shared_prefix": False})
    with pytest.raises(ValueError, match="whose trees are of input_key='input_ids'; got 'tokens'"):
        data.shard_by_batch_size(2, batch_size=4, sequence_packing_args={**args, "input_key": "tokens"})
    with pytest.warns(UserWarning, match="microbatch_order='largest_first' not used"):
        data.shard_by_batch_size(2, batch_size=4, sequence_packing_args={**args, "microbatch_order": "largest_first"})


def _recording(forward, lengths):
    """The model's forward, recording each call's input length."""
    def recorded(self, *args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        lengths.append(int(ids.shape[-1]))
        return forward(self, *args, **kwargs)
    return recorded


def test_get_logprobs_over_the_passes_sum_to_the_rows(exact_norms):
    data, rows, groups = grpo_data([30, 18], [[5, 7, 2], [4, 9]], seed=4)
    forest = seqpack.PrefixForest.from_rows(rows, group_ids=groups)
    model = tiny_llama().eval()
    whole_plan = seqpack.plan_step(forest.lengths, 1, 128, forest=forest)
    shards, _ = data.shard_by_batch_size(1, step_plan=whole_plan)
    batch = shards[0].get_batch(0)
    with torch.no_grad():
        want = sum(mb.logprobs(model) for mb in batch.make_microbatch_iterator_for_packable_sequences())
        plan = seqpack.plan_step(forest.lengths, 1, 12, forest=forest, prefix_reuse=True)
        shards, _ = data.shard_by_batch_size(1, step_plan=plan)
        batch = shards[0].get_batch(0)
        got = sum(mb.logprobs(model) for mb in batch.make_microbatch_iterator_for_packable_sequences()
                  if mb.pass_micro_batch is not None)
    order = plan.rank_rows(0, 0)  # the shard's rows in the plan's order; the whole tree's in its own
    whole_order = whole_plan.rank_rows(0, 0)
    back = torch.empty_like(got)
    back[torch.tensor(order)] = got
    ref = torch.empty_like(want)
    ref[torch.tensor(whole_order)] = want
    torch.testing.assert_close(back, ref, rtol=1e-10, atol=1e-12)
    assert int((back != 0).sum()) == sum(len(r) - 1 for r in rows)


def test_plans_and_shards_in_passes_pickle_and_deep_copy():
    import copy
    import pickle

    data, rows, groups = grpo_data([20, 12], [[4, 5], [3, 2, 6]], seed=5)
    forest = seqpack.PrefixForest.from_rows(rows, group_ids=groups)
    plan = seqpack.plan_step(forest.lengths, 1, 8, forest=forest, prefix_reuse=True)
    for back in (pickle.loads(pickle.dumps(plan)), copy.deepcopy(plan)):
        assert back == plan and back.prefix_reuse == plan.prefix_reuse
        assert back.context_pairs == plan.context_pairs and back.rank_rows(0) == plan.rank_rows(0)
    shards, _ = data.shard_by_batch_size(1, step_plan=plan)
    batch = shards[0].get_batch(0)
    for back in (pickle.loads(pickle.dumps(batch)), copy.deepcopy(batch)):
        assert back.micro_batch_passes[0].order == batch.micro_batch_passes[0].order
        assert back.micro_batch_passes[0].tokens().tolist() == batch.micro_batch_passes[0].tokens().tolist()
        assert back.micro_batch_lengths == batch.micro_batch_lengths


def agentic_data(seed=0):
    """Agentic rows: two episodes whose turns extend one history (a row per turn), so
    prefixes nest (a history shared by every later turn, a longer one by fewer)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(2):
        history = rng.integers(1, 31, 12).tolist()
        for _ in range(4):
            history = history + rng.integers(1, 31, int(rng.integers(4, 9))).tolist()
            rows.append(list(history))
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
    lengths = torch.tensor([len(r) for r in rows])
    data = seqpack.BatchedDataDict(input_ids=ids, input_lengths=lengths, sample_mask=torch.ones(len(rows)),
                                   token_mask=(torch.arange(width)[None] < lengths[:, None]).float())
    return data, rows


@pytest.mark.parametrize("cap, dp", [(10, 1), (16, 2)])
def test_nested_agentic_prefixes_through_the_shards(cap, dp, exact_norms):
    data, rows = agentic_data(seed=cap)
    forest = seqpack.PrefixForest.from_rows(rows)
    model = tiny_llama()
    expected, want, _, _ = run_step(model, data, seqpack.plan_step(forest.lengths, dp, 256, forest=forest),
                                    NLLLoss(), dp)
    plan = seqpack.plan_step(forest.lengths, dp, cap, forest=forest, prefix_reuse=True)
    assert plan.planned_on == "prefix_reuse" and max(len(r) for r in rows) > cap  # rows longer than the cap too
    assert any(n > 1 for passes in plan.prefix_reuse for rank in passes.pass_order
               for n in [sum(1 for kind, _ in rank if kind == "close")])  # several nested providers
    total, grads, _, _ = run_step(model, data, plan, NLLLoss(), dp)
    assert total == pytest.approx(expected, rel=1e-11)
    for n, g in grads.items():
        torch.testing.assert_close(g, want[n], rtol=1e-9, atol=1e-12)
