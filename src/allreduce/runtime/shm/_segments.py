"""Shared-memory segments: files in ``/dev/shm`` that every rank of a job maps.

Naming: a job's files start with :func:`shm_prefix`. A rank's control block is ``<prefix>-ctl-<rank>`` (unlinked
as soon as every peer has mapped it); its data segments are ``<prefix>-<rank>-<pid namespace>x<pid>-<id>``, so
that every peer derives the name from the owner's PID (which the control block holds) and a later
:func:`sweep_stale_segments` can tell a file whose owner died.

:class:`LocalSegments` owns this rank's data segments (``group.empty()`` arrays and the staging buffer);
:class:`PeerSegments` keeps the few data segments of one peer that this rank has mapped recently.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
from collections import OrderedDict
from typing import Any

import numpy as np
import numpy.typing as npt

from allreduce.runtime.shm._linux import PID_NAMESPACE, alive

__all__ = [
    "PEER_SEGMENT_CACHE_BYTES",
    "PEER_SEGMENT_CACHE_ENTRIES",
    "PEER_SEGMENT_KEPT",
    "SHM_DIR",
    "STAGING_MIN_BYTES",
    "LocalSegments",
    "PeerSegments",
    "Segment",
    "control_segment_path",
    "data_segment_path",
    "shm_prefix",
    "sweep_stale_segments",
    "unlink_rank_files",
]

SHM_DIR = "/dev/shm"
"""Where segments live (a tmpfs on every Linux)."""

PEER_SEGMENT_CACHE_ENTRIES = 64
"""Data segments of one peer kept mapped at most: a staging buffer, ``group.empty()`` arrays and adopted buffers
(a model's gradient buckets); more are re-mapped on use rather than pinned forever."""

PEER_SEGMENT_CACHE_BYTES = 1 << 30
"""Beyond the :data:`PEER_SEGMENT_KEPT` most recently used, a peer's mapped segments total at most this: a mapping
keeps a segment's memory alive after its owner frees it, so many large ones are re-mapped rather than kept."""

PEER_SEGMENT_KEPT = 8
"""A peer's most recently used segments, kept mapped whatever their size."""

STAGING_MIN_BYTES = 1 << 16
"""The smallest staging segment: sizes round up to a power of two from here, so a sweep over growing sizes
does not recreate the segment every call."""

_DATA_NAME = re.compile(r"^allreduce-.+-\d+-(\d+)x(\d+)-\d+$")


def shm_prefix(job: str) -> str:
    """File-name prefix in /dev/shm of a job's segments (``job`` is shared by all ranks of one group)."""
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in job)
    return f"allreduce-{safe}"


def control_segment_path(prefix: str, rank: int) -> str:
    return f"{prefix}-ctl-{rank}"


def data_segment_path(prefix: str, rank: int, pid: int, segment_id: int) -> str:
    return f"{prefix}-{rank}-{PID_NAMESPACE}x{pid}-{segment_id}"


def sweep_stale_segments(directory: str = SHM_DIR) -> list[str]:
    """Unlink the data segments whose owner process no longer exists; return their names.

    A rank killed before ``close()`` (SIGKILL, or SIGTERM from a launcher) cannot unlink its own segments, and when
    every rank of a job dies nobody else does. Every new shared-memory transport sweeps them, so they never
    accumulate: only files of this PID namespace whose owner PID is gone are touched."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = _DATA_NAME.match(name)
        if m is None or int(m[1]) != PID_NAMESPACE or _owner_running(int(m[2])):
            continue
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(directory, name))
            removed.append(name)
    return removed


def _owner_running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie. A killed rank whose parent died too stays a zombie
    until init reaps it; it has unmapped everything and will never unlink its files, so it counts as gone."""
    if not alive(pid):
        return False
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # cannot tell: leave its files alone
    return state not in ("Z", "X")


def unlink_rank_files(prefix: str, ranks: list[int]) -> None:
    """Remove the /dev/shm files of ``ranks`` of the job at ``prefix`` (ranks that died without close())."""
    directory, stem = os.path.split(prefix)
    for name in os.listdir(directory):
        if any(name.startswith(f"{stem}-{r}-") for r in ranks):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, name))


