"""Reading a peer's data for one collective: where the peer published it, and receiving (and reducing) from it.

A mixin of :class:`~allreduce.runtime.shm.ShmTransport` (its methods resolve like the class's own, so the
per-step loop pays no extra layer). A peer's data is in its eager snapshot area, in a shared segment (its
``group.empty()`` arrays or its staging buffer), or in its private memory, read with ``process_vm_readv``
(:class:`Remote`); a receive that reduces out of private memory goes through a scratch piece that stays in L2.
A read that fails because the peer went away names the root cause (see
:mod:`allreduce.runtime.shm._waiting`).

Under the ptracer discipline (Yama ``ptrace_scope = 1``) the owner of private data admits its readers one at a
time (:meth:`PeerData._admit`): before publishing step t it names step t's reader its ptracer, after the previous
ptracer has said it finished reading (its ``read_done``), so a peer is never refused mid-read.
"""

from __future__ import annotations

import errno
import importlib
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from allreduce.runtime._args import switch_arg
from allreduce.runtime._errors import PeerFailureError, ProtocolError
from allreduce.runtime._transport import ReduceInto
from allreduce.runtime.shm._adopt import Adoptions
from allreduce.runtime.shm._compile import Piece, Receive
from allreduce.runtime.shm._layout import (
    BUFFER_OFFSET_WORD,
    BUFFER_SEGMENT_WORD,
    CLOSED_WORD,
    EAGER_BYTES,
    IN_PRIVATE_MEMORY,
    PTRACER_WORD,
    READ_DONE_WORD,
    UNSATISFIABLE,
)
from allreduce.runtime.shm._linux import (
    TRANSPARENT_HUGEPAGES,
    collapse_to_huge_pages,
    read_remote,
    set_ptracer,
)
from allreduce.runtime.shm._segments import LocalSegments, PeerSegments, Segment, data_segment_path
from allreduce.runtime.shm._waiting import PeerWaiting, corrupt_block_error

__all__ = [
    "COLLAPSE_ENV",
    "COLLAPSE_MIN_BYTES",
    "CROSS_MEMORY_CHUNK_BYTES",
    "NUMPY_HUGEPAGE_MIN_BYTES",
    "HugePageMemo",
    "PeerData",
    "Remote",
    "apply_op",
    "huge_pages_likely",
]

CROSS_MEMORY_CHUNK_BYTES = 1 << 20
"""A cross-memory receive that reduces goes through a scratch piece of this size, which stays in L2."""

CACHE_LINE = 64
"""Bytes per cache line (x86-64 and most arm64 cores): the alignment :func:`apply_op` gives a large range."""

ALIGN_MIN_BYTES = 1 << 16
"""The smallest range :func:`apply_op` splits at a cache-line boundary (below, the extra call costs more)."""


NUMPY_HUGEPAGE_MIN_BYTES = 4 << 20
"""numpy asks the kernel for huge pages (``madvise(MADV_HUGEPAGE)``) for the arrays it allocates from this size."""


def _numpy_asks_for_huge_pages() -> bool:
    for module in ("numpy._core.multiarray", "numpy.core.multiarray"):  # numpy 2, numpy 1
        try:
            ask = getattr(importlib.import_module(module), "_get_madvise_hugepage", None)
        except ImportError:
            continue
        if ask is not None:
            return bool(ask())
    return False


_NUMPY_HUGE_PAGES = _numpy_asks_for_huge_pages()


def huge_pages_likely(buffer: npt.NDArray[Any]) -> bool:
    """Whether ``buffer`` is most likely backed by 2 MiB pages: the kernel gives them to every large region, or it
    gives them on request and the memory is a large array numpy allocated (numpy asks; torch's allocator does not).

    Reading a peer's memory with ``process_vm_readv`` pins it page by page: over 4 KiB pages that costs more than
    staging the buffer through shared memory (64 MiB, N = 2: 12-14.5 ms of CPU per call in place against 9.4 ms
    staged, and 5.3-6.2 ms in place over huge pages), so only buffers this returns True for are read in place."""
    if TRANSPARENT_HUGEPAGES == "always":
        return True
    if TRANSPARENT_HUGEPAGES != "madvise" or not _NUMPY_HUGE_PAGES:
        return False
    owner = buffer
    while isinstance(owner.base, np.ndarray):
        owner = owner.base
    return owner.base is None and owner.nbytes >= NUMPY_HUGEPAGE_MIN_BYTES


COLLAPSE_MIN_BYTES = 16 << 20
"""The smallest buffer :class:`HugePageMemo` collapses: at least 3/4 of it then lies in whole 2 MiB pages, however
it is aligned (the partial huge pages at its two ends stay on 4 KiB pages)."""

COLLAPSE_ENV = "ALLREDUCE_SHM_COLLAPSE"
"""``0`` turns :class:`HugePageMemo` off (the transport's ``collapse_huge_pages`` keyword wins over it)."""

_MEMO_CAPACITY = 64
"""Distinct buffers a rank remembers (oldest forgotten first): more than a training loop's gradient buckets."""

