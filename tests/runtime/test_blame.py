"""Who is blamed when a rank fails: every survivor names the rank at fault, not a neighbour that reacted to it.

Real processes over the real transports: a dying rank really exits, without closing anything.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from test_group_harness import report, run_ranks

import allreduce

BLAME_TIMEOUT_S = 60.0
"""The collective timeout of these groups: far longer than detecting a death takes, so a survivor that raises
CollectiveTimeoutError (instead of PeerFailureError) waited out the clock instead of hearing of the death."""


def _dies_before_collective_zero(rank: int, n: int, port: int, out: Any, victim: int) -> None:
    group = allreduce.init(rank, n, master_port=port, transport="tcp", timeout_s=BLAME_TIMEOUT_S)
    if rank == victim:
        out.put((rank, None))
        out.close()
        out.join_thread()
        os._exit(1)  # no close: the store sees the connection drop, no connection to a peer exists yet

    def body() -> tuple[str, int | None, str]:
        try:
            group.all_reduce(np.ones(1024, np.float32), algorithm="ring")
        except allreduce.CollectiveError as exc:
            return type(exc).__name__, exc.peer, str(exc)
        finally:
            group.close()
        return "returned", None, ""

    report(out, rank, body)


def test_tcp_death_before_the_connections_exist_is_named_by_every_survivor() -> None:
    n, victim = 4, 3
    results = run_ranks(n, _dies_before_collective_zero, victim, timeout_s=BLAME_TIMEOUT_S * 3)
    for rank, result in enumerate(results):
        if rank == victim:
            continue
        assert isinstance(result, tuple), result
        kind, peer, message = result
        assert (kind, peer) == ("PeerFailureError", victim), f"rank {rank}: {message}"
        assert f"rank {victim}" in message
