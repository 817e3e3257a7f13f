"""Shared benchmark harness: timing, environment capture, tables and CSV.

Every benchmark script measures seqpack and its baseline in the same run, prints a
table, and appends long-format rows (one metric per row) to a CSV under
benchmarks/results/ together with the machine it ran on.
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import gc
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # idle BLAS threads would steal a core

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def torch_cpu_arguments(doc: str, repeat: int = 3) -> argparse.ArgumentParser:
    """The options of a CPU model benchmark: ``--quick``, ``--threads`` (torch CPU
    threads, default 1), ``--repeat`` and ``--csv``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--repeat", type=int, default=repeat)
    parser.add_argument("--csv")
    return parser


def measure(fn: Callable[[], Any], repeat: int = 7, warmup: int = 1, budget_s: float = 30.0) -> Dict[str, float]:
    """Run ``fn`` ``warmup`` + up to ``repeat`` times (stopping early once ``budget_s``
    is spent, but always at least once); return median/min/max seconds. Garbage
    left by earlier measurements is collected first so that neither side pays for
    the other's (the cyclic GC stays on, as in a trainer)."""
    gc.collect()
    for _ in range(warmup):
        fn()
    times: List[float] = []
    start = time.perf_counter()
    while len(times) < repeat:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s:
            break
    return {"median": statistics.median(times), "min": min(times), "max": max(times), "runs": len(times)}


def alternating(fns: Sequence[Callable[[], Any]], repeat: int) -> List[float]:
    """Best time in seconds of each of ``fns``, run in turn ``repeat`` times after one
    warm-up each, so that a noisy neighbour on a shared VM slows every side alike."""
    for fn in fns:
        fn()
    gc.collect()
    best = [float("inf")] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def rss_kib(field: str) -> int:
    """A ``/proc/self/status`` memory field (``"VmRSS:"``, ``"VmHWM:"``) in KiB (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(field)


def reset_peak_rss() -> int:
    """Resets the peak RSS (VmHWM) to the current RSS (clear_refs 5); returns it in KiB."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return rss_kib("VmRSS:")


def peak_extra_mib(fn: Callable[[], Any]) -> float:
    """Peak RSS rise while ``fn`` runs, MiB."""
    before = reset_peak_rss()
    fn()
    return (rss_kib("VmHWM:") - before) / 1024


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment() -> Dict[str, str]:
    import numpy
    import seqpack

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        commit = ""
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu_model(),
        "cores": str(os.cpu_count()),
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "seqpack": seqpack.__version__,
        "commit": commit,
    }


def announce(env: Dict[str, str], torch_module: Any = None) -> Dict[str, str]:
    """Add torch's version and threads (when given) to ``env`` and print it."""
    if torch_module is not None:
        env["torch"] = torch_module.__version__
        env["torch_threads"] = str(torch_module.get_num_threads())
    print("environment: " + ", ".join(f"{k}={v}" for k, v in env.items()) + "\n")
    return env


