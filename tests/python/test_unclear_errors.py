"""Issue 16, unclear errors: every bad argument gives a Python exception of the right
type (TypeError for a wrong type, ValueError for a wrong value) whose message names
the argument and the rule broken - never pybind11's signature dump, torch's
NotImplementedError, an AttributeError or a RecursionError. Each test failed before
its fix (docs/reliability.md, "Errors")."""

import tracemalloc

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.profiler import ProfilerActivity, profile

import seqpack
from seqpack import BatchedDataDict
from seqpack.frameworks import roll
from seqpack.frameworks.config import load
from seqpack.planning.packing import adjust_bin_count
from seqpack.tensors.cp import cp_partition_indices, cp_restore_order
from seqpack.tensors.layout import PackedLayout, alignment
from seqpack.training.logprobs import next_token_sources, next_token_targets, packed_token_logprobs

IDS = torch.zeros(2, 4, dtype=torch.long)
LOGITS = torch.zeros(5, 4)
PACKED_IDS = torch.tensor([1, 2, 3, 0, 1])
PACKS = seqpack.pack_dataset([[1, 2, 3], [4, 5]], pack_size=8, cp_size=2)  # collates with cp_size 1 or 2

# (argument name, call taking the bad value, values that are valid for this argument)
INT_ARGS = [
    ("k_partitions", lambda v: seqpack.karmarkar_karp([1, 2, 3], v, False), ()),
    ("k_partitions", lambda v: seqpack.get_seqlen_balanced_partitions([1, 2, 3], v, False), ()),
    ("k_partitions", lambda v: seqpack.greedy_lpt_partition([1, 2, 3], v), ()),
    ("k_partitions", lambda v: seqpack.sorted_stride_partition([1, 2, 3], v), ()),
    ("bin_capacity", lambda v: seqpack.get_packer("first_fit_decreasing", v).pack([1, 2]), ()),
    ("min_bin_count", lambda v: seqpack.get_packer("first_fit_decreasing", 10, min_bin_count=v).pack([1, 2]),
     (None,)),
    ("bin_count_multiple", lambda v: seqpack.get_packer("concatenative", 10, bin_count_multiple=v).pack([1, 2]),
     (None,)),
    ("seed", lambda v: seqpack.get_packer("first_fit_shuffle", 10, seed=v).pack([1, 2]), (None, -1, 2**63)),
    ("min_bin_count", lambda v: adjust_bin_count([[0], [1]], min_bin_count=v), ()),
    ("bin_count_multiple", lambda v: adjust_bin_count([[0], [1]], bin_count_multiple=v), ()),
    ("bin_capacity", lambda v: seqpack.PackingMetrics().calculate_stats_only([1, 2], [[0, 1]], v), ()),
    ("attention_coeff", lambda v: seqpack.sequence_workloads([1, 2], v), (None,)),
    ("max_tokens", lambda v: seqpack.plan_micro_batches([1, 2], v), ()),
    ("min_num", lambda v: seqpack.plan_micro_batches([1, 2], 10, min_num=v), ()),
    ("multiple_of", lambda v: seqpack.plan_micro_batches([1, 2], 10, multiple_of=v), ()),
    ("attention_coeff", lambda v: seqpack.plan_micro_batches([1, 2], 10, attention_coeff=v), (None,)),
    ("shards", lambda v: seqpack.plan_dynamic_batching([1, 2], v, 10, 1), ()),
    ("max_tokens_per_microbatch", lambda v: seqpack.plan_dynamic_batching([1, 2], 1, v, 1), ()),
    ("sequence_length_round", lambda v: seqpack.plan_dynamic_batching([1, 2], 1, 10, v), ()),
    ("batch_size", lambda v: seqpack.plan_dynamic_batching([1, 2], 1, 10, 1, batch_size=v), (None,)),
    ("max_seqlen", lambda v: seqpack.plan_dynamic_batching([1, 2], 1, 10, 1, max_seqlen=v), (None,)),
    ("pp_size", lambda v: seqpack.plan_dynamic_batching([1, 2], 1, 10, 1, pp_size=v), ()),
    ("dp_size", lambda v: seqpack.plan_step([1, 2], v, 10), ()),
    ("max_tokens", lambda v: seqpack.plan_step([1, 2], 1, v), ()),
    ("mini_batches", lambda v: seqpack.plan_step([1, 2], 1, 10, mini_batches=v), ()),
    ("min_micro_batches", lambda v: seqpack.plan_step([1, 2], 1, 10, min_micro_batches=v), ()),
    ("multiple_of", lambda v: seqpack.plan_step([1, 2], 1, 10, multiple_of=v), ()),
    ("seed", lambda v: seqpack.plan_step([1, 2], 1, 10, seed=v), (None, 2**63)),  # a uint64
    ("pad_multiple", lambda v: seqpack.pack_sequences(IDS, seq_lens=[2, 3], pad_multiple=v), ()),
    ("pad_packed_to", lambda v: seqpack.pack_sequences(IDS, seq_lens=[2, 3], pad_packed_to=v), (None,)),
    ("pad_packed_multiple", lambda v: seqpack.pack_sequences(IDS, seq_lens=[2, 3], pad_packed_multiple=v), (None,)),
    ("cp_size", lambda v: seqpack.pack_sequences(IDS, seq_lens=[2, 3], cp_size=v), ()),
    ("cp_rank", lambda v: seqpack.pack_sequences(IDS, seq_lens=[2, 3], cp_rank=v), ()),
    ("num_threads", lambda v: seqpack.pack_sequences(IDS, seq_lens=[2, 3], num_threads=v), ()),
    ("num_threads", lambda v: seqpack.pack_to_layout(IDS, PackedLayout.from_offsets([0, 2, 5]), num_threads=v), ()),
    ("cp_size", lambda v: seqpack.unpack_sequences(torch.zeros(8), [0, 4, 8], cp_size=v), ()),
    ("pad_multiple", lambda v: PackedLayout.from_lengths([2, 3], pad_multiple=v), ()),
    ("pad_packed_to", lambda v: PackedLayout.from_lengths([2, 3], pad_packed_to=v), (None,)),
    ("cp_size", lambda v: PackedLayout.from_lengths([2, 3], cp_size=v), ()),
    ("cp_rank", lambda v: PackedLayout.from_offsets([0, 4], cp_size=2, cp_rank=v), ()),
    ("cp_size", lambda v: alignment(cp_size=v), ()),
    ("tp_size", lambda v: alignment(tp_size=v), ()),
    ("cp_size", lambda v: cp_partition_indices([0, 4, 8], v, 0), ()),
    ("cp_rank", lambda v: cp_partition_indices([0, 4, 8], 2, v), ()),
    ("cp_size", lambda v: cp_restore_order([0, 4, 8], v), ()),
    ("pack_size", lambda v: seqpack.pack_dataset([[1, 2]], pack_size=v), ()),
    ("max_packs", lambda v: seqpack.pack_dataset([[1, 2]], pack_size=4, max_packs=v), (None,)),
    ("padding_idx", lambda v: seqpack.pack_dataset([[1, 2, 3]], pack_size=4, padding_idx=v), (-1,)),
    ("label_pad", lambda v: seqpack.pack_dataset([[1, 2, 3]], pack_size=4, label_pad=v), (-1,)),
    ("cp_rank", lambda v: seqpack.collate_packs(PACKS, cp_size=2, cp_rank=v), ()),
    ("max_tokens", lambda v: seqpack.pack_sequences_static(IDS, [2, 3], max_tokens=v), ()),
    ("max_seqs", lambda v: seqpack.pack_sequences_static(IDS, [2, 3], max_tokens=8, max_seqs=v), (None,)),
    ("cp_rank", lambda v: seqpack.pack_sequences_static(IDS, [2, 3], max_tokens=8, cp_rank=v), ()),
    # the implementation's split arguments (the op takes a layout carrying its cut)
    ("cp_size", lambda v: packed_token_logprobs(LOGITS, PACKED_IDS, [0, 2, 5], cp_size=v), ()),
    ("cp_rank", lambda v: packed_token_logprobs(LOGITS, PACKED_IDS, [0, 2, 5], cp_rank=v), ()),
    ("vocab_start", lambda v: seqpack.token_logprobs(LOGITS, [0, 2, 5], PACKED_IDS, vocab_start=v), ()),
    ("num_threads", lambda v: seqpack.token_logprobs(LOGITS, [0, 2, 5], PACKED_IDS, num_threads=v), ()),
    ("chunk_tokens", lambda v: seqpack.token_logprobs(torch.zeros(5, 2), [0, 2, 5], PACKED_IDS,
                                                      weight=torch.zeros(4, 2), chunk_tokens=v), (None,)),
    ("num_threads", lambda v: seqpack.token_logprobs(torch.zeros(5, 2), [0, 2, 5], PACKED_IDS,
                                                     weight=torch.zeros(4, 2), num_threads=v), ()),
    ("cp_rank", lambda v: next_token_sources([0, 4, 8], cp_size=2, cp_rank=v), ()),
]
BAD_INTS = [(2.0, TypeError), (None, TypeError), ("2", TypeError), (True, TypeError), (2**63, ValueError),
            (-1, ValueError)]


