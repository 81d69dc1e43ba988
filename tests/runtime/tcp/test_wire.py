"""The frame header: round trips, and a fuzzed decoder that fails clearly on anything else."""

from __future__ import annotations

import struct
import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from allreduce.runtime import ProtocolError
from allreduce.runtime.tcp._frames import (
    FLAG_ABORT,
    FLAG_AGREE,
    FLAG_CHECKSUM,
    HEADER_SIZE,
    MAX_PAYLOAD_BYTES,
    FrameHeader,
    decode_header,
    encode_header,
)

u32 = st.integers(0, 2**32 - 1)
headers = st.builds(
    FrameHeader,
    flags=st.sampled_from([0, FLAG_CHECKSUM, FLAG_AGREE, FLAG_AGREE | FLAG_CHECKSUM]),
    sequence=st.integers(0, 2**64 - 1),
    step=u32,
    block=u32,
    segment=u32,
    length=st.integers(0, MAX_PAYLOAD_BYTES),
    crc32=st.just(0),
    tag=u32,
)


def _encode(h: FrameHeader) -> bytes:
    return encode_header(
        sequence=h.sequence,
        step=h.step,
        block=h.block,
        segment=h.segment,
        length=h.length,
        flags=h.flags,
        crc32=h.crc32,
        tag=h.tag,
    )


@given(header=headers, crc=u32)
def test_round_trip(header: FrameHeader, crc: int) -> None:
    if header.checksum:
        header = FrameHeader(
            header.flags, header.sequence, header.step, header.block, header.segment, header.length, crc, header.tag
        )
    raw = _encode(header)
    assert len(raw) == HEADER_SIZE == 44
    assert decode_header(raw) == header
    assert decode_header(bytearray(raw)) == header
    assert decode_header(memoryview(raw)) == header


@given(data=st.binary(max_size=2 * HEADER_SIZE))
def test_random_bytes_raise_a_clear_protocol_error(data: bytes) -> None:
    # Random input (even of the right size) cannot pass the magic and the header crc: always a ProtocolError.
    with pytest.raises(ProtocolError, match=r"truncated|expected exactly|magic|version|checksum|flags|inconsistent"):
        decode_header(data)


@given(header=headers, cut=st.integers(0, HEADER_SIZE - 1))
def test_truncated_header_is_named(header: FrameHeader, cut: int) -> None:
    with pytest.raises(ProtocolError, match=rf"truncated frame header: {cut} of {HEADER_SIZE} bytes"):
        decode_header(_encode(header)[:cut])


@given(header=headers, position=st.integers(0, HEADER_SIZE - 1), bit=st.integers(0, 7))
def test_any_flipped_bit_is_caught(header: FrameHeader, position: int, bit: int) -> None:
    raw = bytearray(_encode(header))
    raw[position] ^= 1 << bit
    with pytest.raises(ProtocolError):
        decode_header(raw)


def _forge(*fields: object) -> bytes:
    """A header with a valid header crc but chosen (possibly inconsistent) fields."""
    body = struct.pack("!2sBBQIIIQII", *fields)
    return body + struct.pack("!I", zlib.crc32(body))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ((b"XX", 1, 0, 0, 0, 0, 0, 0, 0, 0), "bad frame magic"),
        ((b"AR", 9, 0, 0, 0, 0, 0, 0, 0, 0), "frame version 9, this side speaks 1"),
        ((b"AR", 1, 0x80, 0, 0, 0, 0, 0, 0, 0), "unknown frame flags 0x80"),
        ((b"AR", 1, FLAG_ABORT | FLAG_AGREE, 0, 0, 0, 0, 0, 0, 0), "both ABORT and AGREE"),
        ((b"AR", 1, 0, 0, 0, 0, 0, 0, 1234, 0), "crc32 0x000004d2 without the CHECKSUM flag"),
        ((b"AR", 1, 0, 0, 0, 0, 0, MAX_PAYLOAD_BYTES + 1, 0, 0), "exceeds the maximum"),
        ((b"AR", 1, FLAG_ABORT, 0, 0, 0, 0, 1 << 20, 0, 0), "abort frame with a 1048576-byte message"),
    ],
)
def test_inconsistent_headers_are_named(fields: tuple[object, ...], message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        decode_header(_forge(*fields))


def test_encoder_rejects_out_of_range_fields() -> None:
    with pytest.raises(ValueError, match="needs the CHECKSUM flag"):
        encode_header(sequence=0, step=0, block=0, segment=0, length=1, crc32=5)
    with pytest.raises(ValueError, match="out of range"):
        encode_header(sequence=0, step=2**32, block=0, segment=0, length=1)
    with pytest.raises(ValueError, match="length -1 out of range"):
        encode_header(sequence=0, step=0, block=0, segment=0, length=-1)
    with pytest.raises(ValueError, match="unknown frame flags"):
        encode_header(sequence=0, step=0, block=0, segment=0, length=0, flags=0x40)
