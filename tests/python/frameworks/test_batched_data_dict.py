"""BatchedDataDict: NeMo-RL's test vectors literally, properties, the reference, errors."""

import copy

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack import BatchedDataDict, SlicedDataDict, reference
from seqpack.batched_data_dict import BatchedDataDictError, bin_assignment_spread

L8 = [46, 24, 55, 88, 11, 14, 73, 17]


def packing_args(cap=100, algorithm="modified_first_fit_decreasing", pad=1, **extra):
    return dict(max_tokens_per_microbatch=cap, input_key="input_ids", input_lengths_key="input_lengths",
                algorithm=algorithm, sequence_length_pad_multiple=pad, **extra)


def dynamic_args(cap, round_to, **extra):
    return dict(max_tokens_per_microbatch=cap, sequence_length_round=round_to, input_key="input_ids",
                input_lengths_key="input_lengths", **extra)


def packed_data(lengths, width=100):
    n = len(lengths)
    return BatchedDataDict(input_ids=torch.arange(n * width).reshape(n, width),
                           input_lengths=torch.tensor(lengths), problem_ids=torch.arange(n))


# ---------------------------------------------------------------- NeMo-RL vectors


def test_plain_sharding_vectors():
    data = BatchedDataDict(tensor_data=torch.arange(8), other_tensor=torch.arange(10, 18))
    s0, s1 = data.shard_by_batch_size(shards=2, batch_size=4)
    assert s0["tensor_data"].tolist() == [0, 1, 4, 5] and s0["other_tensor"].tolist() == [10, 11, 14, 15]
    assert s1["tensor_data"].tolist() == [2, 3, 6, 7] and isinstance(s0, SlicedDataDict)
    lists = BatchedDataDict(list_data=list("ABCDEFGH"), tensor=torch.arange(8))
    s0, s1 = lists.shard_by_batch_size(2, 4)
    assert s0["list_data"] == list("ABEF") and s1["list_data"] == list("CDGH")
    big = BatchedDataDict(x=torch.arange(12))
    assert [s["x"].tolist() for s in big.shard_by_batch_size(3, 3)] == [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8, 11]]
    rows = BatchedDataDict(x=torch.arange(1, 19).reshape(6, 3))
    assert [s["x"][:, 0].tolist() for s in rows.shard_by_batch_size(3, 3)] == [[1, 10], [4, 13], [7, 16]]
    ex = BatchedDataDict(problem_id=[0, 0, 1, 1, 2, 2, 3, 3])
    assert [s["problem_id"] for s in ex.shard_by_batch_size(2)] == [[0, 0, 1, 1], [2, 2, 3, 3]]
    assert [s["problem_id"] for s in ex.shard_by_batch_size(2, 4)] == [[0, 0, 2, 2], [1, 1, 3, 3]]
    letters = BatchedDataDict(x=list("AABBCCDD"))
    assert [s["x"] for s in letters.shard_by_batch_size(2, 2)] == [list("ABCD"), list("ABCD")]
    assert BatchedDataDict(x=torch.arange(8)).shard_by_batch_size(1, 2)[0]["x"].tolist() == list(range(8))


def test_uneven_shards():
    data = BatchedDataDict(x=torch.arange(5), y=list("abcde"))
    assert [s["x"].tolist() for s in data.shard_by_batch_size(2, allow_uneven_shards=True)] == [[0, 1, 2], [3, 4]]
    four = data.shard_by_batch_size(4, allow_uneven_shards=True)
    assert [s["x"].tolist() for s in four] == [[0, 1], [2, 3], [4], []]
    assert four[3].size == 0 and four[3]["y"] == []
    with pytest.raises(AssertionError, match="batch_size must be None"):
        data.shard_by_batch_size(2, batch_size=5, allow_uneven_shards=True)


