"""The kernel's counters of a TCP connection (TCP_INFO): bytes the peer acknowledged, and the time the network
limited sending, read from real loopback sockets; a connection the kernel paces."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from allreduce.runtime.tcp._tcpinfo import pace_sending, sent_and_busy

PAYLOAD = 8 << 20


def _connected_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
    return client, accepted


def _drain(sock: socket.socket, total: int) -> None:
    got = 0
    while got < total:
        got += len(sock.recv(1 << 20))


def _counters(sock: socket.socket) -> tuple[int, float]:
    counters = sent_and_busy(sock)
    assert counters is not None
    return counters


def _sent_and_read() -> tuple[tuple[int, float], tuple[int, float]]:
    """The client's counters before and after it sent PAYLOAD bytes that the peer read (its last ACK awaited)."""
    client, accepted = _connected_pair()
    with client, accepted:
        before = _counters(client)
        reader = threading.Thread(target=_drain, args=(accepted, PAYLOAD))
        reader.start()
        client.sendall(b"\0" * PAYLOAD)
        reader.join(timeout=60)
        deadline = time.monotonic() + 10
        while _counters(client)[0] - before[0] < PAYLOAD and time.monotonic() < deadline:
            time.sleep(0.01)  # the last ACK may still be on its way
        return before, _counters(client)


def test_the_bytes_a_peer_read_are_counted_as_acknowledged() -> None:
    before, after = _sent_and_read()
    assert after[0] - before[0] == PAYLOAD


def test_the_network_limited_time_never_goes_back() -> None:
    before, after = _sent_and_read()
    assert after[1] >= before[1] >= 0.0


def test_a_unix_socket_has_no_counters() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        assert sent_and_busy(a) is None


def test_a_paced_connection_counts_its_sending_as_network_limited() -> None:
    """2 MiB paced at 4 MB/s: the kernel counts most of the 0.52 s as network-limited (not the app's).

    Not all of it: the first flight leaves before pacing spaces the segments (1 MiB took 0.18 s, not 0.26, over
    loopback, its network-limited time 0.144-0.168 s), so the bound is 0.3 s: 0.08 s below what is left after a first
    flight of 330 KB, 35 jiffies of the counter's rounding."""
    client, accepted = _connected_pair()
    with client, accepted:
        pace_sending(client, 4e6)
        before = _counters(client)
        reader = threading.Thread(target=_drain, args=(accepted, 2 << 20))
        reader.start()
        client.sendall(b"\0" * (2 << 20))
        reader.join(timeout=60)
        after = _counters(client)
    assert after[1] - before[1] >= 0.3


def test_only_a_tcp_connection_is_paced_by_the_kernel() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b, pytest.raises(ValueError, match="Unix socket"):
        pace_sending(a, 4e6)
