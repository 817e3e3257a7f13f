"""NeMo-RL compatibility: what NeMo-RL's own unit tests of ``BatchedDataDict`` and of
the packing algorithms expect, checked on seqpack (issue 17).

NeMo-RL is not installed here, so its multimodal ``PackedTensor`` is played by two
stand-ins written for these tests: :class:`OldPacked` behaves as NeMo-RL v0.6's (one
segment per row; it cannot be built from an empty list), :class:`MediaRows` as the
current one (rows mapped onto physical segments, provenance-based deduplication,
``empty_rows_like``). seqpack duck-types both. Vectors marked "NeMo-RL's" are the
inputs and expected results of NeMo-RL's tests or docstrings.
"""

from __future__ import annotations

import copy
import itertools
import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from seqpack import BatchedDataDict, SequencePackingArgs, get_packer  # noqa: E402
from seqpack.planning.packing import (BestFitDecreasingPacker, ConcatenativePacker,  # noqa: E402
                                      FirstFitDecreasingPacker, FirstFitPacker, FirstFitShufflePacker,
                                      GreedySequentialPacker, ModifiedFirstFitDecreasingPacker, PackingAlgorithm,
                                      SequencePacker)

# ---------------------------------------------------------------- PackedTensor stand-ins

_provenance = itertools.count()


class OldPacked:
    """NeMo-RL v0.6's ``PackedTensor`` as seqpack uses it."""

    def __init__(self, tensors, dim_to_pack=0):
        tensors = [tensors] if torch.is_tensor(tensors) else list(tensors)
        if not tensors:
            raise AssertionError("Input tensors to PackedTensor must be a non-empty list")
        self.tensors, self.dim_to_pack = tensors, dim_to_pack

    def __len__(self):
        return len(self.tensors)

    def slice(self, indices):
        indices = indices.tolist() if torch.is_tensor(indices) else indices
        return type(self)([self.tensors[i] for i in indices], self.dim_to_pack)

    @classmethod
    def concat(cls, parts):
        return cls([t for p in parts for t in p.tensors], parts[0].dim_to_pack)

    @classmethod
    def empty_like(cls, other):
        return cls([None] * len(other), other.dim_to_pack)

    def as_tensor(self, device=None):
        present = [t for t in self.tensors if t is not None]
        return torch.cat(present, self.dim_to_pack).to(device) if present else None

    def to(self, device):
        self.tensors = [t if t is None else t.to(device) for t in self.tensors]
        return self


