"""Silent ranks, end to end: a rank SIGSTOPped in the middle of all-reduces (its connections open, its kernel still
acknowledging) is declared dead by the store after its lease, every survivor's collective raises PeerFailureError
naming it long before the group's timeout, and ``group.shrink()`` goes on without it, over tcp and shm; a rank busy
computing for longer than the lease, in Python or in numpy, is not declared dead, even the store's host.

Real processes with the rendezvous variables (no launcher: a stopped rank is this test's to stop, wake and kill).
Times are orderings against the lease and the group's timeout, never absolute figures.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import numpy as np
import pytest
from rank_processes import RANKS

from allreduce.runtime import CollectiveError, ProcessGroup, spawn
from allreduce.runtime.launcher._spawn import new_token, rank_environment, reserve_port

TIMEOUT_S = 120.0  # the group's timeout: a silent rank must be found long before it
LEASE_S = 3.0
WORLD_SIZE = 3
VICTIM = 2

pytestmark = pytest.mark.slow


def _looping_rank(env: dict[str, str], transport: str, out: Any) -> None:
    """A rank that all-reduces until its collective raises (reported at once), then shrinks and all-reduces once on
    the survivors (reported after)."""
    os.environ.update(env)
    import allreduce

    group = allreduce.init(transport=transport, timeout_s=TIMEOUT_S, lease_s=LEASE_S)
    rank = group.rank
    x = np.ones(1 << 16, np.float32)
    group.all_reduce(x)
    out.put(("ready", rank))
    try:
        while True:
            x[:] = 1.0
            group.all_reduce(x)
    except CollectiveError as exc:
        report: dict[str, Any] = {
            "rank": rank, "raised": time.monotonic(), "kind": type(exc).__name__, "peer": exc.peer,
            "message": str(exc),
        }  # fmt: skip
    out.put(("raised", report))
    report = {"rank": rank}
    try:
        group = group.shrink()
        if group.ahead_ranks:  # the stop split the survivors by one call: those behind take its result first
            group.broadcast(x, root=group.ahead_ranks[0])
        x[:] = 1.0
        group.all_reduce(x)
        report.update(size=group.world_size, sum=float(x[0]))
    except CollectiveError as exc:
        report["shrink_error"] = str(exc)
    finally:
        group.close()
    out.put(("shrunk", report))


def _stop_one(transport: str, victim: int, *, shrink: bool) -> dict[str, Any]:
    """Rank ``victim`` of 3 stopped while the ranks loop all-reduces: when it was stopped (``time.monotonic()``,
    which every process of the host shares) and the survivors' reports of what they raised, with, if ``shrink``,
    what their shrink did. Every process left (the stopped rank) is killed at the end."""
    ctx = RANKS
    out = ctx.Queue()
    reservation = reserve_port()
    port, token = int(reservation.getsockname()[1]), new_token()
    processes = [
        ctx.Process(target=_looping_rank, args=(rank_environment(r, WORLD_SIZE, master_port=port, token=token),
                                                transport, out))
        for r in range(WORLD_SIZE)
    ]  # fmt: skip
    for process in processes:
        process.start()
    reservation.close()
    try:
        for _ in range(WORLD_SIZE):
            assert out.get(timeout=TIMEOUT_S)[0] == "ready"
        time.sleep(0.5)  # the ranks are in the middle of their all-reduces
        stopped_at = time.monotonic()
        os.kill(processes[victim].pid, signal.SIGSTOP)
        reports: dict[int, dict[str, Any]] = {}
        seen = {"raised": 0, "shrunk": 0}
        while seen["raised"] < WORLD_SIZE - 1 or (shrink and seen["shrunk"] < WORLD_SIZE - 1):
            what, report = out.get(timeout=2 * TIMEOUT_S)
            seen[what] += 1
            reports.setdefault(report["rank"], {}).update(report)
        return {"transport": transport, "stopped_at": stopped_at, "reports": list(reports.values())}
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()  # SIGKILL ends a stopped rank too, and kill() allows one that ended since is_alive()
            process.join(timeout=30)


@pytest.fixture(scope="module", params=["tcp", "shm"])
def stopped(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Rank 2 of 3 stopped mid-loop (:func:`_stop_one`)."""
    return _stop_one(request.param, VICTIM, shrink=True)


