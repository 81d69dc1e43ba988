"""Reading a peer's data for one collective: where the peer published it, and receiving (and reducing) from it.

:class:`PeerData` owns what a rank keeps to read its peers: the peers' data segments it mapped, views of their
snapshot areas, a scratch piece. A peer's data is in its eager snapshot area, in a shared segment (its
``group.empty()`` arrays or its staging buffer), or in its private memory, read with ``process_vm_readv``
(:class:`Remote`); a receive that reduces out of private memory goes through a scratch piece that stays in L2.
A read that fails because the peer went away names the root cause (see
:mod:`allreduce.runtime.shm._watch`). Under the ptracer discipline (Yama ``ptrace_scope = 1``,
:mod:`allreduce.runtime.shm._ptracer`) a reader checks, before every read of private memory, that the owner named
it its ptracer: the permission the kernel checks there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from allreduce.runtime._errors import CollectiveError, PeerFailureError, ProtocolError
from allreduce.runtime.shm._compile import Piece, Receive
from allreduce.runtime.shm._layout import (
    BUFFER_OFFSET_WORD,
    BUFFER_SEGMENT_WORD,
    CLOSED_WORD,
    EAGER_BYTES,
    IN_PRIVATE_MEMORY,
    PTRACER_WORD,
    UNSATISFIABLE,
    ControlLayout,
)
from allreduce.runtime.shm._linux import read_remote
from allreduce.runtime.shm._segments import PeerSegments, Segment, data_segment_path
from allreduce.runtime.shm._watch import PeerWatch, corrupt_block_error
from allreduce.runtime.transport._transport import ReduceInto

__all__ = ["ALIGN_MIN_BYTES", "CACHE_LINE", "CROSS_MEMORY_CHUNK_BYTES", "PeerData", "Remote", "apply_op"]

CROSS_MEMORY_CHUNK_BYTES = 1 << 20
"""A cross-memory receive that reduces goes through a scratch piece of this size, which stays in L2."""

CACHE_LINE = 64
"""Bytes per cache line (x86-64 and most arm64 cores): the alignment :func:`apply_op` gives a large range."""

ALIGN_MIN_BYTES = 1 << 16
"""The smallest range :func:`apply_op` splits at a cache-line boundary (below, the extra call costs more)."""


@dataclass(frozen=True, slots=True)
class Remote:
    """A peer's private array, read with process_vm_readv: element i is at ``address + i * itemsize``."""

    peer: int
    pid: int
    address: int
    itemsize: int


