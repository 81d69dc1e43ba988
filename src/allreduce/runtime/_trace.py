"""The timeline of a real run as a Chrome / Perfetto trace, in the trace-event format ``allreduce sim --trace`` writes.

One process (pid 0) with one track per rank (tid = rank), like the simulator's, so a real run and its simulation
open side by side: a slice per collective (``all_reduce 12``) and, on the same track, a slice per step from its
start to its last received byte (``step 3``) whose args name the peer waited on longest and the wait and move
times. Times are CLOCK_MONOTONIC microseconds, one clock for every rank of a host.

``ALLREDUCE_TRACE=FILE``: at close every rank writes its events to ``FILE.rank-R.part``; after a barrier rank 0
merges them into ``FILE`` and removes the parts (ranks on other hosts need ``FILE`` on a shared file system).
The simulator's writer is not imported (the runtime never imports the simulator); the format is small enough
to write twice.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from allreduce.runtime._stats import CALL_CAPACITY, Recorder

__all__ = ["TRACE_ENV", "merge_parts", "part_path", "rank_events", "write_part"]

TRACE_ENV = "ALLREDUCE_TRACE"


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


def part_path(path: str | Path, rank: int) -> Path:
    return Path(f"{path}.rank-{rank}.part")


def write_part(path: str | Path, recorder: Recorder, rank: int) -> None:
    """This rank's events, for :func:`merge_parts` to collect."""
    part = part_path(path, rank)
    tmp = part.with_suffix(".tmp")
    tmp.write_text(json.dumps(rank_events(recorder, rank)))
    os.replace(tmp, part)


def merge_parts(path: str | Path, world_size: int, transport: str) -> None:
    """Every rank's part into one trace at ``path`` (the parts are removed)."""
    events: list[dict[str, Any]] = [
        {
            "ph": "M",
            "name": "process_name",
            "pid": 0,
            "tid": 0,
            "args": {"name": f"allreduce runtime ({transport}, ranks 0-{world_size - 1} of {world_size})"},
        }
    ]
    for rank in range(world_size):
        part = part_path(path, rank)
        events.extend(json.loads(part.read_text()))
        part.unlink()
    trace = {"traceEvents": events, "displayTimeUnit": "ns", "otherData": {"ranks_shown": {transport: world_size}}}
    Path(path).write_text(json.dumps(trace))