@pytest.mark.parametrize("bad, kind", BAD_INTS, ids=[repr(b) for b, _ in BAD_INTS])
@pytest.mark.parametrize("name, call, valid", INT_ARGS, ids=[f"{i}-{c[0]}" for i, c in enumerate(INT_ARGS)])
def test_int_arguments_are_checked_in_python(name, call, valid, bad, kind):
    if any(bad is v or (type(bad) is type(v) and bad == v) for v in valid):
        pytest.skip(f"{bad!r} is a valid {name}")
    with pytest.raises((TypeError, ValueError)) as info:
        call(bad)
    message = str(info.value)
    assert "incompatible function arguments" not in message
    assert info.type is kind or issubclass(info.type, kind), f"{info.type.__name__}: {message}"
    assert name in message, message
    if bad == 2**63 and bad is not True:
        assert "int64" in message and str(2**63) in message


def test_numpy_ints_are_accepted_and_huge_ones_are_shown_as_given():
    assert seqpack.karmarkar_karp([1, 2, 3], np.int32(2), False) == seqpack.karmarkar_karp([1, 2, 3], 2, False)
    assert seqpack.get_packer("first_fit_decreasing", np.uint16(10)).bin_capacity == 10
    # NumPy uint64 used to wrap to a negative int64 in the core's message.
    with pytest.raises(ValueError, match=r"k_partitions must fit in int64 .*got 9223372036854775809"):
        seqpack.karmarkar_karp([1, 2, 3], np.uint64(2**63 + 1), False)
    with pytest.raises(ValueError, match=r"bin_capacity must fit in int64"):
        seqpack.get_packer("first_fit_decreasing", 2**63)


