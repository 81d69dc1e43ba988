"""Start-up of the shared-memory transport: map every peer's control block, open its pidfd, probe cross-memory.

A mixin of :class:`~allreduce.runtime.shm.ShmTransport`, run once from its constructor. Each rank creates its
control block, then maps every peer's once the peer has created and initialised it (backing off while the peers
are still starting their interpreters), probes how it may read its peers' private memory with
``process_vm_readv``, and unlinks its own control file once every peer has mapped it, so that a crash leaves
nothing in /dev/shm.

The probe (the mode comes from the ``cross_memory_mode`` argument, else :data:`CROSS_MEMORY_ENV`, else
``auto``), in two parts whose results every rank publishes as bits of its ``cross_memory`` word:

- *open* (modes ``auto`` and ``open``): read each peer's magic word where the peer mapped it, with no
  permission asked of anyone: allowed where the kernel has no Yama or ``ptrace_scope = 0``;
- *ptracer* (modes ``auto`` and ``ptracer``): name the successor (rank + 1 mod N) the one process that may trace
  this one (``PR_SET_PTRACER``, never ``PR_SET_PTRACER_ANY``), then read the predecessor's magic word once it has
  done the same: what works under Yama ``ptrace_scope = 1``, the default of Ubuntu.

The group reads in place without asking when every rank found reads open; otherwise with the ptracer discipline
when every rank's ptracer read worked (the owner of the data admits exactly the peer reading it at each step;
:mod:`allreduce.runtime.shm._peer_data`); otherwise it stages. Mode ``ptracer`` forces the discipline where reads
are open anyway (a kernel without Yama, where ``prctl`` itself refuses with EINVAL), so tests and benchmarks run
the code that stock Ubuntu runs; ``off`` never reads private memory (under Yama ``ptrace_scope >= 2`` the probe
finds nothing either).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import numpy as np

from allreduce.runtime._errors import CollectiveTimeoutError
from allreduce.runtime.shm._layout import (
    ATTACHED_WORD,
    CROSS_MEMORY_WORD,
    MAGIC,
    MAGIC_WORD,
    PID_WORD,
    PROBE_ADDRESS_WORD,
    PTRACER_READY_WORD,
    PTRACER_WORD,
    READS_OPEN,
    READS_WITH_PTRACER,
    ControlLayout,
)
from allreduce.runtime.shm._linux import open_pidfd, read_remote, set_ptracer
from allreduce.runtime.shm._segments import Segment, control_segment_path

__all__ = ["CROSS_MEMORY_ENV", "CROSS_MEMORY_MODES", "Rendezvous", "cross_memory_mode"]

CROSS_MEMORY_ENV = "ALLREDUCE_SHM_CROSS_MEMORY"
"""Environment variable choosing how peers read plain arrays in place: one of :data:`CROSS_MEMORY_MODES`."""

CROSS_MEMORY_MODES = ("auto", "open", "ptracer", "off")
"""``auto``: open reads if allowed, else the ptracer discipline, else staging; ``open`` / ``ptracer``: only that
way (else staging); ``off``: always stage."""


_PTRACER_SLOT: list[object] = []
"""The transport of this process that holds its one ptracer slot (Yama keeps one declared tracer per process):
a second group in the same process does not probe the ptracer way, so two groups never take the slot from each
other mid-collective."""


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


class Rendezvous:
    """Attaching to the peers at start-up (mixed into the transport, which owns the state it fills in)."""

    rank: int
    world_size: int
    _prefix: str
    _layout: ControlLayout
    _ctl: list[Segment | None]
    """Every rank's control block, ``None`` until mapped."""
    _views: list[memoryview]
    _peer_pids: list[int]
    _pidfds: list[int]
    _want_cross_memory: bool
    _cross_memory_mode: str
    _cross_memory_available: bool
    _ptracer: bool
    """The ptracer discipline is in force: the owner of private data admits each step's reader first."""
    _tracer: int
    """The peer this rank last named its ptracer (-1: none)."""

    def _ctl_list(self) -> list[Segment]:
        """Every rank's control block, once all are mapped."""
        out = []
        for s in self._ctl:
            assert s is not None
            out.append(s)
        return out

    def _map_control_block(self, peer: int) -> Segment | None:
        """Peer's control block once it is created and initialised, else ``None``."""
        try:
            segment = Segment(control_segment_path(self._prefix, peer), 0, create=False)
        except FileNotFoundError:
            return None
        if segment.size_bytes >= self._layout.size_bytes:
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

    def _attach_peers(self, own_words: memoryview, timeout_s: float) -> None:
        """Map every peer's control block, open the pidfds, run the probe, then unlink this rank's control file."""
        deadline = time.monotonic() + timeout_s
        unmapped = [p for p in range(self.world_size) if p != self.rank]

        def map_control_blocks() -> list[int]:
            for p in list(unmapped):
                segment = self._map_control_block(p)
                if segment is not None:
                    self._ctl[p] = segment
                    unmapped.remove(p)
            return unmapped

        self._poll(map_control_blocks, deadline=deadline, timeout_s=timeout_s, until="join")
        self._views = [own_words if p == self.rank else s.words() for p, s in enumerate(self._ctl_list())]
        views = self._views
        self._peer_pids = [int(view[PID_WORD]) for view in views]
        self._pidfds = [open_pidfd(pid) for p, pid in enumerate(self._peer_pids) if p != self.rank]
        own_words[CROSS_MEMORY_WORD] = self._probe_open() | self._probe_ptracer(own_words, deadline)
        own_words[ATTACHED_WORD] = 1
        # Unlink our control file once every peer has mapped it, so a crash leaves nothing in /dev/shm.
        self._poll(
            lambda: [p for p in range(self.world_size) if views[p][ATTACHED_WORD] != 1],
            deadline=deadline, timeout_s=timeout_s, until="map the control segments",
        )  # fmt: skip
        found = [int(view[CROSS_MEMORY_WORD]) for view in self._views]
        if all(bits & READS_OPEN for bits in found):
            self._cross_memory_available = True
        elif all(bits & READS_WITH_PTRACER for bits in found):
            self._cross_memory_available = self._ptracer = True
        if not self._ptracer:
            self._release_ptracer()
        own = self._ctl[self.rank]
        assert own is not None
        own.unlink()

    def _release_ptracer(self) -> None:
        """Name no ptracer any more and free this process's slot, if this transport holds it."""
        if any(holder is self for holder in _PTRACER_SLOT):
            _PTRACER_SLOT.clear()
            set_ptracer(0)
        self._tracer = -1
        if self._views:
            self._views[self.rank][PTRACER_WORD] = -1

    def _read_magic(self, peer: int) -> bool:
        """Can this rank read ``peer``'s private memory now? (Its magic word, where it mapped its block.)"""
        probe = np.zeros(1, dtype=np.int64)
        address = int(self._views[peer][PROBE_ADDRESS_WORD])
        return not read_remote(self._peer_pids[peer], address, probe) and int(probe[0]) == MAGIC

    def _probe_open(self) -> int:
        """READS_OPEN if this rank reads every peer's private memory without any permission of theirs."""
        if not self._want_cross_memory or self._cross_memory_mode not in ("auto", "open"):
            return 0
        return READS_OPEN if all(self._read_magic(p) for p in range(self.world_size) if p != self.rank) else 0

    def _probe_ptracer(self, own_words: memoryview, deadline: float) -> int:
        """READS_WITH_PTRACER if this rank reads its predecessor once the predecessor named it its ptracer.

        Every rank of a group of two or more marks ``ptracer_ready`` (whether or not it named a ptracer), so no
        rank waits for a peer that probes differently."""
        if self.world_size == 1:
            return 0
        wanted = self._want_cross_memory and self._cross_memory_mode in ("auto", "ptracer") and not _PTRACER_SLOT
        if wanted:
            _PTRACER_SLOT.append(self)
            successor = (self.rank + 1) % self.world_size
            # EINVAL without Yama (nothing to lift); the read below decides either way.
            set_ptracer(self._peer_pids[successor])
            self._tracer = own_words[PTRACER_WORD] = successor
        own_words[PTRACER_READY_WORD] = 1
        predecessor = (self.rank - 1) % self.world_size
        pause = _ATTACH_FIRST_PAUSE_S
        while self._views[predecessor][PTRACER_READY_WORD] != 1:
            if time.monotonic() > deadline:
                raise CollectiveTimeoutError(
                    f"rank {self.rank}: shared-memory rendezvous timed out waiting for rank {predecessor} to "
                    "finish the cross-memory probe",
                    rank=self.rank,
                    peer=predecessor,
                )
            time.sleep(pause)
            pause = min(pause * 2, _ATTACH_MAX_PAUSE_S)
        return READS_WITH_PTRACER if wanted and self._read_magic(predecessor) else 0
