"""group.shrink(): after a rank is SIGKILLed mid-loop, the survivors agree on who is left and go on as a smaller
group with exact results, over shm and tcp; when the store's host dies, every survivor says so.

Plain processes with the rendezvous variables (not spawn(), which stops the survivors as soon as a rank dies).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from allreduce.runtime._spawn import new_token, rank_environment, reserve_port

TIMEOUT_S = 60.0


def _rank(rank: int, env: dict[str, str], transport: str, victims: Sequence[int], out: Any) -> None:
    """Loop all-reduces; every victim (old rank numbers, in order) dies in turn; survivors shrink each time and
    report what each group of survivors summed."""
    os.environ.update(env)
    import allreduce

    group = allreduce.init(transport=transport, timeout_s=TIMEOUT_S)
    me = rank  # this process's rank in the group as first formed
    alive = list(range(group.world_size))
    report: dict[str, Any] = {"rank": rank, "errors": [], "groups": []}
    try:
        for victim in victims:
            x = np.full(4096, float(me + 1))
            group.all_reduce(x)
            if me == victim:
                os.kill(os.getpid(), signal.SIGKILL)
            try:
                while True:
                    group.all_reduce(x)
            except allreduce.CollectiveError as exc:
                report["errors"].append((type(exc).__name__, exc.peer))
            alive.remove(victim)
            started = time.monotonic()
            group = group.shrink()
            x = np.full(4096, float(me + 1))
            group.all_reduce(x)
            report["groups"].append(
                {"rank": group.rank, "size": group.world_size, "sum": float(x[0]), "s": time.monotonic() - started}
            )
    except allreduce.CollectiveError as exc:
        report["final"] = (type(exc).__name__, exc.peer, str(exc))
    finally:
        group.close()
        out.put(report)


def _run(world_size: int, transport: str, victims: Sequence[int]) -> dict[int, dict[str, Any]]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    reservation = reserve_port()
    port, token = int(reservation.getsockname()[1]), new_token()
    processes = [
        ctx.Process(
            target=_rank,
            args=(r, rank_environment(r, world_size, master_port=port, token=token), transport, victims, out),
        )
        for r in range(world_size)
    ]
    for p in processes:
        p.start()
    reservation.close()
    try:
        reports = [out.get(timeout=3 * TIMEOUT_S) for _ in range(world_size - len(victims))]
    finally:
        for p in processes:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for v in victims:
        assert processes[v].exitcode == -signal.SIGKILL
    return {r["rank"]: r for r in reports}


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_survivors_of_a_killed_rank_shrink_and_sum_exactly(transport: str) -> None:
    reports = _run(4, transport, victims=[2])
    assert sorted(reports) == [0, 1, 3]
    for old_rank, report in reports.items():
        assert report["errors"] == [("PeerFailureError", 2)], report
        assert len(report["groups"]) == 1, report
        (group,) = report["groups"]
        assert group["size"] == 3
        assert group["rank"] == [0, 1, 3].index(old_rank)
        assert group["sum"] == 1.0 + 2.0 + 4.0


@pytest.mark.slow
def test_a_group_shrinks_twice_and_renumbers_each_time() -> None:
    reports = _run(4, "shm", victims=[3, 1])
    assert sorted(reports) == [0, 2]
    for old_rank, report in reports.items():
        first, second = report["groups"]
        assert (first["size"], first["sum"]) == (3, 1.0 + 2.0 + 3.0)
        assert (second["size"], second["rank"], second["sum"]) == (2, [0, 2].index(old_rank), 1.0 + 3.0)


@pytest.mark.slow
def test_when_the_stores_host_dies_every_survivor_says_the_group_cannot_shrink() -> None:
    reports = _run(3, "shm", victims=[0])
    assert sorted(reports) == [1, 2]
    for report in reports.values():
        kind, peer, message = report["final"]
        assert (kind, peer) == ("ShrinkError", 0)
        assert "rank 0, which hosts the store" in message
