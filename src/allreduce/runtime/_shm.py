"""The shared-memory transport: ranks on one host read each other's buffers directly, no socket in the data path.

One-sided execution. Every rank's working buffer ``W`` lives in a shared segment (a file in ``/dev/shm`` that
every peer maps). A receiver reduces straight out of the sender's segment into its own memory
(``np.add(mine, theirs, out=mine)``, one pass), so a transfer is never copied into an intermediate channel.
Two counters per rank in a small control segment carry all synchronisation:

- ``progress`` = (seq, t): "my buffer holds the state at the start of step t" — a receiver waits for it
  before it reads the sender's step-t blocks;
- ``read_done`` = (seq, t+1): "I have finished reading your step-t blocks" — a sender waits for it before it
  overwrites a range that a peer reads at that step or earlier.

A range that is both sent and received in the same step (recursive doubling) is reduced into scratch memory and
copied in once the readers are done (the plan semantics: sends read the step-start state).

Small buffers go *eager*: each step's sent ranges are copied into a snapshot area of the owner's control segment
(two areas, alternating by sequence number) and peers read that, so the owner overwrites its buffer without
waiting for readers; :meth:`ShmTransport.prepare` publishes step 0 together with the descriptor. A 4 KiB
all-reduce of two ranks then waits on its peer once.

Large user arrays (8 MiB and up) that are not in shared memory are read by peers where they are, in the owner's
private memory, with ``process_vm_readv(2)`` (one kernel copy, as Open MPI's CMA path does): the owner publishes
the array's address instead of a segment, and a receiver reduces through a 1 MiB scratch piece (read a piece,
reduce it while it is in cache) or copies straight into its own buffer. No staging copy in or out. A probe at
start-up (every rank reads each peer's magic word) decides whether the kernel allows it; we never loosen ptrace
permissions for it, so under Yama ``ptrace_scope >= 1`` (or with ``cross_memory=False``) the ranks stage instead.

Smaller user arrays are staged, *lazily*: a compile pass over the plan tracks, for every
element range, whether its current value lives in the user array ``U`` or in ``W``; a range is copied into ``W``
only before it is sent, a received range is written into ``W`` only when it is sent again later (else straight
into ``U``), and only ranges whose final value is in ``W`` are copied out. Arrays from
:meth:`ShmTransport.allocate` (``group.empty()``) *are* ``W``: no copy at all.

Waiting spins briefly, then blocks in ``futex(2)`` on the counter (a shared mapping, so the futex works across
processes) with a short timeout, so that N ranks on fewer cores do not starve each other. While waiting, the
transport watches every peer's process (``pidfd``) and abort flag: a dead rank, a rank that gave up, or the
deadline end the wait with an error naming the culprit. Counters are aligned 8-byte stores, ordered by x86 TSO.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import errno
import mmap
import os
import platform
import re
import select
import struct
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, NoReturn

import numpy as np
import numpy.typing as npt

from allreduce.runtime._errors import (
    ChecksumError,
    CollectiveError,
    CollectiveTimeoutError,
    PeerFailureError,
)
from allreduce.runtime._plan import RankPlan
from allreduce.runtime._transport import ReduceInto

__all__ = ["ShmTransport", "shm_prefix", "sweep_stale_segments"]

_SHM_DIR = "/dev/shm"
_MAGIC = 0x414C4C5245445543  # "ALLREDUC"

# int64 slots of a rank's control segment
_S_MAGIC = 0
_S_PID = 1
_S_ATTACHED = 2
_S_PROGRESS = 3
_S_READ_DONE = 4
_S_ABORT_KIND = 5
_S_ABORT_CULPRIT = 6
_S_ABORT_SEQ = 7
_S_ABORT_STEP = 8
_S_BUF_SEG = 9
_S_BUF_OFFSET = 10
_S_CLOSED = 11
_S_PROBE_ADDR = 13  # where this control segment is mapped in its owner (peers probe cross-memory reads there)
_S_CROSS_OK = 14  # 1: this rank can read every peer's private memory (process_vm_readv)
_DESC_SLOT0 = 16  # two descriptor slots (seq parity): stamp, length, then _DESC_BYTES of payload
_DESC_BYTES = 240
_DESC_SLOT_WORDS = 2 + _DESC_BYTES // 8
_SLEEPERS0 = 128  # slot 128 + r: rank r is (about to be) blocked in futex on one of this rank's counters
_CRC_OFFSET_BYTES = 8 * (_SLEEPERS0 + 512)
_CRC_PER_PEER = 1024  # crc32 slots per (sender, receiver) pair and collective
_STEP_BITS = 24
_DONE_STEP = (1 << _STEP_BITS) - 1

_ABORT_DEAD = 1
_ABORT_TIMEOUT = 2
_ABORT_CHECKSUM = 3
_ABORT_OTHER = 4

_SEG_PRIVATE = -1  # _S_BUF_SEG: a private array of the owner at address _S_BUF_OFFSET (process_vm_readv)
_SEG_EAGER = -2  # _S_BUF_SEG: each step's sent data is a snapshot in the owner's control segment (small buffers)
_EAGER_BYTES = 256 << 10  # per sequence-number parity: a buffer is eager when (last step + 1) x its size fits
# Below this, staging is faster: process_vm_readv pins the peer's pages one by one, and only large numpy arrays
# are backed by huge pages (A/B in one run, N=2, 2 cores: 4 MiB 1.23 ms read in place vs 1.01 ms staged;
# 8 MiB 1.82 ms vs 2.31 ms; 64 MiB 17.5 ms vs 41 ms).
_CROSS_MEMORY_MIN_BYTES = 8 << 20
_CHUNK_BYTES = 1 << 20  # reduce a cross-memory receive through a scratch piece that stays in L2

_U = 0  # value lives in the user's array
_W = 1  # value lives in the shared working buffer
_BOTH = 2

_FUTEX_WAIT = 0
_FUTEX_WAKE = 1
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
_POLL_S = 0.001  # longest a waiter blocks before it re-checks deadline, dead peers and abort flags
_SPIN_S = 30e-6  # busy-wait first when every rank has a core: a handoff then costs well under a microsecond
_YIELD_S = 300e-6  # then give the core away between checks; then block in futex


class _Timespec(ctypes.Structure):
    _fields_ = (("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long))


def _load_futex() -> Any:
    if _SYS_FUTEX is None:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    fn.argtypes = (ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
    return fn


_futex_syscall = _load_futex()


def _futex_wait(addr: int, seen: int, timeout_s: float) -> None:
    """Block until the 32-bit word at ``addr`` may differ from the low half of ``seen`` (or timeout)."""
    if _futex_syscall is None:
        time.sleep(min(timeout_s, 50e-6))
        return
    low = seen & 0xFFFFFFFF
    if low >= 1 << 31:
        low -= 1 << 32
    ts = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
    _futex_syscall(_SYS_FUTEX, addr, _FUTEX_WAIT, low, ctypes.byref(ts), None)


def _futex_wake(addr: int) -> None:
    if _futex_syscall is not None:
        _futex_syscall(_SYS_FUTEX, addr, _FUTEX_WAKE, 0x7FFFFFFF, None, None)


class _IoVec(ctypes.Structure):
    _fields_ = (("base", ctypes.c_void_p), ("length", ctypes.c_size_t))


def _load_vm_readv() -> Any:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = (
        ctypes.c_int,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    )
    return fn


_vm_readv = _load_vm_readv()


def _read_remote(pid: int, address: int, out: npt.NDArray[Any]) -> int:
    """Copy ``out.nbytes`` bytes at ``address`` in process ``pid`` into ``out`` (contiguous); 0 or an errno."""
    nbytes = out.nbytes
    done = 0
    base = int(out.ctypes.data)
    while done < nbytes:
        local = _IoVec(base + done, nbytes - done)
        remote = _IoVec(address + done, nbytes - done)
        got = _vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got <= 0:
            return ctypes.get_errno() or 5  # EIO: a zero-length read of memory that should be there
        done += got
    return 0


def shm_prefix(job: str) -> str:
    """File-name prefix in /dev/shm of a job's segments (``job`` is shared by all ranks of one group)."""
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in job)
    return f"allreduce-{safe}"


