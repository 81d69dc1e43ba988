"""Identifying the other end of a loopback TCP connection: real sockets, and a real process of another user."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest

from allreduce.runtime.tcp._peercred import PeerCredentials, diag_lookup, holds_socket, loopback_peer, proc_lookup

NOBODY_UID = 65534
FAMILIES = {"ipv4": (socket.AF_INET, "127.0.0.1"), "ipv6": (socket.AF_INET6, "::1")}


@pytest.fixture(params=sorted(FAMILIES))
def connection(request: pytest.FixtureRequest) -> Iterator[tuple[socket.socket, socket.socket]]:
    """A connected pair over loopback: (client, accepted)."""
    family, host = FAMILIES[request.param]
    with socket.create_server((host, 0), family=family) as server:
        client = socket.create_connection(server.getsockname()[:2], timeout=30)
        accepted, _ = server.accept()
        with client, accepted:
            yield client, accepted


def _ends(sock: socket.socket) -> tuple[tuple[str, int], tuple[str, int]]:
    peer, ours = sock.getpeername(), sock.getsockname()
    return (str(peer[0]), int(peer[1])), (str(ours[0]), int(ours[1]))


def test_the_peer_is_this_user_and_its_socket(connection: tuple[socket.socket, socket.socket]) -> None:
    client, accepted = connection
    assert loopback_peer(accepted) == PeerCredentials(uid=os.geteuid(), inode=os.fstat(client.fileno()).st_ino)
    assert loopback_peer(client) == PeerCredentials(uid=os.geteuid(), inode=os.fstat(accepted.fileno()).st_ino)


def test_netlink_and_the_proc_table_agree(connection: tuple[socket.socket, socket.socket]) -> None:
    _, accepted = connection
    peer, ours = _ends(accepted)
    assert diag_lookup(accepted.family, peer, ours) == proc_lookup(accepted.family, peer, ours) is not None


def test_no_such_connection_is_none() -> None:
    assert diag_lookup(socket.AF_INET, ("127.0.0.1", 1), ("127.0.0.1", 2)) is None
    assert proc_lookup(socket.AF_INET, ("127.0.0.1", 1), ("127.0.0.1", 2)) is None


def test_this_process_holds_its_socket_and_init_does_not(connection: tuple[socket.socket, socket.socket]) -> None:
    client, _ = connection
    inode = os.fstat(client.fileno()).st_ino
    assert holds_socket(os.getpid(), inode)
    assert not holds_socket(1, inode)


@pytest.mark.skipif(os.geteuid() != 0, reason="running as another user needs root")
def test_a_peer_of_another_user_is_named_by_its_uid() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        pid = os.fork()
        if pid == 0:  # the child connects as nobody and waits until the parent has looked
            try:
                os.setuid(NOBODY_UID)
                client = socket.socket()
                client.connect(server.getsockname())
                client.recv(1)
            finally:
                os._exit(0)
        accepted, _ = server.accept()
        with accepted:
            found = loopback_peer(accepted)
            held = found is not None and holds_socket(pid, found.inode)
            accepted.sendall(b"x")
        os.waitpid(pid, 0)
    assert found is not None
    assert found.uid == NOBODY_UID
    assert held
