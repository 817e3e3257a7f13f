"""Prefix trees through BatchedDataDict (issue 29, item 4): sequence-packing shards
planned on physical tokens with ``shared_prefix``, and the iterators' tree
micro-batches, whose loss through SequencePackingLossWrapper equals the rows'
packed without sharing (fp64)."""

import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import seqpack
from seqpack import BatchedDataDict
from seqpack.frameworks.batched_data_dict import TreeMicroBatch
from seqpack.loss import ClippedPGLoss, SequencePackingLossWrapper

VOCAB = 31


def grpo_data(prompt_lens, response_lens, seed=0, width=None):
    """NeMo-RL-like GRPO data: group g's rows share prompt g (``response_lens[g]``
    gives its responses' lengths)."""
    rng = np.random.default_rng(seed)
    rows, groups = [], []
    for g, (p, responses) in enumerate(zip(prompt_lens, response_lens)):
        prompt = rng.integers(1, VOCAB, p).tolist()
        for r in responses:
            rows.append(prompt + rng.integers(1, VOCAB, r).tolist())
            groups.append(g)
    width = width or max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
    lengths = torch.tensor([len(r) for r in rows])
    gen = torch.Generator().manual_seed(seed)
    data = BatchedDataDict(input_ids=ids, input_lengths=lengths, idx=torch.tensor(groups),
                           token_mask=(torch.arange(width)[None] < lengths[:, None]).float(),
                           sample_mask=torch.ones(len(rows)), advantages=torch.randn(len(rows), width, generator=gen),
                           prev_logprobs=-torch.rand(len(rows), width, generator=gen),
                           generation_logprobs=-torch.rand(len(rows), width, generator=gen),
                           reference_policy_logprobs=-torch.rand(len(rows), width, generator=gen))
    return data, rows, groups


def packing_args(cap, multiple=1, **extra):
    return {"max_tokens_per_microbatch": cap, "input_key": "input_ids", "input_lengths_key": "input_lengths",
            "algorithm": "modified_first_fit_decreasing", "sequence_length_pad_multiple": multiple,
            "shared_prefix": True, **extra}


def physical(rows, groups=None):
    return seqpack.pack_prefix_tree(rows, group_ids=groups).metrics().physical_tokens if rows else 0


