"""Choosing an all-reduce schedule from measured link rates: the cost model fed with a rate per pair of ranks, the
rule that names a slow rank, and the schedule re-planning takes around a slow rank.

The cost model (:mod:`._cost`) gives every link one bandwidth. Measured links differ, so here a flow's transfer
time is the longest of three:

    bytes of the flow / rates[src, dst]                      the link itself (a degraded cable, a congested path)
    bytes src sends in the step / fastest rate out of src      src's port, shared by all it sends in the step
    bytes dst receives in the step / fastest rate into dst     dst's port, likewise

and a step costs α more, through the same critical-path recurrence (:mod:`._timing`). A rank's fastest measured
link is the least its port can do, so a slow *rank* (its port: every link of it slow) is slow for all it moves
at once, and a slow *link* only for its own flow. With every rate equal this is the cost model's
``α + max(sent, received)·β`` exactly (a test checks it on every registered algorithm); for a ring it is the
closed form :func:`~allreduce.schedules.ring_time_s`. The reduction's cost (γ) is left out: the measured rates are
transfers, and every candidate reduces the same bytes.

A ring moves ``2(N-1)/N·S`` through every rank's port, so a slow rank costs every ring order alike. A tree that
has it as a leaf moves only ``S`` through it each way, pipelined in chunks (its parent's port carries the rest):
at most ``2(N-1)/N`` times faster (1.75x at 8 ranks), approached with many chunks. :func:`best_schedule` scores,
with the measured rates, the best ring order and each registered all-reduce (and a single pipelined binary tree,
which the registry does not hold: NCCL's double tree makes every rank an inner node of one of its trees) with the
slow ranks on the positions that move the fewest bytes, and returns the fastest.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from allreduce.schedules._algorithms import _inorder_tree, _tree_streams
from allreduce.schedules._registry import algorithms, get_algorithm, make_schedule
from allreduce.schedules._reorder import RateMatrix, best_ring_order, relabel, relabelled
from allreduce.schedules._schedule import Collective, Phase, Schedule
from allreduce.schedules._timing import propagate

__all__ = ["TREE_CHUNKS", "Replan", "best_schedule", "link_time_s", "replan_schedule", "slow_ranks"]

Link = tuple[int, int]

TREE_CHUNKS = (8, 32, 128)
"""The chunk counts tried for a pipelined tree around a slow rank: more chunks bring a leaf's time closer to
``S / rate`` (its port busy both ways at once, every step), at α a step more."""

BINARY_TREE = "binary_tree"
"""The single pipelined binary tree (reduce up, broadcast down, overlapped), by its schedule's name."""


def link_time_s(schedule: Schedule, size_bytes: float, rates: RateMatrix, *, latency_s: float = 0.0) -> float:
    """Predicted time of ``schedule`` on ``size_bytes`` per rank when bytes move from rank i to rank j at
    ``rates[i, j]`` bytes per second (the module docstring gives the model)."""
    n = schedule.world_size
    if rates.shape != (n, n) or not bool(np.all(rates[~np.eye(n, dtype=bool)] > 0)):
        raise ValueError(f"rates must be an {n} x {n} matrix of positive rates off the diagonal")
    off = np.where(np.eye(n, dtype=bool), 0.0, rates)
    port_out, port_in = off.max(axis=1), off.max(axis=0)

    def flow_seconds(phase: Phase) -> npt.NDArray[np.float64]:
        nbytes = phase.fraction * size_bytes
        sent = np.bincount(phase.src, weights=nbytes, minlength=n)[phase.src] / port_out[phase.src]
        received = np.bincount(phase.dst, weights=nbytes, minlength=n)[phase.dst] / port_in[phase.dst]
        own = nbytes / rates[phase.src, phase.dst]
        return np.asarray(latency_s + np.maximum(own, np.maximum(sent, received)), dtype=np.float64)

    clock, _ = propagate(n, schedule.phases(), flow_seconds, lambda phase: None)
    return float(clock.max()) if clock.size else 0.0


def slow_ranks(rates: Mapping[Link, float], ratio: float) -> tuple[int, ...]:
    """The ranks whose every measured link is slow: even the fastest of them, into the rank or out of it, below
    ``ratio`` times the median of the other ranks' fastest links (what their ports do at least). A rank needs a
    link into it and one out of it, to or from two or more peers: with one peer, a slow pair of links between two
    ranks would name both. A slow cable slows its own link only, so its ends' other links keep them off the list.
    Slowest first (then by rank)."""
    port: dict[int, float] = {}
    into: set[int] = set()
    out: set[int] = set()
    peers: dict[int, set[int]] = {}
    for (src, dst), rate in rates.items():
        for rank, peer in ((src, dst), (dst, src)):
            port[rank] = max(port.get(rank, 0.0), rate)
            peers.setdefault(rank, set()).add(peer)
        out.add(src)
        into.add(dst)
    named = []
    for rank, fastest in port.items():
        others = [rate for other, rate in port.items() if other != rank]
        placed = rank in into and rank in out and len(peers[rank]) >= 2
        if placed and others and fastest < ratio * statistics.median(others):
            named.append(rank)
    return tuple(sorted(named, key=lambda rank: (port[rank], rank)))


