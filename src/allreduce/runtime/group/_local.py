"""An in-process transport: N ranks are N threads of one process, exchanging copies through one shared hub.

A real transport (it subclasses :class:`Transport` and honours the plan semantics: a step's sends are copied out
when the step begins, its receives are applied when they arrive, after this rank's sends of the step were
taken), with no sockets, no shared memory and no processes, so the process group's own semantics (agreement,
mismatch detection, ordering, reductions, buffer handling, timeouts, a peer that gave up) are tested in
milliseconds. :func:`local_groups` makes the N groups; use each from its own thread.

A rank that closes its transport while peers wait on it is reported to them as a dead peer
(:class:`PeerFailureError`); a rank that gives up (timeout, checksum, ...) makes every peer raise an error of the
same class, naming the culprit.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from allreduce.runtime._errors import CollectiveError, CollectiveTimeoutError, PeerFailureError, corrupted
from allreduce.runtime.group._group import DEFAULT_TIMEOUT_S, ProcessGroup
from allreduce.runtime.store._memory_store import MemoryStore
from allreduce.runtime.transport._transport import Call, Transport, abort_kind, error_class
from allreduce.schedules import CostModel

__all__ = ["LocalTransport", "local_groups", "local_transports"]

_DESCRIPTORS_KEPT = 2
"""Collectives whose descriptors the hub keeps: a rank publishing collective k has read k-1's, so every rank has
read k-2's (no rank passes an agreement before all ranks reach it)."""

_MessageKey = tuple[int, int, int, int, int, int]  # seq, step, src, dst, block, segment


class _Abort:
    __slots__ = ("culprit", "kind", "message", "rank", "seq")

    def __init__(self, rank: int, seq: int, kind: int, culprit: int | None, message: str) -> None:
        self.rank, self.seq, self.kind, self.culprit, self.message = rank, seq, kind, culprit, message