def test_dynamic_batching_vector():
    data = BatchedDataDict(input_ids=torch.ones(8, 128, dtype=torch.long),
                           input_lengths=torch.tensor([2, 8, 4, 16, 28, 32, 2, 32], dtype=torch.int32))
    shards, order = data.shard_by_batch_size(2, dynamic_batching_args=dynamic_args(32, 4))
    assert order == [0, 2, 3, 5, 6, 1, 4, 7]
    assert shards[0]["input_lengths"].tolist() == [2, 4, 16, 32] and shards[1]["input_lengths"].tolist() == [2, 8, 28, 32]
    for s in shards:
        assert s.micro_batch_indices == [[[0, 2], [2, 3], [3, 4]]] and s.micro_batch_lengths == [[8, 28, 32]]
        batch = s.get_batch(0, batch_size=4)
        assert [tuple(mb["input_ids"].shape) for mb in batch.make_microbatch_iterator_with_dynamic_shapes()] == \
            [(2, 8), (1, 28), (1, 32)]
        assert batch.get_microbatch_iterator_dynamic_shapes_len() == 3


def test_dynamic_batching_several_global_batches_and_width_cap():
    data = BatchedDataDict(input_ids=torch.ones(8, 16), input_lengths=torch.tensor([5, 1, 7, 3, 2, 8, 6, 4]),
                           id=torch.arange(8))
    shards, order = data.shard_by_batch_size(2, batch_size=4, dynamic_batching_args=dynamic_args(16, 4))
    assert order == [1, 0, 3, 2, 4, 6, 7, 5]  # chunk-major, as NeMo-RL's
    assert shards[0]["id"].tolist() == [1, 0, 4, 6] and shards[1]["id"].tolist() == [3, 2, 7, 5]
    assert shards[0].micro_batch_indices == [[[0, 2]], [[0, 2]]] and shards[0].micro_batch_lengths == [[8], [8]]
    assert shards[0].get_batch(1, batch_size=2)["id"].tolist() == [4, 6]
    capped = BatchedDataDict(input_ids=torch.ones(2, 10), input_lengths=[9, 3])
    shards, order = capped.shard_by_batch_size(1, dynamic_batching_args=dynamic_args(12, 8))
    assert order == [1, 0] and shards[0].micro_batch_lengths == [[8, 10]]
    with pytest.raises(ValueError, match="exceeds max_tokens_per_microbatch=9"):
        capped.shard_by_batch_size(1, dynamic_batching_args=dynamic_args(9, 8))


def test_sequence_packing_largest_first_vector():
    data = packed_data(L8)
    shards, order = data.shard_by_batch_size(2, sequence_packing_args=packing_args(microbatch_order="largest_first"))
    assert order == [3, 4, 2, 7, 1, 6, 5, 0]
    assert [s.micro_batch_lengths for s in shards] == [[[99, 96]], [[87, 46]]]
    assert shards[0]["problem_ids"].tolist() == [3, 4, 2, 7, 1] and shards[0].micro_batch_indices == [[[0, 2], [2, 5]]]
    assert shards[1]["problem_ids"].tolist() == [6, 5, 0] and shards[1].elem_counts_per_gb == [3]
    for order_arg in (None, "packer"):
        extra = {} if order_arg is None else {"microbatch_order": order_arg}
        again, again_order = data.shard_by_batch_size(2, sequence_packing_args=packing_args(**extra))
        assert again_order == order and [s.micro_batch_lengths for s in again] == [[[99, 96]], [[87, 46]]]
    merged = BatchedDataDict.from_batches(shards)
    merged.reorder_data(order)
    for key in data:
        assert torch.equal(merged[key], data[key])
    assert list(shards[0].keys()) == sorted(data.keys())


