"""A rank's incoming point-to-point messages matched to its receives, as MPI and Gloo match them.

Receives are *posted* in call order; each peer's messages arrive on that peer's connection in send order, read
by a thread of their own as soon as they come (so a sender never waits for its receiver to call ``recv``). A
message goes to the first posted receive of its source (or of any source) and tag; one that no receive waits for
yet is kept (*unexpected*) until one is posted. So the k-th send from rank s with tag t meets the k-th receive
from s (or from any source) with tag t, whatever other tags and peers come between.

A message is checked against its receive (dtype and element count) before a byte lands in the caller's buffer:
a mismatch fails the receive naming the peer, the tag and both shapes, and the message is consumed (the
connection stays in step). A receive fails, never hangs: at its deadline (:class:`CollectiveTimeoutError`), when
its peer's connection ends or the store reports the peer dead (:class:`PeerFailureError`), when a peer's header
is malformed (:class:`ProtocolError`), or when the group closes. A watchdog thread keeps the deadlines.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable

import numpy as np

from allreduce.runtime._errors import CollectiveError, CollectiveTimeoutError, PeerFailureError, ProtocolError
from allreduce.runtime.pipeline._buffers import Buffer
from allreduce.runtime.pipeline._work import Work
from allreduce.runtime.tcp._frames import HEADER_SIZE, decode_header

__all__ = ["DEAD_POLL_S", "DTYPE_NAMES", "Inbox", "Receive", "shape"]

DEAD_POLL_S = 0.5
"""How often, while a receive waits on a peer that has not connected, the watchdog asks the store which ranks
died (one small request): a peer that dies before it ever sends is named within this, not at the timeout."""

DTYPE_NAMES = (
    "float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64", "bool", "complex64", "complex128",
)  # fmt: skip
"""The element types a message may hold; a header carries a dtype as its position here."""

UNEXPECTED_LIMIT_BYTES = 256 << 20
"""Per peer, the bytes of messages no receive waits for yet that are kept. Beyond it (a message larger than the
limit is kept alone) the peer's reader stops reading its connection until a receive takes one: the sender's kernel
buffers fill and its sends wait, as a rendezvous protocol's do, so a sender nobody receives from cannot grow this
rank's memory without bound."""

_CHUNK_BYTES = 1 << 20  # what a kept message's memory starts at and grows by at least (doubling)
_JOIN_S = 5.0  # how long close() waits for each thread (they wake at once: sockets shut down, condition notified)


_ITEMSIZES = {name: 2 if name == "bfloat16" else np.dtype(name).itemsize for name in DTYPE_NAMES}
# (bfloat16 is 2 bytes; naming it here keeps ml_dtypes, slow to import, out of `import allreduce`)


def shape(dtype: str, count: int) -> str:
    """``count`` elements of ``dtype``, as errors describe a message or a receive."""
    return f"{count} {dtype} element{'s' * (count != 1)} ({count * _ITEMSIZES[dtype]} bytes)"


class Receive:
    """One receive: into ``buffer`` (``flat`` is where bytes land), from ``src`` (None: any rank) with ``tag``."""

    __slots__ = ("buffer", "count", "deadline", "dtype", "src", "tag", "timeout_s", "what", "work")

    def __init__(self, buffer: Buffer, src: int | None, tag: int, timeout_s: float) -> None:
        self.buffer = buffer
        self.dtype = buffer.flat.dtype.name
        self.count = int(buffer.flat.size)
        self.src = src
        self.tag = tag
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.what = f"recv from {'any rank' if src is None else f'rank {src}'} (tag {tag})"
        self.work = Work(self.what)

    def matches(self, src: int, tag: int) -> bool:
        return tag == self.tag and self.src in (None, src)


class _Message:
    """A message no receive waited for when it arrived."""

    __slots__ = ("count", "dtype", "payload", "src", "tag")

    def __init__(self, src: int, tag: int, dtype: str, count: int, payload: bytes | bytearray) -> None:
        self.src, self.tag, self.dtype, self.count, self.payload = src, tag, dtype, count, payload


Finish = tuple[Receive, int | None, CollectiveError | None]  # a receive to complete: with its source, or an error


