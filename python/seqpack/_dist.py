"""Small ``torch.distributed`` helpers shared by seqpack's multi-rank entry points:
the agreement every rank runs before its first collective
(:func:`checked_on_every_rank`) and the facts it compares."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, TypeVar, Union

T = TypeVar("T")


def active(group=None) -> bool:
    """True when a process group is initialised (and ``group`` has more than one rank)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def all_reduce_ints(values: Sequence[int], op: str, group=None) -> List[int]:
    """``values`` reduced element-wise with ``"max"`` or ``"min"`` over ``group``, in
    one collective (a CUDA tensor on NCCL, a CPU one otherwise)."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    t = torch.tensor([int(v) for v in values], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.MIN, group=group)
    return [int(v) for v in t.tolist()]


def all_reduce_int(value: int, op: str, group=None) -> int:
    """``value`` reduced with ``"max"`` or ``"min"`` over ``group``."""
    return all_reduce_ints([value], op, group)[0]


def size_and_rank(group) -> Tuple[int, int]:
    """``(world size, this process's rank)`` of ``group``; ``(1, 0)`` for ``None``."""
    if group is None:
        return 1, 0
    import torch.distributed as dist

    return dist.get_world_size(group), dist.get_rank(group)


def groups_of(*groups: Any) -> List[Any]:
    """The process groups among ``groups`` that have more than one rank (``None``
    entries dropped: there ``None`` means "no such parallelism", not WORLD)."""
    return [g for g in groups if g is not None and active(g)]


def grad_on(t: Any) -> bool:
    """Whether autograd will record ops on ``t`` here: it requires grad and grad
    mode is on (``torch.no_grad`` / ``inference_mode`` turn a backward off just as
    ``requires_grad=False`` does)."""
    import torch

    return t is not None and bool(t.requires_grad) and torch.is_grad_enabled()


def tensor_facts(*tensors: Any) -> Dict[str, Any]:
    """What a collective's ranks must share about ``tensors`` (``None`` entries kept
    as ``None``): their shapes, dtypes and whether each takes part in a backward
    (:func:`grad_on`), as named facts for :func:`checked_on_every_rank`."""
    return {"shape": [None if t is None else tuple(t.shape) for t in tensors],
            "dtype": [None if t is None else str(t.dtype) for t in tensors],
            "requires_grad": [None if t is None else grad_on(t) for t in tensors]}


def autocast_state(device_type: str) -> Any:
    """``(enabled, dtype)`` of ``torch.autocast`` for ``device_type`` here: under
    autocast an op's output dtype (and so what a later collective exchanges) can
    differ from its inputs'."""
    import torch

    try:
        if not torch.is_autocast_enabled(device_type):
            return False, None  # its dtype is then of no consequence
        return True, str(torch.get_autocast_dtype(device_type))
    except (RuntimeError, TypeError, AttributeError):  # a device type without autocast
        return False, None


def _hash(value: Any) -> int:
    """A non-negative int below 2**56 of ``value``: NumPy arrays by their bytes (a
    long array's repr elides its middle), other values by ``repr``, lists and tuples
    element by element."""
    import hashlib

    import numpy as np

    h = hashlib.blake2b(digest_size=7)

    def feed(v: Any) -> None:
        if isinstance(v, np.ndarray):
            h.update(b"a" + repr((v.dtype.str, v.shape)).encode())
            h.update(np.ascontiguousarray(v).tobytes())
        elif isinstance(v, (list, tuple)):
            h.update(b"(" if isinstance(v, tuple) else b"[")
            for x in v:
                feed(x)
                h.update(b",")
            h.update(b")")
        else:
            h.update(repr(v).encode())

    feed(value)
    return int.from_bytes(h.digest(), "little")


def checked_on_every_rank(local: Callable[[], T], group, what: str, agree: bool = True,
                          fingerprint: Optional[Callable[[T], Union[int, Mapping[str, Any]]]] = None,
                          fingerprint_of: str = "their shared inputs") -> T:
    """``local()`` (a rank's own checks and first plan), then one all-reduce so that
    every rank of ``group`` learns whether any rank failed: the failing rank raises
    its own error, every other rank a ``ValueError`` saying another rank failed, so
    none goes on to a collective the failing rank will never join. Any exception
    of ``local()`` counts as a failure (a rank that raised skips the collectives
    after it, whatever the error). Without ``agree`` (no process group) this is just
    ``local()``.

    ``group`` may be a list of process groups (say TP and CP): one all-reduce over
    each in turn, each carrying what the ones before it learnt, so on a grid of
    ranks every rank of every group learns of a failure anywhere on it.

    ``fingerprint(result)``, when given, is what every rank must share (the shapes,
    dtypes and ``requires_grad`` of what the collectives - the forward's and the
    backward's - exchange): a non-negative int below ``2**62`` named by
    ``fingerprint_of``, or a mapping of named facts (any values, hashed; the names
    fixed by the caller's code, not by its input). The same all-reduce carries the
    minimum and maximum of one hash of them all; when the ranks passed their own
    checks but disagree, a second all-reduce (only then) finds which facts differ,
    and every rank raises the same ``ValueError`` naming them."""
    if not agree:
        return local()
    groups = list(group) if isinstance(group, (list, tuple)) else [group]

    def reduce(values: List[int]) -> List[int]:
        for g in groups:  # each all-reduce carries what the ones before it learnt
            values = all_reduce_ints(values, "min", g)
        return values

    result: Optional[T] = None
    failure: Optional[BaseException] = None
    names: List[str] = []
    marks: List[int] = []
    try:
        result = local()
        if fingerprint is not None:
            facts = fingerprint(result)
            if isinstance(facts, Mapping):
                names, marks = [str(k) for k in facts], [_hash(v) for v in facts.values()]
            else:
                names, marks = [fingerprint_of], [int(facts)]
    except Exception as exc:  # noqa: BLE001 - re-raised below, after the agreement
        failure = exc
    # Every rank sends the same count of values, whatever its checks gave: the
    # verdict, then one mark of all the facts (its minimum and, negated, maximum).
    whole = _hash(marks) if failure is None else 0
    reduced = reduce([0 if failure is not None else 1] + ([whole, -whole] if fingerprint is not None else []))
    if reduced[0] == 0:
        if failure is not None:
            raise failure
        raise ValueError(f"{what}: another rank's input failed its checks (its error names the rule broken); "
                         "every rank stops here instead of waiting in a collective")
    if fingerprint is None or reduced[1] == -reduced[2]:
        return result
    # The ranks disagree (every rank knows, so every rank runs this): which facts,
    # in a second all-reduce of a fixed number of slots.
    slots = marks[:_FACT_SLOTS - 1] + ([_hash(marks[_FACT_SLOTS - 1:])] if len(marks) >= _FACT_SLOTS else [])
    slots += [0] * (_FACT_SLOTS - len(slots))
    each = reduce([x for m in slots for x in (m, -m)])
    differ = [names[i] if i < _FACT_SLOTS - 1 else ", ".join(names[i:]) for i in range(min(len(names), _FACT_SLOTS))
              if each[2 * i] != -each[2 * i + 1]] or [", ".join(names)]
    raise ValueError(f"{what}: the ranks passed their own checks but disagree on {'; '.join(differ)}, which must be "
                     "the same on every rank; every rank stops here instead of running collectives on mismatched "
                     "tensors")


_FACT_SLOTS = 16  # named facts compared one by one (the rest together in the last slot)


def agree_on_count(local: int, plan_with: Callable[[int], T], count_of: Callable[[T], int], group,
                   what: str) -> T:
    """Plans with the same count on every rank of ``group``: the largest local
    count, then every rank re-plans with it. A rank that cannot (too few
    sequences) makes every rank raise the same ``ValueError``, so none waits in a
    collective the others skipped."""
    target = all_reduce_int(local, "max", group)
    plan: Optional[T] = None
    error = ""
    try:
        plan = plan_with(target)
        if count_of(plan) != target:
            error = f"planned {count_of(plan)} micro-batches, not {target}"
    except ValueError as exc:
        error = str(exc)
    if all_reduce_int(0 if error else 1, "min", group) == 0:
        raise ValueError(f"{what}: the ranks cannot agree on the same micro-batch count across DP ranks "
                         f"({target}, the largest rank's){': ' + error if error else ' (another rank failed)'}")
    return plan