def test_sequence_packing_chunks_and_get_batch():
    lengths = [46, 24, 55, 88, 11, 14, 73, 17, 31, 67, 19, 82, 12, 43, 58, 21]
    data = packed_data(lengths)
    shards, order = data.shard_by_batch_size(2, batch_size=8, sequence_packing_args=packing_args())
    assert order == [3, 4, 2, 7, 1, 11, 12, 14, 10, 15, 6, 5, 0, 9, 8, 13]
    assert shards[0].micro_batch_lengths == [[99, 96], [94, 98]] and shards[0].elem_counts_per_gb == [5, 5]
    assert shards[1].micro_batch_indices == [[[0, 2], [2, 3]], [[0, 2], [2, 3]]]
    first, _ = data.shard_by_batch_size(2, batch_size=8,
                                        sequence_packing_args=packing_args(microbatch_order="largest_first"))
    assert first[0]["problem_ids"].tolist() == [3, 4, 2, 7, 1, 14, 10, 15, 11, 12]
    assert first[0].micro_batch_indices == [[[0, 2], [2, 5]], [[0, 3], [3, 5]]]
    gb = shards[1].get_batch(1)
    assert gb["problem_ids"].tolist() == [9, 8, 13] and gb.micro_batch_lengths == [[98, 43]]
    assert [mb["problem_ids"].tolist() for mb in gb.make_microbatch_iterator_for_packable_sequences()] == [[9, 8], [13]]
    assert gb.get_microbatch_iterator_for_packable_sequences_len() == (2, 98)


def test_sequence_packing_pad_multiple_and_small_cases():
    shards, order = packed_data([5, 9, 17, 30, 3, 12]).shard_by_batch_size(
        2, sequence_packing_args=packing_args(cap=64, pad=8))
    assert order == [1, 5, 0, 4, 3, 2]
    assert shards[0].micro_batch_lengths == [[48]] and shards[1].micro_batch_lengths == [[56]]
    shards, order = packed_data([3, 4, 5, 6]).shard_by_batch_size(4, sequence_packing_args=packing_args(cap=16))
    assert order == [0, 3, 1, 2] and [s.micro_batch_lengths for s in shards] == [[[3]], [[6]], [[4]], [[5]]]
    shards, _ = packed_data([900, 850, 1000, 950], width=1000).shard_by_batch_size(
        2, sequence_packing_args=packing_args(cap=1024))
    assert all(e - s == 1 for sh in shards for s, e in sh.micro_batch_indices[0])


# ---------------------------------------------------------------- other methods


def test_from_batches_padding_rules():
    out = BatchedDataDict.from_batches([{"x": torch.tensor([[1, 2], [3, 4]]), "y": ["a", "b"], "z": torch.tensor([1, 2])},
                                        {"x": torch.tensor([[5, 6, 7]]), "y": ["c"], "z": torch.tensor([3])}],
                                       pad_value_dict={"x": -1})
    assert out["x"].tolist() == [[1, 2, -1], [3, 4, -1], [5, 6, 7]] and out["y"] == ["a", "b", "c"]
    assert list(out.keys()) == ["x", "y", "z"] and type(out) is BatchedDataDict
    a, b = torch.arange(48).reshape(2, 3, 4, 2), torch.arange(100, 140).reshape(1, 5, 4, 2)
    four = BatchedDataDict.from_batches([{"t": a}, {"t": b}], pad_value_dict={"t": -1})["t"]
    assert four.shape == (3, 5, 4, 2) and torch.equal(four[:2, :3], a) and (four[:2, 3:] == -1).all()
    empty = BatchedDataDict.from_batches([{"output_ids": torch.zeros(0, 0, dtype=torch.long)},
                                          {"output_ids": torch.tensor([[1, 2, 3]]), "extra": torch.ones(1, 2)}])
    assert empty["output_ids"].tolist() == [[1, 2, 3]] and empty["extra"].shape == (1, 2)
    with pytest.raises(KeyError, match="'extra'"):
        BatchedDataDict.from_batches([{"t": [[1], [2]]}, {"t": [[3]], "extra": torch.tensor([1])}])
    assert BatchedDataDict.from_batches([]).size == 0


