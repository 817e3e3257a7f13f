"""verl 0.9.1's engine path (issue 51, item 1): the trainer's no-padding TensorDicts
(``left_right_2_no_padding``: nested ``input_ids`` / ``position_ids``, metadata as
``NonTensorData``, ``uid`` as ``NonTensorStack``) through seqpack's micro-batching,
with or without ``attention_mask``; the tree forward in the engine's ``model_output``
layout, exact in fp64 at every position; and verl's own ``FSDPEngineWithLMHead`` on
the CPU, stock against ``seqpack.frameworks.verl.engine.patch(shared_prefix=True)``:
the same log-probs, entropies, loss and gradient norm."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

tensordict = pytest.importorskip("tensordict")
transformers = pytest.importorskip("transformers")

import seqpack.frameworks.verl as sv  # noqa: E402
from seqpack.frameworks.verl import engine as seqpack_engine  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def engine_td(prompts_, responses_, uid=None, **meta):
    """An engine TensorDict as ``left_right_2_no_padding`` makes it: padded prompts
    (left) and responses (right) kept, ``input_ids`` / ``position_ids`` nested over
    each row's real tokens, metadata as NonTensorData."""
    pm, rm = (prompts_ != 0).long(), (responses_ != 0).long()
    am = torch.cat([pm, rm], 1)
    ids = torch.cat([prompts_, responses_], 1)
    rows = [ids[b][am[b].bool()] for b in range(ids.shape[0])]
    td = tensordict.TensorDict({
        "prompts": prompts_, "responses": responses_, "attention_mask": am, "response_mask": rm, "loss_mask": rm,
        "input_ids": torch.nested.as_nested_tensor(rows, layout=torch.jagged),
        "position_ids": torch.nested.as_nested_tensor([torch.arange(len(r)) for r in rows], layout=torch.jagged),
    }, batch_size=[ids.shape[0]])
    if uid is not None:
        td["uid"] = tensordict.NonTensorStack(*uid)
    for key, value in meta.items():
        td[key] = tensordict.NonTensorData(value)
    return td


def random_td(seed, rows=12, p=6, r=5, groups=4):
    g = torch.Generator().manual_seed(seed)
    pl, rl = torch.randint(1, p + 1, (rows,), generator=g), torch.randint(1, r + 1, (rows,), generator=g)
    prompts_ = torch.randint(3, 50, (rows, p), generator=g) * (torch.arange(p)[None] >= p - pl[:, None])
    responses_ = torch.randint(3, 50, (rows, r), generator=g) * (torch.arange(r)[None] < rl[:, None])
    return engine_td(prompts_, responses_, uid=[f"u{i * groups // rows}" for i in range(rows)])


def lengths_of(mb):
    return mb["input_ids"].offsets().diff().tolist()


def test_recorded_engine_micro_batches_with_and_without_the_mask():
    # verl 0.9.1's rearrange_micro_batches on this TensorDict, cap 16 (recorded).
    td = random_td(0)
    for drop in (False, True):
        t = td.clone()
        if drop:
            del t["attention_mask"]  # verl reads the nested offsets; seqpack needed the mask
        mbs, idx = sv.rearrange_micro_batches(t, max_token_len=16, strict=False)
        assert idx == [[1, 8], [2, 3], [5, 6], [7, 10], [4, 9], [0, 11]]
        for mb, part in zip(mbs, idx):
            assert mb["input_ids"].is_nested and lengths_of(mb) == [lengths_of(td)[i] for i in part]
            assert [r.tolist() for r in mb["input_ids"].unbind()] == [td["input_ids"][i].tolist() for i in part]
            assert list(mb["uid"]) == [td["uid"][i] for i in part]
        strict, sidx = sv.rearrange_micro_batches(t, max_token_len=16)  # seqpack's: the hard cap
        assert sorted(i for p in sidx for i in p) == list(range(12)) and max(sum(lengths_of(m)) for m in strict) <= 16
        trees, _ = sv.rearrange_micro_batches(t, max_token_len=16, shared_prefix=True)  # forest from nested rows
        assert all(m["input_ids"].is_nested for m in trees)


