"""Starting N local ranks and watching them: one way, for Python functions (:func:`spawn`) and commands (the launcher).

Every rank gets the rendezvous environment that ``allreduce.init()`` and torch's ``env://`` read (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) and a random per-job
``ALLREDUCE_TOKEN``, so the store refuses strangers. ``MASTER_PORT`` is known before any rank starts and cannot be
taken by anyone else: the parent holds a *port reservation* for the whole job, a socket bound to the port with
``SO_REUSEADDR`` that never listens. The kernel hands that port to no other ``bind(0)`` or outgoing connection,
while rank 0's store (allreduce's, or torch's, both of which set ``SO_REUSEADDR``) binds and listens on it.

:func:`spawn`'s ranks are forks of a server that imported numpy and allreduce once, or fresh interpreters
(``ALLREDUCE_START_METHOD=spawn``); :mod:`._forkserver` says how a fork is made to be what a fresh one is.

A rank never outlives its job: it asks the kernel for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``; the
parent of a forked rank is the fork server, which exits when the caller does), each
rank leads its own process group and is signalled as a group, and a :class:`~allreduce.runtime.launcher._reaper.Reaper`
kills those groups and sweeps their shared memory if the parent is killed without warning. A
:class:`~._watch.RankWatch` waits on the ranks' exits: on the first failure it names the rank and
stops the others (SIGTERM, then SIGKILL after a grace period), as it does at the job's deadline and when the
parent receives SIGINT, SIGTERM or SIGHUP; the parent then delivers that signal to itself as if it had arrived
once the ranks were gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import multiprocessing as mp
import os
import pickle
import secrets
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from types import FrameType
from typing import Any, Generic, TypeVar

from allreduce.runtime.elastic._elastic import JOIN_ENV
from allreduce.runtime.launcher._forkserver import (
    PickledLater,
    caller_stdio,
    enter_forked_rank,
    exit_as_an_interpreter_does,
    fork_server_pid,
    start_method,
)
from allreduce.runtime.launcher._rank_report import install_failure_report, reacted_to
from allreduce.runtime.launcher._reaper import Reaper
from allreduce.runtime.launcher._watch import RankWatch, describe_status, ranks_phrase

__all__ = [
    "DEFAULT_GRACE_S",
    "MASTER_ADDR",
    "MAX_LOCAL_RANKS",
    "STOP_SIGNALS",
    "Departure",
    "ElasticOutcome",
    "Elasticity",
    "JobInterruptedError",
    "RankFailedError",
    "RankWatch",
    "check_world_size",
    "describe_status",
    "die_with_parent",
    "new_token",
    "rank_environment",
    "reserve_port",
    "spawn",
    "spawn_elastic",
    "stop_signal_handlers",
]

R = TypeVar("R")

MASTER_ADDR = "127.0.0.1"
"""Local ranks meet on loopback."""

DEFAULT_GRACE_S = 5.0
"""After a failure or an interrupt, how long the ranks get to exit on SIGTERM (time to close their groups and
unlink shared memory) before SIGKILL."""

MAX_LOCAL_RANKS = 256
"""The most ranks one launcher starts on one host. The launcher holds three descriptors per rank (its two output
pipes and a pidfd), so 256 ranks stay within the usual limit of 1,024 open files; past the cores, more ranks only
time-share them."""

STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Signals that stop a job: Ctrl-C, a polite kill, and a closed terminal or lost ssh session."""

MAX_RESTARTS = 1000
"""The most restarts an elastic job may ask for."""

TOKEN_BYTES = 16
"""Random bytes in a job's token: 128 bits, not guessable by a stranger on the host."""

_PR_SET_PDEATHSIG = 1  # prctl(2) option: the signal a process receives when the thread that started it exits
_ORPHANED_AT_START_STATUS = 1  # a rank whose parent died before it asked to die with it exits at once


