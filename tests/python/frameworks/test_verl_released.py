"""``seqpack.verl`` with ``strict=False`` against the released verl (0.9.1) itself:
``rearrange_micro_batches`` (one rank and 2 gloo ranks with ``dp_group``),
``prepare_dynamic_batch``, ``get_group_balanced_partitions`` and
``get_seqlen_balanced_partitions`` give verl's row indices exactly, and raise
(a ``ValueError`` naming the argument) where verl raises.

Two sources of verl's answers: verl itself where it is importable (the ``live``
tests draw fresh cases), and ``data/verl_cases.json``, recorded from it by
``data/make_verl_cases.py``, everywhere. Two differences are on purpose (see
docs/verl.md): a ``max_token_len`` below the padded width is taken (seqpack gives
verl's answer on the same lengths without the padding), and an all-padding batch
that verl's Karmarkar-Karp fails on (``k = 0``) becomes ``num_batches_divided_by``
(or one) micro-batches.
"""

import importlib.util
import json
import pathlib
import random
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _gloo import RankPool
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack.verl import (get_group_balanced_partitions, get_seqlen_balanced_partitions, prepare_dynamic_batch,
                          rearrange_micro_batches)

DATA = pathlib.Path(__file__).resolve().parent / "data"


def _load_cases_module():
    spec = importlib.util.spec_from_file_location("make_verl_cases", DATA / "make_verl_cases.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("make_verl_cases", module)
    spec.loader.exec_module(module)
    return module


cases = _load_cases_module()
RECORDED = json.loads((DATA / "verl_cases.json").read_text())
# What a seqpack error names: the argument or the rule broken.
NAMED = ("max_token_len", "force_group_size", "min_num_micro_batch", "num_batches_divided_by", "no rows",
         "k_partitions", "uid", "strict")


def live_verl():
    # ImportError too: verl is installed without its dependencies (a missing one skips, not fails).
    return pytest.importorskip("verl.utils.seqlen_balancing", exc_type=ImportError)


def seqpack_outcome(fn):
    try:
        parts = fn()
    except ValueError as exc:
        assert any(name in str(exc) for name in NAMED), f"the error names no argument: {exc}"
        return {"raises": "ValueError"}
    return {"parts": [[int(i) for i in p] for p in parts]}


def seqpack_rearrange(case):
    args = cases.rearrange_args(case)
    return seqpack_outcome(lambda: rearrange_micro_batches(cases.batch_of(case["lengths"], case["width"]), *args,
                                                           strict=False)[1])


def check_rearrange(case, verl, ours):
    """``ours`` is what seqpack must give where verl gave ``verl``."""
    case = cases.with_defaults(case)
    lengths = case["lengths"]
    if "unpadded" in verl:  # verl refuses a cap below the padded width; seqpack reads the real lengths
        assert verl["raises"] == "AssertionError" and case["max_token_len"] < case["width"]
        verl = verl["unpadded"]
    if verl.get("raises") == "IndexError":
        # All padding: verl's count is 0 and its Karmarkar-Karp fails; seqpack makes the smallest count.
        assert lengths and not any(lengths)
        step = case["num_batches_divided_by"] or 1
        if len(lengths) // case["force_group_size"] < step:
            assert ours == {"raises": "ValueError"}
        else:
            assert len(ours["parts"]) == step and sorted(sum(ours["parts"], [])) == list(range(len(lengths)))
        return
    if "raises" in verl:
        assert ours == {"raises": "ValueError"}, (case, verl)
    else:
        assert ours == verl, case


# ------------------------------------------------------------------ one rank


def test_recorded_cases_give_verls_indices():
    single = RECORDED["rearrange_micro_batches"]
    assert RECORDED["verl_version"] == "0.9.1" and len(single) >= 300
    kinds = {"parts": 0, "raises": 0, "unpadded": 0}
    for case in single:
        check_rearrange(case, case["verl"], seqpack_rearrange(case))
        kinds["unpadded" if "unpadded" in case["verl"] else next(iter(case["verl"]))] += 1
    assert min(kinds.values()) >= 10, kinds  # successes, raises and refused caps all come up


def test_recorded_issue_case_grows_in_steps_of_the_divisor():
    # 71 rows, cap 72, num_batches_divided_by=2: verl grows the count until its parts fit.
    case = RECORDED["rearrange_micro_batches"][1]
    assert len(case["lengths"]) == 71 and case["max_token_len"] == 72 and case["num_batches_divided_by"] == 2
    parts = seqpack_rearrange(case)["parts"]
    assert parts == case["verl"]["parts"] and len(parts) % 2 == 0
    assert max(sum(case["lengths"][i] for i in p) for p in parts) <= 72
    soft = rearrange_micro_batches(cases.batch_of(case["lengths"], 72), 72, num_batches_divided_by=2,
                                   strict="soft_cap")[1]
    assert len(soft) < len(parts) and max(sum(case["lengths"][i] for i in p) for p in soft) > 72


def test_live_random_batches_give_verls_indices():
    live_verl()
    rng = random.Random(2027)
    for _ in range(300):
        case = cases.random_case(rng, max_rows=rng.choice([12, 40, 80]))
        check_rearrange(case, cases.verl_record(case), seqpack_rearrange(case))


def test_live_hand_cases_and_tensordict_batches():
    live_verl()
    from tensordict import TensorDict

    for case in map(cases.with_defaults, cases.HAND_CASES):
        verl = cases.verl_record(case)
        check_rearrange(case, verl, seqpack_rearrange(case))
        if "parts" in verl:  # a TensorDict gives TensorDicts of the same rows
            batch = cases.batch_of(case["lengths"], case["width"], tensordict=True)
            mbs, idx = rearrange_micro_batches(batch, *cases.rearrange_args(case), strict=False)
            assert idx == verl["parts"] and all(isinstance(mb, TensorDict) for mb in mbs)
            assert [mb["input_ids"][:, 0].tolist() for mb in mbs] == idx


def test_live_prepare_dynamic_batch_on_verls_dataproto():
    seqlen_balancing = live_verl()
    from verl.protocol import DataProto

    rng = random.Random(7)
    for _ in range(40):
        case = cases.random_case(rng)
        case.update(force_group_size=1, max_token_len=max(case["max_token_len"], case["width"]))
        batch = cases.batch_of(case["lengths"], case["width"])
        rows = len(case["lengths"])
        proto = DataProto.from_single_dict({**batch, "uid": np.array([f"u{i}" for i in range(rows)], dtype=object)},
                                           meta_info={"step": 3, "tags": ["a"]})
        cap, _, divisor, _, min_num, balance, _ = cases.rearrange_args(case)
        verl = cases.outcome(lambda: seqlen_balancing.prepare_dynamic_batch(proto, cap, None, divisor, True, min_num,
                                                                            balance)[1])
        ours = seqpack_outcome(lambda: prepare_dynamic_batch(proto, cap, None, divisor, True, min_num, balance,
                                                             strict=False)[1])
        check_rearrange(case, verl, ours)
        if "parts" not in verl:
            continue
        theirs, _ = seqlen_balancing.prepare_dynamic_batch(proto, cap, None, divisor, True, min_num, balance)
        mine, _ = prepare_dynamic_batch(proto, cap, None, divisor, True, min_num, balance, strict=False)
        for a, b in zip(theirs, mine):
            assert isinstance(b, DataProto) and b.meta_info == a.meta_info and b.meta_info is not proto.meta_info
            assert b.non_tensor_batch["uid"].tolist() == a.non_tensor_batch["uid"].tolist()
            for key in ("input_ids", "attention_mask"):
                assert torch.equal(a.batch[key], b.batch[key])


def test_recorded_group_balanced_partitions():
    groups = RECORDED["get_group_balanced_partitions"]
    assert sum("parts" in c["verl"] for c in groups) >= 10 and sum("raises" in c["verl"] for c in groups) >= 10
    for case in groups:
        ours = seqpack_outcome(lambda: get_group_balanced_partitions(case["seqlen_list"], case["uid_list"],
                                                                     case["k_partitions"]))
        assert ours == ({"raises": "ValueError"} if "raises" in case["verl"] else case["verl"]), case


def test_live_group_balanced_and_seqlen_balanced_partitions():
    seqlen_balancing = live_verl()
    rng = random.Random(11)
    for _ in range(150):
        case = cases.random_group_case(rng)
        verl = cases.verl_group_balanced(case)
        ours = seqpack_outcome(lambda: get_group_balanced_partitions(case["seqlen_list"], case["uid_list"],
                                                                     case["k_partitions"]))
        assert ours == ({"raises": "ValueError"} if "raises" in verl else verl), case
    for _ in range(150):
        values = [rng.randint(0, 10**6) for _ in range(rng.randint(1, 30))]
        k, equal = rng.randint(1, 8), rng.random() < 0.5
        verl = cases.outcome(lambda: seqlen_balancing.get_seqlen_balanced_partitions(values, k, equal))
        ours = cases.outcome(lambda: get_seqlen_balanced_partitions(values, k, equal))
        assert ours == verl or ("raises" in verl and ours == {"raises": "ValueError"}), (values, k, equal)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 32), min_size=1, max_size=40), extra=st.integers(0, 64),
       divisor=st.sampled_from([None, 1, 2, 3]), min_num=st.sampled_from([None, 0, 1, 4]), balance=st.booleans(),
       group=st.sampled_from([1, 2]))