def start(doc: str, name: str, title: str, repeat: Optional[int] = None) -> "tuple[argparse.Namespace, CsvLog]":
    """A planning benchmark's start: ``--quick`` and ``--csv`` (and ``--repeat`` when
    given a default), the environment announced, its CSV log ``name``, its title
    printed. Returns ``(args, log)``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    if repeat is not None:
        parser.add_argument("--repeat", type=int, default=repeat)
    parser.add_argument("--csv")
    args = parser.parse_args()
    env = environment()
    announce(env)
    log = CsvLog(name, env, args.csv)
    print(title)
    return args, log


def torch_start(doc: str, name: str, *modules: Any, repeat: int = 3) -> "tuple[argparse.Namespace, CsvLog]":
    """A torch benchmark's start: :func:`torch_cpu_arguments` parsed, the torch thread
    count set, the environment (torch and each of ``modules``' version) announced and
    its CSV log ``name``. Returns ``(args, log)``."""
    import torch

    args = torch_cpu_arguments(doc, repeat=repeat).parse_args()
    torch.set_num_threads(args.threads)
    env = announce(environment(), torch)
    env.update({module.__name__: module.__version__ for module in modules})  # the CSV's last columns
    return args, CsvLog(name, env, args.csv)


def format_table(title: str, columns: List[str], rows: Iterable[List[Any]], note: str = "") -> str:
    try:
        from seqpack.tools.report import Table
    except ImportError:  # a build from before the layers, measured for an A/B comparison
        from seqpack.report import Table

    return Table(title, columns, list(rows), note).format()


class CsvLog:
    """Long-format rows: benchmark, case, impl, metric, value (+ environment)."""

    def __init__(self, name: str, env: Dict[str, str], path: Optional[str] = None):
        os.makedirs(RESULTS_DIR, exist_ok=True)
        self.path = path or os.path.join(RESULTS_DIR, f"{name}.csv")
        self.env = env
        self.name = name
        self.rows: List[Dict[str, Any]] = []

    def add(self, case: str, impl: str, metric: str, value: Any) -> None:
        self.rows.append({"benchmark": self.name, "case": case, "impl": impl, "metric": metric, "value": value})

    def timing(self, case: str, impl: str, m: Dict[str, float]) -> None:
        """Log a :func:`measure` result: best and median seconds, and the run count."""
        self.add(case, impl, "seconds_min", m["min"])
        self.add(case, impl, "seconds_median", m["median"])
        self.add(case, impl, "runs", m["runs"])

    def write(self) -> str:
        fields = ["benchmark", "case", "impl", "metric", "value"] + list(self.env)
        with open(self.path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields)
            w.writeheader()
            for r in self.rows:
                w.writerow({**r, **self.env})
        return self.path


def run_child(script: str, spec: str, env: Optional[Dict[str, str]] = None) -> dict:
    """Runs ``script --child spec`` in a fresh process (its own peak memory, no warm
    caches from the other side), with ``env`` added to the environment, and returns
    the JSON its last line prints."""
    proc = subprocess.run([sys.executable, os.path.abspath(script), "--child", spec], capture_output=True, text=True,
                          env=None if env is None else {**os.environ, **env})
    if proc.returncode != 0:
        raise RuntimeError(f"{spec} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def arrow_digest(ds: Any, columns: Optional[Sequence[str]] = None, with_schema: bool = False) -> str:
    """SHA-256 of a ``datasets.Dataset``'s columns (all, or those of ``columns`` it
    has): each column's row lengths and raw values, chunk by chunk (no copy of the
    values; the chunking does not change the digest), and its schema if asked."""
    table = ds.with_format("arrow")[:]
    parts = [str(table.schema.remove_metadata())] if with_schema else []
    import numpy as np

    for name in (table.column_names if columns is None else [c for c in columns if c in table.column_names]):
        lengths, values = hashlib.sha256(), hashlib.sha256()
        for chunk in table.column(name).chunks:
            lengths.update(np.asarray(chunk.value_lengths()).astype(np.int64).tobytes())
            values.update(memoryview(np.ascontiguousarray(chunk.flatten().to_numpy(zero_copy_only=False))))
        parts += [name, lengths.hexdigest(), values.hexdigest()]
    return hashlib.sha256("".join(parts).encode()).hexdigest()


def timed_runs(fn: Callable[[], Any], runs: int = 1) -> "tuple[Any, float, float]":
    """Calls ``fn`` ``runs`` times: (the first result, the best wall time in seconds,
    the peak RSS rise of the first call in MiB)."""
    out: Dict[str, Any] = {}

    def first():
        t0 = time.perf_counter()
        out["result"] = fn()
        out["seconds"] = time.perf_counter() - t0

    mem = peak_extra_mib(first)
    best = out["seconds"]
    for _ in range(runs - 1):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return out["result"], best, mem


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_gloo_ranks(worker: Callable[..., None], world: int, job: Any, timeout_s: float, what: str) -> Any:
    """``worker(rank, world, port, job, results)`` on ``world`` spawned processes that
    join one gloo group through a TCPStore kept in this process until they exit (as
    tests/python/_gloo.py does). A rank puts ``("ok", payload)`` (rank 0) or
    ``("error", traceback)`` on ``results``; returns the payload, or raises with the
    errors (or a timeout)."""
    import datetime
    import queue

    import torch.distributed as dist
    import torch.multiprocessing as mp

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False,  # noqa: F841
                          timeout=datetime.timedelta(seconds=60))
    procs = [ctx.Process(target=worker, args=(r, world, port, job, results)) for r in range(world)]
    for p in procs:
        p.start()
    got, errors = None, []
    try:
        deadline = time.time() + timeout_s
        while got is None and time.time() < deadline and (any(p.is_alive() for p in procs) or not results.empty()):
            try:
                kind, payload = results.get(timeout=1.0)
            except queue.Empty:
                continue
            if kind == "ok":
                got = payload
            else:
                errors.append(payload)
                break
        for p in procs:
            p.join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    if got is None:
        raise RuntimeError(f"{what} failed:\n" + ("\n".join(errors) or "no result (timeout)"))
    return got
