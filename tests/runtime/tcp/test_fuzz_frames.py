"""Fuzzing the TCP wire formats in process: the 44-byte frame header and both sides of the handshake.

The long run (a million inputs, with throughput and memory) is ``benchmarks/fuzz.py``; these are the same
properties over a few thousand hypothesis examples.
"""

from __future__ import annotations

import socket
import struct
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from allreduce.runtime import ProtocolError
from allreduce.runtime.tcp import ClientHello, connect_handshake
from allreduce.runtime.tcp._frames import (
    FLAG_ABORT,
    FLAG_AGREE,
    FLAG_CHECKSUM,
    HEADER_SIZE,
    MAX_ABORT_BYTES,
    decode_header,
    encode_header,
)
from allreduce.runtime.tcp._handshake import accept_handshake

FUZZ = settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SOCKET_FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
HANDSHAKE_ERRORS = (ProtocolError, OSError, EOFError)  # what the listener and the connecting side handle
_BODY = struct.Struct("!2sBBQIIIQII")
_HELLO = struct.Struct("!4sBBiiI32s32s")


@st.composite
def header_fields(draw: st.DrawFn) -> dict[str, int]:
    flags = draw(st.sampled_from((0, FLAG_CHECKSUM, FLAG_AGREE, FLAG_ABORT, FLAG_CHECKSUM | FLAG_AGREE)))
    return {
        "flags": flags,
        "sequence": draw(st.integers(0, 2**64 - 1)),
        "step": draw(st.integers(0, 2**32 - 1)),
        "block": draw(st.integers(0, 2**32 - 1)),
        "segment": draw(st.integers(0, 2**32 - 1)),
        "length": draw(st.integers(0, MAX_ABORT_BYTES if flags & FLAG_ABORT else 2**40)),
        "crc32": draw(st.integers(0, 2**32 - 1)) if flags & FLAG_CHECKSUM else 0,
        "tag": draw(st.integers(0, 2**32 - 1)),
    }


def _decode_or_refuse(data: bytes) -> None:
    """decode_header either refuses with ProtocolError or returns a header that encodes back to ``data``."""
    try:
        header = decode_header(data)
    except ProtocolError:
        return
    again = encode_header(
        sequence=header.sequence,
        step=header.step,
        block=header.block,
        segment=header.segment,
        length=header.length,
        flags=header.flags,
        crc32=header.crc32,
        tag=header.tag,
    )
    assert again == data


@FUZZ
@given(st.binary(max_size=3 * HEADER_SIZE))
@pytest.mark.slow
def test_random_bytes_decode_or_raise_protocol_error(data: bytes) -> None:
    _decode_or_refuse(data)


@FUZZ
@given(header_fields())
@pytest.mark.slow
def test_valid_headers_round_trip(fields: dict[str, int]) -> None:
    header = decode_header(encode_header(**fields))
    assert (header.flags, header.sequence, header.step, header.length, header.tag) == (
        fields["flags"],
        fields["sequence"],
        fields["step"],
        fields["length"],
        fields["tag"],
    )


@FUZZ
@given(header_fields(), st.integers(0, HEADER_SIZE - 1), st.integers(0, 7))
@pytest.mark.slow
def test_a_flipped_bit_is_refused(fields: dict[str, int], byte: int, bit: int) -> None:
    data = bytearray(encode_header(**fields))
    data[byte] ^= 1 << bit
    try:
        decode_header(bytes(data))
    except ProtocolError:
        return
    raise AssertionError(f"a header with bit {bit} of byte {byte} flipped was accepted")


@FUZZ
@given(header_fields(), st.integers(0, 9), st.integers(0, 2**64 - 1))
@pytest.mark.slow
def test_a_field_out_of_contract_behind_a_valid_crc_is_refused_or_consistent(
    fields: dict[str, int], index: int, value: int
) -> None:
    # the header crc is recomputed, so the checks behind it (magic, version, flags, lengths) are what decides
    values = list(_BODY.unpack(encode_header(**fields)[:-4]))
    values[index] = b"XY" if index == 0 else value
    try:
        body = _BODY.pack(*values)
    except struct.error:
        return
    _decode_or_refuse(body + struct.pack("!I", zlib.crc32(body)))


def _feed(data: bytes) -> tuple[socket.socket, socket.socket]:
    ours, theirs = socket.socketpair()
    theirs.sendall(data)
    theirs.shutdown(socket.SHUT_WR)
    ours.settimeout(2.0)
    return ours, theirs


@st.composite
def hellos(draw: st.DrawFn) -> bytes:
    valid_like = _HELLO.pack(
        draw(st.sampled_from((b"ARHS", b"ARHX"))),
        draw(st.integers(0, 255)),
        draw(st.integers(0, 255)),
        draw(st.integers(-(2**31), 2**31 - 1)),
        draw(st.integers(-(2**31), 2**31 - 1)),
        draw(st.integers(0, 2**32 - 1)),
        draw(st.binary(min_size=32, max_size=32)),
        draw(st.binary(min_size=32, max_size=32)),
    )
    cut = draw(st.integers(0, len(valid_like)))
    return draw(st.sampled_from((valid_like, valid_like[:cut], valid_like + b"extra"))) or draw(st.binary())


@SOCKET_FUZZ
@given(hellos(), st.booleans())
@pytest.mark.slow
def test_the_accepting_side_raises_only_handshake_errors(data: bytes, with_token: bool) -> None:
    ours, theirs = _feed(data)
    try:
        hello = accept_handshake(ours, b"tcp", b"secret" if with_token else None, lambda hello: None)
    except HANDSHAKE_ERRORS:
        return
    finally:
        ours.close()
        theirs.close()
    assert not with_token, "a hello without the token's MAC was accepted"
    assert isinstance(hello, ClientHello)


@SOCKET_FUZZ
@given(st.binary(max_size=200), st.booleans())
@pytest.mark.slow
def test_the_connecting_side_raises_only_handshake_errors(data: bytes, with_token: bool) -> None:
    ours, theirs = _feed(data)
    try:
        connect_handshake(
            ours, b"tcp", b"secret" if with_token else None, ClientHello(rank=1, world_size=2, target=0), what="fuzz"
        )
    except HANDSHAKE_ERRORS:
        return
    finally:
        ours.close()
        theirs.close()
    assert not with_token, "an endpoint that cannot know the token was trusted"
