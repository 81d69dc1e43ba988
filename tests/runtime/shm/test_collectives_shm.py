"""Every collective × algorithm × dtype × op on the shared-memory transport, real processes, exact references.

One set of processes per world size (a module-scoped fixture) runs the matrix of collective_matrix (which
test_tcp_group.py runs over TCP), each all-reduce over four homes of its buffer; each rank reports the combinations
it got wrong and, per home, the paths its executes took (from the transport's ``statistics()``). One test per
behaviour (and per collective and algorithm) reads that report.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from collective_matrix import WORLD_SIZES, assert_exact, assert_ran, case_id, cases, run_matrix

import allreduce
from allreduce.runtime import ProcessGroup
from allreduce.runtime.launcher._spawn import spawn
from allreduce.runtime.shm import CROSS_MEMORY_MIN_BYTES, ShmTransport
from allreduce.runtime.shm._huge_pages import huge_pages_likely

_PATHS = ("eager", "shared", "cross_memory", "staged")


def _path_taken(shm: ShmTransport, before: dict[str, int]) -> str | None:
    """Which path the one execute since ``before`` (a ``statistics()``) took; None if it had nothing to move."""
    after = shm.statistics()
    taken = [path for path in _PATHS if after[f"executes_{path}"] != before[f"executes_{path}"]]
    assert len(taken) <= 1, taken
    return taken[0] if taken else None


def _matrix_rank(group: allreduce.ProcessGroup) -> dict[str, Any]:
    """The matrix, its all-reduces taking turns over four homes of their buffer (every algorithm meets each home
    with many dtypes, ops and sizes; every home of every call was four times the calls for no path the turns miss),
    each rank picking its own path (readers follow the data's owner): small plain arrays through per-step snapshots
    (eager), plain arrays read in place by peers (process_vm_readv), plain arrays staged through shared memory on
    odd ranks, group.empty() arrays next to eager ranks."""
    shm = group.transport
    assert isinstance(shm, ShmTransport)
    rank = group.rank
    paths: set[tuple[str, str]] = set()
    turns = itertools.cycle(("eager", "cross", "staged", "shm"))

    def homes(x: np.ndarray[Any, Any]) -> Iterator[tuple[str, np.ndarray[Any, Any]]]:
        for mode in (next(turns),):
            y = x.copy()
            if mode == "shm":
                y = group.empty(x.size, x.dtype)
                y[...] = x
            shm.cross_memory = not (mode == "staged" and rank % 2)
            shm.cross_memory_min_bytes = 0
            eager = mode == "eager" or (mode == "shm" and rank % 2 == 0)
            shm.eager_bytes = 64 << 10 if eager else 0
            before = dict(shm.statistics())
            yield mode, y
            if (path := _path_taken(shm, before)) is not None:
                paths.add((mode, path))

    report = run_matrix(group, homes)
    report["cross_memory_available"] = bool(shm.statistics()["cross_memory_available"])
    report["paths"] = paths
    return report


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"world{n}")
def matrix(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    """Each rank's report of the whole matrix, for one world size (one set of processes per world size)."""
    return spawn(request.param, _matrix_rank, init_options={"transport": "shm", "timeout_s": 120}, timeout_s=240)


def _moving_data(matrix: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The reports of a group whose collectives move data (a group of one takes no path at all)."""
    if len(matrix) == 1:
        pytest.skip("a group of one moves no data")
    return matrix


def _yama_ptrace_scope() -> int | None:
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read())
    except OSError:
        return None


@pytest.mark.slow
def test_the_probe_finds_cross_memory_reads_where_the_kernel_allows_them(matrix: list[dict[str, Any]]) -> None:
    if _yama_ptrace_scope() not in (None, 0):
        pytest.skip("Yama restricts ptrace here: the probe may rightly find cross-memory reads refused")
    for result in _moving_data(matrix):
        assert result["cross_memory_available"]


@pytest.mark.slow
@pytest.mark.parametrize("case", cases(), ids=case_id)
def test_every_dtype_and_op_is_exact_over_shm(matrix: list[dict[str, Any]], case: tuple[str, str]) -> None:
    assert_exact(matrix, case)


@pytest.mark.slow
def test_the_matrix_ran_over_shm(matrix: list[dict[str, Any]]) -> None:
    assert_ran(matrix, "shm")


@pytest.mark.slow
def test_small_buffers_go_through_eager_snapshots(matrix: list[dict[str, Any]]) -> None:
    for result in _moving_data(matrix):
        assert ("eager", "eager") in result["paths"]


@pytest.mark.slow
def test_plain_arrays_are_read_in_place_exactly_when_the_probe_allows(matrix: list[dict[str, Any]]) -> None:
    # The start-up probe decides (refused under Yama ptrace_scope >= 1): the path taken must follow it.
    for result in _moving_data(matrix):
        expected = "cross_memory" if result["cross_memory_available"] else "staged"
        assert {path for mode, path in result["paths"] if mode == "cross"} == {expected}


@pytest.mark.slow
def test_a_rank_that_turns_cross_memory_off_stages(matrix: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(_moving_data(matrix)):
        staged = ("staged", "staged") in result["paths"]
        assert staged == (rank % 2 == 1 or not result["cross_memory_available"])


@pytest.mark.slow
def test_shared_arrays_are_read_in_place(matrix: list[dict[str, Any]]) -> None:
    for result in _moving_data(matrix):
        assert ("shm", "shared") in result["paths"]


# ----------------------------------------------------------------------------------- which path each buffer takes
def _paths_rank() -> dict[str, Any]:
    """Each case once, on default knobs unless it says otherwise: the path its execute took, by case."""
    rank, n, port = (int(os.environ[name]) for name in ("RANK", "WORLD_SIZE", "MASTER_PORT"))
    taken: dict[str, Any] = {}
    shm = ShmTransport(rank, n, f"paths-{port}", timeout_s=120)
    with ProcessGroup(shm, transport_name="shm", timeout_s=120) as group:
        taken["cross_memory_available"] = bool(shm.statistics()["cross_memory_available"])
        buffers: list[tuple[str, Any, dict[str, Any]]] = [
            ("small", np.full(1024, rank + 1.0, np.float32), {}),
            ("small_with_checksum", np.full(1024, rank + 1.0, np.float32), {"checksum": True}),
            ("medium_plain", np.full(1 << 18, rank + 1.0, np.float32), {}),
            ("large_plain", np.full(CROSS_MEMORY_MIN_BYTES // 4, rank + 1.0, np.float32), {}),
        ]
        shared = group.zeros(1 << 18, np.float32)
        shared[...] = rank + 1.0
        buffers.append(("medium_shared", shared, {}))
        taken["large_plain_on_huge_pages"] = huge_pages_likely({c: x for c, x, _ in buffers}["large_plain"])
        for case, x, kwargs in buffers:
            before = dict(shm.statistics())
            group.all_reduce(x, algorithm="ring", **kwargs)
            taken[case] = (_path_taken(shm, before), bool((x == n * (n + 1) / 2).all()))
        shm.eager_bytes = 0
        before = dict(shm.statistics())
        y = np.full(1024, rank + 1.0, np.float32)
        group.all_reduce(y, algorithm="ring")
        taken["small_without_eager"] = (_path_taken(shm, before), bool((y == n * (n + 1) / 2).all()))
    # a rank that declines cross-memory reads turns them off for the whole group
    declining = ShmTransport(rank, n, f"paths-off-{port}", timeout_s=120, cross_memory=rank == 0)
    with ProcessGroup(declining, transport_name="shm", timeout_s=120) as group:
        declining.cross_memory_min_bytes = 0
        before = dict(declining.statistics())
        z = np.full(1 << 18, rank + 1.0, np.float32)
        group.all_reduce(z, algorithm="ring")
        taken["declined"] = (_path_taken(declining, before), bool((z == n * (n + 1) / 2).all()))
        taken["declined_available"] = bool(declining.statistics()["cross_memory_available"])
    return taken


@pytest.fixture(scope="module")
def paths() -> list[dict[str, Any]]:
    return spawn(2, _paths_rank, group=False, timeout_s=240)


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("small", "eager"),
        ("small_with_checksum", "staged"),  # crc32s are of the buffer itself, not of snapshots
        ("small_without_eager", "staged"),
        ("medium_plain", "staged"),  # below CROSS_MEMORY_MIN_BYTES
        ("medium_shared", "shared"),
    ],
)
@pytest.mark.slow
def test_a_buffer_takes_the_path_its_size_and_home_call_for(
    paths: list[dict[str, Any]], case: str, expected: str
) -> None:
    for result in paths:
        assert result[case] == (expected, True)


def test_a_large_plain_array_is_read_in_place_exactly_when_the_probe_allows(paths: list[dict[str, Any]]) -> None:
    # ... and its memory is likely backed by huge pages (numpy's large arrays, unless the kernel has THP off)
    for result in paths:
        in_place = result["cross_memory_available"] and result["large_plain_on_huge_pages"]
        expected = "cross_memory" if in_place else "staged"
        assert result["large_plain"] == (expected, True)


def test_a_rank_that_declines_cross_memory_reads_turns_them_off_for_the_group(paths: list[dict[str, Any]]) -> None:
    for result in paths:
        assert not result["declined_available"]
        assert result["declined"] == ("staged", True)
