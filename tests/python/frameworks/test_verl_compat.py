"""seqpack.verl against the behaviour verl's own ``tests/utils/test_seqlen_balancing.py``
checks (issue 17): the round trip through ``rearrange_micro_batches`` /
``get_reverse_idx``, ``prepare_dynamic_batch`` / ``restore_dynamic_batch`` on a
``DataProto``, ``get_group_balanced_partitions``' uid groups, and the micro-batch
counts of ``min_num_micro_batch`` / ``same_micro_num_in_dp`` on real gloo ranks.

verl (and tensordict) are not installed: ``TensorDictStandIn`` and
``DataProtoStandIn`` below carry just the interface seqpack duck-types (keys and
row indexing; ``.batch``, ``.non_tensor_batch``, ``.meta_info`` and
``select_idxs``). Where seqpack differs on purpose (the strict cap), the test
checks both the default and verl's rules: ``strict=False`` (the released verl,
compared with verl itself in ``test_verl_released.py``) and ``strict="soft_cap"``
(verl before verl#7553).
"""

import copy

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _gloo import run_world
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack.testing import reference
from seqpack.verl import (ceildiv, get_group_balanced_partitions, get_reverse_idx, get_seqlen_balanced_partitions,
                          prepare_dynamic_batch, rearrange_micro_batches, restore_dynamic_batch, roundup_divisible)

# 20 rows of width 100 (verl's test shape) whose split into ceil(1644 / 300) = 6
# micro-batches (verl before verl#7553) puts 319 tokens in one: the strict cap needs 7.
CASE_300 = [78, 77, 85, 86, 79, 84, 85, 84, 73, 79, 87, 90, 84, 90, 76, 89, 87, 74, 73, 84]


class TensorDictStandIn:
    """The slice of tensordict's ``TensorDict`` that seqpack and these tests use."""

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

    def __getitem__(self, index):
        if isinstance(index, str):
            return self._data[index]
        index = torch.as_tensor(index, dtype=torch.long)
        return TensorDictStandIn({k: v[index] for k, v in self._data.items()}, [len(index)])

    def __setitem__(self, key, value):
        assert value.shape[0] == self.batch_size[0]
        self._data[key] = value


def cat_tensordicts(parts):
    return TensorDictStandIn({k: torch.cat([p[k] for p in parts]) for k in parts[0].keys()},
                             [sum(len(p) for p in parts)])


