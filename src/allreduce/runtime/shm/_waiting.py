"""Waiting on peers' counters, and watching the peers while waiting.

A mixin of :class:`~allreduce.runtime.shm.ShmTransport` (its methods resolve like the class's own, so the hot
path pays no extra layer). A waiter spins briefly when every rank has a core, then yields, then blocks in
``futex(2)`` on the counter with a short timeout, so that N ranks on fewer cores do not starve each other; a
publisher wakes the futex only when a peer has marked itself asleep. The spin adapts: a wait that had to block
halves the next spin (a busy machine: spinning only takes the core from the peer being waited for), and a wait
that a full spin would have caught restores it. While waiting it watches every peer's
process (pidfd) and abort flag: a dead rank, a rank that closed or gave up, or the deadline end the wait with an
error naming the culprit, the step and what was awaited.
"""

from __future__ import annotations

import os
import time

from allreduce.runtime._errors import ChecksumError, CollectiveTimeoutError, PeerFailureError, ProtocolError
from allreduce.runtime._transport import ABORT_KINDS, error_class
from allreduce.runtime.shm._layout import (
    ABORTED_WORD,
    CLOSED_WORD,
    CULPRIT_WORD,
    NO_ABORT,
    NO_CULPRIT,
    NOT_WAITING,
    PID_WORD,
    SLEEPERS_WORD,
    WAITING_FOR_WORD,
)
from allreduce.runtime.shm._linux import exited, futex_wait, futex_wake
from allreduce.runtime.shm._segments import unlink_rank_files

__all__ = ["MIN_SPIN_S", "POLL_S", "SPIN_S", "YIELD_S", "PeerWaiting", "corrupt_block_error"]

SPIN_S = 30e-6
"""A waiter busy-waits this long first when every rank has a core: a handoff then costs well under a microsecond."""

MIN_SPIN_S = 1e-6
"""A spin budget halved below this is zero (a spin shorter than a few reads of the clock catches nothing)."""

YIELD_S = 300e-6
"""Then it gives the core away between checks for this long; then it blocks in futex."""
YIELD_NS = int(YIELD_S * 1e9)

POLL_S = 0.001
"""Longest a waiter blocks in futex before it re-checks the deadline, dead peers and abort flags."""

CLOSED_GRACE_S = 0.2
"""How long a rank that finds a peer closed the group while it waited gives a death elsewhere to show before naming
the peer: a rank that closes mid-collective is usually reacting to a death (seen on another group of its process,
or on a socket), and a SIGKILLed process's sockets reset before its pidfd reports the exit."""


def corrupt_block_error(rank: int, owner: int, word: str, value: int, *, seq: int, step: int) -> ProtocolError:
    """The error for a value in ``owner``'s control block that no legitimate writer produces: the same message on
    every rank that reads it, naming the block's owner."""
    return ProtocolError(
        f"rank {rank}: rank {owner}'s control block is corrupt (word {word} = {value}) at {_where(step)} of "
        f"collective {seq}",
        rank=rank,
        peer=owner,
        step=step if step >= 0 else None,
    )


def _is_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped by a signal or a tracer (state T or t in /proc/PID/stat)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rpartition(b")")[2].split()
    except OSError:
        return False
    return bool(fields) and fields[0] in (b"T", b"t")


def _where(step: int) -> str:
    """``step`` in a message (-1 is the descriptor exchange, before the first step)."""
    return f"step {step}" if step >= 0 else "the descriptor exchange"


