"""A listening socket that accepts connections and authenticates each one, for the store and the TCP transport.

One thread runs every handshake at once (:class:`~._handshake.AcceptHandshake` over non-blocking sockets and a
selector), so an idle or hostile client costs a socket and a few hundred bytes, never a thread, and never stalls
the others or the owner's loop. A connection that has not finished its handshake within
:data:`~._handshake.ACCEPT_HANDSHAKE_TIMEOUT_S` is closed; at most :data:`MAX_PENDING_HANDSHAKES` are under way
(when full, the oldest is closed once it is :data:`EVICT_AFTER_S` old, else new ones wait in the kernel's queue).
The owner hears of every authenticated connection (``accepted``) and of every refused one (``refused``), and
decides who is welcome (``check``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from allreduce.runtime._errors import ProtocolError
from allreduce.runtime.tcp._handshake import (
    ACCEPT_HANDSHAKE_TIMEOUT_S,
    AcceptHandshake,
    ClientHello,
    HandshakeRefusedError,
    Refusal,
)
from allreduce.runtime.tcp._peercred import loopback_peer
from allreduce.runtime.tcp._socket import family_of

__all__ = [
    "ACCEPTOR_JOIN_S",
    "EVICT_AFTER_S",
    "MAX_PENDING_HANDSHAKES",
    "REFUSALS_SHOWN",
    "Listener",
    "RefusalLog",
    "listening_socket",
]

ACCEPTOR_JOIN_S = 10.0
"""How long :meth:`Listener.close` waits for the accepting thread to notice; it wakes at once, so this only
bounds a thread stuck in the kernel."""

MAX_PENDING_HANDSHAKES = 128
"""Connections whose handshake may be under way at once: each costs a socket (a file descriptor) and a few hundred
bytes; legitimate ones finish in milliseconds, so more would only serve a flood of idle connections."""

EVICT_AFTER_S = 1.0
"""With :data:`MAX_PENDING_HANDSHAKES` under way, the oldest is closed to make room once it is this old (a live
client answers the greeting in milliseconds); younger ones are left to finish while new ones wait in the kernel."""

REFUSALS_SHOWN = 5
"""Refused clients a :class:`RefusalLog` describes one line each (on rank 0's stderr, for the store). After them it
only counts: a port scan or a crowd of strangers would otherwise print a line per connection (500 connections,
500 lines). The count is logged at each power of ten and, if any went unshown, when the listener's owner stops."""

_MIN_BACKLOG = 128  # pending connections the kernel queues; at least one per rank of a large group
_ACCEPTS_PER_WAKE = 64  # connections taken from the kernel's queue per wake-up, so handshakes under way progress


def listening_socket(host: str, *, backlog: int, congestion: bytes | None = None) -> socket.socket:
    """A TCP socket bound to a free port of ``host`` and listening; with ``congestion``, the TCP congestion
    control every connection it accepts starts with (they inherit a listener's chosen one, ``tcp_ca_openreq_child``;
    see :func:`allreduce.runtime.tcp._socket.connect_tcp` for why it must be chosen before the handshake)."""
    sock = socket.create_server((host, 0), family=family_of(host), backlog=max(_MIN_BACKLOG, backlog))
    if congestion is not None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, congestion)
        except BaseException:
            sock.close()
            raise
    return sock


Accepted = Callable[[socket.socket, ClientHello, str], None]
"""``accepted(sock, hello, address)``: a connection authenticated (handed over non-blocking); the callee owns
``sock`` from now on."""

Refused = Callable[[str, BaseException, "ClientHello | None"], None]
"""``refused(address, error, admitted)``: a connection failed its handshake (it is closed, or is being closed
once the refusal has been sent: the owner hears of a refusal before the client does); ``admitted`` is its hello
when ``check`` had let it in before the handshake broke (so the owner can release what it reserved). A
:class:`~._handshake.HandshakeRefusedError` says why (``kind``) and who the client claimed to be (``hello``)."""


@dataclass(eq=False)
class _Pending:
    """One connection in its handshake."""

    sock: socket.socket
    address: str
    handshake: AcceptHandshake
    started: float
    outbuf: bytearray
    inbuf: bytearray = field(default_factory=bytearray)
    outcome: ClientHello | HandshakeRefusedError | None = None  # decided; sent once outbuf drains
    reported: bool = False  # the owner has heard of the refusal