def test_chunk_reorder_select_slice_repeat_truncate():
    data = BatchedDataDict(x=list("AAABBBDDE"[:8]) + ["E"], n=torch.arange(9))
    assert data.chunk(2, 3)["x"] == ["D", "D", "E"] and data.chunk(2, 3)["n"].tolist() == [6, 7, 8]
    d = BatchedDataDict(a=torch.tensor([10, 11, 12, 13]), l=list("abcd"))
    d.reorder_data([2, 0, 3, 1])
    assert d["a"].tolist() == [11, 13, 10, 12] and d["l"] == list("bdac")
    with pytest.raises(AssertionError, match="2 entries for a batch of 4"):
        d.reorder_data([1, 0])
    sel = d.select_indices([3, 0])
    assert sel["a"].tolist() == [12, 11] and sel["l"] == ["c", "b"] and sel.micro_batch_indices is None
    assert d.select_indices(torch.tensor([1]))["l"] == ["d"]
    with pytest.raises(TypeError, match="Unsupported type"):
        BatchedDataDict(t=(1, 2)).select_indices([0])
    sl = d.slice(1, 3)
    assert sl["a"].tolist() == [13, 10] and isinstance(sl, SlicedDataDict)
    with pytest.raises(AssertionError, match="end: 9 is greater than the shape"):
        d.slice(0, 9)
    rep = BatchedDataDict(t=torch.tensor([1, 2, 3]), o=[{"k": [1]}, {"k": [2]}, {"k": [3]}]).repeat_interleave(2)
    assert rep["t"].tolist() == [1, 1, 2, 2, 3, 3] and rep["o"][0] == rep["o"][1] and rep["o"][0] is not rep["o"][1]
    image = np.zeros((4, 4, 3), dtype=np.uint8)
    shared = BatchedDataDict(msgs=[{"images": [image], "text": "hi"}]).repeat_interleave(
        2, share_immutable_media=True, media_keys=("images",))  # "images" is not one of NeMo-RL's media keys
    assert shared["msgs"][0]["images"][0] is image and shared["msgs"][1]["images"][0] is image
    assert shared["msgs"][0]["images"] is not shared["msgs"][1]["images"]
    copied = BatchedDataDict(msgs=[{"images": [image]}]).repeat_interleave(2)
    assert copied["msgs"][0]["images"][0] is not image
    tr = BatchedDataDict(x=torch.ones(2, 4), y=torch.ones(2))
    tr.truncate_tensors(1, 3)
    assert tr["x"].shape == (2, 3) and tr["y"].shape == (2,)
    assert BatchedDataDict().size == 0 and BatchedDataDict(x=[1, 2]).size == 2
    assert tr.to("cpu") is tr and tr.get_dict() is tr.data
    mbs = list(BatchedDataDict(x=torch.arange(6)).make_microbatch_iterator(2))
    assert [m["x"].tolist() for m in mbs] == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(AssertionError, match="not a multiple of the provided microbatch size"):
        BatchedDataDict(x=torch.arange(5)).make_microbatch_iterator(2)
    kept = BatchedDataDict(x=torch.arange(2))
    kept.micro_batch_indices = [[[0, 2]]]
    assert copy.deepcopy(kept).micro_batch_indices == [[[0, 2]]]


def test_errors():
    data = BatchedDataDict(x=torch.arange(10))
    with pytest.raises(AssertionError, match=r"Total batch size \(10\) is not a multiple of batch_size \(3\)"):
        data.shard_by_batch_size(2, 3)
    with pytest.raises(ValueError, match=r"Batch size \(8\) is not a multiple of shards \(3\)"):
        BatchedDataDict(x=torch.arange(8)).shard_by_batch_size(3, 4 * 2)
    with pytest.raises(AssertionError, match="Batch sizes are not the same across the rollout batch"):
        BatchedDataDict(a=torch.arange(4), b=torch.arange(3)).shard_by_batch_size(2, 2)
    both = packed_data(L8)
    with pytest.raises(AssertionError, match="cannot be passed together"):
        both.shard_by_batch_size(2, dynamic_batching_args=dynamic_args(100, 4), sequence_packing_args=packing_args())
    with pytest.raises(ValueError, match="microbatch_order"):
        both.shard_by_batch_size(1, sequence_packing_args=packing_args(microbatch_order="unknown"))
    with pytest.raises(ValueError, match="exceeds"):
        both.shard_by_batch_size(2, sequence_packing_args=packing_args(cap=50))
    with pytest.raises(ValueError, match="input_lengths_key 'lens'"):
        both.shard_by_batch_size(2, sequence_packing_args={**packing_args(), "input_lengths_key": "lens"})
    with pytest.raises(AssertionError, match="exactly one global batch"):
        both.make_microbatch_iterator_for_packable_sequences()
    with pytest.raises(AssertionError, match="index OOB"):
        BatchedDataDict(x=torch.arange(4)).chunk(4, 4)
    assert issubclass(BatchedDataDictError, ValueError)