class PeerData:
    """Rank ``rank``'s reads of its peers' data in the job at ``prefix``: every rank's control block (``segments``,
    laid out as ``layout`` says, and ``views`` of them as int64 words), the peers' process ids (``peer_pids``, for
    their segments' names and ``process_vm_readv``), whether the ptracer discipline is in force, and the ``watch``
    that names why a peer went away when a read fails."""

    def __init__(
        self,
        rank: int,
        prefix: str,
        segments: list[Segment],
        views: list[memoryview],
        peer_pids: list[int],
        *,
        layout: ControlLayout,
        ptracer: bool,
        watch: PeerWatch,
    ) -> None:
        self._eager_offsets = (layout.eager_area_offset(0), layout.eager_area_offset(1))
        """Offset of snapshot area 0 and 1 in a control block (alternating with the parity of the sequence number)."""
        self._eager_areas: dict[tuple[int, int, np.dtype[Any]], npt.NDArray[Any]] = {}
        """Views of the snapshot areas made so far (dropped before the control blocks are unmapped)."""
        self._peer_segments = [PeerSegments() for _ in views]
        """Per peer, the data segments this rank has mapped (by segment id)."""
        self._scratch: npt.NDArray[np.uint8] | None = None
        self.rank = rank
        self._prefix = prefix
        self._segments = segments
        self._views = views
        self._peer_pids = peer_pids
        self._ptracer = ptracer
        self._watch = watch

    def release(self) -> None:
        """Let go of the snapshot views and unmap the peers' data segments (before the control blocks go)."""
        self._eager_areas.clear()
        for cache in self._peer_segments:
            cache.close()

    def peer_array(
        self, peer: int, dtype: np.dtype[Any], count: int, *, seq: int, step: int
    ) -> npt.NDArray[Any] | Remote:
        """Where ``peer`` published its data for this collective, as an array (or a :class:`Remote`)."""
        view = self._views[peer]
        segment_id, offset = view[BUFFER_SEGMENT_WORD], view[BUFFER_OFFSET_WORD]
        if segment_id == IN_PRIVATE_MEMORY:
            return Remote(peer, self._peer_pids[peer], offset, dtype.itemsize)
        cache = self._peer_segments[peer]
        segment = cache.get(segment_id)
        if segment is None:
            path = data_segment_path(self._prefix, peer, self._peer_pids[peer], segment_id)
            try:
                segment = Segment(path, 0, create=False)
            except FileNotFoundError:
                # The peer has already given up and released its memory: report why it left.
                raise self._gone(peer, f"rank {peer} released its shared memory during collective {seq}",
                                 seq=seq, step=step) from None  # fmt: skip
            cache.add(segment_id, segment)
        if not 0 <= offset <= segment.size_bytes - count * dtype.itemsize:
            # the owner publishes where its buffer lies in the segment; past the segment's end it lies nowhere
            raise corrupt_block_error(self.rank, peer, "buffer_offset", int(offset), seq=seq, step=step)
        return segment.array(dtype, count, offset)

    def fetch(self, remote: Remote, start: int, out: npt.NDArray[Any], *, seq: int, step: int) -> None:
        """Copy the peer's elements [start, start + out.size) into ``out``."""
        peer = remote.peer
        if self._ptracer and self._views[peer][PTRACER_WORD] != self.rank:
            # Under Yama the kernel would refuse this read; checked everywhere, so that the discipline is tested
            # where the kernel has no Yama too.
            message = f"rank {peer} had not named this rank its ptracer when it read rank {peer}'s buffer"
            raise _peer_error(ProtocolError, self.rank, peer, f"{message} (collective {seq}, step {step})", step)
        error = read_remote(remote.pid, remote.address + start * remote.itemsize, out)
        if error:
            # The peer is gone or gave up (its memory went with it): name the root cause when there is one.
            message = f"cannot read rank {peer}'s buffer during collective {seq} (step {step}): {os.strerror(error)}"
            raise self._gone(peer, message, seq=seq, step=step)

    def _gone(self, peer: int, message: str, *, seq: int, step: int) -> CollectiveError:
        """The error for ``peer``'s data that is no longer there: the root cause if the watch finds one (it
        raises it), else a :class:`PeerFailureError` saying ``message``."""
        self._watch.check(peer, CLOSED_WORD, UNSATISFIABLE, seq=seq, what="its data", step=step)
        return _peer_error(PeerFailureError, self.rank, peer, message, step)

    def eager_area(self, rank: int, seq: int, dtype: np.dtype[Any]) -> npt.NDArray[Any]:
        """Rank ``rank``'s snapshot area for collective ``seq`` (two areas, alternating with seq's parity).

        Cached per (rank, parity, dtype): making the view costs more than the rest of a small step's bookkeeping."""
        key = (rank, seq & 1, dtype)
        area = self._eager_areas.get(key)
        if area is None:
            area = self._eager_areas[key] = self._segments[rank].array(
                dtype, EAGER_BYTES // dtype.itemsize, self._eager_offsets[seq & 1]
            )
        return area

    def _scratch_of(self, dtype: np.dtype[Any]) -> npt.NDArray[Any]:
        if self._scratch is None:
            self._scratch = np.empty(CROSS_MEMORY_CHUNK_BYTES, dtype=np.uint8)
        return self._scratch.view(dtype)

    def receive_staged(
        self,
        pc: Piece,
        rv: Receive,
        source: npt.NDArray[Any] | Remote,
        shift: int,
        *,
        arrays: tuple[npt.NDArray[Any], npt.NDArray[Any]],
        ufunc: Any,
        reduce_into: ReduceInto,
        seq: int,
        step: int,
        into: npt.NDArray[Any] | None,
    ) -> npt.NDArray[Any]:
        """A piece also sent this step: its result goes to scratch, written once this step's readers are done.

        ``into`` is the scratch result of an earlier receive of the same range in this step: the data is reduced
        into it (the buffer itself still holds the step-start value that peers are reading)."""
        a, b = pc.start, pc.stop
        dtype = arrays[0].dtype
        if into is not None:
            incoming = np.empty(b - a, dtype)
            if isinstance(source, Remote):
                self.fetch(source, a, incoming, seq=seq, step=step)
            else:
                incoming[...] = source[a - shift : b - shift]
            if rv.reduce:
                reduce_into(into, incoming)
                return into
            return incoming
        if isinstance(source, Remote):
            tmp = np.empty(b - a, dtype)
            self.fetch(source, a, tmp, seq=seq, step=step)
            if rv.reduce:
                tmp = _reduced(ufunc, reduce_into, arrays[pc.src][a:b], tmp)
        elif rv.reduce:
            tmp = np.empty(b - a, dtype)
            apply_op(ufunc, reduce_into, arrays[pc.src][a:b], source[a - shift : b - shift], tmp, in_place=False)
        else:
            tmp = source[a - shift : b - shift].copy()
        return tmp

    def receive_remote(
        self,
        pc: Piece,
        rv: Receive,
        source: Remote,
        *,
        arrays: tuple[npt.NDArray[Any], npt.NDArray[Any]],
        ufunc: Any,
        reduce_into: ReduceInto,
        seq: int,
        step: int,
    ) -> None:
        """A piece in the peer's private memory: copied straight into place, or reduced through scratch pieces."""
        a, b = pc.start, pc.stop
        out = arrays[pc.dst][a:b]
        if not rv.reduce:
            self.fetch(source, a, out, seq=seq, step=step)
            return
        # Read a cache-sized piece, reduce it, next: the peer's data crosses memory once.
        scratch = self._scratch_of(arrays[0].dtype)
        mine = arrays[pc.src]
        for c in range(a, b, scratch.size):
            d = min(c + scratch.size, b)
            piece = scratch[: d - c]
            self.fetch(source, c, piece, seq=seq, step=step)
            apply_op(ufunc, reduce_into, mine[c:d], piece, out[c - a : d - a], in_place=pc.src == pc.dst)


