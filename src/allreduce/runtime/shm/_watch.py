"""Watching the peers while a rank waits on them: a dead process, a rank that closed or gave up, a stalled chain of
waiters, a control-block word no writer produces.

:class:`PeerWatch` reads every rank's control block (abort flag and culprit, closed flag, ``waiting_for``) and each
peer's pidfd. A wait (:mod:`allreduce.runtime.shm._waiting`) asks it between futex sleeps, and a failed read of a
peer's memory asks it for the root cause: every error names the culprit, the step and what was awaited, and every
survivor names the same culprit.
"""

from __future__ import annotations

import time

from allreduce.runtime._errors import ChecksumError, CollectiveTimeoutError, PeerFailureError, ProtocolError
from allreduce.runtime.shm._layout import (
    ABORTED_WORD,
    CLOSED_WORD,
    CULPRIT_WORD,
    NO_ABORT,
    NO_CULPRIT,
    PID_WORD,
    WAITING_FOR_WORD,
)
from allreduce.runtime.shm._linux import exited
from allreduce.runtime.shm._segments import unlink_rank_files
from allreduce.runtime.transport._transport import ABORT_KINDS, error_class

__all__ = ["CLOSED_GRACE_S", "DEATH_POLL_S", "PeerWatch", "corrupt_block_error"]

CLOSED_GRACE_S = 0.2
"""How long a rank that finds a peer closed the group while it waited gives a death elsewhere to show before naming
the peer: a rank that closes mid-collective is usually reacting to a death (seen on another group of its process,
or on a socket), and a SIGKILLed process's sockets reset before its pidfd reports the exit."""

DEATH_POLL_S = 0.001
"""How often :meth:`PeerWatch.deaths_within` looks again for a death while it gives one time to show."""


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


