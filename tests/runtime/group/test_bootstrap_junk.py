"""init() reading junk from the rendezvous store: one clear ProtocolError naming the key and the store.

Real store, real rank process: the test hosts the store as rank 0, plants a junk value where init() reads the
job id or a rank's host id, and starts rank 1, which must refuse it with an error that says what and where.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
from collections.abc import Iterator
from typing import Any

import pytest
from rank_processes import RANKS

import allreduce
from allreduce.runtime.store._store import TCPStore

TOKEN = "junk-test-token"
WORLD_SIZE = 2
TIMEOUT_S = 60.0  # rank 1 fails as soon as it reads the junk; this only turns a hang into a failure
VALID_JOB = b"0123456789abcdef0123456789abcdef"


def _rank_1(port: int, out: mp.Queue[tuple[str, str]]) -> None:
    try:
        allreduce.init(1, WORLD_SIZE, master_port=port, token=TOKEN, timeout_s=TIMEOUT_S).close()
    except Exception as exc:  # reported to the test, which asserts on it
        out.put((type(exc).__name__, str(exc)))
    else:
        out.put(("ok", ""))


@pytest.fixture
def store() -> Iterator[TCPStore]:
    host = TCPStore("127.0.0.1", 0, is_server=True, world_size=WORLD_SIZE, rank=0, timeout_s=TIMEOUT_S, token=TOKEN)
    yield host
    host.close(wait_for_ranks_s=0)


def _rank_1_outcome(port: int) -> tuple[str, str]:
    out: mp.Queue[tuple[str, str]] = RANKS.Queue()
    proc = RANKS.Process(target=_rank_1, args=(port, out), daemon=True)
    proc.start()
    try:
        return out.get(timeout=TIMEOUT_S * 2)
    except queue.Empty:
        raise AssertionError(f"rank 1 did not report within {TIMEOUT_S * 2} s") from None
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join()


@pytest.mark.parametrize("junk", [b"\xff" * 60, b"127.0.0.1:1", b""], ids=["not-utf8", "an-address", "empty"])
@pytest.mark.slow
def test_a_junk_job_id_is_refused_naming_the_key_and_the_store(store: TCPStore, junk: bytes) -> None:
    store.set("allreduce/job", junk)
    kind, message = _rank_1_outcome(store.port)
    assert kind == "ProtocolError", message
    assert f"rank 1: the rendezvous store at 127.0.0.1:{store.port} holds 'allreduce/job' = {junk[:40]!r}" in message
    assert "which is not a job id" in message
    assert "set ALLREDUCE_TOKEN" in message


@pytest.mark.parametrize("junk", [b"\xfe\xff", b"127.0.0.1:1", b"a/b c/1"], ids=["not-utf8", "an-address", "spaces"])
@pytest.mark.slow
def test_a_junk_host_id_is_refused_naming_the_key_and_the_store(store: TCPStore, junk: bytes) -> None:
    store.set("allreduce/job", VALID_JOB)
    store.set("allreduce/host/0", junk)
    kind, message = _rank_1_outcome(store.port)
    assert kind == "ProtocolError", message
    assert f"rank 1: the rendezvous store at 127.0.0.1:{store.port} holds 'allreduce/host/0' = {junk!r}" in message
    assert "which is not a host id" in message


@pytest.mark.slow
def test_a_junk_value_names_the_client_that_wrote_it(store: TCPStore) -> None:
    store.set("allreduce/job", b"not a job id")  # written by this process, seated as rank 0
    kind, message = _rank_1_outcome(store.port)
    assert kind == "ProtocolError", message
    assert "(written by rank 0 (127.0.0.1:" in message


def _init_reporting(rank: int, world_size: int, port: int, out: Any, go: Any = None) -> None:
    if go is not None:
        go.wait(TIMEOUT_S)
    try:
        allreduce.init(rank, world_size, master_port=port, token=TOKEN, timeout_s=TIMEOUT_S).close()
    except Exception as exc:
        out.put((rank, type(exc).__name__, str(exc)))
    else:
        out.put((rank, "ok", ""))


@pytest.mark.slow
def test_a_rank_joining_after_rank_0_gave_up_is_told_why() -> None:
    from test_group_harness import free_port

    port = free_port()
    out: Any = RANKS.Queue()
    go = RANKS.Event()
    procs = [
        RANKS.Process(target=_init_reporting, args=(0, 3, port, out), daemon=True),
        RANKS.Process(target=_init_reporting, args=(2, 3, port, out, go), daemon=True),  # joins when told to
    ]
    for proc in procs:
        proc.start()
    try:
        # a process with the job's token takes rank 1's seat and plants a junk host id: rank 0 gives up on it
        impostor = TCPStore("127.0.0.1", port, is_server=False, world_size=3, rank=1, timeout_s=TIMEOUT_S, token=TOKEN)
        impostor_address = f"127.0.0.1:{impostor._sock.getsockname()[1]}"  # type: ignore[union-attr]
        impostor.set("allreduce/host/1", b"junk")
        impostor.get("__dead__/0")  # rank 0 gave up: the store says so
        impostor.close()
        go.set()  # rank 2 joins only now
        reports = {rank: (kind, message) for rank, kind, message in (out.get(timeout=TIMEOUT_S) for _ in procs)}
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    assert reports[0][0] == "ProtocolError", reports[0]
    assert f"(written by rank 1 ({impostor_address}" in reports[0][1]
    assert "the group failed before rank 2 joined: rank 0 gave up" in reports[2][1], reports[2]
    assert f"written by rank 1 ({impostor_address}" in reports[2][1], reports[2]


@pytest.mark.slow
def test_a_rank_that_gives_up_tells_the_ranks_waiting_for_it_why(store: TCPStore) -> None:
    from allreduce.runtime import PeerFailureError

    store.set("allreduce/job", b"not a job id")
    kind, _ = _rank_1_outcome(store.port)
    assert kind == "ProtocolError"
    # rank 0 would wait for rank 1's host id until its timeout: the store says at once that rank 1 gave up, and why
    with pytest.raises(PeerFailureError, match=r"rank 1 gave up \(a client from 127\.0\.0\.1:\d+\): rank 1: .*job id"):
        store.wait(["allreduce/host/1"], timeout_s=TIMEOUT_S)
