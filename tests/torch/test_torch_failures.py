"""Failures on the "allreduce" backend raise on every rank, through torch, and never crash a process.

Each test runs one 2-rank job of ``failing_job.py``: one good call, then rank 1 dies (SIGKILL), stalls past the
collective timeout, or makes a call that pairs with another of rank 0's; the second call is ``dist.all_reduce``,
an asynchronous ``dist.broadcast(...).wait()``, a DDP backward on the backend (DDP's reducer reads the work's
future in C++), or a DDP backward with ``allreduce.torch.comm_hook``. Every rank writes what it raised. No process
may end by a signal other than the SIGKILL the job sent itself.

The ranks started by hand are forks of one server per module that has imported torch and the backend
(``failing_job.py --zygote``): 1.9 CPU-s a rank saved, each still a process of its own, in a session of its own,
joining through its environment. Under torchrun the ranks are the agent's, fresh interpreters.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from allreduce.runtime.launcher._spawn import reserve_port

JOB = Path(__file__).with_name("failing_job.py")
WORLD_SIZE = 2
DEADLINE_S = 150.0
MODES = ["collective", "async", "ddp", "hook"]

pytestmark = [pytest.mark.slow, pytest.mark.serial]


def _env(transport: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", ALLREDUCE_TRANSPORT=transport)
    return env


def _finish(procs: Sequence[subprocess.Popen[str] | _Forked]) -> tuple[list[int], str]:
    try:
        outputs = [proc.communicate(timeout=DEADLINE_S)[0] for proc in procs]
    except subprocess.TimeoutExpired:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the job hung: " + "\n".join(proc.communicate()[0][-3000:] for proc in procs))
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # whatever a rank left behind
    return [_exit_code(proc) for proc in procs], "\n".join(outputs)


def _exit_code(proc: subprocess.Popen[str] | _Forked) -> int:
    assert proc.returncode is not None, f"pid {proc.pid} has not exited"
    return proc.returncode


class _Forked:
    """A rank forked by the zygote: what of ``subprocess.Popen`` the tests use (pid, returncode, communicate)."""

    def __init__(self, pid: int, output: Path, exit_path: Path) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._output = output
        self._exit = exit_path

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._exit.exists():
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(JOB), timeout or 0.0)
            time.sleep(0.01)
        self.returncode = int(self._exit.read_text())
        return self._output.read_text(errors="replace"), None

    def wait(self, timeout: float | None = None) -> int:
        self.communicate(timeout)
        assert self.returncode is not None
        return self.returncode


class _Zygote:
    """``failing_job.py --zygote``: torch and the backend imported once; it forks each rank asked for."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, str(JOB), "--zygote"], env=_env("auto"), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip

    def fork(self, out_dir: Path, args: list[str], env: dict[str, str], rank: int) -> _Forked:
        output, exit_path = out_dir / f"rank-{rank}.out", out_dir / f"rank-{rank}.exit"
        request = {"args": args, "env": env, "output": str(output), "exit": str(exit_path)}
        assert self._proc.stdin is not None
        assert self._proc.stdout is not None
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        assert line, "the zygote exited"
        return _Forked(int(line), output, exit_path)

    def close(self) -> None:
        assert self._proc.stdin is not None
        assert self._proc.stdout is not None
        self._proc.stdin.close()  # it kills the ranks left and exits
        self._proc.wait(timeout=60)
        self._proc.stdout.close()


@pytest.fixture(scope="module")
def zygote() -> Iterator[_Zygote]:
    server = _Zygote()
    yield server
    server.close()


def _start(zygote: _Zygote, out_dir: Path, fault: str, mode: str, transport: str, **env: str) -> list[_Forked]:
    """Every rank of the job started by hand (RANK, WORLD_SIZE, MASTER_*), each in a session of its own."""
    with reserve_port() as reservation:
        port = reservation.getsockname()[1]
        return [
            zygote.fork(
                out_dir,
                [str(out_dir), fault, mode],
                {**_env(transport), "RANK": str(rank), "WORLD_SIZE": str(WORLD_SIZE), **env}
                | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
                rank,
            )
            for rank in range(WORLD_SIZE)
        ]


def _by_hand(zygote: _Zygote, out_dir: Path, fault: str, mode: str, transport: str) -> tuple[list[int], str]:
    return _finish(_start(zygote, out_dir, fault, mode, transport))


