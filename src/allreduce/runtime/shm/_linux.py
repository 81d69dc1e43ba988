"""Linux primitives of the shared-memory transport: futex wait/wake, ``process_vm_readv``, Yama's
``PR_SET_PTRACER``, pidfd, PID namespace.

Each is loaded once through ``ctypes`` (or ``os``) and degrades to something slower but correct where the kernel
or the C library lacks it: no futex → a short sleep; no ``process_vm_readv`` → :data:`CROSS_MEMORY_SUPPORTED` is
false and the transport stages; no pidfd → a dead peer is found by its abort flag or the deadline.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform
import select
import time
from typing import Any

import numpy.typing as npt

__all__ = [
    "CROSS_MEMORY_SUPPORTED",
    "FUTEX_SUPPORTED",
    "HUGE_PAGE_BYTES",
    "PID_NAMESPACE",
    "TRANSPARENT_HUGEPAGES",
    "alive",
    "close_pidfds",
    "collapse_to_huge_pages",
    "exited",
    "futex_wait",
    "futex_wake",
    "libc_function",
    "open_pidfd",
    "read_remote",
    "set_ptracer",
    "yama_ptrace_scope",
]

_FUTEX_WAIT = 0
_FUTEX_WAKE = 1
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
_WAKE_EVERY_WAITER = 0x7FFFFFFF  # futex(2): the number of waiters FUTEX_WAKE wakes at most
_NO_FUTEX_SLEEP_S = 50e-6  # without futex, a waiter sleeps this long between checks (bounded by its timeout)


class _Timespec(ctypes.Structure):
    _fields_ = (("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long))


def libc_function(name: str, restype: Any, *argtypes: Any) -> Any:
    """The C library's function ``name`` with its signature set (errno kept), or None where it has none."""
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.restype = restype
    fn.argtypes = argtypes
    return fn