# ---------------------------------------------------------------- properties and the reference


@st.composite
def batches(draw):
    shards = draw(st.integers(1, 4))
    per_chunk = shards * draw(st.integers(1, 6))
    chunks = draw(st.integers(1, 3))
    n = per_chunk * chunks
    lengths = draw(st.lists(st.integers(1, 40), min_size=n, max_size=n))
    return shards, per_chunk, lengths


@settings(max_examples=60, deadline=None)
@given(case=batches(), algorithm=st.sampled_from(["concatenative", "first_fit_decreasing",
                                                  "modified_first_fit_decreasing", "best_fit_decreasing"]),
       pad=st.sampled_from([1, 4]), order_arg=st.sampled_from(["packer", "largest_first"]))
def test_packing_matches_nemo_rl_reference(case, algorithm, pad, order_arg):
    shards, batch_size, lengths = case
    data = packed_data(lengths, width=40)
    data["names"] = [f"s{i}" for i in range(len(lengths))]
    args = packing_args(cap=64, algorithm=algorithm, pad=pad, microbatch_order=order_arg)
    try:
        ref_shards, ref_order, ref_meta = reference.shard_by_batch_size(dict(data), shards, batch_size,
                                                                        sequence_packing_args=args)
    except ValueError:
        with pytest.raises(ValueError):
            data.shard_by_batch_size(shards, batch_size, sequence_packing_args=args)
        return
    ours, order = data.shard_by_batch_size(shards, batch_size, sequence_packing_args=args)
    assert order == ref_order and sorted(order) == list(range(len(lengths)))
    for shard, ref, meta in zip(ours, ref_shards, ref_meta):
        assert list(shard.keys()) == list(ref.keys())
        for key in ref:
            assert (shard[key] == ref[key]) if isinstance(ref[key], list) else torch.equal(shard[key], ref[key])
        assert shard.micro_batch_indices == meta["micro_batch_indices"]
        assert shard.micro_batch_lengths == meta["micro_batch_lengths"]
        assert shard.elem_counts_per_gb == meta["elem_counts_per_gb"]
        padded = [-(-x // pad) * pad for x in shard["input_lengths"].tolist()]
        for c, (idx, lens) in enumerate(zip(shard.micro_batch_indices, shard.micro_batch_lengths)):
            base = sum(shard.elem_counts_per_gb[:c])
            assert all(sum(padded[base + s: base + e]) == t <= 64 for (s, e), t in zip(idx, lens))
            gb = shard.get_batch(c)  # one global batch: its rows, its plan
            assert gb.size == shard.elem_counts_per_gb[c] and gb.micro_batch_indices == [idx]
            assert all(c * batch_size <= p < (c + 1) * batch_size for p in gb["problem_ids"].tolist())
            rows = [r for mb in gb.make_microbatch_iterator_for_packable_sequences() for r in mb["problem_ids"].tolist()]
            assert rows == gb["problem_ids"].tolist()
    assert len({len(s.micro_batch_indices[0]) for s in ours}) == 1  # equal micro-batch counts
    merged = BatchedDataDict.from_batches(ours)
    merged.reorder_data(order)
    assert torch.equal(merged["problem_ids"], data["problem_ids"]) and merged["names"] == data["names"]


@settings(max_examples=60, deadline=None)
@given(case=batches(), round_to=st.sampled_from([1, 4, 8]))
def test_dynamic_batching_matches_nemo_rl_reference(case, round_to):
    shards, batch_size, lengths = case
    data = packed_data(lengths, width=40)
    args = dynamic_args(96, round_to)
    ref_shards, ref_order, ref_meta = reference.shard_by_batch_size(dict(data), shards, batch_size,
                                                                    dynamic_batching_args=args)
    ours, order = data.shard_by_batch_size(shards, batch_size, dynamic_batching_args=args)
    assert order == ref_order
    for shard, ref, meta in zip(ours, ref_shards, ref_meta):
        assert all(torch.equal(shard[k], ref[k]) for k in ref)
        assert shard.micro_batch_indices == meta["micro_batch_indices"]
        assert shard.micro_batch_lengths == meta["micro_batch_lengths"]
        for c in range(len(lengths) // batch_size):
            gb = shard.get_batch(c, batch_size // shards)
            seen = 0
            for mb in gb.make_microbatch_iterator_with_dynamic_shapes():
                assert mb["input_ids"].shape[0] * mb["input_ids"].shape[1] <= 96
                assert (mb["input_lengths"] <= mb["input_ids"].shape[1]).all()
                seen += mb.size
            assert seen == gb.size
    if len(lengths) == batch_size:
        merged = BatchedDataDict.from_batches(ours)
        merged.reorder_data(order)
        assert torch.equal(merged["problem_ids"], data["problem_ids"])
    optimal, _ = data.shard_by_batch_size(shards, batch_size, dynamic_batching_args=dynamic_args(96, round_to,
                                                                                                 rule="optimal"))
    tokens = lambda sh: sum((e - s) * n for ci, cl in zip(sh.micro_batch_indices, sh.micro_batch_lengths)  # noqa: E731
                            for (s, e), n in zip(ci, cl))
    assert tokens(optimal[0]) <= tokens(ours[0])


def test_karmarkar_karp_bin_assignment():
    rng = np.random.default_rng(0)
    lengths = rng.integers(10, 900, 256).tolist()
    data = packed_data(lengths, width=900)
    args = packing_args(cap=2048, algorithm="first_fit_decreasing")
    rr, _ = data.shard_by_batch_size(8, sequence_packing_args=args)
    kk, order = data.shard_by_batch_size(8, sequence_packing_args={**args, "balance": "karmarkar_karp"})
    per_shard = lambda shards: [sum(s.micro_batch_lengths[0]) for s in shards]  # noqa: E731
    assert sorted(order) == list(range(256)) and sum(per_shard(kk)) == sum(per_shard(rr))
    assert len({len(s.micro_batch_indices[0]) for s in kk}) == 1
    assert max(per_shard(kk)) - min(per_shard(kk)) <= max(per_shard(rr)) - min(per_shard(rr))
    spread = bin_assignment_spread(lengths, 8, args)
    assert spread["round_robin"]["spread"] == max(per_shard(rr)) - min(per_shard(rr))
    assert spread["karmarkar_karp"]["spread"] == max(per_shard(kk)) - min(per_shard(kk))
    with pytest.raises(ValueError, match="balance must be"):
        data.shard_by_batch_size(8, sequence_packing_args={**args, "balance": "random"})


def test_packed_microbatch_iterator_yields_thd_batches():
    lengths = [5, 9, 17, 30, 3, 12, 7, 21]
    width = 32
    ids = torch.arange(8 * width).reshape(8, width)
    data = BatchedDataDict(input_ids=ids, labels=ids + 1000, input_lengths=torch.tensor(lengths))
    shards, _ = data.shard_by_batch_size(2, sequence_packing_args=packing_args(cap=64, pad=4))
    for shard in shards:
        gb = shard.get_batch(0)
        packed = list(gb.make_packed_microbatch_iterator(cp_size=2, pp_size=2, pad_values={"labels": -100}))
        assert len(packed) == gb.get_microbatch_iterator_for_packable_sequences_len()[0]
        assert len({p.cu_seqlens_padded[-1].item() for p in packed}) == 1  # PP: one buffer size
        for p, (s, e) in zip(packed, gb.micro_batch_indices[0]):
            assert p.cp_size == 2 and (p.padded_lens % 4 == 0).all()
            back = p.unpack(p["input_ids"], fill=-1)
            for row, n in enumerate(gb["input_lengths"][s:e].tolist()):
                cp_rank0 = back[row][back[row] >= 0]
                assert set(cp_rank0.tolist()) <= set(gb["input_ids"][s + row, :n].tolist())
