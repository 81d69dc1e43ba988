"""Silent ranks: the lease after which the store declares a rank it hears nothing from dead, and the check a rank
blocked on its peers makes of the store's dead list.

A rank whose process dies is found in milliseconds: its sockets close, its pidfd reports the exit, its store
connection drops. A rank that goes silent (its process stopped or hung, its host powered off, its NIC, cable or
switch gone) keeps its connections open and tells nobody. Two physical facts cover both kinds: a stopped process's
kernel still acknowledges TCP, so only an application-level heartbeat finds it; a vanished host acknowledges
nothing, and sends no heartbeat either. So every rank's store client sends a heartbeat several times a lease
(:mod:`allreduce.runtime.store._store`), the store's server declares a rank dead after a lease without a word from
it, as it does a rank whose connection dropped (``__dead__/<rank>``), and a rank blocked on a peer for longer than
:data:`CHECK_AFTER_S` asks the store, at most every :data:`CHECK_EVERY_S`, whether that peer was declared dead
(:class:`SilenceWatch`), and raises :class:`PeerFailureError` naming it. Everything downstream is the dead-rank
path: the rank aborts, its peers raise naming the same rank, and a shrink's agreement leaves it out at once.

The rule for a live rank (docs/reliability.md, "Silent ranks"): it is declared dead only if the store reads nothing
from it for a whole lease, five heartbeat periods; the heartbeat thread needs the GIL a few microseconds a beat, and
CPython hands it over within its switch interval from Python code and from numpy (which releases it), so a long
compute step does not starve it. A single C call that holds the GIL for longer than a lease would.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from typing import Any

from allreduce.runtime._errors import CollectiveError, PeerFailureError

__all__ = [
    "BEATS_PER_LEASE",
    "CHECK_AFTER_S",
    "CHECK_EVERY_S",
    "DEFAULT_LEASE_S",
    "LEASE_ENV",
    "LEASE_SWEEPS",
    "LEASE_SWEEP_MAX_S",
    "MAX_LEASE_S",
    "MIN_LEASE_S",
    "SilenceWatch",
    "lease_arg",
    "silent_detection_s",
]

LEASE_ENV = "ALLREDUCE_LEASE_S"
"""The lease in seconds when ``allreduce.init(lease_s=...)`` is not given (``0``: off)."""

DEFAULT_LEASE_S = 10.0
"""The default lease (see docs/reliability.md for the measured heartbeat gaps it must outlast)."""

MIN_LEASE_S = 1.0
"""The shortest lease allowed."""

MAX_LEASE_S = 3600.0
"""The longest lease allowed: past an hour, the group's timeout finds a silent rank first anyway."""

BEATS_PER_LEASE = 5
"""Heartbeats a client sends per lease: a live rank is declared dead only if the server reads nothing from it for
four beat periods past the one it expected (docs/reliability.md has the measured gaps)."""
LEASE_SWEEPS = 4
"""The store's server looks for silent ranks this many times a lease (a sweep reads every connection's last word)..."""
LEASE_SWEEP_MAX_S = 0.5
"""...and at least every half second, so a rank is declared dead at most that long after its lease ran out."""

CHECK_AFTER_S = 1.0
"""A rank blocked on a peer this long asks the store whether the peer was declared dead..."""

CHECK_EVERY_S = 1.0
"""...and asks again at most this often (a small request to rank 0's store: N a second while N ranks wait)."""


def silent_detection_s(lease_s: float) -> tuple[float, float]:
    """How long after a rank goes silent a survivor blocked on it raises, on average and at worst, with a lease of
    ``lease_s`` (> 0), by the mechanism's own periods: the rank's last heartbeat left ``U·P`` before it went
    silent (``P`` = lease / :data:`BEATS_PER_LEASE`, ``U`` uniform on [0, 1)), the store's sweep (every ``S`` =
    min(:data:`LEASE_SWEEP_MAX_S`, lease / :data:`LEASE_SWEEPS`)) declares it dead within ``S`` of its lease running
    out, and the survivor asks the store every ``C`` = :data:`CHECK_EVERY_S`, at a phase of its own. Mean:
    lease - P/2 + S/2 + C/2; worst: lease + S + C (a lease of 10 s: 9.75 and 11.5 s)."""
    if not lease_s > 0:
        raise ValueError(f"lease_s must be > 0 (the heartbeat on), got {lease_s}")
    period = lease_s / BEATS_PER_LEASE
    sweep = min(LEASE_SWEEP_MAX_S, lease_s / LEASE_SWEEPS)
    return lease_s - period / 2 + sweep / 2 + CHECK_EVERY_S / 2, lease_s + sweep + CHECK_EVERY_S


