"""A job's reaper: a small process that outlives a launcher killed without warning and cleans up after it.

A launcher (``allreduce run``, :func:`~allreduce.runtime.spawn`) starts one reaper per job in a session of its own,
so that a signal sent to the launcher's process group or terminal (``timeout -s KILL``, a closed terminal) does
not reach it, and writes each rank's process id to the reaper's stdin as the rank starts. A launcher that ends
normally writes ``done`` and the reaper exits. When stdin ends without ``done``, the launcher died (even by
SIGKILL, which it cannot catch): the reaper kills every rank's process group, waits until none of them runs, and
unlinks the shared-memory files they left in ``/dev/shm`` (and removes the launcher's scratch directory, if it
named one). The ranks themselves already die with the launcher (``PR_SET_PDEATHSIG``); the reaper covers what
they started and the files they could not unlink.

Run as a script (``python -I _reaper.py SRC_DIR [SCRATCH_DIR]``), it imports only the standard library until it
must sweep, so that it starts in milliseconds; ``SRC_DIR`` is where the launcher's ``allreduce`` package lives.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time

__all__ = ["KILL_POLL_S", "KILL_WAIT_S", "Reaper", "running_in_groups"]

KILL_WAIT_S = 5.0
"""Longest wait for killed process groups to be gone (the kernel takes microseconds; a loaded machine longer)."""
KILL_POLL_S = 0.005
"""How often /proc is scanned while waiting for killed processes to go (SIGKILL leaves no event to wait on)."""
REAPER_EXIT_WAIT_S = 5.0
"""Longest a launcher waits for its reaper to exit after ``done`` (it exits as soon as it reads it)."""
_DONE = b"done\n"


def running_in_groups(groups: set[int]) -> bool:
    """Whether any process (not a zombie) belongs to one of the process groups ``groups``."""
    with os.scandir("/proc") as entries:  # closed on the early return too (else a ResourceWarning when collected)
        for entry in entries:
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[0] not in ("Z", "X") and int(fields[2]) in groups:
                return True
    return False


def kill_groups(groups: set[int], *, wait_s: float = KILL_WAIT_S) -> None:
    """SIGKILL every process of ``groups`` and return once none runs (or after ``wait_s``)."""
    for group in groups:
        # A process group outlives its leader while members remain, and its id is not reused meanwhile.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while running_in_groups(groups) and time.monotonic() < deadline:
        time.sleep(KILL_POLL_S)


class Reaper:
    """The launcher's side: starts the reaper process, tells it the ranks, and says ``done`` at the end."""

    def __init__(self, *, scratch_dir: str | None = None) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._pipe: int | None = None
        if not sys.executable:  # an embedded interpreter cannot start another one: no reaper
            return
        # .../src/allreduce/runtime/launcher/_reaper.py -> .../src
        src_dir = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        read, write = os.pipe()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", os.path.abspath(__file__), src_dir, *([scratch_dir] if scratch_dir else [])],
                stdin=read,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError:
            os.close(write)
            return
        finally:
            os.close(read)
        self._pipe = write

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def add(self, pid: int) -> None:
        """A rank started as process ``pid``, leader of its own process group."""
        self._send(f"{pid}\n".encode())

    def close(self) -> None:
        """The launcher is ending normally (its ranks are gone): the reaper exits without touching anything."""
        self._send(_DONE)
        if self._pipe is not None:
            os.close(self._pipe)
            self._pipe = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=REAPER_EXIT_WAIT_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def _send(self, message: bytes) -> None:
        if self._pipe is None:
            return
        with contextlib.suppress(OSError):  # the reaper is gone (someone killed it): nothing to tell
            os.write(self._pipe, message)


def _sweep(src_dir: str) -> None:
    sys.path.insert(0, src_dir)
    from allreduce.runtime.shm import sweep_stale_segments

    sweep_stale_segments()


def main(argv: list[str]) -> int:
    """Read rank ids until ``done`` (exit) or the end of input (the launcher died: kill, wait, sweep, remove the
    scratch directory)."""
    groups: set[int] = set()
    for line in sys.stdin.buffer:
        if line == _DONE:
            return 0
        with contextlib.suppress(ValueError):
            groups.add(int(line))
    kill_groups(groups)
    if len(argv) > 2:
        shutil.rmtree(argv[2], ignore_errors=True)
    if len(argv) > 1:
        _sweep(argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
