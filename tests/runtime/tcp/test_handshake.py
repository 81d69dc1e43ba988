"""The one authenticated handshake, from both endpoints that speak it: the store's server and the TCP transport.

Each test connects over loopback with raw sockets and :func:`connect_handshake`, so both endpoints meet exactly
the same clients: the right token, a wrong one, none, garbage, and a connection that never says anything.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from allreduce.runtime import ProtocolError
from allreduce.runtime.store._store import TCPStore
from allreduce.runtime.tcp import ClientHello, TcpTransport, connect_handshake

TOKEN = "s3cret"
TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Endpoint:
    """Where to connect, which service answers there, and the hello it admits."""

    port: int
    service: bytes
    hello: ClientHello


@pytest.fixture(autouse=True)
def no_env_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ALLREDUCE_TOKEN", raising=False)


def _store_endpoint(token: str | None) -> Iterator[Endpoint]:
    with TCPStore("127.0.0.1", 0, is_server=True, world_size=3, rank=-1, token=token, timeout_s=TIMEOUT_S) as store:
        yield Endpoint(store.port, b"store", ClientHello(rank=-1, world_size=3, target=0))


def _transport_endpoint(token: str | None) -> Iterator[Endpoint]:
    # Rank 0 of 2 listens; the clients below play rank 1 (higher ranks connect to lower ones).
    with (
        TCPStore("127.0.0.1", 0, is_server=True, world_size=2, rank=-1, timeout_s=TIMEOUT_S) as store,
        TcpTransport(0, 2, store, token=token, timeout_s=TIMEOUT_S) as transport,
    ):
        port = int(store.get("tcp/addr/0").decode().rpartition(":")[2])
        yield Endpoint(port, b"tcp", ClientHello(rank=1, world_size=2, target=0))
        assert transport.failure is None


ENDPOINTS = {"store": _store_endpoint, "tcp": _transport_endpoint}


@pytest.fixture(params=sorted(ENDPOINTS))
def endpoint(request: pytest.FixtureRequest) -> Iterator[Endpoint]:
    yield from ENDPOINTS[request.param](TOKEN)


@pytest.fixture
def open_endpoint() -> Iterator[Endpoint]:
    """The store without a token (loopback only); a rank's TCP listener without one uses its group's secret."""
    yield from _store_endpoint(None)


def _connect(endpoint: Endpoint, token: str | None) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", endpoint.port), timeout=TIMEOUT_S)
    try:
        connect_handshake(
            sock, endpoint.service, None if token is None else token.encode(), endpoint.hello, what="the endpoint"
        )
    except BaseException:
        sock.close()
        raise
    return sock


def test_the_right_token_is_admitted(endpoint: Endpoint) -> None:
    _connect(endpoint, TOKEN).close()


def test_a_wrong_token_is_refused(endpoint: Endpoint) -> None:
    with pytest.raises(ProtocolError, match="refused the connection: wrong token"):
        _connect(endpoint, "guess")


def test_no_token_is_refused_where_one_is_required(endpoint: Endpoint) -> None:
    with pytest.raises(ProtocolError, match="a shared token is required"):
        _connect(endpoint, None)


def test_a_client_with_a_token_refuses_an_endpoint_without_one(open_endpoint: Endpoint) -> None:
    with pytest.raises(ProtocolError, match="does not use a token"):
        _connect(open_endpoint, TOKEN)


def test_without_a_token_loopback_clients_are_admitted(open_endpoint: Endpoint) -> None:
    _connect(open_endpoint, None).close()


def test_a_rank_listener_without_a_shared_token_requires_the_group_secret() -> None:
    with (
        TCPStore("127.0.0.1", 0, is_server=True, world_size=2, rank=-1, timeout_s=TIMEOUT_S) as store,
        TcpTransport(0, 2, store, token=None, timeout_s=TIMEOUT_S),
    ):
        port = int(store.get("tcp/addr/0").decode().rpartition(":")[2])
        endpoint = Endpoint(port, b"tcp", ClientHello(rank=1, world_size=2, target=0))
        with pytest.raises(ProtocolError, match="a shared token is required"):
            _connect(endpoint, None)
        _connect(endpoint, store.group_secret().decode()).close()


def test_the_wrong_service_is_named(endpoint: Endpoint) -> None:
    other = Endpoint(endpoint.port, b"tcp" if endpoint.service == b"store" else b"store", endpoint.hello)
    with pytest.raises(ProtocolError, match=f"is a {endpoint.service.decode()!r} endpoint"):
        _connect(other, TOKEN)


def test_garbage_is_refused_and_the_endpoint_still_serves(endpoint: Endpoint) -> None:
    # The endpoint greets, then refuses or drops us (a reset, or "not connected" if it already has): it never
    # hangs on garbage; the recv loop ends when it closes.
    with (
        socket.create_connection(("127.0.0.1", endpoint.port), timeout=TIMEOUT_S) as raw,
        contextlib.suppress(OSError),
    ):
        raw.sendall(b"GET / HTTP/1.1\r\n" * 10)
        raw.shutdown(socket.SHUT_WR)
        while raw.recv(4096):
            pass
    _connect(endpoint, TOKEN).close()


def test_an_idle_connection_does_not_block_other_clients(endpoint: Endpoint) -> None:
    with socket.create_connection(("127.0.0.1", endpoint.port), timeout=TIMEOUT_S):
        # Connected and silent: its handshake waits in a thread of its own while others get through.
        _connect(endpoint, TOKEN).close()


def test_beyond_loopback_a_store_without_a_token_refuses_to_start() -> None:
    with pytest.raises(ValueError, match="beyond loopback: set a shared token"):
        TCPStore("0.0.0.0", 0, is_server=True, world_size=2, rank=0)


def test_beyond_loopback_a_transport_without_a_token_refuses_to_start() -> None:
    with (
        TCPStore("127.0.0.1", 0, is_server=True, world_size=2, rank=-1, timeout_s=TIMEOUT_S) as store,
        pytest.raises(ValueError, match="beyond loopback: set a shared token"),
    ):
        TcpTransport(0, 2, store, host="0.0.0.0", token=None)