class MediaRows:
    """NeMo-RL's current ``PackedTensor``, reduced to what seqpack relies on.

    ``rows`` (``None``: one segment per row, the plain form) lists each logical
    row's physical segments; ``ids`` (``None``: deduplication off) gives each
    segment a provenance kept across ``deepcopy``, by which ``slice``/``concat``
    store a shared segment once."""

    def __init__(self, tensors, dim_to_pack=0, *, rows=None, ids=None):
        tensors = [tensors] if torch.is_tensor(tensors) else list(tensors)
        if not tensors and rows is None:
            raise AssertionError("Input tensors to PackedTensor must be a non-empty list")
        self.tensors, self.dim_to_pack, self.rows, self.ids = tensors, dim_to_pack, rows, ids

    @property
    def deduplication_enabled(self):
        return self.ids is not None

    @property
    def _row_offsets(self):
        return None if self.rows is None else np.cumsum([0] + [len(r) for r in self.rows]).tolist()

    def enable_deduplication(self):
        if self.ids is None:
            self.ids = [next(_provenance) for _ in self.tensors]
        return self

    def _segments_of(self, row):
        return [row] if self.rows is None else self.rows[row]

    def __len__(self):
        return len(self.tensors) if self.rows is None else len(self.rows)

    def logical_segment_counts_by_row(self):
        return [sum(self.tensors[s] is not None for s in self._segments_of(r)) for r in range(len(self))]

    @classmethod
    def _gather(cls, parts, selections):
        dedup = any(p.ids is not None for p in parts)
        tensors, ids, rows, stored = [], [], [], {}
        for part, selection in zip(parts, selections):
            local = {}
            for r in selection:
                for s in part._segments_of(r):
                    if s in local:
                        continue
                    key = part.ids[s] if part.ids is not None else next(_provenance)
                    if key not in stored:
                        stored[key] = len(tensors)
                        tensors.append(part.tensors[s])
                        ids.append(key)
                    local[s] = stored[key]
                rows.append([local[s] for s in part._segments_of(r)])
        return cls(tensors, parts[0].dim_to_pack, rows=rows, ids=ids if dedup else None)

    def slice(self, indices):
        indices = list(indices.tolist() if torch.is_tensor(indices) else indices)
        if self.rows is None and self.ids is None:
            return MediaRows([self.tensors[i] for i in indices], self.dim_to_pack)
        return MediaRows._gather([self], [indices])

    @classmethod
    def concat(cls, parts):
        if all(p.rows is None and p.ids is None for p in parts):
            return cls([t for p in parts for t in p.tensors], parts[0].dim_to_pack)
        return cls._gather(parts, [range(len(p)) for p in parts])

    @classmethod
    def merge_segments(cls, parts):
        merged = cls.concat(parts)
        return cls(merged.tensors, merged.dim_to_pack, rows=[[s for r in merged.rows for s in r]], ids=merged.ids)

    @classmethod
    def empty_rows_like(cls, other, num_rows):
        if other.rows is None and other.ids is None:
            return cls([None] * num_rows, other.dim_to_pack) if num_rows else cls([], other.dim_to_pack, rows=[])
        return cls([], other.dim_to_pack, rows=[[] for _ in range(num_rows)], ids=[])

    @classmethod
    def empty_like(cls, other):
        return cls.empty_rows_like(other, len(other))

    def as_tensor(self, device=None):
        segments = self.tensors if self.rows is None else [self.tensors[s] for r in self.rows for s in r]
        present = [t for t in segments if t is not None]
        return torch.cat(present, self.dim_to_pack).to(device) if present else None

    def to(self, device):
        self.tensors = [t if t is None else t.to(device) for t in self.tensors]
        return self

    def __deepcopy__(self, memo):
        tensors = list(self.tensors) if self.ids is not None else [copy.deepcopy(t, memo) for t in self.tensors]
        out = MediaRows(tensors, self.dim_to_pack, rows=copy.deepcopy(self.rows),
                        ids=None if self.ids is None else list(self.ids))
        memo[id(self)] = out
        return out


# ---------------------------------------------------------------- shard_by_batch_size: empty shards


@pytest.mark.parametrize("packed_type", [OldPacked, MediaRows])
def test_uneven_shards_past_the_last_row_keep_every_key_empty(packed_type):
    images = packed_type([torch.randn(2, 3, 4, 4), torch.randn(1, 3, 4, 4)])
    batch = BatchedDataDict(input_ids=torch.tensor([[1, 2, 3], [4, 5, 6]]), pixel_values=images, labels=[0, 1])

    shards = batch.shard_by_batch_size(shards=4, allow_uneven_shards=True)  # 2 rows, 4 shards: two empty

    assert [s.size for s in shards] == [1, 1, 0, 0]
    for empty in shards[2:]:
        assert list(empty) == list(batch)
        assert empty["input_ids"].shape == (0, 3)
        assert type(empty["pixel_values"]) is packed_type
        assert len(empty["pixel_values"]) == 0 and empty["pixel_values"].as_tensor() is None
        assert empty["labels"] == []
    rebuilt = BatchedDataDict.from_batches(shards)  # the empty values concatenate
    assert torch.equal(rebuilt["pixel_values"].as_tensor(), images.as_tensor())
    assert torch.equal(rebuilt["input_ids"], batch["input_ids"]) and rebuilt["labels"] == [0, 1]
    assert len(batch.select_indices([])["pixel_values"]) == 0


def test_uneven_shards_of_deduplicated_media_are_empty_row_maps():
    media = MediaRows(torch.ones(1, 2)).enable_deduplication()
    batch = BatchedDataDict(pixel_values=MediaRows.concat([media] * 2), input_ids=torch.arange(4).reshape(2, 2))
    empty = batch.shard_by_batch_size(shards=3, allow_uneven_shards=True)[2]
    assert len(empty["pixel_values"]) == 0 and empty["pixel_values"].deduplication_enabled


