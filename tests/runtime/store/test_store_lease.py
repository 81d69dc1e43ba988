"""The store's lease: a rank it hears nothing from for a lease is dead (as if its connection had dropped), its seat
is free, and it learns so if it ever runs again; heartbeats keep a live rank alive; a client that bounds its wait
for an answer finds a stopped store host.

Silent ranks are real: a connection that passed the real handshake and then says nothing, or a real client process
stopped with SIGSTOP. Timing assertions are orderings against the lease, never absolute times.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from rank_processes import RANKS

from allreduce.runtime import CollectiveTimeoutError, PeerFailureError
from allreduce.runtime._liveness import BEATS_PER_LEASE
from allreduce.runtime.store._store import ANSWER_MARGIN_S, TCPStore
from allreduce.runtime.tcp import ClientHello, connect_handshake

TOKEN = b"lease-token"
LEASE_S = 1.0
DECLARED_WITHIN_S = 15 * LEASE_S  # a loaded machine delays the server's sweep: far more than enough


@pytest.fixture
def host() -> Iterator[TCPStore]:
    store = TCPStore("127.0.0.1", 0, is_server=True, world_size=3, rank=0, timeout_s=30, token=TOKEN, lease_s=LEASE_S)
    yield store
    store.close(wait_for_ranks_s=0)


def _silent_rank(port: int, rank: int) -> socket.socket:
    """A connection that takes ``rank``'s seat with the real handshake, then never says anything: a silent rank."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    connect_handshake(sock, b"store", TOKEN, ClientHello(rank=rank, world_size=3, target=0), what="store")
    return sock


def _until_dead(store: TCPStore, rank: int, within_s: float) -> float:
    """Seconds until ``store`` reports ``rank`` dead (asking every 50 ms), or ``within_s`` if it never does."""
    start = time.monotonic()
    while time.monotonic() - start < within_s:
        if rank in store.dead_ranks():
            return time.monotonic() - start
        time.sleep(0.05)
    return within_s


def test_a_rank_that_says_nothing_for_a_lease_is_declared_dead(host: TCPStore) -> None:
    with _silent_rank(host.port, 1):
        took = _until_dead(host, 1, DECLARED_WITHIN_S)
    assert took < DECLARED_WITHIN_S


def test_a_silent_rank_is_not_declared_dead_before_its_lease(host: TCPStore) -> None:
    with _silent_rank(host.port, 1):
        took = _until_dead(host, 1, DECLARED_WITHIN_S)
    assert took >= LEASE_S


def test_a_wait_for_a_silent_ranks_key_fails_naming_it(host: TCPStore) -> None:
    with _silent_rank(host.port, 1), pytest.raises(PeerFailureError) as info:
        host.get("addr/1", timeout_s=DECLARED_WITHIN_S)
    assert info.value.peer == 1
    assert f"past its lease of {LEASE_S:g} s" in str(info.value)


@pytest.mark.slow  # waits out several leases (3-4 s): in `make test`, not the edit loop
def test_heartbeats_keep_an_idle_rank_alive_for_many_leases(host: TCPStore) -> None:
    with TCPStore("127.0.0.1", host.port, is_server=False, world_size=3, rank=1, token=TOKEN) as client:
        time.sleep(4 * LEASE_S)
        assert host.dead_ranks() == []
        assert client.dead_ranks() == []


@pytest.mark.slow  # waits out several leases (3-4 s): in `make test`, not the edit loop
def test_every_client_beats_at_the_hosts_lease(host: TCPStore) -> None:
    with TCPStore("127.0.0.1", host.port, is_server=False, world_size=3, rank=1, token=TOKEN) as client:
        time.sleep(3 * LEASE_S)
        assert client.lease_s == LEASE_S
        assert LEASE_S / BEATS_PER_LEASE <= host.heartbeat_gaps()[1] < LEASE_S


def test_the_seat_of_a_rank_declared_dead_is_free_for_a_new_process(host: TCPStore) -> None:
    with _silent_rank(host.port, 1):
        _until_dead(host, 1, DECLARED_WITHIN_S)
        with TCPStore("127.0.0.1", host.port, is_server=False, world_size=3, rank=1, token=TOKEN) as again:
            again.set("addr/1", b"back")
            assert host.dead_ranks() == []


