"""The TCP transport: executes compiled plans over one TCP connection per peer pair the schedule uses.

Data path. The calling thread drives every socket of a step with non-blocking calls and ``poll``: it sends each
frame (header and payload in one ``sendmsg``, straight from the user's buffer) while receiving the step's frames
into their destination: directly into the user's buffer for a copy, into a reusable per-peer window for a
reduction, which is reduced each time the window fills so reducing overlaps receiving and the data is still in
cache. A step sending at least ``_THREAD_MIN_BYTES`` hands its sends to the rank's sender thread instead, so the
rank copies out and copies in at once (socket calls and numpy release the GIL). Over loopback the send buffer is
kept small so the bytes in flight stay in cache between the kernel's two copies (see ``_tune``). Profiled at
N=2, 256 MiB (perf): the kernel's copies into and out of the sockets are most of the time, Python under 5%.

Plan semantics (see :mod:`allreduce.runtime._plan`): sends read the step-start state; a receive whose range is
also sent in the same step is staged in scratch and applied once the sends overlapping it have left.

Connections are made lazily, the first time a plan needs a peer: the higher rank connects to the lower one's
listening port (published in the store as ``<prefix>/addr/<rank>``), and an acceptor thread answers, so no two
ranks ever wait on each other to accept. Each frame's header is checked against the frame the receiver expects
next on that connection (sequence, step, block, segment, length, plan tag), so a mismatch names the peer and
the step.

Failures: a peer's EOF or reset raises :class:`PeerFailureError` naming it at once; a rank that fails sends an
ABORT frame naming the culprit to every peer (then drains and closes its sockets in the background so that no
peer stays blocked sending to it), so a death propagates along the schedule's connections in milliseconds.
After any error the transport is unusable.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from allreduce.runtime._errors import (
    ChecksumError,
    CollectiveError,
    CollectiveTimeoutError,
    MismatchError,
    PeerFailureError,
    ProtocolError,
)
from allreduce.runtime._plan import RankPlan
from allreduce.runtime._transport import ReduceInto
from allreduce.runtime._wire import (
    FLAG_ABORT,
    FLAG_AGREE,
    FLAG_CHECKSUM,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_ABORT_BYTES,
    VERSION,
    ClientHello,
    accept_handshake,
    connect_handshake,
    decode_header,
    encode_header,
    is_loopback,
    resolve_token,
)

__all__ = ["TcpTransport"]

_SERVICE = b"tcp"
_IO_CHUNK_BYTES = 1 << 20  # per send/recv call: keeps the loop alternating between peers
# A reduction is received into a small per-peer window and reduced each time the window fills: the window
# and the matching part of the user's buffer stay in L2 (1 MiB per core here), instead of streaming the whole
# piece through a scratch area as large as itself. A multiple of every itemsize.
_WINDOW_BYTES = 256 << 10
_MAX_AGREE_BYTES = 1 << 16
# A step sending at least this much hands its sends to the rank's sender thread (see _Sender); smaller steps
# run in the calling thread, where a hand-off would cost more than it saves.
_THREAD_MIN_BYTES = 1 << 20
_LOOPBACK_SNDBUF_BYTES = 256 << 10  # see _tune
_SENDER_POLL_S = 0.05  # how often a blocked sender thread looks for cancellation
_POLL_IN = select.POLLIN | select.POLLPRI
_POLL_ERR = select.POLLERR | select.POLLHUP | select.POLLNVAL

# ABORT frames carry the kind of error so the receiving ranks raise the same class.
_KINDS: tuple[type[CollectiveError], ...] = (
    PeerFailureError,
    CollectiveTimeoutError,
    MismatchError,
    ChecksumError,
    ProtocolError,
    CollectiveError,
)
_NO_CULPRIT = 0xFFFFFFFF


class _Store(Protocol):
    def set(self, key: str, value: bytes) -> None: ...
    def get(self, key: str, *, timeout_s: float | None = None) -> bytes: ...


# ---------------------------------------------------------------------------------------------- prepared plans


@dataclass(frozen=True, slots=True)
class _SendSpec:
    peer: int
    byte_start: int
    byte_stop: int
    block: int
    segment: int


@dataclass(frozen=True, slots=True)
class _RecvSpec:
    peer: int
    byte_start: int
    byte_stop: int
    block: int
    segment: int
    reduce: bool
    staged: bool  # its range is also sent in this step: land in scratch, apply after those sends
    windowed: bool  # a reduction received through a window (not staged, no checksum to verify first)
    scratch_offset: int  # where it lands in scratch (reductions and staged receives)
    blockers: tuple[int, ...]  # indices of this step's sends that read the range (staged only)


@dataclass(frozen=True, slots=True)
class _PreparedStep:
    index: int
    sends: tuple[_SendSpec, ...]
    recvs: tuple[_RecvSpec, ...]


@dataclass(frozen=True, slots=True)
class _Prepared:
    tag: int
    steps: tuple[_PreparedStep, ...]
    scratch_bytes: int


def _prepare(plan: RankPlan, itemsize: int, *, checksum: bool) -> _Prepared:
    tag = zlib.crc32(f"{plan.schedule_name}|{plan.world_size}|{plan.count}|{itemsize}".encode())
    steps = []
    scratch_bytes = 0
    for step in plan.steps:
        sends = tuple(_SendSpec(t.peer, t.start * itemsize, t.stop * itemsize, t.block, t.segment) for t in step.sends)
        recvs = []
        # Scratch layout: staged receives each own a region; other reductions reuse one region per peer (a
        # peer's receives complete one after another); copies land in the user's buffer.
        offset = 0
        peer_region: dict[int, int] = {}
        peer_size: dict[int, int] = {}
        for t in step.recvs:
            blockers = tuple(i for i, s in enumerate(step.sends) if s.start < t.stop and t.start < s.stop)
            staged = bool(blockers)
            size = t.count * itemsize
            if staged:
                where = offset
                offset += size
            elif t.reduce:
                # With checksum=True the whole piece is verified before it is reduced, so it needs full space.
                where = peer_region.setdefault(t.peer, -1)
                peer_size[t.peer] = max(peer_size.get(t.peer, 0), size if checksum else min(size, _WINDOW_BYTES))
            else:
                where = -1
            recvs.append(
                _RecvSpec(
                    t.peer,
                    t.start * itemsize,
                    t.stop * itemsize,
                    t.block,
                    t.segment,
                    t.reduce,
                    staged,
                    windowed=t.reduce and not staged and not checksum,
                    scratch_offset=where,
                    blockers=blockers,
                )
            )
        # Now place the per-peer regions after the staged ones.
        for peer in sorted(peer_size):
            peer_region[peer] = offset
            offset += peer_size[peer]
        recvs = [r if r.staged or not r.reduce else replace(r, scratch_offset=peer_region[r.peer]) for r in recvs]
        scratch_bytes = max(scratch_bytes, offset)
        steps.append(_PreparedStep(step.index, sends, tuple(recvs)))
    return _Prepared(tag, tuple(steps), scratch_bytes)


# ---------------------------------------------------------------------------------------------- per-call state


class _OutFrame:
    """A frame being sent: header then payload, resumed across non-blocking calls."""

    __slots__ = ("done", "header", "payload", "sent", "total")

    def __init__(self, header: bytes, payload: memoryview) -> None:
        self.header = header
        self.payload = payload
        self.sent = 0
        self.total = HEADER_SIZE + len(payload)
        self.done = False


class _InFrame:
    """A frame being received into ``dest``; ``apply`` runs when (part of) it may land in the user's buffer."""

    __slots__ = (
        "applied",
        "block",
        "crc",
        "dest",
        "dst_typed",
        "expect_crc",
        "fill",
        "flags",
        "got",
        "header_got",
        "length",
        "reduce",
        "reduced",
        "segment",
        "spec",
        "src_typed",
        "staged",
        "step",
        "windowed",
    )

    def __init__(self, *, step: int, block: int, segment: int, flags: int, length: int, dest: memoryview) -> None:
        self.step = step
        self.block = block
        self.segment = segment
        self.flags = flags
        self.length = length
        self.dest = dest
        self.got = 0
        self.header_got = 0
        self.crc = 0
        self.expect_crc = 0
        self.reduce = False
        self.staged = False
        self.applied = False
        self.reduced = 0  # elements of a windowed reduction already reduced
        self.fill = 0  # bytes in the window
        self.windowed = False
        self.spec: _RecvSpec | None = None
        self.dst_typed: npt.NDArray[Any] | None = None
        self.src_typed: npt.NDArray[Any] | None = None


