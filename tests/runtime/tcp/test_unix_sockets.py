"""Ranks of one host that share a token connect over Unix sockets: same handshake, same frames, exact sums, and
TCP when they can't.

Every rank is a :class:`TcpTransport` of its own in a thread of this process (real sockets, real listeners);
a rank process killed mid-collective over a Unix socket is in ``tests/runtime/tcp/test_tcp.py`` (the ``unix`` cases).
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from allreduce.runtime import ChecksumError, PeerFailureError, ProtocolError, compile_plan
from allreduce.runtime.store._store import TCPStore
from allreduce.runtime.tcp import ClientHello, TcpTransport, connect_handshake
from allreduce.runtime.tcp._socket import UNIX_SHARED_CORES_SNDBUF_BYTES, UNIX_SNDBUF_BYTES
from allreduce.runtime.tcp._transport import THREAD_MIN_BYTES, UNIX_ENV
from allreduce.schedules import all_reduce

TIMEOUT_S = 60.0
TOKEN = "s3cret"
# Odd, and large enough that a ring step's sends go through the sender thread at N=3.
LARGE_COUNT = (3 << 19) + 7


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ALLREDUCE_TOKEN", raising=False)
    monkeypatch.delenv(UNIX_ENV, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)


@pytest.fixture
def store() -> Iterator[TCPStore]:
    with TCPStore("127.0.0.1", 0, is_server=True, world_size=8, rank=-1, timeout_s=TIMEOUT_S) as server:
        yield server


def add_into(dst: np.ndarray, src: np.ndarray) -> None:
    np.add(dst, src, out=dst)


def rank_data(rank: int, count: int) -> np.ndarray:
    return np.arange(count, dtype=np.int64) * (rank + 1) + rank


def exact_sum(world_size: int, count: int) -> np.ndarray:
    return np.arange(count, dtype=np.int64) * (world_size * (world_size + 1) // 2) + world_size * (world_size - 1) // 2


def on_every_rank(world_size: int, body: Callable[[int], Any]) -> list[Any]:
    """``body(rank)`` in one thread per rank; the results by rank (re-raises the first rank's error)."""
    results: list[Any] = [None] * world_size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = body(rank)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=4 * TIMEOUT_S)
    assert not any(thread.is_alive() for thread in threads), "a rank never finished"
    if errors:
        raise errors[0]
    return results


def ring_all_reduce(
    store: TCPStore,
    world_size: int,
    count: int,
    *,
    unix_sockets: Callable[[int], bool | None] = lambda rank: None,
    token: str | None = TOKEN,
    checksum: bool = False,
    before: Callable[[int, TcpTransport], None] = lambda rank, transport: None,
    sender_thread: bool | None = None,
) -> list[tuple[bool, dict[str, int]]]:
    """A ring all-reduce on every rank: (whether its result is the exact sum, its transport's statistics)."""
    transports = [
        TcpTransport(
            r,
            world_size,
            store,
            token=token,
            timeout_s=TIMEOUT_S,
            unix_sockets=unix_sockets(r),
            sender_thread=sender_thread,
        )
        for r in range(world_size)
    ]

    def body(rank: int) -> tuple[bool, dict[str, int]]:
        buffer = rank_data(rank, count)
        before(rank, transports[rank])
        plan = compile_plan(all_reduce("ring", world_size, segments=2), rank, count)
        transports[rank].execute(plan, buffer, add_into, seq=0, timeout_s=TIMEOUT_S, checksum=checksum)
        return bool(np.array_equal(buffer, exact_sum(world_size, count))), dict(transports[rank].statistics())

    try:
        return on_every_rank(world_size, body)
    finally:
        for transport in transports:
            transport.close()


@pytest.mark.parametrize("world_size", [2, 3, 5])
def test_ranks_of_one_host_connect_over_unix_sockets(store: TCPStore, world_size: int) -> None:
    for rank, (exact, stats) in enumerate(ring_all_reduce(store, world_size, 1001)):
        assert exact, f"rank {rank}"
        # A ring: one connection to each neighbour (one neighbour at N=2).
        assert stats["unix_connections"] == min(world_size - 1, 2), f"rank {rank}"


@pytest.mark.parametrize("sender_thread", [True, False], ids=["sender-thread", "calling-thread"])
def test_large_messages_over_unix_sockets_are_exact(store: TCPStore, sender_thread: bool) -> None:
    assert LARGE_COUNT * 8 // 3 >= THREAD_MIN_BYTES
    for rank, (exact, stats) in enumerate(ring_all_reduce(store, 3, LARGE_COUNT, sender_thread=sender_thread)):
        assert exact, f"rank {rank}"
        assert (stats["sender_handoffs"] > 0) == sender_thread, f"rank {rank}"


CPUS = len(os.sched_getaffinity(0))


@pytest.mark.parametrize("ranks_here", [1, CPUS, CPUS + 1])
def test_unix_send_buffers_grow_only_where_the_hosts_ranks_outnumber_its_cores(
    store: TCPStore, monkeypatch: pytest.MonkeyPatch, ranks_here: int
) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks_here))
    asked = UNIX_SHARED_CORES_SNDBUF_BYTES if ranks_here > CPUS else UNIX_SNDBUF_BYTES
    with open("/proc/sys/net/core/wmem_max") as f:
        cap = int(f.read())
    for rank, (exact, stats) in enumerate(ring_all_reduce(store, 2, 1001)):
        assert exact, f"rank {rank}"
        # the kernel caps what is asked at net.core.wmem_max, then doubles it for its bookkeeping
        assert stats["largest_unix_send_buffer_bytes"] == 2 * min(asked, cap), f"rank {rank}"


