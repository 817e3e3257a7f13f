"""Issue 26, item 8: NumPy scalars, 0-d arrays and 0-d tensors are accepted wherever
a Python number is, with the same result, through one helper
(``seqpack._lengths``: ``as_positive_int`` / ``as_int64`` / ``as_int`` for integers,
``as_real`` for real numbers, ``as_temperature`` for softmax temperatures); bools,
strings, ``None``, arrays of several numbers, complex numbers and NaN are refused by
name, with the value as given. ``temperature=np.float32(0.5)`` used to be refused
("must be a positive finite number, got 0.5"), ``temperature=1e-320`` reached the
C++ core (refused there with no value), a CostModel coefficient of ``10**400`` gave a
bare OverflowError and ``flops_per_second=torch.tensor(1e15)`` a ValueError."""

import dataclasses
import math

import numpy as np
import pytest
import torch
from test_unclear_errors import INT_ARGS, LOGITS, PACKED_IDS

import seqpack
from seqpack import _lengths
from seqpack._lengths import as_int64, as_positive_int, as_real, as_temperature
from seqpack.frameworks.config import load
from seqpack.planning.cost import CostModel
from seqpack.training.loss import ClippedPGLoss, calculate_kl


def same(a, b) -> bool:
    """Equal results: tensors and arrays elementwise (NaN equal to NaN), containers
    and dataclasses item by item, objects without ``__eq__`` by their attributes,
    anything else by ``==``."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b):  # public fields (private ones are caches)
        return type(a) is type(b) and all(same(getattr(a, f.name), getattr(b, f.name))
                                          for f in dataclasses.fields(a) if not f.name.startswith("_"))
    if hasattr(a, "__dict__") and type(a) is type(b) and type(a).__eq__ is object.__eq__:
        return same(vars(a), vars(b))
    return a == b


INT_FORMS = [
    ("numpy.int64", np.int64),
    ("numpy.uint8", np.uint8),
    ("0-d array", np.array),
    ("0-d tensor", torch.tensor),
    ("0-d int32 tensor", lambda v: torch.tensor(v, dtype=torch.int32)),
]


def _valid_int(call):
    """The first of a few small ints the call accepts, and its result."""
    for v in (2, 1, 4, 0, 8):
        try:
            return v, call(v)
        except (TypeError, ValueError):
            continue
    pytest.fail("no small valid int for this call: give the case inputs it accepts")


@pytest.mark.parametrize("form_name, form", INT_FORMS, ids=[f for f, _ in INT_FORMS])
@pytest.mark.parametrize("name, call, valid", INT_ARGS, ids=[f"{i}-{c[0]}" for i, c in enumerate(INT_ARGS)])
def test_every_int_argument_takes_numpy_and_0d_tensor_ints(name, call, valid, form_name, form):
    v, expected = _valid_int(call)
    assert same(call(form(v)), expected), f"{name} = {form_name}({v}) gives another result than {v}"


BAD_INT_FORMS = [np.float64(2.0), torch.tensor(2.0), torch.tensor(True), np.array(True), np.array([1, 2]),
                 torch.tensor([2]), np.array(2.5), complex(2, 0)]


@pytest.mark.parametrize("bad", BAD_INT_FORMS, ids=repr)
@pytest.mark.parametrize("name, call, valid", INT_ARGS[::4], ids=[f"{i}-{c[0]}" for i, c in enumerate(INT_ARGS[::4])])
def test_float_bool_and_multi_element_numbers_are_refused_as_ints_by_name(name, call, valid, bad):
    with pytest.raises(TypeError) as info:
        call(bad)
    assert name in str(info.value) and "must be an int" in str(info.value), str(info.value)


def test_the_int_helpers():
    for form in (np.int16(-5), np.array(-5), torch.tensor(-5), torch.tensor(-5, dtype=torch.int8)):
        assert as_int64(form, "pad") == -5 and type(as_int64(form, "pad")) is int
        assert _lengths.as_int(form, "seed") == -5
    assert as_positive_int(np.array(7, dtype=np.uint64), "k") == 7
    with pytest.raises(TypeError, match=r"k must be an int, got torch.Tensor of dtype torch.bool: tensor\(True\)"):
        as_positive_int(torch.tensor(True), "k")
    with pytest.raises(TypeError, match=r"k must be an int, got numpy.ndarray of dtype float32"):
        as_positive_int(np.array(3, dtype=np.float32), "k")
    with pytest.raises(TypeError, match=r"k must be an int, got a numpy.ndarray of shape \(1,\)"):
        as_positive_int(np.array([3]), "k")
    with pytest.raises(ValueError, match="pad must fit in int64"):
        as_int64(-2**63 - 1, "pad")
    with pytest.raises(ValueError, match=r"k must be positive, got 0"):
        as_positive_int(torch.tensor(0), "k")
    with pytest.raises(ValueError, match="meta device"):
        as_positive_int(torch.tensor(3, device="meta"), "k")


# ---------------------------------------------------------------- real numbers

HIDDEN, WEIGHT = torch.randn(5, 3, generator=torch.Generator().manual_seed(0)), torch.randn(4, 3)
RAND_LOGITS = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
Q = torch.randn(6, 2, 4, generator=torch.Generator().manual_seed(2))
LP, REF = torch.tensor([-1.0, -30.0, -0.5]), torch.tensor([-2.0, -0.1, -0.5])


def _pg(key):
    return lambda v: ClippedPGLoss({key: v}).cfg[key]


def _metrics_time(v):
    m = seqpack.PackingMetrics()
    m.update([1, 2], [[0, 1]], 4, packing_time=v)
    return m.packing_times


# (argument name, call taking the number, a valid value exact in float32, None allowed)
REAL_ARGS = [
    ("temperature", lambda v: seqpack.token_logprobs(RAND_LOGITS, [0, 2, 5], PACKED_IDS, temperature=v,
                                                     return_entropy=True), 0.5, False),
    ("temperature", lambda v: seqpack.token_logprobs(HIDDEN, [0, 2, 5], PACKED_IDS, weight=WEIGHT,
                                                     temperature=v), 0.75, False),
    ("temperature", lambda v: seqpack.SequencePackingLossWrapper(seqpack.NLLLoss(), cu_seqlens_q=[0, 2, 5],
                                                                 temperature=v).temperature, 2.0, False),
    ("per_micro_batch", lambda v: CostModel(v, 1.0, 0.5), 3.0, False),
    ("per_token", lambda v: CostModel(0.0, v, 0.5), 3.0, False),
    ("per_token_squared", lambda v: CostModel(0.0, 1.0, v), 0.25, False),
    ("flops_per_second", lambda v: CostModel.from_model(64, 2, 4, flops_per_second=v), 2.0**50, True),
    ("per_micro_batch", lambda v: CostModel.from_model(64, 2, 4, per_micro_batch=v), 0.5, False),
    ("softmax_scale", lambda v: seqpack.varlen_attention(Q, Q, Q, [0, 2, 6], [0, 2, 6], 4, 4, softmax_scale=v,
                                                         backend="reference"), 0.25, True),
    ("ratio_clip_min", _pg("ratio_clip_min"), 0.25, False),
    ("entropy_coef", _pg("entropy_coef"), 0.5, False),
    ("ratio_clip_c", _pg("ratio_clip_c"), 3.0, True),
    ("kl_input_clamp_value", _pg("kl_input_clamp_value"), 8.0, True),
    ("input_clamp_value", lambda v: calculate_kl(LP, REF, "k3", input_clamp_value=v), 4.0, True),
    ("output_clamp_value", lambda v: calculate_kl(LP, REF, "k1", output_clamp_value=v), 0.5, True),
    ("packing_time", _metrics_time, 0.125, True),
]
REAL_FORMS = [
    ("numpy.float32", np.float32),
    ("numpy.float64", np.float64),
    ("0-d array", np.array),
    ("0-d tensor", torch.tensor),
    ("0-d float64 tensor", lambda v: torch.tensor(v, dtype=torch.float64)),
    ("0-d bfloat16 tensor", lambda v: torch.tensor(v, dtype=torch.bfloat16)),
]


@pytest.mark.parametrize("form_name, form", REAL_FORMS, ids=[f for f, _ in REAL_FORMS])
@pytest.mark.parametrize("name, call, good, none_ok", REAL_ARGS, ids=[f"{i}-{a[0]}" for i, a in enumerate(REAL_ARGS)])
def test_every_real_argument_takes_numpy_and_0d_tensor_numbers(name, call, good, none_ok, form_name, form):
    expected = call(good)
    assert same(call(form(good)), expected), f"{name} = {form_name}({good}) gives another result than {good}"
    if float(good).is_integer():  # an integer where a real number is read: NumPy and tensor ints too
        assert same(call(np.int64(good)), expected) and same(call(torch.tensor(int(good))), expected)


BAD_REALS = [(True, TypeError, "bool"), ("0.5", TypeError, "str"), (None, TypeError, "NoneType"),
             (np.array([0.5, 0.5]), TypeError, "shape (2,)"), (torch.tensor([0.5]), TypeError, "shape (1,)"),
             (1j, TypeError, "complex"), (torch.tensor(0.5j), TypeError, "complex"),
             (math.nan, ValueError, "nan"), (np.float32("nan"), ValueError, "nan"), (-math.inf, ValueError, "inf")]


@pytest.mark.parametrize("bad, kind, shown", BAD_REALS, ids=[repr(b) for b, _, _ in BAD_REALS])
@pytest.mark.parametrize("name, call, good, none_ok", REAL_ARGS, ids=[f"{i}-{a[0]}" for i, a in enumerate(REAL_ARGS)])
def test_bad_real_numbers_are_refused_by_name(name, call, good, none_ok, bad, kind, shown):
    if bad is None and none_ok:
        call(None)  # None means "the default" here
        return
    with pytest.raises((TypeError, ValueError)) as info:
        call(bad)
    message = str(info.value)
    assert issubclass(info.type, kind), f"{info.type.__name__}: {message}"
    assert name in message and shown in message, message


@pytest.mark.parametrize("bad", [1e-320, 1e-39, 0.0, -0.5, 1e39, np.float64(5e-324), torch.tensor(1e-40)])
def test_temperature_is_a_normal_float32_and_the_message_shows_it(bad):
    # 1e-320 became 0 in float32 and was refused inside C++, with no value; 1e-40
    # (a float32 subnormal) passed and gave an infinite 1 / temperature.
    for call in (lambda: seqpack.token_logprobs(LOGITS, [0, 2, 5], PACKED_IDS, temperature=bad),
                 lambda: seqpack.token_logprobs(HIDDEN, [0, 2, 5], PACKED_IDS, weight=WEIGHT, temperature=bad),
                 lambda: seqpack.SequencePackingLossWrapper(seqpack.NLLLoss(), cu_seqlens_q=[0, 2, 5],
                                                            temperature=bad)):
        with pytest.raises(ValueError, match=r"^temperature must be a positive finite number in \[1.1754944e-38, "
                                             r"3.4028235e\+38\] .*got ") as info:
            call()
        assert _lengths.shown(bad) in str(info.value)
    assert as_temperature(np.finfo(np.float32).tiny) == float(np.finfo(np.float32).tiny)
    assert as_temperature(float(np.finfo(np.float32).max)) == float(np.finfo(np.float32).max)


def test_as_real_rules_and_messages():
    assert as_real(np.float16(0.5), "x") == 0.5 and type(as_real(np.float16(0.5), "x")) is float
    assert as_real(10**20, "x") == 1e20
    assert as_real(math.inf, "x", finite=False) == math.inf
    with pytest.raises(ValueError, match=r"^x must be a finite number \(it must fit in a float64\), got 1000"):
        as_real(10**400, "x")
    with pytest.raises(ValueError, match=r"^x must be a finite number > 0 and <= 1, got np.float32\(1.5\)"):
        as_real(np.float32(1.5), "x", minimum=0, minimum_inclusive=False, maximum=1)
    with pytest.raises(ValueError, match=r"^x must be a finite number >= 0, got tensor\(-1.\) \(torch.Tensor\)"):
        as_real(torch.tensor(-1.0), "x", minimum=0)
    with pytest.raises(ValueError, match="^x must be a number, got nan"):
        as_real(math.nan, "x", finite=False)


def test_cost_model_numbers():
    # flops_per_second=torch.tensor(1e15) used to be a ValueError.
    rate = torch.tensor(1e15, dtype=torch.float64)
    assert CostModel.from_model(4096, 32, 32, flops_per_second=rate) == CostModel.from_model(4096, 32, 32,
                                                                                              flops_per_second=1e15)
    with pytest.raises(ValueError, match=r"per_token must be a finite number >= 0 \(it must fit in a float64\)"):
        CostModel(0.0, 10**400, 0.0)  # was a bare OverflowError
    with pytest.raises(ValueError, match=r"flops_per_second is too small"):
        CostModel.from_model(4096, 32, 32, flops_per_second=5e-324)


def test_config_integers_may_be_numpy_or_0d_tensors():
    def cfg(cap):
        return {"actor_rollout_ref": {"actor": {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": cap}}}

    expected = load(cfg(4096)).micro_batching("actor")
    for form in (np.int64(4096), np.array(4096), torch.tensor(4096)):
        assert load(cfg(form)).micro_batching("actor") == expected
    assert load(cfg(4096)).balance_batch_kwargs(np.int64(4)) == {"k_partitions": 4, "equal_size": True}


def test_step_plan_indices_may_be_numpy_or_0d_tensors():
    plan = seqpack.plan_step([5, 3, 4, 2], dp_size=2, max_tokens=8, mini_batches=2)
    for r in (np.int8(1), torch.tensor(1), np.array(1)):
        assert plan.rank(r) == plan.rank(1) and plan.rank_rows(1, np.int64(0)) == plan.rank_rows(1, 0)
        assert plan.local_micro_batches(r, torch.tensor(1)) == plan.local_micro_batches(1, 1)
    with pytest.raises(TypeError, match="r must be an int, got float"):
        plan.rank(1.0)


def test_pad_values_may_be_numpy_or_0d_tensors():
    ids, logits = torch.arange(6).view(2, 3), torch.randn(2, 3)
    for x, pad, forms in [(ids, -100, (np.int64(-100), np.array(-100), torch.tensor(-100))),
                          (logits, -1.5, (np.float32(-1.5), np.array(-1.5), torch.tensor(-1.5)))]:
        expected = seqpack.pack_sequences(x, seq_lens=[2, 1], pad_multiple=2, pad_value=pad)
        for form in forms:
            got = seqpack.pack_sequences(x, seq_lens=[2, 1], pad_multiple=2, pad_value=form)
            assert torch.equal(got["input"], expected["input"])
    with pytest.raises(TypeError, match="pad_value must be a number, got numpy.ndarray"):
        seqpack.pack_sequences(ids, seq_lens=[2, 1], pad_value=np.array([1, 2]))
