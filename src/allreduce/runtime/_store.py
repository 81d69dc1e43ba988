"""A small TCP key-value store for rendezvous, hosted by rank 0 (set / get / add / wait with timeouts).

The server is one thread in the rank-0 process running a ``selectors`` loop; every client (rank 0 included)
keeps one persistent connection and talks in binary length-prefixed messages. Nothing is unpickled.

Blocking calls (``get``, ``wait``) carry their deadline to the server, which answers either with the value or
with "timed out" plus what it knows about the missing keys: which rank a ``<prefix>/<rank>`` key belongs to and
which ranks never connected. When a client that registered a rank disconnects without ``close()`` (its process
died), the server sets ``__dead__/<rank>`` and fails every pending and later wait with that rank's name, so
rendezvous never hangs on a dead process. When the server dies, the kernel closes its sockets and every client
call raises :class:`PeerFailureError` naming rank 0.

Security: the server binds 127.0.0.1 unless given another host. Listening beyond loopback requires a shared
token (``token=`` or ``ALLREDUCE_TOKEN``); the peers then prove they know it with an HMAC challenge-response in
both directions (see :mod:`allreduce.runtime._wire`), so the token never crosses the network.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import struct
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from allreduce.runtime._errors import CollectiveTimeoutError, PeerFailureError, ProtocolError
from allreduce.runtime._wire import (
    ClientHello,
    HandshakeRetryError,
    RetryLater,
    accept_handshake,
    connect_handshake,
    is_loopback,
    recv_exact,
    resolve_token,
)

__all__ = ["DEAD_PREFIX", "TCPStore"]

_log = logging.getLogger("allreduce.store")

DEAD_PREFIX = "__dead__/"
_SERVICE = b"store"

# Request: op, timeout in ms (0xFFFFFFFF: none), key length, value length; then key (utf-8), then value.
_REQUEST = struct.Struct("!BIII")
# Response: status, payload length; then payload.
_RESPONSE = struct.Struct("!BI")
_NO_TIMEOUT = 0xFFFFFFFF
_MAX_KEY_BYTES = 64 * 1024
_MAX_VALUE_BYTES = 256 * 1024 * 1024
_KEY_SEPARATOR = "\x00"  # joins several keys in one WAIT/CHECK request; keys may not contain it

# Request opcodes.
_SET, _GET, _ADD, _WAIT, _CHECK, _DELETE, _CLOSE, _DEAD = range(1, 9)
# Response statuses.
_OK, _MISSING, _TIMEOUT, _DEAD_RANK, _ERROR = range(5)


def _encode_keys(keys: Iterable[str]) -> str:
    keys = list(keys)
    for key in keys:
        _check_key(key)
    return _KEY_SEPARATOR.join(keys)


def _check_key(key: str) -> None:
    if not isinstance(key, str):
        raise TypeError(f"store keys are str, got {type(key).__name__}")
    if not key or _KEY_SEPARATOR in key or len(key.encode()) > _MAX_KEY_BYTES:
        raise ValueError(f"bad store key {key!r}: must be non-empty, without NUL, at most {_MAX_KEY_BYTES} bytes")


def _owner_of(key: str) -> int | None:
    """By convention a key ``<prefix>/<rank>`` is set by that rank; used to name who a waiter waits for."""
    _, _, tail = key.rpartition("/")
    return int(tail) if tail.isdigit() else None


# ---------------------------------------------------------------------------------------------- server


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    address: str
    rank: int | None = None
    inbuf: bytearray = field(default_factory=bytearray)
    outbuf: bytearray = field(default_factory=bytearray)
    closing: bool = False  # the client said CLOSE: its disconnect is not a death
    waiting: _Waiter | None = None


@dataclass(eq=False)
class _Waiter:
    conn: _Conn
    keys: list[str]
    deadline: float | None
    want_value: bool  # GET answers with the value, WAIT with an empty OK


class _Server:
    """The store's event loop; runs in its own daemon thread of the rank-0 process."""

    def __init__(self, sock: socket.socket, *, world_size: int, token: bytes | None, single_group: bool) -> None:
        # single_group: hosted by a member of the group (init()'s rank 0), so it lives exactly as long as that group
        # and a rank that has left it can only be on its way to the next group's store. A standalone store
        # (rank -1) may serve successive groups, and lets ranks come back.
        self._single_group = single_group
        self._listener = sock
        self._world_size = world_size
        self._token = token
        self._data: dict[str, bytes] = {}
        self._waiters: list[_Waiter] = []
        self._conns: set[_Conn] = set()
        self._ranks_seen: set[int] = set()
        self._dead: dict[int, str] = {}
        # Touched by handshake threads too: live ranks (None while a handshake holds the rank) and new connections.
        # A condition so that close() can wait for the ranks to leave.
        self._lock = threading.Condition()
        self._ranks_live: dict[int, _Conn | None] = {}
        self._to_register: list[_Conn] = []
        self._left: set[int] = set()  # ranks that closed cleanly: their group is over for them
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._stop = False
        sock.setblocking(False)
        self._wake_r.setblocking(False)
        self._selector.register(sock, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._run, name="allreduce-store-server", daemon=True)
        self._thread.start()

    def wait_for_ranks_to_leave(self, timeout_s: float) -> list[int]:
        """Wait until no rank client is connected (each closed or died); the ranks still there at the timeout."""
        with self._lock:
            self._lock.wait_for(lambda: not self._ranks_live, timeout_s)
            return sorted(self._ranks_live)

    def stop(self) -> None:
        self._stop = True
        self._wake()
        self._thread.join(timeout=10.0)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    # -- loop
    def _run(self) -> None:
        try:
            while not self._stop:
                for key, mask in self._selector.select(self._next_timeout()):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(4096)
                    else:
                        conn: _Conn = key.data
                        if mask & selectors.EVENT_READ:
                            self._readable(conn)
                        if mask & selectors.EVENT_WRITE and conn in self._conns:
                            self._flush(conn)
                self._register_new()
                self._expire_waiters()
        except Exception:  # never die silently: every client would then see rank 0 as dead
            _log.exception("store server crashed")
        finally:
            for conn in list(self._conns):
                self._drop(conn, died=False)
            self._selector.close()
            self._listener.close()
            self._wake_r.close()
            self._wake_w.close()

    def _next_timeout(self) -> float | None:
        deadlines = [w.deadline for w in self._waiters if w.deadline is not None]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _accept(self) -> None:
        try:
            sock, addr = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        # The handshake is a few small messages; run it off the loop so a slow or hostile client cannot stall
        # the store. The loop registers the connection once it has authenticated.
        threading.Thread(target=self._handshake, args=(sock, addr), name="allreduce-store-hello", daemon=True).start()

    def _handshake(self, sock: socket.socket, addr: tuple[str, int]) -> None:
        address = f"{addr[0]}:{addr[1]}"
        reserved: list[int] = []

        def check(hello: ClientHello) -> str | None:
            reason = self._check_hello(hello)
            if reason is None and hello.rank >= 0:
                reserved.append(hello.rank)
            return reason

        try:
            sock.settimeout(10.0)
            hello = accept_handshake(sock, _SERVICE, self._token, check)
        except (OSError, ProtocolError) as exc:
            # "not yet" to a rank already joining the next group is routine; anything else is worth a warning
            log = _log.debug if isinstance(exc, HandshakeRetryError) else _log.warning
            log("store refused a client from %s: %s", address, exc)
            sock.close()
            with self._lock:  # the client left after its rank was reserved: free the seat
                for rank in reserved:
                    if rank in self._ranks_live and self._ranks_live[rank] is None:
                        del self._ranks_live[rank]
            return
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            self._to_register.append(_Conn(sock, address, hello.rank if hello.rank >= 0 else None))
        self._wake()

    def _check_hello(self, hello: ClientHello) -> str | None:
        """A reason to refuse this client, or None (then its rank is reserved for it)."""
        if hello.world_size != self._world_size:
            return f"world size mismatch: the store has {self._world_size}, rank {hello.rank} says {hello.world_size}"
        if hello.rank >= self._world_size:
            return f"rank {hello.rank} out of range for world size {self._world_size}"
        if hello.rank >= 0:
            with self._lock:
                if self._single_group and hello.rank in self._left:
                    # This rank closed its group and is joining the next one, whose store (same address) is not
                    # up until this one stops: have it come back rather than rejoin a finished group.
                    return RetryLater(f"rank {hello.rank} already left this store's group; the next is not up yet")
                if hello.rank in self._ranks_live:
                    return f"rank {hello.rank} is already connected (two processes with the same RANK?)"
                self._ranks_live[hello.rank] = None
        return None

    def _register_new(self) -> None:
        with self._lock:
            new, self._to_register = self._to_register, []
            for conn in new:
                if conn.rank is not None:
                    self._ranks_live[conn.rank] = conn
        for conn in new:
            self._conns.add(conn)
            if conn.rank is not None:
                self._ranks_seen.add(conn.rank)
                if conn.rank in self._dead:  # a restarted rank: it is alive again
                    del self._dead[conn.rank]
                    self._data.pop(f"{DEAD_PREFIX}{conn.rank}", None)
            self._selector.register(conn.sock, selectors.EVENT_READ, conn)

    def _readable(self, conn: _Conn) -> None:
        try:
            chunk = conn.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(conn, died=not conn.closing)
            return
        conn.inbuf += chunk
        self._parse(conn)

    def _parse(self, conn: _Conn) -> None:
        """Handle every complete request in ``conn.inbuf``; requests behind a pending wait stay queued."""
        while conn in self._conns and conn.waiting is None and len(conn.inbuf) >= _REQUEST.size:
            op, timeout_ms, key_len, value_len = _REQUEST.unpack_from(conn.inbuf)
            if key_len > _MAX_KEY_BYTES * 64 or value_len > _MAX_VALUE_BYTES:
                _log.warning("store: client %s sent an oversized request; dropping it", conn.address)
                self._drop(conn, died=False)
                return
            total = _REQUEST.size + key_len + value_len
            if len(conn.inbuf) < total:
                return
            key_bytes = bytes(conn.inbuf[_REQUEST.size : _REQUEST.size + key_len])
            value = bytes(conn.inbuf[_REQUEST.size + key_len : total])
            del conn.inbuf[:total]
            try:
                key = key_bytes.decode()
            except UnicodeDecodeError:
                self._reply(conn, _ERROR, b"key is not utf-8")
                continue
            self._handle(conn, op, None if timeout_ms == _NO_TIMEOUT else timeout_ms / 1000.0, key, value)

    def _handle(self, conn: _Conn, op: int, timeout_s: float | None, key: str, value: bytes) -> None:
        if op == _SET:
            self._data[key] = value
            self._reply(conn, _OK, b"")
            self._notify()
        elif op == _ADD:
            try:
                current = int(self._data.get(key, b"0"))
                (amount,) = struct.unpack("!q", value)
            except (ValueError, struct.error):
                self._reply(conn, _ERROR, f"add: key {key!r} does not hold an integer".encode())
                return
            current += amount
            self._data[key] = str(current).encode()
            self._reply(conn, _OK, struct.pack("!q", current))
            self._notify()
        elif op in (_GET, _WAIT):
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            waiter = _Waiter(conn, key.split(_KEY_SEPARATOR), deadline, want_value=op == _GET)
            if not self._try_answer(waiter):
                conn.waiting = waiter
                self._waiters.append(waiter)
        elif op == _CHECK:
            present = all(k in self._data for k in key.split(_KEY_SEPARATOR))
            self._reply(conn, _OK if present else _MISSING, b"")
        elif op == _DELETE:
            existed = self._data.pop(key, None) is not None
            self._reply(conn, _OK if existed else _MISSING, b"")
        elif op == _DEAD:
            self._reply(conn, _OK, ",".join(map(str, sorted(self._dead))).encode())
        elif op == _CLOSE:
            conn.closing = True
            if conn.rank is not None:
                with self._lock:
                    self._left.add(conn.rank)
            self._reply(conn, _OK, b"")
        else:
            self._reply(conn, _ERROR, f"unknown request {op}".encode())

    def _try_answer(self, waiter: _Waiter) -> bool:
        if all(k in self._data for k in waiter.keys):
            self._reply(waiter.conn, _OK, self._data[waiter.keys[0]] if waiter.want_value else b"")
            return True
        # A dead rank breaks the rendezvous: fail the wait now, naming it, instead of at the timeout.
        # Waiting for a death notice itself is of course allowed.
        if self._dead and not any(k.startswith(DEAD_PREFIX) for k in waiter.keys):
            dead = min(self._dead)
            self._reply(waiter.conn, _DEAD_RANK, f"{dead}\n{self._dead[dead]}".encode())
            return True
        return False

    def _notify(self) -> None:
        still = []
        woken = []
        for waiter in self._waiters:
            if waiter.conn not in self._conns:
                continue
            if self._try_answer(waiter):
                waiter.conn.waiting = None
                woken.append(waiter.conn)
            else:
                still.append(waiter)
        self._waiters = still
        for conn in woken:
            self._parse(conn)

    def _expire_waiters(self) -> None:
        now = time.monotonic()
        still = []
        woken = []
        for waiter in self._waiters:
            if waiter.conn not in self._conns:
                continue
            if waiter.deadline is not None and now >= waiter.deadline:
                missing = [k for k in waiter.keys if k not in self._data]
                owners = {owner for k in missing if (owner := _owner_of(k)) is not None}
                never = sorted(set(range(self._world_size)) - self._ranks_seen)
                report = "\n".join(
                    [_KEY_SEPARATOR.join(missing), ",".join(map(str, sorted(owners))), ",".join(map(str, never))]
                )
                self._reply(waiter.conn, _TIMEOUT, report.encode())
                waiter.conn.waiting = None
                woken.append(waiter.conn)
            else:
                still.append(waiter)
        self._waiters = still
        for conn in woken:
            self._parse(conn)

    def _reply(self, conn: _Conn, status: int, payload: bytes) -> None:
        conn.outbuf += _RESPONSE.pack(status, len(payload))
        conn.outbuf += payload
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        try:
            while conn.outbuf:
                sent = conn.sock.send(conn.outbuf)
                del conn.outbuf[:sent]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._drop(conn, died=not conn.closing)
            return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.outbuf else 0)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.modify(conn.sock, events, conn)

    def _drop(self, conn: _Conn, *, died: bool) -> None:
        if conn not in self._conns:
            return
        self._conns.discard(conn)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.sock)
        conn.sock.close()
        if conn.rank is None:
            return
        with self._lock:
            if self._ranks_live.get(conn.rank) is conn:
                del self._ranks_live[conn.rank]
                self._lock.notify_all()
        if died and not self._stop:
            reason = f"rank {conn.rank} disconnected from the store without close() (process died?)"
            _log.warning("store: %s", reason)
            self._dead[conn.rank] = reason
            self._data[f"{DEAD_PREFIX}{conn.rank}"] = reason.encode()
            self._notify()


