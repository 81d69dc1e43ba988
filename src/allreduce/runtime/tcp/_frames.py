"""Frames on a data connection: the 44-byte header, and the frames being sent and received.

Header (network byte order, packed with :mod:`struct`)::

    magic "AR" | version u8 | flags u8 | sequence u64 | step u32 | block u32 | segment u32 |
    length u64 | crc32 u32 | tag u32 | header crc32 u32

``sequence`` numbers the collective, ``step``/``block``/``segment`` place the payload in the schedule,
``length`` is the payload size in bytes, ``crc32`` the payload checksum (only with the CHECKSUM flag, else 0),
``tag`` a hash of the compiled plan (schedule, world size, element count, dtype) so two ranks running different
plans are caught at the first frame, and the header crc catches a corrupted or misaligned header. The receiver
always knows which frame it expects next on a connection, so every field is checked against that expectation.

An ABORT frame (the sender gave up) reuses the fields: ``block`` is the culprit rank (:data:`NO_CULPRIT` if
none), ``segment`` the error's kind (:func:`allreduce.runtime.abort_kind`), the payload the error message.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy.typing as npt

from allreduce.runtime._errors import ProtocolError

if TYPE_CHECKING:
    from allreduce.runtime.tcp._prepared import RecvSpec

__all__ = [
    "FLAG_ABORT",
    "FLAG_AGREE",
    "FLAG_CHECKSUM",
    "HEADER",
    "HEADER_SIZE",
    "MAGIC",
    "MAX_ABORT_BYTES",
    "MAX_PAYLOAD_BYTES",
    "NO_CULPRIT",
    "VERSION",
    "FrameHeader",
    "InFrame",
    "OutFrame",
    "decode_header",
    "encode_header",
]

MAGIC = b"AR"
VERSION = 1
FLAG_CHECKSUM = 0x01  # crc32 carries the payload checksum
FLAG_AGREE = 0x02  # a descriptor of the agreement all-gather, not schedule data
FLAG_ABORT = 0x04  # the sender gave up; block = culprit rank, segment = error kind, payload = message
_KNOWN_FLAGS = FLAG_CHECKSUM | FLAG_AGREE | FLAG_ABORT
MAX_PAYLOAD_BYTES = 1 << 40
"""A frame never carries more than 1 TiB: a larger length is garbage, not data."""
MAX_ABORT_BYTES = 4096
"""The longest error message an ABORT frame carries (longer ones are cut)."""
NO_CULPRIT = 0xFFFFFFFF
"""The culprit field of an ABORT frame whose error names no rank."""

# Everything but the trailing header crc; the crc covers exactly these bytes.
_BODY = struct.Struct("!2sBBQIIIQII")
HEADER = struct.Struct("!2sBBQIIIQIII")
HEADER_SIZE = HEADER.size


@dataclass(frozen=True, slots=True)
class FrameHeader:
    flags: int
    sequence: int
    step: int
    block: int
    segment: int
    length: int
    crc32: int = 0
    tag: int = 0

    @property
    def checksum(self) -> bool:
        return bool(self.flags & FLAG_CHECKSUM)


def encode_header(
    *,
    sequence: int,
    step: int,
    block: int,
    segment: int,
    length: int,
    flags: int = 0,
    crc32: int = 0,
    tag: int = 0,
) -> bytes:
    """The 44-byte header of a frame; raises ValueError for fields out of range."""
    if flags & ~_KNOWN_FLAGS:
        raise ValueError(f"unknown frame flags {flags:#x}")
    if not 0 <= length <= MAX_PAYLOAD_BYTES:
        raise ValueError(f"frame length {length} out of range [0, {MAX_PAYLOAD_BYTES}]")
    if crc32 and not flags & FLAG_CHECKSUM:
        raise ValueError("a payload crc32 needs the CHECKSUM flag")
    try:
        body = _BODY.pack(MAGIC, VERSION, flags, sequence, step, block, segment, length, crc32, tag)
    except struct.error as exc:
        raise ValueError(f"frame header field out of range: {exc}") from exc
    return body + struct.pack("!I", zlib.crc32(body))


def decode_header(data: bytes | bytearray | memoryview) -> FrameHeader:
    """Parse and validate a header; :class:`ProtocolError` says what is wrong with a bad one."""
    view = memoryview(data).cast("B")
    if len(view) < HEADER_SIZE:
        raise ProtocolError(f"truncated frame header: {len(view)} of {HEADER_SIZE} bytes")
    if len(view) > HEADER_SIZE:
        raise ProtocolError(f"frame header of {len(view)} bytes; expected exactly {HEADER_SIZE}")
    magic, version, flags, sequence, step, block, segment, length, crc, tag, header_crc = HEADER.unpack(view)
    if magic != MAGIC:
        raise ProtocolError(
            f"bad frame magic {bytes(magic)!r} (expected {MAGIC!r}): not an allreduce peer, or lost sync"
        )
    if version != VERSION:
        raise ProtocolError(f"frame version {version}, this side speaks {VERSION}: mixed allreduce versions?")
    actual = zlib.crc32(view[: _BODY.size])
    if actual != header_crc:
        raise ProtocolError(f"frame header checksum mismatch ({header_crc:#010x} != {actual:#010x}): header corrupted")
    if flags & ~_KNOWN_FLAGS:
        raise ProtocolError(f"unknown frame flags {flags:#x}")
    if flags & FLAG_ABORT and flags & FLAG_AGREE:
        raise ProtocolError("inconsistent frame: both ABORT and AGREE flags set")
    if crc and not flags & FLAG_CHECKSUM:
        raise ProtocolError(f"inconsistent frame: payload crc32 {crc:#010x} without the CHECKSUM flag")
    if length > MAX_PAYLOAD_BYTES:
        raise ProtocolError(f"frame length {length} exceeds the maximum {MAX_PAYLOAD_BYTES}")
    if flags & FLAG_ABORT and length > MAX_ABORT_BYTES:
        raise ProtocolError(f"abort frame with a {length}-byte message (at most {MAX_ABORT_BYTES})")
    return FrameHeader(flags, sequence, step, block, segment, length, crc, tag)


class OutFrame:
    """A frame being sent: header then payload, resumed across non-blocking calls."""

    __slots__ = ("done", "header", "payload", "sent", "total")

    def __init__(self, header: bytes, payload: memoryview) -> None:
        self.header = header
        self.payload = payload
        self.sent = 0
        self.total = HEADER_SIZE + len(payload)
        self.done = False


class InFrame:
    """A frame being received into ``dest``; it lands in the user's buffer when its receive is complete (or,
    windowed, each time the window fills). ``length`` -1: an agreement frame, whose length the header says."""

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
        self.spec: RecvSpec | None = None
        self.dst_typed: npt.NDArray[Any] | None = None
        self.src_typed: npt.NDArray[Any] | None = None
