"""The timeline of a real run as a Chrome / Perfetto trace, in the trace-event format ``allreduce sim --trace`` writes.

One process (pid 0) with one track per rank (tid = rank), like the simulator's, so a real run and its simulation
open side by side: a slice per collective (``all_reduce 12``) and, on the same track, a slice per step from its
start to its last received byte (``step 3``) whose args name the peer waited on longest and the wait and move
times. Times are CLOCK_MONOTONIC microseconds, one clock for every rank of a host.

``ALLREDUCE_TRACE=FILE``: at close (:func:`write_trace`, a collective) rank 0 makes a private directory beside
``FILE`` (``mkdtemp``: a random name, mode 0700) and tells the others its name; every rank writes its events
there, then rank 0 merges them into a new file in that directory and renames it onto ``FILE`` (ranks on other
hosts need ``FILE`` on a shared file system). No file is ever opened under a name another user could guess or
pre-create as a symbolic link: every file is created with ``O_EXCL | O_NOFOLLOW`` inside the private directory,
and the rename replaces whatever ``FILE`` was (a symbolic link there is replaced, never followed). Rank 0
removes the directory whatever happened, and a rank that failed leaves nothing behind. :func:`check_trace_path`
refuses, before a job starts, a ``FILE`` that could not be written (a directory, a missing or read-only
directory, ``/proc``). The simulator's writer is not imported (the runtime never imports the simulator); the
format is small enough to write twice.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from allreduce.runtime.stats._stats import CALL_CAPACITY, Recorder

__all__ = ["TRACE_ENV", "check_trace_path", "rank_events", "write_trace"]

TRACE_ENV = "ALLREDUCE_TRACE"

_PRIVATE_PREFIX = ".allreduce-trace-"
_NAME_BYTES = 256
"""What the broadcast of the private directory's name carries: a status byte, then the name (mkdtemp's are ~30)."""
_CREATE_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


class _Group(Protocol):
    """What :func:`write_trace` needs of a process group."""

    rank: int
    world_size: int
    transport_name: str

    def broadcast(self, x: Any, root: int = 0) -> Any: ...

    def barrier(self) -> None: ...


def rank_events(recorder: Recorder, rank: int) -> list[dict[str, Any]]:
    """This rank's slices: every kept collective, and every step of it that received data."""
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}}
    ]
    calls = recorder.calls(CALL_CAPACITY)
    if len(calls) == 0:
        return events
    events.extend(
        {
            "ph": "X",
            "name": f"collective {int(seq)}",
            "cat": "collective",
            "pid": 0,
            "tid": rank,
            "ts": arrival / 1e3,
            "dur": (end - arrival) / 1e3,
            "args": {"size_bytes": int(size)},
        }
        for seq, arrival, end, size in calls
    )
    transfers = recorder.transfers(int(calls[0, 0]))
    if len(transfers) == 0:
        return events
    keys = transfers[:, 0] * (1 << 20) + transfers[:, 1]
    starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
    for group in np.split(transfers, starts[1:]):
        seq, step, step_start = int(group[0, 0]), int(group[0, 1]), int(group[0, 3])
        ends = group[:, 3] + group[:, 4] + group[:, 5]
        longest = int(np.argmax(group[:, 4]))
        events.append(
            {
                "ph": "X",
                "name": f"step {step}",
                "cat": f"collective {seq}",
                "pid": 0,
                "tid": rank,
                "ts": step_start / 1e3,
                "dur": max(int(ends.max()) - step_start, 0) / 1e3,
                "args": {
                    "waited_on": int(group[longest, 2]),
                    "wait_us": float(group[:, 4].sum()) / 1e3,
                    "move_us": float(group[:, 5].sum()) / 1e3,
                },
            }
        )
    return events


