"""A small TCP key-value store for rendezvous, hosted by rank 0 (set / get / add / wait with timeouts).

:class:`TCPStore` is the client every rank holds; with ``is_server=True`` it also hosts the server
(:mod:`allreduce.runtime.store._store_server`) in this process. Blocking calls (``get``, ``wait``) carry their deadline
to the server, which answers with the value or with "timed out" plus what it knows about the missing keys, and
fails them at once, naming the rank, when a registered rank dies (``__dead__/<rank>``), so rendezvous never hangs
on a dead process. When the server dies, the kernel closes its sockets and every client call raises
:class:`PeerFailureError` naming rank 0.

Liveness: with a lease (``lease_s`` on the hosting side; the server publishes it, and every rank's client reads it
once connected), each rank's client runs a heartbeat thread that sends ``BEAT`` on its connection
:data:`BEATS_PER_LEASE` times a lease, and the server declares a rank dead after a lease without a word from it
(docs/reliability.md, "Silent ranks"). The thread holds the GIL only for the few microseconds of a ``send``, and
CPython hands it the GIL within its switch interval (5 ms) of a compute step in Python or in numpy; only a single
C call that holds the GIL longer than a lease (none of numpy's large operations: they release it) would starve it.

Security (docs/security.md): the server binds 127.0.0.1 unless given another host. Listening beyond loopback
requires a shared token (``token=`` or ``ALLREDUCE_TOKEN``); the peers then prove they know it with an HMAC
challenge-response in both directions (:mod:`allreduce.runtime.tcp._handshake`), so the token never crosses the
network. Without a token, each side checks that the other's socket belongs to this user and to the process it
announces; the server admits anonymous clients only from its own process, and a client checks whom it reached.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import socket
import struct
import threading
import time
import weakref
from collections.abc import Iterator, Sequence

from allreduce.runtime._errors import CollectiveError, CollectiveTimeoutError, PeerFailureError, ProtocolError
from allreduce.runtime._liveness import BEATS_PER_LEASE
from allreduce.runtime.store._store_protocol import (
    BEAT_FRAME,
    DEAD_PREFIX,
    FAILED_LINGER_S,
    GROUP_SECRET_KEY,
    KEY_SEPARATOR,
    LEASE_KEY,
    MAX_ANSWER_BYTES,
    MAX_FAIL_REASON_BYTES,
    MAX_VALUE_BYTES,
    NO_TIMEOUT,
    REQUEST,
    RESPONSE,
    SERVICE,
    Op,
    Status,
    check_key,
    encode_keys,
)
from allreduce.runtime.store._store_server import StoreServer
from allreduce.runtime.tcp import (
    CONNECT_HANDSHAKE_MAX_S,
    ClientHello,
    HandshakeRetryError,
    connect_handshake,
    family_of,
    is_loopback,
    read_exact,
    resolve_token,
)

__all__ = ["DEAD_PREFIX", "TCPStore"]

_log = logging.getLogger("allreduce.store")

SERVER_BACKLOG = 1024
"""Connections the kernel queues for the server: every rank of a large group may connect at once."""

CONNECT_TIMEOUT_MAX_S = 10.0
"""The longest one TCP connection attempt to the server may take (less when the deadline is nearer)."""

HANDSHAKE_TIMEOUT_MIN_S = 1.0
"""The shortest socket timeout for the handshake with the server, however near the deadline: a live server answers
in milliseconds, so a shorter one would only turn a slow moment into a failure."""

CONNECT_BACKOFF_FIRST_S = 0.01
"""The first pause before trying again to reach a server that is not listening yet (doubling each time)."""

CONNECT_BACKOFF_MAX_S = 1.0
"""The longest such pause: rank 0 may start seconds after the others, and should be found within a second."""

RETRY_BACKOFF_MAX_S = 0.2
"""The longest pause before asking again a server that said "not yet" (the previous group's store stopping)."""

ANSWER_MARGIN_S = 30.0
"""A request's socket timeout past its own deadline: the server answers at the deadline, so this only catches a
hung server. With a lease, the lease instead: a store host that does not answer for a lease is as silent as a rank
(a request that does not wait, a ``set`` or a ``check``, is then bounded by the lease alone)."""

CLOSE_TIMEOUT_S = 5.0
"""How long a leaving client waits for the server to acknowledge its CLOSE (then leaves anyway)."""

ADD_ANSWER = struct.Struct("!q")
"""The answer to an add: the counter's new value, a signed 64-bit integer."""

WAIT_FOR_RANKS_MAX_S = 30.0
"""By default, the longest the hosting rank waits in :meth:`TCPStore.close` for the other ranks to leave."""


class TCPStore:
    """A client of the rendezvous store; with ``is_server=True`` it also hosts the store in this process.

    ``host``/``port`` is where the server listens (port 0 with ``is_server``: pick a free one, see ``.port``).
    ``listener``, with ``is_server``: a bound, listening TCP socket to serve on instead of binding one (a launcher
    binds port 0 itself and hands the socket over, so no other process can take the port in between); the store
    owns it from then on and closes it with the server. Its own address then decides whether a token is needed.
    ``rank`` registers this client so its death is reported as ``__dead__/<rank>`` (pass -1 for an anonymous
    client: admitted only from the hosting process, or with the token). ``timeout_s`` bounds connecting and every
    call without its own timeout. ``lease_s``, with ``is_server``: a rank the server hears nothing from for that
    long is dead (0: only a dropped connection is a death); every rank's client reads it from the server
    (:attr:`lease_s`) and, if it is set, sends heartbeats. Calls are serialised on one connection: a thread blocked
    in ``get`` holds it; use a second ``TCPStore`` for concurrent waits.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        is_server: bool,
        world_size: int,
        rank: int,
        timeout_s: float = 300.0,
        token: str | bytes | None = None,
        require_token: bool = False,
        listener: socket.socket | None = None,
        lease_s: float = 0.0,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if rank >= world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if not lease_s >= 0:
            raise ValueError(f"lease_s must be >= 0 seconds, got {lease_s}")
        self.host = host
        self.world_size = world_size
        self.rank = rank
        self.timeout_s = float(timeout_s)
        self._token = resolve_token(token)
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()  # the heartbeat thread sends between, and during, requests
        self._broken: str | None = None
        self.host_lost = False
        """The connection to the store's host (rank 0) dropped: it died or closed the store."""
        self.host_silent = False
        """The store's host (rank 0) did not answer a request in time: it is stopped, hung, or unreachable."""
        self.lease_s = 0.0
        """The server's lease (0: none): a rank silent for that long is dead."""
        self._beat_stop = threading.Event()
        self._server: StoreServer | None = None
        self._failed = False  # fail() was called: close() lingers to tell late ranks why
        self._sock: socket.socket | None = None
        self._where = f"the store at {host}:{port}"
        if is_server:
            adopted = _adopt(listener, port) if listener is not None else None
            listen_host = str(adopted.getsockname()[0]) if adopted is not None else host
            if (require_token or not is_loopback(listen_host)) and self._token is None:
                raise ValueError(
                    f"the store would listen on {listen_host!r}, beyond loopback: set a shared token "
                    "(token= or the ALLREDUCE_TOKEN environment variable) so strangers cannot join"
                )
            sock = adopted if adopted is not None else _bind(host, port)
            self._server = StoreServer(
                sock, world_size=world_size, token=self._token, single_group=rank >= 0, lease_s=lease_s
            )
            self.port = self._server.port
            self._where = f"the store at {host}:{self.port}"
            connect_host = _loopback_for(listen_host)
        else:
            if listener is not None:
                raise ValueError("listener: only the hosting side (is_server=True) takes a listening socket")
            self.port = port
            connect_host = host
        try:
            self._sock = self._connect(connect_host, self.port)
            self.lease_s = self._read_lease()
        except BaseException as exc:
            if self._server is not None:
                if rank >= 0 and isinstance(exc, ProtocolError):  # refused by its own store (its seat taken):
                    self._server.fail(rank, str(exc))  # tell the ranks that join why there is no group
                    self._server.wait_until_told(min(self.timeout_s, FAILED_LINGER_S))
                self._server.stop()
            if self._sock is not None:
                self._sock.close()
            raise
        if self.lease_s > 0 and rank >= 0:
            if self._sock.family in (socket.AF_INET, socket.AF_INET6):
                # Data unacknowledged for a lease (the store's host gone from the network) breaks the connection,
                # so a request waiting on a vanished host fails then, not at its timeout.
                with contextlib.suppress(OSError, AttributeError):
                    self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(self.lease_s * 1000))
            threading.Thread(
                target=_heartbeat, args=(weakref.ref(self), self._beat_stop, self.lease_s / BEATS_PER_LEASE),
                name=f"allreduce-store-beat-{rank}", daemon=True,
            ).start()  # fmt: skip

    def _read_lease(self) -> float:
        text = self._request(Op.GET, LEASE_KEY, timeout_s=0.0)[1].decode(errors="replace")
        try:
            return max(float(text), 0.0)
        except ValueError:
            raise self._bad_answer(f"a request for {LEASE_KEY!r}", f"{text[:40]!r}") from None

    def _send_beat(self) -> bool:
        """Send one heartbeat; False once there is no connection to send it on."""
        with self._send_lock:
            if self._sock is None or self._broken is not None:
                return False
            try:
                self._sock.sendall(BEAT_FRAME)
            except OSError:  # the next request finds out why
                return False
        return True

    @contextlib.contextmanager
    def _holding(self, answer_s: float | None) -> Iterator[None]:
        """The connection, waiting at most ``answer_s`` for another thread's request to finish."""
        if not self._lock.acquire(timeout=-1 if answer_s is None else answer_s):
            raise CollectiveTimeoutError(
                f"rank {self.rank}: the store connection stayed busy (another thread's request) for {answer_s:g} s",
                rank=self.rank,
            )
        try:
            yield
        finally:
            self._lock.release()

    # -- connection
    def _connect(self, host: str, port: int) -> socket.socket:
        deadline = time.monotonic() + self.timeout_s
        delay_s = CONNECT_BACKOFF_FIRST_S
        last_error: OSError | None = None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CollectiveTimeoutError(
                    f"rank {self.rank}: could not reach the store at {host}:{port} within {self.timeout_s:g} s "
                    f"(is rank 0 running, and MASTER_ADDR/MASTER_PORT right?): {last_error}",
                    rank=self.rank,
                    peer=0,
                )
            try:
                sock = socket.create_connection((host, port), timeout=min(remaining, CONNECT_TIMEOUT_MAX_S))
            except OSError as exc:  # the server may simply not be listening yet
                last_error = exc
                time.sleep(min(delay_s, max(0.0, remaining)))
                delay_s = min(delay_s * 2, CONNECT_BACKOFF_MAX_S)
                continue
            try:
                sock.settimeout(min(max(remaining, HANDSHAKE_TIMEOUT_MIN_S), CONNECT_HANDSHAKE_MAX_S))
                connect_handshake(
                    sock,
                    SERVICE,
                    self._token,
                    ClientHello(rank=self.rank, world_size=self.world_size, target=0),
                    what=f"the store at {host}:{port}",
                )
            except (HandshakeRetryError, ConnectionResetError, ConnectionAbortedError, BrokenPipeError) as exc:
                # The previous group's store is still stopping (it says so, or it closed this connection while
                # the handshake was under way): come back until the next store is up, within the deadline.
                sock.close()
                last_error = OSError(str(exc))
                time.sleep(min(delay_s, max(0.0, remaining)))
                delay_s = min(delay_s * 2, RETRY_BACKOFF_MAX_S)
                continue
            except BaseException:
                sock.close()
                raise
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock

    def _request(
        self, op: int, key: str, value: bytes = b"", *, timeout_s: float | None = None, answer_s: float | None = None
    ) -> tuple[int, bytes]:
        """One request and its answer. ``timeout_s``: the server's deadline for a wait; ``answer_s``: how long to
        wait for the connection and then the answer (default: as long as the connection is busy, then that
        deadline and the lease, or without a lease :data:`ANSWER_MARGIN_S`, which only catches a hung server)."""
        with self._holding(answer_s):
            if self._broken is not None:
                raise PeerFailureError(f"rank {self.rank}: the store connection is unusable: {self._broken}", peer=0)
            if self._sock is None:
                raise RuntimeError("the store client is closed")
            key_bytes = key.encode()
            timeout_ms = NO_TIMEOUT if timeout_s is None else min(int(max(timeout_s, 0.0) * 1000), NO_TIMEOUT - 1)
            # The server enforces the request's deadline; the socket timeout only guards against a hung server.
            if answer_s is None:
                answer_s = (
                    (timeout_s or 0.0) + self.lease_s
                    if self.lease_s > 0
                    else (timeout_s if timeout_s is not None else self.timeout_s) + ANSWER_MARGIN_S
                )
            self._sock.settimeout(answer_s)
            try:
                with self._send_lock:
                    self._sock.sendall(REQUEST.pack(op, timeout_ms, len(key_bytes), len(value)) + key_bytes + value)
                status, length = RESPONSE.unpack(read_exact(self._sock, RESPONSE.size))
                if length > MAX_ANSWER_BYTES:
                    self._broken = f"{self._where} answered with a {length}-byte payload"
                    raise ProtocolError(
                        f"rank {self.rank}: {self._where} answered a request for {key!r} with a {length}-byte "
                        f"payload (at most {MAX_ANSWER_BYTES}): it is not a store of this version, or is broken",
                        rank=self.rank,
                        peer=0,
                    )
                payload = read_exact(self._sock, length) if length else b""
            except TimeoutError as exc:
                self._broken = "the store did not answer in time"
                self.host_silent = True
                raise CollectiveTimeoutError(
                    f"rank {self.rank}: the store (rank 0) did not answer a request for {key!r} within {answer_s:g} s",
                    rank=self.rank,
                    peer=0,
                ) from exc
            except (OSError, EOFError) as exc:
                self._broken = f"lost the connection to the store hosted by rank 0 ({exc or type(exc).__name__})"
                self.host_lost = True
                raise PeerFailureError(
                    f"rank {self.rank}: lost the connection to the store hosted by rank 0 (rank 0 died or closed "
                    f"the store) while accessing {key!r}",
                    rank=self.rank,
                    peer=0,
                ) from exc
            except ProtocolError:
                raise
            except BaseException:
                self._broken = "a request was interrupted mid-way"
                raise
        if status == Status.EXPIRED:
            self._broken = "the store declared this rank dead"
            raise PeerFailureError(
                f"rank {self.rank}: the store declared this rank dead: {payload.decode(errors='replace')}",
                rank=self.rank,
                peer=self.rank,
            )
        if status == Status.ERROR:
            raise ValueError(f"store: {payload.decode(errors='replace')}")
        if status == Status.DEAD_RANK:
            rank_text, _, reason = payload.decode(errors="replace").partition("\n")
            if not _is_number(rank_text):
                raise self._bad_answer(f"a request for {key!r}", f"a dead rank {rank_text[:40]!r}")
            dead = int(rank_text)
            raise PeerFailureError(
                f"rank {self.rank}: the store reports rank {dead} gone while waiting for "
                f"{key.replace(KEY_SEPARATOR, ', ')!r}: {reason}",
                rank=self.rank,
                peer=dead,
            )
        if status == Status.TIMEOUT:
            self._raise_timeout(payload, timeout_s)
        if status not in (Status.OK, Status.MISSING):
            raise self._bad_answer(f"a request for {key!r}", f"status {status}")
        return status, payload

    def _bad_answer(self, request: str, answer: str) -> ProtocolError:
        return ProtocolError(
            f"rank {self.rank}: {self._where} answered {request} with {answer}: it is not a store of this version, "
            "or is broken",
            rank=self.rank,
            peer=0,
        )

    def _raise_timeout(self, payload: bytes, timeout_s: float | None) -> None:
        if timeout_s is None:  # the server times out only requests that carry a deadline
            raise self._bad_answer("a request without a deadline", "'timed out'")
        lines = payload.decode(errors="replace").split("\n")
        missing_text, owners_text, never_text = [*lines, "", ""][:3]
        refused = [line.partition(":") for line in lines[3:] if _is_number(line.partition(":")[0])]
        missing = [k for k in missing_text.split(KEY_SEPARATOR) if k]
        owners = sorted({int(o) for o in owners_text.split(",") if _is_number(o)})
        never = [int(r) for r in never_text.split(",") if _is_number(r)]
        message = f"rank {self.rank}: timed out after {timeout_s:g} s waiting for store key(s) {', '.join(missing)}"
        if owners:
            message += f" (expected from rank{'s' if len(owners) > 1 else ''} {', '.join(map(str, owners))})"
        if never:
            message += f"; rank(s) {', '.join(map(str, never))} never connected to the store"
        for rank_text, _, why in refused:
            message += f"; rank {rank_text} tried to connect and was refused ({why})"
        peer = owners[0] if owners else (never[0] if never else int(refused[0][0]) if refused else None)
        raise CollectiveTimeoutError(message, rank=self.rank, peer=peer)

    # -- API
    def set(self, key: str, value: bytes) -> None:
        check_key(key)
        if not isinstance(value, bytes | bytearray | memoryview):
            raise TypeError(f"store values are bytes, got {type(value).__name__} for key {key!r}")
        if len(value) > MAX_VALUE_BYTES:
            raise ValueError(f"value for {key!r} is {len(value)} bytes; the store takes at most {MAX_VALUE_BYTES}")
        self._request(Op.SET, key, bytes(value))

    def get(self, key: str, *, timeout_s: float | None = None) -> bytes:
        """The value of ``key``, waiting until some client sets it (``timeout_s`` defaults to the store's)."""
        check_key(key)
        status, value = self._request(Op.GET, key, timeout_s=self.timeout_s if timeout_s is None else timeout_s)
        if status != Status.OK:
            raise self._bad_answer(f"a get of {key!r}", f"status {status}")
        return value

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer at ``key`` (0 if unset) and return the new value."""
        check_key(key)
        amount = operator.index(amount)
        if not -(2**63) <= amount < 2**63:
            raise ValueError(f"add: the amount for {key!r} must fit in a signed 64-bit integer, got {amount}")
        status, payload = self._request(Op.ADD, key, ADD_ANSWER.pack(amount))
        if status != Status.OK or len(payload) != ADD_ANSWER.size:
            answer = f"status {status} and a {len(payload)}-byte payload (expected OK and {ADD_ANSWER.size} bytes)"
            raise self._bad_answer(f"an add to {key!r}", answer)
        return int(ADD_ANSWER.unpack(payload)[0])

    def wait(self, keys: Sequence[str], *, timeout_s: float | None = None) -> None:
        """Block until every key in ``keys`` exists."""
        if isinstance(keys, str):
            keys = [keys]
        if not keys:
            return
        self._request(Op.WAIT, encode_keys(keys), timeout_s=self.timeout_s if timeout_s is None else timeout_s)

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key in ``keys`` exists, without waiting."""
        if isinstance(keys, str):
            keys = [keys]
        if not keys:
            return True
        return self._request(Op.CHECK, encode_keys(keys))[0] == Status.OK

    def delete(self, key: str) -> bool:
        """Remove ``key``; whether it existed."""
        check_key(key)
        return self._request(Op.DELETE, key)[0] == Status.OK

    def group_secret(self) -> bytes:
        """A random secret of this store's group, known only to the clients the store admitted: ranks without a
        shared token use it to authenticate their connections to each other."""
        return self.get(GROUP_SECRET_KEY)

    def dead_ranks(self, *, answer_s: float | None = None) -> list[int]:
        """Ranks whose store connection dropped without ``close()``, or that were silent for a lease. ``answer_s``:
        how long to wait for the answer (then :class:`CollectiveTimeoutError`, and :attr:`host_silent` if the
        store did not answer)."""
        ranks = self._request(Op.DEAD, "__dead__", answer_s=answer_s)[1].decode(errors="replace").split(",")
        if not all(_is_number(r) for r in ranks if r):
            raise self._bad_answer("a request for the dead ranks", f"{','.join(ranks)[:80]!r}")
        return [int(r) for r in ranks if r]

    def heartbeat_gaps(self) -> dict[int, float]:
        """Hosting the store: per rank, the longest the server went without reading from that rank (heartbeats
        and requests), in seconds; what a lease must outlast. Empty on a client that does not host it."""
        return self._server.heartbeat_gaps() if self._server is not None else {}

    def fail(self, reason: str) -> None:
        """This rank gives up during the rendezvous: every rank waiting on it is told why at once (not at its
        timeout). Hosting the store, it also tells the ranks that join later, for up to :data:`FAILED_LINGER_S`
        (at :meth:`close`). Best effort: a store that cannot be told is left alone."""
        if self.rank < 0:
            return
        if self._server is not None:
            self._server.fail(self.rank, reason)
            self._failed = True
            return
        with contextlib.suppress(CollectiveError, OSError, ValueError):
            self._request(Op.FAIL, "fail", reason.encode()[:MAX_FAIL_REASON_BYTES], timeout_s=CLOSE_TIMEOUT_S)

    def close(self, *, wait_for_ranks_s: float | None = None) -> None:
        """Leave the store (a clean exit, not a death); with ``is_server`` also stop the server.

        The hosting rank first waits, up to ``wait_for_ranks_s`` (default: the smaller of ``timeout_s`` and 30 s),
        for every other rank to close or disconnect: rank 0 finishing first must not pull the store from under
        ranks still using it."""
        self._beat_stop.set()
        with self._lock, self._send_lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            if self._broken is None:
                with contextlib.suppress(OSError, EOFError):
                    sock.settimeout(CLOSE_TIMEOUT_S)
                    sock.sendall(REQUEST.pack(Op.CLOSE, NO_TIMEOUT, 5, 0) + b"close")
                    read_exact(sock, RESPONSE.size)
            sock.close()
        if self._server is not None:
            if self._failed:
                untold = self._server.wait_until_told(min(self.timeout_s, FAILED_LINGER_S))
                if untold:
                    _log.warning("store: closing before rank(s) %s joined to hear why the group failed", untold)
            else:
                wait_s = min(self.timeout_s, WAIT_FOR_RANKS_MAX_S) if wait_for_ranks_s is None else wait_for_ranks_s
                staying = self._server.wait_for_ranks_to_leave(wait_s)
                if staying:
                    _log.warning("store: closing with rank(s) %s still connected after %g s", staying, wait_s)
            self._server.stop()
            self._server = None

    def __enter__(self) -> TCPStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _heartbeat(store_ref: weakref.ref[TCPStore], stop: threading.Event, period_s: float) -> None:
    """A client's heartbeat thread: a ``BEAT`` every ``period_s`` until the client closes, its connection breaks,
    or it is collected (the thread holds it only while it sends, so a store dropped unclosed still dies)."""
    while not stop.wait(period_s):
        store = store_ref()
        if store is None or not store._send_beat():
            return
        del store