class DataProtoStandIn:
    """verl's ``DataProto``: tensors in a TensorDict, NumPy object arrays, meta_info;
    ``select_idxs`` shares ``meta_info`` as verl's does."""

    def __init__(self, batch=None, non_tensor_batch=None, meta_info=None):
        self.batch = batch
        self.non_tensor_batch = non_tensor_batch if non_tensor_batch is not None else {}
        self.meta_info = meta_info if meta_info is not None else {}

    @classmethod
    def from_single_dict(cls, data, meta_info=None):
        tensors = {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
        arrays = {k: np.asarray(v, dtype=object) for k, v in data.items() if isinstance(v, np.ndarray)}
        rows = next(iter(tensors.values())).shape[0]
        return cls(TensorDictStandIn(tensors, [rows]), arrays, meta_info)

    def __len__(self):
        return len(self.batch)

    def select_idxs(self, idxs):
        index = torch.as_tensor(idxs, dtype=torch.long)
        arrays = {k: v[index.numpy()] for k, v in self.non_tensor_batch.items()}
        return DataProtoStandIn(self.batch[index], arrays, self.meta_info)


def padded_mask(lengths, width, seed=0):
    """``[B, width]`` with each row's real tokens after a random left padding (as
    verl's ``create_random_mask`` lays them out)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        left = int(torch.randint(0, width - n + 1, (1,), generator=g))
        mask[row, left:left + n] = 1
    return mask


def random_lengths(rows, width, seed):
    """Between half and nine tenths of ``width`` real tokens per row (verl's test data)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(width // 2, width * 9 // 10 + 1, (rows,), generator=g).tolist()


def soft_cap_expected(lengths, cap, *, min_num=None, divisor=None, balance=True, group=1):
    """verl's rule before verl#7553 (``strict="soft_cap"``), written from its
    documented behaviour on top of the pure-Python Karmarkar-Karp transcription:
    count, partitions and order."""
    work = [24576 * s + s * s for s in lengths]
    units = [sum(work[i:i + group]) for i in range(0, len(work), group)]
    count = min(len(units), ceildiv(sum(lengths), cap))
    if min_num is not None:
        count = max(min_num, count)
    if divisor is not None:
        count = roundup_divisible(count, divisor)
    parts = reference.get_seqlen_balanced_partitions(units, count, equal_size=False)
    if balance:
        parts.sort(key=lambda p: (sum(units[g] for g in p), p[0]), reverse=True)
        parts = parts[::2][::-1] + parts[1::2]
    return [[g * group + j for g in p for j in range(group)] for p in parts]


def tokens_of(idx, lengths):
    return [sum(lengths[i] for i in p) for p in idx]


# ------------------------------------------------------------------ rearrange_micro_batches / get_reverse_idx


@pytest.mark.parametrize("strict", [True, False, "soft_cap"])
def test_round_trip_of_a_tensordict_through_rearrange_and_reverse_idx(strict):
    lengths = random_lengths(20, 100, seed=1)
    data = TensorDictStandIn({"input_ids": torch.randint(0, 10, (20, 100)), "attention_mask": padded_mask(lengths, 100)},
                             [20])
    micro_batches, idx = rearrange_micro_batches(data, max_token_len=300, strict=strict)
    assert all(isinstance(mb, TensorDictStandIn) for mb in micro_batches)
    merged = cat_tensordicts(micro_batches)
    back = merged[torch.tensor(get_reverse_idx([i for p in idx for i in p]))]
    for key in ("input_ids", "attention_mask"):
        torch.testing.assert_close(back[key], data[key])
    assert all(p == sorted(p) for p in idx)
    if strict != "soft_cap":
        assert max(tokens_of(idx, lengths)) <= 300


def test_strict_cap_and_verls_count_on_the_300_token_case():
    mask = padded_mask(CASE_300, 100, seed=3)
    batch = {"attention_mask": mask, "input_ids": torch.arange(20)[:, None].expand(20, 100)}
    assert sum(CASE_300) == 1644 and ceildiv(1644, 300) == 6
    _, loose = rearrange_micro_batches(batch, max_token_len=300, strict="soft_cap")
    assert len(loose) == 6 and max(tokens_of(loose, CASE_300)) == 319  # the old verl's split exceeds its cap
    assert loose == soft_cap_expected(CASE_300, 300)
    _, released = rearrange_micro_batches(batch, max_token_len=300, strict=False)
    assert len(released) == 7 and max(tokens_of(released, CASE_300)) <= 300  # verl#7553 grows the count
    micro_batches, strict = rearrange_micro_batches(batch, max_token_len=300)
    assert len(strict) == 7 and max(tokens_of(strict, CASE_300)) <= 300
    assert [int(mb["attention_mask"].sum()) for mb in micro_batches] == tokens_of(strict, CASE_300)
    assert sorted(i for p in strict for i in p) == list(range(20))


@settings(max_examples=80, deadline=None)
@given(lengths=st.lists(st.integers(0, 64), min_size=1, max_size=40), cap=st.integers(64, 300),
       min_num=st.sampled_from([None, 1, 3]), divisor=st.sampled_from([None, 2]), balance=st.booleans(),
       group=st.sampled_from([1, 2]))
def test_soft_cap_is_the_older_verls_rule(lengths, cap, min_num, divisor, balance, group):
    if len(lengths) % group:
        lengths = lengths + [1]
    if sum(lengths) == 0:  # verl asks KK for 0 partitions there; seqpack makes one micro-batch
        lengths[0] = 1
    batch = {"attention_mask": padded_mask(lengths, 64), "row": torch.arange(len(lengths))}
    try:
        expected = soft_cap_expected(lengths, cap, min_num=min_num, divisor=divisor, balance=balance, group=group)
    except ValueError:  # more partitions than rows (groups): verl asserts, seqpack raises ValueError
        with pytest.raises(ValueError, match="micro-batches need at least"):
            rearrange_micro_batches(batch, cap, None, divisor, True, min_num, balance, group, strict="soft_cap")
        return
    micro_batches, idx = rearrange_micro_batches(batch, cap, None, divisor, True, min_num, balance, group,
                                                 strict="soft_cap")
    assert idx == expected
    assert [mb["row"].tolist() for mb in micro_batches] == idx


def test_force_group_size_keeps_consecutive_rows_together_in_both_modes():
    lengths = [30, 10, 25, 25, 5, 40, 20, 20, 35, 15, 10, 10]
    batch = {"attention_mask": padded_mask(lengths, 50)}
    for strict in (True, False, "soft_cap"):
        _, idx = rearrange_micro_batches(batch, max_token_len=90, force_group_size=2, strict=strict)
        assert all(i + 1 in p for p in idx for i in p if i % 2 == 0), idx
        assert sorted(i for p in idx for i in p) == list(range(12))
        if strict != "soft_cap":
            assert max(tokens_of(idx, lengths)) <= 90
    with pytest.raises(ValueError, match="not a multiple of force_group_size=5"):
        rearrange_micro_batches(batch, max_token_len=90, force_group_size=5)
    with pytest.raises(ValueError, match=r"consecutive rows \(force_group_size\) hold 135 tokens"):
        rearrange_micro_batches(batch, max_token_len=90, force_group_size=6)


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.integers(0, 10**6), min_size=1, max_size=30), k=st.integers(1, 6), equal=st.booleans())
def test_get_seqlen_balanced_partitions_is_verls(values, k, equal):
    if equal:
        values = values[:len(values) - len(values) % k] or values * k
    if len(values) < k:
        return
    assert get_seqlen_balanced_partitions(values, k, equal_size=equal) == \
        reference.get_seqlen_balanced_partitions(values, k, equal)