class PeerWatch:
    """Rank ``rank``'s watch over its peers: every rank's control block as words (``views``, this rank's included),
    the peers' pidfds in rank order without this rank (-1 where pidfds are missing), and the job's file prefix
    (a dead rank's files are removed by the survivor that finds the death)."""

    def __init__(self, rank: int, views: list[memoryview], pidfds: list[int], prefix: str) -> None:
        self._rank = rank
        self._world_size = len(views)
        self._views = views
        self._pidfds = pidfds
        self._prefix = prefix

    def timeout_error(self, peer: int, *, seq: int, what: str, step: int) -> CollectiveTimeoutError:
        """The timeout waiting for ``peer``, naming the rank at the root of the wait: a peer whose process is
        stopped (SIGSTOP, a debugger) if any, else the end of the chain of ranks each blocked waiting for the next
        (``waiting_for`` words), so every rank names the same stalled rank, not only its direct waiters."""
        head = f"rank {self._rank}: collective {seq} timed out at {_where(step)} waiting for rank {peer} ({what})"
        step_or_none = step if step >= 0 else None
        views = self._views
        stopped = [p for p in range(self._world_size) if p != self._rank and _is_stopped(int(views[p][PID_WORD]))]
        if stopped:
            root = stopped[0]
            reason = f"rank {root} stopped responding (its process is stopped)"
            return CollectiveTimeoutError(f"{head}: {reason}", rank=self._rank, peer=root, step=step_or_none)
        chain = [peer]
        while True:
            following = int(views[chain[-1]][WAITING_FOR_WORD])
            if not 0 <= following < self._world_size or following == self._rank or following in chain:
                break
            chain.append(following)
        if len(chain) == 1:
            return CollectiveTimeoutError(head, rank=self._rank, peer=peer, step=step_or_none)
        root = chain[-1]
        links = "; ".join(f"rank {a} waited for rank {b}" for a, b in zip(chain[-2::-1], chain[:0:-1], strict=True))
        reason = f"rank {root} stopped responding ({links}; this rank waited for rank {peer})"
        return CollectiveTimeoutError(f"{head}: {reason}", rank=self._rank, peer=root, step=step_or_none)

    def check(self, peer: int, word: int, target: int, *, seq: int, what: str, step: int) -> None:
        """Raise if the awaited peer died, closed, or gave up (after re-checking the awaited condition); a wait on
        this rank's own word (peers counting in it) watches every peer.

        A death or an abort elsewhere is not this wait's to raise on, as over TCP, where only the awaited peer's
        connection can fail a wait: a peer held up by it gives up and says so (its abort word), and a peer that did
        its part lets this rank finish the collective. Raising on any death would split the survivors of one:
        a rank still waiting on a live peer in the collective the dead rank had finished would fail it, while the
        others complete it and fail the next, and a retry on the shrunk group would pair different collectives."""
        dead = self.exited_peers()
        views = self._views
        self.check_abort_words(seq=seq, step=step)
        watched = range(self._world_size) if peer == self._rank else (peer,)
        # A rank that gave up set its abort flag before exiting; a rank that closed set its closed flag. Only a
        # process that exited with neither died unannounced: that is the root cause to name.
        died = [p for p in dead if p in watched and views[p][ABORTED_WORD] == NO_ABORT and not views[p][CLOSED_WORD]]
        aborted = [p for p in watched if p != self._rank and views[p][ABORTED_WORD] != NO_ABORT]
        # A peer that closed after doing its part is fine unless we still wait on it.
        if peer != self._rank and views[peer][ABORTED_WORD] == NO_ABORT and (views[peer][CLOSED_WORD] or peer in dead):
            aborted.append(peer)
        if not died and not aborted:
            return
        if views[peer][word] >= target:
            return  # the peer did its part before it went away
        step_or_none = step if step >= 0 else None
        if not died and all(views[p][ABORTED_WORD] == NO_ABORT for p in aborted):
            died = self.deaths_within(CLOSED_GRACE_S)
        if died:
            culprit = died[0]
            unlink_rank_files(self._prefix, died)
            raise PeerFailureError(
                f"rank {self._rank}: rank {culprit} died (process exited) during collective {seq}; "
                f"this rank was at {_where(step)} waiting for rank {peer} ({what})",
                rank=self._rank,
                peer=culprit,
                step=step_or_none,
            )
        p = aborted[0]
        if views[p][ABORTED_WORD] == NO_ABORT:
            raise PeerFailureError(
                f"rank {self._rank}: rank {p} closed the group while this rank was at {_where(step)} of collective "
                f"{seq} waiting for rank {peer} ({what})",
                rank=self._rank,
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
            f"rank {self._rank}: collective {seq} aborted at {_where(step)}: rank {p} gave up because {reason}",
            rank=self._rank,
            peer=culprit
            if error_type in (PeerFailureError, CollectiveTimeoutError, ProtocolError) and culprit >= 0
            else p,
            step=step_or_none,
        )

    def deaths_within(self, grace_s: float) -> list[int]:
        """The peers that exited without closing or giving up, waiting up to ``grace_s`` for one to show."""
        views = self._views
        deadline = time.monotonic() + grace_s
        while True:
            dead = self.exited_peers()
            died = [p for p in dead if views[p][ABORTED_WORD] == NO_ABORT and not views[p][CLOSED_WORD]]
            if died or time.monotonic() >= deadline:
                return died
            time.sleep(DEATH_POLL_S)

    def exited_peers(self) -> list[int]:
        """The peers whose process has exited (their pidfd is readable), closed or not."""
        if not self._pidfds:
            return []
        gone = exited(self._pidfds)
        if not gone:
            return []
        others = [p for p in range(self._world_size) if p != self._rank]
        return [p for p, fd in zip(others, self._pidfds, strict=True) if fd in gone]

    def unlink_dead_peers_files(self) -> None:
        """Remove the files of peers that exited without closing (a SIGKILLed rank cannot). The rank whose wait
        finds a dead peer removes them as it raises; a group that never waited on it since (one of a process's many
        groups, when another of them found the death) would otherwise leave them until the next transport's
        sweep, so closing calls this too."""
        views = self._views
        dead = [p for p in self.exited_peers() if not views[p][CLOSED_WORD]]
        if dead:
            unlink_rank_files(self._prefix, dead)

    def check_abort_words(self, *, seq: int, step: int) -> None:
        """Raise :func:`corrupt_block_error` for the lowest peer whose ``aborted``, ``culprit`` or ``closed`` word
        holds a value its owner never writes (a kind out of range, an abort without its culprit, a rank outside the
        group, a flag not 0 or 1)."""
        views = self._views
        for p in range(self._world_size):
            if p == self._rank:
                continue
            view = views[p]
            kind = view[ABORTED_WORD]
            if not NO_ABORT <= kind <= len(ABORT_KINDS):
                raise corrupt_block_error(self._rank, p, "aborted", kind, seq=seq, step=step)
            culprit = view[CULPRIT_WORD]
            if kind != NO_ABORT and culprit == NO_CULPRIT:  # an abort writes its culprit before this word
                raise corrupt_block_error(self._rank, p, "aborted", kind, seq=seq, step=step)
            if kind != NO_ABORT and not -1 <= culprit < self._world_size:
                raise corrupt_block_error(self._rank, p, "culprit", culprit, seq=seq, step=step)
            closed = view[CLOSED_WORD]
            if closed not in (0, 1):
                raise corrupt_block_error(self._rank, p, "closed", closed, seq=seq, step=step)
