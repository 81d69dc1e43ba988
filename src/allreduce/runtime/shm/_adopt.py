"""Adopting a large buffer into shared memory: the second time a rank passes the same array, its pages become a
shared segment's, so that peers read it in place as they read a ``group.empty()`` array.

Why: a plain array lives in private memory. Peers can read it with ``process_vm_readv`` (where the kernel lets
them), but a reduction then crosses memory twice: the kernel copies the peer's range into scratch, and the add
reads the scratch (at N = 4 on two cores, 256 MiB: 305 ms of CPU per call summed over ranks, against 231 ms for a
``group.empty()`` buffer, whose peers add straight out of the owner's pages). A training loop all-reduces the same
gradient buffers step after step, so a rank can move such a buffer, once, onto a shared segment at the same
address: it creates a file in ``/dev/shm`` (``posix_fallocate``, so a full ``/dev/shm`` is a refusal now rather
than a SIGBUS later), copies the buffer's pages into it, and moves the file's mapping over them
(``mremap(MREMAP_FIXED)``, one step: the range is never unmapped in between). The array object, its address and
its contents are unchanged; only which physical pages back them changes. Peers then map the file by name, as they
map ``group.empty()`` segments: no ``process_vm_readv``, so Yama's ``ptrace_scope`` plays no part.

What is adopted: a buffer of at least :data:`ADOPT_MIN_BYTES` that is a whole allocation (a numpy array that owns
its memory, or a torch tensor's whole storage; never a view into a larger array, whose neighbours another thread
may be writing while the pages are copied), lying in private anonymous memory (``/proc/self/maps``: never a
file's mapping, never memory already shared), seen before at the same address with the same size. A buffer
passed once is not adopted. Where its pages are its own (:func:`pages_of_its_own`: the C library mapped it
alone) all of them move. Where the C library put it on its heap (glibc's mmap
threshold climbs to 32 MiB as a program frees large arrays, so in a real program most buffers of 1-32 MiB end up
there), only a numpy array that owns its memory is adopted, and only the whole pages inside it move: the partly
filled pages at its two ends hold other allocations, which must stay private and where they are. The file has
pages for those two ends too; each collective works on a second mapping of the whole file (its *mirror*, where the
buffer lies contiguous, as peers see it), copies the buffer's two ends into it first (less than a page each) and
back out after. Heap pages are the allocator's again once the array is freed, so a weak reference moves the inner
pages back onto private memory the moment the array dies, before numpy frees them (weak references are cleared
first in an array's deallocation); a torch tensor on the heap, whose storage may outlive the Python object, is
not adopted. One case escapes the callback: ``ndarray.resize`` reallocating an adopted array's memory while the
array lives on. Its old inner pages stay the file's until the group closes (or forgets the record) and moves them
back; a write another thread makes during that one copy to whatever the allocator put there would be lost.

Every later use checks that the pages are still the segment's: a byte is flipped through a second mapping of the
file and read back through the buffer, then restored (the buffer then belongs to this rank: it is about to be
overwritten by the collective, and peers finished reading it in the previous one). A buffer that was freed and
replaced by a new one at the same address fails the check: the new buffer takes the other paths, and a buffer at
that address is adopted again only after twice as many uses as the last wait (so a loop that allocates a fresh
buffer per call, which the allocator puts at the same address, pays a copy ever more rarely).

Private memory semantics are kept where they differ from shared memory's:

- ``fork()``: a child would share the adopted pages with its parent instead of getting a copy. The at-fork
  handlers give the child private copies, and the parent returns from ``fork()`` only once the child has made
  them, so the child sees exactly the memory of the moment of the fork.
- close: :meth:`Adoptions.release` moves every adopted buffer that is still alive back onto private pages (one
  copy each), so after ``group.close()`` the process's memory is as it would have been.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from allreduce.runtime._args import switch_arg
from allreduce.runtime.shm._linux import libc_function

__all__ = [
    "ADOPT_ENV",
    "ADOPT_MIN_BYTES",
    "Adopted",
    "Adoptions",
    "adopt_wanted",
    "mapped_to",
    "whole_allocation",
]

ADOPT_MIN_BYTES = 1 << 20
"""The smallest buffer adopted."""

ADOPT_ENV = "ALLREDUCE_SHM_ADOPT"
"""``0`` turns adoption off (the transport's ``adopt_buffers`` keyword wins over it)."""

_CAPACITY = 64
"""Distinct buffers a rank remembers (oldest forgotten first; an adopted one is moved back to private pages)."""

_NEVER = -1
"""A remembered buffer's state when it cannot be adopted (not a whole allocation, not private memory, /dev/shm
full); a state n >= 0 is the number of uses still to wait before adopting it."""

_MAX_WAIT = 1024
"""The longest wait (in uses) before an address whose buffers were replaced is adopted again."""

_PAGE = mmap.PAGESIZE
_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2
_MAP_FAILED = ctypes.c_void_p(-1).value


_mmap = libc_function("mmap", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long)  # fmt: skip
_mremap = libc_function("mremap", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int,
                        ctypes.c_void_p)  # fmt: skip
_munmap = libc_function("munmap", ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t)

SUPPORTED = None not in (_mmap, _mremap, _munmap)


def adopt_wanted(requested: bool | None) -> bool:
    """Whether to adopt buffers used again: ``requested``, else :data:`ADOPT_ENV` (``0`` or ``1``; ValueError
    naming it for anything else), else yes."""
    return switch_arg(requested, ADOPT_ENV)


def whole_allocation(buffer: npt.NDArray[Any]) -> bool:
    """Whether ``buffer`` spans exactly the memory its allocator gave: a numpy array owning its data (or a view of
    all of it), or a view of a torch tensor's whole storage."""
    address, nbytes = int(buffer.ctypes.data), buffer.nbytes
    owner = buffer
    while isinstance(owner.base, np.ndarray):
        owner = owner.base
    base: Any = owner.base  # numpy types it as an array or None; a torch tensor's numpy view has the tensor
    if base is None:
        return bool(owner.flags.owndata) and int(owner.ctypes.data) == address and owner.nbytes == nbytes
    storage = getattr(base, "untyped_storage", None)
    if storage is None:
        return False
    try:
        whole = storage()
        return bool(whole.data_ptr() == address and whole.nbytes() == nbytes)
    except Exception:  # anything else that exposes this name is not a torch tensor we know
        return False


_IS_MMAPPED = 0x2
"""glibc's chunk-size flag: the chunk is a mapping of its own (``malloc.c``: ``IS_MMAPPED``)."""


def pages_of_its_own(address: int, nbytes: int) -> bool:
    """Whether the pages under ``[address, address + nbytes)`` hold no other allocation.

    glibc decides per call: below its mmap threshold (which moves between 128 KiB and 32 MiB as a program frees
    memory) from its heap, and at any size from the heap's free top if that is large enough (a 32 MiB array came
    from the heap in a test process whose heap had grown), so this reads the chunk header glibc keeps in the 16
    bytes before the data:
    the size word with ``IS_MMAPPED`` set, and the offset of the chunk in its mapping (``prev_size``, non-zero for
    ``posix_memalign``, which torch uses), must describe page-aligned whole pages that contain the buffer. Only read
    when those 16 bytes lie on the buffer's first page (so they are mapped); any other allocator fails the test."""
    if address % _PAGE < 16:
        return False
    words = (ctypes.c_uint64 * 2).from_address(address - 16)
    prev_size, size_word = int(words[0]), int(words[1])
    if not size_word & _IS_MMAPPED:
        return False
    size = size_word & ~7
    mapping = address - 16 - prev_size
    return mapping % _PAGE == 0 and (prev_size + size) % _PAGE == 0 and address + nbytes <= mapping + prev_size + size


def _maps() -> list[tuple[int, int, str, int, str]]:
    """This process's mappings: (start, stop, permissions, inode, path)."""
    out = []
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            a, b = fields[0].split("-")
            path = fields[5].strip() if len(fields) > 5 else ""
            out.append((int(a, 16), int(b, 16), fields[1], int(fields[4]), path))
    return out


def private_anonymous(start: int, stop: int, maps: list[tuple[int, int, str, int, str]] | None = None) -> bool:
    """Whether every page of ``[start, stop)`` is private, anonymous, readable and writable memory."""
    covered = start
    for a, b, perms, inode, path in maps if maps is not None else _maps():
        if b <= covered:
            continue
        if a > covered:
            return False
        if not perms.startswith("rw") or perms[3] != "p" or inode != 0 or path not in {"", "[heap]"}:
            return False
        covered = b
        if covered >= stop:
            return True
    return False


def mapped_to(start: int, stop: int, path: str, maps: list[tuple[int, int, str, int, str]] | None = None) -> bool:
    """Whether ``[start, stop)`` is one shared mapping of the file ``path`` (unlinked or not)."""
    for a, b, perms, _, shown in maps if maps is not None else _maps():
        if a <= start < b:
            name = shown.removesuffix(" (deleted)")
            return b >= stop and perms[3] == "s" and name == path
    return False


def _copy_and_move(tmp: int, start: int, length: int) -> int:
    """Copy ``[start, start + length)`` into the new mapping ``tmp``, then move ``tmp`` over the range; 0, or the
    errno of the move (``tmp`` unmapped then, the range unchanged)."""
    ctypes.memmove(tmp, start, length)
    got = _mremap(tmp, length, length, _MREMAP_MAYMOVE | _MREMAP_FIXED, start)
    if got is None or got == _MAP_FAILED:
        err = ctypes.get_errno() or errno.EINVAL
        _munmap(tmp, length)
        return err
    return 0


def _move_over(start: int, length: int, fd: int, offset: int = 0) -> int:
    """Map ``length`` bytes of ``fd`` from ``offset`` (shared) elsewhere, copy ``[start, start + length)`` into it,
    then move that mapping over the range (the range is never left unmapped). 0, or the errno of the step that
    failed (the range is unchanged then)."""
    tmp = _mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, offset)
    if tmp is None or tmp == _MAP_FAILED:
        return ctypes.get_errno() or errno.ENOMEM
    return _copy_and_move(tmp, start, length)


