"""Fuzzing the store protocol: a live server fed generated requests, and the client fed generated answers.

The long run (a million requests, throughput and memory) is ``benchmarks/fuzz.py``; these are the same properties
over a few thousand hypothesis examples, plus the two inputs that run found.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import tracemalloc
import uuid
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from allreduce.runtime import CollectiveError, ProtocolError
from allreduce.runtime.store._store import TCPStore
from allreduce.runtime.tcp import ClientHello, connect_handshake, read_exact
from allreduce.runtime.tcp._handshake import AcceptHandshake
from allreduce.runtime.tcp._peercred import loopback_peer

TOKEN = b"fuzz-token"
WORLD_SIZE = 64
REQUEST = struct.Struct("!BIII")  # op, timeout ms, key length, value length (as a client writes it)
RESPONSE = struct.Struct("!BI")  # status, payload length
OP_ADD, OP_CLOSE = 3, 7
STATUS_ERROR = 4
SOCKET_TIMEOUT_S = 10.0  # a live server answers in milliseconds; this only turns a hang into a failure

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def store() -> Iterator[TCPStore]:
    host = TCPStore("127.0.0.1", 0, is_server=True, world_size=WORLD_SIZE, rank=0, timeout_s=30, token=TOKEN)
    yield host
    host.close(wait_for_ranks_s=0)


_next_rank = iter(range(1, 10**9))


def _session(port: int) -> socket.socket:
    """A connection that has passed the real handshake as a fresh rank of the store's group."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=SOCKET_TIMEOUT_S)
    rank = 1 + next(_next_rank) % (WORLD_SIZE - 1)
    connect_handshake(sock, b"store", TOKEN, ClientHello(rank=rank, world_size=WORLD_SIZE, target=0), what="store")
    return sock


def _read(sock: socket.socket, size: int) -> bytes:
    buf = b""
    while len(buf) < size:
        chunk = sock.recv(size - len(buf))
        assert chunk, f"the server closed the connection after {len(buf)} of {size} bytes"
        buf += chunk
    return buf


def _answer(sock: socket.socket) -> tuple[int, bytes]:
    status, length = RESPONSE.unpack(_read(sock, RESPONSE.size))
    return status, _read(sock, length)


def _serving(store: TCPStore) -> bool:
    try:
        store.set("still/serving", b"yes")
        return store.get("still/serving", timeout_s=5) == b"yes"
    except CollectiveError:
        return False


keys = st.one_of(
    st.sampled_from([b"a", b"b", b"k/1", b"a\x00b"]),
    st.binary(min_size=1, max_size=12),
)


@st.composite
def requests(draw: st.DrawFn) -> bytes:
    """A well-framed request: any op (known or not), a key of any bytes, a value; waits end within 1 ms."""
    op = draw(st.sampled_from((0, 1, 2, 4, 5, 6, 8, 9, 255)))
    key = draw(keys)
    value = draw(st.binary(max_size=40))
    return REQUEST.pack(op, draw(st.integers(0, 1)), len(key), len(value)) + key + value


@FUZZ
@given(st.lists(requests(), min_size=1, max_size=20))
@pytest.mark.slow
def test_every_well_framed_request_gets_one_answer(store: TCPStore, batch: list[bytes]) -> None:
    with _session(store.port) as sock:
        sock.sendall(b"".join(batch))
        for _ in batch:
            status, _payload = _answer(sock)
            assert 0 <= status <= 4
    assert _serving(store)


@FUZZ
@given(st.binary(min_size=1, max_size=300))
@pytest.mark.slow
def test_garbage_after_the_handshake_leaves_the_server_serving(store: TCPStore, junk: bytes) -> None:
    with _session(store.port) as sock, contextlib.suppress(OSError):
        sock.sendall(junk)
    assert _serving(store)


@FUZZ
@given(st.integers(-(2**62), 2**62 - 1), st.integers(-(2**62), 2**62 - 1))
@pytest.mark.slow
def test_add_answers_with_the_sum(store: TCPStore, first: int, second: int) -> None:
    key = f"add/{uuid.uuid4().hex}".encode()  # hypothesis replays examples: a fresh counter each time
    with _session(store.port) as sock:
        for amount in (first, second):
            sock.sendall(REQUEST.pack(OP_ADD, 0, len(key), 8) + key + struct.pack("!q", amount))
        answers = [_answer(sock) for _ in range(2)]
    assert answers == [(0, struct.pack("!q", first)), (0, struct.pack("!q", first + second))]


def test_an_overflowing_add_is_refused_and_the_server_lives_on() -> None:
    own = TCPStore("127.0.0.1", 0, is_server=True, world_size=WORLD_SIZE, rank=0, timeout_s=30, token=TOKEN)
    try:
        key = b"overflow"
        with _session(own.port) as sock:
            for _ in range(2):
                sock.sendall(REQUEST.pack(OP_ADD, 0, len(key), 8) + key + struct.pack("!q", 2**63 - 1))
            assert _answer(sock)[0] == 0
            assert _answer(sock)[0] == 4  # ERROR: the counter would not fit
        assert _serving(own)
    finally:
        own.close(wait_for_ranks_s=0)


