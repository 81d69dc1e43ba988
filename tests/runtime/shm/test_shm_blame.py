"""Whom a waiting rank names when a peer closes the group mid-collective: a death that shows within the grace (a
SIGKILLed process's sockets reset before its pidfd reports the exit, so a peer may react to it first) is the root
cause, not the peer that closed in reaction to it."""

from __future__ import annotations

import os
import signal
import time
import uuid
from typing import Any

import numpy as np
import pytest
from rank_processes import RANKS

from allreduce.runtime import PeerFailureError, ProcessGroup
from allreduce.runtime.shm import ShmTransport


def _rank(rank: int, job: str, out: Any, go: Any) -> None:
    group = ProcessGroup(ShmTransport(rank, 3, job, timeout_s=60), transport_name="shm", timeout_s=60)
    group.all_reduce(np.ones(16))
    out.put((rank, "ready", os.getpid()))
    if rank == 0:
        try:
            group.all_reduce(np.ones(16))  # ranks 1 and 2 never call this one
            out.put((rank, "no error", None))
        except PeerFailureError as exc:
            out.put((rank, "PeerFailureError", exc.peer))
    elif rank == 1:
        go.wait()
        group.close()  # as a rank does that lost a peer on another of its groups
        out.put((rank, "closed", time.monotonic()))
        return
    else:
        time.sleep(600)  # killed by the test
    group.close()


@pytest.mark.slow
@pytest.mark.serial  # the kill must land within the grace after rank 1's close
def test_a_death_just_after_a_peer_closed_is_named_instead_of_the_peer() -> None:
    ctx = RANKS
    out, go = ctx.Queue(), ctx.Event()
    job = f"blame-{uuid.uuid4().hex[:8]}"
    procs = [ctx.Process(target=_rank, args=(r, job, out, go)) for r in range(3)]
    for p in procs:
        p.start()
    try:
        pids = {}
        for _ in range(3):
            rank, what, pid = out.get(timeout=120)
            assert what == "ready"
            pids[rank] = pid
        time.sleep(0.3)  # rank 0 is asleep in its second call's descriptor exchange
        go.set()
        assert out.get(timeout=60)[:2] == (1, "closed")
        os.kill(pids[2], signal.SIGKILL)  # after the close, well within the grace (CLOSED_GRACE_S)
        assert out.get(timeout=60) == (0, "PeerFailureError", 2)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
