"""The TCP transport and what it shares with the store: sockets, the authenticated handshake, the listener.

Files, one concern each (after Gloo's ``transport/tcp``):

- :mod:`._socket`: socket helpers (tuning, exact reads, bounded sends, drain-and-close, the host key that says
  whether a peer is reachable over a Unix socket);
- :mod:`._handshake`: the authenticated handshake, spoken by the store and the transport;
- :mod:`._listener`: a listening socket whose connections are authenticated in threads of their own;
- :mod:`._frames`: the 44-byte frame header and the frames being sent and received;
- :mod:`._prepared`: a rank's plan compiled to byte ranges, per step and peer;
- :mod:`._pair`: one connection to a peer, and the windowed reduction of what it receives;
- :mod:`._loop`: the event loop of one step, and the sender thread;
- :mod:`._blame`: whom a rank names when a peer is gone or silent (the records ranks leave in the store);
- :mod:`._transport`: :class:`TcpTransport` (over TCP, or over a Unix socket between ranks of one host).
"""

from allreduce.runtime.tcp._handshake import (
    CONNECT_HANDSHAKE_MAX_S,
    ClientHello,
    HandshakeRetryError,
    RetryLater,
    connect_handshake,
    resolve_token,
)
from allreduce.runtime.tcp._listener import Listener
from allreduce.runtime.tcp._socket import congestion_control, family_of, is_loopback, read_exact
from allreduce.runtime.tcp._transport import CONGESTION_ENV, TcpTransport

__all__ = [
    "CONGESTION_ENV",
    "CONNECT_HANDSHAKE_MAX_S",
    "ClientHello",
    "HandshakeRetryError",
    "Listener",
    "RetryLater",
    "TcpTransport",
    "congestion_control",
    "connect_handshake",
    "family_of",
    "is_loopback",
    "read_exact",
    "resolve_token",
]
