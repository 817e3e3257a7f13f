"""seqpack.roll against ROLL's own data type and call patterns (issue 17).

ROLL's ``DataProto`` is stood in for by a small double with its attributes
(``batch`` tensors, ``non_tensor_batch`` NumPy object arrays, ``meta_info``) and
the methods ROLL's batching code calls (``select_idxs``, ``slice``, ``reorder``,
``chunk``, ``concat``, ``from_dict``, indexing). Its ``batch`` is a dict, a
TensorDict-like double (not a mapping; iterating it is an error, as iterating a
TensorDict walks rows) or, when ``tensordict`` is installed, a real TensorDict.
The vectors (lengths, caps, expected ranges) are those of ROLL's unit tests
(``tests/utils/test_dynamic_batching.py``, ``tests/utils/test_sequence_packing.py``).
"""

from __future__ import annotations

import datetime
import traceback

import numpy as np
import pytest
import torch
import torch.distributed as dist

from seqpack import roll
from seqpack.frameworks._batch import is_data_proto, proto_columns, proto_select

try:  # pragma: no cover - not installed in the test environment
    from tensordict import TensorDict
except ImportError:  # pragma: no cover
    TensorDict = None


# ---------------------------------------------------------------- test doubles


class TensorDictDouble:
    """Enough of a TensorDict: keys()/items()/[key], row indexing, batch_size. Not a
    Mapping, and ``len()``/iteration are about rows, as TensorDict's are."""

    def __init__(self, source, batch_size):
        self._data = dict(source)
        self.batch_size = torch.Size(batch_size)

    def keys(self):
        return self._data.keys()

    def items(self):
        return self._data.items()

    def __contains__(self, key):
        return key in self._data

    def __len__(self):
        return self.batch_size[0]

    def __iter__(self):
        raise TypeError("iterating a TensorDict walks its rows: use keys()")

    def __getitem__(self, item):
        if isinstance(item, str):
            return self._data[item]
        rows = torch.arange(self.batch_size[0])[item]
        return TensorDictDouble({k: v[item] for k, v in self._data.items()}, (rows.numel(),))

    def __setitem__(self, key, value):
        self._data[key] = value


def make_tensors(tensors, rows, kind):
    if kind == "dict":
        return dict(tensors)
    if kind == "tensordict":
        return TensorDict(source=dict(tensors), batch_size=(rows,))
    return TensorDictDouble(tensors, (rows,))


class DataProto:
    """ROLL's DataProto, as far as its batching code uses it: ``slice``/``select_idxs``
    share ``meta_info`` with the parent (ROLL's do), ``__getitem__`` with an int
    never raises ``IndexError`` (ROLL's does not), so ``"key" in proto`` would loop
    forever: ``__iter__`` raises instead, failing any code that tries."""

    kind = "dict"

    def __init__(self, batch=None, non_tensor_batch=None, meta_info=None):
        self.batch = batch
        self.non_tensor_batch = non_tensor_batch if non_tensor_batch is not None else {}
        self.meta_info = meta_info if meta_info is not None else {}

    @classmethod
    def from_dict(cls, tensors, non_tensors=None, meta_info=None):
        rows = next(iter(tensors.values())).shape[0]
        non_tensors = {k: np.array(list(v), dtype=object) for k, v in (non_tensors or {}).items()}
        return cls(batch=make_tensors(tensors, rows, cls.kind), non_tensor_batch=non_tensors, meta_info=meta_info)

    def __len__(self):
        if self.batch is not None:
            return int(next(iter(self.batch.items()))[1].shape[0])
        return len(next(iter(self.non_tensor_batch.values()))) if self.non_tensor_batch else 0

    def __iter__(self):
        raise TypeError("DataProto is not iterable (ROLL's loops forever on `in`)")

    def __getitem__(self, item):
        if isinstance(item, slice):
            return self.slice(item.start, item.stop, item.step)
        if isinstance(item, (list, np.ndarray, torch.Tensor)):
            return self.select_idxs(item)
        if isinstance(item, (int, np.integer)):
            return self.slice(item, item + 1)
        if isinstance(item, str):
            return self.batch[item] if item in self.batch.keys() else self.non_tensor_batch[item]
        raise TypeError(type(item))

    def _rebuild(self, tensors, non_tensors):
        if tensors and not isinstance(self.batch, dict):
            rows = next(iter(tensors.values())).shape[0]
            tensors = make_tensors(tensors, rows, "tensordict" if TensorDict and isinstance(self.batch, TensorDict)
                                   else "double")
        return type(self)(batch=tensors, non_tensor_batch=non_tensors, meta_info=self.meta_info)

    def select_idxs(self, idxs):
        idx = torch.as_tensor(idxs, dtype=torch.long).reshape(-1)
        return self._rebuild({k: v[idx] for k, v in self.batch.items()},
                             {k: v[idx.numpy()] for k, v in self.non_tensor_batch.items()})

    def slice(self, start=None, end=None, step=None):
        s = slice(start, end, step)
        return self._rebuild({k: v[s] for k, v in self.batch.items()},
                             {k: v[s] for k, v in self.non_tensor_batch.items()})

    def reorder(self, indices):
        moved = self.select_idxs(indices)
        self.batch, self.non_tensor_batch = moved.batch, moved.non_tensor_batch

    def chunk(self, chunks):
        sizes = [len(p) for p in np.array_split(np.arange(len(self)), chunks)]
        starts = np.cumsum([0] + sizes)
        return [self.slice(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:])]

    @staticmethod
    def concat(data):
        first = data[0]
        tensors = {k: torch.cat([d.batch[k] for d in data]) for k in first.batch.keys()}
        non = {k: np.concatenate([d.non_tensor_batch[k] for d in data]) for k in first.non_tensor_batch}
        return first._rebuild(tensors, non)


