"""``allreduce bench``: a real N-rank run prints checked rows; bad input is one line and exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from allreduce.runtime._bench import expected_result, pattern
from allreduce.runtime._group import DTYPES, OPS


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
