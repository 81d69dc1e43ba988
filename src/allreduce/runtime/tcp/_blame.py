"""Whom a rank names when a peer is gone or silent: the records ranks leave in the store.

A failure spreads along the schedule's connections: a rank that loses a peer aborts, and its own peers then lose
it. The ABORT frame it sends names the first cause, but a peer that is sending (not reading) may hit the closed
connection first and see only a broken pipe. So every rank that gives up because of another leaves one record,
``<prefix>/aborted/<rank>`` = the culprit, *before* it closes a connection; a rank that loses a peer follows those
records to the rank that failed first. The store also knows which ranks died (their connection to it dropped
without a close) and, after a timeout, whom each rank waited for (``<prefix>/waited/<rank>``): the chain of waits
leads to the stalled rank at its root.
"""

from __future__ import annotations

import contextlib
import time

from allreduce.runtime._errors import CollectiveError, PeerFailureError
from allreduce.runtime._store_api import Store

__all__ = ["DEAD_POLL_S", "STALL_GRACE_S", "STOP_SETTLE_S", "BlameRecords", "LostPeerError"]

DEAD_POLL_S = 0.2
"""How often a rank waiting for peers to connect asks the store which ranks died (one small request each time): a
rank that dies before its connections exist is named by every waiting rank within this, not at the timeout."""

STOP_SETTLE_S = 2.0
"""A peer found stopping while this rank connects reacted to a failure: how long to wait for the store to learn
which rank died, so that rank is the one named."""

STALL_GRACE_S = 2.0
"""After a timeout, how long a rank waits for the rank it waited for to say (in the store) whom that one waited for:
ranks that are blocked behind a stalled rank time out within about this of each other, the stalled rank never
says; so the chain of waits is followed to the rank at its root, which every rank then names."""


class LostPeerError(PeerFailureError):
    """A connection's end of file, reset or broken pipe: the peer died, or gave up and closed its connections with
    its ABORT frame still unread here. :meth:`BlameRecords.lost` tells which (never raised to the user)."""


