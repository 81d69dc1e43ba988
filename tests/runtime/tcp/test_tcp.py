"""The TCP transport between real processes: every all-reduce algorithm, exact integer sums, failures named.

The behaviours that leave the transport usable run on one set of rank processes per world size (a module-scoped
fixture that takes commands), one test per behaviour; each worker checks its result against the closed form and
reports what was wrong. Failures (corruption, a missing, mismatched or killed peer) get fresh processes each.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from rank_processes import RANKS
from test_group_harness import kill_rounds

from allreduce.runtime import CollectiveError, PeerFailureError, compile_plan
from allreduce.runtime.store._store import TCPStore
from allreduce.runtime.tcp import TcpTransport
from allreduce.runtime.tcp._socket import LOOPBACK_SNDBUF_BYTES
from allreduce.runtime.tcp._transport import THREAD_MIN_BYTES
from allreduce.schedules import algorithms, all_reduce

COUNTS = (0, 1, 2, 7, 13, 97, 1000, 65_537)
# 12 MiB of int64, odd: big enough that the steps go through the sender thread at N <= 5.
LARGE_COUNT = (3 << 19) + 7
# Generous: N=8 oversubscribes the 2 cores of the CI machine.
TIMEOUT_S = 120.0
UNIX_TOKEN = "unix-test-token"  # Unix sockets are taken only by ranks that share a token


def add_into(dst: np.ndarray, src: np.ndarray) -> None:
    np.add(dst, src, out=dst)


def rank_data(rank: int, count: int) -> np.ndarray:
    return np.arange(count, dtype=np.int64) * (rank + 1) + rank


def exact_sum(world_size: int, count: int) -> np.ndarray:
    # sum over r of (i*(r+1) + r) = i*N(N+1)/2 + N(N-1)/2
    return np.arange(count, dtype=np.int64) * (world_size * (world_size + 1) // 2) + world_size * (world_size - 1) // 2


def schedules_for(world_size: int, segments: int = 1) -> list[tuple[str, Any]]:
    out = []
    for name in algorithms(automatic=True):
        kwargs: dict[str, int] = {"segments": segments}
        if name == "hierarchical":
            if world_size % 2:
                continue
            kwargs["group_size"] = 2
        out.append((name, all_reduce(name, world_size, **kwargs)))
    return out


# ----------------------------------------------------------------------------------- harness
Scenario = Callable[..., Any]
"""What a rank runs: ``scenario(rank, world_size, store, transport, ...)``, a function of this module (sent to the
ranks by name, as pickle sends functions)."""


def _setup(
    rank: int, world_size: int, port: int, *, unix_sockets: bool = False, sender_thread: bool | None = None
) -> tuple[TCPStore, TcpTransport]:
    """Every connection on TCP, as between hosts; or ``unix_sockets``, as ranks of one host sharing a token."""
    store = TCPStore("127.0.0.1", port, is_server=False, world_size=world_size, rank=rank, timeout_s=TIMEOUT_S)
    token = UNIX_TOKEN if unix_sockets else None
    options: dict[str, Any] = {"unix_sockets": unix_sockets, "sender_thread": sender_thread}
    return store, TcpTransport(rank, world_size, store, token=token, timeout_s=TIMEOUT_S, **options)


def _worker(
    scenario: Scenario, rank: int, world_size: int, port: int, out: Any, *args: Any, unix_sockets: bool
) -> None:
    try:
        store, transport = _setup(rank, world_size, port, unix_sockets=unix_sockets)
        try:
            result = scenario(rank, world_size, store, transport, *args)
            out.put((rank, "ok", result))
        finally:
            transport.close()
            store.close()
    except CollectiveError as exc:
        out.put((rank, type(exc).__name__, (str(exc), exc.peer)))
    except BaseException:
        out.put((rank, "crash", traceback.format_exc()))


def run_ranks(
    scenario: Scenario,
    world_size: int,
    *args: Any,
    wait_for: set[int] | None = None,
    kill: Callable[..., None] | None = None,
    unix_sockets: bool = False,
) -> dict[int, tuple[str, Any]]:
    """Run ``scenario`` on ``world_size`` fresh rank processes (rank 0's store hosted here); results by rank."""
    server = TCPStore("127.0.0.1", 0, is_server=True, world_size=world_size, rank=-1, timeout_s=TIMEOUT_S)
    out = RANKS.Queue()
    procs = [
        RANKS.Process(
            target=_worker,
            args=(scenario, r, world_size, server.port, out, *args),
            kwargs={"unix_sockets": unix_sockets},
            daemon=True,
        )
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


def _pool_worker(rank: int, world_size: int, port: int, commands: Any, out: Any) -> None:
    """Serve commands ``(scenario, kwargs)`` on one transport until ``None``; report each result. The pool's ranks
    send large steps from the sender thread, as ranks with cores of their own do (here they would not)."""
    store, transport = _setup(rank, world_size, port, sender_thread=True)
    try:
        while (command := commands.get()) is not None:
            scenario, kwargs = command
            try:
                out.put((rank, "ok", scenario(rank, world_size, store, transport, **kwargs)))
            except CollectiveError as exc:
                out.put((rank, type(exc).__name__, (str(exc), exc.peer)))
            except BaseException:
                out.put((rank, "crash", traceback.format_exc()))
    finally:
        transport.close()
        store.close()


class RankPool:
    """``world_size`` rank processes, each holding one store client and one transport across many commands."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.server = TCPStore("127.0.0.1", 0, is_server=True, world_size=world_size, rank=-1, timeout_s=TIMEOUT_S)
        self.out = RANKS.Queue()
        self.commands = [RANKS.Queue() for _ in range(world_size)]
        self.procs = [
            RANKS.Process(target=_pool_worker, args=(r, world_size, self.server.port, self.commands[r], self.out))
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def run(self, scenario: Scenario, **kwargs: Any) -> dict[int, tuple[str, Any]]:
        """Results by rank of ``scenario`` run on every rank."""
        for commands in self.commands:
            commands.put((scenario, kwargs))
        results: dict[int, tuple[str, Any]] = {}
        try:
            while len(results) < self.world_size:
                rank, status, payload = self.out.get(timeout=240)
                results[rank] = (status, payload)
        except queue.Empty:
            pytest.fail(
                f"{scenario.__name__}: ranks {sorted(set(range(self.world_size)) - results.keys())} never reported"
            )
        return results

    def run_ok(self, scenario: Scenario, **kwargs: Any) -> dict[int, Any]:
        """Results by rank of a scenario that must succeed on every rank."""
        results = self.run(scenario, **kwargs)
        for rank, (status, payload) in results.items():
            assert status == "ok", f"rank {rank}: {status}: {payload}"
        return {rank: payload for rank, (_, payload) in results.items()}

    def close(self) -> None:
        for commands in self.commands:
            commands.put(None)
        for p in self.procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
                p.join()
        self.server.close()


@pytest.fixture(scope="module")
def pool(request: pytest.FixtureRequest) -> Iterator[RankPool]:
    """A :class:`RankPool` of ``request.param`` ranks, shared by the module's tests at that world size."""
    ranks = RankPool(request.param)
    yield ranks
    ranks.close()


def at_world_sizes(*world_sizes: int) -> pytest.MarkDecorator:
    """Run the test on a pool of each of ``world_sizes`` ranks."""
    return pytest.mark.parametrize("pool", world_sizes, indirect=True, ids=[f"N{n}" for n in world_sizes])


EVERY_WORLD_SIZE = (1, 2, 3, 4, 5, 8)


# ----------------------------------------------------------------------------------- scenarios (in workers)


def _agree(rank: int, world_size: int, store: TCPStore, transport: TcpTransport) -> list[bytes]:
    return transport.agree(0, f"rank-{rank}".encode(), timeout_s=TIMEOUT_S)


def _algorithm(
    rank: int,
    world_size: int,
    store: TCPStore,
    transport: TcpTransport,
    *,
    name: str,
    segments: int,
    counts: list[int],
    checksum: bool | None = None,
) -> list[str]:
    """``name`` at every count (``checksum`` None: on odd counts): what was not the exact sum."""
    schedule = dict(schedules_for(world_size, segments))[name]
    wrong = []
    for seq, count in enumerate(counts):
        buffer = rank_data(rank, count)
        plan = compile_plan(schedule, rank, count)
        with_crc = count % 2 == 1 if checksum is None else checksum
        transport.execute(plan, buffer, add_into, seq=seq, timeout_s=TIMEOUT_S, checksum=with_crc)
        if not np.array_equal(buffer, exact_sum(world_size, count)):
            bad = np.flatnonzero(buffer != exact_sum(world_size, count))
            wrong.append(f"{name} count={count}: {bad.size} wrong elements, first at {bad[0]}")
    return wrong


def _statistics(rank: int, world_size: int, store: TCPStore, transport: TcpTransport) -> dict[str, int]:
    return dict(transport.statistics())


def _dtype(rank: int, world_size: int, store: TCPStore, transport: TcpTransport, *, dtype_name: str) -> bool:
    """``dtype_name`` over the ring with 3 segments; integer-valued data, so the sum is exact."""
    import ml_dtypes

    dtype = ml_dtypes.bfloat16 if dtype_name == "bfloat16" else np.dtype(dtype_name)
    schedule = all_reduce("ring", world_size, segments=3)
    count = 1001
    buffer = ((np.arange(count) % 5) + rank).astype(dtype)
    transport.execute(compile_plan(schedule, rank, count), buffer, add_into, seq=0, timeout_s=TIMEOUT_S, checksum=False)
    expected = ((np.arange(count) % 5) * world_size + world_size * (world_size - 1) // 2).astype(dtype)
    return bool(np.array_equal(buffer.astype(np.float64), expected.astype(np.float64)))


def _max_op(rank: int, world_size: int, store: TCPStore, transport: TcpTransport) -> list[int]:
    buffer = np.array([rank, -rank, 7], dtype=np.int32)
    transport.execute(
        compile_plan(all_reduce("ring", world_size), rank, 3),
        buffer,
        lambda dst, src: np.maximum(dst, src, out=dst),
        seq=1,
        timeout_s=TIMEOUT_S,
        checksum=False,
    )
    return [int(v) for v in buffer]


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
    """The victim is SIGKILLed between two collectives; the others then run the second one. They poll for the
    go-ahead with ``check``: a blocking ``get`` fails naming the victim when the store sees it die before the
    go-ahead is set, and a rank that failed there would close its transport outside any collective, so its ring
    successor would rightly name it (ci12's one failure: rank 2 named rank 1)."""
    count = 4 << 20  # 32 MiB of int64: long enough that the victim dies mid-way
    schedule = all_reduce("ring", world_size, segments=4)
    buffer = rank_data(rank, count)
    plan = compile_plan(schedule, rank, count)
    transport.execute(plan, buffer, add_into, seq=1, timeout_s=TIMEOUT_S, checksum=False)
    store.set(f"test/ready/{rank}", b"")
    if rank == victim:
        store.get("test/never", timeout_s=TIMEOUT_S)  # the parent SIGKILLs us while the others run
    parked_until = time.monotonic() + TIMEOUT_S
    while not store.check(["test/kill-sent"]) and time.monotonic() < parked_until:
        time.sleep(0.05)
    transport.execute(plan, buffer, add_into, seq=2, timeout_s=TIMEOUT_S, checksum=False)


def _gives_up_unread(
    rank: int, world_size: int, store: TCPStore, transport: TcpTransport, linger_s: float = 0.0
) -> str:
    """A ring of 3: rank 2 gives up because of rank 0 while rank 1 sends to it (and never reads from it in this
    collective), then exits: at once (its unread input makes the kernel reset the connection) or, with
    ``linger_s``, after its abort has read everything rank 1 sends (rank 1 is then done sending and waits for rank 0).
    Rank 0 is parked outside the collective and tells rank 1 nothing: it polls for its release with ``check``, not
    a blocking ``get``, which the store fails once rank 2 dies (rank 0 would then close its connections, and rank 1
    could see that before rank 2's reset)."""
    small = compile_plan(all_reduce("ring", world_size), rank, 1000)
    transport.execute(small, rank_data(rank, 1000), add_into, seq=1, timeout_s=TIMEOUT_S, checksum=False)
    if rank == 0:
        parked_until = time.monotonic() + TIMEOUT_S
        while not store.check(["test/release"]) and time.monotonic() < parked_until:
            time.sleep(0.05)
        return "parked"
    if rank == 2:
        store.get("test/sending", timeout_s=TIMEOUT_S)
        time.sleep(0.5)  # rank 1's send to this rank has filled the socket buffers: it is blocked in send
        transport._record_failure(PeerFailureError("rank 2: rank 0 failed (injected)", rank=2, peer=0), 2)
        time.sleep(linger_s)  # the abort's drain thread reads what rank 1 sends meanwhile
        os._exit(0)
    count = 4 << 20  # 32 MiB of int64: far more than the socket buffers hold
    store.set("test/sending", b"")
    transport.execute(
        compile_plan(all_reduce("ring", world_size), rank, count),
        rank_data(rank, count),
        add_into,
        seq=2,
        timeout_s=TIMEOUT_S,
        checksum=False,
    )
    return "returned"


# ----------------------------------------------------------------------------------- tests


@at_world_sizes(*EVERY_WORLD_SIZE)
@pytest.mark.slow
def test_agree_gathers_every_rank_descriptor(pool: RankPool) -> None:
    expected = [f"rank-{r}".encode() for r in range(pool.world_size)]
    assert pool.run_ok(_agree) == dict.fromkeys(range(pool.world_size), expected)


@at_world_sizes(*EVERY_WORLD_SIZE)
@pytest.mark.parametrize("name", algorithms(automatic=True))
@pytest.mark.slow
def test_algorithm_is_exact_on_integers_at_awkward_counts(pool: RankPool, name: str) -> None:
    n = pool.world_size
    if name == "hierarchical" and n % 2:
        pytest.skip("hierarchical needs an even world size (groups of 2)")
    segments = 1 if n in (1, 8) else n - 1  # exercise segment pipelining too
    assert pool.run_ok(_algorithm, name=name, segments=segments, counts=list(COUNTS)) == {r: [] for r in range(n)}


@at_world_sizes(*EVERY_WORLD_SIZE)
def test_statistics_count_one_frame_per_ring_transfer(pool: RankPool) -> None:
    # A ring all-reduce sends and receives 2(N-1) frames per rank (one segment); no agreement frames here.
    n = pool.world_size
    before = pool.run_ok(_statistics)
    pool.run_ok(_algorithm, name="ring", segments=1, counts=[1000])
    after = pool.run_ok(_statistics)
    for rank in range(n):
        assert after[rank]["frames_sent"] - before[rank]["frames_sent"] == 2 * (n - 1), rank
        assert after[rank]["frames_received"] - before[rank]["frames_received"] == 2 * (n - 1), rank


@at_world_sizes(*EVERY_WORLD_SIZE)
def test_statistics_count_each_connection_once(pool: RankPool) -> None:
    # Every pair of ranks that talked is one connection: made by the higher rank, accepted by the lower one.
    pool.run_ok(_algorithm, name="ring", segments=1, counts=[1000])
    stats = pool.run_ok(_statistics)
    made = sum(s["connections_made"] for s in stats.values())
    accepted = sum(s["connections_accepted"] for s in stats.values())
    assert made == accepted
    assert made >= (pool.world_size if pool.world_size > 2 else pool.world_size - 1)


@pytest.mark.slow
@at_world_sizes(2, 3, 5)
@pytest.mark.parametrize("checksum", [False, True], ids=["windowed", "checksum"])
@pytest.mark.parametrize("name", algorithms(automatic=True))
def test_large_messages_through_the_sender_thread_are_exact(pool: RankPool, name: str, checksum: bool) -> None:
    # Without checksums a reduction streams through the window; with them it is verified whole first.
    n = pool.world_size
    assert LARGE_COUNT * 8 // n >= THREAD_MIN_BYTES  # a ring step's sends go through the thread
    if name == "hierarchical" and n % 2:
        pytest.skip("hierarchical needs an even world size (groups of 2)")
    assert pool.run_ok(_algorithm, name=name, segments=2, counts=[LARGE_COUNT], checksum=checksum) == {
        r: [] for r in range(n)
    }


@pytest.mark.slow
@at_world_sizes(2, 3, 5)
def test_large_steps_are_handed_to_the_sender_thread(pool: RankPool) -> None:
    pool.run_ok(_algorithm, name="ring", segments=2, counts=[LARGE_COUNT])
    for rank, stats in pool.run_ok(_statistics).items():
        assert stats["sender_handoffs"] > 0, f"rank {rank}: the sender thread never ran"


@at_world_sizes(*EVERY_WORLD_SIZE)
def test_small_steps_stay_in_the_calling_thread(pool: RankPool) -> None:
    before = pool.run_ok(_statistics)
    pool.run_ok(_algorithm, name="ring", segments=1, counts=[1000])
    after = pool.run_ok(_statistics)
    assert all(after[r]["sender_handoffs"] == before[r]["sender_handoffs"] for r in range(pool.world_size))


@at_world_sizes(2, 3, 5)
def test_loopback_send_buffers_stay_small(pool: RankPool) -> None:
    pool.run_ok(_algorithm, name="ring", segments=1, counts=[1000])
    for rank, stats in pool.run_ok(_statistics).items():
        # The kernel doubles what is asked; autotuning would have grown it to megabytes.
        assert 0 < stats["largest_send_buffer_bytes"] <= 2 * LOOPBACK_SNDBUF_BYTES, f"rank {rank}"


@at_world_sizes(3)
@pytest.mark.parametrize("dtype_name", ["int8", "uint8", "int16", "int32", "float16", "bfloat16", "float32", "float64"])
def test_dtype_sums_exactly(pool: RankPool, dtype_name: str) -> None:
    assert pool.run_ok(_dtype, dtype_name=dtype_name) == dict.fromkeys(range(3), True)


@at_world_sizes(2)
def test_max_op(pool: RankPool) -> None:
    assert pool.run_ok(_max_op) == {0: [1, 0, 7], 1: [1, 0, 7]}


# Sent from the calling thread, from the sender thread.
@pytest.mark.parametrize("unix_sockets", [False, True], ids=["tcp", "unix"])
@pytest.mark.parametrize("count", [4096, pytest.param(LARGE_COUNT, marks=pytest.mark.slow)])
def test_checksum_names_the_corrupting_link(count: int, unix_sockets: bool) -> None:
    results = run_ranks(_corrupt, 2, count, unix_sockets=unix_sockets)
    status, (message, peer) = results[0]
    assert status == "ChecksumError"
    assert "link rank 1 -> rank 0" in message
    assert peer == 1
    # Rank 1 is told by rank 0's abort and raises the same kind of error, naming the same link.
    assert results[1][0] == "ChecksumError"
    assert "link rank 1 -> rank 0" in results[1][1][0]


@pytest.mark.slow
@pytest.mark.parametrize("unix_sockets", [False, True], ids=["tcp", "unix"])
def test_timeout_names_the_missing_peer(unix_sockets: bool) -> None:
    results = run_ranks(_absent_peer, 3, 2, wait_for={0, 1}, unix_sockets=unix_sockets)
    for rank in (0, 1):
        status, (message, peer) = results[rank]
        assert status == "CollectiveTimeoutError", message
        assert "rank 2" in message or "rank(s) 2" in message
        assert peer == 2


@pytest.mark.parametrize("unix_sockets", [False, True], ids=["tcp", "unix"])
@pytest.mark.slow
def test_mismatched_sizes_raise_on_every_rank(unix_sockets: bool) -> None:
    results = run_ranks(_mismatched_count, 2, unix_sockets=unix_sockets)
    for rank, (status, (message, _)) in results.items():
        assert status == "MismatchError", f"rank {rank}: {message}"
        assert "different plan" in message


@pytest.mark.parametrize("unix_sockets", [False, True], ids=["tcp", "unix"])
@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_killed_peer_is_named_by_every_rank(world_size: int, unix_sockets: bool) -> None:
    victim = world_size - 1

    def kill_victim(server: TCPStore, procs: list[Any]) -> None:
        server.wait([f"test/ready/{r}" for r in range(world_size)], timeout_s=240)
        os.kill(procs[victim].pid, signal.SIGKILL)
        server.set("test/kill-sent", b"")

    survivors = set(range(world_size)) - {victim}
    results = run_ranks(
        _die_mid_collective, world_size, victim, wait_for=survivors, kill=kill_victim, unix_sockets=unix_sockets
    )
    for rank in survivors:
        status, payload = results[rank]
        assert status == "PeerFailureError", f"rank {rank}: {status} {payload}"
        message, peer = payload
        assert peer == victim, f"rank {rank}: {message}"
        assert f"rank {victim}" in message


@pytest.mark.parametrize("unix_sockets", [False, True], ids=["tcp", "unix"])
@pytest.mark.parametrize("linger_s", [0.0, 1.0], ids=["exits", "drains"])
@pytest.mark.slow
def test_a_peer_that_gave_up_is_heard_while_this_rank_waits_for_another(unix_sockets: bool, linger_s: float) -> None:
    """Rank 1 reads rank 2's ABORT frame while it sends to rank 2 or, once done sending, while it waits for the
    parked rank 0 (which before watching idle peers it saw only at its timeout, then naming rank 2)."""
    results = run_ranks(_gives_up_unread, 3, linger_s, wait_for={1}, unix_sockets=unix_sockets)
    status, payload = results[1]
    assert status == "PeerFailureError", f"rank 1: {status} {payload}"
    message, peer = payload
    assert peer == 0, f"rank 1: {message}"
    assert "rank 2 aborted collective 2" in message


@pytest.fixture
def solo() -> Iterator[TcpTransport]:
    """A transport of a group of one (no peers: arguments are checked, nothing moves)."""
    with (
        TCPStore("127.0.0.1", 0, is_server=True, world_size=1, rank=0, timeout_s=30) as store,
        TcpTransport(0, 1, store) as transport,
    ):
        yield transport


def test_a_buffer_that_does_not_fit_the_plan_is_refused(solo: TcpTransport) -> None:
    plan = compile_plan(all_reduce("ring", 1), 0, 10)
    with pytest.raises(ValueError, match="buffer must be 1-D, contiguous and hold 10 elements"):
        solo.execute(plan, np.zeros(11), add_into, seq=0, timeout_s=1, checksum=False)
    assert solo.failure is None  # an input error leaves the transport usable


def test_another_rank_plan_is_refused(solo: TcpTransport) -> None:
    with pytest.raises(ValueError, match="is for rank 1 of 2, but this transport is rank 0 of 1"):
        solo.execute(
            compile_plan(all_reduce("ring", 2), 1, 10), np.zeros(10), add_into, seq=0, timeout_s=1, checksum=False
        )


def test_a_closed_transport_raises_a_collective_error(solo: TcpTransport) -> None:
    solo.close()
    with pytest.raises(CollectiveError, match="rank 0: the tcp transport is closed"):
        solo.execute(
            compile_plan(all_reduce("ring", 1), 0, 10), np.zeros(10), add_into, seq=0, timeout_s=1, checksum=False
        )


@pytest.mark.slow
def test_corruption_can_only_be_injected_towards_another_rank(solo: TcpTransport) -> None:
    with pytest.raises(ValueError, match="peer 0 is not another rank"):
        solo.inject_corruption(peer=0)


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


def _run_token_pair(tokens: tuple[str, str], *, wrong: bool) -> dict[int, tuple[str, Any]]:
    """Ranks 0 and 1 with the transport listening beyond loopback, each with its token; results by rank."""
    with TCPStore("0.0.0.0", 0, is_server=True, world_size=2, rank=-1, token="store", timeout_s=60) as server:
        out = RANKS.Queue()
        procs = [RANKS.Process(target=_token_worker, args=(r, server.port, tokens[r], wrong, out)) for r in (0, 1)]
        for p in procs:
            p.start()
        results = {r: (s, m) for r, s, m in (out.get(timeout=120) for _ in procs)}
        for p in procs:
            p.join(timeout=60)
    return results


@pytest.mark.slow
def test_transport_beyond_loopback_with_the_right_token_sums_exactly() -> None:
    assert _run_token_pair(("t", "t"), wrong=False) == {0: ("ok", True), 1: ("ok", True)}


@pytest.mark.slow
def test_transport_beyond_loopback_refuses_a_wrong_token_on_both_sides() -> None:
    results = _run_token_pair(("t", "wrong"), wrong=True)
    # Rank 1 (the connecting side) is refused; rank 0 never sees an authenticated peer and times out
    # naming rank 1 and the refusal.
    assert results[1][0] == "ProtocolError", results[1]
    assert "wrong token" in results[1][1]
    assert results[0][0] == "CollectiveTimeoutError", results[0]
    assert "rank(s) 1" in results[0][1]
    assert "wrong token" in results[0][1]


# ----------------------------------------------------------------------------------- SIGKILL, repeated


def _looping_rank(rank: int, world_size: int, port: int, started: Any, out: Any, *, unix_sockets: bool) -> None:
    _store, transport = _setup(rank, world_size, port, unix_sockets=unix_sockets)
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


def _kill_launcher(repetitions: int, world_size: int, unix_sockets: bool, results: Any) -> None:
    """Runs in one rank process (rank_processes.RANKS) and forks each rank set from it (numpy already imported)."""
    fork = mp.get_context("fork")

    def start(rep: int, started: Any, out: Any) -> tuple[list[Any], Callable[[], None]]:
        server = TCPStore("127.0.0.1", 0, is_server=True, world_size=world_size, rank=-1, timeout_s=60)
        procs = [
            fork.Process(
                target=_looping_rank,
                args=(r, world_size, server.port, started, out),
                kwargs={"unix_sockets": unix_sockets},
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        return procs, server.close

    results.put(kill_rounds(repetitions, world_size, start))


@pytest.mark.slow
@pytest.mark.parametrize("unix_sockets", [False, True], ids=["tcp", "unix"])
def test_sigkill_20_times_every_survivor_names_the_victim(unix_sockets: bool) -> None:
    results = RANKS.Queue()
    launcher = RANKS.Process(target=_kill_launcher, args=(20, 3, unix_sockets, results))
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
