"""How :func:`~allreduce.runtime.spawn` starts a rank: as a fork of a warm server, or as a fresh interpreter.

A fresh interpreter (multiprocessing's ``"spawn"``) imports numpy and allreduce again in every rank: 0.35 CPU-s
each, most of what a short job costs. With ``"forkserver"`` (the default) the caller starts, once, a server
process that imports them (:data:`PRELOAD`), and each rank is a fork of it. ``ALLREDUCE_START_METHOD=spawn`` (in
the caller's environment or a call's ``env``) keeps the fresh interpreter. A forked rank must not differ from a
spawned one, so :func:`enter_forked_rank`, the first thing it runs after asking to die with its parent:

- closes its copy of the server's *alive* pipe (multiprocessing gives each fork one): the server exits when the
  caller's copy closes, i.e. when the caller dies, however it dies, and its ranks with it (``PR_SET_PDEATHSIG``);
- takes the caller's standard output and error as they are now (the server's are those of the caller when the
  server started: a later redirection, pytest's capture, would miss the rank's output);
- takes the caller's environment as it is now (the server's is the caller's at its start), before it unpickles
  the rank's function, so that modules it imports see what they would in a spawned rank; then the rank's own;
- sets numpy's BLAS thread count to what a spawned rank's numpy reads from that environment when it loads OpenBLAS
  (``OPENBLAS_NUM_THREADS``, ``GOTO_NUM_THREADS``, ``OMP_NUM_THREADS``, read once: here, in the server); a spawned
  rank loads numpy before it applies its own variables, so ``OMP_NUM_THREADS`` from spawn() does not reach it;
- reseeds numpy's global random generator, if the server imported it (a fork shares its parent's state);
- and when it is done, waits for its threads and runs its ``atexit`` functions, as an interpreter's exit does
  (multiprocessing ends a fork with ``os._exit``). Objects still referenced when it exits are not finalized: a
  group left open does not unlink its files in ``/dev/shm`` from ``__del__``; spawn() sweeps them after the job.

The server is started in its own process group (a signal to the caller's group, a closed terminal's SIGHUP, must
reach the ranks only through the caller, which forwards SIGTERM and waits the grace period). ``"spawn"`` is used
instead when the fork server cannot be made to match: numpy's BLAS is not an OpenBLAS whose thread count can be set
at run time, multiprocessing lacks the pieces relied on here, or the server imported allreduce from another place
than the caller did (a relative ``PYTHONPATH`` and a changed directory: it is checked once per server).

Torch is not preloaded: importing it costs 1.3-1.6 CPU-s that ranks without torch would pay in every server, and
what torch reads when imported must come from the rank's environment; ranks that use torch import it themselves, as
spawned ones do. Nothing here is read from a network: the server's socket is a Unix socket in a private directory
(mode 0600), and what a rank unpickles comes from the caller through a pipe.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import multiprocessing as mp
import multiprocessing.forkserver as mp_forkserver
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable, Mapping
from multiprocessing import reduction
from types import FrameType
from typing import Any

__all__ = [
    "PRELOAD",
    "START_METHODS",
    "START_METHOD_ENV",
    "InheritedFd",
    "PickledLater",
    "blas_threads",
    "blas_threads_now",
    "caller_stdio",
    "enter_forked_rank",
    "exit_as_an_interpreter_does",
    "fork_server_cpu_s",
    "fork_server_pid",
    "start_method",
]

START_METHOD_ENV = "ALLREDUCE_START_METHOD"
"""``forkserver`` (default) or ``spawn``: how spawn() starts ranks (read from the caller's environment and ``env``)."""
START_METHODS = ("forkserver", "spawn")

PRELOAD = (
    "numpy",
    "allreduce.runtime.launcher._spawn",
    "allreduce.runtime.group._bootstrap",
    "allreduce.runtime.shm",
    "allreduce.runtime.store._store_server",
    "encodings.idna",
    __name__,  # last: it makes the server a process group of its own (see _in_fork_server)
)
"""What the server imports once: what a rank of a group imports (measured: the modules a 2-rank shm and tcp job
had in ``sys.modules`` beyond ``import allreduce``)."""

_BLAS_ENV = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")
"""What OpenBLAS reads for its thread count, the first set and positive wins, at most the cores (OpenBLAS
``driver/others/openblas_env.c`` and ``blas_get_cpu_number`` in ``init.c``)."""

_lock = threading.Lock()
_checked_servers: dict[int, bool] = {}  # server pid -> whether it imported allreduce from where the caller did


def start_method(environ: Mapping[str, str]) -> str:
    """The start method for ranks whose environment is ``environ``: ``forkserver`` when asked and usable."""
    asked = environ.get(START_METHOD_ENV) or "forkserver"
    if asked not in START_METHODS:
        raise ValueError(f"{START_METHOD_ENV} must be one of {', '.join(START_METHODS)}, got {asked!r}")
    if asked == "spawn" or not _forkserver_supported():
        return "spawn"
    return "forkserver" if _server_matches() else "spawn"


@functools.cache
def _forkserver_supported() -> bool:
    return (
        "forkserver" in mp.get_all_start_methods()
        and hasattr(os, "pidfd_open")
        and hasattr(mp_forkserver, "_forkserver")
        and hasattr(_server(), "_forkserver_alive_fd")
        and hasattr(_server(), "_forkserver_pid")
        and _blas_function("set_num_threads") is not None
    )


def fork_server_pid() -> int:
    """Start the server if it is not running (as the caller is now: its environment, directory, descriptors)
    and return its process id, the parent of every rank forked from it. The caller reaps it at its exit
    (:func:`_reap_server`)."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))
    mp_forkserver.ensure_running()
    pid = _server()._forkserver_pid
    assert isinstance(pid, int)
    _reap_at_exit()
    return pid


@functools.cache
def _reap_at_exit() -> None:
    atexit.register(_reap_server)  # once per process


_REAP_WAIT_S = 5.0
"""How long the caller's exit waits for its server to exit once told (it exits at once: it only serves forks)."""


def _reap_server() -> None:
    """At the caller's exit: close its end of the alive pipe, which ends the server, and reap the server (waiting
    at most :data:`_REAP_WAIT_S`). The server has reaped the ranks forked from it, so their CPU time, in the
    server's children's, reaches the caller's own ``RUSAGE_CHILDREN`` as a spawned rank's does (a test runner
    counting a command's CPU sees its ranks'), and no exited server is left for init to reap. Ranks still running
    die with the server, as they would when the caller's exit closed the pipe anyway."""
    server = _server()
    pid, alive = server._forkserver_pid, server._forkserver_alive_fd
    if pid is None or alive is None:
        return
    with contextlib.suppress(OSError):
        os.close(alive)
    server._forkserver_alive_fd = None
    deadline = time.monotonic() + _REAP_WAIT_S
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(pid, os.WNOHANG)[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
    server._forkserver_pid = None


def fork_server_cpu_s() -> float:
    """CPU seconds (user and system) of the running server and of the ranks it has reaped; 0 when none runs (a
    server the caller reaped counts in the caller's ``RUSAGE_CHILDREN`` instead). From ``/proc/PID/stat``'s
    utime, stime, cutime and cstime (proc(5)), in clock ticks."""
    pid = _server()._forkserver_pid
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    # after the name: state is field 3 (index 0 here), utime..cstime are fields 14-17 (indices 11-14)
    return sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def _server_matches() -> bool:
    """Whether the running (or a new) server imported :data:`PRELOAD` from the files the caller would: once per
    server, by forking it once and asking."""
    with _lock:
        pid = fork_server_pid()
        if pid not in _checked_servers:
            _checked_servers[pid] = _ask_server() == _module_files()
        return _checked_servers[pid]


def _ask_server() -> dict[str, str | None]:
    context = mp.get_context("forkserver")
    receive, send = context.Pipe(duplex=False)
    probe = context.Process(target=_reply_module_files, args=(send,), name="allreduce-forkserver-probe")
    probe.start()
    send.close()
    try:
        files: dict[str, str | None] = pickle.loads(receive.recv_bytes())  # from the caller's own fork, by pipe
    except (EOFError, OSError):
        files = {}
    finally:
        receive.close()
        probe.join()
    return files


_TREES = ("numpy", "allreduce")
"""The packages whose files say where the server's preloaded code came from."""


def _module_files() -> dict[str, str | None]:
    import importlib

    return {name: getattr(importlib.import_module(name), "__file__", None) for name in _TREES}


def _reply_module_files(send: Any) -> None:
    _leave_server()
    files = {name: getattr(sys.modules.get(name), "__file__", None) for name in _TREES}
    send.send_bytes(pickle.dumps(files))
    send.close()


class PickledLater:
    """An object that reaches the child as the bytes multiprocessing's pickler makes of it while it starts the
    child (so what may only be passed to a starting process, a lock, a pipe, may be in it), for the child to
    unpickle when it chooses."""

    def __init__(self, value: object) -> None:
        self.value = value

    def __reduce__(self) -> tuple[type[bytes], tuple[bytes]]:
        return bytes, (bytes(reduction.ForkingPickler.dumps(self.value)),)


class InheritedFd:
    """One of the caller's file descriptors, passed to a forked rank (a duplicate, sent with the fork request)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Callable[[Any], int], tuple[Any]]:
        return _detach, (reduction.DupFd(self.fd),)


def _detach(dup: Any) -> int:
    fd: int = dup.detach()
    return fd


def caller_stdio() -> dict[int, InheritedFd]:
    """The caller's standard output and error as they are now (those it has open)."""
    stdio = {}
    for fd in (1, 2):
        with contextlib.suppress(OSError):
            os.fstat(fd)
            stdio[fd] = InheritedFd(fd)
    return stdio


def enter_forked_rank(*, stdio: Mapping[int, int], environ: Mapping[str, str]) -> None:
    """In a rank forked from the server (once it asked to die with it): leave the server's alive pipe, take the
    caller's output and environment, and set the BLAS thread count (see the module docstring)."""
    _leave_server()
    for target, received in stdio.items():
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os.dup2(received, target)
        os.close(received)
    os.environ.clear()
    os.environ.update(environ)
    set_blas_threads(blas_threads(environ))
    if "numpy.random" in sys.modules:  # numpy's global generator does not reseed itself in a fork
        sys.modules["numpy.random"].seed()


def _leave_server() -> None:
    """Close this fork's copy of the server's alive pipe, so that only the caller's copy keeps the server up."""
    fd = _server()._forkserver_alive_fd
    if fd is not None:
        os.close(fd)
        _server()._forkserver_alive_fd = None


def exit_as_an_interpreter_does() -> None:
    """What a spawned rank's interpreter does as it exits and a fork skips (multiprocessing ends a fork with
    ``os._exit``): wait for the threads that are not daemons, then run the ``atexit`` functions (the torch backend
    closes the groups left open there)."""
    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()


def blas_threads(environ: Mapping[str, str]) -> int:
    """The thread count OpenBLAS takes from ``environ`` when loaded: the first of :data:`_BLAS_ENV` set to a
    positive number, else the cores, at most the cores either way."""
    cores = len(os.sched_getaffinity(0))
    for name in _BLAS_ENV:
        value = environ.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return min(int(value), cores)
    return cores


def set_blas_threads(count: int) -> None:
    setter = _blas_function("set_num_threads")
    if setter is not None:
        setter(count)


def blas_threads_now() -> int | None:
    """The thread count of numpy's OpenBLAS in this process (None: not an OpenBLAS this finds)."""
    getter = _blas_function("get_num_threads")
    return None if getter is None else int(getter())


@functools.cache
def _blas_function(what: str) -> Callable[..., Any] | None:
    """numpy's OpenBLAS ``openblas_<what>`` (named after how numpy built it), or None."""
    import numpy  # noqa: F401  (loads the library)

    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "openblas" in line.lower() and "/" in line})
    except OSError:
        return None
    for path in paths:
        try:
            library = ctypes.CDLL(path)  # already loaded: this finds it, it loads nothing
        except OSError:
            continue
        for name in (f"openblas_{what}", f"openblas_{what}64_", f"scipy_openblas_{what}64_"):
            function = getattr(library, name, None)
            if function is not None:
                function.argtypes = [ctypes.c_int] if what.startswith("set") else []
                function.restype = None if what.startswith("set") else ctypes.c_int
                found: Callable[..., Any] = function
                return found
    return None


def _server() -> Any:
    """multiprocessing's fork server state (private attributes: checked by _forkserver_supported)."""
    return mp_forkserver._forkserver


def _in_fork_server() -> bool:
    """Whether this module is being imported by multiprocessing's fork server as a preload."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is mp_forkserver.main.__code__:
            return True
        frame = frame.f_back
    return False


if _in_fork_server():
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    _blas_function("set_num_threads")  # found once here, for every fork