def check_trace_path(path: str | Path) -> Path:
    """The absolute path a trace will be written to, or ``ValueError`` naming it and why it cannot be: a directory,
    something that is not a regular file (a symbolic link, a device), or a directory where no file can be created
    (missing, read-only, ``/proc``: tried for real, with a private directory that is removed at once)."""
    target = Path(os.path.abspath(path))
    try:
        mode = os.lstat(target).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        raise ValueError(f"trace file {target}: {exc.strerror}") from None
    if mode is not None and stat.S_ISDIR(mode):
        raise ValueError(f"trace file {target}: is a directory; name a file in it, e.g. {target / 'trace.json'}")
    if mode is not None and not stat.S_ISREG(mode):
        raise ValueError(
            f"trace file {target}: exists and is not a regular file (a symbolic link, a device, a pipe); the trace "
            "replaces the file at that path, so name a new one or a regular file"
        )
    if not target.parent.is_dir():
        raise ValueError(f"trace file {target}: directory {target.parent} does not exist")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=_PRIVATE_PREFIX, dir=target.parent))
    except OSError as exc:
        raise ValueError(f"trace file {target}: cannot create files in {target.parent} ({exc.strerror})") from None
    return target


def _write_new(path: str, data: bytes) -> None:
    """Write ``data`` to a file that must not exist yet, and is never reached through a symbolic link."""
    fd = os.open(path, _CREATE_NEW, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def write_trace(path: str | Path, recorder: Recorder, group: _Group) -> None:
    """Every rank's events into one trace at ``path`` (see the module docstring); a collective: every rank of
    ``group`` calls it at close. Raises ``OSError`` on every rank if rank 0 cannot make its private directory, and
    on rank 0 (after removing it) if a rank's events did not arrive; nothing is left but ``path``."""
    rank, world_size = group.rank, group.world_size
    target = Path(os.path.abspath(path))
    data = json.dumps(rank_events(recorder, rank)).encode()  # before the collectives below, which are not recorded
    name = np.zeros(_NAME_BYTES, np.uint8)
    private, problem = "", ""
    if rank == 0:
        try:
            private = tempfile.mkdtemp(prefix=_PRIVATE_PREFIX, dir=target.parent)
            encoded = os.path.basename(private).encode()
            name[0], name[1 : 1 + len(encoded)] = 1, np.frombuffer(encoded, np.uint8)
        except OSError as exc:
            problem = f"trace file {target}: cannot create a directory in {target.parent} ({exc.strerror})"
    try:
        group.broadcast(name, root=0)
        if name[0] != 1:
            raise OSError(problem or f"trace file {target}: rank 0 could not create its directory")
        private = str(target.parent / bytes(name[1:]).rstrip(b"\0").decode())
        written: OSError | None = None
        try:
            _write_new(os.path.join(private, f"rank-{rank}.json"), data)
        except OSError as exc:  # the barrier first: the others must not wait for this rank
            written = exc
        group.barrier()
        if rank == 0:
            _merge(private, target, world_size, group.transport_name)
        if written is not None:
            raise OSError(f"trace file {target}: rank {rank} could not write its events ({written})")
    finally:
        if rank == 0 and private:  # also when a peer failed during the broadcast or the barrier
            shutil.rmtree(private, ignore_errors=True)


def _merge(private: str, target: Path, world_size: int, transport: str) -> None:
    events: list[dict[str, Any]] = [
        {
            "ph": "M",
            "name": "process_name",
            "pid": 0,
            "tid": 0,
            "args": {"name": f"allreduce runtime ({transport}, ranks 0-{world_size - 1} of {world_size})"},
        }
    ]
    missing = []
    for rank in range(world_size):
        try:
            with open(os.path.join(private, f"rank-{rank}.json"), "rb") as part:
                events.extend(json.loads(part.read()))
        except (OSError, ValueError):
            missing.append(rank)
    if missing:
        raise OSError(f"trace file {target}: no events from rank(s) {', '.join(map(str, missing))}; nothing written")
    trace = {"traceEvents": events, "displayTimeUnit": "ns", "otherData": {"ranks_shown": {transport: world_size}}}
    merged = os.path.join(private, "trace.json")
    _write_new(merged, json.dumps(trace).encode())
    os.chmod(merged, 0o666 & ~_umask())  # as a new file would be, not the private 0600 the parts need
    os.replace(merged, target)  # a symbolic link at target is replaced, not followed


def _umask() -> int:
    """This process's umask, read without setting it (``os.umask`` would change it for every thread a moment)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022
