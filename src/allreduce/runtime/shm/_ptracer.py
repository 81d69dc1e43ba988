"""Yama's ptracer discipline: how a rank lets exactly one peer read its private memory at a time.

Under Yama ``ptrace_scope = 1`` (the default of Ubuntu) ``process_vm_readv`` of another process's memory works
only for the one process it named with ``PR_SET_PTRACER``. Yama keeps one declared tracer per process, so a process
has one slot: the first transport that probes the ptracer way takes it (:meth:`Ptracer.claim`), a second group in
the same process does not, and two groups never take the slot from each other mid-collective. At start-up a rank
names its successor (:mod:`allreduce.runtime.shm._rendezvous`'s probe); under the discipline the owner of private
data then admits each step's reader before it publishes the step (:meth:`Ptracer.admit`), once the reader admitted
before it has said it finished reading (its ``read_done``), so a peer is never refused mid-read. The rank it named
is published in its control block's ``ptracer`` word, which readers check before every read.
"""

from __future__ import annotations

from collections.abc import Callable

from allreduce.runtime.shm._layout import PTRACER_WORD, READ_DONE_WORD
from allreduce.runtime.shm._linux import set_ptracer

__all__ = ["Ptracer"]

_SLOT: list[Ptracer] = []
"""The ptracer of this process that holds its one slot (empty: none)."""


class Ptracer:
    """The rank that may read this rank's private memory, published in ``own`` (this rank's control block as
    words). ``in_force``: the group reads private memory under the discipline (set by the start-up probe)."""

    def __init__(self, own: memoryview) -> None:
        self.in_force = False
        self.tracer = -1
        """The peer this rank last named its ptracer (-1: none)."""
        self.switches = 0
        """How many times a reader was admitted in place of another."""
        self._own = own
        self._release_at = -1
        """The ``read_done`` value the current ptracer reaches once it has read everything it was admitted for."""

    def claim(self) -> bool:
        """Take this process's slot: False if another transport of this process holds it."""
        if _SLOT:
            return False
        _SLOT.append(self)
        return True

    def name(self, peer: int, pid: int) -> None:
        """Let ``peer`` (process ``pid``) read this rank's memory (EINVAL without Yama: nothing to lift)."""
        set_ptracer(pid)
        self.tracer = self._own[PTRACER_WORD] = peer

    def admit(
        self, reader: int, pid: int, release: int, wait: Callable[..., int], *, deadline: float, seq: int, step: int
    ) -> None:
        """Let ``reader`` (process ``pid``) alone read this rank's private memory until its ``read_done`` reaches
        ``release``; the peer admitted before it first finishes what it was admitted for (``wait``: the waits of
        :class:`~allreduce.runtime.shm._waiting.Waiting`)."""
        if reader != self.tracer:
            if self.tracer >= 0 and self._release_at >= 0:
                wait(self.tracer, READ_DONE_WORD, self._release_at, deadline=deadline, seq=seq,
                     what="reading this rank's data before the next reader is admitted", step=step)  # fmt: skip
            self.name(reader, pid)
            self.switches += 1
        self._release_at = release

    def release(self) -> None:
        """Name no ptracer any more and free this process's slot, if this one holds it (before ``own`` is
        unmapped)."""
        if any(holder is self for holder in _SLOT):
            _SLOT.clear()
            set_ptracer(0)
        self.tracer = -1
        self._own[PTRACER_WORD] = -1
