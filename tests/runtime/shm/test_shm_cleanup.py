"""Shared memory never accumulates: segments of ranks killed before close() are swept by the next transport."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid

import pytest

from allreduce.runtime.shm import ShmTransport, shm_prefix, sweep_stale_segments

_CHILD = r"""
import os, signal, sys
from allreduce.runtime.shm import ShmTransport
t = ShmTransport(0, 1, sys.argv[1], timeout_s=30)
t.allocate(1 << 20)          # two group.empty() segments
t.allocate(1 << 16)
print("ready", flush=True)
os.kill(os.getpid(), signal.SIGKILL)   # die without close(), as a killed rank does
"""


def _files(job: str) -> list[str]:
    stem = shm_prefix(job)
    return sorted(name for name in os.listdir("/dev/shm") if name.startswith(stem + "-"))


@pytest.mark.slow
@pytest.mark.serial  # alone: any transport another test starts meanwhile sweeps the dead rank's files first
def test_segments_of_a_killed_rank_are_swept_by_the_next_transport() -> None:
    job = f"sweep-{uuid.uuid4().hex}"
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, job], capture_output=True, text=True, timeout=120, check=False
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert "ready" in child.stdout
    left = _files(job)
    assert len(left) == 2, left  # the data segments outlived their owner (control segments are unlinked at start)
    survivor = ShmTransport(0, 1, f"other-{uuid.uuid4().hex}", timeout_s=30)
    try:
        assert _files(job) == []
    finally:
        survivor.close()


def test_the_sweep_leaves_live_owners_alone() -> None:
    job = f"live-{uuid.uuid4().hex}"
    transport = ShmTransport(0, 1, job, timeout_s=30)
    try:
        transport.allocate(4096)
        before = _files(job)
        assert len(before) == 1
        assert not any(name in before for name in sweep_stale_segments())
        assert _files(job) == before
    finally:
        transport.close()
    assert _files(job) == []


_TWO_GROUPS_CHILD = r"""
import os, signal, sys
from allreduce.runtime.shm import ShmTransport
transports = [ShmTransport(1, 2, job, timeout_s=60) for job in sys.argv[1:]]
for t in transports:
    t.allocate(1 << 16)
print("ready", flush=True)
sys.stdin.readline()
os.kill(os.getpid(), signal.SIGKILL)   # die without close(), as a killed rank does
"""


@pytest.mark.slow
@pytest.mark.serial  # alone: any transport another test starts meanwhile sweeps the dead rank's files first
def test_closing_groups_removes_the_files_of_a_peer_that_was_killed() -> None:
    # No collective runs after the kill, so no wait ever finds the dead peer: only close() can.
    jobs = [f"closed-{uuid.uuid4().hex}" for _ in range(2)]
    with subprocess.Popen(
        [sys.executable, "-c", _TWO_GROUPS_CHILD, *jobs], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as child:
        try:
            transports = [ShmTransport(0, 2, job, timeout_s=60) for job in jobs]
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "ready"
            assert child.stdin is not None
            child.stdin.write("die\n")
            child.stdin.flush()
            assert child.wait(timeout=60) == -signal.SIGKILL
            assert all(any("-1-" in name for name in _files(job)) for job in jobs)  # the dead rank's data segments
            for t in transports:
                t.close()
            assert [_files(job) for job in jobs] == [[], []]
        finally:
            child.kill()