_SEEN, _COLLAPSED, _REFUSED = 0, 1, 2


def collapse_wanted(requested: bool | None) -> bool:
    """Whether to collapse buffers used again: ``requested``, else :data:`COLLAPSE_ENV` (``0`` or ``1``; ValueError
    naming it for anything else), else yes."""
    return switch_arg(requested, COLLAPSE_ENV)


class HugePageMemo:
    """Buffers that are used again are moved onto huge pages, so that peers read them in place.

    Reading a peer's private memory pins it page by page, which over 4 KiB pages costs more than staging (see
    :func:`huge_pages_likely`). Plain arrays numpy allocates are on huge pages already; torch's CPU tensors and
    memory from other allocators are not. A training loop all-reduces the same buffers step after step, so the
    second time a rank passes a buffer of at least :data:`COLLAPSE_MIN_BYTES` (same address and size) it asks the
    kernel to collapse the buffer's whole huge pages (``MADV_COLLAPSE``, Linux 6.1: a one-off copy inside the
    kernel, contents unchanged), and from then on that buffer is read in place. A buffer seen once is staged as
    before, so a loop that allocates a fresh buffer per call never pays for a collapse.

    A refusal (an older kernel, no huge page to be had) is remembered: that buffer stays staged, and on EINVAL or
    ENOSYS (the kernel has no ``MADV_COLLAPSE``) no buffer is tried again. If a collapsed buffer is freed and a new
    one lands at the same address with the same size, it is read in place over whatever pages it has: slower
    than staging, never wrong."""

    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled and TRANSPARENT_HUGEPAGES != "never"  # the administrator said no huge pages
        self.collapsed = 0
        """Buffers collapsed."""
        self.refused = 0
        """Collapses the kernel refused."""
        self.last_errno = 0
        self._seen: OrderedDict[tuple[int, int], int] = OrderedDict()

    def in_place(self, buffer: npt.NDArray[Any]) -> bool:
        """Whether peers may read ``buffer`` in place as on huge pages (collapsing it now if this is its second
        use); False for a buffer this memo does not (or cannot) move onto huge pages."""
        if not self.enabled or buffer.nbytes < COLLAPSE_MIN_BYTES:
            return False
        key = (int(buffer.ctypes.data), buffer.nbytes)
        state = self._seen.get(key)
        if state is None:
            self._seen[key] = _SEEN
            if len(self._seen) > _MEMO_CAPACITY:
                self._seen.popitem(last=False)
            return False
        self._seen.move_to_end(key)
        if state == _SEEN:
            done, err = collapse_to_huge_pages(*key)
            state = _COLLAPSED if done else _REFUSED
            self._seen[key] = state
            if done:
                self.collapsed += 1
            else:
                self.refused += 1
                self.last_errno = err
                if err in (errno.EINVAL, errno.ENOSYS):
                    self.enabled = False
        return state == _COLLAPSED


@dataclass(frozen=True, slots=True)
class Remote:
    """A peer's private array, read with process_vm_readv: element i is at ``address + i * itemsize``."""

    peer: int
    pid: int
    address: int
    itemsize: int


