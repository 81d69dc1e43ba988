"""The authenticated connection handshake, spoken by the store and the TCP transport alike.

Both directions authenticate when a token is set; the token itself never crosses the network::

    acceptor  -> connector: GREETING  magic "ARHS", version, service, flags(auth), nonce_a
    connector -> acceptor : HELLO     magic, version, flags(has mac), rank, target, world_size, nonce_c,
                                      mac_c = HMAC-SHA256(token, "connect" | service | nonce_a | nonce_c | fields)
    acceptor  -> connector: REPLY     magic, status, message length, mac_a = HMAC(token, "accept" | ... ), message

``service`` ("store", "tcp") keeps a client from talking to the wrong kind of endpoint. Nothing here unpickles
or evaluates anything received.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass

from allreduce.runtime._errors import ProtocolError
from allreduce.runtime.tcp._socket import read_exact

__all__ = [
    "ACCEPT_HANDSHAKE_TIMEOUT_S",
    "CONNECT_HANDSHAKE_MAX_S",
    "HANDSHAKE_VERSION",
    "ClientHello",
    "HandshakeRetryError",
    "RetryLater",
    "accept_handshake",
    "connect_handshake",
    "resolve_token",
]

HANDSHAKE_VERSION = 1

ACCEPT_HANDSHAKE_TIMEOUT_S = 10.0
"""How long the accepting side gives a new connection to complete the handshake: a few small messages that take
milliseconds, so a client still silent after this long is stuck or hostile and its thread is freed."""

CONNECT_HANDSHAKE_MAX_S = 30.0
"""The most the connecting side waits for the endpoint's answers (less when the caller's deadline is nearer)."""

_MAX_REPLY_MESSAGE_BYTES = 1024  # a refusal's reason, cut to this length
_SERVICE_BYTES = 8
_NONCE_BYTES = 32
_HS_MAGIC = b"ARHS"
_GREETING = struct.Struct("!4sB8sB32s")
_HELLO = struct.Struct("!4sBBiiI32s32s")
_REPLY = struct.Struct("!4sBH32s")
_AUTH = 0x01
_STATUS_OK, _STATUS_REFUSED, _STATUS_RETRY = 0, 1, 2


class RetryLater(str):
    """A reason for refusing a client that should try again shortly (returned by an acceptor's ``check``):
    the endpoint is still finishing a previous group and the one the client wants is not up yet."""

    __slots__ = ()


class HandshakeRetryError(ProtocolError):
    """The endpoint answered "not yet" (:class:`RetryLater`); connecting again later may succeed."""


@dataclass(frozen=True, slots=True)
class ClientHello:
    """Who is connecting: ``rank`` (-1: anonymous), the ``target`` rank it means to reach, its ``world_size``."""

    rank: int
    world_size: int
    target: int


def resolve_token(token: str | bytes | None) -> bytes | None:
    """The shared secret: the argument, else ``ALLREDUCE_TOKEN``, else None (loopback only)."""
    if token is None:
        token = os.environ.get("ALLREDUCE_TOKEN") or None
    if token is None:
        return None
    raw = token.encode() if isinstance(token, str) else bytes(token)
    if not raw:
        raise ValueError("the shared token is empty")
    return raw


def _mac(token: bytes, *parts: bytes) -> bytes:
    return hmac.new(token, b"|".join(parts), hashlib.sha256).digest()


def _service_field(service: bytes) -> bytes:
    if len(service) > _SERVICE_BYTES:
        raise ValueError(f"service name {service!r} longer than {_SERVICE_BYTES} bytes")
    return service.ljust(_SERVICE_BYTES, b"\0")


def accept_handshake(
    sock: socket.socket,
    service: bytes,
    token: bytes | None,
    check: Callable[[ClientHello], str | None],
) -> ClientHello:
    """Run the acceptor's side on a fresh connection; return the authenticated hello or raise ProtocolError.

    ``check`` may refuse a well-authenticated client by returning a reason (sent back to it)."""
    nonce_a = secrets.token_bytes(_NONCE_BYTES)
    service8 = _service_field(service)
    sock.sendall(_GREETING.pack(_HS_MAGIC, HANDSHAKE_VERSION, service8, _AUTH if token else 0, nonce_a))
    try:
        raw = read_exact(sock, _HELLO.size)
    except EOFError as exc:
        raise ProtocolError(f"client left during the handshake: {exc}") from exc
    magic, version, flags, rank, target, world_size, nonce_c, mac_c = _HELLO.unpack(raw)
    if magic != _HS_MAGIC:
        raise ProtocolError(f"not an allreduce client (bad handshake magic {magic!r})")
    fields = struct.pack("!iiI", rank, target, world_size)
    reason: str | None = None
    if version != HANDSHAKE_VERSION:
        reason = f"protocol version {version}, this side speaks {HANDSHAKE_VERSION}"
    elif token is not None and not flags & _AUTH:
        reason = "a shared token is required (set ALLREDUCE_TOKEN) and the client presented none"
    elif token is not None and not hmac.compare_digest(
        mac_c, _mac(token, b"connect", service8, nonce_a, nonce_c, fields)
    ):
        reason = "wrong token"
    hello = ClientHello(rank=rank, world_size=world_size, target=target)
    if reason is None:
        reason = check(hello)
    message = (reason or "").encode()[:_MAX_REPLY_MESSAGE_BYTES]
    mac_a = _mac(token, b"accept", service8, nonce_c, nonce_a, fields) if token and reason is None else bytes(32)
    status = _STATUS_OK if reason is None else _STATUS_RETRY if isinstance(reason, RetryLater) else _STATUS_REFUSED
    sock.sendall(_REPLY.pack(_HS_MAGIC, status, len(message), mac_a) + message)
    if reason is not None:
        who = f"rank {rank}" if rank >= 0 else "an anonymous client"
        kind = HandshakeRetryError if isinstance(reason, RetryLater) else ProtocolError
        raise kind(f"refused {who}: {reason}", peer=rank if rank >= 0 else None)
    return hello


def connect_handshake(
    sock: socket.socket, service: bytes, token: bytes | None, hello: ClientHello, *, what: str
) -> None:
    """Run the connector's side; raise ProtocolError (naming ``what`` we connect to) if refused or spoofed."""
    service8 = _service_field(service)
    try:
        raw = read_exact(sock, _GREETING.size)
    except (EOFError, ConnectionResetError) as exc:
        # An endpoint greets every connection it accepts, even one it then refuses: closing before the greeting
        # means it is going away (the previous group's store stopping), so the caller may come back.
        raise HandshakeRetryError(f"{what} closed the connection before the handshake (stopping?)") from exc
    magic, version, their_service, flags, nonce_a = _GREETING.unpack(raw)
    if magic != _HS_MAGIC:
        raise ProtocolError(f"{what} is not an allreduce endpoint (bad handshake magic {magic!r})")
    if their_service != service8:
        kind = their_service.rstrip(b"\0").decode(errors="replace")
        raise ProtocolError(f"{what} is a {kind!r} endpoint, expected {service.decode()!r}")
    if version != HANDSHAKE_VERSION:
        raise ProtocolError(f"{what} speaks protocol version {version}, this side {HANDSHAKE_VERSION}")
    nonce_c = secrets.token_bytes(_NONCE_BYTES)
    fields = struct.pack("!iiI", hello.rank, hello.target, hello.world_size)
    use_auth = token is not None
    mac_c = _mac(token, b"connect", service8, nonce_a, nonce_c, fields) if token is not None else bytes(32)
    sock.sendall(
        _HELLO.pack(
            _HS_MAGIC,
            HANDSHAKE_VERSION,
            _AUTH if use_auth else 0,
            hello.rank,
            hello.target,
            hello.world_size,
            nonce_c,
            mac_c,
        )
    )
    try:
        magic, status, length, mac_a = _REPLY.unpack(read_exact(sock, _REPLY.size))
        message = read_exact(sock, length).decode(errors="replace") if length else ""
    except (EOFError, ConnectionResetError) as exc:
        # A refusal is a reply; closing without one means the endpoint is going away: the caller may come back.
        raise HandshakeRetryError(f"{what} closed the connection during the handshake (stopping?)") from exc
    if status == _STATUS_RETRY:
        raise HandshakeRetryError(f"{what} is not ready for this client yet: {message}")
    if status != _STATUS_OK:
        raise ProtocolError(f"{what} refused the connection: {message}")
    if token is not None:
        if not flags & _AUTH:
            raise ProtocolError(f"{what} does not use a token but this side has one (ALLREDUCE_TOKEN mismatch?)")
        if not hmac.compare_digest(mac_a, _mac(token, b"accept", service8, nonce_c, nonce_a, fields)):
            raise ProtocolError(f"{what} failed to prove it knows the shared token")