# ---------------------------------------------------------------- from_batches


def test_from_batches_with_missing_packed_tensors_rejects_inconsistent_row_counts():
    # NeMo-RL's vector: one media row beside two token rows.
    batch = BatchedDataDict(pixel_values=MediaRows(torch.tensor([[1.0]])).enable_deduplication(),
                            input_ids=torch.tensor([[1, 2], [3, 4]]))
    with pytest.raises(ValueError, match="inconsistent logical row counts"):
        BatchedDataDict.from_batches([batch], allow_missing_packed_tensors=True)
    ok = BatchedDataDict(input_ids=torch.tensor([[5, 6]]))
    with pytest.raises(ValueError, match=r"Source batch 1 has inconsistent logical row counts: \[1, 2\]"):
        BatchedDataDict.from_batches([ok, batch], allow_missing_packed_tensors=True)


def test_from_batches_without_the_flag_sizes_a_batch_by_its_first_value():
    class Unsized:  # NeMo-RL's vector: the flag-off path never asks a later value its length
        def __len__(self):
            raise AssertionError("flag-off batch sizing must not scan metadata")

    batches = [{"tokens": torch.tensor([[1], [2]]), "metadata": Unsized()},
               {"tokens": torch.tensor([[3]]), "metadata": Unsized(), "extra": torch.tensor([1])}]
    with pytest.raises(KeyError, match="'extra'"):
        BatchedDataDict.from_batches(batches)


def test_from_batches_fills_missing_media_keys_with_empty_rows():
    # NeMo-RL's vector: an image batch (two rows sharing one image) and an audio batch.
    shared = MediaRows(torch.tensor([[1.0]])).enable_deduplication()
    sizes = MediaRows([torch.tensor([[10, 20]]), torch.tensor([[30, 40]])]).enable_deduplication()
    visual = BatchedDataDict(input_ids=torch.tensor([[1, 2], [3, 4]]), pixel_values=MediaRows.concat([shared] * 2),
                             imgs_sizes=sizes)
    audio = BatchedDataDict(input_ids=torch.tensor([[5, 6]]),
                            audio_values=MediaRows(torch.tensor([[5.0]])).enable_deduplication())

    stacked = BatchedDataDict.from_batches([visual, audio], allow_missing_packed_tensors=True)

    assert stacked.size == 3
    assert [len(stacked[k]) for k in ("pixel_values", "imgs_sizes", "audio_values")] == [3, 3, 3]
    assert len(stacked["pixel_values"].tensors) == 1 and len(stacked["imgs_sizes"].tensors) == 2
    assert stacked["pixel_values"].slice([2]).as_tensor() is None
    assert stacked["audio_values"].slice([0, 1]).as_tensor() is None
    assert torch.equal(stacked["audio_values"].slice([2]).as_tensor(), torch.tensor([[5.0]]))
    with pytest.raises(KeyError, match="non-empty batches"):
        BatchedDataDict.from_batches([visual, audio])  # without the flag a missing key stays an error


# ---------------------------------------------------------------- get_multimodal_dict


