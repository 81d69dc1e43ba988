"""A rank's point-to-point channels: a listener for its peers' messages, a connection to each peer it sends to.

The sender of each ordered pair connects, the first time it sends there: it reads the receiver's address from the
group's store (``p2p/<epoch>/addr/<rank>``, published when the receiver made its first point-to-point call),
connects and runs the TCP transport's authenticated handshake (service ``p2p``); the receiver's :class:`Listener`
answers and hands the connection to its :class:`~._inbox.Inbox`. The listener binds to loopback when every rank
of the group is on this host; across hosts it binds to the interface that reaches the store's host and every
peer must present the shared token (``ALLREDUCE_TOKEN``). On loopback without a token the group's secret (which
the store hands only to the ranks it admitted) authenticates the peers, as for the TCP transport.

Each message is one frame of the TCP transport (:mod:`allreduce.runtime.tcp._frames`, one writer and one decoder
for the format): ``sequence`` counts the messages of the pair and tag, ``step`` is the dtype's code
(:data:`~._inbox.DTYPE_NAMES`), ``tag`` the caller's tag, ``length`` the payload's bytes; the other fields are 0.
Sends to one peer go out in call order (asynchronous ones on a worker thread of that peer's channel).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any

import numpy as np

from allreduce.runtime._args import integer_arg, rank_arg
from allreduce.runtime._errors import CollectiveError, CollectiveTimeoutError, PeerFailureError, ProtocolError
from allreduce.runtime._store_api import Store
from allreduce.runtime.p2p._inbox import DEAD_POLL_S, DTYPE_NAMES, Inbox, Receive
from allreduce.runtime.pipeline._buffers import Buffer, as_buffer
from allreduce.runtime.pipeline._work import OrderedExecutor, Work
from allreduce.runtime.tcp._frames import encode_header
from allreduce.runtime.tcp._handshake import ClientHello, connect_handshake, resolve_token
from allreduce.runtime.tcp._listener import Listener, listening_socket
from allreduce.runtime.tcp._socket import advertised_host, send_until

__all__ = ["MAX_TAG", "PointToPoint"]

MAX_TAG = (1 << 32) - 1
"""The largest tag a message may carry (the frame's 32-bit field)."""

_SERVICE = b"p2p"
_ONE_SEGMENT_BYTES = 64 << 10  # a message up to this size leaves in one write, header and payload together
_LOOKUP_POLL_S = 0.02  # between looks at the store for a receiver's address (no request holds the store meanwhile)


def _check_dtype(dtype: np.dtype[Any], what: str) -> None:
    if dtype.name not in DTYPE_NAMES:
        raise TypeError(f"{what}: unsupported dtype {dtype}; supported: {', '.join(DTYPE_NAMES)}")


class _Channel:
    """The connection to one peer this rank sends to, made on the first send."""

    def __init__(self, dst: int) -> None:
        self.dst = dst
        self.sock: socket.socket | None = None
        self.sequence: dict[int, int] = {}  # per tag: the number of the next message
        self.broken: CollectiveError | None = None  # a send failed part-way: the stream is out of step for good
        self.executor = OrderedExecutor(f"allreduce-p2p-send-{dst}")


class PointToPoint:
    """The point-to-point channels of rank ``rank`` of a group whose ``store`` every rank shares; ``epoch`` keeps
    the keys of successive groups on one store apart (a shrunk or grown group is another epoch)."""

    def __init__(self, rank: int, world_size: int, store: Store, *, epoch: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self._store = store
        self._prefix = f"p2p/{epoch}"
        host, self._token = _where_to_listen(store, rank, world_size)
        self._lock = threading.Lock()
        self._channels: dict[int, _Channel] = {}
        self._closed = False
        self.inbox = Inbox(rank, world_size, store.dead_ranks)
        try:
            sock = listening_socket(host, backlog=world_size)
        except BaseException:
            self.inbox.close()
            raise
        self._listener = Listener(
            sock, service=_SERVICE, token=self._token, check=self._check_hello, accepted=self._accepted,
            refused=_ignore_refusal, name=f"allreduce-p2p-{rank}",
        )  # fmt: skip
        try:
            store.set(f"{self._prefix}/addr/{rank}", f"{host}:{self._listener.port}".encode())
        except BaseException:
            self._listener.close()
            self.inbox.close()
            raise

    # ------------------------------------------------------------------------------------------ calls
    def isend(self, x: Any, dst: Any, tag: Any, *, timeout_s: float, async_op: bool) -> Work | None:
        """Send ``x`` to ``dst``: a :class:`Work` if ``async_op``, else once the bytes are handed to the kernel."""
        dst = rank_arg(dst, "dst", self.world_size)
        tag = _tag_arg(tag)
        buffer = as_buffer(x, "send", check=_check_dtype, writable=False)
        what = f"send to rank {dst} (tag {tag})"
        if dst == self.rank:  # to itself: straight into the inbox
            self.inbox.deliver(self.rank, tag, buffer.flat.dtype.name, buffer.flat.tobytes())
            return _done(what, None) if async_op else None
        with self._lock:
            self._check_open(what)
            channel = self._channels.get(dst) or self._channels.setdefault(dst, _Channel(dst))
        deadline = time.monotonic() + timeout_s

        def send() -> None:
            self._send(channel, buffer, tag, deadline=deadline, timeout_s=timeout_s, what=what)

        if async_op and buffer.flat.nbytes <= _ONE_SEGMENT_BYTES and channel.executor.enter():
            # A small message fits the connection's buffer (the peer reads at once): sent here, it skips a hand-off
            # to the channel's worker thread, which is most of a small message's latency.
            try:
                send()
            except CollectiveError as exc:
                return _done(what, exc)
            finally:
                channel.executor.leave()
            return _done(what, None)
        result: Work | None = channel.executor.run(send, async_op=async_op, describe=lambda: what)
        return result

    def irecv(self, x: Any, src: Any, tag: Any, *, timeout_s: float) -> Work:
        """Post a receive into ``x`` from ``src`` (None: any rank); its work's result is the source rank."""
        src = None if src is None else rank_arg(src, "src", self.world_size)
        receive = Receive(as_buffer(x, "recv", check=_check_dtype), src, _tag_arg(tag), timeout_s)
        with self._lock:
            self._check_open(receive.what)
        return self.inbox.post(receive)

    def close(self) -> None:
        """Finish the sends under way, fail the receives that wait, close every connection."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            channels = list(self._channels.values())
        self._listener.close()
        for channel in channels:
            channel.executor.close()
            if channel.sock is not None:
                channel.sock.close()
        self.inbox.close()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise CollectiveError(f"rank {self.rank}: {what}: the group is closed", rank=self.rank)

    # ------------------------------------------------------------------------------------------ sending
    def _send(
        self, channel: _Channel, buffer: Buffer, tag: int, *, deadline: float, timeout_s: float, what: str
    ) -> None:
        dst = channel.dst
        if channel.broken is not None:
            raise type(channel.broken)(
                f"rank {self.rank}: {what}: an earlier send to rank {dst} failed: {channel.broken}",
                rank=self.rank,
                peer=dst,
            )
        if channel.sock is None:
            channel.sock = self._connect(dst, deadline, timeout_s, what)
        sequence = channel.sequence.get(tag, 0)
        payload = buffer.flat.view(np.uint8)
        header = encode_header(
            sequence=sequence, step=DTYPE_NAMES.index(buffer.flat.dtype.name), block=0, segment=0,
            length=payload.nbytes, tag=tag,
        )  # fmt: skip
        try:
            if payload.nbytes <= _ONE_SEGMENT_BYTES:
                send_until(channel.sock, header + payload.tobytes(), deadline)
            else:
                send_until(channel.sock, header, deadline)
                send_until(channel.sock, payload.data, deadline)
        except OSError as exc:  # TimeoutError included: either way the stream is out of step for good
            stalled = isinstance(exc, TimeoutError)
            kind = CollectiveTimeoutError if stalled else PeerFailureError
            why = f"took nothing for {timeout_s:g} s (stalled)" if stalled else f"is gone ({exc}): it died, or left"
            channel.broken = kind(f"rank {self.rank}: {what}: rank {dst} {why}", rank=self.rank, peer=dst)
            raise channel.broken from exc
        channel.sequence[tag] = sequence + 1

    def _connect(self, dst: int, deadline: float, timeout_s: float, what: str) -> socket.socket:
        address = self._address_of(dst, deadline, timeout_s, what)
        host, _, port = address.rpartition(":")
        try:
            sock = socket.create_connection((host.strip("[]"), int(port)), timeout=max(deadline - time.monotonic(), 1))
        except OSError as exc:  # its listener is published before we read it: refused means it has exited
            raise PeerFailureError(
                f"rank {self.rank}: {what}: cannot reach rank {dst} at {address} ({exc}): it exited?",
                rank=self.rank,
                peer=dst,
            ) from exc
        try:
            hello = ClientHello(rank=self.rank, world_size=self.world_size, target=dst)
            connect_handshake(sock, _SERVICE, self._token, hello, what=f"rank {dst} at {address}")
        except (OSError, EOFError, ProtocolError) as exc:
            sock.close()
            kind = ProtocolError if isinstance(exc, ProtocolError) else PeerFailureError
            raise kind(
                f"rank {self.rank}: {what}: handshake with rank {dst} failed: {exc}", rank=self.rank, peer=dst
            ) from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        return sock

    def _address_of(self, dst: int, deadline: float, timeout_s: float, what: str) -> str:
        """Where ``dst`` listens, once it has made its first point-to-point call. Polled, not waited for: a wait
        would hold this rank's one store connection, which the collectives use too."""
        key = f"{self._prefix}/addr/{dst}"
        next_dead_check = 0.0
        while not self._store.check([key]):
            self._check_open(what)  # a send still waiting when the group closes gives up at once
            now = time.monotonic()
            if now >= deadline:
                raise CollectiveTimeoutError(
                    f"rank {self.rank}: {what}: rank {dst} made no point-to-point call (send or receive) within "
                    f"{timeout_s:g} s, so it takes no messages yet",
                    rank=self.rank,
                    peer=dst,
                )
            if now >= next_dead_check:
                next_dead_check = now + DEAD_POLL_S
                if dst in self._store.dead_ranks():
                    raise PeerFailureError(f"rank {self.rank}: {what}: rank {dst} died", rank=self.rank, peer=dst)
            time.sleep(_LOOKUP_POLL_S)
        return self._store.get(key).decode()

    # ------------------------------------------------------------------------------------------ accepting
    def _check_hello(self, hello: ClientHello) -> str | None:
        if hello.world_size != self.world_size:
            return f"world size mismatch: rank {self.rank} has {self.world_size}, rank {hello.rank} {hello.world_size}"
        if hello.target != self.rank or not 0 <= hello.rank < self.world_size or hello.rank == self.rank:
            return f"rank {hello.rank} meant to reach rank {hello.target}, this is rank {self.rank}"
        return None

    def _accepted(self, sock: socket.socket, hello: ClientHello, address: str) -> None:
        if self.inbox.read(hello.rank, sock) is not None:  # a second connection claiming that rank, or closing
            sock.close()


def _done(what: str, error: CollectiveError | None) -> Work:
    """The work of a send that has finished (``error``: how it failed)."""
    work = Work(what)
    work._finish(None, error)
    return work


def _ignore_refusal(address: str, error: BaseException, admitted: ClientHello | None) -> None:
    """A refused connection is not a rank of the group (those pass the handshake): nothing waits on it."""


def _tag_arg(tag: Any) -> int:
    value = integer_arg(tag, "tag")
    if not 0 <= value <= MAX_TAG:
        raise ValueError(f"tag: {value} is not in 0..{MAX_TAG}")
    return value


def _where_to_listen(store: Store, rank: int, world_size: int) -> tuple[str, bytes | None]:
    """The address to listen on and the secret peers prove they know: loopback and the group's secret (or the
    shared token) when every rank is on this host, else the interface that reaches the store's host and the
    shared token, which is then required."""
    hosts = {bytes(store.get(f"allreduce/host/{r}")) for r in range(world_size)}
    token = resolve_token(None)
    if len(hosts) <= 1:
        return "127.0.0.1", token or resolve_token(store.group_secret())
    if token is None:
        raise ValueError(
            f"rank {rank}: point-to-point between hosts listens beyond loopback: set a shared token "
            "(the ALLREDUCE_TOKEN environment variable, the same on every rank)"
        )
    with contextlib.suppress(AttributeError):
        return advertised_host(str(store.host)), token  # type: ignore[attr-defined]
    return socket.gethostname(), token
