"""The authenticated connection handshake, spoken by the store and the TCP transport alike.

Both directions authenticate; the token itself never crosses the network::

    acceptor  -> connector: GREETING  magic "ARHS", version, service, flags(auth), nonce_a, pid_a
    connector -> acceptor : HELLO     magic, version, flags(has mac), rank, target, world_size, pid_c, nonce_c,
                                      mac_c = HMAC-SHA256(token, "connect" | service | nonce_a | nonce_c | fields)
    acceptor  -> connector: REPLY     magic, status, message length, mac_a = HMAC(token, "accept" | ... ), message

With a token, the MACs prove each side knows it. Without one (loopback only), each side checks the other's
socket instead (:mod:`allreduce.runtime.tcp._peercred`): it must belong to this user's uid and be held by the
process whose pid the other side announced (``pid_a``, ``pid_c``). ``service`` ("store", "tcp") keeps a client
from talking to the wrong kind of endpoint. Nothing here unpickles or evaluates anything received.

The acceptor's side is a state machine without I/O (:class:`AcceptHandshake`), so that one thread can run the
handshakes of many connections at once (:mod:`._listener`).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
import secrets
import select
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass

from allreduce.runtime._errors import ProtocolError
from allreduce.runtime.tcp._peercred import PeerCredentials, holds_socket, loopback_peer
from allreduce.runtime.tcp._socket import read_exact

__all__ = [
    "ACCEPT_HANDSHAKE_TIMEOUT_S",
    "CONNECT_HANDSHAKE_MAX_S",
    "HANDSHAKE_VERSION",
    "AcceptHandshake",
    "ClientHello",
    "HandshakeRefusedError",
    "HandshakeRetryError",
    "Refusal",
    "RetryLater",
    "accept_handshake",
    "connect_handshake",
    "resolve_token",
]

HANDSHAKE_VERSION = 2

ACCEPT_HANDSHAKE_TIMEOUT_S = 5.0
"""How long the accepting side gives a new connection to complete the handshake: a few small messages that take
milliseconds, so a client still silent after this long is stuck or hostile and is closed."""

CONNECT_HANDSHAKE_MAX_S = 30.0
"""The most the connecting side waits for the endpoint's answers (less when the caller's deadline is nearer)."""

_MAX_REPLY_MESSAGE_BYTES = 1024  # a refusal's reason, cut to this length
_SERVICE_BYTES = 8
_NONCE_BYTES = 32
_HS_MAGIC = b"ARHS"
_GREETING = struct.Struct("!4sB8sB32sI")
_HELLO = struct.Struct("!4sBBiiII32s32s")
_REPLY = struct.Struct("!4sBH32s")
_AUTH = 0x01
_STATUS_OK, _STATUS_REFUSED, _STATUS_RETRY = 0, 1, 2


class RetryLater(str):
    """A reason for refusing a client that should try again shortly (returned by an acceptor's ``check``):
    the endpoint is still finishing a previous group and the one the client wants is not up yet."""

    __slots__ = ()


class Refusal(enum.Enum):
    """Why an acceptor refused a connection, as its owner reports it."""

    WRONG_TOKEN = "wrong token"
    NO_TOKEN = "no token"
    FOREIGN_UID = "foreign uid"
    UNVERIFIED_PEER = "unverified peer"
    PROTOCOL = "protocol"
    OWNER = "refused by the endpoint"  # the owner's check said no (duplicate rank, size mismatch, ...)
    RETRY = "not yet"


class HandshakeRetryError(ProtocolError):
    """The endpoint answered "not yet" (:class:`RetryLater`); connecting again later may succeed."""


class HandshakeRefusedError(ProtocolError):
    """The acceptor refused a client: ``kind`` says why, ``reason`` is what the client was told (or the message),
    ``hello`` is what the client claimed (None if it never said)."""

    def __init__(self, message: str, *, kind: Refusal, hello: ClientHello | None, reason: str | None = None) -> None:
        super().__init__(message, peer=hello.rank if hello is not None and hello.rank >= 0 else None)
        self.kind = kind
        self.hello = hello
        self.reason = message if reason is None else reason


@dataclass(frozen=True, slots=True)
class ClientHello:
    """Who is connecting: ``rank`` (-1: anonymous), the ``target`` rank it means to reach, its ``world_size``;
    ``pid``: its process id, once the acceptor has verified it (None with a token, or before the check)."""

    rank: int
    world_size: int
    target: int
    pid: int | None = None


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


def _unverified_peer(peer: PeerCredentials | None, pid: int, whose: str) -> tuple[Refusal, str] | None:
    """Why the other end of a loopback connection without a token is not to be trusted, or None."""
    uid = os.geteuid()
    if peer is None:
        return Refusal.UNVERIFIED_PEER, (
            f"cannot tell who owns {whose} socket (not on loopback, or /proc/net/tcp unreadable): set ALLREDUCE_TOKEN"
        )
    if peer.uid != uid:
        return Refusal.FOREIGN_UID, f"foreign uid: {whose} socket belongs to uid {peer.uid}, this side runs as {uid}"
    if peer.pid is not None and peer.pid != pid:
        return Refusal.UNVERIFIED_PEER, f"{whose} announced pid {pid}, but the kernel says pid {peer.pid} holds it"
    if peer.pid is None and not holds_socket(pid, peer.inode):
        return Refusal.UNVERIFIED_PEER, (
            f"{whose} announced pid {pid}, which does not hold its socket "
            "(in another PID namespace? then set ALLREDUCE_TOKEN)"
        )
    return None


class AcceptHandshake:
    """The acceptor's side on one fresh connection: send :attr:`greeting`, read :data:`hello_size` bytes, pass them
    to :meth:`answer`, send its reply; then the connection is the owner's (accepted) or closed (refused).

    ``check`` may refuse a well-authenticated client by returning a reason (sent back to it). ``peer`` reads the
    credentials of the connection's other end, used without a token (loopback only)."""

    hello_size = _HELLO.size

    def __init__(
        self,
        service: bytes,
        token: bytes | None,
        check: Callable[[ClientHello], str | None],
        peer: Callable[[], PeerCredentials | None],
    ) -> None:
        self._service8 = _service_field(service)
        self._token = token
        self._check = check
        self._peer = peer
        self._nonce_a = secrets.token_bytes(_NONCE_BYTES)
        self._pid = os.getpid()
        self.greeting = _GREETING.pack(
            _HS_MAGIC, HANDSHAKE_VERSION, self._service8, _AUTH if token else 0, self._nonce_a, self._pid
        )

    def answer(self, raw: bytes) -> tuple[bytes, ClientHello | HandshakeRefusedError]:
        """The reply to send for the client's HELLO ``raw``, and the verified hello or why it was refused."""
        magic, version, flags, rank, target, world_size, pid_c, nonce_c, mac_c = _HELLO.unpack(raw)
        claimed = ClientHello(rank=rank, world_size=world_size, target=target)
        if magic != _HS_MAGIC:  # not our protocol: no reply, the connection is closed
            why = f"not an allreduce client (bad handshake magic {magic!r})"
            return b"", HandshakeRefusedError(why, kind=Refusal.PROTOCOL, hello=None)
        fields = struct.pack("!iiII", rank, target, world_size, pid_c)
        token = self._token
        problem: tuple[Refusal, str] | None = None
        verified_pid: int | None = None
        if version != HANDSHAKE_VERSION:
            problem = Refusal.PROTOCOL, f"protocol version {version}, this side speaks {HANDSHAKE_VERSION}"
        elif token is not None and not flags & _AUTH:
            problem = (
                Refusal.NO_TOKEN,
                "no token: a shared token is required (set ALLREDUCE_TOKEN) and the client presented none",
            )
        elif token is not None and not hmac.compare_digest(
            mac_c, _mac(token, b"connect", self._service8, self._nonce_a, nonce_c, fields)
        ):
            problem = Refusal.WRONG_TOKEN, "wrong token"
        elif token is None:
            problem = _unverified_peer(self._peer(), pid_c, "the client's")
            verified_pid = pid_c if problem is None else None
        hello = ClientHello(rank=rank, world_size=world_size, target=target, pid=verified_pid)
        if problem is None:
            reason = self._check(hello)
            if reason is not None:
                problem = (Refusal.RETRY if isinstance(reason, RetryLater) else Refusal.OWNER), reason
        if problem is None:
            mac_a = _mac(token, b"accept", self._service8, nonce_c, self._nonce_a, fields) if token else bytes(32)
            return _REPLY.pack(_HS_MAGIC, _STATUS_OK, 0, mac_a), hello
        kind, reason = problem
        message = reason.encode()[:_MAX_REPLY_MESSAGE_BYTES]
        status = _STATUS_RETRY if kind is Refusal.RETRY else _STATUS_REFUSED
        who = f"rank {rank}" if rank >= 0 else "an anonymous client"
        error = HandshakeRefusedError(f"refused {who} (pid {pid_c}): {reason}", kind=kind, hello=claimed, reason=reason)
        return _REPLY.pack(_HS_MAGIC, status, len(message), bytes(32)) + message, error


_CLOSED_WAIT_S = 0.2
"""How long a connector that could not verify its endpoint waits to see whether the endpoint closed the connection
(a stopping endpoint's close is already on its way when its socket is found held by nobody)."""


def _closed_by_endpoint(sock: socket.socket) -> bool:
    """Whether the other end has closed ``sock`` (EOF or reset) or does so within :data:`_CLOSED_WAIT_S`."""
    try:
        # poll, not select: select.select refuses descriptors numbered 1024 or more.
        poller = select.poll()
        poller.register(sock, select.POLLIN | select.POLLRDHUP)
        ready = poller.poll(_CLOSED_WAIT_S * 1000)
        return bool(ready) and sock.recv(1, socket.MSG_PEEK) == b""
    except (ConnectionResetError, ConnectionAbortedError):
        return True
    except OSError:
        return False


def connect_handshake(
    sock: socket.socket,
    service: bytes,
    token: bytes | None,
    hello: ClientHello,
    *,
    what: str,
    expected_pid: int | None = None,
) -> int:
    """Run the connector's side; raise ProtocolError (naming ``what`` we connect to) if refused or spoofed.

    Without a token, the endpoint's socket must belong to this user and be held by the process it announces
    (and that process must be ``expected_pid`` when given). Returns the endpoint's pid."""
    service8 = _service_field(service)
    try:
        raw = read_exact(sock, _GREETING.size)
    except (EOFError, ConnectionResetError) as exc:
        # An endpoint greets every connection it accepts, even one it then refuses: closing before the greeting
        # means it is going away (the previous group's store stopping), or it is full: the caller may come back.
        raise HandshakeRetryError(f"{what} closed the connection before the handshake (stopping?)") from exc
    magic, version, their_service, flags, nonce_a, pid_a = _GREETING.unpack(raw)
    if magic != _HS_MAGIC:
        raise ProtocolError(f"{what} is not an allreduce endpoint (bad handshake magic {magic!r})")
    if their_service != service8:
        kind = their_service.rstrip(b"\0").decode(errors="replace")
        raise ProtocolError(f"{what} is a {kind!r} endpoint, expected {service.decode()!r}")
    if version != HANDSHAKE_VERSION:
        raise ProtocolError(f"{what} speaks protocol version {version}, this side {HANDSHAKE_VERSION}")
    if token is None:
        problem = _unverified_peer(loopback_peer(sock), pid_a, f"{what}'s")
        if problem is not None:
            if _closed_by_endpoint(sock):
                # It greeted, then closed: an endpoint stopping (the previous group's store), whose socket no
                # process holds any more, not an impostor, which keeps the connection open for the hello.
                raise HandshakeRetryError(f"{what} closed the connection during the handshake (stopping?)")
            raise ProtocolError(f"{what} is not this job's endpoint: {problem[1]}")
        if expected_pid is not None and pid_a != expected_pid:
            raise ProtocolError(f"{what} is held by pid {pid_a}, not by pid {expected_pid} as expected")
    nonce_c = secrets.token_bytes(_NONCE_BYTES)
    pid_c = os.getpid()
    fields = struct.pack("!iiII", hello.rank, hello.target, hello.world_size, pid_c)
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
            pid_c,
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
    return int(pid_a)


def accept_handshake(
    sock: socket.socket, service: bytes, token: bytes | None, check: Callable[[ClientHello], str | None]
) -> ClientHello:
    """The acceptor's side run to its end on one blocking socket: the verified hello, or the refusal raised (for
    tools and tests; listeners drive :class:`AcceptHandshake` from their selector without blocking)."""
    handshake = AcceptHandshake(service, token, check, lambda: loopback_peer(sock))
    sock.sendall(handshake.greeting)
    reply, outcome = handshake.answer(read_exact(sock, handshake.hello_size))
    if reply:
        sock.sendall(reply)
    if isinstance(outcome, HandshakeRefusedError):
        raise outcome
    return outcome