class Segment:
    """A mapped /dev/shm file: created (``create=True``, ``size_bytes`` zero bytes) or opened at its full size."""

    def __init__(self, path: str, size_bytes: int, *, create: bool) -> None:
        self.path = path
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, max(size_bytes, 1))
            else:
                size_bytes = os.fstat(fd).st_size
                if size_bytes == 0:
                    raise FileNotFoundError(path)  # created by its owner but not yet sized
            self.size_bytes = size_bytes
            populate = getattr(mmap, "MAP_POPULATE", 0)
            self.mm = mmap.mmap(fd, max(size_bytes, 1), flags=mmap.MAP_SHARED | populate)
        finally:
            os.close(fd)
        self.bytes = np.frombuffer(self.mm, dtype=np.uint8)
        self.address = int(self.bytes.ctypes.data)

    def array(self, dtype: np.dtype[Any], count: int, offset_bytes: int = 0) -> npt.NDArray[Any]:
        return np.frombuffer(self.mm, dtype=dtype, count=count, offset=offset_bytes)

    def words(self) -> memoryview:
        """The segment as 8-byte words (how control blocks are read and written)."""
        return memoryview(self.mm).cast("q")

    def close(self) -> None:
        del self.bytes
        # BufferError: a user still holds an array of this segment; the mapping lives until that array dies.
        with contextlib.suppress(BufferError):
            self.mm.close()

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class LocalSegments:
    """This rank's data segments: ``group.empty()`` arrays and one staging buffer, unlinked by :meth:`release`."""

    def __init__(self, prefix: str, rank: int) -> None:
        self._prefix = prefix
        self._rank = rank
        self._next_id = 1
        self._allocations: dict[int, Segment] = {}
        self._staging: Segment | None = None
        self._staging_id = 0

    def new_segment(self) -> tuple[int, str]:
        """A new segment id and the path of its file (not created), named as peers derive it."""
        segment_id = self._next_id
        self._next_id += 1
        return segment_id, data_segment_path(self._prefix, self._rank, os.getpid(), segment_id)

    def _create(self, size_bytes: int) -> tuple[int, Segment]:
        segment_id, path = self.new_segment()
        return segment_id, Segment(path, size_bytes, create=True)

    def allocate(self, size_bytes: int) -> npt.NDArray[np.uint8]:
        """A zero-filled byte array in a new segment of its own."""
        segment_id, segment = self._create(size_bytes)
        self._allocations[segment_id] = segment
        return segment.bytes[:size_bytes]

    def locate(self, buffer: npt.NDArray[Any]) -> tuple[int, int] | None:
        """(segment id, byte offset) when ``buffer`` lies in one of our allocations."""
        address = int(buffer.ctypes.data)
        end = address + buffer.nbytes
        for segment_id, segment in self._allocations.items():
            if segment.address <= address and end <= segment.address + segment.size_bytes:
                return segment_id, address - segment.address
        return None

    def staging(self, size_bytes: int) -> tuple[int, Segment]:
        """The staging segment (id, segment), grown to at least ``size_bytes``."""
        if self._staging is None or self._staging.size_bytes < size_bytes:
            if self._staging is not None:
                self._staging.unlink()
                self._staging.close()
                self._staging = None
            rounded = max(STAGING_MIN_BYTES, 1 << max(size_bytes - 1, 1).bit_length())
            self._staging_id, self._staging = self._create(rounded)
        return self._staging_id, self._staging

    def unlink(self) -> None:
        """Remove the files (mappings stay valid); safe in ``__del__``."""
        for segment in (*self._allocations.values(), self._staging):
            if segment is not None:
                segment.unlink()

    def release(self) -> None:
        """Unlink and unmap every segment."""
        self.unlink()
        for segment in (*self._allocations.values(), self._staging):
            if segment is not None:
                segment.close()
        self._allocations.clear()
        self._staging = None


class PeerSegments:
    """The data segments of one peer that this rank has mapped, least recently used closed first."""

    def __init__(
        self,
        capacity: int = PEER_SEGMENT_CACHE_ENTRIES,
        capacity_bytes: int = PEER_SEGMENT_CACHE_BYTES,
        kept: int = PEER_SEGMENT_KEPT,
    ) -> None:
        self.capacity = capacity
        self.capacity_bytes = capacity_bytes
        self.kept = kept
        self.nbytes = 0
        self._segments: OrderedDict[int, Segment] = OrderedDict()

    def get(self, segment_id: int) -> Segment | None:
        segment = self._segments.get(segment_id)
        if segment is not None:
            self._segments.move_to_end(segment_id)
        return segment

    def add(self, segment_id: int, segment: Segment) -> None:
        replaced = self._segments.pop(segment_id, None)
        if replaced is not None:
            self.nbytes -= replaced.size_bytes
            replaced.close()
        self._segments[segment_id] = segment
        self.nbytes += segment.size_bytes
        while len(self._segments) > self.capacity or (
            self.nbytes > self.capacity_bytes and len(self._segments) > self.kept
        ):
            _, old = self._segments.popitem(last=False)
            self.nbytes -= old.size_bytes
            old.close()

    def __len__(self) -> int:
        return len(self._segments)

    def close(self) -> None:
        for segment in self._segments.values():
            segment.close()
        self._segments.clear()
        self.nbytes = 0
