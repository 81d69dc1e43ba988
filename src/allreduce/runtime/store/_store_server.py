"""The store's server: one event loop thread in the hosting process, and the binary protocol it speaks.

Every client (the host's own included) keeps one persistent connection, authenticated by the shared listener
(:class:`allreduce.runtime.tcp.Listener`), and sends length-prefixed requests; the server answers each in order.
Nothing is unpickled. ``GET`` and ``WAIT`` carry their deadline: the server answers with the value once some
client sets the key, or with "timed out" and what it knows about the missing keys (which rank a
``<prefix>/<rank>`` key belongs to, which ranks never connected and which were refused, and why). A registered
rank whose connection drops without ``CLOSE`` is dead: the server sets ``__dead__/<rank>`` and fails every pending
and later wait naming it. So is a rank it has heard nothing from for a lease (``lease_s``; each client's heartbeat
thread sends ``BEAT`` several times a lease, which the server reads even while the client waits for an answer): a
stopped process or a host gone from the network keeps its connection open, so only its silence tells. The server
then frees its seat and answers that connection ``EXPIRED`` (the rank, should it wake, learns it was declared
dead), and reads nothing more from it.

Who may do what (the threat model is in docs/security.md): a client is a rank of the group (one connection per
rank), or anonymous. Without a token, an anonymous client is admitted only from the hosting process itself (the
listener has verified its pid); with a token, knowing it is the proof. Keys under ``__`` are the server's
(``__dead__/<rank>``, :data:`GROUP_SECRET_KEY`): clients read them, never write them. A key ``<prefix>/<r>``,
``r`` a rank of the group, is rank ``r``'s (and ``allreduce/job`` rank 0's): only ``r`` and an anonymous client
of the hosting process itself write it; an anonymous client from another process, admitted for the token it
knows, writes only keys no rank owns. Sizes are bounded: a value (:data:`MAX_VALUE_BYTES`), everything stored
(:data:`MAX_STORED_BYTES`), anonymous connections (:data:`MAX_ANONYMOUS_CLIENTS`), and what one connection may
have in flight (one request: clients never pipeline, so the server reads no further until it has answered).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable

from allreduce.runtime._liveness import LEASE_SWEEP_MAX_S, LEASE_SWEEPS
from allreduce.runtime.store._store_conn import Conn, Waiter
from allreduce.runtime.store._store_protocol import (
    _INT64_MAX,
    _INT64_MIN,
    _MAX_REFUSAL_CHARS,
    _MAX_REQUEST_BYTES,
    _MAX_REQUEST_KEY_BYTES,
    _MAX_RIVALS_LISTED,
    _RANK_ZERO_KEYS,
    _RECV_BYTES,
    BEAT_FRAME,
    DEAD_PREFIX,
    ELASTIC_PREFIX,
    GROUP_SECRET_KEY,
    KEY_SEPARATOR,
    LEASE_KEY,
    MAX_ANONYMOUS_CLIENTS,
    MAX_ANSWER_BYTES,
    MAX_FAIL_REASON_BYTES,
    MAX_KEY_BYTES,
    MAX_STORED_BYTES,
    MAX_VALUE_BYTES,
    NO_TIMEOUT,
    REQUEST,
    RESERVED_PREFIX,
    RESPONSE,
    SERVER_STOP_S,
    SERVICE,
    WRITER_PREFIX,
    Op,
    Status,
    _owner_of,
)
from allreduce.runtime.tcp import ClientHello, Listener, RetryLater
from allreduce.runtime.tcp._handshake import HandshakeRefusedError, Refusal
from allreduce.runtime.tcp._listener import RefusalLog

__all__ = ["StoreServer"]

_log = logging.getLogger("allreduce.store")


class StoreServer:
    """The store's event loop; runs in its own daemon thread of the rank-0 process."""

    def __init__(
        self, sock: socket.socket, *, world_size: int, token: bytes | None, single_group: bool, lease_s: float = 0.0
    ) -> None:
        # single_group: hosted by a member of the group (init()'s rank 0), so it lives exactly as long as that group
        # and a rank that has left it can only be on its way to the next group's store. A standalone store
        # (rank -1) may serve successive groups, and lets ranks come back.
        self._single_group = single_group
        self._world_size = world_size
        self._token = token
        self._data: dict[str, bytes] = {
            GROUP_SECRET_KEY: secrets.token_hex(32).encode(),
            LEASE_KEY: repr(float(lease_s)).encode(),
        }
        # A rank silent for lease_s is dead (0: never). Swept a few times a lease, not at every event: a sweep
        # looks at every connection.
        self._lease_s = float(lease_s)
        self._sweep_s = min(LEASE_SWEEP_MAX_S, self._lease_s / LEASE_SWEEPS)
        self._next_sweep = time.monotonic() + self._sweep_s
        # per rank, the longest the server went without reading from its connection (the silence a lease must
        # outlast); its keys never change, so other threads may copy it
        self._gaps = dict.fromkeys(range(world_size), 0.0)
        self._stored_bytes = sum(len(k.encode()) + len(v) for k, v in self._data.items())
        self._waiters: list[Waiter] = []
        self._conns: set[Conn] = set()
        self._ranks_seen: set[int] = set()
        self._dead: dict[int, str] = {}
        # Touched by handshake threads too: live ranks (None while a handshake holds the rank) and new connections.
        # A condition so that close() can wait for the ranks to leave.
        self._lock = threading.Condition()
        self._ranks_live: dict[int, Conn | None] = {}
        self._to_register: list[Conn] = []
        self._left: set[int] = set()  # ranks that closed cleanly: their group is over for them
        self._anonymous = 0  # anonymous connections admitted or being admitted
        self._refusals: dict[int, str] = {}  # claimed rank -> why its last attempt to join was refused
        self._failure: str | None = None  # the hosting rank gave up: what every rank is told (under the lock)
        self._failure_applied = False  # the loop has told the ranks already connected
        self._told: set[int] = set()  # ranks refused at the handshake with the failure
        self._failed_rank = -1  # the hosting rank that gave up
        self._clients_came = 0  # clients that said who they are (admitted, or refused after their hello)
        self._refusal_log = RefusalLog(_log, "store")
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._stop = False
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._run, name="allreduce-store-server", daemon=True)
        self._thread.start()
        # Handshakes run off the loop, in the listener's threads, so a slow or hostile client cannot stall the
        # store; the loop registers a connection once it has authenticated.
        self._listener = Listener(
            sock,
            service=SERVICE,
            token=token,
            check=self._check_hello,
            accepted=self._accepted,
            refused=self._refused,
            name="allreduce-store",
        )

    @property
    def port(self) -> int:
        return self._listener.port

    def heartbeat_gaps(self) -> dict[int, float]:
        """Per rank, the longest the server went without reading anything from that rank's connection (its
        heartbeats and requests), in seconds: the silence of a live rank that the lease must outlast."""
        return dict(self._gaps)

    def wait_for_ranks_to_leave(self, timeout_s: float) -> list[int]:
        """Wait until no rank client is connected (each closed or died); the ranks still there at the timeout."""
        with self._lock:
            self._lock.wait_for(lambda: not self._ranks_live, timeout_s)
            return sorted(self._ranks_live)

    def fail(self, rank: int, reason: str) -> None:
        """The hosting ``rank`` gave up during the rendezvous: every rank waiting on the store is answered that
        rank ``rank`` is gone, with ``reason``, and every rank that joins from now on is refused with it."""
        with self._lock:
            self._failure = f"rank {rank} gave up: {reason}"
            self._failed_rank = rank
            self._told.add(rank)
        self._wake()

    def wait_until_told(self, timeout_s: float) -> list[int]:
        """After :meth:`fail`: wait until every rank has joined (and been told) or been refused with the failure,
        and no rank is still connected; the ranks never reached within ``timeout_s``."""

        # Told: the ranks refused with the failure, and those connected when it was applied (their waits fail
        # with it). Not a rank merely seen: an impostor that held a rank's seat and left has told that rank nothing.
        def done() -> bool:
            return not self._ranks_live and self._told >= set(range(self._world_size))

        with self._lock:
            if self._clients_came <= 1 and not (self._ranks_seen | self._told) - {self._failed_rank}:
                # Nobody but the host's own client ever came: none is waiting to hear (a store nobody else joined).
                # A client that took the host's own seat is someone: the ranks that join after it must hear why.
                return []
            self._lock.wait_for(done, timeout_s)
            return sorted(set(range(self._world_size)) - self._told)

    def stop(self) -> None:
        self._listener.close()  # every handshake under way has reported by now
        self._stop = True
        self._wake()
        self._thread.join(timeout=SERVER_STOP_S)
        self._refusal_log.summarize()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    # -- loop
    def _run(self) -> None:
        try:
            while not self._stop:
                for key, mask in self._selector.select(self._next_timeout()):
                    if key.fileobj is self._wake_r:
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(4096)
                    else:
                        self._guarded(key.data, functools.partial(self._ready, key.data, mask))
                self._register_new()
                self._apply_failure()
                self._expire_waiters()
                self._expire_leases()
        except Exception:  # never die silently: every client would then see rank 0 as dead
            _log.exception("store server crashed")
        finally:
            for conn in list(self._conns):
                self._drop(conn, died=False)
            with self._lock:  # handed over by the listener but never registered
                pending, self._to_register = self._to_register, []
            for conn in pending:
                conn.sock.close()
            self._selector.close()
            self._wake_r.close()
            self._wake_w.close()

    def _apply_failure(self) -> None:
        """Once, after :meth:`fail`: the host is dead to every rank (pending and later waits fail naming it)."""
        with self._lock:
            failure, host = self._failure, self._failed_rank
        if failure is None or self._failure_applied:
            return
        self._failure_applied = True
        with self._lock:  # every rank connected now hears of it (its waits fail with it)
            self._told.update(conn.rank for conn in self._conns if conn.rank is not None)
            self._lock.notify_all()
        self._dead[host] = failure
        self._data[f"{DEAD_PREFIX}{host}"] = failure.encode()
        self._notify()

    def _ready(self, conn: Conn, mask: int) -> None:
        if mask & selectors.EVENT_READ:
            self._readable(conn)
        if mask & selectors.EVENT_WRITE and conn in self._conns:
            self._flush(conn)
            self._parse(conn)  # requests held back until the last answer was sent

    def _guarded(self, conn: Conn, action: Callable[[], None]) -> None:
        """Run ``action`` for ``conn``; if it fails, drop that client: one client's request never stops the store
        for every rank."""
        try:
            action()
        except Exception:
            _log.exception("store: handling a request from %s failed; dropping that client", conn.who)
            self._drop(conn, died=False)

    def _next_timeout(self) -> float | None:
        deadlines = [w.deadline for w in self._waiters if w.deadline is not None]
        if self._lease_s > 0:
            deadlines.append(self._next_sweep)
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _accepted(self, sock: socket.socket, hello: ClientHello, address: str) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = Conn(sock, address, hello.rank if hello.rank >= 0 else None, hello.pid)
        with self._lock:
            self._clients_came += 1
            self._to_register.append(conn)
            if conn.rank is not None:
                self._ranks_live[conn.rank] = conn  # the seat's holder from now on, as a rival would be told
                self._refusals.pop(conn.rank, None)
        self._wake()

    def _refused(self, address: str, error: BaseException, admitted: ClientHello | None) -> None:
        # "not yet" to a rank already joining the next group is routine; anything else is worth a warning
        retry = isinstance(error, HandshakeRefusedError) and error.kind is Refusal.RETRY
        self._refusal_log.note(address, error, routine=retry)
        with self._lock:
            if admitted is not None and admitted.rank >= 0:
                # the client left after its rank was reserved: free the seat
                if admitted.rank in self._ranks_live and self._ranks_live[admitted.rank] is None:
                    del self._ranks_live[admitted.rank]
            elif admitted is not None:
                self._anonymous -= 1
            claimed = error.hello if isinstance(error, HandshakeRefusedError) else None
            if claimed is not None or admitted is not None:
                self._clients_came += 1
            holder = self._ranks_live.get(claimed.rank) if claimed is not None and admitted is None else None
            # an authenticated client claimed a rank whose seat is held
            rival = isinstance(error, HandshakeRefusedError) and error.kind is Refusal.OWNER
            if holder is not None and rival and len(holder.rivals) < _MAX_RIVALS_LISTED:
                holder.rivals.append(f"a client from {address}")
            if not retry and claimed is not None and 0 <= claimed.rank < self._world_size:
                # Reported when a wait for this rank times out: it tried, and was turned away (the rank it claims
                # is unauthenticated, so this only explains, it never fails anyone).
                assert isinstance(error, HandshakeRefusedError)
                self._refusals[claimed.rank] = f"{error.reason[:_MAX_REFUSAL_CHARS]}; from {address}"

    def _check_hello(self, hello: ClientHello) -> str | None:
        """A reason to refuse this client, or None (then its rank, or an anonymous seat, is reserved for it)."""
        if hello.world_size != self._world_size:
            return f"world size mismatch: the store has {self._world_size}, rank {hello.rank} says {hello.world_size}"
        if hello.rank >= self._world_size:
            return f"rank {hello.rank} out of range for world size {self._world_size}"
        if hello.rank < 0:
            if self._token is None and hello.pid != os.getpid():
                return (
                    f"anonymous clients (no rank) are not admitted from another process (pid {hello.pid}); "
                    "join with your RANK, or set a shared token (ALLREDUCE_TOKEN)"
                )
            with self._lock:
                if self._anonymous >= MAX_ANONYMOUS_CLIENTS:
                    return f"too many anonymous clients (at most {MAX_ANONYMOUS_CLIENTS})"
                self._anonymous += 1
            return None
        if hello.rank >= 0:
            with self._lock:
                if self._failure is not None:
                    self._told.add(hello.rank)
                    self._lock.notify_all()
                    return f"the group failed before rank {hello.rank} joined: {self._failure}"
                if self._single_group and hello.rank in self._left:
                    # This rank closed its group and is joining the next one, whose store (same address) is not
                    # up until this one stops: have it come back rather than rejoin a finished group.
                    return RetryLater(f"rank {hello.rank} already left this store's group; the next is not up yet")
                if hello.rank in self._ranks_live:
                    holder = self._ranks_live[hello.rank]
                    held = f", from {holder.origin}" if holder is not None else " (joining now)"
                    return (
                        f"rank {hello.rank} is already connected{held}: two processes with the same RANK, or another "
                        f"process took rank {hello.rank}'s seat (set ALLREDUCE_TOKEN so only this job's processes join)"
                    )
                self._ranks_live[hello.rank] = None
        return None

    def _register_new(self) -> None:
        with self._lock:
            new, self._to_register = self._to_register, []
        for conn in new:
            self._conns.add(conn)
            if conn.rank is not None:
                self._ranks_seen.add(conn.rank)
                if conn.rank in self._dead:  # a restarted rank: it is alive again
                    del self._dead[conn.rank]
                    self._data.pop(f"{DEAD_PREFIX}{conn.rank}", None)
            self._selector.register(conn.sock, selectors.EVENT_READ, conn)

    def _readable(self, conn: Conn) -> None:
        try:
            chunk = conn.sock.recv(_RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(conn, died=not conn.closing)
            return
        now = time.monotonic()
        if conn.rank is not None and now - conn.last_heard > self._gaps.get(conn.rank, now):
            self._gaps[conn.rank] = now - conn.last_heard
        conn.last_heard = now
        if conn.expired:
            return
        conn.inbuf += chunk
        if len(conn.inbuf) > _MAX_REQUEST_BYTES:
            # A client sends its next request only after reading the answer to the last, so its buffer never
            # holds more than one request: this one floods it.
            _log.warning("store: client %s sent more than one request's worth without waiting; dropping it", conn.who)
            self._drop(conn, died=False)
            return
        self._parse(conn)

    def _parse(self, conn: Conn) -> None:
        """Handle every complete request in ``conn.inbuf``; requests behind a pending wait or an unsent answer stay
        queued (so what one connection makes the server hold is bounded by one request and one answer)."""
        while conn in self._conns and not conn.expired and len(conn.inbuf) >= REQUEST.size:
            if conn.inbuf.startswith(BEAT_FRAME):  # a heartbeat: read whenever it comes, never answered
                del conn.inbuf[: len(BEAT_FRAME)]
                continue
            if conn.waiting is not None or conn.outbuf:
                return
            op, timeout_ms, key_len, value_len = REQUEST.unpack_from(conn.inbuf)
            if key_len > _MAX_REQUEST_KEY_BYTES or value_len > MAX_VALUE_BYTES:
                _log.warning(
                    "store: %s sent a request of a %d-byte key and a %d-byte value (at most %d and %d); dropping it",
                    conn.who,
                    key_len,
                    value_len,
                    _MAX_REQUEST_KEY_BYTES,
                    MAX_VALUE_BYTES,
                )
                self._drop(conn, died=False)
                return
            total = REQUEST.size + key_len + value_len
            if len(conn.inbuf) < total:
                return
            key_bytes = bytes(conn.inbuf[REQUEST.size : REQUEST.size + key_len])
            value = bytes(conn.inbuf[REQUEST.size + key_len : total])
            del conn.inbuf[:total]
            try:
                key = key_bytes.decode()
            except UnicodeDecodeError:
                self._reply(conn, Status.ERROR, b"key is not utf-8")
                continue
            self._handle(conn, op, None if timeout_ms == NO_TIMEOUT else timeout_ms / 1000.0, key, value)

    def _forbidden(self, conn: Conn, key: str) -> str | None:
        """Why ``conn`` may not write ``key``, or None."""
        if key.startswith(RESERVED_PREFIX):
            return f"key {key!r} is the store's own (keys under {RESERVED_PREFIX!r} are read-only)"
        owner = 0 if key in _RANK_ZERO_KEYS else _owner_of(key)
        if owner is None or owner >= self._world_size or owner == conn.rank:
            return None
        # The hosting process's own anonymous client acts for the job (a harness hosting the store); one from
        # another process, admitted for the token it knows, writes only keys no rank owns: it cannot rewrite where
        # a rank listens, which host it is on, or which job this is.
        if conn.rank is None and conn.pid == os.getpid():
            return None
        return f"key {key!r} belongs to rank {owner}; {conn.who} may not write it"

    def _put(self, conn: Conn, key: str, value: bytes) -> bool:
        """Store ``value`` at ``key`` within :data:`MAX_STORED_BYTES`; else answer an error and return False."""
        old = self._data.get(key)
        grown = self._stored_bytes + len(value) - (len(old) if old is not None else -len(key.encode()))
        if grown > MAX_STORED_BYTES:
            message = f"store full: {key!r} would bring it to {grown} bytes (at most {MAX_STORED_BYTES})"
            self._reply(conn, Status.ERROR, message.encode())
            return False
        self._data[key] = value
        self._stored_bytes = grown
        self._attribute(conn, key)
        return True

    def _attribute(self, conn: Conn, key: str) -> None:
        """Record ``conn`` as the last writer of ``key`` (``__writer__/<key>``, counted like any value; skipped
        when that would overflow the key limit or the store)."""
        name = WRITER_PREFIX + key
        if len(name.encode()) > MAX_KEY_BYTES:
            return
        writer = conn.writer.encode()
        old = self._data.get(name)
        grown = self._stored_bytes + len(writer) - (len(old) if old is not None else -len(name.encode()))
        if grown <= MAX_STORED_BYTES:
            self._data[name] = writer
            self._stored_bytes = grown

    def _handle(self, conn: Conn, op: int, timeout_s: float | None, key: str, value: bytes) -> None:
        if op in (Op.SET, Op.ADD, Op.DELETE) and (reason := self._forbidden(conn, key)) is not None:
            _log.warning("store: refused a write from %s: %s", conn.who, reason)
            self._reply(conn, Status.ERROR, reason.encode())
            return
        if op == Op.SET:
            if self._put(conn, key, value):
                self._reply(conn, Status.OK, b"")
                self._notify()
        elif op == Op.ADD:
            try:
                current = int(self._data.get(key, b"0"))
                (amount,) = struct.unpack("!q", value)
            except (ValueError, struct.error):
                self._reply(conn, Status.ERROR, f"add: key {key!r} does not hold an integer".encode())
                return
            current += amount
            if not _INT64_MIN <= current <= _INT64_MAX:
                message = f"add: key {key!r} would hold {current}, which does not fit in a signed 64-bit integer"
                self._reply(conn, Status.ERROR, message.encode())
                return
            if self._put(conn, key, str(current).encode()):
                self._reply(conn, Status.OK, struct.pack("!q", current))
                self._notify()
        elif op in (Op.GET, Op.WAIT):
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            waiter = Waiter(conn, key.split(KEY_SEPARATOR), deadline, want_value=op == Op.GET)
            if not self._try_answer(waiter):
                conn.waiting = waiter
                self._waiters.append(waiter)
        elif op == Op.CHECK:
            present = all(k in self._data for k in key.split(KEY_SEPARATOR))
            self._reply(conn, Status.OK if present else Status.MISSING, b"")
        elif op == Op.DELETE:
            old = self._data.pop(key, None)
            if old is not None:
                self._stored_bytes -= len(key.encode()) + len(old)
                self._attribute(conn, key)  # who deleted it
            self._reply(conn, Status.OK if old is not None else Status.MISSING, b"")
        elif op == Op.DEAD:
            self._reply(conn, Status.OK, ",".join(map(str, sorted(self._dead))).encode())
        elif op == Op.FAIL:  # a rank gives up (its init failed): every rank waiting on it hears why at once
            if conn.rank is None:
                self._reply(conn, Status.ERROR, b"only a rank can give up")
                return
            why = value[:MAX_FAIL_REASON_BYTES].decode(errors="replace")
            reason = f"rank {conn.rank} gave up (a client from {conn.origin}): {why}"
            _log.warning("store: %s", reason)
            self._dead[conn.rank] = reason
            self._data[f"{DEAD_PREFIX}{conn.rank}"] = reason.encode()
            conn.gave_up = True  # if it also says goodbye (CLOSE), a lingering store need not wait for it
            self._reply(conn, Status.OK, b"")
            self._notify()
        elif op == Op.BEAT:
            pass  # never answered (a client sends only BEAT_FRAME, read above; this is one split across reads)
        elif op == Op.CLOSE:
            first_close = not conn.closing
            conn.closing = True
            with self._lock:
                if conn.rank is not None:
                    self._left.add(conn.rank)
                    if conn.gave_up:  # a rank that gave up and left in order knows why the group failed
                        self._told.add(conn.rank)
                        self._lock.notify_all()
                elif first_close:  # its seat is free once it has said goodbye, before the loop reads its EOF
                    self._anonymous -= 1
            self._reply(conn, Status.OK, b"")
        else:
            self._reply(conn, Status.ERROR, f"unknown request {op}".encode())

    def _try_answer(self, waiter: Waiter) -> bool:
        if all(k in self._data for k in waiter.keys):
            self._reply(waiter.conn, Status.OK, self._data[waiter.keys[0]] if waiter.want_value else b"")
            return True
        # A dead rank breaks the rendezvous: fail the wait now, naming it, instead of at the timeout. Waiting for a
        # death notice itself is allowed; under ELASTIC_PREFIX only the death of a rank whose key is awaited counts.
        if self._dead and not any(k.startswith(DEAD_PREFIX) for k in waiter.keys):
            elastic = all(k.startswith(ELASTIC_PREFIX) for k in waiter.keys)
            fatal = [r for r in self._dead if not elastic or r in {_owner_of(k) for k in waiter.keys}]
            if fatal:
                self._reply(waiter.conn, Status.DEAD_RANK, f"{min(fatal)}\n{self._dead[min(fatal)]}".encode())
                return True
        return False

    def _notify(self) -> None:
        def answered(waiter: Waiter) -> bool:
            if not self._try_answer(waiter):
                return False
            waiter.conn.waiting = None
            return True

        self._settle_waiters(answered)

    def _expire_waiters(self) -> None:
        now = time.monotonic()

        def expired(waiter: Waiter) -> bool:
            if waiter.deadline is None or now < waiter.deadline:
                return False
            self._guarded(waiter.conn, functools.partial(self._time_out, waiter))
            return True

        self._settle_waiters(expired)

    def _settle_waiters(self, settled: Callable[[Waiter], bool]) -> None:
        """Drop the waiters of closed connections and those ``settled(waiter)`` answered; the connections of the
        answered ones go on with their next request."""
        still = []
        woken = []
        for waiter in self._waiters:
            if waiter.conn not in self._conns:
                continue
            if settled(waiter):
                woken.append(waiter.conn)
            else:
                still.append(waiter)
        self._waiters = still
        for conn in woken:
            self._guarded(conn, functools.partial(self._parse, conn))

    def _time_out(self, waiter: Waiter) -> None:
        """Answer ``waiter`` "timed out", with what the server knows about the keys it still misses."""
        missing = [k for k in waiter.keys if k not in self._data]
        owners = {owner for k in missing if (owner := _owner_of(k)) is not None}
        with self._lock:
            # a rank admitted since its refusal has no entry; a seen rank's entry is a rival of its seat
            refusals = dict(self._refusals)
        never = sorted(set(range(self._world_size)) - self._ranks_seen - refusals.keys())
        report = "\n".join(
            [
                KEY_SEPARATOR.join(missing),
                ",".join(map(str, sorted(owners))),
                ",".join(map(str, never)),
                *(f"{r}:{why.replace(chr(10), ' ')}" for r, why in sorted(refusals.items())),
            ]
        )
        waiter.conn.waiting = None
        # Cut to what a client accepts (the keys echoed back could be longer): the report only explains.
        self._reply(waiter.conn, Status.TIMEOUT, report.encode()[:MAX_ANSWER_BYTES])

    def _reply(self, conn: Conn, status: int, payload: bytes) -> None:
        conn.outbuf += RESPONSE.pack(status, len(payload))
        conn.outbuf += payload
        self._flush(conn)

    def _flush(self, conn: Conn) -> None:
        try:
            while conn.outbuf:
                sent = conn.sock.send(conn.outbuf)
                del conn.outbuf[:sent]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._drop(conn, died=not conn.closing)
            return
        if conn.expired and not conn.outbuf:  # EXPIRED was its last answer: end of file after it
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_WR)
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.outbuf else 0)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.modify(conn.sock, events, conn)

    def _drop(self, conn: Conn, *, died: bool) -> None:
        if conn not in self._conns:
            return
        self._conns.discard(conn)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.sock)
        conn.sock.close()
        if conn.rank is None:
            if not conn.closing:
                with self._lock:
                    self._anonymous -= 1
            return
        with self._lock:
            if self._ranks_live.get(conn.rank) is conn:
                del self._ranks_live[conn.rank]
                self._lock.notify_all()
        if died and not self._stop and not conn.expired:
            reason = (
                f"rank {conn.rank} disconnected from the store without close() (process died?); its seat was held "
                f"by a client from {conn.origin}"
            )
            with self._lock:
                rivals = list(conn.rivals)
            if rivals:
                reason = (
                    f"rank {conn.rank}'s seat in the store was held by a client from {conn.origin}, which left "
                    f"without close(); while it held the seat, {' and '.join(rivals)} claiming rank {conn.rank} "
                    f"{'was' if len(rivals) == 1 else 'were'} refused, so the one that left may not have been the "
                    f"real rank {conn.rank}: two processes claimed rank {conn.rank} (a duplicate RANK, or another "
                    "process took the seat; set ALLREDUCE_TOKEN so only this job's processes join)"
                )
            _log.warning("store: %s", reason)
            self._dead[conn.rank] = reason
            self._data[f"{DEAD_PREFIX}{conn.rank}"] = reason.encode()
            self._notify()

    # -- leases
    def _expire_leases(self) -> None:
        """Declare dead every rank the server has heard nothing from for a lease (its connections were read first
        in this turn of the loop: a server that was itself held up reads what waited in the kernel before this)."""
        if self._lease_s <= 0:
            return
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + self._sweep_s
        silent = [
            c
            for c in self._conns
            if c.rank is not None and not (c.closing or c.expired or c.gave_up) and now - c.last_heard > self._lease_s
        ]
        for conn in silent:
            self._expire(conn, now - conn.last_heard)

    def _expire(self, conn: Conn, silent_s: float) -> None:
        """``conn``'s rank is dead: its seat is free, every wait naming it fails, and the connection is answered
        EXPIRED (the rank, if it ever runs again, learns it was declared dead) and read no more."""
        assert conn.rank is not None
        reason = (
            f"rank {conn.rank} sent nothing to the store for {silent_s:.1f} s, past its lease of {self._lease_s:g} s "
            f"(ALLREDUCE_LEASE_S): its process is stopped or hung, or its host or network is gone; its seat was "
            f"held by a client from {conn.origin}"
        )
        _log.warning("store: %s", reason)
        conn.expired = True
        with self._lock:
            if self._ranks_live.get(conn.rank) is conn:
                del self._ranks_live[conn.rank]
                self._lock.notify_all()
        self._waiters = [w for w in self._waiters if w.conn is not conn]
        conn.waiting = None
        conn.inbuf.clear()
        self._dead[conn.rank] = reason
        self._data[f"{DEAD_PREFIX}{conn.rank}"] = reason.encode()
        self._guarded(conn, functools.partial(self._reply, conn, Status.EXPIRED, reason.encode()))
        self._notify()
