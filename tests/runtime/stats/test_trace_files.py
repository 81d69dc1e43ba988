"""``allreduce run --trace`` and ``--stats`` files on real ranks: no predictable temporary a symbolic link can
redirect, a trace path that cannot be written refused before the job starts, nothing left behind by a rank that
left early or by a launcher killed with SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from allreduce.runtime import RankFailedError, spawn
from allreduce.runtime.stats import check_trace_path

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("stop_signals_not_ignored")]

SRC = Path(__file__).resolve().parents[3] / "src"
RANKS = 3
WAIT_S = 120.0

JOB = """
import os, sys, numpy as np, allreduce
open(os.path.join(sys.argv[1], f"started-{os.environ['RANK']}"), "w").close()
g = allreduce.init(transport="shm")
x = np.zeros(1 << 10, np.float32)
for _ in range(5):
    g.all_reduce(x, algorithm="ring")
if g.rank == int(sys.argv[2]):
    os._exit(0)  # leaves without closing: the others' close cannot gather its events
g.close()
"""

SLEEPER = """
import os, sys, time, allreduce
g = allreduce.init(transport="shm")
open(os.path.join(sys.argv[1], f"started-{g.rank}"), "w").close()
time.sleep(600)
"""


def _env(tmp: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(SRC), "TMPDIR": str(tmp)}


def _run(workdir: Path, *options: str, leaver: int = -1) -> subprocess.CompletedProcess[str]:
    script = workdir / "job.py"
    script.write_text(JOB)
    (workdir / "tmp").mkdir(exist_ok=True)
    return subprocess.run(
        [sys.executable, "-m", "allreduce", "run", "-n", str(RANKS), *options, "--", sys.executable, str(script),
         str(workdir), str(leaver)],
        capture_output=True, text=True, env=_env(workdir / "tmp"), timeout=WAIT_S, check=False,
    )  # fmt: skip


def test_temporaries_a_symlink_could_redirect_are_never_opened(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    trace = tmp_path / "out" / "trace.json"
    trace.parent.mkdir()
    for rank in range(RANKS):  # every name the old scheme wrote through, planted by another local user
        for suffix in (".tmp", ".part"):
            (trace.parent / f"trace.json.rank-{rank}{suffix}").symlink_to(victim)
    done = _run(tmp_path, "--trace", str(trace))
    assert done.returncode == 0, done.stderr
    assert victim.read_text() == "precious\n"
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["tid"] for e in events if e["ph"] == "X"} == set(range(RANKS))


def test_a_trace_path_that_is_a_symlink_is_refused_before_the_job(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    link = tmp_path / "trace.json"
    link.symlink_to(victim)
    done = _run(tmp_path, "--trace", str(link))
    assert done.returncode == 2
    assert "not a regular file" in done.stderr
    assert not list(tmp_path.glob("started-*"))
    assert victim.read_text() == "precious\n"


@pytest.mark.parametrize(
    ("where", "why"),
    [("/proc/t.json", "cannot create files in /proc"), ("DIR", "is a directory"), ("DIR/no/t.json", "does not exist")],
)
def test_a_trace_path_that_cannot_be_written_is_refused_before_any_rank_starts(
    tmp_path: Path, where: str, why: str
) -> None:
    path = where.replace("DIR", str(tmp_path))
    done = _run(tmp_path, "--trace", path)
    assert done.returncode == 2, done.stderr
    assert why in done.stderr
    assert "Traceback" not in done.stderr
    assert not list(tmp_path.glob("started-*"))


@pytest.mark.parametrize("leaver", [0, 1])
def test_a_rank_that_leaves_without_closing_leaves_no_trace_files(tmp_path: Path, leaver: int) -> None:
    out = tmp_path / "out"
    out.mkdir()
    done = _run(tmp_path, "--trace", str(out / "trace.json"), leaver=leaver)
    assert "no stats or trace at close" in done.stderr  # the others said why there is no trace
    assert list(out.iterdir()) == []


def test_check_trace_path_returns_the_absolute_path_of_a_new_file(tmp_path: Path) -> None:
    os.chdir(tmp_path)
    assert check_trace_path("t.json") == tmp_path / "t.json"
    assert list(tmp_path.iterdir()) == []  # its probe of the directory is gone


def _wait_for(condition: object, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(what)
        time.sleep(0.05)


def test_a_launcher_killed_with_sigkill_leaves_nothing_in_the_temporary_directory(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "allreduce", "run", "-n", "2", "--stats", "--trace", str(tmp_path / "t.json"), "--",
         sys.executable, str(script), str(tmp_path)],
        env=_env(tmp), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        _wait_for(lambda: len(list(tmp_path.glob("started-*"))) == 2, "the ranks did not start")
        assert list(tmp.iterdir()) != []  # the launcher's scratch directory is there while it runs
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=WAIT_S)
        _wait_for(lambda: list(tmp.iterdir()) == [], f"left in the temporary directory: {list(tmp.iterdir())}")
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()


def _calls(group: object) -> int:
    return 0


@pytest.mark.parametrize("path", ["/proc/t.json", "DIR"])
def test_an_unwritable_trace_variable_fails_init_on_real_ranks(tmp_path: Path, path: str) -> None:
    with pytest.raises(RankFailedError, match="ALLREDUCE_TRACE") as failed:
        spawn(2, _calls, env={"ALLREDUCE_TRACE": path.replace("DIR", str(tmp_path))}, timeout_s=120)
    assert "no stats or trace at close" not in str(failed.value)
