"""The socket helpers the store and the transport share, on real socket pairs."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from allreduce.runtime.tcp import read_exact
from allreduce.runtime.tcp._listener import listening_socket
from allreduce.runtime.tcp._socket import (
    LOOPBACK_SNDBUF_BYTES,
    congestion_control,
    connect_tcp,
    drain_and_close,
    send_until,
    tune,
)


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    with a, b:
        yield a, b


def test_read_exact_joins_pieces(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.sendall(b"abc")
    a.sendall(b"defg")
    assert read_exact(b, 7) == b"abcdefg"


def test_read_exact_names_an_early_close(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.sendall(b"ab")
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(EOFError, match="connection closed after 2 of 5 bytes"):
        read_exact(b, 5)


def test_read_exact_on_a_non_blocking_socket_stops_at_the_deadline(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    b.setblocking(False)
    a.sendall(b"x")
    with pytest.raises(TimeoutError, match="read 1 of 2 bytes before the deadline"):
        read_exact(b, 2, deadline=time.monotonic() + 0.05)


def test_read_exact_on_a_blocking_socket_honours_its_timeout(pair: tuple[socket.socket, socket.socket]) -> None:
    _, b = pair
    b.settimeout(0.05)
    with pytest.raises(TimeoutError):
        read_exact(b, 1)


def test_send_until_gives_up_when_the_peer_does_not_read(pair: tuple[socket.socket, socket.socket]) -> None:
    a, _ = pair
    a.setblocking(False)
    with pytest.raises(TimeoutError, match="peer not reading"):
        send_until(a, bytes(64 << 20), time.monotonic() + 0.05)


def test_drain_and_close_reads_until_the_peer_closes() -> None:
    a, b = socket.socketpair()
    with b:
        b.sendall(b"leftover")
        b.shutdown(socket.SHUT_WR)
        drain_and_close([a], linger_s=30.0)
        assert a.fileno() == -1


def test_tune_keeps_the_loopback_send_buffer_small() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(server.getsockname()) as client:
        tune(client)
        assert not client.getblocking()
        assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        # The kernel doubles what is asked; autotuning would grow it to megabytes.
        assert client.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) <= 2 * LOOPBACK_SNDBUF_BYTES
        server.accept()[0].close()


def test_tune_sets_the_congestion_control_asked_for() -> None:
    # reno is built into every Linux kernel and always allowed
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(server.getsockname()) as client:
        tune(client, congestion=congestion_control("reno"))
        assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0") == b"reno"
        server.accept()[0].close()


def test_an_unknown_congestion_control_is_refused_naming_what_the_kernel_has() -> None:
    with pytest.raises(ValueError, match=r"'no-such-cc' cannot be set here .*this kernel has .*reno"):
        congestion_control("no-such-cc")


def test_the_transport_names_the_variable_of_an_unknown_congestion_control(monkeypatch: pytest.MonkeyPatch) -> None:
    from allreduce.runtime.store._store import TCPStore
    from allreduce.runtime.tcp import CONGESTION_ENV, TcpTransport

    monkeypatch.setenv(CONGESTION_ENV, "no-such-cc")
    with (
        TCPStore("127.0.0.1", 0, is_server=True, world_size=2, rank=0, timeout_s=30) as store,
        pytest.raises(ValueError, match=rf"rank 0: {CONGESTION_ENV}='no-such-cc': .*cannot be set here"),
    ):
        TcpTransport(0, 2, store)


def _not_the_default() -> str:
    """A congestion control other than the kernel's default (so that inheriting it is not a coincidence)."""
    default = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    return "cubic" if default == "reno" else "reno"


def _congestion_of(sock: socket.socket) -> str:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0").decode()


def test_a_listeners_connections_start_with_its_congestion_control() -> None:
    name = _not_the_default()
    with (
        listening_socket("127.0.0.1", backlog=1, congestion=congestion_control(name)) as server,
        socket.create_connection(server.getsockname()) as client,
    ):
        accepted, _ = server.accept()
        with accepted:
            assert (_congestion_of(client), _congestion_of(accepted)) != (name, name)  # the client: the default
            assert _congestion_of(accepted) == name


def test_connect_tcp_connects_with_the_congestion_control_asked_for() -> None:
    name = _not_the_default()
    with socket.create_server(("127.0.0.1", 0)) as server:
        host, port = server.getsockname()
        with connect_tcp(host, port, timeout_s=10, congestion=congestion_control(name)) as client:
            server.accept()[0].close()
            assert _congestion_of(client) == name


def test_connect_tcp_raises_the_refusal() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        host, port = server.getsockname()
    with pytest.raises(ConnectionRefusedError):
        connect_tcp(host, port, timeout_s=10)