# ------------------------------------------------------------------------------------------------ the client
class FakeStore:
    """A server that passes the handshake and says it has no lease, then answers the client's next request (its
    first call's) with ``answer``."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        conn, _ = self._listener.accept()
        with conn, contextlib.suppress(OSError, EOFError, CollectiveError):
            conn.settimeout(SOCKET_TIMEOUT_S)
            handshake = AcceptHandshake(b"store", None, lambda hello: None, lambda: loopback_peer(conn))
            conn.sendall(handshake.greeting)
            conn.sendall(handshake.answer(read_exact(conn, handshake.hello_size))[0])
            conn.recv(1 << 16)  # the client asks for the lease once connected: none
            conn.sendall(RESPONSE.pack(0, 1) + b"0")
            conn.recv(1 << 16)
            conn.sendall(self.answer)
            conn.settimeout(0.2)  # then: acknowledge a CLOSE, or hang up on a client waiting for more
            while request := conn.recv(1 << 16):
                if request[0] == OP_CLOSE:
                    conn.sendall(RESPONSE.pack(0, 0))

    def close(self) -> None:
        self._listener.close()
        self._thread.join(timeout=SOCKET_TIMEOUT_S)


def _call_with_answer(answer: bytes, call: int) -> None:
    fake = FakeStore(answer)
    client = TCPStore("127.0.0.1", fake.port, is_server=False, world_size=2, rank=1, timeout_s=SOCKET_TIMEOUT_S)
    try:
        (
            lambda: client.get("k", timeout_s=1),
            lambda: client.add("k", 1),
            lambda: client.wait(["a", "b"], timeout_s=1),
            client.dead_ranks,
        )[call]()
    finally:
        client.close()
        fake.close()


answers = st.builds(
    lambda status, payload: RESPONSE.pack(status, len(payload)) + payload,
    st.integers(0, 255),
    st.one_of(st.binary(max_size=40), st.sampled_from([b"1\nreason", b"k\n1,2\n3", b"x\ny\nz"])),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(answers, st.integers(0, 3))
@pytest.mark.slow
def test_the_client_raises_only_its_documented_errors_on_any_answer(answer: bytes, call: int) -> None:
    try:
        _call_with_answer(answer, call)
    except CollectiveError:
        pass
    except ValueError as exc:
        if answer[0] != STATUS_ERROR or not str(exc).startswith("store: "):
            raise  # only the server's own error answer is a ValueError


@pytest.mark.parametrize("status", [1, 6, 255], ids=["missing", "unknown-6", "unknown-255"])
def test_a_get_answered_with_another_status_than_ok_raises_a_protocol_error(status: int) -> None:
    with pytest.raises(ProtocolError, match=rf"the store at 127.0.0.1:\d+ answered .*'k' with status {status}:"):
        _call_with_answer(RESPONSE.pack(status, 5) + b"value", call=0)


@pytest.mark.parametrize("payload", [b"\xd9\xa1\nreason", b"x\nreason", b"9" * 5000 + b"\nreason"])
def test_a_dead_rank_answer_that_names_no_rank_raises_a_protocol_error(payload: bytes) -> None:
    with pytest.raises(ProtocolError, match="answered a request for 'k' with a dead rank"):
        _call_with_answer(RESPONSE.pack(3, len(payload)) + payload, call=0)


def test_a_timeout_answer_to_add_raises_a_collective_error() -> None:
    with pytest.raises(CollectiveError):
        _call_with_answer(RESPONSE.pack(2, 0), call=1)


def test_a_short_answer_to_add_raises_a_collective_error() -> None:
    with pytest.raises(CollectiveError):
        _call_with_answer(RESPONSE.pack(0, 3) + b"abc", call=1)


def test_an_answer_declaring_gigabytes_is_refused_without_allocating_them() -> None:
    tracemalloc.start()
    try:
        with pytest.raises(CollectiveError):
            _call_with_answer(RESPONSE.pack(0, 2**32 - 1), call=0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20


@pytest.mark.parametrize("key", ["k/²", "k/١"], ids=["superscript-two", "arabic-indic-one"])
def test_a_key_ending_in_a_non_ascii_digit_belongs_to_no_rank(key: str) -> None:
    with TCPStore("127.0.0.1", 0, is_server=True, world_size=2, rank=0, timeout_s=30, token=TOKEN) as own:
        with pytest.raises(CollectiveError) as info:
            own.get(key, timeout_s=0.2)
        assert f"waiting for store key(s) {key};" in str(info.value)
        assert "expected from" not in str(info.value)  # no rank owns it
        with TCPStore("127.0.0.1", own.port, is_server=False, world_size=2, rank=1, token=TOKEN) as rank_1:
            rank_1.set(key, b"anyone's")
        assert _serving(own)


@pytest.mark.parametrize("amount", [2**63, -(2**63) - 1])
def test_an_add_amount_beyond_int64_is_refused_by_the_client(store: TCPStore, amount: int) -> None:
    with pytest.raises(ValueError, match=r"add: the amount for 'c' must fit in a signed 64-bit integer"):
        store.add("c", amount)
    assert _serving(store)
