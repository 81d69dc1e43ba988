"""Start N local ranks of a command, the way torchrun does on one host, and watch them.

Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1 and MASTER_PORT (a free
port unless given), and PYTHONUNBUFFERED=1 so that its lines arrive as they are printed. Every line it writes
is prefixed with ``[rank k]`` on the same stream. SIGINT and SIGTERM sent to the launcher are forwarded to every
rank (each rank runs in its own process group, so a terminal's Ctrl-C reaches it exactly once, through us); a
second Ctrl-C kills them. When a rank fails, the others are sent SIGTERM, then SIGKILL after a grace period, and
the launcher exits with the failing rank's status (128 + signal number if it was killed), naming it.
Ranks get no stdin.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import IO

__all__ = ["LaunchResult", "launch"]


@dataclass(frozen=True)
class LaunchResult:
    """How a launch ended: ``exit_code`` for the shell, the ranks' return codes, and the first failure if any."""

    exit_code: int
    returncodes: tuple[int | None, ...]
    failed_rank: int | None
    interrupted_by: int | None  # the signal the launcher received, if any


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def describe_status(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with status {returncode}"


class _Launch:
    """One run of N ranks: their processes, the threads copying their output, and the signal forwarding."""

    def __init__(
        self,
        command: Sequence[str],
        *,
        world_size: int,
        master_port: int,
        grace_s: float,
        stdout: IO[bytes],
        stderr: IO[bytes],
        log: Callable[[str], None],
    ) -> None:
        self.command = list(command)
        self.world_size = world_size
        self.master_port = master_port
        self.grace_s = grace_s
        self.out = stdout
        self.err = stderr
        self.log = log
        self.procs: list[subprocess.Popen[bytes]] = []
        self.exited: queue.Queue[int] = queue.Queue()
        self.write_lock = threading.Lock()
        self.threads: list[threading.Thread] = []
        self.interrupted_by: int | None = None
        self.interrupts = 0

    def environment(self, rank: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(self.world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(self.master_port),
        )
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def start(self) -> None:
        for rank in range(self.world_size):
            try:
                proc = subprocess.Popen(
                    self.command,
                    env=self.environment(rank),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    process_group=0,
                )
            except OSError as exc:
                self.signal_all(signal.SIGKILL)
                raise ValueError(f"cannot run {self.command[0]!r} for rank {rank}: {exc.strerror or exc}") from exc
            self.procs.append(proc)
            assert proc.stdout is not None
            assert proc.stderr is not None
            for pipe, dest in ((proc.stdout, self.out), (proc.stderr, self.err)):
                self._thread(self._copy_lines, rank, pipe, dest)
            self._thread(self._wait, rank, proc)

    def _thread(self, target: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self.threads.append(thread)

    def _copy_lines(self, rank: int, pipe: IO[bytes], dest: IO[bytes]) -> None:
        prefix = f"[rank {rank}] ".encode()
        with pipe:
            for line in iter(pipe.readline, b""):
                with self.write_lock, contextlib.suppress(OSError, ValueError):
                    dest.write(prefix + line + (b"" if line.endswith(b"\n") else b"\n"))
                    dest.flush()

    def _wait(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        proc.wait()
        self.exited.put(rank)

    def signal_all(self, sig: int) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, sig)

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.interrupts += 1
        if self.interrupted_by is None:
            self.interrupted_by = signum
        # Forward once; a second Ctrl-C means "now".
        self.signal_all(signum if self.interrupts == 1 else signal.SIGKILL)

    def watch(self) -> LaunchResult:
        failed_rank: int | None = None
        stop_deadline: float | None = None
        remaining = set(range(self.world_size))
        while remaining:
            timeout = None if stop_deadline is None else max(stop_deadline - time.monotonic(), 0.0)
            try:
                rank = self.exited.get(timeout=timeout)
            except queue.Empty:
                self.log(f"ranks {', '.join(map(str, sorted(remaining)))} did not stop in {self.grace_s:g} s; killing")
                self.signal_all(signal.SIGKILL)
                stop_deadline = None
                continue
            remaining.discard(rank)
            code = self.procs[rank].returncode
            if code != 0 and failed_rank is None and self.interrupted_by is None:
                failed_rank = rank
                if remaining:
                    self.log(
                        f"rank {rank} {describe_status(code)}; stopping ranks {', '.join(map(str, sorted(remaining)))}"
                    )
                else:
                    self.log(f"rank {rank} {describe_status(code)}")
                self.signal_all(signal.SIGTERM)
                stop_deadline = time.monotonic() + self.grace_s
            elif self.interrupted_by is not None and stop_deadline is None:
                stop_deadline = time.monotonic() + self.grace_s
        for thread in self.threads:
            thread.join(timeout=5.0)  # a rank's orphaned children may hold its pipes open: do not wait on them
        codes = tuple(p.returncode for p in self.procs)
        if failed_rank is not None:
            code = codes[failed_rank]
            assert code is not None
            exit_code = 128 - code if code < 0 else code
        elif self.interrupted_by is not None:
            exit_code = 128 + self.interrupted_by
        else:
            exit_code = 0
        return LaunchResult(exit_code, codes, failed_rank, self.interrupted_by)


def launch(
    command: Sequence[str],
    *,
    world_size: int,
    master_port: int | None = None,
    grace_s: float = 5.0,
    stdout: IO[bytes] | None = None,
    stderr: IO[bytes] | None = None,
) -> LaunchResult:
    """Run ``command`` as ``world_size`` local ranks until all exit (see the module docstring).

    Signal forwarding is installed only when called from the main thread."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"the number of ranks must be an integer >= 1, got {world_size!r}")
    if not command:
        raise ValueError("no command to run (usage: allreduce run -n N -- python script.py ...)")
    if master_port is not None and not 0 < master_port < 65536:
        raise ValueError(f"--master-port must be in 1..65535, got {master_port}")
    err = stderr if stderr is not None else sys.stderr.buffer

    def log(message: str) -> None:
        with run.write_lock, contextlib.suppress(OSError, ValueError):
            err.write(f"allreduce run: {message}\n".encode())
            err.flush()

    run = _Launch(
        command,
        world_size=world_size,
        master_port=master_port if master_port is not None else _free_port("127.0.0.1"),
        grace_s=grace_s,
        stdout=stdout if stdout is not None else sys.stdout.buffer,
        stderr=err,
        log=log,
    )
    in_main = threading.current_thread() is threading.main_thread()
    previous = {}
    if in_main:
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, run.on_signal)
    try:
        run.start()
        result = run.watch()
    finally:
        run.signal_all(signal.SIGKILL)  # only ranks still running: after an exception in the launcher itself
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if result.interrupted_by is not None:
        log(f"interrupted by {signal.Signals(result.interrupted_by).name}; forwarded to every rank")
    return result
