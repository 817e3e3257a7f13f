"""The public surface is one explicit list (issue 50): ``seqpack.__all__`` equals the
checked-in list below, so adding or removing a name is a deliberate edit here;
every other top-level name is a subpackage, a moved module path or a deprecated
alias that warns with the call replacing it."""

import warnings

import pytest

import seqpack

# Edit on purpose: a new public name is a decision (docs/api.md says what each is).
PUBLIC = [
    # planning
    "get_packer", "PackingAlgorithm", "SequencePacker", "adjust_bin_count",
    "get_seqlen_balanced_partitions", "karmarkar_karp", "greedy_lpt_partition", "sorted_stride_partition",
    "log_seqlen_unbalance", "plan_micro_batches", "MicroBatchPlan", "sequence_workloads",
    "plan_dynamic_batching", "DynamicBatchingPlan", "PackingMetrics", "dp_balance_metrics",
    "dynamic_batching_metrics", "CostModel", "plan_step", "StepPlan", "StepOptions", "PrefixForest", "StreamPlanner",
    "StreamStep",
    # packed tensors
    "TokenLayout", "PackedLayout", "alignment", "shard_layout", "PackedBatch", "PackedSeqParams", "pack_sequences",
    "pack_to_layout", "unpack_sequences", "StaticPackedBatch", "pack_sequences_static",
    "PackedDataset", "collate_packs", "pack_dataset", "pack_prefix_tree", "PrefixTreeBatch", "PrefixTreeMetrics",
    "prepare_tree", "HybridCpBatch", "pack_hybrid_cp", "hybrid_cp_micro_batches", "hybrid_cp_groups",
    "split_prefix_tree",
    # training
    "attention", "varlen_attention", "attention_backends", "token_logprobs", "TokenLogprobs",
    "column_logprobs", "linear_column_logprobs",
    "SequencePackingLossWrapper", "prepare_loss_input", "NLLLoss", "ClippedPGLoss", "prefix_reuse",
    # frameworks
    "BatchedDataDict", "DynamicBatchingArgs", "SequencePackingArgs", "SlicedDataDict",
    # support
    "build_info",
]

# The per-kind families the one operations replace: deprecated aliases only.
FAMILIES = ["tree_attention", "cp_attention", "tree_cp_attention", "hybrid_cp_attention", "ulysses_attention",
            "packed_token_logprobs", "linear_token_logprobs", "tree_token_logprobs", "tree_linear_token_logprobs",
            "hybrid_cp_token_logprobs", "HybridCpLossWrapper", "HybridCpPart", "tree_cp_bounds",
            "tree_cp_local_rows", "cp_partition_indices", "cp_restore_order"]


def test_all_is_the_checked_in_list():
    assert seqpack.__all__ == PUBLIC
    assert len(PUBLIC) <= 64 and len(set(PUBLIC)) == len(PUBLIC)


def test_every_top_level_name_is_declared_or_a_deprecated_alias():
    undeclared = set(seqpack._EXPORTS) - set(seqpack.__all__)
    assert not undeclared, f"reachable but not in __all__ (declare it or deprecate it): {sorted(undeclared)}"
    assert not set(seqpack._DEPRECATED) & set(seqpack.__all__)
    public = {n for n in dir(seqpack) if not n.startswith("_")}
    known = set(seqpack.__all__) | set(seqpack._DEPRECATED) | set(seqpack._SUBPACKAGES) | set(seqpack._MOVED)
    assert public <= known | {"annotations", "importlib", "sys", "warnings", "TYPE_CHECKING", "Any", "Dict",
                              "List", "Tuple"}, sorted(public - known)


def test_one_entry_point_per_concept():
    attention = [n for n in seqpack.__all__ if n.endswith("attention")]
    logprobs = [n for n in seqpack.__all__ if n.endswith("token_logprobs")]
    wrappers = [n for n in seqpack.__all__ if n.endswith("LossWrapper")]
    assert attention == ["attention", "varlen_attention"] and logprobs == ["token_logprobs"]
    assert wrappers == ["SequencePackingLossWrapper"]
    assert set(FAMILIES) <= set(seqpack._DEPRECATED)


@pytest.mark.parametrize("name", sorted(seqpack._DEPRECATED))
def test_a_deprecated_alias_warns_with_the_new_call_and_still_works(name):
    module, attr, instead = seqpack._DEPRECATED[name]
    with pytest.warns(DeprecationWarning, match=f"seqpack.{name} is deprecated") as caught:
        value = getattr(seqpack, name)
    assert instead in str(caught[0].message) and "docs/migration.md" in str(caught[0].message)
    assert callable(value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        import importlib

        assert getattr(importlib.import_module(f"seqpack.{module}"), attr) is value  # the module path stays quiet
