"""init() reading junk from the rendezvous store: one clear ProtocolError naming the key and the store.

Real store, real rank process: the test hosts the store as rank 0, plants a junk value where init() reads the
job id or a rank's host id, and starts rank 1, which must refuse it with an error that says what and where.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
from collections.abc import Iterator

import pytest

import allreduce
from allreduce.runtime._store import TCPStore

SPAWN = mp.get_context("spawn")
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
    out: mp.Queue[tuple[str, str]] = SPAWN.Queue()
    proc = SPAWN.Process(target=_rank_1, args=(port, out), daemon=True)
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
def test_a_junk_job_id_is_refused_naming_the_key_and_the_store(store: TCPStore, junk: bytes) -> None:
    store.set("allreduce/job", junk)
    kind, message = _rank_1_outcome(store.port)
    assert kind == "ProtocolError", message
    assert f"rank 1: the rendezvous store at 127.0.0.1:{store.port} holds 'allreduce/job' = {junk[:40]!r}" in message
    assert "which is not a job id" in message
    assert "set ALLREDUCE_TOKEN" in message


@pytest.mark.parametrize("junk", [b"\xfe\xff", b"127.0.0.1:1", b"a/b c/1"], ids=["not-utf8", "an-address", "spaces"])
def test_a_junk_host_id_is_refused_naming_the_key_and_the_store(store: TCPStore, junk: bytes) -> None:
    store.set("allreduce/job", VALID_JOB)
    store.set("allreduce/host/0", junk)
    kind, message = _rank_1_outcome(store.port)
    assert kind == "ProtocolError", message
    assert f"rank 1: the rendezvous store at 127.0.0.1:{store.port} holds 'allreduce/host/0' = {junk!r}" in message
    assert "which is not a host id" in message
