"""Watching N rank processes until they exit: who failed first, and stopping the others (SIGTERM, then SIGKILL).

Every way a job stops goes the same way: a rank's own failure, an interrupt of the launcher (SIGINT, SIGTERM,
SIGHUP, its output closing), or the job's deadline sends the running ranks a signal, and SIGKILL follows after
the grace period, so a rank that ignores SIGTERM cannot keep the job alive. A failure that is a reaction to
another rank's (the rank reports it, see :mod:`._rank_report`) does not start the stop: the rank
it names is failing too and must not be interrupted while it reports why; if that rank is still running a grace
period later, the stop starts then. Exits are waited on with pidfds, never polled.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

from allreduce.runtime.launcher._reaper import kill_groups

__all__ = ["RankProcess", "RankWatch", "describe_status", "ranks_phrase", "signal_rank"]


def describe_status(returncode: int) -> str:
    """``exited with status 3`` or ``was killed by SIGKILL``."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with status {returncode}"


def ranks_phrase(ranks: Iterable[int]) -> str:
    """``rank 3`` or ``ranks 0, 2``."""
    ordered = sorted(ranks)
    return f"rank {ordered[0]}" if len(ordered) == 1 else "ranks " + ", ".join(map(str, ordered))


def _them(ranks: Iterable[int]) -> str:
    return "it" if len(list(ranks)) == 1 else "them"


def signal_rank(pid: int, sig: int) -> None:
    """Send ``sig`` to the rank ``pid`` and its process group."""
    # A rank leads its own process group once it has started; before that, signal the process itself.
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    except PermissionError:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