def test_groups_stay_whole_under_a_cap_on_physical_tokens():
    # 4 prompts of 100 tokens x 4 responses of 20: 180 physical / 480 logical tokens per group.
    data, rows, groups = grpo_data([100] * 4, [[20] * 4] * 4)
    args = packing_args(256, multiple=8, shared_prefix_group_key="idx")
    shards, _ = data.shard_by_batch_size(2, batch_size=16, sequence_packing_args=args)
    placed = []
    for shard in shards:
        shard_rows = shard["idx"].tolist()
        for (start, end), length in zip(shard.micro_batch_indices[0], shard.micro_batch_lengths[0]):
            mine = _global_rows(data, shard, start, end)
            assert length == -(-physical([rows[i] for i in mine], [groups[i] for i in mine]) // 8) * 8 <= 256  # the tree's tokens, padded, under the cap
            assert len(set(shard_rows[start:end])) == 1  # one group per bin: each fits (180 <= 256 < 360)
        placed += _global_rows(data, shard, 0, len(shard_rows))
    assert sorted(placed) == list(range(16))
    assert [len(s.micro_batch_indices[0]) for s in shards] == [2, 2]  # equal counts per rank
    # Plain packing: rows of 120 tokens, two per bin, 8 bins.
    plain, _ = data.shard_by_batch_size(2, batch_size=16, sequence_packing_args=packing_args(256, 8, shared_prefix=False))
    assert sum(len(s.micro_batch_indices[0]) for s in plain) == 8


def _global_rows(data, shard, start, end):
    """The global row ids of a shard's rows [start, end) (rows are unique by their
    input_ids and index here)."""
    ids = data["input_ids"]
    out = []
    for i in range(start, end):
        match = [j for j in range(ids.shape[0]) if torch.equal(ids[j], shard["input_ids"][i])
                 and data["idx"][j] == shard["idx"][i]]
        out.append(match[0])
    return out


@st.composite
def batches(draw):
    groups = draw(st.integers(1, 6))
    prompt_lens = draw(st.lists(st.integers(1, 30), min_size=groups, max_size=groups))
    response_lens = [draw(st.lists(st.integers(1, 12), min_size=1, max_size=6)) for _ in range(groups)]
    return prompt_lens, response_lens


@settings(max_examples=30, deadline=None)
@given(batches(), st.sampled_from([1, 4]), st.integers(1, 3), st.integers(0, 1000))
def test_shared_prefix_shards_keep_the_rules(batch, multiple, shards, seed):
    prompt_lens, response_lens = batch
    data, rows, groups = grpo_data(prompt_lens, response_lens, seed=seed)
    n = len(rows)
    longest = max(len(r) for r in rows)
    cap = -(-max(longest, 48) // multiple) * multiple
    if n < shards:
        return
    try:
        out, order = data.shard_by_batch_size(shards, allow_uneven_shards=True, sequence_packing_args=packing_args(
            cap, multiple, shared_prefix_group_key="idx"))  # one tree per group
    except ValueError as exc:  # more bins than rows: the planner says so
        assert "micro-batches" in str(exc)
        return
    assert sorted(order) == list(range(n))  # every row once
    counts = {len(s.micro_batch_indices[0]) for s in out}
    assert len(counts) == 1  # equal counts per rank
    pos = 0
    for shard in out:
        for (start, end), length in zip(shard.micro_batch_indices[0], shard.micro_batch_lengths[0]):
            mine = order[pos + start: pos + end]
            tokens = physical([rows[i] for i in mine], [groups[i] for i in mine])
            assert length == -(-tokens // multiple) * multiple <= cap  # recomputed from the rows
        pos += shard.size


def test_dpo_pairs_with_shared_prefix_keep_their_trees_whole():
    """force_group_size=2 with shared_prefix (NeMo-RL's DPO: chosen and rejected
    consecutive, sharing their prompt): each pair's tree whole in one bin."""
    data, rows, groups = grpo_data([40, 40, 40, 40], [[10, 10]] * 4)
    args = packing_args(128, 1, shared_prefix_group_key="idx")
    args["force_group_size"] = 2
    out, order = data.shard_by_batch_size(2, allow_uneven_shards=True, sequence_packing_args=args)
    assert sorted(order) == list(range(len(rows)))
    pos = 0
    for shard in out:
        for start, end in shard.micro_batch_indices[0]:
            mine = sorted(order[pos + start: pos + end])
            assert len(mine) % 2 == 0 and all(mine[k] // 2 == mine[k + 1] // 2 for k in range(0, len(mine), 2))
        pos += shard.size


def test_tree_iterator_and_the_loss_equal_the_rows_unshared():
    data, rows, groups = grpo_data([12, 9, 15], [[4, 6, 3], [5, 5], [2, 7, 4, 3]], seed=3)
    shards, _ = data.shard_by_batch_size(1, sequence_packing_args=packing_args(64, shared_prefix_group_key="idx"))
    batch = shards[0].get_batch(0)
    loss_fn = ClippedPGLoss({"ratio_clip_min": 0.2, "ratio_clip_max": 0.28, "ratio_clip_c": None,
                             "reference_policy_kl_penalty": 0.01, "use_importance_sampling_correction": False})
    g = torch.Generator().manual_seed(1)
    embed, pos_embed = (torch.randn(n, VOCAB, generator=g, dtype=torch.float64) for n in (VOCAB, 64))
    total_rows = 0
    for tmb in batch.make_microbatch_iterator_for_packable_sequences(shared_prefix=True, group_key="idx"):
        assert isinstance(tmb, TreeMicroBatch)
        mb_lengths = tmb.data["input_lengths"].tolist()
        assert tmb.tree.seq_lens.tolist() == mb_lengths and len(tmb.rows) == len(mb_lengths)
        total_rows += len(tmb.rows)
        gvs, gvt = tmb.data["sample_mask"].sum(), tmb.data["token_mask"][:, 1:].sum()
        # A "model" whose logits depend on the token and its position only: shared
        # prefixes get the same logits in both layouts.
        e_tree, p_tree = embed.clone().requires_grad_(), pos_embed.clone().requires_grad_()
        ids, positions = torch.tensor(tmb.tree.input_ids) % VOCAB, torch.tensor(tmb.tree.position_ids)
        loss, _ = SequencePackingLossWrapper(loss_fn, cu_seqlens_q=tmb.tree)(e_tree[ids] + p_tree[positions],
                                                                            tmb.data, gvs, gvt)
        loss.backward()
        e_rows, p_rows = embed.clone().requires_grad_(), pos_embed.clone().requires_grad_()
        flat = torch.cat([tmb.data["input_ids"][i, :n] for i, n in enumerate(mb_lengths)])
        flat_pos = torch.cat([torch.arange(n) for n in mb_lengths])
        cu = np.concatenate([[0], np.cumsum(mb_lengths)])
        ref, _ = SequencePackingLossWrapper(loss_fn, cu_seqlens_q=cu, fused=True)(e_rows[flat] + p_rows[flat_pos],
                                                                                  tmb.data, gvs, gvt)
        ref.backward()
        torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(e_tree.grad, e_rows.grad, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(p_tree.grad, p_rows.grad, rtol=1e-10, atol=1e-12)
    assert total_rows == len(rows)


def test_dynamic_batching_iterator_yields_trees():
    data, rows, _ = grpo_data([10, 10], [[3, 4], [5, 2]], seed=4)
    args = {"max_tokens_per_microbatch": 64, "sequence_length_round": 4, "input_key": "input_ids",
            "input_lengths_key": "input_lengths"}
    shards, _ = data.shard_by_batch_size(1, dynamic_batching_args=args)
    batch = shards[0].get_batch(0, batch_size=4)
    plain = list(batch.make_microbatch_iterator_with_dynamic_shapes())
    trees = list(batch.make_microbatch_iterator_with_dynamic_shapes(shared_prefix=True, pad_to_multiple_of=8))
    assert len(plain) == len(trees)
    for mb, tmb in zip(plain, trees):
        assert tmb.tree.num_tokens % 8 == 0
        assert tmb.tree.seq_lens.tolist() == mb["input_lengths"].tolist()


def test_tree_micro_batches_pickle_and_options_are_checked():
    data, _, _ = grpo_data([6], [[2, 3]])
    shards, _ = data.shard_by_batch_size(1, sequence_packing_args=packing_args(64))
    batch = shards[0].get_batch(0)
    tmb = next(batch.make_microbatch_iterator_for_packable_sequences(shared_prefix=True))
    back = pickle.loads(pickle.dumps(tmb))
    assert back.tree == tmb.tree and back.rows == tmb.rows and back.data == tmb.data
    with pytest.raises(ValueError, match=r"unknown shared-prefix option\(s\) \['pad_multiple'\]"):
        batch.make_microbatch_iterator_for_packable_sequences(shared_prefix=True, pad_multiple=4)
    with pytest.raises(ValueError, match="shared_prefix_group_key 'group' is not a key"):
        data.shard_by_batch_size(1, sequence_packing_args=packing_args(64, shared_prefix_group_key="group"))
    with pytest.raises(ValueError, match="below sequence_length_pad_multiple"):
        data.shard_by_batch_size(1, sequence_packing_args=packing_args(3, multiple=4))


def test_a_forest_step_plan_shards_and_iterates_as_trees():
    """plan_step with a forest -> shard_by_batch_size(step_plan=) -> tree micro-batches:
    every rank the same count, every bin's tree within the cap, every row once."""
    data, rows, groups = grpo_data([30, 20, 25, 10], [[5, 6, 7], [8, 2], [3, 3, 3, 3], [9]], seed=6)
    forest = seqpack.PrefixForest.from_rows(rows, group_ids=groups)
    plan = seqpack.plan_step(forest.lengths, dp_size=2, max_tokens=64, forest=forest)
    shards, order = data.shard_by_batch_size(2, step_plan=plan)
    seen, counts = [], []
    for shard in shards:
        batch = shard.get_batch(0)
        tmbs = list(batch.make_microbatch_iterator_for_packable_sequences(shared_prefix=True, group_key="idx"))
        counts.append(len(tmbs))
        for tmb, length in zip(tmbs, batch.micro_batch_lengths[0]):
            if tmb.rows:
                assert tmb.tree.num_tokens - tmb.tree.num_pad_tokens == length <= 64
                seen += [int(tmb.data["idx"][i]) * 100 + int(tmb.data["input_lengths"][i]) for i in range(len(tmb.rows))]
    assert len(set(counts)) == 1
    assert sorted(seen) == sorted(g * 100 + len(r) for g, r in zip(groups, rows))
    # Padded trees: the plan counts physical tokens unpadded; padding up to the
    # step's max_tokens is accepted (issue 38: 20 tokens padded to 4 against a
    # planned 19 were refused), past it refused.
    for shard in shards:
        batch = shard.get_batch(0)
        for tmb in batch.make_microbatch_iterator_for_packable_sequences(shared_prefix=True, group_key="idx",
                                                                         pad_to_multiple_of=4):
            assert tmb.tree.num_tokens % 4 == 0 and tmb.tree.num_tokens <= 64
        with pytest.raises(ValueError, match="more than the 64 tokens its micro-batch was planned under"):
            list(batch.make_microbatch_iterator_for_packable_sequences(shared_prefix=True, group_key="idx",
                                                                       pad_to_multiple_of=128))


def test_dynamic_batching_args_with_shared_prefix_plan_trees():
    """dynamic_batching_args["shared_prefix"]: each shard's micro-batches are whole
    trees under the cap (physical tokens rounded to sequence_length_round), every
    row once, the same count on every shard; the dynamic iterator yields them."""
    data, rows, groups = grpo_data([100] * 4, [[20] * 4] * 4, seed=7)
    args = {"max_tokens_per_microbatch": 256, "sequence_length_round": 16, "input_key": "input_ids",
            "input_lengths_key": "input_lengths", "shared_prefix": True, "shared_prefix_group_key": "idx"}
    shards, order = data.shard_by_batch_size(2, batch_size=16, dynamic_batching_args=args)
    assert sorted(order) == list(range(16))
    assert [len(s.micro_batch_indices[0]) for s in shards] == [2, 2]
    for shard in shards:
        batch = shard.get_batch(0)
        for tmb, length in zip(batch.make_microbatch_iterator_with_dynamic_shapes(shared_prefix=True),
                               batch.micro_batch_lengths[0]):
            assert len(set(tmb.data["idx"].tolist())) == 1  # one group (180 tokens -> 192) per micro-batch
            assert length == 192 == -(-(tmb.tree.num_tokens - tmb.tree.num_pad_tokens) // 16) * 16 <= 256


def test_the_iterator_refuses_a_tree_above_its_plan_and_errors_name_the_keys():
    data, rows, groups = grpo_data([100] * 2, [[20] * 4] * 2, seed=8)  # 180 physical tokens a group
    shards, _ = data.shard_by_batch_size(1, sequence_packing_args=packing_args(256, 8, shared_prefix_group_key="idx"))
    batch = shards[0].get_batch(0)
    with pytest.raises(ValueError, match=r"has 180 tokens, 512 padded to pad_to_multiple_of = 512: more than the "
                                         r"256 tokens its micro-batch was planned under \(the token cap\)"):
        list(batch.make_microbatch_iterator_for_packable_sequences(shared_prefix=True, group_key="idx",
                                                                   pad_to_multiple_of=512))
    padded = list(batch.make_microbatch_iterator_for_packable_sequences(shared_prefix=True, group_key="idx",
                                                                        pad_to_multiple_of=128))
    assert [t.tree.num_tokens for t in padded] == [256] * len(padded)  # 180 -> 256: within the cap
    with pytest.raises(ValueError, match=r"has \d+ tokens, more than its planned micro_batch_lengths entry "
                                         r"\(184\).*min_shared_tokens = 1, got 500"):
        list(batch.make_microbatch_iterator_for_packable_sequences(shared_prefix=True, group_key="idx",
                                                                   min_shared_tokens=500))
    tmbs = list(batch.make_microbatch_iterator_for_packable_sequences(shared_prefix=True, group_key="idx",
                                                                      pad_to_multiple_of=8))
    # rows: positions in the batch iterated (its order), as micro_batch_indices count them
    assert [t.rows for t in tmbs] == [tuple(range(s, e)) for s, e in batch.micro_batch_indices[0]]
    for t in tmbs:
        assert torch.equal(t.data["input_ids"], batch["input_ids"][list(t.rows)])
    args = {"max_tokens_per_microbatch": 100, "sequence_length_round": 16, "input_key": "input_ids",
            "input_lengths_key": "input_lengths", "shared_prefix": True}
    with pytest.raises(ValueError, match=r"more than max_tokens_per_microbatch = 100 holds as a tree padded to "
                                         r"sequence_length_round = 16 \(96\)"):
        data.shard_by_batch_size(1, dynamic_batching_args=args)


def test_shards_carry_their_trees_built_once_with_their_plans(monkeypatch):
    """Issue 38: shard_by_batch_size(shared_prefix) builds each bin's tree (and its
    host plans) once; its shards remember it, so the iterator (shared_prefix by
    default) builds no trie; other options build the trees again, with the shard's keys."""
    data, rows, groups = grpo_data([40, 30, 50, 20], [[6, 9, 4], [7, 7], [5, 8, 3, 2], [9]], seed=12)
    shards, _ = data.shard_by_batch_size(2, batch_size=len(rows),
                                         sequence_packing_args=packing_args(160, 8, shared_prefix_group_key="idx"))
    batches = [pickle.loads(pickle.dumps(s.get_batch(0))) for s in shards]  # the trees travel with the shards
    built = []
    real_from_packed = seqpack.PrefixTreeBatch.from_packed

    def counting(*args, **kwargs):
        built.append(1)
        return real_from_packed(*args, **kwargs)

    monkeypatch.setattr(seqpack.PrefixTreeBatch, "from_packed", counting)
    for batch in batches:
        assert batch.micro_batch_tree_options["group_key"] == "idx"
        tmbs = list(batch.make_microbatch_iterator_for_packable_sequences())  # shared_prefix: the shard's
        same = list(batch.make_microbatch_iterator_for_packable_sequences(shared_prefix=True, group_key="idx"))
        assert built == [] and len(tmbs) == len(batch.micro_batch_indices[0])
        for tmb, again in zip(tmbs, same):
            assert isinstance(tmb, TreeMicroBatch) and tmb.tree is again.tree
            assert set(tmb.tree.planned()) == {"attention", "targets"}
            want = real_from_packed(
                np.concatenate([tmb.data["input_ids"][i, :int(n)].numpy() for i, n in enumerate(tmb.data["input_lengths"])]),
                np.concatenate([[0], np.cumsum(tmb.data["input_lengths"].numpy())]),
                group_ids=tmb.data["idx"].tolist())
            assert tmb.tree == want
        padded = list(batch.make_microbatch_iterator_for_packable_sequences(pad_to_multiple_of=8))
        assert len(built) == len(tmbs)  # other options: built again, grouped by the shard's key
        for tmb, p in zip(tmbs, padded):
            assert p.tree.num_tokens % 8 == 0 and p.tree.num_tokens - p.tree.num_pad_tokens == tmb.tree.num_tokens
        built.clear()
        # Issue 50: a tree plan cannot run as rows (its bins may pass the cap as rows).
        with pytest.raises(ValueError, match=r"shared_prefix=False\) contradicts the shard's plan"):
            batch.make_microbatch_iterator_for_packable_sequences(shared_prefix=False)
