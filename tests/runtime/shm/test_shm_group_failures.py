"""Reliability of the group over shared memory: dead ranks, mismatched calls, timeouts, corrupted data.

Real processes throughout: a killed rank is SIGKILLed, a missing rank really never calls.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from rank_processes import RANKS
from test_group_harness import kill_rounds

import allreduce
from allreduce.runtime import (
    CollectiveError,
    CollectiveTimeoutError,
    MismatchError,
    ProcessGroup,
    spawn,
)
from allreduce.runtime.shm import ShmTransport


# ----------------------------------------------------------------------------------- SIGKILL mid-collective
def _looping_rank(rank: int, n: int, job: str, started: Any, out: Any, *, plain: bool, small: bool = False) -> None:
    # 1 MiB: the kill lands in the data phase most of the time; a plain array is read by peers in the victim's
    # own memory (process_vm_readv), a group.zeros() array in its shared segment. small: 1 KiB with auto, the
    # one-pass small-call path (snapshots)
    transport = ShmTransport(rank, n, job, timeout_s=60, cross_memory_min_bytes=0)
    group = ProcessGroup(transport, transport_name="shm", timeout_s=60)
    algorithm = "auto" if small else "ring"
    if small:
        x = np.zeros(256, np.float32)
    else:
        x = np.zeros(1 << 18, np.float32) if plain else group.zeros(1 << 18, np.float32)
    group.all_reduce(x, algorithm=algorithm)
    started.put(rank)
    try:
        while True:
            group.all_reduce(x, algorithm=algorithm)
    except CollectiveError as exc:
        out.put((rank, type(exc).__name__, exc.peer, str(exc), time.monotonic()))
    finally:
        group.close()


def _kill_launcher(repetitions: int, world_size: int, results: Any, small: bool = False) -> None:
    """Runs in one rank process (rank_processes.RANKS) and forks each group from it (numpy is already imported)."""
    fork = mp.get_context("fork")

    def start(rep: int, started: Any, out: Any) -> tuple[list[Any], Callable[[], None]]:
        job = f"kill-{os.getpid()}-{rep}"
        kwargs = {"plain": rep % 2 == 1, "small": small}
        procs = [
            fork.Process(target=_looping_rank, args=(r, world_size, job, started, out), kwargs=kwargs)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        return procs, lambda: None

    results.put(kill_rounds(repetitions, world_size, start, report_timeout_s=30))


@pytest.mark.slow
@pytest.mark.parametrize("small", [False, True], ids=["1MiB-ring", "small-call-path"])
def test_sigkill_of_one_rank_makes_every_other_rank_raise_naming_it(small: bool) -> None:
    # The issue asks for "within 5 s". Ranks run with a 60 s collective timeout, so a PeerFailureError (not a
    # CollectiveTimeoutError) proves the death was detected by the peer-process watch, not by running out the
    # clock; the latency itself is not asserted (shared machines), benchmarks and the closing note report it.
    results = RANKS.Queue()
    launcher = RANKS.Process(target=_kill_launcher, args=(20, 3, results, small))
    launcher.start()
    runs = results.get(timeout=240)
    launcher.join(timeout=30)
    assert launcher.exitcode == 0
    assert len(runs) == 20
    for victim, killed_at, reports in runs:
        assert None not in reports, f"a survivor of the kill of rank {victim} never raised (hang)"
        for rank, kind, peer, message, raised_at in reports:
            assert rank != victim
            assert kind == "PeerFailureError", message
            assert peer == victim, message
            assert f"rank {victim}" in message
            assert raised_at >= killed_at
    # the survivors removed the dead ranks' segments; everyone else closed: nothing of these jobs is left
    pid_jobs = [f for f in os.listdir("/dev/shm") if f.startswith(f"allreduce-kill-{launcher.pid}-")]
    assert pid_jobs == []


# ----------------------------------------------------------------------------------- one process set, many cases
# One set of 3 processes (runtime.spawn, module-scoped fixture) runs every case below once, in this order (the
# last leaves the group broken); each test asserts one behaviour of what the ranks saw. One spawn per case would
# cost a process set each (2-7 s on this machine, load 3-18), for behaviours tested in milliseconds on the
# in-process transport too (tests/runtime/local/); these hold the shared-memory transport to them.
Seen = dict[str, Any]


def _mismatches(group: ProcessGroup, seen: Seen) -> None:
    """Mismatched sizes, collectives, dtypes, ops, roots, algorithms: every rank raises before any data moves."""
    rank = group.rank
    x = np.arange(10 + (rank == 2), dtype=np.int32)
    before = x.copy()
    try:
        group.all_reduce(x)
    except MismatchError as exc:
        seen["count_mismatch"] = str(exc)
    seen["untouched"] = bool(np.array_equal(x, before))
    for field, call in (
        ("collective", lambda: group.broadcast(np.zeros(4)) if rank == 1 else group.all_reduce(np.zeros(4))),
        ("dtype", lambda: group.all_reduce(np.zeros(4, np.float32 if rank else np.float64))),
        ("op", lambda: group.all_reduce(np.zeros(4), op="max" if rank == 0 else "sum")),
        ("root", lambda: group.broadcast(np.zeros(4), root=rank % 2)),
        ("algorithm", lambda: group.all_reduce(np.zeros(4), algorithm="ring" if rank else "direct")),
    ):
        try:
            call()
        except MismatchError as exc:
            seen[f"{field}_mismatch"] = str(exc)
    y = np.full(5, rank + 1, dtype=np.int64)
    group.all_reduce(y)
    seen["after_mismatch"] = y.tolist()


def _checksum_and_determinism(group: ProcessGroup, seen: Seen) -> None:
    """checksum=True on healthy data; deterministic=True gives the same bits whatever the algorithm."""
    rank, n = group.rank, group.world_size
    z = np.arange(1000, dtype=np.float32) * (rank + 1)
    group.all_reduce(z, checksum=True, algorithm="ring", segments=4)
    seen["checksum_ok"] = bool(np.array_equal(z, np.arange(1000, dtype=np.float32) * (n * (n + 1) // 2)))
    data = np.random.default_rng(rank).standard_normal(4099).astype(np.float32)
    results = []
    for algorithm in ("auto", "ring", "halving_doubling", "recursive_doubling", "direct", "double_binary_tree"):
        w = data.copy()
        group.all_reduce(w, algorithm=algorithm, deterministic=True)
        results.append(w.tobytes())
    seen["deterministic_same"] = len(set(results)) == 1
    seen["deterministic_digest"] = hashlib.sha256(results[0]).hexdigest()
    plain = [data.copy() for _ in range(2)]
    group.all_reduce(plain[0], algorithm="ring")
    group.all_reduce(plain[1], algorithm="recursive_doubling")
    seen["plain_differs"] = plain[0].tobytes() != plain[1].tobytes()


def _async_and_callbacks(group: ProcessGroup, seen: Seen) -> None:
    """Async handles keep call order; done callbacks run once each, in issue order, with the result readable;
    one added to a finished work runs at once; one that raises does not stop later collectives."""
    rank = group.rank
    bufs = [np.full(100, rank + i, dtype=np.int64) for i in range(3)]
    works = [group.all_reduce(b, async_op=True) for b in bufs]
    sync = np.ones(7, dtype=np.int64)
    group.all_reduce(sync)
    seen["async"] = [w.result()[0] for w in works] + [int(sync[0])] + [w.done() for w in works]
    calls: list[tuple[int, int]] = []
    cb_works = [group.all_reduce(np.full(4, rank + i, dtype=np.int64), async_op=True) for i in range(3)]
    for i, w in enumerate(cb_works):
        w.add_done_callback(lambda w, i=i: calls.append((i, int(w.wait()[0]))))
    bad = group.all_reduce(np.ones(2, dtype=np.int64), async_op=True)
    bad.add_done_callback({}.pop)  # raises KeyError
    after = group.all_reduce(np.ones(2, dtype=np.int64), async_op=True)
    after_value = after.wait().tolist()
    late: list[bool] = []
    cb_works[0].add_done_callback(lambda w: late.append(w.done()))
    seen["callbacks"] = (calls, late, after_value)


def _argument_errors(group: ProcessGroup, seen: Seen) -> None:
    """Local argument errors consume nothing and name the culprit."""
    errors = []
    for call in (
        lambda: group.all_reduce(np.zeros(3, np.int32), op="avg"),
        lambda: group.all_reduce(np.zeros(3, np.complex64)),
        lambda: group.all_reduce(np.zeros(3).view(np.ndarray).__array__().copy().setflags(write=False)),
        lambda: group.all_reduce(np.zeros(3), algorithm="bogus"),
        lambda: group.all_reduce(np.zeros(3), op="median"),
        lambda: group.broadcast(np.zeros(3), root=group.world_size),
        lambda: group.all_reduce([1, 2, 3]),
    ):
        try:
            call()
            errors.append("no error")
        except (TypeError, ValueError, AttributeError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    ro = np.zeros(3)
    ro.setflags(write=False)
    try:
        group.all_reduce(ro)
    except ValueError as exc:
        errors.append(f"ValueError: {exc}")
    seen["errors"] = errors
    v = np.ones(3, dtype=np.int64)
    group.all_reduce(v)
    seen["after_errors"] = v.tolist()


def _strided(group: ProcessGroup, seen: Seen) -> None:
    """Non-contiguous numpy arrays and torch tensors, reduced in place."""
    import torch

    rank = group.rank
    m = np.arange(24, dtype=np.float64).reshape(4, 6) * (rank + 1)
    group.all_reduce(m[:, ::2])
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6) * (rank + 1)
    tv = t[:, 1::2]
    same = group.all_reduce(tv)
    tb = torch.ones(33, dtype=torch.bfloat16) * (rank + 1)
    group.all_reduce(tb)
    ti = torch.arange(10, dtype=torch.int64)
    group.all_reduce(ti, op="max")
    seen["strided"] = (m.tolist(), t.tolist(), same is tv, tb.float().tolist(), ti.tolist())


def _corrupted_data(group: ProcessGroup, seen: Seen, job: str) -> None:
    """Corrupted data is caught and the link named (on a second group, unusable afterwards)."""
    rank, n = group.rank, group.world_size
    side = ProcessGroup(ShmTransport(rank, n, job, timeout_s=60), transport_name="shm", timeout_s=60)
    c = np.arange(64, dtype=np.int32)
    try:
        if rank == 0:
            side.transport.inject_corruption(peer=1, step=0)
        side.all_reduce(c, algorithm="direct", checksum=True)
    except Exception as exc:  # recorded for its own test; the other cases still run
        seen["checksum"] = (type(exc).__name__, str(exc))
    side.close()


def _rank_2_never_calls(group: ProcessGroup, seen: Seen, timed_out: Any) -> None:
    """The others time out naming rank 2, then learn the group failed; a closed group says so."""
    if group.rank != 2:
        try:
            group.all_reduce(np.zeros(8), timeout_s=1.0)
        except CollectiveTimeoutError as exc:
            seen["timeout"] = str(exc)
        timed_out.put(group.rank)
        try:
            group.all_reduce(np.zeros(2))
        except CollectiveError as exc:
            seen["broken"] = str(exc)
    else:
        for _ in range(group.world_size - 1):
            timed_out.get(timeout=60)  # stay alive (and silent) until both others have given up
        seen["timeout"] = "rank 2 stayed away"
        seen["broken"] = "collective (not called)"
    group.close()
    try:
        group.all_reduce(np.zeros(2))
    except CollectiveError as exc:
        seen["closed"] = str(exc)


def _scenarios(group: ProcessGroup, job: str, timed_out: Any) -> Seen:
    seen: Seen = {}
    for case in (_mismatches, _checksum_and_determinism, _async_and_callbacks, _argument_errors, _strided):
        case(group, seen)
    _corrupted_data(group, seen, job)
    _rank_2_never_calls(group, seen, timed_out)
    return seen


@pytest.fixture(scope="module")
def shm_scenario() -> list[Seen]:
    """What each of 3 shared-memory ranks saw in :func:`_scenarios`, by rank."""
    job = f"cks-{os.getpid()}"
    return spawn(3, _scenarios, job, RANKS.Queue(), init_options={"transport": "shm", "timeout_s": 60})


@pytest.mark.slow
def test_shm_count_mismatch_names_the_field_and_each_ranks_count(shm_scenario: list[Seen]) -> None:
    for seen in shm_scenario:
        assert "count" in seen["count_mismatch"]
        assert "rank 2: 11" in seen["count_mismatch"]


@pytest.mark.slow
def test_shm_mismatch_leaves_the_buffer_untouched(shm_scenario: list[Seen]) -> None:
    for seen in shm_scenario:
        assert seen["untouched"]


@pytest.mark.slow
@pytest.mark.parametrize("field", ["collective", "dtype", "op", "root", "algorithm"])
def test_shm_mismatch_names_the_field(shm_scenario: list[Seen], field: str) -> None:
    for seen in shm_scenario:
        assert field in seen[f"{field}_mismatch"], (field, seen)


@pytest.mark.slow
def test_shm_group_is_usable_after_a_mismatch(shm_scenario: list[Seen]) -> None:
    for seen in shm_scenario:
        assert seen["after_mismatch"] == [6] * 5


@pytest.mark.slow
def test_shm_checksum_passes_healthy_data(shm_scenario: list[Seen]) -> None:
    for seen in shm_scenario:
        assert seen["checksum_ok"]


@pytest.mark.slow
def test_shm_deterministic_gives_the_same_bits_whatever_the_algorithm(shm_scenario: list[Seen]) -> None:
    for seen in shm_scenario:
        assert seen["deterministic_same"]
    assert len({r["deterministic_digest"] for r in shm_scenario}) == 1


@pytest.mark.slow
def test_shm_async_collectives_complete_in_call_order(shm_scenario: list[Seen]) -> None:
    for seen in shm_scenario:
        assert seen["async"] == [3, 6, 9, 3, True, True, True]


@pytest.mark.slow
def test_shm_done_callbacks_run_in_order_and_survive_a_raising_one(shm_scenario: list[Seen]) -> None:
    for seen in shm_scenario:
        assert seen["callbacks"] == ([(0, 3), (1, 6), (2, 9)], [True], [3, 3])


@pytest.mark.slow
def test_shm_bad_arguments_name_the_culprit(shm_scenario: list[Seen]) -> None:
    for seen in shm_scenario:
        names = seen["errors"]
        assert "avg" in names[0]
        assert "int32" in names[0]
        assert "complex64" in names[1]
        assert "bogus" in names[3]
        assert "median" in names[4]
        assert "root" in names[5]
        assert "list" in names[6]
        assert "read-only" in names[7]


@pytest.mark.slow
def test_shm_bad_arguments_consume_nothing(shm_scenario: list[Seen]) -> None:
    for seen in shm_scenario:
        assert seen["after_errors"] == [3, 3, 3]


@pytest.mark.slow
def test_shm_strided_arrays_and_tensors_are_reduced_in_place(shm_scenario: list[Seen]) -> None:
    for rank, seen in enumerate(shm_scenario):
        m, t, same, tb, ti = seen["strided"]
        base = np.arange(24, dtype=np.float64).reshape(4, 6)
        expect_m = base * (rank + 1)
        expect_m[:, ::2] = base[:, ::2] * 6
        assert m == expect_m.tolist()
        expect_t = np.arange(24, dtype=np.float64).reshape(4, 6) * (rank + 1)
        expect_t[:, 1::2] = np.arange(24).reshape(4, 6)[:, 1::2] * 6
        assert t == expect_t.tolist()
        assert same
        assert tb == [6.0] * 33
        assert ti == list(range(10))


@pytest.mark.slow
def test_shm_corrupted_data_is_caught_naming_the_link(shm_scenario: list[Seen]) -> None:
    for rank, seen in enumerate(shm_scenario):
        kind, message = seen["checksum"]
        assert kind == "ChecksumError", message
        assert "rank 0" in message
        if rank == 1:
            assert "rank 0 -> rank 1" in message


@pytest.mark.slow
def test_shm_timeout_names_the_rank_that_never_called(shm_scenario: list[Seen]) -> None:
    for seen in shm_scenario:
        assert "rank 2" in seen["timeout"]


@pytest.mark.slow
def test_shm_group_is_unusable_after_a_timeout(shm_scenario: list[Seen]) -> None:
    for seen in shm_scenario:
        assert "collective" in seen["broken"]


@pytest.mark.slow
def test_shm_closed_group_says_it_is_closed(shm_scenario: list[Seen]) -> None:
    for seen in shm_scenario:
        assert "closed" in seen["closed"]


def test_a_group_of_one_needs_no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    monkeypatch.delenv("SLURM_NTASKS", raising=False)
    with allreduce.init() as group:
        assert (group.rank, group.world_size) == (0, 1)
        x = group.zeros((3, 4), np.float32) + 0
        x[...] = 2.0
        assert group.all_reduce(x, op="avg") is x
        assert x.tolist() == [[2.0] * 4] * 3


def test_init_reads_mpi_and_slurm_environment_and_rejects_bad_values(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="rank: 3 is not in a group of 2"):
        allreduce.init()
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="OMPI_COMM_WORLD_SIZE"):
        allreduce.init()
    monkeypatch.delenv("OMPI_COMM_WORLD_RANK")
    monkeypatch.delenv("OMPI_COMM_WORLD_SIZE")
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    with allreduce.init(transport="shm") as group:
        assert group.world_size == 1
    with pytest.raises(ValueError, match="transport"):
        allreduce.init(transport="carrier-pigeon")
