"""PackedLayout: one validating constructor, the alignment rules, the offsets rule."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import seqpack
from seqpack.tensors.layout import PackedLayout, alignment, check_offsets, round_up


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 50), max_size=20), st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 3]),
       st.data())
def test_from_lengths_matches_its_definition_and_round_trips(lens, multiple, cp, data):
    multiple = multiple * 2 * cp if cp > 1 else multiple
    rank = data.draw(st.integers(0, cp - 1))
    layout = PackedLayout.from_lengths(lens, pad_multiple=multiple, cp_size=cp, cp_rank=rank)
    padded = [round_up(n, multiple) for n in lens]
    assert layout.seq_lens.tolist() == lens and layout.padded_lens.tolist() == padded
    assert layout.cu_seqlens.tolist() == np.concatenate([[0], np.cumsum(lens)]).tolist()
    assert layout.num_tokens == sum(padded) and layout.local_tokens * cp == sum(padded)
    assert layout.max_seqlen == max(lens, default=0) and layout.max_seqlen_padded == max(padded, default=0)
    again = PackedLayout.from_offsets(layout.cu_seqlens, layout.cu_seqlens_padded, cp_size=cp, cp_rank=rank)
    assert again.cu_seqlens_padded.tolist() == layout.cu_seqlens_padded.tolist()
    assert layout.for_rank(0).cp_rank == 0
    with pytest.raises(ValueError):
        layout.cu_seqlens[0] = 1  # read-only


def test_constructor_rejects_every_broken_rule():
    for cu, padded, cp, message in [
        ([0, 3], [0, 2], 1, "sequence 0 has 3 real tokens but a padded length of 2"),
        ([0, 3], [0, 4, 8], 1, "cu_seqlens has 2 entries, cu_seqlens_padded 3"),
        ([0, 3], [0, 6], 2, "not a multiple of 2 \\* cp_size = 4"),
        ([1, 3], [0, 4], 1, "cu_seqlens must start at 0"),
        ([0, 3, 2], [0, 4, 8], 1, "never decrease"),
        ([0, 2**31], [0, 2**31], 1, "fit in int32"),
    ]:
        with pytest.raises(ValueError, match=message):
            PackedLayout.from_offsets(cu, padded, cp_size=cp)
    with pytest.raises(ValueError, match="cp_rank must be an int in \\[0, cp_size=2\\)"):
        PackedLayout.from_offsets([0, 4], cp_size=2, cp_rank=2)
    with pytest.raises(TypeError, match="cu_seqlens must hold integers"):
        PackedLayout.from_offsets([0.0, 4.0])


def test_alignment_rules():
    assert alignment() == 1
    assert alignment(cp_size=2) == 4 and alignment(cp_size=2, tp_size=4) == 4
    assert alignment(cp_size=2, tp_size=4, sequence_parallel=True) == 16
    assert alignment(tp_size=4, rule="roll") == 4 and alignment(cp_size=2, tp_size=4, rule="roll") == 16
    with pytest.raises(ValueError, match="rule must be one of megatron, roll"):
        alignment(rule="verl")
    with pytest.raises(ValueError, match="cp_size must be positive"):
        alignment(cp_size=0)


def test_one_offsets_rule_for_every_form():
    torch = pytest.importorskip("torch")
    for form in ([0, 3, 8], (0, 3, 8), np.array([0, 3, 8], np.int32), np.array([0, 3, 8]),
                 torch.tensor([0, 3, 8]), torch.tensor([0, 3, 8], dtype=torch.int32)):
        assert check_offsets(form).tolist() == [0, 3, 8]
    with pytest.raises(ValueError, match="at least one offset"):
        check_offsets([])
    with pytest.raises(ValueError, match="must be 1-D"):
        check_offsets(np.zeros((2, 2), np.int64))


def test_packed_batch_holds_its_layout_and_layouts_are_accepted_in_place_of_offsets():
    torch = pytest.importorskip("torch")
    from seqpack.training.logprobs import packed_token_logprobs  # the offsets form, under the op

    ids = torch.tensor([[5, 6, 0, 0], [7, 8, 9, 0]])
    batch = seqpack.pack_sequences(ids, seq_lens=[2, 3], pad_multiple=2)
    assert batch.layout.cu_seqlens_padded.tolist() == batch.cu_seqlens_padded.tolist() == [0, 2, 6]
    params = batch.layout.packed_seq_params()
    assert params.qkv_format == "thd" and params.max_seqlen_q == 4
    logits = torch.randn(6, 11)
    by_layout = seqpack.token_logprobs(logits, batch.layout, batch["input"]).logprobs
    by_batch = seqpack.token_logprobs(logits, batch, batch["input"]).logprobs
    by_offsets = packed_token_logprobs(logits, batch["input"], batch.cu_seqlens, batch.cu_seqlens_padded)
    assert torch.equal(by_layout, by_offsets.logprobs) and torch.equal(by_batch, by_layout)
    with pytest.raises(ValueError, match="logits has 5 rows; the packed layout has 6"):
        seqpack.token_logprobs(logits[:5], batch.layout, batch["input"])
    wrapper = seqpack.SequencePackingLossWrapper(seqpack.NLLLoss(), None, batch.layout)
    assert wrapper.cu_padded.tolist() == [0, 2, 6]
