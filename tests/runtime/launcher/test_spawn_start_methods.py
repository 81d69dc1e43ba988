"""spawn()'s two ways to start a rank: a fork of the warm server (the default) is what a fresh interpreter is.

Each behaviour is checked under both start methods: whose child a rank is, the environment and output it gets (the
caller's at the call, not the server's from its start), numpy's BLAS threads, and dying with a caller killed by
SIGKILL when nobody else (the reaper) is left to clean up.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import pytest

from allreduce.runtime.launcher._forkserver import START_METHOD_ENV, blas_threads_now, fork_server_pid
from allreduce.runtime.launcher._spawn import spawn

METHODS = ("forkserver", "spawn")
WAIT_S = 120.0


def _parent() -> int:
    return os.getppid()


def _variable(name: str) -> str | None:
    return os.environ.get(name)


def _blas_threads() -> int | None:
    return blas_threads_now()


def _meet(barrier: Any) -> str:
    barrier.wait(timeout=60)
    return os.environ["RANK"]


def _leave_work_for_the_exit(directory: str) -> None:
    def late(name: str) -> None:
        time.sleep(0.2)
        Path(directory, name).write_text("done")

    atexit.register(late, "atexit")
    threading.Thread(target=late, args=("thread",)).start()  # not a daemon: the exit waits for it


def _say(text: str) -> None:
    print(text, flush=True)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _wait_until(condition: object, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"after {WAIT_S:g} s: {what}")
        time.sleep(0.02)


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_a_rank_is_a_child_of_the_caller_or_of_its_fork_server(method: str) -> None:
    parents = spawn(2, _parent, group=False, env={START_METHOD_ENV: method})
    expected = os.getpid() if method == "spawn" else fork_server_pid()
    assert parents == [expected, expected]
    assert expected != os.getpid() or method == "spawn"


def test_the_fork_server_is_a_process_group_of_its_own() -> None:
    spawn(1, _parent, group=False)
    server = fork_server_pid()
    assert os.getpgid(server) == server != os.getpgid(0)


def test_an_unknown_start_method_is_refused() -> None:
    with pytest.raises(ValueError, match=START_METHOD_ENV):
        spawn(1, _parent, group=False, env={START_METHOD_ENV: "fork"})


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_a_rank_sees_the_callers_environment_at_the_call(method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(START_METHOD_ENV, method)
    monkeypatch.setenv("ALLREDUCE_TEST_VARIABLE", "first")
    assert spawn(1, _variable, "ALLREDUCE_TEST_VARIABLE", group=False) == ["first"]  # the server runs by now
    monkeypatch.setenv("ALLREDUCE_TEST_VARIABLE", "second")
    assert spawn(1, _variable, "ALLREDUCE_TEST_VARIABLE", group=False) == ["second"]
    monkeypatch.delenv("ALLREDUCE_TEST_VARIABLE")
    assert spawn(1, _variable, "ALLREDUCE_TEST_VARIABLE", group=False) == [None]


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_an_argument_only_a_starting_process_may_receive_reaches_the_ranks(method: str) -> None:
    barrier = get_context("spawn").Barrier(2)  # its semaphore is passed as the rank starts, never pickled later
    assert spawn(2, _meet, barrier, group=False, env={START_METHOD_ENV: method}) == ["0", "1"]


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_a_rank_exits_as_an_interpreter_does_threads_then_atexit(method: str, tmp_path: Path) -> None:
    spawn(1, _leave_work_for_the_exit, str(tmp_path), group=False, env={START_METHOD_ENV: method})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["atexit", "thread"]


@pytest.mark.slow
@pytest.mark.parametrize("omp", [None, "1"])
def test_a_forked_rank_has_the_blas_threads_of_a_spawned_one(omp: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    # A spawned rank's numpy loads OpenBLAS with the caller's environment; the server's did so once, at its start.
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    for name in ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    cores = len(os.sched_getaffinity(0))
    expected = cores if omp is None else 1
    threads = {m: spawn(2, _blas_threads, group=False, env={START_METHOD_ENV: m}) for m in METHODS}
    assert threads == {m: [expected, expected] for m in METHODS}


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_a_ranks_output_goes_where_the_callers_goes_at_the_call(method: str, tmp_path: Path) -> None:
    spawn(1, _say, "before", group=False, env={START_METHOD_ENV: method})  # the server, if any, starts here
    saved = os.dup(1)
    try:
        with open(tmp_path / "out", "wb") as out:
            os.dup2(out.fileno(), 1)
            spawn(1, _say, f"to the file, by {method}", group=False, env={START_METHOD_ENV: method})
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    assert (tmp_path / "out").read_text() == f"to the file, by {method}\n"


CALLER = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from hang import hang
    from allreduce.runtime.launcher._spawn import spawn

    if __name__ == "__main__":
        spawn(2, hang, sys.argv[1], group=False, timeout_s=600)
    """
)
HANG = textwrap.dedent(
    """
    import os, signal

    def hang(directory):
        path = os.path.join(directory, "pid-" + os.environ["RANK"])
        with open(path + ".partial", "w") as f:
            f.write(f"{os.getpid()} {os.getppid()}")
        os.replace(path + ".partial", path)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.pause()
    """
)


def _reaper_of(caller: int) -> int:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                command = (entry / "cmdline").read_bytes()
            except (OSError, IndexError):
                continue
            if ppid == caller and b"_reaper.py" in command:
                return int(entry.name)
    raise AssertionError(f"process {caller} has no reaper")


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_ranks_die_with_a_caller_killed_by_sigkill_even_without_its_reaper(method: str, tmp_path: Path) -> None:
    (tmp_path / "caller.py").write_text(CALLER)
    (tmp_path / "hang.py").write_text(HANG)
    with subprocess.Popen(
        [sys.executable, str(tmp_path / "caller.py"), str(tmp_path)],
        env={**os.environ, START_METHOD_ENV: method},
        start_new_session=True,
    ) as caller:
        files = [tmp_path / f"pid-{rank}" for rank in range(2)]
        _wait_until(lambda: all(f.exists() for f in files), "the ranks did not start")
        ranks, parents = zip(*(map(int, f.read_text().split()) for f in files), strict=True)
        assert len(set(parents)) == 1
        assert (parents[0] == caller.pid) == (method == "spawn")  # else the caller's fork server
        os.kill(_reaper_of(caller.pid), signal.SIGKILL)  # only the kernel is left to stop the ranks
        caller.kill()
        caller.wait(timeout=WAIT_S)
        _wait_until(lambda: not any(_alive(pid) for pid in (*ranks, *parents)), f"ranks {ranks} outlived the caller")
