"""One authenticated connection to a peer: pushing frames out, pulling frames in, the windowed reduction.

Each frame's header is checked against the frame this rank expects next on the connection (sequence, step,
block, segment, length, plan tag), so a mismatch names the peer and the step. A reduction is received into a
small window of scratch and reduced into the user's buffer each time the window fills (so reducing overlaps
receiving and the data is still in cache); with checksums, a piece is verified whole before it is reduced.
Every call is non-blocking: it moves what the socket takes now and says whether any byte moved.
"""

from __future__ import annotations

import socket
import time
import zlib
from typing import NoReturn

import numpy as np

from allreduce.runtime._errors import MismatchError, ProtocolError, corrupted
from allreduce.runtime.tcp._blame import LostPeerError
from allreduce.runtime.tcp._frames import (
    FLAG_ABORT,
    FLAG_AGREE,
    FLAG_CHECKSUM,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    NO_CULPRIT,
    VERSION,
    InFrame,
    OutFrame,
    decode_header,
)
from allreduce.runtime.tcp._socket import IO_CHUNK_BYTES, read_exact
from allreduce.runtime.transport._transport import MAX_DESCRIPTOR_BYTES, ReduceInto, error_class

__all__ = ["ABORT_MESSAGE_WAIT_S", "Pair", "apply_staged", "check_idle"]

ABORT_MESSAGE_WAIT_S = 5.0
"""How long to wait for the message of a peer's ABORT frame once its header arrived: the peer sent both at once,
so this only bounds a peer that died in between (its abort is then raised without the message)."""