def lease_arg(value: object) -> float:
    """The lease in seconds: ``value`` (``init(lease_s=...)``), else :data:`LEASE_ENV`, else
    :data:`DEFAULT_LEASE_S`; 0 turns it off. ``ValueError`` or ``TypeError`` naming the source for anything else."""
    source = "lease_s"
    if value is None:
        text = os.environ.get(LEASE_ENV, "").strip()
        if not text:
            return DEFAULT_LEASE_S
        source = f"{LEASE_ENV}={text[:40]!r}"
        try:
            value = float(text)
        except ValueError:
            raise ValueError(
                f"{source}: not a number of seconds (0 turns the heartbeat off; else {MIN_LEASE_S:g} to "
                f"{MAX_LEASE_S:g})"
            ) from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{source}: expected a number of seconds, got {type(value).__name__} {value!r}")
    lease = float(value)
    if lease == 0:
        return 0.0
    if not (math.isfinite(lease) and MIN_LEASE_S <= lease <= MAX_LEASE_S):
        raise ValueError(
            f"{source}: {lease:g} s is not a lease: 0 turns the heartbeat off, else {MIN_LEASE_S:g} to "
            f"{MAX_LEASE_S:g} s (how long a rank may go unheard before it is declared dead)"
        )
    return lease


class SilenceWatch:
    """A rank's look, while it is blocked on its peers, at the ranks the store declared dead (``store``: the
    group's, whose :attr:`~allreduce.runtime.store._store.TCPStore.lease_s` is set)."""

    def __init__(self, store: Any, rank: int) -> None:
        self._store = store
        self._rank = rank
        self.lease_s = float(getattr(store, "lease_s", 0.0) or 0.0)
        self._next = 0.0

    @classmethod
    def of(cls, store: Any, rank: int) -> SilenceWatch | None:
        """The watch of a group whose store has a lease; None when it has none (nothing would be declared)."""
        return cls(store, rank) if store is not None and float(getattr(store, "lease_s", 0.0) or 0.0) > 0 else None

    def check(self, waiting_for: Iterable[int], now: float, *, seq: int, what: str, step: int | None = None) -> None:
        """Raise :class:`PeerFailureError` naming the lowest rank of ``waiting_for`` the store declared dead, or
        rank 0 if the store (which rank 0 hosts) did not answer within a lease; at most every
        :data:`CHECK_EVERY_S` (``now``: ``time.monotonic()``), else return at once."""
        if now < self._next:
            return
        self._next = now + CHECK_EVERY_S
        store = self._store
        try:
            dead = store.dead_ranks(answer_s=self.lease_s)
        except CollectiveError as exc:
            if not getattr(store, "host_silent", False):
                return  # the connection was busy, or is gone (then the sockets say so)
            raise PeerFailureError(
                f"rank {self._rank}: the store's host, rank 0, did not answer within the lease ({self.lease_s:g} s) "
                f"while this rank waited at {what} of collective {seq}: its process is stopped or hung, or its host "
                "or network is gone",
                rank=self._rank,
                peer=0,
                step=step,
            ) from exc
        except (OSError, ValueError):
            return
        culprits = sorted(set(dead) & set(waiting_for))
        if not culprits:
            return
        culprit = culprits[0]
        try:
            reason = bytes(store.get(f"__dead__/{culprit}", timeout_s=0.0)).decode(errors="replace")
        except (CollectiveError, OSError, ValueError):
            reason = "the store declared it dead"
        raise PeerFailureError(
            f"rank {self._rank}: rank {culprit} is dead to the store while this rank waited for it at {what} of "
            f"collective {seq}: {reason}",
            rank=self._rank,
            peer=culprit,
            step=step,
        )