def test_engine_metadata_and_a_dummy_row():
    td = random_td(1)
    td["temperature"] = tensordict.NonTensorData(0.7)
    mb = sv.rearrange_micro_batches(td, max_token_len=16)[0][0]
    assert mb["temperature"] == 0.7
    plan = __import__("seqpack").plan_step(np.asarray(lengths_of(td)), 1, 16, min_micro_batches=16)
    mbs, idx = sv.rearrange_micro_batches(td, max_token_len=16, step_plan=plan, dp_rank=0)
    empty = [m for m, p in zip(mbs, idx) if not p]
    assert empty and all(lengths_of(m) == [1] and int(m["response_mask"].sum()) == 0 for m in empty)
    out = torch.nested.as_nested_tensor([torch.zeros(n) for m in mbs for n in lengths_of(m)], layout=torch.jagged)
    back = sv.restore_dynamic_batch(out, idx)  # the dummies' rows dropped
    assert back.offsets().diff().tolist() == lengths_of(td)


def test_prepare_micro_batches_reads_the_engines_metadata():
    td = random_td(2)
    td["use_dynamic_bsz"] = tensordict.NonTensorData(True)
    td["max_token_len_per_gpu"] = tensordict.NonTensorData(8)
    td["sp_size"] = tensordict.NonTensorData(2)  # the cap is max_token_len_per_gpu x sp_size
    mbs, idx = seqpack_engine.prepare_micro_batches(td)
    assert max(sum(lengths_of(m)) for m in mbs) <= 16 and sorted(sum(idx, [])) == list(range(12))
    td["use_dynamic_bsz"] = tensordict.NonTensorData(False)
    td["micro_batch_size_per_gpu"] = tensordict.NonTensorData(4)
    mbs, idx = seqpack_engine.prepare_micro_batches(td)
    assert idx is None and [lengths_of(m) for m in mbs] == [lengths_of(td)[i:i + 4] for i in (0, 4, 8)]
    td["micro_batch_size_per_gpu"] = tensordict.NonTensorData(5)
    with pytest.raises(ValueError, match="not a multiple of micro_batch_size_per_gpu"):
        seqpack_engine.prepare_micro_batches(td)


verl_seqlen = pytest.importorskip("verl.utils.seqlen_balancing", reason="verl is not installed")


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), cap=st.integers(11, 40), drop=st.booleans(), balance=st.booleans())
def test_released_rule_gives_verls_indices_on_engine_batches(seed, cap, drop, balance):
    td = random_td(seed, rows=10)
    if drop:
        del td["attention_mask"]
    ours = sv.rearrange_micro_batches(td, max_token_len=cap, strict=False, use_dynamic_bsz_balance=balance)[1]
    theirs = verl_seqlen.rearrange_micro_batches(td, max_token_len=cap, use_dynamic_bsz_balance=balance)[1]
    assert ours == [list(map(int, p)) for p in theirs]


def test_prepare_micro_batches_equals_verls():
    engine_utils = pytest.importorskip("verl.workers.engine.utils", reason="verl's engine needs codetiming")
    for seed in range(5):
        td = random_td(seed)
        td["max_token_len_per_gpu"] = tensordict.NonTensorData(14)
        ours = seqpack_engine.prepare_micro_batches(td, strict=False)
        theirs = engine_utils.prepare_micro_batches(td)
        assert ours[1] == [list(map(int, p)) for p in theirs[1]]
        assert [lengths_of(a) for a in ours[0]] == [lengths_of(b) for b in theirs[0]]


def tiny_qwen2():
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=64, max_position_embeddings=128)
    return transformers.Qwen2ForCausalLM(cfg).double()


