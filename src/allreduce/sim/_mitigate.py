"""What re-planning around a slow link or rank would gain, predicted before the cluster is touched.

The runtime's re-planning (:mod:`allreduce.runtime` ``ALLREDUCE_REPLAN``) measures the rate of every link its
ring uses and, when one is consistently slow, measures every pair of ranks (over TCP) and runs the schedule
that the cost model fed with those rates predicts fastest: :func:`allreduce.schedules.best_ring_order`, and
around a rank whose every link is slow (:func:`allreduce.schedules.slow_ranks`) a tree with it on a leaf
(:func:`allreduce.schedules.best_schedule`). This module plays the same rounds on the simulator: the links are
"measured" as the flow model gives them (the ring's one flow pattern, routed, max-min fair, with the faults
applied); while one is slow (below :data:`~allreduce.schedules.SLOW_LINK_RATIO` of the median, the runtime's rule)
every pair is measured as the runtime's probe does (its pairwise all-to-all's N-1 patterns, up to
:data:`MAX_PROBED_RANKS` ranks; above, the ring's links round by round, links never measured at the median) and the
schedule is chosen from those rates; then both schedules are simulated. The answer is what re-planning can
recover: a degraded link, a congested path or a rank's slow port; not a rank slow to compute, whose delay every
schedule waits for (said in the note).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from allreduce.schedules import (
    SLOW_LINK_RATIO,
    Replan,
    Schedule,
    best_ring_order,
    best_schedule,
    ring_all_reduce,
    slow_ranks,
)
from allreduce.sim._faults import Faults, apply_faults
from allreduce.sim._result import SimResult
from allreduce.sim._routing import Router
from allreduce.sim._simulate import simulate
from allreduce.topology import Topology, place

__all__ = ["MAX_MITIGATE_RANKS", "MAX_PROBED_RANKS", "Mitigation", "mitigate_ring"]

MAX_MITIGATE_RANKS = 4096
"""The re-planning search holds an N x N rate matrix and scores O(N^2) moves per round."""
MAX_PROBED_RANKS = 64
"""Up to this many ranks every pair is measured (N-1 flow patterns of N flows, as the runtime's probe)."""
_ROUNDS = 8


@dataclass(frozen=True)
class Mitigation:
    """The ring as it is, the schedule re-planned from the rates its links would show, and what was found."""

    order: tuple[int, ...]
    """Which rank plays each position of the re-planned schedule."""
    before: SimResult
    after: SimResult
    slowest_before_Bps: float
    slowest_after_Bps: float
    """The slowest link of the ring as placed, and of the re-planned ring (of the ring as placed when re-planning
    chose another algorithm)."""
    rounds: int
    note: str
    algorithm: str = "ring"
    chunks: int = 0
    slow_ranks: tuple[int, ...] = ()
    """The ranks whose every link measured slow (around which the schedule was chosen)."""

    @property
    def speedup(self) -> float:
        return self.before.seconds / self.after.seconds if self.after.seconds > 0 else 1.0


def _slow_ranks(rates: npt.NDArray[np.float64]) -> tuple[int, ...]:
    """Of every pair's rate, the ranks whose every link is slow (the runtime's rule,
    :func:`allreduce.schedules.slow_ranks`), slowest first."""
    n = rates.shape[0]
    return slow_ranks({(i, j): float(rates[i, j]) for i in range(n) for j in range(n) if i != j}, SLOW_LINK_RATIO)


def _probe(router: Router, n: int) -> npt.NDArray[np.float64]:
    """Every pair's rate, as the runtime's probe measures it: the pairwise all-to-all's steps (rank r sends to
    r + k), one flow pattern each."""
    rates = np.zeros((n, n))
    src = np.arange(n, dtype=np.int64)
    for k in range(1, n):
        dst = (src + k) % n
        rates[src, dst] = router.pattern(src, dst).rate_Bps
    return rates


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
    beyond_ring: bool = False,
) -> Mitigation:
    """Simulate the ring all-reduce of ``world_size`` ranks as placed, and the schedule re-planning would pick: a
    ring order, or with ``beyond_ring`` around a slow rank any registered all-reduce (a tree with it on a leaf)."""
    if not 2 <= world_size <= MAX_MITIGATE_RANKS:
        raise ValueError(f"re-planning is predicted for 2..{MAX_MITIGATE_RANKS} ranks, got {world_size}")
    faults = faults or Faults()
    faulted = apply_faults(topology, faults)
    rank_gpu = np.asarray(place(world_size, faulted, placement, seed=seed), dtype=np.int64)
    router = Router(faulted, rank_gpu, routing, seed)
    identity = tuple(range(world_size))
    # a step's latency in the model: one switch between two GPUs (the choice of a tree's chunks weighs it)
    latency_s = 2 * float(np.median(faulted.link_latency_s))
    plan, measured, rounds = Replan("ring", identity, 0.0), np.full((world_size, world_size), np.nan), 0
    ranks: tuple[int, ...] = ()
    first_slowest = 0.0
    for rounds in range(1, _ROUNDS + 1):  # the count is reported
        src = np.asarray(plan.order, dtype=np.int64)
        rates = router.pattern(src, np.roll(src, -1)).rate_Bps
        if rounds == 1:
            first_slowest = float(rates.min())
        measured[src, np.roll(src, -1)] = rates
        median = statistics.median(measured[~np.isnan(measured)].tolist())
        if rates.min() >= SLOW_LINK_RATIO * median:
            break  # no slow link (the runtime's rule): nothing to re-plan
        if world_size <= MAX_PROBED_RANKS:  # every pair measured at once: one choice from all of them
            probed = _probe(router, world_size)
            ranks = _slow_ranks(probed)
            plan = best_schedule(probed, size_bytes, latency_s=latency_s, slow=ranks if beyond_ring else ())
            break
        matrix = np.where(np.isnan(measured), median, measured)
        new = best_ring_order(matrix, size_bytes, latency_s=latency_s, current=plan.order).order
        if new == plan.order:
            break
        plan = Replan("ring", new, 0.0)
    src = np.asarray(plan.order if plan.algorithm == "ring" else identity, dtype=np.int64)
    last_slowest = float(router.pattern(src, np.roll(src, -1)).rate_Bps.min())

    def run(schedule: Schedule) -> SimResult:
        return simulate(schedule, topology, size_bytes=size_bytes, placement=placement, routing=routing, seed=seed,
                        faults=faults, engine=engine)  # fmt: skip

    before = run(ring_all_reduce(world_size))
    kept = (plan.algorithm, plan.order) == ("ring", identity)
    after = before if kept else run(plan.schedule())
    notes = []
    if kept:
        notes.append("no slow link, or none a ring order avoids: the ring is kept")
    if ranks:
        named = ", ".join(map(str, ranks))
        notes.append(f"rank{'s' if len(ranks) > 1 else ''} {named}: every link slow (its port, not a cable)"
                     + (f": {plan.algorithm} with it where it moves the fewest bytes" if not kept and beyond_ring
                        else ""))  # fmt: skip
    if faults.rank_delay_s(world_size) is not None:
        notes.append("a rank slow to compute delays every schedule alike: re-planning cannot route around compute")
    return Mitigation(plan.order, before, after, first_slowest, last_slowest, rounds, "; ".join(notes),
                      plan.algorithm, plan.chunks, ranks)  # fmt: skip