def _pid_namespace() -> int:
    """Identity of this process's PID namespace (0 where /proc does not say), so that the stale-segment sweep
    never judges a file by a PID from another namespace sharing /dev/shm (containers with a shared IPC)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


_PIDNS = _pid_namespace()
# Data segments are named <prefix>-<rank>-<pid namespace>x<owner pid>-<segment id>: every peer can derive the
# name from the owner's PID (it knows it from the control segment), and a later sweep can tell a dead owner.
_DATA_NAME = re.compile(r"^allreduce-.+-\d+-(\d+)x(\d+)-\d+$")


def _data_segment_path(prefix: str, rank: int, pid: int, seg_id: int) -> str:
    return f"{prefix}-{rank}-{_PIDNS}x{pid}-{seg_id}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_segments(directory: str = _SHM_DIR) -> list[str]:
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
        if m is None or int(m[1]) != _PIDNS or _alive(int(m[2])):
            continue
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(directory, name))
            removed.append(name)
    return removed


# --------------------------------------------------------------------------------------------------------
# Compiling a plan into shared-memory operations
# --------------------------------------------------------------------------------------------------------
Wait = tuple[int, int]  # (reader rank, read_done step value it must reach)


@dataclass(frozen=True, slots=True)
class _Piece:
    """Part of a receive: elements [start, stop) read from the peer, combined with ``src`` (U or W), into ``dst``."""

    start: int
    stop: int
    src: int
    dst: int
    staged: bool
    waits: tuple[Wait, ...]


@dataclass(frozen=True, slots=True)
class _Recv:
    peer: int
    start: int
    stop: int
    reduce: bool
    crc_slot: int  # k-th transfer from peer to this rank in the plan
    pieces: tuple[_Piece, ...]


@dataclass(frozen=True, slots=True)
class _StepProgram:
    index: int
    copyin_waits: tuple[Wait, ...]
    copyins: tuple[tuple[int, int], ...]
    send_crcs: tuple[tuple[int, int, int, int], ...]  # (dst, slot, start, stop)
    recvs: tuple[_Recv, ...]


@dataclass(frozen=True, slots=True)
class _Program:
    steps: tuple[_StepProgram, ...]
    final_waits: tuple[Wait, ...]
    copyouts: tuple[tuple[int, int], ...]
    max_crc_slots: int


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


@lru_cache(maxsize=512)
def _compile(plan: RankPlan, in_shm: bool) -> _Program:
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

    loc = [_W if in_shm else _U] * n_int
    crc_next_send: dict[int, int] = {}
    crc_next_recv: dict[int, int] = {}
    max_slots = 0
    steps: list[_StepProgram] = []
    for step in plan.steps:
        # 1. copy into W every range sent this step whose current value is only in U
        copy_items: list[tuple[int, int, Any]] = []
        for t in sorted(step.sends, key=lambda t: t.start):
            for i in intervals(t.start, t.stop):
                if loc[i] == _U:
                    copy_items.append((cuts[i], cuts[i + 1], None))
                    loc[i] = _BOTH
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
                src = _W if loc[i] == _W else _U
                dst = _W if (in_shm or sent_again_after(i, step.index)) else _U
                staged = dst == _W and any(sa < b and a < sb for sa, sb in sent_now)
                items.append((a, b, (src, dst, staged)))
                loc[i] = dst
            pieces = []
            for a, b, (src, dst, staged) in _runs(items):
                waits = write_waits(a, b, step.index) if dst == _W else {}
                pieces.append(_Piece(a, b, src, dst, staged, _merge_waits(waits)))
            recvs.append(_Recv(t.peer, t.start, t.stop, t.reduce, slot, tuple(pieces)))
        steps.append(_StepProgram(step.index, _merge_waits(cw), copyins, tuple(send_crcs), tuple(recvs)))
    final: dict[int, int] = {}
    for s, reader, _, _ in sends_done:
        final[reader] = max(final.get(reader, 0), s + 1)
    copyouts: tuple[tuple[int, int], ...] = ()
    if not in_shm:
        copyouts = tuple(
            (a, b) for a, b, _ in _runs([(cuts[i], cuts[i + 1], None) for i in range(n_int) if loc[i] == _W])
        )
    return _Program(tuple(steps), _merge_waits(final), copyouts, max_slots)


# --------------------------------------------------------------------------------------------------------
# Segments
# --------------------------------------------------------------------------------------------------------
class _Segment:
    """A mapped /dev/shm file."""

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

    def close(self) -> None:
        del self.bytes
        # BufferError: a user still holds an array of this segment; the mapping lives until that array dies.
        with contextlib.suppress(BufferError):
            self.mm.close()

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


@dataclass(frozen=True, slots=True)
class _Remote:
    """A peer's private array, read with process_vm_readv: element i is at ``address + i * itemsize``."""

    peer: int
    pid: int
    address: int
    itemsize: int