class _Hub:
    """What the N transports of one local group share; every field is guarded by ``cond``."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.cond = threading.Condition()
        self.descriptors: dict[int, dict[int, bytes]] = {}
        self.messages: dict[_MessageKey, tuple[npt.NDArray[Any], int]] = {}
        self.closed: set[int] = set()
        self.abort: _Abort | None = None


class LocalTransport(Transport):
    """One rank of an in-process group (made by :func:`local_transports`)."""

    name: ClassVar[str] = "local"

    def __init__(self, rank: int, world_size: int, hub: _Hub) -> None:
        super().__init__(rank, world_size)
        if hub.world_size != world_size:
            raise ValueError(f"hub is for {hub.world_size} ranks, not {world_size}")
        self._hub = hub
        self._corrupt: tuple[int, int] | None = None  # (peer, step) of the next send to corrupt
        self._messages_sent = 0
        self._bytes_sent = 0

    # ------------------------------------------------------------------------------------------------
    def inject_corruption(self, *, peer: int, step: int = 0) -> None:
        if not 0 <= peer < self.world_size or peer == self.rank:
            raise ValueError(f"peer: {peer!r} is not another rank of this group of {self.world_size}")
        self._corrupt = (peer, step)

    def statistics(self) -> Mapping[str, int]:
        return {"messages_sent": self._messages_sent, "bytes_sent": self._bytes_sent}

    # ------------------------------------------------------------------------------------------------
    def _agree(self, seq: int, descriptor: bytes, *, deadline: float, timeout_s: float) -> list[bytes]:
        hub = self._hub
        with hub.cond:
            hub.descriptors.pop(seq - _DESCRIPTORS_KEPT, None)
            published = hub.descriptors.setdefault(seq, {})
            published[self.rank] = descriptor
            hub.cond.notify_all()
            self._wait(
                lambda: len(published) == self.world_size,
                lambda: [r for r in range(self.world_size) if r not in published],
                seq=seq,
                step=None,
                deadline=deadline,
                timeout_s=timeout_s,
            )
            return [published[r] for r in range(self.world_size)]

    def _execute(self, call: Call) -> None:
        plan, buffer, reduce_into, seq = call.plan, call.buffer, call.reduce_into, call.seq
        deadline, timeout_s, checksum = call.deadline, call.timeout_s, call.checksum
        hub = self._hub
        recorder = self.recorder if self.recorder.enabled else None
        injection = self.injection
        clock = time.perf_counter_ns
        step_start = waited = 0
        for step in plan.steps:
            if injection is not None:
                injection.hold_step()
            if recorder is not None:
                step_start = clock()
            # sends read the state at the start of the step: copy them all out before applying any receive
            outgoing = []
            for t in step.sends:
                payload = buffer[t.start : t.stop].copy()
                crc = zlib.crc32(payload.data) if checksum else 0
                if self._corrupt == (t.peer, step.index):
                    self._corrupt = None
                    payload.view(np.uint8)[0] ^= 0xFF
                outgoing.append(((seq, step.index, self.rank, t.peer, t.block, t.segment), (payload, crc)))
                self._messages_sent += 1
                self._bytes_sent += payload.nbytes
            with hub.cond:
                hub.messages.update(outgoing)
                hub.cond.notify_all()
            for t in step.recvs:
                key = (seq, step.index, t.peer, self.rank, t.block, t.segment)
                if recorder is not None:
                    waited = clock()
                with hub.cond:
                    self._wait(
                        lambda key=key: key in hub.messages,  # type: ignore[misc]
                        lambda t=t: [t.peer],  # type: ignore[misc]
                        seq=seq,
                        step=step.index,
                        deadline=deadline,
                        timeout_s=timeout_s,
                    )
                    payload, crc = hub.messages.pop(key)
                arrived = clock() if recorder is not None or injection is not None else 0
                if checksum and (got := zlib.crc32(payload.data)) != crc:
                    raise corrupted(
                        rank=self.rank, peer=t.peer, step=step.index, seq=seq,
                        what=f"block {t.block}, segment {t.segment}", got=got, expected=crc,
                    )  # fmt: skip
                view = buffer[t.start : t.stop]
                if t.reduce:
                    reduce_into(view, payload)
                else:
                    view[...] = payload
                if injection is not None:
                    injection.pace(t.peer, payload.nbytes, arrived)
                if recorder is not None:
                    recorder.transfer(
                        seq, step.index, t.peer, step_start, arrived - waited, clock() - arrived, payload.nbytes
                    )

    def _wait(
        self,
        ready: Callable[[], bool],
        waiting_for: Callable[[], list[int]],
        *,
        seq: int,
        step: int | None,
        deadline: float,
        timeout_s: float,
    ) -> None:
        """Wait on the hub (its lock held) until ``ready()``; raise on a peer's abort, a closed peer, the deadline."""
        hub = self._hub
        where = "the descriptor exchange" if step is None else f"step {step}"
        while True:
            # a peer's abort is checked first and is final: the group failed, even if this rank's data is there
            abort = hub.abort
            if abort is not None and abort.rank != self.rank:
                raise error_class(abort.kind)(
                    f"rank {self.rank}: collective {seq} failed because rank {abort.rank} gave up on collective "
                    f"{abort.seq}: {abort.message}",
                    rank=self.rank,
                    peer=abort.culprit if abort.culprit is not None else abort.rank,
                    step=step,
                )
            if ready():
                return
            gone = [peer for peer in waiting_for() if peer in hub.closed]
            if gone:
                raise PeerFailureError(
                    f"rank {self.rank}: rank {gone[0]} closed its transport while rank {self.rank} waited for it "
                    f"at {where} of collective {seq}",
                    rank=self.rank,
                    peer=gone[0],
                    step=step,
                )
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                peers = waiting_for()
                names = ", ".join(f"rank {p}" for p in peers)
                raise CollectiveTimeoutError(
                    f"rank {self.rank}: collective {seq} timed out after {timeout_s} s at {where} waiting for {names}",
                    rank=self.rank,
                    peer=peers[0] if peers else None,
                    step=step,
                )
            hub.cond.wait(remaining_s)

    def _abort(self, error: CollectiveError, seq: int) -> None:
        hub = self._hub
        with hub.cond:
            if hub.abort is None:
                hub.abort = _Abort(self.rank, seq, abort_kind(error), error.peer, str(error))
            hub.cond.notify_all()

    def _release(self) -> None:
        hub = self._hub
        with hub.cond:
            hub.closed.add(self.rank)
            hub.cond.notify_all()


def local_transports(world_size: int) -> list[LocalTransport]:
    """``world_size`` connected in-process transports, by rank."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    hub = _Hub(world_size)
    return [LocalTransport(rank, world_size, hub) for rank in range(world_size)]


def local_groups(
    world_size: int,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    cost_model: CostModel | None = None,
    group_size: int | None = None,
) -> list[ProcessGroup]:
    """``world_size`` process groups of one in-process group, by rank; call each from its own thread.

    The options are those of :class:`~allreduce.runtime.ProcessGroup` (``group_size``: ranks per simulated host).
    """
    transports = local_transports(world_size)
    store = MemoryStore(timeout_s)  # where point-to-point channels publish their addresses
    for rank in range(world_size):
        store.set(f"allreduce/host/{rank}", b"this process")
    return [
        ProcessGroup(t, timeout_s=timeout_s, cost_model=cost_model, group_size=group_size, store=store)
        for t in transports
    ]