def test_get_multimodal_dict_checks_coupled_media_segment_counts_per_row():
    # NeMo-RL's vector: two images with their sizes, then sizes whose two segments
    # are both on row 0 (the same total, a different order).
    pixels = MediaRows([torch.tensor([[1.0]]), torch.tensor([[2.0]])]).enable_deduplication()
    sizes = MediaRows([torch.tensor([[10, 20]]), torch.tensor([[30, 40]])]).enable_deduplication()
    valid = BatchedDataDict(pixel_values=pixels, imgs_sizes=sizes).get_multimodal_dict(as_tensors=True)
    assert torch.equal(valid["pixel_values"], torch.tensor([[1.0], [2.0]]))
    assert torch.equal(valid["imgs_sizes"], torch.tensor([[10, 20], [30, 40]]))

    both_on_row_0 = MediaRows.merge_segments([MediaRows(torch.tensor([[10, 20]])).enable_deduplication(),
                                              MediaRows(torch.tensor([[30, 40]])).enable_deduplication()])
    misplaced = MediaRows.concat([both_on_row_0, MediaRows.empty_rows_like(both_on_row_0, 1)])
    invalid = BatchedDataDict(pixel_values=pixels, imgs_sizes=misplaced)
    with pytest.raises(ValueError, match=r"ordered per-row segment counts.*\[1, 1\].*\[2, 0\]"):
        invalid.get_multimodal_dict(as_tensors=True)
    assert invalid.get_multimodal_dict()["imgs_sizes"] is misplaced  # checked only when materialised

    for value_key, meta_key in (("pixel_values", "image_grid_thw"), ("pixel_values", "num_frames"),
                                ("pixel_values_videos", "video_grid_thw")):
        with pytest.raises(ValueError, match="ordered per-row segment counts"):
            BatchedDataDict({value_key: pixels, meta_key: misplaced}).get_multimodal_dict(as_tensors=True)


@pytest.mark.parametrize("packed_type", [OldPacked, MediaRows])
def test_get_multimodal_dict_does_not_scan_plain_media(packed_type):
    # NeMo-RL's vector: plain values have no row map to validate (NeMo-RL skips them).
    plain = BatchedDataDict(pixel_values=packed_type([torch.tensor([[1.0]]), torch.tensor([[2.0]])]),
                            imgs_sizes=packed_type(torch.tensor([[10, 20]])))
    out = plain.get_multimodal_dict(as_tensors=True)
    assert torch.equal(out["pixel_values"], torch.tensor([[1.0], [2.0]]))
    assert torch.equal(out["imgs_sizes"], torch.tensor([[10, 20]]))


# ---------------------------------------------------------------- repeat_interleave


def test_repeat_interleave_shares_media_not_token_ids():
    media = MediaRows(torch.ones(1, 3, 2, 2))
    batch = BatchedDataDict(message_log=[[{"role": "user", "content": "look", "token_ids": torch.tensor([1, 2]),
                                           "pixel_values": media}]])

    off = batch.repeat_interleave(2)  # NeMo-RL's vector, flag off: nothing shared, nothing flagged
    off_media = [off["message_log"][r][0]["pixel_values"] for r in (0, 1)]
    assert not off_media[0].deduplication_enabled and off_media[0].tensors[0] is not off_media[1].tensors[0]

    on = batch.repeat_interleave(2, share_immutable_media=True)
    first, second = on["message_log"][0][0], on["message_log"][1][0]
    assert first["pixel_values"].deduplication_enabled  # flagged, as NeMo-RL does
    assert first["pixel_values"] is not second["pixel_values"]
    assert first["pixel_values"].tensors[0] is second["pixel_values"].tensors[0]
    assert on["message_log"][0] is not on["message_log"][1] and first is not second
    assert first["token_ids"] is not second["token_ids"]  # token ids are not media
    first["token_ids"][0] = 99
    assert second["token_ids"].tolist() == [1, 2] and batch["message_log"][0][0]["token_ids"].tolist() == [1, 2]


def test_repeat_interleave_shares_native_and_typed_media_leaves():
    image, video, audio = torch.ones(1, 2), np.ones((2, 2), np.float32), np.ones(16, np.float32)
    pixels = torch.zeros(2, 2)
    batch = BatchedDataDict(
        vllm_images=[[image]], vllm_videos=[[video]], vllm_audios=[[(audio, 16_000)]],  # NeMo-RL's vector
        message_log=[[{"content": [{"type": "image", "image": pixels}, {"type": "text", "text": "hi"}],
                       "token_ids": torch.tensor([3])}]],
        frames=[{"array": video}])

    off = batch.repeat_interleave(2)
    assert off["vllm_images"][0][0] is not off["vllm_images"][1][0]
    assert off["vllm_audios"][0][0][0] is not off["vllm_audios"][1][0][0]

    on = batch.repeat_interleave(2, share_immutable_media=True)
    assert on["vllm_images"][0] is not on["vllm_images"][1]
    assert on["vllm_images"][0][0] is on["vllm_images"][1][0] is image
    assert on["vllm_videos"][0][0] is on["vllm_videos"][1][0]
    assert on["vllm_audios"][0][0][0] is on["vllm_audios"][1][0][0]
    parts = [on["message_log"][r][0]["content"] for r in (0, 1)]
    assert parts[0][0]["image"] is parts[1][0]["image"] and parts[0][0] is not parts[1][0]
    assert on["message_log"][0][0]["token_ids"] is not on["message_log"][1][0]["token_ids"]
    assert on["frames"][0]["array"] is not on["frames"][1]["array"]  # not a media key ...
    named = batch.repeat_interleave(2, share_immutable_media=True, media_keys=["frames"])
    assert named["frames"][0]["array"] is named["frames"][1]["array"]  # ... unless named