class BlameRecords:
    """The store's records of one rank's group: deaths, who gave up because of whom, who waited for whom."""

    def __init__(self, store: Store, prefix: str, rank: int, world_size: int) -> None:
        self._store = store
        self._rank = rank
        self._world_size = world_size
        self._aborted = f"{prefix}/aborted/"
        self._waited = f"{prefix}/waited/"

    # -------------------------------------------------------------------------------------------- deaths
    def dead_ranks(self) -> list[int]:
        """The ranks the store saw die (their connection to it dropped without a close), lowest first; the store's
        host, rank 0, if the connection to the store dropped; empty if the store does not track deaths or cannot be
        asked."""
        try:
            return sorted(self._store.dead_ranks())
        except (CollectiveError, OSError, ValueError):
            # A store that cannot be asked because its host's connection dropped: the host is the rank that left
            # (a rank waiting for peers to connect would otherwise wait out its timeout and name one of them).
            return [0] if self._store.host_lost and self._rank != 0 else []

    def raise_if_dead(self, waiting_for: set[int], what: str) -> None:
        """Raise PeerFailureError naming the lowest dead rank if any rank of the group died: every rank that waits
        for a connection then names the same rank, whether it waits for that one or for one that exited in
        reaction to it."""
        dead = self.dead_ranks()
        if not dead:
            return
        culprit = dead[0]
        message = f"rank {self._rank}: rank {culprit} died ({what})"
        if len(dead) > 1:
            message += f"; rank(s) {', '.join(map(str, dead[1:]))} died too"
        others = sorted(waiting_for - set(dead))
        if others:
            message += f"; rank(s) {', '.join(map(str, others))} did not connect (exited in reaction, or waiting)"
        raise PeerFailureError(message, rank=self._rank, peer=culprit)

    # -------------------------------------------------------------------------------------------- reactions
    def record_abort(self, culprit: int | None) -> None:
        """Leave the record that this rank gives up because of ``culprit`` (nothing when it is the culprit).
        Called before any connection closes, so a peer that sees one close finds the record. Best effort."""
        if culprit is None or culprit == self._rank:
            return
        with contextlib.suppress(CollectiveError, OSError, ValueError, RuntimeError):
            self._store.set(self._aborted + str(self._rank), str(culprit).encode())

    def reacted_to(self, peer: int) -> list[int]:
        """The ranks ``peer`` gave up because of, in order (``peer`` because of the first, that one because of the
        second...), as their records say; empty if ``peer`` left none (it died, or failed first)."""
        chain = [peer]
        with contextlib.suppress(CollectiveError, OSError, ValueError, RuntimeError):
            while len(chain) <= self._world_size:
                key = self._aborted + str(chain[-1])
                if not self._store.check([key]):
                    break
                culprit = int(self._store.get(key, timeout_s=0.0).decode())
                if not 0 <= culprit < self._world_size or culprit in chain:
                    break
                chain.append(culprit)
        return chain[1:]

    def lost(self, error: LostPeerError) -> PeerFailureError:
        """The error for a connection lost to ``error.peer``: naming the rank it gave up because of, if it did."""
        assert error.peer is not None
        reacted = self.reacted_to(error.peer)
        if not reacted:
            return PeerFailureError(str(error), rank=error.rank, peer=error.peer, step=error.step)
        via = "".join(f", which gave up because of rank {r}" for r in reacted[:-1])
        return PeerFailureError(
            f"rank {self._rank}: rank {reacted[-1]} failed first; {error} (rank {error.peer} gave up because of "
            f"rank {reacted[0]}{via})",
            rank=self._rank,
            peer=reacted[-1],
            step=error.step,
        )

    def exited_peer_error(self, peer: int, what: str, detail: str, *, settle_s: float = 0.0) -> PeerFailureError:
        """The error for ``peer`` gone while this rank connects to it: if ``peer`` gave up because of another
        rank, or some other rank died (as the store saw it), ``peer`` exited in reaction and the error names that
        rank. ``settle_s``: how long to wait for the store to learn of a death (a peer that is stopping reacts to a
        failure the store may not have seen yet)."""
        reacted = self.reacted_to(peer)
        if reacted:
            culprit = reacted[-1]
        else:
            dead = self.dead_ranks()
            settle_until = time.monotonic() + settle_s
            while not dead and time.monotonic() < settle_until:
                time.sleep(DEAD_POLL_S / 4)
                dead = self.dead_ranks()
            culprit = peer if not dead or peer in dead else dead[0]
        message = f"rank {self._rank}: {detail}"
        if culprit != peer:
            message = f"rank {self._rank}: rank {culprit} failed first ({what}); {detail}, in reaction"
        return PeerFailureError(message, rank=self._rank, peer=culprit)

    # -------------------------------------------------------------------------------------------- stalls
    def stall_root(self, peer: int) -> tuple[int, list[str]]:
        """Publish that this rank timed out waiting for ``peer``, then follow the ranks' such records from ``peer``
        on: the first rank that publishes none within :data:`STALL_GRACE_S` is the root, returned with the links
        followed ("rank A waited for rank B"), from the root back.

        The records are per rank, not per collective: a rank one collective behind (still in ``seq - 1``, blocked
        on the stalled rank there) is what the ranks ahead of it wait for, and a timeout ends the group, so every
        record is of this one stall."""
        links: list[str] = []
        try:
            self._store.set(self._waited + str(self._rank), str(peer).encode())
            chain = [self._rank, peer]
            while True:
                try:
                    following = int(self._store.get(self._waited + str(chain[-1]), timeout_s=STALL_GRACE_S).decode())
                except CollectiveError:  # it never said (it is the root), or the store failed the wait: a rank died
                    break
                if not 0 <= following < self._world_size or following in chain:
                    break
                links.insert(0, f"rank {chain[-1]} waited for rank {following}")
                chain.append(following)
        except (ValueError, OSError):
            return peer, []  # the store cannot tell: name the rank this one waited for
        return chain[-1], links