class Listener:
    """Accepts and authenticates connections on ``sock`` (bound and listening) until :meth:`close`."""

    def __init__(
        self,
        sock: socket.socket,
        *,
        service: bytes,
        token: bytes | None,
        check: Callable[[ClientHello], str | None],
        accepted: Accepted,
        refused: Refused,
        name: str,
    ) -> None:
        self.sock = sock
        self._service = service
        self._token = token
        self._check = check
        self._accepted = accepted
        self._refused = refused
        self._name = name
        self._closed = False
        # Held while a connection is handed over and while closing, so that no connection is handed over after
        # close() returned (its owner has released what it holds by then and would never close it).
        self._handover = threading.Lock()
        self._pending: dict[socket.socket, _Pending] = {}  # only the accepting thread touches it
        self._listening = True  # whether the selector watches self.sock (not while the handshakes are full)
        self._paused_until = 0.0  # after a failed accept (out of descriptors): time.monotonic() to listen again
        sock.setblocking(False)  # a connection that vanishes between poll and accept must not block the loop
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.sock, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._loop, name=f"{name}-accept", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    def pending_handshakes(self) -> int:
        """Connections whose handshake is under way now."""
        return len(self._pending)

    def close(self) -> None:
        """Stop accepting and close the listening socket (connections already handed over stay open).

        Handshakes still under way are cut short and have reported (refused) when this returns."""
        with self._handover:
            if self._closed:
                return
            self._closed = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=ACCEPTOR_JOIN_S)

    def _stopped(self) -> bool:
        """Whether close() has begun (read again after every wait: another thread sets it)."""
        return self._closed

    # -- the accepting thread
    def _loop(self) -> None:
        try:
            while not self._closed:
                events = self._selector.select(self._next_timeout())
                if self._stopped():
                    break
                for key, _ in events:
                    if key.fileobj is self._wake_r:
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(4096)
                    elif key.fileobj is self.sock:
                        self._accept_some()
                    else:
                        pending: _Pending = key.data
                        if pending.sock in self._pending:
                            self._progress(pending)
                self._expire()
        finally:
            for pending in list(self._pending.values()):
                self._finish(pending, ProtocolError("the endpoint closed during the handshake"))
            self._selector.close()
            for sock in (self.sock, self._wake_r, self._wake_w):
                sock.close()

    def _next_timeout(self) -> float | None:
        wake_at = [] if self._listening else [self._paused_until]
        if self._pending:
            wake_at.append(min(p.started for p in self._pending.values()) + ACCEPT_HANDSHAKE_TIMEOUT_S)
        return max(0.0, min(wake_at) - time.monotonic()) if wake_at else None

    def _accept_some(self) -> None:
        for _ in range(_ACCEPTS_PER_WAKE):
            if len(self._pending) >= MAX_PENDING_HANDSHAKES:
                oldest = min(self._pending.values(), key=lambda p: p.started)
                if time.monotonic() - oldest.started < EVICT_AFTER_S:
                    self._pause(until=oldest.started + EVICT_AFTER_S)
                    return
                message = f"closed after {EVICT_AFTER_S:g} s: too many connections in handshake"
                self._finish(oldest, _refusal(oldest, message))
            try:
                sock, addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError:  # e.g. out of file descriptors: leave the rest in the kernel's queue for a while
                self._pause(until=time.monotonic() + EVICT_AFTER_S)
                return
            sock.setblocking(False)
            handshake = AcceptHandshake(self._service, self._token, self._check, functools.partial(loopback_peer, sock))
            pending = _Pending(sock, _describe(sock, addr), handshake, time.monotonic(), bytearray(handshake.greeting))
            self._pending[sock] = pending
            self._selector.register(sock, selectors.EVENT_READ, pending)
            self._progress(pending)
        if len(self._pending) < MAX_PENDING_HANDSHAKES:
            self._start_listening()

    def _resume(self) -> None:
        """Listen again after a pause, or make room in the handshakes if it can be made now."""
        if self._listening or time.monotonic() < self._paused_until:
            return
        if len(self._pending) < MAX_PENDING_HANDSHAKES:
            self._start_listening()
        else:
            self._accept_some()  # room only if the oldest can be closed now

    def _pause(self, *, until: float) -> None:
        """Stop taking connections from the kernel's queue until ``until`` (``time.monotonic()``)."""
        self._paused_until = until
        if self._listening:
            self._selector.unregister(self.sock)
            self._listening = False

    def _start_listening(self) -> None:
        if not self._listening and not self._closed:
            self._selector.register(self.sock, selectors.EVENT_READ, None)
            self._listening = True

    def _expire(self) -> None:
        now = time.monotonic()
        for pending in [p for p in self._pending.values() if now - p.started >= ACCEPT_HANDSHAKE_TIMEOUT_S]:
            message = f"did not finish the handshake within {ACCEPT_HANDSHAKE_TIMEOUT_S:g} s"
            self._finish(pending, _refusal(pending, message))
        self._resume()

    def _progress(self, pending: _Pending) -> None:
        """Send what is owed, read what is due, and decide once the client's hello is complete."""
        try:
            while pending.outbuf:
                sent = pending.sock.send(pending.outbuf)
                del pending.outbuf[:sent]
            if pending.outcome is None:
                while len(pending.inbuf) < pending.handshake.hello_size:
                    chunk = pending.sock.recv(pending.handshake.hello_size - len(pending.inbuf))
                    if not chunk:
                        self._finish(pending, _refusal(pending, "the client left during the handshake"))
                        return
                    pending.inbuf += chunk
                reply, outcome = pending.handshake.answer(bytes(pending.inbuf))
                pending.outcome = outcome
                if not isinstance(outcome, ClientHello):
                    pending.reported = True
                    self._refused(pending.address, outcome, None)
                pending.outbuf += reply
                while pending.outbuf:
                    sent = pending.sock.send(pending.outbuf)
                    del pending.outbuf[:sent]
        except (BlockingIOError, InterruptedError):
            events = selectors.EVENT_WRITE if pending.outbuf else selectors.EVENT_READ
            self._selector.modify(pending.sock, events, pending)
            return
        except OSError as exc:
            self._finish(pending, _refusal(pending, f"the connection broke during the handshake ({exc})"))
            return
        if pending.outcome is not None:
            self._finish(pending, pending.outcome)

    def _finish(self, pending: _Pending, outcome: ClientHello | BaseException) -> None:
        """Hand an authenticated connection over, or close and report a refused one."""
        del self._pending[pending.sock]
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(pending.sock)
        admitted = pending.outcome if isinstance(pending.outcome, ClientHello) else None
        if isinstance(outcome, ClientHello):
            with self._handover:
                if not self._closed:
                    self._accepted(pending.sock, outcome, pending.address)
                    return
            # The owner has stopped: nobody would ever close this connection.
            outcome = ProtocolError("the endpoint closed during the handshake")
        pending.sock.close()
        if not pending.reported:
            self._refused(pending.address, outcome, admitted)


