"""The TCP transport: executes compiled plans over one TCP connection per peer pair the schedule uses.

Data path. The calling thread drives every socket of a step (:mod:`._loop`): it sends each frame (header and
payload in one ``sendmsg``, straight from the user's buffer) while receiving the step's frames into their
destination: directly into the user's buffer for a copy, into a reusable per-peer window for a reduction
(:mod:`._pair`). Where a rank has two cores of its own (:func:`sender_thread_pays`), a step sending at least
:data:`THREAD_MIN_BYTES` hands its sends to the rank's sender thread, so the rank copies out and copies in at once;
where ranks share cores that only adds thread switches, and the calling thread sends too.

Connections are made lazily, the first time a plan needs a peer: the higher rank connects to the lower one's
listening port (published in the store as ``<prefix>/addr/<rank>``), and the lower one's :class:`Listener`
answers, so no two ranks ever wait on each other to accept. Two ranks in one kernel and network namespace
(:func:`host_key`) that share a token connect over a Unix socket instead (published as ``<prefix>/unix/<rank>``,
an abstract name): the same handshake and the same frames, without the TCP/IP stack (a raw Unix stream moves about
1.7 times the bytes per second of a loopback TCP one here). The token is required because its MACs authenticate
both ends on any kind of socket. ``unix_sockets=False`` (or ``ALLREDUCE_TCP_UNIX=0``) keeps every connection on
TCP.

Failures: a peer's EOF or reset raises :class:`PeerFailureError` naming it at once; a rank that fails sends an
ABORT frame naming the culprit to every peer (then drains and closes its sockets in the background so that no
peer stays blocked sending to it), so a death propagates along the schedule's connections in milliseconds. A peer
that finds such a connection closed before it read the ABORT frame names the first cause anyway (:mod:`._blame`).
After any error the transport is unusable.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import threading
import time
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from allreduce.runtime._errors import CollectiveError, CollectiveTimeoutError
from allreduce.runtime._liveness import SilenceWatch
from allreduce.runtime._store_api import Store
from allreduce.runtime.tcp._blame import DEAD_POLL_S, STALL_GRACE_S, STOP_SETTLE_S, BlameRecords, LostPeerError
from allreduce.runtime.tcp._frames import (
    FLAG_ABORT,
    FLAG_AGREE,
    FLAG_CHECKSUM,
    HEADER_SIZE,
    MAX_ABORT_BYTES,
    NO_CULPRIT,
    InFrame,
    OutFrame,
    encode_header,
)
from allreduce.runtime.tcp._handshake import (
    CONNECT_HANDSHAKE_MAX_S,
    ClientHello,
    HandshakeRetryError,
    connect_handshake,
    resolve_token,
)
from allreduce.runtime.tcp._listener import Listener, listening_socket
from allreduce.runtime.tcp._loop import Sender, exchange, pace_step
from allreduce.runtime.tcp._pair import Pair
from allreduce.runtime.tcp._prepared import WINDOW_BYTES, PreparedPlan, prepare
from allreduce.runtime.tcp._socket import (
    congestion_control,
    connect_tcp,
    drain_and_close,
    host_key,
    is_loopback,
    send_until,
    tune,
)
from allreduce.runtime.tcp._tcpinfo import pace_sending, sent_and_busy
from allreduce.runtime.transport._transport import Call, Transport, abort_kind

__all__ = [
    "ABORT_BUDGET_S",
    "CONGESTION_ENV",
    "CONNECT_RETRY_S",
    "CONNECT_TIMEOUT_MAX_S",
    "DEAD_POLL_S",
    "SENDER_THREAD_ENV",
    "STALL_GRACE_S",
    "THREAD_MIN_BYTES",
    "UNIX_ENV",
    "TcpTransport",
    "sender_thread_pays",
]

THREAD_MIN_BYTES = 1 << 20
"""A step sending at least this much hands its sends to the rank's sender thread (where the rank uses one);
smaller steps run in the calling thread, where a hand-off would cost more than it saves."""

SENDER_THREAD_ENV = "ALLREDUCE_TCP_SENDER_THREAD"
"""``1`` or ``0``: use the sender thread for large steps, or never; unset, :func:`sender_thread_pays` decides."""


def ranks_on_this_host(world_size: int) -> int:
    """The group's ranks on this host: ``LOCAL_WORLD_SIZE`` as the launchers set it, else all ``world_size``."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(local) if local.isdigit() and int(local) > 0 else world_size