class DataProtoTD(DataProto):
    kind = "double"


class DataProtoRealTD(DataProto):
    kind = "tensordict"


PROTOS = [DataProto, DataProtoTD] + ([DataProtoRealTD] if TensorDict is not None else [])


@pytest.fixture(params=PROTOS, ids=lambda c: c.kind)
def Proto(request):
    return request.param


def mask_of(lengths, width):
    return (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).int()


class FakeDPGroup:  # what ROLL's packer test passes for dp_group, with no process group
    pass


# ---------------------------------------------------------------- DataProto in, DataProto out


def test_dynamic_batching_on_a_data_proto_keeps_its_type_and_roll_vector(Proto):
    # ROLL: dp 2, lengths [2, 4, 7, 6, 3, 4] in 20 columns, 20 tokens per micro-batch, round 2.
    lengths = [2, 4, 7, 6, 3, 4]
    data = Proto.from_dict({"input_ids": torch.arange(6)[:, None].expand(6, 20),
                            "attention_mask": mask_of(lengths, 20)},
                           non_tensors={"uid": [f"u{i}" for i in range(6)]})
    out, metrics = roll.dynamic_batching_shard(data, 2, 20, 2)
    assert type(out) is Proto and is_data_proto(out)
    assert out.meta_info["global_micro_batch_indices"] == [[0, 2], [2, 3]]
    assert out.meta_info["global_micro_batch_lengths"] == [4, 8]
    assert data.meta_info == {}  # the input is not written to
    rows = out.batch["input_ids"][:, 0].tolist()
    assert out.non_tensor_batch["uid"].tolist() == [f"u{i}" for i in rows]  # non-tensor rows follow
    assert metrics["dynamic_batching/actual_tokens"] == 2 * (2 * 4 + 8)

    rank0 = out.slice(0, 3)
    mini = next(roll.make_mini_batch_iter_for_dynamic_batching(rank0, 1, 1))
    assert type(mini) is Proto and len(mini) == 2
    assert mini.meta_info["micro_batch_indices"] == [[0, 2]]
    assert rank0.meta_info["global_micro_batch_indices"] == [[0, 2], [2, 3]]
    assert rank0.meta_info["micro_batch_lengths"] == [4, 8]
    micro = next(roll.make_micro_batch_iter_for_dynamic_batching(mini))
    assert type(micro) is Proto and tuple(micro.batch["input_ids"].shape) == (2, 4)
    assert micro.non_tensor_batch["uid"].shape == (2,)


def test_dynamic_batching_vpp_count_on_a_data_proto(Proto):
    # ROLL: dp 4, 256 sequences of 128..8191 tokens, 8192 per micro-batch, round 128, PP 4 x VPP 2.
    torch.manual_seed(42)
    lengths = torch.randint(low=128, high=8192, size=(256,)).tolist()
    data = Proto.from_dict({"input_ids": torch.arange(256)[:, None].expand(256, 8192),
                            "attention_mask": mask_of(lengths, 8192)})
    out, _ = roll.dynamic_batching_shard(data, 4, 8192, 128, pipeline_model_parallel_size=4,
                                         virtual_pipeline_model_parallel_size=2)
    assert len(out.meta_info["global_micro_batch_indices"]) % 4 == 0
    assert len(out.meta_info["global_micro_batch_lengths"]) == len(out.meta_info["global_micro_batch_indices"])


def _eight_rows(Proto, cap):
    data = Proto.from_dict({"input_ids": torch.arange(64).reshape(8, 8),
                            "attention_mask": torch.ones((8, 8), dtype=torch.long)})
    return roll.dynamic_batching_shard(data, dp_size=1, max_tokens_per_microbatch=cap, sequence_length_round=8)[0]


