"""What re-planning around a slow link would gain, predicted before the cluster is touched.

The runtime's re-planning (:mod:`allreduce.runtime` ``ALLREDUCE_REPLAN``) measures the rate of every link its
ring uses and, when one is consistently slow, re-orders the ring with
:func:`allreduce.schedules.best_ring_order` (links it never measured count as the median one). This module plays
the same rounds on the simulator: the ring's links are "measured" as the flow model gives them (the ring's one
flow pattern, routed, max-min fair, with the faults applied); while one is slow (below
:data:`~allreduce.schedules.SLOW_LINK_RATIO` of the median, the runtime's rule) the order is re-planned from those
rates, and again while it changes (each round measures the links of the new ring too); then both rings are
simulated. The answer is what re-planning can recover: a degraded link or a congested path; not a slow rank,
whose compute delays every ring equally (said in the note).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from allreduce.schedules import SLOW_LINK_RATIO, Schedule, best_ring_order, ordered_ring, ring_all_reduce
from allreduce.sim._faults import Faults, apply_faults
from allreduce.sim._result import SimResult
from allreduce.sim._routing import Router
from allreduce.sim._simulate import simulate
from allreduce.topology import Topology, place

__all__ = ["MAX_MITIGATE_RANKS", "Mitigation", "mitigate_ring"]

MAX_MITIGATE_RANKS = 4096
"""The re-planning search holds an N x N rate matrix and scores O(N^2) moves per round."""
_ROUNDS = 8


@dataclass(frozen=True)
class Mitigation:
    """The ring as it is, the ring re-planned from the rates its links would show, and what was found."""

    order: tuple[int, ...]
    before: SimResult
    after: SimResult
    slowest_before_Bps: float
    slowest_after_Bps: float
    rounds: int
    note: str

    @property
    def speedup(self) -> float:
        return self.before.seconds / self.after.seconds if self.after.seconds > 0 else 1.0


def mitigate_ring(
    topology: Topology,
    world_size: int,
    *,
    size_bytes: float,
    placement: str | Sequence[int] = "linear",
    routing: str | None = None,
    seed: int = 0,
    faults: Faults | None = None,
    engine: str = "auto",
) -> Mitigation:
    """Simulate the ring all-reduce of ``world_size`` ranks as placed, and the ring re-planning would pick."""
    if not 2 <= world_size <= MAX_MITIGATE_RANKS:
        raise ValueError(f"re-planning is predicted for 2..{MAX_MITIGATE_RANKS} ranks, got {world_size}")
    faults = faults or Faults()
    faulted = apply_faults(topology, faults)
    rank_gpu = np.asarray(place(world_size, faulted, placement, seed=seed), dtype=np.int64)
    router = Router(faulted, rank_gpu, routing, seed)
    identity = tuple(range(world_size))
    order, measured, rounds = identity, np.full((world_size, world_size), np.nan), 0
    first_slowest = 0.0
    for rounds in range(1, _ROUNDS + 1):  # the count is reported
        src = np.asarray(order, dtype=np.int64)
        rates = router.pattern(src, np.roll(src, -1)).rate_Bps
        if rounds == 1:
            first_slowest = float(rates.min())
        measured[src, np.roll(src, -1)] = rates
        median = statistics.median(measured[~np.isnan(measured)].tolist())
        if rates.min() >= SLOW_LINK_RATIO * median:
            break  # no slow link (the runtime's rule): nothing to re-plan
        matrix = np.where(np.isnan(measured), median, measured)
        new = best_ring_order(order, matrix)
        if new == order:
            break
        order = new
    src = np.asarray(order, dtype=np.int64)
    last_slowest = float(router.pattern(src, np.roll(src, -1)).rate_Bps.min())

    def run(schedule: Schedule) -> SimResult:
        return simulate(schedule, topology, size_bytes=size_bytes, placement=placement, routing=routing, seed=seed,
                        faults=faults, engine=engine)  # fmt: skip

    before = run(ring_all_reduce(world_size))
    after = before if order == identity else run(ordered_ring(order))
    notes = []
    if order == identity:
        notes.append("no slow link, or none a ring order avoids: the ring is kept")
    if faults.rank_delay_s(world_size) is not None:
        notes.append("a slow rank delays every ring order alike: re-planning cannot route around compute")
    return Mitigation(order, before, after, first_slowest, last_slowest, rounds, "; ".join(notes))