def test_get_reverse_idx_inverts_lists_arrays_and_tensors():
    assert get_reverse_idx([3, 0, 2, 1]) == [1, 3, 2, 0] and get_reverse_idx([]) == []
    arr = get_reverse_idx(np.array([3, 0, 2, 1], dtype=np.int32))
    assert arr.dtype == np.int32 and arr.tolist() == [1, 3, 2, 0]
    t = get_reverse_idx(torch.tensor([3, 0, 2, 1]))
    assert isinstance(t, torch.Tensor) and t.tolist() == [1, 3, 2, 0]
    for bad in ([0, 0], [1, 2], [-1, 0]):
        with pytest.raises(ValueError, match="permutation"):
            get_reverse_idx(bad)


# ------------------------------------------------------------------ prepare_dynamic_batch / restore_dynamic_batch


def proto_case(rows=20, width=100, seed=2):
    lengths = random_lengths(rows, width, seed)
    proto = DataProtoStandIn.from_single_dict(
        {"input_ids": torch.randint(0, 10, (rows, width)), "attention_mask": padded_mask(lengths, width, seed),
         "labels": np.array([f"label_{i}" for i in range(rows)], dtype=object)},
        meta_info={"temperature": 1.0, "tags": ["a"]})
    return proto, lengths


@pytest.mark.parametrize("strict", [True, False, "soft_cap"])
def test_prepare_and_restore_dynamic_batch_on_a_dataproto(strict):
    proto, lengths = proto_case()
    micro_batches, idx = prepare_dynamic_batch(proto, max_token_len=300, strict=strict)
    assert all(isinstance(mb, DataProtoStandIn) for mb in micro_batches)
    assert idx == rearrange_micro_batches(proto.batch, 300, strict=strict)[1]  # the same plan as on the tensors
    for mb, part in zip(micro_batches, idx):
        assert mb.non_tensor_batch["labels"].tolist() == [f"label_{i}" for i in part]
        assert mb.meta_info == proto.meta_info and mb.meta_info is not proto.meta_info
        assert mb.meta_info["tags"] is not proto.meta_info["tags"]  # a deep copy, as verl makes
    input_ids = torch.cat([mb.batch["input_ids"] for mb in micro_batches])
    torch.testing.assert_close(restore_dynamic_batch(input_ids, idx), proto.batch["input_ids"])
    restored = restore_dynamic_batch({"ids": input_ids, "labels": np.concatenate(
        [mb.non_tensor_batch["labels"] for mb in micro_batches])}, idx)
    assert restored["labels"].tolist() == proto.non_tensor_batch["labels"].tolist()
    if strict == "soft_cap":
        assert len(idx) == min(20, ceildiv(sum(lengths), 300))
    else:
        assert max(tokens_of(idx, lengths)) <= 300


