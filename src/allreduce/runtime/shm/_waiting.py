"""Publishing this rank's counters and waiting on a peer's.

A waiter spins briefly when every rank has a core, then yields, then blocks in ``futex(2)`` on the counter with a
short timeout, so that N ranks on fewer cores do not starve each other; a publisher wakes the futex only when a
peer has marked itself asleep. How long a wait spins is :class:`SpinPolicy`'s to say: a wait that a full spin did not
catch halves the next spin (it had to block, or it ended right after a yield that gave this rank's core away: a busy
machine, or the peer waited for runs on this rank's core, where spinning only keeps it from running), and a wait
that a full spin would have caught restores it. Between futex sleeps a waiter asks its
:class:`~allreduce.runtime.shm._watch.PeerWatch` whether a peer died, closed or gave up, and at the deadline it
raises the watch's timeout error, naming the rank at the root of the wait. A wait blocked for
:data:`~allreduce.runtime._liveness.CHECK_AFTER_S` also asks the group's store now and then whether a peer it waits
for was declared dead (:class:`~allreduce.runtime._liveness.SilenceWatch`): a stopped process has no exit to show.
"""

from __future__ import annotations

import math
import os
import time

from allreduce.runtime._errors import PeerFailureError
from allreduce.runtime._liveness import CHECK_AFTER_S, SilenceWatch
from allreduce.runtime.shm._layout import NOT_WAITING, SLEEPERS_WORD, WAITING_FOR_WORD
from allreduce.runtime.shm._linux import futex_wait, futex_wake
from allreduce.runtime.shm._watch import PeerWatch, corrupt_block_error

__all__ = ["MIN_SPIN_S", "POLL_S", "SPIN_S", "YIELD_S", "SpinPolicy", "Waiting"]

SPIN_S = 30e-6
"""A waiter busy-waits this long first when every rank has a core: a handoff then costs well under a microsecond."""

MIN_SPIN_S = 1e-6
"""A spin budget halved below this is zero (a spin shorter than a few reads of the clock catches nothing)."""

YIELD_S = 300e-6
"""Then it gives the core away between checks for this long; then it blocks in futex."""
YIELD_NS = int(YIELD_S * 1e9)

RAN_ELSEWHERE_NS = 5_000
"""A ``sched_yield`` that returns later than this let another task run on this core: one that did not, with its clock
read, takes 0.7-0.8 µs from Python (2026-12-06, 20,000 calls at load 29: 1.6% took longer than this)."""

POLL_S = 0.001
"""Longest a waiter blocks in futex before it re-checks the deadline, dead peers and abort flags."""


class SpinPolicy:
    """How long the next wait busy-waits before it yields, adapted between 0 and ``limit_s``: a wait that a full
    spin would not have caught halves it (below :data:`MIN_SPIN_S`: 0), one that it would have restores it.

    The two ranks of a group of two share one core now and then (the scheduler's placement, on a loaded 2-core
    machine), and a spin there only keeps the peer waited for from running: a 1 MiB all-reduce took a median
    250-300 µs a call placed so, 90 µs on two cores (load 5-7, 2026-12-06), the bimodal busbw of
    benchmarks/bench_runtime.py. Such a wait ends right after a yield that gave the core away, so it halves the spin
    too."""

    __slots__ = ("limit_ns", "spin_ns")

    def __init__(self, limit_s: float) -> None:
        if not limit_s >= 0:
            raise ValueError(f"limit_s must be a non-negative number of seconds, got {limit_s!r}")
        self.limit_ns = int(limit_s * 1e9)
        self.spin_ns = self.limit_ns
        """How long the next wait spins."""

    @classmethod
    def for_group(cls, world_size: int) -> SpinPolicy:
        """:data:`SPIN_S` when every rank of ``world_size`` has a core of this machine, else no spin at all."""
        return cls(SPIN_S if world_size <= (os.cpu_count() or 1) else 0.0)

    def caught(self, waited_ns: int, *, core_given_away: bool) -> None:
        """A wait that yielded was satisfied after ``waited_ns``; ``core_given_away``: another task ran on this
        core just before (then a spin would only have kept it waiting, whatever ``waited_ns``)."""
        if waited_ns <= self.limit_ns and not core_given_away:
            self.spin_ns = self.limit_ns
        else:
            self.blocked()

    def blocked(self) -> None:
        """A wait yielded its whole time and blocks in futex (or a full spin would not have caught it)."""
        halved = self.spin_ns // 2
        self.spin_ns = halved if halved >= MIN_SPIN_S * 1e9 else 0


