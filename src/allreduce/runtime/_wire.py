"""The wire protocol: the data-path frame header and the connection handshake (store and TCP transport).

Frame header (44 bytes, network byte order, packed with :mod:`struct`)::

    magic "AR" | version u8 | flags u8 | sequence u64 | step u32 | block u32 | segment u32 |
    length u64 | crc32 u32 | tag u32 | header crc32 u32

``sequence`` numbers the collective, ``step``/``block``/``segment`` place the payload in the schedule,
``length`` is the payload size in bytes, ``crc32`` the payload checksum (only with the CHECKSUM flag, else 0),
``tag`` a hash of the compiled plan (schedule, world size, element count, dtype) so two ranks running different
plans are caught at the first frame, and the header crc catches a corrupted or misaligned header. The receiver
always knows which frame it expects next on a connection, so every field is checked against that expectation.

Handshake (both directions authenticate when a token is set; the token itself never crosses the network)::

    acceptor  -> connector: GREETING  magic "ARHS", version, service, flags(auth), nonce_a
    connector -> acceptor : HELLO     magic, version, flags(has mac), rank, target, world_size, nonce_c,
                                      mac_c = HMAC-SHA256(token, "connect" | service | nonce_a | nonce_c | fields)
    acceptor  -> connector: REPLY     magic, status, message length, mac_a = HMAC(token, "accept" | ... ), message

Nothing here unpickles or evaluates anything received.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
import socket
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from allreduce.runtime._errors import ProtocolError

__all__ = [
    "FLAG_ABORT",
    "FLAG_AGREE",
    "FLAG_CHECKSUM",
    "HEADER",
    "HEADER_SIZE",
    "MAGIC",
    "MAX_PAYLOAD_BYTES",
    "VERSION",
    "ClientHello",
    "FrameHeader",
    "HandshakeRetryError",
    "RetryLater",
    "accept_handshake",
    "connect_handshake",
    "decode_header",
    "encode_header",
    "is_loopback",
    "recv_exact",
    "resolve_token",
]

MAGIC = b"AR"
VERSION = 1
FLAG_CHECKSUM = 0x01  # crc32 carries the payload checksum
FLAG_AGREE = 0x02  # a descriptor of the agreement all-gather, not schedule data
FLAG_ABORT = 0x04  # the sender gave up; block = culprit rank, segment = error kind, payload = message
_KNOWN_FLAGS = FLAG_CHECKSUM | FLAG_AGREE | FLAG_ABORT
MAX_PAYLOAD_BYTES = 1 << 40  # a frame never carries more than 1 TiB: anything larger is garbage
MAX_ABORT_BYTES = 4096

# Everything but the trailing header crc; the crc covers exactly these bytes.
_BODY = struct.Struct("!2sBBQIIIQII")
HEADER = struct.Struct("!2sBBQIIIQIII")
HEADER_SIZE = HEADER.size


@dataclass(frozen=True, slots=True)
class FrameHeader:
    flags: int
    sequence: int
    step: int
    block: int
    segment: int
    length: int
    crc32: int = 0
    tag: int = 0

    @property
    def checksum(self) -> bool:
        return bool(self.flags & FLAG_CHECKSUM)


def encode_header(
    *,
    sequence: int,
    step: int,
    block: int,
    segment: int,
    length: int,
    flags: int = 0,
    crc32: int = 0,
    tag: int = 0,
) -> bytes:
    """The 44-byte header of a frame; raises ValueError for fields out of range."""
    if flags & ~_KNOWN_FLAGS:
        raise ValueError(f"unknown frame flags {flags:#x}")
    if not 0 <= length <= MAX_PAYLOAD_BYTES:
        raise ValueError(f"frame length {length} out of range [0, {MAX_PAYLOAD_BYTES}]")
    if crc32 and not flags & FLAG_CHECKSUM:
        raise ValueError("a payload crc32 needs the CHECKSUM flag")
    try:
        body = _BODY.pack(MAGIC, VERSION, flags, sequence, step, block, segment, length, crc32, tag)
    except struct.error as exc:
        raise ValueError(f"frame header field out of range: {exc}") from exc
    return body + struct.pack("!I", zlib.crc32(body))


def decode_header(data: bytes | bytearray | memoryview) -> FrameHeader:
    """Parse and validate a header; :class:`ProtocolError` says what is wrong with a bad one."""
    view = memoryview(data).cast("B")
    if len(view) < HEADER_SIZE:
        raise ProtocolError(f"truncated frame header: {len(view)} of {HEADER_SIZE} bytes")
    if len(view) > HEADER_SIZE:
        raise ProtocolError(f"frame header of {len(view)} bytes; expected exactly {HEADER_SIZE}")
    magic, version, flags, sequence, step, block, segment, length, crc, tag, header_crc = HEADER.unpack(view)
    if magic != MAGIC:
        raise ProtocolError(
            f"bad frame magic {bytes(magic)!r} (expected {MAGIC!r}): not an allreduce peer, or lost sync"
        )
    if version != VERSION:
        raise ProtocolError(f"frame version {version}, this side speaks {VERSION}: mixed allreduce versions?")
    actual = zlib.crc32(view[: _BODY.size])
    if actual != header_crc:
        raise ProtocolError(f"frame header checksum mismatch ({header_crc:#010x} != {actual:#010x}): header corrupted")
    if flags & ~_KNOWN_FLAGS:
        raise ProtocolError(f"unknown frame flags {flags:#x}")
    if flags & FLAG_ABORT and flags & FLAG_AGREE:
        raise ProtocolError("inconsistent frame: both ABORT and AGREE flags set")
    if crc and not flags & FLAG_CHECKSUM:
        raise ProtocolError(f"inconsistent frame: payload crc32 {crc:#010x} without the CHECKSUM flag")
    if length > MAX_PAYLOAD_BYTES:
        raise ProtocolError(f"frame length {length} exceeds the maximum {MAX_PAYLOAD_BYTES}")
    if flags & FLAG_ABORT and length > MAX_ABORT_BYTES:
        raise ProtocolError(f"abort frame with a {length}-byte message (at most {MAX_ABORT_BYTES})")
    return FrameHeader(flags, sequence, step, block, segment, length, crc, tag)


# ---------------------------------------------------------------------------------------------- handshake

_HS_MAGIC = b"ARHS"
_GREETING = struct.Struct("!4sB8sB32s")
_HELLO = struct.Struct("!4sBBiiI32s32s")
_REPLY = struct.Struct("!4sBH32s")
_AUTH = 0x01
_STATUS_OK, _STATUS_REFUSED, _STATUS_RETRY = 0, 1, 2


class RetryLater(str):
    """A reason for refusing a client that should try again shortly (returned by an acceptor's ``check``):
    the endpoint is still finishing a previous group and the one the client wants is not up yet."""


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


def is_loopback(host: str) -> bool:
    """Whether listening on ``host`` keeps the port on this machine (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def recv_exact(sock: socket.socket, size: int) -> bytes:
    """Exactly ``size`` bytes from ``sock``; EOFError if the peer closes first."""
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise EOFError(f"connection closed after {got} of {size} bytes")
        got += n
    return bytes(buf)


def _mac(token: bytes, *parts: bytes) -> bytes:
    return hmac.new(token, b"|".join(parts), hashlib.sha256).digest()


def _service_field(service: bytes) -> bytes:
    if len(service) > 8:
        raise ValueError(f"service name {service!r} longer than 8 bytes")
    return service.ljust(8, b"\0")


def accept_handshake(
    sock: socket.socket,
    service: bytes,
    token: bytes | None,
    check: Callable[[ClientHello], str | None],
) -> ClientHello:
    """Run the acceptor's side on a fresh connection; return the authenticated hello or raise ProtocolError.

    ``check`` may refuse a well-authenticated client by returning a reason (sent back to it)."""
    nonce_a = secrets.token_bytes(32)
    service8 = _service_field(service)
    sock.sendall(_GREETING.pack(_HS_MAGIC, VERSION, service8, _AUTH if token else 0, nonce_a))
    try:
        raw = recv_exact(sock, _HELLO.size)
    except EOFError as exc:
        raise ProtocolError(f"client left during the handshake: {exc}") from exc
    magic, version, flags, rank, target, world_size, nonce_c, mac_c = _HELLO.unpack(raw)
    if magic != _HS_MAGIC:
        raise ProtocolError(f"not an allreduce client (bad handshake magic {magic!r})")
    fields = struct.pack("!iiI", rank, target, world_size)
    reason: str | None = None
    if version != VERSION:
        reason = f"protocol version {version}, this side speaks {VERSION}"
    elif token is not None and not flags & _AUTH:
        reason = "a shared token is required (set ALLREDUCE_TOKEN) and the client presented none"
    elif token is not None and not hmac.compare_digest(
        mac_c, _mac(token, b"connect", service8, nonce_a, nonce_c, fields)
    ):
        reason = "wrong token"
    hello = ClientHello(rank=rank, world_size=world_size, target=target)
    if reason is None:
        reason = check(hello)
    message = (reason or "").encode()[:1024]
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
        raw = recv_exact(sock, _GREETING.size)
    except EOFError as exc:
        raise ProtocolError(f"{what} closed the connection before the handshake") from exc
    magic, version, their_service, flags, nonce_a = _GREETING.unpack(raw)
    if magic != _HS_MAGIC:
        raise ProtocolError(f"{what} is not an allreduce endpoint (bad handshake magic {magic!r})")
    if their_service != service8:
        kind = their_service.rstrip(b"\0").decode(errors="replace")
        raise ProtocolError(f"{what} is a {kind!r} endpoint, expected {service.decode()!r}")
    if version != VERSION:
        raise ProtocolError(f"{what} speaks protocol version {version}, this side {VERSION}")
    nonce_c = secrets.token_bytes(32)
    fields = struct.pack("!iiI", hello.rank, hello.target, hello.world_size)
    use_auth = token is not None
    mac_c = _mac(token, b"connect", service8, nonce_a, nonce_c, fields) if token is not None else bytes(32)
    sock.sendall(
        _HELLO.pack(
            _HS_MAGIC, VERSION, _AUTH if use_auth else 0, hello.rank, hello.target, hello.world_size, nonce_c, mac_c
        )
    )
    try:
        magic, status, length, mac_a = _REPLY.unpack(recv_exact(sock, _REPLY.size))
        message = recv_exact(sock, length).decode(errors="replace") if length else ""
    except EOFError as exc:
        raise ProtocolError(f"{what} closed the connection during the handshake") from exc
    if status == _STATUS_RETRY:
        raise HandshakeRetryError(f"{what} is not ready for this client yet: {message}")
    if status != _STATUS_OK:
        raise ProtocolError(f"{what} refused the connection: {message}")
    if token is not None:
        if not flags & _AUTH:
            raise ProtocolError(f"{what} does not use a token but this side has one (ALLREDUCE_TOKEN mismatch?)")
        if not hmac.compare_digest(mac_a, _mac(token, b"accept", service8, nonce_c, nonce_a, fields)):
            raise ProtocolError(f"{what} failed to prove it knows the shared token")