def test_strict_false_fits_the_cap_in_steps_of_the_divisor(lengths, extra, divisor, min_num, balance, group):
    lengths = lengths[:len(lengths) - len(lengths) % group] or [1] * group
    cap = max(32, extra + max(lengths))
    try:
        idx = rearrange_micro_batches(cases.batch_of(lengths, 32), cap, None, divisor, True, min_num, balance, group,
                                      strict=False)[1]
    except ValueError as exc:  # the count passed the rows (groups)
        assert "micro-batches are needed" in str(exc) or "force_group_size" in str(exc)
        return
    assert sorted(sum(idx, [])) == list(range(len(lengths))) and all(idx)
    assert max(sum(lengths[i] for i in p) for p in idx) <= cap
    first = max(min(len(lengths) // group, -(-sum(lengths) // cap)), min_num or 0)
    assert len(idx) % (divisor or 1) == 0 and len(idx) >= first
    assert all(p[i] % group == i % group and p[i + 1] == p[i] + 1 for p in idx for i in range(0, len(p), group)
               if group > 1)


def test_strict_takes_true_false_and_soft_cap_only():
    batch = cases.batch_of([7] * 8, 7)
    assert len(rearrange_micro_batches(batch, 8, strict=np.bool_(False))[1]) == 8  # verl#7553: 7 parts cannot fit
    assert len(rearrange_micro_batches(batch, 8, strict="soft_cap")[1]) == 7
    for bad in ("verl", None, 2):
        with pytest.raises(ValueError, match="strict must be True"):
            rearrange_micro_batches(batch, 8, strict=bad)


# ------------------------------------------------------------------ 2 gloo ranks


def _dp_case(rank, world, case, impl):
    return cases.dp_rank_case(rank, world, case, impl)


def _dp_alone(rank, world, fault):
    """One rank's input fails seqpack's own checks (where verl would leave the other
    rank waiting in its all-reduce), or the ranks ask for different rules."""
    lengths, width = ([5, 6, 7, 8], 8) if rank == 0 else ([3, 4, 5, 6, 7, 8], 8)
    kwargs = {"strict": False}
    if rank == 1 and fault == "narrow":  # a cap below this rank's padded width: taken
        width = 24
    if rank == 1 and fault == "long_row":
        lengths, width = [3, 4, 5, 6, 7, 17], 24
    if rank == 1 and fault == "group":
        kwargs["force_group_size"] = 4
    if rank == 1 and fault == "divisor":
        kwargs["num_batches_divided_by"] = 2
    if rank == 1 and fault == "mode":
        kwargs["strict"] = "soft_cap"
    if rank == 1 and fault == "bad_mode":
        kwargs["strict"] = "verl"
    try:
        return rearrange_micro_batches(cases.batch_of(lengths, width), 16, dist.group.WORLD, **kwargs)[1]
    except ValueError as exc:
        return f"ValueError: {exc}"


@pytest.fixture(scope="module")
def pool():
    with RankPool(2) as p:
        yield p.wait_ready()


def first_count(case):
    """verl's count before it grows: the largest rank's, rounded up to the divisor."""
    size, cap, divisor = case["force_group_size"], case["max_token_len"], case["num_batches_divided_by"] or 1
    count = max(min(len(r["lengths"]) // size, -(-sum(r["lengths"]) // cap)) for r in case["ranks"])
    count = max(count, case["min_num_micro_batch"] or 0)
    return -(-count // divisor) * divisor


def test_gloo_recorded_dp_cases(pool):
    dp = RECORDED["rearrange_micro_batches_dp"]
    grown = 0
    for case in dp:
        outs = pool.run(_dp_case, case, "seqpack", timeout_s=20)
        assert [o.raised for o in outs] == [None, None], [o.trace for o in outs]
        assert [o.value for o in outs] == case["verl"], case
        if case["dp_group"] and case["same_micro_num_in_dp"] and "parts" in case["verl"][0]:
            count = len(case["verl"][0]["parts"])
            assert count == len(case["verl"][1]["parts"])
            grown += count > first_count(case)  # a rank's parts over the cap grew both ranks' count
    assert grown >= 2 and sum("raises" in o for c in dp for o in c["verl"]) >= 10


def test_gloo_live_dp_cases_against_verl(pool):
    live_verl()
    rng = random.Random(5)
    for _ in range(20):
        case = cases.random_dp_case(rng)
        theirs = pool.run(_dp_case, case, "verl", timeout_s=60)
        ours = pool.run(_dp_case, case, "seqpack", timeout_s=20)
        assert [o.raised for o in theirs + ours] == [None] * 4, [o.trace for o in theirs + ours]
        assert [o.value for o in ours] == [o.value for o in theirs], case


@pytest.mark.parametrize("fault", ["none", "narrow", "long_row", "group", "divisor", "mode", "bad_mode"])
def test_gloo_a_rank_failing_alone_stops_every_rank(pool, fault):
    outs = [o.value for o in pool.run(_dp_alone, fault, timeout_s=20)]
    assert all(o is not None for o in outs)
    if fault in ("none", "narrow"):  # rank 0's count 2, rank 1's 3: both run 3
        assert [len(o) for o in outs] == [3, 3], outs
        return
    assert all(isinstance(o, str) and o.startswith("ValueError") for o in outs), outs
    named = {"long_row": "max_token_len", "group": "force_group_size", "divisor": "num_batches_divided_by",
             "mode": "strict", "bad_mode": "strict"}[fault]
    assert named in outs[1] or named in outs[0], outs
