"""The runtime's tail section of ``allreduce demo``: four real processes, one injected straggler, named by stats()."""

from __future__ import annotations

from typing import Any

import numpy as np

from allreduce.runtime import GroupStats, spawn
from allreduce.runtime.transport import INJECT_ENV
from allreduce.units import format_bytes

__all__ = ["demo_section"]

DEMO_RANKS = 4
DEMO_CALLS = 200
DEMO_SIZE_BYTES = 256 * 1024
DEMO_STRAGGLER = 2
DEMO_DELAY = "1ms"
"""Rank 2 sleeps 1 ms before every all-reduce: a straggler, as compute jitter makes one."""


def _rank(group: Any, calls: int, size_bytes: int) -> GroupStats:
    group.recording = True
    x = np.zeros(size_bytes // 4, np.float32)
    for _ in range(calls):
        group.all_reduce(x, algorithm="ring")
    stats: GroupStats = group.stats(last=calls)
    return stats


def demo_section() -> str:
    """A real 4-rank shm ring all-reduce, without and with a 1 ms straggler; the stats table names it (seconds)."""
    clean = spawn(DEMO_RANKS, _rank, DEMO_CALLS, DEMO_SIZE_BYTES, init_options={"transport": "shm"})[0]
    spec = f"delay:rank={DEMO_STRAGGLER}:{DEMO_DELAY}"
    slow = spawn(
        DEMO_RANKS,
        _rank,
        DEMO_CALLS,
        DEMO_SIZE_BYTES,
        init_options={"transport": "shm"},
        env={INJECT_ENV: spec},
    )[0]
    others = [r.time_p50_s for r in slow.ranks if r.rank != DEMO_STRAGGLER]
    clean_p50 = float(np.median([r.time_p50_s for r in clean.ranks]))
    lines = [
        f"{DEMO_RANKS} real processes (shm), ring all-reduce of {format_bytes(DEMO_SIZE_BYTES)}, {DEMO_CALLS} calls; "
        f"{INJECT_ENV}={spec!r}",
        f"  median time in the all-reduce without the straggler: {clean_p50 * 1e3:.3f} ms; with it, on the other "
        f"ranks: {float(np.median(others)) * 1e3:.3f} ms (each waits for rank {DEMO_STRAGGLER}'s {DEMO_DELAY})",
        f"  group.stats() names rank {slow.slowest_rank} as the slowest rank:",
        "",
        *("  " + line for line in slow.table().splitlines()),
    ]
    return "\n".join(lines)