def test_keep_mini_batch_on_a_data_proto(Proto):
    # ROLL issue 442: static mini-batch boundaries kept over dynamic ranges.
    more = list(roll.make_mini_batch_iter_for_dynamic_batching(_eight_rows(Proto, 8), epochs=3, ga_steps=2,
                                                               keep_mini_batch=True, mini_batch_size=4))
    assert len(more) == 6 and all(type(m) is Proto and len(m) == 4 for m in more)
    assert all(m.meta_info["num_micro_batchs"] == 4 for m in more)
    assert all(m.meta_info["micro_batch_indices"] == [[0, 1], [1, 2], [2, 3], [3, 4]] for m in more)

    fewer = list(roll.make_mini_batch_iter_for_dynamic_batching(_eight_rows(Proto, 64), epochs=3, ga_steps=2,
                                                                keep_mini_batch=True, mini_batch_size=4))
    assert len(fewer) == 6 and [m.meta_info["micro_batch_indices"] for m in fewer[:2]] == [[[0, 4]], [[0, 4]]]
    assert [m.batch["input_ids"][:, 0].tolist() for m in fewer[:2]] == [list(range(0, 32, 8)), list(range(32, 64, 8))]

    data = Proto.from_dict({"input_ids": torch.arange(64).reshape(8, 8),
                            "attention_mask": torch.ones((8, 8), dtype=torch.long)},
                           meta_info={"global_micro_batch_indices": [[0, 2], [2, 4], [4, 5], [5, 8]],
                                      "global_micro_batch_lengths": [8, 8, 8, 8]})
    minis = list(roll.make_mini_batch_iter_for_dynamic_batching(data, epochs=1, ga_steps=2, keep_mini_batch=True,
                                                                mini_batch_size=4))
    assert [m.meta_info["micro_batch_indices"] for m in minis] == [[[0, 2], [2, 4]], [[0, 1], [1, 4]]]
    assert minis[0].meta_info is not minis[1].meta_info
    minis[0].meta_info["micro_batch_indices"][0][0] = 99
    assert minis[1].meta_info["micro_batch_indices"] == [[0, 1], [1, 4]]
    assert "micro_batch_indices" not in data.meta_info and "micro_batch_lengths" not in data.meta_info

    spanning = Proto.from_dict({"input_ids": torch.arange(12).reshape(6, 2),
                                "attention_mask": torch.ones((6, 2), dtype=torch.long)},
                               meta_info={"global_micro_batch_indices": [[0, 6]], "global_micro_batch_lengths": [2]})
    minis = list(roll.make_mini_batch_iter_for_dynamic_batching(spanning, epochs=1, ga_steps=8, keep_mini_batch=True,
                                                                mini_batch_size=2))
    assert [len(m) for m in minis] == [2, 2, 2] and [m.meta_info["micro_batch_lengths"] for m in minis] == [[2]] * 3


def test_keep_mini_batch_vpp_on_a_data_proto(Proto):
    data = Proto.from_dict({"input_ids": torch.arange(16).reshape(8, 2),
                            "attention_mask": torch.ones((8, 2), dtype=torch.long)},
                           meta_info={"global_micro_batch_indices": [[0, 4], [4, 8]],
                                      "global_micro_batch_lengths": [2, 2]})
    minis = list(roll.make_mini_batch_iter_for_dynamic_batching(data, epochs=1, ga_steps=2, keep_mini_batch=True,
                                                                mini_batch_size=4, pipeline_model_parallel_size=4,
                                                                virtual_pipeline_model_parallel_size=2))
    assert len(minis) == 2 and all(m.meta_info["micro_batch_lengths"] == [2, 2, 2, 2] for m in minis)
    assert all(m.meta_info["micro_batch_indices"] == [[0, 1], [1, 2], [2, 3], [3, 4]] for m in minis)

    big = roll.dynamic_batching_shard(_eight_rows(Proto, 64), dp_size=1, max_tokens_per_microbatch=64,
                                      sequence_length_round=8, pipeline_model_parallel_size=4,
                                      virtual_pipeline_model_parallel_size=2)[0]
    assert big.meta_info["global_micro_batch_indices"] == [[0, 2], [2, 4], [4, 6], [6, 8]]

    small = Proto.from_dict({"input_ids": torch.arange(4).reshape(2, 2),
                             "attention_mask": torch.ones((2, 2), dtype=torch.long)},
                            meta_info={"global_micro_batch_indices": [[0, 1], [1, 2]],
                                       "global_micro_batch_lengths": [2, 2]})
    with pytest.raises(ValueError, match="cannot be split into a multiple"):
        list(roll.make_mini_batch_iter_for_dynamic_batching(small, epochs=1, ga_steps=2, keep_mini_batch=True,
                                                            mini_batch_size=2, pipeline_model_parallel_size=4,
                                                            virtual_pipeline_model_parallel_size=2))


