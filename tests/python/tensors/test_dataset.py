"""seqpack.dataset: SFT packing into fixed-size packs, and the THD collator."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import seqpack
from seqpack import collate_packs, pack_dataset


# The NeMo AutoModel analysis' worked example (pack size 12, CP 2).
def test_seed_example_literally():
    packs = pack_dataset([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5, 6, 7, 8]}], pack_size=12, cp_size=2,
                         mask_first_label=False)
    assert len(packs) == 1
    p = packs[0]
    assert p["input_ids"].tolist() == [1, 2, 3, 0, 4, 5, 6, 7, 8, 0, 0, 0]
    assert p["labels"].tolist() == [1, 2, 3, -100, 4, 5, 6, 7, 8, -100, -100, -100]
    assert p["position_ids"].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]
    assert p["seq_lens"].tolist() == [3, 5] and p["seq_lens_padded"].tolist() == [4, 8]


def test_first_labels_masked_by_default():
    p = pack_dataset([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5, 6, 7, 8]}], pack_size=12, cp_size=2)[0]
    assert p["labels"].tolist() == [-100, 2, 3, -100, -100, 5, 6, 7, 8, -100, -100, -100]


def test_tail_padding_joins_the_last_sequence():
    packs = pack_dataset([[1, 2, 3], [4, 5]], pack_size=8)
    assert len(packs) == 1
    assert packs[0]["seq_lens_padded"].tolist() == [3, 5]
    assert packs[0]["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    assert packs.efficiency == pytest.approx(5 / 8)


def test_greedy_sequential_keeps_dataset_order():
    packs = pack_dataset([[1] * 5, [2] * 5, [3] * 2, [4] * 6], pack_size=10)
    assert [p["seq_lens"].tolist() for p in packs] == [[5, 5], [2, 6]]
    ffd = pack_dataset([[1] * 5, [2] * 5, [3] * 2, [4] * 6], pack_size=10, algorithm="first_fit_decreasing")
    assert sorted(len(p["seq_lens"]) for p in ffd) == [2, 2]


def test_too_long_policies():
    data = [{"input_ids": list(range(1, 10)), "labels": list(range(11, 20))}, {"input_ids": [7, 7]}]
    with pytest.raises(ValueError, match=r"examples\[0\] has 9 tokens, more than pack_size=8"):
        pack_dataset(data, pack_size=8)
    dropped = pack_dataset(data, pack_size=8, too_long="drop")
    assert dropped.dropped == [0] and len(dropped) == 1 and dropped[0]["seq_lens"].tolist() == [2]
    cut = pack_dataset(data, pack_size=8, too_long="truncate", mask_first_label=False)
    assert cut.truncated == [0]
    assert cut[0]["input_ids"].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert cut[0]["labels"].tolist() == [11, 12, 13, 14, 15, 16, 17, 18]
    # With CP the truncated length stays a multiple of 2 * cp_size.
    cut_cp = pack_dataset([list(range(1, 10))], pack_size=8, cp_size=2, too_long="truncate")
    assert cut_cp[0]["seq_lens"].tolist() == [8]


def test_errors():
    with pytest.raises(ValueError, match="pack_size .* multiple of pad_multiple"):
        pack_dataset([[1]], pack_size=6, cp_size=2)
    with pytest.raises(ValueError, match="algorithm must be one of"):
        pack_dataset([[1]], pack_size=8, algorithm="modified_first_fit_decreasing")
    with pytest.raises(ValueError, match="too_long must be one of"):
        pack_dataset([[1]], pack_size=8, too_long="skip")
    with pytest.raises(ValueError, match=r"examples\[1\]\['input_ids'\] must be a 1-D list"):
        pack_dataset([[1], [[1, 2]]], pack_size=8)
    with pytest.raises(ValueError, match="labels has 1 tokens, input_ids 2"):
        pack_dataset([{"input_ids": [1, 2], "labels": [1]}], pack_size=8)
    with pytest.raises(ValueError, match="pad_multiple .* 2 \\* cp_size"):
        pack_dataset([[1]], pack_size=8, cp_size=2, pad_multiple=2)


@given(
    lengths=st.lists(st.integers(0, 40), max_size=30),
    pack_size=st.sampled_from([16, 32, 48]),
    cp=st.sampled_from([1, 2]),
    algorithm=st.sampled_from(["greedy_sequential", "first_fit_decreasing", "best_fit_decreasing"]),
)
def test_every_token_kept_once(lengths, pack_size, cp, algorithm):
    examples = [{"input_ids": list(range(1000 * i + 1, 1000 * i + 1 + n))} for i, n in enumerate(lengths)]
    packs = pack_dataset(examples, pack_size=pack_size, cp_size=cp, algorithm=algorithm, too_long="drop",
                         mask_first_label=False)
    multiple = 2 * cp if cp > 1 else 1
    expected_dropped = [i for i, n in enumerate(lengths) if -(-n // multiple) * multiple > pack_size]
    assert packs.dropped == expected_dropped
    seen = []
    for p in packs:
        assert all(p[k].shape == (pack_size,) for k in ("input_ids", "labels", "position_ids"))
        assert int(p["seq_lens_padded"].sum()) == pack_size
        assert all(pl % multiple == 0 for pl in p["seq_lens_padded"][:-1].tolist())
        offset = 0
        for n, pl in zip(p["seq_lens"].tolist(), p["seq_lens_padded"].tolist()):
            seq = p["input_ids"][offset:offset + n].tolist()
            assert seq == p["labels"][offset:offset + n].tolist()
            assert (p["input_ids"][offset + n:offset + pl] == 0).all() and (p["labels"][offset + n:offset + pl] == -100).all()
            assert p["position_ids"][offset:offset + pl].tolist() == list(range(pl))
            seen.append(seq)
            offset += pl
    kept = [e["input_ids"] for i, e in enumerate(examples) if i not in expected_dropped]
    assert sorted(seen) == sorted(kept)
    if algorithm == "greedy_sequential":
        assert seen == kept


def test_collate_packs_cp_and_full():
    packs = pack_dataset([[1, 2, 3], [4, 5, 6, 7, 8], [9] * 7, [10]], pack_size=12, cp_size=2)
    full = collate_packs(packs)
    assert isinstance(full, seqpack.PackedBatch) and isinstance(full.layout, seqpack.PackedLayout)
    assert full.cu_seqlens_padded.tolist() == [0, 4, 12, 20, 24]
    assert full.cu_seqlens.tolist() == [0, 3, 8, 15, 16]
    assert full.cu_seqlens.dtype == torch.int32 and full.max_seqlen_padded == 8
    assert full.packed_seq_params().qkv_format == "thd"
    # The plan's positions are the packs' own (the tail padding continues the last sequence).
    assert torch.equal(full.position_ids, torch.from_numpy(np.concatenate([p["position_ids"] for p in packs])))
    for r in range(2):
        local = collate_packs(packs, cp_size=2, cp_rank=r)
        assert local.layout.cp_rank == r and local.num_tokens == 12
        index = torch.from_numpy(seqpack.tensors.cp.cp_partition_indices(full.cu_seqlens_padded, 2, r))
        for key in ("input_ids", "labels"):
            assert torch.equal(local[key], full[key][index])
        assert torch.equal(local.position_ids, full.position_ids[index])
    # The collated THD batch is what pack_sequences makes from the padded rows.
    ids = torch.zeros(4, 8, dtype=torch.int64)
    for b, seq in enumerate([[1, 2, 3], [4, 5, 6, 7, 8], [9] * 7, [10]]):
        ids[b, :len(seq)] = torch.tensor(seq)
    packed = seqpack.pack_sequences(ids, seq_lens=[3, 5, 7, 1], pad_multiple=4)
    # Pack 0 is [3->4, 5->8]; pack 1 [7->8, 1->4]: the same per-sequence padding.
    assert torch.equal(packed["input"], full["input_ids"])
    assert torch.equal(packed.position_ids, full.position_ids)
    # ...and it unpacks to the padded rows.
    assert torch.equal(full.unpack(full["input_ids"]), ids[:, :7])


def test_collate_packs_rejects_inconsistent_packs():
    packs = pack_dataset([[1, 2, 3], [4, 5]], pack_size=8)
    packs[0]["seq_lens_padded"] = np.array([2, 6])
    with pytest.raises(ValueError, match="sequence 0 has 3 real tokens but a padded length of 2"):
        collate_packs(packs)


def test_progress_bar_runs(capsys):
    packs = pack_dataset(({"input_ids": [1] * (i % 7 + 1)} for i in range(200)), pack_size=16, progress=True)
    assert len(packs) > 0 and "seqpack: packing" in capsys.readouterr().err
    assert "packs of 16 tokens from 200 examples" in repr(packs)
