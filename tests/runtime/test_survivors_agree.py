"""Survivors of one SIGKILL agree on which collective failed, over shm and tcp alike: a rank that finished its part
of a collective and then died lets the others finish that one (even a rank still waiting on a live, late peer), and
the next collective fails on every survivor naming it. Were they to disagree, a retry on the shrunk group would pair
different collectives."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from allreduce.runtime import CollectiveError, spawn_elastic

LATE = "hold:rank=1:p=1:ms=300"
"""Rank 1 holds its sends 0.3 s before each step: the root still waits on it, alive, when rank 3 (done) dies."""


def _reduce_until_failure(transport: str) -> tuple[int, str, int | None] | None:
    """Reduce to rank 0 six times; rank 3 SIGKILLs itself after the second. The call that raised, the error's
    class and the peer it names."""
    import allreduce

    group = allreduce.init(transport=transport, timeout_s=60)
    x = np.ones(1 << 14, np.float32)
    for call in range(6):
        try:
            group.reduce(x, root=0)
        except CollectiveError as exc:
            return call, type(exc).__name__, exc.peer
        if group.rank == 3 and call == 1:
            os.kill(os.getpid(), signal.SIGKILL)
    return None


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_every_survivor_of_one_kill_fails_the_same_collective_naming_it(transport: str) -> None:
    outcome = spawn_elastic(
        4, _reduce_until_failure, transport, min_ranks=3, env={"ALLREDUCE_INJECT": LATE}, timeout_s=120
    )
    assert [d.rank for d in outcome.departures] == [3]
    assert sorted(outcome.results) == [0, 1, 2]
    assert set(outcome.results.values()) == {(2, "PeerFailureError", 3)}  # the call after the one rank 3 finished