def test_every_survivor_raises_peer_failure_naming_the_stopped_rank(stopped: dict[str, Any]) -> None:
    assert sorted(r["rank"] for r in stopped["reports"]) == [0, 1]
    for report in stopped["reports"]:
        assert (report["kind"], report["peer"]) == ("PeerFailureError", VICTIM), report["message"]


def test_the_survivors_raise_long_before_the_groups_timeout(stopped: dict[str, Any]) -> None:
    took = max(r["raised"] for r in stopped["reports"]) - stopped["stopped_at"]
    assert took < TIMEOUT_S / 4


def test_the_stopped_rank_is_not_declared_dead_before_its_lease(stopped: dict[str, Any]) -> None:
    # its last heartbeat left at most a beat period (a fifth of the lease) before it was stopped
    took = min(r["raised"] for r in stopped["reports"]) - stopped["stopped_at"]
    assert took >= LEASE_S * (1 - 1 / 5)


def test_the_survivors_shrink_without_the_stopped_rank_and_sum_exactly(stopped: dict[str, Any]) -> None:
    for report in stopped["reports"]:
        assert "shrink_error" not in report, report["shrink_error"]
        assert (report["size"], report["sum"]) == (WORLD_SIZE - 1, float(WORLD_SIZE - 1))


def test_every_survivor_names_a_stopped_store_host() -> None:
    # rank 0 hosts the store: stopped, it answers nobody; a rank blocked on a peer asks the store once a second and
    # gets no answer within the lease, which names rank 0 (the group then cannot shrink: nothing to agree through)
    case = _stop_one("tcp", 0, shrink=False)
    took = max(r["raised"] for r in case["reports"]) - case["stopped_at"]
    assert [(r["kind"], r["peer"]) for r in case["reports"]] == [("PeerFailureError", 0)] * 2
    assert took < TIMEOUT_S / 4


# ----------------------------------------------------------------------------------------------------------------
# A busy rank is not a silent one
# ----------------------------------------------------------------------------------------------------------------
BUSY_LEASE_S = 2.0
BUSY_FOR_S = 2 * BUSY_LEASE_S  # of each kind of work: longer than the lease, whatever the heartbeat's phase


def _busy_then_sum(group: ProcessGroup, busy: int) -> tuple[float, float]:
    """Rank ``busy`` computes (pure Python, then numpy) while the other waits for it in an all-reduce; the sum and
    how long the busy rank computed."""
    computed = 0.0
    if group.rank == busy:
        start = time.monotonic()
        while time.monotonic() - start < BUSY_FOR_S:
            sum(i * i for i in range(100_000))
        a = np.random.default_rng(0).random(4 << 20)
        while time.monotonic() - start < 2 * BUSY_FOR_S:
            np.sqrt(a, out=a)
            a += 1.0
        computed = time.monotonic() - start
    x = np.full(1024, float(group.rank + 1))
    group.all_reduce(x)
    return float(x[0]), computed


@pytest.mark.parametrize("busy", [0, 1], ids=["the-store-host-is-busy", "a-client-rank-is-busy"])
def test_a_rank_busy_for_longer_than_the_lease_is_not_declared_dead(busy: int) -> None:
    results = spawn(
        2, _busy_then_sum, busy, init_options={"transport": "tcp", "lease_s": BUSY_LEASE_S, "timeout_s": TIMEOUT_S},
        timeout_s=TIMEOUT_S,
    )  # fmt: skip
    assert results[busy][1] > 2 * BUSY_LEASE_S  # it did compute that long
    assert [total for total, _ in results] == [3.0, 3.0]