def sender_thread_pays(world_size: int) -> bool:
    """Whether a rank has two cores of its own, so that its sender thread can copy out while the calling thread
    copies in and reduces: the CPUs this process may run on, at least twice the ranks on this host
    (:func:`ranks_on_this_host`).

    Measured on 2 cores (docs/design.md): with ranks sharing the cores the thread only adds switches, and sending
    from the calling thread was 11-36% faster at 64 and 256 MiB with 2, 4 and 8 ranks."""
    return len(os.sched_getaffinity(0)) >= 2 * ranks_on_this_host(world_size)


def cores_shared(world_size: int) -> bool:
    """Whether this host's ranks outnumber the CPUs this process may run on (sizes Unix sockets' buffers)."""
    return ranks_on_this_host(world_size) > len(os.sched_getaffinity(0))


def _sender_thread_setting(rank: int, sender_thread: bool | None, world_size: int) -> bool:
    if sender_thread is not None:
        return sender_thread
    value = os.environ.get(SENDER_THREAD_ENV, "")
    if value in ("0", "1"):
        return value == "1"
    if value:
        raise ValueError(f"rank {rank}: {SENDER_THREAD_ENV}={value!r}: write 1 (use the sender thread) or 0 (never)")
    return sender_thread_pays(world_size)


ABORT_BUDGET_S = 2.0
"""How long a failing rank spends, over all its peers together, finishing half-sent frames and sending ABORT
frames: a peer normally reads them at once; one that does not sees EOF instead (naming this rank)."""

CONNECT_TIMEOUT_MAX_S = 10.0
"""The longest one TCP connection attempt to a peer may take (less when the deadline is nearer)."""

CONNECT_RETRY_S = 0.05
"""The pause before connecting again after a transient error (not a refusal: a refused connection means the
peer's published listener is gone, i.e. the peer exited)."""


CONGESTION_ENV = "ALLREDUCE_TCP_CONGESTION"
"""Set to a TCP congestion control (``cubic``, ``bbr``, ``reno``) to use it on every TCP data connection instead
of the kernel's default: for experiments on how the congestion control shapes an all-reduce (``emulate``)."""

UNIX_ENV = "ALLREDUCE_TCP_UNIX"
"""Set to ``0`` to keep connections between ranks of one host on TCP (the default takes Unix sockets there)."""

_SERVICE = b"tcp"
_NOTHING = memoryview(b"")  # where an agreement frame lands until its header says its length
_UNIX_BACKLOG = 128  # pending connections the kernel queues, as the TCP listener's


def _unix_listening_socket(backlog: int) -> tuple[socket.socket, bytes]:
    """A Unix stream socket listening on a fresh abstract name (no file to clean up; scoped to the network
    namespace; as reachable as a loopback port, so the handshake's token guards it the same way)."""
    name = b"\0allreduce-tcp-" + secrets.token_hex(16).encode()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(name)
        sock.listen(max(_UNIX_BACKLOG, backlog))
    except BaseException:
        sock.close()
        raise
    return sock, name


