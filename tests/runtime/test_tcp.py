"""The TCP transport between real processes: every all-reduce algorithm, exact integer sums, failures named.

One set of spawned processes per world size runs every algorithm and every awkward count, so the suite stays
fast; each worker checks its result against the closed form and reports mismatches to the parent.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from test_group_harness import kill_rounds

from allreduce.runtime import CollectiveError, compile_plan
from allreduce.runtime._store import TCPStore
from allreduce.runtime.tcp import TcpTransport
from allreduce.runtime.tcp._socket import LOOPBACK_SNDBUF_BYTES as _LOOPBACK_SNDBUF_BYTES
from allreduce.runtime.tcp._transport import THREAD_MIN_BYTES as _THREAD_MIN_BYTES
from allreduce.schedules import ALL_REDUCE_ALGORITHMS, all_reduce

SPAWN = mp.get_context("spawn")
COUNTS = (0, 1, 2, 7, 13, 97, 1000, 65_537)
# 12 MiB of int64, odd: big enough that the steps go through the sender thread at N <= 5.
LARGE_COUNT = (3 << 19) + 7
# Generous: N=8 oversubscribes the 2 cores of the CI machine.
TIMEOUT_S = 120.0


def add_into(dst: np.ndarray, src: np.ndarray) -> None:
    np.add(dst, src, out=dst)


def rank_data(rank: int, count: int) -> np.ndarray:
    return np.arange(count, dtype=np.int64) * (rank + 1) + rank


def exact_sum(world_size: int, count: int) -> np.ndarray:
    # sum over r of (i*(r+1) + r) = i*N(N+1)/2 + N(N-1)/2
    return np.arange(count, dtype=np.int64) * (world_size * (world_size + 1) // 2) + world_size * (world_size - 1) // 2


def schedules_for(world_size: int, segments: int = 1) -> list[tuple[str, Any]]:
    out = []
    for name in ALL_REDUCE_ALGORITHMS:
        kwargs: dict[str, int] = {"segments": segments}
        if name == "hierarchical":
            if world_size % 2:
                continue
            kwargs["group_size"] = 2
        out.append((name, all_reduce(name, world_size, **kwargs)))
    return out


# ----------------------------------------------------------------------------------- harness


def _setup(rank: int, world_size: int, port: int, **transport_kwargs: Any) -> tuple[TCPStore, TcpTransport]:
    store = TCPStore("127.0.0.1", port, is_server=False, world_size=world_size, rank=rank, timeout_s=TIMEOUT_S)
    return store, TcpTransport(rank, world_size, store, timeout_s=TIMEOUT_S, **transport_kwargs)


def _worker(scenario: str, rank: int, world_size: int, port: int, out: Any, *args: Any) -> None:
    try:
        store, transport = _setup(rank, world_size, port)
        try:
            result = SCENARIOS[scenario](rank, world_size, store, transport, *args)
            out.put((rank, "ok", result))
        finally:
            transport.close()
            store.close()
    except CollectiveError as exc:
        out.put((rank, type(exc).__name__, (str(exc), exc.peer)))
    except BaseException:
        out.put((rank, "crash", traceback.format_exc()))


def run_ranks(
    scenario: str,
    world_size: int,
    *args: Any,
    wait_for: set[int] | None = None,
    kill: Callable[..., None] | None = None,
) -> dict[int, tuple[str, Any]]:
    """Run ``scenario`` on ``world_size`` spawned ranks (rank 0's store hosted here); results by rank."""
    server = TCPStore("127.0.0.1", 0, is_server=True, world_size=world_size, rank=-1, timeout_s=TIMEOUT_S)
    out = SPAWN.Queue()
    procs = [
        SPAWN.Process(target=_worker, args=(scenario, r, world_size, server.port, out, *args), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    if kill is not None:
        kill(server, procs)
    expected = set(range(world_size)) if wait_for is None else wait_for
    results: dict[int, tuple[str, Any]] = {}
    try:
        while not expected <= results.keys():
            rank, status, payload = out.get(timeout=240)
            results[rank] = (status, payload)
    except queue.Empty:
        pytest.fail(f"ranks {sorted(expected - results.keys())} never reported; got {results}")
    finally:
        server.set("test/release", b"")  # frees a rank parked outside the collective
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
        server.close()
    return results


# ----------------------------------------------------------------------------------- scenarios (in workers)


def _all_algorithms(rank: int, world_size: int, store: TCPStore, transport: TcpTransport, segments: int) -> list[str]:
    wrong = []
    seq = 0
    descriptors = transport.agree(seq, f"rank-{rank}".encode(), timeout_s=TIMEOUT_S)
    if descriptors != [f"rank-{r}".encode() for r in range(world_size)]:
        wrong.append(f"agree returned {descriptors}")
    for name, schedule in schedules_for(world_size, segments):
        for count in COUNTS:
            seq += 1
            buffer = rank_data(rank, count)
            plan = compile_plan(schedule, rank, count)
            transport.execute(plan, buffer, add_into, seq=seq, timeout_s=TIMEOUT_S, checksum=count % 2 == 1)
            if not np.array_equal(buffer, exact_sum(world_size, count)):
                bad = np.flatnonzero(buffer != exact_sum(world_size, count))
                wrong.append(f"{name} count={count}: {bad.size} wrong elements, first at {bad[0]}")
    return wrong


def _large_messages(rank: int, world_size: int, store: TCPStore, transport: TcpTransport) -> list[str]:
    """Every algorithm on steps big enough for the sender thread, with and without checksums; exact sums."""
    count = LARGE_COUNT
    wrong = []
    for seq, (name, schedule) in enumerate(schedules_for(world_size, segments=2)):
        buffer = rank_data(rank, count)
        transport.execute(
            compile_plan(schedule, rank, count), buffer, add_into, seq=seq, timeout_s=TIMEOUT_S, checksum=seq % 2 == 1
        )
        if not np.array_equal(buffer, exact_sum(world_size, count)):
            bad = np.flatnonzero(buffer != exact_sum(world_size, count))
            wrong.append(f"{name}: {bad.size} wrong elements, first at {bad[0]}")
    if transport._sender is None:
        wrong.append("the sender thread never ran")
    for peer in transport._peers.values():
        # The kernel doubles what is asked; autotuning would have grown it to megabytes.
        sndbuf = peer.sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        if sndbuf > 2 * _LOOPBACK_SNDBUF_BYTES:
            wrong.append(f"loopback send buffer to rank {peer.rank} is {sndbuf} bytes")
    return wrong


def _other_dtypes(rank: int, world_size: int, store: TCPStore, transport: TcpTransport) -> list[str]:
    """int8..float64 and bfloat16 over the ring with 3 segments; integer-valued data, so sums are exact."""
    import ml_dtypes

    wrong = []
    schedule = all_reduce("ring", world_size, segments=3)
    for seq, dtype in enumerate(
        [np.int8, np.uint8, np.int16, np.int32, np.float16, ml_dtypes.bfloat16, np.float32, np.float64]
    ):
        count = 1001
        buffer = ((np.arange(count) % 5) + rank).astype(dtype)
        transport.execute(
            compile_plan(schedule, rank, count), buffer, add_into, seq=seq, timeout_s=TIMEOUT_S, checksum=False
        )
        expected = ((np.arange(count) % 5) * world_size + world_size * (world_size - 1) // 2).astype(dtype)
        if not np.array_equal(buffer.astype(np.float64), expected.astype(np.float64)):
            wrong.append(f"dtype {np.dtype(dtype).name}")
    return wrong


def _max_op(rank: int, world_size: int, store: TCPStore, transport: TcpTransport) -> bool:
    buffer = np.array([rank, -rank, 7], dtype=np.int32)
    transport.execute(
        compile_plan(all_reduce("ring", world_size), rank, 3),
        buffer,
        lambda dst, src: np.maximum(dst, src, out=dst),
        seq=1,
        timeout_s=TIMEOUT_S,
        checksum=False,
    )
    return buffer.tolist() == [world_size - 1, 0, 7]


def _corrupt(rank: int, world_size: int, store: TCPStore, transport: TcpTransport, count: int) -> None:
    if rank == 1:
        transport.inject_corruption(peer=0, step=0)  # rank 1's first frame to rank 0 flips a byte
    buffer = rank_data(rank, count)
    transport.execute(
        compile_plan(all_reduce("ring", world_size), rank, count),
        buffer,
        add_into,
        seq=1,
        timeout_s=TIMEOUT_S,
        checksum=True,
    )


def _absent_peer(rank: int, world_size: int, store: TCPStore, transport: TcpTransport, absent: int) -> None:
    if rank == absent:
        store.get("test/release", timeout_s=TIMEOUT_S)  # never joins the collective; waits for the parent
        return
    buffer = rank_data(rank, 1000)
    transport.execute(
        compile_plan(all_reduce("ring", world_size), rank, 1000), buffer, add_into, seq=1, timeout_s=2.0, checksum=False
    )


def _mismatched_count(rank: int, world_size: int, store: TCPStore, transport: TcpTransport) -> None:
    count = 1000 + (rank == 1)
    buffer = rank_data(rank, count)
    transport.execute(
        compile_plan(all_reduce("ring", world_size), rank, count),
        buffer,
        add_into,
        seq=1,
        timeout_s=TIMEOUT_S,
        checksum=False,
    )


def _die_mid_collective(rank: int, world_size: int, store: TCPStore, transport: TcpTransport, victim: int) -> None:
    count = 4 << 20  # 32 MiB of int64: long enough that the victim dies mid-way
    schedule = all_reduce("ring", world_size, segments=4)
    buffer = rank_data(rank, count)
    plan = compile_plan(schedule, rank, count)
    transport.execute(plan, buffer, add_into, seq=1, timeout_s=TIMEOUT_S, checksum=False)
    store.set(f"test/ready/{rank}", b"")
    if rank == victim:
        store.get("test/never", timeout_s=TIMEOUT_S)  # the parent SIGKILLs us while the others run
    store.get("test/kill-sent", timeout_s=TIMEOUT_S)
    transport.execute(plan, buffer, add_into, seq=2, timeout_s=TIMEOUT_S, checksum=False)


SCENARIOS: dict[str, Callable[..., Any]] = {
    "all_algorithms": _all_algorithms,
    "other_dtypes": _other_dtypes,
    "large_messages": _large_messages,
    "max_op": _max_op,
    "corrupt": _corrupt,
    "absent_peer": _absent_peer,
    "mismatched_count": _mismatched_count,
    "die": _die_mid_collective,
}


# ----------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 8])
def test_every_algorithm_exact_on_integers(world_size: int) -> None:
    segments = 1 if world_size in (1, 8) else world_size - 1  # exercise segment pipelining too
    results = run_ranks("all_algorithms", world_size, segments)
    for rank, (status, payload) in results.items():
        assert status == "ok", f"rank {rank}: {status}: {payload}"
        assert payload == [], f"rank {rank}: {payload}"


@pytest.mark.parametrize("world_size", [2, 3, 5])
def test_large_messages_through_the_sender_thread(world_size: int) -> None:
    assert LARGE_COUNT * 8 // world_size >= _THREAD_MIN_BYTES  # a ring step's sends go through the thread
    for rank, (status, payload) in run_ranks("large_messages", world_size).items():
        assert (status, payload) == ("ok", []), f"rank {rank}"


def test_dtypes_and_other_ops() -> None:
    for rank, (status, payload) in run_ranks("other_dtypes", 3).items():
        assert (status, payload) == ("ok", []), f"rank {rank}"
    assert all(r == ("ok", True) for r in run_ranks("max_op", 2).values())


@pytest.mark.parametrize("count", [4096, LARGE_COUNT])  # sent from the calling thread, from the sender thread
def test_checksum_names_the_corrupting_link(count: int) -> None:
    results = run_ranks("corrupt", 2, count)
    status, (message, peer) = results[0]
    assert status == "ChecksumError"
    assert "link rank 1 -> rank 0" in message
    assert peer == 1
    # Rank 1 is told by rank 0's abort and raises the same kind of error, naming the same link.
    assert results[1][0] == "ChecksumError"
    assert "link rank 1 -> rank 0" in results[1][1][0]


def test_timeout_names_the_missing_peer() -> None:
    results = run_ranks("absent_peer", 3, 2, wait_for={0, 1})
    for rank in (0, 1):
        status, (message, peer) = results[rank]
        assert status == "CollectiveTimeoutError", message
        assert "rank 2" in message or "rank(s) 2" in message
        assert peer == 2


def test_mismatched_sizes_raise_on_every_rank() -> None:
    results = run_ranks("mismatched_count", 2)
    for rank, (status, (message, _)) in results.items():
        assert status == "MismatchError", f"rank {rank}: {message}"
        assert "different plan" in message


@pytest.mark.parametrize("world_size", [2, 4])
def test_killed_peer_is_named_by_every_rank(world_size: int) -> None:
    victim = world_size - 1

    def kill_victim(server: TCPStore, procs: list[Any]) -> None:
        server.wait([f"test/ready/{r}" for r in range(world_size)], timeout_s=240)
        os.kill(procs[victim].pid, signal.SIGKILL)
        server.set("test/kill-sent", b"")

    survivors = set(range(world_size)) - {victim}
    results = run_ranks("die", world_size, victim, wait_for=survivors, kill=kill_victim)
    for rank in survivors:
        status, payload = results[rank]
        assert status == "PeerFailureError", f"rank {rank}: {status} {payload}"
        message, peer = payload
        assert peer == victim, f"rank {rank}: {message}"
        assert f"rank {victim}" in message


def test_bad_arguments_fail_before_any_data_moves() -> None:
    with TCPStore("127.0.0.1", 0, is_server=True, world_size=1, rank=0, timeout_s=30) as store:
        with TcpTransport(0, 1, store) as transport:
            plan = compile_plan(all_reduce("ring", 1), 0, 10)
            with pytest.raises(ValueError, match="buffer must be 1-D, contiguous and hold 10 elements"):
                transport.execute(plan, np.zeros(11), add_into, seq=0, timeout_s=1, checksum=False)
            with pytest.raises(ValueError, match="is for rank 1 of 2, but this transport is rank 0 of 1"):
                transport.execute(
                    compile_plan(all_reduce("ring", 2), 1, 10),
                    np.zeros(10),
                    add_into,
                    seq=0,
                    timeout_s=1,
                    checksum=False,
                )
        with pytest.raises(ValueError, match="beyond loopback: set a shared token"):
            TcpTransport(0, 1, store, host="0.0.0.0", token=None)


def _token_worker(rank: int, port: int, token: str, wrong: bool, out: Any) -> None:
    try:
        store = TCPStore("127.0.0.1", port, is_server=False, world_size=2, rank=rank, timeout_s=60, token="store")
        transport = TcpTransport(rank, 2, store, host="0.0.0.0", token=token, timeout_s=60)
        buffer = rank_data(rank, 100)
        if wrong and rank == 0:
            # Time out only after rank 1 has been refused, so the refusal is there to be reported.
            store.get("test/refused", timeout_s=60)
        plan = compile_plan(all_reduce("ring", 2), rank, 100)
        try:
            transport.execute(plan, buffer, add_into, seq=0, timeout_s=2.0 if wrong else 60.0, checksum=False)
        finally:
            if wrong and rank == 1:
                store.set("test/refused", b"")
            # Leave cleanly: a rank that exits without close() is reported dead to the next iteration's ranks.
            transport.close()
            store.close()
        out.put((rank, "ok", bool(np.array_equal(buffer, exact_sum(2, 100)))))
    except CollectiveError as exc:
        out.put((rank, type(exc).__name__, str(exc)))


def test_transport_beyond_loopback_requires_the_right_token() -> None:
    with TCPStore("0.0.0.0", 0, is_server=True, world_size=2, rank=-1, token="store", timeout_s=60) as server:
        for tokens, wrong in ((("t", "t"), False), (("t", "wrong"), True)):
            out = SPAWN.Queue()
            procs = [SPAWN.Process(target=_token_worker, args=(r, server.port, tokens[r], wrong, out)) for r in (0, 1)]
            for p in procs:
                p.start()
            results = {r: (s, m) for r, s, m in (out.get(timeout=120) for _ in procs)}
            for p in procs:
                p.join(timeout=60)
            if not wrong:
                assert results == {0: ("ok", True), 1: ("ok", True)}
            else:
                # Rank 1 (the connecting side) is refused; rank 0 never sees an authenticated peer and times out
                # naming rank 1 and the refusal.
                assert results[1][0] == "ProtocolError", results[1]
                assert "wrong token" in results[1][1]
                assert results[0][0] == "CollectiveTimeoutError", results[0]
                assert "rank(s) 1" in results[0][1]
                assert "wrong token" in results[0][1]
            for r in (0, 1):
                server.delete(f"tcp/addr/{r}")


# ----------------------------------------------------------------------------------- SIGKILL, repeated


def _looping_rank(rank: int, world_size: int, port: int, started: Any, out: Any) -> None:
    _store, transport = _setup(rank, world_size, port)
    plan = compile_plan(all_reduce("ring", world_size, segments=2), rank, 1 << 17)
    buffer = np.zeros(1 << 17, np.int64)  # 1 MiB: the kill lands mid-collective most of the time
    seq = 0
    transport.execute(plan, buffer, add_into, seq=seq, timeout_s=60, checksum=False)
    started.put(rank)
    try:
        while True:
            seq += 1
            transport.execute(plan, buffer, add_into, seq=seq, timeout_s=60, checksum=False)
    except CollectiveError as exc:
        out.put((rank, type(exc).__name__, exc.peer, str(exc), time.monotonic()))
    finally:
        transport.close()
        out.close()
        out.join_thread()  # the report must leave before _exit, which skips the queue's feeder thread
        os._exit(0)  # skip interpreter teardown in a forked child (inherited threads and handlers)


def _kill_launcher(repetitions: int, world_size: int, results: Any) -> None:
    """Runs in one spawned process and forks each rank set from it (fast: numpy is already imported)."""
    fork = mp.get_context("fork")

    def start(rep: int, started: Any, out: Any) -> tuple[list[Any], Callable[[], None]]:
        server = TCPStore("127.0.0.1", 0, is_server=True, world_size=world_size, rank=-1, timeout_s=60)
        procs = [
            fork.Process(target=_looping_rank, args=(r, world_size, server.port, started, out))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        return procs, server.close

    results.put(kill_rounds(repetitions, world_size, start))


def test_sigkill_20_times_every_survivor_names_the_victim() -> None:
    results = SPAWN.Queue()
    launcher = SPAWN.Process(target=_kill_launcher, args=(20, 3, results))
    launcher.start()
    runs = results.get(timeout=280)
    launcher.join(timeout=30)
    assert launcher.exitcode == 0
    assert len(runs) == 20
    for victim, _killed_at, reports in runs:
        assert None not in reports, f"a survivor of the kill of rank {victim} never raised (hang)"
        for rank, kind, peer, message, _raised_at in reports:
            assert rank != victim
            # A PeerFailureError, not the 60 s CollectiveTimeoutError: detected, not timed out.
            assert kind == "PeerFailureError", message
            assert peer == victim, message
            assert f"rank {victim}" in message
    worst_s = max(raised - killed for _, killed, reports in runs for *_, raised in reports)
    print(f"slowest survivor raised {worst_s * 1e3:.0f} ms after the SIGKILL")
