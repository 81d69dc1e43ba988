"""Shrinking a group after ranks died: the survivors agree through the store on who is left, then go on as a
smaller group with ranks renumbered in their old order.

The agreement (one per shrink, numbered by the group's *epoch*):

1. every survivor checks in (``allreduce/elastic/<epoch>/in/<rank>``);
2. it waits until every rank of the group has checked in or is dead to the store (its store connection dropped
   without a close: the store's own failure detector), or until the timeout, after which ranks that neither
   checked in nor died (a stopped process) are left out;
3. the first survivor to get there (an atomic counter in the store) writes the member list: the ranks that
   checked in and are not dead; every survivor reads that one list.

So every survivor ends with the same list, or raises: a survivor that checked in too late to be on the list
raises :class:`ShrinkError` saying so, and a rank on the list that dies before the new group is connected makes
building the new group fail on every member (that rank is named), after which they may shrink again. The store is
hosted by the group's rank 0: when that process is gone there is nothing to agree through, and every survivor
raises :class:`ShrinkError` naming it (a job that must survive it needs a store outside the ranks).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from allreduce.runtime._errors import CollectiveError, ShrinkError
from allreduce.runtime._store_protocol import ELASTIC_PREFIX
from allreduce.runtime._transport import Transport
from allreduce.schedules import CostModel

__all__ = ["SHRINK_PREFIX", "Lineage", "MemberStore", "Rebuild", "Shrunk", "agree_members", "shrink"]

SHRINK_PREFIX = ELASTIC_PREFIX.rstrip("/")
"""Where the agreements and the shrunk groups' transports keep their keys (the store fails a wait there only for
the death of the rank whose key is awaited)."""
_POLL_S = 0.01


Rebuild = Callable[[Sequence[int], int, int, Any], tuple[Transport, int, CostModel]]
"""``rebuild(members, epoch, new_rank, store)``: the transport, ranks per node and cost model of the shrunk group
whose ranks are ``members`` (the store's numbering), this process being ``new_rank`` of them."""


@dataclass(frozen=True)
class Lineage:
    """How a group came to be, for shrinking it: the transport's maker, this process's rank in the store's
    numbering, the store's ranks of the group's members (in order), and how many times the group has shrunk."""

    rebuild: Rebuild
    store_rank: int
    members: tuple[int, ...]
    epoch: int = 0


def agree_members(store: Any, rank: int, members: Sequence[int], *, epoch: int, timeout_s: float) -> list[int]:
    """The ranks of the shrunk group, the same list on every survivor that returns. Ranks are the store's (the
    numbering of the group as first formed): ``rank`` is this one, ``members`` the current group's."""
    prefix = f"{SHRINK_PREFIX}/{epoch}"
    deadline = time.monotonic() + timeout_s
    try:
        store.set(f"{prefix}/in/{rank}", b"1")
        pending = set(members) - {rank}
        while pending and time.monotonic() < deadline:
            dead = set(store.dead_ranks())
            pending = {r for r in pending if r not in dead and not store.check([f"{prefix}/in/{r}"])}
            if pending:
                time.sleep(_POLL_S)
        if store.add(f"{prefix}/decided", 1) == 1:
            dead = set(store.dead_ranks())
            chosen = [r for r in members if r not in dead and store.check([f"{prefix}/in/{r}"])]
            store.set(f"{prefix}/members", ",".join(str(r) for r in chosen).encode())
        remaining = max(deadline - time.monotonic(), 1.0)
        members_text = store.get(f"{prefix}/members", timeout_s=remaining).decode()
    except (CollectiveError, OSError) as exc:
        if isinstance(exc, ShrinkError):
            raise
        host_lost = bool(getattr(store, "host_lost", False))
        why = (
            "rank 0, which hosts the store the survivors agree through, is gone"
            if host_lost or rank == 0
            else f"the store did not answer ({exc})"
        )
        raise ShrinkError(f"rank {rank}: cannot shrink the group: {why}", rank=rank, peer=0) from exc
    agreed = [int(r) for r in members_text.split(",") if r]
    if rank not in agreed:
        raise ShrinkError(
            f"rank {rank}: left out of the shrunk group (it checked in after the others agreed on ranks "
            f"{', '.join(map(str, agreed))})",
            rank=rank,
        )
    return agreed


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

    def dead_ranks(self) -> list[int]:
        return sorted(self._new_rank[r] for r in self._store.dead_ranks() if r in self._new_rank)

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


def shrink(store: Any, lineage: Lineage, *, timeout_s: float, close: Callable[[], None]) -> Shrunk:
    """Agree on the survivors, ``close()`` the old group (its transport; the store is kept), make the new one's
    parts. ``store`` is the old group's (a :class:`MemberStore` after an earlier shrink)."""
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s}")
    root = store.inner if isinstance(store, MemberStore) else store
    epoch = lineage.epoch + 1
    try:
        members = agree_members(root, lineage.store_rank, lineage.members, epoch=epoch, timeout_s=timeout_s)
    except BaseException:
        close()
        root.close()
        raise
    close()
    new_rank = members.index(lineage.store_rank)
    view = MemberStore(root, members)
    try:
        transport, group_size, model = lineage.rebuild(members, epoch, new_rank, view)
    except CollectiveError as exc:
        root.close()
        raise ShrinkError(
            f"rank {new_rank} (rank {lineage.store_rank} before): the shrunk group of ranks "
            f"{', '.join(map(str, members))} could not connect: {exc}",
            rank=new_rank,
            peer=exc.peer,
        ) from exc
    except BaseException:
        root.close()
        raise
    return Shrunk(
        transport, group_size, model, view, Lineage(lineage.rebuild, lineage.store_rank, tuple(members), epoch)
    )