@pytest.mark.parametrize(("ranges", "message"), [([[0, 2], [3, 4]], "contiguous"),
                                                 ([[0, 2]], "complete local batch"),
                                                 ([[0, 3], [2, 4]], "contiguous")])
def test_bad_layouts_raise_what_roll_raises(ranges, message):
    # ROLL asserts (AssertionError); seqpack's RollError is that and a ValueError.
    data = DataProto.from_dict({"input_ids": torch.zeros((4, 2), dtype=torch.long),
                                "attention_mask": torch.ones((4, 2), dtype=torch.long)},
                               meta_info={"global_micro_batch_indices": ranges,
                                          "global_micro_batch_lengths": [2] * len(ranges)})
    for kind in (AssertionError, ValueError, roll.RollError):
        with pytest.raises(kind, match=message):
            list(roll.make_mini_batch_iter_for_dynamic_batching(data, epochs=1, ga_steps=2, keep_mini_batch=True,
                                                                mini_batch_size=2))
    bad_length = DataProto.from_dict({"attention_mask": torch.ones((2, 2), dtype=torch.long)},
                                     meta_info={"global_micro_batch_indices": [[0, 2]],
                                                "global_micro_batch_lengths": [0]})
    with pytest.raises(AssertionError, match="micro-batch length must be a positive integer"):
        roll.make_mini_batch_iter_for_dynamic_batching(bad_length, 1)


@pytest.mark.parametrize("minibatch_size", [0, 3, 8])
def test_batch_balance_rejects_an_incomplete_static_batch(minibatch_size):
    data = DataProto.from_dict({"attention_mask": torch.ones((4, 2), dtype=torch.long)})
    with pytest.raises(ValueError, match="minibatch_size|divisible"):
        roll.batch_balance(data, dp_size=2, minibatch_size=minibatch_size, keep_minibatch=True)


def test_batch_balance_reorders_a_data_proto_in_place(Proto):
    lengths = [10, 20, 30, 40, 50, 60, 70, 80]
    data = Proto.from_dict({"attention_mask": mask_of(lengths, 80), "row": torch.arange(8)},
                           non_tensors={"uid": [f"u{i}" for i in range(8)]})
    metrics = roll.batch_balance(data, dp_size=2, minibatch_size=8)
    assert metrics["global_seqlen/balanced_min"] == metrics["global_seqlen/balanced_max"] == 180
    assert int(data.batch["attention_mask"][:4].sum()) == 180
    assert data.non_tensor_batch["uid"].tolist() == [f"u{i}" for i in data.batch["row"].tolist()]

    class NoReorder(DataProto):  # reordered key by key instead
        reorder = None

    other = NoReorder.from_dict({"attention_mask": mask_of(lengths, 80), "row": torch.arange(8)},
                                non_tensors={"uid": [f"u{i}" for i in range(8)]})
    roll.batch_balance(other, dp_size=2, minibatch_size=8)
    assert other.batch["row"].tolist() == data.batch["row"].tolist()
    assert other.non_tensor_batch["uid"].tolist() == data.non_tensor_batch["uid"].tolist()


def test_a_data_proto_without_select_idxs_is_rebuilt_with_its_class():
    class Minimal:  # attributes and a ROLL-style constructor only
        def __init__(self, batch=None, non_tensor_batch=None, meta_info=None):
            self.batch, self.non_tensor_batch, self.meta_info = batch, non_tensor_batch or {}, meta_info or {}

        def __len__(self):
            return int(self.batch["attention_mask"].shape[0])

    proto = Minimal({"attention_mask": mask_of([3, 1, 2, 4], 4), "row": torch.arange(4)},
                    {"uid": np.array(list("abcd"), dtype=object)}, {"step": 7})
    out, _ = roll.dynamic_batching_shard(proto, 2, 8, 1)
    assert type(out) is Minimal and out.meta_info["step"] == 7 and proto.meta_info == {"step": 7}
    assert out.non_tensor_batch["uid"].tolist() == ["abcd"[i] for i in out.batch["row"].tolist()]
    picked = proto_select(proto, [2, 0])
    assert picked.batch["row"].tolist() == [2, 0] and set(proto_columns(picked)) == {"attention_mask", "row", "uid"}


# ---------------------------------------------------------------- sequence packing: ROLL's packers


LB_LENGTHS = [512, 1024, 256, 2048, 128, 768, 1536, 384, 896, 640]