def test_tree_forward_step_is_the_engines_layout_exact_in_fp64():
    model = tiny_qwen2()
    td = random_td(3, rows=8, groups=2)
    td["temperature"] = tensordict.NonTensorData(0.7)
    td["calculate_entropy"] = tensordict.NonTensorData(True)
    out = seqpack_engine.tree_forward_step(model, td)
    assert out["log_probs"].offsets().tolist() == td["input_ids"].offsets().tolist()
    for b in range(8):
        row = td["input_ids"][b]
        lp = torch.log_softmax(model(row[None]).logits[0] / 0.7, -1)
        ref = lp[:-1].gather(-1, row[1:, None])[:, 0]  # position t: log p(token t + 1), as verl's engine
        got, ent = out["log_probs"][b].detach(), out["entropy"][b].detach()
        assert (got[:-1] - ref).abs().max() < 1e-12 and got[-1] == 0
        assert (ent[:-1] - -(lp.exp() * lp).sum(-1)[:-1]).abs().max() < 1e-12
    (out["log_probs"].values().sum()).backward()  # gradients flow to the model
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    with pytest.raises(ValueError, match="nested rows"):
        seqpack_engine.tree_forward_step(model, {"input_ids": torch.ones(2, 3, dtype=torch.long)})


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def test_verls_fsdp_engine_on_trees_equals_the_stock_engine():
    pytest.importorskip("verl.workers.engine.fsdp.transformer_impl", reason="verl's engine needs codetiming")
    run = subprocess.run([sys.executable, os.path.join(HERE, "verl_engine_cpu.py"), _free_port()],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    stock, tree = got["stock"], got["tree"]
    assert stock["counts"] == {} and tree["counts"] == {"tree": 4}  # 2 inference + 2 training micro-batches
    assert len(tree["patched"]) == 4  # micro-batching, restore, forward_step, forward_backward_batch
    assert np.abs(np.subtract(stock["log_probs"], tree["log_probs"])).max() < 1e-5
    assert np.abs(np.subtract(stock["entropy"], tree["entropy"])).max() < 1e-5
    assert tree["loss"] == pytest.approx(stock["loss"], rel=1e-5)
    assert tree["grad_norm"] == pytest.approx(stock["grad_norm"], rel=1e-4)
    # prefix reuse under a cap of 12 (rows of up to 16 tokens, trees of 34): passes in verl's own loop
    reuse = got["reuse"]
    assert set(reuse["counts"]) == {"prefix_reuse"} and reuse["counts"]["prefix_reuse"] > 4
    assert np.abs(np.subtract(stock["log_probs"], reuse["log_probs"])).max() < 1e-5
    assert np.abs(np.subtract(stock["entropy"], reuse["entropy"])).max() < 1e-5
    assert reuse["loss"] == pytest.approx(stock["loss"], rel=1e-5)
    assert reuse["grad_norm"] == pytest.approx(stock["grad_norm"], rel=1e-4)


def test_prefix_reuse_micro_batches_split_the_loss_mask_over_the_passes():
    # trees of up to 6 + 4 x 5 tokens under a cap of 8: passes, each row in every pass of its tree
    td = random_td(3, rows=8, p=6, r=5, groups=2)
    mbs, parts = sv.rearrange_micro_batches(td, 8, shared_prefix=True, prefix_reuse=True)
    passes = [mb for mb in mbs if "seqpack_pass" in mb.keys()]
    assert passes and len(passes) == sum(1 for p in parts if p) and len({tuple(p) for p in parts if p}) == 1
    rows_ = parts[0]
    want = td["response_mask"][torch.tensor(rows_)]
    total = sum(mb["response_mask"] for mb in passes)
    assert torch.equal(total, want)  # every loss token in exactly one pass
    assert all(torch.equal(mb["loss_mask"], mb["response_mask"]) for mb in passes)
    kinds = [mb["seqpack_pass"].kind for mb in passes]
    assert "close" in kinds and "branch" in kinds
    with pytest.raises(ValueError, match="prefix_reuse=True runs prefix trees larger than the cap in passes: it "
                                         "needs shared_prefix=True"):
        sv.rearrange_micro_batches(td, 8, prefix_reuse=True)
    with pytest.raises(ValueError, match="force_group_size=2"):
        sv.rearrange_micro_batches(td, 64, force_group_size=2, shared_prefix=True, prefix_reuse=True)
    with pytest.raises(ValueError, match="needs shared_prefix=True and strict=True"):
        seqpack_engine.patch(prefix_reuse=True)


def test_prefix_reuse_refuses_losses_that_do_not_split_and_skips_value_heads():
    from functools import partial
    from types import SimpleNamespace

    from seqpack.frameworks.verl.prefix_reuse import check_loss_splits

    def loss(**kw):
        return None

    td = random_td(3, rows=8, p=6, r=5, groups=2)  # trees over a cap of 8: passes (as above)
    ok = SimpleNamespace(loss_agg_mode="token-mean", policy_loss={"loss_mode": "vanilla"})
    check_loss_splits(partial(loss, config=ok), td)
    check_loss_splits(None, td)  # inference: no loss
    for config, match in ((SimpleNamespace(loss_agg_mode="seq-mean-token-mean", policy_loss={}), "seq-mean-token-mean"),
                          (SimpleNamespace(loss_agg_mode="token-mean", policy_loss={"loss_mode": "gspo"}), "'gspo'"),
                          (SimpleNamespace(loss_agg_mode="seq-mean-token-sum", policy_loss={}), "global_batch_size")):
        with pytest.raises(ValueError, match=match):
            check_loss_splits(partial(loss, config=config), td)
    pytest.importorskip("verl.workers.engine.fsdp.transformer_impl", reason="verl's engine needs codetiming")
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

    seqpack_engine.patch(shared_prefix=True, prefix_reuse=True)
    try:
        import verl.workers.engine.utils as engine_utils

        for cls, passes in ((FSDPEngineWithLMHead, True), (FSDPEngineWithValueHead, False)):
            token = seqpack_engine._RUNNING.set(object.__new__(cls))  # as forward_backward_batch sets it
            try:
                mbs, _ = engine_utils.rearrange_micro_batches(td, 12)
            finally:
                seqpack_engine._RUNNING.reset(token)
            assert any("seqpack_pass" in mb.keys() for mb in mbs) == passes, cls.__name__
    finally:
        seqpack_engine.unpatch()
    assert "forward_backward_batch" not in FSDPEngineWithLMHead.__dict__


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.integers(6, 30), st.integers(2, 4))
def test_prefix_reuse_passes_hold_every_loss_token_once(seed, cap, groups):
    # random GRPO engine batches (a prompt of 1-8 tokens per uid, 4 responses of 1-6) under random caps:
    # the passes' response masks partition the rows' (every loss token in exactly one pass)
    g = torch.Generator().manual_seed(seed)
    p, r, rows_per = 8, 6, 4
    pl = torch.randint(1, p + 1, (groups,), generator=g).repeat_interleave(rows_per)  # a prompt per uid group
    prompt_ids = torch.randint(3, 50, (groups, p), generator=g).repeat_interleave(rows_per, 0)
    prompts_ = prompt_ids * (torch.arange(p)[None] >= p - pl[:, None])
    rl = torch.randint(1, r + 1, (groups * rows_per,), generator=g)
    responses_ = torch.randint(3, 50, (groups * rows_per, r), generator=g) * (torch.arange(r)[None] < rl[:, None])
    td = engine_td(prompts_, responses_, uid=[f"u{i // rows_per}" for i in range(groups * rows_per)])
    mbs, parts = sv.rearrange_micro_batches(td, cap, shared_prefix=True, prefix_reuse=True)
    passes = [mb for mb in mbs if "seqpack_pass" in mb.keys()]
    if not passes:  # trees kept (they need no more micro-batches): every row once
        assert sorted(i for p in parts for i in p) == list(range(len(td)))
        return
    rows_ = parts[0]
    assert sorted(rows_) == list(range(len(td))) and all(p in ([], rows_) for p in parts)
    assert torch.equal(sum(mb["response_mask"] for mb in passes), td["response_mask"][torch.tensor(rows_)])
    assert len(mbs) == len(parts) and sum(1 for p in parts if not p) == len(mbs) - len(passes)


