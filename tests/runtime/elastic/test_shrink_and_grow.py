"""group.shrink() and group.grow(): after a rank is SIGKILLed mid-loop, the survivors agree on who is left and go on
as a smaller group with exact results, over shm and tcp; when the store's host dies, every survivor says so; a new
process that takes the dead rank's seat (``ALLREDUCE_JOIN=1``) is admitted at the members' next grow() and they
all sum exactly again.

The ranks run under spawn_elastic (a rank's death does not stop the others; a restart asks to join), but for the
death of rank 0, which ends an elastic job: that test starts plain processes with the rendezvous variables.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from rank_processes import RANKS

from allreduce.runtime import CollectiveError, ProcessGroup, spawn_elastic
from allreduce.runtime.launcher._spawn import new_token, rank_environment, reserve_port

TIMEOUT_S = 60.0


def _sum(group: ProcessGroup, value: float) -> float:
    """All-reduce ``value`` over the group."""
    x = np.full(4096, value)
    group.all_reduce(x)
    return float(x[0])


def _lose_a_rank(group: ProcessGroup, value: float, *, dies: bool) -> tuple[str, int | None]:
    """All-reduce once on the whole group; the rank where ``dies`` then SIGKILLs itself, and the others all-reduce
    until its death reaches them: the error each one raised (its kind and the peer it names)."""
    _sum(group, value)
    if dies:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        while True:
            _sum(group, value)
    except CollectiveError as exc:
        return type(exc).__name__, exc.peer


# ----------------------------------------------------------------------------------------------------------------
# shrink()
# ----------------------------------------------------------------------------------------------------------------
def _shrinking(transport: str, victims: Sequence[int]) -> dict[str, Any]:
    """Every victim (old rank numbers, in order) dies in turn; survivors shrink each time and report what each
    group of survivors summed."""
    import allreduce

    group = allreduce.init(transport=transport, timeout_s=TIMEOUT_S)
    me = group.rank  # this process's rank in the group as first formed
    report: dict[str, Any] = {"rank": me, "errors": [], "groups": []}
    try:
        for victim in victims:
            report["errors"].append(_lose_a_rank(group, float(me + 1), dies=me == victim))
            started = time.monotonic()
            group = group.shrink()
            total = _sum(group, float(me + 1))
            report["groups"].append(
                {"rank": group.rank, "size": group.world_size, "sum": total, "s": time.monotonic() - started}
            )
    except CollectiveError as exc:
        report["final"] = (type(exc).__name__, exc.peer, str(exc))
    finally:
        group.close()
    return report


def _survivors(world_size: int, transport: str, victims: Sequence[int]) -> dict[int, dict[str, Any]]:
    """The reports of the survivors, by rank; every victim has died of its SIGKILL, in turn."""
    outcome = spawn_elastic(
        world_size, _shrinking, transport, victims, min_ranks=world_size - len(victims), timeout_s=3 * TIMEOUT_S
    )
    assert [(d.rank, d.how) for d in outcome.departures] == [(v, "was killed by SIGKILL") for v in victims]
    return outcome.results


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_survivors_of_a_killed_rank_shrink_and_sum_exactly(transport: str) -> None:
    reports = _survivors(4, transport, victims=[2])
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
    reports = _survivors(4, "shm", victims=[3, 1])
    assert sorted(reports) == [0, 2]
    for old_rank, report in reports.items():
        first, second = report["groups"]
        assert (first["size"], first["sum"]) == (3, 1.0 + 2.0 + 3.0)
        assert (second["size"], second["rank"], second["sum"]) == (2, [0, 2].index(old_rank), 1.0 + 3.0)


def _plain_rank(env: dict[str, str], out: Any, transport: str, victims: Sequence[int]) -> None:
    os.environ.update(env)
    out.put(_shrinking(transport, victims))


@pytest.mark.slow
def test_when_the_stores_host_dies_every_survivor_says_the_group_cannot_shrink() -> None:
    world_size = 3
    ctx = RANKS
    out = ctx.Queue()
    reservation = reserve_port()
    port, token = int(reservation.getsockname()[1]), new_token()
    envs = [rank_environment(r, world_size, master_port=port, token=token) for r in range(world_size)]
    processes = [ctx.Process(target=_plain_rank, args=(envs[r], out, "shm", [0])) for r in range(world_size)]
    for p in processes:
        p.start()
    reservation.close()
    try:
        reports = [out.get(timeout=3 * TIMEOUT_S) for _ in range(world_size - 1)]
    finally:
        for p in processes:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert processes[0].exitcode == -signal.SIGKILL
    assert sorted(r["rank"] for r in reports) == [1, 2]
    for report in reports:
        kind, peer, message = report["final"]
        assert (kind, peer) == ("ShrinkError", 0)
        assert "rank 0, which hosts the store" in message


# ----------------------------------------------------------------------------------------------------------------
# grow()
# ----------------------------------------------------------------------------------------------------------------
VICTIM = 2


def _growing(transport: str) -> dict[str, Any]:
    """On three: the victim dies; the others shrink, then call grow() between all-reduces until the group is three
    again, and sum once more. The victim's restart joins and sums with them."""
    import allreduce

    group = allreduce.init(transport=transport, timeout_s=TIMEOUT_S)
    rank = group.rank
    if os.environ.get("ALLREDUCE_JOIN") == "1":
        with group:
            return {"joined": True, "rank_after": rank, "sum": _sum(group, float(VICTIM + 1))}
    report: dict[str, Any] = {"joined": False, "sizes": []}
    try:
        report["error"] = _lose_a_rank(group, float(rank + 1), dies=rank == VICTIM)
        group = group.shrink()
        report["sizes"].append(group.world_size)
        deadline = time.monotonic() + TIMEOUT_S
        while group.world_size < 3 and time.monotonic() < deadline:
            _sum(group, float(rank + 1))  # a step of the shrunk group
            group = group.grow()
            time.sleep(0.01)
        report["sizes"].append(group.world_size)
        report["rank_after"] = group.rank
        report["sum"] = _sum(group, float(rank + 1))
    finally:
        group.close()
    return report


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_restarted_rank_rejoins_and_the_three_sum_exactly(transport: str) -> None:
    outcome = spawn_elastic(3, _growing, transport, min_ranks=2, max_restarts=1, timeout_s=240)
    assert [(d.rank, d.how, d.restarted) for d in outcome.departures] == [(VICTIM, "was killed by SIGKILL", True)]
    reports = outcome.results
    for r in (0, 1):
        assert reports[r]["error"] == ("PeerFailureError", VICTIM)
        assert reports[r]["sizes"] == [2, 3]
        assert reports[r]["rank_after"] == r
        assert reports[r]["sum"] == 6.0
    joiner = reports[VICTIM]  # the restart's result stands for its rank
    assert joiner["joined"]
    assert joiner["rank_after"] == 2  # numbered after the members
    assert joiner["sum"] == 6.0
