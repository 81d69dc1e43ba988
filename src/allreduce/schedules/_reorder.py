"""Ring orders: the ring all-reduce with its ranks in any order, and the order whose slowest link is fastest.

A ring all-reduce moves ``2(N-1)/N · S`` bytes over each of its N links, all at once, so its time is set by the
slowest link it uses (Patarasuk and Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations",
2009): ``2(N-1)·α + 2(N-1)/N · S / r_min``. Putting ranks in another order changes which pairs are neighbours,
so a slow link between two ranks (a degraded cable, a congested switch port on their path) can be left out of
the ring. Runtime re-planning and the simulator's ``--mitigate`` both use these functions.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from allreduce.schedules._algorithms import ring_all_reduce
from allreduce.schedules._schedule import Schedule, Streams, concat_streams
from allreduce.schedules._verify import verify

__all__ = [
    "EXHAUSTIVE_MAX_RANKS",
    "SLOW_LINK_RATIO",
    "RingOrder",
    "best_ring_order",
    "ordered_ring",
    "relabelled",
    "ring_bottleneck",
    "ring_time_s",
]

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


def _fixed_peers(streams: Streams, world_size: int) -> Streams:
    """The same transfers with every stream's peer fixed: a stream whose peer moves by ``peer_stride`` each step
    becomes one stream per step (a relabelled peer is not the old one plus a stride)."""
    moving = (streams.peer_stride != 0) & (streams.steps > 1)
    if not moving.any():
        return streams
    kept, split = streams.select(~moving), streams.select(moving)
    which = np.repeat(np.arange(len(split)), split.steps)
    j = np.arange(len(which)) - np.repeat(np.cumsum(split.steps) - split.steps, split.steps)
    one_each = split.select(which).replace(
        peer=(split.peer[which] + j * split.peer_stride[which]) % world_size,
        peer_stride=0,
        start=split.start[which] + j,
        steps=1,
        block_offset=split.block_offset[which] + j * split.block_stride[which],
    )
    return concat_streams([kept, one_each])


def relabelled(schedule: Schedule, order: Sequence[int]) -> Schedule:
    """``schedule`` with position ``i`` played by rank ``order[i]``: its streams with their ranks relabelled (their
    peers are fixed, so the relabelling is exact; an all-reduce is the same collective whichever rank plays which
    part), verified like any schedule."""
    moved = relabel(schedule, order)
    verify(moved)
    return moved


def relabel(schedule: Schedule, order: Sequence[int]) -> Schedule:
    """:func:`relabelled`, not verified: for scoring candidates, of which only the chosen one runs."""
    n = schedule.world_size
    ranks = _check(order, n)
    streams = _fixed_peers(schedule.streams, n)
    streams = streams.replace(src=ranks[streams.src], peer=ranks[streams.peer])
    return dataclasses.replace(schedule, streams=streams, root=int(ranks[schedule.root]))


def ordered_ring(order: Sequence[int]) -> Schedule:
    """Ring all-reduce with position ``i`` played by rank ``order[i]`` (:func:`relabelled`)."""
    return relabelled(ring_all_reduce(len(order)), order)


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


def _local_search(order: npt.NDArray[np.int64], rates: RateMatrix) -> npt.NDArray[np.int64]:
    """From ``order``, at each round every move of one end of the slowest link (a swap with another position, or
    the reversal of the segment between them) is scored, and the best is taken while it lifts the bottleneck (or
    leaves fewer links at it). O(N²) per round, a round per slow link; it can stop at an order that still uses a
    slow link."""
    n = len(order)
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
    return order


def _exhaustive(order: npt.NDArray[np.int64], rates: RateMatrix) -> npt.NDArray[np.int64]:
    """Of every order with ``order[0]`` first, the one whose links, slowest first, are fastest: the slowest link
    decides a ring's time, the next ones break ties (a second slow link is then avoided too when it can be);
    ``order`` itself when it is as good."""
    rest = [int(r) for r in order[1:]]
    every = np.array([(int(order[0]), *p) for p in itertools.permutations(sorted(rest))], dtype=np.int64)
    ranked = np.sort(_edges(every, rates), axis=1)
    best = int(np.lexsort(-ranked.T[::-1])[0])  # the slowest link first, then the next: largest first
    mine = np.sort(_edges(order[None, :], rates), axis=1)[0]
    return order if np.array_equal(mine, ranked[best]) else every[best]


EXHAUSTIVE_MAX_RANKS = 9
"""Up to this many ranks :func:`best_ring_order` scores every order (8! = 40,320 at 9, 0.1 s); above, a local
search from the current order."""


class RingOrder(NamedTuple):
    """A ring order and the α–β time the measured rates predict for it (:func:`ring_time_s`)."""

    order: tuple[int, ...]
    seconds: float


def best_ring_order(
    rates: RateMatrix, size_bytes: float, *, latency_s: float = 0.0, current: Sequence[int] | None = None
) -> RingOrder:
    """The ring order whose slowest link is fastest under the measured ``rates`` (``rates[i, j]``: bytes per second
    from rank i to rank j), and its predicted time for a buffer of ``size_bytes``.

    Up to :data:`EXHAUSTIVE_MAX_RANKS` ranks every order is scored, the slowest link first, then the next (the
    first decides the time; the others break ties); above, a local search from ``current``. The rank at position
    0 of ``current`` (default: the identity) stays there and ``current`` is kept when no order is better, so every
    rank that reads the same rates finds the same order. Pure: the runtime's re-planning and the simulator's
    ``--mitigate`` both choose with it."""
    n = rates.shape[0]
    if rates.shape != (n, n):
        raise ValueError(f"rates must be a square matrix, got shape {rates.shape}")
    order = _check(range(n) if current is None else current, n)
    if n >= 4:  # three or fewer ranks: every ring uses the same pairs
        order = _exhaustive(order, rates) if n <= EXHAUSTIVE_MAX_RANKS else _local_search(order, rates)
    chosen = tuple(int(r) for r in order)
    return RingOrder(chosen, ring_time_s(chosen, rates, size_bytes, latency_s))
