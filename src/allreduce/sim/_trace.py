"""Chrome / Perfetto trace (JSON trace-event format) of a simulation: one track per rank.

A slice per step (event engine) or per phase (fast engine) for the first ``result.trace_start_s.shape[1]``
ranks only, so a 131,072-rank run writes a file a viewer can open; the trace's metadata says how many ranks
it shows out of how many.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from allreduce.sim._result import SimResult

__all__ = ["chrome_trace", "write_trace"]


def chrome_trace(results: list[SimResult]) -> dict[str, Any]:
    """The trace of one or more runs (one process per run, one thread per rank), times in microseconds."""
    events: list[dict[str, Any]] = []
    for pid, result in enumerate(results):
        shown = result.trace_start_s.shape[1] if result.trace_start_s.ndim == 2 else 0
        events.append(
            {
                "ph": "M",
                "name": "process_name",
                "pid": pid,
                "tid": 0,
                "args": {"name": f"{result.name} ({result.engine} engine, ranks 0-{shown - 1} of {result.world_size})"},
            }
        )
        events.extend(
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": rank, "args": {"name": f"rank {rank}"}}
            for rank in range(shown)
        )
        for row, label in enumerate(result.trace_labels):
            for rank in range(shown):
                start = float(result.trace_start_s[row, rank])
                end = float(result.trace_end_s[row, rank])
                if not (math.isfinite(start) and math.isfinite(end)) or end <= start:
                    continue  # the rank sat this step or phase out
                events.append(
                    {
                        "ph": "X",
                        "name": label,
                        "cat": result.name,
                        "pid": pid,
                        "tid": rank,
                        "ts": start * 1e6,
                        "dur": (end - start) * 1e6,
                    }
                )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ns",
        "otherData": {"ranks_shown": {r.name: min(r.world_size, r.trace_start_s.shape[-1]) for r in results}},
    }


def write_trace(path: str | Path, results: list[SimResult]) -> None:
    """Write :func:`chrome_trace` to ``path`` (open it in ui.perfetto.dev or chrome://tracing)."""
    Path(path).write_text(json.dumps(chrome_trace(results)))