class ShmTransport:
    """Shared-memory transport for ``world_size`` ranks of job ``job`` on one host (see the module docstring).

    Construction is collective: every rank creates its control segment and waits (up to ``timeout_s``) until
    all peers have created theirs, then the files are unlinked (nothing is left in /dev/shm if a rank dies later).
    """

    def __init__(
        self, rank: int, world_size: int, job: str, *, timeout_s: float = 300.0, cross_memory: bool = True
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a group of {world_size}")
        self.rank = rank
        self.world_size = world_size
        self._prefix = os.path.join(_SHM_DIR, shm_prefix(job))
        self._closed = False
        self._broken: CollectiveError | None = None
        self._next_segment_id = 1
        self._allocations: dict[int, _Segment] = {}
        self._staging: _Segment | None = None
        self._staging_id = 0
        self._peer_segments: list[OrderedDict[int, _Segment]] = [OrderedDict() for _ in range(world_size)]
        if world_size > 512:
            raise ValueError(f"the shared-memory transport supports up to 512 ranks on one host, got {world_size}")
        self._spin_s = _SPIN_S if world_size <= (os.cpu_count() or 1) else 0.0
        self._pidfds: list[int] = []
        self._corrupt_sends_to: int | None = None  # fault injection for tests (a corrupted link)
        self._want_cross_memory = cross_memory and _vm_readv is not None
        # Plain arrays are read by peers in place (process_vm_readv) when every rank can read every other;
        # else they are staged through a shared segment. Each rank may decide alone: a reader follows what the
        # owner of the data published (_S_BUF_SEG), so tests can flip this per rank.
        self._cross_memory = False
        self._cross_memory_min_bytes = _CROSS_MEMORY_MIN_BYTES  # tests set 0 to run small arrays this way
        self._peer_pids: list[int] = []
        self._scratch: npt.NDArray[np.uint8] | None = None
        self._eager_offset = -(-(_CRC_OFFSET_BYTES + 4 * world_size * _CRC_PER_PEER) // 4096) * 4096
        ctl_bytes = self._eager_offset + 2 * _EAGER_BYTES
        self._ctl_bytes = ctl_bytes
        self._agreed_seq = -1
        self._eager_bytes = _EAGER_BYTES  # tests set 0 to run small buffers through the other paths
        self._prepared_seq = -1
        sweep_stale_segments(os.path.dirname(self._prefix))
        own = _Segment(f"{self._prefix}-ctl-{rank}", ctl_bytes, create=True)
        self._ctl: list[_Segment | None] = [None] * world_size
        self._ctl[rank] = own
        self._views: list[memoryview] = []
        own_view = memoryview(own.mm).cast("q")
        own_view[_S_PID] = os.getpid()
        own_view[_S_PROBE_ADDR] = own.address
        own_view[_S_PROGRESS] = -1
        own_view[_S_READ_DONE] = -1
        own_view[_DESC_SLOT0] = -1
        own_view[_DESC_SLOT0 + _DESC_SLOT_WORDS] = -1
        own_view[_S_MAGIC] = _MAGIC
        try:
            self._attach_peers(timeout_s)
        except BaseException:
            own_view.release()
            self._release_all()
            raise
        self._views = [memoryview(s.mm).cast("q") for s in self._ctl_list()]
        self._sleepers = self._views[rank][_SLEEPERS0 : _SLEEPERS0 + world_size]
        own_view.release()
        self._addr = [s.address for s in self._ctl_list()]
        self._crc = [
            s.array(np.dtype(np.uint32), world_size * _CRC_PER_PEER, _CRC_OFFSET_BYTES) for s in self._ctl_list()
        ]

    def _ctl_list(self) -> list[_Segment]:
        out = []
        for s in self._ctl:
            assert s is not None
            out.append(s)
        return out

    # ----------------------------------------------------------------------------------------------------
    # Bootstrap
    # ----------------------------------------------------------------------------------------------------
    def _attach_peers(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        missing = [p for p in range(self.world_size) if p != self.rank]
        pause = 1e-4
        while missing:
            still = []
            for p in missing:
                try:
                    seg = _Segment(f"{self._prefix}-ctl-{p}", 0, create=False)
                except FileNotFoundError:
                    still.append(p)
                    continue
                if seg.size_bytes < self._ctl_bytes or struct.unpack_from("<q", seg.mm, 0)[0] != _MAGIC:
                    # created but not yet initialised: try again
                    seg.close()
                    still.append(p)
                    continue
                self._ctl[p] = seg
            missing = still
            if missing:
                if time.monotonic() > deadline:
                    raise CollectiveTimeoutError(
                        f"rank {self.rank}: shared-memory rendezvous timed out after {timeout_s:g} s waiting for "
                        f"rank(s) {', '.join(map(str, missing))} to join",
                        rank=self.rank,
                        peer=missing[0],
                    )
                time.sleep(pause)  # bootstrap only: peers are starting their interpreters
                pause = min(pause * 2, 0.01)
        for p in range(self.world_size):
            ctl = self._ctl[p]
            assert ctl is not None
            pid = struct.unpack_from("<q", ctl.mm, _S_PID * 8)[0]
            if p == self.rank:
                continue
            try:
                self._pidfds.append(os.pidfd_open(pid))
            except (OSError, AttributeError):
                self._pidfds.append(-1)
        self._peer_pids = [struct.unpack_from("<q", ctl.mm, _S_PID * 8)[0] for ctl in self._ctl_list()]
        own = self._ctl[self.rank]
        assert own is not None
        struct.pack_into("<q", own.mm, _S_CROSS_OK * 8, int(self._probe_cross_memory()))
        struct.pack_into("<q", own.mm, _S_ATTACHED * 8, 1)
        # Unlink our control file once every peer has mapped it, so a crash leaves nothing in /dev/shm.
        while True:
            pending = [
                p
                for p in range(self.world_size)
                if struct.unpack_from("<q", self._ctl[p].mm, _S_ATTACHED * 8)[0] != 1  # type: ignore[union-attr]
            ]
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
            pause = min(pause * 2, 0.01)
        self._cross_memory = all(struct.unpack_from("<q", ctl.mm, _S_CROSS_OK * 8)[0] == 1 for ctl in self._ctl_list())
        own.unlink()

    def _probe_cross_memory(self) -> bool:
        """Can this rank read every peer's private memory? (Read each peer's magic word where it mapped it.)"""
        if not self._want_cross_memory:
            return False
        probe = np.zeros(1, dtype=np.int64)
        for p, ctl in enumerate(self._ctl_list()):
            if p == self.rank:
                continue
            address = struct.unpack_from("<q", ctl.mm, _S_PROBE_ADDR * 8)[0]
            if _read_remote(self._peer_pids[p], address, probe) or int(probe[0]) != _MAGIC:
                return False
        return True

    # ----------------------------------------------------------------------------------------------------
    # Shared arrays
    # ----------------------------------------------------------------------------------------------------
    def allocate(self, size_bytes: int) -> npt.NDArray[np.uint8]:
        """A zero-filled byte array in shared memory that peers can read in place (``group.empty()``)."""
        self._check_usable()
        seg_id = self._next_segment_id
        self._next_segment_id += 1
        seg = _Segment(_data_segment_path(self._prefix, self.rank, os.getpid(), seg_id), size_bytes, create=True)
        self._allocations[seg_id] = seg
        return seg.bytes[:size_bytes]

    def _locate(self, buffer: npt.NDArray[Any]) -> tuple[int, int] | None:
        """(segment id, byte offset) when ``buffer`` lies in one of our allocations."""
        address = int(buffer.ctypes.data)
        end = address + buffer.nbytes
        for seg_id, seg in self._allocations.items():
            if seg.address <= address and end <= seg.address + seg.size_bytes:
                return seg_id, address - seg.address
        return None

    def _staging_for(self, size_bytes: int) -> tuple[int, _Segment]:
        if self._staging is None or self._staging.size_bytes < size_bytes:
            if self._staging is not None:
                self._staging.unlink()
                self._staging.close()
            seg_id = self._next_segment_id
            self._next_segment_id += 1
            # Round up so that a sweep of growing sizes does not recreate the segment every call.
            rounded = max(1 << 16, 1 << max(size_bytes - 1, 1).bit_length())
            self._staging = _Segment(
                _data_segment_path(self._prefix, self.rank, os.getpid(), seg_id), rounded, create=True
            )
            self._staging_id = seg_id
        return self._staging_id, self._staging

    def _peer_array(
        self, peer: int, dtype: np.dtype[Any], count: int, *, seq: int, step: int
    ) -> npt.NDArray[Any] | _Remote:
        view = self._views[peer]
        seg_id, offset = view[_S_BUF_SEG], view[_S_BUF_OFFSET]
        if seg_id == _SEG_PRIVATE:
            return _Remote(peer, self._peer_pids[peer], offset, dtype.itemsize)
        cache = self._peer_segments[peer]
        seg = cache.get(seg_id)
        if seg is None:
            try:
                seg = _Segment(_data_segment_path(self._prefix, peer, self._peer_pids[peer], seg_id), 0, create=False)
            except FileNotFoundError:
                # The peer has already given up and released its memory: report why it left.
                self._check_peers(peer, _S_CLOSED, 2, seq=seq, what="its data", step=step)
                self._fail(
                    PeerFailureError(
                        f"rank {self.rank}: rank {peer} released its shared memory during collective {seq}",
                        rank=self.rank,
                        peer=peer,
                        step=step,
                    ),
                    _ABORT_DEAD,
                    peer,
                    seq,
                    step,
                )
            cache[seg_id] = seg
            while len(cache) > 8:
                _, old = cache.popitem(last=False)
                old.close()
        else:
            cache.move_to_end(seg_id)
        return seg.array(dtype, count, offset)

    def _fetch(self, remote: _Remote, start: int, out: npt.NDArray[Any], *, seq: int, step: int) -> None:
        """Copy the peer's elements [start, start + out.size) into ``out``."""
        error = _read_remote(remote.pid, remote.address + start * remote.itemsize, out)
        if not error:
            return
        # The peer is gone or gave up (its memory went with it): name the root cause when there is one.
        self._check_peers(remote.peer, _S_CLOSED, 2, seq=seq, what="its data", step=step)
        self._fail(
            PeerFailureError(
                f"rank {self.rank}: cannot read rank {remote.peer}'s buffer during collective {seq} "
                f"(step {step}): {os.strerror(error)}",
                rank=self.rank,
                peer=remote.peer,
                step=step,
            ),
            _ABORT_DEAD if error == errno.ESRCH else _ABORT_OTHER,  # ESRCH: its memory is gone, it is exiting
            remote.peer,
            seq,
            step,
        )

    def _eager_area(self, rank: int, seq: int, dtype: np.dtype[Any]) -> npt.NDArray[Any]:
        """Rank ``rank``'s snapshot area for collective ``seq`` (two areas, alternating with seq's parity)."""
        ctl = self._ctl[rank]
        assert ctl is not None
        return ctl.array(dtype, _EAGER_BYTES // dtype.itemsize, self._eager_offset + (seq % 2) * _EAGER_BYTES)

    def _scratch_of(self, dtype: np.dtype[Any]) -> npt.NDArray[Any]:
        if self._scratch is None:
            self._scratch = np.empty(_CHUNK_BYTES, dtype=np.uint8)
        return self._scratch.view(dtype)

    # ----------------------------------------------------------------------------------------------------
    # Waiting
    # ----------------------------------------------------------------------------------------------------
    def _publish(self, slot: int, value: int) -> None:
        view = self._views[self.rank]
        view[slot] = value
        # A syscall only when someone sleeps: most handoffs are caught by the waiter's spin. A waiter that
        # registers just as we look may miss this wake; its futex timeout (_POLL_S) bounds the cost.
        if any(self._sleepers):
            _futex_wake(self._addr[self.rank] + 8 * slot)

    def _wait(self, peer: int, slot: int, target: int, *, deadline: float, seq: int, what: str, step: int) -> None:
        view = self._views[peer]
        if view[slot] >= target:
            return
        clock = time.perf_counter
        start = clock()
        spin_until = start + self._spin_s
        while clock() < spin_until:
            if view[slot] >= target:
                return
        yield_until = start + _YIELD_S
        while clock() < yield_until:
            os.sched_yield()
            if view[slot] >= target:
                return
        addr = self._addr[peer] + 8 * slot
        sleeper = _SLEEPERS0 + self.rank
        while True:
            seen = view[slot]
            if seen >= target:
                return
            self._check_peers(peer, slot, target, seq=seq, what=what, step=step)
            now = time.monotonic()
            if now >= deadline:
                if view[slot] >= target:
                    return
                where = f"step {step}" if step >= 0 else "the descriptor exchange"
                self._fail(
                    CollectiveTimeoutError(
                        f"rank {self.rank}: collective {seq} timed out at {where} waiting for rank {peer} ({what})",
                        rank=self.rank,
                        peer=peer,
                        step=step if step >= 0 else None,
                    ),
                    _ABORT_TIMEOUT,
                    peer,
                    seq,
                    step,
                )
            view[sleeper] = 1
            if view[slot] == seen:
                _futex_wait(addr, seen, min(_POLL_S, deadline - now))
            view[sleeper] = 0

    def _check_peers(self, peer: int, slot: int, target: int, *, seq: int, what: str, step: int) -> None:
        """Raise if a peer died, closed, or gave up (after re-checking the awaited condition)."""
        dead: list[int] = []
        if self._pidfds:
            fds = [fd for fd in self._pidfds if fd >= 0]
            if fds:
                readable, _, _ = select.select(fds, [], [], 0)
                if readable:
                    others = [p for p in range(self.world_size) if p != self.rank]
                    dead = [p for p, fd in zip(others, self._pidfds, strict=True) if fd in readable]
        views = self._views
        # A rank that gave up set its abort flag before exiting; a rank that closed set its closed flag. Only a
        # process that exited with neither died unannounced: that is the root cause to name.
        died = [p for p in dead if not views[p][_S_ABORT_KIND] and not views[p][_S_CLOSED]]
        aborted = [p for p in range(self.world_size) if p != self.rank and views[p][_S_ABORT_KIND]]
        # A peer that closed after doing its part is fine unless we still wait on it.
        if peer != self.rank and not views[peer][_S_ABORT_KIND] and (views[peer][_S_CLOSED] or peer in dead):
            aborted.append(peer)
        if not died and not aborted:
            return
        if views[peer][slot] >= target:
            return  # the peer did its part before it went away
        where = f"step {step}" if step >= 0 else "the descriptor exchange"
        if died:
            culprit = died[0]
            self._unlink_dead(died)
            self._fail(
                PeerFailureError(
                    f"rank {self.rank}: rank {culprit} died (process exited) during collective {seq}; "
                    f"this rank was at {where} waiting for rank {peer} ({what})",
                    rank=self.rank,
                    peer=culprit,
                    step=step if step >= 0 else None,
                ),
                _ABORT_DEAD,
                culprit,
                seq,
                step,
            )
        p = aborted[0]
        v = self._views[p]
        kind, culprit = v[_S_ABORT_KIND], v[_S_ABORT_CULPRIT]
        if not kind:
            self._fail(
                PeerFailureError(
                    f"rank {self.rank}: rank {p} closed the group while this rank was at {where} of collective "
                    f"{seq} waiting for rank {peer} ({what})",
                    rank=self.rank,
                    peer=p,
                    step=step if step >= 0 else None,
                ),
                _ABORT_DEAD,
                p,
                seq,
                step,
            )
        reason = {
            _ABORT_DEAD: f"rank {culprit} died",
            _ABORT_TIMEOUT: f"it timed out waiting for rank {culprit}",
            _ABORT_CHECKSUM: f"data from rank {culprit} failed its checksum",
        }.get(kind, "it failed")
        error_type: type[CollectiveError] = {
            _ABORT_DEAD: PeerFailureError,
            _ABORT_TIMEOUT: CollectiveTimeoutError,
            _ABORT_CHECKSUM: ChecksumError,
        }.get(kind, CollectiveError)
        self._fail(
            error_type(
                f"rank {self.rank}: collective {seq} aborted at {where}: rank {p} gave up because {reason}",
                rank=self.rank,
                peer=culprit if kind == _ABORT_DEAD else p,
                step=step if step >= 0 else None,
            ),
            kind,
            culprit if kind == _ABORT_DEAD else p,
            seq,
            step,
        )

    def _unlink_dead(self, ranks: list[int]) -> None:
        """Remove the /dev/shm files of ranks that died without close() (nobody else will)."""
        directory, stem = os.path.split(self._prefix)
        for name in os.listdir(directory):
            if any(name.startswith(f"{stem}-{r}-") for r in ranks):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(directory, name))

    def _fail(self, error: CollectiveError, kind: int, culprit: int, seq: int, step: int) -> NoReturn:
        """Mark this rank aborted (peers waiting on us stop at once), then raise ``error``."""
        self._broken = error
        view = self._views[self.rank]
        view[_S_ABORT_CULPRIT] = culprit
        view[_S_ABORT_SEQ] = seq
        view[_S_ABORT_STEP] = step
        self._publish(_S_ABORT_KIND, kind)
        for slot in (_S_PROGRESS, _S_READ_DONE, _DESC_SLOT0, _DESC_SLOT0 + _DESC_SLOT_WORDS):
            _futex_wake(self._addr[self.rank] + 8 * slot)
        raise error

    def _check_usable(self) -> None:
        if self._closed:
            raise CollectiveError(f"rank {self.rank}: the shared-memory transport is closed", rank=self.rank)
        if self._broken is not None:
            raise CollectiveError(
                f"rank {self.rank}: the group is unusable after an earlier failure: {self._broken}", rank=self.rank
            )

    # ----------------------------------------------------------------------------------------------------
    # Transport protocol
    # ----------------------------------------------------------------------------------------------------
    def prepare(self, seq: int, buffer: npt.NDArray[Any], *, checksum: bool) -> None:
        """Before ``agree(seq)``: publish a small ``buffer``'s step-0 state, so that the descriptor exchange and
        the first step's data cost one handoff, not two.

        The whole buffer goes into snapshot slot 0 (it is the step-0 state whatever plan the ranks agree on)
        and "at step 0" is published with it. Peers read it only after they have compared the descriptors,
        so a mismatch still moves no data. Safe to overwrite the area because agree(seq - 1) proved every peer
        finished reading collective seq - 2; limited to sizes whose every possible plan fits the area.
        """
        if (
            checksum
            or self._agreed_seq != seq - 1
            or buffer.nbytes * _eager_steps(self.world_size) > self._eager_bytes
            or buffer.ndim != 1
            or not buffer.flags.c_contiguous
            or not buffer.size
        ):
            return
        self._check_usable()
        area = self._eager_area(self.rank, seq, buffer.dtype)
        area[: buffer.size] = buffer
        me = self._views[self.rank]
        me[_S_BUF_SEG] = _SEG_EAGER
        me[_S_BUF_OFFSET] = 0
        self._prepared_seq = seq
        self._publish(_S_PROGRESS, seq << _STEP_BITS)

    def agree(self, seq: int, descriptor: bytes, *, timeout_s: float) -> list[bytes]:
        self._check_usable()
        if len(descriptor) > _DESC_BYTES:
            raise ValueError(f"descriptor of {len(descriptor)} bytes exceeds {_DESC_BYTES}")
        deadline = time.monotonic() + timeout_s
        slot = _DESC_SLOT0 + (seq % 2) * _DESC_SLOT_WORDS
        own = self._ctl[self.rank]
        assert own is not None
        own.mm[(slot + 2) * 8 : (slot + 2) * 8 + len(descriptor)] = descriptor
        self._views[self.rank][slot + 1] = len(descriptor)
        self._publish(slot, seq)
        self._agreed_seq = -1
        out: list[bytes] = []
        for p in range(self.world_size):
            if p != self.rank:
                self._wait(p, slot, seq, deadline=deadline, seq=seq, what="its call of this collective", step=-1)
            length = self._views[p][slot + 1]
            seg = self._ctl[p]
            assert seg is not None
            out.append(bytes(seg.mm[(slot + 2) * 8 : (slot + 2) * 8 + length]))
        # Every peer has entered collective seq, so it has finished reading our data of seq - 1 and earlier:
        # execute(seq) may reuse the eager snapshot area of seq - 2 without waiting.
        self._agreed_seq = seq
        return out

    def execute(
        self,
        plan: RankPlan,
        buffer: npt.NDArray[Any],
        reduce_into: ReduceInto,
        *,
        seq: int,
        timeout_s: float,
        checksum: bool,
    ) -> None:
        self._check_usable()
        plan.check_fits(self.rank, self.world_size, buffer)
        if not plan.steps:
            return
        deadline = time.monotonic() + timeout_s
        located = self._locate(buffer)
        dtype = buffer.dtype
        user = buffer
        last_step = plan.steps[-1].index
        # Small buffers go eager: each step's sent ranges are copied into a snapshot that peers read, so this
        # rank writes its buffer without waiting for readers (two handoffs per call fewer). Only right after
        # agree(seq), which proves every peer is done with the snapshot area of the same parity.
        prepared = self._prepared_seq == seq
        fits = (last_step + 1) * buffer.nbytes <= self._eager_bytes
        if prepared and not fits:
            raise CollectiveError(
                f"rank {self.rank}: plan {plan.schedule_name} has {last_step + 1} steps, more than prepare() allows "
                f"for {self.world_size} ranks ({_eager_steps(self.world_size)}); raise _eager_steps",
                rank=self.rank,
            )
        eager = not checksum and self._agreed_seq == seq and fits
        if eager:
            seg_id, offset = _SEG_EAGER, 0
            work = buffer
        elif located is not None:
            seg_id, offset = located
            work = buffer
        elif self._cross_memory and buffer.nbytes >= self._cross_memory_min_bytes:
            # Peers read the user's array where it is: no staging copy in, none out.
            seg_id, offset = _SEG_PRIVATE, int(buffer.ctypes.data)
            work = buffer
        else:
            seg_id, staging = self._staging_for(buffer.nbytes)
            offset = 0
            work = staging.array(dtype, plan.count)
        program = _compile(plan, work is buffer)
        if checksum and program.max_crc_slots > _CRC_PER_PEER:
            raise ValueError(
                f"checksum=True supports up to {_CRC_PER_PEER} transfers per peer per collective; this plan has "
                f"{program.max_crc_slots} (use fewer segments)"
            )
        ufunc = getattr(reduce_into, "ufunc", None)
        arrays = (user, work)
        me = self._views[self.rank]
        me[_S_BUF_SEG] = seg_id
        me[_S_BUF_OFFSET] = offset
        base = seq << _STEP_BITS
        peer_arrays: dict[int, npt.NDArray[Any] | _Remote] = {}
        my_crc = self._crc[self.rank]
        wait = self._wait
        snapshot = self._eager_area(self.rank, seq, dtype) if eager else work
        try:
            for st in program.steps:
                for reader, value in st.copyin_waits:
                    wait(reader, _S_READ_DONE, base + value, deadline=deadline, seq=seq,
                         what="reading an earlier step", step=st.index)  # fmt: skip
                for a, b in st.copyins:
                    work[a:b] = user[a:b]
                if checksum:
                    for dst, slot, a, b in st.send_crcs:
                        my_crc[dst * _CRC_PER_PEER + slot] = zlib.crc32(work[a:b].view(np.uint8).data)
                        if self._corrupt_sends_to == dst:
                            work.view(np.uint8)[a * dtype.itemsize] ^= 0xFF
                if eager and not (prepared and st.index == 0):
                    at = st.index * plan.count
                    for _, _, a, b in st.send_crcs:
                        snapshot[at + a : at + b] = work[a:b]
                self._publish(_S_PROGRESS, base + st.index)
                staged: list[tuple[_Piece, npt.NDArray[Any]]] = []
                for rv in st.recvs:
                    peer = rv.peer
                    wait(peer, _S_PROGRESS, base + st.index, deadline=deadline, seq=seq,
                         what="its data for this step", step=st.index)  # fmt: skip
                    local: npt.NDArray[Any] | _Remote
                    if self._views[peer][_S_BUF_SEG] == _SEG_EAGER:
                        local, shift = self._eager_area(peer, seq, dtype), -st.index * plan.count
                    else:
                        theirs = peer_arrays.get(peer)
                        if theirs is None:
                            theirs = self._peer_array(peer, dtype, plan.count, seq=seq, step=st.index)
                            peer_arrays[peer] = theirs
                        local, shift = theirs, 0
                    if checksum and isinstance(local, _Remote):
                        remote, local, shift = local, np.empty(rv.stop - rv.start, dtype), rv.start
                        self._fetch(remote, rv.start, local, seq=seq, step=st.index)
                    if checksum:
                        assert not isinstance(local, _Remote)
                        expected = int(self._crc[peer][self.rank * _CRC_PER_PEER + rv.crc_slot])
                        got = zlib.crc32(local[rv.start - shift : rv.stop - shift].view(np.uint8).data)
                        if got != expected:
                            self._fail(
                                ChecksumError(
                                    f"rank {self.rank}: checksum mismatch on link rank {peer} -> rank {self.rank} "
                                    f"(collective {seq}, step {st.index}, elements [{rv.start}, {rv.stop}): "
                                    f"crc32 {got:#010x}, sender computed {expected:#010x})",
                                    rank=self.rank,
                                    peer=peer,
                                    step=st.index,
                                ),
                                _ABORT_CHECKSUM,
                                peer,
                                seq,
                                st.index,
                            )
                    for pc in rv.pieces:
                        a, b = pc.start, pc.stop
                        if pc.staged and not eager:
                            if isinstance(local, _Remote):
                                tmp = np.empty(b - a, dtype)
                                self._fetch(local, a, tmp, seq=seq, step=st.index)
                                if rv.reduce:
                                    tmp = _reduced(ufunc, reduce_into, arrays[pc.src][a:b], tmp)
                            elif rv.reduce:
                                tmp = np.empty(b - a, dtype)
                                _apply(ufunc, reduce_into, arrays[pc.src][a:b], local[a - shift : b - shift], tmp,
                                       in_place=False)  # fmt: skip
                            else:
                                tmp = local[a - shift : b - shift].copy()
                            staged.append((pc, tmp))
                            continue
                        for reader, value in () if eager else pc.waits:
                            wait(reader, _S_READ_DONE, base + value, deadline=deadline, seq=seq,
                                 what="reading data this step overwrites", step=st.index)  # fmt: skip
                        out = arrays[pc.dst][a:b]
                        if not isinstance(local, _Remote):
                            incoming = local[a - shift : b - shift]
                            if rv.reduce:
                                _apply(
                                    ufunc, reduce_into, arrays[pc.src][a:b], incoming, out, in_place=pc.src == pc.dst
                                )
                            else:
                                out[...] = incoming
                        elif not rv.reduce:
                            self._fetch(local, a, out, seq=seq, step=st.index)
                        else:
                            # Read a cache-sized piece, reduce it, next: the peer's data crosses memory once.
                            scratch = self._scratch_of(dtype)
                            mine = arrays[pc.src]
                            for c in range(a, b, scratch.size):
                                d = min(c + scratch.size, b)
                                piece = scratch[: d - c]
                                self._fetch(local, c, piece, seq=seq, step=st.index)
                                _apply(
                                    ufunc, reduce_into, mine[c:d], piece, out[c - a : d - a], in_place=pc.src == pc.dst
                                )
                self._publish(_S_READ_DONE, base + st.index + 1)
                for pc, tmp in staged:
                    for reader, value in pc.waits:
                        wait(reader, _S_READ_DONE, base + value, deadline=deadline, seq=seq,
                             what="reading data this step overwrites", step=st.index)  # fmt: skip
                    arrays[pc.dst][pc.start : pc.stop] = tmp
            for reader, value in () if eager else program.final_waits:
                wait(reader, _S_READ_DONE, base + value, deadline=deadline, seq=seq,
                     what="reading this rank's data", step=program.steps[-1].index)  # fmt: skip
            for a, b in program.copyouts:
                user[a:b] = work[a:b]
            self._publish(_S_PROGRESS, base + _DONE_STEP)
        finally:
            peer_arrays.clear()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._views:
            self._publish(_S_CLOSED, 1)
        self._release_all()

    def _release_all(self) -> None:
        sleepers = getattr(self, "_sleepers", None)
        if sleepers is not None:
            sleepers.release()
        for view in self._views:
            view.release()
        self._views = []
        self._crc = []
        for fd in self._pidfds:
            if fd >= 0:
                os.close(fd)
        self._pidfds = []
        for cache in self._peer_segments:
            for seg in cache.values():
                seg.close()
            cache.clear()
        for seg in self._allocations.values():
            seg.unlink()
            seg.close()
        self._allocations.clear()
        if self._staging is not None:
            self._staging.unlink()
            self._staging.close()
            self._staging = None
        for i, ctl in enumerate(self._ctl):
            if ctl is not None:
                if i == self.rank:
                    ctl.unlink()
                ctl.close()
        self._ctl = [None] * self.world_size

    def __del__(self) -> None:
        # Files in /dev/shm outlive the process: never leave ours behind, even without close().
        if not getattr(self, "_closed", True):
            for seg in (*getattr(self, "_allocations", {}).values(), getattr(self, "_staging", None)):
                if seg is not None:
                    seg.unlink()


def _eager_steps(world_size: int) -> int:
    """An upper bound on the steps of any schedule for ``world_size`` ranks (ring: 2(N-1); trees fewer)."""
    return 2 * world_size + 8


def _reduced(ufunc: Any, reduce_into: ReduceInto, mine: npt.NDArray[Any], incoming: npt.NDArray[Any]) -> Any:
    """op(mine, incoming) in a new array (``incoming`` is a private copy and may be reused as the result)."""
    if ufunc is not None:
        ufunc(mine, incoming, out=incoming)
        return incoming
    out = mine.copy()
    reduce_into(out, incoming)
    return out


def _apply(
    ufunc: Any,
    reduce_into: ReduceInto,
    mine: npt.NDArray[Any],
    incoming: npt.NDArray[Any],
    dst: npt.NDArray[Any],
    *,
    in_place: bool,
) -> None:
    """dst = op(mine, incoming), in one pass when the reducer exposes its ufunc."""
    if ufunc is not None:
        ufunc(mine, incoming, out=dst)
        return
    if not in_place:
        dst[...] = mine
    reduce_into(dst, incoming)
