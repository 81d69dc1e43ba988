"""Sweeps in bounded resources: grids generated, not expanded; a bounded number of cases in flight; workers capped,
started as needed and tied to the sweep's process; an unreachable Dask scheduler said at once."""

from __future__ import annotations

import multiprocessing
import socket
import time
import tracemalloc
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import islice
from pathlib import Path
from typing import Any

import pytest

from allreduce.plan import MAX_WORKERS_PER_CPU, make_executor, max_workers, read_grid, run_sweep
from allreduce.plan._sweep import DASK_CONNECT_TIMEOUT_S

# 100 x 100 x 100 x 10 = 10^7 cases in a file of a few KB.
BIG_GRID = (
    "base: {size: 4KiB, topology: 'switch:8', gpus: 2, algorithm: ring}\n"
    "grid:\n"
    f"  seed: {list(range(100))}\n"
    f"  mfu: {[round(0.001 * (i + 1), 3) for i in range(100)]}\n"
    f"  backward_fraction: {[round(0.001 * (i + 1), 3) for i in range(100)]}\n"
    f"  accumulation: {list(range(1, 11))}\n"
)


def test_a_grid_of_ten_million_cases_is_counted_without_being_expanded(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    path.write_text(BIG_GRID)
    tracemalloc.start()
    try:
        grid = read_grid(path)
        first = list(islice(grid, 3))
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert grid.total == 10**7
    assert [c["accumulation"] for c in first] == [1, 2, 3]
    assert peak_bytes < 5e6  # the expanded list took 3.6 GB


class _CountingPool(ThreadPoolExecutor):
    """A thread pool that remembers the most cases it held submitted and unfinished at once."""

    def __init__(self) -> None:
        super().__init__(2)
        self.outstanding = 0
        self.most = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        self.outstanding += 1
        self.most = max(self.most, self.outstanding)
        future = super().submit(fn, *args, **kwargs)
        future.add_done_callback(self._finished)
        return future

    def _finished(self, _future: Future[Any]) -> None:
        self.outstanding -= 1


def test_cases_are_taken_from_the_grid_as_they_can_run(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    path.write_text(BIG_GRID)
    taken = 0

    def cases() -> Any:
        nonlocal taken
        for case in islice(read_grid(path), 40):
            taken += 1
            yield case

    with _CountingPool() as pool:
        summary = run_sweep(cases(), tmp_path / "out.csv", pool, in_flight=3)
    assert taken == 40
    assert summary.ran == 40
    assert pool.most <= 3


def test_more_workers_than_the_cap_are_refused_naming_the_flag_and_the_cap() -> None:
    cap = max_workers()
    with pytest.raises(ValueError, match=rf"--workers {cap + 1}: more than the cap of {cap} \({MAX_WORKERS_PER_CPU}"):
        make_executor("local", workers=cap + 1)


def _one_case(case: dict[str, Any]) -> int:
    return len(case)


def test_pool_workers_start_as_cases_need_them() -> None:
    executor = make_executor("local", workers=min(4, max_workers()))
    try:
        assert multiprocessing.active_children() == []
        for _ in range(3):  # one case at a time: one worker does them all
            assert executor.submit(_one_case, {"a": 1}).result(timeout=120) == 1
        assert len(multiprocessing.active_children()) == 1
    finally:
        executor.shutdown()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_refused_dask_scheduler_is_said_at_once() -> None:
    port = _closed_port()
    started = time.monotonic()
    refused = rf"cannot reach the Dask scheduler at 127.0.0.1:{port} \(Connection refused\)"
    with pytest.raises(ValueError, match=refused):
        make_executor(f"dask://127.0.0.1:{port}")
    assert time.monotonic() - started < DASK_CONNECT_TIMEOUT_S / 2  # distributed alone waited all 30 s


@pytest.mark.parametrize("address", ["dask://127.0.0.1", "dask://host:http", "dask://:8786"])
def test_a_scheduler_address_without_a_port_says_how_to_write_it(address: str) -> None:
    with pytest.raises(ValueError, match="write it as dask://HOST:PORT"):
        make_executor(address)


def test_a_grid_file_beyond_the_cap_is_refused_unparsed(tmp_path: Path) -> None:
    from allreduce.plan._sweep import MAX_GRID_BYTES

    path = tmp_path / "long.yaml"
    path.write_text("grid: {gpus: [2]}\n" + "# padding\n" * (MAX_GRID_BYTES // 10 + 1))
    with pytest.raises(ValueError, match=rf"{path.name}: larger than 1 MiB, the most a grid file may be"):
        read_grid(path)


def test_a_value_or_case_listed_twice_is_one_case(tmp_path: Path) -> None:
    path = tmp_path / "twice.yaml"
    path.write_text(
        "base: {params: 1e6, compute_ms: 10, topology: 'switch:8'}\n"
        "grid: {gpus: [2, 4, 2]}\n"
        "cases: [{gpus: 8}, {gpus: 8, algorithm: auto}]\n"  # auto is the default: the same case
    )
    grid = read_grid(path)
    assert grid.total == 3
    assert [c["gpus"] for c in grid] == [2, 4, 8]
