"""A client that takes a rank's seat in the store before the real rank: what the real rank, a waiter and the death
report are told. Real store, real processes: the impostor is a rank process (rank_processes.RANKS) holding rank 1's
seat."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from rank_processes import RANKS

from allreduce.runtime import CollectiveTimeoutError, PeerFailureError, ProtocolError
from allreduce.runtime.store._store import TCPStore

WORLD_SIZE = 3
TIMEOUT_S = 60.0  # only turns a hang into a failure


@pytest.fixture(autouse=True)
def no_env_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ALLREDUCE_TOKEN", raising=False)


def _impostor(port: int, ready: Any, release: Any) -> None:
    """Take rank 1's seat, say so, and hold it until told to leave (or killed)."""
    store = TCPStore("127.0.0.1", port, is_server=False, world_size=WORLD_SIZE, rank=1, timeout_s=TIMEOUT_S)
    ready.put("seated")
    release.get(timeout=TIMEOUT_S)
    store.close()


@dataclass
class Contest:
    host: TCPStore
    impostor: Any  # the process holding rank 1's seat
    refusal: ProtocolError  # what the real rank 1 was told


def _client(port: int, rank: int) -> TCPStore:
    return TCPStore("127.0.0.1", port, is_server=False, world_size=WORLD_SIZE, rank=rank, timeout_s=TIMEOUT_S)


@pytest.fixture
def contest() -> Iterator[Contest]:
    """The impostor holds rank 1's seat; the real rank 1 has just been refused."""
    with TCPStore("127.0.0.1", 0, is_server=True, world_size=WORLD_SIZE, rank=0, timeout_s=TIMEOUT_S) as host:
        ready, release = RANKS.Queue(), RANKS.Queue()
        impostor = RANKS.Process(target=_impostor, args=(host.port, ready, release), daemon=True)
        impostor.start()
        try:
            assert ready.get(timeout=TIMEOUT_S) == "seated"
            with pytest.raises(ProtocolError) as refused:
                _client(host.port, 1)
            yield Contest(host, impostor, refused.value)
        finally:
            impostor.kill()
            impostor.join(timeout=TIMEOUT_S)


@pytest.mark.slow
def test_the_refused_rank_is_told_who_holds_its_seat(contest: Contest) -> None:
    message = str(contest.refusal)
    assert "rank 1 is already connected, from 127.0.0.1:" in message
    assert f"(pid {contest.impostor.pid})" in message
    assert "another process took rank 1's seat" in message
    assert "set ALLREDUCE_TOKEN" in message


@pytest.mark.slow
def test_a_timed_out_waiter_is_told_the_rank_was_refused_because_its_seat_was_held(contest: Contest) -> None:
    with pytest.raises(CollectiveTimeoutError) as info:
        contest.host.get("addr/1", timeout_s=0.5)
    message = str(info.value)
    assert "rank 1 tried to connect and was refused (rank 1 is already connected, from 127.0.0.1:" in message
    assert f"(pid {contest.impostor.pid})" in message


@pytest.mark.slow
def test_when_the_seat_holder_dies_the_report_says_the_seat_was_contested(contest: Contest) -> None:
    with _client(contest.host.port, 2) as rank_2:
        contest.impostor.kill()
        contest.impostor.join(timeout=TIMEOUT_S)
        with pytest.raises(PeerFailureError) as info:
            rank_2.get("addr/1", timeout_s=TIMEOUT_S)
    message = str(info.value)
    assert info.value.peer == 1
    assert "rank 1's seat in the store was held by a client from 127.0.0.1:" in message
    assert f"(pid {contest.impostor.pid}), which left without close()" in message
    assert "a client from 127.0.0.1:" in message
    assert "claiming rank 1 was refused, so the one that left may not have been the real rank 1" in message
    assert "set ALLREDUCE_TOKEN" in message


@pytest.mark.slow
def test_a_seat_holder_that_was_never_contested_is_reported_dead_naming_its_address_and_pid() -> None:
    with TCPStore("127.0.0.1", 0, is_server=True, world_size=WORLD_SIZE, rank=0, timeout_s=TIMEOUT_S) as host:
        ready, release = RANKS.Queue(), RANKS.Queue()
        holder = RANKS.Process(target=_impostor, args=(host.port, ready, release), daemon=True)
        holder.start()
        try:
            assert ready.get(timeout=TIMEOUT_S) == "seated"
        finally:
            holder.kill()
            holder.join(timeout=TIMEOUT_S)
        with pytest.raises(PeerFailureError) as info:
            host.get("addr/1", timeout_s=TIMEOUT_S)
    message = str(info.value)
    assert "rank 1 disconnected from the store without close() (process died?)" in message
    assert "its seat was held by a client from 127.0.0.1:" in message
    assert f"(pid {holder.pid})" in message
    assert "refused" not in message


def test_a_host_refused_its_own_seat_lingers_to_tell_the_ranks_that_join_why() -> None:
    """Another client took the hosting rank's seat before the host's own client: the host gives up, and its store
    stays up (for a while) to refuse the ranks that join with the reason, rather than vanish so that they time out
    trying to reach it."""
    from allreduce.runtime.store._store_server import StoreServer
    from allreduce.runtime.tcp._listener import listening_socket

    server = StoreServer(listening_socket("127.0.0.1", backlog=8), world_size=WORLD_SIZE, token=None, single_group=True)
    impostor = _client(server.port, 0)
    try:
        with pytest.raises(ProtocolError, match="rank 0 is already connected"):
            _client(server.port, 0)  # the host's own client, refused: what TCPStore(is_server=True) then does
        server.fail(0, "rank 0's seat was taken by another client")
        lingering = threading.Thread(target=lambda: (server.wait_until_told(TIMEOUT_S), server.stop()), daemon=True)
        lingering.start()
        with pytest.raises(
            ProtocolError, match=r"the group failed before rank 1 joined: rank 0 gave up: rank 0.s seat was taken"
        ):
            TCPStore("127.0.0.1", server.port, is_server=False, world_size=WORLD_SIZE, rank=1, timeout_s=5.0)
    finally:
        impostor.close()
        server.stop()
