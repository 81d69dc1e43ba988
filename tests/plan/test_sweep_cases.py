"""Sweeps: grid files, pure cases, failures recorded, re-runs skip, local pool and a real Dask cluster."""

from __future__ import annotations

import csv
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import pytest

from allreduce.plan import case_id, load_grid, make_executor, plan_step, request_of, run_case, run_sweep
from allreduce.schedules import all_reduce
from allreduce.sim import simulate
from allreduce.topology import parse_topology

SRC = str(Path(__file__).resolve().parents[2] / "src")
BASE = {"params": 2e7, "compute_ms": 20, "topology": "fat-tree:k=4", "algorithm": "ring"}


def rows_of(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def write_grid(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "grid.yaml"
    path.write_text(text)
    return path


def test_a_grid_expands_to_every_combination_over_the_base(tmp_path: Path) -> None:
    grid = write_grid(
        tmp_path,
        "base: {params: 1e6, compute_ms: 10, topology: 'switch:8'}\ngrid:\n  gpus: [2, 4, 8]\n  dtype: [bf16, fp32]\n",
    )
    cases = load_grid(grid)
    assert len(cases) == 6
    assert {(c["gpus"], c["dtype"]) for c in cases} == {(g, d) for g in (2, 4, 8) for d in ("bf16", "fp32")}
    assert all(c["topology"] == "switch:8" for c in cases)


def test_an_unknown_parameter_is_named_with_the_file(tmp_path: Path) -> None:
    grid = write_grid(tmp_path, "grid:\n  gpu_count: [2]\n")
    with pytest.raises(ValueError, match=r"grid\.yaml: grid: unknown parameter 'gpu_count'"):
        load_grid(grid)


def test_a_case_is_a_pure_function_of_its_parameters() -> None:
    case = {**BASE, "gpus": 8}
    row = run_case(case)
    assert row["error"] == ""
    assert row["step_s"] == plan_step(request_of(case)).step.step_s
    assert row["case_id"] == case_id(dict(case))


def test_a_size_case_is_one_simulated_all_reduce() -> None:
    row = run_case({"size": "8MiB", "gpus": 16, "topology": "fat-tree:k=4", "algorithm": "ring"})
    expected = simulate(all_reduce("ring", 16), parse_topology("fat-tree:k=4"), size_bytes=8 * 2**20).seconds
    assert row["buckets"] == 1
    assert row["step_s"] == pytest.approx(expected, rel=1e-9, abs=0)


def test_a_failing_case_is_recorded_with_its_error() -> None:
    row = run_case({**BASE, "gpus": 64})
    assert "has only 16 GPUs" in row["error"]
    assert "step_s" not in row


def test_local_pool_runs_every_case_and_a_rerun_skips_those_with_a_result(tmp_path: Path) -> None:
    cases = [{**BASE, "gpus": n} for n in (2, 4, 8, 16, 64)]
    out = tmp_path / "sweep.csv"
    with ProcessPoolExecutor(2) as pool:
        first = run_sweep(cases, out, pool)
    assert (first.ran, first.failed, first.skipped) == (5, 1, 0)
    rows = rows_of(out)
    assert sorted(int(r["gpus"]) for r in rows) == [2, 4, 8, 16, 64]
    by_gpus = {int(r["gpus"]): r for r in rows}
    assert float(by_gpus[8]["step_s"]) == plan_step(request_of(cases[2])).step.step_s
    assert by_gpus[64]["error"]
    with ProcessPoolExecutor(2) as pool:
        again = run_sweep([*cases, {**BASE, "gpus": 12}], out, pool)
    assert (again.ran, again.skipped) == (2, 4)  # the new case, and the failed one again
    rows = rows_of(out)
    assert sorted(int(r["gpus"]) for r in rows) == [2, 4, 8, 12, 16, 64]  # the failed row replaced, not doubled


def test_any_executor_works_a_thread_pool_too(tmp_path: Path) -> None:
    with ThreadPoolExecutor(2) as pool:
        summary = run_sweep([{**BASE, "gpus": 4}], tmp_path / "t.csv", pool)
    assert summary.ran == 1
    assert rows_of(tmp_path / "t.csv")[0]["error"] == ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def dask_cluster() -> Iterator[str]:
    pytest.importorskip("distributed")
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    dask = [sys.executable, "-m", "distributed.cli.dask_scheduler"]
    scheduler = subprocess.Popen(
        [*dask, "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "distributed.cli.dask_worker",
            f"tcp://127.0.0.1:{port}",
            "--nworkers",
            "2",
            "--nthreads",
            "1",
            "--no-dashboard",
            "--host",
            "127.0.0.1",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while True:  # the sweep refuses a scheduler that is not listening yet, as it would a refused address
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or scheduler.poll() is not None:
                    raise
                time.sleep(0.2)
        yield f"dask://127.0.0.1:{port}"
    finally:
        for process in (worker, scheduler):
            process.terminate()
        for process in (worker, scheduler):
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.mark.slow
def test_a_dask_cluster_of_two_worker_processes_runs_the_sweep(tmp_path: Path, dask_cluster: str) -> None:
    cases = [{**BASE, "gpus": n} for n in (2, 4, 8, 16, 64)]
    executor = make_executor(dask_cluster)
    try:
        distributed = pytest.importorskip("distributed")
        client = distributed.get_client()
        client.wait_for_workers(2, timeout=120)
        workers = client.scheduler_info()["workers"]
        summary = run_sweep(cases, tmp_path / "dask.csv", executor)
    finally:
        executor.shutdown()
    assert len(workers) == 2
    assert {w["host"] for w in workers.values()} == {"127.0.0.1"}
    assert (summary.ran, summary.failed) == (5, 1)
    local = {int(r["gpus"]): r["step_s"] for r in rows_of(tmp_path / "dask.csv")}
    assert float(local[16]) == plan_step(request_of(cases[3])).step.step_s


def test_an_unknown_executor_is_refused() -> None:
    with pytest.raises(ValueError, match="use local or dask://HOST:PORT"):
        make_executor("spark://x")


def test_a_parquet_copy_has_every_row_when_pyarrow_is_there(tmp_path: Path) -> None:
    parquet = pytest.importorskip("pyarrow.parquet", reason="pyarrow is optional: the sweep then writes CSV only")
    cases = [{**BASE, "gpus": n} for n in (2, 4, 64)]
    with ThreadPoolExecutor(2) as pool:
        summary = run_sweep(cases, tmp_path / "p.csv", pool)
    assert summary.parquet == tmp_path / "p.parquet"
    table = parquet.read_table(summary.parquet)
    assert table.num_rows == 3
    assert sorted(table.column("gpus").to_pylist()) == [2, 4, 64]