class Waiting:
    """Rank ``rank``'s counters and its waits on its peers' (``views``: every rank's control block as int64 words,
    this rank's included; ``addresses``: where each block is mapped in this process, the futex keys).

    ``watch`` is asked while a wait blocks; ``policy`` says how long a wait spins first."""

    def __init__(
        self, rank: int, views: list[memoryview], addresses: list[int], *, watch: PeerWatch, policy: SpinPolicy
    ) -> None:
        self.rank = rank
        self.watch = watch
        self.policy = policy
        self.silence: SilenceWatch | None = None
        """The group's look at the ranks its store declared dead (None: the store has no lease, or there is none)."""
        self.wait_began = 0
        """When the last wait that had to wait began (``time.perf_counter_ns``): the recorder's mark for a receive
        that read no clock before its wait."""
        self._views = views
        self._own = views[rank]
        self._address = addresses[rank]
        self._addresses = addresses
        self._sleepers = self._own[SLEEPERS_WORD : SLEEPERS_WORD + len(views)]
        """This rank's "asleep in futex" flags, one per rank that waits on it."""

    def publish(self, word: int, value: int) -> None:
        """Set this rank's counter ``word`` to ``value`` and wake the peers asleep on this rank's block."""
        self._own[word] = value
        # A syscall only when someone sleeps: most handoffs are caught by the waiter's spin. A waiter that
        # registers just as we look may miss this wake; its futex timeout (POLL_S) bounds the cost.
        if any(self._sleepers):
            futex_wake(self._address + 8 * word)

    def wake(self, words: tuple[int, ...]) -> None:
        """Wake every peer asleep on any of this rank's counters ``words`` (whether or not it marked itself)."""
        for word in words:
            futex_wake(self._address + 8 * word)

    def wait(
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
        policy = self.policy
        spin_until = start + policy.spin_ns
        while now < spin_until:
            if view[word] >= target:
                return now - start
            now = clock()
        yield_until = start + YIELD_NS
        while now < yield_until:
            os.sched_yield()
            then, now = now, clock()
            if view[word] >= target:
                # Judged by the last yield alone (no work per turn of the loop): on a shared core the peer ran in
                # it, and published what this wait was for.
                policy.caught(now - start, core_given_away=now - then > RAN_ELSEWHERE_NS)
                return now - start
        policy.blocked()
        address = self._addresses[peer] + 8 * word
        sleeper = SLEEPERS_WORD + self.rank
        me = self._own
        # Read by ranks that time out waiting for this one (blame's chain). Cleared only when the wait succeeds: a
        # rank that gave up keeps saying whom it waited for, so a rank timing out just after it still follows the
        # chain through it to the root.
        me[WAITING_FOR_WORD] = peer
        silence = self.silence
        ask_store_at = time.monotonic() + CHECK_AFTER_S if silence is not None else math.inf
        while True:
            seen = view[word]
            if seen >= target:
                break
            if floor is not None and seen < floor:
                raise corrupt_block_error(self.rank, peer, word_name, seen, seq=seq, step=step)
            self.watch.check(peer, word, target, seq=seq, what=what, step=step)
            now_s = time.monotonic()
            if now_s >= deadline:
                if view[word] >= target:
                    break
                raise self.watch.timeout_error(peer, seq=seq, what=what, step=step)
            if now_s >= ask_store_at and silence is not None:
                watched = [p for p in range(len(self._views)) if p != self.rank] if peer == self.rank else [peer]
                try:
                    silence.check(watched, now_s, seq=seq, what=what, step=step if step >= 0 else None)
                except PeerFailureError:
                    if view[word] >= target:  # it did its part before it went silent
                        break
                    raise
            view[sleeper] = 1
            if view[word] == seen:
                futex_wait(address, seen, min(POLL_S, deadline - now_s))
            view[sleeper] = 0
        me[WAITING_FOR_WORD] = NOT_WAITING
        return clock() - start

    def release(self) -> None:
        """Let go of this rank's control block (before it is unmapped)."""
        self._sleepers.release()