class Replan(NamedTuple):
    """An all-reduce schedule chosen from measured rates: which algorithm (``chunks`` for a pipelined tree), which
    rank plays each of its positions, and its predicted time."""

    algorithm: str
    order: tuple[int, ...]
    seconds: float
    chunks: int = 0

    def schedule(self) -> Schedule:
        """The schedule, relabelled and verified (:func:`replan_schedule`)."""
        return replan_schedule(self.algorithm, self.order, chunks=self.chunks)


def _base(algorithm: str, world_size: int, chunks: int) -> Schedule:
    if algorithm == BINARY_TREE:
        streams, steps = _tree_streams(_inorder_tree(world_size), chunks, 0, up=True, down=True)
        return Schedule(BINARY_TREE, Collective.ALL_REDUCE, world_size, chunks, steps, streams)
    return make_schedule(Collective.ALL_REDUCE, algorithm, world_size, **({"chunks": chunks} if chunks else {}))


def replan_schedule(algorithm: str, order: Sequence[int], *, chunks: int = 0) -> Schedule:
    """The all-reduce ``algorithm`` (a registered name, or ``binary_tree``) on ``len(order)`` ranks, ``chunks``
    its pipeline's chunks (0: its default), position ``i`` played by rank ``order[i]``; verified."""
    return relabelled(_base(algorithm, len(order), chunks), order)


def _lightest_positions(schedule: Schedule) -> npt.NDArray[np.int64]:
    """Positions by the bytes they move (sent and received), fewest first, then by position."""
    s = schedule.streams
    moved = s.steps.astype(np.float64) * s.block_count
    load = np.bincount(s.src, weights=moved, minlength=schedule.world_size)
    load += np.bincount(s.peer, weights=moved, minlength=schedule.world_size)
    return np.lexsort((np.arange(schedule.world_size), load)).astype(np.int64)


def _placed(schedule: Schedule, ranks: Sequence[int]) -> tuple[int, ...]:
    """An order that gives ``ranks`` (in turn) the positions of ``schedule`` that move the fewest bytes and leaves
    every other rank where it was."""
    order = list(range(schedule.world_size))
    for rank, position in zip(ranks, _lightest_positions(schedule).tolist(), strict=False):
        where = order.index(rank)
        order[where], order[position] = order[position], order[where]
    return tuple(order)


def _candidates(world_size: int) -> list[tuple[str, int]]:
    """(algorithm, chunks) to score around a slow rank: every automatic registered all-reduce but the ring that needs
    no more than the world size (a chunked one at each of :data:`TREE_CHUNKS`), and the single binary tree."""
    found: list[tuple[str, int]] = []
    for name in (*algorithms(Collective.ALL_REDUCE, automatic=True), BINARY_TREE):
        if name == "ring":
            continue  # its best order is scored on its own
        entry = None if name == BINARY_TREE else get_algorithm(Collective.ALL_REDUCE, name)
        if entry is not None and (entry.needs_group_size or (entry.max_ranks or world_size) < world_size):
            continue
        chunked = entry is None or "chunks" in entry.parameters
        found += [(name, chunks) for chunks in TREE_CHUNKS] if chunked else [(name, 0)]
    return found


def best_schedule(
    rates: RateMatrix,
    size_bytes: float,
    *,
    latency_s: float = 0.0,
    slow: Sequence[int] = (),
    current: Sequence[int] | None = None,
) -> Replan:
    """The fastest all-reduce under the measured ``rates`` (:func:`link_time_s`): the best ring order
    (:func:`~allreduce.schedules.best_ring_order`, from ``current``), and, when ranks are named ``slow`` (slowest
    first), every candidate algorithm with them on the positions that move the fewest bytes (a tree's leaves).
    Ties go to the ring, then to the candidates in registry order, so every rank that reads the same rates chooses
    the same."""
    n = rates.shape[0]
    ring = best_ring_order(rates, size_bytes, latency_s=latency_s, current=current)
    ring_schedule = relabel(_base("ring", n, 0), ring.order)
    best = Replan("ring", ring.order, link_time_s(ring_schedule, size_bytes, rates, latency_s=latency_s))
    if not slow:
        return best
    if len(set(slow)) != len(slow) or not all(0 <= rank < n for rank in slow):
        raise ValueError(f"slow must name distinct ranks of a group of {n}, got {list(slow)[:16]}")
    for name, chunks in _candidates(n):
        base = _base(name, n, chunks)
        order = _placed(base, slow)
        seconds = link_time_s(relabel(base, order), size_bytes, rates, latency_s=latency_s)
        if seconds < best.seconds:
            best = Replan(name, order, seconds, chunks)
    return best
