"""The TCP transport's waits on one socket hold for descriptors numbered past 1,024 (select's FD_SETSIZE)."""

from __future__ import annotations

import os
import resource
import socket
from collections.abc import Iterator

import pytest

from allreduce.runtime.tcp._handshake import _closed_by_endpoint


@pytest.fixture
def high_socket_pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A connected pair whose descriptors are numbered above 1,024 (the descriptors below are held open)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < 2048:
        resource.setrlimit(resource.RLIMIT_NOFILE, (2048 if hard == resource.RLIM_INFINITY else min(2048, hard), hard))
    filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    a, b = socket.socketpair()
    try:
        assert min(a.fileno(), b.fileno()) >= 1024
        yield a, b
    finally:
        a.close()
        b.close()
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_an_endpoint_that_closed_is_seen_on_a_high_descriptor(high_socket_pair: tuple[socket.socket, ...]) -> None:
    a, b = high_socket_pair
    b.close()
    assert _closed_by_endpoint(a)


def test_an_endpoint_still_open_is_not_taken_for_closed_on_a_high_descriptor(
    high_socket_pair: tuple[socket.socket, ...],
) -> None:
    a, _ = high_socket_pair
    assert not _closed_by_endpoint(a)
