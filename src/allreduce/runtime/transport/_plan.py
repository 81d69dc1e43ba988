"""A schedule compiled for one rank and one buffer length: element ranges, ready to execute.

This is the contract between the schedules and every transport: a transport walks ``RankPlan.steps`` in order;
within a step it runs all sends and receives concurrently, each :class:`Transfer` cut into the schedule's
segments (consecutive pieces of the same transfer, sent back to back, so reducing piece k overlaps receiving piece
k+1). Sends read the buffer as it was when the step began; receives land when the step ends (a transport stages a
receive in scratch space when its range is also being sent in the same step).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from allreduce.schedules import Schedule, Verb, block_bounds

__all__ = ["PlanStep", "RankPlan", "Transfer", "compile_plan"]


@dataclass(frozen=True, slots=True)
class Transfer:
    """One piece of data moving between this rank and ``peer``: elements ``[start, stop)`` of the buffer.

    ``block`` and ``segment`` identify it on the wire (first block of the op, piece index within the op);
    ``reduce`` is meaningful for receives (reduce into the buffer, or overwrite it)."""

    peer: int
    start: int
    stop: int
    block: int
    segment: int
    reduce: bool

    @property
    def count(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, slots=True)
class PlanStep:
    index: int
    sends: tuple[Transfer, ...]
    recvs: tuple[Transfer, ...]


@dataclass(frozen=True, slots=True, eq=False)
class RankPlan:
    """What ``rank`` does to run ``schedule_name`` on a buffer of ``count`` elements.

    Compared and hashed by identity: transports key their compiled forms by the plan object the group hands
    them (the same object every call, from the group's plan cache); hashing the steps by value would cost
    microseconds per call (3 µs for a ring of 2, 12 µs for 8).
    """

    schedule_name: str
    rank: int
    world_size: int
    count: int
    segments: int
    steps: tuple[PlanStep, ...]

    def check_fits(self, rank: int, world_size: int, buffer: Any) -> None:
        """Raise ValueError unless this plan is for ``rank`` of ``world_size`` and ``buffer`` is the 1-D contiguous
        array of ``count`` elements it was compiled for (every transport checks this before touching data)."""
        if self.rank != rank or self.world_size != world_size:
            raise ValueError(
                f"plan {self.schedule_name!r} is for rank {self.rank} of {self.world_size}, "
                f"but this transport is rank {rank} of {world_size}"
            )
        if buffer.ndim != 1 or not buffer.flags.c_contiguous or buffer.shape[0] != self.count:
            raise ValueError(
                f"rank {rank}: buffer must be 1-D, contiguous and hold {self.count} elements for plan "
                f"{self.schedule_name!r}; got shape {buffer.shape}, contiguous={buffer.flags.c_contiguous}"
            )

    @property
    def peers(self) -> frozenset[int]:
        """Every rank this rank exchanges data with."""
        return frozenset(t.peer for s in self.steps for t in (*s.sends, *s.recvs))


def _pieces(start: int, stop: int, segments: int) -> list[tuple[int, int]]:
    """``segments`` consecutive pieces of [start, stop); empty pieces are dropped (both ends drop the same)."""
    length = stop - start
    cuts = [start + length * k // segments for k in range(segments + 1)]
    return [(a, b) for a, b in itertools.pairwise(cuts) if b > a]


def compile_plan(schedule: Schedule, rank: int, count: int) -> RankPlan:
    """Compile ``schedule`` for ``rank`` and a buffer of ``count`` elements.

    Not cached: a process group keeps its compiled plans in its :class:`~._transport.PlanCache`.
    """
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    bounds = block_bounds(count, schedule.num_blocks).tolist()
    by_step: dict[int, tuple[list[Transfer], list[Transfer]]] = {}
    for op in schedule.program(rank):
        sends, recvs = by_step.setdefault(op.step, ([], []))
        start, stop = bounds[op.block_start], bounds[op.block_stop]
        pieces = _pieces(start, stop, schedule.segments)
        target = sends if op.verb is Verb.SEND else recvs
        target.extend(
            Transfer(op.peer, a, b, op.block_start, k, op.verb is Verb.RECV_REDUCE) for k, (a, b) in enumerate(pieces)
        )
    steps = tuple(
        PlanStep(index, tuple(sends), tuple(recvs))
        for index, (sends, recvs) in sorted(by_step.items())
        if sends or recvs
    )
    return RankPlan(schedule.name, rank, schedule.world_size, count, schedule.segments, steps)
