"""ROLL's sequence packing in prefix-reuse passes (issue 52):
``make_micro_batch_iter_for_sequence_packing(shared_prefix=True, prefix_reuse=True)``
yields a mini-batch's passes, each shared prompt forwarded and back-propagated once
under a cap smaller than its group (or its rows); ROLL's loss over the global token
count, summed over the passes, and every parameter gradient of a tiny HF Llama
(fp64) equal the rows run alone. ``sequence_packing_args.prefix_reuse`` turns it on."""

import functools
import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

import seqpack  # noqa: E402
from seqpack import config  # noqa: E402
from seqpack import roll  # noqa: E402
from seqpack.integrations import hf  # noqa: E402

from test_batched_data_dict_prefix_reuse import exact_norms, tiny_llama  # noqa: E402,F401
from test_roll_shared_prefix import roll_cfg  # noqa: E402


def roll_rows(prompt_lens, response_lens, seed=0, left=(0,)):
    """ROLL's layout: prompt left-padded by ``left[i % len(left)]`` columns, response
    right-padded; ``response_mask`` on the response tokens, ``prompt_id`` the group."""
    rng = np.random.default_rng(seed)
    rows, groups, starts = [], [], []
    for g, (p, responses) in enumerate(zip(prompt_lens, response_lens)):
        prompt = rng.integers(1, 32, p).tolist()
        for n in responses:
            rows.append(prompt + rng.integers(1, 32, n).tolist())
            groups.append(g)
            starts.append(p)
    pads = [left[i % len(left)] for i in range(len(rows))]
    width = max(len(r) + pad for r, pad in zip(rows, pads))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    response = torch.zeros(len(rows), width, dtype=torch.long)
    for i, (r, pad, s) in enumerate(zip(rows, pads, starts)):
        ids[i, pad:pad + len(r)] = torch.tensor(r)
        mask[i, pad:pad + len(r)] = 1
        response[i, pad + s:pad + len(r)] = 1
    gen = torch.Generator().manual_seed(seed)
    batch = {"input_ids": ids, "attention_mask": mask, "response_mask": response, "prompt_id": torch.tensor(groups),
             "advantages": torch.randn(len(rows), width - 1, generator=gen, dtype=torch.float64),
             "old_log_probs": -torch.rand(len(rows), width - 1, generator=gen, dtype=torch.float64)}
    return batch, rows, groups


def ppo_terms(lp, batch, mask):
    """ROLL's clipped token loss, token-mean over the global count (the caller's)."""
    ratio = torch.exp(lp - batch["old_log_probs"])
    adv = batch["advantages"]
    loss = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    return (loss * mask).sum()


def rows_alone(model, batch, rows):
    """ROLL's [B, S - 1] log-probs, each row run alone (no sharing, no tree)."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    out = torch.zeros(ids.shape[0], ids.shape[1] - 1, dtype=torch.float64)
    for i, row in enumerate(rows):
        first = int(mask[i].nonzero()[0])
        tree = seqpack.pack_prefix_tree([row])
        lp = seqpack.token_logprobs(model(**hf.tree_kwargs(tree)).logits[0], tree).logprobs
        out[i, first:first + len(row) - 1] = lp[:len(row) - 1]
    return out


def passes_step(model, batch, cap, memory="activations", pad=1):
    model.zero_grad(set_to_none=True)
    total_tokens = batch["response_mask"][:, 1:].sum()  # ROLL's batch_num_tokens: before the split
    kinds, loss_sum = [], 0.0
    for mb in roll.make_micro_batch_iter_for_sequence_packing(
            batch, max_packed_sequence_length=cap, shared_prefix=True, prefix_reuse=True, group_key="prompt_id",
            prefix_reuse_memory=memory, pad_multiple=pad, is_train=True):
        if mb.meta_info["is_padding_batch"]:
            kinds.append("dummy")
            continue
        step = mb.meta_info["prefix_pass"]
        kinds.append(step.kind)
        assert step.num_local_tokens <= cap and step.num_local_tokens % pad == 0
        loss = ppo_terms(roll.pass_logprobs(model, mb), mb, mb["response_mask"][:, 1:]) / total_tokens
        loss.backward()
        loss_sum += float(loss.detach())
    return loss_sum, {n: p.grad.clone() for n, p in model.named_parameters()}, kinds


@pytest.mark.parametrize("memory,pad", [("activations", 1), ("kv", 1), ("activations", 4)])
def test_passes_equal_the_rows_alone(memory, pad, exact_norms):
    # prompts of 20-36 tokens, a cap of 16: every group (and every row) runs in passes
    batch, rows, _ = roll_rows([36, 20, 28], [[5, 7, 3, 6], [4, 9], [6, 2, 5]], seed=11, left=(0, 3, 1))
    model = tiny_llama()
    model.zero_grad(set_to_none=True)
    total = batch["response_mask"][:, 1:].sum()
    expected = ppo_terms(rows_alone(model, batch, rows), batch, batch["response_mask"][:, 1:]) / total
    expected.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    got, grads, kinds = passes_step(model, batch, 18, memory, pad)  # pad 4: passes of <= 16 tokens padded
    assert "close" in kinds and "branch" in kinds
    assert got == pytest.approx(float(expected.detach()), rel=1e-12)
    for name, grad in want.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-9, atol=1e-12, msg=name)


def test_a_cap_that_holds_the_trees_keeps_them():
    batch, _, _ = roll_rows([10, 12], [[3, 4], [2, 2, 5]], seed=2)
    mbs = list(roll.make_micro_batch_iter_for_sequence_packing(
        batch, max_packed_sequence_length=64, shared_prefix=True, prefix_reuse=True, group_key="prompt_id",
        is_train=True))
    assert all("prefix_pass" not in mb.meta_info and "prefix_tree" in mb.meta_info for mb in mbs)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 14), min_size=1, max_size=3), st.integers(4, 20), st.integers(0, 10_000))
def test_the_passes_masks_partition_the_rows(prompts, cap, seed):
    """Every loss token in exactly one pass micro-batch: the passes' response masks
    sum to the rows'; every micro-batch under the cap."""
    rng = np.random.default_rng(seed)
    responses = [rng.integers(1, 8, int(rng.integers(1, 5))).tolist() for _ in prompts]
    batch, rows, _ = roll_rows(prompts, responses, seed=seed, left=(0, 2))
    mbs = roll.make_micro_batch_iter_for_sequence_packing(batch, max_packed_sequence_length=cap, shared_prefix=True,
                                                          prefix_reuse=True, group_key="prompt_id", is_train=True)
    first = next(mbs)
    if "prefix_pass" not in first.meta_info:
        return  # trees need no more micro-batches here
    seen = torch.zeros_like(batch["response_mask"])
    model, count = _MODEL[0], 0
    for mb in itertools.chain([first], mbs):  # lazily: the step checks each ran before the next
        count += 1
        if mb.meta_info["is_padding_batch"]:
            continue
        step = mb.meta_info["prefix_pass"]
        assert step.num_local_tokens <= cap
        seen += mb["response_mask"]
        with torch.no_grad():
            roll.pass_logprobs(model, mb)
    assert count == first.meta_info["num_micro_batchs"]
    torch.testing.assert_close(seen, batch["response_mask"])