def test_load_balance_packer_on_a_data_proto(Proto):
    # ROLL's test_load_balance_packer: 10 sequences, cap 4096 for both phases, a stand-in dp_group.
    config = roll.SequencePackingConfig(algorithm="load_balance", max_packed_sequence_length_forward=4096,
                                        max_packed_sequence_length_train=4096)
    packer = roll.LoadBalancePacker(config)
    mini = Proto(batch=make_tensors({"input_ids": torch.randint(0, 1000, (10, 2048)),
                                     "attention_mask": mask_of(LB_LENGTHS, 2048).long()}, 10, Proto.kind),
                 non_tensor_batch={}, meta_info={})
    mbs = list(packer.make_micro_batch_iter_for_sequence_packing(mini_batch=mini, tp_size=1, cp_size=1, vp_size=1,
                                                                 dp_group=FakeDPGroup(), micro_batch_size=None))
    assert all(type(mb) is Proto for mb in mbs)
    parts = mini.meta_info["partition_indices_list"]  # written on the mini-batch, as ROLL does
    assert parts == mbs[0].meta_info["partition_indices_list"]
    assert [mb.meta_info["partition_indices"] for mb in mbs] == parts
    assert sorted(sum(parts, [])) == list(range(10))
    assert [int(mb.batch["attention_mask"].sum()) for mb in mbs] == [4096, 4096]
    workloads = [sum(packer.calculate_workload(LB_LENGTHS[i]) for i in p) for p in parts]
    assert max(workloads) / min(workloads) < 1.02
    results = {"logits": torch.arange(10).float().unsqueeze(1), "loss": torch.arange(10).float() * 10}
    restored = roll.LoadBalancePacker.restore_results_order(results, parts)
    flat = sum(parts, [])
    assert restored["logits"].squeeze(1).tolist() == [float(flat.index(i)) for i in range(10)]
    assert restored["loss"].tolist() == [10.0 * flat.index(i) for i in range(10)]


def test_packer_classes_config_and_workload():
    assert isinstance(roll.get_sequence_packing_packer(), roll.SequencePackingPacker)
    assert not isinstance(roll.get_sequence_packing_packer(), roll.LoadBalancePacker)
    lb = roll.get_sequence_packing_packer(roll.SequencePackingConfig(algorithm="load_balance"))
    assert isinstance(lb, roll.LoadBalancePacker)
    with pytest.raises(ValueError, match="Illegal sequence packing algorithm"):  # ROLL: ValueError too
        roll.get_sequence_packing_packer(roll.SequencePackingConfig(algorithm="greedy"))
    assert roll.SequencePackingConfig() == roll.SequencePackingConfig(
        algorithm="none", max_packed_sequence_length_forward=None, max_packed_sequence_length_train=None,
        min_num_micro_batches_forward=1, min_num_micro_batches_train=1)
    assert roll.calculate_workload(1000) == lb.calculate_workload(1000) == 24576 * 1000 + 1000 ** 2
    assert lb.calculate_workload_batch(torch.tensor([1, 2])).tolist() == [24577, 49156]
    assert lb.ceildiv(7, 2) == 4 and lb.roundup_divisible(7, 4) == 8 and lb.get_device_name() == "cpu"
    # ROLL's pad factor: lcm(16, 2·CP·TP) with CP, lcm(16, TP) without.
    assert [lb.get_pad_factor(cp, tp) for cp, tp in ((1, 1), (1, 3), (2, 2), (2, 4), (4, 4))] == [16, 48, 16, 16, 32]
    mini = DataProto.from_dict({"attention_mask": mask_of([5, 6], 8)})
    with pytest.raises(ValueError, match="max_packed_sequence_length is required"):  # ROLL asserts
        list(roll.LoadBalancePacker(roll.SequencePackingConfig()).make_micro_batch_iter_for_sequence_packing(
            mini, 1, 1, 1, dp_group=FakeDPGroup()))
    old = roll.LoadBalancePacker(roll.SequencePackingConfig(algorithm="load_balance", max_packed_sequence_length=16))
    assert len(list(old.make_micro_batch_iter_for_sequence_packing(mini, 1, 1, 1))) == 2  # older ROLL's single cap


