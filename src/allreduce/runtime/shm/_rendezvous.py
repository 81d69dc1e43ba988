"""Start-up of the shared-memory transport: map every peer's control block, open its pidfd, probe cross-memory.

A mixin of :class:`~allreduce.runtime.shm.ShmTransport`, run once from its constructor. Each rank creates its
control block, then maps every peer's once the peer has created and initialised it (backing off while the peers
are still starting their interpreters), publishes whether it can read every peer's private memory with
``process_vm_readv`` (it reads each peer's magic word where the peer mapped it; ptrace permissions are never
loosened), and unlinks its own control file once every peer has mapped it, so that a crash leaves nothing in
/dev/shm.
"""

from __future__ import annotations

import time

import numpy as np

from allreduce.runtime._errors import CollectiveTimeoutError
from allreduce.runtime.shm._layout import (
    ATTACHED_WORD,
    CROSS_MEMORY_WORD,
    MAGIC,
    MAGIC_WORD,
    PID_WORD,
    PROBE_ADDRESS_WORD,
    ControlLayout,
)
from allreduce.runtime.shm._linux import open_pidfd, read_remote
from allreduce.runtime.shm._segments import Segment, control_segment_path

__all__ = ["Rendezvous"]

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
    _cross_memory_available: bool

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

    def _attach_peers(self, own_words: memoryview, timeout_s: float) -> None:
        """Map every peer's control block, open the pidfds, run the probe, then unlink this rank's control file."""
        deadline = time.monotonic() + timeout_s
        missing = [p for p in range(self.world_size) if p != self.rank]
        pause = _ATTACH_FIRST_PAUSE_S
        while missing:
            still = []
            for p in missing:
                segment = self._map_control_block(p)
                if segment is None:
                    still.append(p)
                else:
                    self._ctl[p] = segment
            missing = still
            if missing:
                if time.monotonic() > deadline:
                    raise CollectiveTimeoutError(
                        f"rank {self.rank}: shared-memory rendezvous timed out after {timeout_s:g} s waiting for "
                        f"rank(s) {', '.join(map(str, missing))} to join",
                        rank=self.rank,
                        peer=missing[0],
                    )
                time.sleep(pause)
                pause = min(pause * 2, _ATTACH_MAX_PAUSE_S)
        self._views = [own_words if p == self.rank else s.words() for p, s in enumerate(self._ctl_list())]
        views = self._views
        self._peer_pids = [int(view[PID_WORD]) for view in views]
        self._pidfds = [open_pidfd(pid) for p, pid in enumerate(self._peer_pids) if p != self.rank]
        own_words[CROSS_MEMORY_WORD] = int(self._probe_cross_memory())
        own_words[ATTACHED_WORD] = 1
        # Unlink our control file once every peer has mapped it, so a crash leaves nothing in /dev/shm.
        while True:
            pending = [p for p in range(self.world_size) if views[p][ATTACHED_WORD] != 1]
            if not pending:
                break
            if time.monotonic() > deadline:
                raise CollectiveTimeoutError(
                    f"rank {self.rank}: shared-memory rendezvous timed out waiting for rank(s) "
                    f"{', '.join(map(str, pending))} to map the control segments",
                    rank=self.rank,
                    peer=pending[0],
                )
            time.sleep(pause)
            pause = min(pause * 2, _ATTACH_MAX_PAUSE_S)
        self._cross_memory_available = all(view[CROSS_MEMORY_WORD] == 1 for view in self._views)
        own = self._ctl[self.rank]
        assert own is not None
        own.unlink()

    def _probe_cross_memory(self) -> bool:
        """Can this rank read every peer's private memory? (Read each peer's magic word where it mapped it.)"""
        if not self._want_cross_memory:
            return False
        probe = np.zeros(1, dtype=np.int64)
        for p, view in enumerate(self._views):
            if p == self.rank:
                continue
            if read_remote(self._peer_pids[p], int(view[PROBE_ADDRESS_WORD]), probe) or int(probe[0]) != MAGIC:
                return False
        return True