class TcpTransport(Transport):
    """Moves compiled plans' data over TCP; see the module docstring."""

    name = "tcp"

    def __init__(
        self,
        rank: int,
        world_size: int,
        store: Store,
        *,
        host: str = "127.0.0.1",
        token: str | bytes | None = None,
        timeout_s: float = 300.0,
        advertise_host: str | None = None,
        prefix: str = "tcp",
        unix_sockets: bool | None = None,
        sender_thread: bool | None = None,
    ) -> None:
        super().__init__(rank, world_size)
        self.sender_thread = _sender_thread_setting(rank, sender_thread, world_size)
        """Whether steps sending at least :data:`THREAD_MIN_BYTES` go through the sender thread (``sender_thread``
        if given, else :data:`SENDER_THREAD_ENV`, else :func:`sender_thread_pays`)."""
        self.timeout_s = timeout_s
        self._store = store
        self._prefix = prefix
        self._blame = BlameRecords(store, prefix, rank, world_size)
        self._silence = SilenceWatch.of(store, rank)
        self._token = resolve_token(token)
        congestion = os.environ.get(CONGESTION_ENV, "")
        try:
            self._congestion = congestion_control(congestion) if congestion else None
        except ValueError as exc:
            raise ValueError(f"rank {rank}: {CONGESTION_ENV}={congestion!r}: {exc}") from None
        self._shared_cores = cores_shared(world_size)
        if not is_loopback(host) and self._token is None:
            raise ValueError(
                f"rank {rank}: the TCP transport would listen on {host!r}, beyond loopback: set a shared token "
                "(token= or the ALLREDUCE_TOKEN environment variable)"
            )
        if self._token is None:
            # No shared token (loopback only): the group's secret, which the store hands only to the ranks it
            # admitted (checked by the kernel's word on who holds each connection), proves to every peer that the
            # other end is a rank of this group, over TCP and Unix sockets alike.
            self._token = resolve_token(store.group_secret())
        self._peers: dict[int, Pair] = {}
        self._cond = threading.Condition()
        self._refused: list[str] = []
        self._scratch = np.empty(0, np.uint8)
        self._sender: Sender | None = None  # started by the first step large enough to use it
        self._drains: list[threading.Thread] = []  # connections an abort is draining (see _abort)
        self._corrupt: tuple[int, int] | None = None  # (step, peer) of the next frame inject_corruption spoils
        self._connections_made = 0
        self._connections_accepted = 0
        self._frames_sent = 0
        self._frames_received = 0
        self._sender_handoffs = 0
        if unix_sockets is None:
            unix_sockets = os.environ.get(UNIX_ENV, "1") != "0"
        self._host_key = host_key() if unix_sockets and self._token is not None else ""
        self._unix_listener: Listener | None = None
        unix_address = b""

        def listener(sock: socket.socket, family: str) -> Listener:
            return Listener(
                sock, service=_SERVICE, token=self._token, check=self._check_hello, accepted=self._accepted,
                refused=self._refused_connection, name=f"allreduce-{family}-{rank}",
            )  # fmt: skip

        if self._host_key:
            unix_sock, unix_name = _unix_listening_socket(world_size)
            self._unix_listener = listener(unix_sock, "unix")
            unix_address = self._host_key.encode() + b"\n" + unix_name.hex().encode()
        try:
            self._listener = listener(listening_socket(host, backlog=world_size, congestion=self._congestion), "tcp")
        except BaseException:
            if self._unix_listener is not None:
                self._unix_listener.close()
            raise
        # Published before the TCP address, which peers read first: whoever sees that one sees this one.
        store.set(f"{prefix}/unix/{rank}", unix_address)
        if advertise_host is None:
            advertise_host = "127.0.0.1" if host in ("", "0.0.0.0") else host
        store.set(f"{prefix}/addr/{rank}", f"{advertise_host}:{self._listener.port}".encode())

    # ------------------------------------------------------------------------------------------------ public
    def inject_corruption(self, *, peer: int, step: int = 0) -> None:
        if not 0 <= peer < self.world_size or peer == self.rank:
            raise ValueError(f"rank {self.rank}: peer {peer} is not another rank of a group of {self.world_size}")
        self._corrupt = (step, peer)

    def sent_counters(self) -> Mapping[int, tuple[int, float]]:
        """The kernel's counters of each TCP connection (bytes acknowledged, seconds network-limited); none over
        Unix sockets."""
        with self._cond:
            pairs = list(self._peers.items())
        out = {}
        for peer, pair in pairs:
            counters = sent_and_busy(pair.sock)
            if counters is not None:
                out[peer] = counters
        return out

    def inject_slow_link(self, *, peer: int, rate_Bps: float) -> None:
        """Make this rank's kernel pace its sending to ``peer`` at ``rate_Bps`` (a slow link the kernel's counters
        see, for tests of re-planning): ValueError if there is no TCP connection to ``peer`` yet (connections are
        made by the first collective) or it is a Unix socket."""
        with self._cond:
            pair = self._peers.get(peer)
        if pair is None:
            raise ValueError(f"rank {self.rank}: no connection to rank {peer} yet (run a collective first)")
        pace_sending(pair.sock, rate_Bps)

    def statistics(self) -> Mapping[str, int]:
        """``connections_made`` (to lower ranks) and ``connections_accepted`` (from higher ranks);
        ``frames_sent`` and ``frames_received`` (data and agreement frames); ``sender_handoffs`` (steps whose
        sends went through the sender thread); ``unix_connections`` (open connections over a Unix socket);
        ``largest_send_buffer_bytes`` and ``largest_unix_send_buffer_bytes`` (SO_SNDBUF, as the kernel reports
        it, over the open TCP and Unix-socket connections)."""
        with self._cond:
            socks = [pair.sock for pair in self._peers.values()]
        send_buffers: list[int] = []
        unix_send_buffers: list[int] = []
        for sock in socks:
            with contextlib.suppress(OSError):
                size = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
                (unix_send_buffers if sock.family == socket.AF_UNIX else send_buffers).append(size)
        return {
            "connections_made": self._connections_made,
            "connections_accepted": self._connections_accepted,
            "frames_sent": self._frames_sent,
            "frames_received": self._frames_received,
            "sender_handoffs": self._sender_handoffs,
            "unix_connections": sum(sock.family == socket.AF_UNIX for sock in socks),
            "largest_send_buffer_bytes": max(send_buffers, default=0),
            "largest_unix_send_buffer_bytes": max(unix_send_buffers, default=0),
        }

    # ------------------------------------------------------------------------------------------------ connections
    def _accepted(self, sock: socket.socket, hello: ClientHello, address: str) -> None:
        tune(sock, congestion=self._congestion, shared_cores=self._shared_cores)
        with self._cond:
            self._peers[hello.rank] = Pair(self.rank, hello.rank, sock)
            self._connections_accepted += 1
            self._cond.notify_all()

    def _refused_connection(self, address: str, error: BaseException, admitted: ClientHello | None) -> None:
        with self._cond:
            self._refused.append(f"{address}: {error}")
            self._cond.notify_all()

    def _check_hello(self, hello: ClientHello) -> str | None:
        if hello.world_size != self.world_size:
            return f"world size mismatch: rank {self.rank} has {self.world_size}, rank {hello.rank} {hello.world_size}"
        if hello.target != self.rank:
            return f"rank {hello.rank} meant to reach rank {hello.target}, this is rank {self.rank}"
        if not self.rank < hello.rank < self.world_size:
            return f"rank {hello.rank} may not connect to rank {self.rank} (higher ranks connect to lower ones)"
        with self._cond:
            if hello.rank in self._peers:
                return f"rank {hello.rank} is already connected (two processes with the same rank?)"
        return None

    def _ensure_connected(self, peers: frozenset[int] | set[int], deadline: float, what: str) -> None:
        for peer in sorted(p for p in peers if p < self.rank and p not in self._peers):
            self._connect(peer, deadline, what)
        higher = {p for p in peers if p > self.rank}
        while True:
            with self._cond:
                missing = higher - self._peers.keys()
                if not missing:
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._blame.raise_if_dead(missing, what)
                    refused = f"; refused connections: {'; '.join(self._refused)}" if self._refused else ""
                    raise CollectiveTimeoutError(
                        f"rank {self.rank}: timed out waiting for rank(s) {', '.join(map(str, sorted(missing)))} to "
                        f"connect ({what}): they have not reached this collective, or cannot reach this host{refused}",
                        rank=self.rank,
                        peer=min(missing),
                    )
                self._cond.wait(min(remaining, DEAD_POLL_S))
                missing = higher - self._peers.keys()
                if not missing:
                    return
            self._blame.raise_if_dead(missing, what)  # outside the lock: the listener's thread reports under it

    def _connect(self, peer: int, deadline: float, what: str) -> None:
        remaining = max(deadline - time.monotonic(), 0.001)
        address = self._store.get(f"{self._prefix}/addr/{peer}", timeout_s=remaining).decode()
        unix_name = self._unix_name_of(peer, deadline)
        if unix_name is not None:
            address = "a Unix socket"
            sock = self._connect_unix(peer, unix_name, deadline, what)
        else:
            sock = self._connect_tcp(peer, address, deadline, what)
        try:
            sock.settimeout(max(min(deadline - time.monotonic(), CONNECT_HANDSHAKE_MAX_S), 1.0))
            connect_handshake(
                sock,
                _SERVICE,
                self._token,
                ClientHello(rank=self.rank, world_size=self.world_size, target=peer),
                what=f"rank {peer} at {address}",
            )
        except (OSError, EOFError) as exc:
            sock.close()
            raise self._blame.exited_peer_error(
                peer, what, f"lost rank {peer} during the handshake ({what}): {exc}"
            ) from exc
        except HandshakeRetryError as exc:  # the peer is stopping: it saw a failure, name that (when the store has)
            sock.close()
            raise self._blame.exited_peer_error(
                peer, what, f"rank {peer} was stopping when this rank connected ({what}): {exc}", settle_s=STOP_SETTLE_S
            ) from exc
        except BaseException:
            sock.close()
            raise
        tune(sock, congestion=self._congestion, shared_cores=self._shared_cores)
        with self._cond:
            self._peers[peer] = Pair(self.rank, peer, sock)
            self._connections_made += 1

    def _unix_name_of(self, peer: int, deadline: float) -> bytes | None:
        """The abstract name of ``peer``'s Unix listener if this rank can reach it (same kernel and network
        namespace, both sides willing), else None."""
        if not self._host_key:
            return None
        remaining = max(deadline - time.monotonic(), 0.001)
        published = self._store.get(f"{self._prefix}/unix/{peer}", timeout_s=remaining)
        key, _, name_hex = published.partition(b"\n")
        if key.decode(errors="replace") != self._host_key or not name_hex:
            return None
        try:
            return bytes.fromhex(name_hex.decode())
        except ValueError:
            return None  # not a name this transport publishes: reach the peer over TCP

    def _connect_unix(self, peer: int, name: bytes, deadline: float, what: str) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind("")  # an abstract address the kernel picks: the listener reports an address, never ""
            sock.settimeout(max(min(deadline - time.monotonic(), CONNECT_TIMEOUT_MAX_S), 0.001))
            sock.connect(name)
        except (ConnectionRefusedError, FileNotFoundError) as exc:  # published before we read it: it has exited
            sock.close()
            raise self._blame.exited_peer_error(
                peer, what, f"rank {peer} refused a connection on its Unix socket ({what}): it has exited"
            ) from exc
        except OSError as exc:
            sock.close()
            raise CollectiveTimeoutError(
                f"rank {self.rank}: could not connect to rank {peer} on its Unix socket ({what}): {exc}",
                rank=self.rank,
                peer=peer,
            ) from exc
        return sock

    def _connect_tcp(self, peer: int, address: str, deadline: float, what: str) -> socket.socket:
        host, _, port_text = address.rpartition(":")
        last_error: OSError | None = None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CollectiveTimeoutError(
                    f"rank {self.rank}: could not connect to rank {peer} at {address} ({what}): {last_error}",
                    rank=self.rank,
                    peer=peer,
                )
            try:
                timeout_s = min(remaining, CONNECT_TIMEOUT_MAX_S)
                sock = connect_tcp(host.strip("[]"), int(port_text), timeout_s=timeout_s, congestion=self._congestion)
                break
            except ConnectionRefusedError as exc:  # its listener is published before we read it: a real failure
                raise self._blame.exited_peer_error(
                    peer, what, f"rank {peer} refused a connection at {address} ({what}): it has exited"
                ) from exc
            except OSError as exc:
                last_error = exc
                time.sleep(CONNECT_RETRY_S)
        return sock

    # ------------------------------------------------------------------------------------------------ collectives
    def _agree(self, seq: int, descriptor: bytes, *, deadline: float, timeout_s: float) -> list[bytes]:
        """An all-gather of small AGREE frames in ceil(log2 N) steps (Bruck's): at step k this rank holds the
        descriptors of ranks ``rank .. rank + 2^k - 1`` and sends up to ``2^k`` of them to ``rank - 2^k`` while
        receiving as many from ``rank + 2^k`` (a ring takes N-1 steps, each a round trip)."""
        n = self.world_size
        held = [descriptor]  # held[i] is the descriptor of rank (self.rank + i) % n
        distance, k = 1, 0
        while distance < n:
            count = min(distance, n - distance)
            to, source = (self.rank - distance) % n, (self.rank + distance) % n
            if to not in self._peers or source not in self._peers:
                self._ensure_connected({to, source}, deadline, f"agreement for collective {seq}")
            sends = [
                (
                    to,
                    OutFrame(
                        encode_header(
                            sequence=seq,
                            step=k,
                            block=(self.rank + i) % n,
                            segment=0,
                            length=len(held[i]),
                            flags=FLAG_AGREE,
                        ),
                        memoryview(held[i]),
                    ),
                )
                for i in range(count)
            ]
            recvs = [
                (
                    source,
                    InFrame(step=k, block=(source + i) % n, segment=0, flags=FLAG_AGREE, length=-1, dest=_NOTHING),
                )
                for i in range(count)
            ]
            self._exchange(
                seq,
                tag=0,
                sends=sends,
                recvs=recvs,
                deadline=deadline,
                timeout_s=timeout_s,
                reduce_into=_no_reduction,
                step=None,
                label=f"agreement step {k}",
                sender=None,
            )
            self._frames_sent += count
            self._frames_received += count
            held.extend(bytes(incoming.dest) for _, incoming in recvs)
            distance, k = 2 * distance, k + 1
        return [held[(r - self.rank) % n] for r in range(n)]

    def _execute(self, call: Call) -> None:
        plan, buffer, reduce_into, seq = call.plan, call.buffer, call.reduce_into, call.seq
        deadline, timeout_s, checksum = call.deadline, call.timeout_s, call.checksum
        itemsize = buffer.itemsize
        prepared: PreparedPlan = self.plans.get(
            ("tcp", plan, itemsize, checksum), lambda: prepare(plan, itemsize, checksum=checksum)
        )
        if self._scratch.size < prepared.scratch_bytes:
            self._scratch = np.empty(prepared.scratch_bytes, np.uint8)
        raw = buffer.view(np.uint8).data
        scratch = self._scratch.data
        flags = FLAG_CHECKSUM if checksum else 0
        if not prepared.peers <= self._peers.keys():
            self._ensure_connected(prepared.peers, deadline, f"collective {seq} ({plan.schedule_name})")
        recorder = self.recorder
        injection = self.injection
        # the recorder's marks (see allreduce.runtime.stats._stats): a clock read each, appended
        mark = recorder.append if recorder.enabled else None
        marks = recorder.log.extend if mark is not None else None  # the call's own list: flush() runs between calls
        if mark is not None:
            mark(prepared.marks_tag)  # the call's layout, and how many marks follow
        arrivals: dict[int, int] | None = {} if mark is not None or injection is not None else None
        clock = time.perf_counter_ns
        for step in prepared.steps:
            if injection is not None:
                injection.hold_step()
            step_start = 0
            if arrivals is not None:
                step_start = clock()  # the one clock read of a step whose data was there
                if mark is not None:
                    mark(step_start)
                if arrivals:
                    arrivals.clear()
            sends = []
            for spec in step.sends:
                payload = raw[spec.byte_start : spec.byte_stop]
                crc = zlib.crc32(payload) if checksum else 0
                if self._corrupt == (step.index, spec.peer):
                    self._corrupt = None
                    corrupted = bytearray(payload)
                    corrupted[len(corrupted) // 2] ^= 0xFF
                    payload = memoryview(corrupted)
                header = encode_header(
                    sequence=seq,
                    step=step.index,
                    block=spec.block,
                    segment=spec.segment,
                    length=spec.byte_stop - spec.byte_start,
                    flags=flags,
                    crc32=crc,
                    tag=prepared.tag,
                )
                sends.append((spec.peer, OutFrame(header, payload)))
            recvs = []
            for rspec in step.recvs:
                length = rspec.byte_stop - rspec.byte_start
                if rspec.scratch_offset >= 0:
                    room = min(length, WINDOW_BYTES) if rspec.windowed else length
                    dest = scratch[rspec.scratch_offset : rspec.scratch_offset + room]
                else:
                    dest = raw[rspec.byte_start : rspec.byte_stop]
                frame = InFrame(
                    step=step.index, block=rspec.block, segment=rspec.segment, flags=flags, length=length, dest=dest
                )
                frame.spec = rspec
                frame.staged = rspec.staged
                frame.reduce = rspec.reduce
                frame.windowed = rspec.windowed
                if rspec.scratch_offset >= 0:
                    e0, e1 = rspec.byte_start // itemsize, rspec.byte_stop // itemsize
                    frame.dst_typed = buffer[e0:e1]
                    frame.src_typed = self._scratch[rspec.scratch_offset : rspec.scratch_offset + len(dest)].view(
                        buffer.dtype
                    )
                recvs.append((rspec.peer, frame))
            sender = None
            if self.sender_thread and step.send_bytes >= THREAD_MIN_BYTES:
                if self._sender is None:
                    self._sender = Sender(self.rank)
                sender = self._sender
                self._sender_handoffs += 1
            self._exchange(
                seq,
                tag=prepared.tag,
                sends=sends,
                recvs=recvs,
                deadline=deadline,
                timeout_s=timeout_s,
                reduce_into=reduce_into,
                step=step.index,
                label=f"step {step.index}",
                sender=sender,
                arrivals=arrivals,
                last_bytes=step.last_bytes or injection is not None,
                watch_idle=True,
            )
            if injection is not None and arrivals is not None:
                pace_step(injection, step, arrivals, step_start)
            if mark is not None and marks is not None and arrivals is not None:
                # first and last byte per peer, in the layout's order; 0: the step's start, the step's end
                if arrivals:
                    for peer in step.recv_peers:
                        mark(arrivals.get(peer, 0))
                        mark(arrivals.get(~peer, 0))
                else:
                    marks(step.no_arrivals)
            self._frames_sent += len(sends)
            self._frames_received += len(recvs)

    def _exchange(self, seq: int, **kwargs: Any) -> None:
        """:func:`exchange` over this rank's connections, whose errors name the first cause: the root of a stall,
        the rank a lost peer gave up because of (:class:`BlameRecords`)."""
        try:
            exchange(self.rank, self._peers, seq, silence=self._silence, **kwargs)
        except LostPeerError as exc:
            raise self._blame.lost(exc) from exc
        except CollectiveTimeoutError as exc:
            if exc.peer is None:
                raise
            root, links = self._blame.stall_root(exc.peer)
            if root == exc.peer:
                raise
            raise CollectiveTimeoutError(
                f"{exc}: rank {root} stopped responding ({'; '.join(links)}; this rank waited for rank {exc.peer})",
                rank=self.rank,
                peer=root,
                step=exc.step,
            ) from exc

    # ------------------------------------------------------------------------------------------------ endings
    def _release(self) -> None:
        self._listener.close()
        if self._unix_listener is not None:
            self._unix_listener.close()
        if self._sender is not None:
            self._sender.stop()
        with self._cond:
            peers, self._peers = list(self._peers.values()), {}
        for peer in peers:
            peer.sock.close()
        for drain in self._drains:  # an abort's ABORT frames reach the peers before this process may exit
            drain.join()

    def _abort(self, error: CollectiveError, seq: int) -> None:
        """Send every peer an ABORT frame naming the culprit, then drain and close the connections."""
        if self._sender is not None and self._sender.busy:
            self._sender.cancel()  # from here on this thread alone writes to the sockets
        # An interruption (not a collective error: wrapped by the base class) names this rank as the culprit.
        culprit = error.peer if error.peer is not None or type(error) is not CollectiveError else self.rank
        self._blame.record_abort(culprit)  # before any connection closes: a peer that sees one close finds it
        message = str(error).encode()[:MAX_ABORT_BYTES]
        with self._cond:
            peers, self._peers = list(self._peers.values()), {}
        abort = encode_header(
            sequence=seq,
            step=0,
            block=NO_CULPRIT if culprit is None else culprit,
            segment=abort_kind(error),
            length=len(message),
            flags=FLAG_ABORT,
        )
        # A peer reading our half-sent frame would see the ABORT header as payload: finish that frame first (the
        # peer is normally reading it), within a short budget shared by all peers; else it just sees EOF.
        budget_end = time.monotonic() + ABORT_BUDGET_S
        for peer in peers:
            with contextlib.suppress(OSError):
                out = peer.current_out
                if out is not None:
                    send_until(
                        peer.sock, memoryview(out.header)[out.sent :] if out.sent < HEADER_SIZE else b"", budget_end
                    )
                    send_until(peer.sock, out.payload[max(out.sent - HEADER_SIZE, 0) :], budget_end)
                    peer.current_out = None
                send_until(peer.sock, abort + message, budget_end)
            with contextlib.suppress(OSError):
                peer.sock.shutdown(socket.SHUT_WR)
        if peers:
            # Keep reading (and discarding) for a while so peers blocked sending to us get unblocked and reach
            # our ABORT frame instead of seeing a reset that would name us rather than the culprit; not a daemon,
            # and joined by close(): a process that exits sooner closes them unread, which resets them.
            drain = threading.Thread(target=drain_and_close, args=([p.sock for p in peers],), name="allreduce-drain")
            drain.start()
            self._drains.append(drain)


def _no_reduction(dst: npt.NDArray[Any], incoming: npt.NDArray[Any]) -> None:
    """The reducer of the agreement exchange, whose frames are never reduced."""
    raise AssertionError("agreement frames are not reduced")