def test_roll_positional_form_takes_the_phase_from_the_config():
    config = roll.SequencePackingConfig(algorithm="load_balance", max_packed_sequence_length_train=4096,
                                        max_packed_sequence_length_forward=2048, min_num_micro_batches_train=3)
    mini = DataProto.from_dict({"attention_mask": mask_of(LB_LENGTHS, 2048)})
    train = list(roll.make_micro_batch_iter_for_sequence_packing(mini, 1, 1, 1, True, FakeDPGroup(), None, config))
    assert len(train) == 3 and max(int(mb.batch["attention_mask"].sum()) for mb in train) <= 4096
    assert set(mini.meta_info["sequence_packing_metrics"]) >= {"train/num_micro_batches", "train/effective_ratio",
                                                               "train/seq_len_balance_ratio",
                                                               "train/avg_samples_per_pack"}
    forward = list(roll.make_micro_batch_iter_for_sequence_packing(mini, 1, 1, 1, False, FakeDPGroup(), None, config))
    assert len(forward) >= 4 and max(int(mb.batch["attention_mask"].sum()) for mb in forward) <= 2048
    assert mini.meta_info["sequence_packing_metrics"]["forward/num_micro_batches"] == float(len(forward))
    # A keyword overrides the config.
    capped = roll.make_micro_batch_iter_for_sequence_packing(mini, 1, 1, 1, True, None, None, config,
                                                             max_packed_sequence_length=8192,
                                                             min_num_micro_batches=1)
    assert len(list(capped)) == 1

    none = roll.SequencePackingConfig()  # ROLL's default: algorithm "none", consecutive chunks
    chunks = list(roll.make_micro_batch_iter_for_sequence_packing(mini, 1, 1, 1, True, None, 5, none))
    assert [mb.meta_info["partition_indices"] for mb in chunks] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert mini.meta_info["partition_indices_list"] == [] and mini.meta_info["num_micro_batchs"] == 2
    results = {"x": torch.arange(10)}
    assert roll.restore_results_order(results, [[1, 0]], none) is results  # ROLL's "none" restores nothing
    assert roll.SequencePackingPacker.restore_results_order(results, [[1, 0]]) is results


def test_pad_and_vpp_rules_of_the_two_forms():
    mini = DataProto.from_dict({"attention_mask": mask_of([17] * 4, 17)})
    config = roll.SequencePackingConfig(algorithm="load_balance", max_packed_sequence_length_forward=34)
    # seqpack's keywords pad to 2·CP·TP (TP = 1 here): two rows of 17 fit 34.
    assert len(list(roll.make_micro_batch_iter_for_sequence_packing(mini, max_packed_sequence_length=34))) == 2
    # ROLL's packer pads to lcm(16, TP) = 16: 32 each, one per micro-batch; pad_multiple restores either.
    assert len(list(roll.LoadBalancePacker(config).make_micro_batch_iter_for_sequence_packing(mini, 1, 1, 1))) == 4
    assert len(list(roll.make_micro_batch_iter_for_sequence_packing(mini, max_packed_sequence_length=34,
                                                                    pad_multiple=16))) == 4
    assert len(list(roll.LoadBalancePacker(config).make_micro_batch_iter_for_sequence_packing(
        mini, 1, 1, 1, pad_multiple=1))) == 2
    # Count rule: ROLL (pp_size given) rounds to a multiple of pp_size when vp_size > 1; the keywords to vp_size.
    eight = DataProto.from_dict({"attention_mask": mask_of([4] * 8, 4)})
    lb = roll.LoadBalancePacker(roll.SequencePackingConfig(algorithm="load_balance",
                                                           max_packed_sequence_length_forward=128))
    assert len(list(lb.make_micro_batch_iter_for_sequence_packing(eight, 1, 1, 2, pp_size=4))) == 4
    assert len(list(lb.make_micro_batch_iter_for_sequence_packing(eight, 1, 1, 2))) == 1  # pp_size 1
    assert len(list(roll.make_micro_batch_iter_for_sequence_packing(eight, max_packed_sequence_length=128,
                                                                    vp_size=2))) == 2


def test_hard_cap_where_roll_exceeds_it():
    # ROLL: ceil(8·112 / 128) = 7 parts, so one holds 224 tokens. seqpack: 8, each <= 128.
    config = roll.SequencePackingConfig(algorithm="load_balance", max_packed_sequence_length_train=128)
    mini = DataProto.from_dict({"attention_mask": mask_of([112] * 8, 112)})
    mbs = list(roll.LoadBalancePacker(config).make_micro_batch_iter_for_sequence_packing(mini, 1, 1, 1, True))
    assert len(mbs) == 8 and all(int(mb.batch["attention_mask"].sum()) <= 128 for mb in mbs)