def test_repeat_interleave_shares_an_older_packed_tensors_segments():
    batch = BatchedDataDict(message_log=[[{"pixel_values": OldPacked(torch.ones(1, 2))}]])
    on = batch.repeat_interleave(3, share_immutable_media=True)
    segments = [on["message_log"][r][0]["pixel_values"].tensors[0] for r in range(3)]
    assert all(s is segments[0] for s in segments)
    off = batch.repeat_interleave(2)
    off_media = [off["message_log"][r][0]["pixel_values"] for r in (0, 1)]
    assert off_media[0].tensors[0] is not off_media[1].tensors[0]


@pytest.mark.parametrize("share", [False, True])
def test_repeat_interleave_refuses_a_top_level_packed_tensor(share):
    with pytest.raises(NotImplementedError, match="PackedTensor does not currently support repeat_interleave"):
        BatchedDataDict(pixel_values=MediaRows(torch.ones(1, 2))).repeat_interleave(2, share_immutable_media=share)


# ---------------------------------------------------------------- deduplicated media through sharding (NeMo-RL's)


def test_shards_store_a_shared_segment_once():
    media = MediaRows(torch.ones(1, 2)).enable_deduplication()
    batch = BatchedDataDict(input_ids=torch.arange(8).reshape(4, 2), input_lengths=torch.tensor([2, 2, 2, 2]),
                            pixel_values=MediaRows.concat([media] * 4))
    shards = batch.shard_by_batch_size(shards=2)
    assert [len(s["pixel_values"]) for s in shards] == [2, 2]
    assert [len(s["pixel_values"].tensors) for s in shards] == [1, 1]

    batch = BatchedDataDict(input_ids=torch.arange(96).reshape(8, 12),
                            input_lengths=torch.tensor([5, 6, 7, 8, 9, 10, 11, 12]),
                            pixel_values=MediaRows.concat([media] * 8))
    args = SequencePackingArgs(max_tokens_per_microbatch=24, input_key="input_ids", input_lengths_key="input_lengths",
                               algorithm="modified_first_fit_decreasing", sequence_length_pad_multiple=4)
    shards, _ = batch.shard_by_batch_size(shards=2, sequence_packing_args=args)
    assert sum(len(s["pixel_values"]) for s in shards) == 8
    assert [len(s["pixel_values"].tensors) for s in shards] == [1, 1]
    for s in shards:
        assert torch.equal(s["pixel_values"].as_tensor(), torch.ones(len(s["pixel_values"]), 2))


def test_deduplicated_media_through_chunk_reorder_select_and_size():
    one = MediaRows(torch.tensor([[1.0]])).enable_deduplication()
    two = MediaRows(torch.tensor([[2.0]])).enable_deduplication()
    batch = BatchedDataDict(pixel_values=MediaRows.concat([MediaRows.concat([one] * 2), MediaRows.concat([two] * 2)]),
                            input_ids=torch.arange(8).reshape(4, 2))
    assert batch.size == 4  # a PackedTensor first: its logical rows
    first = batch.chunk(rank=0, chunks=2)
    assert len(first["pixel_values"].tensors) == 1
    assert torch.equal(first["pixel_values"].as_tensor(), torch.tensor([[1.0], [1.0]]))
    batch.reorder_data([3, 2, 1, 0])
    assert torch.equal(batch["pixel_values"].as_tensor(), torch.tensor([[2.0], [2.0], [1.0], [1.0]]))
    picked = batch.select_indices([0, 3])
    assert len(picked["pixel_values"].tensors) == 2
    assert torch.equal(picked["pixel_values"].as_tensor(), torch.tensor([[2.0], [1.0]]))


