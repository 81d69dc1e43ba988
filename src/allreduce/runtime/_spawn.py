"""Starting N local ranks and watching them: one way, for Python functions (:func:`spawn`) and commands (the launcher).

Every rank gets the rendezvous environment that ``allreduce.init()`` and torch's ``env://`` read (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) and a random per-job
``ALLREDUCE_TOKEN``, so the store refuses strangers. ``MASTER_PORT`` is known before any rank starts and cannot be
taken by anyone else: the parent holds a *port reservation* for the whole job, a socket bound to the port with
``SO_REUSEADDR`` that never listens. The kernel hands that port to no other ``bind(0)`` or outgoing connection,
while rank 0's store (allreduce's, or torch's, both of which set ``SO_REUSEADDR``) binds and listens on it.

A :class:`RankWatch` waits on the ranks' exits (pidfds, no polling): on the first failure it names the rank and
stops the others (SIGTERM, then SIGKILL after a grace period), and at the job's deadline it stops every rank still
running. Each rank leads its own process group and is signalled as a group, so what a rank started goes with it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import multiprocessing as mp
import os
import pickle
import secrets
import selectors
import signal
import socket
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any, Protocol, TypeVar

__all__ = [
    "DEFAULT_GRACE_S",
    "MASTER_ADDR",
    "RankFailedError",
    "RankWatch",
    "describe_status",
    "new_token",
    "rank_environment",
    "reserve_port",
    "spawn",
]

R = TypeVar("R")

MASTER_ADDR = "127.0.0.1"
"""Local ranks meet on loopback."""

DEFAULT_GRACE_S = 5.0
"""After a failure, how long the other ranks get to exit on SIGTERM (time to close their groups and unlink shared
memory) before SIGKILL."""

TOKEN_BYTES = 16
"""Random bytes in a job's token: 128 bits, not guessable by a stranger on the host."""

_PR_SET_PDEATHSIG = 1  # prctl(2) option: the signal a process receives when the thread that started it exits


class RankFailedError(RuntimeError):
    """A rank raised, died, or outlived the deadline; ``rank`` is the first that did, ``detail`` its traceback."""

    def __init__(self, message: str, *, rank: int, detail: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.detail = detail


# --------------------------------------------------------------------------------------------------------
# The pieces every start of ranks shares
# --------------------------------------------------------------------------------------------------------
def reserve_port(host: str = MASTER_ADDR) -> socket.socket:
    """A socket bound to a free port of ``host`` that never listens: the port stays out of the kernel's free pool
    until the socket is closed, and a server that sets ``SO_REUSEADDR`` may still bind and listen on it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
    except BaseException:
        sock.close()
        raise
    return sock


def new_token() -> str:
    """A fresh random token for one job."""
    return secrets.token_hex(TOKEN_BYTES)


def rank_environment(
    rank: int, world_size: int, *, master_port: int, token: str, master_addr: str = MASTER_ADDR
) -> dict[str, str]:
    """The variables rank ``rank`` of a local job of ``world_size`` ranks is started with."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "ALLREDUCE_TOKEN": token,
    }


def describe_status(returncode: int) -> str:
    """``exited with status 3`` or ``was killed by SIGKILL``."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with status {returncode}"


def _ranks_text(ranks: Iterable[int]) -> str:
    return ", ".join(map(str, sorted(ranks)))


class RankProcess(Protocol):
    """What the watch needs of a started rank (``subprocess.Popen`` is one)."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...