def test_strict_false_restores_rolls_rules():
    config = roll.SequencePackingConfig(algorithm="load_balance", max_packed_sequence_length_train=128)
    mini = DataProto.from_dict({"attention_mask": mask_of([112] * 8, 112)})
    packer = roll.LoadBalancePacker(config)
    mbs = list(packer.make_micro_batch_iter_for_sequence_packing(mini, 1, 1, 1, True, strict=False))
    assert sorted(int(mb.batch["attention_mask"].sum()) for mb in mbs) == [112] * 6 + [224]  # ROLL's 7

    # ROLL's count ceil(8192 / 2048) = 4, and its layout: workloads sorted descending, w[::2][::-1] + w[1::2].
    lb = DataProto.from_dict({"attention_mask": mask_of(LB_LENGTHS, 2048)})
    mbs = list(roll.make_micro_batch_iter_for_sequence_packing(lb, max_packed_sequence_length=2048, strict=False))
    work = [sum(roll.calculate_workload(LB_LENGTHS[i]) for i in mb.meta_info["partition_indices"]) for mb in mbs]
    ranked = sorted(work, reverse=True)
    assert len(mbs) == 4 and work == ranked[::2][::-1] + ranked[1::2]
    with pytest.raises(ValueError, match="exceeds max_packed_sequence_length=1024"):  # too long either way
        roll.make_micro_batch_iter_for_sequence_packing(lb, max_packed_sequence_length=1024, strict=False)

    five = DataProto.from_dict({"attention_mask": mask_of([1, 2, 3, 4, 5], 5)})
    chunks = list(roll.make_micro_batch_iter_for_sequence_packing(five, algorithm="none", micro_batch_size=2,
                                                                  strict=False))
    assert [mb.meta_info["partition_indices"] for mb in chunks] == [[0, 1, 2], [3, 4]]  # ROLL's array_split
    with pytest.raises(ValueError, match="dividing the 5 rows"):
        roll.make_micro_batch_iter_for_sequence_packing(five, algorithm="none", micro_batch_size=2)


def test_step_plan_dummies_keep_the_data_proto_class(Proto):
    from seqpack import plan_step

    lengths = [9, 1, 8, 2, 7, 9, 8, 7, 1, 1]
    plan = plan_step(lengths, dp_size=2, max_tokens=10, mini_batches=2, min_micro_batches=3)
    mask = mask_of(lengths, 10)
    for r in range(2):
        rows = plan.rank_rows(r, 1)
        mini = Proto.from_dict({"attention_mask": mask[rows], "loss_mask": mask[rows].float()},
                               non_tensors={"uid": [f"u{i}" for i in rows]})
        mbs = list(roll.make_micro_batch_iter_for_sequence_packing(mini, max_packed_sequence_length=10,
                                                                   step_plan=plan, dp_rank=r, mini_batch_index=1))
        assert all(type(mb) is Proto for mb in mbs)
        assert [mb.meta_info["is_padding_batch"] for mb in mbs] == [not c for c in plan.assignment[1][r]]
        for mb in mbs:
            if mb.meta_info["is_padding_batch"]:
                assert int(mb.batch["attention_mask"].sum()) == 1 and float(mb.batch["loss_mask"].sum()) == 0
                assert len(mb) == 1 and mb.non_tensor_batch["uid"].shape == (1,)
        assert mini.meta_info["partition_indices_list"] == [mb.meta_info["partition_indices"] for mb in mbs]


# ---------------------------------------------------------------- meta_info keys, where ROLL writes them


def test_meta_info_keys_where_roll_writes_them():
    lengths = [5, 3, 8, 2]
    tensors = {"input_ids": torch.arange(32).reshape(4, 8), "attention_mask": mask_of(lengths, 8)}
    data = DataProto.from_dict(tensors, meta_info={"global_step": 1})
    out, _ = roll.dynamic_batching_shard(data, 1, 16, 2)
    assert set(out.meta_info) == {"global_step", "global_micro_batch_indices", "global_micro_batch_lengths",
                                  "micro_batch_indices", "micro_batch_lengths", "num_micro_batchs"}
    assert data.meta_info == {"global_step": 1}
    mini = next(roll.make_mini_batch_iter_for_dynamic_batching(out, 1, ga_steps=8))
    assert set(mini.meta_info) - set(out.meta_info) == {"mini_batch_size"}
    assert mini.meta_info["mini_batch_size"] == 4 and mini.meta_info["num_micro_batchs"] == len(
        out.meta_info["micro_batch_indices"])

    packed_input = DataProto.from_dict(tensors, meta_info={"global_step": 1})
    mbs = list(roll.make_micro_batch_iter_for_sequence_packing(packed_input, max_packed_sequence_length=8))
    assert set(packed_input.meta_info) == {"global_step", "partition_indices_list", "sequence_packing_metrics"}
    metrics = packed_input.meta_info["sequence_packing_metrics"]
    assert metrics["forward/num_micro_batches"] == float(len(mbs))
    assert metrics["forward/effective_ratio"] == sum(lengths) / 32
    assert metrics["forward/avg_samples_per_pack"] == 4 / len(mbs)
    per_mb = [int(mb.batch["attention_mask"].sum()) for mb in mbs]
    assert metrics["forward/seq_len_balance_ratio"] == min(per_mb) / max(per_mb)
    for k, mb in enumerate(mbs):
        assert set(mb.meta_info) == {"global_step", "partition_indices_list", "sequence_packing_metrics",
                                     "micro_batch_idx", "is_padding_batch", "partition_indices", "num_micro_batchs",
                                     "mini_batch_size"}
        assert (mb.meta_info["micro_batch_idx"], mb.meta_info["is_padding_batch"], mb.meta_info["mini_batch_size"],
                mb.meta_info["num_micro_batchs"]) == (k, False, 4, len(mbs))

    rb = roll.RollBatch(tensors, meta_info={})  # a RollBatch's meta_info is written too; a dict has none
    list(roll.make_micro_batch_iter_for_sequence_packing(rb, max_packed_sequence_length=8))
    assert rb.meta_info["partition_indices_list"] == packed_input.meta_info["partition_indices_list"]
    plain = dict(tensors)
    list(roll.make_micro_batch_iter_for_sequence_packing(plain, max_packed_sequence_length=8))
    assert set(plain) == {"input_ids", "attention_mask"}


