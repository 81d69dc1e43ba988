"""``allreduce run --elastic``: a rank's death does not stop the job; with --max-restarts the launcher starts it
again and it rejoins the running group (examples/elastic_train.py, real processes, a real SIGKILL)."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from allreduce.cli._main import main

pytest.importorskip("torch")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "elastic_train.py"


def _run(
    run_allreduce: Callable[..., subprocess.CompletedProcess[str]], *flags: str, example: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    command = ("python", str(EXAMPLE), "--kill-rank", "2@5", *example)
    return run_allreduce("run", "-n", "3", *flags, "--", *command, timeout_s=300)


@pytest.mark.slow
def test_a_killed_rank_is_restarted_and_rejoins_with_the_others_state(
    run_allreduce: Callable[..., subprocess.CompletedProcess[str]],
) -> None:
    done = _run(run_allreduce, "--elastic", "--max-restarts", "1")
    assert done.returncode == 0, done.stderr
    assert "rank 2 was killed by SIGKILL; 2 ranks go on (--min-ranks 2); restarting it to rejoin" in done.stderr
    assert "[rank 2] joined at step 5 as rank 2 of 3" in done.stdout
    states = re.findall(r"\[rank (\d)\] done: 12 steps, 3 ranks, state ([0-9a-f]+)", done.stdout)
    assert sorted(rank for rank, _ in states) == ["0", "1", "2"]
    assert len({state for _, state in states}) == 1  # replicas: parameters and optimizer state


@pytest.mark.slow
def test_without_restarts_the_survivors_finish_and_the_job_succeeds(
    run_allreduce: Callable[..., subprocess.CompletedProcess[str]],
) -> None:
    # nothing restarts rank 2: the survivors need not wait the example's 30 s for it to rejoin before they go on
    done = _run(run_allreduce, "--elastic", example=("--rejoin-wait", "0"))
    assert done.returncode == 0, done.stderr
    assert "rank 2 was killed by SIGKILL; 2 ranks go on (--min-ranks 2)\n" in done.stderr
    assert len(re.findall(r"done: 12 steps, 2 ranks", done.stdout)) == 2


# Rank 0 returns at once; rank 1 kills itself once rank 0's process is gone (exited and reaped by the launcher).
_DIE_AFTER_RANK_0 = """
import os, pathlib, signal, sys, time
path = pathlib.Path(sys.argv[1])
if os.environ["RANK"] == "0":
    path.with_suffix(".tmp").write_text(str(os.getpid()))
    path.with_suffix(".tmp").rename(path)
    sys.exit(0)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    try:
        os.kill(int(path.read_text()), 0)
    except FileNotFoundError:
        pass
    except ProcessLookupError:
        break
    time.sleep(0.01)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.slow
def test_a_rank_that_finished_counts_among_those_that_go_on(
    run_allreduce: Callable[..., subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    pid_file = str(tmp_path / "pid")
    done = run_allreduce("run", "-n", "2", "--elastic", "--min-ranks", "1", "--", "python", "-c", _DIE_AFTER_RANK_0,
                         pid_file, timeout_s=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "rank 1 was killed by SIGKILL; 1 ranks go on (--min-ranks 1)" in done.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--min-ranks", "2"], "--min-ranks needs --elastic"),
        (["--max-restarts", "1"], "--max-restarts needs --elastic"),
        (["--elastic", "--min-ranks", "4"], "--min-ranks must be in 1..3 (-n), got 4"),
        (["--elastic", "--max-restarts", "-1"], "--max-restarts must be in 0..1000, got -1"),
    ],
)
def test_bad_elastic_flags_are_one_line_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["run", "-n", "3", *argv, "--", "python", "-c", "pass"])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err
    assert "Traceback" not in err
