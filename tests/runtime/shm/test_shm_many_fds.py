"""The shared-memory transport in processes with file descriptors numbered past 1,024 (FD_SETSIZE).

A process that has many files open, or many groups, gets pidfds numbered 1,024 and up; the transport watches its
peers through them while it waits. These tests open thousands of descriptors before the groups are made, make a
rank wait (its peer arrives late), and check the results, and that a peer killed then is still named.
"""

from __future__ import annotations

import os
import resource
import signal
import time
import uuid
from typing import Any

import numpy as np
import pytest
from rank_processes import RANKS

from allreduce.runtime import PeerFailureError, ProcessGroup
from allreduce.runtime.launcher._spawn import spawn
from allreduce.runtime.shm import ShmTransport

OPEN_FILES = 4000
LATE_S = 0.15  # longer than the transport's spin and yield: the waiting rank sleeps on a futex and checks its peers


def _open_many(count: int) -> list[int]:
    """Raise the soft descriptor limit as far as needed and open ``count`` descriptors (kept for the process's
    life: the groups made afterwards get descriptors numbered above them)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = count + 1024
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(
            resource.RLIMIT_NOFILE, (wanted if hard == resource.RLIM_INFINITY else min(wanted, hard), hard)
        )
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(count)]
    assert max(fds) >= 1024
    return fds


def _group(rank: int, world_size: int, job: str) -> ProcessGroup:
    transport = ShmTransport(rank, world_size, job, timeout_s=60)  # type: ignore[call-arg]
    return ProcessGroup(transport, transport_name="shm", timeout_s=60)


def _late_peer_rounds(job: str, rounds: int) -> list[float]:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    _open_many(OPEN_FILES)
    group = _group(rank, world_size, job)
    try:
        results = []
        for _ in range(rounds):
            if rank == world_size - 1:
                time.sleep(LATE_S)
            x = np.full(1 << 12, float(rank + 1), np.float32)
            group.all_reduce(x, algorithm="ring")
            results.append(float(x[0]))
        return results
    finally:
        group.close()


def _many_groups(job: str, count: int) -> list[float]:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    _open_many(1100)
    groups = [_group(rank, world_size, f"{job}-{i}") for i in range(count)]
    try:
        results = []
        for i, group in enumerate(groups):
            if rank == world_size - 1 and i % 50 == 0:
                time.sleep(LATE_S)
            x = np.full(64, float(rank + 1 + i), np.float64)
            group.all_reduce(x)
            results.append(float(x[0]))
        return results
    finally:
        for group in groups:
            group.close()


def _killed_while_waited_for(rank: int, world_size: int, job: str, out: Any) -> None:
    _open_many(OPEN_FILES)
    group = _group(rank, world_size, job)
    try:
        x = np.ones(1 << 12, np.float32)
        group.all_reduce(x, algorithm="ring")
        if rank == world_size - 1:
            time.sleep(LATE_S)  # the others are asleep on a futex, watching this rank's pidfd
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            group.all_reduce(x, algorithm="ring")
            out.put((rank, "no error"))
        except PeerFailureError as exc:
            out.put((rank, f"PeerFailureError peer={exc.peer}"))
        except Exception as exc:
            out.put((rank, f"{type(exc).__name__}: {exc}"))
    finally:
        group.close()


@pytest.mark.slow
def test_a_rank_with_4000_open_files_waits_for_a_late_peer_and_gets_the_sum() -> None:
    results = spawn(2, _late_peer_rounds, f"fds-{uuid.uuid4().hex[:8]}", 3, group=False, timeout_s=120)
    assert results == [[3.0, 3.0, 3.0]] * 2


@pytest.mark.slow
def test_300_groups_per_process_all_reduce_exactly() -> None:
    count = 300
    # Recording off: this test is about descriptors, and 300 recorders would take gigabytes per rank.
    results = spawn(
        2,
        _many_groups,
        f"groups-{uuid.uuid4().hex[:8]}",
        count,
        group=False,
        timeout_s=240,
        env={"ALLREDUCE_STATS": "0"},
    )
    want = [float(2 * i + 3) for i in range(count)]
    assert results == [want, want]


@pytest.mark.slow
def test_a_peer_killed_while_a_rank_with_4000_open_files_waits_is_named() -> None:
    # Plain processes, not spawn(): spawn stops the survivors as soon as it sees a rank die, before they notice.
    ctx = RANKS
    out = ctx.Queue()
    job = f"kill-{uuid.uuid4().hex[:8]}"
    processes = [ctx.Process(target=_killed_while_waited_for, args=(r, 3, job, out)) for r in range(3)]
    for p in processes:
        p.start()
    try:
        outcomes = dict(out.get(timeout=120) for _ in range(2))
    finally:
        for p in processes:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert outcomes == {0: "PeerFailureError peer=2", 1: "PeerFailureError peer=2"}
    assert processes[2].exitcode == -signal.SIGKILL
