"""``allreduce run``: real launcher processes starting real ranks; prefixes, failures, Ctrl-C forwarding."""

from __future__ import annotations

import ctypes
import os
import platform
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from allreduce.runtime.launcher._launch import launch

RUN = [sys.executable, "-m", "allreduce", "run"]


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*RUN, *args], capture_output=True, text=True, timeout=timeout, check=False)


def script(body: str) -> list[str]:
    return ["--", sys.executable, "-c", textwrap.dedent(body)]


@pytest.mark.slow
def test_environment_and_prefixes() -> None:
    result = run_cli(
        "-n",
        "3",
        "--master-port",
        "45123",
        *script("""
            import os, sys
            keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
            print(" ".join(os.environ[k] for k in keys))
            print("to stderr", os.environ["RANK"], file=sys.stderr)
            sys.stdout.write("no newline at the end")
        """),
    )
    assert result.returncode == 0, result.stderr
    out_lines = sorted(result.stdout.splitlines())
    assert out_lines == sorted(
        [f"[rank {r}] {r} 3 {r} 3 127.0.0.1 45123" for r in range(3)]
        + [f"[rank {r}] no newline at the end" for r in range(3)]
    )
    assert sorted(result.stderr.splitlines()) == [f"[rank {r}] to stderr {r}" for r in range(3)]


@pytest.mark.slow
def test_a_failing_rank_stops_the_others_and_sets_the_exit_status() -> None:
    result = run_cli(
        "-n",
        "3",
        *script("""
            import os, sys, threading
            rank = int(os.environ["RANK"])
            if rank == 1:
                sys.exit(3)
            threading.Event().wait()  # the others would run forever
        """),
    )
    assert result.returncode == 3
    assert "allreduce run: rank 1 exited with status 3; stopping ranks" in result.stderr


@pytest.mark.slow
def test_a_killed_rank_is_named_with_its_signal() -> None:
    result = run_cli(
        "-n",
        "2",
        *script("""
            import os, signal, threading
            if os.environ["RANK"] == "0":
                os.kill(os.getpid(), signal.SIGKILL)
            threading.Event().wait()
        """),
    )
    assert result.returncode == 128 + signal.SIGKILL
    assert "rank 0 was killed by SIGKILL" in result.stderr


@pytest.mark.slow
def test_ranks_that_ignore_sigterm_are_killed_after_the_grace_period(tmp_path: Path) -> None:
    fifo = tmp_path / "ready"
    os.mkfifo(fifo)
    result = run_cli(
        "-n",
        "2",
        "--grace",
        "0.5",
        *script(f"""
            import os, signal, sys, threading
            if os.environ["RANK"] == "1":
                open({str(fifo)!r}).read()  # returns once rank 0 ignores SIGTERM and has closed the FIFO
                sys.exit(1)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            open({str(fifo)!r}, "w").close()
            threading.Event().wait()
        """),
    )
    assert result.returncode == 1
    assert "rank 0 did not stop in 0.5 s; killing it" in result.stderr


_WAIT_FOR_SIGINT = """
    import signal
    # blocked, then taken with sigwait: nothing of the rank's own can lose or deadlock on the signal
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    print("ready", flush=True)
    signal.sigwait({signal.SIGINT})
    print("got SIGINT", flush=True)
"""