class RankWatch:
    """Waits for N rank processes to exit; stops them all on the first failure, an interrupt, or the deadline.

    ``failed(rank, returncode)`` judges an exit (default: a non-zero status). ``readers`` maps file descriptors to
    callbacks run when they are readable (a callback returns False at end of file). :meth:`interrupt` may be
    called from a signal handler: the first forwards the signal to every rank, a second one kills them.
    """

    def __init__(
        self,
        procs: Sequence[RankProcess],
        *,
        grace_s: float,
        timeout_s: float | None = None,
        log: Callable[[str], None],
        failed: Callable[[int, int], bool] = lambda rank, code: code != 0,
    ) -> None:
        self.procs = list(procs)
        self.grace_s = grace_s
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.timeout_s = timeout_s
        self.log = log
        self.failed = failed
        self.failed_rank: int | None = None
        self.failed_at: float | None = None  # time.monotonic() when the failure was seen
        self.stopped_at: float | None = None  # when the watch began stopping ranks (failure, deadline, interrupt)
        self.timed_out: tuple[int, ...] = ()
        self.interrupted_by: int | None = None
        self.interrupts = 0
        self._stop_deadline: float | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)

    def signal_all(self, sig: int) -> None:
        """Send ``sig`` to every rank still running (its whole process group)."""
        for proc in self.procs:
            if proc.poll() is None:
                _signal_rank(proc.pid, sig)

    def interrupt(self, signum: int) -> None:
        """The launcher received ``signum``: forward it once; a second interrupt means "now"."""
        self.interrupts += 1
        if self.interrupted_by is None:
            self.interrupted_by = signum
            self.stopped_at = time.monotonic()
        self.signal_all(signum if self.interrupts == 1 else signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"\0")

    def watch(self, readers: Mapping[int, Callable[[], bool]] | None = None) -> None:
        """Return once every rank has exited."""
        remaining = set(range(len(self.procs)))
        with selectors.DefaultSelector() as selector:
            pidfds = {}
            for rank, proc in enumerate(self.procs):
                try:
                    pidfd = os.pidfd_open(proc.pid)
                except ProcessLookupError:  # already exited and reaped
                    remaining.discard(rank)
                    self._exited(rank, remaining)
                    continue
                pidfds[rank] = pidfd
                selector.register(pidfd, selectors.EVENT_READ, ("exit", rank))
            for fd, callback in (readers or {}).items():
                selector.register(fd, selectors.EVENT_READ, ("read", callback))
            selector.register(self._wake_r, selectors.EVENT_READ, ("wake", None))
            try:
                while remaining:
                    for key, _ in selector.select(self._next_timeout()):
                        what, value = key.data
                        if what == "read" and not value():
                            selector.unregister(key.fd)
                        elif what == "wake":
                            os.read(self._wake_r, 64)
                            if self._stop_deadline is None:
                                self._stop_deadline = time.monotonic() + self.grace_s
                        elif what == "exit" and self.procs[value].poll() is not None:
                            selector.unregister(key.fd)
                            remaining.discard(value)
                            self._exited(value, remaining)
                    self._check_deadlines(remaining)
            finally:
                for pidfd in pidfds.values():
                    os.close(pidfd)

    def close(self) -> None:
        """Kill whatever still runs (after an error in the caller), and what exited ranks left running in their
        process groups; free the watch's own descriptors."""
        self.signal_all(signal.SIGKILL)
        for proc in self.procs:
            # A process group outlives its leader while members remain, and its id is not reused meanwhile.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        # SIGKILL is delivered asynchronously: return only once nothing of those groups runs any more.
        deadline = time.monotonic() + KILL_WAIT_S
        groups = {proc.pid for proc in self.procs}
        while _running_in_groups(groups) and time.monotonic() < deadline:
            time.sleep(KILL_POLL_S)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    # ------------------------------------------------------------------------------------------------
    def _next_timeout(self) -> float | None:
        deadlines = [d for d in (self._stop_deadline, self.deadline) if d is not None]
        return max(min(deadlines) - time.monotonic(), 0.0) if deadlines else None

    def _exited(self, rank: int, remaining: set[int]) -> None:
        code = self.procs[rank].poll()
        assert code is not None
        if self.failed_rank is not None or self.interrupted_by is not None or self.timed_out:
            return
        if not self.failed(rank, code):
            return
        self.failed_rank = rank
        self.failed_at = self.stopped_at = time.monotonic()
        if remaining:
            self.log(f"rank {rank} {describe_status(code)}; stopping ranks {_ranks_text(remaining)}")
        else:
            self.log(f"rank {rank} {describe_status(code)}")
        self.signal_all(signal.SIGTERM)
        self._stop_deadline = time.monotonic() + self.grace_s

    def _check_deadlines(self, remaining: set[int]) -> None:
        now = time.monotonic()
        if not remaining:
            return
        if self._stop_deadline is not None and now >= self._stop_deadline:
            self.log(f"ranks {_ranks_text(remaining)} did not stop in {self.grace_s:g} s; killing")
            self.signal_all(signal.SIGKILL)
            self._stop_deadline = None
            self.deadline = None
        elif self.deadline is not None and now >= self.deadline and self._stop_deadline is None:
            self.timed_out = tuple(sorted(remaining))
            self.stopped_at = now
            self.log(f"ranks {_ranks_text(remaining)} still running after {self.timeout_s:g} s; stopping them")
            self.signal_all(signal.SIGTERM)
            self._stop_deadline = now + self.grace_s
            self.deadline = None