# ---------------------------------------------------------------------------------------------- client


class TCPStore:
    """A client of the rendezvous store; with ``is_server=True`` it also hosts the store in this process.

    ``host``/``port`` is where the server listens (port 0 with ``is_server``: pick a free one, see ``.port``).
    ``rank`` registers this client so its death is reported as ``__dead__/<rank>`` (pass -1 for an anonymous
    client). ``timeout_s`` bounds connecting and every call without its own timeout. Calls are serialised on
    one connection: a thread blocked in ``get`` holds it; use a second ``TCPStore`` for concurrent waits.
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
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if rank >= world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.host = host
        self.world_size = world_size
        self.rank = rank
        self.timeout_s = float(timeout_s)
        self._token = resolve_token(token)
        self._lock = threading.Lock()
        self._broken: str | None = None
        self._server: _Server | None = None
        self._sock: socket.socket | None = None
        if is_server:
            if (require_token or not is_loopback(host)) and self._token is None:
                raise ValueError(
                    f"the store would listen on {host!r}, beyond loopback: set a shared token "
                    "(token= or the ALLREDUCE_TOKEN environment variable) so strangers cannot join"
                )
            listener = socket.create_server((host, port), family=_family(host), backlog=1024, reuse_port=False)
            self.port = int(listener.getsockname()[1])
            self._server = _Server(listener, world_size=world_size, token=self._token, single_group=rank >= 0)
            connect_host = _loopback_for(host)
        else:
            self.port = port
            connect_host = host
        try:
            self._sock = self._connect(connect_host, self.port)
        except BaseException:
            if self._server is not None:
                self._server.stop()
            raise

    # -- connection
    def _connect(self, host: str, port: int) -> socket.socket:
        deadline = time.monotonic() + self.timeout_s
        delay_s = 0.01
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
                sock = socket.create_connection((host, port), timeout=min(remaining, 10.0))
            except OSError as exc:  # the server may simply not be listening yet
                last_error = exc
                time.sleep(min(delay_s, max(0.0, remaining)))
                delay_s = min(delay_s * 2, 1.0)
                continue
            try:
                sock.settimeout(min(max(remaining, 1.0), 30.0))
                connect_handshake(
                    sock,
                    _SERVICE,
                    self._token,
                    ClientHello(rank=self.rank, world_size=self.world_size, target=0),
                    what=f"the store at {host}:{port}",
                )
            except HandshakeRetryError as exc:  # the previous group's store is still stopping
                sock.close()
                last_error = OSError(str(exc))
                time.sleep(min(delay_s, max(0.0, remaining)))
                delay_s = min(delay_s * 2, 0.2)
                continue
            except BaseException:
                sock.close()
                raise
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock

    def _request(self, op: int, key: str, value: bytes = b"", *, timeout_s: float | None = None) -> tuple[int, bytes]:
        with self._lock:
            if self._broken is not None:
                raise PeerFailureError(f"rank {self.rank}: the store connection is unusable: {self._broken}", peer=0)
            if self._sock is None:
                raise RuntimeError("the store client is closed")
            key_bytes = key.encode()
            timeout_ms = _NO_TIMEOUT if timeout_s is None else min(int(max(timeout_s, 0.0) * 1000), _NO_TIMEOUT - 1)
            # The server enforces the request's deadline; the socket timeout only guards against a hung server.
            self._sock.settimeout((timeout_s if timeout_s is not None else self.timeout_s) + 30.0)
            try:
                self._sock.sendall(_REQUEST.pack(op, timeout_ms, len(key_bytes), len(value)) + key_bytes + value)
                status, length = _RESPONSE.unpack(recv_exact(self._sock, _RESPONSE.size))
                payload = recv_exact(self._sock, length) if length else b""
            except TimeoutError as exc:
                self._broken = "the store did not answer in time"
                raise CollectiveTimeoutError(
                    f"rank {self.rank}: the store (rank 0) did not answer a request for {key!r}", rank=self.rank, peer=0
                ) from exc
            except (OSError, EOFError) as exc:
                self._broken = f"lost the connection to the store hosted by rank 0 ({exc or type(exc).__name__})"
                raise PeerFailureError(
                    f"rank {self.rank}: lost the connection to the store hosted by rank 0 (rank 0 died or closed "
                    f"the store) while accessing {key!r}",
                    rank=self.rank,
                    peer=0,
                ) from exc
            except BaseException:
                self._broken = "a request was interrupted mid-way"
                raise
        if status == _ERROR:
            raise ValueError(f"store: {payload.decode(errors='replace')}")
        if status == _DEAD_RANK:
            rank_text, _, reason = payload.decode(errors="replace").partition("\n")
            dead = int(rank_text)
            raise PeerFailureError(
                f"rank {self.rank}: rank {dead} died while waiting for {key.replace(_KEY_SEPARATOR, ', ')!r}: {reason}",
                rank=self.rank,
                peer=dead,
            )
        if status == _TIMEOUT:
            self._raise_timeout(payload, timeout_s)
        return status, payload

    def _raise_timeout(self, payload: bytes, timeout_s: float | None) -> None:
        missing_text, owners_text, never_text = [*payload.decode(errors="replace").split("\n"), "", ""][:3]
        missing = [k for k in missing_text.split(_KEY_SEPARATOR) if k]
        owners = sorted({int(o) for o in owners_text.split(",") if o.isdigit()})
        never = [int(r) for r in never_text.split(",") if r]
        message = f"rank {self.rank}: timed out after {timeout_s:g} s waiting for store key(s) {', '.join(missing)}"
        if owners:
            message += f" (expected from rank{'s' if len(owners) > 1 else ''} {', '.join(map(str, owners))})"
        if never:
            message += f"; rank(s) {', '.join(map(str, never))} never connected to the store"
        peer = owners[0] if owners else (never[0] if never else None)
        raise CollectiveTimeoutError(message, rank=self.rank, peer=peer)

    # -- API
    def set(self, key: str, value: bytes) -> None:
        _check_key(key)
        if not isinstance(value, bytes | bytearray | memoryview):
            raise TypeError(f"store values are bytes, got {type(value).__name__} for key {key!r}")
        if len(value) > _MAX_VALUE_BYTES:
            raise ValueError(f"value for {key!r} is {len(value)} bytes; the store takes at most {_MAX_VALUE_BYTES}")
        self._request(_SET, key, bytes(value))

    def get(self, key: str, *, timeout_s: float | None = None) -> bytes:
        """The value of ``key``, waiting until some client sets it (``timeout_s`` defaults to the store's)."""
        _check_key(key)
        return self._request(_GET, key, timeout_s=self.timeout_s if timeout_s is None else timeout_s)[1]

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer at ``key`` (0 if unset) and return the new value."""
        _check_key(key)
        return int(struct.unpack("!q", self._request(_ADD, key, struct.pack("!q", amount))[1])[0])

    def wait(self, keys: Sequence[str], *, timeout_s: float | None = None) -> None:
        """Block until every key in ``keys`` exists."""
        if isinstance(keys, str):
            keys = [keys]
        if not keys:
            return
        self._request(_WAIT, _encode_keys(keys), timeout_s=self.timeout_s if timeout_s is None else timeout_s)

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key in ``keys`` exists, without waiting."""
        if isinstance(keys, str):
            keys = [keys]
        if not keys:
            return True
        return self._request(_CHECK, _encode_keys(keys))[0] == _OK

    def delete(self, key: str) -> bool:
        """Remove ``key``; whether it existed."""
        _check_key(key)
        return self._request(_DELETE, key)[0] == _OK

    def dead_ranks(self) -> list[int]:
        """Ranks whose store connection dropped without ``close()``."""
        payload = self._request(_DEAD, "__dead__")[1].decode()
        return [int(r) for r in payload.split(",") if r]

    def close(self, *, wait_for_ranks_s: float | None = None) -> None:
        """Leave the store (a clean exit, not a death); with ``is_server`` also stop the server.

        The hosting rank first waits, up to ``wait_for_ranks_s`` (default: the smaller of ``timeout_s`` and 30 s),
        for every other rank to close or disconnect: rank 0 finishing first must not pull the store from under
        ranks still using it."""
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            if self._broken is None:
                with contextlib.suppress(OSError, EOFError):
                    sock.settimeout(5.0)
                    sock.sendall(_REQUEST.pack(_CLOSE, _NO_TIMEOUT, 5, 0) + b"close")
                    recv_exact(sock, _RESPONSE.size)
            sock.close()
        if self._server is not None:
            wait_s = min(self.timeout_s, 30.0) if wait_for_ranks_s is None else wait_for_ranks_s
            staying = self._server.wait_for_ranks_to_leave(wait_s)
            if staying:
                _log.warning("store: closing with rank(s) %s still connected after %g s", staying, wait_s)
            self._server.stop()
            self._server = None

    def __enter__(self) -> TCPStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _loopback_for(host: str) -> str:
    """Where this process reaches its own server listening on ``host``."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return host