# ---------------------------------------------------------------- packer classes under NeMo-RL's names

NAMED = [(ConcatenativePacker, PackingAlgorithm.CONCATENATIVE),
         (FirstFitDecreasingPacker, PackingAlgorithm.FIRST_FIT_DECREASING),
         (FirstFitShufflePacker, PackingAlgorithm.FIRST_FIT_SHUFFLE),
         (ModifiedFirstFitDecreasingPacker, PackingAlgorithm.MODIFIED_FIRST_FIT_DECREASING),
         (BestFitDecreasingPacker, PackingAlgorithm.BEST_FIT_DECREASING),
         (GreedySequentialPacker, PackingAlgorithm.GREEDY_SEQUENTIAL)]


@pytest.mark.parametrize("cls, algorithm", NAMED)
def test_packer_classes_take_nemo_rl_constructor_arguments(cls, algorithm):
    packer = cls(100, True, 2, 4)  # bin_capacity, collect_metrics, min_bin_count, bin_count_multiple
    assert (packer.bin_capacity, packer.collect_metrics, packer.min_bin_count, packer.bin_count_multiple) == (100, True,
                                                                                                            2, 4)
    assert packer.algorithm is algorithm and isinstance(packer, SequencePacker)
    assert type(get_packer(algorithm, 100)) is cls and type(get_packer(algorithm.name, 100)) is cls
    keywords = cls(bin_capacity=50, min_bin_count=None, bin_count_multiple=None)
    assert keywords.metrics is None and keywords.get_aggregated_metrics() == {}
    bins = packer.pack([30, 20, 60, 10, 40, 50, 70, 90])
    assert len(bins) % 4 == 0 and sorted(i for b in bins for i in b) == list(range(8))
    assert packer.get_aggregated_metrics()["total_sequences"] == 8
    with pytest.raises(ValueError):
        cls(100, min_bin_count=-1)
    with pytest.raises(ValueError):
        cls(100, bin_count_multiple=0)


def test_first_fit_classes_share_nemo_rl_base():
    assert issubclass(FirstFitDecreasingPacker, FirstFitPacker) and issubclass(FirstFitShufflePacker, FirstFitPacker)
    assert not issubclass(ModifiedFirstFitDecreasingPacker, FirstFitPacker)


def test_nemo_rl_packer_vectors():
    # NeMo-RL's: MFFD keeps equal-cost items in source order.
    assert ModifiedFirstFitDecreasingPacker(10).pack([6, 6, 3, 3, 1, 1]) == [[0, 2, 4], [1, 3, 5]]
    # NeMo-RL's ConcatenativePacker docstring: capacity 5 and 8.
    assert ConcatenativePacker(5).pack([4, 1, 3, 2, 1, 3, 4, 5]) == [[0, 1], [2, 3], [4, 5], [6], [7]]
    assert ConcatenativePacker(8).pack([4, 1, 3, 2, 1, 3, 4, 5]) == [[0, 1, 2], [3, 4, 5], [6], [7]]
    # NeMo-RL's: too few sequences for the bin count.
    for kwargs, count in (({"min_bin_count": 3}, 3), ({"bin_count_multiple": 4}, 4)):
        with pytest.raises(ValueError, match=f"Cannot create {count} bins with only 2 sequences"):
            ConcatenativePacker(100, **kwargs).pack([50, 50])
    # NeMo-RL's: a sequence over the capacity is an error (seqpack's cap is hard).
    for cls, _ in NAMED:
        with pytest.raises(ValueError, match="exceeds"):
            cls(100).pack([50, 150, 70])
        assert cls(100).pack([]) == []


