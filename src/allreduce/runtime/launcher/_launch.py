"""Start N local ranks of a command, the way torchrun does on one host, and watch them.

Each rank gets the rendezvous environment of :mod:`allreduce.runtime.launcher._spawn` (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT - a port reserved for the job unless given - and a per-job
ALLREDUCE_TOKEN unless one is set), PYTHONUNBUFFERED=1 so that its lines arrive as they are printed, and
ALLREDUCE_FAILURE_DIR, where a rank that imports allreduce reports an uncaught exception. Every line it writes is
prefixed with ``[rank k]`` on the same stream. Ranks get no stdin.

Stopping: SIGINT, SIGTERM and SIGHUP sent to the launcher are forwarded to every rank (each rank runs in its own
process group, so a terminal's Ctrl-C reaches it exactly once, through us); a second one kills them. When the
launcher's output is closed (``allreduce run ... | head``) the ranks get SIGTERM. When a rank fails on its own
(not in reaction to another rank's failure), the others get SIGTERM. Every stop is followed by SIGKILL after the
grace period. The launcher exits with the status of the rank it blames (128 + signal number if it was killed),
naming it and the ranks that only reacted, or with 128 + the signal it received. Ranks die with the launcher
(``PR_SET_PDEATHSIG``), and its reaper kills their process groups and sweeps their shared memory if the launcher
itself is killed; the launcher sweeps the shared memory of ranks it had to kill.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO

from allreduce.runtime.elastic._elastic import JOIN_ENV
from allreduce.runtime.group._group import STATS_FILE_ENV
from allreduce.runtime.launcher._rank_report import FAILURE_DIR_ENV, read_report, remove_report
from allreduce.runtime.launcher._reaper import Reaper
from allreduce.runtime.launcher._spawn import (
    DEFAULT_GRACE_S,
    Departure,
    Elasticity,
    RankWatch,
    check_world_size,
    describe_status,
    die_with_parent,
    new_token,
    rank_environment,
    reserve_port,
    stop_signal_handlers,
)
from allreduce.runtime.launcher._watch import ranks_phrase

__all__ = ["LaunchResult", "describe_status", "launch"]

OUTPUT_DRAIN_S = 5.0
"""How long the launcher waits, after its ranks exited, for their last output: a rank's orphaned children may
hold its pipes open, and the launcher does not wait on them."""


@dataclass(frozen=True)
class LaunchResult:
    """How a launch ended: ``exit_code`` for the shell, the ranks' return codes, the rank blamed for the failure
    (the first whose failure was its own), the ranks that failed only in reaction to another's, and the signal
    the launcher received (SIGPIPE when its output was closed), if any."""

    exit_code: int
    returncodes: tuple[int | None, ...]
    failed_rank: int | None
    interrupted_by: int | None
    reacted_ranks: tuple[int, ...] = ()
    stats_table: str | None = None
    """With ``launch(stats=True)``: the table rank 0's group wrote at close (None if no group was closed)."""
    departures: tuple[Departure, ...] = ()
    """With ``min_ranks``: the ranks that failed while the job went on (and whether each was restarted)."""


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
        failure_dir: str,
        reaper: Reaper,
        extra_env: Mapping[str, str] | None = None,
        elastic: Elasticity | None = None,
    ) -> None:
        self.command = list(command)
        self.extra_env = dict(extra_env or {})
        self.world_size = world_size
        self.master_port = master_port
        self.token = token
        self.out = stdout
        self.err = stderr
        self.log = log
        self.failure_dir = failure_dir
        self.reaper = reaper
        self.procs: list[subprocess.Popen[bytes]] = []
        self.write_lock = write_lock
        self.closed_outputs: set[int] = set()  # id() of destinations whose reader has gone
        self.threads: list[threading.Thread] = []
        self.elastic = elastic
        self.watch = RankWatch(self.procs, grace_s=grace_s, log=log, reaction=self.reaction, failed=self.failed)

    def environment(self, rank: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.extra_env)
        env.update(rank_environment(rank, self.world_size, master_port=self.master_port, token=self.token))
        env[FAILURE_DIR_ENV] = self.failure_dir
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def failed(self, rank: int, code: int) -> bool:
        """Whether rank ``rank``'s exit fails the job: any non-zero status, unless an elastic job goes on (and
        perhaps restarts the rank, which then joins the running group)."""
        if code == 0:
            return False
        if self.elastic is None:
            return True
        report = read_report(self.failure_dir, rank, self.world_size)
        how = describe_status(code) + ("" if report is None else f": {report.error}")
        # those still running and those that exited 0 (finished: not lost, though they may be reaped first)
        running = sum(1 for r, proc in enumerate(self.procs) if r != rank and proc.poll() in (None, 0))
        restart = self.elastic.departs(rank, how, running)
        if restart is None:
            return True
        restarts = sum(d.restarted for d in self.elastic.departures)
        again = f"; restarting it to rejoin (restart {restarts} of {self.elastic.max_restarts})" if restart else ""
        self.log(f"rank {rank} {how}; {running} ranks go on (--min-ranks {self.elastic.min_ranks}){again}")
        if restart:
            remove_report(self.failure_dir, rank)
            self._start_rank(rank, joining=True)
        return False

    def reaction(self, rank: int) -> int | None:
        report = read_report(self.failure_dir, rank, self.world_size)
        return None if report is None else report.reacted_to

    def start(self) -> None:
        for rank in range(self.world_size):
            if self.watch.interrupted_by is not None:  # stopped while starting: start no more
                break
            self._start_rank(rank, joining=False)

    def _start_rank(self, rank: int, *, joining: bool) -> None:
        env = self.environment(rank)
        if joining:
            env[JOIN_ENV] = "1"
        try:
            proc = subprocess.Popen(
                self.command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                process_group=0,
                # Only prctl and getppid run between fork and exec (the libc function is resolved already).
                preexec_fn=die_with_parent(os.getpid()),  # noqa: PLW1509
            )
        except OSError as exc:
            self.watch.signal_all(signal.SIGKILL)
            raise ValueError(f"cannot run {self.command[0]!r} for rank {rank}: {exc.strerror or exc}") from exc
        self.reaper.add(proc.pid)
        if joining:
            self.procs[rank] = proc
            self.watch.replace(rank, proc)
        else:
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
            # Read to the end even once ``dest`` is closed, so that no rank blocks on a full pipe while it stops.
            for line in iter(pipe.readline, b""):
                if id(dest) in self.closed_outputs:
                    continue
                try:
                    with self.write_lock:
                        dest.write(prefix + line + (b"" if line.endswith(b"\n") else b"\n"))
                        dest.flush()
                except BrokenPipeError:
                    self._output_closed(dest)
                except (OSError, ValueError):
                    pass  # a terminal gone (EIO) or a closed file: the ranks decide for themselves

    def _output_closed(self, dest: IO[bytes]) -> None:
        """The reader of ``dest`` has gone (``| head``): nobody reads the ranks' output any more; stop them."""
        if id(dest) in self.closed_outputs:
            return
        self.closed_outputs.add(id(dest))
        if self.watch.interrupted_by is None:
            self.log("output closed (broken pipe); stopping every rank")
        self.watch.interrupt(signal.SIGPIPE, forward=signal.SIGTERM)

    def run(self) -> LaunchResult:
        self.watch.watch()
        for thread in self.threads:
            thread.join(timeout=OUTPUT_DRAIN_S)
        codes = tuple(p.returncode for p in self.procs)
        blamed = self.watch.blamed_rank()
        reacted = tuple(sorted(self.watch.reactions))
        interrupted_by = self.watch.interrupted_by
        if blamed is not None:
            own = self.watch.failed_rank is not None
            # Blamed only by others' reports: its own status may be the launcher's stop; report the first failure.
            status_rank = blamed if own else self.watch.first_failed_rank
            assert status_rank is not None
            code = codes[status_rank]
            assert code is not None
            exit_code = 128 - code if code < 0 else code
            if reacted:
                self.log(self._blame_message(blamed, own=own, reacted=reacted, code=codes[blamed]))
        elif interrupted_by is not None:
            exit_code = 128 + interrupted_by
        else:
            exit_code = 0
        departures = tuple(self.elastic.departures) if self.elastic else ()
        return LaunchResult(exit_code, codes, blamed, interrupted_by, reacted, departures=departures)

    def _blame_message(self, blamed: int, *, own: bool, reacted: tuple[int, ...], code: int | None) -> str:
        report = read_report(self.failure_dir, blamed, self.world_size)
        if own:
            what = describe_status(code or 0) if report is None else f"{describe_status(code or 0)}: {report.error}"
            return f"rank {blamed} failed first ({what}); {ranks_phrase(reacted)} failed in reaction to it"
        return f"{ranks_phrase(reacted)} failed in reaction to rank {blamed}, which failed or left the group first"


