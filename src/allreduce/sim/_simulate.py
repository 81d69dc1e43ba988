"""``simulate``: run a schedule on a topology, with faults, on the fast or the event-driven engine."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from allreduce.schedules import Schedule
from allreduce.sim._event import run_event
from allreduce.sim._fast import run_fast, run_fast_checked
from allreduce.sim._faults import Faults, apply_faults
from allreduce.sim._result import SimResult
from allreduce.sim._routing import Router
from allreduce.topology import PathTable, Topology, place

__all__ = ["AUTO_EXACT_MAX_RANKS", "ENGINES", "TRACE_RANKS", "simulate"]

# engine="auto" gives the exact result on at most AUTO_EXACT_MAX_RANKS ranks (where the two engines must
# agree): the fast engine's when it certified its result (SimResult.exact: see sim/_fast.py), else the event
# engine's, however many transfers that takes (the slowest measured in benchmarks/bench_sim_agreement.py: 30
# CPU-seconds, a 256-rank ring on a randomly placed torus). Beyond it: the fast engine, whose result says whether
# it is exact.
AUTO_EXACT_MAX_RANKS = 256
# Ranks whose per-step (or per-phase) times a result keeps for traces.
TRACE_RANKS = 64

# The engines simulate (and simulate_tail, per sample) can run.
ENGINES = ("auto", "fast", "event")


def simulate(
    schedule: Schedule,
    topology: Topology,
    *,
    size_bytes: float,
    placement: str | Sequence[int] = "linear",
    routing: str | PathTable | None = None,
    seed: int = 0,
    faults: Faults | None = None,
    engine: str = "auto",
    trace_ranks: int = TRACE_RANKS,
    progress: Callable[[float], None] | None = None,
) -> SimResult:
    """Simulate ``schedule`` on ``topology`` with a buffer of ``size_bytes`` bytes per rank.

    ``placement`` maps ranks to GPUs ("linear", "random" with ``seed``, or a list); ``routing`` is one of the
    topology's routings (None: its default — ECMP, or dimension-order on tori); ``faults`` degrades or fails
    links and slows ranks; ``engine`` is "fast", "event", or "auto" (exact on at most AUTO_EXACT_MAX_RANKS ranks:
    the fast engine where it is exact, else the event engine; the fast engine beyond). While the event engine
    runs, ``progress`` (if given) is called now and then with the fraction of transfers delivered so far.
    """
    try:
        size = float(size_bytes)
    except (TypeError, ValueError):
        raise ValueError(f"size_bytes must be a number of bytes, got {size_bytes!r}") from None
    if not (math.isfinite(size) and size >= 0):
        raise ValueError(f"size_bytes must be a finite number >= 0, got {size_bytes!r}")
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
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
    if engine == "event":
        return run_event(
            schedule, router, size_bytes=size, rank_delay_s=delay, trace_ranks=trace_ranks, progress=progress
        )
    if engine == "fast" or n > AUTO_EXACT_MAX_RANKS:
        return run_fast(schedule, router, size_bytes=size, rank_delay_s=delay, trace_ranks=trace_ranks)
    # The fast run is cheap, and exact when it certified itself; only otherwise pay for the event engine.
    result, exact = run_fast_checked(schedule, router, size_bytes=size, rank_delay_s=delay, trace_ranks=trace_ranks)
    if exact:
        return result
    return run_event(schedule, router, size_bytes=size, rank_delay_s=delay, trace_ranks=trace_ranks, progress=progress)