_MAX_RANK_DIGITS = 10  # a rank is below 2**32 (the handshake's field), so at most 10 decimal digits


def _is_number(text: str) -> bool:
    """Whether ``text`` is a rank as the server writes it (ASCII digits; ``int`` takes more, such as "١")."""
    return 0 < len(text) <= _MAX_RANK_DIGITS and text.isascii() and text.isdigit()


def _bind(host: str, port: int) -> socket.socket:
    return socket.create_server((host, port), family=family_of(host), backlog=SERVER_BACKLOG, reuse_port=False)


def _adopt(sock: socket.socket, port: int) -> socket.socket:
    """Check that ``sock`` can serve the store (a listening TCP socket, on ``port`` unless that is 0)."""
    if not isinstance(sock, socket.socket) or sock.type != socket.SOCK_STREAM:
        raise ValueError(f"listener: expected a listening TCP socket, got {sock!r}")
    try:
        listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        bound_port = int(sock.getsockname()[1])
    except OSError as exc:
        raise ValueError(f"listener: {sock!r} is not usable ({exc})") from exc
    if not listening:
        raise ValueError(f"listener: the socket bound to port {bound_port} is not listening (call listen() first)")
    if port not in (0, bound_port):
        raise ValueError(f"listener: the socket listens on port {bound_port}, but port={port} was asked for")
    return sock


def _loopback_for(host: str) -> str:
    """Where this process reaches its own server listening on ``host``."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return host
