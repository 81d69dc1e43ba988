"""Point-to-point calls of the process group (group.send / recv / isend / irecv), real processes over shm and tcp.

Each test runs its ranks with spawn() and checks what they report: one behaviour per test. A dead rank is
SIGKILLed under spawn_elastic() (spawn() stops the others as soon as a rank dies).
"""

from __future__ import annotations

import os
import signal
import socket
import time
from typing import Any

import numpy as np
import pytest

import allreduce
from allreduce.runtime import CollectiveError, CollectiveTimeoutError, PeerFailureError, ProtocolError, local_groups
from allreduce.runtime.launcher._spawn import spawn, spawn_elastic
from allreduce.runtime.p2p import PointToPoint
from allreduce.runtime.store._memory_store import MemoryStore
from allreduce.runtime.tcp._frames import HEADER_SIZE, encode_header
from allreduce.runtime.tcp._handshake import ClientHello, connect_handshake

TRANSPORTS = ["shm", "tcp"]
TIMEOUT_S = 60.0  # generous: 2 cores at load 8; no test waits for it unless it fails

DTYPES = [np.float32, np.float64, np.int8, np.uint64, np.bool_, np.complex64]
"""With ml_dtypes' bfloat16, imported by the one rank function that sends it: every rank spawned here imports this
module, and importing ml_dtypes would add 0.6-0.9 s to each one's start."""
SIZES_BYTES = [0, 1 << 20]


def _payload(dtype: Any, count: int, seed: int) -> np.ndarray[Any, Any]:
    values = (np.arange(count, dtype=np.int64) * 7 + seed) % 101
    return values.astype(np.bool_) if dtype is np.bool_ else values.astype(dtype)