class RankFailedError(RuntimeError):
    """A rank raised, died, or outlived the deadline; ``rank`` is the first that did, ``detail`` its traceback."""

    def __init__(self, message: str, *, rank: int, detail: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.detail = detail


class JobInterruptedError(RuntimeError):
    """The parent received ``signum`` (SIGINT, SIGTERM, SIGHUP) while its ranks ran; they were stopped."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}; every rank was stopped")
        self.signum = signum


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


def check_world_size(world_size: object, what: str = "world_size") -> int:
    """``world_size`` as a number of local ranks, or ValueError naming ``what`` and :data:`MAX_LOCAL_RANKS`."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"{what} must be an integer >= 1, got {world_size!r}")
    if world_size > MAX_LOCAL_RANKS:
        raise ValueError(
            f"{what}: at most {MAX_LOCAL_RANKS} local ranks (the launcher holds three open files per rank), "
            f"got {world_size}"
        )
    return world_size


@functools.cache
def _prctl() -> Callable[..., int] | None:
    # Resolved once in the parent: between fork and exec a child must not load libraries.
    try:
        function: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return function


def die_with_parent(parent_pid: int) -> Callable[[], None]:
    """A function that, run in a new child of ``parent_pid`` (at its start, or between fork and exec), makes the
    kernel SIGKILL the child when the parent dies, and ends the child at once if the parent is already gone.

    ``PR_SET_PDEATHSIG`` fires when the parent *thread* that forked the child exits: the caller must start ranks
    from a thread that outlives them (the launcher's and spawn()'s calling thread waits for them)."""
    prctl = _prctl()

    def in_child() -> None:
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent went before prctl took effect
            os._exit(_ORPHANED_AT_START_STATUS)

    return in_child


@contextlib.contextmanager
def stop_signal_handlers(on_signal: Callable[[int], None], *, wake_fd: int | None = None) -> Iterator[None]:
    """Route :data:`STOP_SIGNALS` to ``on_signal(signum)`` inside the block, from the main thread only (elsewhere
    nothing changes); a signal the process ignores (``nohup`` ignores SIGHUP) stays ignored.

    ``wake_fd`` (non-blocking, the write end of a pipe the main thread waits on): the kernel may deliver a signal
    to any thread of the process, and Python runs the handler only once the main thread executes bytecode again;
    a main thread asleep in ``select`` with no timeout would sleep on (a launcher whose output threads took a
    Ctrl-C hung until killed). With ``signal.set_wakeup_fd`` the interpreter writes a byte there on every
    signal, which wakes the main thread to run the handler."""
    previous: dict[int, Any] = {}
    old_wake_fd: int | None = None
    if threading.current_thread() is threading.main_thread():

        def handler(signum: int, frame: FrameType | None) -> None:
            on_signal(signum)

        for stop in STOP_SIGNALS:
            if signal.getsignal(stop) is not signal.SIG_IGN:
                previous[stop] = signal.signal(stop, handler)
        if wake_fd is not None:
            old_wake_fd = signal.set_wakeup_fd(wake_fd, warn_on_full_buffer=False)
    try:
        yield
    finally:
        if old_wake_fd is not None:
            signal.set_wakeup_fd(old_wake_fd)
        for stop_signal, old in previous.items():
            signal.signal(stop_signal, old)


def _deliver_to_self(signum: int) -> None:
    """Deliver ``signum`` to this process as if it arrived now, to whatever handled it before the job: the default
    action (a SIGTERM ends the process with that status), a KeyboardInterrupt, or the caller's own handler."""
    if threading.current_thread() is threading.main_thread():
        signal.raise_signal(signum)


# --------------------------------------------------------------------------------------------------------
# spawn(): N local ranks of a Python function
# --------------------------------------------------------------------------------------------------------
class _SpawnedRank:
    """A rank started by multiprocessing, seen through :class:`RankProcess`."""

    def __init__(self, process: Any, *, forked: bool = False) -> None:
        self.process = process
        self.forked = forked  # a child of the fork server, which reaps it and then sends its status

    @property
    def pid(self) -> int:
        pid: int = self.process.pid
        return pid

    def poll(self) -> int | None:
        code: int | None = self.process.exitcode
        if code is None and self.forked and not _running(self.pid):
            self.process.join(_STATUS_WAIT_S)  # exited: the server's word on it is on its way
            code = self.process.exitcode
        return code


_STATUS_WAIT_S = 1.0
"""How long poll() waits for the fork server's word on a rank that has exited (sent once the server reaps it)."""


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: it has exited and waits to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _on_sigterm(signum: int, frame: object) -> None:
    # Unwind (closing the group, unlinking shared memory) instead of vanishing mid-collective; a second SIGTERM
    # must not interrupt that unwinding (SIGKILL follows after the grace period if it takes too long).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def _rank_main(
    *,
    rank: int,
    env: Mapping[str, str],
    fn: Callable[..., Any] | None,
    args: Sequence[Any],
    init_options: Mapping[str, Any] | None,
    report: Connection,
    parent_pid: int,
    forked: Mapping[str, Any] | None = None,
) -> None:
    die_with_parent(parent_pid)()
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    signal.signal(signal.SIGTERM, _on_sigterm)
    if forked is not None:  # a fork of the server: become what a spawned rank is, then unpickle the function
        enter_forked_rank(stdio=forked["stdio"], environ=forked["environ"])
        fn, args = pickle.loads(forked["call"])  # from the caller, through the server's pipe to this process
    assert fn is not None
    os.environ.update(env)
    try:
        _run_and_report(rank, fn, args, init_options, report)
    finally:
        if forked is not None:  # multiprocessing ends a fork with os._exit, skipping what an interpreter does
            exit_as_an_interpreter_does()


