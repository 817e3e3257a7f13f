"""seqpack.thd: pack_sequences / PackedBatch against a pure-PyTorch reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import seqpack
from seqpack import alignment, pack_sequences
from seqpack.tensors.cp import cp_partition_indices, cp_restore_order

from conftest import round_up

P = -1  # pad value used by the literal examples


def reference_pack(x, mask, pad_multiple, pad_value, cp_size, cp_rank, pad_to_total=None):
    """Per-sequence PyTorch loop (the layout spelled out): the real tokens of each
    row in column order, tail-padded to the multiple; the last sequence absorbs the
    bin padding; with CP, chunks r and 2*CP-1-r of every sequence."""
    pieces, positions, padded = [], [], []
    for b in range(x.shape[0]):
        tokens = x[b][mask[b].bool()]
        length = round_up(tokens.shape[0], pad_multiple)
        padded.append(length)
        pad = torch.full((length - tokens.shape[0], *x.shape[2:]), pad_value, dtype=x.dtype)
        pieces.append(torch.cat([tokens, pad]))
    if pad_to_total is not None and pieces and pad_to_total > sum(padded):
        extra = pad_to_total - sum(padded)
        pieces[-1] = torch.cat([pieces[-1], torch.full((extra, *x.shape[2:]), pad_value, dtype=x.dtype)])
        padded[-1] += extra
    out = []
    for seq, length in zip(pieces, padded):
        if cp_size == 1:
            out.append(seq)
            positions.append(torch.arange(length))
            continue
        chunk = length // (2 * cp_size)
        for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
            out.append(seq[c * chunk:(c + 1) * chunk])
            positions.append(torch.arange(c * chunk, (c + 1) * chunk))
    empty = torch.empty((0, *x.shape[2:]), dtype=x.dtype)
    return (torch.cat(out) if out else empty), (torch.cat(positions) if positions else torch.empty(0, dtype=torch.int64)), padded


# ---------------------------------------------------------------- SPEC section 7


def test_spec_context_parallel_example():
    lengths = [2, 4, 6, 1]
    ids = torch.tensor([[b] * 8 for b in range(4)])
    ranks = [
        pack_sequences({"input_ids": ids}, seq_lens=lengths, pad_multiple=alignment(cp_size=2), cp_size=2,
                       cp_rank=r, pad_value=P)
        for r in range(2)
    ]
    assert ranks[0]["input_ids"].tolist() == [0, P, 1, 1, 2, 2, P, P, 3, P]
    assert ranks[1]["input_ids"].tolist() == [0, P, 1, 1, 2, 2, 2, 2, P, P]
    for packed in ranks:
        assert packed.cu_seqlens_padded.tolist() == [0, 4, 8, 16, 20]
        assert packed.padded_lens.tolist() == [4, 4, 8, 4]
        assert packed.cu_seqlens.tolist() == [0, 2, 6, 12, 13]
        assert packed.cu_seqlens.dtype == packed.cu_seqlens_padded.dtype == torch.int32
    assert ranks[0].position_ids.tolist() == [0, 3, 0, 3, 0, 1, 6, 7, 0, 3]


def test_alignment_rule():
    assert alignment() == 1
    assert alignment(cp_size=2) == 4
    assert alignment(cp_size=4, tp_size=2, sequence_parallel=True) == 16
    assert alignment(tp_size=8) == 1 and alignment(tp_size=8, sequence_parallel=True) == 8
    with pytest.raises(ValueError, match="cp_size"):
        alignment(cp_size=0)


def test_left_padded_and_per_name_pad_values():
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 4]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    labels = ids.clone()
    packed = pack_sequences({"input_ids": ids, "labels": labels}, attention_mask=mask, pad_multiple=4,
                            pad_values={"labels": -100})
    assert packed["input_ids"].tolist() == [5, 6, 0, 0, 7, 8, 9, 4]
    assert packed["labels"].tolist() == [5, 6, -100, -100, 7, 8, 9, 4]
    assert packed.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert packed.max_seqlen == 4 and packed.max_seqlen_padded == 4
    assert packed.unpack(packed["input_ids"], fill=0).tolist() == [[0, 0, 5, 6], [7, 8, 9, 4]]


def test_bin_padding_absorbed_by_last_sequence():
    x = torch.arange(12).view(3, 4)
    packed = pack_sequences(x, seq_lens=[1, 2, 3], pad_multiple=2, pad_packed_to=12, pad_value=P)
    assert packed.cu_seqlens_padded.tolist() == [0, 2, 4, 12]
    assert packed["input"].tolist() == [0, P, 4, 5, 8, 9, 10, P, P, P, P, P]
    assert packed.position_ids.tolist() == [0, 1, 0, 1, 0, 1, 2, 3, 4, 5, 6, 7]
    packed = pack_sequences(x, seq_lens=[1, 2, 3], pad_multiple=2, pad_packed_multiple=5)
    assert packed.cu_seqlens_padded.tolist() == [0, 2, 4, 10]


# ---------------------------------------------------------------- properties

DTYPES = [torch.int64, torch.int32, torch.bool, torch.float32, torch.bfloat16, torch.float16, torch.uint8]


@st.composite
def batches(draw):
    batch = draw(st.integers(0, 5))
    width = draw(st.integers(1, 12))
    kind = draw(st.sampled_from(["right", "left", "random"]))
    lens = draw(st.lists(st.integers(0, width), min_size=batch, max_size=batch))
    mask = torch.zeros(batch, width, dtype=torch.int64)
    for b, n in enumerate(lens):
        if kind == "right":
            mask[b, :n] = 1
        elif kind == "left":
            mask[b, width - n:] = 1
        else:
            cols = draw(st.lists(st.integers(0, width - 1), max_size=width, unique=True))
            mask[b, cols] = 1
    cp = draw(st.sampled_from([1, 2, 4]))
    tp = draw(st.sampled_from([1, 2]))
    multiple = alignment(cp_size=cp, tp_size=tp, sequence_parallel=True) * draw(st.sampled_from([1, 3]))
    dtype = draw(st.sampled_from(DTYPES))
    hidden = draw(st.sampled_from([(), (3,), (2, 5)]))
    bin_pad = draw(st.sampled_from([None, 2 * cp * 8]))
    return mask, cp, multiple, dtype, hidden, bin_pad


def random_tensor(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-50, 200 if dtype == torch.uint8 else 1000, shape, generator=g).clamp(min=0 if dtype == torch.uint8 else -50).to(dtype)


@given(case=batches(), seed=st.integers(0, 2**16))
def test_matches_reference_and_round_trips(case, seed):
    mask, cp, multiple, dtype, hidden, bin_pad = case
    batch, width = mask.shape
    x = random_tensor((batch, width, *hidden), dtype, seed)
    pad_value = True if dtype == torch.bool else 7
    full = pack_sequences({"x": x}, attention_mask=mask, pad_multiple=multiple, pad_value=pad_value,
                          pad_packed_multiple=bin_pad)
    total = int(full.cu_seqlens_padded[-1])
    cu = full.cu_seqlens.tolist()
    assert cu == [0] + torch.cumsum(mask.sum(1), 0).tolist()
    padded_lens = full.padded_lens.tolist()
    # Every sequence aligned; bin padding joins the last one, which stays CP-splittable.
    assert all(length % multiple == 0 for length in padded_lens[:-1])
    if padded_lens:
        assert padded_lens[-1] % (multiple if bin_pad is None else 2 * cp if cp > 1 else 1) == 0
    assert bin_pad is None or total % bin_pad == 0
    assert full.max_seqlen == (int(mask.sum(1).max()) if batch else 0)
    gathered = []
    for r in range(cp):
        local = pack_sequences({"x": x}, attention_mask=mask, pad_multiple=multiple, pad_value=pad_value,
                               pad_packed_multiple=bin_pad, cp_size=cp, cp_rank=r)
        expected, positions, padded = reference_pack(x, mask, multiple, pad_value, cp, r, total)
        assert torch.equal(local["x"], expected)
        assert torch.equal(local.position_ids, positions)
        assert local.padded_lens.tolist() == padded
        assert local.num_tokens == total // cp
        # CP-local unpack: this rank's real tokens back in place, the rest filled.
        back = local.unpack(local["x"], fill=pad_value)
        mine = torch.zeros_like(mask, dtype=torch.bool)
        for b in range(batch):
            cols = mask[b].nonzero().flatten()
            chunk = padded[b] // (2 * cp)
            for j, col in enumerate(cols.tolist()):
                mine[b, col] = (j // chunk if chunk else 0) in (r, 2 * cp - 1 - r) if cp > 1 else True
        assert torch.equal(back[mine], x[mine])
        assert bool((back[~mine] == pad_value).all())
        gathered.append(local["x"])
    # The ranks' pieces, reordered, are exactly the full packed stream.
    if cp > 1 and total:
        stream = torch.cat(gathered)[torch.from_numpy(cp_restore_order(full.cu_seqlens_padded, cp))]
        assert torch.equal(stream, full["x"])
    # Round trip on the real tokens.
    back = full.unpack(full["x"], fill=pad_value)
    assert torch.equal(back[mask.bool()], x[mask.bool()])


def test_gradients_match_reference():
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1], [1, 0, 1, 0, 1]])
    h = torch.randn(3, 5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, dtype=torch.float64)
    for cp, rank in [(1, 0), (2, 0), (2, 1)]:
        h.grad = None
        packed = pack_sequences({"h": h}, attention_mask=mask, pad_multiple=alignment(cp_size=cp), cp_size=cp,
                                cp_rank=rank)
        loss = (packed["h"] @ w).pow(2).sum() + packed.unpack(packed["h"] * 3).sum()
        loss.backward()
        ours = h.grad.clone()
        h.grad = None
        ref, _, _ = reference_pack(h, mask, alignment(cp_size=cp), 0, cp, rank)
        ref_loss = (ref @ w).pow(2).sum() + 3 * ref.sum()
        ref_loss.backward()
        assert torch.allclose(ours, h.grad)


def test_exports():
    ids = torch.tensor([[1, 2, 0], [3, 4, 5]])
    packed = pack_sequences(ids, seq_lens=[2, 3], pad_multiple=2)
    params = packed.packed_seq_params()
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q.tolist() == [0, 2, 5] and params.cu_seqlens_kv_padded.tolist() == [0, 2, 6]
    assert params.max_seqlen_q == params.max_seqlen_kv == 4
    fa = packed.flash_attn_kwargs()
    assert fa["cu_seqlens_q"].tolist() == fa["cu_seqlens_k"].tolist() == [0, 2, 6] and fa["max_seqlen_q"] == 4
    hf = packed.hf_kwargs()
    assert hf["position_ids"].tolist() == [[0, 1, 0, 1, 2, 3]] and hf["max_length_k"] == 4
    cp = pack_sequences(ids, seq_lens=[2, 3], pad_multiple=4, cp_size=2)
    with pytest.raises(ValueError, match="cp_size"):
        cp.flash_attn_kwargs()


def test_multithreaded_copies_match_single_thread():
    x = torch.randn(64, 2048, 64)  # 32 MiB: split over threads
    lens = torch.randint(0, 2049, (64,))
    one = pack_sequences(x, seq_lens=lens, pad_multiple=8, num_threads=1)
    many = pack_sequences(x, seq_lens=lens, pad_multiple=8, num_threads=4)
    assert torch.equal(one["input"], many["input"])
    assert torch.equal(one.unpack(one["input"]), many.unpack(many["input"]))


def test_direct_kernels_and_the_registered_ops_agree():
    # Plain no-grad tensors skip the operator dispatch; everything else goes through it.
    from seqpack.tensors import _ops

    torch.manual_seed(1)
    mask = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [0, 0, 0, 0]])
    h = torch.randn(3, 4, 5, dtype=torch.float64)
    packed = pack_sequences(h, attention_mask=mask, pad_multiple=4, cp_size=2, cp_rank=1, pad_value=7.5)
    assert _ops._direct(h) and not _ops._direct(h.clone().requires_grad_())
    via_op = torch.ops.seqpack.pack(h, *packed._runs(), packed.num_tokens, 7.5, 0)
    assert torch.equal(packed["input"], via_op)
    assert torch.equal(packed.unpack(via_op, fill=-1), torch.ops.seqpack.unpack(via_op, *packed._runs(), 3, 4, -1.0, 0))
    with torch.no_grad():  # requires_grad but no grad mode: direct again
        assert _ops._direct(h.clone().requires_grad_())
    graded = pack_sequences(h.clone().requires_grad_(), attention_mask=mask, pad_multiple=4, cp_size=2, cp_rank=1,
                            pad_value=7.5)
    assert graded["input"].grad_fn is not None and torch.equal(graded["input"].detach(), via_op)


def test_pack_sequences_under_torch_compile():
    h = torch.randn(2, 4, 8)

    def f(x, lens):
        packed = pack_sequences({"h": x}, seq_lens=lens, pad_multiple=2)
        return packed.unpack(torch.tanh(packed["h"]))

    compiled = torch.compile(f, backend="aot_eager")
    assert torch.allclose(compiled(h, [3, 1]), f(h, [3, 1]))


# ---------------------------------------------------------------- errors


def test_errors():
    x = torch.zeros(2, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="exactly one of attention_mask and seq_lens"):
        pack_sequences(x)
    with pytest.raises(ValueError, match="seq_lens.*width"):
        pack_sequences(x, seq_lens=[5, 1])
    with pytest.raises(ValueError, match="seq_lens has 3 entries"):
        pack_sequences(x, seq_lens=[1, 1, 1])
    with pytest.raises(ValueError, match=r"\[B, S\] = \[2, 4\]"):
        pack_sequences({"a": x, "b": torch.zeros(3, 4)}, seq_lens=[1, 1])
    with pytest.raises(ValueError, match="attention_mask must be"):
        pack_sequences(x, attention_mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match="pad_multiple.*2 \\* cp_size"):
        pack_sequences(x, seq_lens=[1, 1], pad_multiple=2, cp_size=2)
    with pytest.raises(ValueError, match="cp_rank"):
        pack_sequences(x, seq_lens=[1, 1], pad_multiple=4, cp_size=2, cp_rank=2)
    with pytest.raises(ValueError, match="pad_packed_to"):
        pack_sequences(x, seq_lens=[3, 3], pad_multiple=4, pad_packed_to=4)
    with pytest.raises(ValueError, match="pad_values names"):
        pack_sequences(x, seq_lens=[1, 1], pad_values={"labels": -100})
    with pytest.raises(ValueError, match="rows"):
        pack_sequences(x, seq_lens=[1, 1]).unpack(torch.zeros(7))
    with pytest.raises(TypeError, match="torch.Tensor"):
        pack_sequences({"a": [1, 2]}, seq_lens=[1])
    with pytest.raises(ValueError, match=r"\[B, S, \.\.\.\]"):
        pack_sequences(torch.zeros(4), seq_lens=[1])


def test_unpack_sequences_cp_local():
    lengths = [2, 4, 6, 1]
    ids = torch.tensor([[b] * 8 for b in range(4)])
    local = pack_sequences(ids, seq_lens=lengths, pad_multiple=4, cp_size=2, cp_rank=1, pad_value=P)
    views = seqpack.unpack_sequences(local["input"], local.cu_seqlens_padded, cp_size=2)
    assert [v.tolist() for v in views] == [[0, P], [1, 1], [2, 2, 2, 2], [P, P]]
    assert views[2].data_ptr() == local["input"][4:].data_ptr()  # views, not copies
    with pytest.raises(ValueError, match="rows"):
        seqpack.unpack_sequences(local["input"], local.cu_seqlens_padded, cp_size=1)
    with pytest.raises(ValueError, match="2 \\* cp_size"):
        seqpack.unpack_sequences(torch.zeros(3), [0, 6], cp_size=2)


def test_offsets_take_int32_and_int64_and_refuse_the_rest():
    import numpy as np

    for cu in ([0, 8], np.array([0, 8]), np.array([0, 8], np.int32), torch.tensor([0, 8]),
               torch.tensor([0, 8], dtype=torch.int32)):
        assert cp_partition_indices(cu, 2, 0).tolist() == [0, 1, 6, 7]
        assert [v.tolist() for v in seqpack.unpack_sequences(torch.arange(8), cu)] == [list(range(8))]
    with pytest.raises(TypeError, match="cu_seqlens_padded must hold integers, got float64"):
        cp_partition_indices(np.array([0.0, 8.0]), 2, 0)
    with pytest.raises(TypeError, match="cu_seqlens_padded must be a 1-D int32 or int64 tensor"):
        seqpack.unpack_sequences(torch.zeros(8), torch.tensor([0.0, 8.0]))
    with pytest.raises(ValueError, match="cu_seqlens_padded ends at 4294967296; offsets must fit in int32"):
        cp_partition_indices([0, 2**32], 1, 0)


def test_cp_indices_errors():
    with pytest.raises(ValueError, match="2 \\* cp_size"):
        cp_partition_indices([0, 6], 2, 0)
    with pytest.raises(ValueError, match="never decrease"):
        cp_partition_indices([0, 8, 4], 1, 0)
    assert cp_partition_indices([0, 8, 16], 2, 1).tolist() == [2, 3, 4, 5, 10, 11, 12, 13]


# ---------------------------------------------------------------- torch.library ops


def test_ops_pass_opcheck():
    from seqpack.tensors import _ops

    x = torch.randn(3, 5, 4, dtype=torch.float64, requires_grad=True)
    packed = pack_sequences({"x": x}, seq_lens=[5, 2, 0], pad_multiple=4, cp_size=2, cp_rank=1)
    runs = packed._runs()
    torch.library.opcheck(_ops.pack, (x, *runs, packed.num_tokens, 0.0, 0))
    y = torch.randn(packed.num_tokens, 4, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(_ops.unpack, (y, *runs, 3, 5, 0.0, 0))


def test_torch_compile_traces_through_pack_and_unpack():
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]])
    h = torch.randn(2, 4, 8)
    packed = pack_sequences({"h": h}, attention_mask=mask, pad_multiple=2)

    def f(x):
        p = torch.ops.seqpack.pack(x, *packed._runs(), packed.num_tokens, 0.0, 0)
        return torch.ops.seqpack.unpack(torch.tanh(p) * 2, *packed._runs(), 2, 4, 0.0, 0)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(h), f(h))
    expected = torch.zeros_like(h)
    expected[mask.bool()] = torch.tanh(h[mask.bool()]) * 2
    assert torch.allclose(compiled(h), expected)


# ---- static shapes ------------------------------------------------------------------
@given(lengths=st.lists(st.integers(0, 9), min_size=1, max_size=6), multiple=st.sampled_from([1, 2, 4]),
       spare=st.integers(0, 7), extra_seqs=st.integers(0, 2), hidden=st.sampled_from([0, 1, 3]),
       cp=st.sampled_from([1, 2, 3]), data=st.data())
def test_static_pack_equals_the_planned_pack(lengths, multiple, spare, extra_seqs, hidden, cp, data):
    # The static pack (PyTorch ops, device metadata) = the planned pack padded to the
    # capacity (the last sequence absorbs it), offsets padded with their last value;
    # with CP, each rank's zigzag rows of it.
    width = 9
    batch = len(lengths)
    if cp > 1:
        multiple *= 2 * cp
    rank = data.draw(st.integers(0, cp - 1))
    x = torch.randn(batch, width, hidden) if hidden else torch.randint(0, 100, (batch, width))
    need = sum(round_up(n, multiple) for n in lengths)
    capacity = round_up(max(need + spare, 1), 2 * cp if cp > 1 else 1)
    lens = torch.tensor(lengths)
    static = seqpack.pack_sequences_static({"x": x}, lens, max_tokens=capacity, max_seqs=batch + extra_seqs,
                                           pad_multiple=multiple, pad_value=-1, cp_size=cp, cp_rank=rank)
    planned = pack_sequences({"x": x}, seq_lens=lengths, pad_multiple=multiple, pad_packed_to=capacity,
                             pad_value=-1, cp_size=cp, cp_rank=rank)
    assert torch.equal(static["x"], planned["x"])
    assert static.cu_seqlens.dtype == torch.int32 and static.cu_seqlens.shape == (batch + extra_seqs + 1,)
    assert static.cu_seqlens[: batch + 1].tolist() == planned.cu_seqlens.tolist()
    assert static.cu_seqlens[batch:].unique().numel() == 1
    assert static.cu_seqlens_padded[: batch + 1].tolist() == planned.cu_seqlens_padded.tolist()
    assert (static.cu_seqlens_padded[batch:] == capacity).all()
    assert torch.equal(static.position_ids, planned.position_ids)
    back = static.unpack(static["x"], fill=0)
    assert torch.equal(back, planned.unpack(planned["x"], fill=0))
    # Host lengths (validated, one copy) give the same as a lengths tensor.
    host = seqpack.pack_sequences_static({"x": x}, lengths, max_tokens=capacity, pad_multiple=multiple,
                                         pad_value=-1, cp_size=cp, cp_rank=rank)
    assert torch.equal(host["x"], static["x"])


def test_static_pack_gradients_and_errors():
    x = torch.randn(3, 5, 2, requires_grad=True)
    packed = seqpack.pack_sequences_static(x, torch.tensor([5, 0, 2]), max_tokens=12, pad_multiple=2)
    w = torch.randn(12, 2)
    (packed["input"] * w).sum().backward()
    ref = torch.zeros(3, 5, 2)
    ref[0] = w[:5]
    ref[2, :2] = w[6:8]
    assert torch.equal(x.grad, ref)
    with pytest.raises(ValueError, match="need 10 rows; max_tokens is 9"):
        seqpack.pack_sequences_static(x, [5, 0, 4], max_tokens=9, pad_multiple=2)
    # Lengths the host does not read (a device tensor, or inside torch.compile) are
    # checked by torch._assert_async: a RuntimeError on the CPU.
    compiled = torch.compile(lambda x, n: seqpack.pack_sequences_static(x, n, max_tokens=9, pad_multiple=2)["input"],
                             fullgraph=True, backend="aot_eager")
    with pytest.raises(RuntimeError, match="exceed max_tokens"):
        compiled(x.detach(), torch.tensor([5, 0, 4]))
    with pytest.raises(ValueError, match=r"seq_lens must be in \[0, S = 5\]"):
        seqpack.pack_sequences_static(x, [6, 0, 1], max_tokens=9)
    with pytest.raises(ValueError, match="max_seqs = 2 is below the batch size 3"):
        seqpack.pack_sequences_static(x, [1, 1, 1], max_tokens=9, max_seqs=2)
    with pytest.raises(ValueError, match="max_tokens must be positive"):
        seqpack.pack_sequences_static(x, [1, 1, 1], max_tokens=0)
    with pytest.raises(ValueError, match=r"pad_multiple \(2\) and max_tokens \(16\) must be multiples of 2 \* cp_size = 4"):
        seqpack.pack_sequences_static(x, [1, 1, 1], max_tokens=16, pad_multiple=2, cp_size=2)
    with pytest.raises(ValueError, match="cp_rank must be in"):
        seqpack.pack_sequences_static(x, [1, 1, 1], max_tokens=16, pad_multiple=4, cp_size=2, cp_rank=2)


def test_zero_size_trailing_dimension_round_trips():
    x = torch.zeros(2, 4, 0)
    packed = pack_sequences({"x": x}, seq_lens=[3, 1], pad_multiple=2)
    assert packed["x"].shape == (6, 0)
    assert packed.unpack(packed["x"]).shape == (2, 4, 0)


def test_torch_move_path_equals_the_kernel():
    # The PyTorch path (CUDA tensors where seqpack's kernels cannot run) on CPU
    # tensors: the same rows as the C++ executor.
    from seqpack.tensors import _ops

    x = torch.randn(3, 7, 5)
    packed = pack_sequences({"x": x}, seq_lens=[7, 2, 4], pad_multiple=4, pad_value=2.5, cp_size=2, cp_rank=1)
    runs = packed._runs()
    out = torch.empty(packed.num_tokens, 5)
    _ops._move_torch(x.contiguous(), runs[0].numpy(), out, 21, packed.num_tokens, 2.5)
    assert torch.equal(out, packed["x"])
    back = torch.empty(3, 7, 5)
    _ops._move_torch(packed["x"], runs[2].numpy(), back, packed.num_tokens, 21, -1.0)
    assert torch.equal(back, packed.unpack(packed["x"], fill=-1.0))


def test_host_to_device_segments():
    import numpy as np

    from seqpack.tensors._device import host_to_device

    arrays = [np.arange(5, dtype=np.int64), np.zeros((0, 3), np.int64), np.array([1, 2], np.int32),
              np.frombuffer(b"abc", np.uint8)]
    out = host_to_device(arrays, torch.device("cpu"))
    for a, t in zip(arrays, out):
        assert t.shape == a.shape and t.numpy().tobytes() == a.tobytes()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=6), st.sampled_from([1, 2, 4]), st.sampled_from([1, 2]),
       st.data())
def test_pack_to_layout_equals_pack_sequences_of_the_same_layout(lens, multiple, cp, data):
    multiple = multiple * 2 * cp if cp > 1 else multiple
    rank = data.draw(st.integers(0, cp - 1))
    width = max(lens) + data.draw(st.integers(0, 2))
    x = torch.randn(len(lens), width, 3)
    ref = seqpack.pack_sequences(x, seq_lens=lens, pad_multiple=multiple, pad_value=-1.0, cp_size=cp, cp_rank=rank)
    got = seqpack.pack_to_layout(x, ref.layout, pad_value=-1.0)
    assert torch.equal(got["input"], ref["input"])
    assert torch.equal(got.position_ids, ref.position_ids)
    assert torch.equal(got.unpack(got["input"]), ref.unpack(ref["input"]))


def test_pack_to_layout_errors():
    layout = seqpack.PackedLayout.from_offsets([0, 2, 5], [0, 3, 8])
    with pytest.raises(ValueError, match="the tensors hold 3 rows; the layout has 2 sequences"):
        seqpack.pack_to_layout(torch.zeros(3, 4), layout)
    with pytest.raises(TypeError, match="layout must be a PackedLayout"):
        seqpack.pack_to_layout(torch.zeros(2, 4), [0, 2, 5])
    with pytest.raises(ValueError, match="seq_lens"):  # a row narrower than its sequence
        seqpack.pack_to_layout(torch.zeros(2, 2), layout)