def _privatize(start: int, length: int) -> int:
    """Move ``[start, start + length)`` onto private anonymous pages with the same contents; 0 or errno."""
    tmp = _mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if tmp is None or tmp == _MAP_FAILED:
        return ctypes.get_errno() or errno.ENOMEM
    return _copy_and_move(tmp, start, length)


@dataclass(slots=True)
class Adopted:
    """An adopted buffer at ``address``, on the pages ``[start, start + length)`` of segment
    ``segment_id`` (the file ``path``, which has a page for each of them). The pages ``[moved, moved +
    moved_length)`` of the process are the file's own (all of them unless ``edges``: a buffer on the C library's
    heap, whose two end pages stay private); ``mirror`` is a second mapping of the whole file, through which a use
    checks that they still are and, with ``edges``, where the collective works."""

    segment_id: int
    path: str
    start: int
    length: int
    address: int
    moved: int
    moved_length: int
    mirror: mmap.mmap
    closed: bool = False
    """Closed (forgotten, or moved back): its pages are not the file's, or will not be once the buffer is freed."""
    guard: weakref.ref[Any] | None = None
    """For a heap buffer: the weak reference to its numpy array that moves the pages back when the array dies."""

    @property
    def edges(self) -> bool:
        """Whether the buffer's two end pages stay private (it lies on the C library's heap)."""
        return self.moved_length != self.length

    @property
    def offset(self) -> int:
        """Where the buffer starts in the file."""
        return self.address - self.start

    def alive(self) -> bool:
        """The buffer is still on this segment's pages (a byte of the moved pages flipped through the mirror shows
        through the buffer; it is restored at once). Only while the buffer is this rank's to write."""
        if self.closed:
            return False
        probe = max(self.address, self.moved)
        i = probe - self.start
        old = self.mirror[i]
        self.mirror[i] = old ^ 0xFF
        seen = ctypes.c_uint8.from_address(probe).value
        self.mirror[i] = old
        return seen == old ^ 0xFF

    def _ends(self, itemsize: int, count: int) -> tuple[int, int]:
        """Elements ``[0, head)`` and ``[tail, count)`` of the buffer lie on its private end pages."""
        head = (self.moved - self.address) // itemsize
        tail = (self.moved + self.moved_length - self.address) // itemsize
        return max(head, 0), min(tail, count)

    def work_view(self, buffer: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """The buffer in the mirror (where peers see it), with its two ends copied in from ``buffer``: where a
        collective on a buffer with ``edges`` works; :meth:`copy_ends_out` brings its ends back afterwards."""
        view: npt.NDArray[Any] = np.frombuffer(self.mirror, buffer.dtype, buffer.size, self.offset)
        head, tail = self._ends(buffer.itemsize, buffer.size)
        view[:head] = buffer[:head]
        view[tail:] = buffer[tail:]
        return view

    def copy_ends_out(self, view: npt.NDArray[Any], buffer: npt.NDArray[Any]) -> None:
        """The two ends of the result, from :meth:`work_view`'s ``view`` back into ``buffer``."""
        head, tail = self._ends(buffer.itemsize, buffer.size)
        buffer[:head] = view[:head]
        buffer[tail:] = view[tail:]

    def close(self, *, unlink: bool = True) -> None:
        self.closed = True
        self.guard = None
        with contextlib.suppress(BufferError, ValueError):
            self.mirror.close()
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


def _still_moved(record: Adopted, maps: list[tuple[int, int, str, int, str]]) -> bool:
    """Whether the record's moved pages are still the file's (the buffer was not freed and unmapped)."""
    return mapped_to(record.moved, record.moved + record.moved_length, record.path, maps)


def _numpy_owner(buffer: npt.NDArray[Any]) -> npt.NDArray[Any] | None:
    """The numpy array that owns ``buffer``'s memory (numpy frees it when that array dies), else None."""
    owner = buffer
    while isinstance(owner.base, np.ndarray):
        owner = owner.base
    return owner if owner.base is None and owner.flags.owndata else None


def _on_free(record: Adopted) -> Callable[[Any], None]:
    """The weak reference's callback for a heap buffer: numpy is about to free the array's memory (and the C
    library to reuse its pages for anything), so its moved pages go back onto private memory now; the record
    is closed, and forgotten by its :class:`Adoptions` at its next use of that address or adoption."""

    def moved_back(_: Any) -> None:
        if record.closed:
            return
        # a reentrant lock: a collection inside this thread's fork handler may land here; nothing may escape a
        # weak reference's callback (at interpreter exit, module globals may be gone already)
        with contextlib.suppress(Exception), _ForkGuard.lock:
            if not record.closed:
                _privatize(record.moved, record.moved_length)
                record.close()  # the file's memory goes with it

    return moved_back


_LIVE: weakref.WeakSet[Adoptions] = weakref.WeakSet()


class _ForkGuard:
    """Holds the parent in ``fork()`` until the child has made private copies of the adopted pages."""

    lock = threading.RLock()
    pipe: tuple[int, int] | None = None


class Adoptions:
    """This rank's adopted buffers and the buffers it has seen once (see the module docstring).

    ``new_segment`` names a new segment: ``() -> (segment id, path)``, from the rank's
    :class:`~allreduce.runtime.shm._segments.LocalSegments`, so peers derive the path as for its other segments."""

    def __init__(self, new_segment: Callable[[], tuple[int, str]], *, enabled: bool) -> None:
        self.enabled = enabled and SUPPORTED
        self.adopted = 0
        """Buffers adopted."""
        self.refused = 0
        """Adoptions refused or undone (not a whole allocation, not private memory, /dev/shm full, churning)."""
        self.last_error = ""
        self._new_segment = new_segment
        self._seen: OrderedDict[tuple[int, int], int | Adopted] = OrderedDict()
        self._strikes: dict[tuple[int, int], int] = {}
        """Per address and size: how many times an adopted buffer there was found replaced or freed."""
        _LIVE.add(self)

    def expects(self, buffer: npt.NDArray[Any]) -> bool:
        """Whether :meth:`home` will likely place ``buffer`` on a shared segment on this use (it is adopted, or
        it is adopted now), without counting a use: for choosing the algorithm before the home is chosen."""
        if not self.enabled or buffer.nbytes < ADOPT_MIN_BYTES:
            return False
        state = self._seen.get((int(buffer.ctypes.data), buffer.nbytes))
        return isinstance(state, Adopted) or state == 0

    def home(self, buffer: npt.NDArray[Any]) -> Adopted | None:
        """Where ``buffer`` lies when it is adopted (adopting it now on its second use): its segment, its offset
        there and whether its ends are private (:attr:`Adopted.edges`); None when it takes another path."""
        if not self.enabled or buffer.nbytes < ADOPT_MIN_BYTES:
            return None
        key = (int(buffer.ctypes.data), buffer.nbytes)
        state = self._seen.get(key)
        if state is None:
            self._seen[key] = 0  # adopted on its next use
            self._forget_oldest()
            return None
        self._seen.move_to_end(key)
        if isinstance(state, Adopted):
            if state.alive():
                return state
            # freed, and a new buffer took its address
            state.close()
            self._strike(key)
            self.refused += 1
            self.last_error = "a buffer was replaced at the same address"
            return None
        if state != 0:
            if state > 0:
                self._seen[key] = state - 1
            return None
        self._drop_freed()
        adopted = self._adopt(buffer)
        self._seen[key] = adopted if adopted is not None else _NEVER
        if adopted is None:
            self.refused += 1
            return None
        self.adopted += 1
        return adopted

    def _adopt(self, buffer: npt.NDArray[Any]) -> Adopted | None:
        address = int(buffer.ctypes.data)
        start = address // _PAGE * _PAGE
        length = -(-(address + buffer.nbytes) // _PAGE) * _PAGE - start
        if not whole_allocation(buffer):
            self.last_error = "not a whole allocation (a view into a larger array, or foreign memory)"
            return None
        moved, moved_length = start, length
        owner = None
        if not pages_of_its_own(address, buffer.nbytes):
            # on the C library's heap: only the whole pages inside the buffer move, and only for a numpy array
            # whose death this rank hears of before its memory is freed
            owner = _numpy_owner(buffer)
            if owner is None:
                self.last_error = "on the C library's heap, and not memory a numpy array owns"
                return None
            if address % buffer.itemsize:
                self.last_error = "on the C library's heap, and not aligned to its element size"
                return None
            moved = -(-address // _PAGE) * _PAGE
            moved_length = (address + buffer.nbytes) // _PAGE * _PAGE - moved
        if not private_anonymous(start, start + length):
            self.last_error = "not private anonymous memory (a file's mapping, or memory already shared)"
            return None
        segment_id, path = self._new_segment()
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            self.last_error = f"{path}: {e.strerror}"
            return None
        try:
            try:
                os.posix_fallocate(fd, 0, length)  # a full /dev/shm refuses now, not with SIGBUS on a later write
                mirror = mmap.mmap(fd, length, flags=mmap.MAP_SHARED)
            except OSError as e:
                self.last_error = f"{path}: {e.strerror}"
                os.unlink(path)
                return None
            with _ForkGuard.lock:  # a fork from another thread sees the buffer either before or after the move
                err = _move_over(moved, moved_length, fd, moved - start)
        finally:
            os.close(fd)
        record = Adopted(segment_id, path, start, length, address, moved, moved_length, mirror)
        if err:
            self.last_error = f"mremap: {os.strerror(err)}"
            record.close()
            return None
        if owner is not None:
            record.guard = weakref.ref(owner, _on_free(record))
        return record

    def _drop_freed(self) -> None:
        """Forget the adopted buffers that were freed (their pages are no longer the file's), so that their files
        no longer hold memory. Called before each adoption: frees happen between them."""
        if not self.holds_any():
            return
        maps = _maps()
        for key, state in list(self._seen.items()):
            if isinstance(state, Adopted) and (state.closed or not _still_moved(state, maps)):
                state.close()
                self._strike(key)

    def _strike(self, key: tuple[int, int]) -> None:
        """An adopted buffer at ``key`` was replaced or freed: a buffer there is adopted again only after waiting
        twice as many uses as the last time (1, 2, 4, ... up to :data:`_MAX_WAIT`), so that a loop allocating a
        fresh buffer per call at the same address pays a copy ever more rarely, while one that replaces its
        buffers now and then (a new model, the next case of a benchmark) gets them adopted again."""
        strikes = self._strikes.get(key, 0) + 1
        self._strikes[key] = strikes
        self._seen[key] = min(2 ** (strikes - 1), _MAX_WAIT)

    def _forget_oldest(self) -> None:
        while len(self._seen) > _CAPACITY:
            key, state = self._seen.popitem(last=False)
            self._strikes.pop(key, None)
            if isinstance(state, Adopted):
                self._undo(state, _maps())

    def _undo(self, record: Adopted, maps: list[tuple[int, int, str, int, str]]) -> None:
        """Move a still-adopted buffer back onto private pages; forget the segment."""
        with _ForkGuard.lock:  # not while its array's weak reference does the same
            if not record.closed and _still_moved(record, maps):
                _privatize(record.moved, record.moved_length)
            record.close()

    def release(self) -> None:
        """Move every adopted buffer that is still alive back onto private pages and remove the files."""
        records = [s for s in self._seen.values() if isinstance(s, Adopted)]
        self._seen.clear()
        if records:
            maps = _maps()
            for record in records:
                self._undo(record, maps)
        _LIVE.discard(self)

    def unlink(self) -> None:
        """Remove the files (mappings stay valid); safe in ``__del__``."""
        for state in self._seen.values():
            if isinstance(state, Adopted):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(state.path)

    def holds_any(self) -> bool:
        """Whether any buffer is adopted now."""
        return any(isinstance(s, Adopted) for s in self._seen.values())

    def in_child(self, maps: list[tuple[int, int, str, int, str]]) -> None:
        """After fork, in the child: private copies of the adopted pages; the parent's files are not ours."""
        for state in self._seen.values():
            if isinstance(state, Adopted):
                if not state.closed and _still_moved(state, maps):
                    _privatize(state.moved, state.moved_length)
                state.close(unlink=False)
        self._seen.clear()
        self.enabled = False


def _before_fork() -> None:
    _ForkGuard.lock.acquire()
    if any(a.holds_any() for a in list(_LIVE)):
        _ForkGuard.pipe = os.pipe()


def _after_fork_in_parent() -> None:
    try:
        if _ForkGuard.pipe is not None:
            r, w = _ForkGuard.pipe
            os.close(w)
            with contextlib.suppress(OSError):
                os.read(r, 1)  # the child has made its copies (or died: end of file)
            os.close(r)
    finally:
        _ForkGuard.pipe = None
        _ForkGuard.lock.release()


def _after_fork_in_child() -> None:
    try:
        live = list(_LIVE)
        if live:
            maps = _maps()
            for adoptions in live:
                adoptions.in_child(maps)
    finally:
        if _ForkGuard.pipe is not None:
            r, w = _ForkGuard.pipe
            os.close(r)
            with contextlib.suppress(OSError):
                os.write(w, b"1")
            os.close(w)
        _ForkGuard.pipe = None
        _ForkGuard.lock.release()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)
