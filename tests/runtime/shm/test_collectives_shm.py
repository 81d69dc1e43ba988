"""Every collective × algorithm × dtype × op on the shared-memory transport, real processes, exact references.

The same matrix runs over TCP in test_tcp_group.py (the worker is shared).

One set of processes per world size runs all combinations (a module-scoped fixture, so the suite stays fast); each
rank reports the combinations it got wrong and, per mode, the paths its executes took (from the transport's
``statistics()``). One test per behaviour reads that report.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from test_group_harness import contribution, reference, report, run_ranks

import allreduce
from allreduce.runtime import DTYPES, OPS, ProcessGroup
from allreduce.runtime.shm import CROSS_MEMORY_MIN_BYTES, ShmTransport
from allreduce.runtime.shm._huge_pages import huge_pages_likely
from allreduce.schedules import Collective, algorithms, block_bounds

INT_KINDS = "iu"


def _sizes(world_size: int) -> list[int]:
    # 0, 1, primes, and sizes that leave remainders against N blocks × 3 segments
    return [0, 1, 13, world_size * 3 + 1, 1031]


def _tolerance(dtype: np.dtype[Any]) -> float:
    return {2: 1e-2, 4: 1e-6, 8: 1e-12}.get(dtype.itemsize, 0.0) if dtype.kind == "f" or dtype.itemsize == 2 else 0.0


def _close(got: np.ndarray[Any, Any], want: np.ndarray[Any, Any], op: str) -> bool:
    if op != "avg" or got.dtype.kind in INT_KINDS:
        return bool(np.array_equal(got.view(np.uint8), want.view(np.uint8))) or bool(np.array_equal(got, want))
    return bool(np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=2e-2, atol=1e-2))


_PATHS = ("eager", "shared", "cross_memory", "staged")


def _path_taken(shm: ShmTransport, before: dict[str, int]) -> str | None:
    """Which path the one execute since ``before`` (a ``statistics()``) took; None if it had nothing to move."""
    after = shm.statistics()
    taken = [path for path in _PATHS if after[f"executes_{path}"] != before[f"executes_{path}"]]
    assert len(taken) <= 1, taken
    return taken[0] if taken else None


def _run_matrix(group: allreduce.ProcessGroup, shm: ShmTransport | None) -> dict[str, Any]:
    n, rank = group.world_size, group.rank
    failures: list[str] = []
    ran = 0
    paths: set[tuple[str, str]] = set()
    combos = [(dname, dt, op) for dname, dt in DTYPES.items() for op in OPS if not (op == "avg" and dt.kind in "iu")]
    for algorithm in algorithms(Collective.ALL_REDUCE):
        if algorithm == "hierarchical":
            group.group_size = 2 if n % 2 == 0 else n
        else:
            group.group_size = n
        for k, (dname, dt, op) in enumerate(combos):
            sizes = _sizes(n)
            # every size for one dtype per algorithm, a rotating size for the rest of the matrix
            for count in sizes if dname == "int32" else [sizes[k % len(sizes)], 1031]:
                # small plain arrays through per-step snapshots (eager), plain arrays read in place by peers
                # (process_vm_readv), plain arrays staged through shared memory on odd ranks, group.empty()
                # arrays next to eager ranks: each rank picks its own path, readers follow the data's owner
                for mode in ("eager", "cross", "staged", "shm"):
                    x = contribution(dt, count, rank, op)
                    if mode == "shm":
                        y = group.empty(count, dt)
                        y[...] = x
                        x = y
                    before = {}
                    if shm is not None:
                        shm.cross_memory = not (mode == "staged" and rank % 2)
                        shm.cross_memory_min_bytes = 0
                        eager = mode == "eager" or (mode == "shm" and rank % 2 == 0)
                        shm.eager_bytes = 64 << 10 if eager else 0
                        before = dict(shm.statistics())
                    group.all_reduce(x, op=op, algorithm=algorithm, segments=1 + count % 3)
                    ran += 1
                    if shm is not None and (path := _path_taken(shm, before)) is not None:
                        paths.add((mode, path))
                    if not _close(x, reference(dt, count, n, op), op):
                        failures.append(f"all_reduce {algorithm} {dname} {op} count={count} {mode}")
    group.group_size = n
    for algorithm in algorithms(Collective.REDUCE_SCATTER):
        for dname, dt, op in combos:
            for count in _sizes(n):
                x = contribution(dt, count, rank, op)
                block = group.reduce_scatter(x, op=op, algorithm=algorithm)
                lo, hi = (int(v) for v in block_bounds(count, n)[rank : rank + 2])
                ran += 1
                if block.shape != (hi - lo,) or not _close(block, reference(dt, count, n, op)[lo:hi], op):
                    failures.append(f"reduce_scatter {algorithm} {dname} {op} count={count}")
    for algorithm in algorithms(Collective.ALL_GATHER):
        for dname, dt in DTYPES.items():
            for count in _sizes(n):
                bounds = block_bounds(count, n)
                want = np.concatenate(
                    [contribution(dt, count, r, "sum")[bounds[r] : bounds[r + 1]] for r in range(n)]
                ).astype(dt)
                x = np.zeros(count, dtype=dt)
                x[bounds[rank] : bounds[rank + 1]] = want[bounds[rank] : bounds[rank + 1]]
                group.all_gather(x, algorithm=algorithm)
                ran += 1
                if not np.array_equal(x.view(np.uint8), want.view(np.uint8)):
                    failures.append(f"all_gather {algorithm} {dname} count={count}")
    for algorithm in algorithms(Collective.BROADCAST):
        for root in sorted({0, n - 1, n // 2}):
            for dname, dt in DTYPES.items():
                for count in _sizes(n):
                    want = contribution(dt, count, root, "sum")
                    x = contribution(dt, count, rank, "sum") if rank == root else np.zeros(count, dt)
                    group.broadcast(x, root=root, algorithm=algorithm)
                    ran += 1
                    if not np.array_equal(x.view(np.uint8), want.view(np.uint8)):
                        failures.append(f"broadcast {algorithm} root={root} {dname} count={count}")
    for algorithm in algorithms(Collective.REDUCE):
        for root in sorted({0, n - 1}):
            for k, (dname, dt, op) in enumerate(combos):
                count = _sizes(n)[k % 5]
                mine = contribution(dt, count, rank, op)
                x = mine.copy()
                group.reduce(x, root=root, op=op, algorithm=algorithm)
                ran += 1
                want = reference(dt, count, n, op) if rank == root else mine
                if not _close(x, want, op):
                    failures.append(f"reduce {algorithm} root={root} {dname} {op} count={count}")
    return {
        "failures": failures,
        "ran": ran,
        "transport": group.transport_name,
        "cross_memory_available": bool(shm.statistics()["cross_memory_available"]) if shm is not None else False,
        "paths": paths,
    }


def _matrix_worker(rank: int, n: int, port: int, out: Any, transport: str) -> None:
    def body() -> dict[str, Any]:
        if transport == "shm":
            # built here rather than by init(), so that the test holds the transport and steers its knobs
            shm = ShmTransport(rank, n, f"matrix-{port}", timeout_s=120)
            with ProcessGroup(shm, transport_name="shm", timeout_s=120) as group:
                return _run_matrix(group, shm)
        with allreduce.init(rank, n, master_port=port, transport=transport, timeout_s=120) as group:
            return _run_matrix(group, None)

    report(out, rank, body)


@pytest.fixture(scope="module", params=[1, 2, 3, 4, 5, 8], ids=lambda n: f"world{n}")
def matrix(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    """Each rank's report of the whole matrix, for one world size (one set of processes per world size)."""
    results = run_ranks(request.param, _matrix_worker, "shm")
    for result in results:
        assert isinstance(result, dict), result
    return results


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
def test_every_collective_algorithm_dtype_and_op_is_exact_over_shm(matrix: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(matrix):
        assert result["transport"] == "shm"
        assert result["failures"] == [], f"rank {rank}: {result['failures'][:10]}"


@pytest.mark.slow
def test_every_combination_of_the_matrix_ran(matrix: list[dict[str, Any]]) -> None:
    for result in matrix:
        assert result["ran"] > 500


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
def _paths_worker(rank: int, n: int, port: int, out: Any) -> None:
    """Each case once, on default knobs unless it says otherwise: the path its execute took, by case."""

    def body() -> dict[str, Any]:
        taken: dict[str, Any] = {}
        shm = ShmTransport(rank, n, f"paths-{port}", timeout_s=120)
        with ProcessGroup(shm, transport_name="shm", timeout_s=120) as group:
            taken["cross_memory_available"] = bool(shm.statistics()["cross_memory_available"])
            cases: list[tuple[str, Any, dict[str, Any]]] = [
                ("small", np.full(1024, rank + 1.0, np.float32), {}),
                ("small_with_checksum", np.full(1024, rank + 1.0, np.float32), {"checksum": True}),
                ("medium_plain", np.full(1 << 18, rank + 1.0, np.float32), {}),
                ("large_plain", np.full(CROSS_MEMORY_MIN_BYTES // 4, rank + 1.0, np.float32), {}),
            ]
            shared = group.zeros(1 << 18, np.float32)
            shared[...] = rank + 1.0
            cases.append(("medium_shared", shared, {}))
            taken["large_plain_on_huge_pages"] = huge_pages_likely({c: x for c, x, _ in cases}["large_plain"])
            for case, x, kwargs in cases:
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

    report(out, rank, body)


@pytest.fixture(scope="module")
def paths() -> list[dict[str, Any]]:
    results = run_ranks(2, _paths_worker)
    for result in results:
        assert isinstance(result, dict), result
    return results


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