# ---------------------------------------------------------------- lengths


@pytest.mark.parametrize("lengths, kind", [((x for x in [1, 2]), "generator"), ({1, 2}, "set"),
                                           ({1: 2, 3: 4}, "dict"), ("12", "str"), (b"12", "bytes")])
def test_lengths_of_the_wrong_container_are_a_type_error(lengths, kind):
    message = rf"sequence_lengths must be a 1-D sequence of integers, got {kind}"
    with pytest.raises(TypeError, match=message):
        seqpack.get_packer("first_fit_decreasing", 10).pack(lengths)
    calls = [lambda x: seqpack.karmarkar_karp(x, 2, False), lambda x: seqpack.plan_micro_batches(x, 10),
             lambda x: seqpack.plan_step(x, 1, 10)]
    for call in calls:
        with pytest.raises(TypeError, match=rf"must be a 1-D sequence of integers, got {kind}"):
            call(lengths if not hasattr(lengths, "__next__") else (x for x in [1, 2]))


# ---------------------------------------------------------------- meta and NumPy tensors


def _meta(t):
    return t.to("meta")


META_CALLS = [
    ("tensors\\['input'\\]", lambda: seqpack.pack_sequences(_meta(IDS), seq_lens=[2, 3])),
    ("attention_mask", lambda: seqpack.pack_sequences(IDS, attention_mask=_meta(torch.ones(2, 4)))),
    ("seq_lens", lambda: seqpack.pack_sequences(IDS, seq_lens=_meta(torch.tensor([2, 3])))),
    ("x", lambda: seqpack.pack_sequences(IDS, seq_lens=[2, 3]).unpack(_meta(torch.zeros(5)))),
    ("tensors\\['input'\\]", lambda: seqpack.pack_sequences_static(_meta(IDS), [2, 3], max_tokens=8)),
    ("seq_lens", lambda: seqpack.pack_sequences_static(IDS, _meta(torch.tensor([2, 3])), max_tokens=8)),
    ("x", lambda: seqpack.unpack_sequences(_meta(torch.zeros(5)), [0, 2, 5])),
    ("cu_seqlens_padded", lambda: cp_partition_indices(_meta(torch.tensor([0, 4, 8])), 2, 0)),
    ("cu_seqlens", lambda: PackedLayout.from_offsets(_meta(torch.tensor([0, 4, 8])))),
    ("seq_lens", lambda: PackedLayout.from_lengths(_meta(torch.tensor([4, 4])))),
    ("seqlen_list", lambda: seqpack.karmarkar_karp(_meta(torch.tensor([4, 4])), 2, False)),
    ("logits", lambda: seqpack.token_logprobs(_meta(LOGITS), [0, 2, 5], PACKED_IDS)),
    ("input_ids", lambda: seqpack.token_logprobs(LOGITS, [0, 2, 5], _meta(PACKED_IDS))),
    ("cu_seqlens", lambda: seqpack.token_logprobs(LOGITS, _meta(torch.tensor([0, 2, 5])), PACKED_IDS)),
    ("hidden", lambda: seqpack.token_logprobs(_meta(torch.zeros(5, 2)), [0, 2, 5], PACKED_IDS,
                                              weight=torch.zeros(4, 2))),
    ("input_ids", lambda: next_token_targets(_meta(PACKED_IDS), torch.tensor([0, 2, 5]), torch.tensor([0, 2, 5]), 5)),
]


