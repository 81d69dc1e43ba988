"""Compiling a rank's plan into shared-memory operations (pure: no memory, no processes).

The transport reads peers' data where it lies, so a rank must know, before it runs a step, where every element
range currently lives and who may still read it. Two arrays are in play: the user's array ``U`` and the working
buffer ``W`` that peers can read (a shared segment; or ``U`` itself when it is already in shared memory or read
with ``process_vm_readv``, in which case ``in_shm=True`` and ``U`` is never used).

When ``U`` is not ``W`` the compiler stages *lazily*: it tracks, for every element range, whether its current
value lives in ``U``, in ``W`` or in both; a range is copied into ``W`` only before it is sent, a received range
is written into ``W`` only when it is sent again later (else straight into ``U``), and only ranges whose final
value is in ``W`` are copied out.

Every write into ``W`` waits until the peers that read the overwritten range at an earlier (or the same) step
have said so: a *wait* ``(reader, value)`` means "until ``reader``'s ``read_done`` reaches step ``value``". A
range received in the step it is also sent (recursive doubling) is *staged*: reduced into scratch memory and
written once the readers of the step are done (sends read the step-start state). When several peers' data is
reduced into one staged range in one step (naive all-reduce), every receive after the first reduces into that
scratch result, not into the step-start value.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

from allreduce.runtime.stats._stats import Layout
from allreduce.runtime.transport._plan import RankPlan

__all__ = ["IN_BOTH", "IN_USER", "IN_WORK", "Piece", "RankProgram", "Receive", "StepProgram", "Wait", "compile_program"]

IN_USER = 0
"""The range's current value is in the user's array (also the index of that array in ``(user, work)``)."""
IN_WORK = 1
"""The range's current value is in the working buffer peers read (index 1 of ``(user, work)``)."""
IN_BOTH = 2
"""Copied into the working buffer to be sent, and still equal in the user's array."""

Wait = tuple[int, int]
"""(reader rank, the ``read_done`` step it must reach)."""


@dataclass(frozen=True, slots=True)
class Piece:
    """Part of a receive: elements [start, stop) read from the peer, combined with ``src`` (U or W), into ``dst``."""

    start: int
    stop: int
    src: int
    dst: int
    staged: bool
    waits: tuple[Wait, ...]


@dataclass(frozen=True, slots=True)
class Receive:
    """A receive of elements [start, stop) from ``peer``; ``crc_slot``: the k-th transfer from peer to this rank."""

    peer: int
    start: int
    stop: int
    reduce: bool
    crc_slot: int
    pieces: tuple[Piece, ...]


@dataclass(frozen=True, slots=True)
class StepProgram:
    """One step: wait for readers, copy ``copyins`` from U to W, sign sends, then the receives.

    ``readers``: the peers that read this rank's data at this step (sorted; at most one for ring, halving-doubling
    and recursive doubling, which is what lets one ``PR_SET_PTRACER`` at a time admit them)."""

    index: int
    copyin_waits: tuple[Wait, ...]
    copyins: tuple[tuple[int, int], ...]
    send_crcs: tuple[tuple[int, int, int, int], ...]  # (dst, crc slot, start, stop) of every send
    recvs: tuple[Receive, ...]
    readers: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class RankProgram:
    """A rank's whole collective: its steps, the readers to wait for at the end, the ranges copied back to U."""

    steps: tuple[StepProgram, ...]
    final_waits: tuple[Wait, ...]
    copyouts: tuple[tuple[int, int], ...]
    max_crc_slots: int
    layout: Layout  # what the recorder's marks of one call mean (sequential: one receive after another)
    tag: int  # layout.tag: what the transport appends before its marks (an attribute of an object already in use)


def _merge_waits(waits: dict[int, int]) -> tuple[Wait, ...]:
    return tuple(sorted(waits.items()))


def _runs(items: list[tuple[int, int, Any]]) -> list[tuple[int, int, Any]]:
    """Merge adjacent (start, stop, key) ranges with equal keys."""
    out: list[tuple[int, int, Any]] = []
    for a, b, key in items:
        if out and out[-1][1] == a and out[-1][2] == key:
            out[-1] = (out[-1][0], b, key)
        else:
            out.append((a, b, key))
    return out