class Pair:
    """The connection from rank ``local`` to ``rank``, with its reusable header buffer."""

    __slots__ = ("current_out", "header_buf", "header_view", "local", "rank", "sock")

    def __init__(self, local: int, rank: int, sock: socket.socket) -> None:
        self.local = local
        self.rank = rank
        self.sock = sock
        self.header_buf = bytearray(HEADER_SIZE)
        self.header_view = memoryview(self.header_buf)
        self.current_out: OutFrame | None = None  # a frame partly sent: finish it before an ABORT

    # ------------------------------------------------------------------------------------------------ sending
    def send(self, out: OutFrame, seq: int, label: str) -> bool:
        """Push ``out`` (header and payload in one ``sendmsg`` at first) as far as the socket takes it."""
        try:
            if out.sent < HEADER_SIZE:
                chunk = out.payload[:IO_CHUNK_BYTES]
                n = self.sock.sendmsg([memoryview(out.header)[out.sent :], chunk])
            else:
                start = out.sent - HEADER_SIZE
                n = self.sock.send(out.payload[start : start + IO_CHUNK_BYTES])
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            raise self._lost("sending", label, seq, exc) from exc
        out.sent += n
        out.done = out.sent == out.total
        self.current_out = None if out.done else out
        return n > 0

    def _lost(self, doing: str, label: str, seq: int, exc: OSError) -> LostPeerError:
        """The error of a connection to the peer that broke while ``doing`` (sending or receiving) at ``label``."""
        return LostPeerError(
            f"rank {self.local}: lost rank {self.rank} while {doing} at {label} of collective {seq} "
            f"({exc.strerror or exc}): rank {self.rank} died or aborted",
            rank=self.local,
            peer=self.rank,
        )

    # ------------------------------------------------------------------------------------------------ receiving
    def receive(self, inc: InFrame, seq: int, *, tag: int, reduce_into: ReduceInto, label: str) -> bool:
        """Pull the next bytes of ``inc``: its header first (checked), then its payload, reduced window by window."""
        moved = False
        try:
            if inc.header_got < HEADER_SIZE:
                n = self.sock.recv_into(self.header_view[inc.header_got :])
                if n == 0:
                    self.raise_eof(seq, label)
                inc.header_got += n
                moved = True
                if inc.header_got < HEADER_SIZE:
                    return True
                self._check_header(inc, seq, tag, label)
                if inc.length == 0:
                    self._finish(inc, seq, reduce_into, label)
                    return True
            if inc.windowed:
                n = self.sock.recv_into(inc.dest[inc.fill :], min(len(inc.dest) - inc.fill, inc.length - inc.got))
            else:
                n = self.sock.recv_into(inc.dest[inc.got :], min(inc.length - inc.got, IO_CHUNK_BYTES))
        except (BlockingIOError, InterruptedError):
            return moved
        except ConnectionError as exc:
            raise self._lost("receiving", label, seq, exc) from exc
        if n == 0:
            self.raise_eof(seq, label)
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
            self._finish(inc, seq, reduce_into, label)
        return True

    def _finish(self, inc: InFrame, seq: int, reduce_into: ReduceInto, label: str) -> None:
        if inc.flags & FLAG_CHECKSUM and inc.crc != inc.expect_crc:
            what = f"block {inc.block}, segment {inc.segment}"
            raise corrupted(
                rank=self.local, peer=self.rank, step=inc.step, seq=seq, what=what, got=inc.crc, expected=inc.expect_crc
            )
        if inc.staged or inc.flags & FLAG_AGREE:
            return
        if inc.reduce and not inc.windowed:  # verified by its checksum: now reduce it whole
            assert inc.dst_typed is not None
            assert inc.src_typed is not None
            reduce_into(inc.dst_typed, inc.src_typed)
        inc.applied = True

    def _check_header(self, inc: InFrame, seq: int, tag: int, label: str) -> None:
        magic, version, flags, f_seq, f_step, f_block, f_segment, length, crc, f_tag, header_crc = HEADER.unpack(
            self.header_buf
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
            and header_crc == zlib.crc32(self.header_view[: HEADER_SIZE - 4])
        ):
            inc.expect_crc = crc
            if inc.length < 0:  # an agreement frame: its length is the descriptor's
                if length > MAX_DESCRIPTOR_BYTES:
                    raise ProtocolError(
                        f"rank {self.local}: rank {self.rank} sent a {length}-byte descriptor "
                        f"(max {MAX_DESCRIPTOR_BYTES})",
                        rank=self.local,
                        peer=self.rank,
                    )
                inc.length = length
                inc.dest = memoryview(bytearray(length))
            return
        self._raise_unexpected(inc, seq, tag, label)

    def _raise_unexpected(self, inc: InFrame, seq: int, tag: int, label: str) -> None:
        try:
            header = decode_header(self.header_buf)
        except ProtocolError as exc:
            raise ProtocolError(
                f"rank {self.local}: bad frame from rank {self.rank} at {label} of collective {seq}: {exc}",
                rank=self.local,
                peer=self.rank,
                step=inc.step,
            ) from exc
        if header.flags & FLAG_ABORT:
            self.raise_remote_abort(header.block, header.segment, header.length, seq)
        expected = (
            f"collective {seq}, step {inc.step}, block {inc.block}, segment {inc.segment}, "
            f"{inc.length if inc.length >= 0 else 'any'} bytes"
        )
        got = (
            f"collective {header.sequence}, step {header.step}, block {header.block}, segment {header.segment}, "
            f"{header.length} bytes"
        )
        if header.tag != tag and not inc.flags & FLAG_AGREE:
            why = (
                f"runs a different plan (schedule, size or dtype) at {label} of collective {seq}: expected {expected}, "
                f"got {got}"
            )
        elif (header.flags ^ inc.flags) & FLAG_CHECKSUM:
            why = (
                f"{'uses' if header.checksum else 'does not use'} checksum=True and this rank "
                f"{'does not' if header.checksum else 'does'} (collective {seq})"
            )
        else:
            why = f"sent an unexpected frame at {label}: expected {expected}, got {got}"
        raise MismatchError(
            f"rank {self.local}: rank {self.rank} {why}", rank=self.local, peer=self.rank, step=inc.step
        )

    def raise_remote_abort(self, culprit: int, kind: int, length: int, seq: int) -> NoReturn:
        try:
            message = read_exact(self.sock, length, deadline=time.monotonic() + ABORT_MESSAGE_WAIT_S).decode(
                errors="replace"
            )
        except (EOFError, OSError):
            message = "(its message was lost)"
        raise error_class(kind)(
            f"rank {self.local}: rank {self.rank} aborted collective {seq}: {message}",
            rank=self.local,
            peer=None if culprit == NO_CULPRIT else culprit,
        )

    def raise_eof(self, seq: int, label: str) -> NoReturn:
        raise LostPeerError(
            f"rank {self.local}: rank {self.rank} closed its connection at {label} of collective {seq} "
            f"(rank {self.rank} died or aborted)",
            rank=self.local,
            peer=self.rank,
        )


def check_idle(pair: Pair, seq: int) -> bool:
    """``pair``'s peer, from which this rank expects nothing in this step, has something to read: raise if it is
    an ABORT frame (the peer gave up: the error names whom it names, where this rank, waiting for another peer's
    data, would otherwise see it only at its timeout); return whether to keep watching it: not once a frame of a
    later step waits there (read in its step; watching it would wake every poll), nor after an end of file or a
    reset (a peer that finished the collective may close: whether this rank still needed it, its own receives and
    sends find out)."""
    try:
        head = pair.sock.recv(HEADER_SIZE, socket.MSG_PEEK)
    except (BlockingIOError, InterruptedError):
        return True
    except OSError:
        return False
    if len(head) < HEADER_SIZE:
        return False  # a peer sends a header whole: one that sends part of it is not watched (no busy loop)
    try:
        header = decode_header(head)
    except ProtocolError:
        return False  # the receive that reads it names the bad frame
    if header.flags & FLAG_ABORT:
        pair.sock.recv_into(pair.header_view, HEADER_SIZE)  # taken whole: the peek saw all of it
        pair.raise_remote_abort(header.block, header.segment, header.length, seq)
    return False


def apply_staged(staged: list[InFrame], sends: list[OutFrame], reduce_into: ReduceInto) -> bool:
    """Land every fully received staged frame whose range the step's sends no longer need; whether any landed."""
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
