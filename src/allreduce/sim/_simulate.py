"""``simulate``: run a schedule on a topology, with faults, on the fast or the event-driven engine."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from allreduce.schedules import Schedule
from allreduce.sim._event import run_event
from allreduce.sim._fast import run_fast
from allreduce.sim._faults import Faults, apply_faults
from allreduce.sim._result import SimResult
from allreduce.sim._routing import Router
from allreduce.topology import Topology, place

__all__ = ["AUTO_EVENT_MAX_TRANSFERS", "TRACE_RANKS", "simulate"]

# engine="auto" runs the exact event-driven model when the schedule has at most this many transfers (it then
# takes well under a second) and the fast engine beyond.
AUTO_EVENT_MAX_TRANSFERS = 4096
# Ranks whose per-step (or per-phase) times a result keeps for traces.
TRACE_RANKS = 64

_ENGINES = ("auto", "fast", "event")


def _num_transfers(schedule: Schedule) -> int:
    return int(schedule.streams.steps.sum())


def simulate(
    schedule: Schedule,
    topology: Topology,
    *,
    size_bytes: float,
    placement: str | Sequence[int] = "linear",
    routing: str | None = None,
    seed: int = 0,
    faults: Faults | None = None,
    engine: str = "auto",
    trace_ranks: int = TRACE_RANKS,
) -> SimResult:
    """Simulate ``schedule`` on ``topology`` with a buffer of ``size_bytes`` bytes per rank.

    ``placement`` maps ranks to GPUs ("linear", "random" with ``seed``, or a list); ``routing`` is one of the
    topology's routings (None: its default — ECMP, or dimension-order on tori); ``faults`` degrades or fails
    links and slows ranks; ``engine`` is "fast", "event", or "auto" (event-driven for small schedules).
    """
    try:
        size = float(size_bytes)
    except (TypeError, ValueError):
        raise ValueError(f"size_bytes must be a number of bytes, got {size_bytes!r}") from None
    if not (math.isfinite(size) and size >= 0):
        raise ValueError(f"size_bytes must be a finite number >= 0, got {size_bytes!r}")
    if engine not in _ENGINES:
        raise ValueError(f"engine must be one of {', '.join(_ENGINES)}, got {engine!r}")
    if trace_ranks < 0:
        raise ValueError(f"trace_ranks must be >= 0, got {trace_ranks}")
    faults = faults or Faults()
    n = schedule.world_size
    if n > topology.num_gpus:
        raise ValueError(f"{schedule.name} needs {n} ranks but {topology.name} has only {topology.num_gpus} GPUs")
    delay = faults.rank_delay_s(n)
    faulted = apply_faults(topology, faults)
    rank_gpu = np.asarray(place(n, faulted, placement, seed=seed), dtype=np.int64)
    router = Router(faulted, rank_gpu, routing, seed)
    if engine == "auto":
        engine = "event" if _num_transfers(schedule) <= AUTO_EVENT_MAX_TRANSFERS else "fast"
    run = run_event if engine == "event" else run_fast
    return run(schedule, router, size_bytes=size, rank_delay_s=delay, trace_ranks=trace_ranks)