def _run_and_report(
    rank: int, fn: Callable[..., Any], args: Sequence[Any], init_options: Mapping[str, Any] | None, report: Connection
) -> None:
    try:
        if init_options is None:
            value = fn(*args)
        else:
            from allreduce.runtime.group._bootstrap import init

            with init(**init_options) as group:
                value = fn(group, *args)
        # Plain pickle to bytes: multiprocessing's own pickler would pass torch tensors as handles to this
        # process's shared memory, which vanish when it exits before the parent reads them.
        payload = pickle.dumps(("ok", value))
    except BaseException as exc:
        failed_at = time.monotonic()
        text = f"{type(exc).__name__}: {exc}"
        reply = (failed_at, text, traceback.format_exc(), reacted_to(exc, rank))
        report.send_bytes(pickle.dumps(("error", reply)))
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
    """Run ``fn`` on ``world_size`` new local processes; return its results, indexed by rank.

    With ``group=True`` each rank calls ``fn(group, *args)`` on a group made by ``allreduce.init(**init_options)``
    and closed after ``fn`` returns; with ``group=False`` it calls ``fn(*args)`` in the rendezvous environment (see
    the module docstring), for code that makes its own group (``allreduce.init()``, torch's ``env://``). ``env``
    adds variables (an ``ALLREDUCE_TOKEN`` there replaces the job's random one). ``fn`` must be importable by name
    and its result picklable; results come back over pipes from the processes this call started, never over a
    network.

    Raises :class:`RankFailedError` naming the first rank whose failure was its own (not a
    :class:`~allreduce.runtime.PeerFailureError` in reaction to another rank's) or the ranks still running after
    ``timeout_s``; the others are stopped. Called from the main thread, SIGINT, SIGTERM and SIGHUP stop the ranks
    (SIGTERM, SIGKILL after ``grace_s``) and are then delivered to this process as if they arrived at that moment
    (SIGINT raises KeyboardInterrupt; a SIGTERM with no handler ends the process); a handler that returns makes
    this raise :class:`JobInterruptedError`. Every rank has exited and its shared memory is unlinked when this
    returns or raises.
    """
    replies, _ = _run_ranks(
        world_size,
        fn,
        args,
        group=group,
        init_options=init_options,
        timeout_s=timeout_s,
        grace_s=grace_s,
        env=env,
        elastic=None,
    )
    return [replies[rank] for rank in range(world_size)]


@dataclass(frozen=True)
class Departure:
    """A rank that failed while the job went on without it (:func:`spawn_elastic`)."""

    rank: int
    how: str  # "was killed by SIGKILL", or the exception the rank reported
    at: float  # time.monotonic() when the launcher saw it exit (CLOCK_MONOTONIC: comparable across processes)
    survivors: int  # ranks still running (or finished with their result) once it had gone
    restarted: bool = False  # a new process took its place, asking to join (ALLREDUCE_JOIN=1)


@dataclass
class Elasticity:
    """How many ranks a job needs to go on, and how many restarts it may make (each restart starts a new process
    for a failed rank, with ``ALLREDUCE_JOIN=1`` so that ``allreduce.init()`` joins the running group). Rank 0
    hosts the store: its failure always ends the job."""

    min_ranks: int
    max_restarts: int = 0
    departures: list[Departure] = field(default_factory=list)

    def check(self, world_size: int) -> None:
        if not 1 <= self.min_ranks <= world_size:
            raise ValueError(f"min_ranks must be in 1..{world_size} (the world size), got {self.min_ranks!r}")
        if not 0 <= self.max_restarts <= MAX_RESTARTS:
            raise ValueError(f"max_restarts must be in 0..{MAX_RESTARTS}, got {self.max_restarts!r}")

    def departs(self, rank: int, how: str, running: int) -> bool | None:
        """A rank failed while ``running`` others still run or have returned their result: None if that ends the
        job, else whether to restart it (the departure is recorded either way)."""
        if rank == 0 or (running < self.min_ranks and not self._restarts_left()):
            return None
        restart = self._restarts_left()
        self.departures.append(Departure(rank, how, time.monotonic(), running, restart))
        return restart

    def _restarts_left(self) -> bool:
        return sum(d.restarted for d in self.departures) < self.max_restarts


