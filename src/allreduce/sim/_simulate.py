"""``simulate``: run a schedule on a topology, with faults, on the fast or the event-driven engine;
``simulate_sizes``: the same for several buffer sizes in one pass."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from allreduce.schedules import Schedule
from allreduce.sim._event import run_event
from allreduce.sim._fast import run_fast_certified, run_fast_sizes
from allreduce.sim._faults import Faults, apply_faults
from allreduce.sim._jit import available as kernel_available
from allreduce.sim._result import SimResult
from allreduce.sim._routing import Router
from allreduce.topology import PathTable, Topology, place

__all__ = [
    "AUTO_EXACT_MAX_RANKS",
    "AUTO_EXACT_MAX_TRANSFERS",
    "ENGINES",
    "FAST_ERROR_RANGE",
    "TRACE_RANKS",
    "auto_exact_affordable",
    "simulate",
    "simulate_sizes",
]

# engine="auto" gives the exact result on at most AUTO_EXACT_MAX_RANKS ranks and AUTO_EXACT_MAX_TRANSFERS
# transfers (where the two engines must agree): the fast engine's when it certified its result (SimResult.exact:
# see sim/_fast.py), else the event engine's. Beyond them: the fast engine, whose result says whether it is
# exact. With the compiled core (sim/_kernel.py) the event engine costs 1.5-5 us of CPU per transfer, and from
# 2^22 transfers on it runs on a layout streamed from the schedule (sim/_stream.py), whose memory is that of the
# steps under way, not of every transfer (benchmarks/bench_engines.py --one, random placement, 64 MiB: a
# 2,048-rank ring, 8.4 M transfers, 12.9 CPU-s and 581 MB; direct all-reduce on 512 ranks 4.7 us a transfer).
# So the limit is time alone, that of a run of under a minute: 2^23 transfers, every double binary tree to
# 16,384 ranks, rings and direct to 2,048 ranks (a 4,096-rank ring takes 56 CPU-s, direct on 2,896 ranks about
# 80). Without numba the numpy cores run, 6-15x slower (the slowest measured in
# benchmarks/bench_sim_agreement.py: 30 CPU-seconds, a 256-rank ring on a randomly placed torus): at most 256
# ranks, however many transfers.
AUTO_EXACT_MAX_RANKS = 16_384 if kernel_available() else 256
AUTO_EXACT_MAX_TRANSFERS = 2**23 if kernel_available() else None
# How far the fast engine's time was from the event engine's where it could not certify its result, per
# algorithm: (lowest, highest) relative error over the grid of benchmarks/bench_engines.py --errors (fat-tree,
# Clos 1:1 and 4:1, rail, torus, dragonfly; linear and random placement; 256 and 1,024 ranks; 64 MiB). Measured,
# not proven: the range a reader can expect, not a guarantee. It tends to overstate the time, since it holds
# every flow at its share of the pattern's busiest moment.
FAST_ERROR_RANGE = {
    "ring": (-0.0001, 0.27),
    "halving_doubling": (-0.012, 0.28),
    "double_binary_tree": (0.0, 0.12),
    "hierarchical": (0.0, 0.06),
}
# Ranks whose per-step (or per-phase) times a result keeps for traces.
TRACE_RANKS = 64

# The engines simulate (and simulate_tail, per sample) can run.
ENGINES = ("auto", "fast", "event")


def auto_exact_affordable(schedule: Schedule) -> bool:
    """Whether engine="auto" runs the event engine on ``schedule`` where the fast engine cannot certify."""
    if schedule.world_size > AUTO_EXACT_MAX_RANKS:
        return False
    return AUTO_EXACT_MAX_TRANSFERS is None or int(schedule.streams.steps.sum()) <= AUTO_EXACT_MAX_TRANSFERS


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
    links and slows ranks; ``engine`` is "fast", "event", or "auto" (exact on at most AUTO_EXACT_MAX_RANKS ranks
    and AUTO_EXACT_MAX_TRANSFERS transfers: the fast engine where it is exact, else the event engine; the fast
    engine beyond). While the event engine
    runs, ``progress`` (if given) is called now and then with the fraction of transfers delivered so far.
    """
    (result,) = simulate_sizes(
        schedule,
        topology,
        sizes_bytes=[_checked_size(size_bytes, "size_bytes")],
        placement=placement,
        routing=routing,
        seed=seed,
        faults=faults,
        engine=engine,
        trace_ranks=trace_ranks,
        progress=progress,
    )
    return result


def simulate_sizes(
    schedule: Schedule,
    topology: Topology,
    *,
    sizes_bytes: Sequence[float],
    placement: str | Sequence[int] = "linear",
    routing: str | PathTable | None = None,
    seed: int = 0,
    faults: Faults | None = None,
    engine: str = "auto",
    trace_ranks: int = TRACE_RANKS,
    progress: Callable[[float], None] | None = None,
) -> list[SimResult]:
    """:func:`simulate` for every buffer size of ``sizes_bytes`` at once: one result per size, in order, each
    what :func:`simulate` returns for that size alone (to rounding: the same arithmetic, column by column).

    The flow patterns, their routes and fair rates do not depend on the size; they are computed once, and the
    fast engine advances every size's clocks together. Sizes the event engine runs (``engine="event"``, or
    "auto" where the fast engine cannot certify a size) run one by one on the same routes; ``progress`` is
    then called per run."""
    sizes = [_checked_size(size, f"sizes_bytes[{i}]") for i, size in enumerate(sizes_bytes)]
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if trace_ranks < 0:
        raise ValueError(f"trace_ranks must be >= 0, got {trace_ranks}")
    faults = faults or Faults()
    n = schedule.world_size
    if n > topology.num_gpus:
        raise ValueError(f"{schedule.name} needs {n} ranks but {topology.name} has only {topology.num_gpus} GPUs")
    if not sizes:
        return []
    delay = faults.rank_delay_s(n)
    faulted = apply_faults(topology, faults)
    rank_gpu = np.asarray(place(n, faulted, placement, seed=seed), dtype=np.int64)
    router = Router(faulted, rank_gpu, routing, seed)

    def event(size: float) -> SimResult:
        return run_event(
            schedule, router, size_bytes=size, rank_delay_s=delay, trace_ranks=trace_ranks, progress=progress
        )

    if engine == "event":
        return [event(size) for size in sizes]
    if engine == "fast" or not auto_exact_affordable(schedule):
        return run_fast_sizes(schedule, router, sizes_bytes=sizes, rank_delay_s=delay, trace_ranks=trace_ranks)
    # The fast run is cheap, and exact where it certified itself; only elsewhere pay for the event engine (and
    # once no size is certified, the fast run stops).
    certified = run_fast_certified(schedule, router, sizes_bytes=sizes, rank_delay_s=delay, trace_ranks=trace_ranks)
    if certified is None:
        return [event(size) for size in sizes]
    return [result if result.exact else event(size) for size, result in zip(sizes, certified, strict=True)]


def _checked_size(size_bytes: object, name: str) -> float:
    """``size_bytes`` as a float, refused unless a finite number >= 0 (``name`` says which argument it was)."""
    try:
        size = float(size_bytes)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number of bytes, got {size_bytes!r}") from None
    if not (math.isfinite(size) and size >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {size_bytes!r}")
    return size
