"""Ring orders: the ring all-reduce with its ranks in any order, and the order whose slowest link is fastest.

A ring all-reduce moves ``2(N-1)/N · S`` bytes over each of its N links, all at once, so its time is set by the
slowest link it uses (Patarasuk and Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations",
2009): ``2(N-1)·α + 2(N-1)/N · S / r_min``. Putting ranks in another order changes which pairs are neighbours,
so a slow link between two ranks (a degraded cable, a congested switch port on their path) can be left out of
the ring. Runtime re-planning and the simulator's ``--mitigate`` both use these functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from allreduce.schedules._algorithms import ring_all_reduce
from allreduce.schedules._schedule import Schedule
from allreduce.schedules._verify import verify

__all__ = ["SLOW_LINK_RATIO", "best_ring_order", "ordered_ring", "ring_bottleneck", "ring_time_s"]

SLOW_LINK_RATIO = 0.25
"""A link is slow when its rate is below this fraction of the median link's: what re-planning acts on, in the
runtime and in the simulator's ``--mitigate`` alike. Smaller differences are the ordinary spread of a shared fabric,
which a re-ordered ring would only shuffle: on an emulated 1:1 Clos (two spines, ECMP) the healthy ring's links that
shared a spine uplink read 20-25 MB/s in the senders' kernel counters beside 30-1,200 MB/s for the others (a link
that is not the bottleneck drains each step at once and reads fast), so a half would call healthy contention slow;
a link at 10% reads a tenth of that."""

RateMatrix = npt.NDArray[np.float64]
"""``rates[i, j]``: bytes per second from rank i to rank j."""


def _check(order: Sequence[int], n: int) -> npt.NDArray[np.int64]:
    ranks = np.asarray(order, dtype=np.int64)
    if ranks.shape != (n,) or not np.array_equal(np.sort(ranks), np.arange(n)):
        raise ValueError(f"a ring order must hold each rank 0..{n - 1} once, got {list(order)[:16]}")
    return ranks


def ordered_ring(order: Sequence[int]) -> Schedule:
    """Ring all-reduce with position ``i`` played by rank ``order[i]``: the ring's streams with their ranks
    relabelled (their peers are fixed, so the relabelling is exact), verified like any schedule."""
    n = len(order)
    ranks = _check(order, n)
    ring = ring_all_reduce(n)
    streams = ring.streams.replace(src=ranks[ring.streams.src], peer=ranks[ring.streams.peer])
    schedule = Schedule("ring", ring.collective, n, ring.num_blocks, ring.num_steps, streams)
    verify(schedule)
    return schedule


def _edges(orders: npt.NDArray[np.int64], rates: RateMatrix) -> npt.NDArray[np.float64]:
    """Per order (rows), the rate of each of its ring's links."""
    out: npt.NDArray[np.float64] = rates[orders, np.roll(orders, -1, axis=-1)]
    return out


def ring_bottleneck(order: Sequence[int], rates: RateMatrix) -> float:
    """The rate of the slowest link the ring ``order`` uses."""
    return float(_edges(_check(order, rates.shape[0]), rates).min())


def ring_time_s(order: Sequence[int], rates: RateMatrix, size_bytes: float, alpha_s: float) -> float:
    """α–β time of a ring all-reduce of ``size_bytes`` in ``order``: ``2(N-1)·α + 2(N-1)/N · S / r_min``."""
    n = len(order)
    if n < 2:
        return 0.0
    return 2 * (n - 1) * alpha_s + 2 * (n - 1) / n * size_bytes / ring_bottleneck(order, rates)


def _score(edges: npt.NDArray[np.float64]) -> tuple[Any, Any]:
    """Per row: the bottleneck, and how many links sit at it (fewer is better: the next move can lift it)."""
    low = edges.min(axis=-1)
    return low, -(edges <= low[..., None] * (1 + 1e-12)).sum(axis=-1)


def best_ring_order(current: Sequence[int], rates: RateMatrix) -> tuple[int, ...]:
    """The ring order whose slowest link is fastest, by local search from ``current``: at each round, every move
    of one end of the slowest link (a swap with another position, or the reversal of the segment between them) is
    scored, and the best is taken while it lifts the bottleneck (or leaves fewer links at it). The rank at
    position 0 stays there; ties go to the first move found, so every rank finds the same order from the same
    rates. O(N²) per round, a round per slow link."""
    n = rates.shape[0]
    order = _check(current, n)
    if n < 4:
        return tuple(int(r) for r in order)  # three or fewer ranks: every ring uses the same pairs
    positions = np.arange(n)
    for _ in range(n):
        edges = _edges(order, rates)
        low, count = _score(edges)
        worst = int(np.argmin(edges))
        candidates = []
        for p in sorted({worst, (worst + 1) % n} - {0}):
            others = positions[(positions != 0) & (positions != p)]
            swaps = np.repeat(order[None, :], len(others), axis=0)
            swaps[np.arange(len(others)), p] = order[others]
            swaps[np.arange(len(others)), others] = order[p]
            flips = np.repeat(order[None, :], len(others), axis=0)
            for row, j in enumerate(others):
                lo, hi = min(p, j), max(p, j)
                flips[row, lo : hi + 1] = order[lo : hi + 1][::-1]
            candidates += [swaps, flips]
        moves = np.concatenate(candidates)
        c_low, c_count = _score(_edges(moves, rates))
        better = (c_low > low) | ((c_low == low) & (c_count > count))
        if not better.any():
            break
        ranked = np.lexsort((-c_count, -c_low))  # best bottleneck first, then fewest links at it; stable
        order = moves[ranked[0]]
    return tuple(int(r) for r in order)
