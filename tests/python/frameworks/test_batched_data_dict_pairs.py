"""``shard_by_batch_size(sequence_packing_args={..., "force_group_size": 2})``: DPO's
interleaved chosen / rejected pairs stay whole in one bin, in order, so the packed
DPO loss over every shard's micro-batches is the unpacked loss of the batch (fp64).
Hypothesis: every row once, each group in one bin in row order, no bin over the cap."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack import BatchedDataDict, pack_sequences
from seqpack.batched_data_dict import BatchedDataDictError
from seqpack.loss import DPOLoss, SequencePackingLossWrapper


def args(cap, group=2, pad=1, algorithm="modified_first_fit_decreasing", **extra):
    return dict(max_tokens_per_microbatch=cap, input_key="input_ids", input_lengths_key="input_lengths",
                algorithm=algorithm, sequence_length_pad_multiple=pad, force_group_size=group, **extra)


def pair_batch(lengths, vocab=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    n, width = len(lengths), max(lengths)
    ids = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros(n, width, dtype=torch.float64)
    for i, length in enumerate(lengths):
        ids[i, :length] = torch.randint(0, vocab, (length,), generator=g)
        mask[i, 1:length] = 1.0
    return BatchedDataDict(input_ids=ids, input_lengths=torch.tensor(lengths), token_mask=mask,
                           sample_mask=torch.ones(n, dtype=torch.float64), pair_id=torch.arange(n) // 2,
                           reference_policy_logprobs=-torch.rand(n, width, generator=g, dtype=torch.float64),
                           logits=torch.randn(n, width, vocab, generator=g, dtype=torch.float64))


def unpacked_dpo(loss_fn, data, gvs, gvt):
    lp = torch.log_softmax(data["logits"][:, :-1], -1).gather(-1, data["input_ids"][:, 1:, None])[..., 0]
    return loss_fn(lp, data, gvs, gvt)


@settings(max_examples=40, deadline=None)
@given(pairs=st.lists(st.tuples(st.integers(1, 12), st.integers(1, 12)), min_size=2, max_size=8),
       shards=st.integers(1, 2), pad=st.sampled_from([1, 4]),
       algorithm=st.sampled_from(["modified_first_fit_decreasing", "first_fit_decreasing", "concatenative"]))
def test_pairs_stay_whole_and_the_packed_loss_is_the_batchs(pairs, shards, pad, algorithm):
    pairs = pairs[: len(pairs) // shards * shards] if len(pairs) >= shards else pairs
    lengths = [n for pair in pairs for n in pair]
    data = pair_batch(lengths)
    cap = 32
    loss_fn = DPOLoss({"reference_policy_kl_penalty": 0.3, "sft_loss_weight": 0.2})
    gvs, gvt = data["sample_mask"].sum(), (data["token_mask"][:, 1:] * data["sample_mask"][:, None]).sum()
    whole, _ = unpacked_dpo(loss_fn, data, gvs, gvt)
    if len(pairs) < shards:
        return
    parts, order = data.shard_by_batch_size(shards, sequence_packing_args=args(cap, pad=pad, algorithm=algorithm))
    assert sorted(order) == list(range(len(lengths)))
    total = 0.0
    for shard in parts:
        for mb in shard.make_microbatch_iterator_for_packable_sequences():
            pair_ids = mb["pair_id"].tolist()
            assert len(pair_ids) % 2 == 0 and pair_ids[::2] == pair_ids[1::2]  # interleaved, each pair whole
            mask = torch.arange(mb["input_ids"].shape[1])[None] < mb["input_lengths"][:, None]
            packed = pack_sequences({"logits": mb["logits"]}, attention_mask=mask, pad_multiple=pad)
            assert packed.layout.cu_seqlens_padded[-1] <= cap
            wrapper = SequencePackingLossWrapper(loss_fn, cu_seqlens_q=packed.layout.cu_seqlens,
                                                 cu_seqlens_q_padded=packed.layout.cu_seqlens_padded, fused=True)
            loss, _ = wrapper(packed["logits"], mb, gvs, gvt)
            total = total + loss
    torch.testing.assert_close(total, whole, rtol=1e-10, atol=1e-12)


def test_errors_are_named():
    data = pair_batch([5, 6, 30, 9, 2, 2])
    with pytest.raises(BatchedDataDictError, match=r"group 1 \(rows \[2, 3\]\) holds 39 tokens"):
        data.shard_by_batch_size(1, sequence_packing_args=args(32))
    with pytest.raises(BatchedDataDictError, match="not a multiple of force_group_size=4"):
        data.shard_by_batch_size(1, sequence_packing_args=args(64, group=4))
    with pytest.raises(BatchedDataDictError, match="dynamic batching deals rows"):
        data.shard_by_batch_size(1, dynamic_batching_args=dict(
            max_tokens_per_microbatch=64, sequence_length_round=1, input_key="input_ids",
            input_lengths_key="input_lengths", force_group_size=2))
    # shared_prefix with pairs: each pair must be one prefix tree (these pairs share no prompt)
    with pytest.raises(ValueError, match=r"force_group_size=2: rows 0..1 share no prefix"):
        data.shard_by_batch_size(1, sequence_packing_args=args(64, shared_prefix=True))


def test_one_group_size_is_plain_packing():
    data = pair_batch([5, 6, 3, 9, 2, 2, 7, 1])
    plain = data.shard_by_batch_size(2, sequence_packing_args={k: v for k, v in args(16).items()
                                                                if k != "force_group_size"})
    ones = data.shard_by_batch_size(2, sequence_packing_args=args(16, group=1))
    assert plain[1] == ones[1]
    assert [s.micro_batch_indices for s in plain[0]] == [s.micro_batch_indices for s in ones[0]]
    assert np.array_equal(plain[0][0]["input_ids"].numpy(), ones[0][0]["input_ids"].numpy())