class PeerWaiting:
    """Publishing this rank's counters and waiting on peers' (mixed into the transport, which sets the state)."""

    rank: int
    world_size: int
    _prefix: str
    _views: list[memoryview]
    """Every rank's control block as int64 words (this rank's included)."""
    _sleepers: memoryview
    """This rank's "asleep in futex" flags, one per rank that waits on it."""
    _addr: list[int]
    """Every rank's control block address in this process (futex keys)."""
    _spin_s: float
    """How long the next wait spins (adapted between 0 and ``_spin_limit_s``)."""
    _spin_limit_s: float
    """The longest spin: :data:`SPIN_S` when every rank has a core, else 0."""
    _pidfds: list[int]
    """The peers' pidfds, in rank order without this rank."""
    wait_began: int = 0
    """When the last wait that had to wait began (``time.perf_counter_ns``): the recorder's mark for a receive
    that read no clock before its wait."""

    def _publish(self, word: int, value: int) -> None:
        """Set this rank's counter ``word`` to ``value`` and wake the peers asleep on this rank's block."""
        view = self._views[self.rank]
        view[word] = value
        # A syscall only when someone sleeps: most handoffs are caught by the waiter's spin. A waiter that
        # registers just as we look may miss this wake; its futex timeout (POLL_S) bounds the cost.
        if any(self._sleepers):
            futex_wake(self._addr[self.rank] + 8 * word)

    def _wait(
        self,
        peer: int,
        word: int,
        target: int,
        *,
        deadline: float,
        seq: int,
        what: str,
        step: int,
        floor: int | None = None,
        word_name: str = "",
    ) -> int:
        """Return once ``peer``'s counter ``word`` reaches ``target``, with how long that took in nanoseconds (0
        when it had already: then no clock is read, else :attr:`wait_began` is when it began); raise naming the
        culprit if it cannot.

        ``what`` (what is awaited) and ``step`` (-1: the descriptor exchange) go into the error messages. With
        ``floor``, a counter below it is one no writer produces (the counter only grows, and was at least ``floor``
        already): ``peer``'s block is corrupt, named ``word_name``, instead of a wait until the timeout."""
        view = self._views[peer]
        if view[word] >= target:
            return 0
        clock = time.perf_counter_ns  # the clock reads below happen while waiting: the recorder's waits are free
        start = now = clock()
        self.wait_began = start
        spin_until = start + int(self._spin_s * 1e9)
        while now < spin_until:
            if view[word] >= target:
                return now - start
            now = clock()
        yield_until = start + YIELD_NS
        while now < yield_until:
            os.sched_yield()
            now = clock()
            if view[word] >= target:
                if now - start <= self._spin_limit_s * 1e9:
                    self._spin_s = self._spin_limit_s  # a full spin would have caught it
                return now - start
        spin_s = self._spin_s / 2
        self._spin_s = spin_s if spin_s >= MIN_SPIN_S else 0.0
        address = self._addr[peer] + 8 * word
        sleeper = SLEEPERS_WORD + self.rank
        me = self._views[self.rank]
        # Read by ranks that time out waiting for this one (blame's chain). Cleared only when the wait succeeds: a
        # rank that gave up keeps saying whom it waited for, so a rank timing out just after it still follows the
        # chain through it to the root.
        me[WAITING_FOR_WORD] = peer
        while True:
            seen = view[word]
            if seen >= target:
                break
            if floor is not None and seen < floor:
                raise corrupt_block_error(self.rank, peer, word_name, seen, seq=seq, step=step)
            self._check_peers(peer, word, target, seq=seq, what=what, step=step)
            now_s = time.monotonic()
            if now_s >= deadline:
                if view[word] >= target:
                    break
                raise self._timeout_error(peer, seq=seq, what=what, step=step)
            view[sleeper] = 1
            if view[word] == seen:
                futex_wait(address, seen, min(POLL_S, deadline - now_s))
            view[sleeper] = 0
        me[WAITING_FOR_WORD] = NOT_WAITING
        return clock() - start

    def _timeout_error(self, peer: int, *, seq: int, what: str, step: int) -> CollectiveTimeoutError:
        """The timeout waiting for ``peer``, naming the rank at the root of the wait: a peer whose process is
        stopped (SIGSTOP, a debugger) if any, else the end of the chain of ranks each blocked waiting for the next
        (``waiting_for`` words), so every rank names the same stalled rank, not only its direct waiters."""
        head = f"rank {self.rank}: collective {seq} timed out at {_where(step)} waiting for rank {peer} ({what})"
        step_or_none = step if step >= 0 else None
        views = self._views
        stopped = [p for p in range(self.world_size) if p != self.rank and _is_stopped(int(views[p][PID_WORD]))]
        if stopped:
            root = stopped[0]
            reason = f"rank {root} stopped responding (its process is stopped)"
            return CollectiveTimeoutError(f"{head}: {reason}", rank=self.rank, peer=root, step=step_or_none)
        chain = [peer]
        while True:
            following = int(views[chain[-1]][WAITING_FOR_WORD])
            if not 0 <= following < self.world_size or following == self.rank or following in chain:
                break
            chain.append(following)
        if len(chain) == 1:
            return CollectiveTimeoutError(head, rank=self.rank, peer=peer, step=step_or_none)
        root = chain[-1]
        links = "; ".join(f"rank {a} waited for rank {b}" for a, b in zip(chain[-2::-1], chain[:0:-1], strict=True))
        reason = f"rank {root} stopped responding ({links}; this rank waited for rank {peer})"
        return CollectiveTimeoutError(f"{head}: {reason}", rank=self.rank, peer=root, step=step_or_none)

    def _check_peers(self, peer: int, word: int, target: int, *, seq: int, what: str, step: int) -> None:
        """Raise if a peer died, closed, or gave up (after re-checking the awaited condition)."""
        dead = self._exited_peers()
        views = self._views
        self._check_abort_words(seq=seq, step=step)
        # A rank that gave up set its abort flag before exiting; a rank that closed set its closed flag. Only a
        # process that exited with neither died unannounced: that is the root cause to name.
        died = [p for p in dead if views[p][ABORTED_WORD] == NO_ABORT and not views[p][CLOSED_WORD]]
        aborted = [p for p in range(self.world_size) if p != self.rank and views[p][ABORTED_WORD] != NO_ABORT]
        # A peer that closed after doing its part is fine unless we still wait on it.
        if peer != self.rank and views[peer][ABORTED_WORD] == NO_ABORT and (views[peer][CLOSED_WORD] or peer in dead):
            aborted.append(peer)
        if not died and not aborted:
            return
        if views[peer][word] >= target:
            return  # the peer did its part before it went away
        step_or_none = step if step >= 0 else None
        if not died and all(views[p][ABORTED_WORD] == NO_ABORT for p in aborted):
            died = self._deaths_within(CLOSED_GRACE_S)
        if died:
            culprit = died[0]
            unlink_rank_files(self._prefix, died)
            raise PeerFailureError(
                f"rank {self.rank}: rank {culprit} died (process exited) during collective {seq}; "
                f"this rank was at {_where(step)} waiting for rank {peer} ({what})",
                rank=self.rank,
                peer=culprit,
                step=step_or_none,
            )
        p = aborted[0]
        if views[p][ABORTED_WORD] == NO_ABORT:
            raise PeerFailureError(
                f"rank {self.rank}: rank {p} closed the group while this rank was at {_where(step)} of collective "
                f"{seq} waiting for rank {peer} ({what})",
                rank=self.rank,
                peer=p,
                step=step_or_none,
            )
        error_type = error_class(int(views[p][ABORTED_WORD]) - 1)
        culprit = int(views[p][CULPRIT_WORD])
        if error_type is PeerFailureError:
            reason = f"rank {culprit} died"
        elif error_type is CollectiveTimeoutError:
            reason = f"it timed out waiting for rank {culprit}"
        elif error_type is ChecksumError:
            reason = f"data from rank {culprit} failed its checksum"
        elif error_type is ProtocolError and culprit >= 0:
            reason = f"rank {culprit}'s control block is corrupt"
        else:
            reason = "it failed"
        raise error_type(
            f"rank {self.rank}: collective {seq} aborted at {_where(step)}: rank {p} gave up because {reason}",
            rank=self.rank,
            peer=culprit
            if error_type in (PeerFailureError, CollectiveTimeoutError, ProtocolError) and culprit >= 0
            else p,
            step=step_or_none,
        )

    def _deaths_within(self, grace_s: float) -> list[int]:
        """The peers that exited without closing or giving up, waiting up to ``grace_s`` for one to show."""
        views = self._views
        deadline = time.monotonic() + grace_s
        while True:
            dead = self._exited_peers()
            died = [p for p in dead if views[p][ABORTED_WORD] == NO_ABORT and not views[p][CLOSED_WORD]]
            if died or time.monotonic() >= deadline:
                return died
            time.sleep(POLL_S)

    def _exited_peers(self) -> list[int]:
        """The peers whose process has exited (their pidfd is readable), closed or not."""
        if not self._pidfds:
            return []
        gone = exited(self._pidfds)
        if not gone:
            return []
        others = [p for p in range(self.world_size) if p != self.rank]
        return [p for p, fd in zip(others, self._pidfds, strict=True) if fd in gone]

    def _unlink_dead_peers_files(self) -> None:
        """Remove the files of peers that exited without closing (a SIGKILLed rank cannot). The rank whose wait
        finds a dead peer removes them as it raises; a group that never waited on it since (one of a process's many
        groups, when another of them found the death) would otherwise leave them until the next transport's
        sweep, so closing calls this too."""
        views = self._views
        dead = [p for p in self._exited_peers() if not views[p][CLOSED_WORD]]
        if dead:
            unlink_rank_files(self._prefix, dead)

    def _check_abort_words(self, *, seq: int, step: int) -> None:
        """Raise :func:`corrupt_block_error` for the lowest peer whose ``aborted``, ``culprit`` or ``closed`` word
        holds a value its owner never writes (a kind out of range, an abort without its culprit, a rank outside the
        group, a flag not 0 or 1)."""
        views = self._views
        for p in range(self.world_size):
            if p == self.rank:
                continue
            view = views[p]
            kind = view[ABORTED_WORD]
            if not NO_ABORT <= kind <= len(ABORT_KINDS):
                raise corrupt_block_error(self.rank, p, "aborted", kind, seq=seq, step=step)
            culprit = view[CULPRIT_WORD]
            if kind != NO_ABORT and culprit == NO_CULPRIT:  # an abort writes its culprit before this word
                raise corrupt_block_error(self.rank, p, "aborted", kind, seq=seq, step=step)
            if kind != NO_ABORT and not -1 <= culprit < self.world_size:
                raise corrupt_block_error(self.rank, p, "culprit", culprit, seq=seq, step=step)
            closed = view[CLOSED_WORD]
            if closed not in (0, 1):
                raise corrupt_block_error(self.rank, p, "closed", closed, seq=seq, step=step)
