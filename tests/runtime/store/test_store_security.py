"""Who may reach a group's store and its ranks' listeners without a token, and what any client may make the store
hold: real sockets, real processes (rank_processes.RANKS, or forked to run as another user)."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from rank_processes import RANKS

from allreduce.runtime import CollectiveTimeoutError, ProtocolError
from allreduce.runtime.store._store import TCPStore
from allreduce.runtime.store._store_protocol import (
    GROUP_SECRET_KEY,
    MAX_STORED_BYTES,
    MAX_VALUE_BYTES,
    NO_TIMEOUT,
    REQUEST,
    RESPONSE,
    Op,
)
from allreduce.runtime.tcp import ClientHello, HandshakeRetryError, TcpTransport, connect_handshake, read_exact
from allreduce.runtime.tcp._handshake import HANDSHAKE_VERSION, AcceptHandshake
from allreduce.runtime.tcp._listener import MAX_PENDING_HANDSHAKES

TIMEOUT_S = 60.0
NOBODY_UID = 65534  # the conventional unprivileged user of Linux distributions
IDLE_CONNECTIONS = 300


@pytest.fixture(autouse=True)
def no_env_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ALLREDUCE_TOKEN", raising=False)


@pytest.fixture
def store() -> Iterator[TCPStore]:
    """Rank 0 of a group of 3 hosting the store on loopback, without a token."""
    with TCPStore("127.0.0.1", 0, is_server=True, world_size=3, rank=0, timeout_s=TIMEOUT_S) as host:
        yield host


def _rank_client(port: int, rank: int, **kwargs: Any) -> TCPStore:
    return TCPStore("127.0.0.1", port, is_server=False, world_size=3, rank=rank, timeout_s=TIMEOUT_S, **kwargs)


def _raw_rank_socket(port: int, rank: int) -> socket.socket:
    """A connection that has done the handshake as ``rank`` and then speaks the store protocol by hand."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S)
    connect_handshake(sock, b"store", None, ClientHello(rank=rank, world_size=3, target=0), what="the store")
    return sock


def _request(sock: socket.socket, op: int, key: bytes, value: bytes) -> tuple[int, bytes]:
    sock.sendall(REQUEST.pack(op, NO_TIMEOUT, len(key), len(value)) + key + value)
    status, length = RESPONSE.unpack(read_exact(sock, RESPONSE.size))
    return status, read_exact(sock, length) if length else b""


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the other end closes ``sock`` (reading whatever it still sends), within the socket's timeout."""
    with contextlib.suppress(ConnectionResetError):
        while sock.recv(1 << 16):
            pass
    return True


# ----------------------------------------------------------------------------------- in other processes


def _anonymous_reader(port: int, out: Any) -> None:
    """Try to read rank 1's address as an anonymous client of another process; report what happened."""
    try:
        client = TCPStore("127.0.0.1", port, is_server=False, world_size=3, rank=-1, timeout_s=TIMEOUT_S)
        out.put(("admitted", client.get("tcp/addr/1", timeout_s=TIMEOUT_S).decode()))
        client.close()
    except ProtocolError as exc:
        out.put(("refused", str(exc)))


