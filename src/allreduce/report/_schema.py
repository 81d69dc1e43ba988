"""The shape of every result document the report reads, checked before anything is rendered.

A result file may come from anywhere, so each field the report draws or prints is checked for its type and range
and copied into a fresh document that holds those fields only; an error names the file's field path (``base.
sizes[2].count``) and what was expected. Strings are escaped when they are written into the page (the renderer's
job); numbers here are real numbers, so that nothing but digits reaches it unescaped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "FAILING_PARTS",
    "MAX_ITEMS",
    "MAX_SWEEP_ROWS",
    "MAX_TEXT_CHARS",
    "MAX_TIMELINE_BUCKETS",
    "SWEEP_COLUMNS",
    "check_document",
]

# Longest text field kept (a topology spec, a note, an error message): longer is not a result of ours.
MAX_TEXT_CHARS = 4096
# Most entries of a list in a plan, sim, tail or bench document (scaling rows, sizes, links, curve points).
MAX_ITEMS = 10_000
# Most rows of a sweep a report reads: the report holds them in memory (about 500 bytes each).
MAX_SWEEP_ROWS = 200_000
# The columns a sweep's CSV has; a CSV without them is not a sweep's.
SWEEP_COLUMNS = ("case_id", "gpus", "topology", "algorithm", "step_s", "error")
# Whole numbers of the report: counts, sizes, ranks, seeds (a 64-bit seed is the largest).
MAX_WHOLE = 2**64
# Most buckets in a plan's step timeline: the planner's own cap on buckets per step.
MAX_TIMELINE_BUCKETS = 1 << 15
# The parts of a cluster whose failures a plan counts.
FAILING_PARTS = ("gpu", "host", "nic", "cable", "switch", "software")

Check = Callable[[Any, str], Any]


class _InvalidFieldError(ValueError):
    pass


def _fail(where: str, expected: str, value: Any) -> _InvalidFieldError:
    shown = repr(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    return _InvalidFieldError(f"{where}: expected {expected}, got {shown}")


def number(*, minimum: float = 0.0, maximum: float = math.inf, nullable: bool = False) -> Check:
    """A real number in [minimum, maximum]; ``nullable``: also null or a non-finite float (a bandwidth of a run that
    took no time: --json writes it as null), kept as NaN."""

    def check(value: Any, where: str) -> float:
        if value is None and nullable:
            return math.nan
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _fail(where, "a number", value)
        if nullable and not math.isfinite(value):
            return math.nan
        if not (math.isfinite(value) and minimum <= value <= maximum):
            raise _fail(where, f"a number in [{minimum:g}, {maximum:g}]", value)
        return float(value)

    return check


def whole(*, minimum: int = 0, maximum: int = MAX_WHOLE) -> Check:
    def check(value: Any, where: str) -> int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise _fail(where, "a whole number", value)
        if not minimum <= value <= maximum:
            raise _fail(where, f"a whole number in [{minimum}, {maximum}]", value)
        return value

    return check


def text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise _fail(where, "a string", value)
    if len(value) > MAX_TEXT_CHARS:
        raise _fail(where, f"a string of at most {MAX_TEXT_CHARS} characters", value)
    return value


def flag(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise _fail(where, "true or false", value)
    return value


def optional(check: Check) -> Check:
    """``check``, or null kept as None."""

    def inner(value: Any, where: str) -> Any:
        return None if value is None else check(value, where)

    return inner


def items(check: Check, *, most: int = MAX_ITEMS) -> Check:
    def inner(value: Any, where: str) -> list[Any]:
        if not isinstance(value, list):
            raise _fail(where, "a list", value)
        if len(value) > most:
            raise _InvalidFieldError(f"{where}: {len(value):,} entries, more than the {most:,} a report takes")
        return [check(item, f"{where}[{i}]") for i, item in enumerate(value)]

    return inner


def record(required: Mapping[str, Check], optional_fields: Mapping[str, Check] | None = None) -> Check:
    """A mapping with every ``required`` field and any of ``optional_fields``, copied with those fields only."""
    extra = optional_fields or {}

    def inner(value: Any, where: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise _fail(where, "an object", value)
        out: dict[str, Any] = {}
        for key, check in required.items():
            if key not in value:
                raise _InvalidFieldError(f"{_join(where, key)}: missing")
            out[key] = check(value[key], _join(where, key))
        for key, check in extra.items():
            if key in value:
                out[key] = check(value[key], _join(where, key))
        return out

    return inner


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


seconds = number()
size = whole()
count = whole(minimum=1)
ratio = number(nullable=True)
STEP = {
    "step_s": seconds,
    "compute_s": seconds,
    "waiting_s": seconds,
    "exposed_comm_s": seconds,
    "comm_s": seconds,
}
QUANTILES = {"p50_step_s": seconds, "p99_step_s": seconds, "method": text}
MEASURED_TIMES = ("forward_s", "backward_s", "optimizer_s")

_PLAN = record(
    {
        "kind": text,
        "base": record(
            {
                "model": text,
                "gpus": count,
                "topology": text,
                **STEP,
                "buckets": whole(),
                "sizes": items(
                    record(
                        {
                            "size_bytes": size,
                            "count": count,
                            "algorithm": text,
                            "seconds": seconds,
                            "busbw_GBps": ratio,
                        }
                    )
                ),
            },
            {**QUANTILES, "compute_distribution": optional(text)},
        ),
        "bottleneck": text,
    },
    {
        "scaling": items(
            record(
                {"gpus": count, **STEP, "efficiency": ratio, "algorithm": text},
                {**QUANTILES, "goodput": number(maximum=1.0)},
            ),
        ),
        "what_ifs": items(
            record(
                {"change": text},
                {
                    "note": text,
                    **STEP,
                    **QUANTILES,
                    "goodput": number(maximum=1.0),
                    "effective_step_s": number(nullable=True),
                },
            )
        ),
        "links": items(record({"link": text, "utilization": ratio})),
        "links_of": record({}, {"size_bytes": size, "algorithm": text}),
        "busbw_curve": items(record({"size_bytes": size, "seconds": seconds, "busbw_GBps": ratio, "algorithm": text})),
        "notes": items(text),
        "goodput": record(
            {
                "gpus": count,
                "mtbf_s": number(nullable=True),  # null: nothing can fail
                "checkpoint_write_s": seconds,
                "restart_s": seconds,
                "rates_source": text,
                "policies": items(
                    record(
                        {
                            "policy": text,
                            "goodput": number(maximum=1.0),
                            "interval_s": optional(number(nullable=True)),
                            "restart_s": seconds,
                        },
                        {"lost_work_s": seconds},
                    )
                ),
            },
            {
                "counts": record({}, dict.fromkeys(FAILING_PARTS, whole())),
                "failures_per_h": record({}, dict.fromkeys(FAILING_PARTS, number())),
                "assumed": items(text),
                "elastic_recovery": record(
                    {"seconds": seconds, "basis": text, "source": text},
                    {
                        "ranks": whole(),
                        "silent_share": ratio,
                        **dict.fromkeys(("exit_s", "silent_s", "store_s", "timeout_s", "lease_s", "detect_s"), seconds),
                    },
                ),
            },
        ),
        "measured": record(
            {"source": text, "tensors": count, "params": count, **dict.fromkeys(MEASURED_TIMES, seconds)},
            {"flops": optional(number())},
        ),
        "timeline": record(
            {
                "forward_start_s": seconds,
                "backward_start_s": seconds,
                "compute_end_s": seconds,
                "buckets": items(
                    record({"size_bytes": size, "ready_s": seconds, "start_s": seconds, "end_s": seconds}),
                    most=MAX_TIMELINE_BUCKETS,
                ),
            }
        ),
    },
)

_SIM = record(
    {
        "topology": text,
        "ranks": count,
        "size_bytes": size,
        "algorithms": items(record({"name": text, "seconds": seconds, "busbw_GBps": ratio})),
    },
    {
        "best": text,
        "bottlenecks": items(record({"link": text, "utilization": ratio})),
    },
)

_TAIL_STEP = record(dict.fromkeys(("p50", "p90", "p99", "p99.9", "max", "mean"), seconds))
_TAIL = record(
    {
        "topology": text,
        "ranks": count,
        "size_bytes": size,
        "samples": count,
        "algorithms": items(
            record(
                {"name": text, "noise_free_s": seconds, "step_s": _TAIL_STEP},
                {"engine": text, "exact": flag, "noise": text},
            )
        ),
    },
    {"seed": whole(), "skipped": items(text)},
)

_BENCH = record(
    {
        "kind": text,
        "rows": items(
            record(
                {"size_bytes": size, "time_s": seconds, "busbw_Bps": ratio},
                {"transport": text, "algorithm": text, "world_size": count},
            ),
            most=MAX_SWEEP_ROWS,
        ),
    }
)


def _blank_or(check: Check) -> Check:
    """A sweep cell: ``check``, or an empty cell (a failed case has no results) kept as ""."""

    def inner(value: Any, where: str) -> Any:
        return "" if value in ("", None) else check(value, where)

    return inner


_SWEEP_ROW = record(
    {"case_id": text, "error": _blank_or(text)},
    {
        "gpus": _blank_or(whole()),
        "topology": _blank_or(text),
        "algorithm": _blank_or(text),
        "step_s": _blank_or(seconds),
    },
)
_SWEEP = record({"kind": text, "rows": items(_SWEEP_ROW, most=MAX_SWEEP_ROWS)})

SCHEMAS: dict[str, Check] = {"plan": _PLAN, "sim": _SIM, "tail": _TAIL, "bench": _BENCH, "sweep": _SWEEP}


def check_document(document: Any, kind: str) -> dict[str, Any]:
    """``document`` checked as a ``kind`` result and copied with the fields the report uses; ``ValueError`` names
    the first field that is missing, of the wrong type or out of range."""
    try:
        checked: dict[str, Any] = SCHEMAS[kind](document, "")
    except _InvalidFieldError as exc:
        raise ValueError(f"not a valid {kind} result: {exc}") from None
    return checked