def _peer_error(kind: type[CollectiveError], rank: int, peer: int, message: str, step: int) -> CollectiveError:
    """``kind``'s error for a read by ``rank`` of ``peer``'s data at ``step``."""
    return kind(f"rank {rank}: {message}", rank=rank, peer=peer, step=step)


def _reduced(ufunc: Any, reduce_into: ReduceInto, mine: npt.NDArray[Any], incoming: npt.NDArray[Any]) -> Any:
    """op(mine, incoming) in a new array (``incoming`` is a private copy and may be reused as the result)."""
    if ufunc is not None:
        ufunc(mine, incoming, out=incoming)
        return incoming
    out = mine.copy()
    reduce_into(out, incoming)
    return out


def apply_op(
    ufunc: Any,
    reduce_into: ReduceInto,
    mine: npt.NDArray[Any],
    incoming: npt.NDArray[Any],
    dst: npt.NDArray[Any],
    *,
    in_place: bool,
) -> None:
    """dst = op(mine, incoming), in one pass when the reducer exposes its ufunc.

    A large range whose destination does not start on a cache line is done in two calls, the elements before the
    first cache-line boundary and the rest: numpy's vector loops do not align themselves, so every 64-byte vector
    of a range 16 bytes past a line (where a plain numpy array's data starts) touches two lines, and with the lines
    coming from the peer's core that measured 1.5x slower (N=2, 1 MiB float32, 2026-12-05: 185-196 us against
    120-130 us with the range split, the same as page-aligned buffers)."""
    if ufunc is not None:
        if dst.nbytes >= ALIGN_MIN_BYTES:
            lead = -int(dst.ctypes.data) % CACHE_LINE
            if lead and lead % dst.itemsize == 0:
                k = lead // dst.itemsize
                ufunc(mine[:k], incoming[:k], out=dst[:k])
                ufunc(mine[k:], incoming[k:], out=dst[k:])
                return
        ufunc(mine, incoming, out=dst)
        return
    if not in_place:
        dst[...] = mine
    reduce_into(dst, incoming)