def compile_program(plan: RankPlan, in_shm: bool) -> RankProgram:
    """Decide, for every range, where it is read from and written to, and which reader each write waits for."""
    cuts_set = {0, plan.count}
    for step in plan.steps:
        for t in (*step.sends, *step.recvs):
            cuts_set.update((t.start, t.stop))
    cuts = sorted(cuts_set)
    n_int = len(cuts) - 1

    def intervals(a: int, b: int) -> range:
        return range(bisect.bisect_left(cuts, a), bisect.bisect_left(cuts, b))

    # events per interval: (step, is_send)
    events: list[list[tuple[int, bool]]] = [[] for _ in range(n_int)]
    for step in plan.steps:
        for t in step.sends:
            for i in intervals(t.start, t.stop):
                events[i].append((step.index, True))
        for t in step.recvs:
            for i in intervals(t.start, t.stop):
                events[i].append((step.index, False))

    def sent_again_after(i: int, step_index: int) -> bool:
        """Is interval i sent after step_index before it is next received?"""
        for s, is_send in events[i]:
            if s <= step_index:
                continue
            return is_send
        return False

    sends_done: list[tuple[int, int, int, int]] = []  # (step, reader, start, stop) of every send so far

    def write_waits(a: int, b: int, upto_step: int) -> dict[int, int]:
        waits: dict[int, int] = {}
        for s, reader, sa, sb in sends_done:
            if s <= upto_step and sa < b and a < sb:
                waits[reader] = max(waits.get(reader, 0), s + 1)
        return waits

    loc = [IN_WORK if in_shm else IN_USER] * n_int
    crc_next_send: dict[int, int] = {}
    crc_next_recv: dict[int, int] = {}
    max_slots = 0
    steps: list[StepProgram] = []
    for step in plan.steps:
        # 1. copy into W every range sent this step whose current value is only in U
        copy_items: list[tuple[int, int, Any]] = []
        for t in sorted(step.sends, key=lambda t: t.start):
            for i in intervals(t.start, t.stop):
                if loc[i] == IN_USER:
                    copy_items.append((cuts[i], cuts[i + 1], None))
                    loc[i] = IN_BOTH
        copyins = tuple((a, b) for a, b, _ in _runs(sorted(set(copy_items))))
        cw: dict[int, int] = {}
        for a, b in copyins:
            for r, v in write_waits(a, b, step.index - 1).items():
                cw[r] = max(cw.get(r, 0), v)
        send_crcs = []
        for t in step.sends:
            slot = crc_next_send.get(t.peer, 0)
            crc_next_send[t.peer] = slot + 1
            max_slots = max(max_slots, slot + 1)
            send_crcs.append((t.peer, slot, t.start, t.stop))
        sends_done.extend((step.index, t.peer, t.start, t.stop) for t in step.sends)
        sent_now = [(t.start, t.stop) for t in step.sends]
        # 2. receives
        recvs = []
        for t in step.recvs:
            slot = crc_next_recv.get(t.peer, 0)
            crc_next_recv[t.peer] = slot + 1
            items: list[tuple[int, int, Any]] = []
            for i in intervals(t.start, t.stop):
                a, b = cuts[i], cuts[i + 1]
                src = IN_WORK if loc[i] == IN_WORK else IN_USER
                dst = IN_WORK if (in_shm or sent_again_after(i, step.index)) else IN_USER
                staged = dst == IN_WORK and any(sa < b and a < sb for sa, sb in sent_now)
                # Staged pieces stay one per interval, so that receives of one range from several peers in one
                # step (naive, a tree node's children) name the same piece and accumulate into one result.
                items.append((a, b, (src, dst, staged, i if staged else -1)))
                loc[i] = dst
            pieces = []
            for a, b, (src, dst, staged, _) in _runs(items):
                waits = write_waits(a, b, step.index) if dst == IN_WORK else {}
                pieces.append(Piece(a, b, src, dst, staged, _merge_waits(waits)))
            recvs.append(Receive(t.peer, t.start, t.stop, t.reduce, slot, tuple(pieces)))
        readers = tuple(sorted({t.peer for t in step.sends}))
        steps.append(StepProgram(step.index, _merge_waits(cw), copyins, tuple(send_crcs), tuple(recvs), readers))
    final: dict[int, int] = {}
    for s, reader, _, _ in sends_done:
        final[reader] = max(final.get(reader, 0), s + 1)
    copyouts: tuple[tuple[int, int], ...] = ()
    if not in_shm:
        copyouts = tuple(
            (a, b) for a, b, _ in _runs([(cuts[i], cuts[i + 1], None) for i in range(n_int) if loc[i] == IN_WORK])
        )
    layout = Layout(
        ((st.index, [(rv.peer, rv.stop - rv.start) for rv in st.recvs]) for st in steps),
        concurrent=False,
        count=max(plan.count, 1),
    )
    return RankProgram(tuple(steps), _merge_waits(final), copyouts, max_slots, layout, layout.tag)