# ---------------------------------------------------------------- dp_group, reliability checks


def test_a_stand_in_dp_group_without_a_process_group_is_skipped():
    assert not dist.is_initialized()
    mini = DataProto.from_dict({"attention_mask": mask_of(LB_LENGTHS, 2048)})
    mbs = list(roll.make_micro_batch_iter_for_sequence_packing(mini, max_packed_sequence_length=4096,
                                                               dp_group=FakeDPGroup()))
    assert len(mbs) == 2


def test_with_a_process_group_a_stand_in_dp_group_is_refused(tmp_path):
    mini = DataProto.from_dict({"attention_mask": mask_of(LB_LENGTHS, 2048)})
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(TypeError, match="dp_group must be a torch.distributed ProcessGroup"):
            roll.make_micro_batch_iter_for_sequence_packing(mini, max_packed_sequence_length=4096,
                                                            dp_group=FakeDPGroup())
        mbs = roll.make_micro_batch_iter_for_sequence_packing(mini, max_packed_sequence_length=4096,
                                                              dp_group=dist.group.WORLD)
        assert len(list(mbs)) == 2
    finally:
        dist.destroy_process_group()


def _agreement_rank(rank, world, path, results):
    torch.set_num_threads(1)
    try:
        store = dist.FileStore(path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        lengths = [40 + 30 * rank] * 6  # rank 1 needs more micro-batches
        mini = DataProto.from_dict({"attention_mask": mask_of(lengths, 100)})
        config = roll.SequencePackingConfig(algorithm="load_balance", max_packed_sequence_length_train=192)
        mbs = list(roll.LoadBalancePacker(config).make_micro_batch_iter_for_sequence_packing(
            mini, 1, 1, 1, True, dist.group.WORLD))
        bad = DataProto.from_dict({"attention_mask": mask_of([100 if rank else 10] * 2, 100)})
        try:  # rank 1's row is over the cap: every rank raises, none waits
            list(roll.make_micro_batch_iter_for_sequence_packing(bad, max_packed_sequence_length=64,
                                                                 dp_group=dist.group.WORLD))
            raised = "nothing"
        except ValueError as exc:
            raised = type(exc).__name__ + ": " + str(exc)
        dist.barrier()
        results.put((rank, len(mbs), type(mbs[0]).__name__, raised))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, traceback.format_exc(), None, None))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_ranks_agree_on_the_count_with_a_data_proto(tmp_path):
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_agreement_rank, args=(r, 2, str(tmp_path / "store"), results)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
    assert all(isinstance(n, int) for _, n, _, _ in got), got
    (_, n0, cls0, err0), (_, n1, cls1, err1) = got
    # Padded to 16: rank 0 has 6 x 48 tokens (2 micro-batches of 192), rank 1 6 x 80 (3 of 160): both run 3.
    assert n0 == n1 == 3 and cls0 == cls1 == "DataProto"
    assert "exceeds max_packed_sequence_length=64" in err1 and "another rank's input failed" in err0
    assert all(p.exitcode == 0 for p in procs)


def test_right_padding_is_still_required_of_a_data_proto():
    mask = torch.tensor([[0, 0, 1, 1], [0, 0, 0, 1]])
    data = DataProto.from_dict({"input_ids": torch.arange(8).reshape(2, 4), "attention_mask": mask})
    with pytest.raises(ValueError, match="row 0 is not right-padded"):
        roll.dynamic_batching_shard(data, 1, 100, 1)
