"""Start-up of the shared-memory transport: map every peer's control block, open its pidfd, probe cross-memory.

:class:`ControlBlocks` is what the rendezvous leaves, and its constructor is the rendezvous (collective: every rank
of the group constructs one). Each rank creates its control block, then maps every peer's once the peer has
created and initialised it (backing off while the peers are still starting their interpreters), probes how it may
read its peers' private memory with ``process_vm_readv``, and unlinks its own control file once every peer has
mapped it, so that a crash leaves nothing in /dev/shm. The parts of the transport then share what it mapped.

The probe (the mode comes from the ``cross_memory_mode`` argument, else :data:`CROSS_MEMORY_ENV`, else
``auto``), in two parts whose results every rank publishes as bits of its ``cross_memory`` word:

- *open* (modes ``auto`` and ``open``): read each peer's magic word where the peer mapped it, with no
  permission asked of anyone: allowed where the kernel has no Yama or ``ptrace_scope = 0``;
- *ptracer* (modes ``auto`` and ``ptracer``): name the successor (rank + 1 mod N) the one process that may trace
  this one (``PR_SET_PTRACER``, never ``PR_SET_PTRACER_ANY``), then read the predecessor's magic word once it has
  done the same: what works under Yama ``ptrace_scope = 1``, the default of Ubuntu.

The group reads in place without asking when every rank found reads open; otherwise with the ptracer discipline
when every rank's ptracer read worked (the owner of the data admits exactly the peer reading it at each step;
:mod:`allreduce.runtime.shm._ptracer`); otherwise it stages. Mode ``ptracer`` forces the discipline where reads
are open anyway (a kernel without Yama, where ``prctl`` itself refuses with EINVAL), so tests and benchmarks run
the code that stock Ubuntu runs; ``off`` never reads private memory (under Yama ``ptrace_scope >= 2`` the probe
finds nothing either).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from allreduce.runtime._errors import CollectiveTimeoutError
from allreduce.runtime.shm._layout import (
    ATTACHED_WORD,
    CROSS_MEMORY_WORD,
    CULPRIT_WORD,
    MAGIC,
    MAGIC_WORD,
    NO_CULPRIT,
    NOT_WAITING,
    PID_WORD,
    PROBE_ADDRESS_WORD,
    PROGRESS_WORD,
    PTRACER_READY_WORD,
    PTRACER_WORD,
    READ_DONE_WORD,
    READS_OPEN,
    READS_WITH_PTRACER,
    WAITING_FOR_WORD,
    ControlLayout,
    descriptor_word,
)
from allreduce.runtime.shm._linux import close_pidfds, open_pidfd, read_remote
from allreduce.runtime.shm._ptracer import Ptracer
from allreduce.runtime.shm._segments import Segment, control_segment_path

__all__ = ["CROSS_MEMORY_ENV", "CROSS_MEMORY_MODES", "ControlBlocks", "cross_memory_mode"]

CROSS_MEMORY_ENV = "ALLREDUCE_SHM_CROSS_MEMORY"
"""Environment variable choosing how peers read plain arrays in place: one of :data:`CROSS_MEMORY_MODES`."""

CROSS_MEMORY_MODES = ("auto", "open", "ptracer", "off")
"""``auto``: open reads if allowed, else the ptracer discipline, else staging; ``open`` / ``ptracer``: only that
way (else staging); ``off``: always stage."""


def cross_memory_mode(requested: str | None) -> str:
    """The mode to probe: ``requested``, else :data:`CROSS_MEMORY_ENV`, else ``auto``; ValueError naming the
    source of an unknown mode."""
    if requested is not None:
        source, mode = "cross_memory_mode", requested
    else:
        source, mode = CROSS_MEMORY_ENV, os.environ.get(CROSS_MEMORY_ENV, "") or "auto"
    if mode not in CROSS_MEMORY_MODES:
        raise ValueError(f"{source}: {mode!r} is not one of {', '.join(CROSS_MEMORY_MODES)}")
    return mode


_ATTACH_FIRST_PAUSE_S = 1e-4
_ATTACH_MAX_PAUSE_S = 0.01
"""Start-up only (peers are still starting their interpreters): back off from the first to the longest pause."""


class ControlBlocks:
    """Every rank's control block of the job at ``prefix``, mapped by rank ``rank`` of ``world_size``, and the
    peers' processes; constructing it is the rendezvous (see the module docstring), which gives up after
    ``timeout_s`` naming the ranks that did not come, and probes cross-memory reads in ``cross_memory_mode``
    (one of :data:`CROSS_MEMORY_MODES`, already resolved: ``off`` probes nothing).

    After construction, for every rank (this one included): ``segments`` (the mapped blocks), ``views`` (each as
    int64 words), ``addresses`` (where each is mapped here: the futex keys), ``crcs`` (each block's crc32 area),
    ``peer_pids``; ``pidfds``: the peers' pidfds in rank order without this rank. ``cross_memory_available``:
    every rank may read every other's private memory, under the discipline of ``ptracer`` when
    ``ptracer.in_force``. :meth:`release` unmaps everything; whoever holds a view into a block lets go first."""

    def __init__(self, prefix: str, rank: int, world_size: int, *, timeout_s: float, cross_memory_mode: str) -> None:
        self.prefix = prefix
        self.rank = rank
        self.world_size = world_size
        self.layout = ControlLayout(world_size)
        self.segments: list[Segment] = []
        self.views: list[memoryview] = []
        self.addresses: list[int] = []
        self.crcs: list[npt.NDArray[np.uint32]] = []
        self.peer_pids: list[int] = []
        self.pidfds: list[int] = []
        self.cross_memory_available = False
        self._released = False
        self._mapped: list[Segment | None] = [None] * world_size
        own = Segment(control_segment_path(prefix, rank), self.layout.size_bytes, create=True)
        self._mapped[rank] = own
        self._own = own_words = own.words()
        own_words[PID_WORD] = os.getpid()
        own_words[PROBE_ADDRESS_WORD] = own.address
        own_words[PROGRESS_WORD] = -1
        own_words[READ_DONE_WORD] = -1
        own_words[PTRACER_WORD] = -1
        own_words[WAITING_FOR_WORD] = NOT_WAITING
        own_words[CULPRIT_WORD] = NO_CULPRIT
        own_words[descriptor_word(0)] = -1
        own_words[descriptor_word(1)] = -1
        own_words[MAGIC_WORD] = MAGIC
        self.ptracer = Ptracer(own_words)
        try:
            self._attach(timeout_s, cross_memory_mode)
        except BaseException:
            self.release()
            raise
        self.addresses = [s.address for s in self.segments]
        self.crcs = [s.array(np.dtype(np.uint32), self.layout.crc_count, self.layout.crc_offset) for s in self.segments]

    def release(self) -> None:
        """Name no ptracer, close the pidfds, unmap every block and remove this rank's file; idempotent."""
        if self._released:
            return
        self._released = True
        self.ptracer.release()
        self.crcs.clear()
        for view in self.views:
            view.release()
        self._own.release()  # again if among the views (a no-op), else mapped before the rendezvous failed
        self.views.clear()
        close_pidfds(self.pidfds)
        self.pidfds.clear()
        for p, segment in enumerate(self._mapped):
            if segment is not None:
                if p == self.rank:
                    segment.unlink()
                segment.close()
        self._mapped = [None] * self.world_size
        self.segments.clear()

    def _map_control_block(self, peer: int) -> Segment | None:
        """Peer's control block once it is created and initialised, else ``None``."""
        try:
            segment = Segment(control_segment_path(self.prefix, peer), 0, create=False)
        except FileNotFoundError:
            return None
        if segment.size_bytes >= self.layout.size_bytes:
            words = segment.words()
            initialised = words[MAGIC_WORD] == MAGIC
            words.release()
            if initialised:
                return segment
        segment.close()
        return None

    def _poll(self, waiting_for: Callable[[], list[int]], *, deadline: float, timeout_s: float, until: str) -> None:
        """Ask ``waiting_for()`` until it names no rank, sleeping longer between tries; at ``deadline``, raise
        :class:`CollectiveTimeoutError` naming the ranks that did not ``until``."""
        pause = _ATTACH_FIRST_PAUSE_S
        while pending := waiting_for():
            if time.monotonic() > deadline:
                raise CollectiveTimeoutError(
                    f"rank {self.rank}: shared-memory rendezvous timed out after {timeout_s:g} s waiting for "
                    f"rank(s) {', '.join(map(str, pending))} to {until}",
                    rank=self.rank,
                    peer=pending[0],
                )
            time.sleep(pause)
            pause = min(pause * 2, _ATTACH_MAX_PAUSE_S)

    def _attach(self, timeout_s: float, mode: str) -> None:
        """Map every peer's control block, open the pidfds, run the probe, then unlink this rank's control file."""
        deadline = time.monotonic() + timeout_s
        unmapped = [p for p in range(self.world_size) if p != self.rank]

        def map_control_blocks() -> list[int]:
            for p in list(unmapped):
                segment = self._map_control_block(p)
                if segment is not None:
                    self._mapped[p] = segment
                    unmapped.remove(p)
            return unmapped

        self._poll(map_control_blocks, deadline=deadline, timeout_s=timeout_s, until="join")
        self.segments = [s for s in self._mapped if s is not None]
        own_words = self._own
        self.views = views = [s.words() if p != self.rank else own_words for p, s in enumerate(self.segments)]
        self.peer_pids = [int(view[PID_WORD]) for view in views]
        self.pidfds = [open_pidfd(pid) for p, pid in enumerate(self.peer_pids) if p != self.rank]
        own_words[CROSS_MEMORY_WORD] = self._probe_open(mode) | self._probe_ptracer(mode, deadline, timeout_s)
        own_words[ATTACHED_WORD] = 1
        # Unlink our control file once every peer has mapped it, so a crash leaves nothing in /dev/shm.
        self._poll(
            lambda: [p for p in range(self.world_size) if views[p][ATTACHED_WORD] != 1],
            deadline=deadline, timeout_s=timeout_s, until="map the control segments",
        )  # fmt: skip
        found = [int(view[CROSS_MEMORY_WORD]) for view in views]
        if all(bits & READS_OPEN for bits in found):
            self.cross_memory_available = True
        elif all(bits & READS_WITH_PTRACER for bits in found):
            self.cross_memory_available = self.ptracer.in_force = True
        if not self.ptracer.in_force:
            self.ptracer.release()
        self.segments[self.rank].unlink()

    def _read_magic(self, peer: int) -> bool:
        """Can this rank read ``peer``'s private memory now? (Its magic word, where it mapped its block.)"""
        probe = np.zeros(1, dtype=np.int64)
        address = int(self.views[peer][PROBE_ADDRESS_WORD])
        return not read_remote(self.peer_pids[peer], address, probe) and int(probe[0]) == MAGIC

    def _probe_open(self, mode: str) -> int:
        """READS_OPEN if this rank reads every peer's private memory without any permission of theirs."""
        if mode not in ("auto", "open"):
            return 0
        return READS_OPEN if all(self._read_magic(p) for p in range(self.world_size) if p != self.rank) else 0

    def _probe_ptracer(self, mode: str, deadline: float, timeout_s: float) -> int:
        """READS_WITH_PTRACER if this rank reads its predecessor once the predecessor named it its ptracer.

        Every rank of a group of two or more marks ``ptracer_ready`` (whether or not it named a ptracer), so no
        rank waits for a peer that probes differently."""
        if self.world_size == 1:
            return 0
        own_words = self.views[self.rank]
        wanted = mode in ("auto", "ptracer") and self.ptracer.claim()
        if wanted:
            successor = (self.rank + 1) % self.world_size
            self.ptracer.name(successor, self.peer_pids[successor])
        own_words[PTRACER_READY_WORD] = 1
        predecessor = (self.rank - 1) % self.world_size
        self._poll(
            lambda: [] if self.views[predecessor][PTRACER_READY_WORD] == 1 else [predecessor],
            deadline=deadline, timeout_s=timeout_s, until="finish the cross-memory probe",
        )  # fmt: skip
        return READS_WITH_PTRACER if wanted and self._read_magic(predecessor) else 0