def test_prepare_dynamic_batch_takes_mappings_and_tensordicts():
    proto, _ = proto_case(rows=12, width=40, seed=4)
    plain = {k: proto.batch[k] for k in proto.batch.keys()}
    dicts, idx = prepare_dynamic_batch(plain, max_token_len=80, num_batches_divided_by=2, min_num_micro_batch=4)
    assert all(isinstance(mb, dict) for mb in dicts) and len(idx) % 2 == 0 and len(idx) >= 4
    tds, idx2 = prepare_dynamic_batch(proto.batch, max_token_len=80, num_batches_divided_by=2, min_num_micro_batch=4)
    assert idx2 == idx and all(isinstance(mb, TensorDictStandIn) for mb in tds)
    protos, idx3 = rearrange_micro_batches(proto, max_token_len=80, num_batches_divided_by=2, min_num_micro_batch=4)
    assert idx3 == idx and all(isinstance(mb, DataProtoStandIn) for mb in protos)


def test_restore_dynamic_batch_nested_tensors_dummy_rows_and_errors():
    idx = [[2, 0], [3], [1]]
    rows = [torch.arange(n + 1, dtype=torch.float) for n in (2, 0, 3, 1)]  # row r of the concatenation, in idx order
    nested = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    back = restore_dynamic_batch(nested, idx)
    assert [t.tolist() for t in back.unbind()] == [[0.0], [0.0, 1.0], [0.0, 1.0, 2.0], [0.0, 1.0, 2.0, 3.0]]
    # A step_plan's empty micro-batch ran one dummy row: it is dropped.
    out = torch.tensor([20, 0, -1, 30, 10])
    assert restore_dynamic_batch(out, [[2, 0], [], [3], [1]]).tolist() == [0, 10, 20, 30]
    assert restore_dynamic_batch(torch.tensor([20, 0, 30, 10]), [[2, 0], [], [3], [1]]).tolist() == [0, 10, 20, 30]
    with pytest.raises(ValueError, match="data has 3 rows but batch_idx_list holds 4 indices"):
        restore_dynamic_batch(torch.arange(3), idx)
    with pytest.raises(ValueError, match="permutation"):
        restore_dynamic_batch(torch.arange(4), [[0, 1], [1, 2]])
    # Prefix-reuse passes each list the rank's rows (trees in layout order): a row's passes summed, dummies dropped.
    passes = torch.nested.as_nested_tensor([torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0, 2.0]),
                                            torch.tensor([0.0, 3.0]), torch.tensor([4.0, 0.0, 0.0]),
                                            torch.tensor([-9.0])], layout=torch.jagged)
    back = restore_dynamic_batch(passes, [[1, 0], [1, 0], []])
    assert [t.tolist() for t in back.unbind()] == [[4.0, 0.0, 2.0], [1.0, 3.0]]
    assert restore_dynamic_batch({"x": torch.tensor([[1.0], [2.0], [3.0], [4.0]])}, [[0, 1], [0, 1]])["x"].tolist() \
        == [[4.0], [6.0]]