class Inbox:
    """The receives and unexpected messages of rank ``rank``; ``dead_ranks()`` asks the store (None: no store)."""

    def __init__(self, rank: int, world_size: int, dead_ranks: Callable[[], list[int]] | None) -> None:
        self.rank = rank
        self._world_size = world_size
        self._dead_ranks = dead_ranks
        self._cond = threading.Condition()
        self._posted: list[Receive] = []
        self._unexpected: list[_Message] = []
        self._readers: dict[int, tuple[socket.socket, threading.Thread]] = {}
        self._claimed: dict[int, Receive] = {}  # per source: the receive its reader is filling
        self._aborted: dict[int, CollectiveError] = {}  # per source: why the watchdog cut its connection
        self._gone: dict[int, CollectiveError] = {}  # per source: why no more messages come from it
        self._closed = False
        self._wake_at = 0.0  # when the watchdog wakes next (time.monotonic())
        self._watchdog = threading.Thread(target=self._watch, name=f"allreduce-p2p-watch-{rank}", daemon=True)
        self._watchdog.start()

    # ------------------------------------------------------------------------------------------ receives
    def post(self, receive: Receive) -> Work:
        """Match ``receive`` with a message kept, or wait for one; its work completes with the source rank."""
        failure: CollectiveError | None = None
        with self._cond:
            message = next((m for m in self._unexpected if receive.matches(m.src, m.tag)), None)
            if message is not None:
                self._unexpected.remove(message)
                self._cond.notify_all()  # a reader held at UNEXPECTED_LIMIT_BYTES may go on
            elif self._closed:
                failure = CollectiveError(f"rank {self.rank}: {receive.what}: the group is closed", rank=self.rank)
            elif receive.src is not None and receive.src in self._gone:
                failure = self._gone_error(receive, receive.src)
            else:
                self._posted.append(receive)
                self._cond.notify_all()  # the watchdog may sleep past this deadline or must watch for a death; a
                # reader held at UNEXPECTED_LIMIT_BYTES may hold this receive's message
                return receive.work
        self._complete([self._copy(receive, message) if message is not None else (receive, None, failure)])
        return receive.work

    def deliver(self, src: int, tag: int, dtype: str, payload: bytes | bytearray) -> None:
        """A message from this rank to itself."""
        count = len(payload) // _ITEMSIZES[dtype]
        self._keep(_Message(src, tag, dtype, count, payload))

    def _keep(self, message: _Message) -> None:
        with self._cond:
            receive = next((r for r in self._posted if r.matches(message.src, message.tag)), None)
            if receive is None:
                self._unexpected.append(message)
                return
            self._posted.remove(receive)
        self._complete([self._copy(receive, message)])

    def _copy(self, receive: Receive, message: _Message) -> Finish:
        error = self._mismatch(receive, message.src, message.dtype, message.count)
        if error is None:
            receive.buffer.flat.view(np.uint8)[:] = np.frombuffer(message.payload, np.uint8)
        return receive, message.src, error

    def _mismatch(self, receive: Receive, src: int, dtype: str, count: int) -> CollectiveError | None:
        if dtype == receive.dtype and count == receive.count:
            return None
        return CollectiveError(
            f"rank {self.rank}: {receive.what}: rank {src} sent {shape(dtype, count)}, this receive takes "
            f"{shape(receive.dtype, receive.count)}; the buffer is untouched",
            rank=self.rank,
            peer=src,
        )

    def _gone_error(self, receive: Receive, src: int) -> CollectiveError:
        """The error of ``receive``, from rank ``src`` whose connection ended: of the class of why it ended."""
        why = self._gone[src]
        return type(why)(f"rank {self.rank}: {receive.what}: {why}", rank=self.rank, peer=src)

    def _complete(self, finished: list[Finish]) -> None:
        """Complete works outside the lock (their callbacks may call back into this inbox)."""
        for receive, src, error in finished:
            if error is None:
                receive.buffer.write_back()
            receive.work._finish(src, error)

    # ------------------------------------------------------------------------------------------ connections
    def read(self, src: int, sock: socket.socket) -> str | None:
        """Take rank ``src``'s connection: a thread reads its messages until it ends. The reason if refused."""
        with self._cond:
            if self._closed:
                return "the group is closing"
            if src in self._readers:
                return f"rank {src} is already connected (two processes with the same rank?)"
            thread = threading.Thread(
                target=self._read_loop, args=(src, sock), name=f"allreduce-p2p-recv-{self.rank}-{src}", daemon=True
            )
            self._readers[src] = (sock, thread)
        sock.setblocking(True)
        thread.start()
        return None

    def _read_loop(self, src: int, sock: socket.socket) -> None:
        expected: dict[int, int] = {}  # the sequence number of the next message per tag
        header = bytearray(HEADER_SIZE)
        why: CollectiveError
        try:
            while True:
                if not _fill(sock, memoryview(header), at_boundary=True):
                    why = PeerFailureError(f"rank {src} closed its connection (it exited, or closed its group)")
                    break
                self._receive(src, sock, self._check(header, expected))
        except ProtocolError as exc:
            why = ProtocolError(f"malformed message from rank {src}: {exc}")
        except (OSError, EOFError) as exc:
            why = PeerFailureError(f"lost rank {src} mid-message ({exc}): it died, or its connection broke")
        except Exception as exc:  # never a reader gone silently (a receive would wait for its deadline)
            why = CollectiveError(f"reading rank {src}'s messages failed: {exc!r}")
        finally:
            sock.close()
        with self._cond:
            self._gone.setdefault(src, why)
            lost = [r for r in self._posted if r.src == src]
            self._posted = [r for r in self._posted if r.src != src]
            self._cond.notify_all()
        self._complete([(r, None, self._gone_error(r, src)) for r in lost])

    def _kept_bytes_total(self) -> int:
        """The bytes of every message kept for a receive not posted yet (for tests)."""
        with self._cond:
            return sum(len(m.payload) for m in self._unexpected)

    def _over_limit(self, src: int, nbytes: int) -> bool:
        """Whether keeping ``nbytes`` more of ``src``'s messages would pass :data:`UNEXPECTED_LIMIT_BYTES` (one
        message is always kept, whatever its size; under the lock)."""
        kept = sum(len(m.payload) for m in self._unexpected if m.src == src)
        return kept > 0 and kept + nbytes > UNEXPECTED_LIMIT_BYTES

    def _check(self, header: bytearray, expected: dict[int, int]) -> tuple[int, str, int, int]:
        """The tag, dtype, element count and size of the message whose header is ``header``; ProtocolError
        naming what is wrong (the frame decoder checks the magic, version, header crc and length bound)."""
        frame = decode_header(header)
        if frame.flags or frame.block or frame.segment or not 0 <= frame.step < len(DTYPE_NAMES):
            raise ProtocolError(f"not a point-to-point header (flags {frame.flags}, dtype code {frame.step})")
        dtype = DTYPE_NAMES[frame.step]
        itemsize = _ITEMSIZES[dtype]
        if frame.length % itemsize:
            raise ProtocolError(f"{frame.length} bytes is not a whole number of {dtype} elements")
        if frame.sequence != expected.get(frame.tag, 0):
            raise ProtocolError(
                f"message {frame.sequence} of tag {frame.tag} where message {expected.get(frame.tag, 0)} was due"
            )
        expected[frame.tag] = frame.sequence + 1
        return frame.tag, dtype, frame.length // itemsize, frame.length

    def _receive(self, src: int, sock: socket.socket, message: tuple[int, str, int, int]) -> None:
        """Read the payload of ``message`` (tag, dtype, count, bytes): straight into a receive posted for it,
        else kept."""
        tag, dtype, count, nbytes = message
        with self._cond:
            receive = next((r for r in self._posted if r.matches(src, tag)), None)
            while receive is None and not self._closed and self._over_limit(src, nbytes):
                # held: read on when a receive takes a kept message or is posted for this one
                self._cond.wait()
                receive = next((r for r in self._posted if r.matches(src, tag)), None)
            if self._closed and receive is None:
                raise EOFError("the group closed")
            if receive is not None:
                self._posted.remove(receive)
                self._claimed[src] = receive
        if receive is None:
            self._keep(_Message(src, tag, dtype, count, _read_kept(sock, nbytes)))
            return
        error = self._mismatch(receive, src, dtype, count)
        try:
            if error is None:
                _fill(sock, receive.buffer.flat.view(np.uint8).data)
            else:
                _discard(sock, nbytes)
        except (OSError, EOFError):
            with self._cond:
                del self._claimed[src]
                cut = self._aborted.pop(src, None)
                self._gone[src] = cut or PeerFailureError(f"lost rank {src} mid-message: it died")
            self._complete([(receive, None, cut or self._gone_error(receive, src))])
            raise
        with self._cond:
            del self._claimed[src]
        self._complete([(receive, src, error)])

    # ------------------------------------------------------------------------------------------ deadlines
    def _watch(self) -> None:
        next_poll = 0.0
        while True:
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                expired = [r for r in self._posted if r.deadline <= now]
                self._posted = [r for r in self._posted if r.deadline > now]
                for src, receive in self._claimed.items():
                    if receive.deadline <= now and src not in self._aborted:
                        # Its reader is blocked reading the rest: cutting the connection wakes it, and it fails
                        # the receive with this error.
                        self._aborted[src] = _timed_out(self.rank, receive, "the message stopped halfway")
                        with contextlib.suppress(OSError):
                            self._readers[src][0].shutdown(socket.SHUT_RDWR)
                unconnected = any(r.src not in self._readers for r in self._posted)
            self._complete([(r, None, _timed_out(self.rank, r, "nothing arrived")) for r in expired])
            if unconnected and now >= next_poll and self._dead_ranks is not None:
                next_poll = now + DEAD_POLL_S
                self._fail_dead()
            with self._cond:  # what was posted meanwhile counts (a post while awake does not notify)
                if self._stopped():
                    return
                deadlines = [r.deadline for r in (*self._posted, *self._claimed.values())]
                if any(r.src not in self._readers for r in self._posted):
                    deadlines.append(next_poll)
                self._wake_at = min(deadlines, default=time.monotonic() + 3600.0)
                self._cond.wait(max(self._wake_at - time.monotonic(), 0.001))
                self._wake_at = 0.0

    def _stopped(self) -> bool:
        """Whether close() has begun (read again after every wait: another thread sets it)."""
        return self._closed

    def _fail_dead(self) -> None:
        """Fail the receives that wait on a rank the store reports dead (one that never connected, or whose
        connection has not ended yet)."""
        assert self._dead_ranks is not None
        try:
            dead = set(self._dead_ranks())
        except (CollectiveError, OSError):  # the store itself is gone: the deadlines still hold
            return
        with self._cond:
            for r in dead:
                self._gone.setdefault(r, PeerFailureError(f"rank {r} died (the store lost it)"))
            others = set(range(self._world_size)) - {self.rank}
            failed = [
                r for r in self._posted if (r.src in dead) or (r.src is None and others <= dead | self._gone.keys())
            ]
            self._posted = [r for r in self._posted if r not in failed]
            finished: list[Finish] = [
                (r, None, self._gone_error(r, r.src if r.src is not None else min(others))) for r in failed
            ]
        self._complete(finished)

    def close(self) -> None:
        """Fail what waits, cut every connection, stop the threads."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            pending, self._posted = self._posted, []
            readers = list(self._readers.values())
            self._cond.notify_all()
        error = CollectiveError(f"rank {self.rank}: the group was closed while this receive waited", rank=self.rank)
        self._complete([(r, None, error) for r in pending])
        for sock, _ in readers:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        current = threading.current_thread()
        for thread in [self._watchdog, *(t for _, t in readers)]:
            if thread is not current:
                thread.join(_JOIN_S)


def _timed_out(rank: int, receive: Receive, what: str) -> CollectiveTimeoutError:
    peer = "any rank" if receive.src is None else f"rank {receive.src}"
    return CollectiveTimeoutError(
        f"rank {rank}: {receive.what}: {what} within {receive.timeout_s:g} s ({peer} has not sent it, or stalled)",
        rank=rank,
        peer=receive.src,
    )


def _read_kept(sock: socket.socket, nbytes: int) -> bytearray:
    """A message's ``nbytes`` of payload, in memory that grows as they arrive (a header may claim any size: memory
    follows the bytes that came, not the claim)."""
    payload = bytearray()
    while len(payload) < nbytes:
        start = len(payload)
        payload.extend(bytes(min(nbytes - start, max(start, _CHUNK_BYTES))))
        _fill(sock, memoryview(payload)[start:])
    return payload


def _discard(sock: socket.socket, nbytes: int) -> None:
    """Read and drop ``nbytes`` (a message no receive can take), a chunk at a time."""
    scratch = memoryview(bytearray(min(nbytes, _CHUNK_BYTES)))
    while nbytes:
        _fill(sock, scratch[: min(nbytes, len(scratch))])
        nbytes -= min(nbytes, len(scratch))


def _fill(sock: socket.socket, view: memoryview, *, at_boundary: bool = False) -> bool:
    """Read exactly ``len(view)`` bytes into ``view`` from a blocking socket. False if the peer closed before the
    first byte and ``at_boundary`` (a clean end between messages); EOFError if it closed anywhere else."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:], 0, socket.MSG_WAITALL)
        if n == 0:
            if at_boundary and got == 0:
                return False
            raise EOFError(f"connection closed after {got} of {len(view)} bytes")
        got += n
    return True
