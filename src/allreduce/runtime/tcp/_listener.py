"""A listening socket that accepts connections and authenticates each one, for the store and the TCP transport.

One thread waits for connections; each accepted connection runs the handshake (:mod:`._handshake`) in a thread
of its own, so a slow or hostile client never stalls the others or the owner's loop. The owner hears of every
authenticated connection (``accepted``) and of every refused one (``refused``), and decides who is welcome
(``check``).
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from collections.abc import Callable

from allreduce.runtime._errors import ProtocolError
from allreduce.runtime.tcp._handshake import ACCEPT_HANDSHAKE_TIMEOUT_S, ClientHello, accept_handshake
from allreduce.runtime.tcp._socket import family_of

__all__ = ["ACCEPTOR_JOIN_S", "Listener", "listening_socket"]

ACCEPTOR_JOIN_S = 10.0
"""How long :meth:`Listener.close` waits for the accepting thread to notice; it wakes at once, so this only
bounds a thread stuck in the kernel."""

_MIN_BACKLOG = 128  # pending connections the kernel queues; at least one per rank of a large group


def listening_socket(host: str, *, backlog: int) -> socket.socket:
    """A TCP socket bound to a free port of ``host`` and listening."""
    return socket.create_server((host, 0), family=family_of(host), backlog=max(_MIN_BACKLOG, backlog))


Accepted = Callable[[socket.socket, ClientHello, str], None]
"""``accepted(sock, hello, address)``: a connection authenticated; the callee owns ``sock`` from now on."""

Refused = Callable[[str, BaseException, "ClientHello | None"], None]
"""``refused(address, error, admitted)``: a connection failed its handshake (already closed); ``admitted`` is its
hello when ``check`` had let it in before the handshake broke (so the owner can release what it reserved)."""


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
        self._in_handshake: dict[threading.Thread, socket.socket] = {}  # guarded by _handover
        sock.setblocking(False)  # a connection that vanishes between poll and accept must not block the loop
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._accept_loop, name=f"{name}-accept", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    def close(self) -> None:
        """Stop accepting and close the listening socket (connections already handed over stay open).

        Handshakes still under way are cut short and have reported (accepted or refused) when this returns."""
        with self._handover:
            if self._closed:
                return
            self._closed = True
            in_handshake = dict(self._in_handshake)
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._thread.join(timeout=ACCEPTOR_JOIN_S)
        for sock in (self.sock, self._wake_r, self._wake_w):
            sock.close()
        for thread, sock in in_handshake.items():
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # the handshake's next read fails at once
            thread.join(timeout=ACCEPTOR_JOIN_S)

    def _stopped(self) -> bool:
        """Whether close() has begun (read again after every wait: another thread sets it)."""
        return self._closed

    def _accept_loop(self) -> None:
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while not self._closed:
            ready = {fd for fd, _ in poller.poll()}
            if self._closed or self._wake_r.fileno() in ready:
                return
            try:
                sock, addr = self.sock.accept()
            except OSError:
                continue
            thread = threading.Thread(
                target=self._handshake, args=(sock, addr), name=f"{self._name}-hello", daemon=True
            )
            with self._handover:
                if self._stopped():
                    sock.close()
                    return
                self._in_handshake[thread] = sock
            thread.start()

    def _handshake(self, sock: socket.socket, addr: tuple[str, int]) -> None:
        address = f"{addr[0]}:{addr[1]}"
        admitted: list[ClientHello] = []

        def check(hello: ClientHello) -> str | None:
            reason = self._check(hello)
            if reason is None:
                admitted.append(hello)
            return reason

        try:
            try:
                sock.settimeout(ACCEPT_HANDSHAKE_TIMEOUT_S)
                hello = accept_handshake(sock, self._service, self._token, check)
            except (OSError, ProtocolError) as exc:
                sock.close()
                self._refused(address, exc, admitted[0] if admitted else None)
                return
            with self._handover:
                if self._closed:  # the owner has stopped: nobody would ever close this connection
                    sock.close()
                    return
                self._accepted(sock, hello, address)
        finally:
            with self._handover:
                self._in_handshake.pop(threading.current_thread(), None)