class _Peer:
    """One authenticated connection to ``rank``, with its reusable header buffer."""

    __slots__ = ("current_out", "header_buf", "header_view", "rank", "sock")

    def __init__(self, rank: int, sock: socket.socket) -> None:
        self.rank = rank
        self.sock = sock
        self.header_buf = bytearray(HEADER_SIZE)
        self.header_view = memoryview(self.header_buf)
        self.current_out: _OutFrame | None = None  # a frame partly sent: finish it before an ABORT


class _Sender:
    """The rank's sender thread: sends one step's frames while the calling thread receives and reduces.

    Why a thread: on loopback the work is the kernel's copies (sender side and receiver side) plus the reduction,
    all of which release the GIL; with sends in their own thread, a rank copies out while it copies in and
    reduces, whenever a core is free. Measured at N=2, 256 MiB, same run, load average 9-12 on 2 cores: medians
    within 10% of sending from the calling thread either way, fastest runs 74-131 ms against 210 ms, and in some
    runs medians 1.45-1.85x lower.
    ``post`` hands over a step, ``wait`` returns when it is sent (or raises what the thread raised); the
    calling thread never touches the sockets' send side while a job runs.
    """

    def __init__(self, transport: TcpTransport) -> None:
        self._transport = transport
        self._cond = threading.Condition()
        self._job: tuple[list[tuple[int, _OutFrame]], int, str, float, float] | None = None
        self._busy = False
        self._error: BaseException | None = None
        self._cancelled = False
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=f"allreduce-tcp-send-{transport.rank}", daemon=True)
        self._thread.start()

    def post(self, sends: list[tuple[int, _OutFrame]], seq: int, label: str, deadline: float, timeout_s: float) -> None:
        with self._cond:
            self._job = (sends, seq, label, deadline, timeout_s)
            self._busy = True
            self._error = None
            self._cond.notify_all()

    @property
    def busy(self) -> bool:
        return self._busy

    def error(self) -> BaseException | None:
        return self._error

    def wait(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the posted step; raise the thread's error if it failed."""
        with self._cond:
            self._cond.wait_for(lambda: not self._busy, timeout_s)
            if self._error is not None:
                raise self._error

    def cancel(self) -> None:
        """Make a running job give up within ``_SENDER_POLL_S`` and wait for it (the caller then owns the sockets)."""
        with self._cond:
            self._cancelled = True
            self._cond.wait_for(lambda: not self._busy, 5.0)
            self._cancelled = False

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cancelled = True
            self._cond.notify_all()
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._job is not None or self._stopped)
                if self._stopped:
                    return
                job, self._job = self._job, None
            assert job is not None
            try:
                self._transport._send_all(*job, cancelled=lambda: self._cancelled)
            except BaseException as exc:  # handed to the calling thread by wait()
                self._error = exc
            with self._cond:
                self._busy = False
                self._cond.notify_all()