class RankProcess(Protocol):
    """What the watch needs of a started rank (``subprocess.Popen`` is one)."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...


class RankWatch:
    """Waits for N rank processes to exit; stops them all on the first failure, an interrupt, or the deadline.

    ``failed(rank, returncode)`` judges an exit (default: a non-zero status); ``reaction(rank)`` names the peer a
    failed rank reacted to (default: none, every failure is the rank's own). ``readers`` of :meth:`watch` maps
    file descriptors to callbacks run when they are readable (a callback returns False at end of file).
    :meth:`interrupt` may be called from a signal handler or another thread.

    After :meth:`watch`: ``failed_rank`` is the first rank whose failure was its own, ``reactions`` maps each rank
    whose failure was a reaction (seen before the stop) to the peer it named, and :meth:`blamed_rank` is who the
    job's failure is due to.
    """

    def __init__(
        self,
        procs: Sequence[RankProcess],
        *,
        grace_s: float,
        timeout_s: float | None = None,
        log: Callable[[str], None],
        failed: Callable[[int, int], bool] = lambda rank, code: code != 0,
        reaction: Callable[[int], int | None] = lambda rank: None,
    ) -> None:
        self.procs = list(procs)
        self.grace_s = grace_s
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.timeout_s = timeout_s
        self.log = log
        self.failed = failed
        self.reaction = reaction
        self.failed_rank: int | None = None
        self.failed_at: float | None = None  # time.monotonic() when the failure was seen
        self.first_failed_rank: int | None = None  # the first failed exit, own or a reaction
        self.reactions: dict[int, int] = {}
        self.stopped_at: float | None = None  # when the watch began stopping ranks (failure, deadline, interrupt)
        self.timed_out: tuple[int, ...] = ()
        self.interrupted_by: int | None = None
        self.interrupts = 0
        self._stop_deadline: float | None = None
        self._reaction_deadline: float | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._added: list[tuple[int, dict[int, Callable[[], bool]]]] = []

    @property
    def wake_fd(self) -> int:
        """The write end of the pipe :meth:`watch` also waits on (non-blocking): a byte there wakes it, for
        ``signal.set_wakeup_fd`` (see :func:`~allreduce.runtime.launcher._spawn.stop_signal_handlers`)."""
        return self._wake_w

    @property
    def stopping(self) -> bool:
        """Whether the watch has begun stopping the ranks (after which a failure is a consequence, not a cause)."""
        return self.stopped_at is not None

    def blamed_rank(self) -> int | None:
        """The rank the job's failure is due to: the first own failure, else the peer most reactions named."""
        if self.failed_rank is not None:
            return self.failed_rank
        if self.reactions:
            named = Counter(self.reactions.values())
            return max(named, key=lambda peer: (named[peer], -list(self.reactions.values()).index(peer)))
        return None

    def signal_all(self, sig: int) -> None:
        """Send ``sig`` to every rank still running (its whole process group)."""
        for proc in self.procs:
            if proc.poll() is None:
                signal_rank(proc.pid, sig)

    def interrupt(self, signum: int, *, forward: int | None = None) -> None:
        """The launcher received ``signum``: send the ranks ``forward`` (default: ``signum``) once, then SIGKILL
        after the grace period; a second interrupt means "now"."""
        self.interrupts += 1
        if self.interrupted_by is None:
            self.interrupted_by = signum
            if self.stopped_at is None:
                self.stopped_at = time.monotonic()
        self.signal_all((forward or signum) if self.interrupts == 1 else signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"\0")

    def replace(self, rank: int, proc: RankProcess, readers: Mapping[int, Callable[[], bool]] | None = None) -> None:
        """``proc`` is rank ``rank`` from now on (a restart after its earlier process exited); ``readers`` as in
        :meth:`watch`. Called from ``failed`` (inside :meth:`watch`) or before it."""
        self.procs[rank] = proc
        self._added.append((rank, dict(readers or {})))

    def watch(self, readers: Mapping[int, Callable[[], bool]] | None = None) -> None:
        """Return once every rank has exited."""
        remaining = set(range(len(self.procs)))
        with selectors.DefaultSelector() as selector:
            pidfds: list[int] = []

            def follow(rank: int) -> None:
                try:
                    pidfd = os.pidfd_open(self.procs[rank].pid)
                except ProcessLookupError:  # already exited and reaped
                    remaining.discard(rank)
                    self._exited(rank, remaining)
                    return
                pidfds.append(pidfd)
                selector.register(pidfd, selectors.EVENT_READ, ("exit", (rank, self.procs[rank])))

            for rank in range(len(self.procs)):
                follow(rank)
            for fd, callback in (readers or {}).items():
                selector.register(fd, selectors.EVENT_READ, ("read", callback))
            selector.register(self._wake_r, selectors.EVENT_READ, ("wake", None))
            try:
                while remaining or self._added:
                    while self._added:  # restarted ranks: follow their new processes
                        rank, more = self._added.pop(0)
                        remaining.add(rank)
                        for fd, callback in more.items():
                            selector.register(fd, selectors.EVENT_READ, ("read", callback))
                        follow(rank)
                    if not remaining:
                        break
                    for key, _ in selector.select(self._next_timeout()):
                        what, value = key.data
                        if what == "read" and not value():
                            selector.unregister(key.fd)
                        elif what == "wake":
                            # an interrupt, or any signal's wakeup byte (its handler has run by now: the main
                            # thread ran bytecode since select returned); only an interrupt starts the grace clock
                            os.read(self._wake_r, 64)
                            if self._stop_deadline is None and self.interrupted_by is not None:
                                self._stop_deadline = time.monotonic() + self.grace_s
                        elif what == "exit" and value[1].poll() is not None:
                            selector.unregister(key.fd)
                            remaining.discard(value[0])
                            self._exited(value[0], remaining)
                    self._check_deadlines(remaining)
            finally:
                for pidfd in pidfds:
                    os.close(pidfd)

    def close(self) -> None:
        """Kill whatever still runs (after an error in the caller), and what exited ranks left running in their
        process groups; free the watch's own descriptors."""
        self.signal_all(signal.SIGKILL)
        kill_groups({proc.pid for proc in self.procs})
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    # ------------------------------------------------------------------------------------------------
    def _next_timeout(self) -> float | None:
        deadlines = [d for d in (self._stop_deadline, self._reaction_deadline, self.deadline) if d is not None]
        return max(min(deadlines) - time.monotonic(), 0.0) if deadlines else None

    def _begin_stop(self, remaining: set[int]) -> None:
        self.stopped_at = time.monotonic()
        self._reaction_deadline = None
        self.signal_all(signal.SIGTERM)
        self._stop_deadline = self.stopped_at + self.grace_s

    def _exited(self, rank: int, remaining: set[int]) -> None:
        code = self.procs[rank].poll()
        assert code is not None
        if self.stopping or not self.failed(rank, code):
            return
        if self.first_failed_rank is None:
            self.first_failed_rank = rank
        peer = self.reaction(rank)
        if peer is not None and 0 <= peer < len(self.procs) and peer != rank:
            self.reactions[rank] = peer
            if peer in remaining:
                # The peer is failing too: let it finish and report why before stopping anyone.
                self.log(f"rank {rank} {describe_status(code)}, reacting to a failure of rank {peer}")
                if self._reaction_deadline is None:
                    self._reaction_deadline = time.monotonic() + self.grace_s
                return
            # The peer it names has exited without failing (it closed its group): nobody else will fail first.
            self.failed_at = time.monotonic()
            self.log(
                f"rank {rank} {describe_status(code)}, reacting to rank {peer} leaving the group"
                + (f"; stopping {ranks_phrase(remaining)}" if remaining else "")
            )
            if remaining:
                self._begin_stop(remaining)
            return
        self.failed_rank = rank
        self.failed_at = time.monotonic()
        if remaining:
            self.log(f"rank {rank} {describe_status(code)}; stopping {ranks_phrase(remaining)}")
            self._begin_stop(remaining)
        else:
            self.stopped_at = self.failed_at
            self.log(f"rank {rank} {describe_status(code)}")

    def _check_deadlines(self, remaining: set[int]) -> None:
        now = time.monotonic()
        if not remaining:
            return
        if self._stop_deadline is not None and now >= self._stop_deadline:
            self.log(f"{ranks_phrase(remaining)} did not stop in {self.grace_s:g} s; killing {_them(remaining)}")
            self.signal_all(signal.SIGKILL)
            self._stop_deadline = None
            self.deadline = None
        elif self._reaction_deadline is not None and now >= self._reaction_deadline and not self.stopping:
            named = sorted(set(self.reactions.values()) & remaining)
            self.log(
                f"{ranks_phrase(named)} still running {self.grace_s:g} s after "
                f"{ranks_phrase(self.reactions)} reported {_them(named)} failed; stopping {ranks_phrase(remaining)}"
            )
            self.failed_at = now
            self._begin_stop(remaining)
        elif self.deadline is not None and now >= self.deadline and not self.stopping:
            self.timed_out = tuple(sorted(remaining))
            self.log(f"{ranks_phrase(remaining)} still running after {self.timeout_s:g} s; stopping {_them(remaining)}")
            self._begin_stop(remaining)
            self.deadline = None