@dataclass(frozen=True)
class ElasticOutcome(Generic[R]):
    """What :func:`spawn_elastic` returns: the results of the ranks that finished, and the ranks that did not."""

    results: dict[int, R]
    departures: list[Departure]


def spawn_elastic(
    world_size: int,
    fn: Callable[..., R],
    *args: Any,
    min_ranks: int,
    max_restarts: int = 0,
    timeout_s: float = 300.0,
    grace_s: float = DEFAULT_GRACE_S,
    env: Mapping[str, str] | None = None,
) -> ElasticOutcome[R]:
    """:func:`spawn` (``group=False``) for elastic code: a rank's failure does not stop the others while at least
    ``min_ranks`` still run or have returned their result, so survivors that shrink their group
    (``group.shrink()``) go on without it; up to ``max_restarts`` times a failed rank is started again, with
    ``ALLREDUCE_JOIN=1``, to rejoin the group (``group.grow()`` on the members). Each failure is a
    :class:`Departure` in the outcome, a rank's result is that of its last process; the job fails as :func:`spawn`
    does (a :class:`RankFailedError`) when rank 0 fails (it hosts the store), once fewer than ``min_ranks`` remain
    with no restart left, or at the deadline."""
    check_world_size(world_size)
    elastic = Elasticity(min_ranks, max_restarts)
    elastic.check(world_size)
    replies, departures = _run_ranks(
        world_size,
        fn,
        args,
        group=False,
        init_options=None,
        timeout_s=timeout_s,
        grace_s=grace_s,
        env=env,
        elastic=elastic,
    )
    return ElasticOutcome(results=dict(sorted(replies.items())), departures=departures)


def _run_ranks(
    world_size: int,
    fn: Callable[..., R],
    args: Sequence[Any],
    *,
    group: bool,
    init_options: Mapping[str, Any] | None,
    timeout_s: float,
    grace_s: float,
    env: Mapping[str, str] | None,
    elastic: Elasticity | None,
) -> tuple[dict[int, R], list[Departure]]:
    """Start and watch the ranks; the results of those that returned, and the failures ``elastic`` tolerated
    (None: none)."""
    check_world_size(world_size)
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    if not group and init_options is not None:
        raise ValueError("init_options: only used with group=True (the ranks make their own group)")
    options = None if not group else {"timeout_s": timeout_s, **(init_options or {})}
    method = start_method({**os.environ, **(env or {})})
    ctx: Any = mp.get_context(method)
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
        if code == 0 and rank in replies:
            return False
        if elastic is None:
            return True
        # the others still running, and those that returned their result (exit 0): a survivor that saw the
        # death and finished before this call reaped the dead rank is not lost
        running = sum(1 for r, proc in enumerate(ranks) if r != rank and proc.poll() in (None, 0))
        kind, value = replies.get(rank, ("", None))
        how = value[1] if kind == "error" else describe_status(code)
        restart = elastic.departs(rank, how, running)
        if restart is None:
            return True
        replies.pop(rank, None)
        messages.append(f"rank {rank} {how}; {running} ranks go on" + ("; restarting it" if restart else ""))
        if restart:
            start(rank, joining=True)
        return False

    def reaction(rank: int) -> int | None:
        kind, value = replies.get(rank, ("", None))
        return value[3] if kind == "error" else None

    watch = RankWatch(
        ranks, grace_s=grace_s, timeout_s=timeout_s, log=messages.append, failed=failed, reaction=reaction
    )
    reaper = Reaper()

    def start(rank: int, *, joining: bool) -> None:
        receive, send = ctx.Pipe(duplex=False)
        rank_env = {**shared_env, **rank_environment(rank, world_size, master_port=port, token=token)}
        if joining:
            rank_env[JOIN_ENV] = "1"
        kwargs: dict[str, Any] = {"rank": rank, "env": rank_env, "init_options": options, "report": send}
        if method == "forkserver":
            # The function and its arguments are unpickled once the rank has the caller's environment.
            forked = {"stdio": caller_stdio(), "environ": dict(os.environ), "call": PickledLater((fn, tuple(args)))}
            kwargs.update(fn=None, args=(), parent_pid=fork_server_pid(), forked=forked)
        else:
            kwargs.update(fn=fn, args=args, parent_pid=os.getpid())
        process = ctx.Process(target=_rank_main, kwargs=kwargs, name=f"allreduce-rank-{rank}")
        process.start()
        send.close()
        assert process.pid is not None  # started
        reaper.add(process.pid)
        if joining:
            reports[rank].close()
            reports[rank] = receive
            ranks[rank] = _SpawnedRank(process, forked=method == "forkserver")
            watch.replace(rank, ranks[rank], {receive.fileno(): functools.partial(read, rank)})
        else:
            reports.append(receive)
            ranks.append(_SpawnedRank(process, forked=method == "forkserver"))
            watch.procs.append(ranks[-1])

    try:
        on_signal = lambda signum: watch.interrupt(signum, forward=signal.SIGTERM)  # noqa: E731
        with stop_signal_handlers(on_signal, wake_fd=watch.wake_fd):
            for rank in range(world_size):
                if watch.interrupted_by is not None:
                    break
                start(rank, joining=False)
            watch.watch({reports[r].fileno(): functools.partial(read, r) for r in range(len(ranks))})
            for rank in range(len(ranks)):
                while rank not in replies and read(rank):
                    pass
    finally:
        watch.close()
        for proc in ranks:
            proc.process.join()
        for conn in reports:
            conn.close()
        reservation.close()
        _sweep_shared_memory()
        reaper.close()
    if watch.interrupted_by is not None:
        _deliver_to_self(watch.interrupted_by)
        raise JobInterruptedError(watch.interrupted_by)
    error = _first_failure(watch, ranks, replies, timeout_s)
    if error is not None:
        raise error
    return {
        rank: value for rank, (kind, value) in replies.items() if kind == "ok"
    }, elastic.departures if elastic else []