@pytest.mark.slow  # waits out several leases (3-4 s): in `make test`, not the edit loop
def test_without_a_lease_a_silent_rank_is_never_declared_dead() -> None:
    with TCPStore("127.0.0.1", 0, is_server=True, world_size=3, rank=0, timeout_s=30, token=TOKEN) as unleased:
        with _silent_rank(unleased.port, 1):
            time.sleep(3 * LEASE_S)
            assert unleased.dead_ranks() == []
        unleased.close(wait_for_ranks_s=0)


# ----------------------------------------------------------------------------------------------------------------
# Real processes stopped with SIGSTOP
# ----------------------------------------------------------------------------------------------------------------
@pytest.fixture
def processes() -> Iterator[list[Any]]:
    """Processes a test starts; every one is woken and killed at the end, whatever happened."""
    started: list[Any] = []
    yield started
    for process in started:
        if process.is_alive():
            process.kill()  # SIGKILL ends a stopped rank too, and kill() allows one that ended since is_alive()
        process.join(timeout=30)


def _stop(pid: int) -> None:
    """SIGSTOP ``pid`` and return once it is stopped (its state T in /proc: the signal is delivered asynchronously)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            if stat.read().rpartition(b")")[2].split()[0] == b"T":
                return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop")


def _client_that_is_stopped(port: int, out: Any, go: Any) -> None:
    """Rank 1's client: says it is ready, is stopped and woken by the test, and then reports what its next request
    raised."""
    store = TCPStore("127.0.0.1", port, is_server=False, world_size=3, rank=1, token=TOKEN)
    out.put("ready")
    go.get(timeout=120)
    try:
        store.set("after/1", b"woken")
        out.put("no error")
    except PeerFailureError as exc:
        out.put(str(exc))
    store.close()


def test_a_rank_declared_dead_is_told_so_when_it_runs_again(host: TCPStore, processes: list[Any]) -> None:
    ctx = RANKS
    out, go = ctx.Queue(), ctx.Queue()
    process = ctx.Process(target=_client_that_is_stopped, args=(host.port, out, go))
    processes.append(process)
    process.start()
    assert out.get(timeout=60) == "ready"
    _stop(process.pid)
    assert _until_dead(host, 1, DECLARED_WITHIN_S) < DECLARED_WITHIN_S
    os.kill(process.pid, signal.SIGCONT)
    go.put("go")
    assert "the store declared this rank dead" in out.get(timeout=60)


def _hosting_store(out: Any) -> None:
    """Rank 0: hosts a store with a lease and waits to be stopped (and then killed) by the test."""
    store = TCPStore("127.0.0.1", 0, is_server=True, world_size=3, rank=0, token=TOKEN, lease_s=LEASE_S)
    out.put(store.port)
    time.sleep(600)


@pytest.fixture
def client_of_a_stopped_host(processes: list[Any]) -> Iterator[TCPStore]:
    """Rank 1's client of a store (lease 1 s) whose hosting process is then stopped."""
    ctx = RANKS
    out = ctx.Queue()
    process = ctx.Process(target=_hosting_store, args=(out,))
    processes.append(process)
    process.start()
    client = TCPStore("127.0.0.1", out.get(timeout=60), is_server=False, world_size=3, rank=1, token=TOKEN)
    _stop(process.pid)
    yield client
    client.close()


def test_a_bounded_wait_for_an_answer_finds_a_stopped_store_host(client_of_a_stopped_host: TCPStore) -> None:
    with pytest.raises(CollectiveTimeoutError):
        client_of_a_stopped_host.dead_ranks(answer_s=LEASE_S)
    assert client_of_a_stopped_host.host_silent


def test_with_a_lease_a_request_to_a_stopped_store_host_fails_after_the_lease(
    client_of_a_stopped_host: TCPStore,
) -> None:
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match=f"did not answer a request for 'k/1' within {LEASE_S:g} s"):
        client_of_a_stopped_host.set("k/1", b"v")  # without a lease: the client's timeout and 30 s more
    assert time.monotonic() - start < ANSWER_MARGIN_S


def test_a_ranks_store_socket_gives_up_on_unacknowledged_data_after_the_lease(host: TCPStore) -> None:
    # a store host gone from the network acknowledges nothing: the kernel breaks the connection after a lease
    with TCPStore("127.0.0.1", host.port, is_server=False, world_size=3, rank=1, token=TOKEN) as client:
        assert client._sock is not None
        assert client._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == int(LEASE_S * 1000)