class PeerData(PeerWaiting):
    """Peers' data as this rank reads it (mixed into the transport, which sets the state)."""

    _ctl: list[Segment | None]
    _peer_pids: list[int]
    _peer_segments: list[PeerSegments]
    """Per peer, the data segments this rank has mapped (by segment id)."""
    _eager_offsets: tuple[int, int]
    """Offset of snapshot area 0 and 1 in a control block (alternating with the parity of the sequence number)."""
    _eager_areas: dict[tuple[int, int, np.dtype[Any]], npt.NDArray[Any]]
    """Views of the snapshot areas made so far (dropped before the control blocks are unmapped)."""
    _scratch: npt.NDArray[np.uint8] | None
    _ptracer: bool
    """The ptracer discipline is in force (see the module docstring)."""
    _tracer: int
    """The peer this rank last named its ptracer (-1: none)."""
    _tracer_release: int
    """The ``read_done`` value the current ptracer reaches once it has read everything it was admitted for."""
    _ptracer_switches: int
    _cross_memory_min_bytes: int
    _segments: LocalSegments
    _adoptions: Adoptions

    def fuses(self, buffer: npt.NDArray[Any]) -> bool:
        """A staged array in a group of two: a step's sent ranges are copied into the working buffer and every
        range received is reduced straight out of the peer's into a different array (the working buffer when it
        is sent again, else the user's), one pass, never through scratch. Larger groups are left to the size
        rule: their recursive doubling receives ranges it also sends in that step into scratch first (measured
        at N=2, plain float32 arrays, recursive doubling against the ring, 2026-12-03: 0.66-0.92 of its time
        from 64 KiB to 4 MiB)."""
        return (
            self.world_size == 2
            and buffer.nbytes < self._cross_memory_min_bytes
            and self._segments.locate(buffer) is None
            and not self._adoptions.expects(buffer)
        )

    def _admit(self, reader: int, release: int, *, deadline: float, seq: int, step: int) -> None:
        """Ptracer discipline: let ``reader`` alone read this rank's private memory until its ``read_done`` reaches
        ``release``; the peer admitted before it first finishes what it was admitted for."""
        if reader != self._tracer:
            if self._tracer >= 0 and self._tracer_release >= 0:
                self._wait(self._tracer, READ_DONE_WORD, self._tracer_release, deadline=deadline, seq=seq,
                           what="reading this rank's data before the next reader is admitted", step=step)  # fmt: skip
            set_ptracer(self._peer_pids[reader])
            self._tracer = self._views[self.rank][PTRACER_WORD] = reader
            self._ptracer_switches += 1
        self._tracer_release = release

    def _peer_array(
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
                self._check_peers(peer, CLOSED_WORD, UNSATISFIABLE, seq=seq, what="its data", step=step)
                raise PeerFailureError(
                    f"rank {self.rank}: rank {peer} released its shared memory during collective {seq}",
                    rank=self.rank,
                    peer=peer,
                    step=step,
                ) from None
            cache.add(segment_id, segment)
        if not 0 <= offset <= segment.size_bytes - count * dtype.itemsize:
            # the owner publishes where its buffer lies in the segment; past the segment's end it lies nowhere
            raise corrupt_block_error(self.rank, peer, "buffer_offset", int(offset), seq=seq, step=step)
        return segment.array(dtype, count, offset)

    def _fetch(self, remote: Remote, start: int, out: npt.NDArray[Any], *, seq: int, step: int) -> None:
        """Copy the peer's elements [start, start + out.size) into ``out``."""
        if self._ptracer and self._views[remote.peer][PTRACER_WORD] != self.rank:
            # Under Yama the kernel would refuse this read; checked everywhere, so that the discipline is tested
            # where the kernel has no Yama too.
            raise ProtocolError(
                f"rank {self.rank}: rank {remote.peer} had not named this rank its ptracer when it read rank "
                f"{remote.peer}'s buffer (collective {seq}, step {step})",
                rank=self.rank,
                peer=remote.peer,
                step=step,
            )
        error = read_remote(remote.pid, remote.address + start * remote.itemsize, out)
        if not error:
            return
        # The peer is gone or gave up (its memory went with it): name the root cause when there is one.
        self._check_peers(remote.peer, CLOSED_WORD, UNSATISFIABLE, seq=seq, what="its data", step=step)
        raise PeerFailureError(
            f"rank {self.rank}: cannot read rank {remote.peer}'s buffer during collective {seq} "
            f"(step {step}): {os.strerror(error)}",
            rank=self.rank,
            peer=remote.peer,
            step=step,
        )

    def _eager_area(self, rank: int, seq: int, dtype: np.dtype[Any]) -> npt.NDArray[Any]:
        """Rank ``rank``'s snapshot area for collective ``seq`` (two areas, alternating with seq's parity).

        Cached per (rank, parity, dtype): making the view costs more than the rest of a small step's bookkeeping."""
        key = (rank, seq & 1, dtype)
        area = self._eager_areas.get(key)
        if area is None:
            ctl = self._ctl[rank]
            assert ctl is not None
            area = self._eager_areas[key] = ctl.array(
                dtype, EAGER_BYTES // dtype.itemsize, self._eager_offsets[seq & 1]
            )
        return area

    def _scratch_of(self, dtype: np.dtype[Any]) -> npt.NDArray[Any]:
        if self._scratch is None:
            self._scratch = np.empty(CROSS_MEMORY_CHUNK_BYTES, dtype=np.uint8)
        return self._scratch.view(dtype)

    def _receive_staged(
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
                self._fetch(source, a, incoming, seq=seq, step=step)
            else:
                incoming[...] = source[a - shift : b - shift]
            if rv.reduce:
                reduce_into(into, incoming)
                return into
            return incoming
        if isinstance(source, Remote):
            tmp = np.empty(b - a, dtype)
            self._fetch(source, a, tmp, seq=seq, step=step)
            if rv.reduce:
                tmp = _reduced(ufunc, reduce_into, arrays[pc.src][a:b], tmp)
        elif rv.reduce:
            tmp = np.empty(b - a, dtype)
            apply_op(ufunc, reduce_into, arrays[pc.src][a:b], source[a - shift : b - shift], tmp, in_place=False)
        else:
            tmp = source[a - shift : b - shift].copy()
        return tmp

    def _receive_remote(
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
            self._fetch(source, a, out, seq=seq, step=step)
            return
        # Read a cache-sized piece, reduce it, next: the peer's data crosses memory once.
        scratch = self._scratch_of(arrays[0].dtype)
        mine = arrays[pc.src]
        for c in range(a, b, scratch.size):
            d = min(c + scratch.size, b)
            piece = scratch[: d - c]
            self._fetch(source, c, piece, seq=seq, step=step)
            apply_op(ufunc, reduce_into, mine[c:d], piece, out[c - a : d - a], in_place=pc.src == pc.dst)


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
