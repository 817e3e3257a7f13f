"""Spawned CPU ranks in a gloo process group, for the distributed tests.

- :func:`run_world`: ``world`` fresh processes run ``target(rank, world, *args)``
  once; the test fails on any rank's exception or when a rank is still running
  after the timeout (a hang).
- :class:`RankPool`: ``world`` processes kept for many cases (spawning and
  importing torch costs seconds per rank): each :meth:`RankPool.run` sends one
  case, a module-level function, to every rank and returns every rank's
  :class:`Outcome`; a case that does not finish in time tears the pool down and
  raises :class:`Hang`. :func:`started_pools` (a module fixture's body) and
  :func:`values_of` (every rank's value, or a failure with every rank's traceback)
  are the usual way to use them.

``target`` and the cases must be module-level functions (pickled by name, imported
again in each rank); everything they take and return must pickle.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable, Iterator, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PG_TIMEOUT_S = 60  # gloo's own collective timeout; the tests' timeouts fire first


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _parent_store(world: int) -> Tuple[int, Any]:
    """A TCPStore that lives in the parent until every rank has exited: with rank 0
    hosting it, a rank still tearing down when rank 0 exits could abort in gloo
    ("terminate called without an active exception", about 1 run in 15)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # inherited by the spawned ranks
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    return port, store


def _init_rank(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))


def _exit(queue_, code: int) -> None:
    """Leaves a rank without the interpreter's finalisation: gloo's threads can
    abort it there ("terminate called without an active exception", SIGABRT,
    about 1 run in 25 even after destroy_process_group), failing a test whose every
    check passed. What the rank put on ``queue_`` is flushed first."""
    queue_.close()
    queue_.join_thread()
    os._exit(code)


def _once_worker(rank, world, port, target, args, errors):
    code = 0
    try:
        _init_rank(rank, world, port)
        target(rank, world, *args)
        dist.barrier()  # every rank done before any tears down
    except BaseException:  # report to the parent, which fails the test
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        code = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    _exit(errors, code)


def run_world(world: int, target: Callable, args: tuple = (), timeout_s: float = 120) -> None:
    """``target(rank, world, *args)`` on ``world`` fresh gloo ranks; asserts that
    every rank returned within ``timeout_s`` (else kills them)."""
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    port, store = _parent_store(world)  # noqa: F841 - kept alive until the ranks exit
    procs = [ctx.Process(target=_once_worker, args=(r, world, port, target, args, errors)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        alive = [p for p in procs if p.is_alive()]
        assert not alive, f"{len(alive)} ranks still running after {timeout_s} s"
        failures = []
        while not errors.empty():
            failures.append(errors.get())
        assert not failures, "\n".join(failures)
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()


class Outcome(NamedTuple):
    """One rank's result of a case: ``value`` when it returned, else the exception's
    type name, message and traceback."""

    rank: int
    value: Any = None
    raised: Optional[str] = None
    message: str = ""
    trace: str = ""


class Hang(AssertionError):
    """A case did not finish on every rank in time (the pool is gone)."""


def _pool_worker(rank, world, port, inbox, outbox):
    try:
        _init_rank(rank, world, port)
        outbox.put((0, Outcome(rank, "ready")))
        while True:
            item = inbox.get()
            if item is None:
                break
            case_id, fn, args = item
            try:
                outcome = Outcome(rank, fn(rank, world, *args))
            except Exception as exc:  # noqa: BLE001 - the outcome the parent checks
                outcome = Outcome(rank, None, type(exc).__name__, str(exc), traceback.format_exc())
            outbox.put((case_id, outcome))
    except BaseException:
        outbox.put((-1, Outcome(rank, None, "worker died", "", traceback.format_exc())))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    _exit(outbox, 0)


class RankPool:
    """``world`` spawned ranks sharing one gloo group (the default group in each),
    kept for many cases. Start several pools before waiting on any: they start in
    parallel."""

    def __init__(self, world: int):
        ctx = mp.get_context("spawn")
        self.world = world
        port, self._store = _parent_store(world)
        self._inboxes = [ctx.Queue() for _ in range(world)]
        self._outbox = ctx.Queue()
        self._procs = [ctx.Process(target=_pool_worker, args=(r, world, port, self._inboxes[r], self._outbox),
                                   daemon=True) for r in range(world)]
        for p in self._procs:
            p.start()
        self._case = 0
        self._ready = False
        self.closed = False

    def _collect(self, case_id: int, timeout_s: float, what: str) -> List[Outcome]:
        outcomes: List[Optional[Outcome]] = [None] * self.world
        deadline = time.monotonic() + timeout_s
        while any(o is None for o in outcomes):
            left = deadline - time.monotonic()
            if left <= 0 or self.closed:
                missing = [r for r, o in enumerate(outcomes) if o is None]
                self.close(kill=True)
                raise Hang(f"{what}: ranks {missing} of {self.world} still running after {timeout_s} s "
                           "(a hang; the pool is torn down)")
            try:
                got, outcome = self._outbox.get(timeout=min(left, 0.5))
            except queue.Empty:
                if not all(p.is_alive() for p in self._procs):
                    self.close(kill=True)
                    raise AssertionError(f"{what}: a rank exited, exit codes {[p.exitcode for p in self._procs]}")
                continue
            if got == -1:
                self.close(kill=True)
                raise AssertionError(f"{what}: rank {outcome.rank} died:\n{outcome.trace}")
            if got == case_id:
                outcomes[outcome.rank] = outcome
        return outcomes  # type: ignore[return-value]

    def wait_ready(self, timeout_s: float = 120) -> "RankPool":
        if not self._ready:
            self._collect(0, timeout_s, f"starting {self.world} ranks")
            self._ready = True
        return self

    def run(self, fn: Callable, *args, timeout_s: float = 20) -> List[Outcome]:
        """``fn(rank, world, *args)`` on every rank; every rank's outcome, by rank.
        Raises :class:`Hang` (and tears the pool down) past ``timeout_s``."""
        if self.closed:
            raise RuntimeError("this RankPool is closed")
        self.wait_ready()
        self._case += 1
        for inbox in self._inboxes:
            inbox.put((self._case, fn, args))
        return self._collect(self._case, timeout_s, getattr(fn, "__name__", "case"))

    def close(self, kill: bool = False) -> None:
        """Stops the ranks: asks them to exit, and kills those still running after
        a few seconds (at once with ``kill``: a rank stuck in a collective never reads
        its inbox)."""
        if self.closed:
            return
        self.closed = True
        for inbox in self._inboxes:
            try:
                inbox.put(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + (0 if kill else 10)
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(5)

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def started_pools(worlds) -> Iterator[dict]:
    """A module fixture's body: one :class:`RankPool` per world size, started together
    (they start in parallel), yielded as ``{world: pool}``, closed afterwards."""
    started = {w: RankPool(w) for w in worlds}
    try:
        for pool in started.values():
            pool.wait_ready()
        yield started
    finally:
        for pool in started.values():
            pool.close()


def values_of(pool: "RankPool", fn: Callable, *args: Any, timeout_s: float) -> List[Any]:
    """``fn(rank, world, *args)`` on every rank of ``pool`` (a hang raises :class:`Hang`
    and tears the pool down); fails with every raising rank's traceback, else returns
    the ranks' values in rank order."""
    outcomes = pool.run(fn, *args, timeout_s=timeout_s)
    failed = [o for o in outcomes if o.raised]
    assert not failed, "\n".join(f"rank {o.rank}: {o.raised} {o.message}\n{o.trace}" for o in failed)
    return [o.value for o in outcomes]
