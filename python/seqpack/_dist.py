"""Small ``torch.distributed`` helpers shared by the micro-batch planners."""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, TypeVar

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


def checked_on_every_rank(local: Callable[[], T], group, what: str, agree: bool = True,
                          fingerprint: Optional[Callable[[T], int]] = None,
                          fingerprint_of: str = "their shared inputs") -> T:
    """``local()`` (a rank's own checks and first plan), then one all-reduce so that
    every rank of ``group`` learns whether any rank failed: the failing rank raises
    its own error, every other rank a ``ValueError`` saying another rank failed, so
    none goes on to a collective the failing rank will never join. Any exception
    of ``local()`` counts as a failure (a rank that raised skips the collectives
    after it, whatever the error). Without ``agree`` (no process group) this is just
    ``local()``.

    ``fingerprint(result)``, when given, is a non-negative int (below ``2**62``) of
    what every rank must share (the shapes of the collectives that follow); the same
    all-reduce also carries its minimum and maximum, and when the ranks passed their
    own checks but their fingerprints differ, every rank raises the same
    ``ValueError`` naming ``fingerprint_of``."""
    if not agree:
        return local()
    result: Optional[T] = None
    failure: Optional[BaseException] = None
    mark = 0
    try:
        result = local()
        if fingerprint is not None:
            mark = int(fingerprint(result))
    except Exception as exc:  # noqa: BLE001 - re-raised below, after the agreement
        failure = exc
    values = [0 if failure is not None else 1] + ([mark, -mark] if fingerprint is not None else [])
    reduced = all_reduce_ints(values, "min", group)
    if reduced[0] == 0:
        if failure is not None:
            raise failure
        raise ValueError(f"{what}: another rank's input failed its checks (its error names the rule broken); "
                         "every rank stops here instead of waiting in a collective")
    if fingerprint is not None and reduced[1] != -reduced[2]:
        raise ValueError(f"{what}: the ranks passed their own checks but disagree on {fingerprint_of}, which "
                         "must be the same on every rank; every rank stops here instead of running collectives "
                         "on mismatched tensors")
    return result


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
