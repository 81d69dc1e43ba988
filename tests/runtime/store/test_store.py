"""The rendezvous store: real sockets, real processes (rank_processes.RANKS), failures named."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rank_processes import RANKS

from allreduce.runtime import CollectiveTimeoutError, PeerFailureError, ProtocolError
from allreduce.runtime.store._store import TCPStore


@pytest.fixture
def no_env_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ALLREDUCE_TOKEN", raising=False)


def _client(port: int, rank: int, world_size: int, **kwargs: Any) -> TCPStore:
    return TCPStore("127.0.0.1", port, is_server=False, world_size=world_size, rank=rank, timeout_s=60, **kwargs)


# ----------------------------------------------------------------------------------- workers (rank processes)


def _rendezvous_worker(port: int, rank: int, world_size: int, out: Any) -> None:
    store = _client(port, rank, world_size)
    store.set(f"addr/{rank}", f"rank-{rank}".encode())
    arrived = store.add("arrived", 1)
    store.wait([f"addr/{r}" for r in range(world_size)])
    values = [store.get(f"addr/{r}").decode() for r in range(world_size)]
    store.wait(["go"])
    out.put((rank, arrived, values, store.check(["go", "addr/0"]), store.check(["never"])))
    store.close()


def _die_without_close(port: int, rank: int, world_size: int, ready: Any) -> None:
    _client(port, rank, world_size)
    ready.put("connected")
    ready.get()  # the parent's go-ahead; then die the hard way
    os.kill(os.getpid(), signal.SIGKILL)


def _host_store(ready: Any) -> None:
    store = TCPStore("127.0.0.1", 0, is_server=True, world_size=2, rank=0, timeout_s=60)
    ready.put(store.port)
    threading.Event().wait()  # serve until killed


# ----------------------------------------------------------------------------------- tests


@dataclass(frozen=True)
class Rendezvous:
    """What 4 ranks (rank 0 hosting, 1-3 rank processes) saw in one set / add / wait / get / check rendezvous."""

    worker_results: list[tuple[int, int, list[str], bool, bool]]
    host_arrival: int
    final_count: int
    exit_codes: list[int | None]


@pytest.fixture(scope="module")
def rendezvous() -> Rendezvous:
    world_size = 4
    token = os.environ.pop("ALLREDUCE_TOKEN", None)
    try:
        server = TCPStore("127.0.0.1", 0, is_server=True, world_size=world_size, rank=0, timeout_s=60)
        out = RANKS.Queue()
        procs = [RANKS.Process(target=_rendezvous_worker, args=(server.port, r, world_size, out)) for r in range(1, 4)]
        for p in procs:
            p.start()
        server.set("addr/0", b"rank-0")
        own_arrival = server.add("arrived", 1)
        server.wait([f"addr/{r}" for r in range(world_size)])
        server.set("go", b"")
        results = sorted(out.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(timeout=60)
        final = int(server.get("arrived"))
        server.close()
    finally:
        if token is not None:
            os.environ["ALLREDUCE_TOKEN"] = token
    return Rendezvous(results, own_arrival, final, [p.exitcode for p in procs])


@pytest.mark.slow
def test_rendezvous_workers_exit_cleanly(rendezvous: Rendezvous) -> None:
    assert rendezvous.exit_codes == [0, 0, 0]


def test_every_rank_gets_every_value(rendezvous: Rendezvous) -> None:
    expected = [f"rank-{r}" for r in range(4)]
    assert [r[2] for r in rendezvous.worker_results] == [expected] * 3


def test_add_across_processes_is_atomic(rendezvous: Rendezvous) -> None:
    # Every rank saw a distinct value and they total to 1..N.
    assert sorted([r[1] for r in rendezvous.worker_results] + [rendezvous.host_arrival]) == [1, 2, 3, 4]
    assert rendezvous.final_count == 4


def test_check_tells_present_from_missing_keys(rendezvous: Rendezvous) -> None:
    assert all(r[3] is True and r[4] is False for r in rendezvous.worker_results)


def test_add_is_atomic_under_concurrency(no_env_token: None) -> None:
    server = TCPStore("127.0.0.1", 0, is_server=True, world_size=1, rank=0, timeout_s=60)
    clients = [TCPStore("127.0.0.1", server.port, is_server=False, world_size=1, rank=-1) for _ in range(4)]
    seen: list[int] = []
    lock = threading.Lock()

    def bump(store: TCPStore) -> None:
        for _ in range(100):
            value = store.add("counter", 1)
            with lock:
                seen.append(value)

    threads = [threading.Thread(target=bump, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(seen) == list(range(1, 401))
    assert server.add("counter", -400) == 0
    for c in clients:
        c.close()
    server.close()


@pytest.mark.slow
def test_get_timeout_names_key_and_expected_rank(no_env_token: None) -> None:
    with TCPStore("127.0.0.1", 0, is_server=True, world_size=3, rank=0, timeout_s=60) as store:
        with pytest.raises(CollectiveTimeoutError, match=r"addr/2 \(expected from rank 2\)") as info:
            store.get("addr/2", timeout_s=0.2)
        assert info.value.peer == 2
        assert "ranks 1, 2 never connected" in str(info.value) or "rank(s) 1, 2 never connected" in str(info.value)
        # The connection stays usable after a timeout.
        store.set("x", b"1")
        assert store.get("x") == b"1"
        with pytest.raises(CollectiveTimeoutError, match="k1, k2"):
            store.wait(["k1", "k2", "x"], timeout_s=0.1)


@pytest.mark.slow
def test_dead_client_sets_dead_key_and_fails_waiters(no_env_token: None) -> None:
    server = TCPStore("127.0.0.1", 0, is_server=True, world_size=3, rank=0, timeout_s=60)
    ready = RANKS.Queue()
    proc = RANKS.Process(target=_die_without_close, args=(server.port, 2, 3, ready))
    proc.start()
    assert ready.get(timeout=120) == "connected"
    ready.put("die")
    # The death notice appears, and a waiter for an unrelated key fails naming the dead rank (no 60 s timeout).
    assert b"rank 2" in server.get("__dead__/2", timeout_s=60)
    with pytest.raises(
        PeerFailureError, match=r"the store reports rank 2 gone.*rank 2 disconnected from the store without close"
    ) as info:
        server.get("addr/1", timeout_s=60)
    assert info.value.peer == 2
    assert server.dead_ranks() == [2]
    proc.join(timeout=60)
    assert proc.exitcode == -signal.SIGKILL
    server.close()


def test_clean_close_is_not_a_death(no_env_token: None) -> None:
    with TCPStore("127.0.0.1", 0, is_server=True, world_size=2, rank=0, timeout_s=60) as server:
        _client(server.port, 1, 2).close()
        assert server.dead_ranks() == []
        assert not server.check(["__dead__/1"])


@pytest.mark.slow
def test_pending_waiter_fails_when_a_rank_dies(no_env_token: None) -> None:
    server = TCPStore("127.0.0.1", 0, is_server=True, world_size=3, rank=0, timeout_s=60)
    waiter = _client(server.port, 1, 3)
    ready = RANKS.Queue()
    proc = RANKS.Process(target=_die_without_close, args=(server.port, 2, 3, ready))
    proc.start()
    assert ready.get(timeout=120) == "connected"
    errors: list[BaseException] = []

    def wait_for_key() -> None:
        try:
            waiter.get("never/2", timeout_s=120)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=wait_for_key)
    thread.start()
    ready.put("die")
    thread.join(timeout=120)
    assert len(errors) == 1
    assert isinstance(errors[0], PeerFailureError)
    assert errors[0].peer == 2
    proc.join(timeout=60)
    waiter.close()
    server.close()


@pytest.mark.slow
def test_server_death_raises_peer_failure_naming_rank_0(no_env_token: None) -> None:
    ready = RANKS.Queue()
    host = RANKS.Process(target=_host_store, args=(ready,))
    host.start()
    port = ready.get(timeout=120)
    client = _client(port, 1, 2)
    client.set("k", b"v")
    errors: list[BaseException] = []

    def blocked_get() -> None:
        try:
            client.get("never", timeout_s=600)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=blocked_get)
    thread.start()
    host.kill()
    thread.join(timeout=120)
    assert not thread.is_alive()
    # A PeerFailureError, not a timeout: the 600 s deadline was never reached.
    assert len(errors) == 1
    assert isinstance(errors[0], PeerFailureError)
    assert errors[0].peer == 0
    with pytest.raises(PeerFailureError, match="rank 0"):
        client.get("k")
    client.close()
    host.join(timeout=60)


@pytest.mark.slow
def test_client_gives_up_connecting_with_a_clear_error(no_env_token: None) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: connections are refused
        with pytest.raises(CollectiveTimeoutError, match=rf"could not reach the store at 127.0.0.1:{port}"):
            TCPStore("127.0.0.1", port, is_server=False, world_size=2, rank=1, timeout_s=0.3)


def test_a_duplicate_rank_is_refused(no_env_token: None) -> None:
    with TCPStore("127.0.0.1", 0, is_server=True, world_size=2, rank=0, timeout_s=60) as server:
        with pytest.raises(ProtocolError, match="rank 0 is already connected"):
            _client(server.port, 0, 2)
        # A rank that was refused can still join correctly.
        _client(server.port, 1, 2).close()


def test_a_world_size_mismatch_is_refused(no_env_token: None) -> None:
    with TCPStore("127.0.0.1", 0, is_server=True, world_size=2, rank=0, timeout_s=60) as server:
        with pytest.raises(ProtocolError, match="world size mismatch: the store has 2, rank 1 says 3"):
            _client(server.port, 1, 3)
        # A rank that was refused can still join correctly.
        _client(server.port, 1, 2).close()


def test_beyond_loopback_without_token_refuses_to_start(no_env_token: None) -> None:
    with pytest.raises(ValueError, match=r"beyond loopback: set a shared token"):
        TCPStore("0.0.0.0", 0, is_server=True, world_size=2, rank=0)


def test_require_token_without_one_refuses_to_start(no_env_token: None) -> None:
    with pytest.raises(ValueError, match="ALLREDUCE_TOKEN"):
        TCPStore("127.0.0.1", 0, is_server=True, world_size=2, rank=0, require_token=True)


def test_token_required_wrong_token_refused_on_both_sides(no_env_token: None, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="allreduce.store")
    with TCPStore("0.0.0.0", 0, is_server=True, world_size=3, rank=0, token="s3cret", timeout_s=60) as server:
        good = _client(server.port, 1, 3, token="s3cret")
        good.set("k", b"v")
        assert server.get("k") == b"v"
        with pytest.raises(ProtocolError, match="refused the connection: wrong token"):
            _client(server.port, 2, 3, token="guess")
        with pytest.raises(ProtocolError, match="a shared token is required"):
            _client(server.port, 2, 3)
        # The refused attempts did not take rank 2's seat.
        _client(server.port, 2, 3, token="s3cret").close()
        good.close()
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "wrong token" in messages
    assert "a shared token is required" in messages


def test_token_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ALLREDUCE_TOKEN", "from-env")
    with TCPStore("127.0.0.1", 0, is_server=True, world_size=2, rank=0, timeout_s=60) as server:
        with _client(server.port, 1, 2) as client:
            client.set("k", b"v")
        with pytest.raises(ProtocolError, match="wrong token"):
            _client(server.port, 1, 2, token="other")


def test_client_with_token_refuses_a_server_without_one(no_env_token: None) -> None:
    with (
        TCPStore("127.0.0.1", 0, is_server=True, world_size=2, rank=0, timeout_s=60) as server,
        pytest.raises(ProtocolError, match="does not use a token"),
    ):
        _client(server.port, 1, 2, token="mine")


def test_bad_keys_and_values_are_rejected_locally(no_env_token: None) -> None:
    with TCPStore("127.0.0.1", 0, is_server=True, world_size=1, rank=0, timeout_s=60) as store:
        with pytest.raises(ValueError, match="bad store key"):
            store.set("", b"")
        with pytest.raises(ValueError, match="bad store key"):
            store.set("a\x00b", b"")
        with pytest.raises(TypeError, match="store values are bytes"):
            store.set("a", "text")  # type: ignore[arg-type]
        store.set("s", b"not a number")
        with pytest.raises(ValueError, match="does not hold an integer"):
            store.add("s", 1)


@given(garbage=st.binary(min_size=0, max_size=300))
@pytest.mark.slow
def test_garbage_from_the_network_does_not_break_the_server(garbage: bytes) -> None:
    os.environ.pop("ALLREDUCE_TOKEN", None)
    with TCPStore("127.0.0.1", 0, is_server=True, world_size=1, rank=0, timeout_s=30) as store:
        with socket.create_connection(("127.0.0.1", store.port), timeout=30) as raw:
            raw.sendall(garbage)
            raw.shutdown(socket.SHUT_WR)
            # The server answers with its greeting and then refuses or drops us: it never hangs on us.
            while raw.recv(4096):
                pass
        store.set("still", b"alive")
        assert store.get("still") == b"alive"


@pytest.mark.slow
def test_the_hosting_rank_closes_only_after_the_others_leave(no_env_token: None) -> None:
    server = TCPStore("127.0.0.1", 0, is_server=True, world_size=2, rank=0, timeout_s=60)
    client = _client(server.port, 1, 2)
    closing = threading.Thread(target=server.close)
    closing.start()
    closing.join(timeout=0.5)
    assert closing.is_alive()  # waiting for rank 1 (up to 30 s)
    client.set("late", b"still served")
    assert client.get("late") == b"still served"
    client.close()
    closing.join(timeout=60)
    assert not closing.is_alive()


# ----------------------------------------------------------------------------------- an adopted listening socket


def test_the_server_serves_on_an_adopted_listening_socket(no_env_token: None) -> None:
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    with TCPStore("127.0.0.1", 0, is_server=True, world_size=2, rank=0, timeout_s=60, listener=sock) as server:
        assert server.port == port
        with _client(port, 1, 2) as client:
            client.set("k", b"v")
        assert server.get("k") == b"v"
    assert sock.fileno() == -1  # the store owned it and closed it with the server


def test_an_adopted_socket_must_be_listening(no_env_token: None) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        with pytest.raises(ValueError, match="is not listening"):
            TCPStore("127.0.0.1", 0, is_server=True, world_size=2, rank=0, listener=sock)


def test_an_adopted_socket_must_be_on_the_port_asked_for(no_env_token: None) -> None:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        port = sock.getsockname()[1]
        with pytest.raises(ValueError, match=f"listens on port {port}, but port=1 was asked for"):
            TCPStore("127.0.0.1", 1, is_server=True, world_size=2, rank=0, listener=sock)


def test_only_the_hosting_side_takes_a_listening_socket(no_env_token: None) -> None:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        port = sock.getsockname()[1]
        with pytest.raises(ValueError, match="only the hosting side"):
            TCPStore("127.0.0.1", port, is_server=False, world_size=2, rank=1, listener=sock)


def test_an_adopted_socket_beyond_loopback_needs_a_token(no_env_token: None) -> None:
    # Its own address decides, not the host argument.
    with (
        socket.create_server(("0.0.0.0", 0)) as sock,
        pytest.raises(ValueError, match=r"would listen on '0\.0\.0\.0', beyond loopback"),
    ):
        TCPStore("127.0.0.1", 0, is_server=True, world_size=2, rank=0, listener=sock)