def _first_failure(
    watch: RankWatch, ranks: Sequence[_SpawnedRank], replies: Mapping[int, tuple[str, Any]], timeout_s: float
) -> RankFailedError | None:
    """The first cause: the earliest exception a rank reported as its own (not a reaction to a peer's failure),
    else the first exit judged a failure, else the peer the reactions named. Errors raised after the watch began
    stopping ranks are its consequence, not a cause."""
    stopped_at = watch.stopped_at if watch.stopped_at is not None else float("inf")
    candidates: list[tuple[float, RankFailedError]] = []
    for rank, (kind, value) in replies.items():
        if kind == "error":
            failed_at, text, detail, peer = value
            if peer is not None or (failed_at >= stopped_at and rank != watch.failed_rank):
                continue
            candidates.append((failed_at, RankFailedError(f"rank {rank} failed: {text}", rank=rank, detail=detail)))
    if watch.failed_rank is not None and watch.failed_rank not in {e.rank for _, e in candidates}:
        rank = watch.failed_rank
        code = ranks[rank].poll()
        how = "exited without returning a result" if code == 0 else describe_status(code or 0)
        assert watch.failed_at is not None
        candidates.append((watch.failed_at, RankFailedError(f"rank {rank} {how}", rank=rank)))
    reacted = sorted(watch.reactions)
    also = f" ({ranks_phrase(reacted)} failed in reaction)" if reacted else ""
    if candidates:
        first = min(candidates, key=lambda c: c[0])[1]
        return RankFailedError(f"{first}{also}", rank=first.rank, detail=first.detail)
    blamed = watch.blamed_rank()
    if blamed is not None:
        first_reaction = replies[reacted[0]][1]
        return RankFailedError(
            f"rank {blamed} failed or left the group: {ranks_phrase(reacted)} raised PeerFailureError naming it",
            rank=blamed,
            detail=first_reaction[2],
        )
    if watch.timed_out:
        return RankFailedError(
            f"{ranks_phrase(watch.timed_out)} still running after {timeout_s:g} s; stopped", rank=watch.timed_out[0]
        )
    return None


def _sweep_shared_memory() -> None:
    """Unlink the shared-memory files of ranks that were killed before they could (their owners are gone)."""
    from allreduce.runtime.shm import sweep_stale_segments

    sweep_stale_segments()


# Every `import allreduce` reaches this module: in a rank of `allreduce run` (and only there, see
# _rank_report), an uncaught exception is reported to the launcher, which needs it to tell causes from reactions.
install_failure_report()