def test_prefix_reuse_needs_the_prompts_to_split_the_loss_mask():
    td = random_td(3, rows=8, p=6, r=5, groups=2)
    del td["prompts"]
    with pytest.raises(ValueError, match="needs 'prompts' \\(nested, or padded with 'attention_mask'\\)"):
        sv.rearrange_micro_batches(td, 12, shared_prefix=True, prefix_reuse=True)


def vlm_engine_td(model, batch):
    """A Qwen2-VL micro-batch as verl's engine holds it: nested ``input_ids``, nested
    ``position_ids`` ``[4, len]`` per row (text positions, then M-RoPE, as verl's
    dataset computes them), ``multi_modal_inputs`` one dict per row (its images)."""
    mask = batch["attention_mask"].bool()
    mrope, _ = model.model.get_rope_index(batch["input_ids"], mm_token_type_ids=batch["mm_token_type_ids"],
                                          image_grid_thw=batch["image_grid_thw"], attention_mask=batch["attention_mask"])
    counts = (batch["input_ids"] == model.config.image_token_id).sum(1) * 4  # patches per row (merge 2 x 2)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    grids = iter(batch["image_grid_thw"])
    rows, positions, inputs = [], [], []
    for b in range(mask.shape[0]):
        n = int(mask[b].sum())
        rows.append(batch["input_ids"][b, :n])
        positions.append(torch.cat([torch.arange(n)[None], mrope[:, b, :n]]))
        own = []
        while sum(int(g.prod()) for g in own) < int(counts[b]):
            own.append(next(grids))
        inputs.append({"pixel_values": batch["pixel_values"][starts[b]:starts[b + 1]],
                       "image_grid_thw": torch.stack(own)} if own else None)
    return tensordict.TensorDict({
        "input_ids": torch.nested.as_nested_tensor(rows, layout=torch.jagged),
        "position_ids": torch.nested.as_nested_tensor(positions, layout=torch.jagged),
        "multi_modal_inputs": tensordict.NonTensorStack(*inputs),
        "temperature": tensordict.NonTensorData(0.7), "calculate_entropy": tensordict.NonTensorData(True),
    }, batch_size=[mask.shape[0]])