def _as_nobody(work: Callable[[], str]) -> str:
    """Run ``work`` in a forked child as the unprivileged user; what it returned, or its error."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only code already imported runs here (nobody cannot read this interpreter's files)
        try:
            os.close(read_end)
            os.setgid(NOBODY_UID)
            os.setuid(NOBODY_UID)
            try:
                result = work()
            except Exception as exc:
                result = f"{type(exc).__name__}: {exc}"
            os.write(write_end, result.encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as reader:
        result = reader.read().decode()
    os.waitpid(pid, 0)
    return result


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="running as another user needs root")


# ----------------------------------------------------------------------------------- who may join


@pytest.mark.slow
def test_an_anonymous_client_from_another_process_is_refused(store: TCPStore) -> None:
    store.set("tcp/addr/0", b"127.0.0.1:1")
    out = RANKS.Queue()
    proc = RANKS.Process(target=_anonymous_reader, args=(store.port, out))
    proc.start()
    outcome, detail = out.get(timeout=120)
    proc.join(timeout=60)
    assert outcome == "refused", detail
    assert "anonymous clients (no rank) are not admitted" in detail


def test_an_anonymous_client_of_the_hosting_process_is_admitted(store: TCPStore) -> None:
    with TCPStore("127.0.0.1", store.port, is_server=False, world_size=3, rank=-1) as helper:
        helper.set("k", b"v")
    assert store.get("k") == b"v"


GREETING_BYTES = 50  # magic, version, service, flags, nonce, pid: "!4sB8sB32sI"
HELLO = struct.Struct("!4sBBiiII32s32s")  # magic, version, flags, rank, target, world size, pid, nonce, mac
REPLY_BYTES = 39  # magic, status, message length, mac: "!4sBH32s"; then the message


def _hello_as_rank_1(port: int, world_size: int = 3) -> Callable[[], str]:
    """A client that ignores whom it reached and says its hello as rank 1 (as any program can); the reply."""

    def work() -> str:
        with socket.socket() as sock:
            sock.settimeout(TIMEOUT_S)
            sock.connect(("127.0.0.1", port))
            read_exact(sock, GREETING_BYTES)
            hello = HELLO.pack(b"ARHS", HANDSHAKE_VERSION, 0, 1, 0, world_size, os.getpid(), bytes(32), bytes(32))
            sock.sendall(hello)
            reply = read_exact(sock, REPLY_BYTES)
            length = struct.unpack_from("!H", reply, 5)[0]
            return f"status {reply[4]}: {read_exact(sock, length).decode()}"

    return work


@needs_root
def test_a_rank_of_another_user_is_refused_as_foreign(store: TCPStore) -> None:
    outcome = _as_nobody(_hello_as_rank_1(store.port))
    assert outcome.startswith("status 1: foreign uid: the client's socket belongs to uid 65534"), outcome


@needs_root
def test_a_rank_of_another_user_is_refused_by_a_ranks_tcp_listener() -> None:
    with (
        TCPStore("127.0.0.1", 0, is_server=True, world_size=2, rank=-1, timeout_s=TIMEOUT_S) as standalone,
        TcpTransport(0, 2, standalone, timeout_s=TIMEOUT_S),
    ):
        port = int(standalone.get("tcp/addr/0").decode().rpartition(":")[2])
        outcome = _as_nobody(_hello_as_rank_1(port, world_size=2))
    # Without ALLREDUCE_TOKEN a rank's listener requires the group's secret, which only admitted ranks have.
    assert outcome.startswith("status 1: "), outcome
    assert "token" in outcome, outcome


@needs_root
@pytest.mark.slow
def test_a_foreign_rank_is_reported_on_rank_0_as_refused(store: TCPStore) -> None:
    _as_nobody(_hello_as_rank_1(store.port))
    with pytest.raises(CollectiveTimeoutError) as info:
        store.get("allreduce/host/1", timeout_s=0.5)
    assert "rank 1 tried to connect and was refused (foreign uid: the client's socket belongs to uid 65534" in str(
        info.value
    )
    assert "rank(s) 2 never connected" in str(info.value)


@pytest.mark.parametrize(("token", "why"), [("guess", "wrong token"), (None, "no token")])
@pytest.mark.slow
def test_a_token_refused_rank_is_reported_on_rank_0_as_refused(token: str | None, why: str) -> None:
    with TCPStore("127.0.0.1", 0, is_server=True, world_size=3, rank=0, token="s3cret", timeout_s=TIMEOUT_S) as host:
        with pytest.raises(ProtocolError):
            _rank_client(host.port, 1, token=token)
        with pytest.raises(CollectiveTimeoutError) as info:
            host.get("allreduce/host/1", timeout_s=0.5)
    assert f"rank 1 tried to connect and was refused ({why}" in str(info.value)
    assert "; from 127.0.0.1:" in str(info.value)
    assert "rank(s) 2 never connected" in str(info.value)
    assert info.value.peer == 1


@pytest.mark.slow
def test_a_rank_that_joins_after_a_refusal_is_not_reported_as_refused() -> None:
    with TCPStore("127.0.0.1", 0, is_server=True, world_size=2, rank=0, token="s3cret", timeout_s=TIMEOUT_S) as host:
        with pytest.raises(ProtocolError):
            TCPStore("127.0.0.1", host.port, is_server=False, world_size=2, rank=1, token="guess")
        with (
            TCPStore("127.0.0.1", host.port, is_server=False, world_size=2, rank=1, token="s3cret"),
            pytest.raises(CollectiveTimeoutError) as info,
        ):
            host.get("never/1", timeout_s=0.5)
    assert "refused" not in str(info.value)


# ----------------------------------------------------------------------------------- whom a rank reaches


def _foreign_store_endpoint(port_out: Any) -> Callable[[], str]:
    """A listener, run as nobody, greeting like a store: it reports its port, serves one connection, leaves."""

    def work() -> str:
        with socket.socket() as listener:
            listener.settimeout(TIMEOUT_S)  # never outlive the test
            listener.bind(("127.0.0.1", 0))
            listener.listen()
            os.write(port_out, str(listener.getsockname()[1]).encode().ljust(8))
            conn, _ = listener.accept()
            with conn:
                conn.sendall(AcceptHandshake(b"store", None, lambda _: None, lambda: None).greeting)
                conn.settimeout(TIMEOUT_S)
                return "served" if conn.recv(1 << 16) else "left"

    return work


@needs_root
def test_a_rank_refuses_a_listener_of_another_user() -> None:
    port_r, port_w = os.pipe()
    outcome: list[str] = []
    endpoint = threading.Thread(target=lambda: outcome.append(_as_nobody(_foreign_store_endpoint(port_w))))
    endpoint.start()
    port = int(os.read(port_r, 8).decode())
    os.close(port_r)
    with pytest.raises(ProtocolError, match=r"is not this job's endpoint: foreign uid: .* belongs to uid 65534"):
        TCPStore("127.0.0.1", port, is_server=False, world_size=3, rank=1, timeout_s=TIMEOUT_S)
    endpoint.join(timeout=120)
    os.close(port_w)
    assert outcome == ["left"]  # the rank sent it nothing: not even its hello


def test_a_rank_refuses_a_listener_that_announces_another_process() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname(), timeout=TIMEOUT_S)
        conn, _ = listener.accept()
        with conn, client:
            greeting = AcceptHandshake(b"store", None, lambda _: None, lambda: None).greeting
            conn.sendall(greeting[:-4] + struct.pack("!I", 1))  # the greeting ends with the pid: claim init's
            with pytest.raises(ProtocolError, match="announced pid 1, which does not hold its socket"):
                connect_handshake(client, b"store", None, ClientHello(1, 3, 0), what="the listener")


def test_an_endpoint_that_greets_then_closes_is_one_stopping_and_is_retried_not_refused() -> None:
    # The previous group's store stopping: it greeted, then closed the connection, so by the time the rank looks
    # no process holds the endpoint's socket. That is a store going away (come back), not an impostor.
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname(), timeout=TIMEOUT_S)
        conn, _ = listener.accept()
        with client:
            conn.sendall(AcceptHandshake(b"store", None, lambda _: None, lambda: None).greeting)
            conn.close()
            with pytest.raises(HandshakeRetryError, match="closed the connection during the handshake"):
                connect_handshake(client, b"store", None, ClientHello(1, 3, 0), what="the store")


def test_a_rank_refuses_an_endpoint_that_is_not_the_process_it_expects(store: TCPStore) -> None:
    with (
        socket.create_connection(("127.0.0.1", store.port), timeout=TIMEOUT_S) as sock,
        pytest.raises(ProtocolError, match=f"held by pid {os.getpid()}, not by pid 1 as expected"),
    ):
        connect_handshake(sock, b"store", None, ClientHello(1, 3, 0), what="the store", expected_pid=1)


def test_connecting_returns_the_endpoints_pid(store: TCPStore) -> None:
    with socket.create_connection(("127.0.0.1", store.port), timeout=TIMEOUT_S) as sock:
        assert connect_handshake(sock, b"store", None, ClientHello(1, 3, 0), what="the store") == os.getpid()


# ----------------------------------------------------------------------------------- what a client may write


def test_a_rank_may_not_overwrite_another_ranks_key(store: TCPStore) -> None:
    with _rank_client(store.port, 1) as rank_1, _rank_client(store.port, 2) as rank_2:
        rank_1.set("tcp/addr/1", b"127.0.0.1:4000")
        with pytest.raises(ValueError, match=r"key 'tcp/addr/1' belongs to rank 1; rank 2 .* may not write it"):
            rank_2.set("tcp/addr/1", b"127.0.0.1:6666")
        with pytest.raises(ValueError, match="belongs to rank 1"):
            rank_2.delete("tcp/addr/1")
        assert rank_2.get("tcp/addr/1") == b"127.0.0.1:4000"


def test_rank_0_may_not_overwrite_another_ranks_key(store: TCPStore) -> None:
    with pytest.raises(ValueError, match=r"key 'tcp/addr/2' belongs to rank 2; rank 0 .* may not write it"):
        store.set("tcp/addr/2", b"127.0.0.1:6666")


def test_an_anonymous_client_of_the_hosting_process_may_write_any_key(store: TCPStore) -> None:
    with TCPStore("127.0.0.1", store.port, is_server=False, world_size=3, rank=-1) as helper:
        helper.set("tcp/addr/2", b"set for the job")
    assert store.get("tcp/addr/2") == b"set for the job"


@pytest.mark.parametrize("key", ["__dead__/1", GROUP_SECRET_KEY])
def test_no_client_writes_the_stores_own_keys(store: TCPStore, key: str) -> None:
    with pytest.raises(ValueError, match="is the store's own"):
        store.set(key, b"forged")


def test_every_admitted_rank_reads_the_same_group_secret(store: TCPStore) -> None:
    with _rank_client(store.port, 1) as rank_1:
        assert rank_1.group_secret() == store.group_secret()
    assert len(store.group_secret()) >= 32


def test_each_group_has_its_own_secret(store: TCPStore) -> None:
    with TCPStore("127.0.0.1", 0, is_server=True, world_size=1, rank=0) as other:
        assert other.group_secret() != store.group_secret()


# ----------------------------------------------------------------------------------- bounded sizes


def test_a_value_over_the_limit_is_refused_by_the_client(store: TCPStore) -> None:
    with pytest.raises(ValueError, match=f"the store takes at most {MAX_VALUE_BYTES}"):
        store.set("big", bytes(32 << 20))


def test_a_value_over_the_limit_closes_the_connection_that_sent_it(store: TCPStore) -> None:
    with _raw_rank_socket(store.port, 1) as raw:
        raw.sendall(REQUEST.pack(Op.SET, NO_TIMEOUT, 3, 32 << 20) + b"big" + bytes(1 << 16))
        assert _closed_by_peer(raw)
    assert not store.check(["big"])


def test_the_store_holds_at_most_its_limit_in_total(store: TCPStore) -> None:
    value = bytes(MAX_VALUE_BYTES)
    fits = MAX_STORED_BYTES // MAX_VALUE_BYTES - 1  # the keys, and the store's own secret, take a little room
    for index in range(fits):
        store.set(f"fill-{index}", value)
    with pytest.raises(ValueError, match=f"store full: .* \\(at most {MAX_STORED_BYTES}\\)"):
        store.set("fill-last", value)
    store.delete("fill-0")
    store.set("fill-again", value)  # deleting made room


def test_a_client_that_sends_more_than_one_request_at_a_time_is_dropped(store: TCPStore) -> None:
    with _raw_rank_socket(store.port, 1) as raw:
        # A GET that waits, then more bytes behind it than any one request may hold: the server stops buffering.
        raw.sendall(REQUEST.pack(Op.GET, NO_TIMEOUT, 5, 0) + b"never")
        with contextlib.suppress(OSError):  # the server may close while we are still sending
            raw.sendall(bytes(3 * MAX_VALUE_BYTES))
        assert _closed_by_peer(raw)
    store.set("still", b"served")
    assert store.get("still") == b"served"


@pytest.mark.slow
def test_idle_connections_hold_no_thread_and_are_closed(store: TCPStore) -> None:
    assert IDLE_CONNECTIONS > MAX_PENDING_HANDSHAKES  # so that making room is exercised too
    threads_before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", store.port), timeout=TIMEOUT_S) for _ in range(IDLE_CONNECTIONS)]
    try:
        # A rank still gets in while they sit there, and the idle ones cost no thread of the server.
        with _rank_client(store.port, 1) as rank_1:
            rank_1.set("allreduce/host/1", b"here")
        assert threading.active_count() <= threads_before + 2
        # Each is greeted, then closed for saying nothing (after the handshake deadline, or to make room).
        assert all(_closed_by_peer(sock) for sock in idle)
    finally:
        for sock in idle:
            sock.close()
    assert store.get("allreduce/host/1") == b"here"


def _anonymous_token_writer(port: int, token: str, keys: list[str], out: Any) -> None:
    """As an anonymous client of another process that knows the job's token, try to set each key; report."""
    results = {}
    with TCPStore("127.0.0.1", port, is_server=False, world_size=3, rank=-1, timeout_s=TIMEOUT_S, token=token) as c:
        for key in keys:
            try:
                c.set(key, b"junk")
                results[key] = "set"
            except ValueError as exc:
                results[key] = str(exc)
    out.put(results)