def test_prepare_dynamic_batch_follows_a_step_plan_with_dummy_dataprotos():
    from seqpack import CostModel, plan_step

    lengths = [9, 1, 8, 2, 7, 9, 8, 7, 1, 1]  # 5 rows per mini-batch cannot fill 2 ranks x 3 micro-batches
    plan = plan_step(lengths, dp_size=2, max_tokens=10, cost=CostModel.verl(), mini_batches=2, min_micro_batches=3)
    dummies = 0
    for rank in range(2):
        rows = plan.rank_rows(rank, 0)
        mask = padded_mask([lengths[r] for r in rows], 10)
        proto = DataProtoStandIn.from_single_dict(
            {"input_ids": torch.tensor(rows)[:, None].expand(-1, 10), "attention_mask": mask,
             "response_mask": mask.clone(), "uid": np.array(rows, dtype=object)}, meta_info={"rank": rank})
        micro_batches, idx = prepare_dynamic_batch(proto, 10, step_plan=plan, dp_rank=rank, mini_batch=0)
        assert len(micro_batches) == 3 and idx == plan.local_micro_batches(rank, 0)
        dummies += sum(not part for part in idx)
        for mb, part in zip(micro_batches, idx):
            assert mb.meta_info == {"rank": rank}
            if not part:  # a dummy: one real token, no loss
                assert int(mb.batch["attention_mask"].sum()) == 1 and int(mb.batch["response_mask"].sum()) == 0
        outputs = torch.cat([mb.batch["input_ids"][:, 0] for mb in micro_batches])
        assert restore_dynamic_batch(outputs, idx).tolist() == list(rows)
    assert dummies >= 1


def test_dataproto_errors_are_named():
    proto, _ = proto_case(rows=4, width=10)
    proto.batch = TensorDictStandIn({"input_ids": proto.batch["input_ids"]}, [4])
    with pytest.raises(ValueError, match="attention_mask"):
        prepare_dynamic_batch(proto, max_token_len=30)
    proto, _ = proto_case(rows=4, width=10)
    proto.non_tensor_batch["labels"] = np.array(["x"] * 5, dtype=object)
    with pytest.raises(ValueError, match="share dimension 0"):
        prepare_dynamic_batch(proto, max_token_len=30)


# ------------------------------------------------------------------ get_group_balanced_partitions


def assert_groups_kept(partitions, uids, k):
    assert len(partitions) == k
    assert sorted(i for p in partitions for i in p) == list(range(len(uids)))
    home = {}
    for rank, part in enumerate(partitions):
        assert part == sorted(part)
        for i in part:
            assert home.setdefault(uids[i], rank) == rank, f"uid {uids[i]} split across partitions"