def _cases() -> list[tuple[Any, int]]:
    """Every dtype at 0 elements, 1 element and 1 MiB."""
    import ml_dtypes  # late: see DTYPES

    dtypes = [*DTYPES, ml_dtypes.bfloat16]
    return [(d, count) for d in dtypes for count in (0, 1, (1 << 20) // np.dtype(d).itemsize)]


def _round_trip(group: allreduce.ProcessGroup) -> list[str]:
    """Rank 0 sends each case to rank 1, which sends it back: the cases that did not come back exact."""
    wrong = []
    for k, (dtype, count) in enumerate(_cases()):
        sent = _payload(dtype, count, k)
        got = np.zeros(count, dtype)
        if group.rank == 0:
            group.send(sent, 1, tag=k)
            group.recv(got, 1, tag=k)
        else:
            group.recv(got, 0, tag=k)
            group.send(got, 0, tag=k)
        if not np.array_equal(got.view(np.uint8), sent.view(np.uint8)):
            wrong.append(f"{np.dtype(dtype).name} x {count}")
    return wrong


def _run(world_size: int, fn: Any, transport: str = "shm", *args: Any) -> list[Any]:
    options = {"transport": transport, "timeout_s": TIMEOUT_S}
    return spawn(world_size, fn, *args, init_options=options, timeout_s=4 * TIMEOUT_S)


@pytest.mark.slow
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_every_dtype_and_size_makes_the_round_trip_exactly(transport: str) -> None:
    assert _run(2, _round_trip, transport) == [[], []]


def _tags_out_of_order(group: allreduce.ProcessGroup) -> list[float]:
    if group.rank == 0:
        for value, tag in ((1.0, 1), (2.0, 2), (3.0, 1)):
            group.send(np.full(4, value), 1, tag=tag)
        return []
    order = []
    for tag in (2, 1, 1):  # the second message first: the first is kept until its receive comes
        x = np.zeros(4)
        group.recv(x, 0, tag=tag)
        order.append(float(x[0]))
    return order


@pytest.mark.slow
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_messages_meet_their_receives_in_order_per_tag(transport: str) -> None:
    assert _run(2, _tags_out_of_order, transport)[1] == [2.0, 1.0, 3.0]


def _both_ways_at_once(group: allreduce.ProcessGroup) -> bool:
    """Each rank sends 8 MiB to the other and receives 8 MiB, both in the background: a send that waited for its
    receive to be called first would wait forever (each rank waits for its own send before calling recv)."""
    peer = 1 - group.rank
    out = np.full(1 << 20, float(group.rank + 1))
    back = np.zeros(1 << 20)
    send = group.isend(out, peer, tag=9)
    send.wait()
    receive = group.irecv(back, peer, tag=9)
    return bool(receive.wait() == peer and (back == peer + 1).all())


@pytest.mark.slow
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_isend_completes_before_the_peer_calls_irecv(transport: str) -> None:
    assert _run(2, _both_ways_at_once, transport) == [True, True]


def _overlapping(group: allreduce.ProcessGroup) -> bool:
    """Four receives posted before any send, matched by tag though the sends come in another order."""
    peer = 1 - group.rank
    inbox = [np.zeros(1000, np.int32) for _ in range(4)]
    receives = [group.irecv(x, peer, tag=t) for t, x in enumerate(inbox)]
    sends = [group.isend(np.full(1000, 10 * group.rank + t, np.int32), peer, tag=t) for t in (3, 1, 0, 2)]
    for work in [*sends, *receives]:
        work.wait()
    return all((x == 10 * peer + t).all() for t, x in enumerate(inbox))


@pytest.mark.slow
def test_posted_receives_and_sends_in_flight_overlap_and_match_by_tag() -> None:
    assert _run(2, _overlapping) == [True, True]


def _mismatched(group: allreduce.ProcessGroup, wrong: str) -> Any:
    if group.rank == 0:
        group.send(np.ones(10, np.float32), 1, tag=5)
        return None
    x = np.full(12, 7.0, np.float32) if wrong == "size" else np.full(10, 7.0, np.float64)
    try:
        group.recv(x, 0, tag=5)
    except CollectiveError as exc:
        return str(exc), exc.peer, bool((x == 7.0).all())
    return "no error"


@pytest.mark.slow
@pytest.mark.parametrize("wrong", ["size", "dtype"])
def test_a_receive_that_does_not_fit_raises_naming_the_peer_tag_and_both_shapes(wrong: str) -> None:
    message, peer, untouched = _run(2, _mismatched, "tcp", wrong)[1]
    assert peer == 0
    assert "rank 0 sent 10 float32 elements (40 bytes)" in message
    assert ("12 float32 elements" if wrong == "size" else "10 float64 elements") in message
    assert "(tag 5)" in message
    assert untouched


def _in_step_after_a_mismatch(group: allreduce.ProcessGroup) -> float:
    if group.rank == 0:
        group.send(np.ones(10, np.float32), 1)
        group.send(np.full(3, 4.0, np.float32), 1)
        return 0.0
    with pytest.raises(CollectiveError):
        group.recv(np.zeros(11, np.float32), 0)
    x = np.zeros(3, np.float32)
    group.recv(x, 0)
    return float(x.sum())


@pytest.mark.slow
def test_the_message_after_a_mismatched_one_arrives_intact() -> None:
    assert _run(2, _in_step_after_a_mismatch)[1] == 12.0


def _silent_peer(group: allreduce.ProcessGroup) -> Any:
    result: Any = None
    if group.rank == 0:
        started = time.monotonic()
        try:
            group.recv(np.zeros(4), 1, tag=3, timeout_s=1.0)
        except CollectiveTimeoutError as exc:
            result = (str(exc), exc.peer, time.monotonic() - started)
    group.barrier()
    return result


@pytest.mark.slow
def test_a_receive_nothing_is_sent_to_times_out_naming_the_peer_and_tag() -> None:
    message, peer, elapsed_s = _run(2, _silent_peer)[0]
    assert peer == 1
    assert "recv from rank 1 (tag 3)" in message
    assert elapsed_s < TIMEOUT_S  # its own timeout, not the group's


def _from_anyone(group: allreduce.ProcessGroup) -> Any:
    if group.rank != 0:
        group.send(np.full(5, float(group.rank)), 0, tag=1)
        return None
    got = []
    for _ in range(group.world_size - 1):
        x = np.zeros(5)
        source = group.recv(x, None, tag=1)
        got.append((source, float(x[0])))
    return sorted(got)


@pytest.mark.slow
def test_a_receive_from_any_rank_returns_the_sender() -> None:
    assert _run(3, _from_anyone)[0] == [(1, 1.0), (2, 2.0)]


def _to_itself(group: allreduce.ProcessGroup) -> bool:
    work = group.isend(np.arange(6.0), group.rank, tag=2)
    x = np.zeros(6)
    source = group.recv(x, group.rank, tag=2)
    work.wait()
    return source == group.rank and bool((x == np.arange(6.0)).all())


@pytest.mark.slow
def test_a_rank_sends_to_itself() -> None:
    assert _run(2, _to_itself) == [True, True]


def _closing(group: allreduce.ProcessGroup) -> str:
    work = group.irecv(np.zeros(2), 1 - group.rank)
    group.close()
    try:
        work.wait()
    except CollectiveError as exc:
        return str(exc)
    return "no error"


@pytest.mark.slow
def test_a_receive_pending_when_the_group_closes_fails() -> None:
    for message in _run(2, _closing):
        assert "the group was closed while this receive waited" in message


# ------------------------------------------------------------------------------------------- a dead peer
def _dying_rank(transport: str, when: str) -> Any:
    """Rank 1 is SIGKILLed (before it sent anything, or after one message); rank 0's next receive from it."""
    group = allreduce.init(transport=transport, timeout_s=TIMEOUT_S)
    try:
        if group.rank == 1:
            if when == "after a message":
                group.send(np.ones(3), 0)
            group.barrier()
            os.kill(os.getpid(), signal.SIGKILL)
        x = np.zeros(3)
        if when == "after a message":
            group.recv(x, 1)
        group.barrier()
        try:
            group.recv(x, 1, tag=0)
        except CollectiveError as exc:
            return type(exc).__name__, exc.peer, str(exc)
        return "no error"
    finally:
        group.close()


@pytest.mark.slow
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("when", ["before any message", "after a message"])
def test_a_receive_from_a_rank_that_dies_raises_peer_failure_naming_it(transport: str, when: str) -> None:
    # the ranks' timeout is 60 s and spawn_elastic's 4x that: a PeerFailureError proves the death was seen
    outcome = spawn_elastic(2, _dying_rank, transport, when, min_ranks=1, timeout_s=4 * TIMEOUT_S)
    kind, peer, message = outcome.results[0]
    assert (kind, peer) == (PeerFailureError.__name__, 1), message
    assert "recv from rank 1 (tag 0)" in message


def _exchange(group: allreduce.ProcessGroup, value: float) -> float:
    """Rank 0 sends ``value`` to rank 1, which sends back twice what it got: what each received."""
    y = np.zeros(3)
    if group.rank == 0:
        group.send(np.full(3, value), 1)
        group.recv(y, 1)
    elif group.rank == 1:
        group.recv(y, 0)
        group.send(y * 2, 0)
    return float(y[0])


def _after_shrink(transport: str) -> tuple[int, float]:
    """Point-to-point before rank 2 dies, then on the shrunk group (new channels, new keys)."""
    group = allreduce.init(transport=transport, timeout_s=TIMEOUT_S)
    try:
        _exchange(group, 1.0)
        if group.rank == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            while True:
                group.all_reduce(np.ones(4))
        except CollectiveError:
            group = group.shrink()
        return group.rank, _exchange(group, 5.0)
    finally:
        group.close()


@pytest.mark.slow
def test_the_survivors_of_a_shrink_send_and_receive_on_new_channels() -> None:
    outcome = spawn_elastic(3, _after_shrink, "tcp", min_ranks=2, timeout_s=4 * TIMEOUT_S)
    assert outcome.results == {0: (0, 10.0), 1: (1, 5.0)}


# ------------------------------------------------------------------------------------------- in-process groups
def _threads(world_size: int, fn: Any) -> list[Any]:
    """``fn(group)`` on each rank of an in-process group, each in its own thread: the results by rank."""
    import threading

    groups = local_groups(world_size, timeout_s=TIMEOUT_S)
    results: list[Any] = [None] * world_size

    def run(group: allreduce.ProcessGroup) -> None:
        try:
            results[group.rank] = fn(group)
        except Exception as exc:
            results[group.rank] = exc
        finally:
            group.close()

    threads = [threading.Thread(target=run, args=(g,)) for g in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    return results


def test_an_in_process_group_sends_and_receives_in_order_per_tag() -> None:
    assert _threads(2, _tags_out_of_order)[1] == [2.0, 1.0, 3.0]


# ------------------------------------------------------------------------------------------- a hostile peer
def _raw_peer(store: Any, frame: bytes) -> socket.socket:
    """A connection to rank 0's channel that passes the handshake as rank 1 (it knows the secret), then sends
    ``frame`` where a message header belongs."""
    address = store.get("p2p/0/addr/0").decode()
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    hello = ClientHello(rank=1, world_size=2, target=0)
    connect_handshake(sock, b"p2p", store.group_secret(), hello, what="rank 0")
    sock.sendall(frame)
    return sock


@pytest.mark.parametrize(
    ("frame", "says"),
    [
        (b"X" * HEADER_SIZE, "bad frame magic"),
        (encode_header(sequence=0, step=2, block=0, segment=0, length=(1 << 40) - 1), "not a whole number"),
        (encode_header(sequence=5, step=2, block=0, segment=0, length=4), "message 5 of tag 0 where message 0"),
    ],
    ids=["garbage", "oversized", "out of sequence"],
)
def test_a_malformed_header_fails_the_receive_naming_the_peer(frame: bytes, says: str) -> None:
    store = MemoryStore(TIMEOUT_S)
    for rank in (0, 1):
        store.set(f"allreduce/host/{rank}", b"this process")
    channels = PointToPoint(0, 2, store, epoch=0)
    try:
        work = channels.irecv(np.zeros(4, np.float32), 1, 0, timeout_s=TIMEOUT_S)
        with _raw_peer(store, frame), pytest.raises(ProtocolError, match=says) as info:
            work.wait()
        assert info.value.peer == 1
        assert "malformed message from rank 1" in str(info.value)
    finally:
        channels.close()


def test_a_send_waiting_for_a_peer_that_never_listens_ends_when_the_group_closes() -> None:
    group, silent = local_groups(2, timeout_s=TIMEOUT_S)
    started = time.monotonic()
    work = group.isend(np.ones(4 << 20), 1)  # rank 1 makes no point-to-point call: no address to send to
    group.close()
    silent.close()
    with pytest.raises(CollectiveError, match="send to rank 1 \\(tag 0\\): the group is closed"):
        work.wait()
    assert time.monotonic() - started < TIMEOUT_S


def _flood(group: allreduce.ProcessGroup) -> Any:
    """Rank 0 sends 6 messages of 512 KiB nobody receives yet; rank 1 looks at what it keeps, then receives them."""
    count = (512 << 10) // 4
    if group.rank == 0:
        works = [group.isend(np.full(count, float(i), np.float32), 1, tag=0) for i in range(6)]
        for work in works:
            work.wait()
        return None
    time.sleep(1.0)  # every message has had time to come
    inbox = group._p2p.inbox if group._p2p is not None else None
    kept = 0 if inbox is None else inbox._kept_bytes_total()
    received = []
    for _ in range(6):
        x = np.empty(count, np.float32)
        group.recv(x, 0, tag=0)
        received.append(float(x[0]) if np.all(x == x[0]) else -1.0)
    return kept, received


def test_messages_no_receive_waits_for_are_kept_only_up_to_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    from allreduce.runtime.p2p import _inbox

    monkeypatch.setattr(_inbox, "UNEXPECTED_LIMIT_BYTES", 1 << 20)
    _, (kept, received) = _threads(2, _flood)
    assert kept <= 1 << 20  # the reader stopped reading: the rest waits in the kernel's buffers and the sender
    assert received == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]  # and every message still arrives, in order