@pytest.mark.parametrize("cls, algorithm", NAMED)
def test_pack_is_pack_implementation_then_adjust_bin_count(cls, algorithm):
    rng = random.Random(7)
    for _ in range(20):
        lengths = [rng.randint(1, 90) for _ in range(rng.randint(24, 60))]
        natural = cls(100, seed=3)._pack_implementation(lengths)
        assert natural == cls(100, seed=3).pack(lengths)  # the natural bins: no bin-count rule
        packer = cls(100, min_bin_count=rng.randint(0, 12), bin_count_multiple=rng.choice([1, 2, 4, 8]), seed=3)
        assert packer.pack(lengths) == packer._adjust_bin_count(natural)


def test_a_nemo_rl_style_subclass_runs_its_own_implementation():
    class Singletons(SequencePacker):  # a custom packer, as written against NeMo-RL's base
        def _pack_implementation(self, sequence_lengths):
            self._validate_sequence_lengths(sequence_lengths)
            return [[i] for i in range(len(sequence_lengths))]

    packer = Singletons(100, collect_metrics=True, bin_count_multiple=4)
    assert packer.pack(np.array([10, 20, 30, 40])) == [[0], [1], [2], [3]]
    offsets, indices = packer.pack_arrays([5, 6, 7, 8])
    assert offsets.tolist() == [0, 1, 2, 3, 4] and indices.tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="Cannot create 4 bins with only 3 sequences"):
        packer.pack([1, 2, 3])
    with pytest.raises(ValueError, match="Sequence length 150 exceeds bin capacity 100"):
        packer.pack([150])
    assert packer.get_aggregated_metrics()["total_sequences"] > 0
    assert packer._estimate_bins_needed([60, 60, 60]) == 2 and packer._estimate_bins_needed([]) == 1
    assert packer._create_indexed_lengths([5, 9, 5], reverse=True) == [(9, 1), (5, 2), (5, 0)]

    with pytest.raises(NotImplementedError, match="_pack_implementation"):
        SequencePacker(100).pack([1, 2])
    assert SequencePacker(10, algorithm="first_fit_decreasing").pack([6, 5, 4, 3]) == [[0, 2], [1, 3]]


def test_a_first_fit_subclass_runs_first_fit_over_its_order():
    class Ascending(FirstFitPacker):
        def _prepare_sequences(self, sequence_lengths):
            return sorted(self._create_indexed_lengths(sequence_lengths))

    assert Ascending(100).pack([60, 30, 50, 40]) == [[1, 3], [2], [0]]
    assert Ascending(100, min_bin_count=4).pack([60, 30, 50, 40]) == [[1], [2], [0], [3]]

    class LongestLast(FirstFitDecreasingPacker):  # overriding a built-in order takes effect too
        def _prepare_sequences(self, sequence_lengths):
            return list(reversed(super()._prepare_sequences(sequence_lengths)))

    assert LongestLast(100).pack([60, 30, 50, 40]) == Ascending(100).pack([60, 30, 50, 40])
    # NeMo-RL's FFD order: longest first, the higher index first among equals.
    assert FirstFitDecreasingPacker(8)._prepare_sequences([3, 5, 3]) == [(5, 1), (3, 2), (3, 0)]
    assert sorted(FirstFitShufflePacker(8, seed=1)._prepare_sequences([3, 5, 3])) == [(3, 0), (3, 2), (5, 1)]


def test_concatenative_max_sequences_per_bin():
    packer = ConcatenativePacker(8)
    packer.max_sequences_per_bin = 2
    assert packer.pack([4, 1, 3, 2, 1, 3, 4, 5]) == [[0, 1], [2, 3], [4, 5], [6], [7]]
    assert ConcatenativePacker(8).pack([4, 1, 3, 2, 1, 3, 4, 5]) == [[0, 1, 2], [3, 4, 5], [6], [7]]  # class default


def test_the_algorithm_is_not_a_positional_argument():
    with pytest.raises(TypeError, match="get_packer"):
        SequencePacker(PackingAlgorithm.FIRST_FIT_DECREASING, 100)
    with pytest.raises(ValueError, match="runs 'concatenative'"):
        ConcatenativePacker(100, algorithm="first_fit_decreasing")