def launch(
    command: Sequence[str],
    *,
    world_size: int,
    master_port: int | None = None,
    grace_s: float = DEFAULT_GRACE_S,
    stdout: IO[bytes] | None = None,
    stderr: IO[bytes] | None = None,
    env: Mapping[str, str] | None = None,
    stats: bool = False,
    min_ranks: int | None = None,
    max_restarts: int = 0,
) -> LaunchResult:
    """Run ``command`` as ``world_size`` local ranks until all exit (see the module docstring); ``env`` adds
    variables to every rank's environment. ``stats``: rank 0's group writes its stats table at close into the
    launcher's scratch directory (which the reaper removes even if the launcher is killed), returned as
    ``stats_table``.

    ``min_ranks`` makes the job elastic: a rank's failure does not stop the others while at least ``min_ranks``
    still run (they shrink their group), and up to ``max_restarts`` times a failed rank is started again with
    ``ALLREDUCE_JOIN=1``, so that its ``allreduce.init()`` joins the running group (the members admit it with
    ``group.grow()``). Rank 0 hosts the store: its failure always stops the job.

    Signals are handled only when called from the main thread; ranks are started from the calling thread, which
    must not exit before this returns (it does not: this returns once every rank has exited)."""
    check_world_size(world_size, "the number of ranks")
    if not command:
        raise ValueError("no command to run (usage: allreduce run -n N -- python script.py ...)")
    if master_port is not None and not 0 < master_port < 65536:
        raise ValueError(f"--master-port must be in 1..65535, got {master_port}")
    if not grace_s >= 0:
        raise ValueError(f"--grace must be >= 0 seconds, got {grace_s}")
    elastic = None
    if min_ranks is not None:
        elastic = Elasticity(min_ranks, max_restarts)
        elastic.check(world_size)
    elif max_restarts:
        raise ValueError("max_restarts: restarts need an elastic job (give min_ranks)")
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
    failure_dir = tempfile.mkdtemp(prefix="allreduce-run-")
    reaper = Reaper(scratch_dir=failure_dir)
    stats_file = os.path.join(failure_dir, "stats.txt") if stats else None
    if stats_file is not None:
        env = {**(env or {}), STATS_FILE_ENV: stats_file}
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
        failure_dir=failure_dir,
        reaper=reaper,
        extra_env=env,
        elastic=elastic,
    )
    try:
        with stop_signal_handlers(run.watch.interrupt, wake_fd=run.watch.wake_fd):
            run.start()
            result = run.run()
        if stats_file is not None:
            with contextlib.suppress(OSError, UnicodeDecodeError), open(stats_file, encoding="utf-8") as table:
                result = dataclasses.replace(result, stats_table=table.read())
    finally:
        run.watch.close()  # kills only ranks still running: after an exception in the launcher itself
        _sweep_shared_memory()
        reaper.close()
        shutil.rmtree(failure_dir, ignore_errors=True)
        if reservation is not None:
            reservation.close()
    if result.interrupted_by not in (None, signal.SIGPIPE):  # a closed output was said when it happened
        assert result.interrupted_by is not None
        log(f"interrupted by {signal.Signals(result.interrupted_by).name}; forwarded to every rank")
    return result


def _sweep_shared_memory() -> None:
    """Unlink what ranks killed before their own cleanup left in /dev/shm (only files whose owner is gone)."""
    from allreduce.runtime.shm import sweep_stale_segments

    sweep_stale_segments()