def _load_futex() -> Any:
    if _SYS_FUTEX is None:
        return None
    args = (ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
    return libc_function("syscall", ctypes.c_long, *args)


_futex_syscall = _load_futex()
FUTEX_SUPPORTED = _futex_syscall is not None
"""Whether waiters block in ``futex(2)`` (else they sleep briefly between checks)."""


def futex_wait(address: int, seen: int, timeout_s: float) -> None:
    """Block until the 32-bit word at ``address`` may differ from the low half of ``seen`` (or ``timeout_s``)."""
    if _futex_syscall is None:
        time.sleep(min(timeout_s, _NO_FUTEX_SLEEP_S))
        return
    low = seen & 0xFFFFFFFF
    if low >= 1 << 31:
        low -= 1 << 32
    ts = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
    _futex_syscall(_SYS_FUTEX, address, _FUTEX_WAIT, low, ctypes.byref(ts), None)


def futex_wake(address: int) -> None:
    """Wake every process blocked in :func:`futex_wait` on ``address``."""
    if _futex_syscall is not None:
        _futex_syscall(_SYS_FUTEX, address, _FUTEX_WAKE, _WAKE_EVERY_WAITER, None, None)


class _IoVec(ctypes.Structure):
    _fields_ = (("base", ctypes.c_void_p), ("length", ctypes.c_size_t))


def _load_vm_readv() -> Any:
    iov = ctypes.POINTER(_IoVec)
    args = (ctypes.c_int, iov, ctypes.c_ulong, iov, ctypes.c_ulong, ctypes.c_ulong)
    return libc_function("process_vm_readv", ctypes.c_ssize_t, *args)


_vm_readv = _load_vm_readv()
CROSS_MEMORY_SUPPORTED = _vm_readv is not None
"""Whether the C library has ``process_vm_readv(2)`` (the kernel may still refuse it: the transport probes)."""


def read_remote(pid: int, address: int, out: npt.NDArray[Any]) -> int:
    """Copy ``out.nbytes`` bytes at ``address`` in process ``pid`` into ``out`` (contiguous); 0 or an errno."""
    if _vm_readv is None:
        return errno.ENOSYS
    nbytes = out.nbytes
    done = 0
    base = int(out.ctypes.data)
    while done < nbytes:
        local = _IoVec(base + done, nbytes - done)
        remote = _IoVec(address + done, nbytes - done)
        got = _vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got <= 0:
            return ctypes.get_errno() or errno.EIO  # a zero-length read of memory that should be there
        done += got
    return 0


PR_SET_PTRACER = 0x59616D61
"""prctl(2) option of the Yama LSM: name the one process (with its descendants) that may ptrace this one - and so
read its memory with ``process_vm_readv`` under ``ptrace_scope = 1``. 0 clears it. (``PR_SET_PTRACER_ANY``, which
would let every process of the user in, is never used.)"""


def _load_prctl() -> Any:
    return libc_function("prctl", ctypes.c_int, ctypes.c_int, *(ctypes.c_ulong,) * 4)


_prctl = _load_prctl()


def set_ptracer(pid: int) -> int:
    """Let process ``pid`` (only it and its descendants; 0: nobody) read this process's memory under Yama
    ``ptrace_scope = 1``; 0 or an errno (EINVAL where the kernel has no Yama: nothing to lift then)."""
    if _prctl is None:
        return errno.ENOSYS
    if _prctl(PR_SET_PTRACER, pid, 0, 0, 0) == 0:
        return 0
    return ctypes.get_errno() or errno.EINVAL


def yama_ptrace_scope() -> int | None:
    """Yama's ``ptrace_scope`` (0 classic, 1 restricted to descendants and declared tracers, 2 admin only,
    3 none), or None where the kernel has no Yama."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope", encoding="ascii") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def open_pidfd(pid: int) -> int:
    """A file descriptor that becomes readable when process ``pid`` exits, or -1 where pidfds are missing."""
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return -1


def exited(pidfds: list[int]) -> set[int]:
    """The descriptors among ``pidfds`` (from :func:`open_pidfd`; -1 skipped) whose process has exited."""
    fds = [fd for fd in pidfds if fd >= 0]
    if not fds:
        return set()
    # poll, not select: select.select refuses descriptors numbered 1024 or more (FD_SETSIZE), which a process
    # with many open files or many groups reaches. A pidfd reports POLLIN once its process has exited.
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return {fd for fd, events in poller.poll(0) if events & (select.POLLIN | select.POLLHUP)}


def close_pidfds(pidfds: list[int]) -> None:
    for fd in pidfds:
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (in this PID namespace); a process we may not signal counts as alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _pid_namespace() -> int:
    """Identity of this process's PID namespace (0 where /proc does not say), so that the stale-segment sweep
    never judges a file by a PID from another namespace sharing /dev/shm (containers with a shared IPC)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


PID_NAMESPACE = _pid_namespace()
"""This process's PID namespace (see :func:`_pid_namespace`)."""


def _transparent_hugepages() -> str:
    """The kernel's transparent huge page mode: ``always``, ``madvise`` (only regions that ask, as numpy's large
    arrays do), ``never``, or ``never`` where the file is missing."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled", encoding="ascii") as f:
            text = f.read()
    except OSError:
        return "never"
    start, stop = text.find("["), text.find("]")
    return text[start + 1 : stop] if 0 <= start < stop else "never"


TRANSPARENT_HUGEPAGES = _transparent_hugepages()
"""This kernel's transparent huge page mode (see :func:`_transparent_hugepages`)."""


def _huge_page_bytes() -> int:
    """The size of a transparent huge page (a PMD mapping): 2 MiB on x86-64, read from sysfs where it says."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size", encoding="ascii") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 2 << 20


HUGE_PAGE_BYTES = _huge_page_bytes()
"""The size of one transparent huge page on this kernel."""

_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25  # Linux 6.1: collapse the range into huge pages now, synchronously, keeping its contents


def _load_madvise() -> Any:
    return libc_function("madvise", ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


_madvise = _load_madvise()


def collapse_to_huge_pages(address: int, nbytes: int) -> tuple[int, int]:
    """Back the whole huge pages inside ``[address, address + nbytes)`` with huge pages now (``MADV_HUGEPAGE``,
    then ``MADV_COLLAPSE``: the kernel copies the range's 4 KiB pages into 2 MiB ones; contents are unchanged).

    Returns ``(bytes collapsed, errno)``: ``(interior bytes, 0)`` on success, ``(0, errno)`` where the kernel or
    the C library refuses (EINVAL before Linux 6.1, EAGAIN or ENOMEM when no huge page could be had). Only whole
    huge pages inside the range are touched, so memory outside it (another allocation's) never changes mapping."""
    start = -(-address // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    stop = (address + nbytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if stop <= start:
        return 0, errno.EINVAL
    if _madvise is None:
        return 0, errno.ENOSYS
    for advice in (_MADV_HUGEPAGE, _MADV_COLLAPSE):
        if _madvise(start, stop - start, advice) != 0:
            return 0, ctypes.get_errno() or errno.EINVAL
    return stop - start, 0
