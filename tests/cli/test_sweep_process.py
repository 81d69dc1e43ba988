"""``allreduce sweep`` as a process: a grid of 10^7 cases starts at once in bounded memory, and a SIGKILL of the
sweep takes its pool workers with it."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")
# 100 x 100 x 100 x 10 = 10^7 one-all-reduce cases, each a few milliseconds.
BIG_GRID = (
    "base: {size: 4KiB, topology: 'switch:8', gpus: 2, algorithm: ring}\n"
    "grid:\n"
    f"  seed: {list(range(100))}\n"
    f"  mfu: {[round(0.001 * (i + 1), 3) for i in range(100)]}\n"
    f"  backward_fraction: {[round(0.001 * (i + 1), 3) for i in range(100)]}\n"
    f"  accumulation: {list(range(1, 11))}\n"
)
# Time for a sweep's first rows on a loaded machine: two spawned workers import numpy and allreduce first.
FIRST_ROWS_TIMEOUT_S = 120
# A process tied to its parent by PR_SET_PDEATHSIG is killed when the parent dies; allow the kernel a while.
ORPHAN_TIMEOUT_S = 30
# An interrupted sweep waits for the cases running (milliseconds each here) and stops its pool.
INTERRUPT_TIMEOUT_S = 60


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _children(pid: int) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.add(int(entry.name))
    return found


def _is_resource_tracker(pid: int) -> bool:
    try:
        return b"resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def _data_rows(path: Path) -> int:
    try:
        return max(0, len(path.read_text().splitlines()) - 1)
    except OSError:
        return 0


@pytest.fixture
def big_sweep(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    grid = tmp_path / "big.yaml"
    grid.write_text(BIG_GRID)
    out = tmp_path / "out.csv"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "allreduce", "sweep", str(grid), "-o", str(out), "--workers", "2"]
    errors = tmp_path / "stderr.txt"
    with errors.open("wb") as stderr:
        # a session of its own, as a shell's foreground job is: Ctrl-C reaches its whole process group. SIGINT as a
        # foreground job has it, too: a test run started in the background of a non-interactive shell (`... &`)
        # inherits SIGINT ignored, and the sweep, keeping what it inherited as programs should, never saw Ctrl-C
        process = subprocess.Popen(
            command,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,
            preexec_fn=_default_sigint,  # noqa: PLW1509 (only a signal() call between fork and exec)
        )
    try:
        deadline = time.monotonic() + FIRST_ROWS_TIMEOUT_S
        while _data_rows(out) < 4:
            assert process.poll() is None, errors.read_text()
            assert time.monotonic() < deadline, "no case finished"  # the whole grid was expanded first: 150 s
            time.sleep(0.2)
        yield process, out
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


@pytest.mark.slow
def test_a_grid_of_ten_million_cases_writes_rows_at_once_in_bounded_memory(
    big_sweep: tuple[subprocess.Popen[bytes], Path],
) -> None:
    process, out = big_sweep
    rows = _data_rows(out)
    assert _rss_bytes(process.pid) < 300e6  # expanding the grid took 3.6 GB
    time.sleep(1)
    assert _data_rows(out) > rows  # it goes on
    assert "error" not in out.read_text().splitlines()[1]


@pytest.mark.slow
def test_sigkill_of_the_sweep_takes_its_pool_workers_with_it(
    big_sweep: tuple[subprocess.Popen[bytes], Path],
) -> None:
    process, _ = big_sweep
    workers = _children(process.pid)
    assert workers, "no worker process"
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    deadline = time.monotonic() + ORPHAN_TIMEOUT_S
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in workers if _alive(pid)] == []


@pytest.mark.slow
def test_ctrl_c_to_the_process_group_ends_the_sweep_and_its_workers(
    big_sweep: tuple[subprocess.Popen[bytes], Path],
) -> None:
    process, out = big_sweep
    children = _children(process.pid)
    # multiprocessing's resource tracker is a child too: it ignores SIGINT and ends when it reads EOF from the
    # sweep's exit, a moment after that exit (a loaded CI run saw it still alive); the pool workers are joined first
    trackers = {pid for pid in children if _is_resource_tracker(pid)}
    workers = children - trackers
    assert workers, "no worker process"
    os.killpg(process.pid, signal.SIGINT)
    assert process.wait(timeout=INTERRUPT_TIMEOUT_S) == 130  # it hung when the workers took the interrupt too
    assert [pid for pid in workers if _alive(pid)] == []
    deadline = time.monotonic() + ORPHAN_TIMEOUT_S
    while any(_alive(pid) for pid in trackers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in trackers if _alive(pid)] == []
    rows = list(csv.reader(out.read_text().splitlines()))
    assert len(rows[-1]) == len(rows[0])  # the last row whole
