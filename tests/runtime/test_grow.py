"""group.grow(): a rank SIGKILLed mid-loop is shrunk out, a new process takes its seat (``ALLREDUCE_JOIN=1``), the
members admit it at their next grow() and the three sum exactly again, over shm and tcp.

Plain processes with the rendezvous variables (not spawn(), which stops the survivors as soon as a rank dies).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from typing import Any

import numpy as np
import pytest

from allreduce.runtime._spawn import new_token, rank_environment, reserve_port

TIMEOUT_S = 60.0
VICTIM = 2


def _member(rank: int, env: dict[str, str], transport: str, out: Any) -> None:
    """All-reduce once on three; the victim dies; the others shrink, then call grow() between all-reduces until
    the group is three again, and sum once more."""
    os.environ.update(env)
    import allreduce

    group = allreduce.init(transport=transport, timeout_s=TIMEOUT_S)
    report: dict[str, Any] = {"rank": rank, "sizes": []}
    try:
        x = np.full(1024, float(rank + 1))
        group.all_reduce(x)
        if rank == VICTIM:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            while True:
                group.all_reduce(x)
        except allreduce.CollectiveError as exc:
            report["error"] = (type(exc).__name__, exc.peer)
        group = group.shrink()
        report["sizes"].append(group.world_size)
        deadline = time.monotonic() + TIMEOUT_S
        while group.world_size < 3 and time.monotonic() < deadline:
            x = np.full(1024, float(rank + 1))
            group.all_reduce(x)  # a step of the shrunk group
            group = group.grow()
            time.sleep(0.01)
        report["sizes"].append(group.world_size)
        report["rank_after"] = group.rank
        x = np.full(1024, float(rank + 1))
        group.all_reduce(x)
        report["sum"] = float(x[0])
    finally:
        group.close()
        out.put(report)


def _joiner(env: dict[str, str], transport: str, out: Any) -> None:
    os.environ.update(env)
    import allreduce

    started = time.monotonic()
    with allreduce.init(transport=transport, timeout_s=TIMEOUT_S) as group:
        x = np.full(1024, float(VICTIM + 1))
        group.all_reduce(x)
        out.put({"rank": "joiner", "rank_after": group.rank, "size": group.world_size, "sum": float(x[0]),
                 "s": time.monotonic() - started})  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_restarted_rank_rejoins_and_the_three_sum_exactly(transport: str) -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    reservation = reserve_port()
    port, token = int(reservation.getsockname()[1]), new_token()
    envs = [rank_environment(r, 3, master_port=port, token=token) for r in range(3)]
    procs = [ctx.Process(target=_member, args=(r, envs[r], transport, out)) for r in range(3)]
    for p in procs:
        p.start()
    reservation.close()
    joiner = None
    try:
        procs[VICTIM].join(timeout=120)
        assert procs[VICTIM].exitcode == -signal.SIGKILL
        joiner = ctx.Process(target=_joiner, args=({**envs[VICTIM], "ALLREDUCE_JOIN": "1"}, transport, out))
        joiner.start()
        reports = {r["rank"]: r for r in (out.get(timeout=120) for _ in range(3))}
    finally:
        for p in [*procs, *([joiner] if joiner else [])]:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for r in (0, 1):
        assert reports[r]["error"] == ("PeerFailureError", VICTIM)
        assert reports[r]["sizes"] == [2, 3]
        assert reports[r]["rank_after"] == r
        assert reports[r]["sum"] == 6.0
    assert reports["joiner"]["rank_after"] == 2  # numbered after the members
    assert reports["joiner"]["sum"] == 6.0
