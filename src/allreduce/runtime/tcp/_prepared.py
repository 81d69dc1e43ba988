"""A rank's plan in bytes: for every step, which byte ranges go to and come from which peer, and where they land.

Compiled once per (plan, itemsize, checksum) and cached in the group's plan cache. Receives land directly in the
user's buffer for a copy, and in scratch for a reduction (through a small window, see :data:`WINDOW_BYTES`) or
for a receive whose range is also sent in the same step (*staged*: applied once the sends reading that range have
left, as the plan semantics of :mod:`allreduce.runtime.transport._plan` require).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, replace

from allreduce.runtime.stats._stats import Layout
from allreduce.runtime.transport._plan import RankPlan

__all__ = ["WINDOW_BYTES", "PreparedPlan", "PreparedStep", "RecvSpec", "SendSpec", "prepare"]

WINDOW_BYTES = 256 << 10
"""A reduction is received into a per-peer window of this size and reduced each time the window fills: the
window and the matching part of the user's buffer stay in L2 (1-2 MiB per core on the hosts measured), instead
of streaming the whole piece through a scratch area as large as itself. A multiple of every itemsize."""


@dataclass(frozen=True, slots=True)
class SendSpec:
    peer: int
    byte_start: int
    byte_stop: int
    block: int
    segment: int


@dataclass(frozen=True, slots=True)
class RecvSpec:
    peer: int
    byte_start: int
    byte_stop: int
    block: int
    segment: int
    reduce: bool
    staged: bool  # its range is also sent in this step: land in scratch, apply after those sends
    windowed: bool  # a reduction received through a window (not staged, no checksum to verify first)
    scratch_offset: int  # where it lands in scratch (reductions and staged receives); -1: the user's buffer
    blockers: tuple[int, ...]  # indices of this step's sends that read the range (staged only)


@dataclass(frozen=True, slots=True)
class PreparedStep:
    index: int
    sends: tuple[SendSpec, ...]
    recvs: tuple[RecvSpec, ...]
    send_bytes: int  # what the step sends, over all its peers
    recv_peers: tuple[int, ...]  # the peers it receives from, each once, in the order the recorder marks them
    no_arrivals: tuple[int, ...]  # the recorder's marks of a step whose data was there: (0, 0) per peer
    last_bytes: bool  # receives from several peers: the recorder reads each one's last byte's arrival


@dataclass(frozen=True, slots=True)
class PreparedPlan:
    tag: int  # the frames' plan tag: both ends of a connection must compute the same
    steps: tuple[PreparedStep, ...]
    scratch_bytes: int
    peers: frozenset[int]  # every rank the plan exchanges data with
    layout: Layout  # what the recorder's marks of one call mean (concurrent: first and last byte per peer)
    marks_tag: int  # layout.tag: what the transport appends before its marks


def plan_tag(plan: RankPlan, itemsize: int) -> int:
    """A hash of what every rank's plan must agree on (schedule, world size, element count, itemsize)."""
    return zlib.crc32(f"{plan.schedule_name}|{plan.world_size}|{plan.count}|{itemsize}".encode())


def prepare(plan: RankPlan, itemsize: int, *, checksum: bool) -> PreparedPlan:
    """Compile ``plan`` for elements of ``itemsize`` bytes (``checksum``: reductions are verified whole first)."""
    steps = []
    layout_steps: list[tuple[int, list[tuple[int, int]]]] = []
    scratch_bytes = 0
    for step in plan.steps:
        sends = tuple(SendSpec(t.peer, t.start * itemsize, t.stop * itemsize, t.block, t.segment) for t in step.sends)
        recvs = []
        # Scratch layout: staged receives each own a region; other reductions reuse one region per peer (a
        # peer's receives complete one after another); copies land in the user's buffer.
        offset = 0
        peer_region: dict[int, int] = {}
        peer_size: dict[int, int] = {}
        for t in step.recvs:
            blockers = tuple(i for i, s in enumerate(step.sends) if s.start < t.stop and t.start < s.stop)
            staged = bool(blockers)
            size = t.count * itemsize
            if staged:
                where = offset
                offset += size
            elif t.reduce:
                # With checksum=True the whole piece is verified before it is reduced, so it needs full space.
                where = peer_region.setdefault(t.peer, -1)
                peer_size[t.peer] = max(peer_size.get(t.peer, 0), size if checksum else min(size, WINDOW_BYTES))
            else:
                where = -1
            recvs.append(
                RecvSpec(
                    t.peer,
                    t.start * itemsize,
                    t.stop * itemsize,
                    t.block,
                    t.segment,
                    t.reduce,
                    staged,
                    windowed=t.reduce and not staged and not checksum,
                    scratch_offset=where,
                    blockers=blockers,
                )
            )
        # Now place the per-peer regions after the staged ones.
        for peer in sorted(peer_size):
            peer_region[peer] = offset
            offset += peer_size[peer]
        recvs = [r if r.staged or not r.reduce else replace(r, scratch_offset=peer_region[r.peer]) for r in recvs]
        scratch_bytes = max(scratch_bytes, offset)
        send_bytes = sum(s.byte_stop - s.byte_start for s in sends)
        received: dict[int, int] = {}
        for r in recvs:
            received[r.peer] = received.get(r.peer, 0) + r.byte_stop - r.byte_start
        peers = tuple(received)
        steps.append(
            PreparedStep(step.index, sends, tuple(recvs), send_bytes, peers, (0, 0) * len(peers), len(peers) > 1)
        )
        layout_steps.append((step.index, list(received.items())))
    layout = Layout(layout_steps, concurrent=True, count=max(plan.count * itemsize, 1))  # units: bytes
    return PreparedPlan(plan_tag(plan, itemsize), tuple(steps), scratch_bytes, plan.peers, layout, layout.tag)
