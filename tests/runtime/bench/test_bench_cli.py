"""``allreduce bench``: a real N-rank run prints checked rows; bad input is one line and exit status 2."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from allreduce.cli._tune import fit_cost_model
from allreduce.runtime import DTYPES, OPS
from allreduce.runtime.bench._bench import expected_result, pattern
from allreduce.runtime.group._cost_models import SHM_FUSED_BYTES
from allreduce.runtime.group._tune import load_cost_model, save_cost_model
from allreduce.schedules import CostModel


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "allreduce", "bench", *args], capture_output=True, text=True, timeout=240, check=False
    )


@pytest.mark.slow
def test_bench_prints_checked_rows_for_each_size() -> None:
    done = _bench("-n", "3", "--sizes", "4KiB,12KiB,1MiB", "--iters", "3", "--dtype", "int32", "--json")
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert [r["size_bytes"] for r in rows] == [4096, 12288, 1 << 20]
    assert all(r["wrong"] == 0 and r["time_s"] > 0 and r["world_size"] == 3 for r in rows)
    assert all(r["busbw_Bps"] == pytest.approx(r["algbw_Bps"] * 4 / 3) for r in rows)
    table = _bench("-n", "2", "--sizes", "64KiB", "--iters", "2", "--algorithm", "ring", "--copy")
    assert table.returncode == 0, table.stderr
    assert "busbw(GB/s)" in table.stdout
    assert "ring" in table.stdout
    assert "out of bounds values: 0 OK" in table.stdout


@pytest.mark.parametrize(
    ("args", "culprit"),
    [
        (("--dtype", "complex64"), "--dtype"),
        (("--op", "avg", "--dtype", "int8"), "avg"),
        (("--sizes", "3", "--dtype", "float32"), "--sizes"),
        (("--sizes", "lots"), "--sizes"),
        (("--algorithm", "magic"), "--algorithm"),
        (("-n", "0"), "-n"),
    ],
)
@pytest.mark.slow
def test_bench_rejects_bad_input_in_one_line(args: tuple[str, ...], culprit: str) -> None:
    done = _bench(*args)
    assert done.returncode == 2
    assert culprit in done.stderr
    assert "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_bench_reference_is_the_exact_reduction_of_the_pattern(dtype: str, op: str, world_size: int) -> None:
    dt = DTYPES[dtype]
    if op == "avg" and dt.kind in "iu":
        return
    stack = np.stack([pattern(dt, 50, r, op).astype(np.float64) for r in range(world_size)])
    exact = {
        "sum": stack.sum(0),
        "avg": stack.sum(0) / world_size,
        "min": stack.min(0),
        "max": stack.max(0),
        "prod": stack.prod(0),
    }[op]
    assert np.array_equal(
        expected_result(dt, 50, world_size, op).astype(np.float64), exact.astype(dt).astype(np.float64)
    )


@pytest.mark.slow
def test_tune_measures_and_caches_a_model_that_auto_then_reads(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # `tune` is registered by the lead in cli/_main.py; drive its handler through a parser of its own here.
    from allreduce.cli import _tune

    parser = argparse.ArgumentParser()
    _tune.register(parser.add_subparsers())
    monkeypatch.setenv("ALLREDUCE_TUNE_FILE", str(tmp_path / "tune.json"))
    args = parser.parse_args(["tune", "-n", "2", "--transport", "shm", "--small", "4KiB", "--large", "4MiB"])
    assert args.handler(args) == 0
    data = json.loads((tmp_path / "tune.json").read_text())
    entry = next(iter(data.values()))["shm"]
    assert entry["latency_s"] > 0
    assert entry["bandwidth_Bps"] > 0
    model = load_cost_model("shm")
    assert model is not None
    assert model.latency_s == entry["latency_s"]
    assert load_cost_model("tcp") is None  # not measured: auto falls back to the built-in defaults


def test_a_corrupt_tune_file_means_defaults(tmp_path: Any) -> None:
    path = tmp_path / "tune.json"
    path.write_text("{not json")
    assert load_cost_model("shm", path=path) is None
    save_cost_model("shm", CostModel(latency_s=1e-5, bandwidth_Bps=5e9, reduce_bandwidth_Bps=7e9), path=path)
    model = load_cost_model("shm", path=path)
    assert model == CostModel(latency_s=1e-5, bandwidth_Bps=5e9, reduce_bandwidth_Bps=7e9)


def test_a_tune_file_from_before_fused_bytes_gets_the_transports_built_in_value(tmp_path: Any) -> None:
    path = tmp_path / "tune.json"
    save_cost_model("shm", CostModel(latency_s=1e-5, bandwidth_Bps=5e9, reduce_bandwidth_Bps=7e9), path=path)
    save_cost_model("tcp", CostModel(latency_s=4e-5, bandwidth_Bps=2e9, reduce_bandwidth_Bps=7e9), path=path)
    data = json.loads(path.read_text())
    for entry in next(iter(data.values())).values():
        del entry["fused_bytes"]  # the file as earlier versions wrote it
    path.write_text(json.dumps(data))
    shm, tcp = load_cost_model("shm", path=path), load_cost_model("tcp", path=path)
    assert shm is not None
    assert shm.fused_bytes == SHM_FUSED_BYTES
    assert tcp is not None
    assert tcp.fused_bytes == 0.0


def test_an_unbounded_fused_bytes_round_trips_through_the_tune_file(tmp_path: Any) -> None:
    path = tmp_path / "tune.json"
    model = CostModel(latency_s=1e-5, bandwidth_Bps=5e9, reduce_bandwidth_Bps=7e9, fused_bytes=math.inf)
    save_cost_model("shm", model, path=path)
    assert load_cost_model("shm", path=path) == model


def test_fit_recovers_the_constants_of_a_synthetic_ring() -> None:
    alpha, bw, red = 10e-6, 4e9, 8e9
    n, large = 4, 64 << 20

    def ring_s(size: int) -> float:
        return 2 * (n - 1) * alpha + 2 * (n - 1) / n * size / bw + (n - 1) / n * size / red

    model = fit_cost_model(n, small_s=2 * (n - 1) * alpha, large_bytes=large, large_s=ring_s(large), reduce_Bps=red)
    assert model.latency_s == pytest.approx(alpha)
    assert model.bandwidth_Bps == pytest.approx(bw)


@pytest.mark.slow
def test_bench_runs_a_user_algorithm_given_as_a_file_spec(tmp_path: Path) -> None:
    (tmp_path / "algo.py").write_text(
        "from allreduce.schedules import ring_all_reduce\n\n\n"
        "def my_ring(world_size):\n    return ring_all_reduce(world_size)\n"
    )
    done = _bench(
        "-n", "2", "--sizes", "4KiB", "--iters", "2", "--algorithm", f"{tmp_path / 'algo.py'}:my_ring", "--json"
    )
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(done.stdout)
    assert row["algorithm"] == "my_ring"
    assert row["wrong"] == 0


@pytest.mark.slow
def test_tune_repeats_and_reports_the_median_and_range(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from allreduce.cli import _tune

    parser = argparse.ArgumentParser()
    _tune.register(parser.add_subparsers())
    monkeypatch.setenv("ALLREDUCE_TUNE_FILE", str(tmp_path / "tune.json"))
    argv = ["tune", "-n", "2", "--transport", "shm", "--small", "4KiB", "--large", "1MiB", "--repeats", "3"]
    args = parser.parse_args(argv)
    assert args.handler(args) == 0
    out = capsys.readouterr().out
    assert "median of 3 runs" in out
    low, high = out.split("alpha=")[1].split("(")[1].split(")")[0].split(" to ")
    median = float(out.split("alpha=")[1].split("us")[0])
    assert float(low.removesuffix("us")) <= median <= float(high.removesuffix("us"))
    entry = next(iter(json.loads((tmp_path / "tune.json").read_text()).values()))["shm"]
    assert entry["latency_s"] == pytest.approx(median * 1e-6, rel=0.01)


def test_tune_refuses_zero_repeats(capsys: pytest.CaptureFixture[str]) -> None:
    from allreduce.cli import _tune

    parser = argparse.ArgumentParser()
    _tune.register(parser.add_subparsers())
    with pytest.raises(SystemExit):
        parser.parse_args(["tune", "--repeats", "0"])
    assert "--repeats must be >= 1, got 0" in capsys.readouterr().err