# ---------------------------------------------------------------------------------------------- transport


class TcpTransport:
    """Moves compiled plans' data over TCP; see the module docstring. Implements ``runtime.Transport``."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        store: _Store,
        *,
        host: str = "127.0.0.1",
        token: str | bytes | None = None,
        timeout_s: float = 300.0,
        advertise_host: str | None = None,
        prefix: str = "tcp",
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._store = store
        self._prefix = prefix
        self._token = resolve_token(token)
        if not is_loopback(host) and self._token is None:
            raise ValueError(
                f"rank {rank}: the TCP transport would listen on {host!r}, beyond loopback: set a shared token "
                "(token= or the ALLREDUCE_TOKEN environment variable)"
            )
        self._peers: dict[int, _Peer] = {}
        self._cond = threading.Condition()
        self._refused: list[str] = []
        self._failed: CollectiveError | None = None
        self._closed = False
        self._prepared: OrderedDict[tuple[RankPlan, int, bool], _Prepared] = OrderedDict()
        self._scratch = np.empty(0, np.uint8)
        self._sender: _Sender | None = None  # started by the first step large enough to use it
        # Test hook: (step, peer) of one outgoing frame whose payload is corrupted after its crc was computed.
        self._test_corrupt_frame: tuple[int, int] | None = None
        self._listener = socket.create_server(
            (host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET, backlog=max(128, world_size)
        )
        port = self._listener.getsockname()[1]
        if advertise_host is None:
            advertise_host = "127.0.0.1" if host in ("", "0.0.0.0") else host
        self._wake_r, self._wake_w = socket.socketpair()
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"allreduce-tcp-accept-{rank}", daemon=True)
        self._acceptor.start()
        store.set(f"{prefix}/addr/{rank}", f"{advertise_host}:{port}".encode())

    # -- connections
    def _accept_loop(self) -> None:
        poller = select.poll()
        poller.register(self._listener, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while not self._closed:
            ready = {fd for fd, _ in poller.poll()}
            if self._closed or self._wake_r.fileno() in ready:
                return
            try:
                sock, addr = self._listener.accept()
            except OSError:
                continue
            threading.Thread(target=self._handshake, args=(sock, addr), daemon=True).start()

    def _handshake(self, sock: socket.socket, addr: tuple[str, int]) -> None:
        try:
            sock.settimeout(10.0)
            hello = accept_handshake(sock, _SERVICE, self._token, self._check_hello)
        except (OSError, ProtocolError) as exc:
            with self._cond:
                self._refused.append(f"{addr[0]}:{addr[1]}: {exc}")
                self._cond.notify_all()
            sock.close()
            return
        _tune(sock)
        with self._cond:
            self._peers[hello.rank] = _Peer(hello.rank, sock)
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
        with self._cond:
            while not higher <= self._peers.keys():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(higher - self._peers.keys())
                    refused = f"; refused connections: {'; '.join(self._refused)}" if self._refused else ""
                    raise CollectiveTimeoutError(
                        f"rank {self.rank}: timed out waiting for rank(s) {', '.join(map(str, missing))} to connect "
                        f"({what}): they have not reached this collective, or cannot reach this host{refused}",
                        rank=self.rank,
                        peer=missing[0],
                    )
                self._cond.wait(remaining)

    def _connect(self, peer: int, deadline: float, what: str) -> None:
        remaining = max(deadline - time.monotonic(), 0.001)
        address = self._store.get(f"{self._prefix}/addr/{peer}", timeout_s=remaining).decode()
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
                sock = socket.create_connection((host.strip("[]"), int(port_text)), timeout=min(remaining, 10.0))
                break
            except ConnectionRefusedError as exc:  # its listener is published before we read it: a real failure
                raise PeerFailureError(
                    f"rank {self.rank}: rank {peer} refused a connection at {address} ({what}): it has exited",
                    rank=self.rank,
                    peer=peer,
                ) from exc
            except OSError as exc:
                last_error = exc
                time.sleep(0.05)
        try:
            sock.settimeout(max(min(deadline - time.monotonic(), 30.0), 1.0))
            connect_handshake(
                sock,
                _SERVICE,
                self._token,
                ClientHello(rank=self.rank, world_size=self.world_size, target=peer),
                what=f"rank {peer} at {address}",
            )
        except (OSError, EOFError) as exc:
            sock.close()
            raise PeerFailureError(
                f"rank {self.rank}: lost rank {peer} during the handshake ({what}): {exc}", rank=self.rank, peer=peer
            ) from exc
        except BaseException:
            sock.close()
            raise
        _tune(sock)
        with self._cond:
            self._peers[peer] = _Peer(peer, sock)

    # -- public API
    def agree(self, seq: int, descriptor: bytes, *, timeout_s: float) -> list[bytes]:
        """Every rank's descriptor, by rank: a ring all-gather of small AGREE frames (N-1 steps)."""
        self._check_usable()
        if len(descriptor) > _MAX_AGREE_BYTES:
            raise ValueError(f"descriptor of {len(descriptor)} bytes exceeds {_MAX_AGREE_BYTES}")
        result: list[bytes | None] = [None] * self.world_size
        result[self.rank] = bytes(descriptor)
        if self.world_size == 1:
            return [bytes(descriptor)]
        deadline = time.monotonic() + timeout_s
        nxt, prv = (self.rank + 1) % self.world_size, (self.rank - 1) % self.world_size
        try:
            self._ensure_connected({nxt, prv}, deadline, f"agreement for collective {seq}")
            for k in range(self.world_size - 1):
                origin_out = (self.rank - k) % self.world_size
                origin_in = (self.rank - k - 1) % self.world_size
                payload = result[origin_out]
                assert payload is not None
                out = _OutFrame(
                    encode_header(
                        sequence=seq, step=k, block=origin_out, segment=0, length=len(payload), flags=FLAG_AGREE
                    ),
                    memoryview(payload),
                )
                incoming = _InFrame(
                    step=k, block=origin_in, segment=0, flags=FLAG_AGREE, length=-1, dest=memoryview(b"")
                )
                self._exchange(
                    seq,
                    tag=0,
                    sends=[(nxt, out)],
                    recvs=[(prv, incoming)],
                    deadline=deadline,
                    timeout_s=timeout_s,
                    reduce_into=_no_reduction,
                    step=None,
                    label=f"agreement step {k}",
                    threaded=False,
                )
                result[origin_in] = bytes(incoming.dest)
        except BaseException as exc:
            self._fail(exc, seq)
            raise
        return [r if r is not None else b"" for r in result]

    def execute(
        self,
        plan: RankPlan,
        buffer: npt.NDArray[Any],
        reduce_into: ReduceInto,
        *,
        seq: int,
        timeout_s: float,
        checksum: bool,
    ) -> None:
        """Run ``plan`` on ``buffer`` (1-D, contiguous, ``plan.count`` elements) in place."""
        self._check_usable()
        plan.check_fits(self.rank, self.world_size, buffer)
        if not plan.steps:
            return
        key = (plan, buffer.itemsize, checksum)
        prepared = self._prepared.get(key)
        if prepared is None:
            prepared = self._prepared[key] = _prepare(plan, buffer.itemsize, checksum=checksum)
            if len(self._prepared) > 64:
                self._prepared.popitem(last=False)
        else:
            self._prepared.move_to_end(key)
        if self._scratch.size < prepared.scratch_bytes:
            self._scratch = np.empty(prepared.scratch_bytes, np.uint8)
        deadline = time.monotonic() + timeout_s
        raw = buffer.view(np.uint8).data
        scratch = self._scratch.data
        flags = FLAG_CHECKSUM if checksum else 0
        try:
            self._ensure_connected(plan.peers, deadline, f"collective {seq} ({plan.schedule_name})")
            for step in prepared.steps:
                sends = []
                for spec in step.sends:
                    payload = raw[spec.byte_start : spec.byte_stop]
                    crc = zlib.crc32(payload) if checksum else 0
                    if self._test_corrupt_frame == (step.index, spec.peer):
                        self._test_corrupt_frame = None
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
                    sends.append((spec.peer, _OutFrame(header, payload)))
                recvs = []
                for rspec in step.recvs:
                    length = rspec.byte_stop - rspec.byte_start
                    if rspec.scratch_offset >= 0:
                        room = min(length, _WINDOW_BYTES) if rspec.windowed else length
                        dest = scratch[rspec.scratch_offset : rspec.scratch_offset + room]
                    else:
                        dest = raw[rspec.byte_start : rspec.byte_stop]
                    frame = _InFrame(
                        step=step.index, block=rspec.block, segment=rspec.segment, flags=flags, length=length, dest=dest
                    )
                    frame.spec = rspec
                    frame.staged = rspec.staged
                    frame.reduce = rspec.reduce
                    frame.windowed = rspec.windowed
                    if rspec.scratch_offset >= 0:
                        e0, e1 = rspec.byte_start // buffer.itemsize, rspec.byte_stop // buffer.itemsize
                        frame.dst_typed = buffer[e0:e1]
                        frame.src_typed = self._scratch[rspec.scratch_offset : rspec.scratch_offset + len(dest)].view(
                            buffer.dtype
                        )
                    recvs.append((rspec.peer, frame))
                send_bytes = sum(len(out.payload) for _, out in sends)
                self._exchange(
                    seq,
                    tag=prepared.tag,
                    sends=sends,
                    recvs=recvs,
                    deadline=deadline,
                    timeout_s=timeout_s,
                    reduce_into=reduce_into,
                    step=step,
                    label=f"step {step.index}",
                    threaded=send_bytes >= _THREAD_MIN_BYTES,
                )
        except BaseException as exc:
            self._fail(exc, seq)
            raise

    def close(self) -> None:
        """Close every connection and the listener; idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._acceptor.join(timeout=10.0)
        if self._sender is not None:
            self._sender.stop()
        with self._cond:
            peers, self._peers = list(self._peers.values()), {}
        for peer in peers:
            peer.sock.close()
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()

    def __enter__(self) -> TcpTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the step loop
    def _exchange(
        self,
        seq: int,
        *,
        tag: int,
        sends: list[tuple[int, _OutFrame]],
        recvs: list[tuple[int, _InFrame]],
        deadline: float,
        timeout_s: float,
        reduce_into: ReduceInto,
        step: _PreparedStep | None,
        label: str,
        threaded: bool,
    ) -> None:
        """Send and receive one step's frames concurrently; apply staged receives; raise naming the culprit.

        ``threaded``: the sender thread sends while this thread receives, reduces and applies staged receives."""
        send_q: dict[int, list[_OutFrame]] = {}
        for peer, out in sends:
            send_q.setdefault(peer, []).append(out)
        recv_q: dict[int, list[_InFrame]] = {}
        for peer, inc in recvs:
            recv_q.setdefault(peer, []).append(inc)
        send_pos = dict.fromkeys(send_q, 0)
        recv_pos = dict.fromkeys(recv_q, 0)
        staged = [inc for _, inc in recvs if inc.staged]
        all_out = [out for _, out in sends]
        poller = select.poll()
        registered: dict[int, int] = {}
        fd_peer: dict[int, int] = {}
        sender: _Sender | None = None
        if threaded and sends:
            if self._sender is None:
                self._sender = _Sender(self)
            sender = self._sender
            sender.post(sends, seq, label, deadline, timeout_s)
            send_pos = {}
        while send_pos or recv_pos:
            if sender is not None and sender.error() is not None:
                sender.wait(0.0)
            progress = self._pump_sends(self._peers, send_q, send_pos, seq, label)
            for peer in list(recv_pos):
                conn = self._peers[peer]
                queue_in = recv_q[peer]
                i = recv_pos[peer]
                while i < len(queue_in):
                    moved = self._pump_recv(conn, queue_in[i], seq, tag=tag, reduce_into=reduce_into, label=label)
                    progress = progress or moved
                    if queue_in[i].got < queue_in[i].length or queue_in[i].length < 0:
                        break
                    i += 1
                if i == len(queue_in):
                    del recv_pos[peer]
                else:
                    recv_pos[peer] = i
            if staged:
                progress = self._apply_staged(staged, all_out, reduce_into) or progress
            if progress or not (send_pos or recv_pos):
                continue
            # Nothing moved: sleep in poll until a socket can, or the deadline.
            wanted: dict[int, int] = {}
            for peer in send_pos:
                wanted[self._peers[peer].sock.fileno()] = select.POLLOUT
                fd_peer[self._peers[peer].sock.fileno()] = peer
            for peer in recv_pos:
                fd = self._peers[peer].sock.fileno()
                wanted[fd] = wanted.get(fd, 0) | _POLL_IN
                fd_peer[fd] = peer
            for fd, events in wanted.items():
                if registered.get(fd) != events:
                    poller.register(fd, events)
                    registered[fd] = events
            for fd in [fd for fd in registered if fd not in wanted]:
                poller.unregister(fd)
                del registered[fd]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._raise_timeout(
                    seq, label=label, timeout_s=timeout_s, recv_pos=recv_pos, send_pos=send_pos, recv_q=recv_q
                )
            # With the sender thread running, wake now and then to pick up its failure.
            wait_s = min(remaining, _SENDER_POLL_S if sender is not None else 1.0)
            for fd, revents in poller.poll(wait_s * 1000.0):
                if revents & _POLL_ERR and not revents & (_POLL_IN | select.POLLOUT):
                    peer = fd_peer[fd]
                    raise PeerFailureError(
                        f"rank {self.rank}: the connection to rank {peer} broke at {label} of collective {seq} "
                        f"(rank {peer} died or aborted)",
                        rank=self.rank,
                        peer=peer,
                        step=step.index if step else None,
                    )
        if sender is not None:
            # The sender raises its own timeout at the deadline; the margin only covers its last poll.
            sender.wait(max(deadline - time.monotonic(), 0.0) + 1.0)
            if sender.busy:
                raise CollectiveTimeoutError(
                    f"rank {self.rank}: collective {seq} timed out at {label}: the sender thread did not finish",
                    rank=self.rank,
                )
        if staged:
            self._apply_staged(staged, all_out, reduce_into)

    def _pump_sends(
        self,
        conns: Mapping[int, _Peer],
        send_q: dict[int, list[_OutFrame]],
        send_pos: dict[int, int],
        seq: int,
        label: str,
    ) -> bool:
        """Push every peer's queued frames (from ``send_pos[peer]`` on, in order) as far as its socket takes them;
        drop the peers whose queue is done. Whether any byte moved."""
        progress = False
        for peer in list(send_pos):
            conn = conns[peer]
            queue = send_q[peer]
            i = send_pos[peer]
            while i < len(queue):
                progress = self._pump_send(conn, queue[i], seq, label) or progress
                if not queue[i].done:
                    break
                i += 1
            if i == len(queue):
                del send_pos[peer]
            else:
                send_pos[peer] = i
        return progress

    def _send_all(
        self,
        sends: list[tuple[int, _OutFrame]],
        seq: int,
        label: str,
        deadline: float,
        timeout_s: float,
        *,
        cancelled: Callable[[], bool],
    ) -> None:
        """Send every frame of ``sends`` (in order per peer), polling for room; runs in the sender thread."""
        send_q: dict[int, list[_OutFrame]] = {}
        for peer, out in sends:
            send_q.setdefault(peer, []).append(out)
        send_pos = dict.fromkeys(send_q, 0)
        conns = {peer: self._peers[peer] for peer in send_q}
        poller = select.poll()
        registered: set[int] = set()
        while send_pos and not cancelled():
            progress = self._pump_sends(conns, send_q, send_pos, seq, label)
            if progress or not send_pos:
                continue
            fd_peer = {conns[peer].sock.fileno(): peer for peer in send_pos}
            for fd in fd_peer.keys() - registered:
                poller.register(fd, select.POLLOUT)
            for fd in registered - fd_peer.keys():
                poller.unregister(fd)
            registered = set(fd_peer)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                blocked = sorted(send_pos)
                raise CollectiveTimeoutError(
                    f"rank {self.rank}: collective {seq} timed out after {timeout_s:g} s at {label}: rank(s) "
                    f"{', '.join(map(str, blocked))} not receiving what this rank sends",
                    rank=self.rank,
                    peer=blocked[0],
                )
            for fd, revents in poller.poll(min(remaining, _SENDER_POLL_S) * 1000.0):
                if revents & _POLL_ERR and not revents & select.POLLOUT:
                    peer = fd_peer[fd]
                    raise PeerFailureError(
                        f"rank {self.rank}: the connection to rank {peer} broke at {label} of collective {seq} "
                        f"(rank {peer} died or aborted)",
                        rank=self.rank,
                        peer=peer,
                    )

    def _pump_send(self, conn: _Peer, out: _OutFrame, seq: int, label: str) -> bool:
        try:
            if out.sent < HEADER_SIZE:
                chunk = out.payload[:_IO_CHUNK_BYTES]
                n = conn.sock.sendmsg([memoryview(out.header)[out.sent :], chunk])
            else:
                start = out.sent - HEADER_SIZE
                n = conn.sock.send(out.payload[start : start + _IO_CHUNK_BYTES])
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            raise PeerFailureError(
                f"rank {self.rank}: lost rank {conn.rank} while sending at {label} of collective {seq} "
                f"({exc.strerror or exc}): rank {conn.rank} died or aborted",
                rank=self.rank,
                peer=conn.rank,
            ) from exc
        out.sent += n
        out.done = out.sent == out.total
        conn.current_out = None if out.done else out
        return n > 0

    def _pump_recv(
        self, conn: _Peer, inc: _InFrame, seq: int, *, tag: int, reduce_into: ReduceInto, label: str
    ) -> bool:
        moved = False
        try:
            if inc.header_got < HEADER_SIZE:
                n = conn.sock.recv_into(conn.header_view[inc.header_got :])
                if n == 0:
                    self._raise_eof(conn, seq, label)
                inc.header_got += n
                moved = True
                if inc.header_got < HEADER_SIZE:
                    return True
                self._check_header(conn, inc, seq, tag, label)
                if inc.length == 0:
                    self._finish_frame(conn, inc, seq, reduce_into, label)
                    return True
            if inc.windowed:
                n = conn.sock.recv_into(inc.dest[inc.fill :], min(len(inc.dest) - inc.fill, inc.length - inc.got))
            else:
                n = conn.sock.recv_into(inc.dest[inc.got :], min(inc.length - inc.got, _IO_CHUNK_BYTES))
        except (BlockingIOError, InterruptedError):
            return moved
        except ConnectionError as exc:
            raise PeerFailureError(
                f"rank {self.rank}: lost rank {conn.rank} while receiving at {label} of collective {seq} "
                f"({exc.strerror or exc}): rank {conn.rank} died or aborted",
                rank=self.rank,
                peer=conn.rank,
            ) from exc
        if n == 0:
            self._raise_eof(conn, seq, label)
        if inc.flags & FLAG_CHECKSUM:
            inc.crc = zlib.crc32(inc.dest[inc.got : inc.got + n], inc.crc)
        inc.got += n
        if inc.windowed:
            inc.fill += n
            if inc.fill == len(inc.dest) or inc.got == inc.length:
                # The window holds whole elements here: its size and the frame's length are multiples of itemsize.
                assert inc.dst_typed is not None
                assert inc.src_typed is not None
                k = inc.fill // inc.dst_typed.itemsize
                reduce_into(inc.dst_typed[inc.reduced : inc.reduced + k], inc.src_typed[:k])
                inc.reduced += k
                inc.fill = 0
        if inc.got == inc.length:
            self._finish_frame(conn, inc, seq, reduce_into, label)
        return True

    def _finish_frame(self, conn: _Peer, inc: _InFrame, seq: int, reduce_into: ReduceInto, label: str) -> None:
        if inc.flags & FLAG_CHECKSUM and inc.crc != inc.expect_crc:
            raise ChecksumError(
                f"rank {self.rank}: corrupted data on link rank {conn.rank} -> rank {self.rank} at {label}, block "
                f"{inc.block}, segment {inc.segment} of collective {seq}: crc32 {inc.crc:#010x}, sender said "
                f"{inc.expect_crc:#010x}",
                rank=self.rank,
                peer=conn.rank,
                step=inc.step,
            )
        if inc.staged or inc.flags & FLAG_AGREE:
            return
        if inc.reduce and not inc.windowed:  # verified by its checksum: now reduce it whole
            assert inc.dst_typed is not None
            assert inc.src_typed is not None
            reduce_into(inc.dst_typed, inc.src_typed)
        inc.applied = True

    def _apply_staged(self, staged: list[_InFrame], sends: list[_OutFrame], reduce_into: ReduceInto) -> bool:
        moved = False
        for inc in staged:
            if inc.applied or inc.header_got < HEADER_SIZE or inc.got < inc.length:
                continue
            assert inc.spec is not None
            if not all(sends[i].done for i in inc.spec.blockers):
                continue
            assert inc.dst_typed is not None
            assert inc.src_typed is not None
            if inc.reduce:
                reduce_into(inc.dst_typed, inc.src_typed)
            else:
                np.copyto(inc.dst_typed, inc.src_typed)
            inc.applied = True
            moved = True
        return moved

    def _check_header(self, conn: _Peer, inc: _InFrame, seq: int, tag: int, label: str) -> None:
        magic, version, flags, f_seq, f_step, f_block, f_segment, length, crc, f_tag, header_crc = HEADER.unpack(
            conn.header_buf
        )
        if (
            magic == MAGIC
            and version == VERSION
            and flags == inc.flags
            and f_seq == seq
            and f_step == inc.step
            and f_block == inc.block
            and f_segment == inc.segment
            and (length == inc.length or inc.length < 0)
            and f_tag == tag
            and header_crc == zlib.crc32(conn.header_view[: HEADER_SIZE - 4])
        ):
            inc.expect_crc = crc
            if inc.length < 0:  # an agreement frame: its length is the descriptor's
                if length > _MAX_AGREE_BYTES:
                    raise ProtocolError(
                        f"rank {self.rank}: rank {conn.rank} sent a {length}-byte descriptor (max {_MAX_AGREE_BYTES})",
                        rank=self.rank,
                        peer=conn.rank,
                    )
                inc.length = length
                inc.dest = memoryview(bytearray(length))
            return
        try:
            header = decode_header(conn.header_buf)
        except ProtocolError as exc:
            raise ProtocolError(
                f"rank {self.rank}: bad frame from rank {conn.rank} at {label} of collective {seq}: {exc}",
                rank=self.rank,
                peer=conn.rank,
                step=inc.step,
            ) from exc
        if header.flags & FLAG_ABORT:
            self._raise_remote_abort(conn, header.block, header.segment, header.length, seq)
        expected = (
            f"collective {seq}, step {inc.step}, block {inc.block}, segment {inc.segment}, "
            f"{inc.length if inc.length >= 0 else 'any'} bytes"
        )
        got = (
            f"collective {header.sequence}, step {header.step}, block {header.block}, segment {header.segment}, "
            f"{header.length} bytes"
        )
        if header.tag != tag and not inc.flags & FLAG_AGREE:
            raise MismatchError(
                f"rank {self.rank}: rank {conn.rank} runs a different plan (schedule, size or dtype) at {label} of "
                f"collective {seq}: expected {expected}, got {got}",
                rank=self.rank,
                peer=conn.rank,
                step=inc.step,
            )
        if (header.flags ^ inc.flags) & FLAG_CHECKSUM:
            raise MismatchError(
                f"rank {self.rank}: rank {conn.rank} {'uses' if header.checksum else 'does not use'} checksum=True "
                f"and this rank {'does not' if header.checksum else 'does'} (collective {seq})",
                rank=self.rank,
                peer=conn.rank,
                step=inc.step,
            )
        raise MismatchError(
            f"rank {self.rank}: unexpected frame from rank {conn.rank} at {label}: expected {expected}, got {got}",
            rank=self.rank,
            peer=conn.rank,
            step=inc.step,
        )

    def _raise_remote_abort(self, conn: _Peer, culprit: int, kind: int, length: int, seq: int) -> None:
        message = _read_exact(conn.sock, length, time.monotonic() + 5.0).decode(errors="replace")
        cls = _KINDS[kind] if kind < len(_KINDS) else CollectiveError
        raise cls(
            f"rank {self.rank}: rank {conn.rank} aborted collective {seq}: {message}",
            rank=self.rank,
            peer=None if culprit == _NO_CULPRIT else culprit,
        )

    def _raise_eof(self, conn: _Peer, seq: int, label: str) -> None:
        raise PeerFailureError(
            f"rank {self.rank}: rank {conn.rank} closed its connection at {label} of collective {seq} "
            f"(rank {conn.rank} died or aborted)",
            rank=self.rank,
            peer=conn.rank,
        )

    def _raise_timeout(
        self,
        seq: int,
        *,
        label: str,
        timeout_s: float,
        recv_pos: dict[int, int],
        send_pos: dict[int, int],
        recv_q: dict[int, list[_InFrame]],
    ) -> None:
        waiting = sorted(recv_pos)
        blocked = sorted(send_pos)
        parts = []
        if waiting:
            details = ", ".join(
                f"rank {p} (block {recv_q[p][recv_pos[p]].block}, segment {recv_q[p][recv_pos[p]].segment})"
                for p in waiting
            )
            parts.append(f"waiting for data from {details}")
        if blocked:
            parts.append(f"rank(s) {', '.join(map(str, blocked))} not receiving what this rank sends")
        raise CollectiveTimeoutError(
            f"rank {self.rank}: collective {seq} timed out after {timeout_s:g} s at {label}: {'; '.join(parts)}",
            rank=self.rank,
            peer=(waiting or blocked)[0],
        )

    # -- failure handling
    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError(f"rank {self.rank}: the TCP transport is closed")
        if self._failed is not None:
            raise type(self._failed)(
                f"rank {self.rank}: the TCP transport is unusable after an earlier failure: {self._failed}",
                rank=self.rank,
                peer=self._failed.peer,
                step=self._failed.step,
            )

    def _fail(self, exc: BaseException, seq: int) -> None:
        """Remember the failure, tell every peer (ABORT naming the culprit), and drop the connections."""
        if self._sender is not None and self._sender.busy:
            self._sender.cancel()  # from here on this thread alone writes to the sockets
        if isinstance(exc, CollectiveError):
            self._failed = exc
            culprit = exc.peer
            kind = next(i for i, cls in enumerate(_KINDS) if isinstance(exc, cls))
        else:
            self._failed = CollectiveError(f"interrupted: {type(exc).__name__}: {exc}", rank=self.rank)
            culprit = self.rank
            kind = len(_KINDS) - 1
        message = str(self._failed).encode()[:MAX_ABORT_BYTES]
        with self._cond:
            peers, self._peers = list(self._peers.values()), {}
        abort = encode_header(
            sequence=seq,
            step=0,
            block=_NO_CULPRIT if culprit is None else culprit,
            segment=kind,
            length=len(message),
            flags=FLAG_ABORT,
        )
        # A peer reading our half-sent frame would see the ABORT header as payload: finish that frame first (the
        # peer is normally reading it), within a short budget shared by all peers; else it just sees EOF.
        budget_end = time.monotonic() + 2.0
        for peer in peers:
            with contextlib.suppress(OSError):
                out = peer.current_out
                if out is not None:
                    _send_until(
                        peer.sock, memoryview(out.header)[out.sent :] if out.sent < HEADER_SIZE else b"", budget_end
                    )
                    _send_until(peer.sock, out.payload[max(out.sent - HEADER_SIZE, 0) :], budget_end)
                    peer.current_out = None
                _send_until(peer.sock, abort + message, budget_end)
            with contextlib.suppress(OSError):
                peer.sock.shutdown(socket.SHUT_WR)
        if peers:
            # Keep reading (and discarding) for a few seconds so peers blocked sending to us get unblocked and
            # reach our ABORT frame instead of seeing a reset that would name us rather than the culprit.
            threading.Thread(target=_drain_and_close, args=([p.sock for p in peers],), daemon=True).start()


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        peer_host = sock.getpeername()[0]
    except OSError:  # the peer is already gone: the first read or write will name it
        peer_host = ""
    if is_loopback(peer_host):
        # Over loopback the bytes in flight are copied twice by the CPU (into the socket, out of it): a small
        # send buffer keeps them in cache between the two copies. Measured at N=2, 256 MiB on 2 cores: 256 KiB
        # took 60 ms of CPU per rank against 87 ms with autotuning (which grows to 4 MiB), and 1.5-2.5x less
        # wall time; 128 KiB and 512 KiB were slower. Across a real network the buffer must cover the
        # bandwidth-delay product, so there the kernel's autotuning stays.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _LOOPBACK_SNDBUF_BYTES)
    sock.setblocking(False)


def _read_exact(sock: socket.socket, size: int, deadline: float) -> bytes:
    buf = bytearray()
    while len(buf) < size and time.monotonic() < deadline:
        try:
            chunk = sock.recv(size - len(buf))
        except (BlockingIOError, InterruptedError):
            _wait_readable([sock], deadline)
            continue
        except OSError:
            break
        if not chunk:
            break
        buf += chunk
    return bytes(buf)


def _drain_and_close(socks: list[socket.socket], linger_s: float = 5.0) -> None:
    deadline = time.monotonic() + linger_s
    open_socks = list(socks)
    sink = bytearray(1 << 16)
    for sock in open_socks:
        with contextlib.suppress(OSError):
            sock.setblocking(False)
    while open_socks and time.monotonic() < deadline:
        for sock in _wait_readable(open_socks, deadline):
            try:
                n = sock.recv_into(sink)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                n = 0
            if n == 0:
                open_socks.remove(sock)
                sock.close()
    for sock in open_socks:
        sock.close()


def _wait_readable(socks: list[socket.socket], deadline: float) -> list[socket.socket]:
    """The sockets of ``socks`` readable before ``deadline`` (poll: file descriptors may exceed 1024)."""
    poller = select.poll()
    by_fd = {}
    for sock in socks:
        with contextlib.suppress(OSError, ValueError):
            poller.register(sock, _POLL_IN)
            by_fd[sock.fileno()] = sock
    events = poller.poll(max(deadline - time.monotonic(), 0.0) * 1000.0)
    return [by_fd[fd] for fd, _ in events if fd in by_fd]


def _send_until(sock: socket.socket, data: bytes | memoryview, deadline: float) -> None:
    """Send all of ``data`` before ``deadline`` on a non-blocking socket, else raise TimeoutError."""
    view = memoryview(data).cast("B")
    poller = select.poll()
    poller.register(sock, select.POLLOUT)
    while view:
        try:
            view = view[sock.send(view[:_IO_CHUNK_BYTES]) :]
        except (BlockingIOError, InterruptedError):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("peer not reading") from None
            poller.poll(remaining * 1000.0)


def _no_reduction(dst: npt.NDArray[Any], incoming: npt.NDArray[Any]) -> None:
    """The reducer of the agreement exchange, whose frames are never reduced."""
    raise AssertionError("agreement frames are not reduced")
