"""The listener under a flood of idle connections: one thread, a bounded number of handshakes, none left open."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator

import pytest

from allreduce.runtime import ProtocolError
from allreduce.runtime.tcp import ClientHello, Listener, connect_handshake
from allreduce.runtime.tcp._listener import MAX_PENDING_HANDSHAKES, listening_socket

TIMEOUT_S = 60.0
IDLE_CONNECTIONS = 300


class Owner:
    """What the listener hands over and reports, recorded."""

    def __init__(self) -> None:
        self.accepted: list[ClientHello] = []
        self.refused: list[str] = []
        self.lock = threading.Condition()

    def check(self, hello: ClientHello) -> str | None:
        return None if hello.rank >= 0 else "no anonymous clients here"

    def on_accepted(self, sock: socket.socket, hello: ClientHello, address: str) -> None:
        sock.close()
        with self.lock:
            self.accepted.append(hello)
            self.lock.notify_all()

    def wait_accepted(self, count: int) -> list[ClientHello]:
        """The first ``count`` connections handed over (the listener hands over right after its reply is sent)."""
        with self.lock:
            self.lock.wait_for(lambda: len(self.accepted) >= count, TIMEOUT_S)
            return list(self.accepted)

    def on_refused(self, address: str, error: BaseException, admitted: ClientHello | None) -> None:
        with self.lock:
            self.refused.append(str(error))


@pytest.fixture
def listening() -> Iterator[tuple[Listener, Owner]]:
    owner = Owner()
    listener = Listener(
        listening_socket("127.0.0.1", backlog=IDLE_CONNECTIONS),
        service=b"tcp",
        token=None,
        check=owner.check,
        accepted=owner.on_accepted,
        refused=owner.on_refused,
        name="test-listener",
    )
    yield listener, owner
    listener.close()


def _hello(port: int, rank: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as sock:
        connect_handshake(sock, b"tcp", None, ClientHello(rank=rank, world_size=2, target=0), what="the listener")


@pytest.mark.slow
def test_idle_connections_are_bounded_and_cost_no_thread(listening: tuple[Listener, Owner]) -> None:
    listener, owner = listening
    threads_before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", listener.port), timeout=TIMEOUT_S) for _ in range(IDLE_CONNECTIONS)]
    try:
        _hello(listener.port, 1)  # gets through while they sit there
        owner.wait_accepted(1)
        assert listener.pending_handshakes() <= MAX_PENDING_HANDSHAKES
        assert threading.active_count() == threads_before
        for sock in idle:  # each is closed for saying nothing
            while sock.recv(4096):
                pass
    finally:
        for sock in idle:
            sock.close()
    listener.close()  # every report has been made when it returns
    assert [hello.rank for hello in owner.accepted] == [1]
    assert len(owner.refused) == IDLE_CONNECTIONS


def test_the_verified_pid_is_handed_over(listening: tuple[Listener, Owner]) -> None:
    listener, owner = listening
    _hello(listener.port, 1)
    assert [hello.pid for hello in owner.wait_accepted(1)] == [os.getpid()]


def test_a_refused_client_is_reported_with_the_reason(listening: tuple[Listener, Owner]) -> None:
    listener, owner = listening
    with pytest.raises(ProtocolError, match="no anonymous clients here"):
        _hello(listener.port, -1)
    listener.close()
    assert any("no anonymous clients here" in message for message in owner.refused)