@pytest.mark.slow
def test_an_anonymous_token_holder_of_another_process_writes_no_key_a_rank_owns() -> None:
    token = "campaign-insider-token"
    keys = ["tcp/addr/1", "allreduce/host/2", "allreduce/job", "user/notes"]
    with TCPStore("127.0.0.1", 0, is_server=True, world_size=3, rank=0, timeout_s=TIMEOUT_S, token=token) as host:
        out = RANKS.Queue()
        proc = RANKS.Process(target=_anonymous_token_writer, args=(host.port, token, keys, out))
        proc.start()
        results = out.get(timeout=TIMEOUT_S)
        proc.join(TIMEOUT_S)
    assert results["user/notes"] == "set"
    for key, owner in (("tcp/addr/1", 1), ("allreduce/host/2", 2), ("allreduce/job", 0)):
        assert f"key {key!r} belongs to rank {owner}; an anonymous client" in results[key]


def test_the_store_records_which_client_wrote_each_key(store: TCPStore) -> None:
    with _rank_client(store.port, 1) as rank_1:
        rank_1.set("user/notes", b"hello")
        address = f"127.0.0.1:{rank_1._sock.getsockname()[1]}"  # type: ignore[union-attr]
    assert store.get("__writer__/user/notes").decode().startswith(f"rank 1 ({address}")


def test_no_client_forges_who_wrote_a_key(store: TCPStore) -> None:
    with pytest.raises(ValueError, match="is the store's own"):
        store.set("__writer__/tcp/addr/1", b"rank 1")