def _torchrun(out_dir: Path, fault: str, mode: str, transport: str) -> tuple[list[int], str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD_SIZE), str(JOB)]
    proc = subprocess.Popen(
        [*command, str(out_dir), fault, mode],
        env=_env(transport),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    return _finish([proc])


def _results(out_dir: Path, output: str) -> list[dict[str, Any] | None]:
    files = [out_dir / f"rank-{rank}.json" for rank in range(WORLD_SIZE)]
    return [json.loads(f.read_text()) if f.exists() else None for f in files]


def _raised(result: dict[str, Any] | None, error: str, culprit: int, output: str) -> None:
    """``result`` is a raise of allreduce's ``error`` (as itself, or in the message of DDP's RuntimeError) whose
    message names rank ``culprit``."""
    assert result is not None, output[-4000:]
    assert result["raised"] is not None, f"returned normally: {result}\n{output[-4000:]}"
    assert "RuntimeError" in result["raised"], result
    assert error in result["raised"] or error in result["message"], result
    assert f"rank {culprit}" in result["message"], result


def _check(out_dir: Path, fault: str, mode: str, returncodes: list[int], output: str) -> None:
    results = _results(out_dir, output)
    if fault == "kill":
        _raised(results[0], "PeerFailureError", 1, output)
    elif fault == "stall":
        _raised(results[0], "CollectiveTimeoutError", 1, output)
        # The stalled rank's late call may still complete (rank 0's data was there); if it raises, it says who
        # gave up.
        late = results[1]
        assert late is not None, output[-4000:]
        assert late["raised"] is None or "rank 0" in late["message"], late
    else:
        for rank, result in enumerate(results):
            _raised(result, "MismatchError", 1, output)
            assert result is not None
            assert "mismatch" in result["message"], f"rank {rank}: {result}"
    if mode in ("collective", "async"):
        # Raised by work.wait() in Python: allreduce's own class, also torch's DistBackendError.
        for result in results:
            if result is not None and result["raised"] is not None:
                assert "DistBackendError" in result["raised"], result
    assert all(code >= 0 for code in returncodes if code != -signal.SIGKILL), (returncodes, output[-4000:])
    if fault != "kill":
        assert returncodes == [0] * len(returncodes), (returncodes, output[-4000:])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fault", ["kill", "stall", "mismatch"])
def test_a_failure_raises_on_every_rank_over_shm(zygote: _Zygote, tmp_path: Path, fault: str, mode: str) -> None:
    returncodes, output = _by_hand(zygote, tmp_path, fault, mode, "shm")
    if fault == "kill":
        assert returncodes == [0, -signal.SIGKILL], (returncodes, output[-4000:])
    _check(tmp_path, fault, mode, returncodes, output)


@pytest.mark.parametrize("fault", ["kill", "stall", "mismatch"])
def test_a_failure_under_ddp_raises_on_every_rank_over_tcp(zygote: _Zygote, tmp_path: Path, fault: str) -> None:
    returncodes, output = _by_hand(zygote, tmp_path, fault, "ddp", "tcp")
    if fault == "kill":
        assert returncodes == [0, -signal.SIGKILL], (returncodes, output[-4000:])
    _check(tmp_path, fault, "ddp", returncodes, output)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_stopped_rank_is_named_through_torch_long_before_the_timeout(
    zygote: _Zygote, tmp_path: Path, transport: str
) -> None:
    # rank 1 stops itself before its second call; rank 0's all_reduce waits on it until the store's lease
    # (ALLREDUCE_LEASE_S, read by init under the backend) declares it dead: far sooner than the 120 s timeout
    procs = _start(zygote, tmp_path, "stop", "collective", transport, ALLREDUCE_LEASE_S="2")
    output = ""
    try:
        output = procs[0].communicate(timeout=DEADLINE_S)[0]
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the stopped rank (SIGKILL ends a stopped process too)
        output += procs[1].communicate(timeout=30)[0]
        procs[0].wait(timeout=30)
    result = _results(tmp_path, output)[0]
    _raised(result, "PeerFailureError", 1, output)
    assert result is not None
    assert "DistBackendError" in result["raised"], result
    assert result["seconds"] < 120.0 / 4, result  # failing_job's STOP_TIMEOUT_S


# Not the SIGKILL: torchrun's agent stops the other workers as soon as one dies, racing their own error.
@pytest.mark.parametrize("fault", ["stall", "mismatch"])
def test_a_failure_under_ddp_raises_on_every_rank_under_torchrun(tmp_path: Path, fault: str) -> None:
    returncodes, output = _torchrun(tmp_path, fault, "ddp", "auto")
    _check(tmp_path, fault, "ddp", returncodes, output)
