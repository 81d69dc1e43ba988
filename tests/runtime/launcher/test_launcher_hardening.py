"""Launchers under real signals: ranks never outlive their launcher, every stop ends in SIGKILL, /dev/shm is left
clean, the rank that failed first is the one blamed, a closed output stops the job, and the number of ranks is
capped. Every launcher here is a real process in a session of its own, signalled the way a user or a terminal
would; every wait polls with a deadline."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from allreduce.runtime.launcher._launch import launch
from allreduce.runtime.launcher._spawn import MAX_LOCAL_RANKS, RankFailedError, spawn
from allreduce.runtime.shm import sweep_stale_segments

RUN = [sys.executable, "-m", "allreduce", "run"]
WAIT_S = 120.0
"""Generous: process start-up on a machine shared by many test runs can take seconds."""
POLL_S = 0.02

# A rank of `allreduce run`: makes an shm group with a segment in /dev/shm, writes its pid to the directory in
# argv[1], then all-reduces forever.
LOOP = textwrap.dedent(
    """
    import os, sys
    import allreduce

    directory = sys.argv[1]
    with allreduce.init(transport="shm") as group:
        x = group.zeros(1 << 18)  # a data segment in /dev/shm, named after this process
        group.all_reduce(x)
        pid_file = os.path.join(directory, f"pid-{group.rank}")
        with open(pid_file + ".partial", "w") as f:
            f.write(str(os.getpid()))
        os.replace(pid_file + ".partial", pid_file)
        while True:
            group.all_reduce(x)
    """
)


def _alive(pid: int) -> bool:
    """Running (a killed process not yet reaped is a zombie: it runs nothing and holds nothing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _shm_files_of(pids: list[int]) -> list[str]:
    # Data segments are named ...-<rank>-<pid namespace>x<owner pid>-<segment id>.
    return [name for name in os.listdir("/dev/shm") for pid in pids if f"x{pid}-" in name]


def _wait_until(condition: Callable[[], Any], what: str, timeout_s: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"after {timeout_s:g} s: {what}")
        time.sleep(POLL_S)


def _pids(directory: Path, count: int) -> list[int]:
    def ready() -> list[int] | None:
        files = sorted(directory.glob("pid-*[0-9]"))
        return [int(p.read_text()) for p in files] if len(files) == count else None

    pids: list[int] = _wait_until(ready, f"{count} ranks did not start")
    return pids


# These tests model a terminal: see the fixture (tests/runtime/conftest.py).
pytestmark = pytest.mark.usefixtures("stop_signals_not_ignored")


def _start_run(tmp_path: Path) -> subprocess.Popen[str]:
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    return subprocess.Popen(
        [*RUN, "-n", "2", "--", sys.executable, str(script), str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: what we signal reaches nothing else of ours
    )


def _assert_gone(pids: list[int]) -> None:
    _wait_until(lambda: not any(_alive(pid) for pid in pids), f"ranks {pids} still running")
    _wait_until(lambda: not _shm_files_of(pids), f"/dev/shm still holds {_shm_files_of(pids)}")


def _children(parent: int) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                fields = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == parent:
                found.append(int(entry.name))
    return found


def _environment(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode().split("=", 1) for entry in entries if b"=" in entry)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


# ------------------------------------------------------------------------------------------------------------
# Orphans: the ranks die with their launcher, however it dies
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("target", ["process", "process group"])
def test_ranks_die_with_a_launcher_killed_by_sigkill(tmp_path: Path, target: str) -> None:
    # "process group" is what `timeout -s KILL 3 allreduce run ...` does.
    with _start_run(tmp_path) as launcher:
        pids = _pids(tmp_path, 2)
        assert _shm_files_of(pids)  # the ranks hold /dev/shm
        scratch = Path(_environment(pids[0])["ALLREDUCE_FAILURE_DIR"])
        assert scratch.is_dir()
        if target == "process":
            launcher.kill()
        else:
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.communicate(timeout=WAIT_S)
        assert launcher.returncode == -signal.SIGKILL
        _assert_gone(pids)
        _wait_until(lambda: not scratch.exists(), f"the launcher's {scratch} was left behind")


@pytest.mark.slow
def test_ranks_die_with_their_launcher_even_without_its_reaper(tmp_path: Path) -> None:
    with _start_run(tmp_path) as launcher:
        pids = _pids(tmp_path, 2)
        reapers = [pid for pid in _children(launcher.pid) if "_reaper.py" in _cmdline(pid)]
        assert len(reapers) == 1
        os.kill(reapers[0], signal.SIGKILL)
        launcher.kill()
        launcher.communicate(timeout=WAIT_S)
        # The kernel kills them (PR_SET_PDEATHSIG); nobody is left to sweep their files.
        _wait_until(lambda: not any(_alive(pid) for pid in pids), f"ranks {pids} outlived their launcher")
    sweep_stale_segments()
    assert _shm_files_of(pids) == []


@pytest.mark.slow
def test_what_a_rank_started_dies_with_a_killed_launcher(tmp_path: Path) -> None:
    body = f"""
        import os, subprocess, sys, threading
        child = subprocess.Popen([sys.executable, "-c", "import threading; threading.Event().wait()"])
        path = os.path.join({str(tmp_path)!r}, "pid-" + os.environ["RANK"])
        with open(path + ".partial", "w") as f:
            f.write(str(child.pid))
        os.replace(path + ".partial", path)
        threading.Event().wait()
    """
    with subprocess.Popen(
        [*RUN, "-n", "2", "--", sys.executable, "-c", textwrap.dedent(body)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    ) as launcher:
        grandchildren = _pids(tmp_path, 2)
        launcher.kill()
        launcher.wait(timeout=WAIT_S)
        _wait_until(lambda: not any(_alive(pid) for pid in grandchildren), "the ranks' children outlived the job")


@pytest.mark.slow
def test_ranks_die_with_a_launcher_whose_terminal_hung_up(tmp_path: Path) -> None:
    with _start_run(tmp_path) as launcher:
        pids = _pids(tmp_path, 2)
        launcher.send_signal(signal.SIGHUP)
        _, err = launcher.communicate(timeout=WAIT_S)
        assert launcher.returncode == 128 + signal.SIGHUP, err
        assert "interrupted by SIGHUP" in err
        _assert_gone(pids)


# ------------------------------------------------------------------------------------------------------------
# Every stop escalates to SIGKILL after the grace period, and leaves /dev/shm clean
# ------------------------------------------------------------------------------------------------------------
IGNORE_EVERY_STOP = textwrap.dedent(
    """
    import os, signal, sys, threading
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    path = os.path.join(sys.argv[1], "pid-" + os.environ["RANK"])
    with open(path + ".partial", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".partial", path)
    threading.Event().wait()
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_ranks_that_ignore_the_forwarded_signal_are_killed_after_the_grace(
    tmp_path: Path, stop: signal.Signals
) -> None:
    with subprocess.Popen(
        [*RUN, "-n", "2", "--grace", "0.5", "--", sys.executable, "-c", IGNORE_EVERY_STOP, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as launcher:
        pids = _pids(tmp_path, 2)
        launcher.send_signal(stop)
        _, err = launcher.communicate(timeout=WAIT_S)
        assert launcher.returncode == 128 + stop, err
        assert "ranks 0, 1 did not stop in 0.5 s; killing them" in err
        _wait_until(lambda: not any(_alive(pid) for pid in pids), f"ranks {pids} still running")


@pytest.mark.slow
def test_sigterm_leaves_no_shared_memory_of_the_ranks(tmp_path: Path) -> None:
    with _start_run(tmp_path) as launcher:
        pids = _pids(tmp_path, 2)
        launcher.terminate()
        launcher.communicate(timeout=WAIT_S)
        assert launcher.returncode == 128 + signal.SIGTERM
        # Gone by the time the launcher has exited: no later sweep is needed.
        assert not any(_alive(pid) for pid in pids)
        assert _shm_files_of(pids) == []


@pytest.mark.slow
def test_survivors_stopped_after_a_failure_leave_no_shared_memory(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    body = LOOP.replace(
        "    while True:",
        # rank 1 leaves without closing its group once both pid files are written (rank 0 wrote its own before it
        # entered this all-reduce, which rank 1 cannot finish without it); the launcher stops rank 0
        "    group.all_reduce(x)\n    if group.rank == 1:\n        os._exit(3)\n    while True:",
    )
    assert body != LOOP
    script.write_text(body)
    result = subprocess.run(
        [*RUN, "-n", "2", "--", sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        check=False,
    )
    assert result.returncode == 3, result.stderr
    pids = _pids(tmp_path, 2)
    assert not any(_alive(pid) for pid in pids)
    assert _shm_files_of(pids) == []


# ------------------------------------------------------------------------------------------------------------
# bench and train: the parent's SIGTERM, SIGHUP or SIGKILL leaves nothing behind
# ------------------------------------------------------------------------------------------------------------
def _descendants(parent: int) -> list[int]:
    found, todo = [], [parent]
    while todo:
        children = _children(todo.pop())
        found += children
        todo += children
    return found


def _rank_children_with_segments(parent: int) -> list[int] | None:
    # The ranks are the parent's children (spawned) or its fork server's (forked from it)
    ranks = [pid for pid in _descendants(parent) if _shm_files_of([pid])]
    return ranks if len(ranks) == 2 else None


# What the parent's exit status is after each stop: the signal re-delivered to itself once its ranks are gone
# (Ctrl-C becomes KeyboardInterrupt, which the CLI reports as 130), or SIGKILL, which it cannot catch.
PARENT_STATUS = {signal.SIGINT: 130, signal.SIGTERM: -signal.SIGTERM, signal.SIGHUP: -signal.SIGHUP}


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGKILL], ids=lambda s: s.name)
@pytest.mark.parametrize(
    "command",
    [
        ["bench", "-n", "2", "--sizes", "1MiB", "--iters", "100000000", "--timeout", "600"],
        ["train", "-n", "2", "--epochs", "100000", "--transport", "shm"],
    ],
    ids=["bench", "train"],
)
def test_a_stopped_bench_or_train_leaves_no_rank_and_no_shared_memory(command: list[str], stop: signal.Signals) -> None:
    with subprocess.Popen(
        [sys.executable, "-m", "allreduce", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as parent:
        ranks: list[int] = _wait_until(
            lambda: _rank_children_with_segments(parent.pid), "the ranks did not map their segments"
        )
        parent.send_signal(stop)
        _, err = parent.communicate(timeout=WAIT_S)
        assert parent.returncode == PARENT_STATUS.get(stop, -stop), err
        _assert_gone(ranks)
        assert "resource_tracker" not in err
        assert "leaked" not in err


# ------------------------------------------------------------------------------------------------------------
# Blame: the rank that failed first, not the ranks that reacted to it
# ------------------------------------------------------------------------------------------------------------
RAISE_ON_RANK_1 = textwrap.dedent(
    """
    import numpy as np
    import allreduce

    with allreduce.init() as group:
        group.barrier()
        if group.rank == 1:
            raise ValueError("rank 1's own mistake")
        x = np.zeros(1 << 16)
        while True:
            group.all_reduce(x)  # raises PeerFailureError once rank 1 has gone
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_the_rank_that_raised_is_blamed_in_10_runs_of_10(tmp_path: Path, transport: str) -> None:
    blamed = []
    for run in range(10):
        with open(tmp_path / f"err-{run}", "w+b") as err, open(os.devnull, "wb") as out:
            result = launch(
                [sys.executable, "-c", RAISE_ON_RANK_1.replace("init()", f"init(transport={transport!r})")],
                world_size=3,
                stdout=out,
                stderr=err,
            )
        blamed.append((result.failed_rank, result.exit_code))
    assert blamed == [(1, 1)] * 10


@pytest.mark.slow
def test_the_launcher_says_who_failed_first_and_who_reacted() -> None:
    # Rank 1 is slow to exit after raising, so its peers' PeerFailureError exits come first.
    body = RAISE_ON_RANK_1.replace(
        'raise ValueError("rank 1\'s own mistake")',
        'import atexit, time; atexit.register(time.sleep, 1.0); raise ValueError("rank 1\'s own mistake")',
    )
    result = subprocess.run(
        [*RUN, "-n", "3", "--", sys.executable, "-c", body],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        check=False,
    )
    assert result.returncode == 1
    assert (
        "allreduce run: rank 1 failed first (exited with status 1: ValueError: rank 1's own mistake); "
        "ranks 0, 2 failed in reaction to it" in result.stderr
    )
    assert "reacting to a failure of rank 1" in result.stderr


def _raise_on_rank_1_all_reduce_elsewhere(group: Any) -> None:
    group.barrier()
    if group.rank == 1:
        raise ValueError("rank 1's own mistake")
    x = np.zeros(1 << 16)
    while True:
        group.all_reduce(x)


@pytest.mark.slow
def test_spawn_blames_the_rank_that_raised_in_5_runs_of_5() -> None:
    blamed = []
    for _ in range(5):
        with pytest.raises(RankFailedError) as failure:
            spawn(3, _raise_on_rank_1_all_reduce_elsewhere, timeout_s=120)
        blamed.append((failure.value.rank, str(failure.value).split(" (")[0]))
    assert blamed == [(1, "rank 1 failed: ValueError: rank 1's own mistake")] * 5


# ------------------------------------------------------------------------------------------------------------
# A closed output, too many ranks, the help
# ------------------------------------------------------------------------------------------------------------
PRINT_FOREVER = textwrap.dedent(
    """
    import itertools, os, sys
    path = os.path.join(sys.argv[1], "pid-" + os.environ["RANK"])
    with open(path + ".partial", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".partial", path)
    for i in itertools.count():
        print("line", i)
    """
)


@pytest.mark.slow
def test_a_closed_output_stops_the_ranks(tmp_path: Path) -> None:
    # `allreduce run ... | head -2`: the reader leaves after two lines.
    with subprocess.Popen(
        [*RUN, "-n", "2", "--", sys.executable, "-c", PRINT_FOREVER, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    ) as launcher:
        assert launcher.stdout is not None
        assert launcher.stderr is not None
        for _ in range(2):
            assert launcher.stdout.readline().startswith(b"[rank ")
        pids = _pids(tmp_path, 2)
        launcher.stdout.close()
        err = launcher.stderr.read().decode()
        launcher.wait(timeout=WAIT_S)
    assert launcher.returncode == 128 + signal.SIGPIPE, err
    assert "allreduce run: output closed (broken pipe); stopping every rank" in err
    assert "Traceback" not in err
    assert "BrokenPipeError" not in err
    assert not any(_alive(pid) for pid in pids)


@pytest.mark.slow
def test_too_many_ranks_is_one_line_and_exit_2() -> None:
    result = subprocess.run(
        [*RUN, "-n", "100000", "--", "true"], capture_output=True, text=True, timeout=WAIT_S, check=False
    )
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"allreduce run: error: the number of ranks: at most {MAX_LOCAL_RANKS} local ranks (the launcher holds "
        "three open files per rank), got 100000"
    ]


def test_the_library_refuses_too_many_ranks_too() -> None:
    with pytest.raises(ValueError, match=f"at most {MAX_LOCAL_RANKS} local ranks"):
        launch(["true"], world_size=MAX_LOCAL_RANKS + 1)
    with pytest.raises(ValueError, match=f"at most {MAX_LOCAL_RANKS} local ranks"):
        spawn(MAX_LOCAL_RANKS + 1, _raise_on_rank_1_all_reduce_elsewhere)


@pytest.mark.slow
def test_help_shows_the_grace_default_and_the_environment() -> None:
    result = subprocess.run([*RUN, "--help"], capture_output=True, text=True, timeout=WAIT_S, check=False)
    assert result.returncode == 0
    assert "(default: 5)" in result.stdout
    for variable in ("ALLREDUCE_TOKEN", "ALLREDUCE_DEBUG", "SIGHUP", "SIGKILL"):
        assert variable in result.stdout