def test_tree_forward_step_takes_a_vlms_multi_modal_inputs_exact_in_fp64():
    """Issue 53: a Qwen2-VL micro-batch (images, verl's M-RoPE position ids) runs on
    its tree, each prompt's image encoded once, equal to each row alone; verl's
    stock reasons still route what a tree cannot take."""
    from seqpack.testing.tiny_vlm import tiny_vlm, vlm_grpo_batch

    model = tiny_vlm("qwen2_vl", dtype=torch.float64)
    for p in model.parameters():  # larger than the default init: every input moves the log-probs visibly
        torch.nn.init.normal_(p, std=0.2)
    batch = vlm_grpo_batch([[(4, 4)], [(4, 6), (2, 2)], []], 3, dtype=torch.float64)
    td = vlm_engine_td(model, batch)
    encoded = []
    hook = model.model.visual.register_forward_hook(lambda m, a, o: encoded.append(a[0].shape[0]))
    out = seqpack_engine.tree_forward_step(model, td)
    hook.remove()
    assert encoded == [batch["pixel_values"].shape[0] // 3]  # one vision pass, each prompt's images once
    for b in range(td.batch_size[0]):
        row = td["input_ids"][b]
        mm = td["multi_modal_inputs"][b] or {}
        logits = model(input_ids=row[None], position_ids=td["position_ids"][b][1:, None], **mm).logits[0]
        lp = torch.log_softmax(logits / 0.7, -1)
        ref = lp[:-1].gather(-1, row[1:, None])[:, 0]
        got, ent = out["log_probs"][b].detach(), out["entropy"][b].detach()
        assert (got[:-1] - ref).abs().max() < 1e-12 and got[-1] == 0
        assert (ent[:-1] - -(lp.exp() * lp).sum(-1)[:-1]).abs().max() < 1e-12
    # the positions verl computed are the ones used: the images' height and width swapped change the log-probs
    shifted = td.clone()
    shifted["position_ids"] = torch.nested.as_nested_tensor([p[[0, 1, 3, 2]] for p in td["position_ids"].unbind()],
                                                            layout=torch.jagged)
    moved = seqpack_engine.tree_forward_step(model, shifted)["log_probs"].values()
    assert (moved - out["log_probs"].values()).abs().max() > 1e-6


def test_the_engine_sends_vlm_micro_batches_to_trees_by_what_the_model_takes():
    impl = pytest.importorskip("verl.workers.engine.fsdp.transformer_impl", reason="verl's engine needs codetiming")
    from seqpack.testing.tiny_vlm import tiny_vlm, vlm_grpo_batch

    model = tiny_vlm("qwen2_vl", dtype=torch.float64)
    td = vlm_engine_td(model, vlm_grpo_batch([[(4, 4)]], 2, dtype=torch.float64))
    engine = object.__new__(impl.FSDPEngineWithLMHead)
    engine.module = model
    assert seqpack_engine._tree_reason(engine, td) is None
    engine.module = tiny_qwen2()
    assert "without get_rope_index" in seqpack_engine._tree_reason(engine, td)
    engine.module = model
    other = td.clone()
    other["multi_modal_inputs"] = tensordict.NonTensorStack(
        *[{**d, "pixel_attention_mask": torch.ones(1)} for d in td["multi_modal_inputs"]])
    assert seqpack_engine._tree_reason(engine, other) == "multi-modal inputs ['pixel_attention_mask']"