_MODEL = [tiny_llama()]


def test_bad_combinations_are_named():
    batch, _, _ = roll_rows([5, 5], [[2, 2], [3]])
    run = functools.partial(roll.make_micro_batch_iter_for_sequence_packing, is_train=True)
    with pytest.raises(ValueError, match="the forward phase concatenates per-row results: pass is_train=True"):
        roll.make_micro_batch_iter_for_sequence_packing(batch, max_packed_sequence_length=8, shared_prefix=True,
                                                        prefix_reuse=True)
    with pytest.raises(ValueError, match="it needs shared_prefix=True"):
        run(batch, max_packed_sequence_length=8, prefix_reuse=True)
    with pytest.raises(ValueError, match="no context parallelism, got cp_size=2"):
        run(batch, max_packed_sequence_length=8, cp_size=2, shared_prefix=True, prefix_reuse=True)
    with pytest.raises(ValueError, match="max_packed_sequence_length=3 is below the pad multiple 4"):
        run(batch, max_packed_sequence_length=3, pad_multiple=4, shared_prefix=True, prefix_reuse=True)
    with pytest.raises(ValueError, match="prefix_reuse_memory must be one of"):
        run(batch, max_packed_sequence_length=8, shared_prefix=True, prefix_reuse=True, prefix_reuse_memory="disk")
    with pytest.raises(ValueError, match="pass_logprobs runs a micro-batch of prefix_reuse=True"):
        mb = next(run(batch, max_packed_sequence_length=64, shared_prefix=True))
        roll.pass_logprobs(tiny_llama(), mb)


def test_sequence_packing_args_prefix_reuse_turns_it_on():
    cfg = config.load({**roll_cfg(shared_prefix=True, prefix_reuse=True), "loss_agg_mode": "token-mean"})
    assert cfg.load_balance_kwargs("train")["prefix_reuse"] is True
    assert "prefix_reuse" not in cfg.load_balance_kwargs("forward")
    assert config.load(cfg.to_dict()) == cfg
    with pytest.raises(config.ConfigError, match="prefix_reuse: runs prefix trees in passes; it needs .*shared_prefix"):
        config.load({**roll_cfg(prefix_reuse=True), "loss_agg_mode": "token-mean"})
    with pytest.raises(config.ConfigError, match="loss_agg_mode: 'seq-mean-token-mean'"):
        config.load(roll_cfg(shared_prefix=True, prefix_reuse=True))  # ROLL's default does not split
    with pytest.raises(config.ConfigError, match="importance_sampling: 'seq'"):
        config.load({**roll_cfg(shared_prefix=True, prefix_reuse=True), "loss_agg_mode": "token-mean",
                     "importance_sampling": "seq"})
    with pytest.raises(config.ConfigError, match="ppo_epochs: 2 reuses each pass's old log-probs"):
        config.load({**roll_cfg(shared_prefix=True, prefix_reuse=True), "loss_agg_mode": "token-mean",
                     "ppo_epochs": 2})
    assert config.load({**roll_cfg(shared_prefix=True, prefix_reuse=True), "loss_agg_mode": "token-mean",
                        "ppo_epochs": 2, "enable_old_logprobs_recompute": True}).prefix_reuse_training
    with pytest.raises(config.ConfigError, match="prefix_reus: unknown key; did you mean 'prefix_reuse'"):
        config.load(roll_cfg(shared_prefix=True, prefix_reus=True))
    tp2 = roll_cfg(shared_prefix=True, prefix_reuse=True)
    tp2["actor_train"]["strategy_args"]["strategy_config"] = {"tensor_model_parallel_size": 2}
    padded = config.load({**tp2, "loss_agg_mode": "token-mean"})  # TP pads each pass to 2
    assert padded.load_balance_kwargs("train")["pad_multiple"] == 2 and padded.prefix_reuse_training
    tp2["actor_train"]["strategy_args"]["strategy_config"] = {"context_parallel_size": 2}
    with pytest.raises(config.ConfigError, match="it needs context_parallel_size = 1, got 2"):
        config.load({**tp2, "loss_agg_mode": "token-mean"})
