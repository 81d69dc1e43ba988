"""Elastic groups: shrinking after ranks died, growing when a restarted rank asks to come back.

Shrinking: the survivors agree through the store on who is left, then go on as a smaller group with ranks
renumbered in their old order.

The agreement (one per shrink, numbered by the group's *epoch*; :func:`agree_members`):

1. every survivor checks in (an arrival number from a counter, then its rank and count under that number);
2. the first to claim the agreement's round decides: it waits until every rank of the group has checked in or is
   dead to the store (its store connection dropped without a close: the store's own failure detector), or until
   the timeout, after which ranks that neither checked in nor died (a stopped process) are left out;
3. it writes the member list under a key only it may write; the others wait for it (a wait the store fails if the
   decider dies, and the next round is claimed).

So every survivor ends with the same list, or raises: a survivor that checked in too late to be on the list
raises :class:`ShrinkError` saying so, and a rank on the list that dies before the new group is connected makes
building the new group fail on every member (that rank is named), after which they may shrink again. The store is
hosted by the group's rank 0: when that process is gone there is nothing to agree through, and every survivor
raises :class:`ShrinkError` naming it (a job that must survive it needs a store outside the ranks).

Growing: a process takes a free seat of the store (the rank of a process that died and was shrunk out, restarted
with ``ALLREDUCE_JOIN=1``) and writes a join request with a nonce of its own. The members call ``grow()`` at a step
boundary, every member the same number of times: the first to arrive at each call (an atomic counter) lists the
requests of live ranks outside the group whose nonce was never admitted, marks them admitted, tells each joiner
the new epoch and member list (the members in their order, then the joiners), and writes the list for the other
members. Members and joiners then build the grown group's transport together. A request seen by a shrink's
agreement counts as that rank having left the old group (its process is a new one).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from allreduce.runtime._errors import CollectiveError, PeerFailureError, ShrinkError
from allreduce.runtime.store._store_protocol import ELASTIC_PREFIX
from allreduce.runtime.transport._transport import Transport
from allreduce.schedules import CostModel

__all__ = [
    "JOIN_ENV",
    "SHRINK_PREFIX",
    "Lineage",
    "MemberStore",
    "Rebuild",
    "Shrunk",
    "agree_joiners",
    "agree_members",
    "grow",
    "joined",
    "request_join",
    "shrink",
]

SHRINK_PREFIX = ELASTIC_PREFIX.rstrip("/")
"""Where the agreements and the shrunk groups' transports keep their keys (the store fails a wait there only for
the death of the rank whose key is awaited)."""
_POLL_S = 0.01


Rebuild = Callable[[Sequence[int], int, int, Any], tuple[Transport, int, CostModel]]
"""``rebuild(members, epoch, new_rank, store)``: the transport, ranks per node and cost model of the shrunk group
whose ranks are ``members`` (the store's numbering), this process being ``new_rank`` of them."""


@dataclass(frozen=True)
class Lineage:
    """How a group came to be, for shrinking or growing it: the transport's maker, this process's rank in the
    store's numbering, the store's ranks of the group's members (in order), how many times the membership changed,
    and the store's seats (its world size: the ranks that may ever be members)."""

    rebuild: Rebuild
    store_rank: int
    members: tuple[int, ...]
    epoch: int = 0
    seats: int = 0  # 0: as many as the first members

    def next(self, members: Sequence[int]) -> Lineage:
        return Lineage(self.rebuild, self.store_rank, tuple(members), self.epoch + 1, self.seats or len(self.members))


def agree_members(
    store: Any, rank: int, members: Sequence[int], *, epoch: int, timeout_s: float, completed: int = 0
) -> tuple[list[int], list[int]]:
    """The ranks of the shrunk group, the same list on every survivor that returns, and how many of the old group's
    collectives each of them completed (``completed`` is this rank's count, checked in with it). Ranks are the
    store's (the numbering of the group as first formed): ``rank`` is this one, ``members`` the current group's.

    One survivor decides and the others wait for its list, so the store answers O(N) requests, not one per pair of
    ranks: each survivor checks in (its arrival number from a counter, then ``arrived/n<number>`` = rank and count)
    and claims round 0 (a counter); the first decides (:func:`_decide`) and writes ``members/<its rank>``, which
    only it may write. The others wait for that key, a wait the store fails at once if the decider dies; then the
    next round is claimed the same way by a survivor still waiting. A decider that dies between claiming its round
    and naming itself (two requests in a row) leaves the others to the timeout."""
    prefix = f"{SHRINK_PREFIX}/{epoch}"
    deadline = time.monotonic() + timeout_s
    decider = rank
    try:
        arrival = store.add(f"{prefix}/count", 1)
        store.set(f"{prefix}/arrived/n{arrival}", f"{rank}:{int(completed)}".encode())
        for round_ in itertools.count():
            if store.add(f"{prefix}/claim/r{round_}", 1) == 1:
                store.set(f"{prefix}/decider/r{round_}", str(rank).encode())
                decider = rank
                text = _decide(store, prefix, rank, members, deadline)
                break
            # The decider waits for the others until the deadline: wait a little longer for its list.
            remaining = max(deadline - time.monotonic(), 0.0) + _DECIDER_GRACE_S
            decider = int(bytes(store.get(f"{prefix}/decider/r{round_}", timeout_s=remaining)))
            try:
                remaining = max(deadline - time.monotonic(), 0.0) + _DECIDER_GRACE_S
                text = bytes(store.get(f"{prefix}/members/{decider}", timeout_s=remaining)).decode()
                break
            except PeerFailureError as exc:
                if exc.peer != decider:
                    raise
    except (CollectiveError, OSError, ValueError) as exc:
        if isinstance(exc, ShrinkError):
            raise
        host_lost = bool(getattr(store, "host_lost", False))
        why = (
            "rank 0, which hosts the store the survivors agree through, is gone"
            if host_lost or rank == 0
            else f"the store did not answer ({exc})"
            if decider == rank
            else f"rank {decider}, which decides who is left, gave no member list ({exc})"
        )
        raise ShrinkError(f"rank {rank}: cannot shrink the group: {why}", rank=rank, peer=0) from exc
    pairs = [entry.split(":") for entry in text.split(",") if entry]
    agreed, counts = [int(r) for r, _ in pairs], [int(c) for _, c in pairs]
    if rank not in agreed:
        raise ShrinkError(
            f"rank {rank}: left out of the shrunk group (it checked in after the others agreed on ranks "
            f"{', '.join(map(str, agreed))})",
            rank=rank,
        )
    return agreed, counts


_DECIDER_GRACE_S = 5.0
"""How much longer than the agreement's timeout a survivor waits for the decider's list (the decider itself waits
for late ranks until the timeout, then writes it)."""
_JOIN_SCAN_S = 0.2
"""How often the decider asks whether a rank it still waits for has been restarted (its join request)."""


def _decide(store: Any, prefix: str, rank: int, members: Sequence[int], deadline: float) -> str:
    """As the decider: wait until every member has checked in, died (the store's failure detector) or asked to join
    again as a new process, or until ``deadline`` (ranks that did none of these, a stopped process, are left out);
    write ``members/<rank>``: ``r:count`` for each survivor that checked in and is alive, in the group's order."""
    arrived: dict[int, int] = {}
    read = 0  # arrivals 1..read are in ``arrived`` or were written by a rank that died before writing its entry
    unread: set[int] = set()
    pending = set(members)
    next_scan = 0.0
    while True:
        count = int(store.add(f"{prefix}/count", 0))
        for n in [*sorted(unread), *range(read + 1, count + 1)]:
            key = f"{prefix}/arrived/n{n}"
            if store.check([key]):
                who, _, done = bytes(store.get(key)).decode().partition(":")
                arrived[int(who)] = int(done)
                unread.discard(n)
            else:  # counted, not yet written (or its writer died in between)
                unread.add(n)
        read = max(read, count)
        dead = set(store.dead_ranks())
        pending = {r for r in pending if r not in arrived and r not in dead}
        now = time.monotonic()
        if pending and now >= next_scan:  # a restarted process of a rank has left the old group
            pending = {r for r in pending if _join_request(store, r) is None}
            next_scan = now + _JOIN_SCAN_S
        if not pending or now >= deadline:
            break
        time.sleep(_POLL_S)
    dead = set(store.dead_ranks())
    text = ",".join(f"{r}:{arrived[r]}" for r in members if r in arrived and r not in dead)
    store.set(f"{prefix}/members/{rank}", text.encode())
    return text


class MemberStore:
    """The group's store as a shrunk group sees it: ranks renumbered (``members[i]`` is the store's rank of new
    rank ``i``) in the dead ranks and in keys that end in a rank (``.../addr/<rank>``, which the store lets only
    that rank write), everything else passed through."""

    def __init__(self, store: Any, members: Sequence[int]) -> None:
        self._store = store
        self._members = tuple(members)
        self._new_rank = {old: new for new, old in enumerate(members)}

    @property
    def inner(self) -> Any:
        """The store underneath (the next shrink agrees through it, in the store's numbering)."""
        return self._store

    def _key(self, key: str) -> str:
        head, sep, tail = key.rpartition("/")
        if sep and tail.isascii() and tail.isdigit() and int(tail) < len(self._members):
            return f"{head}/{self._members[int(tail)]}"
        return key

    def set(self, key: str, value: bytes) -> None:
        self._store.set(self._key(key), value)

    def get(self, key: str, *, timeout_s: float | None = None) -> bytes:
        return bytes(self._store.get(self._key(key), timeout_s=timeout_s))

    def check(self, keys: Sequence[str]) -> bool:
        return bool(self._store.check([self._key(k) for k in keys]))

    def wait(self, keys: Sequence[str], *, timeout_s: float | None = None) -> None:
        self._store.wait([self._key(k) for k in keys], timeout_s=timeout_s)

    def add(self, key: str, amount: int) -> int:
        return int(self._store.add(self._key(key), amount))

    def delete(self, key: str) -> bool:
        return bool(self._store.delete(self._key(key)))

    def dead_ranks(self, *, answer_s: float | None = None) -> list[int]:
        dead = self._store.dead_ranks() if answer_s is None else self._store.dead_ranks(answer_s=answer_s)
        return sorted(self._new_rank[r] for r in dead if r in self._new_rank)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


@dataclass(frozen=True)
class Shrunk:
    """What the shrunk group is made of."""

    transport: Transport
    group_size: int
    cost_model: CostModel
    store: MemberStore
    lineage: Lineage
    last_agreed_call: int = -1
    """The old group's last collective (its call number, from 0) that every survivor completed; -1: none."""
    ahead: tuple[int, ...] = ()
    """The new ranks that completed the old group's next call too, which the others raised in (a death in the middle
    of a collective lets the ranks that already hold its whole result finish it)."""


def shrink(store: Any, lineage: Lineage, *, timeout_s: float, close: Callable[[], None], completed: int = 0) -> Shrunk:
    """Agree on the survivors and on the last collective all of them completed (``completed``: how many this rank
    did), ``close()`` the old group (its transport; the store is kept), make the new one's parts. ``store`` is the
    old group's (a :class:`MemberStore` after an earlier shrink)."""
    _check_timeout(timeout_s)
    root = store.inner if isinstance(store, MemberStore) else store
    try:
        members, counts = agree_members(
            root, lineage.store_rank, lineage.members, epoch=lineage.epoch + 1, timeout_s=timeout_s,
            completed=completed,
        )  # fmt: skip
        agreed = min(counts)
        if max(counts) > agreed + 1:
            # A collective completes only once every rank has entered it (each checks every rank's descriptor), so
            # no survivor can be two calls ahead of another: counts that far apart are not one group's calls.
            raise ShrinkError(
                f"rank {lineage.store_rank}: the survivors completed {agreed} to {max(counts)} collectives of the old "
                f"group (ranks {', '.join(map(str, members))}: {', '.join(map(str, counts))}); they must differ "
                "by at most one",
                rank=lineage.store_rank,
            )
    except BaseException:
        close()
        root.close()
        raise
    close()
    parts = _connect(root, lineage.next(members), "shrunk")
    ahead = tuple(new for new, count in enumerate(counts) if count > agreed)
    return dataclasses.replace(parts, last_agreed_call=agreed - 1, ahead=ahead)


# ------------------------------------------------------------------------------------------------------------
# Growing: a process takes a free seat of the store (a rank that died and was shrunk out, restarted) and asks to
# join; the members admit it at their next grow() call, all from the one decision the first of them writes.
# ------------------------------------------------------------------------------------------------------------
JOIN_ENV = "ALLREDUCE_JOIN"
"""Set to 1 in a process that joins a running group (``allreduce.init()`` then asks to join instead of forming
the group); the launcher sets it when it restarts a rank."""


def _join_key(store_rank: int) -> str:
    return f"{SHRINK_PREFIX}/join/{store_rank}"  # ends in the rank: only that rank's process may write it


def _join_request(store: Any, store_rank: int) -> str | None:
    """The nonce of ``store_rank``'s pending request to join (not yet admitted), or None."""
    if not store.check([_join_key(store_rank)]):
        return None
    nonce = bytes(store.get(_join_key(store_rank))).decode()
    return None if store.check([f"{SHRINK_PREFIX}/used/n{nonce}"]) else nonce


def request_join(store: Any, store_rank: int, *, timeout_s: float) -> tuple[int, tuple[int, ...]]:
    """Ask to join the running group as ``store_rank`` and wait until its members admit this process: the epoch
    and member list (store ranks) of the group it joins. Each request has a nonce of its own, so a restarted
    process is never taken for an earlier one of the same rank."""
    _check_timeout(timeout_s)
    nonce = secrets.token_hex(8)
    store.set(_join_key(store_rank), nonce.encode())
    try:
        text = bytes(store.get(f"{SHRINK_PREFIX}/admit/n{nonce}", timeout_s=timeout_s)).decode()
    except CollectiveError as exc:
        raise ShrinkError(
            f"rank {store_rank}: asked to join the running group but was not admitted within {timeout_s:g} s "
            f"(its members admit joiners when they call group.grow()): {exc}",
            rank=store_rank,
        ) from exc
    epoch_text, _, members_text = text.partition(":")
    return int(epoch_text), tuple(int(r) for r in members_text.split(","))


def agree_joiners(store: Any, lineage: Lineage, call: int, *, timeout_s: float) -> list[int]:
    """The store ranks admitted at a group's ``call``-th grow() of its epoch (the same list on every member;
    empty when nobody asked). The first member there decides and admits them."""
    prefix = f"{SHRINK_PREFIX}/{lineage.epoch}/grow/{call}"
    if store.add(f"{prefix}/arrived", 1) == 1:
        dead = set(store.dead_ranks())
        asked = {
            r: nonce
            for r in range(lineage.seats or len(lineage.members))
            if r not in lineage.members and r not in dead and (nonce := _join_request(store, r)) is not None
        }
        members = [*lineage.members, *sorted(asked)]
        for nonce in asked.values():
            store.set(f"{SHRINK_PREFIX}/used/n{nonce}", b"1")
            store.set(f"{SHRINK_PREFIX}/admit/n{nonce}", f"{lineage.epoch + 1}:{','.join(map(str, members))}".encode())
        store.set(f"{prefix}/joiners", ",".join(map(str, sorted(asked))).encode())
    text = bytes(store.get(f"{prefix}/joiners", timeout_s=timeout_s)).decode()
    return [int(r) for r in text.split(",") if r]


def grow(store: Any, lineage: Lineage, call: int, *, timeout_s: float, close: Callable[[], None]) -> Shrunk | None:
    """Admit the processes that asked to join (:func:`agree_joiners`): None when none did, else ``close()`` the
    old group and make the parts of the grown one, the joiners numbered after the members."""
    _check_timeout(timeout_s)
    root = store.inner if isinstance(store, MemberStore) else store
    joiners = agree_joiners(root, lineage, call, timeout_s=timeout_s)
    if not joiners:
        return None
    close()
    return _connect(root, lineage.next([*lineage.members, *joiners]), "grown")


def joined(store: Any, lineage: Lineage) -> Shrunk:
    """The parts of the group a joiner was admitted to (``lineage`` holds its epoch and members)."""
    return _connect(store, lineage, "joined")


def _check_timeout(timeout_s: float) -> None:
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s}")


def _connect(root: Any, lineage: Lineage, what: str) -> Shrunk:
    """Build the transport of the group ``lineage`` describes, over the store ``root``."""
    members = lineage.members
    new_rank = members.index(lineage.store_rank)
    view = MemberStore(root, members)
    try:
        transport, group_size, model = lineage.rebuild(members, lineage.epoch, new_rank, view)
    except CollectiveError as exc:
        root.close()
        raise ShrinkError(
            f"rank {new_rank} (rank {lineage.store_rank} of the store): the {what} group of ranks "
            f"{', '.join(map(str, members))} could not connect: {exc}",
            rank=new_rank,
            peer=exc.peer,
        ) from exc
    except BaseException:
        root.close()
        raise
    return Shrunk(transport, group_size, model, view, lineage)
