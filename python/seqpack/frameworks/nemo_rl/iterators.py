"""The micro-batch iterators of a shard, as functions of its
:class:`~.shard.ShardRecord`: what each yields is decided here, from what the shard
carries of its plan, and nowhere else.

=====================  ===========================  ==============================  ===========================
shard planned as       ``microbatch_iterator``      ``..._with_dynamic_shapes``     ``..._for_packable_sequences``
=====================  ===========================  ==============================  ===========================
nothing (plain)        slices of N rows             (no plan: refused)              (no plan: refused)
dynamic batching       slices of N rows             each cut to its padded width    the planned row slices
rows under a cap       refused (ignores the plan)   refused (lengths are sums)      the planned row slices
prefix trees           refused                      the planned trees               the planned trees
a batch in passes      refused                      its passes (prefix reuse)       its passes (prefix reuse)
a CP step plan         refused                      refused                         refused
=====================  ===========================  ==============================  ===========================

(``make_packed_microbatch_iterator``: :mod:`.packed`.) Prefix trees are planned by
``sequence_packing_args["shared_prefix"]`` or by a step plan made on a
:class:`~seqpack.PrefixForest`; ``shared_prefix=True`` turns row micro-batches into
trees too. A tree shard's trees come as built with the shard; the options that
change only their padding or sharing depth (``pad_to_multiple_of``,
``min_shared_tokens``) build them again, each checked against its planned tokens and
the cap; an option naming another sharing rule or other rows is refused. A batch a
step plan runs in passes (``prefix_reuse``) yields its passes as tree micro-batches
of all its rows, driven by one :func:`seqpack.prefix_reuse` step
(``prefix_reuse_memory="activations"`` or ``"kv"``), then its dummies.

    >>> from seqpack.frameworks.nemo_rl.iterators import fixed_size
    >>> from seqpack.frameworks.nemo_rl.shard import ShardRecord
    >>> list(fixed_size(ShardRecord({"x": [1, 2, 3, 4]}), 2, dict))
    [{'x': [1, 2]}, {'x': [3, 4]}]

Importing this module does not import torch.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence

from .errors import check, positive
from .rows import dummy, lengths, rows_to_split, slice_rows, truncate
from .shard import ShardRecord, one_plan
from .trees import TreeMicroBatch, checked_tree, group_labels

__all__ = ["TREE_OPTIONS", "dynamic_shapes", "fixed_size", "packable", "refuse_cp", "tree_plan"]

Wrap = Callable[[Dict[str, Any]], Any]

TREE_OPTIONS = {"input_key": "input_ids", "input_lengths_key": "input_lengths", "group_key": None,
                "min_shared_tokens": 1, "pad_to_multiple_of": 1}


def refuse_cp(shard: ShardRecord, iterator: str) -> None:
    """A shard of a CP step plan runs its micro-batches per CP rank only."""
    check(not shard.cp_plan, f"{iterator}: this shard is of a step plan with cp_size="
          f"{shard.step_shard.plan.cp_size if shard.step_shard else 1}: each CP rank runs its own part of every "
          "micro-batch; iterate with make_packed_microbatch_iterator(cp_rank=...)")


def tree_plan(shard: ShardRecord) -> bool:
    """The shard's micro-batches were planned as prefix trees (their physical tokens
    under the cap; as rows they may pass it)."""
    return shard.micro_batch_trees is not None


def _rows_refused(shard: ShardRecord, iterator: str, why: str) -> str:
    kind = "prefix trees" if tree_plan(shard) else "rows"
    return (f"{iterator}: this shard's micro-batches were planned as {kind} under a cap of "
            f"{shard.micro_batch_token_cap} tokens (sequence packing or a step plan), {why}; iterate with "
            "make_microbatch_iterator_for_packable_sequences() or make_packed_microbatch_iterator()")


def fixed_size(shard: ShardRecord, microbatch_size: Any, wrap: Wrap) -> Iterator[Any]:
    """Consecutive slices of ``microbatch_size`` rows (a shard planned under a token
    cap is refused: the slices would ignore its plan)."""
    microbatch_size = positive(microbatch_size, "microbatch_size")
    refuse_cp(shard, "make_microbatch_iterator")
    check(shard.micro_batch_token_cap is None,
          _rows_refused(shard, "make_microbatch_iterator", "which slices of a fixed row count ignore"))
    size = rows_to_split(shard.data)
    check(size % microbatch_size == 0,
          f"Data dict size ({size}) is not a multiple of the provided microbatch size ({microbatch_size})")
    return (wrap(slice_rows(shard.data, i, i + microbatch_size)) for i in range(0, size, microbatch_size))


def _yields_trees(shard: ShardRecord, shared_prefix: Optional[bool], iterator: str) -> bool:
    if not tree_plan(shard):
        return bool(shared_prefix)
    check(shared_prefix is None or bool(shared_prefix),
          f"{iterator}(shared_prefix=False) contradicts the shard's plan: its micro-batches are prefix trees, "
          f"planned on their physical tokens under the cap of {shard.micro_batch_token_cap}; as rows they "
          "would pass it (leave shared_prefix out)")
    return True


def dynamic_shapes(shard: ShardRecord, sequence_dim: int, shared_prefix: Optional[bool],
                   tree_options: Mapping[str, Any], wrap: Wrap) -> Iterator[Any]:
    """The dynamic-batching micro-batches, each cut to its padded width; as trees
    with ``shared_prefix`` or on a tree shard (:func:`packable`'s options)."""
    iterator = "make_microbatch_iterator_with_dynamic_shapes"
    refuse_cp(shard, iterator)
    indices, widths = one_plan(shard)
    if _yields_trees(shard, shared_prefix, iterator):
        return _trees(shard, indices, tree_options, wrap)
    check(shard.elem_counts_per_gb is None,
          _rows_refused(shard, iterator, "so its micro_batch_lengths are token sums, not padded widths"))

    def gen():
        for width, (start, end) in zip(widths, indices):
            mb = slice_rows(shard.data, start, end)
            truncate(mb, sequence_dim, width)
            yield wrap(mb)

    return gen()


def packable(shard: ShardRecord, shared_prefix: Optional[bool], tree_options: Mapping[str, Any],
             wrap: Wrap) -> Iterator[Any]:
    """The planned micro-batches as row slices (an empty one, a step plan's dummy, as
    a one-token zero-loss row), or as :class:`~.trees.TreeMicroBatch` with
    ``shared_prefix=True`` or on a tree shard.

    ``tree_options`` (:data:`TREE_OPTIONS`): ``input_key``, ``input_lengths_key``,
    ``group_key`` (share only within rows of one value of it), ``min_shared_tokens``
    and ``pad_to_multiple_of`` (of the tree), as :func:`seqpack.pack_prefix_tree`. On
    a tree shard the keys and the sharing rule are the plan's; a tree whose real
    tokens pass its micro-batch's planned length is refused, and so is one padded past
    the shard's token cap."""
    iterator = "make_microbatch_iterator_for_packable_sequences"
    refuse_cp(shard, iterator)
    indices, _ = one_plan(shard)
    if _yields_trees(shard, shared_prefix, iterator):
        return _trees(shard, indices, tree_options, wrap)
    return (wrap(_rows_or_dummy(shard.data, start, end)) for start, end in indices)


def _rows_or_dummy(data: Mapping[str, Any], start: int, end: int, input_lengths_key: str = "input_lengths"
                   ) -> Dict[str, Any]:
    return slice_rows(data, start, end) if end > start else dummy(data, input_lengths_key)


def _forest_labels(shard: ShardRecord) -> Optional[List[int]]:
    """Each row's tree in the forest a step plan was made on (None: no forest)."""
    step = shard.step_shard
    if step is None or step.plan.forest is None:
        return None
    tree_ids = step.plan.forest.tree_ids
    return [int(tree_ids[i]) for i in step.row_ids]


def _rule(shard: ShardRecord, given: Mapping[str, Any]) -> Dict[str, Any]:
    """The tree options to iterate with: the shard's rule, what is given checked
    against it (another input key or sharing rule contradicts the plan)."""
    unknown = sorted(set(given) - set(TREE_OPTIONS))
    check(not unknown, f"unknown shared-prefix option(s) {unknown}; known: {sorted(TREE_OPTIONS)}")
    rule = shard.micro_batch_tree_options
    if rule is None:
        return {**TREE_OPTIONS, **given}
    for key in ("input_key", "input_lengths_key"):
        check(given.get(key, rule[key]) == rule[key],
              f"{key}={given.get(key)!r} contradicts the shard's plan: its trees are of {key}={rule[key]!r}")
    forest = _forest_labels(shard)
    group_key = given.get("group_key", rule["group_key"])
    if forest is None:
        check(group_key == rule["group_key"],
              f"group_key={group_key!r} contradicts the shard's plan: its trees were planned sharing within "
              f"shared_prefix_group_key={rule['group_key']!r}")
    elif group_key is not None:  # the forest's trees rule; a key that splits one of them contradicts it
        first: Dict[int, Any] = {}
        split = sorted({t for t, v in zip(forest, group_labels(shard.data, group_key)) if first.setdefault(t, v) != v})
        check(not split, f"group_key={group_key!r} contradicts the shard's plan: the step plan's forest shares "
                         f"prefixes within trees whose rows have several values of {group_key!r} (tree {split[:1]})")
    return {**rule, **given, "group_key": rule["group_key"]}


def _trees(shard: ShardRecord, indices: Sequence[Sequence[int]], given: Mapping[str, Any],
           wrap: Wrap) -> Iterator[TreeMicroBatch]:
    """A :class:`~.trees.TreeMicroBatch` per row range: the shard's trees when the
    options are the plan's, else built again (each checked against its planned tokens
    on a shard planned under a cap)."""
    given = dict(given)
    memory = given.pop("prefix_reuse_memory", "activations")
    options = _rule(shard, given)
    from ...training.prefix_reuse import MEMORY_MODES

    # checked on every batch (a step's other batches, or another rank's, may run in passes); used where one does
    check(memory in MEMORY_MODES, f"prefix_reuse_memory must be one of {MEMORY_MODES}, got {memory!r}")
    if shard.micro_batch_passes is not None and shard.micro_batch_passes[0] is not None:
        return _passes(shard, indices, options, memory, wrap)
    carried = shard.micro_batch_trees[0] if tree_plan(shard) else None
    rule = shard.micro_batch_tree_options or {}
    if carried is not None and shard.micro_batch_static_lengths is not None:
        other = sorted(k for k in TREE_OPTIONS if options[k] != rule[k])
        check(not other, f"{', '.join(f'{k}={options[k]!r}' for k in other)} contradicts the shard's plan: it pads "
                         "each tree to its static shape (static_shapes), so its trees are laid out as planned")
    if carried is not None and all(options[k] == rule[k] for k in TREE_OPTIONS):
        static = shard.micro_batch_static_lengths[0] if shard.micro_batch_static_lengths is not None else \
            [None] * len(carried)
        return (_carried(shard, tree, start, end, options, wrap, size)
                for tree, (start, end), size in zip(carried, indices, static))
    planned = one_plan(shard)[1] if shard.elem_counts_per_gb is not None else None
    forest = _forest_labels(shard)
    labels = forest if forest is not None else group_labels(shard.data, options["group_key"])

    def gen():
        for k, (start, end) in enumerate(indices):
            yield _built(shard, start, end, options, labels, None if planned is None else int(planned[k]), wrap)

    return gen()


def _passes(shard: ShardRecord, indices: Sequence[Sequence[int]], options: Mapping[str, Any], memory: str,
            wrap: Wrap) -> Iterator[TreeMicroBatch]:
    """A batch planned in passes (prefix reuse): each pass a :class:`~.trees.TreeMicroBatch`
    of the shard's rows (the whole batch: every pass reads its tree), run through one
    :func:`seqpack.prefix_reuse` step in the planned order, then the dummies."""
    from ...training.prefix_reuse import prefix_reuse
    from ..policy_forward import nemo_rl_pass_forward

    rule = shard.micro_batch_tree_options or {}
    other = sorted(k for k in TREE_OPTIONS if options[k] != rule[k])
    check(not other, f"{', '.join(f'{k}={options[k]!r}' for k in other)} contradicts the shard's plan: this batch "
                     "runs in the passes planned on its trees (plan_step(..., prefix_reuse=True)), laid out as planned")
    passes = shard.micro_batch_passes[0]
    step = prefix_reuse(passes, memory=memory, forward=nemo_rl_pass_forward,
                        pad_to_multiple_of=rule.get("pad_to_multiple_of", 1))
    n = shard.elem_counts_per_gb[0]
    data = wrap(slice_rows(shard.data, 0, n))

    def gen():
        for mb in step:
            yield TreeMicroBatch(tree=mb.layout, data=data, rows=tuple(range(n)), pass_micro_batch=mb)
        for start, end in indices[len(passes.order):]:  # the plan's empty cells: dummies
            yield _built(shard, start, end, options, None, None, wrap)

    return gen()


def _carried(shard: ShardRecord, tree: Any, start: int, end: int, options: Mapping[str, Any],
             wrap: Wrap, static: Optional[int] = None) -> TreeMicroBatch:
    if tree is None:  # a dummy: the tree of its one-token row (padded to its static shape, when planned with one)
        return _built(shard, start, end, options if static is None else {**options, "pad_to_multiple_of": static},
                      None, None, wrap)
    return TreeMicroBatch(tree=tree, data=wrap(slice_rows(shard.data, start, end)), rows=tuple(range(start, end)))


def _built(shard: ShardRecord, start: int, end: int, options: Mapping[str, Any], labels: Optional[Sequence[Any]],
           planned: Optional[int], wrap: Wrap) -> TreeMicroBatch:
    mb = _rows_or_dummy(shard.data, start, end, options["input_lengths_key"])
    rows = range(start, end)
    tree = checked_tree(mb, rows, lengths(mb, options["input_lengths_key"]), input_key=options["input_key"],
                        labels=None if labels is None or not rows else labels[start:end],
                        min_shared_tokens=options["min_shared_tokens"],
                        pad_to_multiple_of=options["pad_to_multiple_of"], planned_tokens=planned,
                        token_cap=shard.micro_batch_token_cap, group_key=options["group_key"])
    return TreeMicroBatch(tree=tree, data=wrap(mb), rows=tuple(rows))