@pytest.mark.parametrize("name, call", META_CALLS, ids=[f"{i}-{c[0]}" for i, c in enumerate(META_CALLS)])
def test_meta_tensors_are_refused_by_name(name, call):
    with pytest.raises(ValueError, match=rf"{name} is on the meta device; seqpack needs real data"):
        call()


NOT_TENSOR_CALLS = [
    ("tensors", "numpy.ndarray", lambda: seqpack.pack_sequences(np.zeros((2, 4)), seq_lens=[2, 3])),
    ("tensors", "NoneType", lambda: seqpack.pack_sequences(None, seq_lens=[2, 3])),
    ("tensors", "list", lambda: seqpack.pack_sequences([[1, 2], [3, 4]], seq_lens=[2, 2])),
    ("tensors\\['a'\\]", "numpy.ndarray", lambda: seqpack.pack_sequences({"a": np.zeros((2, 4))}, seq_lens=[2, 3])),
    ("attention_mask", "numpy.ndarray", lambda: seqpack.pack_sequences(IDS, attention_mask=np.ones((2, 4)))),
    ("x", "numpy.ndarray", lambda: seqpack.pack_sequences(IDS, seq_lens=[2, 3]).unpack(np.zeros(5))),
    ("x", "NoneType", lambda: seqpack.pack_sequences(IDS, seq_lens=[2, 3]).unpack(None)),
    ("tensors", "numpy.ndarray", lambda: seqpack.pack_sequences_static(np.zeros((2, 4)), [2, 3], max_tokens=8)),
    ("tensors", "numpy.ndarray", lambda: seqpack.pack_to_layout(np.zeros((2, 4)),
                                                                PackedLayout.from_offsets([0, 2, 5]))),
    ("x", "numpy.ndarray", lambda: seqpack.unpack_sequences(np.zeros(5), [0, 2, 5])),
    ("logits", "numpy.ndarray", lambda: seqpack.token_logprobs(np.zeros((5, 4)), [0, 2, 5], PACKED_IDS)),
    ("input_ids", "NoneType", lambda: packed_token_logprobs(LOGITS, None, [0, 2, 5])),  # the op: ids required
    ("input_ids", "numpy.ndarray", lambda: seqpack.token_logprobs(LOGITS, [0, 2, 5], PACKED_IDS.numpy())),
    ("hidden", "numpy.ndarray", lambda: seqpack.token_logprobs(np.zeros((5, 2)), [0, 2, 5], PACKED_IDS,
                                                               weight=torch.zeros(4, 2))),
    ("weight", "numpy.ndarray", lambda: seqpack.token_logprobs(torch.zeros(5, 2), [0, 2, 5], PACKED_IDS,
                                                               weight=np.zeros((4, 2)))),
    ("bias", "numpy.ndarray", lambda: seqpack.token_logprobs(torch.zeros(5, 2), [0, 2, 5], PACKED_IDS,
                                                             weight=torch.zeros(4, 2), bias=np.zeros(4))),
    ("input_ids", "numpy.ndarray", lambda: next_token_targets(np.zeros(5), torch.tensor([0, 2, 5]),
                                                              torch.tensor([0, 2, 5]), 5)),
]