def _tgkill(pid: int, tid: int, signum: int) -> None:
    """Send ``signum`` to thread ``tid`` of process ``pid`` (what the kernel does when it picks that thread)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_SYS_TGKILL, pid, tid, signum) != 0:
        raise OSError(ctypes.get_errno(), f"tgkill({pid}, {tid}, {signum})")


_SYS_TGKILL = 234  # x86_64


def _interrupt_a_launch(deliver: Callable[[subprocess.Popen[str]], None]) -> tuple[list[str], str, int]:
    """Run two ranks that wait for SIGINT, ``deliver`` SIGINT to the launcher once both are ready, and return
    the output lines, stderr and exit status; the launcher is killed if it does not end within 120 s."""
    launcher = subprocess.Popen(
        [*RUN, "-n", "2", *script(_WAIT_FOR_SIGINT)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert launcher.stdout is not None
        ready = 0
        lines = []
        while ready < 2:  # both ranks block SIGINT now
            line = launcher.stdout.readline()
            assert line, "launcher ended before its ranks were ready"
            lines.append(line)
            ready += line.endswith("ready\n")
        deliver(launcher)
        rest, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    return lines + rest.splitlines(keepends=True), err, launcher.returncode


@pytest.mark.slow
@pytest.mark.usefixtures("stop_signals_not_ignored")
def test_ctrl_c_is_forwarded_to_every_rank() -> None:
    lines, err, status = _interrupt_a_launch(lambda launcher: launcher.send_signal(signal.SIGINT))
    assert sorted(line.strip() for line in lines if "SIGINT" in line) == [
        "[rank 0] got SIGINT",
        "[rank 1] got SIGINT",
    ]
    assert status == 128 + signal.SIGINT
    assert "interrupted by SIGINT; forwarded to every rank" in err


@pytest.mark.slow
@pytest.mark.usefixtures("stop_signals_not_ignored")
@pytest.mark.skipif(platform.machine() != "x86_64", reason="tgkill's syscall number is x86_64's")
def test_ctrl_c_taken_by_an_output_thread_still_wakes_the_launcher() -> None:
    # The kernel may hand a process's signal to any of its threads; Python runs the handler in the main thread
    # only once it runs bytecode again. The launcher's main thread sleeps in select (no deadline) while its output
    # threads read the ranks' pipes: before signal.set_wakeup_fd it slept on (a CI run hung 120 s).
    def to_an_output_thread(launcher: subprocess.Popen[str]) -> None:
        threads = sorted(int(t) for t in os.listdir(f"/proc/{launcher.pid}/task") if int(t) != launcher.pid)
        assert threads, "the launcher has no thread besides its main one"
        _tgkill(launcher.pid, threads[0], signal.SIGINT)

    lines, _, status = _interrupt_a_launch(to_an_output_thread)
    assert sorted(line.strip() for line in lines if "SIGINT" in line) == [
        "[rank 0] got SIGINT",
        "[rank 1] got SIGINT",
    ]
    assert status == 128 + signal.SIGINT


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-n", "0", "--", "true"], "-n/--nproc must be >= 1, got 0"),
        (["-n", "2"], "no command to run"),
        (["-n", "2", "--", "/nonexistent/program"], "cannot run '/nonexistent/program' for rank 0"),
        (["-n", "2", "--master-port", "70000", "--", "true"], "--master-port must be in 1..65535"),
    ],
)
@pytest.mark.slow
def test_bad_input_is_one_line_and_exit_2(args: list[str], message: str) -> None:
    result = run_cli(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_help_documents_the_environment() -> None:
    result = run_cli("--help")
    assert result.returncode == 0
    for word in ("RANK", "WORLD_SIZE", "MASTER_PORT", "Ctrl-C", "[rank k]"):
        assert word in result.stdout


def test_launch_api_returns_every_status(tmp_path: os.PathLike[str]) -> None:
    out = open(os.path.join(tmp_path, "out"), "w+b")  # noqa: SIM115 (read back below)
    err = open(os.path.join(tmp_path, "err"), "w+b")  # noqa: SIM115
    with out, err:
        result = launch(
            [sys.executable, "-c", "import os, sys; sys.exit(int(os.environ['RANK']) * 0)"],
            world_size=2,
            stdout=out,
            stderr=err,
        )
    assert result.exit_code == 0
    assert result.returncodes == (0, 0)
    assert result.failed_rank is None
    with pytest.raises(ValueError, match="number of ranks must be an integer >= 1"):
        launch(["true"], world_size=0)


_TCP_SCRIPT = """
import os
import numpy as np
from allreduce.runtime import compile_plan
from allreduce.runtime.store._store import TCPStore
from allreduce.runtime.tcp import TcpTransport
from allreduce.schedules import all_reduce

rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_server=rank == 0,
                 world_size=world_size, rank=rank, timeout_s=60)
transport = TcpTransport(rank, world_size, store, timeout_s=60)
x = np.full(10, rank + 1, dtype=np.int64)
transport.execute(compile_plan(all_reduce("ring", world_size), rank, 10), x, lambda d, s: np.add(d, s, out=d),
                  seq=0, timeout_s=60, checksum=False)
print("sum", x[0])
transport.close()
store.close()  # rank 0 hosts the store: its close() waits for the other ranks to leave
"""


@pytest.mark.slow
def test_ranks_rendezvous_through_master_addr_and_port() -> None:
    result = run_cli("-n", "3", "--", sys.executable, "-c", _TCP_SCRIPT)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == [f"[rank {r}] sum 6" for r in range(3)]


USER_ALGORITHM = """
from allreduce.schedules import ring_all_reduce


def my_ring(world_size):
    return ring_all_reduce(world_size)
"""


@pytest.mark.slow
def test_a_user_algorithm_given_to_run_is_registered_in_every_rank(tmp_path: Path) -> None:
    (tmp_path / "algo.py").write_text(USER_ALGORITHM)
    result = run_cli(
        "-n",
        "3",
        "--algorithm",
        f"{tmp_path / 'algo.py'}:my_ring",
        *script("""
            import numpy as np, allreduce
            with allreduce.init() as group:
                x = np.full(1001, group.rank + 1, dtype=np.int64)
                group.all_reduce(x, algorithm="my_ring")
                print("exact" if (x == 6).all() else "WRONG")
        """),
    )
    assert result.returncode == 0, result.stderr
    assert sorted(line.split("] ", 1)[1] for line in result.stdout.splitlines()) == ["exact"] * 3


@pytest.mark.slow
def test_a_user_algorithm_that_does_not_load_is_refused_before_any_rank_starts(tmp_path: Path) -> None:
    result = run_cli("-n", "2", "--algorithm", f"{tmp_path / 'missing.py'}:f", *script("print('started')"))
    assert result.returncode == 2
    assert "missing.py" in result.stderr
    assert "started" not in result.stdout