KILL_WAIT_S = 5.0
"""Longest :meth:`RankWatch.close` waits for killed process groups to be gone (the kernel takes microseconds)."""
KILL_POLL_S = 0.005


def _running_in_groups(groups: set[int]) -> bool:
    """Whether any process (not a zombie) belongs to one of the process groups ``groups``."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] not in ("Z", "X") and int(fields[2]) in groups:
            return True
    return False


def _signal_rank(pid: int, sig: int) -> None:
    # A rank leads its own process group once it has started; before that, signal the process itself.
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    except PermissionError:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


# --------------------------------------------------------------------------------------------------------
# spawn(): N local ranks of a Python function
# --------------------------------------------------------------------------------------------------------
class _SpawnedRank:
    """A rank started by multiprocessing, seen through :class:`RankProcess`."""

    def __init__(self, process: Any) -> None:
        self.process = process

    @property
    def pid(self) -> int:
        pid: int = self.process.pid
        return pid

    def poll(self) -> int | None:
        code: int | None = self.process.exitcode
        return code


def _die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to kill this process when its parent goes (a rank must never outlive its job)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent went before prctl took effect
        os._exit(1)


def _on_sigterm(signum: int, frame: object) -> None:
    # Unwind (closing the group, unlinking shared memory) instead of vanishing mid-collective.
    raise SystemExit(128 + signum)


def _rank_main(
    *,
    rank: int,
    env: Mapping[str, str],
    fn: Callable[..., Any],
    args: Sequence[Any],
    init_options: Mapping[str, Any] | None,
    report: Connection,
    parent_pid: int,
) -> None:
    _die_with_parent(parent_pid)
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    signal.signal(signal.SIGTERM, _on_sigterm)
    os.environ.update(env)
    try:
        if init_options is None:
            value = fn(*args)
        else:
            from allreduce.runtime._bootstrap import init

            with init(**init_options) as group:
                value = fn(group, *args)
        # Plain pickle to bytes: multiprocessing's own pickler would pass torch tensors as handles to this
        # process's shared memory, which vanish when it exits before the parent reads them.
        payload = pickle.dumps(("ok", value))
    except BaseException as exc:
        failed_at = time.monotonic()
        text = f"{type(exc).__name__}: {exc}"
        report.send_bytes(pickle.dumps(("error", (failed_at, text, traceback.format_exc()))))
        report.close()
        raise SystemExit(1) from None
    report.send_bytes(payload)
    report.close()


def spawn(
    world_size: int,
    fn: Callable[..., R],
    *args: Any,
    group: bool = True,
    init_options: Mapping[str, Any] | None = None,
    timeout_s: float = 300.0,
    grace_s: float = DEFAULT_GRACE_S,
    env: Mapping[str, str] | None = None,
) -> list[R]:
    """Run ``fn`` on ``world_size`` fresh local processes; return its results, indexed by rank.

    With ``group=True`` each rank calls ``fn(group, *args)`` on a group made by ``allreduce.init(**init_options)``
    and closed after ``fn`` returns; with ``group=False`` it calls ``fn(*args)`` in the rendezvous environment (see
    the module docstring), for code that makes its own group (``allreduce.init()``, torch's ``env://``). ``env``
    adds variables (an ``ALLREDUCE_TOKEN`` there replaces the job's random one). ``fn`` must be importable by name
    and its result picklable; results come back over pipes from the processes this call started, never over a
    network.

    Raises :class:`RankFailedError` naming the first rank that raised or died (the others are stopped) or the ranks
    still running after ``timeout_s`` (they are stopped); every rank has exited when this returns.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    if not group and init_options is not None:
        raise ValueError("init_options: only used with group=True (the ranks make their own group)")
    options = None if not group else {"timeout_s": timeout_s, **(init_options or {})}
    ctx = mp.get_context("spawn")
    reservation = reserve_port()
    token = (env or {}).get("ALLREDUCE_TOKEN") or new_token()
    port = int(reservation.getsockname()[1])
    cores = os.cpu_count() or 1
    shared_env = {
        # N ranks share the machine's cores: one intra-op thread pool per core, not per rank.
        "OMP_NUM_THREADS": str(max(1, cores // world_size)),
        # Gloo picks its interface from the host name, which may not be loopback; rendezvous stays local.
        "GLOO_SOCKET_IFNAME": "lo",
        **(env or {}),
    }
    reports: list[Connection] = []
    ranks: list[_SpawnedRank] = []
    replies: dict[int, tuple[str, Any]] = {}
    messages: list[str] = []
    watch: RankWatch | None = None
    try:
        for rank in range(world_size):
            receive, send = ctx.Pipe(duplex=False)
            rank_env = {**shared_env, **rank_environment(rank, world_size, master_port=port, token=token)}
            process = ctx.Process(
                target=_rank_main,
                kwargs={
                    "rank": rank,
                    "env": rank_env,
                    "fn": fn,
                    "args": args,
                    "init_options": options,
                    "report": send,
                    "parent_pid": os.getpid(),
                },
                name=f"allreduce-rank-{rank}",
            )
            process.start()
            send.close()
            reports.append(receive)
            ranks.append(_SpawnedRank(process))

        def read(rank: int) -> bool:
            try:
                data = reports[rank].recv_bytes()
            except (EOFError, OSError):
                return False
            replies[rank] = pickle.loads(data)  # bytes from a process this call started, not from the network
            return True

        def failed(rank: int, code: int) -> bool:
            while rank not in replies and read(rank):
                pass
            return code != 0 or rank not in replies

        watch = RankWatch(ranks, grace_s=grace_s, timeout_s=timeout_s, log=messages.append, failed=failed)
        watch.watch({reports[r].fileno(): functools.partial(read, r) for r in range(world_size)})
        for rank in range(world_size):
            while rank not in replies and read(rank):
                pass
    finally:
        if watch is not None:
            watch.close()
        else:
            for proc in ranks:
                _signal_rank(proc.pid, signal.SIGKILL)
        for proc in ranks:
            proc.process.join()
        for conn in reports:
            conn.close()
        reservation.close()
        _sweep_shared_memory()
    error = _first_failure(watch, ranks, replies, timeout_s)
    if error is not None:
        raise error
    return [replies[rank][1] for rank in range(world_size)]


def _first_failure(
    watch: RankWatch, ranks: Sequence[_SpawnedRank], replies: Mapping[int, tuple[str, Any]], timeout_s: float
) -> RankFailedError | None:
    """The earliest failure: a rank's own report of an exception, else the first exit judged a failure. Errors
    raised after the watch began stopping ranks are its consequence, not a cause."""
    stopped_at = watch.stopped_at if watch.stopped_at is not None else float("inf")
    candidates: list[tuple[float, RankFailedError]] = []
    for rank, (kind, value) in replies.items():
        if kind == "error":
            failed_at, text, detail = value
            if failed_at >= stopped_at and rank != watch.failed_rank:
                continue
            candidates.append((failed_at, RankFailedError(f"rank {rank} failed: {text}", rank=rank, detail=detail)))
    if watch.failed_rank is not None and watch.failed_rank not in {e.rank for _, e in candidates}:
        rank = watch.failed_rank
        code = ranks[rank].poll()
        how = "exited without returning a result" if code == 0 else describe_status(code or 0)
        assert watch.failed_at is not None
        candidates.append((watch.failed_at, RankFailedError(f"rank {rank} {how}", rank=rank)))
    if candidates:
        return min(candidates, key=lambda c: c[0])[1]
    if watch.timed_out:
        return RankFailedError(
            f"ranks {_ranks_text(watch.timed_out)} still running after {timeout_s:g} s; stopped",
            rank=watch.timed_out[0],
        )
    return None


def _sweep_shared_memory() -> None:
    """Unlink the shared-memory files of ranks that were killed before they could (their owners are gone)."""
    from allreduce.runtime.shm import sweep_stale_segments

    sweep_stale_segments()