@pytest.mark.parametrize("name, got, call", NOT_TENSOR_CALLS,
                         ids=[f"{i}-{c[0]}" for i, c in enumerate(NOT_TENSOR_CALLS)])
def test_arrays_and_none_where_a_tensor_is_expected_are_a_type_error(name, got, call):
    with pytest.raises(TypeError, match=rf"{name} must be a torch.Tensor.*, got {got}"):
        call()


# ---------------------------------------------------------------- pad values


class _ThroughTheOperator(TorchFunctionMode):
    """Makes seqpack call its registered torch operators (the torch.compile path)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("through_op", [False, True])
@pytest.mark.parametrize("pad", [2**53 + 1, 2**63 - 1, -2**63, -100])
def test_integer_pads_are_exact(pad, through_op):
    ids = torch.tensor([[5, 6, 0], [7, 0, 0]])
    with _ThroughTheOperator() if through_op else torch.no_grad():
        packed = seqpack.pack_sequences(ids, seq_lens=[2, 1], pad_multiple=2, pad_value=pad)
        assert packed["input"].tolist() == [5, 6, 7, pad]
        assert packed.unpack(packed["input"], fill=pad).tolist() == [[5, 6, pad], [7, pad, pad]]
    static = seqpack.pack_sequences_static(ids, [2, 1], max_tokens=4, pad_value=pad)
    assert static["input"].tolist() == [5, 6, 7, pad]
    big = seqpack.pack_dataset([[1, 2, 3]], pack_size=4, padding_idx=pad, label_pad=pad)[0]
    assert big["input_ids"].tolist() == [1, 2, 3, pad] and big["labels"].tolist()[-1] == pad


def test_float_pads_keep_working_through_autograd():
    logits = torch.randn(2, 3, 4, requires_grad=True)
    packed = seqpack.pack_sequences(logits, seq_lens=[2, 1], pad_multiple=2, pad_value=float("-inf"))
    assert torch.isinf(packed["input"][3]).all()
    packed["input"][:3].sum().backward()
    assert logits.grad[0, :2].eq(1).all() and logits.grad[0, 2].eq(0).all()
    nan = seqpack.pack_sequences(torch.zeros(1, 2), seq_lens=[1], pad_multiple=2, pad_value=float("nan"))
    assert torch.isnan(nan["input"][1])
    assert seqpack.pack_sequences(torch.zeros(1, 2, dtype=torch.bool), seq_lens=[1], pad_multiple=2,
                                  pad_value=True)["input"].tolist() == [False, True]


@pytest.mark.parametrize("dtype, pad, kind, message", [
    (torch.int64, 2**63, ValueError, r"pad_value = 9223372036854775808 is outside torch.int64's range"),
    (torch.int32, 2**31, ValueError, r"pad_value = 2147483648 is outside torch.int32's range "
                                     r"\[-2147483648, 2147483647\]"),
    (torch.uint8, -1, ValueError, r"pad_value = -1 is outside torch.uint8's range \[0, 255\]"),
    (torch.bool, 2, ValueError, r"pad_value = 2 is outside torch.bool's range"),
    (torch.int64, 1.5, ValueError, r"pad_value must be an integer for torch.int64, got 1.5"),
    (torch.int64, float("nan"), ValueError, r"pad_value must be an integer for torch.int64, got nan"),
    (torch.int64, float("-inf"), ValueError, r"pad_value must be an integer for torch.int64, got -inf"),
    (torch.int64, "a", TypeError, r"pad_value must be a number, got str"),
    (torch.float32, None, TypeError, r"pad_value must be a number, got NoneType"),
])
def test_pad_values_are_checked_against_the_dtype(dtype, pad, kind, message):
    x = torch.zeros(1, 2, dtype=dtype)
    with pytest.raises(kind, match=message):
        seqpack.pack_sequences(x, seq_lens=[1], pad_multiple=2, pad_value=pad)
    with pytest.raises(kind, match=message.replace("pad_value", "pad_values\\['input'\\]")):
        seqpack.pack_sequences(x, seq_lens=[1], pad_multiple=2, pad_values={"input": pad})
    with pytest.raises(kind, match=message):
        seqpack.pack_sequences_static(x, [1], max_tokens=2, pad_value=pad)
    packed = seqpack.pack_sequences(x, seq_lens=[1], pad_multiple=2)
    with pytest.raises(kind, match=message.replace("pad_value", "fill")):
        packed.unpack(packed["input"], fill=pad)


def test_integral_float_pads_are_accepted_for_integer_tensors():
    packed = seqpack.pack_sequences(torch.tensor([[3, 4]]), seq_lens=[1], pad_multiple=2, pad_value=-100.0)
    assert packed["input"].tolist() == [3, -100] and packed["input"].dtype == torch.int64


def test_dataset_pads_must_fit_int64():
    with pytest.raises(ValueError, match="padding_idx must fit in int64"):
        seqpack.pack_dataset([[1, 2, 3]], pack_size=4, padding_idx=2**63)
    with pytest.raises(TypeError, match="label_pad must be an int, got float"):
        seqpack.pack_dataset([[1, 2, 3]], pack_size=4, label_pad=-100.5)


# ---------------------------------------------------------------- configuration files


def test_a_misspelled_config_path_is_file_not_found(tmp_path):
    for path in ("configs/grpo_math_1B.yaml", str(tmp_path / "missing.yml"), "cfg.json", "conf/base"):
        with pytest.raises(FileNotFoundError, match="no such config file"):
            load(path)
    assert load("policy:\n  sequence_packing: {enabled: false}\n").schema == "nemo_rl"


@pytest.mark.parametrize("depth", [500, 1000])
def test_deeply_nested_configs_are_refused_by_depth(depth):
    text = "".join("  " * i + "k:\n" for i in range(depth)) + "  " * depth + "k: 1\n"
    with pytest.raises(ValueError, match=r"nested deeper than 100 levels"):
        load(text)
    with pytest.raises(ValueError, match=r"nested deeper than 100 levels"):
        load("[" * depth + "]" * depth)
    nested = leaf = {}
    for _ in range(depth):
        leaf["k"] = {}
        leaf = leaf["k"]
    with pytest.raises(ValueError, match=r"nested deeper than 100 levels"):
        load({"policy": nested})


def test_zero_roll_dynamic_batching_cap_is_not_called_missing():
    base = {"actor_train": {"use_dynamic_batching_in_train": True, "max_tokens_per_microbatch_in_train": 0}}
    with pytest.raises(ValueError, match="max_tokens_per_microbatch_in_train: must be >= 1, got 0"):
        load(base)
    with pytest.raises(ValueError, match="strategy_name: must be a non-empty string"):
        load({"actor_train": {"strategy_args": {"strategy_name": ""}}})


# ---------------------------------------------------------------- BatchedDataDict


SP_ARGS = {"max_tokens_per_microbatch": 100, "input_key": "input_ids", "input_lengths_key": "input_lengths",
           "algorithm": "modified_first_fit_decreasing", "sequence_length_pad_multiple": 1}
DB_ARGS = {"max_tokens_per_microbatch": 100, "input_key": "input_ids", "input_lengths_key": "input_lengths",
           "sequence_length_round": 4}


@pytest.mark.parametrize("data, what", [
    (BatchedDataDict(), "no keys"),
    (BatchedDataDict(input_ids=torch.zeros(0, 8, dtype=torch.long), input_lengths=torch.zeros(0, dtype=torch.long)),
     "no rows"),
])
def test_empty_batched_data_dicts_are_named(data, what):
    for kwargs in ({}, {"batch_size": 2}, {"sequence_packing_args": SP_ARGS}, {"dynamic_batching_args": DB_ARGS}):
        with pytest.raises(ValueError, match=f"the BatchedDataDict has {what}"):
            data.shard_by_batch_size(2, **kwargs)
    with pytest.raises(ValueError, match=f"the BatchedDataDict has {what}"):
        data.make_microbatch_iterator(2)
    for call in (data.get_microbatch_iterator_dynamic_shapes_len,
                 data.get_microbatch_iterator_for_packable_sequences_len,
                 data.make_microbatch_iterator_with_dynamic_shapes):
        with pytest.raises(ValueError, match="micro-batch metadata for exactly one global batch"):
            call()


def test_batched_data_dict_int_arguments():
    data = BatchedDataDict(input_ids=torch.ones(4, 8, dtype=torch.long), input_lengths=torch.tensor([3, 4, 5, 6]))
    with pytest.raises(ValueError, match=r"batch_idx must be an int in \[0, 2\), got 5"):
        data.get_batch(5, batch_size=2)
    with pytest.raises(TypeError, match="batch_size must be an int, got float"):
        data.shard_by_batch_size(2, batch_size=2.0)
    with pytest.raises(TypeError, match="microbatch_size must be an int, got NoneType"):
        data.make_microbatch_iterator(None)
    with pytest.raises(ValueError, match="pad_multiple must be positive, got 0"):
        data.shard_by_batch_size(1, sequence_packing_args=SP_ARGS)[0][0].get_batch(0) \
            .make_packed_microbatch_iterator(pad_multiple=0)


# ---------------------------------------------------------------- dynamic batching width


def test_optimal_dynamic_batching_checks_the_width_at_planning():
    data = BatchedDataDict(input_ids=torch.ones(4, 100, dtype=torch.long),
                           input_lengths=torch.tensor([120, 50, 30, 20]))
    with pytest.raises(ValueError, match=r"input_lengths\[0\] = 120 exceeds max_seqlen = 100"):
        data.shard_by_batch_size(1, dynamic_batching_args={**DB_ARGS, "max_tokens_per_microbatch": 512,
                                                           "sequence_length_round": 64, "rule": "optimal"})
    with pytest.raises(ValueError, match=r"input_lengths\[0\] = 120 exceeds max_seqlen = 100"):
        seqpack.plan_dynamic_batching([120, 50], 1, 512, 64, rule="optimal", max_seqlen=100)
    # Lengths that fit, rounded past the width: micro-batches are clamped to it, and iterate.
    data["input_lengths"] = torch.tensor([98, 50, 30, 20])
    (shard,), _ = data.shard_by_batch_size(1, dynamic_batching_args={
        **DB_ARGS, "max_tokens_per_microbatch": 512, "sequence_length_round": 64, "rule": "optimal"})
    assert max(max(c) for c in shard.micro_batch_lengths) <= 100
    assert sum(mb["input_ids"].shape[0] for mb in shard.make_microbatch_iterator_with_dynamic_shapes()) == 4


# ---------------------------------------------------------------- varlen attention


def test_varlen_attention_arguments():
    q = torch.randn(5, 2, 8)
    cu = [0, 3, 5]
    with pytest.raises(TypeError, match="q must be a floating-point tensor, got torch.int64"):
        seqpack.varlen_attention(q.long(), q.long(), q.long(), cu, cu, 3, 3)
    with pytest.raises(TypeError, match="q must be a torch.Tensor.*got numpy.ndarray"):
        seqpack.varlen_attention(q.numpy(), q, q, cu, cu, 3, 3)
    empty = torch.randn(5, 0, 8)
    with pytest.raises(ValueError, match="q must have at least one head"):
        seqpack.varlen_attention(empty, empty, empty, cu, cu, 3, 3)
    with pytest.raises(ValueError, match="k must have at least one head"):
        seqpack.varlen_attention(q, empty, empty, cu, cu, 3, 3)
    no_dim = torch.randn(5, 2, 0)
    with pytest.raises(ValueError, match="head dim"):
        seqpack.varlen_attention(no_dim, no_dim, no_dim, cu, cu, 3, 3)
    unbounded = seqpack.varlen_attention(q, q, q, cu, cu, 3, 3, window_size=(-1, -1))
    assert torch.equal(seqpack.varlen_attention(q, q, q, cu, cu, 3, 3, window_size=None), unbounded)
    with pytest.raises(TypeError, match=r"window_size must be a \(left, right\) pair of ints"):
        seqpack.varlen_attention(q, q, q, cu, cu, 3, 3, window_size=3)
    with pytest.raises(TypeError, match=r"window_size\[0\] must be an int, got float"):
        seqpack.varlen_attention(q, q, q, cu, cu, 3, 3, window_size=(1.5, 0))


# ---------------------------------------------------------------- bool masks


def _torch_bytes_allocated(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(max(e.self_cpu_memory_usage, 0) for e in prof.events())


def _numpy_peak(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_bool_masks_are_read_in_their_own_dtype():
    rows, width = 4, 2**22  # 16 MiB of bool
    mask = torch.zeros(rows, width, dtype=torch.bool)
    mask[:, :3] = True
    data = torch.zeros(rows, width, dtype=torch.uint8)
    # The packed output is 12 rows; before, `mask != 0` made an int64 copy (8x the mask).
    assert _torch_bytes_allocated(lambda: seqpack.pack_sequences(data, attention_mask=mask)) <= 2 * mask.numel()
    batch = {"attention_mask": mask, "input_ids": torch.zeros(rows, 1)}
    assert _numpy_peak(lambda: roll.dynamic_batching_shard(batch, 1, 64, 1)) <= 0.5 * mask.numel()
    packed = seqpack.pack_sequences(data, attention_mask=mask)
    assert packed.cu_seqlens.tolist() == [0, 3, 6, 9, 12]


# ---------------------------------------------------------------- int64 overflow

M64 = 2**63 - 1


def _thd_plan_with_positions_from(first):
    plan = seqpack.pack_sequences(IDS, seq_lens=[2, 3])._plan
    state = plan.__getstate__()
    positions = np.array(state[6]).copy()
    positions[0, 2] = first
    type(plan).__new__(type(plan)).__setstate__(state[:6] + (positions,) + state[7:])


@pytest.mark.parametrize("call, message", [
    (lambda: _thd_plan_with_positions_from(2**63 - 2), r"positions \(first \+ count\) overflow int64"),
    (lambda: _thd_plan_with_positions_from(-5), r"positions \(first \+ count\) overflow int64 or are negative"),
])
def test_a_pickled_plan_whose_positions_overflow_is_refused(call, message):
    # Issue 26: position ids first + i of a tampered pickle wrapped around int64.
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("call, message", [
    # Above 65,536 sequences the cap-aware greedy summed these unchecked; below,
    # Karmarkar-Karp refused them under its own name.
    (lambda: seqpack.plan_micro_batches([3 * 10**9] * 70_000, 6 * 10**9, attention_coeff=1),
     r"^\[seqpack.plan_micro_batches\] sum of workloads \(attention_coeff \* s \+ s \* s\) overflows int64"),
    (lambda: seqpack.plan_micro_batches([3 * 10**9] * 4, 6 * 10**9, attention_coeff=1),
     r"^\[seqpack.plan_micro_batches\] sum of workloads"),
    (lambda: seqpack.sequence_workloads([2**32], 1), r"s \* s = 4294967296 \* 4294967296 overflows int64"),
    (lambda: seqpack.PackingMetrics().calculate_stats_only([M64, 1], [[0], [1]], M64),
     r"\[seqpack.packing_stats\] sum of sequence_lengths overflows int64"),
    (lambda: seqpack.karmarkar_karp([M64, 1], 2, False), r"\[seqpack.karmarkar_karp\] sum of seqlen_list overflows"),
    (lambda: seqpack.get_packer("first_fit_decreasing", M64).pack([M64, 1]),
     r"\[seqpack.first_fit_decreasing\] sum of sequence_lengths overflows int64"),
    (lambda: seqpack.plan_step([M64, 1], 1, M64), r"\[seqpack.plan_step\] sum of lengths overflows int64"),
    (lambda: seqpack.plan_dynamic_batching([M64, 1], 1, M64, 1), r"the padded token count .* overflows int64"),
    (lambda: PackedLayout.from_lengths([1, M64]), r"the packed length \(sum of padded lengths\) overflows int64"),
])
def test_int64_overflows_name_what_overflowed(call, message):
    # Issue 26: every sum of user values that can pass int64 is checked, and the
    # error names it (they read "sum of lengths overflows int64" or "product
    # overflows int64" whatever overflowed, or wrapped around).
    with pytest.raises(ValueError, match=message):
        call()