def _refusal(pending: _Pending, message: str) -> HandshakeRefusedError:
    """Why a connection that broke or stalled in its handshake was closed."""
    admitted = pending.outcome if isinstance(pending.outcome, ClientHello) else None
    return HandshakeRefusedError(f"{pending.address}: {message}", kind=Refusal.PROTOCOL, hello=admitted)


def _describe(sock: socket.socket, addr: object) -> str:
    """Where a connection came from, for messages: host:port, or for a Unix socket (whose client may have no
    address at all) the process the kernel names."""
    if sock.family == socket.AF_UNIX:
        peer = loopback_peer(sock)
        return f"unix socket of pid {peer.pid}" if peer is not None else "an unnamed unix socket"
    if isinstance(addr, tuple) and len(addr) >= 2:
        return f"{addr[0]}:{addr[1]}"
    return str(addr)


class RefusalLog:
    """Warnings about refused clients on ``log``: the first :data:`REFUSALS_SHOWN` one line each, then a count
    (:meth:`note` is called from the listener's thread, :meth:`summarize` when the owner stops)."""

    def __init__(self, log: logging.Logger, owner: str) -> None:
        self._log = log
        self._owner = owner
        self._lock = threading.Lock()
        self.count = 0

    def note(self, address: str, error: BaseException, *, routine: bool = False) -> None:
        """A refusal; a ``routine`` one (a "not yet" to a client that will come back) is only a debug line."""
        if routine:
            self._log.debug("%s refused a client from %s: %s", self._owner, address, error)
            return
        with self._lock:
            self.count += 1
            n = self.count
        if n <= REFUSALS_SHOWN:
            self._log.warning("%s refused a client from %s: %s", self._owner, address, error)
        if n == REFUSALS_SHOWN:
            self._log.warning("%s: further refused clients are counted, not shown one by one", self._owner)
        elif n > REFUSALS_SHOWN and _power_of_ten(n):
            self._log.warning("%s: %d clients refused so far", self._owner, n)

    def summarize(self) -> None:
        with self._lock:
            n = self.count
        if n > REFUSALS_SHOWN:
            self._log.warning(
                "%s: refused %d clients in all (%d not shown one by one)", self._owner, n, n - REFUSALS_SHOWN
            )


def _power_of_ten(n: int) -> bool:
    while n >= 10 and n % 10 == 0:
        n //= 10
    return n == 1