@pytest.mark.parametrize("lengths, uids, k", [
    ([100] * 4 + [200] * 4 + [150] * 4 + [50] * 4, [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4, 2),
    ([100, 200, 150, 50, 300, 250], [0, 1, 2, 3, 4, 5], 2),
    ([100, 100, 200, 200, 150, 150, 50, 50, 300, 300, 250, 250, 180, 180, 120, 120],
     [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7], 4),
])
def test_group_balanced_partitions_keep_uid_groups(lengths, uids, k):
    partitions = get_group_balanced_partitions(lengths, uids, k_partitions=k)
    assert_groups_kept(partitions, uids, k)
    groups = len(set(uids))
    assert all(len({uids[i] for i in p}) == groups // k for p in partitions)  # equal groups per rank, as verl
    # The groups' workloads are balanced with verl's KK, exactly.
    work = {}
    for s, u in zip(lengths, uids):
        work[u] = work.get(u, 0) + 24576 * s + s * s
    order = list(dict.fromkeys(uids))
    expected = reference.get_seqlen_balanced_partitions([work[u] for u in order], k, True)
    assert partitions == [sorted(i for g in p for i, u in enumerate(uids) if u == order[g]) for p in expected]


def test_group_balanced_partitions_on_grpo_uids_and_errors():
    rng = np.random.default_rng(0)
    uids = np.array([f"prompt-{p}" for p in rng.permutation(16) for _ in range(4)], dtype=object)
    uids = uids[rng.permutation(len(uids))]  # a uid's responses need not be contiguous
    lengths = rng.integers(10, 500, len(uids))
    assert_groups_kept(get_group_balanced_partitions(lengths, uids, 4), uids.tolist(), 4)
    uneven = get_group_balanced_partitions([5, 5, 9, 1, 1], ["a", "a", "b", "c", "c"], 2, equal_size=False)
    assert_groups_kept(uneven, ["a", "a", "b", "c", "c"], 2)
    with pytest.raises(ValueError, match="3 uid groups is not a multiple of k_partitions=2"):
        get_group_balanced_partitions([5, 5, 9, 1, 1], ["a", "a", "b", "c", "c"], 2)
    with pytest.raises(ValueError, match="2 uid groups cannot fill k_partitions=3"):
        get_group_balanced_partitions([1, 2, 3], [0, 0, 1], 3)
    with pytest.raises(ValueError, match="same length"):
        get_group_balanced_partitions([1, 2, 3], [0, 1], 1)


# ------------------------------------------------------------------ gloo: min_num_micro_batch, same_micro_num_in_dp


def _verl_count_rank(rank, world):
    # Each rank holds a different number of rows (20 + 5 * rank), as in verl's test.
    rows, cap = 20 + 5 * rank, 300
    lengths = random_lengths(rows, 100, seed=42 + rank)
    data = TensorDictStandIn({"input_ids": torch.randint(0, 10, (rows, 100)),
                              "attention_mask": padded_mask(lengths, 100, seed=rank)}, [rows])
    local = min(rows, ceildiv(sum(lengths), cap))
    counts = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    dist.all_gather(counts, torch.tensor([local]))
    largest = max(int(c) for c in counts)

    def check_round_trip(micro_batches, idx):
        merged = cat_tensordicts(micro_batches)
        back = merged[torch.tensor(get_reverse_idx([i for p in idx for i in p]))]
        torch.testing.assert_close(back["input_ids"], data["input_ids"])

    def run(**kwargs):
        out = rearrange_micro_batches(data, max_token_len=cap, dp_group=dist.group.WORLD, **kwargs)
        check_round_trip(*out)
        return out

    # verl's rule before verl#7553 (strict="soft_cap"): its two cases give exactly its counts.
    micro_batches, _ = run(same_micro_num_in_dp=False, min_num_micro_batch=4, strict="soft_cap")
    assert local >= 4 and len(micro_batches) == max(local, 4) == local
    micro_batches, _ = run(same_micro_num_in_dp=True, strict="soft_cap")
    assert len(micro_batches) == largest
    # The released verl's (strict=False): at least that count, the same on every rank, within the cap.
    micro_batches, idx = run(same_micro_num_in_dp=True, strict=False)
    dist.all_gather(counts, torch.tensor([len(micro_batches)]))
    assert len({int(c) for c in counts}) == 1 and len(micro_batches) >= largest
    assert max(tokens_of(idx, lengths)) <= cap
    # The default (strict): the same count on every rank, never over the cap, at least verl's.
    micro_batches, idx = run(same_micro_num_in_dp=True)
    dist.all_gather(counts, torch.tensor([len(micro_batches)]))
    assert len({int(c) for c in counts}) == 1 and len(micro_batches) >= largest
    assert max(tokens_of(idx, lengths)) <= cap
    micro_batches, idx = run(same_micro_num_in_dp=False, min_num_micro_batch=4)
    assert len(micro_batches) >= max(local, 4) and max(tokens_of(idx, lengths)) <= cap
    # verl agrees only with a dp_group: without one the count is the rank's own.
    assert len(rearrange_micro_batches(data, max_token_len=cap, strict="soft_cap")[0]) == local
    alone = rearrange_micro_batches(data, max_token_len=cap, strict=False)[1]
    assert alone == rearrange_micro_batches(data, cap, dp_group=dist.group.WORLD, same_micro_num_in_dp=False,
                                            strict=False)[1]
    # DataProto level, the count agreed the same way.
    proto = DataProtoStandIn(data, {"uid": np.arange(rows).astype(object)}, {"step": rank})
    protos, idx = prepare_dynamic_batch(proto, max_token_len=cap, dp_group=dist.group.WORLD, strict="soft_cap")
    assert len(protos) == largest and all(mb.meta_info == {"step": rank} for mb in protos)


def test_gloo_same_micro_num_in_dp_and_min_num_micro_batch():
    run_world(2, _verl_count_rank, timeout_s=120)


def test_the_stand_ins_behave_like_verls_types():
    proto, _ = proto_case(rows=3, width=4)
    sub = proto.select_idxs([2, 0])
    assert sub.meta_info is proto.meta_info and sub.non_tensor_batch["labels"].tolist() == ["label_2", "label_0"]
    assert "attention_mask" in proto.batch and len(proto) == 3 and copy.copy(sub.batch["input_ids"]).shape == (2, 4)