def test_unix_sockets_off_keeps_every_connection_on_tcp(store: TCPStore) -> None:
    for rank, (exact, stats) in enumerate(ring_all_reduce(store, 3, 1001, unix_sockets=lambda rank: False)):
        assert exact, f"rank {rank}"
        assert stats["unix_connections"] == 0, f"rank {rank}"


def test_the_environment_turns_unix_sockets_off(store: TCPStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(UNIX_ENV, "0")
    assert all(stats["unix_connections"] == 0 for _, stats in ring_all_reduce(store, 2, 1001))


def test_without_a_shared_token_the_group_secret_opens_unix_sockets(store: TCPStore) -> None:
    # Without ALLREDUCE_TOKEN the ranks authenticate each other with the secret the store gave the ranks it admitted.
    for rank, (exact, stats) in enumerate(ring_all_reduce(store, 3, 1001, token=None)):
        assert exact, f"rank {rank}"
        assert stats["unix_connections"] > 0, f"rank {rank}"


def test_a_rank_without_unix_sockets_is_reached_over_tcp(store: TCPStore) -> None:
    # Rank 1 does not publish a Unix socket: its connections (to rank 0 and from rank 2) are TCP, 0-2 is Unix.
    results = ring_all_reduce(store, 3, 1001, unix_sockets=lambda rank: False if rank == 1 else None)
    assert [exact for exact, _ in results] == [True, True, True]
    assert [stats["unix_connections"] for _, stats in results] == [1, 0, 1]


def test_corruption_over_a_unix_socket_is_caught(store: TCPStore) -> None:
    def corrupt(rank: int, transport: TcpTransport) -> None:
        if rank == 1:
            transport.inject_corruption(peer=0, step=0)

    with pytest.raises(ChecksumError, match="rank 1 -> rank 0"):
        ring_all_reduce(store, 2, 1001, checksum=True, before=corrupt)


def _unix_client(store: TCPStore, token: str | None) -> socket.socket:
    """A raw client of rank 0's Unix socket (as rank 1 of 2) through the handshake."""
    key, _, name_hex = store.get("tcp/unix/0").partition(b"\n")
    assert key, "rank 0 published no Unix socket"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(TIMEOUT_S)
    try:
        sock.connect(bytes.fromhex(name_hex.decode()))
        connect_handshake(
            sock,
            b"tcp",
            None if token is None else token.encode(),
            ClientHello(rank=1, world_size=2, target=0),
            what="rank 0's Unix socket",
        )
    except BaseException:
        sock.close()
        raise
    return sock


def test_a_unix_connection_with_the_token_is_admitted(store: TCPStore) -> None:
    with TcpTransport(0, 2, store, token=TOKEN, timeout_s=TIMEOUT_S) as transport:
        _unix_client(store, TOKEN).close()
        assert transport.failure is None


def test_a_unix_connection_with_a_wrong_token_is_refused(store: TCPStore) -> None:
    with TcpTransport(0, 2, store, token=TOKEN, timeout_s=TIMEOUT_S), pytest.raises(ProtocolError):
        _unix_client(store, "guess")


def test_a_unix_connection_without_the_token_is_refused(store: TCPStore) -> None:
    with TcpTransport(0, 2, store, token=TOKEN, timeout_s=TIMEOUT_S), pytest.raises(ProtocolError):
        _unix_client(store, None)


def test_a_rank_of_another_group_is_refused_over_a_unix_socket(store: TCPStore) -> None:
    # The same checks as over TCP: a hello for another world size is turned away.
    with TcpTransport(0, 3, store, token=TOKEN, timeout_s=TIMEOUT_S), pytest.raises(ProtocolError, match="world size"):
        _unix_client(store, TOKEN)


def test_a_peer_that_exited_is_named_when_its_unix_socket_refuses(store: TCPStore) -> None:
    # Rank 0 published its names and closed (as a process that exited): rank 1's connection is refused.
    TcpTransport(0, 2, store, token=TOKEN, timeout_s=TIMEOUT_S).close()
    with TcpTransport(1, 2, store, token=TOKEN, timeout_s=TIMEOUT_S) as transport:
        plan = compile_plan(all_reduce("ring", 2), 1, 8)
        with pytest.raises(PeerFailureError, match="rank 0 refused a connection on its Unix socket") as caught:
            transport.execute(plan, rank_data(1, 8), add_into, seq=0, timeout_s=TIMEOUT_S, checksum=False)
        assert caught.value.peer == 0


def test_a_client_without_an_address_is_answered(store: TCPStore) -> None:
    # A Unix client that did not bind has no address; the listener still answers it (here: refuses the token).
    with TcpTransport(0, 2, store, token=TOKEN, timeout_s=TIMEOUT_S) as transport:
        name_hex = store.get("tcp/unix/0").partition(b"\n")[2]
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(TIMEOUT_S)
            sock.connect(bytes.fromhex(name_hex.decode()))
            hello = ClientHello(rank=1, world_size=2, target=0)
            with pytest.raises(ProtocolError):
                connect_handshake(sock, b"tcp", b"guess", hello, what="rank 0's Unix socket")
        assert transport.failure is None
