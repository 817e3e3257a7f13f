"""Hostile or careless input (issue 16): no crash, no hang, no silent wrong answer.
Each test failed before its fix; the crash and hang cases run in a child process
with a timeout, so a regression fails the test instead of the suite."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import seqpack
from seqpack.planning.balance import sorted_stride_partition


def run_child(code: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout)


def test_a_racing_writer_never_corrupts_memory():
    # Another thread flips the lengths between valid and out-of-range values while
    # the planners run with the GIL released: errors or odd bins are fine, a crash
    # is not (best fit and first fit segfaulted 3 runs in 3 when the array was read
    # in place).
    child = run_child("""
        import threading, time, numpy as np, seqpack
        rng = np.random.default_rng(0)
        lengths = rng.integers(1, 1000, 200_000)
        good, bad = lengths.copy(), np.where(rng.random(200_000) < 0.5, 10**15, -3)
        stop = False
        def writer():  # whole-array copies: NumPy releases the GIL for them, so they overlap the reads
            while not stop:
                np.copyto(lengths, bad)
                np.copyto(lengths, good)
        t = threading.Thread(target=writer); t.start()
        try:
            end = time.time() + 3
            while time.time() < end:
                for name in ("best_fit_decreasing", "first_fit_decreasing", "modified_first_fit_decreasing"):
                    try:
                        seqpack.get_packer(name, 1000).pack_arrays(lengths)
                    except ValueError:
                        pass
                try:
                    seqpack.karmarkar_karp(lengths, 64, False)
                except ValueError:
                    pass
        finally:
            stop = True
            t.join()
        print("ok")
    """, timeout=300)
    assert child.returncode == 0 and child.stdout.strip().endswith("ok"), (child.returncode, child.stderr[-2000:])


def test_non_native_byte_order_is_read_by_value():
    assert sorted_stride_partition(np.array([1, 256, 3], ">i2"), 3) == sorted_stride_partition([1, 256, 3], 3)
    assert seqpack.get_packer("first_fit_decreasing", 100).pack(np.array([10, 20], ">i8")) == [[1, 0]]
    assert seqpack.karmarkar_karp(np.array([5, 1, 4], ">u4"), 2, False) == seqpack.karmarkar_karp([5, 1, 4], 2, False)


@pytest.mark.parametrize("algorithm", ["concatenative", "greedy_sequential"])
def test_sums_near_int64_do_not_wrap_around(algorithm):
    cap = 2**63 - 1
    bins = seqpack.get_packer(algorithm, cap).pack([2**62] * 3)
    assert bins == [[0], [1], [2]]  # 2^62 + 2^62 > cap: never one bin over capacity


def test_huge_bin_counts_are_refused():
    with pytest.raises(ValueError, match="Cannot create 9223372036854775807 bins"):
        seqpack.get_packer("first_fit_decreasing", 100, min_bin_count=2**63 - 1).pack([1, 2, 3])
    with pytest.raises(ValueError, match="bins"):
        seqpack.get_packer("first_fit_decreasing", 100, bin_count_multiple=2**62 + 1).pack([1, 2, 3])


@pytest.mark.parametrize("call", [lambda: seqpack.tensors.cp.cp_restore_order([0, 8], 2**63 - 1),
                                  lambda: seqpack.tensors.cp.cp_partition_indices([0, 8], 2**63 - 1, 0)],
                         ids=["cp_restore_order", "cp_partition_indices"])
def test_cp_size_whose_double_overflows_is_refused(call):
    # 2 * cp_size wrapped: cp_restore_order ran 2^63 iterations, cp_partition_indices returned [].
    with pytest.raises(ValueError, match="cp_size: 2 \\* cp_size chunks must fit in int64"):
        call()


def test_config_billion_laughs_finishes():
    # Nine levels of aliases, each ten of the previous: walking every path never ended.
    levels = ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, 10):
        levels.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    doc = "\n".join(levels) + "\n"
    assert len(doc) < 700
    child = run_child(f"""
        from seqpack import config
        try:
            config.load({doc!r})
        except config.ConfigError as e:
            print("ConfigError", str(e)[:200])
        print("done")
    """, timeout=60)
    assert child.returncode == 0 and "done" in child.stdout, child.stderr[-2000:]


@pytest.mark.parametrize("args, kwargs", [(([2**62, 1], 2, 2**63 - 1, 1), {}),
                                          (([2**62, 1], 2, 2**63 - 1, 1), {"rule": "optimal"}),
                                          (([1, 2], 1, 2**63 - 1, 2**62), {})])
def test_dynamic_batching_never_wraps_around(args, kwargs):
    # Before: padded_tokens = -2^63, a negative micro-batch length, two rows of 2^62
    # in one micro-batch capped at 2^63 - 1.
    try:
        plan = seqpack.plan_dynamic_batching(*args, **kwargs)
    except ValueError as e:
        assert "overflows int64" in str(e)
        return
    cap = args[2]
    assert plan.padded_tokens >= 0
    for lengths, ranges in zip(plan.micro_batch_lengths, plan.micro_batch_indices):
        for n, (a, b) in zip(lengths, ranges):
            assert n >= 0 and (b - a) * n <= cap


def test_balance_metrics_check_their_inputs():
    from seqpack.planning.metrics import dp_balance_metrics

    with pytest.raises(ValueError, match="overflows int64"):  # was min = max = -2^63
        dp_balance_metrics([2**62] * 4, [[0, 1], [2, 3]], "x")
    with pytest.raises(ValueError, match="index 0 appears twice"):
        dp_balance_metrics([1, 2, 3, 4], [[0, 0], [2, 3]], "x")
    with pytest.raises(ValueError, match="1 are missing"):
        dp_balance_metrics([1, 2, 3, 4], [[0], [2, 3]], "x")
    with pytest.raises(ValueError, match=r"seqlen_list\[1\] = -2 is negative"):
        dp_balance_metrics([1, -2, 3, 4], [[0, 1], [2, 3]], "x")


def test_pack_sequences_refuses_a_cp_size_whose_double_overflows():
    import torch

    with pytest.raises(ValueError, match="cp_size: 2 \\* cp_size chunks must fit in int64"):  # was: 0 rows
        seqpack.pack_sequences({"input_ids": torch.arange(8)[None]}, seq_lens=[8], pad_multiple=2, cp_size=2**63 - 1)


def test_an_indexable_non_mapping_batch_is_refused_not_iterated_forever():
    # ROLL's DataProto has __len__ and __getitem__ that never raises IndexError:
    # "attention_mask" in proto iterated it forever.
    child = run_child("""
        import numpy as np
        from seqpack import roll

        class Indexable:
            def __len__(self):
                return 4
            def __getitem__(self, i):
                return i
        class DataProto(Indexable):  # read as a DataProto now, but it cannot select rows
            batch, non_tensor_batch, meta_info = {"attention_mask": np.ones((4, 3))}, {}, {}
        for stand_in in (Indexable(), DataProto()):
            try:
                roll.dynamic_batching_shard(stand_in, 2, 100, 1)
            except TypeError as e:
                print("TypeError", e)
    """, timeout=60)
    assert child.returncode == 0 and "TypeError origin_batch must be a mapping" in child.stdout, child.stderr[-2000:]
    assert "TypeError origin_batch looks like a DataProto" in child.stdout and "no select_idxs()" in child.stdout


def test_verl_refuses_values_with_other_row_counts():
    import torch

    from seqpack.verl import rearrange_micro_batches

    with pytest.raises(ValueError, match="share dimension 0"):  # rows 3 and 4 of x were dropped
        rearrange_micro_batches({"attention_mask": torch.ones(3, 4), "x": torch.arange(5)}, max_token_len=8)


def test_get_batch_refuses_an_index_out_of_range():
    import torch

    from seqpack import BatchedDataDict

    data = BatchedDataDict(x=torch.arange(8))
    assert data.get_batch(1, batch_size=4)["x"].tolist() == [4, 5, 6, 7]
    for bad in (-1, 2, 1.0):  # -1 gave empty rows with the last batch's metadata; 2 an IndexError
        with pytest.raises(ValueError, match=r"batch_idx must be an int in \[0, 2\)"):
            data.get_batch(bad, batch_size=4)


def test_restore_results_order_needs_a_permutation():
    import torch

    from seqpack import roll

    with pytest.raises(ValueError, match="exactly once"):
        roll.restore_results_order({"x": torch.arange(3)}, [[0, 1], [1]])


def test_the_loss_wrapper_refuses_data_narrower_than_the_sequences():
    import torch

    from seqpack.loss import NLLLoss, SequencePackingLossWrapper

    data = {"input_ids": torch.zeros(1, 6, dtype=torch.long), "token_mask": torch.ones(1, 6),
            "sample_mask": torch.ones(1)}
    for fused in (False, True):  # 6 columns were used silently for a 10-token sequence
        with pytest.raises(ValueError, match="has 6 columns but cu_seqlens_q has a sequence of 10 tokens"):
            SequencePackingLossWrapper(NLLLoss(), None, [0, 10], fused=fused)(torch.zeros(10, 5), data, 1, 5)


@pytest.mark.parametrize("yaml_text, match", [
    ("policy:\n  sequence_packing:\n    enabled: true\n    train_mb_tokens: 4096\n    algoritm: first_fit_decreasing\n",
     r"policy.sequence_packing.algoritm: unknown key; did you mean 'algorithm'"),
    ("policy:\n  sequence_packng:\n    enabled: true\n    train_mb_tokens: 4096\n",
     r"policy.sequence_packng: unknown section; did you mean 'sequence_packing'"),
    ("policy:\n  dynamic_batching:\n    enabled: true\n    train_mb_token: 4096\n",
     r"policy.dynamic_batching.train_mb_token: unknown key; did you mean 'train_mb_tokens'"),
    ("actor_train:\n  use_sequence_packing: true\n  sequence_packing_args:\n    algoritm: load_balance\n",
     r"actor_train.sequence_packing_args.algoritm: unknown key; did you mean 'algorithm'"),
])
def test_config_typos_in_seqpacks_sections_are_errors(yaml_text, match):
    from seqpack import config

    with pytest.raises(config.ConfigError, match=match):  # the typo used to be ignored (default MFFD, packing off)
        config.load(yaml_text)


def test_config_keys_outside_seqpacks_sections_are_left_alone():
    from seqpack import config

    cfg = config.load("policy:\n  max_total_sequence_length: 4096\n  some_future_option: 3\n  sequence_packing:\n"
                      "    enabled: true\n    train_mb_tokens: 4096\n")
    assert cfg.sequence_packing.enabled


@pytest.mark.parametrize("lengths, bins, match", [([30, 30, 30], [[0, 0], [1]], "index 0 appears twice"),
                                                  ([30, -30, 30], [[0, 1], [2]], "is negative"),
                                                  ([30, 30, 30], [[0], [1]], "1 are missing")])
def test_packing_metrics_check_the_solution(lengths, bins, match):
    from seqpack.planning.metrics import PackingMetrics

    with pytest.raises(ValueError, match=match):  # utilization 1.5 and waste -50% before
        PackingMetrics().calculate_stats_only(lengths, bins, 100)


def test_roll_dynamic_batching_refuses_left_padding():
    import torch

    from seqpack import roll

    mask = torch.tensor([[0, 0, 1, 1], [0, 0, 0, 1]])  # 0 of 3 real tokens survived the column cut
    with pytest.raises(ValueError, match="row 0 is not right-padded"):
        roll.dynamic_batching_shard({"input_ids": torch.arange(8).reshape(2, 4), "attention_mask": mask}, 1, 100, 1)


def test_pack_dataset_refuses_packs_beyond_int32_offsets():
    from seqpack import pack_dataset

    with pytest.raises(ValueError, match="pack_size must fit the int32 offsets"):  # allocated 16 GiB per pack before
        pack_dataset([[1, 2, 3]], pack_size=2**31)


def test_integer_items_the_core_cannot_hold_are_named():
    # Was pybind11's "Unable to cast Python instance ... to C++ type '?'".
    packer = seqpack.get_packer("first_fit_decreasing", 100)
    with pytest.raises(ValueError, match=r"sequence_lengths\[1\] = 18446744073709551615 does not fit in int64"):
        packer.pack([3, np.uint64(2**64 - 1)])
    with pytest.raises(TypeError, match=r"bins\[0\] must hold integer indices, got float"):
        seqpack.PackingMetrics().calculate_stats_only([1, 2], [[0, 1.0]], 10)
    # NumPy integers inside lists are read by value.
    assert packer.pack([np.int16(5), np.uint64(7)]) == [[1, 0]]


def test_a_bin_padding_multiple_near_int64_is_refused_not_ignored():
    torch = pytest.importorskip("torch")
    ids = torch.ones(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="does not fit in int32 cu_seqlens"):
        seqpack.pack_sequences(ids, seq_lens=[2, 3], pad_packed_multiple=2**63 - 1)
