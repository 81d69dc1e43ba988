"""The shrink's agreement on who is left, over a real store with one client per rank (threads in this process):
one survivor decides, the others wait for its list; a decider that dies hands the decision on; a rank that checks
in after the list was written is told it was left out."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from allreduce.runtime import ShrinkError
from allreduce.runtime.elastic._elastic import SHRINK_PREFIX, agree_members
from allreduce.runtime.store._store import TCPStore


class _Counted(TCPStore):
    """The real client, counting the requests it sends."""

    requests = 0

    def _request(self, *args: Any, **kwargs: Any) -> tuple[int, bytes]:
        self.requests += 1
        return super()._request(*args, **kwargs)


def _stores(world_size: int) -> list[TCPStore]:
    host = _Counted("127.0.0.1", 0, is_server=True, world_size=world_size, rank=0, timeout_s=60)
    clients = [
        _Counted("127.0.0.1", host.port, is_server=False, world_size=world_size, rank=r, timeout_s=60)
        for r in range(1, world_size)
    ]
    return [host, *clients]


def _die(store: TCPStore) -> None:
    """The connection drops without a close, as when the process is killed: the store marks the rank dead."""
    sock = store._sock
    assert sock is not None
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def _wait_dead(store: TCPStore, ranks: Sequence[int]) -> None:
    deadline = time.monotonic() + 30
    while not set(ranks) <= set(store.dead_ranks()):
        assert time.monotonic() < deadline, store.dead_ranks()
        time.sleep(0.01)


def _agree_in_threads(
    stores: Sequence[TCPStore], ranks: Sequence[int], members: Sequence[int], *, timeout_s: float = 30
) -> tuple[dict[int, Any], list[threading.Thread]]:
    """Start agree_members on ``ranks`` (each rank's count is its rank + 100); the results (or exceptions) fill in
    as the threads end."""
    results: dict[int, Any] = {}

    def run(rank: int) -> None:
        try:
            results[rank] = agree_members(
                stores[rank], rank, members, epoch=1, timeout_s=timeout_s, completed=rank + 100
            )
        except Exception as exc:  # the test reads it
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    return results, threads


def _join(threads: Sequence[threading.Thread]) -> None:
    for t in threads:
        t.join(120)
        assert not t.is_alive()


def _close(stores: Sequence[TCPStore], skip: Callable[[int], bool] = lambda r: False) -> None:
    for r in range(len(stores) - 1, -1, -1):
        if not skip(r):
            stores[r].close()


def test_survivors_of_dead_ranks_agree_on_one_list_and_only_the_decider_reads_the_check_ins() -> None:
    world = 24
    stores = _stores(world)
    dead = [5, 11, 17]
    for r in dead:
        _die(stores[r])
    _wait_dead(stores[0], dead)
    before = [s.requests for s in stores]  # type: ignore[attr-defined]
    survivors = [r for r in range(world) if r not in dead]
    results, threads = _agree_in_threads(stores, survivors, range(world))
    _join(threads)
    expected = (survivors, [r + 100 for r in survivors])
    assert all(results[r] == expected for r in survivors), results
    made = {r: stores[r].requests - before[r] for r in survivors}  # type: ignore[attr-defined]
    # Every survivor but the decider: check in (2), claim (1), who decides (1), its list (1).
    assert sorted(made.values())[:-1] == [5] * (len(survivors) - 1), made
    _close(stores, skip=lambda r: r in dead)


def test_when_the_decider_dies_before_writing_the_list_the_next_round_decides_without_it() -> None:
    world = 8
    stores = _stores(world)
    first, rest = _agree_in_threads(stores, [3], range(world))
    deadline = time.monotonic() + 30
    while not stores[0].check([f"{SHRINK_PREFIX}/1/decider/r0"]):  # rank 3 decides, waiting for the others
        assert time.monotonic() < deadline
        time.sleep(0.01)
    _die(stores[3])
    _join(rest)
    assert isinstance(first[3], ShrinkError)
    _wait_dead(stores[0], [3])
    survivors = [r for r in range(world) if r != 3]
    results, threads = _agree_in_threads(stores, survivors, range(world))
    _join(threads)
    expected = (survivors, [r + 100 for r in survivors])
    assert all(results[r] == expected for r in survivors), results
    _close(stores, skip=lambda r: r == 3)


def test_a_rank_that_checks_in_after_the_list_was_written_is_told_it_was_left_out() -> None:
    world = 4
    stores = _stores(world)
    results, threads = _agree_in_threads(stores, [0, 1, 2], range(world), timeout_s=0.5)  # rank 3: stopped
    _join(threads)
    assert all(results[r] == ([0, 1, 2], [100, 101, 102]) for r in range(3)), results
    late, threads = _agree_in_threads(stores, [3], range(world))
    _join(threads)
    assert isinstance(late[3], ShrinkError), late
    assert "left out" in str(late[3])
    _close(stores)
