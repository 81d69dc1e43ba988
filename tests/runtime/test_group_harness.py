"""Helpers that start real rank processes (rank_processes.RANKS) for the group tests; no tests of its own.

``run_ranks(n, target, *args)`` starts ``n`` processes running ``target(rank, n, port, out, *args)`` and returns
what each put on ``out``, indexed by rank. A rank that exits without reporting, or a run that exceeds its
timeout, fails the calling test with the ranks named (the processes are killed, never left behind).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import socket
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
from rank_processes import RANKS


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(
    n: int,
    target: Callable[..., None],
    *args: Any,
    timeout_s: float = 240.0,
    needed: Iterable[int] | None = None,
) -> list[Any]:
    """``needed`` names the ranks whose reports the test reads (all by default); once they are in, the others
    (a rank the test stalls on purpose) are killed rather than waited for, and their entries are None."""
    wanted = set(range(n) if needed is None else needed)
    port = free_port()
    out = RANKS.Queue()
    procs = [RANKS.Process(target=target, args=(r, n, port, out, *args), daemon=True) for r in range(n)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        while not wanted <= results.keys():
            try:
                rank, value = out.get(timeout=timeout_s)
            except queue.Empty:
                missing = sorted(wanted - results.keys())
                raise AssertionError(f"ranks {missing} did not report within {timeout_s} s") from None
            results[rank] = value
    finally:
        for r, p in enumerate(procs):
            p.join(timeout=30 if r in wanted else 0)
            if p.is_alive():
                p.kill()
                p.join()
        out.close()
        out.join_thread()
    return [results.get(r) for r in range(n)]


def report(out: Any, rank: int, fn: Callable[[], Any]) -> None:
    """Run ``fn`` in a rank process and put (rank, result) on ``out``; an exception becomes its text."""
    try:
        value = fn()
    except BaseException as exc:  # reported to the parent, which fails the test with it
        import traceback

        value = f"rank {rank} raised {type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    out.put((rank, value))


def contribution(dtype: np.dtype[Any], count: int, rank: int, op: str) -> np.ndarray[Any, Any]:
    """Integer-valued data of ``rank`` (exact in every dtype, sums of 8 ranks stay exact in bfloat16)."""
    i = np.arange(count, dtype=np.int64)
    if op == "prod":
        values = np.array([1, 2, -1, 1, 1, 2, 1], dtype=np.int64)[(i + rank) % 7]
    else:
        values = (i * 7 + rank * 3) % 11 - 5
    if dtype.kind == "u":
        values = np.abs(values)
    return values.astype(dtype)


def reference(dtype: np.dtype[Any], count: int, world_size: int, op: str) -> np.ndarray[Any, Any]:
    """The exact reduction over all ranks, computed independently of the runtime (in int64/float64)."""
    stack = np.stack([contribution(dtype, count, r, op).astype(np.float64) for r in range(world_size)])
    if op in ("sum", "avg"):
        exact = stack.sum(axis=0)
    elif op == "prod":
        exact = stack.prod(axis=0)
    elif op == "min":
        exact = stack.min(axis=0)
    else:
        exact = stack.max(axis=0)
    if op == "avg":
        return (exact / world_size).astype(dtype)
    if dtype.kind in "iu":
        return exact.astype(np.int64).astype(dtype)  # wraps like the dtype's own arithmetic
    return exact.astype(dtype)


KillRun = tuple[int, float, list[Any]]  # (victim, when it was killed, each survivor's report or None)


def kill_rounds(
    repetitions: int,
    world_size: int,
    start_ranks: Callable[[int, Any, Any], tuple[list[Any], Callable[[], None]]],
    *,
    report_timeout_s: float = 60.0,
) -> list[KillRun]:
    """SIGKILL one rank per round (rank ``round % world_size``) once all ranks are running, and collect what
    the survivors report. ``start_ranks(round, started, out)`` starts the round's processes — each puts its rank
    on ``started`` when it is inside its collective loop and its error report on ``out`` — and returns them with
    a cleanup for the round's resources. A survivor that never reports (a hang) is recorded as None."""
    fork = mp.get_context("fork")
    runs: list[KillRun] = []
    for rep in range(repetitions):
        started, out = fork.Queue(), fork.Queue()
        procs, cleanup = start_ranks(rep, started, out)
        try:
            for _ in procs:
                started.get(timeout=60)
            victim = rep % world_size
            killed_at = time.monotonic()
            os.kill(procs[victim].pid, signal.SIGKILL)
            reports: list[Any] = []
            for _ in range(world_size - 1):
                try:
                    reports.append(out.get(timeout=report_timeout_s))
                except queue.Empty:
                    reports.append(None)
            runs.append((victim, killed_at, reports))
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
                    p.join()
            cleanup()
    return runs


def count_mismatch(group: Any, dtype: np.dtype[Any], count: int) -> tuple[str, bool]:
    """Rank 0 passes one element more than the others to ``all_reduce``: (the error each rank raised, or "no error";
    whether its array was left untouched)."""
    from allreduce.runtime import MismatchError

    x = contribution(dtype, count + (group.rank == 0), group.rank, "sum")
    kept = x.copy()
    try:
        group.all_reduce(x)
        said = "no error"
    except MismatchError as exc:
        said = str(exc)
    return said, bool(np.array_equal(x, kept))
