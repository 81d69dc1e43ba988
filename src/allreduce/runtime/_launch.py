"""Start N local ranks of a command, the way torchrun does on one host, and watch them.

Each rank gets the rendezvous environment of :mod:`allreduce.runtime._spawn` (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT - a port reserved for the job unless given - and a per-job
ALLREDUCE_TOKEN unless one is set), and PYTHONUNBUFFERED=1 so that its lines arrive as they are printed. Every
line it writes is prefixed with ``[rank k]`` on the same stream. SIGINT and SIGTERM sent to the launcher are
forwarded to every rank (each rank runs in its own process group, so a terminal's Ctrl-C reaches it exactly once,
through us); a second Ctrl-C kills them. When a rank fails, the others are sent SIGTERM, then SIGKILL after a grace
period, and the launcher exits with the failing rank's status (128 + signal number if it was killed), naming it.
Ranks get no stdin.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import IO

from allreduce.runtime._spawn import (
    DEFAULT_GRACE_S,
    RankWatch,
    describe_status,
    new_token,
    rank_environment,
    reserve_port,
)

__all__ = ["LaunchResult", "describe_status", "launch"]


@dataclass(frozen=True)
class LaunchResult:
    """How a launch ended: ``exit_code`` for the shell, the ranks' return codes, and the first failure if any."""

    exit_code: int
    returncodes: tuple[int | None, ...]
    failed_rank: int | None
    interrupted_by: int | None  # the signal the launcher received, if any


class _Launch:
    """One run of N ranks: their processes, the threads copying their output, and the watch over them."""

    def __init__(
        self,
        command: Sequence[str],
        *,
        world_size: int,
        master_port: int,
        token: str,
        grace_s: float,
        stdout: IO[bytes],
        stderr: IO[bytes],
        log: Callable[[str], None],
        write_lock: threading.Lock,
        extra_env: Mapping[str, str] | None = None,
    ) -> None:
        self.command = list(command)
        self.extra_env = dict(extra_env or {})
        self.world_size = world_size
        self.master_port = master_port
        self.token = token
        self.out = stdout
        self.err = stderr
        self.procs: list[subprocess.Popen[bytes]] = []
        self.write_lock = write_lock
        self.threads: list[threading.Thread] = []
        self.watch = RankWatch(self.procs, grace_s=grace_s, log=log)

    def environment(self, rank: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.extra_env)
        env.update(rank_environment(rank, self.world_size, master_port=self.master_port, token=self.token))
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
                self.watch.signal_all(signal.SIGKILL)
                raise ValueError(f"cannot run {self.command[0]!r} for rank {rank}: {exc.strerror or exc}") from exc
            self.procs.append(proc)
            self.watch.procs.append(proc)
            assert proc.stdout is not None
            assert proc.stderr is not None
            for pipe, dest in ((proc.stdout, self.out), (proc.stderr, self.err)):
                thread = threading.Thread(target=self._copy_lines, args=(rank, pipe, dest), daemon=True)
                thread.start()
                self.threads.append(thread)

    def _copy_lines(self, rank: int, pipe: IO[bytes], dest: IO[bytes]) -> None:
        prefix = f"[rank {rank}] ".encode()
        with pipe:
            for line in iter(pipe.readline, b""):
                with self.write_lock, contextlib.suppress(OSError, ValueError):
                    dest.write(prefix + line + (b"" if line.endswith(b"\n") else b"\n"))
                    dest.flush()

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.watch.interrupt(signum)

    def run(self) -> LaunchResult:
        self.watch.watch()
        for thread in self.threads:
            thread.join(timeout=5.0)  # a rank's orphaned children may hold its pipes open: do not wait on them
        codes = tuple(p.returncode for p in self.procs)
        failed_rank = self.watch.failed_rank
        interrupted_by = self.watch.interrupted_by
        if failed_rank is not None:
            code = codes[failed_rank]
            assert code is not None
            exit_code = 128 - code if code < 0 else code
        elif interrupted_by is not None:
            exit_code = 128 + interrupted_by
        else:
            exit_code = 0
        return LaunchResult(exit_code, codes, failed_rank, interrupted_by)


def launch(
    command: Sequence[str],
    *,
    world_size: int,
    master_port: int | None = None,
    grace_s: float = DEFAULT_GRACE_S,
    stdout: IO[bytes] | None = None,
    stderr: IO[bytes] | None = None,
    env: Mapping[str, str] | None = None,
) -> LaunchResult:
    """Run ``command`` as ``world_size`` local ranks until all exit (see the module docstring); ``env`` adds
    variables to every rank's environment.

    Signal forwarding is installed only when called from the main thread."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"the number of ranks must be an integer >= 1, got {world_size!r}")
    if not command:
        raise ValueError("no command to run (usage: allreduce run -n N -- python script.py ...)")
    if master_port is not None and not 0 < master_port < 65536:
        raise ValueError(f"--master-port must be in 1..65535, got {master_port}")
    err = stderr if stderr is not None else sys.stderr.buffer
    write_lock = threading.Lock()

    def log(message: str) -> None:
        with write_lock, contextlib.suppress(OSError, ValueError):
            err.write(f"allreduce run: {message}\n".encode())
            err.flush()

    reservation = None
    if master_port is None:
        reservation = reserve_port()
        master_port = int(reservation.getsockname()[1])
    run = _Launch(
        command,
        world_size=world_size,
        master_port=master_port,
        token=os.environ.get("ALLREDUCE_TOKEN") or new_token(),
        grace_s=grace_s,
        stdout=stdout if stdout is not None else sys.stdout.buffer,
        stderr=err,
        log=log,
        write_lock=write_lock,
        extra_env=env,
    )
    in_main = threading.current_thread() is threading.main_thread()
    previous = {}
    if in_main:
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, run.on_signal)
    try:
        run.start()
        result = run.run()
    finally:
        run.watch.close()  # kills only ranks still running: after an exception in the launcher itself
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if reservation is not None:
            reservation.close()
    if result.interrupted_by is not None:
        log(f"interrupted by {signal.Signals(result.interrupted_by).name}; forwarded to every rank")
    return result
